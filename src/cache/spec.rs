//! What a cache stores, derived from the model geometry and a KV layout (never from layer ids).
//!
//! A [`CacheSpec`] lists the KV-source layers that own global KV (their ratio and record formats),
//! the layers that keep an SWA ring, and the layers whose SWA window is snapshotted at prefix
//! boundaries. [`CacheSpec::from_geometry`] derives it for CSA2 models (docs/SPEC.md §0: only the Full layers
//! store global KV; the encoder layers' SWA is snapshotted to DRAM, the decoder's never);
//! [`CacheSpec::v4_flash`] describes the V4-Flash baseline used for the persistent-footprint
//! comparison.

use crate::error::{Error, Result};
use crate::formats::{KvScheme, RecordFormat};
use crate::geometry::{Geometry, Role};
use serde::Serialize;

/// Page alignment in bytes: every page (data + scale regions) starts on a 512-B boundary, the TMA
/// alignment vLLM uses for V4.1 records on SM100 (docs/SPEC.md §1.6).
pub const PAGE_ALIGN: usize = 512;

/// Global KV owned by one KV-source layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PoolSpec {
    /// Layer id of the KV source.
    pub layer: usize,
    /// Compression ratio m: one compressed entry per m tokens.
    pub ratio: usize,
    /// Main-KV record format.
    pub main: RecordFormat,
    /// Index-K record format (None for layers that have no indexer, e.g. V4 HCA layers).
    pub index: Option<RecordFormat>,
}

impl PoolSpec {
    /// Global bytes this layer stores per original token: (main + index) / ratio.
    pub fn bytes_per_token(&self) -> f64 {
        let rec = self.main.record_bytes() + self.index.map_or(0, |f| f.record_bytes());
        rec as f64 / self.ratio as f64
    }
    /// Bytes per half-finished compressor group: (ratio − 1) tokens × (kv 512 + score 512) f32.
    pub fn compressor_state_floats(&self) -> usize {
        (self.ratio - 1) * 2 * crate::formats::KV_DIM
    }
}

/// Everything the cache manager and the persistent tiers need to know about a model's KV.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheSpec {
    /// Short name for reports (`v41-nvfp4`, `v4-flash`).
    pub name: String,
    /// Layout name, part of the prefix-key salt.
    pub layout: String,
    /// Layers that keep an SWA ring (every backbone layer).
    pub num_layers: usize,
    /// SWA window in tokens (128).
    pub window: usize,
    /// Record format of one SWA token.
    pub swa_format: RecordFormat,
    /// Layers whose SWA window is snapshotted at a prefix boundary (V4.1: the encoder layers).
    pub snapshot_layers: Vec<usize>,
    /// KV-source layers, in layer order.
    pub pools: Vec<PoolSpec>,
}

impl CacheSpec {
    /// The CSA2 cache of `g` in `layout`: one pool per Full layer (role and ratio from the
    /// geometry), SWA rings for every layer, snapshots of the encoder layers (docs/SPEC.md §0, §3).
    pub fn from_geometry(g: &Geometry, layout: KvScheme) -> CacheSpec {
        let KvScheme {
            main, index, swa, ..
        } = layout;
        CacheSpec {
            name: format!("v41-{}", layout.as_str()),
            layout: layout.as_str().to_string(),
            num_layers: g.num_layers,
            window: g.window,
            swa_format: swa,
            snapshot_layers: g
                .layers
                .iter()
                .filter(|l| l.encoder)
                .map(|l| l.id)
                .collect(),
            pools: g
                .layers_with(Role::Full)
                .map(|l| PoolSpec {
                    layer: l.id,
                    ratio: l.ratio,
                    main,
                    index: Some(index),
                })
                .collect(),
        }
    }

