//! Lightning-indexer logits, top-k and the hierarchical candidate pool (`kernels/indexer.cu`,
//! `kernels/topk.cu`; docs/SPEC.md §2 "Indexer" and "Candidate pool").

use super::device::{as_i32, cfg, check_len, launch, Device};
use crate::error::{Error, Result};
use crate::formats::MXFP4_INDEX_BYTES;
use cudarc::driver::CudaSlice;

/// Index-query heads.
pub const INDEX_HEADS: usize = 32;
/// Index head dim.
pub const INDEX_HEAD_DIM: usize = 128;
/// Entries per candidate block.
pub const CANDIDATE_BLOCK: usize = 8;
/// Blocks kept in the candidate pool.
pub const CANDIDATE_BLOCKS: usize = 2048;
const ENTRIES_PER_BLOCK: usize = 64;

/// Index-query rows of one indexer call (decode: one row per request; prefill: every prompt row).
#[derive(Debug, Clone, Copy)]
pub struct IndexerQueries<'a> {
    /// (T, 32, 128) f32, RoPE'd on dims 64..127.
    pub q: &'a [f32],
    /// Head weights (T, 32) f32 (already scaled by 128^-0.5 · 32^-0.5).
    pub w: &'a [f32],
    /// Absolute position of each row (T,) i32: row t sees entries j < (pos + 1) div ratio.
    pub pos: &'a [i32],
    /// Request of each row (T,) i32, a row of `block_table`.
    pub req: &'a [i32],
}

/// Paged MXFP4 index-K cache.
#[derive(Debug, Clone, Copy)]
pub struct IndexCache<'a> {
    /// The page pool (n_pages × page_slots × 68 B, block-planar).
    pub pages: &'a [u8],
    /// (requests, max_blocks) i32, -1 = unmapped.
    pub block_table: &'a [i32],
    /// Columns of the block table.
    pub max_blocks: usize,
    /// Records per page.
    pub page_slots: usize,
    /// Compression ratio of the KV source layer (1 or 2).
    pub ratio: usize,
}

impl Device {
    /// Indexer logits (T, n_cols) f32: `Σ_h w[t,h] · ReLU(q[t,h] · k_j)` for visible j, −Inf
    /// elsewhere; with `cand_mask` ((T, mask_stride) u8 per 8-entry block, 1 = in the pool) entries
    /// outside the pool are −Inf too (Reindex layers).
    ///
    /// Errors: [`Error::Shape`] / [`Error::Invalid`] on inconsistent inputs, [`Error::Cuda`].
    pub fn indexer_logits(
        &self,
        qs: &IndexerQueries,
        cache: &IndexCache,
        cand_mask: Option<(&[u8], usize)>,
        n_cols: usize,
    ) -> Result<Vec<f32>> {
        let t = qs.pos.len();
        check_len(
            "index q values",
            qs.q.len(),
            t * INDEX_HEADS * INDEX_HEAD_DIM,
        )?;
        check_len("index head weights", qs.w.len(), t * INDEX_HEADS)?;
        check_len("req", qs.req.len(), t)?;
        if cache.ratio == 0 || cache.page_slots == 0 {
            return Err(Error::invalid("ratio / page_slots", "must be at least 1"));
        }
        let requests = cache.block_table.len() / cache.max_blocks.max(1);
        check_len(
            "index block_table",
            cache.block_table.len(),
            requests * cache.max_blocks,
        )?;
        if let Some((i, &r)) = qs
            .req
            .iter()
            .enumerate()
            .find(|(_, &r)| r < 0 || r as usize >= requests)
        {
            return Err(Error::invalid(
                "req",
                format!("row {i} names request {r}; the block table has {requests}"),
            ));
        }
        if qs.pos.iter().any(|&p| p < 0) {
            return Err(Error::invalid("pos", "positions must be non-negative"));
        }
        let page = cache.page_slots * MXFP4_INDEX_BYTES;
        if !cache.pages.len().is_multiple_of(page) {
            return Err(Error::shape(
                "index page pool bytes",
                format!("a multiple of {page}"),
                cache.pages.len(),
            ));
        }
        let n_pages = cache.pages.len() / page;
        if let Some(&b) = cache
            .block_table
            .iter()
            .find(|&&b| b < -1 || b as i64 >= n_pages as i64)
        {
            return Err(Error::invalid(
                "index block_table",
                format!("block {b} is outside the {n_pages} pages"),
            ));
        }
        let (mask, stride) = match cand_mask {
            Some((m, s)) => {
                check_len("candidate mask", m.len(), t * s)?;
                if s * CANDIDATE_BLOCK < n_cols {
                    return Err(Error::shape(
                        "candidate mask stride",
                        format!("≥ {}", n_cols.div_ceil(CANDIDATE_BLOCK)),
                        s,
                    ));
                }
                (Some(self.upload(m)?), s)
            }
            None => (None, 0),
        };
        let dq = self.upload(qs.q)?;
        let dw = self.upload(qs.w)?;
        let dpos = self.upload(qs.pos)?;
        let dreq = self.upload(qs.req)?;
        let dbt = self.upload(cache.block_table)?;
        let dpages = self.upload(cache.pages)?;
        let mut out = self.zeros::<f32>(t * n_cols)?;
        self.indexer_logits_dev(
            &dq,
            &dw,
            &dpos,
            &dreq,
            &dbt,
            cache.max_blocks,
            cache.page_slots,
            &dpages,
            cache.ratio,
            mask.as_ref().map(|m| (m, stride)),
            &mut out,
            t,
            n_cols,
        )?;
        let mut v = self.download(&out)?;
        v.truncate(t * n_cols);
        Ok(v)
    }

