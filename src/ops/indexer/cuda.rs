//! Lightning-indexer logits on the GPU (`kernels/indexer.cu`, feature `cuda`) over a paged MXFP4
//! index-K cache ([`super::IndexCache`]); reference: [`super::reference::logits_paged`], which the
//! CUDA tests compare against.
//!
//! The kernel is built for [`INDEX_HEADS`] heads of [`INDEX_DIM`] dims (32 × 128; lane h keeps
//! head h's query in registers) and scores unquantised f32 queries; [`kernel_supports`] refuses
//! other [`IndexerParams`].

use super::{IndexerParams, QueryQuant, INDEX_DIM, INDEX_HEADS};
use crate::cuda::device::{as_i32, cfg, launch, OrNull};
use crate::cuda::shapes::{INDEXER_ENTRIES_PER_BLOCK, INDEXER_THREADS};
use crate::cuda::Device;
use crate::error::{Error, Result};
use cudarc::driver::CudaSlice;

/// Errors unless `p` is what the kernel computes: [`Error::Unsupported`] naming the difference.
pub fn kernel_supports(p: &IndexerParams) -> Result<()> {
    if p.heads != INDEX_HEADS || p.query_quant != QueryQuant::None || p.ratio == 0 {
        return Err(Error::Unsupported(format!(
            "the CUDA indexer is built for {INDEX_HEADS} heads, unquantised queries and ratio ≥ 1; \
             found {} heads, {:?}, ratio {}",
            p.heads, p.query_quant, p.ratio
        )));
    }
    Ok(())
}

/// Device buffers of one indexer call: T query rows of any requests.
#[derive(Debug)]
pub struct DeviceQueries<'a> {
    /// (T, 32, 128) f32, RoPE'd.
    pub q: &'a CudaSlice<f32>,
    /// (T, 32) f32, already scaled.
    pub w: &'a CudaSlice<f32>,
    /// (T,) i32 absolute positions.
    pub pos: &'a CudaSlice<i32>,
    /// (T,) i32 request of each row (a row of the block table).
    pub req: &'a CudaSlice<i32>,
    /// Rows T.
    pub rows: usize,
}

/// The paged index-K cache on the device (shapes as [`super::IndexCache`]).
#[derive(Debug)]
pub struct DeviceIndexCache<'a> {
    /// Page pool bytes.
    pub pages: &'a CudaSlice<u8>,
    /// (requests, max_blocks) i32.
    pub block_table: &'a CudaSlice<i32>,
    /// Columns of the block table.
    pub max_blocks: usize,
    /// Records per page.
    pub page_slots: usize,
}

/// Indexer logits (T, n_cols) f32 into `logits`: `Σ_h w[t,h] · ReLU(q[t,h] · k_j)` for visible j,
/// −Inf elsewhere; with `cand_mask` ((T, stride) u8 per 8-entry block, 1 = in the pool) entries
/// outside the pool are −Inf too (Reindex layers). The kernel does not check block ids: validate
/// the host description with [`super::IndexCache::check`] first.
///
/// Errors: [`Error::Unsupported`] from [`kernel_supports`], [`Error::Shape`] for buffers shorter
/// than the launch, [`Error::Cuda`].
pub fn logits(
    dev: &Device,
    p: &IndexerParams,
    qs: &DeviceQueries,
    cache: &DeviceIndexCache,
    cand_mask: Option<(&CudaSlice<u8>, usize)>,
    logits: &mut CudaSlice<f32>,
    n_cols: usize,
) -> Result<()> {
    kernel_supports(p)?;
    let rows = qs.rows;
    if rows == 0 || n_cols == 0 {
        return Ok(());
    }
    if logits.len() < rows * n_cols || qs.q.len() < rows * INDEX_HEADS * INDEX_DIM {
        return Err(Error::shape(
            "indexer logits buffers",
            format!("{rows} rows × {n_cols}"),
            logits.len(),
        ));
    }
    if let Some((m, s)) = cand_mask {
        if s * 8 < n_cols || m.len() < rows * s {
            return Err(Error::shape(
                "candidate mask",
                format!("(T={rows}, ≥ {}) u8", n_cols.div_ceil(8)),
                format!("{} bytes, stride {s}", m.len()),
            ));
        }
    }
    let (mb, ps, ra, nc) = (
        as_i32("max_blocks", cache.max_blocks)?,
        as_i32("page_slots", cache.page_slots)?,
        as_i32("ratio", p.ratio)?,
        as_i32("n_cols", n_cols)?,
    );
    let grid = (
        n_cols.div_ceil(INDEXER_ENTRIES_PER_BLOCK) as u32,
        as_i32("rows", rows)? as u32,
    );
    let stride = as_i32("mask stride", cand_mask.map_or(0, |m| m.1))?;
    let mask = OrNull(cand_mask.map(|m| m.0));
    // indexer_logits_f32(q, w, pos, req, block_table, max_blocks, page_slots, index_pages, ratio,
    //   cand_mask, mask_stride, logits, n_cols)
    launch!(
        dev,
        "indexer",
        "indexer_logits_f32",
        cfg(grid, INDEXER_THREADS as u32),
        qs.q,
        qs.w,
        qs.pos,
        qs.req,
        cache.block_table,
        &mb,
        &ps,
        cache.pages,
        &ra,
        &mask,
        &stride,
        logits,
        &nc
    );
    Ok(())
}
