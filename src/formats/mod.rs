//! Bit-exact number formats and KV records (docs/SPEC.md §1).
//!
//! - [`scalar`]: E2M1, E4M3 (saturating), E8M0 codecs.
//! - [`records`]: the five record formats, row at a time and over contiguous record buffers.
//! - [`fast`]: the SIMD row codecs (AVX-512 / AVX2, run-time detection), bit-identical to the
//!   scalar reference, used by every bulk entry point.
//! - [`page`]: block-planar cache pages (all slots' data, then all slots' scales).
//! - [`scheme`]: [`KvScheme`], which record format each cache region stores.
//! - [`abi`]: the record widths, `Csa2Format` ids and `Csa2PoolLayout` ids, defined once for the
//!   crate and the CUDA kernels (build.rs passes them to nvcc).

pub mod abi;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fast;
pub mod page;
pub mod records;
pub mod scalar;
pub mod scheme;

pub use records::{
    decode_rows, decode_rows_with, encode_rows, encode_rows_with, RecordFormat, FP8_INDEX_BYTES,
    INDEX_DIM, KV_DIM, MXFP4_INDEX_BYTES, MXFP8_BYTES, NOPE_DIM, NVFP4_DS_BYTES, V4_RECORD_BYTES,
};
pub use scheme::KvScheme;

use rayon::prelude::*;

// `abi` names the geometry's compile-time constants as `super::consts`, the path that also holds
// when build.rs compiles the two files side by side.
use crate::geometry::consts;

/// Rows per parallel task: below this, the thread hand-off costs more than the work.
pub(crate) const ROWS_PER_TASK: usize = 256;

/// Applies `f(input_row, output_record)` over rows, in parallel for large inputs.
pub(crate) fn parallel_rows<F>(dim: usize, rec: usize, x: &[f32], out: &mut [u8], f: F)
where
    F: Fn(&[f32], &mut [u8]) + Sync,
{
    let rows = x.len() / dim;
    if rows < 2 * ROWS_PER_TASK {
        x.chunks_exact(dim)
            .zip(out.chunks_exact_mut(rec))
            .for_each(|(r, o)| f(r, o));
    } else {
        x.par_chunks(dim * ROWS_PER_TASK)
            .zip(out.par_chunks_mut(rec * ROWS_PER_TASK))
            .for_each(|(xs, os)| {
                xs.chunks_exact(dim)
                    .zip(os.chunks_exact_mut(rec))
                    .for_each(|(r, o)| f(r, o));
            });
    }
}

/// Applies `f(output_row, input_record)` over rows, in parallel for large inputs.
pub(crate) fn parallel_rows_mut<F>(dim: usize, rec: usize, out: &mut [f32], recs: &[u8], f: F)
where
    F: Fn(&mut [f32], &[u8]) + Sync,
{
    let rows = out.len() / dim;
    if rows < 2 * ROWS_PER_TASK {
        out.chunks_exact_mut(dim)
            .zip(recs.chunks_exact(rec))
            .for_each(|(o, r)| f(o, r));
    } else {
        out.par_chunks_mut(dim * ROWS_PER_TASK)
            .zip(recs.par_chunks(rec * ROWS_PER_TASK))
            .for_each(|(os, rs)| {
                os.chunks_exact_mut(dim)
                    .zip(rs.chunks_exact(rec))
                    .for_each(|(o, r)| f(o, r));
            });
    }
}
