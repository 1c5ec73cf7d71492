use super::*;
use crate::formats::{encode_rows, MXFP8_BYTES, NVFP4_DS_BYTES};
use crate::ops::testutil::{rand_normal, NewRng, Rng};
use crate::tolerance::{compare, F32_VS_F64, QUANT_VS_EXACT};

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
    (out, lse, rows)
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
        assert_eq!(r.swa, w);
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
        assert_eq!(r.swa, w);
    }
    let rs: Vec<i64> = vec![0, 0, 0, 0, 128, 129, 250];
    let inp3 = AttentionInputs {
        replay_start: &rs,
        ..inp
    };
    let (_, _, rows) = both(&p, &inp3, KvRows::F32(&c.main), KvRows::F32(&c.swa));
    assert_eq!(rows[4].swa, 128..129);
    assert_eq!(rows[5].swa, 129..130);
    assert_eq!(rows[6].swa, 250..301);
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
    let swa = rand_normal(&mut rng, s * KV_DIM, 1.0);
    let main = rand_normal(&mut rng, 300 * KV_DIM, 1.0);
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
