//! Dev A/B of the decode attention paths (interleaved, same process). Not part of the build docs.
use csa2::formats::{encode_rows, RecordFormat};
use csa2::ops::attention::{self, AttentionDots, AttentionInputs, AttentionParams, KvRows};
use csa2_rng::{rand_normal, NewRng, Rng};
use std::sync::atomic::Ordering;
use std::time::Instant;

fn cpu() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512bf16")]
fn probe(n: usize) -> (f64, f64) {
    use std::arch::x86_64::*;
    let a = _mm512_set1_epi16(std::hint::black_box(3));
    let mut acc = [_mm512_setzero_si512(); 12];
    let c0 = cpu();
    for _ in 0..n {
        for r in acc.iter_mut() {
            // SAFETY: register-only instruction.
            unsafe {
                std::arch::asm!("vpdpwssd {r}, {a}, {a}", r = inout(zmm_reg) *r, a = in(zmm_reg) a,
                    options(pure, nomem, nostack))
            };
        }
    }
    let t16 = cpu() - c0;
    std::hint::black_box(acc);
    let x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(1e-3));
    let mut accf = [_mm512_setzero_ps(); 12];
    let c0 = cpu();
    for _ in 0..n {
        for r in accf.iter_mut() {
            *r = _mm512_dpbf16_ps(*r, x, x);
        }
    }
    let tb = cpu() - c0;
    std::hint::black_box(accf);
    (n as f64 * 12.0 * 32.0 / t16 / 1e9, n as f64 * 12.0 * 32.0 / tb / 1e9)
}

fn main() {
    if std::env::var("LAT").is_ok_and(|v| v == "1") {
        use rayon::prelude::*;
        let spin = |us: f64| {
            let t = Instant::now();
            while t.elapsed().as_secs_f64() * 1e6 < us {}
        };
        for round in 0..3 {
            let mut r: Vec<(String, f64)> = vec![];
            for (name, k) in [("2 par phases from main", 0), ("scope{2 par phases}", 1)] {
                let mut ts = vec![];
                for _ in 0..200 {
                    spin(300.0);
                    let t = Instant::now();
                    let body = || {
                        (0..10).into_par_iter().for_each(|_| spin(5.0));
                        (0..8).into_par_iter().for_each(|_| spin(5.0));
                    };
                    if k == 0 {
                        body()
                    } else {
                        rayon::scope(|_| body())
                    }
                    ts.push(t.elapsed().as_secs_f64() * 1e6);
                }
                ts.sort_by(f64::total_cmp);
                r.push((name.into(), ts[ts.len() / 2]));
            }
            println!("round {round}: {r:?} (90 µs of work; ideal on 2 threads 45)");
        }
        return;
    }
    if std::env::var("PROBE").is_ok_and(|v| v == "1") {
        for _ in 0..5 {
            // SAFETY: the example runs on the AVX-512 VNNI + BF16 machine it is for.
            let (i, b) = unsafe { probe(20_000_000) };
            println!("probe: vpdpwssd {i:.1} GMAC/s, vdpbf16ps {b:.1} GMAC/s (one thread, CPU time)");
        }
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(20);
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let variants: Vec<u8> = args
        .get(3)
        .map(|s| s.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![0, 1]);
    let mut rng = Rng::new(1);
    let heads = 64;
    let (nm, ns) = (4096usize, 4096usize);
    let qa = rand_normal(&mut rng, heads * 512, 1.0);
    let main = rand_normal(&mut rng, nm * 512, 1.0);
    let swa = rand_normal(&mut rng, ns * 512, 1.0);
    let mut mq = vec![0u8; nm * 288];
    encode_rows(RecordFormat::Nvfp4Ds, &main, &mut mq).unwrap();
    let mut sq = vec![0u8; ns * 528];
    encode_rows(RecordFormat::Mxfp8, &swa, &mut sq).unwrap();
    let topk_row: Vec<i32> = (0..512).map(|i| (i * 7 % nm) as i32).collect();
    let sink = rand_normal(&mut rng, heads, 1.0);
    let posa = [ns as i64 - 1];
    let inp = AttentionInputs {
        q: &qa,
        topk: &topk_row,
        topk_len: None,
        positions: &posa,
        replay_start: &[],
        sink: &sink,
    };
    let ap = AttentionParams::default();
    let dots = match std::env::var("DOTS").as_deref() {
        Ok("bf16") => AttentionDots::Bf16,
        Ok("f32") => AttentionDots::F32,
        _ => AttentionDots::Int16,
    };
    // CPU=1: process CPU time per call (all threads; robust to preemption on a loaded machine).
    let use_cpu = std::env::var("CPU").is_ok_and(|v| v == "1");
    let mut outs = vec![];
    let mut samples: Vec<Vec<f64>> = vec![vec![]; variants.len()];
    for _ in 0..rounds {
        for (k, &v) in variants.iter().enumerate() {
            attention::DEV_VARIANT.store(v, Ordering::Relaxed);
            let mut o = vec![0f32; heads * 512];
            let mut l = vec![0f32; heads];
            let run = |o: &mut [f32], l: &mut [f32]| {
                attention::attention_with_dots(
                    &ap,
                    dots,
                    &inp,
                    KvRows::Records(RecordFormat::Nvfp4Ds, &mq),
                    KvRows::Records(RecordFormat::Mxfp8, &sq),
                    o,
                    l,
                )
                .unwrap()
            };
            run(&mut o, &mut l);
            for _ in 0..reps {
                let (t0, c0) = (Instant::now(), cpu());
                run(&mut o, &mut l);
                let (w, c) = (t0.elapsed().as_secs_f64() * 1e6, (cpu() - c0) * 1e6);
                samples[k].push(if use_cpu { c } else { w });
            }
            if outs.len() < variants.len() {
                outs.push((o, l));
            }
        }
    }
    for (k, s) in samples.iter_mut().enumerate() {
        s.sort_by(f64::total_cmp);
        println!(
            "variant {}: median {:.1} µs  min {:.1}  p25 {:.1}  (n {})",
            variants[k],
            s[s.len() / 2],
            s[0],
            s[s.len() / 4],
            s.len()
        );
    }
    for (k, (o, l)) in outs.iter().enumerate() {
        let mut hsh = 0xcbf29ce484222325u64;
        for x in o.iter().chain(l.iter()) {
            hsh = (hsh ^ x.to_bits() as u64).wrapping_mul(0x100000001b3);
        }
        println!("variant {} digest {:016x}", variants[k], hsh);
    }
    for k in 1..variants.len() {
        let m0 = samples[0][samples[0].len() / 2];
        let mk = samples[k][samples[k].len() / 2];
        let (o0, _) = &outs[0];
        let (ok, lk) = &outs[k];
        let maxd = o0.iter().zip(ok).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!(
            "variant {} / variant {}: median ratio {:.3}; max |Δout| {:.3e}; lse[0] {}",
            variants[k], variants[0], mk / m0, maxd, lk[0]
        );
    }
}
