//! CSA2 attention ops on the CPU (docs/SPEC.md §2), one folder per op family.
//!
//! Each family has `mod.rs` (parameters validated once, dispatch), `cpu.rs` (the fast path: rayon
//! threads, SIMD with runtime feature detection), `cuda.rs` (feature `cuda`: the kernel launch with
//! the same parameter types) and `reference.rs` (the one readable f64 reference, used by the CPU
//! tests, the CUDA tests and `csa2 check`). Tensor and file formats: `docs/OPS.md`.

pub mod attention;
pub mod candidates;
pub mod compressor;
pub mod indexer;
pub mod mhc;
pub mod rope;
pub mod simd;
pub mod topk;