    /// The DeepSeek-V4-Flash baseline: 43 layers, 2 SWA-only, 21 CSA layers at
    /// ratio 4 with a 584-B main record and a 68-B index K, 20 HCA layers at ratio 128 with a main
    /// record only; SWA of every layer in 584-B records, all of it snapshotted (V4 persists every
    /// layer's window with the global KV). Layer order inside the stack does not change any byte
    /// count; CSA and HCA alternate here.
    pub fn v4_flash() -> CacheSpec {
        let mut pools = Vec::new();
        for i in 0..41 {
            let layer = 2 + i;
            if i % 2 == 0 {
                pools.push(PoolSpec {
                    layer,
                    ratio: 4,
                    main: RecordFormat::V4Record,
                    index: Some(RecordFormat::Mxfp4Index),
                });
            } else {
                pools.push(PoolSpec {
                    layer,
                    ratio: 128,
                    main: RecordFormat::V4Record,
                    index: None,
                });
            }
        }
        CacheSpec {
            name: "v4-flash".into(),
            layout: "v4-flash".into(),
            num_layers: 43,
            window: 128,
            swa_format: RecordFormat::V4Record,
            snapshot_layers: (0..43).collect(),
            pools,
        }
    }

    /// Global KV bytes per token, from the record sizes (the figure the allocator must reproduce:
    /// 890 for V4.1 NVFP4, 1,490 MXFP8, 1,790 V4 record; 3,514.25 for V4-Flash).
    pub fn global_bytes_per_token(&self) -> f64 {
        self.pools.iter().map(PoolSpec::bytes_per_token).sum()
    }

    /// Bytes of one SWA snapshot: `window` tokens × SWA record × snapshotted layers.
    pub fn snapshot_bytes(&self) -> usize {
        self.snapshot_layers.len() * self.window * self.swa_format.record_bytes()
    }

    /// Bytes of the live SWA rings of one request (every layer).
    pub fn swa_ring_bytes(&self) -> usize {
        self.num_layers * self.window * self.swa_format.record_bytes()
    }

    /// Checks that `block_tokens` is usable: > 0 and a multiple of every pool's ratio (a block must
    /// hold whole compressed entries so pages never straddle a group).
    pub fn check_block_tokens(&self, block_tokens: usize) -> Result<()> {
        if block_tokens == 0 {
            return Err(Error::invalid("block_tokens", "must be > 0, found 0"));
        }
        for p in &self.pools {
            if !block_tokens.is_multiple_of(p.ratio) {
                return Err(Error::invalid(
                    "block_tokens",
                    format!(
                        "{block_tokens} is not a multiple of layer {}'s compression ratio {}",
                        p.layer, p.ratio
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_spec_bytes() {
        let g = Geometry::embedded();
        let s = CacheSpec::from_geometry(&g, KvScheme::CSA2);
        assert_eq!(
            s.pools.iter().map(|p| p.layer).collect::<Vec<_>>(),
            vec![2, 8, 14, 20]
        );
        assert_eq!(s.global_bytes_per_token(), 890.0);
        assert_eq!(s.snapshot_layers.len(), 20);
        assert_eq!(s.snapshot_bytes(), 20 * 128 * 528);
        assert_eq!(
            CacheSpec::from_geometry(&g, KvScheme::MXFP8).global_bytes_per_token(),
            1490.0
        );
        assert_eq!(
            CacheSpec::from_geometry(&g, KvScheme::LAUNCH_DAY).global_bytes_per_token(),
            1790.0
        );
        assert_eq!(s.pools[0].compressor_state_floats(), 1024);
    }

    #[test]
    fn v4_flash_arithmetic() {
        let s = CacheSpec::v4_flash();
        assert_eq!(s.pools.iter().filter(|p| p.ratio == 4).count(), 21);
        assert_eq!(s.pools.iter().filter(|p| p.ratio == 128).count(), 20);
        // 21 × (584 + 68) / 4 + 20 × 584 / 128 = 3,423 + 91.25 = 3,514.25 B/token.
        assert_eq!(s.global_bytes_per_token(), 3514.25);
        assert_eq!(s.snapshot_bytes(), 43 * 128 * 584);
        assert!(s.check_block_tokens(256).is_ok());
        assert!(s.check_block_tokens(64).is_err());
    }
}
