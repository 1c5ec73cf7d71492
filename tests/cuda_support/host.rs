//! Host staging for the CUDA checks: validate a host description with the op's own signature,
//! upload, run the library's one launch per kernel, download. Also the host page pool the checks
//! fill with the CPU codecs, and the attention reference adapter (paged pools → the rows of
//! `csa2::ops::attention::reference`).
#![allow(dead_code)]

use csa2::cuda::attention::TablePages;
use csa2::cuda::CudaDevice;
use csa2::error::{Error, Result};
use csa2::formats::page::{block_table_slot, PageLayout};
use csa2::formats::RecordFormat;
use csa2::ops::candidates::CandidateParams;
use csa2::ops::compressor::{CarryState, Compressor, CompressorBatch};
use csa2::ops::indexer::{IndexCache, IndexerParams, IndexerQueries};
use csa2::ops::mhc::{MhcParams, MixWeights, HC};
use half::bf16;

/// A paged pool on the host: bytes plus layout.
#[derive(Clone, Debug)]
pub struct Pool {
    pub layout: PageLayout,
    pub bytes: Vec<u8>,
}

impl Pool {
    pub fn new(format: RecordFormat, slots: usize, pages: usize) -> Pool {
        let layout = PageLayout { format, slots };
        Pool {
            layout,
            bytes: vec![0u8; layout.page_bytes() * pages],
        }
    }
    /// Writes a row at a global slot (page · slots + offset) with the CPU codec.
    pub fn write_slot(&mut self, slot: usize, row: &[f32]) {
        self.layout
            .encode_into_pages(row, &[slot as i64], &mut self.bytes)
            .unwrap();
    }
    /// Decodes the row at a global slot with the CPU codec.
    pub fn read_slot(&self, slot: usize) -> Vec<f32> {
        let mut out = vec![0f32; self.layout.format.dim()];
        self.layout
            .decode_from_pages(&self.bytes, &[slot as i64], &mut out)
            .unwrap();
        out
    }
}

/// Slot of logical row j through a block-table row (the library's addressing rule).
pub fn table_slot(bt_row: &[i32], j: i64, page_slots: usize) -> Option<usize> {
    block_table_slot(bt_row, j, page_slots)
}

fn take<T: Clone>(mut v: Vec<T>, n: usize) -> Vec<T> {
    v.truncate(n);
    v
}

/// Encodes `x` (rows, dim) into the records at `slot_mapping` of `pages`, in place.
pub fn encode_pages(
    dev: &CudaDevice,
    fmt: RecordFormat,
    x: &[f32],
    slot_mapping: &[i64],
    pages: &mut [u8],
    page_slots: usize,
) -> Result<()> {
    let layout = PageLayout {
        format: fmt,
        slots: page_slots,
    };
    if !csa2::formats::cuda::has_kernel(fmt) {
        return Err(Error::Unsupported(format!(
            "no CUDA kernel for {}",
            fmt.name()
        )));
    }
    if page_slots == 0 {
        return Err(Error::invalid("page_slots", "must be at least 1"));
    }
    layout.check_slot_mapping(slot_mapping, pages.len())?;
    if x.len() != slot_mapping.len() * fmt.dim() {
        return Err(Error::shape(
            "input values",
            slot_mapping.len() * fmt.dim(),
            x.len(),
        ));
    }
    let dx = dev.upload(x)?;
    let ds = dev.upload(slot_mapping)?;
    let mut dp = dev.upload(pages)?;
    csa2::formats::cuda::encode_into_pages(dev, &layout, &dx, &ds, &mut dp, slot_mapping.len())?;
    pages.copy_from_slice(&take(dev.download(&dp)?, pages.len()));
    Ok(())
}

/// Gather-decodes the records at `slot_mapping` into (rows, dim) f32.
pub fn decode_pages(
    dev: &CudaDevice,
    fmt: RecordFormat,
    pages: &[u8],
    slot_mapping: &[i64],
    page_slots: usize,
) -> Result<Vec<f32>> {
    let layout = PageLayout {
        format: fmt,
        slots: page_slots,
    };
    layout.check_slot_mapping(slot_mapping, pages.len())?;
    let dp = dev.upload(pages)?;
    let ds = dev.upload(slot_mapping)?;
    let n = slot_mapping.len() * fmt.dim();
    let mut out = dev.zeros::<f32>(n)?;
    csa2::formats::cuda::decode_from_pages(dev, &layout, &dp, &ds, &mut out, slot_mapping.len())?;
    Ok(take(dev.download(&out)?, n))
}

