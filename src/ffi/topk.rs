//! `csa2_topk`: the C face of [`crate::ops::topk`] (conventions: the op section of [`super`]).
//!
//! The export runs [`crate::ops::topk::select_rows_view`]: all tensors on one device — host
//! memory, or (feature `cuda`) one GPU with float32 logits — and one output order on both
//! (`ops::topk`'s order contract: a scored row by (logit desc, index asc), a row with ≤ K visible
//! entries `0..visible`).

use super::dlpack::{check_disjoint, DLTensor, View};
use super::{guarded, Csa2Status};
use crate::ops::topk::signature::{COUNTS_OUT, ERROR, LOGITS, OUT, POSITIONS};

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
    guarded("csa2_topk", || {
        // SAFETY: caller's contract (see above).
        let (lv, pv, mut ov, mut cv, _) = unsafe {
            row_select_views(
                logits,
                positions,
                (out, OUT.name),
                counts_out,
                std::ptr::null(),
            )
        }?;
        let mut counts = cv.as_mut().map(|c| c.tensor_mut()).transpose()?;
        crate::ops::topk::select_rows_view(
            lv.tensor(),
            pv.tensor(),
            ratio as usize,
            &mut ov.tensor_mut()?,
            counts.as_mut(),
        )
    })
}

/// Arguments of [`csa2_topk_on_stream`] (shapes there).
/// Set `struct_size` to `sizeof(Csa2TopkOnStreamArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2TopkOnStreamArgs {
    /// `sizeof(Csa2TopkOnStreamArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `(T, N)` float indexer logits (float32 on CUDA).
    pub logits: *const DLTensor,
    /// `(T)` int token positions (int32 or int64 on CUDA).
    pub positions: *const DLTensor,
    /// Compression ratio (≥ 1): row t sees `(positions[t] + 1) div ratio` entries.
    pub ratio: u32,
    /// Output `(T, K)` int32, −1 padded.
    pub out: *const DLTensor,
    /// Optional output `(T)` int32: entries selected per row.
    pub counts_out: *const DLTensor,
    /// Optional `[4]` int32 on the call's device: on CUDA the first negative position is
    /// recorded as `{1, row, 0, position}` (its row selects nothing); zero it once, read it
    /// whenever you sync. Untouched on the host, where a negative position is the error.
    pub error: *const DLTensor,
    /// `cudaStream_t` / `CUstream` to launch on (CUDA only; 0 = the legacy default stream).
    /// Borrowed: csa2 neither synchronizes nor keeps it.
    pub stream: u64,
}

args_struct!(Csa2TopkOnStreamArgs);

/// [`csa2_topk`] launched on the caller's CUDA stream (the capture-safe form, for a forward
/// captured in a CUDA graph): same selection and the same order (a scored row by (logit desc,
/// index asc), sorted in the kernel; a row with ≤ K visible entries `0..visible`). On `kDLCUDA`
/// tensors it returns after the launch: nothing is allocated, copied to or from the host, or
/// synchronized (load the modules first with `csa2_cuda_preload`); positions are read on the
/// device only, so a negative one is reported in `error`, not as a status. On `kDLCPU` tensors
/// it is [`csa2_topk`] (`stream` unused).
///
/// Errors: as [`csa2_topk`], plus `CSA2_ERR_UNSUPPORTED` for a CUDA K over 4096 (the in-kernel
/// sort's capacity) and `CSA2_ERR_CUDA` for a failed launch. Nothing is written on error.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2TopkOnStreamArgs`. Its members: each tensor
/// pointer null (where optional) or a readable `DLTensor` whose memory stays valid, and unused by
/// others, for the call (on CUDA: until the kernel has run on `stream`).
#[no_mangle]
pub unsafe extern "C" fn csa2_topk_on_stream(args: *const Csa2TopkOnStreamArgs) -> Csa2Status {
    guarded("csa2_topk_on_stream", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let a: Csa2TopkOnStreamArgs = unsafe { super::read_args(args) }?;
        // SAFETY: caller's contract (see above).
        let (lv, pv, mut ov, mut cv, mut ev) = unsafe {
            row_select_views(
                a.logits,
                a.positions,
                (a.out, OUT.name),
                a.counts_out,
                a.error,
            )
        }?;
        let mut counts = cv.as_mut().map(|c| c.tensor_mut()).transpose()?;
        let mut error = ev.as_mut().map(|e| e.tensor_mut()).transpose()?;
        crate::ops::topk::select_rows_view_on_stream(
            lv.tensor(),
            pv.tensor(),
            a.ratio as usize,
            &mut ov.tensor_mut()?,
            counts.as_mut(),
            error.as_mut(),
            a.stream,
        )
    })
}

