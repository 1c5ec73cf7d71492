//! `csa2 replay-error`: what SWA bounded replay costs in accuracy (docs/SPEC.md §3, docs/REPLAY_ERROR.md).
//!
//! Runs one multi-turn session with the exact replay (the reference) and with each compared
//! variant (default: bounded = encoder + decoder bounded replay, and encoder_only = decoder replay
//! off, which attributes the error), same weights and token ids, and prints per turn the worst
//! errors and for the worst turn the per-layer table; `--json` gets every number.

use crate::out::{JsonOut, Progress};
use csa2::backend::{Backend, BackendConfig, Model};
use csa2::weights::Scale;
use csa2::Result;
use csa2_harness::replay_error::{
    analyze, Report, SessionSpec, SnapshotPolicy, TurnStats, Variant,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Model scale for synthetic weights (`tiny` or `full`; with --weights, the checkpoint's).
    #[arg(long, default_value = "tiny")]
    scale: String,
    /// A checkpoint directory (released naming; default: synthetic weights generated in memory).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Turns of the session (turn 0 is a cold prefill; later turns hit the cached prefix).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    turns: usize,
    /// Seed of the synthetic weights and token ids.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = crate::out::count::<u64>)]
    seed: u64,
    /// Decode steps after every turn's prefill (how far the difference persists).
    #[arg(long, default_value_t = 24, allow_negative_numbers = true, value_parser = crate::out::count::<usize>)]
    continuation: usize,
    /// Prompt tokens of turn 0.
    #[arg(long, default_value_t = 232, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    first: usize,
    /// New prompt tokens of every later turn.
    #[arg(long, default_value_t = 160, allow_negative_numbers = true, value_parser = crate::out::count::<usize>)]
    new: usize,
    /// Prefill chunk, tokens.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    chunk: usize,
    /// Whether turns ≥ 1 find the encoder SWA snapshot: miss, hit or alternate (odd turns miss).
    #[arg(long, default_value = "alternate")]
    snapshot: String,
    /// Compared variants, comma separated (bounded, encoder_only, exact, cold).
    #[arg(long, default_value = "bounded,encoder_only")]
    variants: String,
    /// The reference variant (exact or cold).
    #[arg(long, default_value = "exact")]
    reference: String,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::out::count::<usize>)]
    threads: usize,
    /// Write every number as JSON to PATH (`-` = stdout; the tables then go to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
}

pub fn run(a: Args) -> Result<()> {
    crate::out::in_pool(a.threads, || run_in_pool(a))
}

fn run_in_pool(a: Args) -> Result<()> {
    crate::out::json_dest(&a.json)?;
    let scale = Scale::from_name(&a.scale)?;
    let reference = Variant::from_name(&a.reference)?;
    let compare = a
        .variants
        .split(',')
        .map(|s| Variant::from_name(s.trim()))
        .collect::<Result<Vec<_>>>()?;
    let spec = SessionSpec {
        turns: a.turns,
        first_prompt: a.first,
        new_tokens: a.new,
        continuation: a.continuation,
        chunk: a.chunk,
        snapshot: SnapshotPolicy::from_name(&a.snapshot)?,
        seed: a.seed,
    };
    let model = match &a.weights {
        Some(dir) => Model::from_checkpoint(dir, scale.geometry())?,
        None => Model::synthetic(scale, a.seed, scale == Scale::Full)?,
    };
    let backend = Backend::new(Arc::new(model), BackendConfig::CSA2)?;
    let g = backend.geometry();
    say!(
        "csa2 replay-error — {} turns through the CSA2 stack ({} scale: hidden {}, {} layers; {} weights), reference: {} replay",
        a.turns,
        a.scale,
        g.hidden_size,
        g.num_layers,
        if a.weights.is_some() { "checkpoint" } else { "synthetic" },
        reference.name()
    );
    say!(
        "Turn 0: {} prompt tokens (cold); turn t ≥ 1: prefix hit = the context so far, + {} new tokens; {} decode steps per turn; snapshot {}; compared: {}.",
        a.first,
        a.new,
        a.continuation,
        a.snapshot,
        compare.iter().map(|v| v.name()).collect::<Vec<_>>().join(", ")
    );
    say!("Row error = ‖run − reference‖₂ / ‖reference‖₂ per row; cos = row cosine. Placeholders: synthetic token ids and embedding, identity MoE FFN.");
    let steps = a.turns as u64 * (2 + compare.len() as u64);
    let bar = Progress::new(
        "replay-error runs",
        steps,
        "{pos}/{len} [{bar:30}] {elapsed} {msg}",
    );
    let t0 = Instant::now();
    let report = analyze(&backend, &spec, reference, &compare, &mut |m| {
        bar.inc(1);
        bar.set_message(m.to_string());
    })?;
    bar.finish();
    print_report(&report);
    say!("({:.1} s)", t0.elapsed().as_secs_f64());
    crate::out::write_json(&a.json, &report)?;
    Ok(())
}

