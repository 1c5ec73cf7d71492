//! The tier policy: what goes where when a request ends, and how a later prefix hit is rebuilt
//! (docs/SPEC.md §0 and §0.5). One [`TierPolicy`] is the rule both a serving session (`csa2 run`)
//! and the trace simulation (`csa2 trace`) follow, so the two cannot drift apart.
//!
//! | state at a prefix boundary            | V4.1 ([`TierPolicy::v41`])         | V4 ([`TierPolicy::v4_flash`])   |
//! |---------------------------------------|------------------------------------|---------------------------------|
//! | global KV (a block's slab, all KV-source layers) | SSD, under the block's prefix key | SSD, under the block's prefix key |
//! | SWA windows of the snapshot layers    | DRAM (TTL), encoder layers only    | SSD, every layer                |
//! | SWA windows of the other layers       | never persisted: replayed          | — (none)                        |
//! | a hit whose snapshot is missing       | encoder bounded replay             | exact `L × window` staircase    |
//!
//! The snapshot of a boundary is stored under [`TierPolicy::snapshot_key`] of the boundary
//! block's key.

use crate::cache::{CacheSpec, PrefixHasher, PrefixKey};
use crate::error::Result;
use crate::geometry::Geometry;
use crate::replay::{self, ReplayConfig, ReplayMode, ReplayPlan, SnapshotScope};
use serde::Serialize;

/// A persistent tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The SSD store ([`super::SsdStore`]): long-lived, checksummed, keyed by prefix key.
    Ssd,
    /// The host-DRAM snapshot pool ([`super::DramPool`]): minutes-long TTL, LRU.
    Dram,
}

/// Where each kind of per-request state goes, and the replay planner a hit runs under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TierPolicy {
    /// Tier of the global KV (every design: the SSD).
    pub global_tier: Tier,
    /// Layers whose SWA window is snapshotted at a prefix boundary, in layer order.
    pub snapshot_layers: Vec<usize>,
    /// Tier of that snapshot.
    pub snapshot_tier: Tier,
    /// The replay planner's configuration: what a hit recomputes when its snapshot is present or
    /// missing.
    pub replay: ReplayConfig,
}

impl TierPolicy {
    /// DeepSeek-V4.1: global KV on SSD; the encoder layers' SWA windows (with the compressor
    /// carries) snapshotted to DRAM; decoder SWA never persisted (decoder bounded replay rebuilds
    /// it); a snapshot miss replays the encoder's last window, planned in `mode`.
    pub fn v41(g: &Geometry, mode: ReplayMode) -> TierPolicy {
        TierPolicy {
            global_tier: Tier::Ssd,
            snapshot_layers: g
                .layers
                .iter()
                .filter(|l| l.encoder)
                .map(|l| l.id)
                .collect(),
            snapshot_tier: Tier::Dram,
            replay: ReplayConfig::from_geometry(g, mode),
        }
    }

    /// DeepSeek-V4-Flash (`spec` = [`CacheSpec::v4_flash`]): global KV and every layer's SWA
    /// snapshot on SSD; no encoder/decoder split; a snapshot miss runs the exact staircase.
    pub fn v4_flash(spec: &CacheSpec) -> TierPolicy {
        TierPolicy {
            global_tier: Tier::Ssd,
            snapshot_layers: spec.snapshot_layers.clone(),
            snapshot_tier: Tier::Ssd,
            replay: ReplayConfig {
                mode: ReplayMode::Exact,
                window: spec.window,
                num_layers: spec.num_layers,
                first_decoder_layer: spec.num_layers,
                snapshot_scope: SnapshotScope::AllLayers,
                kv_sources: spec.pools.iter().map(|p| (p.layer, p.ratio)).collect(),
            },
        }
    }

    /// The key the SWA snapshot at the end of the block named `boundary` is stored under.
    pub fn snapshot_key(hasher: &PrefixHasher, boundary: &PrefixKey) -> PrefixKey {
        hasher.derived_key(boundary, "swa-snapshot")
    }

    /// The rows a prefill of `prompt_len` tokens runs after a hit of `hit_tokens` (see
    /// [`replay::plan`]), with the boundary's snapshot found (`snapshot`) or not.
    ///
    /// Errors: those of [`replay::plan`].
    pub fn plan(&self, prompt_len: usize, hit_tokens: usize, snapshot: bool) -> Result<ReplayPlan> {
        replay::plan(&self.replay, prompt_len, hit_tokens, snapshot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Role;

    #[test]
    fn v41_snapshots_the_encoder_to_dram_and_v4_every_layer_to_ssd() {
        let g = Geometry::embedded();
        let p = TierPolicy::v41(&g, ReplayMode::Bounded);
        assert_eq!(p.global_tier, Tier::Ssd);
        assert_eq!(p.snapshot_tier, Tier::Dram);
        // The encoder is the first half of the CED stack; the decoder's windows stay out.
        assert_eq!(
            p.snapshot_layers,
            (0..g.first_decoder_layer).collect::<Vec<_>>()
        );
        assert_eq!(
            p.snapshot_layers,
            CacheSpec::from_geometry(&g, crate::formats::KvScheme::CSA2).snapshot_layers
        );
        assert_eq!(p.replay.snapshot_scope, SnapshotScope::Encoder);
        assert_eq!(p.replay.kv_sources.len(), g.layers_with(Role::Full).count());
        let spec = CacheSpec::v4_flash();
        let v4 = TierPolicy::v4_flash(&spec);
        assert_eq!(v4.snapshot_tier, Tier::Ssd);
        assert_eq!(v4.snapshot_layers.len(), spec.num_layers);
        assert_eq!(v4.replay.mode, ReplayMode::Exact);
        assert_eq!(v4.replay.first_decoder_layer, spec.num_layers);
    }

    #[test]
    fn a_snapshot_miss_costs_the_designs_replay() {
        let g = Geometry::embedded();
        let v41 = TierPolicy::v41(&g, ReplayMode::Bounded);
        // A 4,096-token hit of a 5,000-token prompt: with the snapshot no replay, without it the
        // encoder replays one window.
        assert_eq!(v41.plan(5000, 4096, true).unwrap().replayed_tokens(), 0);
        assert_eq!(
            v41.plan(5000, 4096, false).unwrap().replayed_tokens(),
            g.window
        );
        let spec = CacheSpec::v4_flash();
        let v4 = TierPolicy::v4_flash(&spec);
        // V4's miss rebuilds every layer's window: the first layer replays L × window tokens.
        assert_eq!(
            v4.plan(20_000, 16_384, false).unwrap().replayed_tokens(),
            spec.num_layers * spec.window
        );
        assert_eq!(v4.plan(20_000, 16_384, true).unwrap().replayed_tokens(), 0);
        assert!(v41.plan(0, 0, false).is_err());
    }

    #[test]
    fn snapshot_keys_are_derived_from_the_boundary_block() {
        let h = PrefixHasher::new(b"m", "nvfp4", 4);
        let keys = h.keys(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let a = TierPolicy::snapshot_key(&h, &keys[0]);
        assert_ne!(a, keys[0]);
        assert_ne!(a, TierPolicy::snapshot_key(&h, &keys[1]));
        assert_eq!(a, h.derived_key(&keys[0], "swa-snapshot"));
    }
}
