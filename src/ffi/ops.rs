//! The CSA2 ops over DLPack tensors: thin C wrappers around the fast CPU paths of [`crate::ops`].
//!
//! Common contract of every function here (the per-function docs add their shapes):
//! - **Ownership and lifetimes**: every `DLTensor*` is borrowed for the duration of the call only;
//!   csa2 neither frees nor retains the descriptor, its `shape`/`strides` arrays or its data.
//!   Optional tensors are passed as null.
//! - **Host/device**: all tensors must be host-readable (`kDLCPU`, `kDLCUDAHost`,
//!   `kDLCUDAManaged`) and on the same device; a `kDLCUDA` tensor is `CSA2_ERR_UNSUPPORTED` (these
//!   are the CPU paths; the CUDA kernels live behind the `cuda` feature).
//! - **Layouts**: compact row-major (null strides or the row-major ones); element types as listed per
//!   argument (`float` = float32, bfloat16 or float16, converted to f32 on entry and rounded back to
//!   the output's dtype on exit; `int` = int32 or int64).
//! - **Aliasing**: an output may not overlap any other argument (`CSA2_ERR_INVALID_ARGUMENT`); the one
//!   in-place op, [`csa2_rope`], says so.
//! - **Errors**: `CSA2_ERR_NULL_POINTER`, `CSA2_ERR_SHAPE` (names the tensor, expected and found
//!   shapes), `CSA2_ERR_INVALID_ARGUMENT`, `CSA2_ERR_UNSUPPORTED`; the message is in
//!   `csa2_last_error_message`. Outputs are written only after every check passed.
//! - **Threads**: each call is independent and may run concurrently with any other call on other
//!   tensors; the work itself uses the crate's rayon pool.

use super::dlpack::{check_disjoint, DLTensor, DType, View};
use super::{boundary, Csa2Geometry, Csa2Status};
use crate::error::{Error, Result};
use crate::formats::{RecordFormat, INDEX_DIM, KV_DIM, MXFP4_INDEX_BYTES, NVFP4_DS_BYTES};
use crate::geometry::LayerPlan;
use crate::ops::attention::{AttentionInputs, AttentionParams, IndexedInputs, KvRows};
use crate::ops::candidates::CandidateParams;
use crate::ops::compressor::{Compressor, CompressorState, CompressorWeights};
use crate::ops::indexer::{IndexKeys, IndexerParams, IndexerQueries, QueryQuant};
use crate::ops::mhc::{self, BoundaryIn, MhcParams, MixWeights, PostUpdate, HC, MIX};
use crate::ops::rope::{Direction, Rope};
use crate::shape::{Dim, Dims};
use std::borrow::Cow;

pub(super) const FLOATS: &[DType] = &[DType::F32, DType::Bf16, DType::F16];
pub(super) const INTS: &[DType] = &[DType::I32, DType::I64];

/// The validated host views of a compressor call (`csa2_compress`, `csa2_compress_step`): `kv`
/// `(T, 512)` float, optional `score` `(T, 512)` float, `norm` `(512)`, `wk` `(128, 512)`, `k_norm`
/// `(128)` float, and the record outputs `(E, 288)` / `(E, 68)` uint8.
///
/// # Safety
/// Each pointer null or a readable `DLTensor` whose memory stays valid for `'a`.
#[allow(clippy::type_complexity)]
pub(super) unsafe fn compress_views<'a>(
    kv: *const DLTensor,
    score: *const DLTensor,
    norm: *const DLTensor,
    wk: *const DLTensor,
    k_norm: *const DLTensor,
    main_kv_out: *const DLTensor,
    index_k_out: *const DLTensor,
) -> Result<(
    View<'a>,
    Option<View<'a>>,
    View<'a>,
    View<'a>,
    View<'a>,
    View<'a>,
    View<'a>,
)> {
    // SAFETY: forwarded caller contract.
    let (kv, score, norm, wk, k_norm, main_out, index_out) = unsafe {
        (
            host(kv, "kv")?,
            host_opt(score, "score")?,
            host(norm, "norm")?,
            host(wk, "wk")?,
            host(k_norm, "k_norm")?,
            host(main_kv_out, "main_kv_out")?,
            host(index_k_out, "index_k_out")?,
        )
    };
    let mut dims = Dims::default();
    kv.expect(FLOATS, &[Dim::Any("T"), Dim::Fixed(KV_DIM)], &mut dims)?;
    if let Some(s) = &score {
        s.expect(FLOATS, &[Dim::Any("T"), Dim::Fixed(KV_DIM)], &mut dims)?;
    }
    norm.expect(FLOATS, &[Dim::Fixed(KV_DIM)], &mut dims)?;
    wk.expect(
        FLOATS,
        &[Dim::Fixed(INDEX_DIM), Dim::Fixed(KV_DIM)],
        &mut dims,
    )?;
    k_norm.expect(FLOATS, &[Dim::Fixed(INDEX_DIM)], &mut dims)?;
    main_out.expect(
        &[DType::U8],
        &[Dim::Any("E"), Dim::Fixed(NVFP4_DS_BYTES)],
        &mut dims,
    )?;
    index_out.expect(
        &[DType::U8],
        &[Dim::Any("E"), Dim::Fixed(MXFP4_INDEX_BYTES)],
        &mut dims,
    )?;
    Ok((kv, score, norm, wk, k_norm, main_out, index_out))
}

/// A required host tensor.
///
/// # Safety
/// As [`View::from_raw`].
pub(super) unsafe fn host<'a>(t: *const DLTensor, name: &'static str) -> Result<View<'a>> {
    // SAFETY: forwarded caller contract.
    let v = unsafe { View::from_raw(t, name) }?;
    v.require_host()?;
    Ok(v)
}

/// An optional host tensor (null → `None`).
///
/// # Safety
/// As [`View::from_raw`].
pub(super) unsafe fn host_opt<'a>(
    t: *const DLTensor,
    name: &'static str,
) -> Result<Option<View<'a>>> {
    if t.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded caller contract.
    unsafe { host(t, name) }.map(Some)
}

/// A checked geometry handle and one of its layers.
pub(super) struct GeoLayer {
    g: std::sync::Arc<Csa2Geometry>,
    layer: usize,
}

impl GeoLayer {
    /// The layer's plan.
    pub(super) fn plan(&self) -> &LayerPlan {
        &self.g.g.layers[self.layer]
    }
    /// The model's RMSNorm epsilon.
    pub(super) fn eps(&self) -> f64 {
        self.g.g.rms_norm_eps
    }
}

pub(super) fn layer_plan(g: *const Csa2Geometry, layer: u32) -> Result<GeoLayer> {
    let g = super::geometry::geometry(g)?;
    let n = g.g.layers.len();
    if layer as usize >= n {
        return Err(Error::invalid(
            "layer",
            format!("{layer} is past the {n} backbone layers"),
        ));
    }
    Ok(GeoLayer {
        g,
        layer: layer as usize,
    })
}

