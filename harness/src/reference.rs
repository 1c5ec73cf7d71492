//! The f64 reference of one decode step through the whole stack: what `csa2 ab` measures each
//! backend's accuracy against.
//!
//! "The reference" is the step's math with nothing quantized and nothing approximated:
//! - the KV cache holds the exact values the cache was built from (no record format: the main KV,
//!   index K and SWA rows are read through [`ExactCache`] callbacks, e.g. the synthetic values of
//!   `csa2 ab` before any encoder sees them), and this step's new rows are used unrounded;
//! - the index Q is not fake-quantized; indexer logits, the candidate pool (docs/SPEC.md §2) and the top-k
//!   come from exact logits (so a selection that differs from a backend's is part of that backend's
//!   error; [`RefStep::topk`] lets a caller report the overlap);
//! - every op is computed in f64 by the per-op references of `csa2::ops::*::reference` (mHC,
//!   compressor, RoPE, candidate pool, top-k, attention) or, for the projections and the indexer
//!   logits (too large for the scalar references at real dimensions), by f64 loops here. Values
//!   cross op boundaries as f32 (the per-op references take f32 inputs), which adds ≤ 2⁻²⁴ relative
//!   per hand-off: far below the quantization errors this reference exists to measure.
//!
//! Scope: one request, one decode token at position `pos`, after a context of `pos` tokens whose
//! Full layers hold `pos / ratio` entries and whose compressors start a new group at `pos` (so
//! `pos` must be a multiple of every ratio; [`decode_step`] rejects other positions).

use csa2::backend::gemm::WeightView;
use csa2::backend::stack::{embed, FfnPlaceholder, Model};
use csa2::cache::RecordKind;
use csa2::error::{Error, Result};
use csa2::formats::{INDEX_DIM, KV_DIM};
use csa2::geometry::{CandidateUse, Geometry, Role};
use csa2::ops::attention::{self, AttentionInputs, AttentionParams, KvRows};
use csa2::ops::candidates::{self, CandidateParams};
use csa2::ops::compressor::{self, PooledWeights};
use csa2::ops::indexer::visible;
use csa2::ops::mhc::{self, one_hot_pre, BoundaryIn, MhcParams, PostUpdate};
use csa2::ops::rope::{reference::rotate_f64, Direction, Rope};
use csa2::ops::topk;
use csa2::weights::{LayerWeights, Matrix};
use rayon::prelude::*;
use std::collections::HashMap;

/// `(layer, region, entry, out row)`: writes the exact values of one entry.
pub type EntryFn<'a> = dyn Fn(usize, RecordKind, usize, &mut [f32]) + Sync + 'a;

/// `layer → (n, 512)` exact SWA rows before the step.
pub type WindowFn<'a> = dyn Fn(usize) -> Vec<f32> + Sync + 'a;

/// Exact contents of one request's cache before the step.
pub struct ExactCache<'a> {
    /// Exact value row of entry `i` of KV-source layer `layer` in `region` (512 values for
    /// [`RecordKind::Main`], 128 for [`RecordKind::Index`]); called for `i < pos / ratio` only.
    pub entry: &'a EntryFn<'a>,
    /// Exact SWA rows of `layer` for the positions just before the step, oldest first,
    /// `(n, 512)` f32 (RoPE applied, as stored); `n ≥ min(pos, window − 1)`, extra older rows are
    /// ignored.
    pub window: &'a WindowFn<'a>,
}

/// What the reference step produces (f64).
#[derive(Debug, Clone)]
pub struct RefStep {
    /// Final hidden state `[hidden]` (empty when layer inputs were forced).
    pub hidden: Vec<f64>,
    /// Attention input of every layer `[hidden]`, in layer order.
    pub layer_inputs: Vec<Vec<f64>>,
    /// Attention sublayer output of every layer `[hidden]`, in layer order.
    pub attn_out: Vec<Vec<f64>>,
    /// Selected entries of every Full and Reindex layer (`[index_topk]`, −1 padded), `None` for the
    /// other roles.
    pub topk: Vec<Option<Vec<i32>>>,
}

