//! The engine over the C ABI (`csa2_engine_*`): the same outputs as the Rust `Backend` that
//! `csa2 run`'s session drives, bit for bit, and bad handles / stale handles / wrong shapes refused
//! with a clear error and nothing changed.

use crate::ffi_support::{last_error, HostTensor};
use csa2::backend::{Backend, BackendConfig, KvCache, Model, PagedCache, Phase, SeqStep};
use csa2::ffi::*;
use csa2::replay::ReplayMode;
use csa2::store::TierPolicy;
use csa2::tensor::DType;
use csa2::weights::Scale;
use csa2_harness::session::{self, token_at, SessionConfig, TurnReport};
use std::ptr::{null, null_mut};
use std::sync::Arc;

fn ok(s: Csa2Status) {
    assert_eq!(s, Csa2Status::Csa2Ok, "{}", last_error());
}

fn engine(cache: Csa2EngineCacheKind, num_blocks: usize) -> *mut Csa2Engine {
    let args = Csa2EngineCreateArgs {
        scale: Csa2ModelScale::Csa2ScaleTiny as i32,
        seed: 1,
        cache: cache as i32,
        num_blocks,
        ..Default::default()
    };
    let mut e = null_mut();
    ok(unsafe { csa2_engine_create(&args, &mut e) });
    e
}

fn info(e: *const Csa2Engine) -> Csa2EngineInfo {
    let mut i = Csa2EngineInfo::default();
    ok(unsafe { csa2_engine_info(e, &mut i) });
    i
}

fn hidden_size(e: *const Csa2Engine) -> usize {
    info(e).hidden_size as usize
}

fn seq(s: &SeqStep) -> Csa2EngineSeq {
    let (phase, prompt_end, prefill_start) = match s.phase {
        Phase::Prefill {
            prompt_end,
            prefill_start,
        } => (Csa2EnginePhase::Csa2PhasePrefill, prompt_end, prefill_start),
        Phase::Decode => (Csa2EnginePhase::Csa2PhaseDecode, 0, 0),
    };
    Csa2EngineSeq {
        req: s.req,
        first_pos: s.first_pos as u64,
        len: s.len as u64,
        phase: phase as i32,
        prompt_end: prompt_end as u64,
        prefill_start: prefill_start as u64,
        replay_start: s.replay_start as u64,
        cached_until: s.cached_until as u64,
    }
}

/// (hidden, positions, requests) of a step's output rows.
type StepRows = (Vec<f32>, Vec<i64>, Vec<u64>);

/// Token ids as the `[T]` int64 tensor `csa2_engine_step` reads.
fn token_tensor(tokens: &[u32]) -> HostTensor<i64> {
    HostTensor::new(
        tokens.iter().map(|&t| t as i64).collect(),
        &[tokens.len() as i64],
        DType::I64,
    )
}

/// One step through the C ABI: a count-only call, then the step into `[rows, d]` float32 hidden
/// and `[rows]` int64 positions and request ids.
fn step(
    e: *const Csa2Engine,
    seqs: &[Csa2EngineSeq],
    tokens: &[u32],
) -> Result<StepRows, (Csa2Status, String)> {
    let d = hidden_size(e);
    let mut tok = token_tensor(tokens);
    let tok_dl = tok.dl();
    let mut args = Csa2EngineStepArgs {
        seqs: seqs.as_ptr(),
        n_seqs: seqs.len(),
        tokens: &tok_dl,
        ..Default::default()
    };
    let mut rows = usize::MAX;
    let s = unsafe { csa2_engine_step(e, &args, &mut rows) };
    if s != Csa2Status::Csa2Ok {
        return Err((s, last_error()));
    }
    let mut h = HostTensor::new(
        vec![f32::NAN; rows * d],
        &[rows as i64, d as i64],
        DType::F32,
    );
    let mut p = HostTensor::new(vec![-1i64; rows], &[rows as i64], DType::I64);
    let mut r = HostTensor::new(vec![-1i64; rows], &[rows as i64], DType::I64);
    let (hd, pd, rd) = (h.dl(), p.dl(), r.dl());
    args.hidden = &hd;
    args.positions = &pd;
    args.requests = &rd;
    let mut rows2 = 0;
    let s = unsafe { csa2_engine_step(e, &args, &mut rows2) };
    if s != Csa2Status::Csa2Ok {
        return Err((s, last_error()));
    }
    assert_eq!(rows2, rows, "the count-only call planned the same rows");
    Ok((h.data, p.data, r.data.iter().map(|&x| x as u64).collect()))
}

