use super::*;
use crate::formats::{decode_rows, RecordFormat};
use crate::geometry::Geometry;
use crate::tolerance::{compare, Tolerance, F32_VS_F64, QUANT_VS_EXACT};
use csa2_rng::{rand_normal, NewRng, Rng};

const BF16_STEP: Tolerance = crate::tolerance::BF16_ROUNDED;

pub(super) struct Weights {
    pub(super) norm: Vec<f32>,
    pub(super) wk: Vec<f32>,
    pub(super) k_norm: Vec<f32>,
}

pub(super) fn weights(rng: &mut Rng) -> Weights {
    Weights {
        norm: rand_normal(rng, KV_DIM, 0.2)
            .iter()
            .map(|v| 1.0 + v)
            .collect(),
        wk: rand_normal(rng, INDEX_DIM * KV_DIM, (KV_DIM as f32).sqrt().recip()),
        k_norm: rand_normal(rng, INDEX_DIM, 0.2)
            .iter()
            .map(|v| 1.0 + v)
            .collect(),
    }
}

pub(super) fn cw(w: &Weights) -> PooledWeights<'_> {
    PooledWeights {
        norm: &w.norm,
        wk: &w.wk,
        k_norm: &w.k_norm,
    }
}

fn rope(layer: usize) -> Rope {
    Rope::for_layer(&Geometry::embedded().layers[layer])
}

/// Decoded records agree with the reference's qdq records except for rare one-code flips caused by
/// f32-vs-f64 rounding just before the quantiser.
pub(super) fn records_close(fmt: RecordFormat, a: &[u8], b: &[u8]) {
    let n = a.len() / fmt.record_bytes();
    let (mut da, mut db) = (vec![0f32; n * fmt.dim()], vec![0f32; n * fmt.dim()]);
    decode_rows(fmt, a, &mut da).unwrap();
    decode_rows(fmt, b, &mut db).unwrap();
    let differ = da.iter().zip(&db).filter(|(x, y)| x != y).count();
    assert!(
        differ * 1000 <= da.len().max(1000),
        "{fmt:?}: {differ} of {} values differ",
        da.len()
    );
    let s = compare(&da, &db, &QUANT_VS_EXACT);
    assert!(s.cos_diff < 1e-4, "{fmt:?}: {s:?}");
}

fn check_against_reference(m: usize, t: usize, start: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let w = weights(&mut rng);
    let kv = rand_normal(&mut rng, t * KV_DIM, 1.0);
    let score = rand_normal(&mut rng, t * KV_DIM, 2.0);
    let layer = if m == 2 { 2 } else { 20 };
    let c = Compressor::new(m, 1e-20, rope(layer), cw(&w)).unwrap();
    let sc = (m == 2).then_some(&score[..]);
    let mut st = CompressorState::new(start as u64);
    let out = c.compress(&mut st, &kv, sc).unwrap();
    let r = reference::compress(m, 1e-20, &rope(layer), &cw(&w), &kv, sc, start);
    assert_eq!(out.count, t / m);
    assert_eq!(out.first_entry, start / m);
    assert_eq!(st.pending_tokens(), t % m);
    let s = compare(&out.latent, &r.latent, &BF16_STEP);
    assert!(s.ok(&BF16_STEP), "latent m={m}: {s:?}");
    // Downstream of the latent, compare against the reference continued from *our* latent (a bf16
    // step may have flipped; with no flip this is the reference chain itself).
    let (mut rm, mut ri) = (Vec::new(), Vec::new());
    for (g, lat) in out.latent.chunks_exact(KV_DIM).enumerate() {
        let (a, b) = reference::from_latent(1e-20, &rope(layer), &cw(&w), lat, (start / m + g) * m);
        rm.extend(a);
        ri.extend(b);
    }
    if out.latent == r.latent {
        assert_eq!((&rm, &ri), (&r.main_kv, &r.index_k));
    }
    let s = compare(&out.main_kv, &rm, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "main_kv m={m}: {s:?}");
    let s = compare(&out.index_k, &ri, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "index_k m={m}: {s:?}");
    records_close(
        RecordFormat::Nvfp4Ds,
        &out.main_kv_nvfp4,
        &r.f32.main_kv_nvfp4,
    );
    records_close(
        RecordFormat::Mxfp4Index,
        &out.index_k_mxfp4,
        &r.f32.index_k_mxfp4,
    );
    // The records are a loose approximation of the unquantised values.
    let mut dec = vec![0f32; out.count * KV_DIM];
    decode_rows(RecordFormat::Nvfp4Ds, &out.main_kv_nvfp4, &mut dec).unwrap();
    let s = compare(&dec, &r.main_kv, &QUANT_VS_EXACT);
    assert!(
        s.cos_diff < QUANT_VS_EXACT.cos_diff,
        "nvfp4 vs exact: {s:?}"
    );
}

