//! The candidate pool on the GPU (`kernels/indexer.cu` block scores and mask, `kernels/topk.cu`
//! selection; feature `cuda`). Reference: [`super::reference::pool_mask`], which the CUDA tests
//! compare against exactly.
//!
//! The kernels are built for the geometry's blocks of [`CANDIDATE_BLOCK_SIZE`] entries (8); the
//! number of kept blocks is a launch argument ([`CandidateParams::num_blocks`]).

use super::CandidateParams;
use crate::cuda::device::{as_i32, cfg, launch};
use crate::cuda::shapes::CANDIDATE_THREADS;
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::geometry::consts::CANDIDATE_BLOCK_SIZE;
use cudarc::driver::CudaSlice;

/// The pool mask of each row into `mask` ((rows, ceil(n_cols / 8)) u8, 1 = kept): block score =
/// max of its visible logits, the newest visible block pinned, the top `p.num_blocks` kept.
///
/// Errors: [`Error::Unsupported`] for another block size, [`Error::Shape`] for a short mask,
/// [`Error::Cuda`].
pub fn pool_mask(
    dev: &Device,
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
            "the CUDA candidate pool is built for blocks of {CANDIDATE_BLOCK_SIZE} entries, found {}",
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
    let mut scores = dev.zeros::<f32>(rows * nb)?;
    let mut kept = dev.zeros::<i32>(rows * p.num_blocks)?;
    let mut nblk = dev.zeros::<i32>(rows)?;
    let (nc, nbi, r) = (
        as_i32("n_cols", n_cols)?,
        as_i32("blocks", nb)?,
        as_i32("rows", rows)?,
    );
    // candidate_block_scores_f32(logits, n_cols, n_valid, block_scores, n_blocks, blocks_valid)
    launch!(
        dev,
        "indexer",
        "candidate_block_scores_f32",
        cfg(
            (nb.div_ceil(CANDIDATE_THREADS) as u32, r as u32),
            CANDIDATE_THREADS as u32
        ),
        logits,
        &nc,
        n_valid,
        &mut scores,
        &nbi,
        &mut nblk
    );
    crate::ops::topk::cuda::select_rows(dev, &scores, nb, &nblk, p.num_blocks, &mut kept, rows)?;
    let k = as_i32("num_blocks", p.num_blocks)?;
    // candidate_mask_from_blocks(blocks, k, mask, mask_stride)
    launch!(
        dev,
        "indexer",
        "candidate_mask_from_blocks",
        cfg((r as u32, 1), CANDIDATE_THREADS as u32),
        &kept,
        &k,
        mask,
        &nbi
    );
    Ok(())
}