fn stats(e: *const Csa2Engine) -> Csa2EngineStats {
    let mut s = Csa2EngineStats::default();
    ok(unsafe { csa2_engine_stats(e, &mut s) });
    s
}

/// `csa2 run`'s session through the C ABI engine: the turns, prefix hits, snapshot hits and
/// misses the Rust session reported, laid out as steps exactly as `harness::session` lays them.
fn session_over_c(
    e: *const Csa2Engine,
    a: &SessionConfig,
    reports: &[TurnReport],
    policy: &TierPolicy,
) -> Vec<Vec<f32>> {
    let sid = 1u64;
    let mut outs = vec![];
    let mut ctx = 0usize;
    for r in reports {
        let prompt = r.prompt_tokens;
        let p = policy.plan(prompt, ctx, r.snapshot_hit).unwrap();
        assert_eq!(
            (p.hit_used, p.snapshot_used),
            (r.prefix_hit, r.snapshot_hit)
        );
        if ctx > 0 && p.hit_used == 0 {
            // Nothing usable (the context is below one block): start over; freeing the request
            // discards its suspended state.
            ok(unsafe { csa2_engine_free_request(e, sid) });
        } else if ctx > 0 {
            ok(unsafe { csa2_engine_resume(e, sid, p.snapshot_used as i32) });
        }
        let enc = &p.layers[0];
        let first = enc.rows.start;
        let mut pos = first;
        while pos < prompt {
            let len = a.chunk.min(prompt - pos);
            let s = SeqStep {
                req: sid,
                first_pos: pos,
                len,
                phase: Phase::Prefill {
                    prompt_end: prompt,
                    prefill_start: first,
                },
                replay_start: enc.window_floor,
                cached_until: p.hit_used,
            };
            let toks: Vec<u32> = (pos..pos + len).map(|q| token_at(sid, q)).collect();
            outs.push(step(e, &[seq(&s)], &toks).unwrap().0);
            pos += len;
        }
        for i in 0..r.generated_tokens {
            let q = prompt + i;
            let s = SeqStep {
                req: sid,
                first_pos: q,
                len: 1,
                phase: Phase::Decode,
                replay_start: 0,
                cached_until: q,
            };
            outs.push(step(e, &[seq(&s)], &[token_at(sid, q)]).unwrap().0);
        }
        ctx = prompt + r.generated_tokens;
        ok(unsafe { csa2_engine_suspend(e, sid) });
    }
    outs
}

