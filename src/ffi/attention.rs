//! `csa2_attention` and `csa2_attention_indexed`: the C face of [`crate::ops::attention`]
//! (conventions: the op section of [`super`]).

use super::dlpack::{check_disjoint, fill_floats, host, host_opt, DLTensor, DType, View};
use super::{guarded, Csa2Status};
use crate::error::{Error, Result};
use crate::formats::{RecordFormat, KV_DIM};
use crate::ops::attention::signature as sig;
use crate::ops::attention::{AttentionInputs, AttentionParams, IndexedInputs, KvRows};
use crate::shape::{Arg, Dims};
use std::borrow::Cow;

/// A 512-value record format (main KV or SWA) from its `Csa2Format` id.
fn record_format(v: i32, what: &'static str) -> Result<RecordFormat> {
    RecordFormat::from_abi_id(v, what)
        .ok()
        .filter(|f| f.dim() == KV_DIM)
        .ok_or_else(|| {
            Error::invalid(
                what,
                format!("{v} is not a 512-value Csa2Format (0 nvfp4, 2 mxfp8, 3 v4)"),
            )
        })
}

/// Arguments of [`csa2_attention`] (shapes there).
/// Set `struct_size` to `sizeof(Csa2AttentionArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2AttentionArgs {
    /// `sizeof(Csa2AttentionArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `(T, H, 512)` float queries.
    pub q: *const DLTensor,
    /// `(N, 512)` float or `(N, record bytes)` uint8 main-KV rows in `main_format`.
    pub main_kv: *const DLTensor,
    /// `Csa2Format` of `main_kv` records (0 NVFP4-DS, 2 MXFP8, 3 V4; ignored for float).
    pub main_format: i32,
    /// `(S, 512)` float or uint8 SWA rows in `swa_format`, row s = token s.
    pub swa: *const DLTensor,
    /// `Csa2Format` of `swa` records.
    pub swa_format: i32,
    /// `(T, K)` int32 selected entries (−1 = none).
    pub topk: *const DLTensor,
    /// Optional `(T)` int32 valid length per row (null: whole rows).
    pub topk_len: *const DLTensor,
    /// `(T)` int token positions.
    pub positions: *const DLTensor,
    /// Optional `(1)` or `(T)` int SWA window floor (null: none).
    pub replay_start: *const DLTensor,
    /// `(H)` float attention sink per head.
    pub sink: *const DLTensor,
    /// SWA window in tokens (128).
    pub window: u32,
    /// 0 = no visibility guard, else a selected entry must be `< (p + 1) div ratio`.
    pub ratio: u32,
    /// Softmax scale; not positive and finite → 512^-0.5.
    pub scale: f32,
    /// Output `(T, H, 512)` float.
    pub out: *const DLTensor,
    /// Output `(T, H)` float log-sum-exp (−∞ for a row that attends nothing).
    pub lse: *const DLTensor,
}

