use super::*;
use crate::formats::{encode_rows, MXFP8_BYTES, NVFP4_DS_BYTES};
use crate::tolerance::{compare, BF16_DOTS_VS_F64, F32_VS_F64, QUANT_VS_EXACT};
use csa2_rng::{rand_normal, NewRng, Rng};

struct Case {
    q: Vec<f32>,
    main: Vec<f32>,
    main_rec: Vec<u8>,
    swa: Vec<f32>,
    swa_rec: Vec<u8>,
    sink: Vec<f32>,
}

fn case(rng: &mut Rng, t: usize, n: usize, s: usize) -> Case {
    let q = rand_normal(rng, t * HEADS * KV_DIM, 1.0);
    let main = rand_normal(rng, n * KV_DIM, 1.0);
    let swa = rand_normal(rng, s * KV_DIM, 1.0);
    let mut main_rec = vec![0u8; n * NVFP4_DS_BYTES];
    encode_rows(RecordFormat::Nvfp4Ds, &main, &mut main_rec).unwrap();
    let mut swa_rec = vec![0u8; s * MXFP8_BYTES];
    encode_rows(RecordFormat::Mxfp8, &swa, &mut swa_rec).unwrap();
    let sink = rand_normal(rng, HEADS, 1.0);
    Case {
        q,
        main,
        main_rec,
        swa,
        swa_rec,
        sink,
    }
}

/// Runs fast and reference; asserts they agree; returns (out, lse, rows).
fn both(
    p: &AttentionParams,
    inp: &AttentionInputs,
    main: KvRows,
    swa: KvRows,
) -> (Vec<f32>, Vec<f32>, Vec<TokenRows>) {
    let t = inp.positions.len();
    let mut out = vec![f32::NAN; t * p.heads * KV_DIM];
    let mut lse = vec![f32::NAN; t * p.heads];
    attention(p, inp, main, swa, &mut out, &mut lse).unwrap();
    let rows = plan(p, inp, &main, &swa).unwrap();
    let (ro, rl) = reference::attention(p, inp, &rows, main, swa);
    assert!(out.iter().all(|v| v.is_finite()), "never NaN");
    let s = compare(&out, &ro, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "out: {s:?}");
    let s = compare(&lse, &rl, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "lse: {s:?}");
    // The backend's default where the CPU has it: the same case on bf16 dots, against the same
    // f64 reference, within its own row of the tolerance table. Its error analysis holds for rows
    // exact in bf16, which every cache format decodes to (the backend's rows); raw f32 test rows
    // that are not are left to the f32 path.
    // The int16 path (NVFP4 main rows on int16 dots) likewise, where the CPU has VNNI.
    for dots in [AttentionDots::Bf16, AttentionDots::Int16] {
        if !(dots.is_supported() && bf16_exact(&main) && bf16_exact(&swa)) {
            continue;
        }
        let mut bo = vec![f32::NAN; out.len()];
        let mut bl = vec![f32::NAN; lse.len()];
        attention_with_dots(p, dots, inp, main, swa, &mut bo, &mut bl).unwrap();
        assert!(bo.iter().all(|v| v.is_finite()), "{dots:?}: never NaN");
        let s = compare(&bo, &ro, &BF16_DOTS_VS_F64);
        assert!(s.ok(&BF16_DOTS_VS_F64), "{dots:?} out: {s:?}");
        let s = compare(&bl, &rl, &BF16_DOTS_VS_F64);
        assert!(s.ok(&BF16_DOTS_VS_F64), "{dots:?} lse: {s:?}");
    }
    (out, lse, rows)
}

/// Whether every value of `kv` is exact in bf16 (records always are: E2M1 / E4M3 times a power
/// of two or an E4M3 scale, and bf16 RoPE values).
fn bf16_exact(kv: &KvRows) -> bool {
    match kv {
        KvRows::Records(..) | KvRows::Pool(..) => true,
        KvRows::F32(x) => x.iter().all(|v| v.to_bits() & 0xFFFF == 0),
    }
}

fn topk_rows(rng: &mut Rng, positions: &[i64], m: usize, k: usize) -> Vec<i32> {
    use rand::seq::SliceRandom;
    let mut out = Vec::new();
    for &p in positions {
        let vis = (p as usize + 1) / m;
        let mut ids: Vec<i32> = (0..vis as i32).collect();
        ids.shuffle(rng);
        ids.truncate(k);
        ids.resize(k, -1);
        out.extend(ids);
    }
    out
}

#[test]
fn fast_matches_reference_quantised_and_f32_prefill_and_decode() {
    let mut rng = Rng::new(1);
    let (n, s) = (700, 1400);
    for positions in [vec![1399i64], (0..12).map(|i| 120 * i + 7).collect()] {
        let t = positions.len();
        let c = case(&mut rng, t, n, s);
        let topk = topk_rows(&mut rng, &positions, 2, 512);
        let inp = AttentionInputs {
            q: &c.q,
            topk: &topk,
            topk_len: None,
            positions: &positions,
            replay_start: &[],
            sink: &c.sink,
        };
        let p = AttentionParams {
            ratio: Some(2),
            ..Default::default()
        };
        let (exact, _, _) = both(&p, &inp, KvRows::F32(&c.main), KvRows::F32(&c.swa));
        let (quant, _, _) = both(
            &p,
            &inp,
            KvRows::Records(RecordFormat::Nvfp4Ds, &c.main_rec),
            KvRows::Records(RecordFormat::Mxfp8, &c.swa_rec),
        );
        let st = compare(&quant, &exact, &QUANT_VS_EXACT);
        assert!(
            st.cos_diff < QUANT_VS_EXACT.cos_diff,
            "quantised vs exact: {st:?}"
        );
    }
}

#[test]
fn window_edges_126_to_129_and_replay_start() {
    let mut rng = Rng::new(2);
    let positions = vec![0i64, 1, 126, 127, 128, 129, 300];
    let c = case(&mut rng, positions.len(), 10, 301);
    let topk = vec![-1i32; positions.len() * 16];
    let p = AttentionParams::default();
    let inp = AttentionInputs {
        q: &c.q,
        topk: &topk,
        topk_len: None,
        positions: &positions,
        replay_start: &[],
        sink: &c.sink,
    };
    let (_, _, rows) = both(&p, &inp, KvRows::F32(&c.main), KvRows::F32(&c.swa));
    let want = [0..1, 0..2, 0..127, 0..128, 1..129, 2..130, 173..301];
    for (r, w) in rows.iter().zip(want) {
        assert_eq!(r.swa, w.collect::<Vec<_>>());
    }
    // replay_start inside the window raises the floor; one value for all tokens or one per token.
    let inp2 = AttentionInputs {
        replay_start: &[100],
        ..inp
    };
    let (_, _, rows) = both(&p, &inp2, KvRows::F32(&c.main), KvRows::F32(&c.swa));
    // Tokens 0 and 1 sit below the floor: an empty window (the range is normalised to 100..100).
    let want = [
        100..100,
        100..100,
        100..127,
        100..128,
        100..129,
        100..130,
        173..301,
    ];
    for (r, w) in rows.iter().zip(want) {
        assert_eq!(r.swa, w.collect::<Vec<_>>());
    }
    let rs: Vec<i64> = vec![0, 0, 0, 0, 128, 129, 250];
    let inp3 = AttentionInputs {
        replay_start: &rs,
        ..inp
    };
    let (_, _, rows) = both(&p, &inp3, KvRows::F32(&c.main), KvRows::F32(&c.swa));
    assert_eq!(rows[4].swa, (128..129).collect::<Vec<_>>());
    assert_eq!(rows[5].swa, (129..130).collect::<Vec<_>>());
    assert_eq!(rows[6].swa, (250..301).collect::<Vec<_>>());
}