fn settles(t: &TurnStats) -> String {
    match t.settles_at {
        Some(s) => format!("step {s}"),
        None if t.persistence.is_empty() => "-".into(),
        None => format!("> {}", t.persistence.len()),
    }
}

fn print_report(r: &Report) {
    say!();
    say!(
        "{:<13} {:>4} {:>6} {:>5} {:>5} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9}",
        "variant",
        "turn",
        "prompt",
        "hit",
        "snap",
        "replay",
        "layers/x",
        "replayed",
        "prompt",
        "out max",
        "out mean",
        "out cos",
        "decode[0]",
        "settles"
    );
    for v in &r.variants {
        for t in &v.turns {
            let worst_streams = |f: fn(&csa2_harness::replay_error::Classes) -> f64| {
                t.layers.iter().map(|l| f(&l.streams)).fold(0.0, f64::max)
            };
            say!(
                "{:<13} {:>4} {:>6} {:>5} {:>5} {:>6} {:>9.3} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.6} {:>10} {:>9}",
                v.variant.name(),
                t.turn,
                t.prompt_tokens,
                t.hit,
                if t.turn == 0 { "-" } else if t.snapshot_hit { "hit" } else { "miss" },
                t.replayed_tokens,
                t.token_layers as f64 / t.token_layers_exact.max(1) as f64,
                worst_streams(|c| c.replayed.max_rel),
                worst_streams(|c| c.prompt.max_rel),
                t.output.prompt.max_rel,
                t.output.prompt.mean_rel,
                t.output.prompt.min_cos,
                t.persistence
                    .first()
                    .map_or("-".into(), |p| format!("{:.2e}", p.rel)),
                settles(t)
            );
        }
    }
    say!(
        "layers/x = token-layers run in prefill / the reference's; replayed, prompt = worst stream row error over the layers; out = final collapsed output on the new prompt rows; decode[0] = first continuation step; settles = first step from which the output error stays below {:.0e}.",
        r.floor
    );
    // Per layer for the worst turn of the first variant.
    let Some(v) = r.variants.first() else { return };
    let Some(t) = v
        .turns
        .iter()
        .max_by(|a, b| a.output.prompt.max_rel.total_cmp(&b.output.prompt.max_rel))
    else {
        return;
    };
    say!();
    say!(
        "{} turn {} per layer (streams after the layer; rows: replayed / new prompt / decode):",
        v.variant.name(),
        t.turn
    );
    say!(
        "{:>5} {:<8} {:>6} {:>9} {:>9} {:>6} {:>9} {:>9} {:>10} {:>6} {:>9} {:>9}",
        "layer",
        "role",
        "rep n",
        "rep max",
        "rep mean",
        "new n",
        "new max",
        "new mean",
        "new cos",
        "dec n",
        "dec max",
        "dec mean"
    );
    for l in &t.layers {
        let s = &l.streams;
        say!(
            "{:>5} {:<8} {:>6} {:>9.2e} {:>9.2e} {:>6} {:>9.2e} {:>9.2e} {:>10.6} {:>6} {:>9.2e} {:>9.2e}",
            l.layer,
            l.role,
            s.replayed.rows,
            s.replayed.max_rel,
            s.replayed.mean_rel,
            s.prompt.rows,
            s.prompt.max_rel,
            s.prompt.mean_rel,
            s.prompt.min_cos,
            s.decode.rows,
            s.decode.max_rel,
            s.decode.mean_rel
        );
    }
    if !t.persistence.is_empty() {
        let steps: Vec<String> = t
            .persistence
            .iter()
            .map(|p| format!("{:.1e}", p.rel))
            .collect();
        say!("output error per decode step: {}", steps.join(" "));
    }
}