#[test]
fn c_abi_engine_gives_the_rust_sessions_outputs_bit_for_bit() {
    let trace = csa2_harness::sim::trace::parse(
        csa2_harness::sim::trace::EXCERPT,
        std::path::Path::new("assets/mooncake_conversation_excerpt.jsonl"),
    )
    .unwrap();
    let model = Arc::new(Model::synthetic(Scale::Tiny, 1, false).unwrap());
    let backend = Backend::new(model, BackendConfig::CSA2).unwrap();
    let g = backend.geometry().clone();
    let policy = TierPolicy::v41(&g, ReplayMode::Bounded);
    let (mut hits, mut misses) = (0, 0);
    // A long TTL (every snapshot found) and a one-second one (the turns' gaps, trace gaps × 30,
    // outlast it: every snapshot expired, an encoder replay). Trace requests 0, 22 and 44 (6,758,
    // 5,954 and 9,615 input tokens, arriving 3 s and 12 s apart) at 0.03: 203 + 179 + 288 new
    // tokens, so each later turn's prefix hit is longer than the window (a miss replays a whole
    // window) and the context crosses two 256-token blocks of the paged cache. (The top-k's choice
    // of a subset is the backend's, the same code under both faces: backend_paged's tests cover it.)
    for ttl_s in [100_000, 1] {
        let a = SessionConfig {
            turns: 3,
            token_scale: 0.03,
            decode_max: 3,
            time_scale: 30.0,
            stride: 22,
            ttl_s,
            chunk: 96,
        };
        let blocks = session::session_tokens(&a, &trace).div_ceil(256) + 1;
        let mut cache = PagedCache::host(&g, backend.cfg.formats, blocks).unwrap();
        let mut want: Vec<Vec<f32>> = vec![];
        let reports = session::run(
            &a,
            &backend,
            &trace,
            &mut cache,
            |_, _, o| want.push(o.hidden.clone()),
            |_| {},
        )
        .unwrap();
        hits += reports[1..].iter().filter(|r| r.snapshot_hit).count();
        misses += reports[1..]
            .iter()
            .filter(|r| !r.snapshot_hit && r.replayed_tokens > 0)
            .count();
        for kind in [
            Csa2EngineCacheKind::Csa2EngineCachePaged,
            Csa2EngineCacheKind::Csa2EngineCacheContiguous,
        ] {
            let e = engine(kind, blocks);
            let got = session_over_c(e, &a, &reports, &policy);
            assert_eq!(got.len(), want.len(), "steps");
            for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                assert_eq!(x.len(), y.len(), "step {i} rows");
                assert!(
                    x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "ttl {ttl_s} {kind:?}: step {i} differs from the Rust session"
                );
            }
            // Same cache after the session: the session's request is open, its windows dropped.
            let s = stats(e);
            let u = cache.usage();
            assert_eq!(
                (s.requests, s.main_bytes, s.index_bytes, s.carry_bytes),
                (
                    u.requests as u64,
                    u.main_bytes as u64,
                    u.index_bytes as u64,
                    u.carry_bytes as u64
                ),
                "{kind:?}"
            );
            if kind == Csa2EngineCacheKind::Csa2EngineCachePaged {
                let m = cache.manager().stats();
                assert_eq!(
                    (
                        s.total_blocks,
                        s.used_blocks,
                        s.global_allocated,
                        s.swa_bytes
                    ),
                    (
                        m.total_blocks as u64,
                        m.used_blocks as u64,
                        u.global_allocated as u64,
                        u.swa_bytes as u64
                    )
                );
            }
            assert_eq!(s.suspended, 1, "the last turn's snapshot is kept");
            ok(unsafe { csa2_engine_free(e) });
        }
    }
    assert!(
        hits > 0 && misses > 0,
        "the sessions cover snapshot hits ({hits}) and misses with replay ({misses})"
    );
}

/// Two decode-ready engines fed the same calls agree bit for bit (a refused call in between must
/// not have changed the first one).
fn prefill(e: *const Csa2Engine, req: u64, n: usize) -> Vec<f32> {
    let s = SeqStep {
        req,
        first_pos: 0,
        len: n,
        phase: Phase::Prefill {
            prompt_end: n,
            prefill_start: 0,
        },
        replay_start: 0,
        cached_until: 0,
    };
    let toks: Vec<u32> = (0..n).map(|q| token_at(req, q)).collect();
    step(e, &[seq(&s)], &toks).unwrap().0
}

fn decode_seq(req: u64, pos: usize) -> Csa2EngineSeq {
    seq(&SeqStep {
        req,
        first_pos: pos,
        len: 1,
        phase: Phase::Decode,
        replay_start: 0,
        cached_until: pos,
    })
}