/// f64 dot of an f32 weight row with an f64 vector; eight independent partial sums so the
/// compiler can vectorise without reassociating one chain.
fn dot64(w: &[f32], x: &[f64]) -> f64 {
    let mut acc = [0f64; 8];
    let (wc, wr) = w.split_at(w.len() / 8 * 8);
    let (xc, xr) = x.split_at(wc.len());
    for (a, b) in wc.chunks_exact(8).zip(xc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += a[i] as f64 * b[i];
        }
    }
    acc.iter().sum::<f64>() + wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b).sum::<f64>()
}

/// `W·x` in f64 for W `[out, cols]` (any stored dtype), each weight the f32 value the fast kernel
/// multiplies ([`WeightView::get`]: the dequantized weight), so both sides see the same weights.
fn gemv64(w: WeightView<'_>, x: &[f64]) -> Vec<f64> {
    let cols = w.cols();
    debug_assert_eq!(x.len(), cols);
    (0..w.rows())
        .into_par_iter()
        .map(|o| (0..cols).map(|k| w.get(o, k) as f64 * x[k]).sum())
        .collect()
}

fn linear64(m: &Matrix, x: &[f64]) -> Result<Vec<f64>> {
    if x.len() != m.cols {
        return Err(Error::shape(
            "reference projection",
            format!(
                "an input of {} for a [{}, {}] weight",
                m.cols, m.rows, m.cols
            ),
            x.len(),
        ));
    }
    Ok(gemv64(m.view(), x))
}

fn rms64(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(&v, &w)| v * r * w as f64).collect()
}

fn rotate_heads(rope: &Rope, x: &mut [f64], dim: usize, pos: usize, dir: Direction) {
    let rd = rope.rope_dim();
    for head in x.chunks_exact_mut(dim) {
        rotate_f64(rope, &mut head[dim - rd..], pos as u64, dir);
    }
}

fn to_f32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Per-step state of the reference: this step's new entries and the published top-k / pool.
#[derive(Default)]
struct RefBuffers {
    /// KV-source layer → (main KV, index K) of the entry this step completed (ratio-1 layers).
    new_entry: HashMap<usize, (Vec<f32>, Vec<f32>)>,
    topk: HashMap<usize, Vec<i32>>,
    pool: Option<Vec<i32>>,
}

struct Ctx<'a> {
    g: &'a Geometry,
    cache: &'a ExactCache<'a>,
    pos: usize,
}

impl Ctx<'_> {
    fn stored(&self, layer: usize) -> usize {
        self.pos / self.g.layers[layer].ratio
    }
    fn entries(&self, layer: usize, b: &RefBuffers) -> usize {
        self.stored(layer) + usize::from(b.new_entry.contains_key(&layer))
    }
    fn entry(&self, layer: usize, region: RecordKind, i: usize, b: &RefBuffers, out: &mut [f32]) {
        if i < self.stored(layer) {
            (self.cache.entry)(layer, region, i, out);
        } else {
            let (m, k) = &b.new_entry[&layer];
            out.copy_from_slice(match region {
                RecordKind::Main => m,
                RecordKind::Index => k,
            });
        }
    }
}

