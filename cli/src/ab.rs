//! `csa2 ab`: the CSA2 backend and the launch-day backend on identical inputs: KV bytes, decode step
//! times by layer role and by op, the agreement and accuracy of the first decode step, and prefill.
//!
//! The measuring is `csa2_harness::ab` (synthesized caches, interleaved decode steps, the f64
//! reference, prefills); this file parses the flags and prints the tables, the JSON and the plots.

use crate::out::{JsonOut, Progress};
use csa2::backend::timing::{Op, ROLES};
use csa2::backend::Backend;
use csa2::geometry::Role;
use csa2::weights::Scale;
use csa2::{Error, Result};
use csa2_harness::ab::{
    cos_and_rel, median_of, noisy, range, ratio, without_projections, AbConfig, AbReport, Decoded,
};
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Workload: `bundled` (the trace excerpt shipped in assets/) or `trace FILE`.
    #[arg(long, num_args = 1..=2, default_values_t = vec!["bundled".to_string()])]
    workload: Vec<String>,
    /// Context lengths for the decode rows (K = 1024, M = 1024²).
    /// The default covers the short end, the length where the candidate pool starts to bound
    /// Reindex scoring (128K), and 1M where the designs differ most; add 32K etc. at will.
    #[arg(long, default_value = "4K,128K,1M", allow_hyphen_values = true)]
    contexts: String,
    /// Timed decode steps per context and backend (at least 1). The two backends run their steps
    /// interleaved (A B A B ...) on the same synthesized caches, so machine drift hits both alike;
    /// the median and the min–max spread are printed.
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    decode_steps: usize,
    /// Untimed decode steps per backend before the timed ones (first touch of the weights and of
    /// the synthesized cache, scratch allocation). The first warm-up step is the traced one the
    /// accuracy rows compare with the reference.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = crate::out::count::<usize>)]
    warmup: usize,
    /// Timed prefills per variant, interleaved (A B C A B C ...) after one untimed warm-up prefill.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    prefill_reps: usize,
    /// Contexts (a subset of --contexts) where each backend's first decode step is compared with
    /// the f64 reference step (`all`, `none` or lengths). The reference reads every visible index
    /// key in f64 three times (end-to-end, and once on each backend's layer inputs), which costs
    /// seconds per 100K entries on 2 cores, on top of three f64 passes over the weights: by
    /// default only the shortest context (4K); `--accuracy-max 128K` adds the pooled regime.
    #[arg(long, default_value = "4K", allow_hyphen_values = true)]
    accuracy_max: String,
    /// Model scale: `full` (real dimensions; layers of one role share synthetic weights to fit in
    /// memory) or `tiny`.
    #[arg(long, default_value = "full")]
    scale: String,
    /// Largest prompt used for the prefill rows (the workload's prompt is clipped to it). Default:
    /// 32 at full scale (a prefill is ~1.7 TFLOP per 192 rows on 2 cores; decoder replay trims
    /// nothing below the 128-token window, so pass 256 or more to see its saving), 1024 tiny.
    #[arg(long, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    prefill_max: Option<usize>,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::out::count::<usize>)]
    threads: usize,
    /// Keep the synthetic weights as f32 instead of the checkpoint's FP8 / bf16 (same values,
    /// 2–4× the bytes the projections stream): the baseline of the projection figures.
    #[arg(long)]
    f32_weights: bool,
    /// Write every number as JSON to PATH (`-` = stdout; the tables then go to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
    /// Write the SVG plots (`kv_bytes.svg`, `decode_time.svg`) into DIR.
    #[arg(long, value_name = "DIR")]
    plots: Option<PathBuf>,
}

/// 141 GB of one H200.
const H200_BYTES: f64 = 141e9;

fn parse_len(s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('K') | Some('k') => (&t[..t.len() - 1], 1024),
        Some('M') | Some('m') => (&t[..t.len() - 1], 1024 * 1024),
        _ => (t, 1),
    };
    let not_positive = || {
        Error::invalid(
            "contexts",
            format!("a length must be positive, found `{t}`"),
        )
    };
    if num.trim_start().starts_with('-') {
        return Err(not_positive());
    }
    match num.parse::<usize>().ok().and_then(|n| n.checked_mul(mul)) {
        Some(n) if n > 0 => Ok(n),
        Some(_) => Err(not_positive()),
        None => Err(Error::invalid(
            "contexts",
            format!("`{s}` is not a length like 4K, 32768 or 1M"),
        )),
    }
}

