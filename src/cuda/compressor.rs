//! The compressor fused with the main-KV and index-K cache writes (`kernels/compressor.cu`,
//! docs/SPEC.md §2 "Compressor").
//!
//! Per compressed entry j of a request (tokens [j·m, j·m + m)): pool (ratio 2: per-channel softmax
//! gate of the two scores; ratio 1: the token itself) → RMSNorm(norm_w) → bf16 latent; main KV =
//! NVFP4-DS(RoPE(latent) at j·m); index K = MXFP4(RoPE(RMSNorm(wk · latent, k_norm_w)) at j·m,
//! dims 64..127). Entry j of request r is written to slot `block_table[r][j / page_slots] ·
//! page_slots + j % page_slots` of both pools (the main-KV and index-K pools share the block table).

use super::device::{as_i32, cfg, check_len, launch, Device};
use crate::error::{Error, Result};
use crate::formats::{INDEX_DIM, KV_DIM, MXFP4_INDEX_BYTES, NVFP4_DS_BYTES};
use cudarc::driver::CudaSlice;

/// Layer weights of one compressor.
#[derive(Debug, Clone, Copy)]
pub struct CompressorWeights<'a> {
    /// Compression ratio m: 1 or 2.
    pub ratio: usize,
    /// `compressor.norm` weight, (512,) f32.
    pub norm_w: &'a [f32],
    /// Index-K projection `wk`, (128, 512) f32 row-major (output-major).
    pub wk: &'a [f32],
    /// `k_norm` weight, (128,) f32.
    pub k_norm_w: &'a [f32],
    /// RoPE inverse frequencies (32,) f64 ([`crate::geometry::RopeParams::inv_freqs`]).
    pub inv_freq: &'a [f64],
}

/// One call's tokens, packed request after request.
#[derive(Debug, Clone, Copy)]
pub struct CompressorBatch<'a> {
    /// kv rows (tokens, 512) f32.
    pub kv: &'a [f32],
    /// Gate scores (tokens, 512) f32 — ratio 2 only.
    pub score: Option<&'a [f32]>,
    /// Token offsets (requests + 1,) i32: request r owns rows cu_tokens[r]..cu_tokens[r+1].
    pub cu_tokens: &'a [i32],
    /// Absolute position of each request's first row (requests,) i32.
    pub start_pos: &'a [i32],
    /// Compressed-cache block table (requests, max_blocks) i32; -1 = unmapped (entry skipped).
    pub block_table: &'a [i32],
    /// Columns of `block_table`.
    pub max_blocks: usize,
    /// Records per page in both pools.
    pub page_slots: usize,
}

/// The carried half-pair of ratio-2 compressors, per request.
#[derive(Debug, Clone, PartialEq)]
pub struct CarryState {
    /// (requests, 1024) f32: the carried token's kv (512) then its score (512).
    pub kv_score: Vec<f32>,
    /// (requests,) i32: the carried token's position, -1 when nothing is carried.
    pub pos: Vec<i32>,
}

impl CarryState {
    /// Empty state for `requests` requests.
    pub fn new(requests: usize) -> CarryState {
        CarryState {
            kv_score: vec![0.0; requests * 2 * KV_DIM],
            pos: vec![-1; requests],
        }
    }
}

/// The compressor's checked geometry.
struct Plan {
    requests: usize,
    max_entries: usize,
}

