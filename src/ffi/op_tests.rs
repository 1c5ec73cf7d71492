//! Each op export against a direct call of the op it wraps, on the same data: the wrappers must add
//! checks, never change results.
use super::dlpack::{DLTensor, DType};
use super::test_support::last_error;
use super::*;
use super::{Csa2Geometry, Csa2Status};
use crate::formats::RecordFormat;
use crate::geometry::Geometry;
use crate::ops::attention::{AttentionParams, KvRows};
use crate::ops::candidates::CandidateParams;
use crate::ops::compressor::{Compressor, CompressorState, PooledWeights};
use crate::ops::rope::{Direction, Rope};
use csa2_rng::{rand_normal, NewRng, Rng};

use super::test_support::desc;

/// A registered geometry handle (`p`) and the geometry it holds (`g`), freed on drop.
struct TestGeometry {
    p: *mut Csa2Geometry,
    g: Geometry,
}

impl Drop for TestGeometry {
    fn drop(&mut self) {
        unsafe { crate::ffi::csa2_geometry_free(self.p) };
    }
}

fn geometry() -> TestGeometry {
    TestGeometry {
        p: super::test_support::geometry(),
        g: Geometry::embedded(),
    }
}

#[test]
fn rope_export_equals_direct_call_and_checks_inverse() {
    let g = geometry();
    let mut rng = Rng::new(5);
    let x0 = rand_normal(&mut rng, 3 * 2 * 128, 1.0);
    let mut pos = vec![0i64, 127, 4096];
    let mut want = x0.clone();
    let rope = Rope::new(&g.g.layers[2].rope).unwrap();
    rope.apply(&mut want, 2, 128, &pos, Direction::Forward)
        .unwrap();
    let mut x = x0.clone();
    let (mut sx, mut sp) = ([3i64, 2, 128], [3i64]);
    let tx = desc(&mut x, &mut sx, DType::F32);
    let tp = desc(&mut pos, &mut sp, DType::I64);
    let st = unsafe { csa2_rope(g.p, 2, &tx, &tp, 0) };
    assert_eq!(st, Csa2Status::Csa2Ok);
    assert_eq!(x, want);
    assert_eq!(
        unsafe { csa2_rope(g.p, 2, &tx, &tp, 2) },
        Csa2Status::Csa2ErrInvalidArgument
    );
    assert_eq!(
        unsafe { csa2_rope(g.p, 999, &tx, &tp, 0) },
        Csa2Status::Csa2ErrInvalidArgument
    );
}

#[test]
fn compress_export_equals_direct_call_and_refuses_a_split_pair() {
    let g = geometry();
    let layer = g.g.layers.iter().position(|l| l.ratio == 2).unwrap();
    let mut rng = Rng::new(6);
    let (t, e) = (4usize, 2usize);
    let mut kv = rand_normal(&mut rng, t * 512, 1.0);
    let mut score = rand_normal(&mut rng, t * 512, 1.0);
    let mut norm = vec![1.0f32; 512];
    let mut wk = rand_normal(&mut rng, 128 * 512, 0.04);
    let mut k_norm = vec![1.0f32; 128];
    let c = Compressor::new(
        2,
        g.g.rms_norm_eps,
        Rope::new(&g.g.layers[layer].rope).unwrap(),
        PooledWeights {
            norm: &norm,
            wk: &wk,
            k_norm: &k_norm,
        },
    )
    .unwrap();
    let want = c
        .compress(&mut CompressorState::new(6), &kv, Some(&score))
        .unwrap();
    let (mut main, mut index) = (vec![0u8; e * 288], vec![0u8; e * 68]);
    let mut shapes = [
        vec![t as i64, 512],
        vec![t as i64, 512],
        vec![512],
        vec![128, 512],
        vec![128],
        vec![e as i64, 288],
        vec![e as i64, 68],
    ];
    let [s0, s1, s2, s3, s4, s5, s6] = &mut shapes;
    let d = [
        desc(&mut kv, s0, DType::F32),
        desc(&mut score, s1, DType::F32),
        desc(&mut norm, s2, DType::F32),
        desc(&mut wk, s3, DType::F32),
        desc(&mut k_norm, s4, DType::F32),
        desc(&mut main, s5, DType::U8),
        desc(&mut index, s6, DType::U8),
    ];
    let call = |start: i64| unsafe {
        csa2_compress(&crate::ffi::Csa2CompressArgs {
            geometry: g.p,
            layer: layer as u32,
            kv: &d[0],
            score: &d[1],
            norm: &d[2],
            wk: &d[3],
            k_norm: &d[4],
            start_pos: start,
            main_kv_out: &d[5],
            index_k_out: &d[6],
            ..Default::default()
        })
    };
    assert_eq!(call(6), Csa2Status::Csa2Ok);
    assert_eq!(main, want.main_kv_nvfp4);
    assert_eq!(index, want.index_k_mxfp4);
    // A start inside a pair needs state this stateless call does not keep: refused.
    assert_eq!(call(7), Csa2Status::Csa2ErrInvalidArgument);
}

