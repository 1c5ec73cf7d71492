//! Record-level cache access, the stateful compressor and the candidate-restricted indexer over
//! the C ABI (`src/ffi/{records,compressor}.rs`, `csa2_indexer_logits_in_blocks`), checked against
//! the Rust ops and codecs they wrap.

use crate::ffi_support::{geometry, last_error};
use csa2::ffi::dlpack::{DLDataType, DLDevice, DLTensor, K_DL_CPU, K_DL_CUDA};
use csa2::ffi::*;
use csa2::formats::{decode_rows, encode_rows, RecordFormat};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::ffi::c_void;
use std::ptr::{null, null_mut};

/// An owned host tensor and its DLPack descriptor (rebuilt on every `dl()`, so moves are safe).
struct T<E> {
    data: Vec<E>,
    shape: Vec<i64>,
    code: (u8, u8),
    device: i32,
}

impl<E: Copy> T<E> {
    fn dl(&mut self) -> DLTensor {
        DLTensor {
            data: self.data.as_mut_ptr() as *mut c_void,
            device: DLDevice {
                device_type: self.device,
                device_id: 0,
            },
            ndim: self.shape.len() as i32,
            dtype: DLDataType {
                code: self.code.0,
                bits: self.code.1,
                lanes: 1,
            },
            shape: self.shape.as_mut_ptr(),
            strides: null_mut(),
            byte_offset: 0,
        }
    }
}

fn t<E>(data: Vec<E>, shape: &[usize], code: (u8, u8)) -> T<E> {
    T {
        data,
        shape: shape.iter().map(|&d| d as i64).collect(),
        code,
        device: K_DL_CPU,
    }
}
fn f32t(data: Vec<f32>, shape: &[usize]) -> T<f32> {
    t(data, shape, (2, 32))
}
fn u8t(data: Vec<u8>, shape: &[usize]) -> T<u8> {
    t(data, shape, (1, 8))
}
fn i64t(data: Vec<i64>) -> T<i64> {
    let n = data.len();
    t(data, &[n], (0, 64))
}
fn i32t(data: Vec<i32>, shape: &[usize]) -> T<i32> {
    t(data, shape, (0, 32))
}

fn randn(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-2.0f32..2.0)).collect()
}

#[track_caller]
fn ok(s: Csa2Status) {
    assert_eq!(s, Csa2Status::Csa2Ok, "{}", last_error());
}

#[track_caller]
fn err(s: Csa2Status, want: Csa2Status, needle: &str) {
    assert_eq!(s, want, "{}", last_error());
    assert!(
        last_error().contains(needle),
        "`{}` lacks `{needle}`",
        last_error()
    );
}

/// A cache of `blocks` 256-token blocks (NVFP4 layout).
fn cache(blocks: usize) -> *mut Csa2Cache {
    let g = geometry();
    let mut c = null_mut();
    ok(unsafe {
        csa2_cache_create(
            &csa2::ffi::Csa2CacheCreateArgs {
                geometry: g,
                layout: 0,
                num_blocks: blocks,
                block_tokens: 256,
                model: null(),
                model_len: 0,
                ..Default::default()
            },
            &mut c,
        )
    });
    unsafe { csa2_geometry_free(g) };
    c
}

fn info(c: *const Csa2Cache, layer: u32) -> Csa2CacheLayerInfo {
    let mut i = Csa2CacheLayerInfo::default();
    ok(unsafe { csa2_cache_layer_info(c, layer, &mut i) });
    i
}

fn fmt_of(id: i32) -> RecordFormat {
    RecordFormat::ALL[id as usize]
}

/// quantize→dequantize reference of rows in `fmt`.
fn qdq(fmt: RecordFormat, x: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut rec = vec![0u8; x.len() / fmt.dim() * fmt.record_bytes()];
    encode_rows(fmt, x, &mut rec).unwrap();
    let mut y = vec![0f32; x.len()];
    decode_rows(fmt, &rec, &mut y).unwrap();
    (rec, y)
}

fn read_f32(c: *const Csa2Cache, id: u64, layer: u32, kind: i32, entries: &[i64]) -> Vec<f32> {
    let fmt = if kind == 0 {
        fmt_of(info(c, layer).main_format)
    } else {
        fmt_of(info(c, layer).index_format)
    };
    let mut e = i64t(entries.to_vec());
    let mut out = f32t(
        vec![f32::NAN; entries.len() * fmt.dim()],
        &[entries.len(), fmt.dim()],
    );
    ok(unsafe { csa2_cache_read_entries(c, id, layer, kind, &e.dl(), &out.dl()) });
    out.data
}

#[test]
fn layer_info_describes_the_cache() {
    let c = cache(2);
    let i2 = info(c, 2);
    assert_eq!((i2.kv_source, i2.ratio, i2.entries_per_block), (1, 2, 128));
    assert_eq!((i2.main_record_bytes, i2.index_record_bytes), (288, 68));
    assert_eq!(i2.compressor_state_floats, 1024);
    assert_eq!((i2.window, i2.swa_record_bytes), (128, 528));
    let i20 = info(c, 20);
    assert_eq!(
        (
            i20.ratio,
            i20.entries_per_block,
            i20.compressor_state_floats
        ),
        (1, 256, 0)
    );
    let i0 = info(c, 0);
    assert_eq!((i0.kv_source, i0.main_format, i0.index_format), (0, -1, -1));
    let mut i = Csa2CacheLayerInfo::default();
    err(
        unsafe { csa2_cache_layer_info(c, 40, &mut i) },
        Csa2Status::Csa2ErrInvalidArgument,
        "40",
    );
    unsafe { csa2_cache_free(c) };
}

