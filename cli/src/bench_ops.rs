//! `csa2 bench ops`: times the CPU fast paths on the benchmark shapes of the ops issue and prints
//! `median µs [min–max] | GFLOP/s | GB/s` beside an in-run baseline (a read pass, the machine's
//! FMA peak). The torch CPU baseline is `benches/torch_ops.py`, run in the same session
//! (`benches/ops_side_by_side.sh` interleaves the two); docs/PERF.md records both.

use crate::out::JsonOut;
use csa2::formats::{encode_rows, RecordFormat};
use csa2::ops::attention::{self, AttentionDots, AttentionInputs, AttentionParams, KvRows, HEADS};
use csa2::ops::candidates::{self, CandidateParams};
use csa2::ops::indexer::cpu::{DotKernel, Prepared};
use csa2::ops::indexer::{self, IndexKeys, IndexerParams, IndexerQueries, QueryQuant};
use csa2::ops::simd;
use csa2::ops::topk;
use csa2::{Error, Result};
use csa2_harness::rng::{rand_normal, NewRng, Rng};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Keys of the decode indexer (1M = 1,048,576).
    #[arg(long, default_value_t = 1 << 20, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    keys: usize,
    /// Tokens of the prefill-indexer chunk (keys = tokens / ratio, causal).
    #[arg(long, default_value_t = 4096, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    prefill_tokens: usize,
    /// Compression ratio of the prefill chunk.
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    prefill_ratio: usize,
    /// Repetitions of the prefill-indexer figure (after one warm-up).
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    prefill_reps: usize,
    /// Repetitions per figure (the median is reported, with the min–max spread).
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    reps: usize,
    /// Write every figure as JSON to PATH (`-` = stdout; the table then goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
}

/// The figures printed so far, for `--json`.
static ROWS: std::sync::Mutex<Vec<serde_json::Value>> = std::sync::Mutex::new(Vec::new());

/// Wall times of `reps` runs after one warm-up, in seconds.
#[derive(Clone, Copy)]
struct Stats {
    median: f64,
    min: f64,
    max: f64,
}

fn time<F: FnMut()>(reps: usize, mut f: F) -> Stats {
    f();
    let mut ts: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    ts.sort_by(f64::total_cmp);
    Stats {
        median: ts[ts.len() / 2],
        min: ts[0],
        max: ts[ts.len() - 1],
    }
}

fn line(name: &str, st: Stats, flops: f64, bytes: f64, note: &str) {
    let secs = st.median;
    ROWS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(serde_json::json!({
            "name": name, "median_us": secs * 1e6, "min_us": st.min * 1e6, "max_us": st.max * 1e6,
            "gflops": flops / secs / 1e9, "gbps": bytes / secs / 1e9, "note": note,
        }));
    say!(
        "{name:<44} {:>10.1} µs [{:.1}–{:.1}] | {:>8.2} GFLOP/s | {:>7.2} GB/s  {note}",
        secs * 1e6,
        st.min * 1e6,
        st.max * 1e6,
        flops / secs / 1e9,
        bytes / secs / 1e9
    );
}

/// A row's hardware floor from this run's probes: the time its dot-unit instructions alone take
/// on all threads at the probed rates (`terms`: MACs and the one-thread GMAC/s of the unit that
/// runs them), printed beside the row's median with the share of the floor reached. `None` when
/// a probe is off (the unit is missing or capped).
fn floor(name: &str, st: Stats, threads: usize, terms: &[(f64, Option<f64>, &str)]) {
    let mut secs = 0.0;
    let mut parts = Vec::new();
    for &(macs, peak, unit) in terms {
        let Some(g) = peak else {
            say!("floor {name}: skipped ({unit} probe off)");
            return;
        };
        let t = macs / (g * 1e9 * threads as f64);
        secs += t;
        parts.push(format!(
            "{:.1} M {unit} MACs / ({threads} × {g:.1} GMAC/s) = {:.1} µs",
            macs / 1e6,
            t * 1e6
        ));
    }
    ROWS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(serde_json::json!({
            "floor_of": name, "floor_us": secs * 1e6, "median_us": st.median * 1e6,
            "share_of_floor": secs / st.median, "terms": parts,
        }));
    say!(
        "floor {name}: {:.1} µs ({}); the median is at {:.0}% of it",
        secs * 1e6,
        parts.join(" + "),
        100.0 * secs / st.median
    );
}

