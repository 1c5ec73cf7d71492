//! mHC boundary: fused single pass vs the four unfused passes, beside a memcpy and an FMA-peak probe
//! measured in the same run. Prints `T | µs | GB/s` per path; bytes are the modeled activation
//! traffic ((2n+2)·d f32 per token fused, (4n+4)·d unfused) plus one read of `hc_fn` per call. The
//! variants are timed round-robin (medians) so a load change on a shared machine hits all alike.
//! The `GEMV` columns time the coefficient pass alone (`cpu::coefficients`: 24·4d FMAs per token)
//! against the measured peak.
//!
//! `cargo bench --bench mhc` (env: CSA2_BENCH_TOKENS="1,16,256,4096", CSA2_BENCH_D=5120,
//! CSA2_BENCH_SECONDS=2 per measurement).

use csa2::ops::mhc::{
    cpu, BoundaryIn, BoundaryOut, Coeffs, MhcParams, MixWeights, PostUpdate, HC, MIX,
};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::time::{Duration, Instant};

fn env_or<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn fill(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// The clock: wall time, or with `CSA2_BENCH_CLOCK=cpu` the CPU time of all this process's threads
/// (sum of the first field of `/proc/self/task/*/schedstat`, ns). On a shared, overloaded machine
/// CPU time leaves out the time other processes held the cores; use it with `RAYON_NUM_THREADS=1`
/// (idle spinning of pool threads would count) and T ≥ 16 (reading the files costs tens of µs).
fn now() -> Duration {
    static CPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *CPU.get_or_init(|| std::env::var("CSA2_BENCH_CLOCK").as_deref() == Ok("cpu")) {
        let ns: u64 = std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task")
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        Duration::from_nanos(ns)
    } else {
        static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        T0.get_or_init(Instant::now).elapsed()
    }
}

/// Best wall time of `f` over repeated runs for about `budget` (at least 3 runs).
fn best<F: FnMut()>(budget: Duration, mut f: F) -> Duration {
    let start = Instant::now();
    f();
    let (mut b, mut runs) = (Duration::MAX, 0);
    while runs < 3 || start.elapsed() < budget {
        let t = now();
        f();
        b = b.min(now() - t);
        runs += 1;
    }
    b
}

/// Median time of each of the N variants, run round-robin (one warm-up round, then ≥ 5 rounds, for
/// about `budget`), so a load change on a shared machine hits every variant alike.
fn medians<const N: usize, F: FnMut(usize)>(budget: Duration, mut f: F) -> [Duration; N] {
    (0..N).for_each(&mut f);
    let start = Instant::now();
    let mut runs: [Vec<Duration>; N] = std::array::from_fn(|_| vec![]);
    while runs[0].len() < 5 || start.elapsed() < budget {
        for (i, r) in runs.iter_mut().enumerate() {
            let t = now();
            f(i);
            r.push(now() - t);
        }
    }
    runs.map(|mut r| {
        r.sort();
        r[r.len() / 2]
    })
}

fn main() {
    let d: usize = env_or("CSA2_BENCH_D", 5120);
    let secs: f64 = env_or("CSA2_BENCH_SECONDS", 2.0);
    let budget = Duration::from_secs_f64(secs);
    let tokens: Vec<usize> = std::env::var("CSA2_BENCH_TOKENS")
        .unwrap_or_else(|_| "1,16,256,4096".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let p = MhcParams::new(d);
    let mut rng = StdRng::seed_from_u64(1);
    let hc_fn = fill(&mut rng, MIX * HC * d, -0.01, 0.01);
    let base = fill(&mut rng, MIX, -0.5, 0.5);
    let scale = vec![1.0f32; 3];
    let norm = fill(&mut rng, d, 0.9, 1.1);
    let fn_bytes = (MIX * HC * d * 4) as f64;

    // memcpy baseline over 256 MiB (read + write counted).
    let n = 64 << 20;
    let src = fill(&mut rng, n, -1.0, 1.0);
    let mut dst = vec![0.0f32; n];
    let t = best(budget, || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    });
    let memcpy_gbs = 2.0 * (n * 4) as f64 / t.as_secs_f64() / 1e9;
    // The same copy split over all threads (1 MiB pieces): the bandwidth the fused pass, which
    // runs on all threads, can have.
    let t = best(budget, || {
        use rayon::prelude::*;
        dst.par_chunks_mut(1 << 18)
            .zip(std::hint::black_box(&src).par_chunks(1 << 18))
            .for_each(|(d, s)| d.copy_from_slice(s));
        std::hint::black_box(&mut dst);
    });
    let memcpy_all_gbs = 2.0 * (n * 4) as f64 / t.as_secs_f64() / 1e9;
    drop((src, dst));
    println!(
        "mHC boundary, d = {d}, threads = {}, clock = {}",
        rayon::current_num_threads(),
        std::env::var("CSA2_BENCH_CLOCK").unwrap_or_else(|_| "wall".into())
    );
    println!(
        "memcpy 256 MiB: {memcpy_gbs:.1} GB/s (read + write); on all threads at once \
         {memcpy_all_gbs:.1} GB/s"
    );
    // The peak is a property of the cores: every thread's rate by its own CPU time, all threads
    // at once, summed. The wall-clock rate of the same loop on all threads says how much of that
    // the machine gave this process during the run (less than the peak on a shared machine).
    let one = csa2::ops::simd::fma_peak_gflops(300);
    let peak = cpu::fma_peak_gflops(300);
    let wall: f64 = rayon::broadcast(|_| {
        let (t, c) = (Instant::now(), csa2::ops::simd::thread_cpu_seconds());
        let r = csa2::ops::simd::fma_peak_gflops(300);
        r * (csa2::ops::simd::thread_cpu_seconds() - c) / t.elapsed().as_secs_f64()
    })
    .into_iter()
    .sum();
    println!(
        "FMA peak (ISA {:?}, thread CPU time): one thread {one:.1} GFLOP/s, all threads at once \
         {peak:.1} GFLOP/s; the same loop by wall clock {wall:.1} GFLOP/s",
        csa2::isa::level()
    );
    let packed = cpu::PackedHcFn::new(d, &hc_fn).unwrap();
    println!(
        "medians; 'packed' = hc_fn packed at load (MixWeights::packed), 'row-major' = the same \
         kernels reading hc_fn [24, 4d] directly"
    );
    println!(
        "{:>6} | {:>10} {:>7} {:>10} {:>7} {:>8} | {:>10} {:>10} {:>8} | {:>9} {:>7} {:>6} | {:>9} {:>7}",
        "T",
        "fused µs",
        "GB/s",
        "unfused µs",
        "GB/s",
        "unf/fus",
        "fused rm",
        "unfused rm",
        "unf/fus",
        "GEMV µs",
        "GFLOP/s",
        "%peak",
        "GEMV rm",
        "GFLOP/s"
    );
    for &t in &tokens {
        let x = fill(&mut rng, t * HC * d, -1.0, 1.0);
        let y = fill(&mut rng, t * d, -1.0, 1.0);
        let post = fill(&mut rng, t * HC, 0.0, 2.0);
        let comb = fill(&mut rng, t * HC * HC, 0.0, 0.5);
        let pre = fill(&mut rng, t * HC, 0.0, 1.0);
        let w = |pk: bool| MixWeights {
            hc_fn: &hc_fn,
            base: &base,
            scale: &scale,
            packed: pk.then_some(&packed),
        };
        let inp = |pk: bool| BoundaryIn {
            x: &x,
            update: Some(PostUpdate {
                y: &y,
                post: &post,
                comb: &comb,
            }),
            pre_prev: &pre,
            next: Some(w(pk)),
            norm: &norm,
        };
        let mut x_new = vec![1.0f32; t * HC * d];
        let mut layer_in = vec![1.0f32; t * d];
        let mut co = Coeffs::zeros(t);
        // 0 fused, 1 unfused, 2 fused row-major, 3 unfused row-major, 4 GEMV, 5 GEMV row-major.
        let m = medians::<6, _>(budget, |i| {
            if i >= 4 {
                cpu::coefficients(&p, &w(i == 4), &x, &mut co.as_mut());
                return;
            }
            let mut out = BoundaryOut {
                x_new: &mut x_new,
                layer_in: &mut layer_in,
                coeffs: Some(co.as_mut()),
            };
            let pk = i == 0 || i == 1;
            if i % 2 == 0 {
                cpu::fused_boundary(&p, &inp(pk), &mut out).unwrap()
            } else {
                cpu::unfused_boundary(&p, &inp(pk), &mut out).unwrap()
            }
        });
        let gflops = |dt: Duration| (2 * MIX * HC * d * t) as f64 / dt.as_secs_f64() / 1e9;
        let act = (t * d * 4) as f64;
        let fused_bytes = (2 * HC + 2) as f64 * act + fn_bytes;
        let unfused_bytes = (4 * HC + 4) as f64 * act + fn_bytes;
        let gbs = |b: f64, dt: Duration| b / dt.as_secs_f64() / 1e9;
        let us = |dt: Duration| dt.as_secs_f64() * 1e6;
        println!(
            "{:>6} | {:>10.1} {:>7.1} {:>10.1} {:>7.1} {:>7.2}x | {:>10.1} {:>10.1} {:>7.2}x | {:>9.1} {:>7.1} {:>5.0}% | {:>9.1} {:>7.1}",
            t,
            us(m[0]),
            gbs(fused_bytes, m[0]),
            us(m[1]),
            gbs(unfused_bytes, m[1]),
            m[1].as_secs_f64() / m[0].as_secs_f64(),
            us(m[2]),
            us(m[3]),
            m[3].as_secs_f64() / m[2].as_secs_f64(),
            us(m[4]),
            gflops(m[4]),
            100.0 * gflops(m[4]) / peak,
            us(m[5]),
            gflops(m[5]),
        );
        // What bounds the fused pass: its mul/FMA operations at the all-thread peak, and its
        // modeled bytes at the all-thread memcpy rate. With both overlapped the pass cannot beat
        // the larger; with them in turn, the sum. The unfused time over each is the ratio that
        // floor would give.
        // FMA-pipe operations per dim and token in the fused pass (each mul or FMA once): the
        // GEMV's 24 · 4, the mix statistic Σx'² (4), the post update (4 × (1 mul + 4 FMAs)), the
        // collapse (1 mul + 3 FMAs), Σu² (1) and the norm's two scalings (2). The peak counts
        // an FMA as 2 FLOPs, so the unit issues peak / 2 of these per second.
        let ops_per_dim = MIX * HC + HC + HC * (HC + 1) + HC + 1 + 2;
        let fma_ops = (ops_per_dim * d * t) as f64;
        let fma_s = fma_ops / (peak / 2.0 * 1e9);
        let mem_s = fused_bytes / (memcpy_all_gbs * 1e9);
        let unf = m[1].as_secs_f64();
        println!(
            "floor T={t}: FMAs {:.1} µs ({:.1} M mul/FMA ops, {ops_per_dim} per dim and token, at \
             {peak:.1} GFLOP/s), bytes {:.1} µs ({:.1} MB \
             at {memcpy_all_gbs:.1} GB/s); fused at {:.0}% of the overlapped floor ({:.1} µs), \
             {:.0}% of the serialized one ({:.1} µs); unfused / floor = {:.2}x overlapped, \
             {:.2}x serialized",
            fma_s * 1e6,
            fma_ops / 1e6,
            mem_s * 1e6,
            fused_bytes / 1e6,
            100.0 * fma_s.max(mem_s) / m[0].as_secs_f64(),
            fma_s.max(mem_s) * 1e6,
            100.0 * (fma_s + mem_s) / m[0].as_secs_f64(),
            (fma_s + mem_s) * 1e6,
            unf / fma_s.max(mem_s),
            unf / (fma_s + mem_s),
        );
    }
}
