//! The view entry of the flat indexed form ([`attention_indexed_view`]): the host branch is the
//! fast path, a call across devices is refused, and a build without CUDA names the problem.

use super::*;
use crate::formats::{encode_rows, MXFP8_BYTES, NVFP4_DS_BYTES};
#[cfg(not(feature = "cuda"))]
use crate::tensor::DType;
use crate::tolerance::{compare, F32_VS_F64};
use csa2_rng::{rand_normal, NewRng, Rng};

/// One flat indexed call: T tokens of H heads over N main records and S SWA records.
pub(super) struct Flat {
    pub q: Vec<f32>,
    pub sink: Vec<f32>,
    pub main: Vec<u8>,
    pub swa: Vec<u8>,
    pub main_idx: Vec<i32>,
    pub main_len: Vec<i32>,
    pub swa_idx: Vec<i32>,
    pub km: usize,
    pub ks: usize,
}

pub(super) fn flat(seed: u64, t: usize, h: usize) -> Flat {
    let (n, s, km, ks) = (40usize, 24usize, 12usize, 8usize);
    let mut rng = Rng::new(seed);
    let mut main = vec![0u8; n * NVFP4_DS_BYTES];
    encode_rows(
        RecordFormat::Nvfp4Ds,
        &rand_normal(&mut rng, n * KV_DIM, 1.0),
        &mut main,
    )
    .unwrap();
    let mut swa = vec![0u8; s * MXFP8_BYTES];
    encode_rows(
        RecordFormat::Mxfp8,
        &rand_normal(&mut rng, s * KV_DIM, 1.0),
        &mut swa,
    )
    .unwrap();
    // Lists with −1 holes, a repeated id and a length that cuts the row short.
    let main_idx: Vec<i32> = (0..t * km)
        .map(|i| if i % 5 == 3 { -1 } else { ((i * 7) % n) as i32 })
        .collect();
    let main_len: Vec<i32> = (0..t).map(|i| (km - i % 3) as i32).collect();
    let swa_idx: Vec<i32> = (0..t * ks).map(|i| ((i * 3) % s) as i32).collect();
    Flat {
        q: rand_normal(&mut rng, t * h * KV_DIM, 1.0),
        sink: rand_normal(&mut rng, h, 1.0),
        main,
        swa,
        main_idx,
        main_len,
        swa_idx,
        km,
        ks,
    }
}

fn host<'a, T: crate::tensor::Element>(v: &'a [T], shape: &[usize]) -> TensorView<'a> {
    TensorView::from_host_slice(v, shape).unwrap()
}

/// The host branch writes what [`attention_indexed`] computes, bit for bit, and that follows the
/// f64 reference.
#[test]
fn indexed_view_on_host_is_the_fast_path() {
    let (t, h) = (3, 16);
    let f = flat(71, t, h);
    let p = AttentionParams {
        heads: h,
        ..Default::default()
    };
    let main = KvRows::Records(RecordFormat::Nvfp4Ds, &f.main);
    let swa = KvRows::Records(RecordFormat::Mxfp8, &f.swa);
    let inp = IndexedInputs {
        q: &f.q,
        sink: &f.sink,
        main_idx: &f.main_idx,
        main_len: Some(&f.main_len),
        swa_idx: &f.swa_idx,
        swa_len: None,
    };
    let mut want = vec![0f32; t * h * KV_DIM];
    let mut want_lse = vec![0f32; t * h];
    attention_indexed(&p, &inp, main, swa, &mut want, &mut want_lse).unwrap();
    let rows = plan_indexed(&p, &inp, &main, &swa).unwrap();
    let (ro, rl) = reference::attention_rows(&p, &f.q, &f.sink, &rows, main, swa);
    assert!(compare(&want, &ro, &F32_VS_F64).ok(&F32_VS_F64));
    assert!(compare(&want_lse, &rl, &F32_VS_F64).ok(&F32_VS_F64));

    let (q, sink) = (host(&f.q, &[t, h, KV_DIM]), host(&f.sink, &[h]));
    let (mv, sv) = (
        host(&f.main, &[f.main.len() / NVFP4_DS_BYTES, NVFP4_DS_BYTES]),
        host(&f.swa, &[f.swa.len() / MXFP8_BYTES, MXFP8_BYTES]),
    );
    let (mi, ml, si) = (
        host(&f.main_idx, &[t, f.km]),
        host(&f.main_len, &[t]),
        host(&f.swa_idx, &[t, f.ks]),
    );
    let views = IndexedViews {
        q: &q,
        main: KvView {
            rows: &mv,
            format: Some(RecordFormat::Nvfp4Ds),
        },
        main_idx: &mi,
        main_len: Some(&ml),
        swa: KvView {
            rows: &sv,
            format: Some(RecordFormat::Mxfp8),
        },
        swa_idx: &si,
        swa_len: None,
        sink: &sink,
    };
    let mut out = vec![f32::NAN; t * h * KV_DIM];
    let mut lse = vec![f32::NAN; t * h];
    attention_indexed_view(
        &p,
        &views,
        0,
        &mut TensorViewMut::from_host_slice(&mut out, &[t, h, KV_DIM]).unwrap(),
        &mut TensorViewMut::from_host_slice(&mut lse, &[t, h]).unwrap(),
    )
    .unwrap();
    assert_eq!(out, want);
    assert_eq!(lse, want_lse);

    // A record pool whose width is not its format's is a shape error naming it.
    let views = IndexedViews {
        main: KvView {
            rows: &sv,
            format: Some(RecordFormat::Nvfp4Ds),
        },
        ..views
    };
    let e = attention_indexed_view(
        &p,
        &views,
        0,
        &mut TensorViewMut::from_host_slice(&mut out, &[t, h, KV_DIM]).unwrap(),
        &mut TensorViewMut::from_host_slice(&mut lse, &[t, h]).unwrap(),
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::Shape { .. }) && e.to_string().contains("main_kv"),
        "{e}"
    );
}