#[test]
fn entries_round_trip_through_the_slot_mapping() {
    let mut r = StdRng::seed_from_u64(7);
    let c = cache(6);
    unsafe {
        ok(csa2_cache_add_request(c, 1));
        ok(csa2_cache_add_request(c, 2));
        // Interleave the two requests' blocks so the slot mapping is not the identity.
        ok(csa2_cache_allocate(c, 2, 256));
        ok(csa2_cache_allocate(c, 1, 600));
    }
    for (layer, kind) in [(2u32, 0i32), (2, 1), (20, 0), (20, 1)] {
        let inf = info(c, layer);
        let fmt = fmt_of(if kind == 0 {
            inf.main_format
        } else {
            inf.index_format
        });
        let s = inf.entries_per_block as i64;
        // Around the block boundary, out of order, plus the first and last allocated entries.
        let cap = 768 / inf.ratio as i64;
        let entries = vec![s - 1, s, s + 1, 0, cap - 1, 2 * s, 5];
        let n = entries.len();
        let x = randn(&mut r, n * fmt.dim());
        let mut e = i64t(entries.clone());
        let mut src = f32t(x.clone(), &[n, fmt.dim()]);
        ok(unsafe { csa2_cache_write_entries(c, 1, layer, kind, &e.dl(), &src.dl()) });
        let (rec, want) = qdq(fmt, &x);
        // Tight: the cache holds exactly the codec's records.
        assert_eq!(
            read_f32(c, 1, layer, kind, &entries),
            want,
            "{layer} {kind}"
        );
        let mut raw = u8t(vec![0; n * fmt.record_bytes()], &[n, fmt.record_bytes()]);
        ok(unsafe { csa2_cache_read_entries(c, 1, layer, kind, &e.dl(), &raw.dl()) });
        assert_eq!(raw.data, rec);
        // Loose: against the unquantised rows (E2M1 / E4M3 step at |x| < 2).
        let tol = if fmt.record_bytes() < fmt.dim() {
            0.7
        } else {
            0.13
        };
        for (a, b) in want.iter().zip(&x) {
            assert!((a - b).abs() <= tol, "{a} vs {b}");
        }
        // Gather with −1 padding: zero rows there.
        let got = read_f32(c, 1, layer, kind, &[-1, s, -1]);
        let d = fmt.dim();
        assert!(got[..d].iter().chain(&got[2 * d..]).all(|&v| v == 0.0));
        assert_eq!(&got[d..2 * d], &want[d..2 * d]);
        // The slots written are the ones csa2_cache_slot_mapping names: request 2 untouched.
        let zero = read_f32(c, 2, layer, kind, &[0, s - 1]);
        assert!(zero.iter().all(|&v| v == 0.0));
        // Raw records in, same records out; bf16 rows in.
        let mut src8 = u8t(rec.clone(), &[n, fmt.record_bytes()]);
        let mut e2 = i64t((0..n as i64).map(|i| i + 2 * s + 1).collect());
        ok(unsafe { csa2_cache_write_entries(c, 1, layer, kind, &e2.dl(), &src8.dl()) });
        let shifted: Vec<i64> = (0..n as i64).map(|i| i + 2 * s + 1).collect();
        assert_eq!(read_f32(c, 1, layer, kind, &shifted), want);
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let mut srcb = t(xb, &[n, fmt.dim()], (4, 16));
        ok(unsafe { csa2_cache_write_entries(c, 1, layer, kind, &e.dl(), &srcb.dl()) });
        assert_eq!(read_f32(c, 1, layer, kind, &entries), qdq(fmt, &xr).1);
    }
    unsafe { csa2_cache_free(c) };
}

