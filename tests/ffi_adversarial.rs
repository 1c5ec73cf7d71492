//! The C ABI as a hostile caller uses it: counts no buffer can hold, null / stale /
//! freed / foreign handles, one engine from several threads and a free racing its steps, tensors
//! of the wrong dtype, shape, strides or device, non-contiguous, zero-size and overlapping ones,
//! dims whose products overflow, args structs smaller and larger than the header's, and damaged
//! store directories. Every case must come back as a typed status with a message naming the
//! argument, write no output, and leave the object as it was: after the refusals an engine's next
//! step equals that of a twin that never saw them, bit for bit.
//!
//! Breaks found and fixed: a pointer-and-count argument whose count spans more than `isize::MAX`
//! bytes went straight into `slice::from_raw_parts` (undefined behaviour; the test binary aborted
//! on Rust's precondition check; `counts_no_buffer_can_hold_are_refused_before_a_slice_is_made`),
//! now refused by `ffi::check_span`; an engine step of zero sequences was OK although the
//! contract says `n_seqs` ≥ 1 (`engine_step_refuses_hostile_tensors_and_changes_nothing`).

use crate::ffi_support::{geometry, last_error, HostTensor};
use csa2::ffi::dlpack::{DLDataType, DLTensor, K_DL_CUDA};
use csa2::ffi::*;
use csa2::tensor::DType;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn ok(s: Csa2Status) {
    assert_eq!(s, Csa2Status::Csa2Ok, "{}", last_error());
}

#[track_caller]
fn refused(s: Csa2Status, want: Csa2Status, needle: &str) {
    let msg = last_error();
    assert_eq!(s, want, "{msg}");
    assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
}

fn engine(blocks: usize) -> *mut Csa2Engine {
    let args = Csa2EngineCreateArgs {
        seed: 1,
        num_blocks: blocks,
        ..Default::default()
    };
    let mut e = null_mut();
    ok(unsafe { csa2_engine_create(&args, &mut e) });
    e
}

fn hidden_size(e: *const Csa2Engine) -> usize {
    let mut i = Csa2EngineInfo::default();
    ok(unsafe { csa2_engine_info(e, &mut i) });
    i.hidden_size as usize
}

fn stats(e: *const Csa2Engine) -> Csa2EngineStats {
    let mut s = Csa2EngineStats::default();
    ok(unsafe { csa2_engine_stats(e, &mut s) });
    s
}

fn prefill_seq(req: u64, n: usize) -> Csa2EngineSeq {
    Csa2EngineSeq {
        req,
        len: n as u64,
        phase: Csa2EnginePhase::Csa2PhasePrefill as i32,
        prompt_end: n as u64,
        ..Default::default()
    }
}

fn decode_seq(req: u64, pos: usize) -> Csa2EngineSeq {
    Csa2EngineSeq {
        req,
        first_pos: pos as u64,
        len: 1,
        phase: Csa2EnginePhase::Csa2PhaseDecode as i32,
        cached_until: pos as u64,
        ..Default::default()
    }
}

fn tokens(req: u64, from: usize, n: usize) -> HostTensor<i64> {
    let t: Vec<i64> = (from..from + n)
        .map(|q| ((req as i64 + 1) * 7919 + q as i64 * 31) % 50_000)
        .collect();
    HostTensor::new(t, &[n as i64], DType::I64)
}

/// One step into a fresh `[rows, d]` float32 output; the hidden state on success.
fn run(e: *const Csa2Engine, seqs: &[Csa2EngineSeq], tok: &mut HostTensor<i64>) -> Vec<f32> {
    let d = hidden_size(e);
    let t = tok.dl();
    let mut args = Csa2EngineStepArgs {
        seqs: seqs.as_ptr(),
        n_seqs: seqs.len(),
        tokens: &t,
        ..Default::default()
    };
    let mut rows = 0usize;
    ok(unsafe { csa2_engine_step(e, &args, &mut rows) });
    let mut h = HostTensor::new(
        vec![f32::NAN; rows * d],
        &[rows as i64, d as i64],
        DType::F32,
    );
    let hd = h.dl();
    args.hidden = &hd;
    ok(unsafe { csa2_engine_step(e, &args, &mut rows) });
    assert!(h.data.iter().all(|x| x.is_finite()), "no NaN out of a step");
    h.data
}

