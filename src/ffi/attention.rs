//! `csa2_attention` and `csa2_attention_indexed`: the C face of [`crate::ops::attention`]
//! (conventions: the op section of [`super`]).

use super::dlpack::{check_disjoint, fill_floats, host, host_opt, DLTensor, DType, View};
use super::{guarded, Csa2Status};
use crate::error::{Error, Result};
use crate::formats::{RecordFormat, KV_DIM};
use crate::ops::attention::signature as sig;
use crate::ops::attention::{AttentionInputs, AttentionParams, IndexedViews, KvRows, KvView};
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
        crate::ops::attention::finite_output(o, &lse_vals, heads)
    })?;
    lse.write_f32s(&lse_vals)
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
    /// `kDLCUDA` tensors only: the `cudaStream_t` / `CUstream` to launch on (0 = the legacy
    /// default stream). Ignored for host tensors. Added after the first version: a caller
    /// compiled without it gets 0.
    pub stream: u64,
}

args_struct!(Csa2AttentionIndexedArgs, grown_at = stream);

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
/// Devices ([`crate::ops::attention::attention_indexed_view`]): all tensors in host memory, or
/// all on one CUDA device (`kDLCUDA`, a build with the `cuda` feature): then csa2's pool kernel
/// runs on `stream` and the call returns after the launch. The CUDA path takes bfloat16 `q` /
/// `out`, float32 `sink` / `lse`, record pools, 64 or 128 heads; it skips slots past a pool
/// instead of reporting them and does not scan the result for NaN.
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
            stream,
        } = unsafe { super::read_args(args) }?;
        // SAFETY: caller's contract (see above).
        let (qv, mv, miv, mlv, sv, siv, slv, sinkv, mut ov, mut ev) = unsafe {
            (
                View::from_raw(q, sig::Q.name)?,
                View::from_raw(main_kv, sig::MAIN_KV.name)?,
                View::from_raw(main_idx, sig::MAIN_IDX.name)?,
                View::from_raw_opt(main_len, sig::MAIN_LEN.name)?,
                View::from_raw(swa_kv, sig::SWA_KV.name)?,
                View::from_raw(swa_idx, sig::SWA_IDX.name)?,
                View::from_raw_opt(swa_len, sig::SWA_LEN.name)?,
                View::from_raw(sink, sig::SINK.name)?,
                View::from_raw(out, sig::OUT.name)?,
                View::from_raw(lse, sig::LSE.name)?,
            )
        };
        let mut dims = Dims::default();
        expect_attention_io(&qv, &sinkv, &ov, &ev, &mut dims)?;
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
        let views = IndexedViews {
            q: qv.tensor(),
            main: KvView {
                rows: mv.tensor(),
                format: mf,
            },
            main_idx: miv.tensor(),
            main_len: mlv.as_ref().map(|l| l.tensor()),
            swa: KvView {
                rows: sv.tensor(),
                format: sf,
            },
            swa_idx: siv.tensor(),
            swa_len: slv.as_ref().map(|l| l.tensor()),
            sink: sinkv.tensor(),
        };
        crate::ops::attention::attention_indexed_view(
            &params,
            &views,
            stream,
            &mut ov.tensor_mut()?,
            &mut ev.tensor_mut()?,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::dlpack::K_DL_CUDA;
    use crate::ffi::test_support::{host_tensor, last_error};

    /// `csa2_attention_indexed` on one token of 16 heads over 2 NVFP4-DS main rows and 2 MXFP8 SWA
    /// rows; `cuda` lists the arguments (0 q, 1 main_kv, 2 main_idx, 3 swa_kv, 4 swa_idx, 5 sink,
    /// 6 out, 7 lse) whose descriptor claims `kDLCUDA` memory (never dereferenced: those calls fail
    /// first).
    fn indexed_on(cuda: &[usize]) -> Csa2Status {
        let (t, h) = (1usize, 16usize);
        let mut q = vec![0.1f32; t * h * KV_DIM];
        let mut sink = vec![0f32; h];
        let mut main = vec![0u8; 2 * 288];
        let mut swa = vec![0u8; 2 * 528];
        crate::formats::encode_rows(RecordFormat::Nvfp4Ds, &[0.25; 2 * KV_DIM], &mut main).unwrap();
        crate::formats::encode_rows(RecordFormat::Mxfp8, &[0.5; 2 * KV_DIM], &mut swa).unwrap();
        let (mut mi, mut si) = (vec![0i32, 1], vec![1i32]);
        let mut out = vec![0f32; t * h * KV_DIM];
        let mut lse = vec![0f32; t * h];
        let mut shapes = [
            vec![t as i64, h as i64, 512],
            vec![2, 288],
            vec![t as i64, 2],
            vec![2, 528],
            vec![t as i64, 1],
            vec![h as i64],
            vec![t as i64, h as i64, 512],
            vec![t as i64, h as i64],
        ];
        let (f, u, i) = (
            DType::F32.code_bits(),
            DType::U8.code_bits(),
            DType::I32.code_bits(),
        );
        let [s0, s1, s2, s3, s4, s5, s6, s7] = &mut shapes;
        let mut d = [
            host_tensor(q.as_mut_ptr().cast(), f.0, f.1, s0, None),
            host_tensor(main.as_mut_ptr().cast(), u.0, u.1, s1, None),
            host_tensor(mi.as_mut_ptr().cast(), i.0, i.1, s2, None),
            host_tensor(swa.as_mut_ptr().cast(), u.0, u.1, s3, None),
            host_tensor(si.as_mut_ptr().cast(), i.0, i.1, s4, None),
            host_tensor(sink.as_mut_ptr().cast(), f.0, f.1, s5, None),
            host_tensor(out.as_mut_ptr().cast(), f.0, f.1, s6, None),
            host_tensor(lse.as_mut_ptr().cast(), f.0, f.1, s7, None),
        ];
        for &k in cuda {
            d[k].device.device_type = K_DL_CUDA;
        }
        unsafe {
            csa2_attention_indexed(&Csa2AttentionIndexedArgs {
                q: &d[0],
                main_kv: &d[1],
                main_format: RecordFormat::Nvfp4Ds.abi_id(),
                main_idx: &d[2],
                swa_kv: &d[3],
                swa_format: RecordFormat::Mxfp8.abi_id(),
                swa_idx: &d[4],
                sink: &d[5],
                out: &d[6],
                lse: &d[7],
                ..Default::default()
            })
        }
    }

    /// One `kDLCUDA` tensor among host ones is a device mismatch naming it (before the export
    /// dispatched by device it was "built without CUDA" / "needs host memory").
    #[test]
    fn indexed_refuses_mixed_devices() {
        assert_eq!(indexed_on(&[]), Csa2Status::Csa2Ok);
        assert_eq!(indexed_on(&[4]), Csa2Status::Csa2ErrInvalidArgument);
        let msg = last_error();
        assert!(
            msg.contains("swa_idx") && msg.contains("share a device"),
            "{msg}"
        );
    }

    /// All tensors on CUDA in a build without the feature: unsupported, saying how to get it.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn indexed_on_cuda_without_the_feature_says_rebuild() {
        assert_eq!(
            indexed_on(&[0, 1, 2, 3, 4, 5, 6, 7]),
            Csa2Status::Csa2ErrNoCudaBuild
        );
        assert!(last_error().contains("--features cuda"), "{}", last_error());
    }
}
