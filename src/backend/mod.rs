//! The CSA2 attention backend: layer modes over shared per-step buffers, the 40-layer stack with
//! mHC between sublayers, and the launch-day baseline for A/B comparison.
//!
//! - [`cache`]: the [`cache::KvCache`] trait the layer modes reach the KV cache through, and a simple
//!   contiguous per-request implementation;
//! - [`plan`]: the rows of one step (prefill chunks and decode tokens of many requests), decoder
//!   bounded replay (SPEC §3) and window floors;
//! - [`gemm`]: the dense projections.

pub mod cache;
pub mod gemm;
pub mod plan;
