//! Per-request compressor carries: the one place that owns them. A carry is the compressor's
//! [`CompressorState`] of one KV-source layer (its next position and the half-finished group:
//! ratio 2, at most one token's kv[512] and score[512], f32), kept between steps so a request can
//! resume where its previous step stopped.
//!
//! Two faces read and write the same slot:
//! - the engine (`backend::PagedCache`, through [`CacheManager::carry`] / [`CacheManager::set_carry`])
//!   keeps the whole state, position included, for every KV-source layer (a ratio-1 layer carries
//!   no rows, only its next position);
//! - the C ABI (`csa2_cache_{set,get}_compressor_state`, through
//!   [`CacheManager::set_compressor_state`] / [`CacheManager::compressor_state`]) exchanges the
//!   open group's rows only, `(ratio − 1) × 1024` f32 (kv rows, then score rows), for layers of
//!   ratio > 1. A group set there gets the next position the request's stored entries imply
//!   (`entries × ratio + carried tokens`).

use super::{CacheManager, RequestId};
use crate::error::{Error, Result};
use crate::formats::KV_DIM;
use crate::ops::compressor::CompressorState;

/// One request's carries (behind the request's session lock), one slot per KV-source pool, in
/// the spec's pool order.
pub(super) struct Carries {
    states: Vec<Option<CompressorState>>,
}

impl Carries {
    pub(super) fn new(pools: usize) -> Carries {
        Carries {
            states: vec![None; pools],
        }
    }

    /// Bytes of the carried rows (kv + score, f32).
    pub(super) fn bytes(&self) -> usize {
        self.states
            .iter()
            .flatten()
            .map(|c| c.pending_tokens() * 2 * KV_DIM * 4)
            .sum()
    }
}

impl CacheManager {
    /// The pool slot of KV-source `layer`.
    fn carry_pool(&self, layer: usize) -> Result<usize> {
        self.spec
            .pools
            .iter()
            .position(|p| p.layer == layer)
            .ok_or_else(|| {
                Error::invalid(
                    "layer",
                    format!("layer {layer} is not a KV source (it owns no compressor)"),
                )
            })
    }

    /// The compressor state the engine carries for KV-source `layer` of request `id` (`None`
    /// until set, or after [`CacheManager::clear_carries`]).
    ///
    /// Errors: [`Error::Invalid`] when `layer` is not a KV source; [`Error::NotFound`] for an
    /// unknown request.
    pub fn carry(&self, id: RequestId, layer: usize) -> Result<Option<CompressorState>> {
        let k = self.carry_pool(layer)?;
        let s = self.session(id)?;
        let st = s.lock();
        Ok(st.carries.states[k].clone())
    }

    /// Sets (Some) or clears (None) the compressor state of KV-source `layer` for request `id`.
    ///
    /// Errors: as [`CacheManager::carry`]; nothing changes on error.
    pub fn set_carry(
        &self,
        id: RequestId,
        layer: usize,
        state: Option<CompressorState>,
    ) -> Result<()> {
        let k = self.carry_pool(layer)?;
        let s = self.session(id)?;
        s.lock().carries.states[k] = state;
        Ok(())
    }

    /// Clears every carry of request `id` (the end of a turn: carries are persisted by the
    /// caller's snapshot, if at all).
    ///
    /// Errors: [`Error::NotFound`] for an unknown request.
    pub fn clear_carries(&self, id: RequestId) -> Result<()> {
        let s = self.session(id)?;
        s.lock().carries.states.iter_mut().for_each(|c| *c = None);
        Ok(())
    }

    /// Bytes of the rows request `id` carries (kv + score f32 of every open group).
    ///
    /// Errors: [`Error::NotFound`] for an unknown request.
    pub fn carry_bytes(&self, id: RequestId) -> Result<usize> {
        let s = self.session(id)?;
        let b = s.lock().carries.bytes();
        Ok(b)
    }

    /// Sets (Some) or clears (None) the half-finished compressor group of KV-source `layer` for
    /// request `id` in the C ABI's form: `(ratio − 1) × 1024` f32, kv rows then score rows (ratio
    /// 2: one token's kv[512] then score[512]). The state's next position is the one the stored
    /// entries imply (`entries × ratio + carried tokens`).
    ///
    /// Errors: [`Error::Invalid`] when `layer` has ratio ≤ 1 or is not a KV source, or for a
    /// non-finite value; [`Error::Shape`]; [`Error::NotFound`] for an unknown request. Nothing
    /// changes on error.
    pub fn set_compressor_state(
        &self,
        id: RequestId,
        layer: usize,
        state: Option<&[f32]>,
    ) -> Result<()> {
        let (k, floats, ratio) = self.group_slot(layer)?;
        let st = match state {
            Some(v) => {
                if v.len() != floats {
                    return Err(Error::shape("compressor state", floats, v.len()));
                }
                let (kv, score) = v.split_at(floats / 2);
                let pending = kv.len() / KV_DIM;
                let stored = self.stored_entries(id, layer, super::RecordKind::Main)?;
                let next = (stored * ratio + pending) as u64;
                Some(CompressorState::with_pending(
                    next,
                    kv.to_vec(),
                    score.to_vec(),
                )?)
            }
            None => None,
        };
        let s = self.session(id)?;
        s.lock().carries.states[k] = st;
        Ok(())
    }

    /// The half-finished compressor group of `layer` for request `id` in the C ABI's form (see
    /// [`CacheManager::set_compressor_state`]), or `None` when no group is open.
    ///
    /// Errors: as [`CacheManager::set_compressor_state`]; [`Error::Internal`] if the engine left
    /// a group of another size than the C form (a ratio above 2 stopped mid-group).
    pub fn compressor_state(&self, id: RequestId, layer: usize) -> Result<Option<Vec<f32>>> {
        let (k, floats, _) = self.group_slot(layer)?;
        let s = self.session(id)?;
        let st = s.lock();
        let Some(c) = st.carries.states[k]
            .as_ref()
            .filter(|c| c.pending_tokens() > 0)
        else {
            return Ok(None);
        };
        let (kv, score) = c.pending();
        if kv.len() + score.len() != floats {
            return Err(Error::Internal(format!(
                "layer {layer} carries {} tokens, the C form holds {}",
                c.pending_tokens(),
                floats / (2 * KV_DIM)
            )));
        }
        Ok(Some([kv, score].concat()))
    }

    /// The pool slot, group size (floats) and ratio of `layer`, which must have ratio > 1.
    fn group_slot(&self, layer: usize) -> Result<(usize, usize, usize)> {
        self.spec
            .pools
            .iter()
            .position(|p| p.layer == layer && p.ratio > 1)
            .map(|k| {
                let p = &self.spec.pools[k];
                (k, p.compressor_state_floats(), p.ratio)
            })
            .ok_or_else(|| {
                Error::invalid(
                    "layer",
                    format!("layer {layer} is not a KV source with compression ratio > 1"),
                )
            })
    }
}
