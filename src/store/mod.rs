//! Persistent tiers behind the HBM cache (docs/SPEC.md §0.5).
//!
//! - [`ssd`]: global KV on SSD, keyed by the chained prefix key; append-only segments, CRC32C per
//!   record and a checksummed state word, index rebuilt on restart (resynchronising past damage),
//!   one writer per directory (lock), live-byte capacity with compaction, 72-h minimum lifetime in
//!   store age (wall-clock jumps do not expire entries) with admission control.
//! - [`dram`]: encoder SWA snapshots in host DRAM (10% of RAM, 5-minute TTL, LRU).
//! - [`clock`]: injected time, so tests and the trace simulator drive the lifetimes.
//! - [`tiers`]: the tier policy, [`TierPolicy`] — what goes where, for the serving session and the
//!   trace simulation alike.
//!
//! What goes where: a block's global KV (every KV-source layer's main and index pages, one slab) is
//! one SSD record under the block's prefix key; the SWA windows of the encoder layers at a prefix
//! boundary are one DRAM snapshot under [`crate::cache::PrefixHasher::derived_key`] of the boundary
//! block. Decoder SWA state is never persisted: after a prefix hit the replay planner
//! ([`crate::replay`]) rebuilds what is missing. [`TierPolicy`] states this rule once.

pub mod clock;
pub mod dram;
pub mod ssd;
pub mod tiers;

pub use clock::{Clock, ManualClock, SystemClock};
pub use dram::{DramConfig, DramPool, DramStats, Snapshot};
pub use ssd::{FsyncPolicy, RecoveryReport, RefreshReport, SsdConfig, SsdStats, SsdStore};
pub use tiers::{Tier, TierPolicy};