fn cuda<T: crate::tensor::Element>(shape: &[usize]) -> TensorView<'static> {
    crate::tensor::fake::cuda(0x1000, shape, T::DTYPE)
}

#[cfg(not(feature = "cuda"))]
fn cuda_mut(shape: &[usize], dt: DType) -> TensorViewMut<'static> {
    crate::tensor::fake::cuda_mut(0x8000, shape, dt)
}

/// One CUDA tensor among host ones is refused by name (whatever the build); all on CUDA in a
/// build without the feature is `NoCudaBuild`.
#[test]
fn indexed_view_refuses_mixed_devices_and_cuda_without_the_feature() {
    let (t, h) = (2, 16);
    let f = flat(72, t, h);
    let p = AttentionParams {
        heads: h,
        ..Default::default()
    };
    let (q, sink) = (host(&f.q, &[t, h, KV_DIM]), host(&f.sink, &[h]));
    let mv = host(&f.main, &[f.main.len() / NVFP4_DS_BYTES, NVFP4_DS_BYTES]);
    let sv = host(&f.swa, &[f.swa.len() / MXFP8_BYTES, MXFP8_BYTES]);
    let mi = host(&f.main_idx, &[t, f.km]);
    let dsi = cuda::<i32>(&[t, f.ks]);
    let views = IndexedViews {
        q: &q,
        main: KvView {
            rows: &mv,
            format: Some(RecordFormat::Nvfp4Ds),
        },
        main_idx: &mi,
        main_len: None,
        swa: KvView {
            rows: &sv,
            format: Some(RecordFormat::Mxfp8),
        },
        swa_idx: &dsi,
        swa_len: None,
        sink: &sink,
    };
    let mut out = vec![0f32; t * h * KV_DIM];
    let mut lse = vec![0f32; t * h];
    let e = attention_indexed_view(
        &p,
        &views,
        0,
        &mut TensorViewMut::from_host_slice(&mut out, &[t, h, KV_DIM]).unwrap(),
        &mut TensorViewMut::from_host_slice(&mut lse, &[t, h]).unwrap(),
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::Invalid { .. }) && e.to_string().contains("swa_idx"),
        "{e}"
    );
    assert!(out.iter().all(|&v| v == 0.0), "nothing written on error");

    #[cfg(not(feature = "cuda"))]
    {
        let (dq, dsink) = (cuda::<half::bf16>(&[t, h, KV_DIM]), cuda::<f32>(&[h]));
        let (dm, ds) = (
            cuda::<u8>(&[f.main.len() / NVFP4_DS_BYTES, NVFP4_DS_BYTES]),
            cuda::<u8>(&[f.swa.len() / MXFP8_BYTES, MXFP8_BYTES]),
        );
        let dmi = cuda::<i32>(&[t, f.km]);
        let views = IndexedViews {
            q: &dq,
            main: KvView {
                rows: &dm,
                format: Some(RecordFormat::Nvfp4Ds),
            },
            main_idx: &dmi,
            swa: KvView {
                rows: &ds,
                format: Some(RecordFormat::Mxfp8),
            },
            sink: &dsink,
            ..views
        };
        let e = attention_indexed_view(
            &p,
            &views,
            0,
            &mut cuda_mut(&[t, h, KV_DIM], DType::Bf16),
            &mut cuda_mut(&[t, h], DType::F32),
        )
        .unwrap_err();
        assert!(matches!(e, Error::NoCudaBuild(_)), "{e:?}");
    }
}