pub fn run(a: Args) -> Result<()> {
    crate::out::in_pool(a.threads, || run_in_pool(a))
}

fn run_in_pool(a: Args) -> Result<()> {
    crate::out::json_dest(&a.json)?;
    crate::out::plots_dest(&a.plots)?;
    let scale = Scale::from_name(&a.scale)?;
    let contexts = a
        .contexts
        .split(',')
        .map(parse_len)
        .collect::<Result<Vec<_>>>()?;
    let accuracy_max = match a.accuracy_max.trim() {
        "none" => 0,
        "all" => usize::MAX,
        s => parse_len(s).map_err(|_| {
            Error::invalid(
                "accuracy-max",
                format!("expected `all`, `none` or a positive length like 128K, found `{s}`"),
            )
        })?,
    };
    let reqs = match a.workload.first().map(String::as_str) {
        Some("bundled") => csa2_harness::sim::trace::parse(
            csa2_harness::sim::trace::EXCERPT,
            std::path::Path::new("assets/mooncake_conversation_excerpt.jsonl"),
        )?,
        Some("trace") => {
            let p = a.workload.get(1).ok_or_else(|| {
                Error::invalid("workload", "`trace` needs a file: --workload trace FILE")
            })?;
            csa2_harness::sim::trace::read(std::path::Path::new(p))?
        }
        other => {
            return Err(Error::invalid(
                "workload",
                format!("expected `bundled` or `trace FILE`, found {other:?}"),
            ))
        }
    };
    let prefill_max = a.prefill_max.unwrap_or(match scale {
        Scale::Full => 32,
        Scale::Tiny => 1024,
    });
    let cfg = AbConfig {
        contexts,
        decode_steps: a.decode_steps,
        warmup: a.warmup,
        prefill_reps: a.prefill_reps,
        accuracy_max,
        scale,
        prefill_max,
        f32_weights: a.f32_weights,
    };
    let bar = Progress::new(
        "ab",
        cfg.progress_steps(),
        "{msg:<44} [{bar:30}] {pos}/{len} {elapsed}",
    );
    let AbReport {
        model,
        backends,
        rows,
        accuracy: accs,
        reference_secs,
        weights_secs,
        prefills,
        prefill_len,
        median_prompt,
        trims,
    } = csa2_harness::ab::run(&cfg, &reqs, &bar)?;
    bar.finish();

    // ---- report ----------------------------------------------------------------------------
    let g = &model.geometry;
    say!(
        "csa2 ab — CSA2 vs launch-day backend, {} scale (hidden {}, {} heads, {} layers){}",
        scale.as_str(),
        g.hidden_size,
        g.num_heads,
        g.num_layers,
        if model.shared {
            "; layers of one role share synthetic weights"
        } else {
            ""
        }
    );
    say!(
        "Long contexts are synthesized directly into each backend's cache (its own record formats), \
         not prefilled; decode steps then run the whole stack: {} warm-up + {} timed step(s) per backend, \
         the two backends interleaved step by step; times are medians [min–max].",
        a.warmup, a.decode_steps
    );
    say!();
    say!("KV bytes, measured from each backend's allocator");
    say!(
        "{:>9} | {:>18} | {:>18} | {:>6}",
        "context",
        "csa2 B/token",
        "launch-day B/token",
        "ratio"
    );
    for (ctx, p) in &rows {
        say!(
            "{:>9} | {:>18.1} | {:>18.1} | {:>6}",
            ctx,
            p[0].global_bytes_per_token,
            p[1].global_bytes_per_token,
            sig(p[0].global_bytes_per_token / p[1].global_bytes_per_token)
        );
    }
    let (s0, s1) = (
        rows[0].1[0].swa_bytes_per_request,
        rows[0].1[1].swa_bytes_per_request,
    );
    say!(
        "SWA per request: {} B vs {} B (ratio {}); persistent (global KV → SSD) per token as above",
        s0,
        s1,
        sig(s0 as f64 / s1 as f64)
    );
    say!();
    decode_tables(&rows, &backends, a.decode_steps);
    say!();
    say!("Agreement of the two backends on the same first decode step (final hidden state)");
    for (ctx, p) in &rows {
        let (c, r) = cos_and_rel(&p[0].hidden, &p[1].hidden);
        say!(
            "{:>9}: cosine {:.6}, relative L2 difference {:.4}",
            ctx,
            c,
            r
        );
    }
    say!();
    say!(
        "Accuracy of the first decode step vs the f64 reference (exact cache values, unquantized \
         index Q, exact top-k; cos = cosine, rel = max|a−r|/max|r|)"
    );
    say!(
        "  hidden: final hidden state vs the reference's own chain; per role: each layer's attention \
         output vs the reference on the backend's own layer input (worst layer); topk: mean overlap \
         of the selected entries with the reference's"
    );
    say!("  {ACCURACY_EXPECTED}");
    let mut header = format!(
        "{:>9} {:>10} | {:>11} {:>10}",
        "context", "backend", "hidden cos", "hidden rel"
    );
    for n in ["full", "reindex", "reuse", "swa"] {
        header += &format!(" | {:>11} {:>11}", format!("{n} cos"), format!("{n} rel"));
    }
    header += &format!(" | {:>9} {:>12}", "topk full", "topk reindex");
    say!("{header}");
    for ((ctx, _), acc) in rows.iter().zip(&accs) {
        let Some(acc) = acc else {
            say!("{ctx:>9} {:>10} | (not computed: above --accuracy-max)", "");
            continue;
        };
        for (b, ac) in backends.iter().zip(acc) {
            let mut line = format!(
                "{:>9} {:>10} | {:>11.6} {:>10.4}",
                ctx,
                short(b.cfg.name),
                ac.hidden.cosine,
                ac.hidden.max_rel
            );
            for r in ROLES {
                match ac.roles.iter().find(|x| x.role == r.as_str()) {
                    Some(x) => {
                        line += &format!(" | {:>11.6} {:>11.4}", x.cosine_min, x.max_rel_max)
                    }
                    None => line += &format!(" | {:>11} {:>11}", "-", "-"),
                }
            }
            for (r, w) in [(Role::Full, 9), (Role::Reindex, 12)] {
                match ac
                    .roles
                    .iter()
                    .find(|x| x.role == r.as_str())
                    .and_then(|x| x.topk_overlap)
                {
                    Some(o) => line += &format!(" {:>w$.4}", o),
                    None => line += &format!(" {:>w$}", "-"),
                }
            }
            say!("{line}");
        }
    }
    if reference_secs > 0.0 {
        say!("(f64 reference steps took {reference_secs:.1} s)");
    }
    say!();
    say!(
        "Prefill of {prefill_len} tokens (workload median {median_prompt}, clipped to {prefill_max}); \
         median of {} interleaved run(s) after one warm-up prefill",
        a.prefill_reps
    );
    let ld = prefills[2].secs;
    for p in &prefills {
        let (lo, hi) = range(&p.samples);
        say!(
            "{:>28}: {:>8.3} s [{:.3}–{:.3}]  {:>8.1} tokens/s  ({}× the launch-day speed)",
            p.name,
            p.secs,
            lo,
            hi,
            prefill_len as f64 / p.secs,
            sig(ld / p.secs)
        );
    }
    if !trims {
        say!(
            "(decoder replay keeps the last {} prompt rows, so at {prefill_len} tokens both csa2 plans run the same \
             rows: their difference, {:+.1} %, is this machine's run-to-run noise; pass --prefill-max 256 or more \
             to measure the saving)",
            model.geometry.window,
            100.0 * (prefills[0].secs / prefills[1].secs - 1.0)
        );
    }
    say!("(synthetic weights generated in {weights_secs:.1} s)");

    let v = json!({
        "scale": scale.as_str(),
        "shared_weights": model.shared,
        "decode_steps": a.decode_steps,
        "warmup_steps": a.warmup,
        "prefill_reps": a.prefill_reps,
        "reference_seconds": reference_secs,
        "weights_seconds": weights_secs,
        "weights_dtype": if a.f32_weights { "f32" } else { "checkpoint (fp8_e4m3 / bf16 / f32)" },
        "weight_bytes_per_layer": model.layers.iter().map(|l| l.matrix_bytes()).collect::<Vec<_>>(),
        "contexts": rows.iter().zip(&accs).map(|((ctx, p), acc)| json!({
            "context": ctx,
            "backends": backends.iter().zip(p).map(|(b, d)| json!({
                "name": b.cfg.name,
                "step_seconds": d.step_secs,
                "step_seconds_samples": d.step_samples,
                "step_seconds_min": range(&d.step_samples).0,
                "step_seconds_max": range(&d.step_samples).1,
                "step_seconds_without_projections": without_projections(d),
                "projection_seconds": median_of(d, |t| t.op_total(Op::Projections)),
                "global_bytes_per_token": d.global_bytes_per_token,
                "swa_bytes_per_request": d.swa_bytes_per_request,
                "timings": d.timings.to_json(),
            })).collect::<Vec<_>>(),
            "ratio_step": p[0].step_secs / p[1].step_secs,
            "ratio_step_without_projections": without_projections(&p[0]) / without_projections(&p[1]),
            "spread_exceeds_difference": noisy(p),
            "ratio_bytes": p[0].global_bytes_per_token / p[1].global_bytes_per_token,
            "agreement": {"cosine": cos_and_rel(&p[0].hidden, &p[1].hidden).0,
                          "rel_l2": cos_and_rel(&p[0].hidden, &p[1].hidden).1},
            "accuracy": acc.as_ref().map(|acc| backends.iter().zip(acc).map(|(b, ac)| json!({
                "name": b.cfg.name,
                "hidden": ac.hidden,
                "roles": ac.roles,
            })).collect::<Vec<_>>()),
            "ratio_roles": ROLES.iter().map(|&r| (r.as_str().to_string(), json!(ratio(median_of(&p[0], |t| t.role_total(r)), median_of(&p[1], |t| t.role_total(r)))))).collect::<serde_json::Map<_, _>>(),
            "ratio_ops": Op::ALL.iter().map(|&o| (o.as_str().to_string(), json!(ratio(median_of(&p[0], |t| t.op_total(o)), median_of(&p[1], |t| t.op_total(o)))))).collect::<serde_json::Map<_, _>>(),
        })).collect::<Vec<_>>(),
        "prefill": {
            "tokens": prefill_len,
            "workload_median": median_prompt,
            "decoder_replay_trims_rows": trims,
            "runs": prefills.iter().map(|p| json!({"name": p.name, "seconds": p.secs, "seconds_samples": p.samples, "tokens_per_second": prefill_len as f64 / p.secs, "ratio_to_launch_day": p.secs / ld, "timings": p.timings.to_json()})).collect::<Vec<_>>(),
        },
    });
    crate::out::write_json(&a.json, &v)?;
    if let Some(dir) = &a.plots {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        plots(dir, &rows, &backends)?;
        say!(
            "wrote {}/kv_bytes.svg and {}/decode_time.svg",
            dir.display(),
            dir.display()
        );
    }
    Ok(())
}

