//! `csa2 ab`: the CSA2 backend and the launch-day backend on identical inputs, one table.
//!
//! Long contexts are not prefilled: each backend's cache is filled directly with synthetic entries
//! (encoded by that backend's own record formats) and synthetic SWA windows, then decode steps run
//! through the full stack. Prefill is measured separately on a short prompt.

use crate::out::{JsonOut, Progress};
use csa2::backend::launch_day::LAUNCH_DAY;
use csa2::backend::reference::{self, ExactCache, RefStep};
use csa2::backend::stack::FfnPlaceholder;
use csa2::backend::timing::{Op, Timings, ROLES};
use csa2::backend::{Backend, BackendConfig, ContiguousCache, KvCache, Model, Phase, SeqStep};
use csa2::cache::RecordKind;
use csa2::geometry::Role;
use csa2::ops::compressor::CompressorState;
use csa2::weights::Scale;
use csa2::{Error, Result};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Workload: `bundled` (the trace excerpt shipped in assets/) or `trace FILE`.
    #[arg(long, num_args = 1..=2, default_values_t = vec!["bundled".to_string()])]
    workload: Vec<String>,
    /// Context lengths for the decode rows (K = 1024, M = 1024²).
    /// The default covers the short end, the length where the candidate pool starts to bound
    /// Reindex scoring (128K), and 1M where the designs differ most; add 32K etc. at will.
    #[arg(long, default_value = "4K,128K,1M")]
    contexts: String,
    /// Timed decode steps per context and backend (at least 1). The two backends run their steps
    /// interleaved (A B A B ...) on the same synthesized caches, so machine drift hits both alike;
    /// the median and the min–max spread are printed.
    #[arg(long, default_value_t = 3)]
    decode_steps: usize,
    /// Untimed decode steps per backend before the timed ones (first touch of the weights and of
    /// the synthesized cache, scratch allocation). The first warm-up step is the traced one the
    /// accuracy rows compare with the reference.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed prefills per variant, interleaved (A B C A B C ...) after one untimed warm-up prefill.
    #[arg(long, default_value_t = 1)]
    prefill_reps: usize,
    /// Contexts (a subset of --contexts) where each backend's first decode step is compared with
    /// the f64 reference step (`all`, `none` or lengths). The reference reads every visible index
    /// key in f64 three times (end-to-end, and once on each backend's layer inputs), which costs
    /// seconds per 100K entries on 2 cores, on top of three f64 passes over the weights: by
    /// default only the shortest context (4K); `--accuracy-max 128K` adds the pooled regime.
    #[arg(long, default_value = "4K")]
    accuracy_max: String,
    /// Model scale: `full` (real dimensions; layers of one role share synthetic weights to fit in
    /// memory) or `tiny`.
    #[arg(long, default_value = "full")]
    scale: String,
    /// Largest prompt used for the prefill rows (the workload's prompt is clipped to it). Default:
    /// 32 at full scale (a prefill is ~1.7 TFLOP per 192 rows on 2 cores; decoder replay trims
    /// nothing below the 128-token window, so pass 256 or more to see its saving), 1024 tiny.
    #[arg(long)]
    prefill_max: Option<usize>,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
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
    num.parse::<usize>().map(|n| n * mul).map_err(|_| {
        Error::invalid(
            "contexts",
            format!("`{s}` is not a length like 4K, 32768 or 1M"),
        )
    })
}

struct Decoded {
    /// Median of the timed steps' wall times.
    step_secs: f64,
    /// Every timed step's wall time, in run order.
    step_samples: Vec<f64>,
    /// Every timed step's split by role and op.
    step_timings: Vec<Timings>,
    /// Per-step mean of the split (the JSON's `timings`).
    timings: Timings,
    global_bytes_per_token: f64,
    swa_bytes_per_request: usize,
    hidden: Vec<f32>,
    /// The first step's per-layer inputs / outputs and top-k (for the accuracy rows).
    trace: Option<csa2::backend::stack::StepOutput>,
}