/// A pointer-and-count argument whose count no buffer can have (more than `isize::MAX` bytes) is
/// refused by its count, before a slice is made. Before the fix each call here aborted the process
/// (`slice::from_raw_parts`' precondition check) and, in a release build, was undefined behaviour.
#[test]
fn counts_no_buffer_can_hold_are_refused_before_a_slice_is_made() {
    let json = b"{}";
    let mut g = null_mut();
    refused(
        unsafe { csa2_geometry_from_json(json.as_ptr().cast(), usize::MAX, &mut g) },
        Csa2Status::Csa2ErrInvalidArgument,
        "exceed the address space",
    );
    assert!(g.is_null());
    let x = [0f32; 4];
    let mut out = [0u8; 4];
    refused(
        unsafe { csa2_encode_rows(0, x.as_ptr(), usize::MAX / 2, out.as_mut_ptr(), 4) },
        Csa2Status::Csa2ErrInvalidArgument,
        "address space",
    );
    refused(
        unsafe { csa2_encode_rows(0, x.as_ptr(), 4, out.as_mut_ptr(), usize::MAX) },
        Csa2Status::Csa2ErrInvalidArgument,
        "address space",
    );
    assert_eq!(out, [0; 4]);
    let e = engine(2);
    let seqs = [decode_seq(1, 0)];
    let mut tok = tokens(1, 0, 1);
    let t = tok.dl();
    let args = Csa2EngineStepArgs {
        seqs: seqs.as_ptr(),
        n_seqs: usize::MAX / 8,
        tokens: &t,
        ..Default::default()
    };
    let mut rows = 77usize;
    refused(
        unsafe { csa2_engine_step(e, &args, &mut rows) },
        Csa2Status::Csa2ErrInvalidArgument,
        "seqs",
    );
    assert_eq!((rows, stats(e).requests), (77, 0));
    ok(unsafe { csa2_engine_free(e) });
}