/// Writes `f`'s f32 results into a float output: straight into float32 memory, through a temporary
/// for bfloat16/float16.
fn fill_floats(out: &mut View, f: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<()> {
    if out.dtype() == DType::F32 {
        f(out.f32s_mut()?)
    } else {
        let mut tmp = vec![0.0f32; out.numel()];
        f(&mut tmp)?;
        out.write_f32s(&tmp)
    }
}

fn record_format(v: i32, what: &'static str) -> Result<RecordFormat> {
    usize::try_from(v)
        .ok()
        .and_then(|i| RecordFormat::ALL.get(i).copied())
        .filter(|f| f.dim() == KV_DIM)
        .ok_or_else(|| {
            Error::invalid(
                what,
                format!("{v} is not a 512-value Csa2Format (0 nvfp4, 2 mxfp8, 3 v4)"),
            )
        })
}

/// Rotary embedding in place on `x` `(tokens, heads, dim)` float, token t at `positions[t]`
/// (`(tokens)` int, ≥ 0), with the rotary of layer `layer` of `geometry` (θ, YaRN, rope_dim on the
/// trailing dims; docs/SPEC.md §2 "RoPE"). `inverse` = 0 rotates forward (Q, KV), 1 by the negative angle
/// (the attention output).
///
/// `x` is read and written (in place, the only aliasing allowed); `positions` may not overlap it.
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` (layer, `inverse`, negative position), `CSA2_ERR_SHAPE`
/// (dim < rope_dim, T mismatch), plus the common ones.
///
/// # Safety
/// `geometry` must be a live handle; each tensor pointer null or a readable `DLTensor` whose memory
/// stays valid and unused by other threads for the call.
#[no_mangle]
pub unsafe extern "C" fn csa2_rope(
    geometry: *const Csa2Geometry,
    layer: u32,
    x: *const DLTensor,
    positions: *const DLTensor,
    inverse: i32,
) -> Csa2Status {
    boundary("csa2_rope", || {
        let gl = layer_plan(geometry, layer)?;
        let plan = gl.plan();
        let dir = match inverse {
            0 => Direction::Forward,
            1 => Direction::Inverse,
            v => return Err(Error::invalid("inverse", format!("0 or 1, found {v}"))),
        };
        // SAFETY: caller's contract (see above).
        let (mut xv, pv) = unsafe { (host(x, "x")?, host(positions, "positions")?) };
        let mut dims = Dims::default();
        xv.expect(
            FLOATS,
            &[Dim::Any("T"), Dim::Any("H"), Dim::Any("D")],
            &mut dims,
        )?;
        pv.expect(INTS, &[Dim::Any("T")], &mut dims)?;
        check_disjoint(&[&pv], &[&xv])?;
        let (h, d) = (xv.shape()[1], xv.shape()[2]);
        let pos = pv.i64s()?;
        let rope = Rope::new(&plan.rope)?;
        if xv.dtype() == DType::F32 {
            rope.apply(xv.f32s_mut()?, h, d, &pos, dir)
        } else {
            let mut vals = xv.f32s()?.into_owned();
            rope.apply(&mut vals, h, d, &pos, dir)?;
            xv.write_f32s(&vals)
        }
    })
}

/// KV compressor of Full layer `layer` (docs/SPEC.md §2 "Compressor"): turns `kv` `(T, 512)` float (and, for
/// ratio 2, the gate `score` `(T, 512)` float; null for ratio 1) of tokens `start_pos ..
/// start_pos + T` into `E = T / ratio` compressed entries, written as NVFP4-DS main-KV records
/// `main_kv_out` `(E, 288)` uint8 and MXFP4 index-K records `index_k_out` `(E, 68)` uint8.
/// Weights: `norm` `(512)`, `wk` `(128, 512)`, `k_norm` `(128)` float.
///
/// Stateless: `start_pos` and `T` must be multiples of the ratio (a caller that splits a pair across
/// calls keeps the odd token and sends it with the next call).
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` (not a compressed layer, misaligned `start_pos`/`T`,
/// `score` given or missing, non-finite values), plus the common ones.
///
/// # Safety
/// As [`csa2_rope`].
#[no_mangle]
pub unsafe extern "C" fn csa2_compress(
    geometry: *const Csa2Geometry,
    layer: u32,
    kv: *const DLTensor,
    score: *const DLTensor,
    norm: *const DLTensor,
    wk: *const DLTensor,
    k_norm: *const DLTensor,
    start_pos: i64,
    main_kv_out: *const DLTensor,
    index_k_out: *const DLTensor,
) -> Csa2Status {
    boundary("csa2_compress", || {
        let gl = layer_plan(geometry, layer)?;
        let (plan, eps) = (gl.plan(), gl.eps());
        let m = plan.ratio;
        // SAFETY: caller's contract (see above).
        let (kv, score, norm, wk, k_norm, mut main_out, mut index_out) =
            unsafe { compress_views(kv, score, norm, wk, k_norm, main_kv_out, index_k_out) }?;
        let t = kv.shape()[0];
        if m == 0 {
            return Err(Error::invalid(
                "layer",
                format!("layer {layer} has no compressor (ratio 0)"),
            ));
        }
        if start_pos < 0 || !(start_pos as u64).is_multiple_of(m as u64) || !t.is_multiple_of(m) {
            return Err(Error::invalid(
                "start_pos",
                format!(
                    "start_pos and T must be multiples of the ratio {m} (stateless call), \
                     found start_pos {start_pos}, T {t}"
                ),
            ));
        }
        if main_out.shape()[0] != t / m {
            return Err(Error::shape(
                "main_kv_out",
                format!("[E={}, {NVFP4_DS_BYTES}] (T / ratio)", t / m),
                format!("{:?}", main_out.shape()),
            ));
        }
        let mut inputs = vec![&kv, &norm, &wk, &k_norm];
        inputs.extend(score.as_ref());
        check_disjoint(&inputs, &[&main_out, &index_out])?;
        let (normv, wkv, knv) = (norm.f32s()?, wk.f32s()?, k_norm.f32s()?);
        let c = Compressor::new(
            m,
            eps,
            Rope::new(&plan.rope)?,
            CompressorWeights {
                norm: &normv,
                wk: &wkv,
                k_norm: &knv,
            },
        )?;
        let kvv = kv.f32s()?;
        let sv = score.as_ref().map(|s| s.f32s()).transpose()?;
        let mut st = CompressorState::new(start_pos as u64);
        let out = c.compress(&mut st, &kvv, sv.as_deref())?;
        if out.count != t / m || st.pending_tokens() != 0 {
            return Err(Error::Internal(format!(
                "compressor emitted {} entries ({} pending) for T={t}, ratio {m}",
                out.count,
                st.pending_tokens()
            )));
        }
        main_out.bytes_mut()?.copy_from_slice(&out.main_kv_nvfp4);
        index_out.bytes_mut()?.copy_from_slice(&out.index_k_mxfp4);
        Ok(())
    })
}

/// Lightning-indexer logits (docs/SPEC.md §2 "Indexer"): `logits[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j)`
/// for the visible entries `j < (positions[t] + 1) div ratio`, −∞ elsewhere.
///
/// `q` `(T, H, 128)` float (RoPE'd index Q), `w` `(T, H)` float (already scaled), `positions` `(T)`
/// int; `keys` either `(N, 128)` float or `(N, 68)` uint8 MXFP4 index-K records; `q_quant`: 0 none,
/// 1 MXFP4 (V4.1), 2 FP8 E4M3 (the launch-day path) fake-quantisation of Q; `logits_out` `(T, N)`
/// float. Errors: `CSA2_ERR_INVALID_ARGUMENT` (ratio 0, `q_quant`, negative position),
/// `CSA2_ERR_SHAPE` (too few keys for a position), plus the common ones.
///
/// # Safety
/// Each tensor pointer null or a readable `DLTensor` whose memory stays valid and unused by other
/// threads for the call.
#[no_mangle]
pub unsafe extern "C" fn csa2_indexer_logits(
    q: *const DLTensor,
    w: *const DLTensor,
    positions: *const DLTensor,
    keys: *const DLTensor,
    ratio: u32,
    q_quant: i32,
    logits_out: *const DLTensor,
) -> Csa2Status {
    boundary("csa2_indexer_logits", || {
        // SAFETY: caller's contract (see above).
        unsafe { indexer(q, w, positions, keys, None, ratio, q_quant, logits_out) }
    })
}

/// Candidate-restricted lightning-indexer logits (docs/SPEC.md §2 "Indexer", the Reindex path): as
/// [`csa2_indexer_logits`], but row t scores only the entries inside its candidate blocks
/// `blocks[t, :]` (block b = entries `[b·block_size, (b+1)·block_size)`, −1 ends the list early;
/// only visible entries count); every other entry is −∞. This is `csa2 op indexer` with `blocks`.
///
/// `blocks` `(T, B)` int32 from `csa2_candidates`; `block_size` ≥ 1 (the geometry's
/// `candidate_block_size`, 8). Errors: a block id past the keys (`CSA2_ERR_INVALID_ARGUMENT`),
/// `block_size` 0, plus those of [`csa2_indexer_logits`].
///
/// # Safety
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_indexer_logits_in_blocks(
    q: *const DLTensor,
    w: *const DLTensor,
    positions: *const DLTensor,
    keys: *const DLTensor,
    blocks: *const DLTensor,
    ratio: u32,
    block_size: u32,
    q_quant: i32,
    logits_out: *const DLTensor,
) -> Csa2Status {
    boundary("csa2_indexer_logits_in_blocks", || {
        // SAFETY: a null `blocks` is refused here; the rest is the caller's contract.
        unsafe {
            if blocks.is_null() {
                return Err(Error::NullPointer("blocks"));
            }
            indexer(
                q,
                w,
                positions,
                keys,
                Some((blocks, block_size)),
                ratio,
                q_quant,
                logits_out,
            )
        }
    })
}

/// The body of both indexer exports; `blocks` = (candidate blocks, block size) for the Reindex path.
///
/// # Safety
/// As [`csa2_indexer_logits`].
#[allow(clippy::too_many_arguments)]
unsafe fn indexer(
    q: *const DLTensor,
    w: *const DLTensor,
    positions: *const DLTensor,
    keys: *const DLTensor,
    blocks: Option<(*const DLTensor, u32)>,
    ratio: u32,
    q_quant: i32,
    logits_out: *const DLTensor,
) -> Result<()> {
    let query_quant = match q_quant {
        0 => QueryQuant::None,
        1 => QueryQuant::Mxfp4,
        2 => QueryQuant::Fp8,
        v => {
            return Err(Error::invalid(
                "q_quant",
                format!("0 none, 1 mxfp4 or 2 fp8, found {v}"),
            ))
        }
    };
    // SAFETY: caller's contract (see above).
    let (qv, wv, pv, kv, mut out) = unsafe {
        (
            host(q, "q")?,
            host(w, "w")?,
            host(positions, "positions")?,
            host(keys, "keys")?,
            host(logits_out, "logits_out")?,
        )
    };
    let mut dims = Dims::default();
    qv.expect(
        FLOATS,
        &[Dim::Any("T"), Dim::Any("H"), Dim::Fixed(INDEX_DIM)],
        &mut dims,
    )?;
    wv.expect(FLOATS, &[Dim::Any("T"), Dim::Any("H")], &mut dims)?;
    pv.expect(INTS, &[Dim::Any("T")], &mut dims)?;
    if kv.dtype() == DType::U8 {
        kv.expect(
            &[DType::U8],
            &[Dim::Any("N"), Dim::Fixed(MXFP4_INDEX_BYTES)],
            &mut dims,
        )?;
    } else {
        kv.expect(FLOATS, &[Dim::Any("N"), Dim::Fixed(INDEX_DIM)], &mut dims)?;
    }
    out.expect(FLOATS, &[Dim::Any("T"), Dim::Any("N")], &mut dims)?;
    let bv = match blocks {
        // SAFETY: caller's contract (see above).
        Some((b, _)) => Some(unsafe { host(b, "blocks") }?),
        None => None,
    };
    if let Some(b) = &bv {
        b.expect(&[DType::I32], &[Dim::Any("T"), Dim::Any("B")], &mut dims)?;
    }
    let mut inputs = vec![&qv, &wv, &pv, &kv];
    inputs.extend(bv.as_ref());
    check_disjoint(&inputs, &[&out])?;
    let params = IndexerParams {
        ratio: ratio as usize,
        heads: qv.shape()[1],
        query_quant,
    };
    let (qf, wf, pos) = (qv.f32s()?, wv.f32s()?, pv.i64s()?);
    let kf;
    let keys = if kv.dtype() == DType::U8 {
        IndexKeys::Mxfp4(kv.bytes()?)
    } else {
        kf = kv.f32s()?;
        IndexKeys::F32(&kf)
    };
    let qs = IndexerQueries {
        q: &qf,
        w: &wf,
        positions: &pos,
    };
    match (&bv, blocks) {
        (Some(b), Some((_, block_size))) => {
            let cp = CandidateParams {
                block_size: block_size as usize,
                num_blocks: b.shape()[1].max(1),
            };
            let ids = b.i32s()?;
            fill_floats(&mut out, |o| {
                crate::ops::indexer::logits_in_blocks(&params, &qs, keys, ids, &cp, o)
            })
        }
        _ => fill_floats(&mut out, |o| {
            crate::ops::indexer::logits(&params, &qs, keys, o)
        }),
    }
}

fn visible_rows(pos: &[i64], ratio: u32) -> Result<Vec<usize>> {
    if ratio == 0 {
        return Err(Error::invalid("ratio", "must be ≥ 1, found 0"));
    }
    crate::ops::rope::check_positions(pos)?;
    Ok(pos
        .iter()
        .map(|&p| crate::ops::indexer::visible(p, ratio as usize))
        .collect())
}

/// Top-k of indexer logits (docs/SPEC.md §2 "Indexer"): for row t, the K largest of
/// `logits[t, 0 .. (positions[t] + 1) div ratio]` (ties → smaller index; −∞/NaN never chosen; all
/// visible entries in index order when they are ≤ K), −1 padded.
///
/// `logits` `(T, N)` float, `positions` `(T)` int, `out` `(T, K)` int32, `counts_out` (optional)
/// `(T)` int32 = entries selected per row. Errors: ratio 0, negative position, plus the common ones.
///
/// # Safety
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_topk(
    logits: *const DLTensor,
    positions: *const DLTensor,
    ratio: u32,
    out: *const DLTensor,
    counts_out: *const DLTensor,
) -> Csa2Status {
    boundary("csa2_topk", || {
        // SAFETY: caller's contract (see above).
        let (lv, pv, mut ov, mut cv) = unsafe {
            (
                host(logits, "logits")?,
                host(positions, "positions")?,
                host(out, "out")?,
                host_opt(counts_out, "counts_out")?,
            )
        };
        let mut dims = Dims::default();
        lv.expect(FLOATS, &[Dim::Any("T"), Dim::Any("N")], &mut dims)?;
        pv.expect(INTS, &[Dim::Any("T")], &mut dims)?;
        ov.expect(&[DType::I32], &[Dim::Any("T"), Dim::Any("K")], &mut dims)?;
        let mut outs = vec![&ov];
        if let Some(c) = &cv {
            c.expect(&[DType::I32], &[Dim::Any("T")], &mut dims)?;
            outs.push(c);
        }
        check_disjoint(&[&lv, &pv], &outs)?;
        let vis = visible_rows(&pv.i64s()?, ratio)?;
        let lf = lv.f32s()?;
        let n = lv.shape()[1];
        let counts = crate::ops::topk::select_rows(&lf, n, &vis, ov.i32s_mut()?)?;
        if let Some(c) = &mut cv {
            for (o, &k) in c.i32s_mut()?.iter_mut().zip(&counts) {
                *o = k as i32;
            }
        }
        Ok(())
    })
}

/// Hierarchical candidate pool of the candidate-source layer (docs/SPEC.md §2 "Candidate pool"): per row,
/// blocks of `block_size` entries scored by their max visible logit, the newest block pinned, the
/// best `B` kept sorted (score desc, id asc), −1 padded.
///
/// `logits` `(T, N)` float, `positions` `(T)` int (visible = `(p + 1) div ratio`), `blocks_out`
/// `(T, B)` int32 (B = blocks kept, 2048 in V4.1). Errors: ratio/block_size/B of 0, negative
/// position, plus the common ones.
///
/// # Safety
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_candidates(
    logits: *const DLTensor,
    positions: *const DLTensor,
    ratio: u32,
    block_size: u32,
    blocks_out: *const DLTensor,
) -> Csa2Status {
    boundary("csa2_candidates", || {
        // SAFETY: caller's contract (see above).
        let (lv, pv, mut ov) = unsafe {
            (
                host(logits, "logits")?,
                host(positions, "positions")?,
                host(blocks_out, "blocks_out")?,
            )
        };
        let mut dims = Dims::default();
        lv.expect(FLOATS, &[Dim::Any("T"), Dim::Any("N")], &mut dims)?;
        pv.expect(INTS, &[Dim::Any("T")], &mut dims)?;
        ov.expect(&[DType::I32], &[Dim::Any("T"), Dim::Any("B")], &mut dims)?;
        check_disjoint(&[&lv, &pv], &[&ov])?;
        let p = CandidateParams {
            block_size: block_size as usize,
            num_blocks: ov.shape()[1],
        };
        p.validate()?;
        let vis = visible_rows(&pv.i64s()?, ratio)?;
        let lf = lv.f32s()?;
        crate::ops::candidates::select_blocks_rows(&p, &lf, lv.shape()[1], &vis, ov.i32s_mut()?)
    })
}

/// Sparse + sliding-window attention with a sink (docs/SPEC.md §2 "Attention"): per token and head, one
/// softmax over the selected main-KV entries ∪ the SWA window `[max(p − window + 1, 0,
/// replay_start), p]`, plus the sink logit in the denominator; `lse` excludes the sink.
///
/// - `q` `(T, H, 512)` float, RoPE'd; `sink` `(H)` float;
/// - `main_kv` `(N, 512)` float, or `(N, record bytes)` uint8 in `main_format` (a `Csa2Format`:
///   0 NVFP4-DS, 2 MXFP8, 3 V4; ignored for float); `swa` `(S, 512)` float or uint8 in `swa_format`,
///   row s = token s;
/// - `topk` `(T, K)` int32 (−1 = none), `topk_len` optional `(T)` int32 valid length per row;
/// - `positions` `(T)` int; `replay_start` optional `(1)` or `(T)` int window floor;
/// - `window` (128), `ratio` (0 = no visibility guard, else a selected entry must be
///   `< (p + 1) div ratio`), `scale` (not positive and finite → 512^-0.5);
/// - outputs `out` `(T, H, 512)` float and `lse` `(T, H)` float (a row with nothing attended: zeros
///   and −∞).
///
/// Errors: out-of-range or invisible top-k entry, SWA shorter than a position, a token attending
/// more than 65 536 rows (`MAX_TOKEN_ROWS`), non-finite `q`/`sink`, bad formats, a non-finite
/// result (a NaN/Inf KV row or an f32 overflow; `out` is then not valid), plus the common ones.
///
/// # Safety
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_attention(
    q: *const DLTensor,
    main_kv: *const DLTensor,
    main_format: i32,
    swa: *const DLTensor,
    swa_format: i32,
    topk: *const DLTensor,
    topk_len: *const DLTensor,
    positions: *const DLTensor,
    replay_start: *const DLTensor,
    sink: *const DLTensor,
    window: u32,
    ratio: u32,
    scale: f32,
    out: *const DLTensor,
    lse: *const DLTensor,
) -> Csa2Status {
    boundary("csa2_attention", || {
        // SAFETY: caller's contract (see above).
        let (qv, mv, sv, tv, lv, pv, rv, sinkv, mut ov, mut ev) = unsafe {
            (
                host(q, "q")?,
                host(main_kv, "main_kv")?,
                host(swa, "swa")?,
                host(topk, "topk")?,
                host_opt(topk_len, "topk_len")?,
                host(positions, "positions")?,
                host_opt(replay_start, "replay_start")?,
                host(sink, "sink")?,
                host(out, "out")?,
                host(lse, "lse")?,
            )
        };
        let mut dims = Dims::default();
        expect_attention_io(&qv, &sinkv, &ov, &ev, &mut dims)?;
        tv.expect(&[DType::I32], &[Dim::Any("T"), Dim::Any("K")], &mut dims)?;
        pv.expect(INTS, &[Dim::Any("T")], &mut dims)?;
        if let Some(l) = &lv {
            l.expect(&[DType::I32], &[Dim::Any("T")], &mut dims)?;
        }
        if let Some(r) = &rv {
            if r.shape() != [1] {
                r.expect(INTS, &[Dim::Any("T")], &mut dims)?;
            } else {
                r.expect(INTS, &[Dim::Fixed(1)], &mut dims)?;
            }
        }
        let mf = kv_pool(&mv, main_format, "N", "main_format")?;
        let sf = kv_pool(&sv, swa_format, "S", "swa_format")?;
        let mut inputs = vec![&qv, &mv, &sv, &tv, &pv, &sinkv];
        inputs.extend(lv.as_ref());
        inputs.extend(rv.as_ref());
        check_disjoint(&inputs, &[&ov, &ev])?;
        let params = AttentionParams {
            heads: qv.shape()[1],
            window: window as usize,
            scale: softmax_scale(scale),
            ratio: (ratio > 0).then_some(ratio as usize),
        };
        let (qf, kf, pos) = (qv.f32s()?, sinkv.f32s()?, pv.i64s()?);
        let rs = rv
            .as_ref()
            .map(|r| r.i64s())
            .transpose()?
            .unwrap_or_default();
        let (mut mff, mut sff) = (Cow::Borrowed(&[][..]), Cow::Borrowed(&[][..]));
        let main = kv_rows(&mv, mf, &mut mff)?;
        let swa = kv_rows(&sv, sf, &mut sff)?;
        let inp = AttentionInputs {
            q: &qf,
            topk: tv.i32s()?,
            topk_len: lv.as_ref().map(|l| l.i32s()).transpose()?,
            positions: &pos,
            replay_start: &rs,
            sink: &kf,
        };
        // Plan first so that no output is touched when a check fails.
        crate::ops::attention::plan(&params, &inp, &main, &swa)?;
        write_attention(&mut ov, &mut ev, |o, l| {
            crate::ops::attention::attention(&params, &inp, main, swa, o, l)
        })
    })
}

/// The shapes every attention export shares: `q` `(T, H, 512)`, `sink` `(H)`, `out` `(T, H, 512)`,
/// `lse` `(T, H)`, all float; binds `T` and `H` in `dims`.
fn expect_attention_io(
    q: &View<'_>,
    sink: &View<'_>,
    out: &View<'_>,
    lse: &View<'_>,
    dims: &mut Dims,
) -> Result<()> {
    let rows = [Dim::Any("T"), Dim::Any("H"), Dim::Fixed(KV_DIM)];
    q.expect(FLOATS, &rows, dims)?;
    sink.expect(FLOATS, &[Dim::Any("H")], dims)?;
    out.expect(FLOATS, &rows, dims)?;
    lse.expect(FLOATS, &[Dim::Any("T"), Dim::Any("H")], dims)
}

/// Runs an attention op into the `out` / `lse` views (converted to their float dtypes); the op
/// gets f32 buffers `(T, H, 512)` and `(T, H)`. A non-finite result is an error (see
/// [`finite_output`]), never a silent NaN.
fn write_attention(
    out: &mut View<'_>,
    lse: &mut View<'_>,
    f: impl FnOnce(&mut [f32], &mut [f32]) -> Result<()>,
) -> Result<()> {
    let heads = lse.shape().get(1).copied().unwrap_or(1);
    let mut lse_vals = vec![0.0f32; lse.numel()];
    fill_floats(out, |o| {
        f(o, &mut lse_vals)?;
        finite_output(o, &lse_vals, heads)
    })?;
    lse.write_f32s(&lse_vals)
}

/// No silent NaN: the inputs are checked before the op, but a KV record can still decode to
/// NaN/Inf (E4M3 0x7F, UE8M0 0xFF, an f32 pool holding NaN) or a legal extreme scale can overflow
/// f32, and FlashMLA would return the NaN. `out` is `(T, H, 512)`, `lse` `(T, H)`; −∞ in `lse` is a
/// token with nothing attended and is fine.
fn finite_output(out: &[f32], lse: &[f32], heads: usize) -> Result<()> {
    let bad = out.iter().position(|v| !v.is_finite()).map(|i| i / KV_DIM);
    let bad = bad.or_else(|| lse.iter().position(|v| v.is_nan() || *v == f32::INFINITY));
    match bad {
        None => Ok(()),
        Some(row) => Err(Error::invalid(
            "attention output",
            format!(
                "non-finite result at token {}, head {}: the KV rows it attends decode to \
                 NaN/Inf, or the scale overflows f32",
                row / heads.max(1),
                row % heads.max(1)
            ),
        )),
    }
}

/// The softmax scale of the attention exports: `scale` when positive and finite, else 512^-0.5.
fn softmax_scale(scale: f32) -> f32 {
    if scale > 0.0 && scale.is_finite() {
        scale
    } else {
        (KV_DIM as f32).sqrt().recip()
    }
}

/// Checks a KV pool argument: uint8 `(rows, record bytes)` in the `Csa2Format` `fmt` (returned),
/// or float `(rows, 512)` (`None`); `rows` names the row dim, `what` the format argument.
fn kv_pool(
    v: &View,
    fmt: i32,
    rows: &'static str,
    what: &'static str,
) -> Result<Option<RecordFormat>> {
    if v.dtype() == DType::U8 {
        let f = record_format(fmt, what)?;
        v.expect(
            &[DType::U8],
            &[Dim::Any(rows), Dim::Fixed(f.record_bytes())],
            &mut Dims::default(),
        )?;
        Ok(Some(f))
    } else {
        v.expect(
            FLOATS,
            &[Dim::Any(rows), Dim::Fixed(KV_DIM)],
            &mut Dims::default(),
        )?;
        Ok(None)
    }
}

/// The rows of a pool checked by [`kv_pool`]: records in place, or floats converted into `keep`.
fn kv_rows<'b, 'a: 'b>(
    v: &View<'a>,
    fmt: Option<RecordFormat>,
    keep: &'b mut Cow<'a, [f32]>,
) -> Result<KvRows<'b>> {
    Ok(match fmt {
        Some(f) => KvRows::Records(f, v.bytes()?),
        None => {
            *keep = v.f32s()?;
            let keep: &'b Cow<'a, [f32]> = keep;
            KvRows::F32(keep)
        }
    })
}

/// Sparse attention over explicit slot lists with a sink — the contract of FlashMLA's sparse
/// `flash_mla_with_kvcache(q, k_cache=swa, indices=swa_idx, topk_length=swa_len,
/// extra_k_cache=main, extra_indices_in_kvcache=main_idx, extra_topk_length=main_len, attn_sink,
/// softmax_scale)` as vLLM 0.33 `models/deepseek_v41/nvidia/flashmla.py` calls it: per token and
/// head one softmax over the rows `main_idx[t, :main_len[t]]` of `main_kv` then
/// `swa_idx[t, :swa_len[t]]` of `swa_kv` (−1 entries skipped; a repeated id is attended once per
/// occurrence), plus the sink logit in the denominator; `lse` excludes the sink (docs/SPEC.md §2
/// "Attention"). No positions, window or visibility here: the caller resolved them when it built
/// the lists (for one sequence, listing the window rows reproduces [`csa2_attention`] exactly).
///
/// - `q` `(T, H, 512)` float, RoPE'd; `sink` `(H)` float;
/// - `main_kv` `(N, 512)` float or `(N, record bytes)` uint8 in `main_format` (a `Csa2Format`:
///   0 NVFP4-DS, 2 MXFP8, 3 V4; ignored for float); `swa_kv` `(S, 512)` float or uint8 in
///   `swa_format`; either pool may have 0 rows;
/// - `main_idx` `(T, Km)` int32 rows of `main_kv`, `swa_idx` `(T, Ks)` int32 rows of `swa_kv`
///   (−1 = none; Km, Ks may be 0); `main_len` / `swa_len` optional `(T)` int32 valid lengths,
///   clamped to `[0, K]` (slots past them are ignored, whatever they hold; null = whole row);
/// - `scale` (not positive and finite → 512^-0.5);
/// - outputs `out` `(T, H, 512)` float and `lse` `(T, H)` float (a token with nothing attended:
///   zeros and −∞).
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` for a valid slot holding an id `< −1` or `≥` its pool's rows
/// (the message names the list, token, slot and id), a token attending more than 65 536 rows
/// (`MAX_TOKEN_ROWS`), non-finite `q`/`sink`, a bad format, a non-finite result (a NaN/Inf KV row
/// or an f32 overflow; `out` is then not valid); `CSA2_ERR_SHAPE` for T / H / length mismatches; plus the common ones.
///
/// # Safety
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_attention_indexed(
    q: *const DLTensor,
    main_kv: *const DLTensor,
    main_format: i32,
    main_idx: *const DLTensor,
    main_len: *const DLTensor,
    swa_kv: *const DLTensor,
    swa_format: i32,
    swa_idx: *const DLTensor,
    swa_len: *const DLTensor,
    sink: *const DLTensor,
    scale: f32,
    out: *const DLTensor,
    lse: *const DLTensor,
) -> Csa2Status {
    boundary("csa2_attention_indexed", || {
        // SAFETY: caller's contract (see above).
        let (qv, mv, miv, mlv, sv, siv, slv, sinkv, mut ov, mut ev) = unsafe {
            (
                host(q, "q")?,
                host(main_kv, "main_kv")?,
                host(main_idx, "main_idx")?,
                host_opt(main_len, "main_len")?,
                host(swa_kv, "swa_kv")?,
                host(swa_idx, "swa_idx")?,
                host_opt(swa_len, "swa_len")?,
                host(sink, "sink")?,
                host(out, "out")?,
                host(lse, "lse")?,
            )
        };
        let mut dims = Dims::default();
        expect_attention_io(&qv, &sinkv, &ov, &ev, &mut dims)?;
        miv.expect(&[DType::I32], &[Dim::Any("T"), Dim::Any("Km")], &mut dims)?;
        siv.expect(&[DType::I32], &[Dim::Any("T"), Dim::Any("Ks")], &mut dims)?;
        for l in mlv.iter().chain(&slv) {
            l.expect(&[DType::I32], &[Dim::Any("T")], &mut dims)?;
        }
        let mf = kv_pool(&mv, main_format, "N", "main_format")?;
        let sf = kv_pool(&sv, swa_format, "S", "swa_format")?;
        let mut inputs = vec![&qv, &mv, &miv, &sv, &siv, &sinkv];
        inputs.extend(mlv.as_ref());
        inputs.extend(slv.as_ref());
        check_disjoint(&inputs, &[&ov, &ev])?;
        let params = AttentionParams {
            heads: qv.shape()[1],
            scale: softmax_scale(scale),
            ..Default::default()
        };
        let (qf, kf) = (qv.f32s()?, sinkv.f32s()?);
        let (mut mff, mut sff) = (Cow::Borrowed(&[][..]), Cow::Borrowed(&[][..]));
        let main = kv_rows(&mv, mf, &mut mff)?;
        let swa = kv_rows(&sv, sf, &mut sff)?;
        let inp = IndexedInputs {
            q: &qf,
            sink: &kf,
            main_idx: miv.i32s()?,
            main_len: mlv.as_ref().map(|l| l.i32s()).transpose()?,
            swa_idx: siv.i32s()?,
            swa_len: slv.as_ref().map(|l| l.i32s()).transpose()?,
        };
        // Plan first so that no output is touched when a check fails.
        crate::ops::attention::plan_indexed(&params, &inp, &main, &swa)?;
        write_attention(&mut ov, &mut ev, |o, l| {
            crate::ops::attention::attention_indexed(&params, &inp, main, swa, o, l)
        })
    })
}

/// Scalars of [`csa2_mhc`] (docs/SPEC.md §4; config `hc_*`, `rms_norm_eps`). Pass null for the V4.1 values
/// (2.0, 20, 1e-6, 1e-20).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2MhcParams {
    /// Multiplier of the post sigmoid (2.0).
    pub post_mult: f32,
    /// Sinkhorn iterations, counting the first column normalization (20).
    pub sinkhorn_iters: u32,
    /// `hc_eps` (1e-6).
    pub hc_eps: f32,
    /// RMS epsilon of the mix statistic and the input RMSNorm (1e-20).
    pub rms_eps: f32,
}

/// One mHC boundary between two sublayer sites (docs/SPEC.md §4, V4.1 single-pass shift; fused CPU path):
///
/// ```text
/// x_new    = post ⊙ y + combᵀ · x                   (skipped when y/post/comb are null: x_new = x)
/// layer_in = RMSNorm(Σ_i pre_prev_i · x_new[i], norm)
/// (pre_out, post_out, comb_out) = coefficients(x_new; hc_fn, hc_base, hc_scale)   (when given)
/// ```
///
/// Shapes (d = stream width, from `norm`): `x` `(T, 4, d)`, `y` `(T, d)`, `post` `(T, 4)`, `comb`
/// `(T, 4, 4)` (`comb[t][i][j]` = weight of stream i in output j), `pre_prev` `(T, 4)`, `hc_fn`
/// `(24, 4d)`, `hc_base` `(24)`, `hc_scale` `(3)`, `norm` `(d)`, all float; outputs `x_new`
/// `(T, 4, d)`, `layer_in` `(T, d)`, `pre_out`/`post_out` `(T, 4)`, `comb_out` `(T, 4, 4)` float.
/// `y`, `post`, `comb` are given together or not at all; so are `hc_fn`, `hc_base`, `hc_scale`,
/// and then the three coefficient outputs are required.
///
/// Errors: a partial group, bad params (`CSA2_ERR_INVALID_ARGUMENT`), plus the common ones.
///
/// # Safety
/// `params` null or readable; tensors as in [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_mhc(
    params: *const Csa2MhcParams,
    x: *const DLTensor,
    y: *const DLTensor,
    post: *const DLTensor,
    comb: *const DLTensor,
    pre_prev: *const DLTensor,
    hc_fn: *const DLTensor,
    hc_base: *const DLTensor,
    hc_scale: *const DLTensor,
    norm: *const DLTensor,
    x_new: *const DLTensor,
    layer_in: *const DLTensor,
    pre_out: *const DLTensor,
    post_out: *const DLTensor,
    comb_out: *const DLTensor,
) -> Csa2Status {
    boundary("csa2_mhc", || {
        // SAFETY: caller's contract (see above).
        let (xv, yv, postv, combv, prev, fnv, basev, scalev, normv) = unsafe {
            (
                host(x, "x")?,
                host_opt(y, "y")?,
                host_opt(post, "post")?,
                host_opt(comb, "comb")?,
                host(pre_prev, "pre_prev")?,
                host_opt(hc_fn, "hc_fn")?,
                host_opt(hc_base, "hc_base")?,
                host_opt(hc_scale, "hc_scale")?,
                host(norm, "norm")?,
            )
        };
        // SAFETY: as above.
        let (mut xo, mut lo, po, qo, co) = unsafe {
            (
                host(x_new, "x_new")?,
                host(layer_in, "layer_in")?,
                host_opt(pre_out, "pre_out")?,
                host_opt(post_out, "post_out")?,
                host_opt(comb_out, "comb_out")?,
            )
        };
        let update = match (yv, postv, combv) {
            (Some(a), Some(b), Some(c)) => Some((a, b, c)),
            (None, None, None) => None,
            _ => {
                return Err(Error::invalid(
                    "y/post/comb",
                    "the post update needs all three tensors (or none at the first site)",
                ))
            }
        };
        let next = match (fnv, basev, scalev) {
            (Some(a), Some(b), Some(c)) => Some((a, b, c)),
            (None, None, None) => None,
            _ => return Err(Error::invalid(
                "hc_fn/hc_base/hc_scale",
                "the next site's mix weights need all three tensors (or none after the last site)",
            )),
        };
        let mut coeff_outs = match (po, qo, co) {
            (Some(a), Some(b), Some(c)) => Some((a, b, c)),
            (None, None, None) => None,
            _ => {
                return Err(Error::invalid(
                    "pre_out/post_out/comb_out",
                    "give all three coefficient outputs or none",
                ))
            }
        };
        if next.is_some() && coeff_outs.is_none() {
            return Err(Error::invalid(
                "pre_out/post_out/comb_out",
                "the mix weights are given, so the coefficient outputs are required",
            ));
        }
        // SAFETY: null or readable (caller's contract).
        let p = match unsafe { params.as_ref() } {
            None => MhcParams::new(normv.shape().first().copied().unwrap_or(0)),
            Some(c) => MhcParams {
                hidden: normv.shape().first().copied().unwrap_or(0),
                post_mult: c.post_mult,
                sinkhorn_iters: c.sinkhorn_iters as usize,
                hc_eps: c.hc_eps,
                rms_eps: c.rms_eps,
            },
        };
        let mut dims = Dims::default();
        normv.expect(FLOATS, &[Dim::Any("d")], &mut dims)?;
        p.validate()?;
        let d = p.hidden;
        let (t3, t4, t44) = (
            [Dim::Any("T"), Dim::Fixed(HC), Dim::Any("d")],
            [Dim::Any("T"), Dim::Fixed(HC)],
            [Dim::Any("T"), Dim::Fixed(HC), Dim::Fixed(HC)],
        );
        xv.expect(FLOATS, &t3, &mut dims)?;
        prev.expect(FLOATS, &t4, &mut dims)?;
        if let Some((a, b, c)) = &update {
            a.expect(FLOATS, &[Dim::Any("T"), Dim::Any("d")], &mut dims)?;
            b.expect(FLOATS, &t4, &mut dims)?;
            c.expect(FLOATS, &t44, &mut dims)?;
        }
        if let Some((a, b, c)) = &next {
            a.expect(FLOATS, &[Dim::Fixed(MIX), Dim::Fixed(HC * d)], &mut dims)?;
            b.expect(FLOATS, &[Dim::Fixed(MIX)], &mut dims)?;
            c.expect(FLOATS, &[Dim::Fixed(3)], &mut dims)?;
        }
        xo.expect(FLOATS, &t3, &mut dims)?;
        lo.expect(FLOATS, &[Dim::Any("T"), Dim::Any("d")], &mut dims)?;
        if let Some((a, b, c)) = &coeff_outs {
            a.expect(FLOATS, &t4, &mut dims)?;
            b.expect(FLOATS, &t4, &mut dims)?;
            c.expect(FLOATS, &t44, &mut dims)?;
        }
        let mut inputs = vec![&xv, &prev, &normv];
        if let Some((a, b, c)) = &update {
            inputs.extend([a, b, c]);
        }
        if let Some((a, b, c)) = &next {
            inputs.extend([a, b, c]);
        }
        let mut outputs = vec![&xo, &lo];
        if let Some((a, b, c)) = &coeff_outs {
            outputs.extend([a, b, c]);
        }
        check_disjoint(&inputs, &outputs)?;
        let (xf, pf, nf) = (xv.f32s()?, prev.f32s()?, normv.f32s()?);
        let upd = update
            .as_ref()
            .map(|(a, b, c)| Ok::<_, Error>((a.f32s()?, b.f32s()?, c.f32s()?)))
            .transpose()?;
        let mix = next
            .as_ref()
            .map(|(a, b, c)| Ok::<_, Error>((a.f32s()?, b.f32s()?, c.f32s()?)))
            .transpose()?;
        let inp = BoundaryIn {
            x: &xf,
            update: upd.as_ref().map(|(a, b, c)| PostUpdate {
                y: a,
                post: b,
                comb: c,
            }),
            pre_prev: &pf,
            next: mix.as_ref().map(|(a, b, c)| MixWeights {
                hc_fn: a,
                base: b,
                scale: c,
                packed: None,
            }),
            norm: &nf,
        };
        let r = mhc::boundary(&p, &inp, mhc::Path::Fused)?;
        xo.write_f32s(&r.x_new)?;
        lo.write_f32s(&r.layer_in)?;
        if let (Some((a, b, c)), Some(k)) = (&mut coeff_outs, &r.coeffs) {
            a.write_f32s(&k.pre)?;
            b.write_f32s(&k.post)?;
            c.write_f32s(&k.comb)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    //! Each export against a direct call of the op it wraps, on the same data: the wrappers must add
    //! checks, never change results.
    use super::super::dlpack::{DLDataType, DLDevice, K_DL_CPU};
    use super::*;
    use crate::geometry::Geometry;
    use csa2_rng::{rand_normal, NewRng, Rng};

    /// A float32/int/uint8 host descriptor over `data` with `shape` (kept alive by the caller).
    fn desc<T>(data: &mut [T], shape: &mut [i64], dtype: DType) -> DLTensor {
        let (code, bits) = dtype.code_bits();
        DLTensor {
            data: data.as_mut_ptr().cast(),
            device: DLDevice {
                device_type: K_DL_CPU,
                device_id: 0,
            },
            ndim: shape.len() as i32,
            dtype: DLDataType {
                code,
                bits,
                lanes: 1,
            },
            shape: shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        }
    }

    /// A registered geometry handle (`p`) and the geometry it holds (`g`), freed on drop.
    struct TestGeometry {
        p: *mut Csa2Geometry,
        g: Geometry,
    }

    impl Drop for TestGeometry {
        fn drop(&mut self) {
            unsafe { crate::ffi::csa2_geometry_free(self.p) };
        }
    }

    fn geometry() -> TestGeometry {
        let mut p = std::ptr::null_mut();
        assert_eq!(
            unsafe { crate::ffi::csa2_geometry_embedded(&mut p) },
            Csa2Status::Csa2Ok
        );
        TestGeometry {
            p,
            g: Geometry::embedded(),
        }
    }

    #[test]
    fn rope_export_equals_direct_call_and_checks_inverse() {
        let g = geometry();
        let mut rng = Rng::new(5);
        let x0 = rand_normal(&mut rng, 3 * 2 * 128, 1.0);
        let mut pos = vec![0i64, 127, 4096];
        let mut want = x0.clone();
        let rope = Rope::new(&g.g.layers[2].rope).unwrap();
        rope.apply(&mut want, 2, 128, &pos, Direction::Forward)
            .unwrap();
        let mut x = x0.clone();
        let (mut sx, mut sp) = ([3i64, 2, 128], [3i64]);
        let tx = desc(&mut x, &mut sx, DType::F32);
        let tp = desc(&mut pos, &mut sp, DType::I64);
        let st = unsafe { csa2_rope(g.p, 2, &tx, &tp, 0) };
        assert_eq!(st, Csa2Status::Csa2Ok);
        assert_eq!(x, want);
        assert_eq!(
            unsafe { csa2_rope(g.p, 2, &tx, &tp, 2) },
            Csa2Status::Csa2ErrInvalidArgument
        );
        assert_eq!(
            unsafe { csa2_rope(g.p, 999, &tx, &tp, 0) },
            Csa2Status::Csa2ErrInvalidArgument
        );
    }

    #[test]
    fn compress_export_equals_direct_call_and_refuses_a_split_pair() {
        let g = geometry();
        let layer = g.g.layers.iter().position(|l| l.ratio == 2).unwrap();
        let mut rng = Rng::new(6);
        let (t, e) = (4usize, 2usize);
        let mut kv = rand_normal(&mut rng, t * 512, 1.0);
        let mut score = rand_normal(&mut rng, t * 512, 1.0);
        let mut norm = vec![1.0f32; 512];
        let mut wk = rand_normal(&mut rng, 128 * 512, 0.04);
        let mut k_norm = vec![1.0f32; 128];
        let c = Compressor::new(
            2,
            g.g.rms_norm_eps,
            Rope::new(&g.g.layers[layer].rope).unwrap(),
            CompressorWeights {
                norm: &norm,
                wk: &wk,
                k_norm: &k_norm,
            },
        )
        .unwrap();
        let want = c
            .compress(&mut CompressorState::new(6), &kv, Some(&score))
            .unwrap();
        let (mut main, mut index) = (vec![0u8; e * 288], vec![0u8; e * 68]);
        let mut shapes = [
            vec![t as i64, 512],
            vec![t as i64, 512],
            vec![512],
            vec![128, 512],
            vec![128],
            vec![e as i64, 288],
            vec![e as i64, 68],
        ];
        let [s0, s1, s2, s3, s4, s5, s6] = &mut shapes;
        let d = [
            desc(&mut kv, s0, DType::F32),
            desc(&mut score, s1, DType::F32),
            desc(&mut norm, s2, DType::F32),
            desc(&mut wk, s3, DType::F32),
            desc(&mut k_norm, s4, DType::F32),
            desc(&mut main, s5, DType::U8),
            desc(&mut index, s6, DType::U8),
        ];
        let call = |start: i64| unsafe {
            csa2_compress(
                g.p,
                layer as u32,
                &d[0],
                &d[1],
                &d[2],
                &d[3],
                &d[4],
                start,
                &d[5],
                &d[6],
            )
        };
        assert_eq!(call(6), Csa2Status::Csa2Ok);
        assert_eq!(main, want.main_kv_nvfp4);
        assert_eq!(index, want.index_k_mxfp4);
        // A start inside a pair needs state this stateless call does not keep: refused.
        assert_eq!(call(7), Csa2Status::Csa2ErrInvalidArgument);
    }

    #[test]
    fn topk_and_candidates_exports_equal_direct_calls() {
        let mut rng = Rng::new(7);
        let (t, n, k) = (3usize, 40usize, 5usize);
        let mut logits = rand_normal(&mut rng, t * n, 1.0);
        let mut pos = vec![2i64, 17, 39];
        let vis: Vec<usize> = pos
            .iter()
            .map(|&p| crate::ops::indexer::visible(p, 1))
            .collect();
        let mut want = vec![0i32; t * k];
        let counts = crate::ops::topk::select_rows(&logits, n, &vis, &mut want).unwrap();
        let (mut out, mut cnt) = (vec![0i32; t * k], vec![0i32; t]);
        let (mut sl, mut sp, mut so, mut sc) = (
            [t as i64, n as i64],
            [t as i64],
            [t as i64, k as i64],
            [t as i64],
        );
        let tl = desc(&mut logits, &mut sl, DType::F32);
        let tp = desc(&mut pos, &mut sp, DType::I64);
        let to = desc(&mut out, &mut so, DType::I32);
        let tc = desc(&mut cnt, &mut sc, DType::I32);
        assert_eq!(
            unsafe { csa2_topk(&tl, &tp, 1, &to, &tc) },
            Csa2Status::Csa2Ok
        );
        assert_eq!(out, want);
        assert_eq!(cnt, counts.iter().map(|&c| c as i32).collect::<Vec<_>>());

        let p = CandidateParams {
            block_size: 4,
            num_blocks: 3,
        };
        let mut want = vec![0i32; t * 3];
        let lf = logits.clone();
        crate::ops::candidates::select_blocks_rows(&p, &lf, n, &vis, &mut want).unwrap();
        let mut blocks = vec![0i32; t * 3];
        let mut sb = [t as i64, 3];
        let tb = desc(&mut blocks, &mut sb, DType::I32);
        assert_eq!(
            unsafe { csa2_candidates(&tl, &tp, 1, 4, &tb) },
            Csa2Status::Csa2Ok
        );
        assert_eq!(blocks, want);
        // The counts output aliasing the logits is refused, naming both.
        let ta = desc(&mut logits[..t], &mut sc, DType::I32);
        assert_eq!(
            unsafe { csa2_topk(&tl, &tp, 1, &to, &ta) },
            Csa2Status::Csa2ErrInvalidArgument
        );
    }

    #[test]
    fn attention_indexed_export_equals_direct_call_and_checks_ids() {
        use crate::ops::attention::{attention_indexed, IndexedInputs};
        let mut rng = Rng::new(8);
        let (t, h, n, s, km, ks) = (3usize, 4usize, 6usize, 5usize, 4usize, 3usize);
        let mut q = rand_normal(&mut rng, t * h * 512, 1.0);
        let mut sink = rand_normal(&mut rng, h, 1.0);
        let main_f = rand_normal(&mut rng, n * 512, 1.0);
        let mut main = vec![0u8; n * 288];
        crate::formats::encode_rows(RecordFormat::Nvfp4Ds, &main_f, &mut main).unwrap();
        let mut swa = rand_normal(&mut rng, s * 512, 1.0);
        let mut mi = vec![0i32, 5, -1, 2, 3, 3, -1, -1, -1, -1, -1, -1];
        let mut si = vec![4i32, -1, 0, 1, 2, 9, -1, -1, -1];
        // Token 1's stale SWA id 9 sits behind its length of 2; token 2 attends nothing.
        let mut sl = vec![3i32, 2, 0];
        let mut want = vec![0f32; t * h * 512];
        let mut want_lse = vec![0f32; t * h];
        let p = AttentionParams {
            heads: h,
            ..Default::default()
        };
        let inp = IndexedInputs {
            q: &q,
            sink: &sink,
            main_idx: &mi,
            main_len: None,
            swa_idx: &si,
            swa_len: Some(&sl),
        };
        attention_indexed(
            &p,
            &inp,
            KvRows::Records(RecordFormat::Nvfp4Ds, &main),
            KvRows::F32(&swa),
            &mut want,
            &mut want_lse,
        )
        .unwrap();
        let (mut out, mut lse) = (vec![0f32; t * h * 512], vec![0f32; t * h]);
        let mut shapes = [
            vec![t as i64, h as i64, 512],
            vec![n as i64, 288],
            vec![t as i64, km as i64],
            vec![s as i64, 512],
            vec![t as i64, ks as i64],
            vec![t as i64],
            vec![h as i64],
            vec![t as i64, h as i64, 512],
            vec![t as i64, h as i64],
        ];
        let [s0, s1, s2, s3, s4, s5, s6, s7, s8] = &mut shapes;
        let d = [
            desc(&mut q, s0, DType::F32),
            desc(&mut main, s1, DType::U8),
            desc(&mut mi, s2, DType::I32),
            desc(&mut swa, s3, DType::F32),
            desc(&mut si, s4, DType::I32),
            desc(&mut sl, s5, DType::I32),
            desc(&mut sink, s6, DType::F32),
            desc(&mut out, s7, DType::F32),
            desc(&mut lse, s8, DType::F32),
        ];
        let call = |d: &[DLTensor; 9]| unsafe {
            csa2_attention_indexed(
                &d[0],
                &d[1],
                0,
                &d[2],
                std::ptr::null(),
                &d[3],
                2,
                &d[4],
                &d[5],
                &d[6],
                0.0,
                &d[7],
                &d[8],
            )
        };
        assert_eq!(call(&d), Csa2Status::Csa2Ok);
        assert_eq!(out, want);
        assert_eq!(lse, want_lse);
        assert!(lse[2 * h..].iter().all(|&v| v == f32::NEG_INFINITY));
        // Without the SWA lengths token 1's stale id 9 (of 5 rows) is read: refused, named, and
        // nothing written.
        out.fill(7.0);
        let st = unsafe {
            csa2_attention_indexed(
                &d[0],
                &d[1],
                0,
                &d[2],
                std::ptr::null(),
                &d[3],
                2,
                &d[4],
                std::ptr::null(),
                &d[6],
                0.0,
                &d[7],
                &d[8],
            )
        };
        assert_eq!(st, Csa2Status::Csa2ErrInvalidArgument);
        let n = unsafe { crate::ffi::csa2_last_error_message(std::ptr::null_mut(), 0) };
        let mut buf = vec![0 as std::ffi::c_char; n];
        unsafe { crate::ffi::csa2_last_error_message(buf.as_mut_ptr(), n) };
        let msg = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        assert!(
            msg.contains("swa_idx") && msg.contains("token 1, slot 2: row 9"),
            "{msg}"
        );
        assert!(out.iter().all(|&v| v == 7.0));
        // A length tensor of the wrong T is a shape error; an empty main pool with −1 ids is fine.
        let mut short = [2i64];
        let mut d2 = d;
        d2[5].shape = short.as_mut_ptr();
        assert_eq!(call(&d2), Csa2Status::Csa2ErrShape);
        let mut empty_shape = [0i64, 288];
        let mut holes = vec![-1i32; t * km];
        let mut d3 = d;
        d3[1].shape = empty_shape.as_mut_ptr();
        d3[2] = desc(&mut holes, s2, DType::I32);
        assert_eq!(call(&d3), Csa2Status::Csa2Ok);
        // No silent NaN: a NaN in an attended SWA row (token 0 reads row 4) is an error naming the
        // token, not a NaN output.
        swa[4 * 512 + 7] = f32::NAN;
        assert_eq!(call(&d), Csa2Status::Csa2ErrInvalidArgument);
        let n = unsafe { crate::ffi::csa2_last_error_message(std::ptr::null_mut(), 0) };
        let mut buf = vec![0 as std::ffi::c_char; n];
        unsafe { crate::ffi::csa2_last_error_message(buf.as_mut_ptr(), n) };
        let msg = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        assert!(msg.contains("non-finite result at token 0"), "{msg}");
    }
}
