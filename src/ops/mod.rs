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
pub mod pool;
pub mod rope;
pub mod simd;
pub mod topk;

/// Compressed entries a query at `pos` sees with ratio `m`: `(pos + 1) div m` (docs/SPEC.md §2.4).
/// The one visibility rule of the indexer, top-k, candidates and attention.
#[inline]
pub fn visible(pos: i64, m: usize) -> usize {
    // Through i128: `pos + 1` overflows i64 at i64::MAX (found by tests/ffi_fuzz.rs).
    ((pos.max(-1) as i128 + 1) as u64 / m as u64) as usize
}