#[test]
fn masked_rows_stale_entries_and_empty_rows() {
    let mut rng = Rng::new(3);
    let positions = vec![40i64, 41, 42];
    let c = case(&mut rng, 3, 64, 43);
    let p = AttentionParams {
        ratio: Some(1),
        ..Default::default()
    };
    // Row 0: first 16 entries −1 then real ones; row 1: all −1; row 2: valid length 3 then stale
    // garbage (out of range and invisible) that must be ignored.
    let mut topk = vec![-1i32; 3 * 32];
    for (i, v) in topk[16..32].iter_mut().enumerate() {
        *v = i as i32;
    }
    topk[64..67].copy_from_slice(&[5, 1, 9]);
    topk[67..96].fill(1_000_000);
    let len = vec![32, 32, 3];
    let inp = AttentionInputs {
        q: &c.q,
        topk: &topk,
        topk_len: Some(&len),
        positions: &positions,
        replay_start: &[],
        sink: &c.sink,
    };
    let (out, _, rows) = both(&p, &inp, KvRows::F32(&c.main), KvRows::F32(&c.swa));
    assert_eq!(rows[0].main, (0..16).collect::<Vec<usize>>());
    assert!(rows[1].main.is_empty());
    assert_eq!(rows[2].main, vec![5, 1, 9]);
    // Same result as writing −1 into the stale slots.
    let mut clean = topk.clone();
    clean[67..96].fill(-1);
    let inp_clean = AttentionInputs {
        topk: &clean,
        topk_len: None,
        ..inp
    };
    let (out2, _, _) = both(&p, &inp_clean, KvRows::F32(&c.main), KvRows::F32(&c.swa));
    assert_eq!(out, out2);
    // Nothing attended (all −1 and replay_start past p): zeros and lse = −∞, never NaN.
    let inp_empty = AttentionInputs {
        topk: &topk[32..64],
        topk_len: None,
        positions: &positions[..1],
        replay_start: &[41],
        q: &c.q[..HEADS * KV_DIM],
        ..inp
    };
    let (out, lse, _) = both(&p, &inp_empty, KvRows::F32(&c.main), KvRows::F32(&c.swa));
    assert!(out.iter().all(|&v| v == 0.0));
    assert!(lse.iter().all(|&v| v == f32::NEG_INFINITY));
}