/// One attention sublayer for the decode token with input `u` `[hidden]`; returns y `[hidden]`.
fn sublayer(
    cx: &Ctx,
    w: &LayerWeights,
    l: usize,
    u: &[f32],
    b: &mut RefBuffers,
) -> Result<(Vec<f64>, Option<Vec<i32>>)> {
    let g = cx.g;
    let lp = &g.layers[l];
    let (h, hd, eps, pos) = (g.num_heads, g.head_dim, g.rms_norm_eps, cx.pos);
    let a = &w.attn;
    let rope = Rope::for_layer(lp);
    let u64v = to_f64(u);

    let qr = rms64(&linear64(&a.wq_a, &u64v)?, &a.q_norm, eps);
    let mut q = linear64(&a.wq_b, &qr)?;
    rotate_heads(&rope, &mut q, hd, pos, Direction::Forward);
    let mut kv = rms64(&linear64(&a.wkv, &u64v)?, &a.kv_norm, eps);
    rotate_heads(&rope, &mut kv, KV_DIM, pos, Direction::Forward);

    // The window: the older rows the cache held (exact), then this step's row (unrounded to any
    // record format; f32 for the attention reference's input).
    let older = (cx.cache.window)(l);
    let want = pos.min(g.window - 1);
    let have = older.len() / KV_DIM;
    if have < want {
        return Err(Error::shape(
            format!("reference layer {l} window"),
            format!("at least {want} rows before position {pos}"),
            have,
        ));
    }
    let mut swa = older[(have - want) * KV_DIM..].to_vec();
    swa.extend(to_f32(&kv));
    let base = pos - want;

    // ---- role work
    if lp.role == Role::Full && lp.ratio == 1 {
        // A ratio-1 compressor completes this token's group at once: a new entry, visible now.
        let cw = a.compressor.as_ref().ok_or_else(|| {
            Error::NotFound(format!("layer {l}: Full layer without compressor weights"))
        })?;
        let ik = a
            .indexer
            .as_ref()
            .and_then(|i| i.k.as_ref())
            .ok_or_else(|| Error::NotFound(format!("layer {l}: Full layer without indexer wk")))?;
        let kvc = to_f32(&linear64(&cw.wkv, &u64v)?);
        let r = compressor::reference::compress(
            1,
            eps,
            &rope,
            &PooledWeights {
                norm: &cw.norm,
                wk: &ik.wk.f32_values(),
                k_norm: &ik.k_norm,
            },
            &kvc,
            None,
            pos,
        );
        b.new_entry
            .insert(l, (to_f32(&r.main_kv), to_f32(&r.index_k)));
    }
    // Ratio-2 compressors only hold this token as the pending half of a pair: no entry this step.
    let k = g.index_topk;
    let sel: Option<Vec<i32>> = match lp.role {
        Role::SwaOnly => None,
        Role::Reuse => {
            let src = lp
                .index_source
                .ok_or_else(|| Error::Internal(format!("reuse layer {l} has no index source")))?;
            Some(b.topk.get(&src).cloned().ok_or_else(|| {
                Error::Internal(format!("layer {l} reads the top-k of layer {src}, not run"))
            })?)
        }
        Role::Full | Role::Reindex => {
            let s = index_select(cx, w, l, &u64v, &qr, b)?;
            b.topk.insert(l, s.clone());
            Some(s)
        }
    };

    // ---- attention over the selected entries (gathered exactly) ∪ the window
    let mut main = vec![];
    let mut compact = vec![-1i32; k];
    if let (Some(src), Some(sel)) = (lp.kv_source, &sel) {
        let mut row = vec![0f32; KV_DIM];
        for (c, &j) in sel.iter().filter(|&&j| j >= 0).enumerate() {
            cx.entry(src, RecordKind::Main, j as usize, b, &mut row);
            main.extend_from_slice(&row);
            compact[c] = c as i32;
        }
    }
    let params = AttentionParams {
        heads: h,
        window: g.window,
        scale: (hd as f32).sqrt().recip(),
        ratio: None,
    };
    let qf = to_f32(&q);
    let positions = [(pos - base) as i64];
    let inp = AttentionInputs {
        q: &qf,
        topk: if sel.is_some() { &compact } else { &[] },
        topk_len: None,
        positions: &positions,
        replay_start: &[],
        sink: &a.attn_sink,
    };
    let (mr, sr) = (KvRows::F32(&main), KvRows::F32(&swa));
    let rows = attention::plan(&params, &inp, &mr, &sr)?;
    let (mut o, _lse) = attention::reference::attention(&params, &inp, &rows, mr, sr);
    rotate_heads(&rope, &mut o, hd, pos, Direction::Inverse);

    // ---- grouped output projection
    let (grp, lr) = (g.o_groups, g.o_lora_rank);
    let gw = h / grp * hd;
    let mut z = Vec::with_capacity(grp * lr);
    for gi in 0..grp {
        z.extend(gemv64(
            a.wo_a.view().row_block(gi * lr, lr)?,
            &o[gi * gw..(gi + 1) * gw],
        ));
    }
    Ok((linear64(&a.wo_b, &z)?, sel))
}

