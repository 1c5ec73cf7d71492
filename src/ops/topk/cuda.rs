//! Top-k on the GPU (`kernels/topk.cu`, feature `cuda`: radix select). Reference:
//! [`super::reference::select_rows_index_order`], which the CUDA tests compare against exactly.
//!
//! Same selection rules as the CPU ([`super`]): ties → smaller index; −Inf / NaN never selected; a
//! row with `n_valid ≤ k` selects `0..n_valid`. The output is in ascending index order (the CPU
//! path orders by score; the set is the same).

use crate::cuda::device::{as_i32, cfg, launch};
use crate::cuda::shapes::TOPK_THREADS;
use crate::cuda::Device;
use crate::error::{Error, Result};
use cudarc::driver::CudaSlice;

/// Top-k of each row of `keys` (rows, n_cols) over its first `n_valid[t]` keys into `out`
/// (rows, k) i32, −1 padded.
///
/// Errors: [`Error::Invalid`] for k = 0, [`Error::Shape`] for buffers shorter than the launch,
/// [`Error::Cuda`].
pub fn select_rows(
    dev: &Device,
    keys: &CudaSlice<f32>,
    n_cols: usize,
    n_valid: &CudaSlice<i32>,
    k: usize,
    out: &mut CudaSlice<i32>,
    rows: usize,
) -> Result<()> {
    if k == 0 {
        return Err(Error::invalid("k", "must be at least 1"));
    }
    if rows == 0 {
        return Ok(());
    }
    if out.len() < rows * k || keys.len() < rows * n_cols || n_valid.len() < rows {
        return Err(Error::shape(
            "top-k buffers",
            format!("{rows} rows of {n_cols} keys → {k}"),
            format!(
                "{} keys, {} n_valid, {} out",
                keys.len(),
                n_valid.len(),
                out.len()
            ),
        ));
    }
    let (nc, kk) = (as_i32("n_cols", n_cols)?, as_i32("k", k)?);
    // topk_f32(keys, n_cols, n_valid, k, out)
    launch!(
        dev,
        "topk",
        "topk_f32",
        cfg((as_i32("rows", rows)? as u32, 1), TOPK_THREADS as u32),
        keys,
        &nc,
        n_valid,
        &kk,
        out
    );
    Ok(())
}