#[test]
fn ratio_2_and_1_match_the_reference() {
    check_against_reference(2, 64, 0, 1);
    check_against_reference(2, 256, 0, 4); // large enough that a bf16 step of the latent may differ
    check_against_reference(2, 37, 128, 2); // odd length: the last token stays pending
    check_against_reference(1, 33, 65_530, 3); // crosses YaRN's original context
}

#[test]
fn a_pair_split_across_calls_pools_exactly_as_in_one_call() {
    let mut rng = Rng::new(7);
    let w = weights(&mut rng);
    let t = 21;
    let kv = rand_normal(&mut rng, t * KV_DIM, 1.0);
    let score = rand_normal(&mut rng, t * KV_DIM, 2.0);
    for m in [1usize, 2] {
        let c = Compressor::new(m, 1e-20, rope(2), cw(&w)).unwrap();
        let sc = |a: usize, b: usize| (m == 2).then_some(&score[a * KV_DIM..b * KV_DIM]);
        let mut one = CompressorState::new(6);
        let whole = c.compress(&mut one, &kv, sc(0, t)).unwrap();
        // Prefill chunk of 5 (ends mid-pair), a decode step, a chunk of 1, then the rest.
        let mut st = CompressorState::new(6);
        let mut parts = Vec::new();
        let cuts = [0usize, 5, 6, 7, 8, 15, t];
        for w2 in cuts.windows(2) {
            let (a, b) = (w2[0], w2[1]);
            parts.push(
                c.compress(&mut st, &kv[a * KV_DIM..b * KV_DIM], sc(a, b))
                    .unwrap(),
            );
        }
        assert_eq!(st, one, "same final state");
        let cat =
            |f: &dyn Fn(&Compressed) -> Vec<f32>| parts.iter().flat_map(f).collect::<Vec<f32>>();
        assert_eq!(cat(&|p| p.latent.clone()), whole.latent);
        assert_eq!(cat(&|p| p.main_kv.clone()), whole.main_kv);
        assert_eq!(cat(&|p| p.index_k.clone()), whole.index_k);
        let recs: Vec<u8> = parts.iter().flat_map(|p| p.main_kv_nvfp4.clone()).collect();
        assert_eq!(recs, whole.main_kv_nvfp4);
        // Entry ids are contiguous across calls.
        let mut next = 6 / m;
        for p in &parts {
            if p.count > 0 {
                assert_eq!(p.first_entry, next);
            }
            next += p.count;
        }
    }
}

#[test]
fn bad_inputs_are_errors_and_leave_the_state_alone() {
    let mut rng = Rng::new(9);
    let w = weights(&mut rng);
    let c2 = Compressor::new(2, 1e-20, rope(2), cw(&w)).unwrap();
    let kv = rand_normal(&mut rng, 3 * KV_DIM, 1.0);
    let mut st = CompressorState::new(1);
    let e = c2.compress(&mut st, &kv, Some(&kv)).unwrap_err();
    assert!(e.to_string().contains("half pair"), "{e}");
    let mut st = CompressorState::new(0);
    assert!(c2.compress(&mut st, &kv, None).is_err());
    let mut bad = kv.clone();
    bad[700] = f32::NAN;
    let e = c2.compress(&mut st, &bad, Some(&kv)).unwrap_err();
    assert!(e.to_string().contains("row 1, column 188"), "{e}");
    assert_eq!(st, CompressorState::new(0));
    assert!(c2.compress(&mut st, &kv[..100], Some(&kv[..100])).is_err());
    assert!(Compressor::new(3, 1e-20, rope(2), cw(&w)).is_err());
    let short = PooledWeights {
        wk: &w.wk[..10],
        ..cw(&w)
    };
    assert!(Compressor::new(2, 1e-20, rope(2), short).is_err());
}

