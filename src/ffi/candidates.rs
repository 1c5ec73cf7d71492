//! `csa2_candidates`, `csa2_candidates_on_stream`: the C face of [`crate::ops::candidates`]
//! (conventions: the op section of [`super`]).
//!
//! Both run [`crate::ops::candidates::select_blocks_view`] (the stream form
//! [`crate::ops::candidates::select_blocks_view_on_stream`]): all tensors on one device — host
//! memory, or (feature `cuda`) one GPU with float32 logits — and one output on both (per row the
//! kept blocks sorted by (score desc, id asc), −1 padded).

use super::dlpack::{check_disjoint, DLTensor, View};
use super::{guarded, Csa2Status};
use crate::ops::candidates::signature::{BLOCKS_OUT, LOGITS, POSITIONS};
use crate::ops::candidates::CandidateParams;

/// Hierarchical candidate pool of the candidate-source layer (docs/SPEC.md §2 "Candidate pool"): per row,
/// blocks of `block_size` entries scored by their max visible logit, the newest block pinned, the
/// best `B` kept sorted (score desc, id asc), −1 padded.
///
/// `logits` `(T, N)` float, `positions` `(T)` int (visible = `(p + 1) div ratio`), `blocks_out`
/// `(T, B)` int32 (B = blocks kept, 2048 in V4.1). Host tensors, or `kDLCUDA` tensors on one
/// device in a build with the `cuda` feature (float32 logits, B ≤ 4096; the call waits for the
/// GPU). Errors: ratio/block_size/B of 0, negative position, plus the common ones.
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
    guarded("csa2_candidates", || {
        // SAFETY: caller's contract (see above).
        let (lv, pv, mut ov) = unsafe {
            (
                View::from_raw(logits, LOGITS.name)?,
                View::from_raw(positions, POSITIONS.name)?,
                View::from_raw(blocks_out, BLOCKS_OUT.name)?,
            )
        };
        check_disjoint(&[&lv, &pv], &[&ov])?;
        let mut out = ov.tensor_mut()?;
        let p = CandidateParams {
            block_size: block_size as usize,
            num_blocks: out.shape().get(1).copied().unwrap_or(0),
        };
        crate::ops::candidates::select_blocks_view(
            &p,
            lv.tensor(),
            pv.tensor(),
            ratio as usize,
            &mut out,
            None,
        )
    })
}

/// Arguments of [`csa2_candidates_on_stream`] (shapes there).
/// Set `struct_size` to `sizeof(Csa2CandidatesOnStreamArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2CandidatesOnStreamArgs {
    /// `sizeof(Csa2CandidatesOnStreamArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `(T, N)` float indexer logits of the candidate-source layer (float32 on CUDA).
    pub logits: *const DLTensor,
    /// `(T)` int token positions (int32 or int64 on CUDA).
    pub positions: *const DLTensor,
    /// Compression ratio (≥ 1): row t sees `(positions[t] + 1) div ratio` entries.
    pub ratio: u32,
    /// Entries per block (≥ 1; 8 in V4.1).
    pub block_size: u32,
    /// Output `(T, B)` int32: the kept blocks, sorted by (score desc, id asc), −1 padded
    /// (B = blocks kept, 2048 in V4.1).
    pub blocks_out: *const DLTensor,
    /// Optional output `(T)` int32: blocks kept per row.
    pub counts_out: *const DLTensor,
    /// Optional `[4]` int32 on the call's device: on CUDA the first negative position is
    /// recorded as `{1, row, 0, position}` (its row keeps nothing); zero it once, read it
    /// whenever you sync. Untouched on the host, where a negative position is the error.
    pub error: *const DLTensor,
    /// `cudaStream_t` / `CUstream` to launch on (CUDA only; 0 = the legacy default stream).
    /// Borrowed: csa2 neither synchronizes nor keeps it.
    pub stream: u64,
}

args_struct!(Csa2CandidatesOnStreamArgs);