#[test]
fn visibility_guard_around_multiples_of_the_ratio() {
    let mut rng = Rng::new(4);
    let c = case(&mut rng, 1, 100, 100);
    for m in [1usize, 2] {
        for pos in [0i64, 1, 2, 3, 4, 5, 62, 63, 64, 65] {
            let vis = (pos as usize + 1) / m;
            let p = AttentionParams {
                ratio: Some(m),
                ..Default::default()
            };
            let ok_sel = vec![vis as i32 - 1, -1];
            let positions = [pos];
            let inp = AttentionInputs {
                q: &c.q,
                topk: &ok_sel,
                topk_len: None,
                positions: &positions,
                replay_start: &[],
                sink: &c.sink,
            };
            if vis > 0 {
                let (_, _, rows) = both(&p, &inp, KvRows::F32(&c.main), KvRows::F32(&c.swa));
                assert_eq!(rows[0].main, vec![vis - 1]);
            }
            let bad = vec![vis as i32, -1];
            let inp = AttentionInputs { topk: &bad, ..inp };
            let mut out = vec![0f32; HEADS * KV_DIM];
            let mut lse = vec![0f32; HEADS];
            let e = attention(
                &p,
                &inp,
                KvRows::F32(&c.main),
                KvRows::F32(&c.swa),
                &mut out,
                &mut lse,
            );
            assert!(
                e.unwrap_err().to_string().contains("not visible"),
                "m {m} p {pos}"
            );
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let mut rng = Rng::new(5);
    let c = case(&mut rng, 1, 10, 10);
    let p = AttentionParams::default();
    let mut out = vec![0f32; HEADS * KV_DIM];
    let mut lse = vec![0f32; HEADS];
    let base = AttentionInputs {
        q: &c.q,
        topk: &[0, -1],
        topk_len: None,
        positions: &[9],
        replay_start: &[],
        sink: &c.sink,
    };
    let run = |inp: AttentionInputs, out: &mut [f32], lse: &mut [f32]| {
        attention(
            &p,
            &inp,
            KvRows::F32(&c.main),
            KvRows::F32(&c.swa),
            out,
            lse,
        )
    };
    assert!(run(base, &mut out, &mut lse).is_ok());
    assert!(run(
        AttentionInputs {
            positions: &[10],
            ..base
        },
        &mut out,
        &mut lse
    )
    .unwrap_err()
    .to_string()
    .contains("at least 11 rows"));
    assert!(run(
        AttentionInputs {
            topk: &[10, -1],
            ..base
        },
        &mut out,
        &mut lse
    )
    .is_err());
    assert!(run(
        AttentionInputs {
            topk: &[-2, -1],
            ..base
        },
        &mut out,
        &mut lse
    )
    .is_err());
    assert!(run(
        AttentionInputs {
            sink: &c.sink[..3],
            ..base
        },
        &mut out,
        &mut lse
    )
    .is_err());
    let mut q = c.q.clone();
    q[5] = f32::INFINITY;
    assert!(run(AttentionInputs { q: &q, ..base }, &mut out, &mut lse).is_err());
}

/// Head counts that are not a multiple of the fast path's lane padding (64), attended-row counts
/// around its 64-row chunks and 4-row tiles, and sharp score spreads (chunk maxima far apart, so
/// the merge of per-chunk softmax statistics matters), for a lone token and a batch. Query scale 4
/// gives logits of std ≈ 4 (chunk maxima several units apart); at scale 12 the f32 rounding of any
/// 512-term dot product order already reaches the 1e-5 tolerance on the sharpest rows.
#[test]
fn head_counts_row_counts_and_chunk_merge() {
    let mut rng = Rng::new(7);
    let s = 400;
    // Rows rounded to bf16 (what every cache format decodes to), so `both` checks the bf16-dot
    // path too. With a single-bf16 query that path exceeded its cosine bound here (1 head,
    // 1 token, 385 rows, q of σ = 4: 1 − cos = 2.6e-5 against 2e-5); the split query (hi + lo)
    // brings it inside the unchanged bound.
    let to_bf16 = |v: Vec<f32>| -> Vec<f32> {
        v.into_iter()
            .map(|x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    let swa = to_bf16(rand_normal(&mut rng, s * KV_DIM, 1.0));
    let main = to_bf16(rand_normal(&mut rng, 300 * KV_DIM, 1.0));
    for heads in [1usize, 5, 8, 64, 72] {
        for (k, pos) in [
            (0usize, 0i64),
            (0, 62),
            (60, 3),
            (63, 127),
            (65, 200),
            (257, 399),
        ] {
            for t in [1usize, 3] {
                for sharp in [1.0f32, 4.0] {
                    let q = rand_normal(&mut rng, t * heads * KV_DIM, sharp);
                    let sink = rand_normal(&mut rng, heads, 1.0);
                    let topk: Vec<i32> = (0..t * k).map(|i| ((i * 37) % 300) as i32).collect();
                    let positions = vec![pos; t];
                    let inp = AttentionInputs {
                        q: &q,
                        topk: &topk,
                        topk_len: None,
                        positions: &positions,
                        replay_start: &[],
                        sink: &sink,
                    };
                    let p = AttentionParams {
                        heads,
                        ..Default::default()
                    };
                    let (_, lse, rows) = both(&p, &inp, KvRows::F32(&main), KvRows::F32(&swa));
                    let n = rows[0].main.len() + rows[0].swa.len();
                    assert_eq!(n, k + (pos as usize + 1).min(128));
                    assert!(lse.iter().all(|v| v.is_finite()));
                }
            }
        }
    }
}

/// Runs [`attention_indexed`] and its f64 reference on the same (already quantised) rows; asserts
/// they agree; returns (out, lse, rows).
fn both_indexed(
    p: &AttentionParams,
    inp: &IndexedInputs,
    main: KvRows,
    swa: KvRows,
) -> (Vec<f32>, Vec<f32>, Vec<TokenRows>) {
    let t = inp.q.len() / (p.heads * KV_DIM);
    let mut out = vec![f32::NAN; t * p.heads * KV_DIM];
    let mut lse = vec![f32::NAN; t * p.heads];
    attention_indexed(p, inp, main, swa, &mut out, &mut lse).unwrap();
    let rows = plan_indexed(p, inp, &main, &swa).unwrap();
    let (ro, rl) = reference::attention_rows(p, inp.q, inp.sink, &rows, main, swa);
    assert!(out.iter().all(|v| v.is_finite()), "never NaN");
    let s = compare(&out, &ro, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "out: {s:?}");
    let s = compare(&lse, &rl, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "lse: {s:?}");
    // The narrow-dot paths on the same rows (records and pools read in place), within their row.
    for dots in [AttentionDots::Bf16, AttentionDots::Int16] {
        if !(dots.is_supported() && bf16_exact(&main) && bf16_exact(&swa)) {
            continue;
        }
        let mut bo = vec![f32::NAN; out.len()];
        let mut bl = vec![f32::NAN; lse.len()];
        attention_with_rows(p, dots, inp.q, inp.sink, &rows, main, swa, &mut bo, &mut bl);
        let s = compare(&bo, &ro, &BF16_DOTS_VS_F64);
        assert!(s.ok(&BF16_DOTS_VS_F64), "{dots:?} out: {s:?}");
        let s = compare(&bl, &rl, &BF16_DOTS_VS_F64);
        assert!(s.ok(&BF16_DOTS_VS_F64), "{dots:?} lse: {s:?}");
    }
    (out, lse, rows)
}

/// Random `(t, k)` slot lists over a pool of `n` rows with about a quarter −1 holes.
fn slot_lists(rng: &mut Rng, t: usize, k: usize, n: usize) -> Vec<i32> {
    use rand::Rng as _;
    (0..t * k)
        .map(|_| {
            if n == 0 || rng.random_bool(0.25) {
                -1
            } else {
                rng.random_range(0..n as i32)
            }
        })
        .collect()
}

/// The rows a token must attend, written out independently of `plan_indexed`.
fn expected_rows(ids: &[i32], len: Option<i32>) -> Vec<usize> {
    let valid = match len {
        None => ids.len(),
        Some(l) if l <= 0 => 0,
        Some(l) => (l as usize).min(ids.len()),
    };
    ids[..valid]
        .iter()
        .filter(|&&j| j >= 0)
        .map(|&j| j as usize)
        .collect()
}

/// All record formats of 512-value rows, as (main, SWA) pairs, with the quantised copies of the
/// f32 pools.
fn encoded(fmt: RecordFormat, x: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8; x.len() / KV_DIM * fmt.record_bytes()];
    encode_rows(fmt, x, &mut b).unwrap();
    b
}

/// Random slot lists with holes, lengths 0 / 1 / full / past K / negative / none, an all-masked
/// token, SWA-only and main-only tokens, 1 and 64 heads, a lone token (row tasks spread over
/// rayon) and a batch (one token per task), every record format and f32 rows: fast path against
/// the f64 reference on the same rows (tight), quantised against f32 rows (loose).
#[test]
fn indexed_matches_reference_formats_lengths_and_holes() {
    let mut rng = Rng::new(11);
    let (n, s, km, ks) = (300usize, 200usize, 96usize, 128usize);
    let main = rand_normal(&mut rng, n * KV_DIM, 1.0);
    let swa = rand_normal(&mut rng, s * KV_DIM, 1.0);
    let pairs = [
        (RecordFormat::Nvfp4Ds, RecordFormat::Mxfp8),
        (RecordFormat::Mxfp8, RecordFormat::Mxfp8),
        (RecordFormat::V4Record, RecordFormat::Nvfp4Ds),
    ];
    // Per token: (main_len, swa_len).
    let lens: [(i32, i32); 9] = [
        (km as i32, ks as i32), // full
        (0, 0),                 // all masked
        (0, 50),                // SWA only
        (70, 0),                // main only
        (1, 1),
        (km as i32 + 9, ks as i32 + 1), // past K: clamped
        (-5, 3),                        // negative: nothing
        (40, 127),
        (km as i32, 64),
    ];
    for heads in [1usize, 64] {
        for t in [1usize, lens.len()] {
            let q = rand_normal(&mut rng, t * heads * KV_DIM, 2.0);
            let sink = rand_normal(&mut rng, heads, 1.0);
            let mut main_idx = slot_lists(&mut rng, t, km, n);
            let swa_idx = slot_lists(&mut rng, t, ks, s);
            // Token 1 (all masked) also has only −1 in its lists; stale ids past a length are
            // out of range and must be ignored.
            if t > 1 {
                main_idx[km..2 * km].fill(-1);
                main_idx[3 * km + 70..4 * km].fill(i32::MAX);
            }
            let ml: Vec<i32> = (0..t).map(|i| lens[i].0).collect();
            let sl: Vec<i32> = (0..t).map(|i| lens[i].1).collect();
            let p = AttentionParams {
                heads,
                ..Default::default()
            };
            for with_len in [true, false] {
                if !with_len && t > 1 {
                    continue; // the stale ids would be read
                }
                let inp = IndexedInputs {
                    q: &q,
                    sink: &sink,
                    main_idx: &main_idx,
                    main_len: with_len.then_some(&ml[..]),
                    swa_idx: &swa_idx,
                    swa_len: with_len.then_some(&sl[..]),
                };
                let (exact, lse, rows) =
                    both_indexed(&p, &inp, KvRows::F32(&main), KvRows::F32(&swa));
                for (i, r) in rows.iter().enumerate() {
                    let (a, b) = (with_len.then_some(ml[i]), with_len.then_some(sl[i]));
                    assert_eq!(r.main, expected_rows(&main_idx[i * km..][..km], a));
                    assert_eq!(r.swa, expected_rows(&swa_idx[i * ks..][..ks], b));
                    let l = &lse[i * heads..][..heads];
                    if r.main.is_empty() && r.swa.is_empty() {
                        assert!(exact[i * heads * KV_DIM..][..heads * KV_DIM]
                            .iter()
                            .all(|&v| v == 0.0));
                        assert!(l.iter().all(|&v| v == f32::NEG_INFINITY));
                    } else {
                        assert!(l.iter().all(|v| v.is_finite()));
                    }
                }
                if t > 1 {
                    assert!(rows[1].main.is_empty() && rows[1].swa.is_empty());
                    assert!(rows[2].main.is_empty() && !rows[2].swa.is_empty());
                    assert!(!rows[3].main.is_empty() && rows[3].swa.is_empty());
                }
                for (mf, sf) in pairs {
                    let (mq, sq) = (encoded(mf, &main), encoded(sf, &swa));
                    let (quant, _, _) =
                        both_indexed(&p, &inp, KvRows::Records(mf, &mq), KvRows::Records(sf, &sq));
                    let st = compare(&quant, &exact, &QUANT_VS_EXACT);
                    assert!(
                        st.cos_diff < QUANT_VS_EXACT.cos_diff,
                        "{mf:?} + {sf:?} vs f32 rows: {st:?}"
                    );
                }
            }
        }
    }
}

/// A repeated id is attended once per occurrence (FlashMLA does not deduplicate): a token that
/// lists row j twice (once as main, once as SWA, or twice in one list) has lse = z + ln 2 against
/// the token that lists it once.
#[test]
fn indexed_duplicate_ids_are_attended_twice() {
    let mut rng = Rng::new(12);
    let c = case(&mut rng, 1, 8, 8);
    let p = AttentionParams::default();
    let run = |m: &[i32], s: &[i32]| {
        let inp = IndexedInputs {
            q: &c.q,
            sink: &c.sink,
            main_idx: m,
            main_len: None,
            swa_idx: s,
            swa_len: None,
        };
        // The same f32 rows in both pools, so that a main and an SWA id name the same key.
        both_indexed(&p, &inp, KvRows::F32(&c.main), KvRows::F32(&c.main))
    };
    let (_, once, _) = run(&[5, -1], &[-1]);
    for (m, s) in [
        (&[5, 5][..], &[-1][..]),
        (&[5, -1], &[5]),
        (&[-1, -1], &[5, 5]),
    ] {
        let (_, twice, rows) = run(m, s);
        assert_eq!(rows[0].main.len() + rows[0].swa.len(), 2);
        for (a, b) in twice.iter().zip(&once) {
            assert!((a - b - std::f32::consts::LN_2).abs() < 1e-5, "{a} vs {b}");
        }
    }
}

/// For one sequence, listing the window rows explicitly gives exactly what [`attention`] computes
/// from positions (same rows, same order, same kernel): bit for bit, for a decode token and a
/// prefill batch, f32 and quantised rows, with and without a replay floor, lengths or −1 padding.
#[test]
fn indexed_window_lists_equal_positional_attention_bit_for_bit() {
    let mut rng = Rng::new(13);
    let (n, s) = (700, 1400);
    for positions in [
        vec![1399i64],
        vec![0i64, 1, 126, 127, 128, 129, 300],
        (0..12).map(|i| 120 * i + 7).collect(),
    ] {
        let t = positions.len();
        let c = case(&mut rng, t, n, s);
        let topk = topk_rows(&mut rng, &positions, 2, 512);
        for replay in [&[][..], &[100i64][..]] {
            let inp = AttentionInputs {
                q: &c.q,
                topk: &topk,
                topk_len: None,
                positions: &positions,
                replay_start: replay,
                sink: &c.sink,
            };
            let p = AttentionParams::default();
            let floor = replay.first().copied().unwrap_or(0);
            // Window rows padded with −1 to 128 (vLLM's layout), and the same with lengths.
            let mut swa_idx = vec![-1i32; t * 128];
            let mut swa_len = vec![0i32; t];
            for (i, &pos) in positions.iter().enumerate() {
                let lo = (pos - 127).max(0).max(floor);
                for (c, r) in (lo..=pos).enumerate() {
                    swa_idx[i * 128 + c] = r as i32;
                }
                swa_len[i] = (pos + 1 - lo).max(0) as i32;
            }
            for (mf, sf) in [
                (None, None),
                (Some(RecordFormat::Nvfp4Ds), Some(RecordFormat::Mxfp8)),
            ] {
                let main = mf.map_or(KvRows::F32(&c.main), |f| KvRows::Records(f, &c.main_rec));
                let swa = sf.map_or(KvRows::F32(&c.swa), |f| KvRows::Records(f, &c.swa_rec));
                let (want, want_lse, want_rows) = both(&p, &inp, main, swa);
                for len in [None, Some(&swa_len[..])] {
                    let ix = IndexedInputs {
                        q: &c.q,
                        sink: &c.sink,
                        main_idx: &topk,
                        main_len: None,
                        swa_idx: &swa_idx,
                        swa_len: len,
                    };
                    let (got, got_lse, rows) = both_indexed(&p, &ix, main, swa);
                    assert_eq!(rows, want_rows);
                    assert!(got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()));
                    assert!(got_lse
                        .iter()
                        .zip(&want_lse)
                        .all(|(a, b)| a.to_bits() == b.to_bits()));
                }
            }
        }
    }
}

/// Out-of-range ids (past either pool, below −1) name the list, token, slot and id; shapes of
/// every list, length, `q`, `sink` and output are checked; empty pools work with −1 lists; nothing
/// is written on error.
#[test]
fn indexed_bad_inputs_are_errors() {
    let mut rng = Rng::new(14);
    let t = 2;
    let c = case(&mut rng, t, 10, 20);
    let p = AttentionParams::default();
    let main_idx = [0, 1, 2, 3, 9, -1, -1, -1];
    let swa_idx = [19, 0, 5, -1, -1, -1];
    let base = IndexedInputs {
        q: &c.q,
        sink: &c.sink,
        main_idx: &main_idx,
        main_len: None,
        swa_idx: &swa_idx,
        swa_len: None,
    };
    let run = |inp: IndexedInputs, nm: usize, ns: usize| {
        let mut out = vec![7f32; t * HEADS * KV_DIM];
        let mut lse = vec![7f32; t * HEADS];
        let r = attention_indexed(
            &p,
            &inp,
            KvRows::F32(&c.main[..nm * KV_DIM]),
            KvRows::F32(&c.swa[..ns * KV_DIM]),
            &mut out,
            &mut lse,
        );
        if r.is_err() {
            assert!(out.iter().chain(&lse).all(|&v| v == 7.0), "untouched");
        }
        r.map_err(|e| e.to_string())
    };
    assert!(run(base, 10, 20).is_ok());
    let err = |inp, nm, ns| run(inp, nm, ns).unwrap_err();
    // Past the pools: main row 9 of 9, SWA row 19 of 19; −2; a length exposing a bad id.
    let e = err(base, 9, 20);
    assert!(
        e.contains("main_idx") && e.contains("token 1, slot 0: row 9"),
        "{e}"
    );
    let e = err(base, 10, 19);
    assert!(
        e.contains("swa_idx") && e.contains("token 0, slot 0: row 19"),
        "{e}"
    );
    let bad = [0, 1, 2, 3, 9, -1, -2, -1];
    let e = err(
        IndexedInputs {
            main_idx: &bad,
            ..base
        },
        10,
        20,
    );
    assert!(e.contains("token 1, slot 2: row -2"), "{e}");
    // The same −2 is ignored behind a length of 2, reported behind a length past K.
    assert!(run(
        IndexedInputs {
            main_idx: &bad,
            main_len: Some(&[4, 2]),
            ..base
        },
        10,
        20
    )
    .is_ok());
    assert!(run(
        IndexedInputs {
            main_idx: &bad,
            main_len: Some(&[4, 99]),
            ..base
        },
        10,
        20
    )
    .is_err());
    // Shapes.
    for e in [
        err(
            IndexedInputs {
                main_idx: &main_idx[..7],
                ..base
            },
            10,
            20,
        ),
        err(
            IndexedInputs {
                swa_idx: &swa_idx[..5],
                ..base
            },
            10,
            20,
        ),
        err(
            IndexedInputs {
                main_len: Some(&[1]),
                ..base
            },
            10,
            20,
        ),
        err(
            IndexedInputs {
                swa_len: Some(&[1, 2, 3]),
                ..base
            },
            10,
            20,
        ),
        err(
            IndexedInputs {
                sink: &c.sink[..63],
                ..base
            },
            10,
            20,
        ),
        err(
            IndexedInputs {
                q: &c.q[..c.q.len() - 1],
                ..base
            },
            10,
            20,
        ),
    ]
    .into_iter()
    .zip(["main_idx", "swa_idx", "main_len", "swa_len", "sink", "q"])
    {
        assert!(
            e.0.contains(e.1) && e.0.contains("expected") && e.0.contains("found"),
            "{e:?}"
        );
    }
    let mut out = vec![0f32; HEADS * KV_DIM];
    let mut lse = vec![0f32; t * HEADS];
    assert!(attention_indexed(
        &p,
        &base,
        KvRows::F32(&c.main),
        KvRows::F32(&c.swa),
        &mut out,
        &mut lse
    )
    .is_err());
    let mut q = c.q.clone();
    q[HEADS * KV_DIM + 3] = f32::NAN;
    assert!(err(IndexedInputs { q: &q, ..base }, 10, 20).contains("non-finite"));
    // Empty pools: fine when every slot is −1 (zeros, −∞), an error for any id.
    let holes = [-1i32; 8];
    let ih = IndexedInputs {
        main_idx: &holes,
        swa_idx: &holes[..6],
        ..base
    };
    assert!(run(ih, 0, 0).is_ok());
    assert!(err(
        IndexedInputs {
            swa_idx: &swa_idx,
            ..ih
        },
        0,
        0
    )
    .contains("swa_idx"));
    // Zero tokens: lists must be empty too.
    let none = IndexedInputs {
        q: &[],
        main_idx: &[],
        swa_idx: &[],
        ..base
    };
    assert!(attention_indexed(
        &p,
        &none,
        KvRows::F32(&[]),
        KvRows::F32(&[]),
        &mut [],
        &mut []
    )
    .is_ok());
    assert!(attention_indexed(
        &p,
        &IndexedInputs {
            main_idx: &[0],
            ..none
        },
        KvRows::F32(&c.main),
        KvRows::F32(&[]),
        &mut [],
        &mut []
    )
    .is_err());
}

#[test]
fn indexed_rows_per_token_are_bounded() {
    // A 256 KiB index list must not become a multi-GiB per-thread tile: past MAX_TOKEN_ROWS the
    // plan is refused (checked before any compute), at the bound it is accepted.
    let p = AttentionParams {
        heads: 1,
        ..Default::default()
    };
    let (q, sink, main) = (vec![0f32; KV_DIM], vec![0f32], vec![0f32; KV_DIM]);
    let swa = vec![0f32; 2 * KV_DIM];
    let ids = vec![0i32; MAX_TOKEN_ROWS];
    let two = [0i32, 1];
    let plan = |main_idx: &[i32], swa_idx: &[i32], swa_len: Option<&[i32]>| {
        plan_indexed(
            &p,
            &IndexedInputs {
                q: &q,
                sink: &sink,
                main_idx,
                main_len: None,
                swa_idx,
                swa_len,
            },
            &KvRows::F32(&main),
            &KvRows::F32(&swa),
        )
        .map(|r| r[0].main.len() + r[0].swa.len())
        .map_err(|e| e.to_string())
    };
    assert_eq!(plan(&ids, &[], None), Ok(MAX_TOKEN_ROWS));
    let e = plan(&ids, &two, None).unwrap_err();
    assert!(
        e.contains("token 0 attends 65538 rows (65536 main + 2 SWA)")
            && e.contains("MAX_TOKEN_ROWS"),
        "{e}"
    );
    // Masked slots do not count: the same lists behind an SWA length of 0 are fine.
    assert_eq!(plan(&ids, &two, Some(&[0])), Ok(MAX_TOKEN_ROWS));
    // The positional path: a top-k row of MAX_TOKEN_ROWS − 1 entries plus the token's own SWA row
    // is the bound; at position 1 the window adds a second row, one too many.
    let topk = vec![0i32; MAX_TOKEN_ROWS - 1];
    let positional = |pos: i64| {
        super::plan(
            &p,
            &AttentionInputs {
                q: &q,
                topk: &topk,
                topk_len: None,
                positions: &[pos],
                replay_start: &[],
                sink: &sink,
            },
            &KvRows::F32(&main),
            &KvRows::F32(&swa),
        )
        .map(|r| r[0].main.len() + r[0].swa.len())
        .map_err(|e| e.to_string())
    };
    assert_eq!(positional(0), Ok(MAX_TOKEN_ROWS));
    let e = positional(1).unwrap_err();
    assert!(
        e.contains("topk / window") && e.contains("65537 rows"),
        "{e}"
    );
}

#[test]
fn a_long_token_does_not_pin_its_scratch_to_the_thread() {
    // One token of 8,000 rows needs ~4.7 M scratch floats (past the 4 M kept). In a 2-thread pool
    // a single token runs on the calling worker (T < threads), so its scratch is this thread's.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    pool.install(|| {
        let n = 8_000;
        let p = AttentionParams {
            heads: 1,
            ..Default::default()
        };
        let mut rng = Rng::new(31);
        let main = rand_normal(&mut rng, n * KV_DIM, 1.0);
        let q = rand_normal(&mut rng, KV_DIM, 0.1);
        let ids: Vec<i32> = (0..n as i32).collect();
        let inp = IndexedInputs {
            q: &q,
            sink: &[0.0],
            main_idx: &ids,
            main_len: None,
            swa_idx: &[],
            swa_len: None,
        };
        let (mut out, mut lse) = (vec![0f32; KV_DIM], vec![0f32]);
        attention_indexed(
            &p,
            &inp,
            KvRows::F32(&main),
            KvRows::F32(&[]),
            &mut out,
            &mut lse,
        )
        .unwrap();
        assert!(out.iter().all(|v| v.is_finite()));
        assert!(cpu::kept_scratch_floats() <= 4 << 20);
        // A V4.1-sized token (top-512 + 128 window, 64 heads) keeps its buffer for the next call.
        let p64 = AttentionParams::default();
        let q64 = rand_normal(&mut rng, 64 * KV_DIM, 0.1);
        let inp64 = IndexedInputs {
            q: &q64,
            sink: &[0.0; 64],
            main_idx: &ids[..640],
            ..inp
        };
        let (mut out, mut lse) = (vec![0f32; 64 * KV_DIM], vec![0f32; 64]);
        attention_indexed(
            &p64,
            &inp64,
            KvRows::F32(&main),
            KvRows::F32(&[]),
            &mut out,
            &mut lse,
        )
        .unwrap();
        assert!(cpu::kept_scratch_floats() > 0);
    });
}