/// The batched paged reference (the CUDA kernel's contract) splits a request's tokens into calls
/// any way and writes the same pages, and its entries are the fast path's entries.
#[test]
fn paged_reference_carry_equals_one_shot_and_matches_the_fast_path() {
    let mut rng = Rng::new(3);
    let w = weights(&mut rng);
    let c = Compressor::new(2, 1e-20, rope(2), cw(&w)).unwrap();
    let kv = rand_normal(&mut rng, 9 * KV_DIM, 1.0);
    let score = rand_normal(&mut rng, 9 * KV_DIM, 2.0);
    let bt = vec![0i32, 1];
    let run = |splits: &[usize]| {
        let mut main = vec![0u8; 2 * 4 * NVFP4_DS_BYTES];
        let mut idx = vec![0u8; 2 * 4 * MXFP4_INDEX_BYTES];
        let mut st = CarryState::new(1);
        let (mut p, mut entries) = (0usize, vec![]);
        for &l in splits {
            let b = CompressorBatch {
                kv: &kv[p * KV_DIM..(p + l) * KV_DIM],
                score: Some(&score[p * KV_DIM..(p + l) * KV_DIM]),
                cu_tokens: &[0, l as i32],
                start_pos: &[p as i32],
                block_table: &bt,
                max_blocks: 2,
                page_slots: 4,
            };
            entries
                .extend(reference::compress_paged(&c, &b, &mut st, &mut main, &mut idx).unwrap());
            p += l;
        }
        (main, idx, st, entries)
    };
    let one = run(&[9]);
    let split = run(&[1, 2, 3, 3]);
    assert_eq!(one.0, split.0, "main pages depend on the chunking");
    assert_eq!(one.1, split.1, "index pages depend on the chunking");
    assert_eq!(one.2, split.2);
    assert_eq!(one.2.pos, vec![8], "token 8 (even, unpaired) is carried");
    assert_eq!(one.3.len(), 4);
    assert_eq!(
        one.3[3].slot,
        Some(3),
        "entry 3: block 0 → page 0, offset 3"
    );
    // The same tokens through the CPU fast path: the same entries within the f32 tolerance.
    let mut state = CompressorState::new(0);
    let fast = c.compress(&mut state, &kv, Some(&score)).unwrap();
    let want: Vec<f64> = one.3.iter().flat_map(|e| e.main_kv.clone()).collect();
    let s = compare(&fast.main_kv, &want, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "{s:?}");
    let want: Vec<f64> = one.3.iter().flat_map(|e| e.index_k.clone()).collect();
    let s = compare(&fast.index_k, &want, &F32_VS_F64);
    assert!(s.ok(&F32_VS_F64), "{s:?}");
}

/// A carry state shorter than the batch is a shape error, not an index panic (the check used to
/// read `state.pos[r]` before checking the state's length).
#[test]
fn batched_plan_checks_the_carry_before_reading_it() {
    let kv = vec![0f32; 2 * KV_DIM];
    let b = CompressorBatch {
        kv: &kv,
        score: Some(&kv),
        cu_tokens: &[0, 1, 2],
        start_pos: &[0, 1],
        block_table: &[0, 0],
        max_blocks: 1,
        page_slots: 4,
    };
    let st = CarryState::new(1);
    let e = b
        .plan(2, Some(&st), 4 * NVFP4_DS_BYTES, 4 * MXFP4_INDEX_BYTES)
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");
    let e = b.plan(3, None, 0, 0).unwrap_err().to_string();
    assert!(e.contains("ratio"), "{e}");
    let e = b
        .plan(1, None, 4 * NVFP4_DS_BYTES + 1, 4 * MXFP4_INDEX_BYTES)
        .unwrap_err()
        .to_string();
    assert!(e.contains("page pools"), "{e}");
}

// ---- the view entry (`compress_view`): one dispatch for host and CUDA tensors ----

pub(super) fn params(m: usize) -> CompressorParams {
    CompressorParams {
        ratio: m,
        eps: 1e-20,
        rope: rope(if m == 2 { 2 } else { 20 }),
    }
}

/// The view entry on host tensors writes exactly what `Compressor::compress` emits, for both
/// ratios and a start that is not 0, and the records follow the f64 reference.
#[test]
fn compress_view_on_host_is_the_compressor() {
    for (m, t, start, seed) in [(2usize, 10usize, 6i64, 41u64), (1, 5, 3, 42)] {
        let mut rng = Rng::new(seed);
        let w = weights(&mut rng);
        let kv = rand_normal(&mut rng, t * KV_DIM, 1.0);
        let score = rand_normal(&mut rng, t * KV_DIM, 2.0);
        let sc = (m == 2).then_some(&score[..]);
        let c = Compressor::new(m, 1e-20, params(m).rope, cw(&w)).unwrap();
        let want = c
            .compress(&mut CompressorState::new(start as u64), &kv, sc)
            .unwrap();
        let e = t / m;
        let (kvv, sv) = (
            TensorView::from_host_slice(&kv, &[t, KV_DIM]).unwrap(),
            TensorView::from_host_slice(&score, &[t, KV_DIM]).unwrap(),
        );
        let nv = TensorView::from_host_slice(&w.norm, &[KV_DIM]).unwrap();
        let wv = TensorView::from_host_slice(&w.wk, &[INDEX_DIM, KV_DIM]).unwrap();
        let kn = TensorView::from_host_slice(&w.k_norm, &[INDEX_DIM]).unwrap();
        let (mut main, mut index) = record_buffers(e);
        let views = CompressViews {
            kv: &kvv,
            score: (m == 2).then_some(&sv),
            norm: &nv,
            wk: &wv,
            k_norm: &kn,
        };
        compress_view(
            &params(m),
            &views,
            start,
            0,
            &mut TensorViewMut::from_host_slice(&mut main, &[e, NVFP4_DS_BYTES]).unwrap(),
            &mut TensorViewMut::from_host_slice(&mut index, &[e, MXFP4_INDEX_BYTES]).unwrap(),
        )
        .unwrap();
        assert_eq!(main, want.main_kv_nvfp4, "m={m}");
        assert_eq!(index, want.index_k_mxfp4, "m={m}");
        let r = reference::compress(m, 1e-20, &params(m).rope, &cw(&w), &kv, sc, start as usize);
        records_close(RecordFormat::Nvfp4Ds, &main, &r.f32.main_kv_nvfp4);
        records_close(RecordFormat::Mxfp4Index, &index, &r.f32.index_k_mxfp4);
    }
}