#[test]
fn bad_writes_change_nothing() {
    let mut r = StdRng::seed_from_u64(8);
    let c = cache(4);
    let g = geometry();
    unsafe {
        ok(csa2_cache_add_request(c, 1));
        ok(csa2_cache_allocate(c, 1, 512));
    }
    let x = randn(&mut r, 2 * 512);
    let mut e = i64t(vec![3, 200]);
    let mut src = f32t(x.clone(), &[2, 512]);
    ok(unsafe { csa2_cache_write_entries(c, 1, 2, 0, &e.dl(), &src.dl()) });
    let before = read_f32(c, 1, 2, 0, &[3, 200]);
    let y = randn(&mut r, 2 * 512);
    let w = |c: *const Csa2Cache,
             id: u64,
             layer: u32,
             kind: i32,
             e: &mut T<i64>,
             s: &mut T<f32>| unsafe {
        csa2_cache_write_entries(c, id, layer, kind, &e.dl(), &s.dl())
    };
    let mut ys = f32t(y.clone(), &[2, 512]);
    err(
        w(c, 9, 2, 0, &mut e, &mut ys),
        Csa2Status::Csa2ErrNotFound,
        "request 9",
    );
    err(
        w(c, 1, 0, 0, &mut e, &mut ys),
        Csa2Status::Csa2ErrInvalidArgument,
        "layer 0 has no",
    );
    err(
        w(c, 1, 2, 5, &mut e, &mut ys),
        Csa2Status::Csa2ErrInvalidArgument,
        "Csa2RecordKind",
    );
    // One good entry, one past the allocation: the good one is not written either.
    let mut past = i64t(vec![3, 256]);
    err(
        w(c, 1, 2, 0, &mut past, &mut ys),
        Csa2Status::Csa2ErrInvalidArgument,
        "entry 256",
    );
    let mut neg = i64t(vec![3, -1]);
    err(
        w(c, 1, 2, 0, &mut neg, &mut ys),
        Csa2Status::Csa2ErrInvalidArgument,
        "negative",
    );
    let mut nan = y.clone();
    nan[700] = f32::NAN;
    let mut ns = f32t(nan, &[2, 512]);
    err(
        w(c, 1, 2, 0, &mut e, &mut ns),
        Csa2Status::Csa2ErrInvalidArgument,
        "row 1, column 188",
    );
    let mut short = f32t(y[..512].to_vec(), &[1, 512]);
    err(
        w(c, 1, 2, 0, &mut e, &mut short),
        Csa2Status::Csa2ErrShape,
        "src",
    );
    let mut wide = f32t(vec![0.0; 2 * 128], &[2, 128]);
    err(
        w(c, 1, 2, 0, &mut e, &mut wide),
        Csa2Status::Csa2ErrShape,
        "src",
    );
    let mut dev = f32t(y.clone(), &[2, 512]);
    dev.device = K_DL_CUDA;
    err(
        w(c, 1, 2, 0, &mut e, &mut dev),
        Csa2Status::Csa2ErrUnsupported,
        "CUDA",
    );
    err(
        unsafe { csa2_cache_write_entries(c, 1, 2, 0, null(), &ys.dl()) },
        Csa2Status::Csa2ErrNullPointer,
        "entries",
    );
    assert_eq!(read_f32(c, 1, 2, 0, &[3, 200]), before);

    // Publish block 0 (entries 0..128 of layer 2): it becomes read-only, block 1 stays writable.
    let tokens: Vec<u32> = (0..300).collect();
    let mut key = [0u8; 32];
    let mut n = 0usize;
    unsafe {
        ok(csa2_cache_prefix_keys(
            c,
            tokens.as_ptr(),
            300,
            key.as_mut_ptr(),
            1,
            &mut n,
        ));
        ok(csa2_cache_publish(c, 1, key.as_ptr(), 1, &mut n));
    }
    assert_eq!(n, 1);
    let mut mixed = i64t(vec![200, 3]);
    err(
        w(c, 1, 2, 0, &mut mixed, &mut ys),
        Csa2Status::Csa2ErrInvalidArgument,
        "read-only",
    );
    let mut yi = f32t(y[..256].to_vec(), &[2, 128]);
    err(
        w(c, 1, 2, 1, &mut mixed, &mut yi),
        Csa2Status::Csa2ErrInvalidArgument,
        "read-only",
    );
    assert_eq!(read_f32(c, 1, 2, 0, &[3, 200]), before);
    // A request that adopted the prefix reads it but cannot write it.
    unsafe {
        ok(csa2_cache_add_request(c, 5));
        ok(csa2_cache_adopt_prefix(c, 5, key.as_ptr(), 1, &mut n));
    }
    assert_eq!(read_f32(c, 5, 2, 0, &[3]), before[..512].to_vec());
    let mut one = i64t(vec![3]);
    let mut ys1 = f32t(y[..512].to_vec(), &[1, 512]);
    err(
        w(c, 5, 2, 0, &mut one, &mut ys1),
        Csa2Status::Csa2ErrInvalidArgument,
        "read-only",
    );
    let mut e200 = i64t(vec![200]);
    ok(w(c, 1, 2, 0, &mut e200, &mut ys1));

    // Reads: `dst` aliasing `entries`, a wrong dst shape; dst untouched on error.
    let mut ee = i64t(vec![3, 4]);
    let mut d = f32t(vec![7.0; 2 * 512], &[2, 512]);
    let mut alias = ee.dl();
    alias.dtype = DLDataType {
        code: 2,
        bits: 32,
        lanes: 1,
    };
    let mut sh = [1i64, 4];
    alias.shape = sh.as_mut_ptr();
    err(
        unsafe { csa2_cache_read_entries(c, 1, 2, 0, &ee.dl(), &alias) },
        Csa2Status::Csa2ErrShape,
        "dst",
    );
    let mut past = i64t(vec![3, 9999]);
    err(
        unsafe { csa2_cache_read_entries(c, 1, 2, 0, &past.dl(), &d.dl()) },
        Csa2Status::Csa2ErrInvalidArgument,
        "9999",
    );
    assert!(d.data.iter().all(|&v| v == 7.0));
    // A raw record with a NaN scale is refused on a float read (no silent NaN).
    let mut bad = vec![0u8; 68];
    bad[64] = 0xFF;
    let mut bs = u8t(bad, &[1, 68]);
    let mut e201 = i64t(vec![201]);
    ok(unsafe { csa2_cache_write_entries(c, 1, 2, 1, &e201.dl(), &bs.dl()) });
    let mut d1 = f32t(vec![0.0; 128], &[1, 128]);
    err(
        unsafe { csa2_cache_read_entries(c, 1, 2, 1, &e201.dl(), &d1.dl()) },
        Csa2Status::Csa2ErrInvalidArgument,
        "non-finite",
    );
    let _ = &mut ee;
    unsafe {
        csa2_cache_free(c);
        csa2_geometry_free(g);
    }
}