/// Every tensor a hostile caller can hand `csa2_engine_step` instead of the right one: a typed
/// status naming the argument, `rows_out` and the outputs untouched, and the engine unchanged (its
/// stats, and its next decode equal to a twin's).
#[test]
fn engine_step_refuses_hostile_tensors_and_changes_nothing() {
    let (e, twin) = (engine(2), engine(2));
    let d = hidden_size(e);
    let n = 8;
    assert_eq!(
        run(e, &[prefill_seq(1, n)], &mut tokens(1, 0, n)),
        run(twin, &[prefill_seq(1, n)], &mut tokens(1, 0, n))
    );
    let before = stats(e);
    let dec = [decode_seq(1, n)];
    // A two-row prefill of a request not yet open: if a refused call ran, it would open it.
    let two = [prefill_seq(9, 2)];
    let sentinel = -7.5f32;
    type Mutate = fn(&mut HostTensor<i64>, &mut HostTensor<f32>);
    let cases: Vec<(&str, &[Csa2EngineSeq], Mutate, Csa2Status, &str)> = vec![
        (
            "float token ids",
            &dec,
            |t, _| {
                t.dtype = DLDataType {
                    code: 2,
                    bits: 32,
                    lanes: 1,
                }
            },
            Csa2Status::Csa2ErrShape,
            "tokens.dtype",
        ),
        (
            "a four-lane dtype",
            &dec,
            |t, _| t.dtype.lanes = 4,
            Csa2Status::Csa2ErrInvalidArgument,
            "tokens.dtype",
        ),
        (
            "a dim whose byte count overflows",
            &dec,
            |t, _| t.shape = vec![1 << 62],
            Csa2Status::Csa2ErrShape,
            "overflows",
        ),
        (
            "a zero dim beside one of 2^62 × 64",
            &dec,
            |t, _| t.shape = vec![0, 1 << 62, 64],
            Csa2Status::Csa2ErrShape,
            "overflows",
        ),
        (
            "ndim 9",
            &dec,
            |t, _| t.shape = vec![1; 9],
            Csa2Status::Csa2ErrShape,
            "tokens.ndim",
        ),
        (
            "rank 2 tokens",
            &dec,
            |t, _| t.shape = vec![1, 1],
            Csa2Status::Csa2ErrShape,
            "tokens: expected [T=1]",
        ),
        (
            "zero-size tokens for a one-row step",
            &dec,
            |t, _| t.shape = vec![0],
            Csa2Status::Csa2ErrShape,
            "tokens",
        ),
        (
            "tokens on a GPU",
            &dec,
            |t, _| {
                t.device.device_type = K_DL_CUDA;
                t.byte_offset = 0;
            },
            Csa2Status::Csa2ErrInvalidArgument,
            "share a device",
        ),
        (
            "a misaligned token pointer",
            &dec,
            |t, _| t.byte_offset = 4,
            Csa2Status::Csa2ErrShape,
            "aligned to 8",
        ),
        (
            "a byte_offset that wraps the address space",
            &dec,
            |t, _| t.byte_offset = u64::MAX - 7,
            Csa2Status::Csa2ErrShape,
            "byte_offset",
        ),
        (
            "a negative token id",
            &dec,
            |t, _| t.data[0] = -1,
            Csa2Status::Csa2ErrInvalidArgument,
            "tokens[0]",
        ),
        (
            "a token id past uint32",
            &dec,
            |t, _| t.data[0] = 1 << 32,
            Csa2Status::Csa2ErrInvalidArgument,
            "tokens[0]",
        ),
        (
            "strided tokens",
            &two,
            |t, _| {
                t.data = vec![1, 0, 2, 0];
                t.shape = vec![2];
                t.strides = Some(vec![2]);
            },
            Csa2Status::Csa2ErrShape,
            "tokens.strides",
        ),
        (
            "negative token strides",
            &two,
            |t, _| {
                t.strides = Some(vec![-1]);
                t.byte_offset = 8;
            },
            Csa2Status::Csa2ErrShape,
            "non-negative",
        ),
        (
            "an int32 hidden output",
            &dec,
            |_, h| {
                h.dtype = DLDataType {
                    code: 0,
                    bits: 32,
                    lanes: 1,
                }
            },
            Csa2Status::Csa2ErrShape,
            "hidden.dtype",
        ),
        (
            "a zero-size hidden output for one row",
            &dec,
            |_, h| h.shape[0] = 0,
            Csa2Status::Csa2ErrShape,
            "hidden: expected [rows=1, d=",
        ),
        (
            "a hidden output one column short",
            &dec,
            |_, h| h.shape[1] -= 1,
            Csa2Status::Csa2ErrShape,
            "hidden",
        ),
        (
            "a transposed hidden output",
            &two,
            |_, h| {
                let d = h.shape[1];
                h.shape[0] = 2;
                h.strides = Some(vec![1, 2]);
                h.data.resize(2 * d as usize, -7.5);
            },
            Csa2Status::Csa2ErrShape,
            "hidden.strides",
        ),
        (
            "a hidden output on a GPU",
            &dec,
            |_, h| h.device.device_type = K_DL_CUDA,
            Csa2Status::Csa2ErrInvalidArgument,
            "share a device",
        ),
    ];
    for (what, seqs, mutate, want, needle) in cases {
        let mut tok = tokens(1, n, seqs[0].len as usize);
        let mut h = HostTensor::new(vec![sentinel; d], &[1, d as i64], DType::F32);
        if seqs[0].len == 2 {
            h.data = vec![sentinel; 2 * d];
            h.shape = vec![2, d as i64];
        }
        mutate(&mut tok, &mut h);
        let (t, hd) = (tok.dl(), h.dl());
        let args = Csa2EngineStepArgs {
            seqs: seqs.as_ptr(),
            n_seqs: seqs.len(),
            tokens: &t,
            hidden: &hd,
            ..Default::default()
        };
        let mut rows = 4242usize;
        let s = unsafe { csa2_engine_step(e, &args, &mut rows) };
        let msg = last_error();
        assert_eq!(s, want, "{what}: {msg}");
        assert!(msg.contains(needle), "{what}: {msg:?} lacks {needle:?}");
        assert_eq!(rows, 4242, "{what}: rows_out written");
        assert!(
            h.data.iter().all(|&x| x.to_bits() == sentinel.to_bits()),
            "{what}: hidden written"
        );
        assert_eq!(stats(e), before, "{what}: the engine changed");
    }
    // Outputs that overlap: the hidden state over the token ids' memory, the positions over the
    // hidden state, and outputs on two devices.
    let mut backing = HostTensor::new(vec![0i64; d / 2 + 1], &[1], DType::I64);
    backing.data[0] = 5;
    let t = backing.dl();
    let mut over = t;
    let mut hshape = [1i64, d as i64];
    over.shape = hshape.as_mut_ptr();
    over.ndim = 2;
    over.dtype = DLDataType {
        code: 2,
        bits: 32,
        lanes: 1,
    };
    let mut h = HostTensor::new(vec![sentinel; d], &[1, d as i64], DType::F32);
    let hd = h.dl();
    let mut pos_over = hd;
    let mut pshape = [1i64];
    pos_over.shape = pshape.as_mut_ptr();
    pos_over.ndim = 1;
    pos_over.dtype = DLDataType {
        code: 0,
        bits: 64,
        lanes: 1,
    };
    let mut gpu_pos = pos_over;
    gpu_pos.data = std::ptr::without_provenance_mut(0x7f00_0000_0000);
    gpu_pos.device.device_type = K_DL_CUDA;
    let mut ok_tok = tokens(1, n, 1);
    let okt = ok_tok.dl();
    for (what, tok, hid, pos, needle) in [
        ("hidden over tokens", &t, &over, null(), "overlaps `tokens`"),
        (
            "positions over hidden",
            &okt,
            &hd,
            &pos_over as *const DLTensor,
            "overlaps `hidden`",
        ),
        (
            "positions on a GPU",
            &okt,
            &hd,
            &gpu_pos as *const DLTensor,
            "share a device",
        ),
    ] {
        let args = Csa2EngineStepArgs {
            seqs: dec.as_ptr(),
            n_seqs: 1,
            tokens: tok,
            hidden: hid,
            positions: pos,
            ..Default::default()
        };
        let mut rows = 4242usize;
        let s = unsafe { csa2_engine_step(e, &args, &mut rows) };
        let msg = last_error();
        assert_eq!(s, Csa2Status::Csa2ErrInvalidArgument, "{what}: {msg}");
        assert!(msg.contains(needle), "{what}: {msg:?} lacks {needle:?}");
        assert_eq!(rows, 4242, "{what}");
        assert_eq!(backing.data[0], 5, "{what}: tokens overwritten");
        assert_eq!(stats(e), before, "{what}");
    }
    assert!(h.data.iter().all(|&x| x.to_bits() == sentinel.to_bits()));
    // Null members and a step with no rows at all.
    let mut rows = 4242usize;
    let nulls = [
        (
            Csa2EngineStepArgs {
                seqs: dec.as_ptr(),
                n_seqs: 1,
                ..Default::default()
            },
            Csa2Status::Csa2ErrNullPointer,
            "tokens",
        ),
        (
            Csa2EngineStepArgs {
                n_seqs: 1,
                tokens: &okt,
                ..Default::default()
            },
            Csa2Status::Csa2ErrNullPointer,
            "seqs",
        ),
    ];
    for (args, want, needle) in nulls {
        refused(
            unsafe { csa2_engine_step(e, &args, &mut rows) },
            want,
            needle,
        );
    }
    let mut empty = HostTensor::new(Vec::<i64>::new(), &[0], DType::I64);
    let et = empty.dl();
    let args = Csa2EngineStepArgs {
        tokens: &et,
        ..Default::default()
    };
    // Zero sequences (the contract's n_seqs ≥ 1): before the fix, planned as zero rows and OK.
    refused(
        unsafe { csa2_engine_step(e, &args, &mut rows) },
        Csa2Status::Csa2ErrInvalidArgument,
        "n_seqs",
    );
    let mut h0 = HostTensor::new(Vec::<f32>::new(), &[0, d as i64], DType::F32);
    let h0d = h0.dl();
    let args = Csa2EngineStepArgs {
        tokens: &et,
        hidden: &h0d,
        ..Default::default()
    };
    refused(
        unsafe { csa2_engine_step(e, &args, &mut rows) },
        Csa2Status::Csa2ErrInvalidArgument,
        "n_seqs",
    );
    let args = Csa2EngineStepArgs {
        seqs: dec.as_ptr(),
        n_seqs: 1,
        tokens: &okt,
        ..Default::default()
    };
    refused(
        unsafe { csa2_engine_step(e, &args, null_mut()) },
        Csa2Status::Csa2ErrNullPointer,
        "rows_out",
    );
    assert_eq!((rows, stats(e)), (4242, before));
    // After all of it the decode equals the twin's.
    let x = run(e, &dec, &mut tokens(1, n, 1));
    assert_eq!(x, run(twin, &dec, &mut tokens(1, n, 1)));
    ok(unsafe { csa2_engine_free(e) });
    ok(unsafe { csa2_engine_free(twin) });
}