/// The batched compressor: checks `b` with [`CompressorBatch::plan`], runs the kernel, updates
/// `state` (ratio 2) and the pools.
pub fn compress(
    dev: &CudaDevice,
    c: &Compressor,
    b: &CompressorBatch,
    state: &mut CarryState,
    main_pages: &mut [u8],
    index_pages: &mut [u8],
) -> Result<()> {
    use csa2::ops::compressor::cuda::{self, DeviceBatch};
    let plan = b.plan(c.ratio(), Some(state), main_pages.len(), index_pages.len())?;
    let w = c.weights();
    let (dkv, dscore) = (dev.upload(b.kv)?, dev.upload(b.score.unwrap_or(&[]))?);
    let (dcu, dstart, dbt) = (
        dev.upload(b.cu_tokens)?,
        dev.upload(b.start_pos)?,
        dev.upload(b.block_table)?,
    );
    let (dnorm, dwk, dkn) = (
        dev.upload(w.norm)?,
        dev.upload(w.wk)?,
        dev.upload(w.k_norm)?,
    );
    let dfreq = dev.upload(c.rope().inv_freqs())?;
    let (dstate_in, dpos_in) = (dev.upload(&state.kv_score)?, dev.upload(&state.pos)?);
    let mut dstate_out = dev.zeros::<f32>(state.kv_score.len())?;
    let mut dpos_out = dev.upload(&state.pos)?;
    let mut dmain = dev.upload(main_pages)?;
    let mut dindex = dev.upload(index_pages)?;
    cuda::compress(
        dev,
        c,
        &plan,
        &DeviceBatch {
            kv: &dkv,
            score: &dscore,
            cu_tokens: &dcu,
            start_pos: &dstart,
            block_table: &dbt,
            max_blocks: b.max_blocks,
            page_slots: b.page_slots,
            norm: &dnorm,
            wk: &dwk,
            k_norm: &dkn,
            inv_freq: &dfreq,
        },
        (&dstate_in, &dpos_in),
        (&mut dstate_out, &mut dpos_out),
        &mut dmain,
        &mut dindex,
    )?;
    main_pages.copy_from_slice(&take(dev.download(&dmain)?, main_pages.len()));
    index_pages.copy_from_slice(&take(dev.download(&dindex)?, index_pages.len()));
    if c.ratio() == 2 {
        state.kv_score = take(dev.download(&dstate_out)?, state.kv_score.len());
        state.pos = take(dev.download(&dpos_out)?, state.pos.len());
    }
    Ok(())
}

/// Indexer logits (T, n_cols) of query rows `qs` of requests `req` over the paged `cache`.
pub fn indexer_logits(
    dev: &CudaDevice,
    p: &IndexerParams,
    qs: &IndexerQueries,
    req: &[i32],
    cache: &IndexCache,
    cand_mask: Option<(&[u8], usize)>,
    n_cols: usize,
) -> Result<Vec<f32>> {
    use csa2::ops::indexer::cuda::{self, DeviceIndexCache, DeviceQueries};
    cache.check()?;
    let t = qs.positions.len();
    if req.len() != t || req.iter().any(|&r| r < 0 || r as usize >= cache.requests()) {
        return Err(Error::invalid(
            "req",
            "one request (a block-table row) per query row",
        ));
    }
    let pos: Vec<i32> = qs
        .positions
        .iter()
        .map(|&p| i32::try_from(p).map_err(|_| Error::invalid("positions", "0..2^31")))
        .collect::<Result<_>>()?;
    if pos.iter().any(|&p| p < 0) {
        return Err(Error::invalid("positions", "must be non-negative"));
    }
    let mask = cand_mask
        .map(|(m, s)| dev.upload(m).map(|d| (d, s)))
        .transpose()?;
    let (dq, dw, dpos, dreq) = (
        dev.upload(qs.q)?,
        dev.upload(qs.w)?,
        dev.upload(&pos)?,
        dev.upload(req)?,
    );
    let (dbt, dpages) = (dev.upload(cache.block_table)?, dev.upload(cache.pages)?);
    let mut out = dev.zeros::<f32>(t * n_cols)?;
    cuda::logits(
        dev,
        p,
        &DeviceQueries {
            q: &dq,
            w: &dw,
            pos: &dpos,
            req: &dreq,
            rows: t,
        },
        &DeviceIndexCache {
            pages: &dpages,
            block_table: &dbt,
            max_blocks: cache.max_blocks,
            page_slots: cache.page_slots,
        },
        mask.as_ref().map(|(m, s)| (m, *s)),
        &mut out,
        n_cols,
    )?;
    Ok(take(dev.download(&out)?, t * n_cols))
}