/// Deterministic synthetic cache value for (seed, entry i, channel k): uniform in ±1.7 (unit RMS,
/// like normed latents). Hash arithmetic wraps on purpose; plain `*`/`+` overflowed for k ≥ 1 under
/// overflow checks and made `csa2 ab` panic in test/debug builds.
fn synth_value(seed: usize, i: usize, k: usize) -> f32 {
    let h = (i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((k as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(seed as u64);
    let h = (h ^ (h >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.4
}

/// The exact value row of entry `i` of Full layer `layer` (main KV: 512 values; index K: the
/// first 128 of the same row) — what [`synthesize`] encodes and the f64 reference reads.
fn exact_entry(layer: usize, _region: RecordKind, i: usize, row: &mut [f32]) {
    for (k, v) in row.iter_mut().enumerate() {
        *v = synth_value(layer, i, k);
    }
}

/// The exact SWA rows of positions `ctx − min(window, ctx) .. ctx` (the same rows for every layer).
fn exact_window(window: usize, ctx: usize) -> Vec<f32> {
    let w = window.min(ctx);
    (0..w * 512)
        .map(|i| synth_value(99, i / 512, i % 512))
        .collect()
}

/// Fills `cache` for request 1 as if `ctx` tokens had been prefilled: every Full layer's entries
/// and every layer's SWA window (synthetic values with unit RMS, like normed latents), encoded in
/// parallel by the cache's own record formats.
fn synthesize(b: &Backend, cache: &mut ContiguousCache, ctx: usize) -> Result<()> {
    let g = b.geometry();
    cache.open(1)?;
    for lp in g.layers_with(Role::Full) {
        let n = ctx / lp.ratio;
        for region in [RecordKind::Main, RecordKind::Index] {
            cache
                .synthesize_entries(1, lp.id, region, n, |i, r| exact_entry(lp.id, region, i, r))?;
        }
        *cache.carry(1, lp.id)? = Some(CompressorState::new(ctx as u64));
    }
    let w = g.window.min(ctx);
    let rows = exact_window(g.window, ctx);
    for l in 0..g.num_layers {
        cache.swa_write(1, l, ctx - w, &rows)?;
    }
    Ok(())
}

/// The f64 reference of the first decode step at `ctx` (token 7, as in [`decode_on`]) over the
/// exact synthetic cache; with `forced`, on a backend's traced layer inputs.
fn reference_step(model: &Model, ctx: usize, forced: Option<&[Vec<f32>]>) -> Result<RefStep> {
    let rows = exact_window(model.geometry.window, ctx);
    let window = |_l: usize| rows.clone();
    let exact = ExactCache {
        entry: &exact_entry,
        window: &window,
    };
    reference::decode_step(model, FfnPlaceholder::Identity, 7, ctx, &exact, forced)
}

/// Agreement of a result with the reference: cosine, and max |a − r| / max |r| (the ∞-norm
/// relative error; an elementwise ratio would be dominated by entries near zero).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
struct Agreement {
    cosine: f64,
    max_rel: f64,
}

fn agreement(a: &[f32], r: &[f64]) -> Result<Agreement> {
    if a.len() != r.len() {
        return Err(Error::shape("accuracy comparison", r.len(), a.len()));
    }
    if a.iter().any(|v| !v.is_finite()) {
        return Ok(Agreement {
            cosine: f64::NAN,
            max_rel: f64::INFINITY,
        });
    }
    let s = csa2::tolerance::compare(a, r, &csa2::tolerance::QUANT_VS_EXACT);
    let rmax = r.iter().fold(0f64, |m, v| m.max(v.abs()));
    Ok(Agreement {
        cosine: 1.0 - s.cos_diff,
        max_rel: s.max_abs / rmax.max(f64::MIN_POSITIVE),
    })
}

/// One role's attention outputs against the reference run on the backend's own layer inputs
/// (each layer's error on identical inputs): worst cosine and worst max-rel over the role's
/// layers, and the mean top-k overlap of its indexing layers (Full, Reindex).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
struct RoleAccuracy {
    role: &'static str,
    layers: usize,
    cosine_min: f64,
    max_rel_max: f64,
    topk_overlap: Option<f64>,
}

/// A backend's first decode step against the f64 reference.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
struct Accuracy {
    /// Final hidden state vs the end-to-end reference.
    hidden: Agreement,
    /// Per role (report order), local errors.
    roles: Vec<RoleAccuracy>,
}

/// |selected ∩ reference| / |reference| over the valid (≥ 0) ids of one top-k row.
fn overlap(sel: &[i32], reference: &[i32]) -> f64 {
    let want: std::collections::HashSet<i32> =
        reference.iter().copied().filter(|&j| j >= 0).collect();
    if want.is_empty() {
        return 1.0;
    }
    let hit = sel
        .iter()
        .filter(|&&j| j >= 0)
        .collect::<std::collections::HashSet<_>>()
        .into_iter()
        .filter(|j| want.contains(j))
        .count();
    hit as f64 / want.len() as f64
}

fn accuracy(model: &Model, ctx: usize, d: &Decoded, e2e: &RefStep) -> Result<Accuracy> {
    let g = &model.geometry;
    let tr = d
        .trace
        .as_ref()
        .ok_or_else(|| Error::Internal("accuracy needs a traced first step".into()))?;
    let local = reference_step(model, ctx, Some(&tr.layer_inputs))?;
    let mut roles = vec![];
    for role in ROLES {
        let mut acc = RoleAccuracy {
            role: role.as_str(),
            layers: 0,
            cosine_min: f64::INFINITY,
            max_rel_max: 0.0,
            topk_overlap: None,
        };
        let mut ov = vec![];
        for lp in g.layers.iter().filter(|lp| lp.role == role) {
            let a = agreement(&tr.layer_outputs[lp.id], &local.attn_out[lp.id])?;
            acc.layers += 1;
            acc.cosine_min = acc.cosine_min.min(a.cosine);
            acc.max_rel_max = acc.max_rel_max.max(a.max_rel);
            if let (Some((_, sel)), Some(Some(r))) =
                (tr.topk.iter().find(|t| t.0 == lp.id), local.topk.get(lp.id))
            {
                ov.push(overlap(sel, r));
            }
        }
        if !ov.is_empty() {
            acc.topk_overlap = Some(ov.iter().sum::<f64>() / ov.len() as f64);
        }
        if acc.layers > 0 {
            roles.push(acc);
        }
    }
    Ok(Accuracy {
        hidden: agreement(&d.hidden, &e2e.hidden)?,
        roles,
    })
}

/// The median of `v` (mean of the two middle values for an even count; NaN when empty).
fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// (min, max) of `v`.
fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        })
}

/// One backend's decode steps at one context, on its own cache holding `ctx` tokens of request 1.
struct DecodeRun<'a> {
    b: &'a Backend,
    cache: ContiguousCache,
    ctx: usize,
    done: usize,
    first: Option<csa2::backend::stack::StepOutput>,
    samples: Vec<(f64, Timings)>,
}

impl<'a> DecodeRun<'a> {
    fn new(b: &'a Backend, ctx: usize) -> Result<DecodeRun<'a>> {
        let mut cache = ContiguousCache::new(b.geometry(), b.cfg.formats);
        synthesize(b, &mut cache, ctx)?;
        Ok(DecodeRun {
            b,
            cache,
            ctx,
            done: 0,
            first: None,
            samples: vec![],
        })
    }

    /// Step `done` (token 7 + done at position ctx + done); the first step of every run has the
    /// same inputs for both backends and the reference, and is traced when `trace`.
    fn step(&mut self, timed: bool, trace: bool) -> Result<()> {
        let i = self.done;
        let s = SeqStep {
            req: 1,
            first_pos: self.ctx + i,
            len: 1,
            phase: Phase::Decode,
            replay_start: 0,
            cached_until: self.ctx + i,
        };
        let mut tm = Timings::default();
        let t0 = Instant::now();
        let out = self.b.step(
            &[s],
            &[(7 + i) as u32],
            &mut self.cache,
            &mut tm,
            trace && i == 0,
        )?;
        let dt = t0.elapsed().as_secs_f64();
        if i == 0 {
            self.first = Some(out);
        }
        if timed {
            self.samples.push((dt, tm));
        }
        self.done += 1;
        Ok(())
    }

    fn finish(self, trace: bool) -> Decoded {
        let u = self.cache.usage();
        let step_samples: Vec<f64> = self.samples.iter().map(|(s, _)| *s).collect();
        let step_timings: Vec<Timings> = self.samples.iter().map(|(_, t)| t.clone()).collect();
        let mut total = Timings::default();
        step_timings.iter().for_each(|t| total.merge(t));
        let n = step_timings.len().max(1) as f64;
        let first = self.first;
        Decoded {
            step_secs: median(&step_samples),
            step_samples,
            step_timings,
            timings: total.scaled(1.0 / n),
            global_bytes_per_token: u.global_bytes() as f64 / (self.ctx + self.done) as f64,
            swa_bytes_per_request: u.swa_bytes,
            hidden: first.as_ref().map(|o| o.hidden.clone()).unwrap_or_default(),
            trace: first.filter(|_| trace),
        }
    }
}

/// Decode steps of both backends at `ctx` on caches synthesized once: `warmup` untimed steps, then
/// `steps` timed ones, the backends interleaved step by step (A B A B ...) so a slow spell of the
/// machine lands on both. Returns one [`Decoded`] per backend.
fn decode_pair(
    backends: &[&Backend],
    ctx: usize,
    warmup: usize,
    steps: usize,
    trace: bool,
    mut on_step: impl FnMut(&str),
) -> Result<Vec<Decoded>> {
    let mut runs = backends
        .iter()
        .map(|b| DecodeRun::new(b, ctx))
        .collect::<Result<Vec<_>>>()?;
    for i in 0..warmup + steps.max(1) {
        for r in runs.iter_mut() {
            on_step(r.b.cfg.name);
            r.step(i >= warmup, trace)?;
        }
    }
    Ok(runs.into_iter().map(|r| r.finish(trace)).collect())
}

/// One backend alone (the unit test's corrupted-cache path): as [`decode_pair`] on a given cache.
#[cfg(test)]
fn decode_run(
    b: &Backend,
    ctx: usize,
    warmup: usize,
    steps: usize,
    trace: bool,
) -> Result<Decoded> {
    Ok(decode_pair(&[b], ctx, warmup, steps, trace, |_| {})?.remove(0))
}

/// Decode steps on a cache already holding `ctx` tokens of request 1.
#[cfg(test)]
fn decode_on(
    b: &Backend,
    cache: ContiguousCache,
    ctx: usize,
    warmup: usize,
    steps: usize,
    trace: bool,
) -> Result<Decoded> {
    let mut r = DecodeRun {
        b,
        cache,
        ctx,
        done: 0,
        first: None,
        samples: vec![],
    };
    for i in 0..warmup + steps.max(1) {
        r.step(i >= warmup, trace)?;
    }
    Ok(r.finish(trace))
}

fn prefill_run(b: &Backend, tokens: &[u32]) -> Result<(f64, Timings)> {
    let mut cache = ContiguousCache::new(b.geometry(), b.cfg.formats);
    let n = tokens.len();
    let s = SeqStep {
        req: 1,
        first_pos: 0,
        len: n,
        phase: Phase::Prefill {
            prompt_end: n,
            prefill_start: 0,
        },
        replay_start: 0,
        cached_until: 0,
    };
    let mut tm = Timings::default();
    let t0 = Instant::now();
    b.step(&[s], tokens, &mut cache, &mut tm, false)?;
    Ok((t0.elapsed().as_secs_f64(), tm))
}

fn cos_and_rel(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (mut dot, mut na, mut nb, mut nd) = (0f64, 0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        dot += x * y;
        na += x * x;
        nb += y * y;
        nd += (x - y) * (x - y);
    }
    (
        dot / (na.sqrt() * nb.sqrt()).max(1e-300),
        (nd / nb.max(1e-300)).sqrt(),
    )
}

pub fn run(a: Args) -> Result<()> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(a.threads)
        .build()
        .map_err(|e| Error::invalid("threads", e.to_string()))?;
    pool.install(|| run_in_pool(a))
}

fn run_in_pool(a: Args) -> Result<()> {
    crate::out::json_dest(&a.json);
    if a.decode_steps == 0 || a.prefill_reps == 0 {
        return Err(Error::invalid(
            "decode-steps/prefill-reps",
            "must be ≥ 1 (a median needs at least one timed run)",
        ));
    }
    let scale = Scale::from_name(&a.scale)?;
    let contexts = a
        .contexts
        .split(',')
        .map(parse_len)
        .collect::<Result<Vec<_>>>()?;
    if contexts.is_empty() || contexts.iter().any(|&c| c < 1024) {
        return Err(Error::invalid("contexts", "give one or more lengths ≥ 1K"));
    }
    let accuracy_max = match a.accuracy_max.trim() {
        "none" => 0,
        "all" => usize::MAX,
        s => parse_len(s).map_err(|_| {
            Error::invalid(
                "accuracy-max",
                format!("expected `all`, `none` or a length like 128K, found `{s}`"),
            )
        })?,
    };
    let n_acc = contexts.iter().filter(|&&c| c <= accuracy_max).count();
    let reqs = match a.workload.first().map(String::as_str) {
        Some("bundled") => csa2::sim::trace::parse(
            csa2::sim::trace::EXCERPT,
            std::path::Path::new("assets/mooncake_conversation_excerpt.jsonl"),
        )?,
        Some("trace") => {
            let p = a.workload.get(1).ok_or_else(|| {
                Error::invalid("workload", "`trace` needs a file: --workload trace FILE")
            })?;
            csa2::sim::trace::read(std::path::Path::new(p))?
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
    // The workload's median prompt, clipped to what this machine prefills in seconds.
    let mut lens: Vec<usize> = reqs.iter().map(|r| r.input_length).collect();
    lens.sort_unstable();
    let median_prompt = lens.get(lens.len() / 2).copied().unwrap_or(prefill_max);
    let prefill_len = median_prompt.clamp(1, prefill_max);

    let steps_per_ctx = 2 * (a.warmup + a.decode_steps) as u64;
    let bar = Progress::new(
        "ab",
        1 + steps_per_ctx * contexts.len() as u64
            + 3 * n_acc as u64
            + 1
            + 3 * a.prefill_reps as u64,
        "{msg:<44} [{bar:30}] {pos}/{len} {elapsed}",
    );
    bar.set_message(format!("synthetic weights ({} scale)", scale.as_str()));
    let t0 = Instant::now();
    let model = Model::synthetic(scale, 1, scale == Scale::Full)?;
    let model = Arc::new(if a.f32_weights {
        let f = model.with_f32_weights();
        drop(model);
        f
    } else {
        model
    });
    let weights_secs = t0.elapsed().as_secs_f64();
    bar.inc(1);
    let backends = [
        Backend::new(model.clone(), BackendConfig::CSA2)?,
        Backend::new(model.clone(), LAUNCH_DAY)?,
    ];

    let mut rows = vec![];
    let mut accs: Vec<Option<Vec<Accuracy>>> = vec![];
    let mut reference_secs = 0.0;
    for &ctx in &contexts {
        let traced = ctx <= accuracy_max;
        bar.set_message(format!("decode at {ctx} tokens (synthesizing caches)"));
        let mut pair = decode_pair(
            &[&backends[0], &backends[1]],
            ctx,
            a.warmup,
            a.decode_steps,
            traced,
            |name| {
                bar.set_message(format!("decode at {ctx} tokens: {name}"));
                bar.inc(1);
            },
        )?;
        if traced {
            let t = Instant::now();
            bar.set_message(format!("f64 reference at {ctx} tokens"));
            let e2e = reference_step(&model, ctx, None)?;
            bar.inc(1);
            let mut acc = vec![];
            for (b, d) in backends.iter().zip(&pair) {
                bar.set_message(format!("f64 reference at {ctx}: {} layers", b.cfg.name));
                acc.push(accuracy(&model, ctx, d, &e2e)?);
                bar.inc(1);
            }
            reference_secs += t.elapsed().as_secs_f64();
            accs.push(Some(acc));
        } else {
            accs.push(None);
        }
        // The traces are only needed for the accuracy rows.
        pair.iter_mut().for_each(|d| d.trace = None);
        rows.push((ctx, pair));
    }
    let toks: Vec<u32> = (0..prefill_len as u32)
        .map(|i| (i * 7919 + 13) % 50_000)
        .collect();
    let variants = [
        ("csa2 (decoder replay)", backends[0].clone()),
        (
            "csa2 (--no-decoder-replay)",
            Backend::new(
                model.clone(),
                BackendConfig::CSA2.with_decoder_replay(false),
            )?,
        ),
        ("launch_day", backends[1].clone()),
    ];
    // One untimed prefill first: the first prefill of a process pays for scratch growth to the
    // prompt's row count and first-touch page faults, which used to land on whichever variant ran
    // first (32 tokens: decoder replay 14.35 s vs 9.64 s off, although their plans are identical).
    bar.set_message(format!("prefill {prefill_len} tokens: warm-up"));
    prefill_run(&variants[0].1, &toks)?;
    bar.inc(1);
    let mut prefill_samples: Vec<Vec<(f64, Timings)>> = vec![vec![]; variants.len()];
    for _ in 0..a.prefill_reps {
        for (vi, (name, b)) in variants.iter().enumerate() {
            bar.set_message(format!("prefill {prefill_len} tokens: {name}"));
            prefill_samples[vi].push(prefill_run(b, &toks)?);
            bar.inc(1);
        }
    }
    bar.finish();
    let prefills: Vec<Prefill> = variants
        .iter()
        .zip(&prefill_samples)
        .map(|((name, _), v)| {
            let secs: Vec<f64> = v.iter().map(|x| x.0).collect();
            let mut tm = Timings::default();
            v.iter().for_each(|x| tm.merge(&x.1));
            Prefill {
                name,
                secs: median(&secs),
                samples: secs,
                timings: tm.scaled(1.0 / v.len().max(1) as f64),
            }
        })
        .collect();
    // Decoder replay keeps the last `window` prompt rows; below that both csa2 plans are the same.
    let trims = csa2::replay::StepPlan::new(
        &model.geometry,
        &[SeqStep {
            req: 1,
            first_pos: 0,
            len: prefill_len,
            phase: Phase::Prefill {
                prompt_end: prefill_len,
                prefill_start: 0,
            },
            replay_start: 0,
            cached_until: 0,
        }],
        true,
    )?
    .trimmed;

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
        "{:>9} {:>10} | {:>9} {:>8}",
        "context", "backend", "hid cos", "hid rel"
    );
    for n in ["full", "rdx", "reuse", "swa"] {
        header += &format!(" | {:>9} {:>8}", format!("{n} cos"), format!("{n} rel"));
    }
    header += &format!(" | {:>9} {:>9}", "topk full", "topk rdx");
    say!("{header}");
    for ((ctx, _), acc) in rows.iter().zip(&accs) {
        let Some(acc) = acc else {
            say!("{ctx:>9} {:>10} | (not computed: above --accuracy-max)", "");
            continue;
        };
        for (b, ac) in backends.iter().zip(acc) {
            let mut line = format!(
                "{:>9} {:>10} | {:>9.6} {:>8.4}",
                ctx,
                short(b.cfg.name),
                ac.hidden.cosine,
                ac.hidden.max_rel
            );
            for r in ROLES {
                match ac.roles.iter().find(|x| x.role == r.as_str()) {
                    Some(x) => line += &format!(" | {:>9.6} {:>8.4}", x.cosine_min, x.max_rel_max),
                    None => line += &format!(" | {:>9} {:>8}", "-", "-"),
                }
            }
            for r in [Role::Full, Role::Reindex] {
                match ac
                    .roles
                    .iter()
                    .find(|x| x.role == r.as_str())
                    .and_then(|x| x.topk_overlap)
                {
                    Some(o) => line += &format!(" {:>9.4}", o),
                    None => line += &format!(" {:>9}", "-"),
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
            "{:>28}: {:>8.3} s [{:.3}–{:.3}]  {:>8.1} tokens/s  (× {} of launch day)",
            p.name,
            p.secs,
            lo,
            hi,
            prefill_len as f64 / p.secs,
            sig(p.secs / ld)
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

/// One prefill variant's timed runs.
struct Prefill {
    name: &'static str,
    secs: f64,
    samples: Vec<f64>,
    timings: Timings,
}

/// The median over timed steps of a per-step quantity.
fn median_of(d: &Decoded, f: impl Fn(&Timings) -> f64) -> f64 {
    median(&d.step_timings.iter().map(f).collect::<Vec<_>>())
}

/// The median over timed steps of the step time less its dense projections.
fn without_projections(d: &Decoded) -> f64 {
    median(
        &d.step_samples
            .iter()
            .zip(&d.step_timings)
            .map(|(s, t)| s - t.op_total(Op::Projections))
            .collect::<Vec<_>>(),
    )
}

/// Whether either backend's step times spread (max − min) more than the two medians differ: the
/// ratio printed is then within this machine's noise.
fn noisy(p: &[Decoded]) -> bool {
    let spread = p
        .iter()
        .map(|d| {
            let (lo, hi) = range(&d.step_samples);
            hi - lo
        })
        .fold(0.0, f64::max);
    spread > (p[0].step_secs - p[1].step_secs).abs()
}

/// A ratio or time with four significant digits, in plain or scientific notation (never `0.000`).
fn sig(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    if x == 0.0 {
        return "0".into();
    }
    let mag = x.abs().log10().floor() as i32;
    if (-3..5).contains(&mag) {
        format!("{:.*}", (3 - mag).max(0) as usize, x)
    } else {
        format!("{x:.3e}")
    }
}

/// The two decode tables: by layer role (with the step time without projections) and by op.
fn decode_tables(rows: &[(usize, Vec<Decoded>)], backends: &[Backend], steps: usize) {
    let w = 12;
    say!("Decode step (one request) by layer role: seconds, median of {steps} timed step(s)");
    let mut h = format!(
        "{:>9} {:>10} | {:>w$} {:>17} | {:>w$}",
        "context", "backend", "step", "[min–max]", "w/o project."
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
    say!("  (ratio = csa2 / launch-day; w/o project. = step time less the dense projections)");
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

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::NAN
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
    let colors = [BLUE, RED];
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
        for (bi, b) in backends.iter().enumerate() {
            let c = colors[bi];
            let pts: Vec<(f64, f64)> = rows
                .iter()
                .map(|(x, p)| ((*x as f64).log2(), bytes(&p[bi], *x as f64)))
                .collect();
            ch.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(short(b.cfg.name))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
            ch.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))
                .map_err(|e| err(e.to_string()))?;
        }
        ch.draw_series(LineSeries::new(
            vec![(x0, H200_BYTES), (x1, H200_BYTES)],
            BLACK.stroke_width(1),
        ))
        .map_err(|e| err(e.to_string()))?
        .label("141 GB (one H200)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
        ch.configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(e.to_string()))?;
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
        for (bi, b) in backends.iter().enumerate() {
            let c = colors[bi];
            let pts: Vec<(f64, f64)> = rows
                .iter()
                .map(|(x, p)| ((*x as f64).log2(), p[bi].step_secs))
                .collect();
            ch.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(short(b.cfg.name))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
            ch.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))
                .map_err(|e| err(e.to_string()))?;
        }
        ch.configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use csa2::Geometry;

    /// Regression: the hash overflowed (and panicked under overflow checks) for any k ≥ 1.
    #[test]
    fn synthetic_values_never_overflow_and_stay_bounded() {
        let mut sum_sq = 0.0f64;
        let mut n = 0usize;
        for seed in [0usize, 2, 20, 99] {
            for i in [0usize, 1, 7, 1 << 20, usize::MAX] {
                for k in 0..512usize {
                    let v = synth_value(seed, i, k);
                    assert!(v.is_finite() && v.abs() <= 1.7, "{v}");
                    sum_sq += f64::from(v) * f64::from(v);
                    n += 1;
                }
            }
        }
        let rms = (sum_sq / n as f64).sqrt();
        assert!((0.8..1.2).contains(&rms), "rms {rms}");
    }

    /// Regression (issue 18): ratios printed `0.000` with `{:.3}`, and the kv_bytes.svg y ticks
    /// were raw floats (`100000000000.0`) that ran off the canvas.
    #[test]
    fn ratios_keep_their_digits_and_ticks_read_in_units() {
        assert_eq!(sig(0.000_678), "6.780e-4");
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
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(range(&[3.0, 1.0, 2.0]), (1.0, 3.0));
    }

    /// The 32-token prefill of the default (issue 18: decoder replay 14.35 s vs 9.64 s off): below
    /// the 128-row window the two csa2 plans are the same rows and floors, so any time difference
    /// is noise, not an overhead of the replay path; at 256 rows the replay trims.
    #[test]
    fn decoder_replay_plans_equal_the_full_plan_below_the_window() {
        use csa2::replay::StepPlan;
        let g = Geometry::embedded();
        let plan = |n: usize, on: bool| {
            StepPlan::new(
                &g,
                &[SeqStep {
                    req: 1,
                    first_pos: 0,
                    len: n,
                    phase: Phase::Prefill {
                        prompt_end: n,
                        prefill_start: 0,
                    },
                    replay_start: 0,
                    cached_until: 0,
                }],
                on,
            )
            .unwrap()
        };
        for n in [1, 32, 128] {
            assert_eq!(plan(n, true), plan(n, false), "{n} rows");
            assert!(!plan(n, true).trimmed);
        }
        assert!(plan(256, true).trimmed);
        assert_ne!(plan(256, true), plan(256, false));
    }

    #[test]
    fn agreement_and_overlap_math() {
        let a = agreement(&[1.0, 0.5, 0.0], &[1.0, 0.0, 0.0]).unwrap();
        assert!((a.cosine - 1.0 / 1.25f64.sqrt()).abs() < 1e-12, "{a:?}");
        assert!((a.max_rel - 0.5).abs() < 1e-12, "{a:?}");
        let same = agreement(&[2.0, -4.0], &[2.0, -4.0]).unwrap();
        assert!(
            (same.cosine - 1.0).abs() < 1e-12 && same.max_rel == 0.0,
            "{same:?}"
        );
        // The error is relative to the largest reference magnitude, not per element.
        let b = agreement(&[10.0, 1e-3], &[10.0, 0.0]).unwrap();
        assert!((b.max_rel - 1e-4).abs() < 1e-9, "{b:?}");
        let nan = agreement(&[f32::NAN, 1.0], &[1.0, 1.0]).unwrap();
        assert!(nan.cosine.is_nan() && nan.max_rel.is_infinite());
        assert!(agreement(&[1.0], &[1.0, 2.0]).is_err());
        assert!((overlap(&[1, 2, 3, -1], &[2, 3, 4, -1]) - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(overlap(&[-1, -1], &[-1, -1]), 1.0);
        assert_eq!(overlap(&[5, 5, 6], &[5, 7]), 0.5);
    }

    fn tiny() -> Arc<Model> {
        Arc::new(Model::synthetic(Scale::Tiny, 1, false).unwrap())
    }

    /// Both backends agree with the f64 reference up to quantization error (a wrong reference —
    /// RoPE, scale, window or selection — would not), and corrupting one main-KV record that
    /// layers 2–7 attend moves the figures (measured: hidden cosine 0.99995 → 0.14).
    #[test]
    fn accuracy_column_measures_and_can_fail() {
        let model = tiny();
        let ctx = 1024;
        let e2e = reference_step(&model, ctx, None).unwrap();
        assert_eq!(e2e.hidden.len(), model.geometry.hidden_size);
        let mut clean = vec![];
        for cfg in [BackendConfig::CSA2, LAUNCH_DAY] {
            let b = Backend::new(model.clone(), cfg).unwrap();
            let d = decode_run(&b, ctx, 0, 1, true).unwrap();
            let acc = accuracy(&model, ctx, &d, &e2e).unwrap();
            // Full scale measures 0.9995 (csa2) / 0.9999 (launch day); tiny has 256-wide states.
            assert!(acc.hidden.cosine > 0.98, "{}: {acc:?}", cfg.name);
            // Quantized caches cannot be exact: a figure of exactly 1 would mean nothing was read.
            assert!(acc.hidden.cosine < 1.0 - 1e-9, "{}: {acc:?}", cfg.name);
            assert_eq!(acc.roles.len(), 4);
            for r in &acc.roles {
                // Per layer, FP4 records cost csa2 ≈ 0.94 cosine at full scale (launch day 0.99).
                assert!(r.cosine_min > 0.85, "{}: {r:?}", cfg.name);
                if r.role == "full" || r.role == "reindex" {
                    assert!(r.topk_overlap.is_some(), "{r:?}");
                }
            }
            clean.push((b, acc));
        }
        // Corrupt entry 0 of layer 2 (512 entries at ratio 2 = index_topk: all are selected).
        let (b, acc) = &clean[0];
        let mut cache = ContiguousCache::new(b.geometry(), b.cfg.formats);
        synthesize(b, &mut cache, ctx).unwrap();
        cache
            .write_entries(1, 2, RecordKind::Main, 0, &[40.0f32; 512])
            .unwrap();
        let d = decode_on(b, cache, ctx, 0, 1, true).unwrap();
        let bad = accuracy(&model, ctx, &d, &e2e).unwrap();
        // Entry 0 is read by layer 2 and its five Reuse layers; whichever role's attention output
        // it dominates, the worst per-role cosine and the final hidden state must both move.
        let worst = |a: &Accuracy| a.roles.iter().map(|r| r.cosine_min).fold(1.0, f64::min);
        assert!(worst(&bad) < worst(acc) - 0.05, "{bad:?} vs {acc:?}");
        assert!(
            bad.hidden.cosine < acc.hidden.cosine - 0.05,
            "{bad:?} vs {acc:?}"
        );
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