fn plan(w: &CompressorWeights, b: &CompressorBatch, state: Option<&CarryState>) -> Result<Plan> {
    if w.ratio != 1 && w.ratio != 2 {
        return Err(Error::invalid(
            "ratio",
            format!("{} (the compressor kernel supports 1 and 2)", w.ratio),
        ));
    }
    check_len("compressor norm_w", w.norm_w.len(), KV_DIM)?;
    check_len("compressor wk", w.wk.len(), INDEX_DIM * KV_DIM)?;
    check_len("compressor k_norm_w", w.k_norm_w.len(), INDEX_DIM)?;
    check_len("rope inv_freq", w.inv_freq.len(), 32)?;
    if b.cu_tokens.is_empty() || b.cu_tokens[0] != 0 {
        return Err(Error::invalid("cu_tokens", "must start with 0"));
    }
    let requests = b.cu_tokens.len() - 1;
    check_len("start_pos", b.start_pos.len(), requests)?;
    check_len("block_table", b.block_table.len(), requests * b.max_blocks)?;
    if b.page_slots == 0 {
        return Err(Error::invalid("page_slots", "must be at least 1"));
    }
    let tokens = *b.cu_tokens.last().unwrap();
    if b.cu_tokens.windows(2).any(|p| p[1] < p[0]) {
        return Err(Error::invalid("cu_tokens", "must be non-decreasing"));
    }
    check_len("kv values", b.kv.len(), tokens as usize * KV_DIM)?;
    match (w.ratio, b.score) {
        (2, Some(s)) => check_len("score values", s.len(), b.kv.len())?,
        (2, None) => return Err(Error::invalid("score", "ratio 2 needs gate scores")),
        _ => {}
    }
    let mut max_entries = 0usize;
    for r in 0..requests {
        let s = b.start_pos[r] as i64;
        let len = (b.cu_tokens[r + 1] - b.cu_tokens[r]) as i64;
        if s < 0 {
            return Err(Error::invalid(
                "start_pos",
                format!("request {r}: {s} is negative"),
            ));
        }
        let m = w.ratio as i64;
        max_entries = max_entries.max(((s + len) / m - s / m) as usize);
        if w.ratio == 2 && len > 0 && s % 2 == 1 {
            let st = state.ok_or_else(|| Error::invalid("state", "ratio 2 needs a carry state"))?;
            if st.pos[r] != (s - 1) as i32 {
                return Err(Error::invalid(
                    "state",
                    format!(
                        "request {r} starts at odd position {s} but carries position {} (expected {})",
                        st.pos[r],
                        s - 1
                    ),
                ));
            }
        }
    }
    if let Some(st) = state {
        check_len("state kv_score", st.kv_score.len(), requests * 2 * KV_DIM)?;
        check_len("state pos", st.pos.len(), requests)?;
    }
    Ok(Plan {
        requests,
        max_entries,
    })
}

/// Device buffers of a compressor call (see [`CompressorBatch`] for shapes).
#[derive(Debug)]
pub struct CompressorDevBatch<'a> {
    /// (tokens, 512) f32.
    pub kv: &'a CudaSlice<f32>,
    /// (tokens, 512) f32; for ratio 1 any buffer (unused).
    pub score: &'a CudaSlice<f32>,
    /// (requests + 1,) i32.
    pub cu_tokens: &'a CudaSlice<i32>,
    /// (requests,) i32.
    pub start_pos: &'a CudaSlice<i32>,
    /// (requests, max_blocks) i32.
    pub block_table: &'a CudaSlice<i32>,
    /// Columns of the block table.
    pub max_blocks: usize,
    /// Records per page.
    pub page_slots: usize,
    /// Requests in the batch.
    pub requests: usize,
    /// Most entries any request completes in this call (grid width).
    pub max_entries: usize,
}

/// Device weights of a compressor (see [`CompressorWeights`]).
#[derive(Debug)]
pub struct CompressorDevWeights<'a> {
    /// 1 or 2.
    pub ratio: usize,
    /// (512,) f32.
    pub norm_w: &'a CudaSlice<f32>,
    /// (128, 512) f32.
    pub wk: &'a CudaSlice<f32>,
    /// (128,) f32.
    pub k_norm_w: &'a CudaSlice<f32>,
    /// (32,) f64.
    pub inv_freq: &'a CudaSlice<f64>,
}

