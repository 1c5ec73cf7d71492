//! The A/B driver behind `csa2 ab`: the CSA2 backend and the launch-day backend on identical
//! inputs — KV bytes from each allocator, decode steps (interleaved), the f64 reference and
//! prefills — with the engine's own per-role, per-op [`Timings`].
//!
//! Long contexts are not prefilled: each backend's cache is filled directly with synthetic entries
//! (encoded by that backend's own record formats) and synthetic SWA windows, then decode steps run
//! through the full stack. Prefill is measured separately on a short prompt. The CLI parses the
//! flags into an [`AbConfig`] and prints the [`AbReport`].

use crate::reference::{self, ExactCache, RefStep};
use crate::sim::trace::TraceRequest;
use csa2::backend::launch_day::LAUNCH_DAY;
use csa2::backend::stack::FfnPlaceholder;
use csa2::backend::timing::{Op, Timings, ROLES};
use csa2::backend::{Backend, BackendConfig, ContiguousCache, KvCache, Model, Phase, SeqStep};
use csa2::cache::RecordKind;
use csa2::geometry::Role;
use csa2::ops::compressor::CompressorState;
use csa2::replay::StepPlan;
use csa2::weights::Scale;
use csa2::{Error, Result};
use std::sync::Arc;
use std::time::Instant;

/// What one A/B run measures (the flags of `csa2 ab`).
#[derive(Debug, Clone, PartialEq)]
pub struct AbConfig {
    /// Context lengths of the decode rows.
    pub contexts: Vec<usize>,
    /// Timed decode steps per context and backend (≥ 1).
    pub decode_steps: usize,
    /// Untimed decode steps per backend before the timed ones.
    pub warmup: usize,
    /// Timed prefills per variant (≥ 1).
    pub prefill_reps: usize,
    /// Contexts up to this length get the f64 reference comparison (0: none).
    pub accuracy_max: usize,
    /// Model scale of the synthetic weights.
    pub scale: Scale,
    /// Largest prompt of the prefill rows (the workload's median prompt is clipped to it).
    pub prefill_max: usize,
    /// Keep the synthetic weights as f32 (the projection figures' baseline).
    pub f32_weights: bool,
}

impl AbConfig {
    /// Progress steps [`run`] reports with [`Progress::step`] (for a bar's length).
    pub fn progress_steps(&self) -> u64 {
        let steps_per_ctx = 2 * (self.warmup + self.decode_steps) as u64;
        let n_acc = self
            .contexts
            .iter()
            .filter(|&&c| c <= self.accuracy_max)
            .count();
        1 + steps_per_ctx * self.contexts.len() as u64
            + 3 * n_acc as u64
            + 1
            + 3 * self.prefill_reps as u64
    }
}

/// Where [`run`] is (the CLI draws a progress bar from it; `()` ignores it).
pub trait Progress {
    /// The stage now running.
    fn stage(&self, what: &str);
    /// One of [`AbConfig::progress_steps`] done.
    fn step(&self);
}

impl Progress for () {
    fn stage(&self, _: &str) {}
    fn step(&self) {}
}

/// Everything one A/B run measured.
pub struct AbReport {
    /// The synthetic model both backends ran.
    pub model: Arc<Model>,
    /// CSA2, launch day.
    pub backends: [Backend; 2],
    /// Per context: one [`Decoded`] per backend (traces dropped).
    pub rows: Vec<(usize, Vec<Decoded>)>,
    /// Per context: each backend's [`Accuracy`], when within `accuracy_max`.
    pub accuracy: Vec<Option<Vec<Accuracy>>>,
    /// Wall seconds of the f64 reference steps.
    pub reference_secs: f64,
    /// Wall seconds of the synthetic weights' generation.
    pub weights_secs: f64,
    /// Prefill variants: csa2 (decoder replay), csa2 without it, launch day.
    pub prefills: Vec<Prefill>,
    /// Prompt length of the prefill rows.
    pub prefill_len: usize,
    /// The workload's median prompt.
    pub median_prompt: usize,
    /// Whether decoder replay trims rows at `prefill_len` (below the window both csa2 plans match).
    pub trims: bool,
}