pub fn run(a: Args) -> Result<()> {
    crate::out::json_dest(&a.json)?;
    if a.keys == 0 || a.prefill_tokens == 0 || a.prefill_ratio == 0 {
        return Err(Error::invalid(
            "bench sizes",
            "keys, prefill tokens and ratio must be > 0",
        ));
    }
    ROWS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    let mut rng = Rng::new(1);
    let threads = rayon::current_num_threads();
    let peak1 = simd::fma_peak_gflops(300);
    say!(
        "threads {threads}; ISA {}; FMA peak one thread {peak1:.1} GFLOP/s (×{threads} = {:.1})",
        csa2::isa::describe(),
        peak1 * threads as f64
    );
    let (vnni_peak, bf16_peak) = simd::dot_peak_gmacs(300);
    let int16_peak = simd::int16_dot_peak_gmacs(300);
    say!(
        "dot units (one thread, GMAC/s): f32 FMA {:.1}, int8 vpdpbusd {}, bf16 vdpbf16ps {}, int16 vpdpwssd {}",
        peak1 / 2.0,
        vnni_peak.map_or("off".into(), |v| format!("{v:.1}")),
        bf16_peak.map_or("off".into(), |v| format!("{v:.1}")),
        int16_peak.map_or("off".into(), |v| format!("{v:.1}"))
    );

    // The same int8 probe on every thread at once: whether the threads are cores of their own or
    // share one (SMT siblings split a core's dot ports).
    let all: Vec<Option<f64>> = rayon::broadcast(|_| simd::dot_peak_gmacs(300).0);
    if all.iter().all(|v| v.is_some()) {
        say!(
            "int8 vpdpbusd on all {threads} threads at once: {:.1} GMAC/s in all (per thread {})",
            all.iter().flatten().sum::<f64>(),
            all.iter()
                .flatten()
                .map(|v| format!("{v:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    // Memory bandwidth: one streaming read of 256 MiB per thread share (far beyond the caches), the
    // bound of any sweep over a cache that does not fit (1M MXFP4 index keys = 68 MiB).
    let big = vec![1u64; 32 << 20];
    let dram = time(3, || {
        use rayon::prelude::*;
        let s: u64 = big
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .sum();
        std::hint::black_box(s);
    });
    say!(
        "memory read, 256 MiB on {threads} threads: {:.1} GB/s (median of 3, wall) [best {:.1}]",
        256.0 * 1048576.0 / dram.median / 1e9,
        256.0 * 1048576.0 / dram.min / 1e9
    );
    drop(big);

    // Read-pass baseline: sum of 1M f32 (one thread), the unit of the top-k goal.
    let logits = rand_normal(&mut rng, 1 << 20, 1.0);
    let read = time(a.reps * 4, || {
        let mut acc = [0f32; 16];
        for c in logits.chunks_exact(16) {
            for l in 0..16 {
                acc[l] += c[l];
            }
        }
        std::hint::black_box(acc);
    });
    line(
        "read pass, 1M f32 (1 thread)",
        read,
        1048576.0,
        4.0 * 1048576.0,
        "baseline",
    );
    let mut sel = vec![0i32; 512];
    let tk = time(a.reps * 4, || {
        topk::select(&logits, logits.len(), &mut sel);
    });
    line(
        "top-512 of 1M logits (1 thread)",
        tk,
        0.0,
        4.0 * 1048576.0,
        &format!("= {:.2}× the read pass (medians)", tk.median / read.median),
    );

    // Decode indexer: one query, 32 heads × 128, over `keys` MXFP4 entries.
    let n = a.keys;
    let q = rand_normal(&mut rng, 32 * 128, 1.0);
    let w = rand_normal(&mut rng, 32, 1.0 / 64.0);
    let k = rand_normal(&mut rng, n * 128, 1.0);
    let mut km = vec![0u8; n * 68];
    encode_rows(RecordFormat::Mxfp4Index, &k, &mut km)?;
    drop(k);
    let pos = [n as i64 - 1];
    let qs = IndexerQueries {
        q: &q,
        w: &w,
        positions: &pos,
    };
    let p1 = IndexerParams::new(1);
    let mut out = vec![0f32; n];
    let t_idx = time(a.reps, || {
        indexer::logits(&p1, &qs, IndexKeys::Mxfp4(&km), &mut out).expect("valid")
    });
    let macs = 32.0 * 128.0 * n as f64;
    line(
        &format!("decode indexer, {n} MXFP4 keys"),
        t_idx,
        2.0 * macs,
        68.0 * n as f64,
        &format!(
            "{:.1} GMAC/s = {:.0}% of the {threads}-thread FMA peak",
            macs / t_idx.median / 1e9,
            100.0 * 2.0 * macs / t_idx.median / 1e9 / (peak1 * threads as f64)
        ),
    );
    // The same sweep over f32 keys: the like-for-like figure for torch on pre-decoded keys.
    let kf: Vec<f32> = {
        let mut v = vec![0f32; n * 128];
        csa2::formats::decode_rows(RecordFormat::Mxfp4Index, &km, &mut v)?;
        v
    };
    let t_f32 = time(a.reps, || {
        indexer::logits(&p1, &qs, IndexKeys::F32(&kf), &mut out).expect("valid")
    });
    line(
        &format!("decode indexer, {n} f32 keys"),
        t_f32,
        2.0 * macs,
        512.0 * n as f64,
        &format!("{:.1} GMAC/s", macs / t_f32.median / 1e9),
    );
    drop(kf);
    // The same sweep per query quantisation and kernel (MXFP4 keys): `mxfp4` (the V4.1 design)
    // on the integer kernel and on the f32 kernel, `bf16` on the bf16 kernel; the ratio is to the
    // f32-query figure above, same run.
    for (qq, kernel) in [
        (QueryQuant::Mxfp4, DotKernel::F32),
        (QueryQuant::Mxfp4, DotKernel::Int8),
        (QueryQuant::Bf16, DotKernel::Bf16),
    ] {
        let pq = IndexerParams {
            query_quant: qq,
            ..p1
        };
        let pr = match Prepared::with_kernel(&pq, &qs, vec![n], kernel) {
            Ok(pr) => pr,
            Err(e) => {
                say!(
                    "decode indexer, q {qq:?}, {} kernel: skipped ({e})",
                    kernel.name()
                );
                continue;
            }
        };
        let t = time(a.reps, || {
            indexer::cpu::dense(&pr, IndexKeys::Mxfp4(&km), &mut out)
        });
        line(
            &format!("decode indexer, q {qq:?}, {} kernel", kernel.name()),
            t,
            2.0 * macs,
            68.0 * n as f64,
            &format!(
                "{:.1} GMAC/s, {:.2}× the f32-query time",
                macs / t.median / 1e9,
                t_idx.median / t.median
            ),
        );
        let unit = match kernel {
            DotKernel::Int8 => Some((vnni_peak, "int8 vpdpbusd")),
            DotKernel::Bf16 => Some((bf16_peak, "bf16 vdpbf16ps")),
            _ => None,
        };
        if let Some((peak, unit)) = unit {
            floor(
                &format!("decode indexer, q {qq:?}, {} kernel", kernel.name()),
                t,
                threads,
                &[(macs, peak, unit)],
            );
        }
        if let Some(b) = indexer::cpu::kernel_breakdown(&pr, &km, n.min(1 << 18), 5) {
            // One thread; 64 vpdpbusd (64 MACs each) or 128 vdpbf16ps (32 each) per key at
            // 32 heads × 128 dims.
            let (what, unit, peak) = match b.kernel {
                DotKernel::Int8 => ("int8", "vpdpbusd", vnni_peak),
                _ => ("bf16", "vdpbf16ps", bf16_peak),
            };
            let ideal = 32.0 * 128.0 / peak.unwrap_or(f64::NAN);
            say!(
                "  {what} breakdown, one thread, CPU time, ns/key: unpack {:.2}, scoring hot keys {:.2}, whole loop {:.2}; {unit}-only bound {:.2} (hot scoring at {:.0}%, whole loop at {:.0}% of it)",
                b.unpack_ns,
                b.score_hot_ns,
                b.total_ns,
                ideal,
                100.0 * ideal / b.score_hot_ns,
                100.0 * ideal / b.total_ns
            );
        }
    }
    let t_full = time(a.reps, || {
        indexer::logits(&p1, &qs, IndexKeys::Mxfp4(&km), &mut out).expect("valid");
        topk::select(&out, n, &mut sel);
    });
    line(
        "decode indexer + top-512",
        t_full,
        2.0 * macs,
        68.0 * n as f64,
        "",
    );

    // Reindex sweep: pool of 2048 blocks from the candidate source, score inside it, own top-512.
    let cp = CandidateParams::default();
    let mut blocks = vec![0i32; cp.num_blocks];
    candidates::select_blocks(&cp, &out, n, &mut blocks);
    let t_cand = time(a.reps, || {
        candidates::select_blocks(&cp, &out, n, &mut blocks);
    });
    line(
        "candidate blocks (2048 of 8) from 1M logits",
        t_cand,
        0.0,
        4.0 * n as f64,
        "",
    );
    // Per query quantisation: f32 queries (f32 kernel) and MXFP4 queries (the V4.1 design: the
    // integer kernel where the CPU has VNNI). 1M and 64K entries alternate, so that machine noise
    // hits both sizes alike.
    let pm = IndexerParams {
        query_quant: QueryQuant::Mxfp4,
        ..p1
    };
    for pq in [p1, pm] {
        let mut meds = Vec::new();
        for nn in [n, 65536.min(n)] {
            let posn = [nn as i64 - 1];
            let qs = IndexerQueries {
                q: &q,
                w: &w,
                positions: &posn,
            };
            let mut b = vec![0i32; cp.num_blocks];
            candidates::select_blocks(&cp, &out[..nn], nn, &mut b);
            let pools = indexer::pools_of(1, nn, &b, &cp, &[nn])?;
            let pr = Prepared::new(&pq, &qs, vec![nn]);
            let ids = &pools[0];
            let mut vals = vec![0f32; ids.len()];
            let keys = IndexKeys::Mxfp4(&km[..nn * 68]);
            let t = time(a.reps * 4, || {
                use rayon::prelude::*;
                vals.par_chunks_mut(4096)
                    .zip(ids.par_chunks(4096))
                    .for_each(|(v, id)| {
                        indexer::cpu::score_ids(&pr, 0, &keys, id, &mut [v]);
                    });
                topk::cpu::select_scored(&vals, &mut sel);
            });
            meds.push(t);
            line(
                &format!(
                    "reindex sweep at {nn} entries (pool {}), q {:?}, {}",
                    ids.len(),
                    pq.query_quant,
                    pr.kernel().name()
                ),
                t,
                2.0 * 4096.0 * ids.len() as f64,
                68.0 * ids.len() as f64,
                "",
            );
        }
        if meds.len() == 2 {
            say!(
                "reindex {n} / {} entries, q {:?}: median ratio {:.2}, minimum ratio {:.2}",
                65536.min(n),
                pq.query_quant,
                meds[0].median / meds[1].median,
                meds[0].min / meds[1].min
            );
        }
    }

    // Decode attention: 64 heads over 512 NVFP4 main rows + 128 MXFP8 window rows.
    let (nm, ns) = (4096usize, 4096usize);
    let qa = rand_normal(&mut rng, HEADS * 512, 1.0);
    let main = rand_normal(&mut rng, nm * 512, 1.0);
    let swa = rand_normal(&mut rng, ns * 512, 1.0);
    let mut mq = vec![0u8; nm * 288];
    encode_rows(RecordFormat::Nvfp4Ds, &main, &mut mq)?;
    let mut sq = vec![0u8; ns * 528];
    encode_rows(RecordFormat::Mxfp8, &swa, &mut sq)?;
    let topk_row: Vec<i32> = (0..512).map(|i| (i * 7 % nm) as i32).collect();
    let sink = rand_normal(&mut rng, HEADS, 1.0);
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
    let mut o = vec![0f32; HEADS * 512];
    let mut l = vec![0f32; HEADS];
    let t_att = time(a.reps * 4, || {
        attention::attention(
            &ap,
            &inp,
            KvRows::Records(RecordFormat::Nvfp4Ds, &mq),
            KvRows::Records(RecordFormat::Mxfp8, &sq),
            &mut o,
            &mut l,
        )
        .expect("valid")
    });
    let fl = 2.0 * 2.0 * 64.0 * 640.0 * 512.0;
    line(
        "decode attention 64×(512+128)×512, fp4+fp8",
        t_att,
        fl,
        (512.0 * 288.0 + 128.0 * 528.0) + 64.0 * 512.0 * 8.0,
        "f32 dots",
    );
    // The narrow-dot paths, old and new interleaved (bf16, int16, bf16, int16, ...: `ATT_ROUNDS`
    // alternations of reps × 2 calls each) so that both see the same load; each row's median is
    // over all of its calls.
    let att = |dots: AttentionDots, o: &mut [f32], l: &mut [f32]| {
        attention::attention_with_dots(
            &ap,
            dots,
            &inp,
            KvRows::Records(RecordFormat::Nvfp4Ds, &mq),
            KvRows::Records(RecordFormat::Mxfp8, &sq),
            o,
            l,
        )
        .expect("valid")
    };
    let narrow: Vec<AttentionDots> = [AttentionDots::Bf16, AttentionDots::Int16]
        .into_iter()
        .filter(|d| d.is_supported())
        .collect();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); narrow.len()];
    for _ in 0..8 {
        for (k, &d) in narrow.iter().enumerate() {
            att(d, &mut o, &mut l);
            for _ in 0..a.reps.max(1) {
                let t0 = Instant::now();
                att(d, &mut o, &mut l);
                samples[k].push(t0.elapsed().as_secs_f64());
            }
        }
    }
    let stats: Vec<Stats> = samples
        .iter_mut()
        .map(|ts| {
            ts.sort_by(f64::total_cmp);
            Stats {
                median: ts[ts.len() / 2],
                min: ts[0],
                max: ts[ts.len() - 1],
            }
        })
        .collect();
    let bytes = (512.0 * 288.0 + 128.0 * 528.0) + 64.0 * 512.0 * 8.0;
    for (k, &d) in narrow.iter().enumerate() {
        let (name, note) = match d {
            AttentionDots::Int16 => (
                "decode attention, int16 dots (NVFP4 keys)",
                format!(
                    "{:.2}× the f32-dot time, {:.2}× the bf16-dot time (interleaved)",
                    t_att.median / stats[k].median,
                    stats[0].median / stats[k].median
                ),
            ),
            _ => (
                "decode attention, bf16 dots",
                format!("{:.2}× the f32-dot time", t_att.median / stats[k].median),
            ),
        };
        line(name, stats[k], fl, bytes, &note);
    }
    // The dot-unit floors of the narrow paths: 64 heads × 512 dims over 512 NVFP4 main rows and
    // 128 MXFP8 window rows. Scores: the int16 path's main rows take one `vpdpwssd` pass, bf16
    // rows two `vdpbf16ps` passes (the split query, hi and lo); P·V one `vdpbf16ps` pass over all
    // 640 rows.
    let hd = HEADS as f64 * 512.0;
    // Rows per token: the top-k main rows and the SWA window rows.
    let (rk, rw) = (topk_row.len() as f64, ap.window as f64);
    // The f32 path's (and torch's, on pre-decoded f32 rows) 2 × 640 rows of FMAs.
    floor(
        "decode attention 64×(512+128)×512, fp4+fp8",
        t_att,
        threads,
        &[(hd * 2.0 * (rk + rw), Some(peak1 / 2.0), "f32 FMA")],
    );
    for (k, &d) in narrow.iter().enumerate() {
        let (name, terms) = match d {
            AttentionDots::Int16 => (
                "decode attention, int16 dots (NVFP4 keys)",
                vec![
                    (hd * rk, int16_peak, "int16 vpdpwssd"),
                    (hd * (2.0 * rw + rk + rw), bf16_peak, "bf16 vdpbf16ps"),
                ],
            ),
            _ => (
                "decode attention, bf16 dots",
                vec![(hd * 3.0 * (rk + rw), bf16_peak, "bf16 vdpbf16ps")],
            ),
        };
        floor(name, stats[k], threads, &terms);
    }
    if !AttentionDots::Bf16.is_supported() {
        say!("decode attention, bf16 dots: skipped (no AVX-512 BF16, or CSA2_ISA caps it)");
    }
    if !AttentionDots::Int16.is_supported() {
        say!("decode attention, int16 dots: skipped (no AVX-512 VNNI + BF16, or CSA2_ISA caps it)");
    }

    // Prefill indexer: a chunk of T tokens over its own T / ratio entries, causal.
    let t = a.prefill_tokens;
    let m = a.prefill_ratio;
    let ne = t / m;
    let qp = rand_normal(&mut rng, t * 32 * 128, 1.0);
    let wp = rand_normal(&mut rng, t * 32, 1.0 / 64.0);
    let kp = rand_normal(&mut rng, ne * 128, 1.0);
    let mut kpm = vec![0u8; ne * 68];
    encode_rows(RecordFormat::Mxfp4Index, &kp, &mut kpm)?;
    let posp: Vec<i64> = (0..t as i64).collect();
    let qs = IndexerQueries {
        q: &qp,
        w: &wp,
        positions: &posp,
    };
    let pp = IndexerParams::new(m);
    let mut outp = vec![0f32; t * ne];
    let t_pre = time(a.prefill_reps, || {
        indexer::logits(&pp, &qs, IndexKeys::Mxfp4(&kpm), &mut outp).expect("valid")
    });
    let vis_sum: f64 = posp.iter().map(|&p| indexer::visible(p, m) as f64).sum();
    let macs = vis_sum * 4096.0;
    line(
        &format!("prefill indexer {t} tokens × {ne} entries (m={m})"),
        t_pre,
        2.0 * macs,
        4.0 * (t * ne) as f64,
        &format!(
            "{:.1} GMAC/s (causal: visible MACs only)",
            macs / t_pre.median / 1e9
        ),
    );
    let rows = std::mem::take(&mut *ROWS.lock().unwrap_or_else(|e| e.into_inner()));
    crate::out::write_json(
        &a.json,
        &serde_json::json!({
            "threads": threads, "fma_peak_gflops_one_thread": peak1, "keys": a.keys,
            "prefill_tokens": a.prefill_tokens, "prefill_ratio": a.prefill_ratio, "reps": a.reps,
            "figures": rows,
        }),
    )?;
    Ok(())
}
