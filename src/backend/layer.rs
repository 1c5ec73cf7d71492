//! The attention sublayer of one layer in its CSA2 role (docs/SPEC.md §0 table, §2), over the rows of a
//! step, with the per-step buffers the roles share.
//!
//! Every role: `qr = RMSNorm(wq_a·u)`, `q = RoPE(wq_b·qr)` (64 heads × 512), `kv = RoPE(RMSNorm(wkv·u))`
//! written to the layer's own SWA window; then
//! - **Full**: the compressor turns `compressor.wkv·u` (and `wgate·u` at ratio 2) into entries whose
//!   main KV and index K the cache encodes; the indexer scores every visible entry and publishes a
//!   top-k (the candidate source also publishes the candidate pool);
//! - **Reindex**: own indexer Q and head weights over the KV source's index K, scored only inside the
//!   candidate pool (launch day: dense logits over every visible entry, then masked to the pool);
//!   publishes its own top-k;
//! - **Reuse**: the latest top-k of its index source;
//! - **SWA-only**: the window alone.
//!
//! Attention runs over the selected main-KV entries of the KV source ∪ the window, then inverse RoPE
//! and the grouped output projection (`o_groups` groups of `heads/o_groups` heads →
//! `o_lora_rank` each, then → hidden).

use super::cache::KvCache;
use super::gemm::linear_w;
use super::timing::{Op, Timings};
use super::BackendConfig;
use crate::cache::RecordKind;
use crate::error::{Error, Result};
use crate::formats::{RecordFormat, INDEX_DIM, KV_DIM};
use crate::geometry::{CandidateUse, Geometry, LayerPlan, Role};
use crate::ops::attention::{
    attention_with_dots, AttentionDots, AttentionInputs, AttentionParams, KvRows,
};
use crate::ops::candidates::{mask_outside, select_blocks_rows, CandidateParams};
use crate::ops::compressor::{cpu::rms_norm, Compressor, CompressorState, PooledWeights};
use crate::ops::indexer::{
    logits, logits_in_blocks, visible, IndexKeys, IndexerParams, IndexerQueries,
};
use crate::ops::rope::{Direction, Rope};
use crate::ops::topk::select_rows;
use crate::replay::{RowSet, StepPlan};
use crate::weights::LayerWeights;
use rayon::prelude::*;
use std::collections::HashMap;

/// Per-step buffers shared by the layers of one step: the latest top-k of every index source and
/// the candidate pool of the candidate source, for the rows they were computed on.
#[derive(Debug, Default)]
pub struct StepBuffers {
    /// index-source layer → (the layer whose rows it was computed on, top-k `[rows, k]`).
    pub topk: HashMap<usize, (usize, Vec<i32>)>,
    /// The candidate pool `[rows, num_blocks]` (block ids, −1 padded) and the layer whose rows it
    /// was computed on; `None` while no row has more visible entries than the pool holds (no-op,
    /// docs/SPEC.md §2).
    pub pool: Option<(usize, Vec<i32>)>,
    /// Main KV of (request, KV source, entries) decoded once per step for prefill spans, shared by
    /// the Reuse layers of that source (a prefill row set reads most entries many times over).
    pub decoded_main: HashMap<(u64, usize, usize), std::sync::Arc<Vec<f32>>>,
}

impl StepBuffers {
    fn rows_of(
        &self,
        data: &[i32],
        src: usize,
        dst: usize,
        width: usize,
        plan: &StepPlan,
    ) -> Vec<i32> {
        // Published on more rows than the reader runs (after the decoder cut, or a step higher on
        // the exact-replay staircase): select the reader's rows.
        match plan.select_between(src, dst) {
            None => data.to_vec(),
            Some(idx) => idx
                .iter()
                .flat_map(|&i| data[i * width..(i + 1) * width].iter().copied())
                .collect(),
        }
    }
}

fn rms_rows(x: &mut [f32], w: &[f32], eps: f64) {
    let d = w.len();
    x.par_chunks_mut(d).for_each(|r| {
        let src = r.to_vec();
        rms_norm(&src, w, eps, r);
    });
}