/// What the accuracy columns should show on this tool's synthetic data, so a reader can tell a
/// normal figure from a broken one (measured by this file's tests and by the default run).
const ACCURACY_EXPECTED: &str = "expected here: the cache holds random values uniform in ±1.7 (no \
outliers, no structure), the hardest case for a 4-bit record with one scale per 16 values; FP4 \
records (csa2) measure a worst-layer cosine ≈ 0.94 and max rel of a few tenths, the launch-day FP8 \
records ≈ 0.99, and both keep the final hidden cosine ≥ 0.999 at full scale. Real latents after \
RMSNorm + RoPE do better; a cosine far below these, or exactly 1, means a bug.";

/// A ratio or time with four significant digits, always in plain decimal notation (never
/// `0.000`, never an exponent; at most 9 decimals, so a figure below 1e-9 shows as `0.000000000`).
fn sig(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    if x == 0.0 {
        return "0".into();
    }
    let mag = x.abs().log10().floor() as i32;
    format!("{:.*}", (3 - mag).clamp(0, 9) as usize, x)
}

/// The two decode tables: by layer role (with the step time without projections) and by op.
fn decode_tables(rows: &[(usize, Vec<Decoded>)], backends: &[Backend], steps: usize) {
    let w = 14;
    say!("Decode step (one request) by layer role: seconds, median of {steps} timed step(s)");
    let mut h = format!(
        "{:>9} {:>10} | {:>w$} {:>17} | {:>w$}",
        "context", "backend", "step", "[min–max]", "no projections"
    );
    for r in ROLES {
        h += &format!(" {:>w$}", r.as_str());
    }
    say!("{h}");
    let mut warnings = vec![];
    for (ctx, p) in rows {
        for (b, d) in backends.iter().zip(p) {
            let (lo, hi) = range(&d.step_samples);
            let mut line = format!(
                "{:>9} {:>10} | {:>w$} {:>17} | {:>w$}",
                ctx,
                short(b.cfg.name),
                sig(d.step_secs),
                format!("[{}–{}]", sig(lo), sig(hi)),
                sig(without_projections(d))
            );
            for r in ROLES {
                line += &format!(" {:>w$}", sig(median_of(d, |t| t.role_total(r))));
            }
            say!("{line}");
        }
        let mut line = format!(
            "{:>9} {:>10} | {:>w$} {:>17} | {:>w$}",
            "",
            "ratio",
            sig(p[0].step_secs / p[1].step_secs),
            "",
            sig(without_projections(&p[0]) / without_projections(&p[1]))
        );
        for r in ROLES {
            line += &format!(
                " {:>w$}",
                sig(ratio(
                    median_of(&p[0], |t| t.role_total(r)),
                    median_of(&p[1], |t| t.role_total(r))
                ))
            );
        }
        say!("{line}");
        if noisy(p) {
            warnings.push(*ctx);
        }
    }
    say!("  (ratio = csa2 time / launch-day time; no projections = step time less the dense projections)");
    for ctx in warnings {
        say!(
            "  warning: at {ctx} tokens the step times spread (max − min) more than the two backends differ: \
             the step ratio is within this machine's noise; rerun with --decode-steps 7 on a quieter machine"
        );
    }
    say!();
    say!("Decode step by op: seconds, median of {steps} timed step(s)");
    let mut h = format!("{:>9} {:>10} |", "context", "backend");
    for op in Op::ALL {
        h += &format!(" {:>w$}", op.as_str());
    }
    say!("{h}");
    for (ctx, p) in rows {
        for (b, d) in backends.iter().zip(p) {
            let mut line = format!("{:>9} {:>10} |", ctx, short(b.cfg.name));
            for op in Op::ALL {
                line += &format!(" {:>w$}", sig(median_of(d, |t| t.op_total(op))));
            }
            say!("{line}");
        }
        let mut line = format!("{:>9} {:>10} |", "", "ratio");
        for op in Op::ALL {
            line += &format!(
                " {:>w$}",
                sig(ratio(
                    median_of(&p[0], |t| t.op_total(op)),
                    median_of(&p[1], |t| t.op_total(op))
                ))
            );
        }
        say!("{line}");
    }
}