#[test]
fn topk_and_candidates_exports_equal_direct_calls() {
    let mut rng = Rng::new(7);
    let (t, n, k) = (3usize, 40usize, 5usize);
    let mut logits = rand_normal(&mut rng, t * n, 1.0);
    let mut pos = vec![2i64, 17, 39];
    let vis: Vec<usize> = pos.iter().map(|&p| crate::ops::visible(p, 1)).collect();
    let mut want = vec![0i32; t * k];
    let counts = crate::ops::topk::select_rows(&logits, n, &vis, &mut want).unwrap();
    let (mut out, mut cnt) = (vec![0i32; t * k], vec![0i32; t]);
    let (mut sl, mut sp, mut so, mut sc) = (
        [t as i64, n as i64],
        [t as i64],
        [t as i64, k as i64],
        [t as i64],
    );
    let tl = desc(&mut logits, &mut sl, DType::F32);
    let tp = desc(&mut pos, &mut sp, DType::I64);
    let to = desc(&mut out, &mut so, DType::I32);
    let tc = desc(&mut cnt, &mut sc, DType::I32);
    assert_eq!(
        unsafe { csa2_topk(&tl, &tp, 1, &to, &tc) },
        Csa2Status::Csa2Ok
    );
    assert_eq!(out, want);
    assert_eq!(cnt, counts.iter().map(|&c| c as i32).collect::<Vec<_>>());

    let p = CandidateParams {
        block_size: 4,
        num_blocks: 3,
    };
    let mut want = vec![0i32; t * 3];
    let lf = logits.clone();
    crate::ops::candidates::select_blocks_rows(&p, &lf, n, &vis, &mut want).unwrap();
    let mut blocks = vec![0i32; t * 3];
    let mut sb = [t as i64, 3];
    let tb = desc(&mut blocks, &mut sb, DType::I32);
    assert_eq!(
        unsafe { csa2_candidates(&tl, &tp, 1, 4, &tb) },
        Csa2Status::Csa2Ok
    );
    assert_eq!(blocks, want);
    // The counts output aliasing the logits is refused, naming both.
    let ta = desc(&mut logits[..t], &mut sc, DType::I32);
    assert_eq!(
        unsafe { csa2_topk(&tl, &tp, 1, &to, &ta) },
        Csa2Status::Csa2ErrInvalidArgument
    );
}