/// Top-k (rows, k) in ascending index order.
pub fn topk(
    dev: &CudaDevice,
    keys: &[f32],
    n_cols: usize,
    n_valid: &[i32],
    k: usize,
) -> Result<Vec<i32>> {
    let t = n_valid.len();
    if keys.len() != t * n_cols {
        return Err(Error::shape("top-k keys", t * n_cols, keys.len()));
    }
    let (dk, dn) = (dev.upload(keys)?, dev.upload(n_valid)?);
    let mut out = dev.zeros::<i32>(t * k)?;
    csa2::ops::topk::cuda::select_rows(dev, &dk, n_cols, &dn, k, &mut out, t)?;
    Ok(take(dev.download(&out)?, t * k))
}

/// The candidate pool mask (rows, ceil(n_cols / 8)) and its stride.
pub fn candidate_mask(
    dev: &CudaDevice,
    logits: &[f32],
    n_cols: usize,
    n_valid: &[i32],
) -> Result<(Vec<u8>, usize)> {
    let t = n_valid.len();
    if logits.len() != t * n_cols {
        return Err(Error::shape("candidate logits", t * n_cols, logits.len()));
    }
    let nb = n_cols.div_ceil(8);
    let (dl, dn) = (dev.upload(logits)?, dev.upload(n_valid)?);
    let mut mask = dev.zeros::<u8>(t * nb)?;
    let p = CandidateParams::default();
    csa2::ops::candidates::cuda::pool_mask(dev, &p, &dl, n_cols, &dn, &mut mask, t)?;
    Ok((take(dev.download(&mask)?, t * nb), nb))
}

/// Outputs of one mHC boundary.
#[derive(Debug, Clone, PartialEq)]
pub struct MhcOutputs {
    pub x: Vec<bf16>,
    pub pre: Vec<f32>,
    pub post: Vec<f32>,
    pub comb: Vec<f32>,
    pub x_in: Vec<bf16>,
}

/// One Mega-mHC boundary over bf16 streams `x` (T, 4, d) with optional post update
/// (y (T, d) bf16, post_prev, comb_prev), carried `pre_prev`, the new site's weights `w` and `norm`.
#[allow(clippy::too_many_arguments)]
pub fn mega_mhc(
    dev: &CudaDevice,
    p: &MhcParams,
    w: &MixWeights,
    norm: &[f32],
    x: &[bf16],
    y: Option<&[bf16]>,
    post_prev: &[f32],
    comb_prev: &[f32],
    pre_prev: &[f32],
) -> Result<MhcOutputs> {
    use csa2::ops::mhc::cuda::{self, DeviceBoundaryIn, DeviceBoundaryOut};
    let d = p.hidden;
    let t = pre_prev.len() / HC;
    w.validate(p)?;
    if x.len() != t * HC * d || norm.len() != d {
        return Err(Error::shape("mHC x / norm", t * HC * d, x.len()));
    }
    let dx = dev.upload(x)?;
    let dy = y.map(|y| dev.upload(y)).transpose()?;
    let (dpp, dcp, dpc) = (
        dev.upload(post_prev)?,
        dev.upload(comb_prev)?,
        dev.upload(pre_prev)?,
    );
    let (dfn, dbase, dscale, dnorm) = (
        dev.upload(w.hc_fn)?,
        dev.upload(w.base)?,
        dev.upload(w.scale)?,
        dev.upload(norm)?,
    );
    let mut xo = dev.zeros::<bf16>(t * HC * d)?;
    let mut xin = dev.zeros::<bf16>(t * d)?;
    let mut pre = dev.zeros::<f32>(t * HC)?;
    let mut post = dev.zeros::<f32>(t * HC)?;
    let mut comb = dev.zeros::<f32>(t * HC * HC)?;
    cuda::boundary(
        dev,
        p,
        &DeviceBoundaryIn {
            x: &dx,
            y: dy.as_ref(),
            post_prev: &dpp,
            comb_prev: &dcp,
            pre_prev: &dpc,
            hc_fn: &dfn,
            base: &dbase,
            scale: &dscale,
            norm: &dnorm,
            tokens: t,
        },
        DeviceBoundaryOut {
            x_new: &mut xo,
            layer_in: &mut xin,
            pre: &mut pre,
            post: &mut post,
            comb: &mut comb,
        },
    )?;
    Ok(MhcOutputs {
        x: if y.is_some() {
            take(dev.download(&xo)?, t * HC * d)
        } else {
            x.to_vec()
        },
        pre: take(dev.download(&pre)?, t * HC),
        post: take(dev.download(&post)?, t * HC),
        comb: take(dev.download(&comb)?, t * HC * HC),
        x_in: take(dev.download(&xin)?, t * d),
    })
}

