//! Dev A/B of the decode attention paths (interleaved, same process). Not part of the build docs.
use csa2::formats::{encode_rows, RecordFormat};
use csa2::ops::attention::{self, AttentionDots, AttentionInputs, AttentionParams, KvRows};
use csa2_rng::{rand_normal, NewRng, Rng};
use std::sync::atomic::Ordering;
use std::time::Instant;

fn main() {
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
    let mut outs = vec![];
    let mut samples: Vec<Vec<f64>> = vec![vec![]; variants.len()];
    for _ in 0..rounds {
        for (k, &v) in variants.iter().enumerate() {
            attention::DEV_VARIANT.store(v, Ordering::Relaxed);
            let mut o = vec![0f32; heads * 512];
            let mut l = vec![0f32; heads];
            let mut run = |o: &mut [f32], l: &mut [f32]| {
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
                let t0 = Instant::now();
                run(&mut o, &mut l);
                samples[k].push(t0.elapsed().as_secs_f64() * 1e6);
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