/// Runs the A/B comparison of [`AbConfig`] on the workload `reqs` (its median prompt sets the
/// prefill length). Errors: [`Error::InvalidArgument`] for zero steps/reps or contexts below 1K;
/// those of the backends and the reference.
pub fn run(cfg: &AbConfig, reqs: &[TraceRequest], progress: &dyn Progress) -> Result<AbReport> {
    if cfg.decode_steps == 0 || cfg.prefill_reps == 0 {
        return Err(Error::invalid(
            "decode-steps/prefill-reps",
            "must be ≥ 1 (a median needs at least one timed run)",
        ));
    }
    if cfg.prefill_max == 0 {
        return Err(Error::invalid(
            "prefill-max",
            "must be ≥ 1 token (the prefill rows need a prompt)",
        ));
    }
    if cfg.contexts.is_empty() || cfg.contexts.iter().any(|&c| c < 1024) {
        return Err(Error::invalid("contexts", "give one or more lengths ≥ 1K"));
    }
    let scale = cfg.scale;
    let prefill_max = cfg.prefill_max;
    // The workload's median prompt, clipped to what this machine prefills in seconds.
    let mut lens: Vec<usize> = reqs.iter().map(|r| r.input_length).collect();
    lens.sort_unstable();
    let median_prompt = lens.get(lens.len() / 2).copied().unwrap_or(prefill_max);
    let prefill_len = median_prompt.clamp(1, prefill_max);

    progress.stage(&format!("synthetic weights ({} scale)", scale.as_str()));
    let t0 = Instant::now();
    let model = Model::synthetic(scale, 1, scale == Scale::Full)?;
    let model = Arc::new(if cfg.f32_weights {
        let f = model.with_f32_weights();
        drop(model);
        f
    } else {
        model
    });
    let weights_secs = t0.elapsed().as_secs_f64();
    progress.step();
    let backends = [
        Backend::new(model.clone(), BackendConfig::CSA2)?,
        Backend::new(model.clone(), LAUNCH_DAY)?,
    ];

    let mut rows = vec![];
    let mut accs: Vec<Option<Vec<Accuracy>>> = vec![];
    let mut reference_secs = 0.0;
    for &ctx in &cfg.contexts {
        let traced = ctx <= cfg.accuracy_max;
        progress.stage(&format!("decode at {ctx} tokens (synthesizing caches)"));
        let mut pair = decode_pair(
            &[&backends[0], &backends[1]],
            ctx,
            cfg.warmup,
            cfg.decode_steps,
            traced,
            |name| {
                progress.stage(&format!("decode at {ctx} tokens: {name}"));
                progress.step();
            },
        )?;
        if traced {
            let t = Instant::now();
            progress.stage(&format!("f64 reference at {ctx} tokens"));
            let e2e = reference_step(&model, ctx, None)?;
            progress.step();
            let mut acc = vec![];
            for (b, d) in backends.iter().zip(&pair) {
                progress.stage(&format!("f64 reference at {ctx}: {} layers", b.cfg.name));
                acc.push(accuracy(&model, ctx, d, &e2e)?);
                progress.step();
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
    progress.stage(&format!("prefill {prefill_len} tokens: warm-up"));
    prefill_run(&variants[0].1, &toks)?;
    progress.step();
    let mut prefill_samples: Vec<Vec<(f64, Timings)>> = vec![vec![]; variants.len()];
    for _ in 0..cfg.prefill_reps {
        for (vi, (name, b)) in variants.iter().enumerate() {
            progress.stage(&format!("prefill {prefill_len} tokens: {name}"));
            prefill_samples[vi].push(prefill_run(b, &toks)?);
            progress.step();
        }
    }
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
    let trims = StepPlan::new(
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
    Ok(AbReport {
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
    })
}

/// A backend's decode figures at one context.
pub struct Decoded {
    /// Median of the timed steps' wall times.
    pub step_secs: f64,
    /// Every timed step's wall time, in run order.
    pub step_samples: Vec<f64>,
    /// Every timed step's split by role and op.
    pub step_timings: Vec<Timings>,
    /// Per-step mean of the split (the JSON's `timings`).
    pub timings: Timings,
    /// Global KV bytes per token, read from the cache's allocator after the steps.
    pub global_bytes_per_token: f64,
    /// SWA window bytes of the request.
    pub swa_bytes_per_request: usize,
    /// The first step's final hidden state.
    pub hidden: Vec<f32>,
    /// The first step's per-layer inputs / outputs and top-k (for the accuracy rows).
    pub trace: Option<csa2::backend::stack::StepOutput>,
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
        cache.set_carry(1, lp.id, Some(CompressorState::new(ctx as u64)))?;
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
pub struct Agreement {
    /// Cosine similarity.
    pub cosine: f64,
    /// max |a − r| / max |r|.
    pub max_rel: f64,
}

/// [`Agreement`] of `a` with `r`; a non-finite `a` gives cosine NaN and max_rel ∞ (never a
/// silent pass). Errors: [`Error::Shape`] when the lengths differ.
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
pub struct RoleAccuracy {
    /// The role's name.
    pub role: &'static str,
    /// Layers of the role.
    pub layers: usize,
    /// Worst cosine over its layers.
    pub cosine_min: f64,
    /// Worst max-rel over its layers.
    pub max_rel_max: f64,
    /// Mean top-k overlap with the reference (indexing roles only).
    pub topk_overlap: Option<f64>,
}

/// A backend's first decode step against the f64 reference.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Accuracy {
    /// Final hidden state vs the end-to-end reference.
    pub hidden: Agreement,
    /// Per role (report order), local errors.
    pub roles: Vec<RoleAccuracy>,
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

/// A backend's traced first decode step at `ctx` against the f64 reference: `e2e` end to end,
/// and per layer on the backend's own layer inputs. Errors: [`Error::Internal`] without a trace.
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
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// (min, max) of `v`.
pub fn range(v: &[f64]) -> (f64, f64) {
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

/// One backend alone (the unit test's path): as [`decode_pair`].
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

/// Decode steps on a cache already holding `ctx` tokens of request 1 (the unit test's
/// corrupted-cache path).
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

/// One prefill of `tokens` from an empty cache: wall seconds and the split.
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

/// Cosine and relative L2 difference ‖a − b‖ / ‖b‖ of two backends' outputs.
pub fn cos_and_rel(a: &[f32], b: &[f32]) -> (f64, f64) {
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

/// One prefill variant's timed runs.
pub struct Prefill {
    /// The variant's name.
    pub name: &'static str,
    /// Median wall seconds.
    pub secs: f64,
    /// Every timed run's wall seconds.
    pub samples: Vec<f64>,
    /// Per-run mean of the split.
    pub timings: Timings,
}

/// The median over timed steps of a per-step quantity.
pub fn median_of(d: &Decoded, f: impl Fn(&Timings) -> f64) -> f64 {
    median(&d.step_timings.iter().map(f).collect::<Vec<_>>())
}

/// The median over timed steps of the step time less its dense projections.
pub fn without_projections(d: &Decoded) -> f64 {
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
pub fn noisy(p: &[Decoded]) -> bool {
    let spread = p
        .iter()
        .map(|d| {
            let (lo, hi) = range(&d.step_samples);
            hi - lo
        })
        .fold(0.0, f64::max);
    spread > (p[0].step_secs - p[1].step_secs).abs()
}

/// a / b, NaN when b is not positive (a role or op the baseline never ran).
pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::NAN
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use csa2::Geometry;

    /// Regression: `csa2 ab --prefill-max 0` panicked in `clamp` ("min > max") after building the
    /// weights; a zero prefill length is an argument error, returned before any work.
    #[test]
    fn a_zero_prefill_length_is_an_argument_error() {
        let cfg = AbConfig {
            contexts: vec![1024],
            decode_steps: 1,
            warmup: 0,
            prefill_reps: 1,
            accuracy_max: 0,
            scale: Scale::Tiny,
            prefill_max: 0,
            f32_weights: false,
        };
        let e = run(&cfg, &[], &()).err().expect("refused");
        assert!(e.to_string().contains("prefill-max"), "{e}");
    }

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

    #[test]
    fn median_and_range() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        assert_eq!(range(&[3.0, 1.0, 2.0]), (1.0, 3.0));
    }

    /// The 32-token prefill of the default (measured: decoder replay 14.35 s vs 9.64 s off): below
    /// the 128-row window the two csa2 plans are the same rows and floors, so any time difference
    /// is noise, not an overhead of the replay path; at 256 rows the replay trims.
    #[test]
    fn decoder_replay_plans_equal_the_full_plan_below_the_window() {
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
}