    /// Device form of [`Device::indexer_logits`] (shapes as there; `rows` = T).
    #[allow(clippy::too_many_arguments)]
    pub fn indexer_logits_dev(
        &self,
        q: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        req: &CudaSlice<i32>,
        block_table: &CudaSlice<i32>,
        max_blocks: usize,
        page_slots: usize,
        index_pages: &CudaSlice<u8>,
        ratio: usize,
        cand_mask: Option<(&CudaSlice<u8>, usize)>,
        logits: &mut CudaSlice<f32>,
        rows: usize,
        n_cols: usize,
    ) -> Result<()> {
        if rows == 0 || n_cols == 0 {
            return Ok(());
        }
        if logits.len() < rows * n_cols || q.len() < rows * INDEX_HEADS * INDEX_HEAD_DIM {
            return Err(Error::shape(
                "indexer_logits_dev buffers",
                format!("{rows} rows × {n_cols}"),
                logits.len(),
            ));
        }
        let (mb, ps, ra, nc) = (
            as_i32("max_blocks", max_blocks)?,
            as_i32("page_slots", page_slots)?,
            as_i32("ratio", ratio)?,
            as_i32("n_cols", n_cols)?,
        );
        let grid = (
            n_cols.div_ceil(ENTRIES_PER_BLOCK) as u32,
            as_i32("rows", rows)? as u32,
        );
        let null = 0u64;
        let stride = as_i32("mask stride", cand_mask.map_or(0, |m| m.1))?;
        // indexer_logits_f32(q, w, pos, req, block_table, max_blocks, page_slots, index_pages, ratio,
        //   cand_mask, mask_stride, logits, n_cols)
        match cand_mask {
            Some((m, _)) => launch!(
                self,
                "indexer",
                "indexer_logits_f32",
                cfg(grid, 128),
                q,
                w,
                pos,
                req,
                block_table,
                &mb,
                &ps,
                index_pages,
                &ra,
                m,
                &stride,
                logits,
                &nc
            ),
            None => launch!(
                self,
                "indexer",
                "indexer_logits_f32",
                cfg(grid, 128),
                q,
                w,
                pos,
                req,
                block_table,
                &mb,
                &ps,
                index_pages,
                &ra,
                &null,
                &stride,
                logits,
                &nc
            ),
        }
        Ok(())
    }

    /// Top-k of each row of `keys` (T, n_cols) over its first `n_valid[t]` keys: the selected
    /// indices in ascending order, padded with -1, (T, k) i32. Ties → smaller index; −Inf / NaN keys
    /// are never selected; a row with n_valid ≤ k selects 0..n_valid−1 (docs/SPEC.md §2).
    pub fn topk(&self, keys: &[f32], n_cols: usize, n_valid: &[i32], k: usize) -> Result<Vec<i32>> {
        let t = n_valid.len();
        check_len("top-k keys", keys.len(), t * n_cols)?;
        if k == 0 {
            return Err(Error::invalid("k", "must be at least 1"));
        }
        let dk = self.upload(keys)?;
        let dn = self.upload(n_valid)?;
        let mut out = self.zeros::<i32>(t * k)?;
        self.topk_dev(&dk, n_cols, &dn, k, &mut out, t)?;
        let mut v = self.download(&out)?;
        v.truncate(t * k);
        Ok(v)
    }