/// Full / Reindex: exact indexer logits over the KV source's index K, the candidate pool, top-k.
fn index_select(
    cx: &Ctx,
    w: &LayerWeights,
    l: usize,
    u: &[f64],
    qr: &[f64],
    b: &mut RefBuffers,
) -> Result<Vec<i32>> {
    let g = cx.g;
    let lp = &g.layers[l];
    let src = lp
        .kv_source
        .ok_or_else(|| Error::Internal(format!("indexing layer {l} has no KV source")))?;
    let iw = lp_indexer(w, l)?;
    let (ih, k) = (g.index_heads, g.index_topk);
    let n = cx.entries(src, b);
    let vis = visible(cx.pos as i64, g.layers[src].ratio).min(n);
    let cp = CandidateParams {
        block_size: g.candidate_block_size,
        num_blocks: g.candidate_topk_blocks,
    };
    let writes_pool = lp.candidates == CandidateUse::Writes;
    let needs_pool = writes_pool && vis > cp.capacity();
    if vis <= k && !needs_pool {
        // Everything visible is selected (docs/SPEC.md §2): no scoring changes the set.
        return Ok((0..k as i32)
            .map(|j| if (j as usize) < vis { j } else { -1 })
            .collect());
    }
    let mut qi = linear64(&iw.wq_b, qr)?;
    rotate_heads(
        &Rope::for_layer(lp),
        &mut qi,
        INDEX_DIM,
        cx.pos,
        Direction::Forward,
    );
    let sc = (INDEX_DIM as f64).powf(-0.5) * (ih as f64).powf(-0.5);
    let wts: Vec<f64> = linear64(&iw.weights_proj, u)?
        .iter()
        .map(|v| v * sc)
        .collect();
    // Entries a pooled query may score (docs/SPEC.md §2): the pool's blocks when the row sees more than
    // the pool holds.
    let allowed: Option<Vec<bool>> = match (&b.pool, lp.candidates) {
        (Some(p), CandidateUse::Reads) if vis > cp.capacity() => {
            let mut a = vec![false; vis];
            for &blk in p.iter().filter(|&&x| x >= 0) {
                let s = blk as usize * cp.block_size;
                for e in a.iter_mut().take((s + cp.block_size).min(vis)).skip(s) {
                    *e = true;
                }
            }
            Some(a)
        }
        _ => None,
    };
    // logit_j = Σ_h w_h · max(0, q_h · k_j)  (docs/SPEC.md §2.5).
    let bs: &RefBuffers = b;
    let logits: Vec<f32> = (0..vis)
        .into_par_iter()
        .map_init(
            || vec![0f32; INDEX_DIM],
            |key, j| {
                if allowed.as_ref().is_some_and(|a| !a[j]) {
                    return f32::NEG_INFINITY;
                }
                cx.entry(src, RecordKind::Index, j, bs, key);
                let mut s = 0f64;
                for (hh, qh) in qi.chunks_exact(INDEX_DIM).enumerate() {
                    s += wts[hh] * dot64(key, qh).max(0.0);
                }
                s as f32
            },
        )
        .collect();
    if needs_pool {
        b.pool = Some(candidates::reference::select_blocks(&cp, &logits, vis));
    }
    Ok(topk::reference::select(&logits, vis, k))
}

fn lp_indexer(w: &LayerWeights, l: usize) -> Result<&csa2::weights::IndexerWeights> {
    w.attn.indexer.as_ref().ok_or_else(|| {
        Error::NotFound(format!("layer {l}: indexing layer without indexer weights"))
    })
}