/// `struct_size` below the first version is refused naming the struct; above it (a caller built
/// against a newer header, with members this library does not know) the known prefix is read and
/// the rest ignored, so the step runs as with the exact size.
#[test]
fn engine_args_struct_size_too_small_or_too_large() {
    let (e, twin) = (engine(2), engine(2));
    let n = 8;
    let seqs = [prefill_seq(1, n)];
    let size = std::mem::size_of::<Csa2EngineStepArgs>();
    let mut tok = tokens(1, 0, n);
    let t = tok.dl();
    for small in [0, 8, size - 8] {
        let args = Csa2EngineStepArgs {
            struct_size: small,
            seqs: seqs.as_ptr(),
            n_seqs: 1,
            tokens: &t,
            ..Default::default()
        };
        let mut rows = 5;
        refused(
            unsafe { csa2_engine_step(e, &args, &mut rows) },
            Csa2Status::Csa2ErrInvalidArgument,
            "struct_size",
        );
        assert_eq!(rows, 5);
    }
    // The args at the start of a larger, 8-aligned buffer whose tail is garbage.
    let d = hidden_size(e);
    let rows = n.min(128);
    let mut h = HostTensor::new(vec![0f32; rows * d], &[rows as i64, d as i64], DType::F32);
    let hd = h.dl();
    let mut big = vec![u64::MAX; size / 8 + 16];
    let args = Csa2EngineStepArgs {
        struct_size: size + 128,
        seqs: seqs.as_ptr(),
        n_seqs: 1,
        tokens: &t,
        hidden: &hd,
        ..Default::default()
    };
    unsafe { std::ptr::write(big.as_mut_ptr().cast::<Csa2EngineStepArgs>(), args) };
    let mut got = 0usize;
    ok(unsafe { csa2_engine_step(e, big.as_ptr().cast(), &mut got) });
    assert_eq!(got, rows);
    assert_eq!(h.data, run(twin, &seqs, &mut tokens(1, 0, n)));
    ok(unsafe { csa2_engine_free(e) });
    ok(unsafe { csa2_engine_free(twin) });
}