    /// Device form of [`Device::topk`].
    pub fn topk_dev(
        &self,
        keys: &CudaSlice<f32>,
        n_cols: usize,
        n_valid: &CudaSlice<i32>,
        k: usize,
        out: &mut CudaSlice<i32>,
        rows: usize,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        if out.len() < rows * k || keys.len() < rows * n_cols || n_valid.len() < rows {
            return Err(Error::shape(
                "topk_dev buffers",
                format!("{rows} rows"),
                out.len() / k,
            ));
        }
        let (nc, kk) = (as_i32("n_cols", n_cols)?, as_i32("k", k)?);
        // topk_f32(keys, n_cols, n_valid, k, out)
        launch!(
            self,
            "topk",
            "topk_f32",
            cfg((as_i32("rows", rows)? as u32, 1), 1024),
            keys,
            &nc,
            n_valid,
            &kk,
            out
        );
        Ok(())
    }

    /// The candidate pool of each row (layer 20, docs/SPEC.md §2): block score = max of 8 consecutive
    /// logits, the newest visible block pinned, the top min(2048, blocks) kept. Returns the pool
    /// mask (T, ceil(n_cols / 8)) u8, 1 = kept, and its stride.
    pub fn candidate_mask(
        &self,
        logits: &[f32],
        n_cols: usize,
        n_valid: &[i32],
    ) -> Result<(Vec<u8>, usize)> {
        let t = n_valid.len();
        check_len("candidate logits", logits.len(), t * n_cols)?;
        let nb = n_cols.div_ceil(CANDIDATE_BLOCK);
        let dl = self.upload(logits)?;
        let dn = self.upload(n_valid)?;
        let mut mask = self.zeros::<u8>(t * nb)?;
        self.candidate_mask_dev(&dl, n_cols, &dn, &mut mask, t)?;
        let mut v = self.download(&mask)?;
        v.truncate(t * nb);
        Ok((v, nb))
    }

    /// Device form of [`Device::candidate_mask`]; `mask` holds (rows, ceil(n_cols / 8)) u8.
    pub fn candidate_mask_dev(
        &self,
        logits: &CudaSlice<f32>,
        n_cols: usize,
        n_valid: &CudaSlice<i32>,
        mask: &mut CudaSlice<u8>,
        rows: usize,
    ) -> Result<()> {
        if rows == 0 || n_cols == 0 {
            return Ok(());
        }
        let nb = n_cols.div_ceil(CANDIDATE_BLOCK);
        if mask.len() < rows * nb {
            return Err(Error::shape("candidate mask buffer", rows * nb, mask.len()));
        }
        let mut scores = self.zeros::<f32>(rows * nb)?;
        let mut kept = self.zeros::<i32>(rows * CANDIDATE_BLOCKS)?;
        let mut nblk = self.zeros::<i32>(rows)?;
        let (nc, nbi, r) = (
            as_i32("n_cols", n_cols)?,
            as_i32("blocks", nb)?,
            as_i32("rows", rows)?,
        );
        // candidate_block_scores_f32(logits, n_cols, n_valid, block_scores, n_blocks, blocks_valid)
        launch!(
            self,
            "indexer",
            "candidate_block_scores_f32",
            cfg((nb.div_ceil(256) as u32, r as u32), 256),
            logits,
            &nc,
            n_valid,
            &mut scores,
            &nbi,
            &mut nblk
        );
        self.topk_dev(&scores, nb, &nblk, CANDIDATE_BLOCKS, &mut kept, rows)?;
        let (k, st) = (as_i32("k", CANDIDATE_BLOCKS)?, nbi);
        // candidate_mask_from_blocks(blocks, k, mask, mask_stride)
        launch!(
            self,
            "indexer",
            "candidate_mask_from_blocks",
            cfg((r as u32, 1), 256),
            &kept,
            &k,
            mask,
            &st
        );
        Ok(())
    }
}