#[test]
fn swa_rows_keep_the_window() {
    let mut r = StdRng::seed_from_u64(9);
    let c = cache(1);
    let fmt = fmt_of(info(c, 0).swa_format);
    unsafe { ok(csa2_cache_add_request(c, 3)) };
    let mut newest = 0i64;
    ok(unsafe { csa2_cache_swa_newest(c, 3, 5, &mut newest) });
    assert_eq!(newest, -1);
    // 130 tokens at 0..130 (more than the window): 2..130 stay.
    let x = randn(&mut r, 130 * 512);
    let mut src = f32t(x.clone(), &[130, 512]);
    ok(unsafe { csa2_cache_swa_write(c, 3, 5, 0, &src.dl()) });
    ok(unsafe { csa2_cache_swa_newest(c, 3, 5, &mut newest) });
    assert_eq!(newest, 130);
    let (rec, want) = qdq(fmt, &x);
    let mut out = f32t(vec![0.0; 128 * 512], &[128, 512]);
    ok(unsafe { csa2_cache_swa_read(c, 3, 5, 2, &out.dl()) });
    assert_eq!(out.data, want[2 * 512..]);
    let mut raw = u8t(vec![0; 3 * 528], &[3, 528]);
    ok(unsafe { csa2_cache_swa_read(c, 3, 5, 127, &raw.dl()) });
    assert_eq!(raw.data, rec[127 * 528..130 * 528]);
    // Token 1 fell out of the window; token 130 is not written yet; dst untouched.
    let mut o1 = f32t(vec![5.0; 512], &[1, 512]);
    err(
        unsafe { csa2_cache_swa_read(c, 3, 5, 1, &o1.dl()) },
        Csa2Status::Csa2ErrNotFound,
        "window",
    );
    err(
        unsafe { csa2_cache_swa_read(c, 3, 5, 130, &o1.dl()) },
        Csa2Status::Csa2ErrNotFound,
        "window",
    );
    err(
        unsafe { csa2_cache_swa_read(c, 3, 4, 0, &o1.dl()) },
        Csa2Status::Csa2ErrNotFound,
        "None",
    );
    assert!(o1.data.iter().all(|&v| v == 5.0));
    // Writing older than the window is refused and changes nothing; a NaN too.
    let mut w1 = f32t(randn(&mut r, 512), &[1, 512]);
    err(
        unsafe { csa2_cache_swa_write(c, 3, 5, 1, &w1.dl()) },
        Csa2Status::Csa2ErrInvalidArgument,
        "older",
    );
    w1.data[3] = f32::INFINITY;
    err(
        unsafe { csa2_cache_swa_write(c, 3, 5, 130, &w1.dl()) },
        Csa2Status::Csa2ErrInvalidArgument,
        "non-finite",
    );
    w1.data[3] = 0.0;
    err(
        unsafe { csa2_cache_swa_write(c, 3, 40, 130, &w1.dl()) },
        Csa2Status::Csa2ErrInvalidArgument,
        "layer",
    );
    err(
        unsafe { csa2_cache_swa_write(c, 4, 5, 130, &w1.dl()) },
        Csa2Status::Csa2ErrNotFound,
        "request 4",
    );
    ok(unsafe { csa2_cache_swa_newest(c, 3, 5, &mut newest) });
    assert_eq!(newest, 130);
    ok(unsafe { csa2_cache_swa_read(c, 3, 5, 2, &out.dl()) });
    assert_eq!(out.data, want[2 * 512..]);
    // Rewriting inside the window (a replayed token) is allowed.
    let mut w2 = f32t(randn(&mut r, 512), &[1, 512]);
    ok(unsafe { csa2_cache_swa_write(c, 3, 5, 100, &w2.dl()) });
    ok(unsafe { csa2_cache_swa_read(c, 3, 5, 100, &o1.dl()) });
    assert_eq!(o1.data, qdq(fmt, &w2.data).1);
    unsafe { csa2_cache_free(c) };
}

fn weights(r: &mut StdRng) -> (T<f32>, T<f32>, T<f32>) {
    (
        f32t(
            (0..512).map(|_| r.random_range(0.5f32..1.5)).collect(),
            &[512],
        ),
        f32t(
            (0..128 * 512)
                .map(|_| r.random_range(-0.05f32..0.05))
                .collect(),
            &[128, 512],
        ),
        f32t(
            (0..128).map(|_| r.random_range(0.5f32..1.5)).collect(),
            &[128],
        ),
    )
}