fn rows_of_span<'a, T>(x: &'a [T], width: usize, r: &std::ops::Range<usize>) -> &'a [T] {
    &x[r.start * width..r.end * width]
}

/// The attention sublayer of layer `l` in its role.
///
/// `u_all` is the layer input `[plan.all rows, d]` when `l` is the cut layer (its compressor sees
/// every row), else `None`; `u` is the input of the rows the layer runs on (`plan.rows_for(l)`).
/// Returns `y [rows, d]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_sublayer(
    g: &Geometry,
    cfg: &BackendConfig,
    w: &LayerWeights,
    plan: &StepPlan,
    l: usize,
    u_all: Option<&[f32]>,
    u: &[f32],
    cache: &mut dyn KvCache,
    bufs: &mut StepBuffers,
    tm: &mut Timings,
) -> Result<Vec<f32>> {
    let lp: &LayerPlan = &g.layers[l];
    let role = lp.role;
    let rows = plan.rows_for(l);
    let r = rows.len();
    let d = g.hidden_size;
    let (h, hd) = (g.num_heads, g.head_dim);
    let eps = g.rms_norm_eps;
    if u.len() != r * d {
        return Err(Error::shape(
            format!("layer {l} input"),
            format!("[{r}, {d}]"),
            u.len(),
        ));
    }
    let a = &w.attn;
    let rope = Rope::for_layer(lp);

    // ---- Q and the window KV -----------------------------------------------------------------
    let (qr, q, kv) = tm.time(role, Op::Projections, || -> Result<_> {
        let mut qr = vec![0f32; r * g.q_lora_rank];
        linear_w("wq_a", u, r, a.wq_a.view(), g.q_lora_rank, &mut qr)?;
        rms_rows(&mut qr, &a.q_norm, eps);
        let mut q = vec![0f32; r * h * hd];
        linear_w("wq_b", &qr, r, a.wq_b.view(), h * hd, &mut q)?;
        let mut kv = vec![0f32; r * KV_DIM];
        linear_w("wkv", u, r, a.wkv.view(), KV_DIM, &mut kv)?;
        rms_rows(&mut kv, &a.kv_norm, eps);
        Ok((qr, q, kv))
    })?;
    let (q, kv) = tm.time(role, Op::Rope, || -> Result<_> {
        let (mut q, mut kv) = (q, kv);
        rope.apply(&mut q, h, hd, &rows.pos, Direction::Forward)?;
        rope.apply(&mut kv, 1, KV_DIM, &rows.pos, Direction::Forward)?;
        Ok((q, kv))
    })?;

    // Windows per request: decoded older rows from the cache, then this step's rows quantized
    // and dequantized exactly as the cache will return them. Built before this step's rows are
    // written, since the ring only keeps `window` positions.
    let swa_fmt = cache.formats().swa;
    let windows = tm.time(role, Op::Codecs, || -> Result<Vec<Window>> {
        let mut out = Vec::with_capacity(rows.spans.len());
        for (si, span) in &rows.spans {
            let s = &plan.seqs[*si];
            let first = rows.pos[span.start] as usize;
            let lo_want = span
                .clone()
                .map(|i| {
                    (rows.pos[i] as usize + 1)
                        .saturating_sub(g.window)
                        .max(rows.floor[i])
                })
                .min()
                .unwrap_or(first);
            let held = if cache.contains(s.req) {
                cache.swa_held(s.req, l)?
            } else {
                0..0
            };
            // Older rows exist only where the window held them contiguously up to this step.
            let base = if lo_want < first && held.end == first {
                lo_want.max(held.start)
            } else {
                first
            };
            let mut buf = vec![0f32; (first - base + span.len()) * KV_DIM];
            cache.swa_read(s.req, l, base..first, &mut buf[..(first - base) * KV_DIM])?;
            qdq_rows(
                swa_fmt,
                rows_of_span(&kv, KV_DIM, span),
                &mut buf[(first - base) * KV_DIM..],
            )?;
            out.push(Window { base, rows: buf });
        }
        Ok(out)
    })?;
    tm.time(role, Op::Codecs, || -> Result<()> {
        for (si, span) in &rows.spans {
            let s = &plan.seqs[*si];
            cache.swa_write(
                s.req,
                l,
                rows.pos[span.start] as usize,
                rows_of_span(&kv, KV_DIM, span),
            )?;
        }
        Ok(())
    })?;

    // ---- role work: compressor, indexer, selection ---------------------------------------------
    if role == Role::Full {
        let (crow, cu) = match u_all {
            Some(ua) => (&plan.all, ua),
            None => (rows, u),
        };
        compress_and_store(g, cfg, w, plan, l, crow, cu, cache, tm)?;
    }
    let k = g.index_topk;
    let topk: Vec<i32> = match role {
        Role::SwaOnly => vec![],
        Role::Full | Role::Reindex => {
            let sel = index_and_select(g, cfg, w, plan, l, rows, u, &qr, cache, bufs, tm)?;
            bufs.topk.insert(l, (l, sel.clone()));
            sel
        }
        Role::Reuse => {
            let src = lp
                .index_source
                .ok_or_else(|| Error::Internal(format!("reuse layer {l} has no index source")))?;
            let (src_rows, t) = bufs.topk.get(&src).ok_or_else(|| {
                Error::Internal(format!(
                    "layer {l} reads the top-k of layer {src}, which has not run in this step"
                ))
            })?;
            bufs.rows_of(t, *src_rows, l, k, plan)
        }
    };

    // ---- attention --------------------------------------------------------------------------
    let mut o = vec![0f32; r * h * hd];
    tm.time(role, Op::Attention, || -> Result<()> {
        let params = AttentionParams {
            heads: h,
            window: g.window,
            scale: (hd as f32).sqrt().recip(),
            ratio: None,
        };
        let main_fmt = cache.formats().main;
        let dots = AttentionDots::backend_default();
        for ((si, span), win) in rows.spans.iter().zip(&windows) {
            let s = &plan.seqs[*si];
            let (topk_rows, main_bytes) = match lp.kv_source {
                Some(src) => {
                    let n = cache.entries(s.req, src)?;
                    (
                        &topk[span.start * k..span.end * k],
                        cache.records(s.req, src, RecordKind::Main, 0..n)?,
                    )
                }
                None => (&[][..], std::borrow::Cow::Borrowed(&[][..])),
            };
            // Many rows selecting from few entries (prefill): decode every entry once per step
            // instead of once per row; one decode row reads its ≤ k records directly. Not where
            // the kernel scores the records themselves (int16 on NVFP4): there the choice, which
            // depends on the rows in this step, would change the scores of the rows.
            let n = main_bytes.len() / main_fmt.record_bytes();
            let dense = lp
                .kv_source
                .filter(|_| n > 0 && n < span.len() * k && !dots.reads_records(main_fmt));
            let decoded = match dense {
                Some(src) => Some(match bufs.decoded_main.get(&(s.req, src, n)) {
                    Some(v) => v.clone(),
                    None => {
                        let mut v = vec![0f32; n * KV_DIM];
                        crate::formats::decode_rows(main_fmt, &main_bytes, &mut v)?;
                        let v = std::sync::Arc::new(v);
                        bufs.decoded_main.insert((s.req, src, n), v.clone());
                        v
                    }
                }),
                None => None,
            };
            let main_rows = match &decoded {
                Some(v) => KvRows::F32(v),
                None => KvRows::Records(main_fmt, &main_bytes),
            };
            // Window positions relative to the window buffer (RoPE is already applied).
            let pos: Vec<i64> = span
                .clone()
                .map(|i| rows.pos[i] - win.base as i64)
                .collect();
            let floor: Vec<i64> = span
                .clone()
                .map(|i| rows.floor[i].max(win.base) as i64 - win.base as i64)
                .collect();
            let mut lse = vec![0f32; span.len() * h];
            attention_with_dots(
                &params,
                dots,
                &AttentionInputs {
                    q: rows_of_span(&q, h * hd, span),
                    topk: topk_rows,
                    topk_len: None,
                    positions: &pos,
                    replay_start: &floor,
                    sink: &a.attn_sink,
                },
                main_rows,
                KvRows::F32(&win.rows),
                &mut o[span.start * h * hd..span.end * h * hd],
                &mut lse,
            )?;
        }
        Ok(())
    })?;
    tm.time(role, Op::Rope, || {
        rope.apply(&mut o, h, hd, &rows.pos, Direction::Inverse)
    })?;

    // ---- grouped output projection ------------------------------------------------------------
    tm.time(role, Op::Projections, || -> Result<Vec<f32>> {
        let (grp, lr) = (g.o_groups, g.o_lora_rank);
        let gw = h / grp * hd;
        let mut z = vec![0f32; r * grp * lr];
        let mut xg = vec![0f32; r * gw];
        let mut zg = vec![0f32; r * lr];
        for gi in 0..grp {
            for t in 0..r {
                xg[t * gw..(t + 1) * gw]
                    .copy_from_slice(&o[t * h * hd + gi * gw..t * h * hd + (gi + 1) * gw]);
            }
            linear_w(
                "wo_a",
                &xg,
                r,
                a.wo_a.view().row_block(gi * lr, lr)?,
                lr,
                &mut zg,
            )?;
            for t in 0..r {
                z[t * grp * lr + gi * lr..t * grp * lr + (gi + 1) * lr]
                    .copy_from_slice(&zg[t * lr..(t + 1) * lr]);
            }
        }
        let mut y = vec![0f32; r * d];
        linear_w("wo_b", &z, r, a.wo_b.view(), d, &mut y)?;
        Ok(y)
    })
}

