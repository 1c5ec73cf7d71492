//! CSA2 attention ops on the CPU (docs/SPEC.md §2), one folder per op family.
//!
//! Each family has `mod.rs` (parameters validated once, dispatch), `cpu.rs` (the fast path: rayon
//! threads, SIMD with runtime feature detection) and `reference.rs` (a readable f64 reference used
//! by the tests and by `csa2 check`). Tensor and file formats: `docs/OPS.md`.

pub mod attention;
pub mod candidates;
pub mod compressor;
pub mod indexer;
pub mod mhc;
pub mod rope;
pub mod simd;
pub mod topk;