/// Handles of one type given where another is expected, freed ones, garbage: refused, and a wrong
/// `_free` never frees the object it was handed.
#[test]
fn foreign_and_stale_handles_are_refused_and_a_wrong_free_frees_nothing() {
    let e = engine(2);
    let g = geometry();
    let as_geometry = e.cast::<Csa2Geometry>();
    let mut layers = 0usize;
    refused(
        unsafe { csa2_geometry_num_layers(as_geometry, &mut layers) },
        Csa2Status::Csa2ErrInvalidHandle,
        "Csa2Engine",
    );
    refused(
        unsafe { csa2_geometry_free(as_geometry) },
        Csa2Status::Csa2ErrInvalidHandle,
        "Csa2Engine",
    );
    refused(
        unsafe { csa2_engine_free(g.cast()) },
        Csa2Status::Csa2ErrInvalidHandle,
        "Csa2Geometry",
    );
    refused(
        unsafe { csa2_engine_free_request(g.cast(), 1) },
        Csa2Status::Csa2ErrInvalidHandle,
        "Csa2Geometry",
    );
    // Both survived the wrong frees.
    ok(unsafe { csa2_geometry_num_layers(g, &mut layers) });
    assert!(layers > 0);
    assert_eq!(stats(e).requests, 0);
    let mut s = Csa2EngineStats::default();
    for h in [
        std::ptr::without_provenance::<Csa2Engine>(1),
        std::ptr::without_provenance(usize::MAX),
        std::ptr::without_provenance(0xC8usize << 56),
        std::ptr::without_provenance((0xC8usize << 56) | 0xFF_FFFF_FFFF),
    ] {
        refused(
            unsafe { csa2_engine_stats(h, &mut s) },
            Csa2Status::Csa2ErrInvalidHandle,
            "",
        );
        refused(
            unsafe { csa2_engine_suspend(h, 0) },
            Csa2Status::Csa2ErrInvalidHandle,
            "",
        );
    }
    assert_eq!(
        s,
        Csa2EngineStats::default(),
        "stats written through a bad handle"
    );
    ok(unsafe { csa2_engine_free(e) });
    for call in [
        unsafe { csa2_engine_stats(e, &mut s) },
        unsafe { csa2_engine_resume(e, 0, 1) },
        unsafe { csa2_engine_free(e) },
    ] {
        assert_eq!(call, Csa2Status::Csa2ErrInvalidHandle, "{}", last_error());
    }
    ok(unsafe { csa2_geometry_free(g) });
}

