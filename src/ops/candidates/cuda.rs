//! The candidate pool on the GPU (feature `cuda`): `candidate_blocks_f32` (`kernels/topk.cu`)
//! scores the blocks where it reads them, pins the newest, selects the best `k` by the top-k's
//! radix select and sorts them in shared memory into [`super`]'s contract (score desc, id asc,
//! −1 padded) — the export's sorted block lists and counts, no host step, capture-safe. The mask
//! form the pooled indexer reads is that list expanded by `candidate_mask_from_blocks`
//! (`kernels/indexer.cu`).
//!
//! References: the CPU path ([`super::select_blocks_rows`]) and [`super::reference`], which the
//! CUDA tests compare against exactly.

use super::CandidateParams;
use crate::cuda::device::{as_i32, cfg, launch};
use crate::cuda::driver::CudaSlice;
use crate::cuda::shapes::{CANDIDATE_THREADS, TOPK_THREADS};
use crate::cuda::CudaDevice;
use crate::error::{Error, Result};
use crate::geometry::consts::CANDIDATE_BLOCK_SIZE;
use crate::ops::topk::cuda::{check_k, run_rows_views, RowsKernel, RowsViews};

/// Runs `candidate_blocks_f32` over checked views (the CUDA branch of
/// [`super::select_blocks_view`]; `stream` as [`run_rows_views`]).
pub(crate) fn select_blocks_views(
    ordinal: i32,
    p: &CandidateParams,
    v: &RowsViews<'_>,
    ratio: usize,
    stream: Option<u64>,
) -> Result<()> {
    p.validate()?;
    let kernel = RowsKernel::CandidateBlocks {
        block_size: p.block_size,
    };
    run_rows_views(ordinal, kernel, v, ratio, stream)
}

/// The kept blocks of each row of `logits` (rows, n_cols) over its first `n_valid[t]` entries
/// into `blocks` (rows, `p.num_blocks`) i32 and, when given, `counts` (rows,) on the device's own
/// stream: [`super::select_blocks_rows`]' result.
///
/// Errors: [`Error::Invalid`] for bad params, [`Error::Unsupported`] for more kept blocks than
/// the kernel orders, [`Error::Shape`] for short buffers, [`Error::Cuda`].
#[allow(clippy::too_many_arguments)]
pub fn select_blocks_rows(
    dev: &CudaDevice,
    p: &CandidateParams,
    logits: &CudaSlice<f32>,
    n_cols: usize,
    n_valid: &CudaSlice<i32>,
    blocks: &mut CudaSlice<i32>,
    counts: Option<&mut CudaSlice<i32>>,
    rows: usize,
) -> Result<()> {
    p.validate()?;
    check_k(p.num_blocks)?;
    if rows == 0 {
        return Ok(());
    }
    let counts_len = counts.as_ref().map_or(rows, |c| c.len());
    if blocks.len() < rows * p.num_blocks
        || logits.len() < rows * n_cols
        || n_valid.len() < rows
        || counts_len < rows
    {
        return Err(Error::shape(
            "candidate buffers",
            format!("{rows} rows of {n_cols} logits → {} blocks", p.num_blocks),
            format!(
                "{} logits, {} n_valid, {} blocks, {counts_len} counts",
                logits.len(),
                n_valid.len(),
                blocks.len()
            ),
        ));
    }
    let (nc, k, bs) = (
        as_i32("n_cols", n_cols)?,
        as_i32("num_blocks", p.num_blocks)?,
        as_i32("block_size", p.block_size)?,
    );
    let (null, no_i64, ratio) = (0u64, 0i32, 1i32);
    let r = as_i32("rows", rows)? as u32;
    // The counts' address (0 = none); the guard records the launch on the slice's stream.
    let (cp, _guard) = match counts {
        Some(c) => {
            use crate::cuda::driver::DevicePtrMut;
            let (ptr, g) = c.device_ptr_mut(dev.stream());
            (ptr, Some(g))
        }
        None => (0, None),
    };
    // candidate_blocks_f32(logits, n_cols, n_valid, positions, pos_i64, ratio, k, out, counts,
    //   err, block_size)
    launch!(
        dev,
        "topk",
        "candidate_blocks_f32",
        cfg((r, 1), TOPK_THREADS as u32),
        logits,
        &nc,
        n_valid,
        &null,
        &no_i64,
        &ratio,
        &k,
        blocks,
        &cp,
        &null,
        &bs
    );
    Ok(())
}

/// The pool mask of each row into `mask` ((rows, ceil(n_cols / 8)) u8, 1 = kept): the blocks
/// [`select_blocks_rows`] keeps, as the pooled indexer's `cand_mask` reads them
/// ([`super::reference::pool_mask`]).
///
/// Errors: [`Error::Unsupported`] for another block size than the indexer kernel's
/// [`CANDIDATE_BLOCK_SIZE`] (8), [`Error::Shape`] for a short mask, those of
/// [`select_blocks_rows`].
pub fn pool_mask(
    dev: &CudaDevice,
    p: &CandidateParams,
    logits: &CudaSlice<f32>,
    n_cols: usize,
    n_valid: &CudaSlice<i32>,
    mask: &mut CudaSlice<u8>,
    rows: usize,
) -> Result<()> {
    p.validate()?;
    if p.block_size != CANDIDATE_BLOCK_SIZE {
        return Err(Error::Unsupported(format!(
            "the CUDA candidate mask is read in blocks of {CANDIDATE_BLOCK_SIZE} entries, found {}",
            p.block_size
        )));
    }
    if rows == 0 || n_cols == 0 {
        return Ok(());
    }
    let nb = n_cols.div_ceil(CANDIDATE_BLOCK_SIZE);
    if mask.len() < rows * nb {
        return Err(Error::shape("candidate mask buffer", rows * nb, mask.len()));
    }
    let mut kept = dev.zeros::<i32>(rows * p.num_blocks)?;
    select_blocks_rows(dev, p, logits, n_cols, n_valid, &mut kept, None, rows)?;
    let (k, nbi) = (as_i32("num_blocks", p.num_blocks)?, as_i32("blocks", nb)?);
    // candidate_mask_from_blocks(blocks, k, mask, mask_stride)
    launch!(
        dev,
        "indexer",
        "candidate_mask_from_blocks",
        cfg((rows as u32, 1), CANDIDATE_THREADS as u32),
        &kept,
        &k,
        mask,
        &nbi
    );
    Ok(())
}