/// A request's SWA window for one layer and step: decoded rows of positions `base ..`.
struct Window {
    base: usize,
    rows: Vec<f32>,
}

/// Quantize → dequantize rows through a record format (what the cache will hand back).
fn qdq_rows(fmt: RecordFormat, x: &[f32], out: &mut [f32]) -> Result<()> {
    let mut rec = vec![0u8; x.len() / fmt.dim() * fmt.record_bytes()];
    crate::formats::encode_rows(fmt, x, &mut rec)?;
    crate::formats::decode_rows(fmt, &rec, out)
}

/// Full layers: compressor over `crow` (all rows at the cut layer), entries into the cache.
/// Entries already stored (a prefix hit) are never rewritten (docs/SPEC.md §3).
#[allow(clippy::too_many_arguments)]
fn compress_and_store(
    g: &Geometry,
    _cfg: &BackendConfig,
    w: &LayerWeights,
    plan: &StepPlan,
    l: usize,
    crow: &RowSet,
    cu: &[f32],
    cache: &mut dyn KvCache,
    tm: &mut Timings,
) -> Result<()> {
    let lp = &g.layers[l];
    let m = lp.ratio;
    let cw = w.attn.compressor.as_ref().ok_or_else(|| {
        Error::NotFound(format!(
            "layer {l} is a Full layer but has no compressor weights"
        ))
    })?;
    let ik = w
        .attn
        .indexer
        .as_ref()
        .and_then(|i| i.k.as_ref())
        .ok_or_else(|| {
            Error::NotFound(format!(
                "layer {l} is a Full layer but has no indexer wk/k_norm"
            ))
        })?;
    let rc = crow.len();
    let (kvc, score) = tm.time(Role::Full, Op::Projections, || -> Result<_> {
        let mut kvc = vec![0f32; rc * KV_DIM];
        linear_w("compressor.wkv", cu, rc, cw.wkv.view(), KV_DIM, &mut kvc)?;
        let score = match &cw.wgate {
            Some(wg) if m > 1 => {
                let mut s = vec![0f32; rc * KV_DIM];
                linear_w("compressor.wgate", cu, rc, wg.view(), KV_DIM, &mut s)?;
                Some(s)
            }
            _ => None,
        };
        Ok((kvc, score))
    })?;
    let wk = ik.wk.f32_values();
    let comp = Compressor::new(
        m,
        g.rms_norm_eps,
        Rope::for_layer(lp),
        PooledWeights {
            norm: &cw.norm,
            wk: &wk,
            k_norm: &ik.k_norm,
        },
    )?;
    for (si, span) in &crow.spans {
        let s = &plan.seqs[*si];
        let first = crow.pos[span.start] as usize;
        // Feed from the first group not yet complete in the cache: on a replay the cached groups
        // are skipped and the half-finished one is rebuilt from its first token.
        let stored = cache.entries(s.req, l)?;
        let held = cache.carry(s.req, l)?;
        let (start, mut state) = match held {
            Some(c) if c.next_pos() as usize == first => (first, c),
            _ => {
                let st = (stored * m).max(first);
                if !st.is_multiple_of(m) || st < first {
                    return Err(Error::invalid(
                        format!("request {} layer {l}", s.req),
                        format!(
                            "rows start at {first} but the compressor needs the group starting at {} (no carry held)",
                            st / m * m
                        ),
                    ));
                }
                (st, CompressorState::new(st as u64))
            }
        };
        let skip = start - first;
        if skip >= span.len() {
            cache.set_carry(s.req, l, Some(state))?;
            continue;
        }
        let sub = span.start + skip..span.end;
        let out = tm.time(Role::Full, Op::Compressor, || {
            comp.compress(
                &mut state,
                rows_of_span(&kvc, KV_DIM, &sub),
                score.as_ref().map(|sc| rows_of_span(sc, KV_DIM, &sub)),
            )
        });
        cache.set_carry(s.req, l, Some(state))?;
        let out = out?;
        if out.count == 0 {
            continue;
        }
        // Never overwrite stored entries.
        let skip_e = stored.saturating_sub(out.first_entry).min(out.count);
        let e0 = out.first_entry + skip_e;
        tm.time(Role::Full, Op::Codecs, || -> Result<()> {
            cache.write_entries(
                s.req,
                l,
                RecordKind::Main,
                e0,
                &out.main_kv[skip_e * KV_DIM..],
            )?;
            cache.write_entries(
                s.req,
                l,
                RecordKind::Index,
                e0,
                &out.index_k[skip_e * INDEX_DIM..],
            )
        })?;
    }
    Ok(())
}

