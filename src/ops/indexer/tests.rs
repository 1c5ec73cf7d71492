use super::*;
use crate::formats::encode_rows;
use crate::ops::testutil::{rand_normal, NewRng, Rng};
use crate::ops::topk;
use crate::tolerance::{compare, F32_VS_F64};

struct Case {
    q: Vec<f32>,
    w: Vec<f32>,
    k: Vec<f32>,
    k_mx: Vec<u8>,
    positions: Vec<i64>,
}

fn case(rng: &mut Rng, n: usize, positions: Vec<i64>) -> Case {
    let t = positions.len();
    let q = rand_normal(rng, t * INDEX_HEADS * INDEX_DIM, 1.0);
    let w = rand_normal(rng, t * INDEX_HEADS, (128f32 * 32.0).sqrt().recip());
    let k = rand_normal(rng, n * INDEX_DIM, 1.0);
    let mut k_mx = vec![0u8; n * MXFP4_INDEX_BYTES];
    encode_rows(RecordFormat::Mxfp4Index, &k, &mut k_mx).unwrap();
    Case {
        q,
        w,
        k,
        k_mx,
        positions,
    }
}

fn run_both(p: &IndexerParams, c: &Case, keys: IndexKeys) -> (Vec<f32>, Vec<f64>) {
    let qs = IndexerQueries {
        q: &c.q,
        w: &c.w,
        positions: &c.positions,
    };
    let mut out = vec![0f32; c.positions.len() * keys.len()];
    logits(p, &qs, keys, &mut out).unwrap();
    let r = reference::logits(p, &qs, keys, None);
    (out, r)
}

#[test]
fn visibility_around_every_multiple_of_the_ratio() {
    let mut rng = Rng::new(1);
    for m in [1usize, 2] {
        let n = 300;
        // p from 0 up to the last position whose visible count fits n, stepping over m·j − 1, m·j, m·j + 1.
        let positions: Vec<i64> = (0..(n * m) as i64)
            .filter(|p| p % 37 < 3 || p % 37 > 34)
            .collect();
        let c = case(&mut rng, n, positions.clone());
        let p = IndexerParams::new(m);
        let (out, r) = run_both(&p, &c, IndexKeys::F32(&c.k));
        for (ti, &pos) in positions.iter().enumerate() {
            let vis = (pos as usize + 1) / m;
            let row = &out[ti * n..(ti + 1) * n];
            assert!(
                row[..vis].iter().all(|v| v.is_finite()),
                "m {m} p {pos}: visible entries finite"
            );
            assert!(
                row[vis..].iter().all(|&v| v == f32::NEG_INFINITY),
                "m {m} p {pos}: entry {vis} hidden"
            );
        }
        let s = compare(&out, &r, &F32_VS_F64);
        assert!(s.ok(&F32_VS_F64), "m {m}: {s:?}");
    }
}

#[test]
fn mxfp4_keys_and_quantised_queries_match_the_reference() {
    let mut rng = Rng::new(2);
    // Enough queries for the prefill path (query blocks) and a single query for the decode path.
    for positions in [
        (0..40).map(|i| 100 + 97 * i).collect::<Vec<i64>>(),
        vec![4095],
    ] {
        let c = case(&mut rng, 4096, positions);
        for qq in [QueryQuant::None, QueryQuant::Mxfp4, QueryQuant::Fp8] {
            let p = IndexerParams {
                query_quant: qq,
                ..IndexerParams::new(1)
            };
            let (out, r) = run_both(&p, &c, IndexKeys::Mxfp4(&c.k_mx));
            let s = compare(&out, &r, &F32_VS_F64);
            assert!(s.ok(&F32_VS_F64), "{qq:?}: {s:?}");
        }
        // The MXFP4 keys are a loose approximation of the f32 keys.
        let p = IndexerParams::new(1);
        let (exact, _) = run_both(&p, &c, IndexKeys::F32(&c.k));
        let (quant, _) = run_both(&p, &c, IndexKeys::Mxfp4(&c.k_mx));
        let s = compare(&quant, &exact, &crate::tolerance::QUANT_VS_EXACT);
        assert!(s.cos_diff < 2e-2, "mxfp4 vs f32 keys: {s:?}");
    }
}