fn short(n: &str) -> &str {
    if n == "launch_day" {
        "launch-day"
    } else {
        n
    }
}

/// A byte count for an axis tick: `141 GB`, `890 MB`, `2.7 kB` (decimal units, as HBM is sold).
fn bytes_label(v: f64) -> String {
    let (d, u) = match v.abs() {
        x if x >= 1e12 => (1e12, "TB"),
        x if x >= 1e9 => (1e9, "GB"),
        x if x >= 1e6 => (1e6, "MB"),
        x if x >= 1e3 => (1e3, "kB"),
        _ => (1.0, "B"),
    };
    let x = v / d;
    if (x - x.round()).abs() < 1e-6 {
        format!("{x:.0} {u}")
    } else {
        format!("{x:.1} {u}")
    }
}

/// A linear-axis tick: at most three decimals, trailing zeros dropped (`0.05`, `0.2`, `12`).
fn tick(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A context length for an axis tick: `4K`, `128K`, `1M` (K = 1024), else the plain count.
fn tokens_label(v: f64) -> String {
    let k = v / 1024.0;
    if k >= 1024.0 && (k / 1024.0 - (k / 1024.0).round()).abs() < 1e-6 {
        format!("{}M", (k / 1024.0).round())
    } else if k >= 1.0 && (k - k.round()).abs() < 1e-6 {
        format!("{}K", k.round())
    } else if v >= 1e6 {
        format!("{:.1}M", v / 1048576.0)
    } else if v >= 1e3 {
        format!("{:.0}K", k)
    } else {
        format!("{v:.0}")
    }
}

fn plots(
    dir: &std::path::Path,
    rows: &[(usize, Vec<Decoded>)],
    backends: &[Backend],
) -> Result<()> {
    use plotters::prelude::*;
    // x = log2(context) on a linear axis with a tick per power of two: plotters' own log-scale
    // ticks crowd and repeat labels between powers of ten (the plot test caught `10K` twice).
    let xs: Vec<f64> = rows.iter().map(|(c, _)| (*c as f64).log2()).collect();
    let (x0, x1) = (xs[0] - 0.5, xs[xs.len() - 1] + 0.5);
    let x_ticks = (x1 - x0).ceil() as usize + 1;
    let x_label = |v: &f64| {
        if (v - v.round()).abs() < 1e-6 {
            tokens_label(2f64.powf(v.round()))
        } else {
            String::new()
        }
    };
    // KV bytes of one session vs context (measured per-token global + measured SWA).
    {
        let path = dir.join("kv_bytes.svg");
        let err = |e: String| Error::Internal(format!("plot {}: {e}", path.display()));
        let root = SVGBackend::new(&path, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let bytes =
            |d: &Decoded, c: f64| d.global_bytes_per_token * c + d.swa_bytes_per_request as f64;
        let ymax = rows
            .iter()
            .flat_map(|(c, p)| p.iter().map(move |d| bytes(d, *c as f64)))
            .fold(H200_BYTES, f64::max)
            * 2.0;
        let ymin = rows
            .iter()
            .flat_map(|(c, p)| p.iter().map(move |d| bytes(d, *c as f64)))
            .fold(f64::INFINITY, f64::min)
            * 0.5;
        let mut ch = ChartBuilder::on(&root)
            .caption(
                "KV bytes per session vs context (measured)",
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(45)
            .y_label_area_size(85)
            .build_cartesian_2d(x0..x1, (ymin..ymax).log_scale())
            .map_err(|e| err(e.to_string()))?;
        ch.configure_mesh()
            .x_desc("context (tokens)")
            .y_desc("KV per session")
            .x_labels(x_ticks)
            .x_label_formatter(&x_label)
            .y_label_formatter(&|v| bytes_label(*v))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        backend_series(&mut ch, rows, backends, bytes).map_err(err)?;
        ch.draw_series(LineSeries::new(
            vec![(x0, H200_BYTES), (x1, H200_BYTES)],
            BLACK.stroke_width(1),
        ))
        .map_err(|e| err(e.to_string()))?
        .label("141 GB (one H200)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
        legend(&mut ch).map_err(err)?;
        root.present().map_err(|e| err(e.to_string()))?;
    }
    {
        let path = dir.join("decode_time.svg");
        let err = |e: String| Error::Internal(format!("plot {}: {e}", path.display()));
        let root = SVGBackend::new(&path, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let ymax = rows
            .iter()
            .flat_map(|(_, p)| p.iter().map(|d| d.step_secs))
            .fold(0.0, f64::max)
            * 1.15;
        let mut ch = ChartBuilder::on(&root)
            .caption(
                "Decode step time vs context (measured, one request)",
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(45)
            .y_label_area_size(75)
            .build_cartesian_2d(x0..x1, 0f64..ymax.max(1e-6))
            .map_err(|e| err(e.to_string()))?;
        ch.configure_mesh()
            .x_desc("context (tokens)")
            .y_desc("seconds per step (median)")
            .x_labels(x_ticks)
            .x_label_formatter(&x_label)
            .y_label_formatter(&|v| tick(*v))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        backend_series(&mut ch, rows, backends, |d, _| d.step_secs).map_err(err)?;
        legend(&mut ch).map_err(err)?;
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(())
}

/// The chart type of both plots: an SVG with x = log2(context), y linear or log.
type Chart<'a, 'b, Y> = plotters::chart::ChartContext<
    'a,
    plotters::backend::SVGBackend<'b>,
    plotters::coord::cartesian::Cartesian2d<plotters::coord::types::RangedCoordf64, Y>,
>;

/// One line with point markers per backend (blue, red: the order of `backends`), `y(d, context)`
/// of its measurement `d` at each context, each labelled with the backend's short name.
fn backend_series<Y: plotters::coord::ranged1d::Ranged<ValueType = f64>>(
    ch: &mut Chart<'_, '_, Y>,
    rows: &[(usize, Vec<Decoded>)],
    backends: &[Backend],
    y: impl Fn(&Decoded, f64) -> f64,
) -> std::result::Result<(), String> {
    use plotters::prelude::*;
    for (bi, (b, c)) in backends.iter().zip([BLUE, RED]).enumerate() {
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .map(|(x, p)| ((*x as f64).log2(), y(&p[bi], *x as f64)))
            .collect();
        ch.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(short(b.cfg.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        ch.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The legend box of both plots, upper left.
fn legend<'a, Y: plotters::coord::ranged1d::Ranged<ValueType = f64>>(
    ch: &mut Chart<'a, 'a, Y>,
) -> std::result::Result<(), String> {
    use plotters::prelude::*;
    ch.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ratios printed `0.000` with `{:.3}`, then mixed `6.780e-4` and `0.3722` in one column;
    /// and the kv_bytes.svg y ticks were raw floats (`100000000000.0`) that ran off the canvas.
    #[test]
    fn ratios_keep_their_digits_and_ticks_read_in_units() {
        assert_eq!(sig(0.000_678), "0.0006780");
        assert_eq!(sig(0.000_329_1), "0.0003291");
        assert_eq!(sig(123_456.7), "123457");
        assert_eq!(sig(0.8765), "0.8765");
        assert_eq!(sig(19.471), "19.47");
        assert_eq!(sig(0.0012345), "0.001234");
        assert_eq!(sig(0.0), "0");
        assert!(sig(f64::NAN).contains("NaN"));
        assert_eq!(bytes_label(1e11), "100 GB");
        assert_eq!(bytes_label(141e9), "141 GB");
        assert_eq!(bytes_label(2.7e6), "2.7 MB");
        assert_eq!(bytes_label(890.0), "890 B");
        assert_eq!(tokens_label(4096.0), "4K");
        assert_eq!(tokens_label(1048576.0), "1M");
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: Args,
    }

    /// `csa2 ab --scale tiny` end to end, with a context above the candidate pool's capacity
    /// (16,384 entries) so pooled Reindex scoring runs; the JSON holds every table number.
    #[test]
    fn tiny_run_end_to_end_json_holds_the_table() {
        use clap::Parser;
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("ab.json");
        let cli = Cli::try_parse_from([
            "ab",
            "--scale",
            "tiny",
            "--contexts",
            "1K,20K",
            "--accuracy-max",
            "all",
            "--prefill-max",
            "24",
            "--threads",
            "2",
            "--json",
            json.to_str().unwrap(),
            "--plots",
            dir.path().to_str().unwrap(),
        ])
        .unwrap();
        run(cli.a).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let ctxs = v["contexts"].as_array().unwrap();
        assert_eq!(ctxs.len(), 2);
        for c in ctxs {
            for b in c["backends"].as_array().unwrap() {
                assert!(b["step_seconds"].as_f64().unwrap() > 0.0);
                assert!(b["global_bytes_per_token"].as_f64().unwrap() > 0.0);
                assert!(b["timings"]["by_role"]["full"]["total"].is_number());
            }
            for k in ["ratio_step", "ratio_bytes"] {
                assert!(c[k].is_number(), "{k}");
            }
            assert_eq!(c["ratio_roles"].as_object().unwrap().len(), 4);
            assert_eq!(c["ratio_ops"].as_object().unwrap().len(), Op::ALL.len());
            let acc = c["accuracy"].as_array().unwrap();
            assert_eq!(acc.len(), 2);
            for a in acc {
                let cos = a["hidden"]["cosine"].as_f64().unwrap();
                assert!(cos > 0.98 && cos < 1.0, "{a}");
                assert_eq!(a["roles"].as_array().unwrap().len(), 4);
            }
        }
        // At 20K the Reindex layers score inside the pool; the overlap is reported for them.
        let rdx = &ctxs[1]["accuracy"][0]["roles"][1];
        assert_eq!(rdx["role"], "reindex");
        assert!(rdx["topk_overlap"].as_f64().unwrap() > 0.5, "{rdx}");
        assert_eq!(v["prefill"]["runs"].as_array().unwrap().len(), 3);
        assert!(dir.path().join("kv_bytes.svg").exists());
        assert!(dir.path().join("decode_time.svg").exists());
    }
}