/// The reference decode step of `token` at position `pos` over `cache` (see the module docs).
///
/// With `forced` (`[layers][hidden]`, e.g. a backend's traced attention inputs), each attention
/// sublayer runs on the given input instead of the reference's own mHC chain: the per-layer
/// outputs then measure each layer's own error on identical inputs, and `hidden` is left empty.
///
/// Errors: a `pos` that is not a multiple of a Full layer's ratio, a window callback returning too
/// few rows, a forced input of the wrong shape, missing weights.
pub fn decode_step(
    model: &Model,
    ffn: FfnPlaceholder,
    token: u32,
    pos: usize,
    cache: &ExactCache,
    forced: Option<&[Vec<f32>]>,
) -> Result<RefStep> {
    let g = &model.geometry;
    let d = g.hidden_size;
    for lp in g.layers_with(Role::Full) {
        if !pos.is_multiple_of(lp.ratio) {
            return Err(Error::invalid(
                "reference position",
                format!(
                    "{pos} is not a multiple of layer {}'s ratio {} (the reference starts every compressor group at the step)",
                    lp.id, lp.ratio
                ),
            ));
        }
    }
    if let Some(f) = forced {
        if f.len() != g.num_layers || f.iter().any(|r| r.len() != d) {
            return Err(Error::shape(
                "forced layer inputs",
                format!("[{}][{d}]", g.num_layers),
                format!("{} rows", f.len()),
            ));
        }
    }
    let cx = Ctx { g, cache, pos };
    let mp = MhcParams::from_geometry(g)?;
    let mut b = RefBuffers::default();
    let mut out = RefStep {
        hidden: vec![],
        layer_inputs: vec![],
        attn_out: vec![],
        topk: vec![],
    };
    let hc = mhc::HC;
    let mut x = vec![0f32; hc * d];
    embed(token, model.embed_seed, d, &mut x[..d]);
    let (first, rest) = x.split_at_mut(d);
    for c in rest.chunks_exact_mut(d) {
        c.copy_from_slice(first);
    }
    let mut pre = one_hot_pre(1);
    let mut pending: Option<(Vec<f32>, Vec<f32>, Vec<f32>)> = None;
    for l in 0..g.num_layers {
        let w = &model.layers[l];
        if let Some(f) = forced {
            let (y, sel) = sublayer(&cx, w, l, &f[l], &mut b)?;
            out.layer_inputs.push(to_f64(&f[l]));
            out.attn_out.push(y);
            out.topk
                .push(sel.filter(|_| g.layers[l].role != Role::Reuse));
            continue;
        }
        let bd = mhc::reference::boundary(
            &mp,
            &BoundaryIn {
                x: &x,
                update: pending
                    .as_ref()
                    .map(|(y, post, comb)| PostUpdate { y, post, comb }),
                pre_prev: &pre,
                next: Some(w.hc_attn.mix()),
                norm: &w.attn_norm,
            },
        )?;
        let (cpre, cpost, ccomb) = bd.flat_coeffs();
        let u = to_f32(&bd.layer_in);
        x = to_f32(&bd.x_new);
        let (y, sel) = sublayer(&cx, w, l, &u, &mut b)?;
        let yf = to_f32(&y);
        out.layer_inputs.push(bd.layer_in);
        out.attn_out.push(y);
        out.topk
            .push(sel.filter(|_| g.layers[l].role != Role::Reuse));
        pre = to_f32(&cpre);
        let (post, comb) = (to_f32(&cpost), to_f32(&ccomb));
        let bf = mhc::reference::boundary(
            &mp,
            &BoundaryIn {
                x: &x,
                update: Some(PostUpdate {
                    y: &yf,
                    post: &post,
                    comb: &comb,
                }),
                pre_prev: &pre,
                next: Some(w.hc_ffn.mix()),
                norm: &w.ffn_norm,
            },
        )?;
        let (fpre, fpost, fcomb) = bf.flat_coeffs();
        x = to_f32(&bf.x_new);
        let y_ffn = match ffn {
            FfnPlaceholder::Identity => to_f32(&bf.layer_in),
            FfnPlaceholder::Zero => vec![0.0; d],
        };
        pre = to_f32(&fpre);
        pending = Some((y_ffn, to_f32(&fpost), to_f32(&fcomb)));
    }
    if forced.is_none() {
        let bd = mhc::reference::boundary(
            &mp,
            &BoundaryIn {
                x: &x,
                update: pending
                    .as_ref()
                    .map(|(y, post, comb)| PostUpdate { y, post, comb }),
                pre_prev: &pre,
                next: None,
                norm: &model.final_norm,
            },
        )?;
        out.hidden = bd.layer_in;
    }
    Ok(out)
}
