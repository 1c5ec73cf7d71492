//! The CSA2 attention backend: layer modes over shared per-step buffers, the 40-layer stack with
//! mHC between sublayers, and the launch-day baseline for A/B comparison.
//!
//! - [`cache`]: the [`cache::KvCache`] trait the layer modes reach the KV cache through, and a simple
//!   contiguous per-request implementation;
//! - [`paged`]: the same trait over the paged block manager of `crate::cache` (block tables, slot
//!   mapping, block-planar pages);
//! - [`layer`]: one attention sublayer in its role (Full / Reindex / Reuse / SWA-only);
//! - [`stack`]: the layers with mHC at both sites, embedding and FFN placeholders;
//! - [`launch_day`]: the configuration vLLM first shipped (docs/SPEC.md §5);
//! - [`signature`]: the tensor signature of one engine step (the C ABI's `csa2_engine_step`);
//! - [`gemm`]: the dense projections; [`timing`]: per-role, per-op wall time (recorded by the
//!   layers as they run, so it stays beside them; the harness aggregates it).
//!
//! The f64 reference of a decode step and the replay-error analyzer are measurements over this
//! engine: they live in the `csa2-harness` crate.

pub mod cache;
pub mod gemm;
pub mod launch_day;
pub mod layer;
pub mod paged;
pub mod signature;
pub mod stack;
pub mod timing;

pub use cache::{ContiguousCache, KvCache};
pub use layer::ReindexMode;
pub use paged::PagedCache;
// The engine takes its steps as the replay planner lays them out (`crate::replay::step`).
pub use crate::replay::{Phase, SeqStep, StepPlan};
pub use stack::{Backend, Model};

use crate::formats::KvScheme;
use crate::ops::indexer::QueryQuant;
use crate::ops::mhc::Path as MhcPath;

/// What distinguishes two backends running the same math: record formats, how Reindex layers
/// score, the mHC path and decoder bounded replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendConfig {
    /// Short name for reports (`csa2`, `launch_day`).
    pub name: &'static str,
    /// Cache record formats.
    pub formats: KvScheme,
    /// Reindex scoring.
    pub reindex: ReindexMode,
    /// mHC: fused single pass (Mega-mHC order) or four passes.
    pub mhc: MhcPath,
    /// Decoder bounded replay in prefill (docs/SPEC.md §3).
    pub decoder_replay: bool,
    /// Index-Q fake quantization matching the index-K format.
    pub query_quant: QueryQuant,
}

impl BackendConfig {
    /// The V4.1 design: NVFP4-DS main KV, MXFP4 index K (and Q), MXFP8 SWA, pooled Reindex
    /// scoring, fused mHC, decoder bounded replay on.
    pub const CSA2: BackendConfig = BackendConfig {
        name: "csa2",
        formats: KvScheme::CSA2,
        reindex: ReindexMode::Pooled,
        mhc: MhcPath::Fused,
        decoder_replay: true,
        query_quant: QueryQuant::Mxfp4,
    };

    /// The same configuration with decoder bounded replay switched (`--no-decoder-replay`).
    pub fn with_decoder_replay(mut self, on: bool) -> BackendConfig {
        self.decoder_replay = on;
        self
    }
}