/// One stateful step: returns (main records, index records, first entry).
#[allow(clippy::too_many_arguments)]
fn step(
    g: *const Csa2Geometry,
    layer: u32,
    st: *const Csa2CompressorState,
    kv: &[f32],
    score: Option<&[f32]>,
    w: &mut (T<f32>, T<f32>, T<f32>),
    e: usize,
) -> Result<(Vec<u8>, Vec<u8>, u64), Csa2Status> {
    let t = kv.len() / 512;
    let mut kvt = f32t(kv.to_vec(), &[t, 512]);
    let mut sct = score.map(|s| f32t(s.to_vec(), &[t, 512]));
    let mut mo = u8t(vec![0; e * 288], &[e, 288]);
    let mut io = u8t(vec![0; e * 68], &[e, 68]);
    let mut first = u64::MAX;
    let sd = sct.as_mut().map(|s| s.dl());
    let s = unsafe {
        csa2_compress_step(&csa2::ffi::Csa2CompressStepArgs {
            geometry: g,
            layer,
            state: st,
            kv: &kvt.dl(),
            score: sd.as_ref().map_or(null(), |d| d as *const _),
            norm: &w.0.dl(),
            wk: &w.1.dl(),
            k_norm: &w.2.dl(),
            main_kv_out: &mo.dl(),
            index_k_out: &io.dl(),
            first_entry: &mut first,
            ..Default::default()
        })
    };
    if s == Csa2Status::Csa2Ok {
        Ok((mo.data, io.data, first))
    } else {
        Err(s)
    }
}

fn stateless(
    g: *const Csa2Geometry,
    layer: u32,
    kv: &[f32],
    score: Option<&[f32]>,
    w: &mut (T<f32>, T<f32>, T<f32>),
    start: i64,
    e: usize,
) -> (Vec<u8>, Vec<u8>) {
    let t = kv.len() / 512;
    let mut kvt = f32t(kv.to_vec(), &[t, 512]);
    let mut sct = score.map(|s| f32t(s.to_vec(), &[t, 512]));
    let mut mo = u8t(vec![0; e * 288], &[e, 288]);
    let mut io = u8t(vec![0; e * 68], &[e, 68]);
    let sd = sct.as_mut().map(|s| s.dl());
    ok(unsafe {
        csa2_compress(&csa2::ffi::Csa2CompressArgs {
            geometry: g,
            layer,
            kv: &kvt.dl(),
            score: sd.as_ref().map_or(null(), |d| d as *const _),
            norm: &w.0.dl(),
            wk: &w.1.dl(),
            k_norm: &w.2.dl(),
            start_pos: start,
            main_kv_out: &mo.dl(),
            index_k_out: &io.dl(),
            ..Default::default()
        })
    });
    (mo.data, io.data)
}

fn query(st: *const Csa2CompressorState) -> (u64, u64) {
    let (mut p, mut n) = (0u64, 0u64);
    ok(unsafe { csa2_compressor_state_query(st, &mut p, &mut n, null_mut()) });
    (p, n)
}

#[test]
fn a_pair_split_across_calls_pools_as_one_call() {
    let mut r = StdRng::seed_from_u64(10);
    let g = geometry();
    let mut w = weights(&mut r);
    let kv = randn(&mut r, 8 * 512);
    let sc = randn(&mut r, 8 * 512);
    // Ratio 2 (layer 2): 8 tokens from position 100 in one stateless call.
    let (m_all, i_all) = stateless(g, 2, &kv, Some(&sc), &mut w, 100, 4);
    for split in [1usize, 3, 4, 7] {
        let mut st = null_mut();
        ok(unsafe { csa2_compressor_state_create(g, 2, 100, &mut st) });
        let (a, b) = (split * 512, 8 * 512);
        let (m1, i1, f1) = step(g, 2, st, &kv[..a], Some(&sc[..a]), &mut w, split / 2).unwrap();
        assert_eq!(query(st), (100 + split as u64, (split % 2) as u64));
        let e2 = 4 - split / 2;
        let (m2, i2, f2) = step(g, 2, st, &kv[a..b], Some(&sc[a..b]), &mut w, e2).unwrap();
        assert_eq!(f1, 50);
        assert_eq!(f2, 50 + (split / 2) as u64);
        assert_eq!([m1, m2].concat(), m_all, "split {split}");
        assert_eq!([i1, i2].concat(), i_all, "split {split}");
        unsafe { csa2_compressor_state_free(st) };
    }
    // Ratio 1 (layer 20): any split, nothing carried.
    let (m_all, i_all) = stateless(g, 20, &kv[..5 * 512], None, &mut w, 7, 5);
    let mut st = null_mut();
    ok(unsafe { csa2_compressor_state_create(g, 20, 7, &mut st) });
    let (m1, i1, _) = step(g, 20, st, &kv[..2 * 512], None, &mut w, 2).unwrap();
    let (m2, i2, f2) = step(g, 20, st, &kv[2 * 512..5 * 512], None, &mut w, 3).unwrap();
    assert_eq!((f2, query(st)), (9, (12, 0)));
    assert_eq!(([m1, m2].concat(), [i1, i2].concat()), (m_all, i_all));
    unsafe { csa2_compressor_state_free(st) };
    unsafe { csa2_geometry_free(g) };
}