#[test]
fn pooled_scoring_masks_outside_the_blocks() {
    let mut rng = Rng::new(3);
    let n = 1000;
    let c = case(&mut rng, n, vec![999, 500, 7]);
    let p = IndexerParams::new(1);
    let cp = CandidateParams {
        block_size: 8,
        num_blocks: 4,
    };
    // Token 0: blocks 124 (newest), 3 and 0 listed out of order; token 1: none; token 2: block 0.
    let blocks = vec![124, 3, 0, -1, -1, 9, 9, 9, 0, -1, -1, -1];
    let qs = IndexerQueries {
        q: &c.q,
        w: &c.w,
        positions: &c.positions,
    };
    let mut out = vec![0f32; 3 * n];
    logits_in_blocks(&p, &qs, IndexKeys::Mxfp4(&c.k_mx), &blocks, &cp, &mut out).unwrap();
    let vis = [1000, 501, 8];
    let pools = pools_of(3, n, &blocks, &cp, &vis).unwrap();
    assert_eq!(pools[1].len(), 0, "a list starting with −1 is empty");
    let r = reference::logits(&p, &qs, IndexKeys::Mxfp4(&c.k_mx), Some(&pools));
    let s = compare(&out, &r, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "{s:?}");
    let finite: Vec<usize> = (0..n).filter(|&j| out[j].is_finite()).collect();
    let want: Vec<usize> = (0..8).chain(24..32).chain(992..1000).collect();
    assert_eq!(finite, want);
    assert!(out[n..2 * n].iter().all(|&v| v == f32::NEG_INFINITY));
    // A block id past the keys is an error naming it.
    let e = logits_in_blocks(
        &p,
        &qs,
        IndexKeys::F32(&c.k),
        &[200, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1],
        &cp,
        &mut out,
    );
    assert!(e.unwrap_err().to_string().contains("block 200"));
}

#[test]
fn integer_logits_tie_to_the_smaller_index() {
    // Keys that are copies of 3 patterns make many exactly equal logits.
    let mut rng = Rng::new(4);
    let n = 2000;
    let mut c = case(&mut rng, n, vec![1999]);
    let pats: Vec<f32> = c.k[..3 * INDEX_DIM].iter().map(|v| v.round()).collect();
    for j in 0..n {
        let src = &pats[(j % 3) * INDEX_DIM..][..INDEX_DIM];
        c.k[j * INDEX_DIM..][..INDEX_DIM].copy_from_slice(src);
    }
    for v in c.q.iter_mut() {
        *v = v.round();
    }
    for v in c.w.iter_mut() {
        *v = v.abs().max(0.25).round().max(1.0);
    }
    let p = IndexerParams::new(1);
    let (out, r) = run_both(&p, &c, IndexKeys::F32(&c.k));
    let r32: Vec<f32> = r.iter().map(|&v| v as f32).collect();
    assert_eq!(out, r32, "integer inputs are exact in f32");
    let mut sel = vec![0i32; 512];
    topk::select(&out, 2000, &mut sel);
    let refsel = topk::reference::select(&r32, 2000, 512);
    assert_eq!(sel, refsel);
    // Among equal logits the smallest indices win: every selected entry of the boundary value has a
    // smaller index than every unselected one.
    let kth = out[sel[511] as usize];
    let max_sel = sel
        .iter()
        .filter(|&&j| out[j as usize] == kth)
        .max()
        .unwrap();
    let min_unsel = (0..n as i32)
        .filter(|j| !sel.contains(j) && out[*j as usize] == kth)
        .min();
    if let Some(u) = min_unsel {
        assert!(max_sel < &u);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let mut rng = Rng::new(5);
    let c = case(&mut rng, 10, vec![9]);
    let qs = IndexerQueries {
        q: &c.q,
        w: &c.w,
        positions: &c.positions,
    };
    let mut out = vec![0f32; 10];
    assert!(logits(&IndexerParams::new(0), &qs, IndexKeys::F32(&c.k), &mut out).is_err());
    let e = logits(
        &IndexerParams::new(1),
        &IndexerQueries {
            positions: &[20],
            ..qs
        },
        IndexKeys::F32(&c.k),
        &mut out,
    );
    assert!(e.unwrap_err().to_string().contains("at least 21 entries"));
    let e = logits(
        &IndexerParams::new(1),
        &IndexerQueries {
            positions: &[-3],
            ..qs
        },
        IndexKeys::F32(&c.k),
        &mut out,
    );
    assert!(e.is_err());
    assert!(logits(
        &IndexerParams::new(1),
        &qs,
        IndexKeys::F32(&c.k[..100]),
        &mut out
    )
    .is_err());
}