#[test]
fn bad_handles_stale_handles_and_wrong_shapes_are_refused_and_change_nothing() {
    let e = engine(Csa2EngineCacheKind::Csa2EngineCachePaged, 4);
    let twin = engine(Csa2EngineCacheKind::Csa2EngineCachePaged, 4);
    let d = hidden_size(e);
    let n = 200;
    assert_eq!(prefill(e, 7, n), prefill(twin, 7, n));
    let before = stats(e);
    let tok = [token_at(7, n)];
    let good = [decode_seq(7, n)];
    let expect = |s: Csa2Status, want: Csa2Status, needle: &str| {
        assert_eq!(s, want, "{}", last_error());
        let msg = last_error();
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    };
    let call = |seqs: &[Csa2EngineSeq], tokens: &[u32], cap: usize| {
        let mut tok = token_tensor(tokens);
        let tok_dl = tok.dl();
        let mut h = HostTensor::new(vec![0f32; cap], &[(cap / d) as i64, d as i64], DType::F32);
        if !cap.is_multiple_of(d) {
            h.shape = vec![1, cap as i64];
        }
        let hd = h.dl();
        let args = Csa2EngineStepArgs {
            seqs: seqs.as_ptr(),
            n_seqs: seqs.len(),
            tokens: &tok_dl,
            hidden: &hd,
            ..Default::default()
        };
        let mut rows = 12345usize;
        let s = unsafe { csa2_engine_step(e, &args, &mut rows) };
        if s != Csa2Status::Csa2Ok {
            assert_eq!(rows, 12345, "rows_out untouched on error");
            assert!(
                h.data.iter().all(|&x| x == 0.0),
                "hidden untouched on error"
            );
        }
        s
    };
    // Wrong shapes and values: token count, output room, phase, a two-row decode, a request twice,
    // a position past 2^62, a struct_size of no version.
    expect(call(&good, &[1, 2], d), Csa2Status::Csa2ErrShape, "tokens");
    expect(
        call(&good, &tok, d - 1),
        Csa2Status::Csa2ErrShape,
        "hidden: expected [rows=1, d=",
    );
    let mut bad_phase = good;
    bad_phase[0].phase = 9;
    expect(
        call(&bad_phase, &tok, d),
        Csa2Status::Csa2ErrInvalidArgument,
        "phase",
    );
    let mut two = good;
    two[0].len = 2;
    expect(
        call(&two, &[1, 2], 2 * d),
        Csa2Status::Csa2ErrInvalidArgument,
        "decode step has one row",
    );
    expect(
        call(&[good[0], good[0]], &[1, 2], 2 * d),
        Csa2Status::Csa2ErrInvalidArgument,
        "twice",
    );
    let mut far = good;
    far[0].first_pos = 1 << 62;
    expect(
        call(&far, &tok, d),
        Csa2Status::Csa2ErrInvalidArgument,
        "2^62",
    );
    let args = Csa2EngineStepArgs {
        struct_size: 8,
        ..Default::default()
    };
    let mut rows = 0;
    expect(
        unsafe { csa2_engine_step(e, &args, &mut rows) },
        Csa2Status::Csa2ErrInvalidArgument,
        "struct_size",
    );
    // Bad and stale handles.
    let mut tok_t = token_tensor(&tok);
    let tok_dl = tok_t.dl();
    let step_on = |h: *const Csa2Engine| {
        let args = Csa2EngineStepArgs {
            seqs: good.as_ptr(),
            n_seqs: 1,
            tokens: &tok_dl,
            ..Default::default()
        };
        let mut rows = 0;
        unsafe { csa2_engine_step(h, &args, &mut rows) }
    };
    expect(step_on(null()), Csa2Status::Csa2ErrNullPointer, "engine");
    expect(
        step_on(std::ptr::without_provenance(0xdead_beef)),
        Csa2Status::Csa2ErrInvalidHandle,
        "garbage",
    );
    let g = crate::ffi_support::geometry();
    expect(
        step_on(g.cast::<Csa2Engine>()),
        Csa2Status::Csa2ErrInvalidHandle,
        "Csa2Geometry handle",
    );
    ok(unsafe { csa2_geometry_free(g) });
    let gone = engine(Csa2EngineCacheKind::Csa2EngineCacheContiguous, 0);
    ok(unsafe { csa2_engine_free(gone) });
    expect(
        step_on(gone),
        Csa2Status::Csa2ErrInvalidHandle,
        "freed or never created",
    );
    expect(
        unsafe { csa2_engine_free(gone) },
        Csa2Status::Csa2ErrInvalidHandle,
        "freed",
    );
    // Requests that do not exist, a resume with nothing suspended.
    expect(
        unsafe { csa2_engine_free_request(e, 99) },
        Csa2Status::Csa2ErrNotFound,
        "99",
    );
    expect(
        unsafe { csa2_engine_suspend(e, 99) },
        Csa2Status::Csa2ErrNotFound,
        "99",
    );
    expect(
        unsafe { csa2_engine_resume(e, 7, 1) },
        Csa2Status::Csa2ErrNotFound,
        "not suspended",
    );
    // Bad create arguments: out untouched.
    let mut out = std::ptr::without_provenance_mut::<Csa2Engine>(0x5);
    for (args, needle) in [
        (
            Csa2EngineCreateArgs {
                scale: 7,
                ..Default::default()
            },
            "scale",
        ),
        (
            Csa2EngineCreateArgs {
                backend: -1,
                num_blocks: 4,
                ..Default::default()
            },
            "backend",
        ),
        (Csa2EngineCreateArgs::default(), "num_blocks"),
        (
            Csa2EngineCreateArgs {
                cache: 2,
                ..Default::default()
            },
            "cache",
        ),
    ] {
        expect(
            unsafe { csa2_engine_create(&args, &mut out) },
            Csa2Status::Csa2ErrInvalidArgument,
            needle,
        );
        assert_eq!(out.addr(), 0x5, "out untouched");
    }
    let missing = std::ffi::CString::new("/nonexistent/csa2-checkpoint").unwrap();
    let args = Csa2EngineCreateArgs {
        weights_dir: missing.as_ptr(),
        num_blocks: 4,
        ..Default::default()
    };
    assert_ne!(
        unsafe { csa2_engine_create(&args, &mut out) },
        Csa2Status::Csa2Ok
    );
    assert!(last_error().contains("csa2-checkpoint"), "{}", last_error());
    assert_eq!(out.addr(), 0x5);
    // Nothing the refused calls did shows: same stats, and the next decode equals the twin's.
    assert_eq!(stats(e), before);
    let x = step(e, &good, &tok).unwrap();
    let y = step(twin, &good, &tok).unwrap();
    assert_eq!(x, y);
    assert_eq!((x.1, x.2), (vec![n as i64], vec![7]));
    // The request can be freed once, then it is gone.
    ok(unsafe { csa2_engine_free_request(e, 7) });
    assert_eq!(stats(e).requests, 0);
    assert_eq!(
        unsafe { csa2_engine_free_request(e, 7) },
        Csa2Status::Csa2ErrNotFound
    );
    ok(unsafe { csa2_engine_free(e) });
    ok(unsafe { csa2_engine_free(twin) });
}