args_struct!(Csa2AttentionArgs);

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
/// `args`: `struct_size` readable bytes of a `Csa2AttentionArgs`. Its members:
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_attention(args: *const Csa2AttentionArgs) -> Csa2Status {
    guarded("csa2_attention", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let Csa2AttentionArgs {
            struct_size: _,
            q,
            main_kv,
            main_format,
            swa,
            swa_format,
            topk,
            topk_len,
            positions,
            replay_start,
            sink,
            window,
            ratio,
            scale,
            out,
            lse,
        } = unsafe { super::read_args(args) }?;
        // SAFETY: caller's contract (see above).
        let (qv, mv, sv, tv, lv, pv, rv, sinkv, mut ov, mut ev) = unsafe {
            (
                host(q, sig::Q.name)?,
                host(main_kv, sig::MAIN_KV.name)?,
                host(swa, sig::SWA.name)?,
                host(topk, sig::TOPK.name)?,
                host_opt(topk_len, sig::TOPK_LEN.name)?,
                host(positions, sig::POSITIONS.name)?,
                host_opt(replay_start, sig::REPLAY_START.name)?,
                host(sink, sig::SINK.name)?,
                host(out, sig::OUT.name)?,
                host(lse, sig::LSE.name)?,
            )
        };
        let mut dims = Dims::default();
        expect_attention_io(&qv, &sinkv, &ov, &ev, &mut dims)?;
        tv.expect(&sig::TOPK, &mut dims)?;
        pv.expect(&sig::POSITIONS, &mut dims)?;
        if let Some(l) = &lv {
            l.expect(&sig::TOPK_LEN, &mut dims)?;
        }
        if let Some(r) = &rv {
            if r.shape() != [1] {
                r.expect(&sig::REPLAY_START, &mut dims)?;
            } else {
                r.expect(&sig::REPLAY_START_ALL, &mut dims)?;
            }
        }
        let mf = kv_pool(&mv, main_format, MAIN_POOL, "main_format")?;
        let sf = kv_pool(&sv, swa_format, SWA_POOL, "swa_format")?;
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
    q.expect(&sig::Q, dims)?;
    sink.expect(&sig::SINK, dims)?;
    out.expect(&sig::OUT, dims)?;
    lse.expect(&sig::LSE, dims)
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

/// A KV pool argument's two forms (float rows, records) and the size name of its record width.
struct PoolForms {
    rows: Arg,
    records: Arg,
    record_bytes: &'static str,
}
const MAIN_POOL: PoolForms = PoolForms {
    rows: sig::MAIN_KV,
    records: sig::MAIN_KV_RECORDS,
    record_bytes: "main_record_bytes",
};
const SWA_POOL: PoolForms = PoolForms {
    rows: sig::SWA,
    records: sig::SWA_RECORDS,
    record_bytes: "swa_record_bytes",
};
const SWA_KV_POOL: PoolForms = PoolForms {
    rows: sig::SWA_KV,
    records: sig::SWA_KV_RECORDS,
    record_bytes: "swa_record_bytes",
};

/// Checks a KV pool argument: uint8 records in the `Csa2Format` `fmt` (returned), or float rows
/// (`None`); `what` names the format argument. Each pool binds its own row count.
fn kv_pool(
    v: &View,
    fmt: i32,
    forms: PoolForms,
    what: &'static str,
) -> Result<Option<RecordFormat>> {
    let mut dims = Dims::default();
    if v.dtype() == DType::U8 {
        let f = record_format(fmt, what)?;
        dims.bind(forms.record_bytes, f.record_bytes());
        v.expect(&forms.records, &mut dims)?;
        Ok(Some(f))
    } else {
        v.expect(&forms.rows, &mut dims)?;
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

/// Arguments of [`csa2_attention_indexed`] (shapes there).
/// Set `struct_size` to `sizeof(Csa2AttentionIndexedArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2AttentionIndexedArgs {
    /// `sizeof(Csa2AttentionIndexedArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `(T, H, 512)` float queries.
    pub q: *const DLTensor,
    /// `(N, 512)` float or `(N, record bytes)` uint8 main-KV pool in `main_format`.
    pub main_kv: *const DLTensor,
    /// `Csa2Format` of `main_kv` records.
    pub main_format: i32,
    /// `(T, K)` int32 rows of `main_kv` per token (−1 skipped).
    pub main_idx: *const DLTensor,
    /// Optional `(T)` int32 valid length of each `main_idx` row (null: whole rows).
    pub main_len: *const DLTensor,
    /// `(S, 512)` float or `(S, record bytes)` uint8 SWA pool in `swa_format`.
    pub swa_kv: *const DLTensor,
    /// `Csa2Format` of `swa_kv` records.
    pub swa_format: i32,
    /// `(T, W)` int32 rows of `swa_kv` per token (−1 skipped).
    pub swa_idx: *const DLTensor,
    /// Optional `(T)` int32 valid length of each `swa_idx` row (null: whole rows).
    pub swa_len: *const DLTensor,
    /// `(H)` float attention sink per head.
    pub sink: *const DLTensor,
    /// Softmax scale; not positive and finite → 512^-0.5.
    pub scale: f32,
    /// Output `(T, H, 512)` float.
    pub out: *const DLTensor,
    /// Output `(T, H)` float log-sum-exp.
    pub lse: *const DLTensor,
}

args_struct!(Csa2AttentionIndexedArgs);

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
/// `args`: `struct_size` readable bytes of a `Csa2AttentionIndexedArgs`. Its members:
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_attention_indexed(
    args: *const Csa2AttentionIndexedArgs,
) -> Csa2Status {
    guarded("csa2_attention_indexed", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let Csa2AttentionIndexedArgs {
            struct_size: _,
            q,
            main_kv,
            main_format,
            main_idx,
            main_len,
            swa_kv,
            swa_format,
            swa_idx,
            swa_len,
            sink,
            scale,
            out,
            lse,
        } = unsafe { super::read_args(args) }?;
        // SAFETY: caller's contract (see above).
        let (qv, mv, miv, mlv, sv, siv, slv, sinkv, mut ov, mut ev) = unsafe {
            (
                host(q, sig::Q.name)?,
                host(main_kv, sig::MAIN_KV.name)?,
                host(main_idx, sig::MAIN_IDX.name)?,
                host_opt(main_len, sig::MAIN_LEN.name)?,
                host(swa_kv, sig::SWA_KV.name)?,
                host(swa_idx, sig::SWA_IDX.name)?,
                host_opt(swa_len, sig::SWA_LEN.name)?,
                host(sink, sig::SINK.name)?,
                host(out, sig::OUT.name)?,
                host(lse, sig::LSE.name)?,
            )
        };
        let mut dims = Dims::default();
        expect_attention_io(&qv, &sinkv, &ov, &ev, &mut dims)?;
        miv.expect(&sig::MAIN_IDX, &mut dims)?;
        siv.expect(&sig::SWA_IDX, &mut dims)?;
        if let Some(l) = &mlv {
            l.expect(&sig::MAIN_LEN, &mut dims)?;
        }
        if let Some(l) = &slv {
            l.expect(&sig::SWA_LEN, &mut dims)?;
        }
        let mf = kv_pool(&mv, main_format, MAIN_POOL, "main_format")?;
        let sf = kv_pool(&sv, swa_format, SWA_KV_POOL, "swa_format")?;
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