/// A ratio-1 compressor closes every group in the step that opens it, so it never carries rows and
/// the cache keeps no slot for its layer: saving stores nothing and succeeds (it used to be
/// refused as "not a KV source with compression ratio > 1"), loading restores just the position,
/// and the pair round-trips — the resumed state compresses exactly like one stateless call. The
/// request must still exist for both.
#[test]
fn ratio_one_state_save_is_a_no_op_and_load_round_trips() {
    let mut r = StdRng::seed_from_u64(12);
    let g = geometry();
    let c = cache(2);
    let mut w = weights(&mut r);
    let kv = randn(&mut r, 5 * 512);
    let (m_all, i_all) = stateless(g, 20, &kv, None, &mut w, 7, 5);
    unsafe { ok(csa2_cache_add_request(c, 1)) };
    let mut st = null_mut();
    ok(unsafe { csa2_compressor_state_create(g, 20, 7, &mut st) });
    let (m1, i1, _) = step(g, 20, st, &kv[..2 * 512], None, &mut w, 2).unwrap();
    assert_eq!(query(st), (9, 0));
    ok(unsafe { csa2_compressor_state_save(st, c, 1) });
    err(
        unsafe { csa2_compressor_state_save(st, c, 9) },
        Csa2Status::Csa2ErrNotFound,
        "request 9",
    );
    unsafe { csa2_compressor_state_free(st) };
    // Nothing was stored: the raw slot of a ratio-1 layer still does not exist.
    let mut present = 0i32;
    err(
        unsafe { csa2_cache_get_compressor_state(c, 1, 20, null(), &mut present) },
        Csa2Status::Csa2ErrInvalidArgument,
        "ratio > 1",
    );
    let mut st2 = null_mut();
    ok(unsafe { csa2_compressor_state_create(g, 20, 0, &mut st2) });
    err(
        unsafe { csa2_compressor_state_load(st2, c, 9, 9) },
        Csa2Status::Csa2ErrNotFound,
        "request 9",
    );
    assert_eq!(query(st2), (0, 0));
    ok(unsafe { csa2_compressor_state_load(st2, c, 1, 9) });
    assert_eq!(query(st2), (9, 0));
    let (m2, i2, f2) = step(g, 20, st2, &kv[2 * 512..], None, &mut w, 3).unwrap();
    assert_eq!(f2, 9);
    assert_eq!(([m1, m2].concat(), [i1, i2].concat()), (m_all, i_all));
    unsafe { csa2_compressor_state_free(st2) };
    unsafe { csa2_cache_free(c) };
    unsafe { csa2_geometry_free(g) };
}

#[test]
fn compressor_state_survives_the_cache_and_refuses_bad_steps() {
    let mut r = StdRng::seed_from_u64(11);
    let g = geometry();
    let c = cache(2);
    let mut w = weights(&mut r);
    let kv = randn(&mut r, 4 * 512);
    let sc = randn(&mut r, 4 * 512);
    let (m_all, i_all) = stateless(g, 8, &kv, Some(&sc), &mut w, 0, 2);
    unsafe { ok(csa2_cache_add_request(c, 1)) };
    let mut st = null_mut();
    ok(unsafe { csa2_compressor_state_create(g, 8, 0, &mut st) });
    let (m1, i1, _) = step(g, 8, st, &kv[..3 * 512], Some(&sc[..3 * 512]), &mut w, 1).unwrap();

    // Refused steps leave the state alone: wrong E, wrong layer, missing score, NaN.
    assert_eq!(
        step(g, 8, st, &kv[3 * 512..], Some(&sc[3 * 512..]), &mut w, 0),
        Err(Csa2Status::Csa2ErrShape)
    );
    assert_eq!(
        step(g, 2, st, &kv[3 * 512..], Some(&sc[3 * 512..]), &mut w, 1),
        Err(Csa2Status::Csa2ErrInvalidArgument)
    );
    assert!(last_error().contains("state's layer 8"), "{}", last_error());
    assert_eq!(
        step(g, 8, st, &kv[3 * 512..], None, &mut w, 1),
        Err(Csa2Status::Csa2ErrInvalidArgument)
    );
    let mut nan = kv[3 * 512..].to_vec();
    nan[0] = f32::NAN;
    assert_eq!(
        step(g, 8, st, &nan, Some(&sc[3 * 512..]), &mut w, 1),
        Err(Csa2Status::Csa2ErrInvalidArgument)
    );
    assert_eq!(query(st), (3, 1));

    // Park the odd token in the cache, drop the handle, resume from a fresh one.
    ok(unsafe { csa2_compressor_state_save(st, c, 1) });
    unsafe { csa2_compressor_state_free(st) };
    let mut present = 0i32;
    let mut raw = f32t(vec![0.0; 1024], &[1024]);
    ok(unsafe { csa2_cache_get_compressor_state(c, 1, 8, &raw.dl(), &mut present) });
    assert_eq!(present, 1);
    assert_eq!(
        raw.data,
        [&kv[2 * 512..3 * 512], &sc[2 * 512..3 * 512]].concat()
    );
    let mut st2 = null_mut();
    ok(unsafe { csa2_compressor_state_create(g, 8, 0, &mut st2) });
    err(
        unsafe { csa2_compressor_state_load(st2, c, 1, 4) },
        Csa2Status::Csa2ErrInvalidArgument,
        "next_pos",
    );
    assert_eq!(query(st2), (0, 0));
    ok(unsafe { csa2_compressor_state_load(st2, c, 1, 3) });
    assert_eq!(query(st2), (3, 1));
    let (m2, i2, f2) = step(g, 8, st2, &kv[3 * 512..], Some(&sc[3 * 512..]), &mut w, 1).unwrap();
    assert_eq!(f2, 1);
    assert_eq!(
        ([m1.clone(), m2].concat(), [i1, i2].concat()),
        (m_all, i_all)
    );
    // Saving a closed group clears the slot.
    ok(unsafe { csa2_compressor_state_save(st2, c, 1) });
    ok(unsafe { csa2_cache_get_compressor_state(c, 1, 8, null(), &mut present) });
    assert_eq!(present, 0);

    // Raw slot access errors; reset and create errors.
    let mut short = f32t(vec![0.0; 512], &[512]);
    err(
        unsafe { csa2_cache_set_compressor_state(c, 1, 8, &short.dl()) },
        Csa2Status::Csa2ErrShape,
        "compressor state",
    );
    err(
        unsafe { csa2_cache_set_compressor_state(c, 1, 20, &short.dl()) },
        Csa2Status::Csa2ErrInvalidArgument,
        "ratio > 1",
    );
    err(
        unsafe { csa2_cache_set_compressor_state(c, 9, 8, null()) },
        Csa2Status::Csa2ErrNotFound,
        "request 9",
    );
    short.data[0] = f32::NAN;
    err(
        unsafe { csa2_cache_set_compressor_state(c, 1, 8, &short.dl()) },
        Csa2Status::Csa2ErrInvalidArgument,
        "non-finite",
    );
    err(
        unsafe { csa2_compressor_state_reset(st2, 5) },
        Csa2Status::Csa2ErrInvalidArgument,
        "multiple",
    );
    ok(unsafe { csa2_compressor_state_reset(st2, 6) });
    assert_eq!(query(st2), (6, 0));
    // A start at the end of the position range: refused, not an overflow (found by the fuzzer).
    let mut far = null_mut();
    ok(unsafe { csa2_compressor_state_create(g, 20, u64::MAX, &mut far) });
    assert_eq!(
        step(g, 20, far, &kv[..512], None, &mut w, 1),
        Err(Csa2Status::Csa2ErrInvalidArgument)
    );
    assert!(
        last_error().contains("largest position"),
        "{}",
        last_error()
    );
    assert_eq!(query(far), (u64::MAX, 0));
    unsafe { csa2_compressor_state_free(far) };
    let mut bad = null_mut();
    err(
        unsafe { csa2_compressor_state_create(g, 0, 0, &mut bad) },
        Csa2Status::Csa2ErrInvalidArgument,
        "no compressor",
    );
    err(
        unsafe { csa2_compressor_state_create(g, 2, 1, &mut bad) },
        Csa2Status::Csa2ErrInvalidArgument,
        "multiple",
    );
    err(
        unsafe { csa2_compressor_state_create(g, 99, 0, &mut bad) },
        Csa2Status::Csa2ErrInvalidArgument,
        "layer",
    );
    assert!(bad.is_null());
    err(
        unsafe { csa2_compressor_state_query(null(), null_mut(), null_mut(), null_mut()) },
        Csa2Status::Csa2ErrNullPointer,
        "state",
    );
    unsafe {
        csa2_compressor_state_free(st2);
        csa2_compressor_state_free(null_mut());
        csa2_cache_free(c);
        csa2_geometry_free(g);
    }
}

