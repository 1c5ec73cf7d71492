//! Record-level cache access through the C ABI (`csa2_cache_write_entries` / `_read_entries`):
//! 1024 main-KV rows of a ratio-2 layer scattered through a request's slot mapping, beside the
//! codec alone on the same rows (`encode_rows` / `decode_rows`, the floor) and a memcpy of the f32
//! bytes; and the cost of zeroing reused blocks beside a plain memset of the same slabs. Run:
//! `cargo bench --bench cache_records` (figures in docs/PERF.md).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use csa2::ffi::dlpack::{DLDataType, DLDevice, DLTensor, K_DL_CPU};
use csa2::ffi::*;
use csa2::formats::{decode_rows, encode_rows, RecordFormat};
use std::ffi::c_void;
use std::hint::black_box;
use std::ptr::{null, null_mut};

const ROWS: usize = 1024;

fn desc<T>(data: &mut [T], shape: &mut [i64], code: u8, bits: u8) -> DLTensor {
    DLTensor {
        data: data.as_mut_ptr() as *mut c_void,
        device: DLDevice {
            device_type: K_DL_CPU,
            device_id: 0,
        },
        ndim: shape.len() as i32,
        dtype: DLDataType {
            code,
            bits,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: null_mut(),
        byte_offset: 0,
    }
}

fn records(c: &mut Criterion) {
    let fmt = RecordFormat::Nvfp4Ds;
    let mut g_ = null_mut();
    let mut cache = null_mut();
    unsafe {
        assert_eq!(csa2_geometry_embedded(&mut g_), Csa2Status::Csa2Ok);
        assert_eq!(
            csa2_cache_create(
                &csa2::ffi::Csa2CacheCreateArgs {
                    geometry: g_,
                    layout: 0,
                    num_blocks: 64,
                    block_tokens: 256,
                    model: null(),
                    model_len: 0,
                    ..Default::default()
                },
                &mut cache
            ),
            Csa2Status::Csa2Ok
        );
        assert_eq!(csa2_cache_add_request(cache, 1), Csa2Status::Csa2Ok);
        // 1024 entries of a ratio-2 layer = 2048 tokens = 8 blocks.
        assert_eq!(csa2_cache_allocate(cache, 1, 2 * ROWS), Csa2Status::Csa2Ok);
    }
    let n = ROWS * fmt.dim();
    let mut x: Vec<f32> = (0..n)
        .map(|i| ((i * 2654435761) % 1000) as f32 * 0.006 - 3.0)
        .collect();
    let mut y = vec![0f32; n];
    let mut rec = vec![0u8; ROWS * fmt.record_bytes()];
    let mut entries: Vec<i64> = (0..ROWS as i64).collect();
    let (mut es, mut xs, mut ys) = ([ROWS as i64], [ROWS as i64, 512], [ROWS as i64, 512]);
    let ed = desc(&mut entries, &mut es, 0, 64);
    let xd = desc(&mut x, &mut xs, 2, 32);
    let yd = desc(&mut y, &mut ys, 2, 32);
    let mut g = c.benchmark_group("cache_records/nvfp4");
    g.throughput(Throughput::Bytes((n * 4) as u64));
    let x2 = x.clone();
    let mut y2 = vec![0f32; n];
    g.bench_function("memcpy", |b| b.iter(|| y2.copy_from_slice(black_box(&x2))));
    g.bench_function("encode_rows", |b| {
        b.iter(|| encode_rows(fmt, black_box(&x2), &mut rec).unwrap())
    });
    g.bench_function("write_entries", |b| {
        b.iter(|| unsafe {
            assert_eq!(
                csa2_cache_write_entries(cache, 1, 2, 0, &ed, black_box(&xd)),
                Csa2Status::Csa2Ok
            )
        })
    });
    g.bench_function("decode_rows", |b| {
        b.iter(|| decode_rows(fmt, black_box(&rec), &mut y2).unwrap())
    });
    g.bench_function("read_entries", |b| {
        b.iter(|| unsafe {
            assert_eq!(
                csa2_cache_read_entries(cache, 1, 2, 0, &ed, black_box(&yd)),
                Csa2Status::Csa2Ok
            )
        })
    });
    g.finish();
    unsafe {
        csa2_cache_free(cache);
        csa2_geometry_free(g_);
    }
}

/// The cost of zeroing reused blocks (C ABI finding 8): one request allocating 8 blocks (2048
/// tokens) that the previous iteration freed — so every block is reused and zeroed — and freeing
/// them, beside a plain memset of the same 8 slabs, in the same run.
fn reuse(c: &mut Criterion) {
    let mut g_ = null_mut();
    let mut cache = null_mut();
    let mut st = Csa2CacheStats::default();
    unsafe {
        assert_eq!(csa2_geometry_embedded(&mut g_), Csa2Status::Csa2Ok);
        assert_eq!(
            csa2_cache_create(
                &csa2::ffi::Csa2CacheCreateArgs {
                    geometry: g_,
                    layout: 0,
                    num_blocks: 8,
                    block_tokens: 256,
                    model: null(),
                    model_len: 0,
                    ..Default::default()
                },
                &mut cache
            ),
            Csa2Status::Csa2Ok
        );
        // First use allocates the slabs; every later allocation reuses (and zeroes) them.
        assert_eq!(csa2_cache_add_request(cache, 0), Csa2Status::Csa2Ok);
        assert_eq!(csa2_cache_allocate(cache, 0, 2048), Csa2Status::Csa2Ok);
        assert_eq!(csa2_cache_free_request(cache, 0), Csa2Status::Csa2Ok);
        assert_eq!(csa2_cache_stats(cache, &mut st), Csa2Status::Csa2Ok);
    }
    let bytes = 8 * st.slab_bytes as usize;
    let mut g = c.benchmark_group("cache_reuse/8_blocks");
    g.throughput(Throughput::Bytes(bytes as u64));
    let mut slabs = vec![1u8; bytes];
    g.bench_function("memset_slabs", |b| {
        b.iter(|| black_box(&mut slabs[..]).fill(0))
    });
    let mut id = 1u64;
    g.bench_function("allocate_zeroed_and_free", |b| {
        b.iter(|| unsafe {
            id += 1;
            assert_eq!(csa2_cache_add_request(cache, id), Csa2Status::Csa2Ok);
            assert_eq!(csa2_cache_allocate(cache, id, 2048), Csa2Status::Csa2Ok);
            assert_eq!(csa2_cache_free_request(cache, id), Csa2Status::Csa2Ok);
        })
    });
    g.bench_function("add_and_free_request_only", |b| {
        b.iter(|| unsafe {
            id += 1;
            assert_eq!(csa2_cache_add_request(cache, id), Csa2Status::Csa2Ok);
            assert_eq!(csa2_cache_free_request(cache, id), Csa2Status::Csa2Ok);
        })
    });
    g.finish();
    eprintln!(
        "cache_reuse: slab_bytes {} (8 slabs = {bytes} B)",
        st.slab_bytes
    );
    unsafe {
        csa2_cache_free(cache);
        csa2_geometry_free(g_);
    }
}

criterion_group!(benches, records, reuse);
criterion_main!(benches);