/// One engine from several threads at once: four threads decode their own requests while another
/// reads stats and info and a sixth sends refused steps; every request's outputs equal a twin's
/// run one call at a time. Then a free races steps on another thread: each step is OK or
/// `CSA2_ERR_INVALID_HANDLE`, never a panic or a crash.
#[test]
fn one_engine_from_several_threads_and_a_free_racing_its_steps() {
    let (e, twin) = (engine(8), engine(8));
    let n = 8;
    let reqs = [11u64, 12, 13, 14];
    for &r in &reqs {
        run(e, &[prefill_seq(r, n)], &mut tokens(r, 0, n));
        run(twin, &[prefill_seq(r, n)], &mut tokens(r, 0, n));
    }
    let decodes = 2;
    let addr = e as usize;
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = reqs
        .iter()
        .map(|&r| {
            std::thread::spawn(move || {
                let e = std::ptr::without_provenance::<Csa2Engine>(addr);
                (0..decodes)
                    .map(|i| run(e, &[decode_seq(r, n + i)], &mut tokens(r, n + i, 1)))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|k| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let e = std::ptr::without_provenance::<Csa2Engine>(addr);
                let mut calls = 0u64;
                loop {
                    if k == 0 {
                        let s = stats(e);
                        assert!(s.requests == 4 && s.used_blocks <= 8);
                    } else {
                        // A count-only step (planned, never run) racing the decodes.
                        let mut t = tokens(11, 0, 1);
                        let dl = t.dl();
                        let seqs = [decode_seq(11, 1000)];
                        let args = Csa2EngineStepArgs {
                            seqs: seqs.as_ptr(),
                            n_seqs: 1,
                            tokens: &dl,
                            ..Default::default()
                        };
                        let mut rows = 0;
                        ok(unsafe { csa2_engine_step(e, &args, &mut rows) });
                        assert_eq!(rows, 1);
                    }
                    calls += 1;
                    if stop.load(Ordering::Relaxed) {
                        break calls;
                    }
                }
            })
        })
        .collect();
    let got: Vec<Vec<Vec<f32>>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
    for (&r, outs) in reqs.iter().zip(&got) {
        for (i, out) in outs.iter().enumerate() {
            let want = run(twin, &[decode_seq(r, n + i)], &mut tokens(r, n + i, 1));
            assert_eq!(out, &want, "request {r} decode {i}");
        }
    }
    assert_eq!(stats(e), stats(twin));
    ok(unsafe { csa2_engine_free(twin) });
    // A free racing steps on another thread.
    let d = hidden_size(e);
    let stepper = std::thread::spawn(move || {
        let e = std::ptr::without_provenance::<Csa2Engine>(addr);
        let mut statuses = vec![];
        for i in 0..16 {
            let mut t = tokens(11, n + decodes + i, 1);
            let dl = t.dl();
            let seqs = [decode_seq(11, n + decodes + i)];
            let mut h = HostTensor::new(vec![0f32; d], &[1, d as i64], DType::F32);
            let hd = h.dl();
            let args = Csa2EngineStepArgs {
                seqs: seqs.as_ptr(),
                n_seqs: 1,
                tokens: &dl,
                hidden: &hd,
                ..Default::default()
            };
            let mut rows = 0;
            let s = unsafe { csa2_engine_step(e, &args, &mut rows) };
            statuses.push(s);
            if s != Csa2Status::Csa2Ok {
                break;
            }
        }
        statuses
    });
    std::thread::sleep(std::time::Duration::from_millis(5));
    ok(unsafe { csa2_engine_free(e) });
    let statuses = stepper.join().unwrap();
    let (last, rest) = statuses.split_last().unwrap();
    assert!(
        rest.iter().all(|&s| s == Csa2Status::Csa2Ok),
        "{statuses:?}"
    );
    assert!(
        matches!(last, Csa2Status::Csa2Ok | Csa2Status::Csa2ErrInvalidHandle),
        "{statuses:?}"
    );
}

