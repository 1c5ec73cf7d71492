//! Per-request compressor carries: the half-finished compressor group of every KV-source layer
//! with ratio > 1 (ratio 2: one token's kv[512] then score[512], f32), kept between steps so a
//! request can resume after its engine-side state is dropped (`csa2_compressor_state_save`).

use super::{CacheManager, RequestId};
use crate::error::{Error, Result};

/// One request's carried groups (behind the request's session lock), one slot per pool with
/// ratio > 1.
pub(super) struct Carries {
    groups: Vec<Option<Vec<f32>>>,
}

impl Carries {
    pub(super) fn new(slots: usize) -> Carries {
        Carries {
            groups: vec![None; slots],
        }
    }

    /// Bytes of the groups held.
    pub(super) fn bytes(&self) -> usize {
        self.groups.iter().flatten().map(|v| v.len() * 4).sum()
    }
}

/// Which slot of [`Carries`] each pool of a spec uses (None: ratio 1, nothing to carry).
pub(super) fn slots(pools: &[super::PoolSpec]) -> Vec<Option<usize>> {
    let mut k = 0;
    pools
        .iter()
        .map(|p| {
            (p.ratio > 1).then(|| {
                k += 1;
                k - 1
            })
        })
        .collect()
}

impl CacheManager {
    /// Sets (Some) or clears (None) the half-finished compressor group of KV-source `layer` for
    /// request `id`: `(ratio − 1) × 1024` f32 (ratio 2: one token's kv[512] then score[512]).
    ///
    /// Errors: [`Error::Invalid`] when `layer` has ratio ≤ 1 or is not a KV source; [`Error::Shape`].
    pub fn set_compressor_state(
        &self,
        id: RequestId,
        layer: usize,
        state: Option<&[f32]>,
    ) -> Result<()> {
        let (k, floats) = self.carry_slot(layer)?;
        if let Some(v) = state {
            if v.len() != floats {
                return Err(Error::shape("compressor state", floats, v.len()));
            }
        }
        let s = self.session(id)?;
        s.lock().carries.groups[k] = state.map(<[f32]>::to_vec);
        Ok(())
    }

    /// The half-finished compressor group of `layer` for request `id`, if any.
    pub fn compressor_state(&self, id: RequestId, layer: usize) -> Result<Option<Vec<f32>>> {
        let (k, _) = self.carry_slot(layer)?;
        let s = self.session(id)?;
        let st = s.lock();
        Ok(st.carries.groups[k].clone())
    }

    /// The slot and group size (floats) of `layer`.
    fn carry_slot(&self, layer: usize) -> Result<(usize, usize)> {
        self.spec
            .pools
            .iter()
            .zip(&self.carry_slots)
            .find(|(p, _)| p.layer == layer)
            .and_then(|(p, k)| k.map(|k| (k, p.compressor_state_floats())))
            .ok_or_else(|| {
                Error::invalid(
                    "layer",
                    format!("layer {layer} is not a KV source with compression ratio > 1"),
                )
            })
    }
}