#[test]
fn attention_indexed_export_equals_direct_call_and_checks_ids() {
    use crate::ops::attention::{attention_indexed, IndexedInputs};
    let mut rng = Rng::new(8);
    let (t, h, n, s, km, ks) = (3usize, 4usize, 6usize, 5usize, 4usize, 3usize);
    let mut q = rand_normal(&mut rng, t * h * 512, 1.0);
    let mut sink = rand_normal(&mut rng, h, 1.0);
    let main_f = rand_normal(&mut rng, n * 512, 1.0);
    let mut main = vec![0u8; n * 288];
    crate::formats::encode_rows(RecordFormat::Nvfp4Ds, &main_f, &mut main).unwrap();
    let mut swa = rand_normal(&mut rng, s * 512, 1.0);
    let mut mi = vec![0i32, 5, -1, 2, 3, 3, -1, -1, -1, -1, -1, -1];
    let mut si = vec![4i32, -1, 0, 1, 2, 9, -1, -1, -1];
    // Token 1's stale SWA id 9 sits behind its length of 2; token 2 attends nothing.
    let mut sl = vec![3i32, 2, 0];
    let mut want = vec![0f32; t * h * 512];
    let mut want_lse = vec![0f32; t * h];
    let p = AttentionParams {
        heads: h,
        ..Default::default()
    };
    let inp = IndexedInputs {
        q: &q,
        sink: &sink,
        main_idx: &mi,
        main_len: None,
        swa_idx: &si,
        swa_len: Some(&sl),
    };
    attention_indexed(
        &p,
        &inp,
        KvRows::Records(RecordFormat::Nvfp4Ds, &main),
        KvRows::F32(&swa),
        &mut want,
        &mut want_lse,
    )
    .unwrap();
    let (mut out, mut lse) = (vec![0f32; t * h * 512], vec![0f32; t * h]);
    let mut shapes = [
        vec![t as i64, h as i64, 512],
        vec![n as i64, 288],
        vec![t as i64, km as i64],
        vec![s as i64, 512],
        vec![t as i64, ks as i64],
        vec![t as i64],
        vec![h as i64],
        vec![t as i64, h as i64, 512],
        vec![t as i64, h as i64],
    ];
    let [s0, s1, s2, s3, s4, s5, s6, s7, s8] = &mut shapes;
    let d = [
        desc(&mut q, s0, DType::F32),
        desc(&mut main, s1, DType::U8),
        desc(&mut mi, s2, DType::I32),
        desc(&mut swa, s3, DType::F32),
        desc(&mut si, s4, DType::I32),
        desc(&mut sl, s5, DType::I32),
        desc(&mut sink, s6, DType::F32),
        desc(&mut out, s7, DType::F32),
        desc(&mut lse, s8, DType::F32),
    ];
    // `swa_len`: `&d[5]`, or null to leave the SWA lengths out.
    let call_swa_len = |d: &[DLTensor; 9], swa_len: *const DLTensor| unsafe {
        csa2_attention_indexed(&crate::ffi::Csa2AttentionIndexedArgs {
            q: &d[0],
            main_kv: &d[1],
            main_format: 0,
            main_idx: &d[2],
            main_len: std::ptr::null(),
            swa_kv: &d[3],
            swa_format: 2,
            swa_idx: &d[4],
            swa_len,
            sink: &d[6],
            scale: 0.0,
            out: &d[7],
            lse: &d[8],
            ..Default::default()
        })
    };
    let call = |d: &[DLTensor; 9]| call_swa_len(d, &d[5]);
    assert_eq!(call(&d), Csa2Status::Csa2Ok);
    assert_eq!(out, want);
    assert_eq!(lse, want_lse);
    assert!(lse[2 * h..].iter().all(|&v| v == f32::NEG_INFINITY));
    // Without the SWA lengths token 1's stale id 9 (of 5 rows) is read: refused, named, and
    // nothing written.
    out.fill(7.0);
    let st = call_swa_len(&d, std::ptr::null());
    assert_eq!(st, Csa2Status::Csa2ErrInvalidArgument);
    let msg = last_error();
    assert!(
        msg.contains("swa_idx") && msg.contains("token 1, slot 2: row 9"),
        "{msg}"
    );
    assert!(out.iter().all(|&v| v == 7.0));
    // A length tensor of the wrong T is a shape error; an empty main pool with −1 ids is fine.
    let mut short = [2i64];
    let mut d2 = d;
    d2[5].shape = short.as_mut_ptr();
    assert_eq!(call(&d2), Csa2Status::Csa2ErrShape);
    let mut empty_shape = [0i64, 288];
    let mut holes = vec![-1i32; t * km];
    let mut d3 = d;
    d3[1].shape = empty_shape.as_mut_ptr();
    d3[2] = desc(&mut holes, s2, DType::I32);
    assert_eq!(call(&d3), Csa2Status::Csa2Ok);
    // No silent NaN: a NaN in an attended SWA row (token 0 reads row 4) is an error naming the
    // token, not a NaN output.
    swa[4 * 512 + 7] = f32::NAN;
    assert_eq!(call(&d), Csa2Status::Csa2ErrInvalidArgument);
    let msg = last_error();
    assert!(msg.contains("non-finite result at token 0"), "{msg}");
}

/// Every args-struct export refuses a null `args` and a `struct_size` below its first version,
/// naming the struct, before it looks at any member (all members here are null or zero).
#[test]
fn every_args_struct_export_checks_null_and_struct_size() {
    use crate::ffi::*;
    macro_rules! check {
        ($f:ident, $T:ident $(, $extra:expr)?) => {{
            let name = stringify!($T);
            let st = unsafe { $f(std::ptr::null() $(, $extra)?) };
            assert_eq!(st, Csa2Status::Csa2ErrNullPointer, "{name}");
            assert!(last_error().contains(name), "{name}: {}", last_error());
            for size in [0, 8, <$T as crate::ffi::ArgsStruct>::V1_SIZE - 1] {
                let a = $T {
                    struct_size: size,
                    ..Default::default()
                };
                let st = unsafe { $f(&a $(, $extra)?) };
                assert_eq!(st, Csa2Status::Csa2ErrInvalidArgument, "{name} size {size}");
                let msg = last_error();
                assert!(
                    msg.contains(name) && msg.contains(&format!("struct_size is {size}")),
                    "{msg}"
                );
            }
            // The full size passes the size check and fails on the (null) members instead.
            let st = unsafe { $f(&$T::default() $(, $extra)?) };
            assert_ne!(st, Csa2Status::Csa2Ok, "{name}");
            assert!(!last_error().contains("struct_size"), "{name}: {}", last_error());
        }};
    }
    check!(csa2_attention, Csa2AttentionArgs);
    check!(csa2_attention_indexed, Csa2AttentionIndexedArgs);
    check!(csa2_mhc, Csa2MhcArgs);
    check!(csa2_compress, Csa2CompressArgs);
    check!(csa2_compress_step, Csa2CompressStepArgs);
    check!(csa2_indexer_logits, Csa2IndexerLogitsArgs);
    check!(csa2_indexer_logits_in_blocks, Csa2IndexerLogitsInBlocksArgs);
    check!(csa2_encode_into_pages, Csa2EncodeIntoPagesArgs);
    let mut cache = std::ptr::null_mut();
    check!(csa2_cache_create, Csa2CacheCreateArgs, &mut cache);
    assert!(cache.is_null());
}