/// Sparse decode attention reference (out (T, 64, 512), lse (T, 64)) in f64 over paged pools: each
/// row's main-KV entries (top-k, mapped) and SWA window [max(p − 127, 0, window_start), p] are
/// decoded with the CPU codecs and handed to `csa2::ops::attention::reference::attention_rows`;
/// the rope dims of the output are then rotated back (inverse RoPE at p) when `rope` is given.
#[allow(clippy::too_many_arguments)]
pub fn attention_ref(
    q: &[f32],
    topk: &[i32],
    topk_len: usize,
    pos: &[i32],
    req: &[i32],
    window_start: &[i32],
    main: (&PageLayout, &TablePages),
    swa: (&PageLayout, &TablePages),
    sink: Option<&[f32]>,
    rope: Option<&csa2::ops::rope::Rope>,
    scale: f32,
) -> (Vec<f64>, Vec<f64>) {
    use csa2::ops::attention::{reference::attention_rows, AttentionParams, KvRows, TokenRows};
    use csa2::ops::rope::{reference::rotate_f64, Direction};
    let (heads, kv) = (64usize, 512usize);
    let t = pos.len();
    let mut main_rows = vec![];
    let mut swa_rows = vec![];
    let mut rows = Vec::with_capacity(t);
    let decode = |(l, c): (&PageLayout, &TablePages), r: usize, j: i64, into: &mut Vec<f32>| {
        let max_blocks = c.block_table.shape()[1];
        let bt = c.block_table.as_slice::<i32>("block_table").unwrap();
        let pages = c.pages.as_slice::<u8>("pages").unwrap();
        let bt = &bt[r * max_blocks..(r + 1) * max_blocks];
        block_table_slot(bt, j, c.page_slots).map(|s| {
            let mut row = vec![0f32; kv];
            l.decode_from_pages(pages, &[s as i64], &mut row).unwrap();
            into.extend(row);
        })
    };
    for row in 0..t {
        let r = req[row] as usize;
        let p = pos[row] as i64;
        let mut tr = TokenRows {
            main: vec![],
            swa: vec![],
        };
        for i in 0..topk_len {
            let j = topk[row * topk_len + i];
            if decode(main, r, j as i64, &mut main_rows).is_some() {
                tr.main.push(main_rows.len() / kv - 1);
            }
        }
        let lo = (p - 127).max(0).max(window_start[row] as i64);
        for qp in lo..=p {
            if decode(swa, r, qp, &mut swa_rows).is_some() {
                tr.swa.push(swa_rows.len() / kv - 1);
            }
        }
        rows.push(tr);
    }
    let params = AttentionParams {
        scale,
        ..AttentionParams::default()
    };
    let sinks = sink.map_or(vec![f32::NEG_INFINITY; heads], |s| s.to_vec());
    let (mut out, lse) = attention_rows(
        &params,
        q,
        &sinks,
        &rows,
        KvRows::F32(&main_rows),
        KvRows::F32(&swa_rows),
    );
    if let Some(rope) = rope {
        for (row, o) in out.chunks_mut(heads * kv).enumerate() {
            for h in o.chunks_mut(kv) {
                rotate_f64(
                    rope,
                    &mut h[kv - rope.rope_dim()..],
                    pos[row] as u64,
                    Direction::Inverse,
                );
            }
        }
    }
    (out, lse)
}
