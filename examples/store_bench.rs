//! SSD-tier throughput beside the plain-file baseline measured in the same run.
//!
//! `cargo run --profile test --example store_bench [-- RECORDS]`: writes RECORDS (default 400)
//! block slabs of a 512-token V4.1 block (455,680 B) through `SsdStore::put` (no fsync) and the same
//! bytes with one `write_all` per record to a plain file, then reads them back through
//! `SsdStore::get` (pread + CRC32C check) and plain `read_exact`. Prints GB/s and ratios.

use csa2::store::ssd::{crash_test_record, synthetic_payload};
use csa2::store::{FsyncPolicy, ManualClock, SsdConfig, SsdStore};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(400);
    let len = 455_680;
    let dir = std::env::temp_dir().join(format!("csa2-store-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let recs: Vec<_> = (0..n)
        .map(|i| {
            let (k, _) = crash_test_record(1, i, 1);
            let mut v = Vec::new();
            synthetic_payload(&k, len, &mut v);
            (k, v)
        })
        .collect();
    let bytes = (n as usize * len) as f64;

    let t = Instant::now();
    let mut f = std::fs::File::create(dir.join("plain.bin")).unwrap();
    for (_, v) in &recs {
        f.write_all(v).unwrap();
    }
    drop(f);
    let plain_w = t.elapsed().as_secs_f64();

    let mut cfg = SsdConfig::new(dir.join("ssd"), 1 << 40);
    cfg.fsync = FsyncPolicy::Never;
    let (s, _) = SsdStore::open(cfg, Arc::new(ManualClock::new(0))).unwrap();
    let t = Instant::now();
    for (k, v) in &recs {
        s.put(k, v).unwrap();
    }
    let ssd_w = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let mut f = std::fs::File::open(dir.join("plain.bin")).unwrap();
    let mut buf = vec![0u8; len];
    for _ in 0..n {
        f.read_exact(&mut buf).unwrap();
    }
    let plain_r = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for (k, _) in &recs {
        assert_eq!(s.get(k).unwrap().map(|v| v.len()), Some(len));
    }
    let ssd_r = t.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&dir).unwrap();

    let gbs = |sec: f64| bytes / sec / 1e9;
    println!("{n} records × {len} B (page cache, no fsync)");
    println!(
        "write: SsdStore::put {:.2} GB/s | plain write_all {:.2} GB/s | ratio {:.2}",
        gbs(ssd_w),
        gbs(plain_w),
        plain_w / ssd_w
    );
    println!(
        "read:  SsdStore::get {:.2} GB/s | plain read_exact {:.2} GB/s | ratio {:.2}",
        gbs(ssd_r),
        gbs(plain_r),
        plain_r / ssd_r
    );
}