/// [`csa2_candidates`] launched on the caller's CUDA stream (the capture-safe form, for a
/// forward captured in a CUDA graph), with the kept count per row: the same lists in the same
/// order, sorted in the kernel. On `kDLCUDA` tensors it returns after the launch: nothing is
/// allocated, copied to or from the host, or synchronized (load the modules first with
/// `csa2_cuda_preload`); positions are read on the device only, so a negative one is reported in
/// `error`, not as a status. On `kDLCPU` tensors it is [`csa2_candidates`] (`stream` unused).
///
/// Errors: as [`csa2_candidates`], plus `CSA2_ERR_UNSUPPORTED` for a CUDA B over 4096 (the
/// in-kernel sort's capacity) and `CSA2_ERR_CUDA` for a failed launch. Nothing is written on
/// error.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2CandidatesOnStreamArgs`. Its members: each
/// tensor pointer null (where optional) or a readable `DLTensor` whose memory stays valid, and
/// unused by others, for the call (on CUDA: until the kernel has run on `stream`).
#[no_mangle]
pub unsafe extern "C" fn csa2_candidates_on_stream(
    args: *const Csa2CandidatesOnStreamArgs,
) -> Csa2Status {
    guarded("csa2_candidates_on_stream", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let a: Csa2CandidatesOnStreamArgs = unsafe { super::read_args(args) }?;
        // SAFETY: caller's contract (see above).
        let (lv, pv, mut ov, mut cv, mut ev) = unsafe {
            super::topk::row_select_views(
                a.logits,
                a.positions,
                (a.blocks_out, BLOCKS_OUT.name),
                a.counts_out,
                a.error,
            )
        }?;
        let mut out = ov.tensor_mut()?;
        let mut counts = cv.as_mut().map(|c| c.tensor_mut()).transpose()?;
        let mut error = ev.as_mut().map(|e| e.tensor_mut()).transpose()?;
        let p = CandidateParams {
            block_size: a.block_size as usize,
            num_blocks: out.shape().get(1).copied().unwrap_or(0),
        };
        crate::ops::candidates::select_blocks_view_on_stream(
            &p,
            lv.tensor(),
            pv.tensor(),
            a.ratio as usize,
            &mut out,
            counts.as_mut(),
            error.as_mut(),
            a.stream,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::dlpack::DType;
    use crate::ffi::test_support::{desc, last_error};

    /// On host tensors the stream form is `csa2_candidates` plus counts: same lists, same order;
    /// the error record is left alone, a negative position is the status and writes nothing, a
    /// B mismatch between the outputs and a short `struct_size` are refused.
    #[test]
    fn on_stream_export_on_the_host_is_csa2_candidates() {
        let (t, n, b) = (4usize, 300usize, 8usize);
        let mut logits: Vec<f32> = (0..t * n).map(|i| ((i * 7919) % 97) as f32 / 7.0).collect();
        logits[5] = f32::NAN;
        logits[9] = -0.0;
        logits[2 * n..3 * n].fill(f32::NEG_INFINITY);
        let mut pos = vec![299i64, 9, 250, 0];
        let mut want = vec![0i32; t * b];
        let (mut out, mut cnt, mut err) = (vec![0i32; t * b], vec![0i32; t], vec![5i32; 4]);
        let (mut sl, mut sp, mut so, mut sc, mut se) = (
            [t as i64, n as i64],
            [t as i64],
            [t as i64, b as i64],
            [t as i64],
            [4i64],
        );
        let tl = desc(&mut logits, &mut sl, DType::F32);
        let tp = desc(&mut pos, &mut sp, DType::I64);
        let tw = desc(&mut want, &mut so, DType::I32);
        assert_eq!(
            unsafe { csa2_candidates(&tl, &tp, 2, 4, &tw) },
            Csa2Status::Csa2Ok,
            "{}",
            last_error()
        );
        let to = desc(&mut out, &mut so, DType::I32);
        let tc = desc(&mut cnt, &mut sc, DType::I32);
        let te = desc(&mut err, &mut se, DType::I32);
        let args = Csa2CandidatesOnStreamArgs {
            struct_size: std::mem::size_of::<Csa2CandidatesOnStreamArgs>(),
            logits: &tl,
            positions: &tp,
            ratio: 2,
            block_size: 4,
            blocks_out: &to,
            counts_out: &tc,
            error: &te,
            stream: 0,
        };
        let small = Csa2CandidatesOnStreamArgs {
            struct_size: 16,
            ..args
        };
        assert_eq!(
            unsafe { csa2_candidates_on_stream(&small) },
            Csa2Status::Csa2ErrInvalidArgument
        );
        assert!(last_error().contains("struct_size"), "{}", last_error());
        assert_eq!(
            unsafe { csa2_candidates_on_stream(&args) },
            Csa2Status::Csa2Ok,
            "{}",
            last_error()
        );
        assert_eq!((&out, &err), (&want, &vec![5; 4]));
        let kept: Vec<i32> = want
            .chunks(b)
            .map(|r| r.iter().filter(|&&x| x >= 0).count() as i32)
            .collect();
        assert_eq!(cnt, kept);
        assert_eq!(
            &want[2 * b..3 * b],
            &[31, -1, -1, -1, -1, -1, -1, -1],
            "−∞ row: pin"
        );
        assert_eq!(&want[3 * b..], &[-1; 8], "nothing visible");
        let mut neg = vec![299i64, -1, 3, 4];
        let tn = desc(&mut neg, &mut sp, DType::I64);
        out.fill(42);
        cnt.fill(42);
        let bad = Csa2CandidatesOnStreamArgs {
            positions: &tn,
            ..args
        };
        assert_eq!(
            unsafe { csa2_candidates_on_stream(&bad) },
            Csa2Status::Csa2ErrInvalidArgument
        );
        assert!(out.iter().chain(&cnt).all(|&v| v == 42), "written on error");
        // A zero block size is refused by name.
        let zero = Csa2CandidatesOnStreamArgs {
            block_size: 0,
            ..args
        };
        assert_eq!(
            unsafe { csa2_candidates_on_stream(&zero) },
            Csa2Status::Csa2ErrInvalidArgument
        );
        assert!(last_error().contains("block_size"), "{}", last_error());
    }
}