#[test]
fn indexer_in_blocks_matches_the_op_and_its_reference() {
    use csa2::ops::candidates::CandidateParams;
    use csa2::ops::indexer::{self, IndexKeys, IndexerParams, IndexerQueries, QueryQuant};
    use csa2::tolerance::{compare, F32_VS_F64};
    let mut r = StdRng::seed_from_u64(12);
    let (tt, h, n, m, bs) = (5usize, 4usize, 37usize, 2usize, 4usize);
    let q = randn(&mut r, tt * h * 128);
    let w = randn(&mut r, tt * h);
    let keys = randn(&mut r, n * 128);
    let pos: Vec<i64> = vec![0, 17, 40, 73, 73];
    // Blocks per row, −1 padded, one row all padding.
    let blocks: Vec<i32> = vec![0, -1, -1, 2, 0, -1, 4, 1, 3, 9, 0, 5, -1, -1, -1];
    let mut qt = f32t(q.clone(), &[tt, h, 128]);
    let mut wt = f32t(w.clone(), &[tt, h]);
    let mut pt = i64t(pos.clone());
    let mut kt = f32t(keys.clone(), &[n, 128]);
    let mut bt = i32t(blocks.clone(), &[tt, 3]);
    let mut out = f32t(vec![0.0; tt * n], &[tt, n]);
    ok(unsafe {
        csa2_indexer_logits_in_blocks(&csa2::ffi::Csa2IndexerLogitsInBlocksArgs {
            q: &qt.dl(),
            w: &wt.dl(),
            positions: &pt.dl(),
            keys: &kt.dl(),
            blocks: &bt.dl(),
            ratio: m as u32,
            block_size: bs as u32,
            q_quant: 0,
            logits_out: &out.dl(),
            ..Default::default()
        })
    });
    let ip = IndexerParams {
        ratio: m,
        heads: h,
        query_quant: QueryQuant::None,
    };
    let cp = CandidateParams {
        block_size: bs,
        num_blocks: 3,
    };
    let qs = IndexerQueries {
        q: &q,
        w: &w,
        positions: &pos,
    };
    let mut want = vec![0f32; tt * n];
    indexer::logits_in_blocks(&ip, &qs, IndexKeys::F32(&keys), &blocks, &cp, &mut want).unwrap();
    assert_eq!(out.data, want);
    let vis: Vec<usize> = pos.iter().map(|&p| indexer::visible(p, m)).collect();
    let pools = indexer::pools_of(tt, n, &blocks, &cp, &vis).unwrap();
    let reference = indexer::reference::logits(&ip, &qs, IndexKeys::F32(&keys), Some(&pools));
    for (i, (&a, &b)) in out.data.iter().zip(&reference).enumerate() {
        assert_eq!(a.is_finite(), b.is_finite(), "{i}: {a} vs {b}");
        let in_pool = pools[i / n].contains(&((i % n) as u32));
        assert_eq!(a.is_finite(), in_pool, "{i}");
    }
    let st = compare(&out.data, &reference, &F32_VS_F64);
    assert!(st.ok(&F32_VS_F64), "{st:?}");
    // Row 0 (position 0, ratio 2) sees no entry; row 4 has no block.
    assert!(out.data[..n]
        .iter()
        .chain(&out.data[4 * n..])
        .all(|v| *v == f32::NEG_INFINITY));

    // Errors: block past the keys, block size 0, null blocks, wrong dtype.
    let mut far = i32t(vec![10; tt * 3], &[tt, 3]);
    let call = |b: *const DLTensor,
                bs: u32,
                o: &mut T<f32>,
                q: &mut T<f32>,
                w: &mut T<f32>,
                p: &mut T<i64>,
                k: &mut T<f32>| unsafe {
        csa2_indexer_logits_in_blocks(&csa2::ffi::Csa2IndexerLogitsInBlocksArgs {
            q: &q.dl(),
            w: &w.dl(),
            positions: &p.dl(),
            keys: &k.dl(),
            blocks: b,
            ratio: m as u32,
            block_size: bs,
            q_quant: 0,
            logits_out: &o.dl(),
            ..Default::default()
        })
    };
    let mut o2 = f32t(vec![1.0; tt * n], &[tt, n]);
    let fd = far.dl();
    err(
        call(&fd, 4, &mut o2, &mut qt, &mut wt, &mut pt, &mut kt),
        Csa2Status::Csa2ErrInvalidArgument,
        "blocks",
    );
    let bd = bt.dl();
    err(
        call(&bd, 0, &mut o2, &mut qt, &mut wt, &mut pt, &mut kt),
        Csa2Status::Csa2ErrInvalidArgument,
        "block_size",
    );
    err(
        call(null(), 4, &mut o2, &mut qt, &mut wt, &mut pt, &mut kt),
        Csa2Status::Csa2ErrNullPointer,
        "blocks",
    );
    let mut b64 = t(vec![0i64; tt * 3], &[tt, 3], (0, 64));
    let b64d = b64.dl();
    err(
        call(&b64d, 4, &mut o2, &mut qt, &mut wt, &mut pt, &mut kt),
        Csa2Status::Csa2ErrShape,
        "blocks",
    );
    assert!(o2.data.iter().all(|&v| v == 1.0));
}