/// Full / Reindex: indexer logits over the KV source's index K, candidate pool (source), top-k.
#[allow(clippy::too_many_arguments)]
fn index_and_select(
    g: &Geometry,
    cfg: &BackendConfig,
    w: &LayerWeights,
    plan: &StepPlan,
    l: usize,
    rows: &RowSet,
    u: &[f32],
    qr: &[f32],
    cache: &dyn KvCache,
    bufs: &mut StepBuffers,
    tm: &mut Timings,
) -> Result<Vec<i32>> {
    let lp = &g.layers[l];
    let role = lp.role;
    let src = lp
        .kv_source
        .ok_or_else(|| Error::Internal(format!("indexing layer {l} has no KV source")))?;
    let m = g.layers[src].ratio;
    let r = rows.len();
    let (ih, k) = (g.index_heads, g.index_topk);
    let iw = w.attn.indexer.as_ref().ok_or_else(|| {
        Error::NotFound(format!(
            "layer {l} ({}) has no indexer weights",
            role.as_str()
        ))
    })?;
    let (qi, wts) = tm.time(role, Op::Projections, || -> Result<_> {
        let mut qi = vec![0f32; r * ih * INDEX_DIM];
        linear_w(
            "indexer.wq_b",
            qr,
            r,
            iw.wq_b.view(),
            ih * INDEX_DIM,
            &mut qi,
        )?;
        let mut wts = vec![0f32; r * ih];
        linear_w(
            "indexer.weights_proj",
            u,
            r,
            iw.weights_proj.view(),
            ih,
            &mut wts,
        )?;
        let sc = (INDEX_DIM as f32).powf(-0.5) * (ih as f32).powf(-0.5);
        wts.iter_mut().for_each(|v| *v *= sc);
        Ok((qi, wts))
    })?;
    let qi = tm.time(role, Op::Rope, || -> Result<_> {
        let mut qi = qi;
        Rope::for_layer(lp).apply(&mut qi, ih, INDEX_DIM, &rows.pos, Direction::Forward)?;
        Ok(qi)
    })?;
    let cp = CandidateParams {
        block_size: g.candidate_block_size,
        num_blocks: g.candidate_topk_blocks,
    };
    let writes_pool = lp.candidates == CandidateUse::Writes;
    let reads_pool = lp.candidates == CandidateUse::Reads;
    let pool = if reads_pool {
        bufs.pool
            .as_ref()
            .map(|(pl, p)| bufs.rows_of(p, *pl, l, cp.num_blocks, plan))
    } else {
        None
    };
    let mut sel = vec![-1i32; r * k];
    let mut new_pool: Option<Vec<i32>> = None;
    let ip = IndexerParams {
        ratio: m,
        heads: ih,
        query_quant: cfg.query_quant,
    };
    for (si, span) in &rows.spans {
        let s = &plan.seqs[*si];
        let n = cache.entries(s.req, src)?;
        let vis: Vec<usize> = span
            .clone()
            .map(|i| visible(rows.pos[i], m).min(n))
            .collect();
        let maxvis = vis.iter().copied().max().unwrap_or(0);
        let out_sel = &mut sel[span.start * k..span.end * k];
        let needs_pool = writes_pool && maxvis > cp.capacity();
        if maxvis <= k && !needs_pool {
            // Everything visible is selected; no scoring needed (docs/SPEC.md §2).
            for (row, &v) in out_sel.chunks_mut(k).zip(&vis) {
                for (j, o) in row.iter_mut().enumerate() {
                    *o = if j < v { j as i32 } else { -1 };
                }
            }
            continue;
        }
        let recs = cache.records(s.req, src, RecordKind::Index, 0..n)?;
        let decoded;
        let keys = match cache.formats().index {
            RecordFormat::Mxfp4Index => IndexKeys::Mxfp4(&recs),
            fmt => {
                decoded = tm.time(role, Op::Codecs, || {
                    let mut v = vec![0f32; n * INDEX_DIM];
                    crate::formats::decode_rows(fmt, &recs, &mut v).map(|_| v)
                })?;
                IndexKeys::F32(&decoded)
            }
        };
        let qs = IndexerQueries {
            q: rows_of_span(&qi, ih * INDEX_DIM, span),
            w: rows_of_span(&wts, ih, span),
            positions: &rows.pos[span.clone()],
        };
        let mut lg = vec![0f32; span.len() * n];
        let pool_rows = pool.as_ref().filter(|_| maxvis > cp.capacity());
        match (pool_rows, cfg.reindex) {
            (Some(p), ReindexMode::Pooled) => tm.time(role, Op::Indexer, || {
                logits_in_blocks(
                    &ip,
                    &qs,
                    keys,
                    rows_of_span(p, cp.num_blocks, span),
                    &cp,
                    &mut lg,
                )
            })?,
            (Some(p), ReindexMode::DenseThenMask) => {
                tm.time(role, Op::Indexer, || logits(&ip, &qs, keys, &mut lg))?;
                tm.time(role, Op::Topk, || {
                    lg.par_chunks_mut(n)
                        .zip(rows_of_span(p, cp.num_blocks, span).par_chunks(cp.num_blocks))
                        .for_each(|(row, blocks)| mask_outside(&cp, blocks, row));
                });
            }
            (None, _) => tm.time(role, Op::Indexer, || logits(&ip, &qs, keys, &mut lg))?,
        }
        if needs_pool {
            let np = new_pool.get_or_insert_with(|| vec![-1i32; r * cp.num_blocks]);
            tm.time(role, Op::Topk, || {
                select_blocks_rows(
                    &cp,
                    &lg,
                    n,
                    &vis,
                    &mut np[span.start * cp.num_blocks..span.end * cp.num_blocks],
                )
            })?;
        }
        tm.time(role, Op::Topk, || select_rows(&lg, n, &vis, out_sel))?;
    }
    if writes_pool {
        bufs.pool = new_pool.map(|p| (l, p));
    }
    Ok(sel)
}

/// How Reindex layers score (docs/SPEC.md §2 vs the launch-day path of docs/SPEC.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReindexMode {
    /// Score only the entries inside the candidate pool (≤ 16,384 per query).
    Pooled,
    /// Dense logits over every visible entry, then mask everything outside the pool (launch day).
    DenseThenMask,
}
