//! Top-k on the GPU (`kernels/topk.cu`, feature `cuda`: radix select, then a bitonic sort of the
//! selection in shared memory). Reference: the CPU path ([`super::select_rows`]), which the CUDA
//! tests compare against exactly.
//!
//! Same selection rules and the same output order as the CPU ([`super`]'s order contract): ties →
//! smaller index; −Inf / NaN never selected; a row with `n_valid ≤ k` selects `0..n_valid`;
//! a scored row comes out by (logit desc, index asc), sorted in the kernel — no host step, so the
//! launch is CUDA-graph capturable. The in-kernel sort holds at most
//! [`TOPK_SORT_MAX`] entries: a larger k is refused ([`Error::Unsupported`]).

use crate::cuda::device::{as_i32, cfg, cuda_error, launch};
use crate::cuda::shapes::{TOPK_SORT_MAX, TOPK_THREADS};
use crate::cuda::Device;
use crate::error::{Error, Result};
use cudarc::driver::CudaSlice;

/// Errors unless the kernel can select and order `k` entries per row.
pub fn check_k(k: usize) -> Result<()> {
    if k == 0 {
        return Err(Error::invalid("k", "must be at least 1"));
    }
    if k > TOPK_SORT_MAX {
        return Err(Error::Unsupported(format!(
            "the CUDA top-k orders at most {TOPK_SORT_MAX} entries per row in shared memory; \
             k = {k} (run it on host memory, which has no such bound)"
        )));
    }
    Ok(())
}

/// Top-k of each row of `keys` (rows, n_cols) over its first `n_valid[t]` keys into `out`
/// (rows, k) i32, −1 padded, in the order contract, on the device's own stream.
///
/// Errors: [`Error::Invalid`] for k = 0, [`Error::Unsupported`] for k over [`TOPK_SORT_MAX`],
/// [`Error::Shape`] for buffers shorter than the launch, [`Error::Cuda`].
pub fn select_rows(
    dev: &Device,
    keys: &CudaSlice<f32>,
    n_cols: usize,
    n_valid: &CudaSlice<i32>,
    k: usize,
    out: &mut CudaSlice<i32>,
    rows: usize,
) -> Result<()> {
    check_k(k)?;
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
    let (null, no_i64, ratio) = (0u64, 0i32, 1i32);
    // topk_f32(keys, n_cols, n_valid, positions, pos_i64, ratio, k, out, counts, err)
    launch!(
        dev,
        "topk",
        "topk_f32",
        cfg((as_i32("rows", rows)? as u32, 1), TOPK_THREADS as u32),
        keys,
        &nc,
        n_valid,
        &null,
        &no_i64,
        &ratio,
        &kk,
        out,
        &null,
        &null
    );
    Ok(())
}

/// One top-k launch over raw device addresses (the tensor-view entry, checked there): row t sees
/// `(positions[t] + 1) div ratio` entries of `logits`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowsLaunch {
    /// `(rows, n_cols)` f32.
    pub logits: u64,
    pub n_cols: usize,
    /// `(rows,)` i32 or i64 (`pos_i64`).
    pub positions: u64,
    pub pos_i64: bool,
    pub ratio: usize,
    /// `(rows, k)` i32.
    pub out: u64,
    pub k: usize,
    /// `(rows,)` i32 or 0.
    pub counts: u64,
    /// `[4]` i32 or 0: the first negative position `{1, row, 0, position}`.
    pub err: u64,
    pub rows: usize,
}

/// Launches `topk_f32` for `a` on `stream` (a `CUstream` of `dev`'s context owned by the caller,
/// borrowed for the launch; 0 = the legacy default stream). Returns after the launch: nothing is
/// allocated, copied or synchronized.
///
/// k = 0 is allowed here (counts are written as 0).
///
/// Errors: as [`select_rows`]; [`Error::Cuda`] for the module or the launch.
pub(crate) fn select_rows_launch(dev: &Device, a: &RowsLaunch, stream: u64) -> Result<()> {
    if a.k > 0 {
        check_k(a.k)?;
    }
    if a.rows == 0 {
        return Ok(());
    }
    if a.ratio == 0 {
        return Err(Error::invalid("ratio", "must be ≥ 1, found 0"));
    }
    let (nc, kk, ratio) = (
        as_i32("n_cols", a.n_cols)?,
        as_i32("k", a.k)?,
        as_i32("ratio", a.ratio)?,
    );
    let rows = as_i32("rows", a.rows)? as u32;
    let pos_i64 = i32::from(a.pos_i64);
    let f = dev.function("topk", "topk_f32")?;
    // SAFETY: `stream` is a live stream of this device's context (the entry's contract); the
    // wrapper does not own it and is dropped after the launch.
    let s = unsafe {
        dev.context()
            .wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream)
    };
    let null = 0u64;
    let mut b = s.launch_builder(&f);
    use cudarc::driver::PushKernelArg;
    // topk_f32(keys, n_cols, n_valid, positions, pos_i64, ratio, k, out, counts, err)
    b.arg(&a.logits).arg(&nc).arg(&null);
    b.arg(&a.positions).arg(&pos_i64).arg(&ratio).arg(&kk);
    b.arg(&a.out).arg(&a.counts).arg(&a.err);
    // SAFETY: the arguments follow the kernel's signature in order and type; the entry checked
    // every tensor's shape, dtype, device and density against `a`, so every access is in bounds.
    unsafe { b.launch(cfg((rows, 1), TOPK_THREADS as u32)) }
        .map_err(|e| cuda_error("launch topk_f32", e))?;
    Ok(())
}