/// The bf16-dot path against the f64 reference on NVFP4 + MXFP8 rows (exact in bf16): decode
/// (one token, chunks over threads) and prefill batches, head counts that pad, odd row counts
/// (a zero row completes the last pair), sharp queries; and each token's result is bit-identical
/// whether it runs alone or in a batch.
#[test]
fn bf16_dots_match_the_reference_and_are_batch_invariant() {
    for dots in [AttentionDots::Bf16, AttentionDots::Int16] {
        if dots.is_supported() {
            narrow_dots_match_the_reference_and_are_batch_invariant(dots);
        }
    }
}

/// A head's output and lse do not depend on how many heads share the call (heads are padded to
/// 16 on the CPU and the score kernels take tiles of 4, 3, 2 or 1 vectors of 16 heads): every
/// dots mode this CPU has, records and f32 rows, a decode token and a prefill batch; each call
/// on the first `h` heads of a 120-head query (tiles 64 + 48 + 8 live) is bit-identical to those
/// heads of the 120-head call. This is what lets a tensor-parallel rank's share of the heads
/// compute the same bits as the whole.
#[test]
fn a_heads_result_does_not_depend_on_the_head_count() {
    let mut rng = Rng::new(23);
    let (n, s, big) = (200, 300, 120);
    let c = case(&mut rng, 1, n, s);
    let recs = (
        KvRows::Records(RecordFormat::Nvfp4Ds, &c.main_rec),
        KvRows::Records(RecordFormat::Mxfp8, &c.swa_rec),
    );
    let f32s = (KvRows::F32(&c.main), KvRows::F32(&c.swa));
    for t in [1usize, 3] {
        let q = rand_normal(&mut rng, t * big * KV_DIM, 2.0);
        let sink = rand_normal(&mut rng, big, 1.0);
        let k = 150;
        let topk: Vec<i32> = (0..t * k).map(|i| ((i * 41) % n) as i32).collect();
        let positions: Vec<i64> = (0..t as i64).map(|i| 290 - i).collect();
        for dots in [
            AttentionDots::F32,
            AttentionDots::Bf16,
            AttentionDots::Int16,
        ] {
            if !dots.is_supported() {
                continue;
            }
            for (main, swa) in [recs, f32s] {
                let run = |h: usize| {
                    let q: Vec<f32> = (0..t)
                        .flat_map(|ti| &q[(ti * big) * KV_DIM..][..h * KV_DIM])
                        .copied()
                        .collect();
                    let inp = AttentionInputs {
                        q: &q,
                        topk: &topk,
                        topk_len: None,
                        positions: &positions,
                        replay_start: &[],
                        sink: &sink[..h],
                    };
                    let p = AttentionParams {
                        heads: h,
                        ..Default::default()
                    };
                    let mut out = vec![f32::NAN; t * h * KV_DIM];
                    let mut lse = vec![f32::NAN; t * h];
                    attention_with_dots(&p, dots, &inp, main, swa, &mut out, &mut lse).unwrap();
                    (out, lse)
                };
                let (bo, bl) = run(big);
                for h in [1usize, 16, 20, 40, 56, 64, 72, 100] {
                    let (o, l) = run(h);
                    for ti in 0..t {
                        let what = format!("{dots:?} t {t} token {ti} heads {h}");
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&o[ti * h * KV_DIM..][..h * KV_DIM]),
                            bits(&bo[ti * big * KV_DIM..][..h * KV_DIM]),
                            "{what}: out"
                        );
                        assert_eq!(
                            bits(&l[ti * h..][..h]),
                            bits(&bl[ti * big..][..h]),
                            "{what}: lse"
                        );
                    }
                }
            }
        }
    }
}

