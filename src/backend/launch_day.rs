//! The launch-day backend: what vLLM first shipped for DeepSeek-V4.1 (docs/SPEC.md §5.6, "launch
//! day"), reproduced in this crate so the A/B isolates engineering choices:
//!
//! | | launch day | CSA2 |
//! |---|---|---|
//! | main KV | V4 record, 584 B (E4M3 NoPE + bf16 RoPE) | NVFP4-DS, 288 B |
//! | index K (and Q) | FP8, 132 B | MXFP4, 68 B |
//! | SWA window | V4 record, 584 B | MXFP8, 528 B |
//! | Reindex layers | dense logits over every visible entry, then masked to the pool | scored only inside the pool |
//! | mHC | unfused: post, coefficients, collapse, norm as four passes | one fused pass |
//! | decoder replay | off: layers 20–39 run every prefill row | on |
//!
//! Everything else — roles, compressor, indexer math, top-k, candidate pool, attention, projections —
//! is the same code, so outputs differ only by quantization and by what the rows see.

use super::{BackendConfig, ReindexMode};
use crate::formats::KvScheme;
use crate::ops::indexer::QueryQuant;
use crate::ops::mhc::Path as MhcPath;

/// The launch-day configuration.
pub const LAUNCH_DAY: BackendConfig = BackendConfig {
    name: "launch_day",
    formats: KvScheme::LAUNCH_DAY,
    reindex: ReindexMode::DenseThenMask,
    mhc: MhcPath::Unfused,
    decoder_replay: false,
    query_quant: QueryQuant::Fp8,
};