/// The DLPack views of a row-selection export on the caller's stream (top-k, candidates):
/// `logits`, `positions`, the output named `out.1`, the optional counts and error record, the
/// outputs checked disjoint from each other and from the inputs.
///
/// # Safety
/// Each pointer null (where optional) or a readable `DLTensor` whose memory stays valid for 'a.
#[allow(clippy::type_complexity)]
pub(super) unsafe fn row_select_views<'a>(
    logits: *const DLTensor,
    positions: *const DLTensor,
    out: (*const DLTensor, &'static str),
    counts_out: *const DLTensor,
    error: *const DLTensor,
) -> crate::error::Result<(
    View<'a>,
    View<'a>,
    View<'a>,
    Option<View<'a>>,
    Option<View<'a>>,
)> {
    // SAFETY: this function's contract.
    let (lv, pv, ov, cv, ev) = unsafe {
        (
            View::from_raw(logits, LOGITS.name)?,
            View::from_raw(positions, POSITIONS.name)?,
            View::from_raw(out.0, out.1)?,
            View::from_raw_opt(counts_out, COUNTS_OUT.name)?,
            View::from_raw_opt(error, ERROR.name)?,
        )
    };
    let mut outs = vec![&ov];
    outs.extend(cv.as_ref());
    outs.extend(ev.as_ref());
    check_disjoint(&[&lv, &pv], &outs)?;
    Ok((lv, pv, ov, cv, ev))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::dlpack::DType;
    use crate::ffi::test_support::{desc, last_error};

    /// On host tensors the stream form is `csa2_topk`: same selection, same order, same counts;
    /// the error record is left alone, a negative position is the status and writes nothing, and
    /// a short `struct_size` is refused.
    #[test]
    fn on_stream_export_on_the_host_is_csa2_topk() {
        let (t, n, k) = (3usize, 700usize, 16usize);
        let mut logits: Vec<f32> = (0..t * n).map(|i| ((i * 7919) % 97) as f32 / 7.0).collect();
        logits[5] = f32::NAN;
        logits[9] = -0.0;
        let mut pos = vec![699i64, 9, 1397];
        let (mut want, mut want_c) = (vec![0i32; t * k], vec![0i32; t]);
        let (mut out, mut cnt, mut err) = (vec![0i32; t * k], vec![0i32; t], vec![5i32; 4]);
        let (mut sl, mut sp, mut so, mut sc, mut se) = (
            [t as i64, n as i64],
            [t as i64],
            [t as i64, k as i64],
            [t as i64],
            [4i64],
        );
        let tl = desc(&mut logits, &mut sl, DType::F32);
        let tp = desc(&mut pos, &mut sp, DType::I64);
        let two = desc(&mut want, &mut so, DType::I32);
        let twc = desc(&mut want_c, &mut sc, DType::I32);
        assert_eq!(
            unsafe { csa2_topk(&tl, &tp, 2, &two, &twc) },
            Csa2Status::Csa2Ok
        );
        let to = desc(&mut out, &mut so, DType::I32);
        let tc = desc(&mut cnt, &mut sc, DType::I32);
        let te = desc(&mut err, &mut se, DType::I32);
        let args = Csa2TopkOnStreamArgs {
            struct_size: std::mem::size_of::<Csa2TopkOnStreamArgs>(),
            logits: &tl,
            positions: &tp,
            ratio: 2,
            out: &to,
            counts_out: &tc,
            error: &te,
            stream: 0,
        };
        let small = Csa2TopkOnStreamArgs {
            struct_size: 16,
            ..args
        };
        assert_eq!(
            unsafe { csa2_topk_on_stream(&small) },
            Csa2Status::Csa2ErrInvalidArgument
        );
        assert!(last_error().contains("struct_size"), "{}", last_error());
        assert_eq!(
            unsafe { csa2_topk_on_stream(&args) },
            Csa2Status::Csa2Ok,
            "{}",
            last_error()
        );
        assert_eq!((&out, &cnt, &err), (&want, &want_c, &vec![5; 4]));
        let mut neg = vec![699i64, -1, 3];
        let tn = desc(&mut neg, &mut sp, DType::I64);
        out.fill(42);
        let bad = Csa2TopkOnStreamArgs {
            positions: &tn,
            ..args
        };
        assert_eq!(
            unsafe { csa2_topk_on_stream(&bad) },
            Csa2Status::Csa2ErrInvalidArgument
        );
        assert!(out.iter().all(|&v| v == 42), "written on error");
    }
}