/// A fake device view: never dereferenced (every test below fails before memory is touched).
fn cuda_view(shape: &[usize], dt: crate::tensor::DType) -> TensorView<'static> {
    crate::tensor::fake::cuda(0x1000, shape, dt)
}

fn cuda_view_mut(shape: &[usize]) -> TensorViewMut<'static> {
    crate::tensor::fake::cuda_mut(0x8000, shape, crate::tensor::DType::U8)
}

/// Host and CUDA tensors in one call are refused by name, whatever the build; bad alignment and
/// output sizes are refused before any device is looked at.
#[test]
fn compress_view_refuses_mixed_devices_and_bad_sizes() {
    let mut rng = Rng::new(5);
    let w = weights(&mut rng);
    let kv = rand_normal(&mut rng, 4 * KV_DIM, 1.0);
    let kvv = TensorView::from_host_slice(&kv, &[4, KV_DIM]).unwrap();
    let nv = TensorView::from_host_slice(&w.norm, &[KV_DIM]).unwrap();
    let wv = TensorView::from_host_slice(&w.wk, &[INDEX_DIM, KV_DIM]).unwrap();
    let dev_kn = cuda_view(&[INDEX_DIM], crate::tensor::DType::F32);
    let (mut main, mut index) = record_buffers(4);
    let views = CompressViews {
        kv: &kvv,
        score: None,
        norm: &nv,
        wk: &wv,
        k_norm: &dev_kn,
    };
    let mut mo = TensorViewMut::from_host_slice(&mut main, &[4, NVFP4_DS_BYTES]).unwrap();
    let mut io = TensorViewMut::from_host_slice(&mut index, &[4, MXFP4_INDEX_BYTES]).unwrap();
    let e = compress_view(&params(1), &views, 0, 0, &mut mo, &mut io).unwrap_err();
    assert!(
        matches!(e, Error::Invalid { .. }) && e.to_string().contains("k_norm"),
        "{e}"
    );
    let e = compress_view(
        &params(1),
        &views,
        0,
        0,
        &mut mo,
        &mut cuda_view_mut(&[4, 68]),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Invalid { .. }), "{e}");
    let e = compress_view(&params(2), &views, 0, 0, &mut mo, &mut io).unwrap_err();
    assert!(e.to_string().contains("score"), "{e}");
    let views = CompressViews {
        k_norm: &nv,
        ..views
    };
    let e = compress_view(&params(1), &views, 0, 0, &mut mo, &mut io).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "k_norm of 512: {e}");
    assert_eq!(
        main,
        vec![0u8; 4 * NVFP4_DS_BYTES],
        "nothing written on error"
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn compress_view_on_cuda_tensors_without_the_feature_is_no_cuda_build() {
    use crate::tensor::DType::F32;
    let (kv, norm) = (cuda_view(&[4, KV_DIM], F32), cuda_view(&[KV_DIM], F32));
    let (wk, k_norm) = (
        cuda_view(&[INDEX_DIM, KV_DIM], F32),
        cuda_view(&[INDEX_DIM], F32),
    );
    let views = CompressViews {
        kv: &kv,
        score: None,
        norm: &norm,
        wk: &wk,
        k_norm: &k_norm,
    };
    let e = compress_view(
        &params(1),
        &views,
        0,
        0,
        &mut cuda_view_mut(&[4, NVFP4_DS_BYTES]),
        &mut cuda_view_mut(&[4, MXFP4_INDEX_BYTES]),
    )
    .unwrap_err();
    assert!(matches!(e, Error::NoCudaBuild(_)), "{e:?}");
}