/// The head-count tests again at every lower ISA level this CPU runs, each in a process of its
/// own (`CSA2_ISA` is read once): the 8-lane kernels (AVX2 and the portable one) score 16 padded
/// heads with their own leftover tile, which the machine's best level never runs.
#[test]
fn head_count_tests_at_every_lower_isa_level() {
    use crate::isa::Isa;
    let exe = std::env::current_exe().unwrap();
    for isa in Isa::supported() {
        if isa >= Isa::best() {
            continue;
        }
        for test in [
            "ops::attention::tests::a_heads_result_does_not_depend_on_the_head_count",
            "ops::attention::tests::head_counts_row_counts_and_chunk_merge",
        ] {
            let out = std::process::Command::new(&exe)
                .args(["--exact", test, "--test-threads", "1"])
                .env("CSA2_ISA", isa.name())
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "CSA2_ISA={} {test}:\n{text}{}",
                isa.name(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

fn narrow_dots_match_the_reference_and_are_batch_invariant(dots: AttentionDots) {
    use crate::tolerance::BF16_DOTS_VS_F64 as TOL;
    let mut rng = Rng::new(21);
    let (n, s) = (300, 400);
    let c = case(&mut rng, 1, n, s);
    let main = KvRows::Records(RecordFormat::Nvfp4Ds, &c.main_rec);
    let swa = KvRows::Records(RecordFormat::Mxfp8, &c.swa_rec);
    for heads in [1usize, 5, 64, 72] {
        for (k, pos) in [(0usize, 62i64), (65, 200), (257, 399), (512, 399)] {
            let k = k.min(n);
            for sharp in [1.0f32, 3.0] {
                let t = 5;
                let q = rand_normal(&mut rng, t * heads * KV_DIM, sharp);
                let sink = rand_normal(&mut rng, heads, 1.0);
                let topk: Vec<i32> = (0..t * k).map(|i| ((i * 37) % n) as i32).collect();
                let positions: Vec<i64> = (0..t as i64).map(|i| pos - 3 * i).collect();
                let inp = AttentionInputs {
                    q: &q,
                    topk: &topk,
                    topk_len: None,
                    positions: &positions,
                    replay_start: &[],
                    sink: &sink,
                };
                let p = AttentionParams {
                    heads,
                    ..Default::default()
                };
                let mut out = vec![f32::NAN; t * heads * KV_DIM];
                let mut lse = vec![f32::NAN; t * heads];
                attention_with_dots(&p, dots, &inp, main, swa, &mut out, &mut lse).unwrap();
                let rows = plan(&p, &inp, &main, &swa).unwrap();
                let (ro, rl) = reference::attention(&p, &inp, &rows, main, swa);
                let so = compare(&out, &ro, &TOL);
                let sl = compare(&lse, &rl, &TOL);
                let what = format!("{dots:?} heads {heads} k {k} pos {pos} sharp {sharp}");
                assert!(so.ok(&TOL), "{what} out: {so:?}");
                assert!(sl.ok(&TOL), "{what} lse: {sl:?}");
                // Token 2 alone (the decode path: chunks and slices as rayon tasks).
                let one = AttentionInputs {
                    q: &q[2 * heads * KV_DIM..][..heads * KV_DIM],
                    topk: &topk[2 * k..][..k],
                    positions: &positions[2..3],
                    ..inp
                };
                let mut o1 = vec![f32::NAN; heads * KV_DIM];
                let mut l1 = vec![f32::NAN; heads];
                attention_with_dots(&p, dots, &one, main, swa, &mut o1, &mut l1).unwrap();
                let row = &out[2 * heads * KV_DIM..][..heads * KV_DIM];
                assert!(
                    o1.iter().zip(row).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: token alone vs in a batch"
                );
            }
        }
    }
}

#[test]
fn bf16_dots_names_parse() {
    assert_eq!(
        AttentionDots::from_name("bf16").unwrap(),
        AttentionDots::Bf16
    );
    assert_eq!(
        AttentionDots::from_name("int16").unwrap(),
        AttentionDots::Int16
    );
    assert_eq!(AttentionDots::from_name("f32").unwrap(), AttentionDots::F32);
    assert!(AttentionDots::from_name("fp8").is_err());
    assert!(AttentionDots::F32.is_supported());
    // Int16 needs the bf16 unit too (the window rows and P·V run on it).
    if AttentionDots::Int16.is_supported() {
        assert!(AttentionDots::Bf16.is_supported());
    }
}

/// The backend's rule: int16 where VNNI and BF16 exist, else bf16 where BF16 exists, unless f32
/// (or bf16) is asked for; never a path without its unit.
#[test]
fn backend_dots_default_to_bf16_where_supported() {
    use AttentionDots::{Bf16, Int16, F32};
    for asked in [None, Some(Int16)] {
        assert_eq!(AttentionDots::choose(asked, true, true), Int16);
        assert_eq!(AttentionDots::choose(asked, true, false), Bf16);
        assert_eq!(AttentionDots::choose(asked, false, false), F32);
    }
    assert_eq!(AttentionDots::choose(Some(Bf16), true, true), Bf16);
    assert_eq!(AttentionDots::choose(Some(Bf16), true, false), Bf16);
    assert_eq!(AttentionDots::choose(Some(F32), true, true), F32);
    assert_eq!(AttentionDots::choose(Some(F32), false, false), F32);
    assert_eq!(AttentionDots::choose(Some(Bf16), false, false), F32);
}

/// The int16 path's edges on NVFP4 + MXFP8 records, against the f64 reference and against the
/// bf16 path: one token; all-masked rows (nothing attended: zeros, lse = −∞), a token whose main
/// list is empty (window rows only) and one whose window is empty (main rows only, so every row is
/// an int16 row); main lengths around the chunk size and odd (an int16 row and a window row share
/// a V pair); positions around multiples of the ratio; window lengths 126–129; sharp queries, an
/// all-zero query head and a tiny one.
#[test]
fn int16_dots_edges() {
    use crate::tolerance::BF16_DOTS_VS_F64 as TOL;
    if !AttentionDots::Int16.is_supported() {
        return;
    }
    let mut rng = Rng::new(31);
    let (n, s) = (600, 700);
    let c = case(&mut rng, 1, n, s);
    let main = KvRows::Records(RecordFormat::Nvfp4Ds, &c.main_rec);
    let swa = KvRows::Records(RecordFormat::Mxfp8, &c.swa_rec);
    let run = |p: &AttentionParams, inp: &AttentionInputs, what: &str| {
        let t = inp.positions.len();
        let rows = plan(p, inp, &main, &swa).unwrap();
        let (ro, rl) = reference::attention(p, inp, &rows, main, swa);
        let mut out = vec![f32::NAN; t * p.heads * KV_DIM];
        let mut lse = vec![f32::NAN; t * p.heads];
        attention_with_dots(p, AttentionDots::Int16, inp, main, swa, &mut out, &mut lse).unwrap();
        assert!(out.iter().all(|v| v.is_finite()), "{what}: never NaN");
        for (tok, r) in rows.iter().enumerate() {
            let o = &out[tok * p.heads * KV_DIM..][..p.heads * KV_DIM];
            let l = &lse[tok * p.heads..][..p.heads];
            if r.main.is_empty() && r.swa.is_empty() {
                assert!(o.iter().all(|&v| v == 0.0), "{what} token {tok}: zeros");
                assert!(
                    l.iter().all(|&v| v == f32::NEG_INFINITY),
                    "{what} token {tok}"
                );
            }
        }
        let so = compare(&out, &ro, &TOL);
        let sl = compare(&lse, &rl, &TOL);
        assert!(so.ok(&TOL), "{what} out: {so:?}");
        assert!(sl.ok(&TOL), "{what} lse: {sl:?}");
        (out, lse, rows)
    };
    // One token, a main list of each length class, the window full.
    for k in [0usize, 1, 2, 63, 64, 65, 127, 129, 512] {
        for sharp in [1.0f32, 4.0] {
            let mut q = rand_normal(&mut rng, HEADS * KV_DIM, sharp);
            q[3 * KV_DIM..4 * KV_DIM].fill(0.0);
            q[5 * KV_DIM..6 * KV_DIM]
                .iter_mut()
                .for_each(|v| *v *= 1e-30);
            let topk: Vec<i32> = (0..k).map(|i| ((i * 13) % n) as i32).collect();
            let inp = AttentionInputs {
                q: &q,
                topk: &topk,
                topk_len: None,
                positions: &[s as i64 - 1],
                replay_start: &[],
                sink: &c.sink,
            };
            let p = AttentionParams::default();
            let (_, _, rows) = run(&p, &inp, &format!("k {k} sharp {sharp}"));
            assert_eq!((rows[0].main.len(), rows[0].swa.len()), (k, 128));
            // The same rows with the window cut off (replay_start past p): only int16 rows.
            let inp_main = AttentionInputs {
                replay_start: &[s as i64],
                ..inp
            };
            let (out, lse, rows) = run(&p, &inp_main, &format!("k {k} main only"));
            assert!(rows[0].swa.is_empty());
            if k == 0 {
                assert!(out.iter().all(|&v| v == 0.0) && lse.iter().all(|v| v.is_infinite()));
            }
        }
    }
    // A prefill batch: positions around multiples of the ratio (visibility guard), window lengths
    // 126–129, an all-masked top-k row and one cut by its valid length.
    let positions: Vec<i64> = vec![0, 1, 2, 3, 125, 126, 127, 128, 129, 255, 256, 257, 699];
    let t = positions.len();
    let q = rand_normal(&mut rng, t * HEADS * KV_DIM, 2.0);
    let ratio = 2;
    let mut topk = topk_rows(&mut rng, &positions, ratio, 64);
    topk[4 * 64..5 * 64].fill(-1);
    let len: Vec<i32> = (0..t as i32).map(|i| if i == 6 { 7 } else { 64 }).collect();
    let inp = AttentionInputs {
        q: &q,
        topk: &topk,
        topk_len: Some(&len),
        positions: &positions,
        replay_start: &[],
        sink: &c.sink,
    };
    let p = AttentionParams {
        ratio: Some(ratio),
        ..Default::default()
    };
    let (out, _, rows) = run(&p, &inp, "prefill");
    assert!(rows[4].main.is_empty() && rows[6].main.len() <= 7);
    // Nothing attended anywhere (all −1, window cut): zeros and −∞.
    let none = vec![-1i32; t * 64];
    let cut: Vec<i64> = positions.iter().map(|&p| p + 1).collect();
    let inp_none = AttentionInputs {
        topk: &none,
        topk_len: None,
        replay_start: &cut,
        ..inp
    };
    let (o2, _, rows2) = run(&p, &inp_none, "all masked");
    assert!(rows2.iter().all(|r| r.main.is_empty() && r.swa.is_empty()));
    assert!(o2.iter().all(|&v| v == 0.0));
    // Each token alone gives the bits it got in the batch.
    for ti in [0usize, 5, 12] {
        let one = AttentionInputs {
            q: &q[ti * HEADS * KV_DIM..][..HEADS * KV_DIM],
            topk: &topk[ti * 64..][..64],
            topk_len: Some(&len[ti..ti + 1]),
            positions: &positions[ti..ti + 1],
            ..inp
        };
        let (o1, _, _) = run(&p, &one, "alone");
        let row = &out[ti * HEADS * KV_DIM..][..HEADS * KV_DIM];
        assert!(
            o1.iter().zip(row).all(|(a, b)| a.to_bits() == b.to_bits()),
            "token {ti}: alone vs in a batch"
        );
    }
}

/// Several threads outside the pool (as engine threads calling the C ABI would be) run lone decode
/// tokens at once on the narrow paths: their crews share the rayon pool's workers as helpers, and
/// every output must carry the bits of the same token run alone.
#[test]
fn concurrent_callers_get_the_bits_of_a_lone_call() {
    for dots in [AttentionDots::Bf16, AttentionDots::Int16] {
        if !dots.is_supported() {
            continue;
        }
        let mut rng = Rng::new(33);
        let (n, s) = (700, 300);
        let c = case(&mut rng, 4, n, s);
        let main = KvRows::Records(RecordFormat::Nvfp4Ds, &c.main_rec);
        let swa = KvRows::Records(RecordFormat::Mxfp8, &c.swa_rec);
        let p = AttentionParams::default();
        let k = 512;
        let topk: Vec<i32> = (0..4 * k).map(|i| ((i * 13) % n) as i32).collect();
        let run = |ti: usize| {
            let inp = AttentionInputs {
                q: &c.q[ti * HEADS * KV_DIM..][..HEADS * KV_DIM],
                topk: &topk[ti * k..][..k],
                topk_len: None,
                positions: &[s as i64 - 1 - ti as i64],
                replay_start: &[],
                sink: &c.sink,
            };
            let mut o = vec![f32::NAN; HEADS * KV_DIM];
            let mut l = vec![f32::NAN; HEADS];
            attention_with_dots(&p, dots, &inp, main, swa, &mut o, &mut l).unwrap();
            (o, l)
        };
        let alone: Vec<_> = (0..4).map(run).collect();
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..4)
                .map(|ti| {
                    let (run, alone) = (&run, &alone);
                    sc.spawn(move || {
                        for _ in 0..20 {
                            let (o, l) = run(ti);
                            let same = |a: &[f32], b: &[f32]| {
                                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                            };
                            assert!(same(&o, &alone[ti].0) && same(&l, &alone[ti].1));
                        }
                    })
                })
                .collect();
            for h in hs {
                if h.join().is_err() {
                    panic!("{dots:?}: a concurrent caller got other bits");
                }
            }
        });
    }
}