impl Device {
    /// Runs the compressor over a batch, writing main-KV records into `main_pages` (NVFP4-DS) and
    /// index-K records into `index_pages` (MXFP4), and updating the ratio-2 carry `state`.
    ///
    /// Errors: [`Error::Invalid`] / [`Error::Shape`] for inconsistent inputs (including a request that
    /// starts at an odd position without carrying the previous token), [`Error::Cuda`].
    pub fn compress(
        &self,
        w: &CompressorWeights,
        b: &CompressorBatch,
        state: &mut CarryState,
        main_pages: &mut [u8],
        index_pages: &mut [u8],
    ) -> Result<()> {
        let p = plan(w, b, Some(state))?;
        let main_page = b.page_slots * NVFP4_DS_BYTES;
        let index_page = b.page_slots * MXFP4_INDEX_BYTES;
        if !main_pages.len().is_multiple_of(main_page)
            || !index_pages.len().is_multiple_of(index_page)
        {
            return Err(Error::shape(
                "main / index page pools",
                format!("multiples of {main_page} / {index_page} bytes"),
                format!("{} / {}", main_pages.len(), index_pages.len()),
            ));
        }
        let pages = (main_pages.len() / main_page).min(index_pages.len() / index_page);
        if let Some(&bad) = b
            .block_table
            .iter()
            .find(|&&x| x < -1 || x as i64 >= pages as i64)
        {
            return Err(Error::invalid(
                "block_table",
                format!("block {bad} is outside the {pages} pages of the pools"),
            ));
        }
        let dkv = self.upload(b.kv)?;
        let dscore = self.upload(b.score.unwrap_or(&[]))?;
        let dcu = self.upload(b.cu_tokens)?;
        let dstart = self.upload(b.start_pos)?;
        let dbt = self.upload(b.block_table)?;
        let dnorm = self.upload(w.norm_w)?;
        let dwk = self.upload(w.wk)?;
        let dkn = self.upload(w.k_norm_w)?;
        let dfreq = self.upload(w.inv_freq)?;
        let dstate_in = self.upload(&state.kv_score)?;
        let dpos_in = self.upload(&state.pos)?;
        let mut dstate_out = self.zeros::<f32>(state.kv_score.len())?;
        let mut dpos_out = self.upload(&state.pos)?;
        let mut dmain = self.upload(main_pages)?;
        let mut dindex = self.upload(index_pages)?;
        self.compress_dev(
            &CompressorDevWeights {
                ratio: w.ratio,
                norm_w: &dnorm,
                wk: &dwk,
                k_norm_w: &dkn,
                inv_freq: &dfreq,
            },
            &CompressorDevBatch {
                kv: &dkv,
                score: &dscore,
                cu_tokens: &dcu,
                start_pos: &dstart,
                block_table: &dbt,
                max_blocks: b.max_blocks,
                page_slots: b.page_slots,
                requests: p.requests,
                max_entries: p.max_entries,
            },
            (&dstate_in, &dpos_in),
            (&mut dstate_out, &mut dpos_out),
            &mut dmain,
            &mut dindex,
        )?;
        main_pages.copy_from_slice(&self.download(&dmain)?);
        index_pages.copy_from_slice(&self.download(&dindex)?);
        if w.ratio == 2 {
            let mut s = self.download(&dstate_out)?;
            s.truncate(state.kv_score.len());
            state.kv_score = s;
            let mut ps = self.download(&dpos_out)?;
            ps.truncate(state.pos.len());
            state.pos = ps;
        }
        Ok(())
    }

    /// Device form of [`Device::compress`]. `state_in` / `state_out` ((requests, 1024) f32 and
    /// (requests,) i32 each) must be distinct buffers; for ratio 1 they are not touched. The caller
    /// guarantees the block table stays inside the pools and the carried positions match.
    pub fn compress_dev(
        &self,
        w: &CompressorDevWeights,
        b: &CompressorDevBatch,
        state_in: (&CudaSlice<f32>, &CudaSlice<i32>),
        state_out: (&mut CudaSlice<f32>, &mut CudaSlice<i32>),
        main_pages: &mut CudaSlice<u8>,
        index_pages: &mut CudaSlice<u8>,
    ) -> Result<()> {
        if b.requests == 0 {
            return Ok(());
        }
        let ratio = as_i32("ratio", w.ratio)?;
        let mb = as_i32("max_blocks", b.max_blocks)?;
        let ps = as_i32("page_slots", b.page_slots)?;
        let grid = (
            as_i32("entries", b.max_entries + 1)? as u32,
            as_i32("requests", b.requests)? as u32,
        );
        let (st_out, pos_out) = state_out;
        // compressor_f32(kv, score, cu_tokens, start_pos, state_in, state_pos_in, state_out,
        //   state_pos_out, norm_w, wk, k_norm_w, inv_freq, block_table, max_blocks, page_slots,
        //   main_pages, index_pages, ratio)
        launch!(
            self,
            "compressor",
            "compressor_f32",
            cfg(grid, 128),
            b.kv,
            b.score,
            b.cu_tokens,
            b.start_pos,
            state_in.0,
            state_in.1,
            st_out,
            pos_out,
            w.norm_w,
            w.wk,
            w.k_norm_w,
            w.inv_freq,
            b.block_table,
            &mb,
            &ps,
            main_pages,
            index_pages,
            &ratio,
        );
        Ok(())
    }
}