#[test]
fn decoder_replay_trims_a_prefill_to_its_last_window_rows() {
    let e = engine(Csa2EngineCacheKind::Csa2EngineCacheContiguous, 0);
    let i = info(e);
    assert_eq!((i.num_layers, i.decoder_replay), (40, 1));
    // The engine's geometry handle answers the geometry queries.
    let mut g = null_mut();
    ok(unsafe { csa2_engine_geometry(e, &mut g) });
    let mut layers = 0;
    ok(unsafe { csa2_geometry_num_layers(g, &mut layers) });
    assert_eq!(layers as u64, i.num_layers);
    ok(unsafe { csa2_geometry_free(g) });
    let window = i.window as usize;
    let n = window + 40;
    let s = seq(&SeqStep {
        req: 3,
        first_pos: 0,
        len: n,
        phase: Phase::Prefill {
            prompt_end: n,
            prefill_start: 0,
        },
        replay_start: 0,
        cached_until: 0,
    });
    let toks: Vec<u32> = (0..n).map(|q| token_at(3, q)).collect();
    let (h, p, r) = step(e, &[s], &toks).unwrap();
    // The CSA2 default keeps the last `window` rows of a prompt (docs/SPEC.md §3).
    assert_eq!(p, ((n - window) as i64..n as i64).collect::<Vec<_>>());
    assert!(r.iter().all(|&x| x == 3));
    assert_eq!(h.len(), window * hidden_size(e));
    assert!(h.iter().all(|x| x.is_finite()));
    ok(unsafe { csa2_engine_free(e) });
}