/// A pool too small for a prefill: `CSA2_ERR_OUT_OF_BLOCKS`, and freeing the request gives every
/// block back, after which the engine serves a request that fits exactly as a twin does.
#[test]
fn out_of_blocks_mid_step_is_recovered_by_freeing_the_request() {
    let (e, twin) = (engine(1), engine(1));
    // One row past the one 256-token block.
    let n = 257;
    let seqs = [prefill_seq(1, n)];
    let mut tok = tokens(1, 0, n);
    let t = tok.dl();
    let d = hidden_size(e);
    let mut args = Csa2EngineStepArgs {
        seqs: seqs.as_ptr(),
        n_seqs: 1,
        tokens: &t,
        ..Default::default()
    };
    let mut rows = 0;
    ok(unsafe { csa2_engine_step(e, &args, &mut rows) });
    let mut h = HostTensor::new(vec![0f32; rows * d], &[rows as i64, d as i64], DType::F32);
    let hd = h.dl();
    args.hidden = &hd;
    refused(
        unsafe { csa2_engine_step(e, &args, &mut rows) },
        Csa2Status::Csa2ErrOutOfBlocks,
        "",
    );
    assert!(
        h.data.iter().all(|&x| x == 0.0),
        "no output after a failed step"
    );
    // The module docs: the request may be partly advanced; free it before reusing the id.
    let _ = unsafe { csa2_engine_free_request(e, 1) };
    let s = stats(e);
    assert_eq!((s.requests, s.used_blocks, s.main_bytes), (0, 0, 0));
    let m = 8;
    assert_eq!(
        run(e, &[prefill_seq(1, m)], &mut tokens(1, 0, m)),
        run(twin, &[prefill_seq(1, m)], &mut tokens(1, 0, m))
    );
    assert_eq!(stats(e), stats(twin));
    ok(unsafe { csa2_engine_free(e) });
    ok(unsafe { csa2_engine_free(twin) });
}