#[test]
fn concurrent_requests_write_and_read_their_own_entries() {
    // The module docs promise concurrent calls on one handle: 4 threads, each its own request,
    // writing and reading back entries and SWA rows at the same time.
    let c = cache(8) as usize;
    let handles: Vec<_> = (0..4u64)
        .map(|id| {
            std::thread::spawn(move || {
                let c = c as *const Csa2Cache;
                let mut r = StdRng::seed_from_u64(100 + id);
                unsafe {
                    ok(csa2_cache_add_request(c, id));
                    ok(csa2_cache_allocate(c, id, 512));
                }
                for round in 0..20 {
                    let e: Vec<i64> = (0..8).map(|_| r.random_range(0..256)).collect();
                    let mut uniq = e.clone();
                    uniq.sort();
                    uniq.dedup();
                    let x = randn(&mut r, uniq.len() * 512);
                    let mut et = i64t(uniq.clone());
                    let mut src = f32t(x.clone(), &[uniq.len(), 512]);
                    ok(unsafe { csa2_cache_write_entries(c, id, 8, 0, &et.dl(), &src.dl()) });
                    let want = qdq(RecordFormat::Nvfp4Ds, &x).1;
                    assert_eq!(
                        read_f32(c, id, 8, 0, &uniq),
                        want,
                        "request {id} round {round}"
                    );
                    let mut s = f32t(x[..512].to_vec(), &[1, 512]);
                    ok(unsafe { csa2_cache_swa_write(c, id, 3, round, &s.dl()) });
                }
                unsafe { ok(csa2_cache_free_request(c, id)) };
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    unsafe { csa2_cache_free(c as *mut Csa2Cache) };
}

/// A kDLCUDA tensor reaching a host-only op export (RoPE runs fused into its consumers on the GPU)
/// is refused with CSA2_ERR_UNSUPPORTED saying the call needs host memory — not
/// CSA2_ERR_NO_CUDA_BUILD, which would send the caller to rebuild for nothing — and nothing is
/// written.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_tensor_in_a_host_only_call_says_it_needs_host_memory() {
    let mut g = null_mut();
    ok(unsafe { csa2_geometry_embedded(&mut g) });
    let x0: Vec<f32> = (0..2 * 64 * 512).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut x = f32t(x0.clone(), &[2, 64, 512]);
    x.device = K_DL_CUDA;
    let mut pos = i64t(vec![3, 4]);
    let s = unsafe { csa2_rope(g, 0, &x.dl(), &pos.dl(), 0) };
    assert_eq!(s, Csa2Status::Csa2ErrUnsupported);
    let e = last_error();
    assert!(e.contains("needs host memory"), "{e}");
    assert_eq!(x.data, x0, "nothing written");
    unsafe { csa2_geometry_free(g) };
}
