//! Record codec throughput per format and instruction set, beside a memcpy of the same f32 bytes.
//! Run: `cargo bench --bench codecs` (figures in docs/PERF.md).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use csa2::formats::fast::Isa;
use csa2::formats::{decode_rows_with, encode_rows_with, RecordFormat};
use std::hint::black_box;

const ROWS: usize = 1024;

fn codecs(c: &mut Criterion) {
    for fmt in RecordFormat::ALL {
        let n = ROWS * fmt.dim();
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 2654435761) % 1000) as f32 * 0.006 - 3.0)
            .collect();
        let mut rec = vec![0u8; ROWS * fmt.record_bytes()];
        let mut y = vec![0f32; n];
        let mut g = c.benchmark_group(format!("codec/{}", fmt.name()));
        g.throughput(Throughput::Bytes((n * 4) as u64));
        g.bench_function("memcpy", |b| b.iter(|| y.copy_from_slice(black_box(&x))));
        for isa in Isa::supported() {
            g.bench_function(format!("encode/{}", isa.name()), |b| {
                b.iter(|| encode_rows_with(isa, fmt, black_box(&x), &mut rec).unwrap())
            });
            g.bench_function(format!("decode/{}", isa.name()), |b| {
                b.iter(|| decode_rows_with(isa, fmt, black_box(&rec), &mut y).unwrap())
            });
        }
        g.finish();
    }
}

criterion_group!(benches, codecs);
criterion_main!(benches);