/// Store directories a caller (or a crash, or another program) damaged: a path that is a file, a
/// segment that is a directory, a segment of garbage or cut inside its first header. Each is a
/// typed error or a recovery that indexes nothing it cannot verify; never a panic.
#[test]
fn damaged_store_directories_are_typed_errors_or_clean_recoveries() {
    use std::ffi::CString;
    let open = |dir: &std::path::Path| {
        let c = CString::new(dir.to_str().unwrap()).unwrap();
        let a = Csa2SsdOpenArgs {
            struct_size: std::mem::size_of::<Csa2SsdOpenArgs>(),
            dir: c.as_ptr(),
            capacity_bytes: 1 << 20,
            min_lifetime_ms: 0,
            segment_bytes: 0,
            fsync: Csa2Fsync::Csa2FsyncNever as i32,
            verify_on_open: 1,
            read_only: 0,
            clock: null(),
        };
        let mut rep = Csa2SsdRecovery::default();
        let mut out = null_mut();
        let s = unsafe { csa2_ssd_open(&a, &mut rep, &mut out) };
        (s, rep, out)
    };
    let root = tempfile::tempdir().unwrap();
    // A regular file where the directory should be.
    let file = root.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let (s, _, out) = open(&file);
    assert_ne!(s, Csa2Status::Csa2Ok);
    assert!(out.is_null() && !last_error().is_empty());
    // A store with one record, then its segment damaged three ways.
    let good = root.path().join("store");
    let (s, _, st) = open(&good);
    ok(s);
    let key = [3u8; 32];
    let payload = vec![0x5Au8; 3000];
    ok(unsafe {
        csa2_ssd_put(
            st,
            key.as_ptr(),
            payload.as_ptr(),
            payload.len(),
            null_mut(),
        )
    });
    ok(unsafe { csa2_ssd_free(st) });
    let seg = std::fs::read_dir(&good)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "log"))
        .unwrap();
    let bytes = std::fs::read(&seg).unwrap();
    type Damage<'a> = (&'a str, Box<dyn Fn(&std::path::Path) + 'a>);
    let damage: [Damage; 3] = [
        (
            "garbage",
            Box::new(|p| std::fs::write(p, vec![0xC3u8; 5000]).unwrap()),
        ),
        (
            "cut inside the first header",
            Box::new(|p| std::fs::write(p, &bytes[..bytes.len().min(20)]).unwrap()),
        ),
        (
            "a directory",
            Box::new(|p| {
                std::fs::remove_file(p).unwrap();
                std::fs::create_dir(p).unwrap();
            }),
        ),
    ];
    for (what, f) in damage {
        let dir = root.path().join(what.replace(' ', "-"));
        std::fs::create_dir(&dir).unwrap();
        for e in std::fs::read_dir(&good).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
            }
        }
        f(&dir.join(seg.file_name().unwrap()));
        let (s, rep, st) = open(&dir);
        if s != Csa2Status::Csa2Ok {
            assert!(st.is_null(), "{what}");
            assert!(
                !last_error().is_empty(),
                "{what}: a status without a message"
            );
            continue;
        }
        assert_eq!(rep.records, 0, "{what}: nothing unverifiable is indexed");
        let mut buf = vec![0u8; 4096];
        let (mut len, mut found) = (0usize, 9u8);
        ok(unsafe {
            csa2_ssd_get(
                st,
                key.as_ptr(),
                buf.as_mut_ptr(),
                buf.len(),
                &mut len,
                &mut found,
            )
        });
        assert_eq!(found, 0, "{what}: a damaged record served");
        // The tier keeps working: a new put is read back byte-exact.
        let k2 = [4u8; 32];
        ok(unsafe { csa2_ssd_put(st, k2.as_ptr(), payload.as_ptr(), 100, null_mut()) });
        ok(unsafe {
            csa2_ssd_get(
                st,
                k2.as_ptr(),
                buf.as_mut_ptr(),
                buf.len(),
                &mut len,
                &mut found,
            )
        });
        assert_eq!((found, &buf[..len]), (1, &payload[..100]), "{what}");
        ok(unsafe { csa2_ssd_free(st) });
    }
}
