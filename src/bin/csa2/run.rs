//! `csa2 run`: a multi-turn agentic session through the stack.
//!
//! Turn k takes request k of the trace: `input_length × --token-scale` new prompt tokens appended to
//! the context so far, then `min(output_length, --decode-max)` generated tokens. Between turns the
//! request ends: its global KV stays cached (the prefix hit of the next turn), its encoder SWA
//! windows and compressor carries go to the DRAM snapshot pool (TTL, `store::dram`), decoder SWA is
//! dropped (never persisted). The next turn arrives after the trace's gap × `--time-scale`; a live
//! snapshot is restored (no replay), an expired one costs an encoder bounded replay of the last
//! window (docs/SPEC.md §3, planned by `replay::plan`).
//!
//! The KV cache is the paged block manager through `PagedCache` (`--cache paged`, the default; the
//! pool is sized to the session's final context unless `--cache-blocks` says otherwise) or the
//! per-request `ContiguousCache` (`--cache contiguous`); both give the same `output_sha256`.
//!
//! Placeholders (out of scope, stated in the output): token ids of prompts and of generated tokens
//! are deterministic synthetic ids (no tokenizer, no LM head); the embedding and the MoE FFN are the
//! stack's placeholders.

use crate::out::{JsonOut, Progress};
use csa2::backend::launch_day::LAUNCH_DAY;
use csa2::backend::stack::StepOutput;
use csa2::backend::timing::Timings;
use csa2::backend::{
    Backend, BackendConfig, ContiguousCache, KvCache, Model, PagedCache, Phase, SeqStep,
};
use csa2::cache::prefix::PrefixKey;
use csa2::cache::CacheManager;
use csa2::geometry::Role;
use csa2::ops::compressor::CompressorState;
use csa2::replay::ReplayMode;
use csa2::store::clock::ManualClock;
use csa2::store::dram::{DramConfig, DramPool, Snapshot};
use csa2::store::TierPolicy;
use csa2::weights::Scale;
use csa2::{Error, Result};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// A checkpoint directory (released naming; default: synthetic weights generated in memory).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// A Mooncake-format trace (default: the excerpt bundled in assets/).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Turns of the session.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// Model scale for synthetic weights (`tiny` or `full`).
    #[arg(long, default_value = "tiny")]
    scale: String,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Write every number as JSON to PATH (`-` = stdout; the table then goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
    /// New prompt tokens per turn = trace input_length × this.
    #[arg(long, default_value_t = 0.03)]
    token_scale: f64,
    /// Generated tokens per turn are clipped to this.
    #[arg(long, default_value_t = 16)]
    decode_max: usize,
    /// Session seconds per trace second between turns.
    #[arg(long, default_value_t = 30.0)]
    time_scale: f64,
    /// Turn k is trace request k × stride (spreads the turns over the trace's timeline).
    #[arg(long, default_value_t = 25)]
    stride: usize,
    /// DRAM snapshot time to live, seconds (docs/SPEC.md §0: minutes).
    #[arg(long, default_value_t = 300)]
    ttl_s: u64,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Run every decoder row in prefill (decoder bounded replay off).
    #[arg(long)]
    no_decoder_replay: bool,
    /// Use the launch-day backend instead of CSA2.
    #[arg(long)]
    launch_day: bool,
    /// KV cache: `paged` (the block manager: block tables, slot mapping, block-planar pages) or
    /// `contiguous` (one growing buffer per request and layer). Same outputs bit for bit.
    #[arg(long, value_enum, default_value_t = CacheKind::Paged)]
    cache: CacheKind,
    /// Blocks of 256 tokens in the paged pool (0 = enough for the session's final context).
    #[arg(long, default_value_t = 0)]
    cache_blocks: usize,
}

/// Which KV cache implementation a run uses (plain words: clap prints these docs in `--help`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheKind {
    /// The paged block manager (CacheManager): block tables, slot mapping, block-planar pages.
    Paged,
    /// One growing buffer per request and layer.
    Contiguous,
}

impl CacheKind {
    fn as_str(self) -> &'static str {
        match self {
            CacheKind::Paged => "paged",
            CacheKind::Contiguous => "contiguous",
        }
    }
}

/// Tokens of the session's final context: every turn's new prompt tokens and generated tokens.
fn session_tokens(a: &Args, reqs: &[csa2::sim::trace::TraceRequest]) -> usize {
    reqs.iter()
        .step_by(a.stride.max(1))
        .take(a.turns)
        .map(|r| {
            ((r.input_length as f64 * a.token_scale).round() as usize).max(1)
                + r.output_length.clamp(1, a.decode_max.max(1))
        })
        .sum()
}

/// One turn's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct TurnReport {
    /// Turn index.
    pub turn: usize,
    /// Session clock at arrival, seconds.
    pub arrival_s: f64,
    /// Prompt length (whole context).
    pub prompt_tokens: usize,
    /// Prefix tokens served from the cache.
    pub prefix_hit: usize,
    /// Whether the encoder SWA snapshot was found in DRAM.
    pub snapshot_hit: bool,
    /// Tokens recomputed inside the hit (encoder bounded replay).
    pub replayed_tokens: usize,
    /// Rows the prefill computed (replayed + new).
    pub prefill_rows: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// Prefill wall time, s.
    pub prefill_s: f64,
    /// Decode wall time, s.
    pub decode_s: f64,
    /// Prefill rows per second.
    pub prefill_tok_s: f64,
    /// Generated tokens per second.
    pub decode_tok_s: f64,
    /// Global KV bytes (HBM pages; also what the SSD tier persists).
    pub hbm_global_bytes: usize,
    /// SWA window bytes live during the turn (HBM).
    pub hbm_swa_bytes: usize,
    /// Bytes persisted to the SSD tier (global KV).
    pub ssd_bytes: usize,
    /// Bytes in the DRAM snapshot pool after the turn.
    pub dram_bytes: usize,
}

/// Deterministic synthetic token id of position `p` in session `s`.
pub fn token_at(s: u64, p: usize) -> u32 {
    ((p as u64).wrapping_mul(2_654_435_761).wrapping_add(s * 97) % 50_000) as u32
}

/// What the DRAM pool keeps besides the SWA records: the compressor carries.
struct Saved {
    snap: csa2::backend::cache::SwaSnapshot,
    carries: Vec<(usize, Option<CompressorState>)>,
}

fn key(session: u64, ctx: usize) -> PrefixKey {
    PrefixKey(
        Sha256::new()
            .chain_update(b"csa2-run-session")
            .chain_update(session.to_le_bytes())
            .chain_update((ctx as u64).to_le_bytes())
            .finalize()
            .into(),
    )
}

/// Runs a session over `cache`; `on_turn` is called after each turn.
pub fn session(
    a: &Args,
    backend: &Backend,
    reqs: &[csa2::sim::trace::TraceRequest],
    cache: &mut dyn KvCache,
    mut on_step: impl FnMut(usize, &str, &StepOutput),
    mut on_turn: impl FnMut(&TurnReport),
) -> Result<Vec<TurnReport>> {
    let g = backend.geometry().clone();
    let sid = 1u64;
    let clock = Arc::new(ManualClock::new(0));
    let pool = DramPool::new(
        DramConfig {
            capacity_bytes: 1 << 34,
            ttl_ms: a.ttl_s * 1000,
        },
        clock.clone(),
    )?;
    let mut saved: HashMap<[u8; 32], Saved> = HashMap::new();
    // The store's tier policy says what the end of a turn keeps (the encoder windows, to DRAM)
    // and what a hit replays; the trace simulation follows the same policy.
    let policy = TierPolicy::v41(&g, ReplayMode::Bounded);
    let encoder = &policy.snapshot_layers;
    let all_layers: Vec<usize> = (0..g.num_layers).collect();
    let kv_layers: Vec<usize> = g.layers_with(Role::Full).map(|l| l.id).collect();
    let mut ctx = 0usize;
    let mut reports = vec![];
    let t_first = reqs.first().map_or(0, |r| r.timestamp);
    for (turn, r) in reqs
        .iter()
        .step_by(a.stride.max(1))
        .take(a.turns)
        .enumerate()
    {
        let now_ms = ((r.timestamp - t_first) as f64 * a.time_scale) as u64;
        clock.set(now_ms.max(clock_ms(&clock)));
        let new = ((r.input_length as f64 * a.token_scale).round() as usize).max(1);
        let prompt = ctx + new;
        let k = key(sid, ctx);
        let snap = if ctx > 0 { pool.get(&k) } else { None };
        let p = policy.plan(prompt, ctx, snap.is_some())?;
        let enc = &p.layers[0];
        if !cache.contains(sid) || p.hit_used == 0 {
            // Nothing usable: start the request from scratch.
            if cache.contains(sid) {
                cache.close(sid)?;
            }
            cache.open(sid)?;
        }
        if p.snapshot_used {
            let s = saved
                .get(&k.0)
                .ok_or_else(|| Error::Internal("snapshot bytes missing".into()))?;
            cache.swa_restore(sid, &s.snap)?;
            for (l, c) in &s.carries {
                *cache.carry(sid, *l)? = c.clone();
            }
        }
        let first = enc.rows.start;
        let replayed = p.replayed_tokens();
        // ---- prefill in chunks
        let t0 = Instant::now();
        let mut pos = first;
        while pos < prompt {
            let len = a.chunk.max(1).min(prompt - pos);
            let s = SeqStep {
                req: sid,
                first_pos: pos,
                len,
                phase: Phase::Prefill {
                    prompt_end: prompt,
                    prefill_start: first,
                },
                replay_start: enc.window_floor,
                cached_until: p.hit_used,
            };
            let toks: Vec<u32> = (pos..pos + len).map(|q| token_at(sid, q)).collect();
            let mut tm = Timings::default();
            let out = backend.step(&[s], &toks, cache, &mut tm, true)?;
            on_step(turn, "prefill", &out);
            pos += len;
        }
        let prefill_s = t0.elapsed().as_secs_f64();
        // ---- decode
        let gen = r.output_length.clamp(1, a.decode_max.max(1));
        let t1 = Instant::now();
        let mut swa_peak = cache.usage().swa_bytes;
        for i in 0..gen {
            let q = prompt + i;
            let s = SeqStep {
                req: sid,
                first_pos: q,
                len: 1,
                phase: Phase::Decode,
                replay_start: 0,
                cached_until: q,
            };
            let mut tm = Timings::default();
            let out = backend.step(&[s], &[token_at(sid, q)], cache, &mut tm, true)?;
            on_step(turn, "decode", &out);
            swa_peak = swa_peak.max(cache.usage().swa_bytes);
        }
        let decode_s = t1.elapsed().as_secs_f64();
        ctx = prompt + gen;
        // ---- end of turn: snapshot encoder windows + carries, drop live SWA state
        let snap = cache.swa_snapshot(sid, encoder)?;
        let mut carries = vec![];
        for &l in &kv_layers {
            carries.push((l, cache.carry(sid, l)?.take()));
        }
        let bytes = snap.bytes() + carries.len() * 4096;
        let k2 = key(sid, ctx);
        pool.put(k2, Snapshot::Sized(bytes))?;
        saved.insert(k2.0, Saved { snap, carries });
        cache.swa_drop(sid, &all_layers)?;
        cache.carry_drop(sid)?;
        let u = cache.usage();
        let rep = TurnReport {
            turn,
            arrival_s: now_ms as f64 / 1000.0,
            prompt_tokens: prompt,
            prefix_hit: p.hit_used,
            snapshot_hit: p.snapshot_used,
            replayed_tokens: replayed,
            prefill_rows: prompt - first,
            generated_tokens: gen,
            prefill_s,
            decode_s,
            prefill_tok_s: (prompt - first) as f64 / prefill_s.max(1e-12),
            decode_tok_s: gen as f64 / decode_s.max(1e-12),
            hbm_global_bytes: u.global_bytes(),
            hbm_swa_bytes: swa_peak,
            ssd_bytes: u.global_bytes(),
            dram_bytes: pool.stats().bytes as usize,
        };
        on_turn(&rep);
        reports.push(rep);
    }
    Ok(reports)
}

fn clock_ms(c: &ManualClock) -> u64 {
    use csa2::store::clock::Clock;
    c.now_ms()
}

pub fn load_backend(a: &Args) -> Result<Backend> {
    let scale = Scale::from_name(&a.scale)?;
    let model = match &a.weights {
        Some(dir) => Model::from_checkpoint(dir, scale.geometry())?,
        None => Model::synthetic(scale, 1, scale == Scale::Full)?,
    };
    let cfg = if a.launch_day {
        LAUNCH_DAY
    } else {
        BackendConfig::CSA2
    };
    let cfg = if a.no_decoder_replay {
        cfg.with_decoder_replay(false)
    } else {
        cfg
    };
    Backend::new(Arc::new(model), cfg)
}

pub fn load_trace(a: &Args) -> Result<Vec<csa2::sim::trace::TraceRequest>> {
    match &a.trace {
        Some(p) => csa2::sim::trace::read(p),
        None => csa2::sim::trace::parse(
            csa2::sim::trace::EXCERPT,
            std::path::Path::new("assets/mooncake_conversation_excerpt.jsonl"),
        ),
    }
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
    if a.turns == 0 {
        return Err(Error::invalid("turns", "must be ≥ 1"));
    }
    let reqs = load_trace(&a)?;
    let stride = a.stride.max(1);
    if reqs.len().div_ceil(stride) < a.turns {
        return Err(Error::invalid(
            "turns",
            format!(
                "the trace has {} requests: {} turns at stride {stride} need {}",
                reqs.len(),
                a.turns,
                (a.turns - 1) * stride + 1
            ),
        ));
    }
    let backend = load_backend(&a)?;
    let g = backend.geometry();
    say!(
        "csa2 run — {} turns of an agentic session through the {} backend ({} scale: hidden {}, {} heads, {} layers; {} weights)",
        a.turns,
        backend.cfg.name,
        a.scale,
        g.hidden_size,
        g.num_heads,
        g.num_layers,
        if a.weights.is_some() { "checkpoint" } else { "synthetic" }
    );
    say!(
        "Turn k = trace request k×{}: input_length × {} new tokens, outputs clipped to {}; gaps: trace × {} s/s; DRAM TTL {} s; decoder replay {}.",
        stride,
        a.token_scale,
        a.decode_max,
        a.time_scale,
        a.ttl_s,
        if backend.cfg.decoder_replay { "on" } else { "off" }
    );
    say!("Placeholders: synthetic token ids and embedding, identity MoE FFN, no LM head.");
    let bar = Progress::new(
        "run turns",
        a.turns as u64,
        "turn {pos}/{len} [{bar:30}] {elapsed} {msg}",
    );
    bar.set_message("turn 0: prefill");
    // Digest of every step's final hidden state: what the weights produced (tests compare it).
    let mut digest = Sha256::new();
    let (mut cache, manager): (Box<dyn KvCache>, Option<Arc<CacheManager>>) = match a.cache {
        CacheKind::Paged => {
            let blocks = match a.cache_blocks {
                0 => session_tokens(&a, &reqs).div_ceil(256) + 1,
                n => n,
            };
            let p = PagedCache::host(g, backend.cfg.formats, blocks)?;
            let m = p.manager().clone();
            (Box::new(p), Some(m))
        }
        CacheKind::Contiguous => (Box::new(ContiguousCache::new(g, backend.cfg.formats)), None),
    };
    let t_session = Instant::now();
    let reports = session(
        &a,
        &backend,
        &reqs,
        cache.as_mut(),
        |_, _, out| {
            out.hidden
                .iter()
                .for_each(|v| digest.update(v.to_le_bytes()))
        },
        |t| {
            bar.inc(1);
            bar.set_message(format!(
                "context {} after turn {}",
                t.prompt_tokens + t.generated_tokens,
                t.turn
            ));
        },
    )?;
    let session_s = t_session.elapsed().as_secs_f64();
    bar.finish();
    say!(
        "{:>4} {:>8} {:>7} {:>7} {:>5} {:>7} {:>7} {:>4} {:>8} {:>8} {:>9} {:>8} {:>11} {:>10} {:>10}",
        "turn", "arrive s", "prompt", "hit", "snap", "replay", "rows", "gen", "prefill s", "decode s",
        "prefill/s", "decode/s", "global B", "SWA B", "DRAM B"
    );
    for t in &reports {
        say!(
            "{:>4} {:>8.1} {:>7} {:>7} {:>5} {:>7} {:>7} {:>4} {:>8.3} {:>8.3} {:>9.1} {:>8.2} {:>11} {:>10} {:>10}",
            t.turn,
            t.arrival_s,
            t.prompt_tokens,
            t.prefix_hit,
            if t.turn == 0 { "-" } else if t.snapshot_hit { "hit" } else { "miss" },
            t.replayed_tokens,
            t.prefill_rows,
            t.generated_tokens,
            t.prefill_s,
            t.decode_s,
            t.prefill_tok_s,
            t.decode_tok_s,
            t.hbm_global_bytes,
            t.hbm_swa_bytes,
            t.dram_bytes
        );
    }
    if let Some(last) = reports.last() {
        let ctx = last.prompt_tokens + last.generated_tokens;
        say!(
            "Global KV after the session: {} B for {} tokens = {:.1} B/token (persisted to the SSD tier).",
            last.hbm_global_bytes,
            ctx,
            last.hbm_global_bytes as f64 / ctx as f64
        );
    }
    let usage = cache.usage();
    // The session's request (id 1) stays open after its last turn: its table is the context.
    let manager = match &manager {
        Some(m) => Some((m.stats(), m.request_bytes(1)?)),
        None => None,
    };
    match &manager {
        Some((m, r)) => say!(
            "Cache: paged (CacheManager, {} blocks of 256 tokens): {} blocks in use = {} B of slabs measured by the allocator for {} tokens = {:.1} B/token ({} B padding in the last block); SWA rings {} B; session {:.2} s.",
            m.total_blocks,
            m.used_blocks,
            r.slab_bytes,
            r.tokens,
            r.bytes_per_token,
            r.padding_bytes,
            m.session_bytes,
            session_s
        ),
        None => say!(
            "Cache: contiguous (one buffer per request and layer): {} B of global KV allocated; session {:.2} s.",
            usage.global_allocated, session_s
        ),
    }
    let output_sha256: String = digest
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    say!("Output digest (SHA-256 of every step's final hidden state): {output_sha256}");
    crate::out::write_json(
        &a.json,
        &serde_json::json!({
            "backend": backend.cfg.name,
            "cache": a.cache.as_str(),
            "cache_manager": manager.map(|(stats, request)| serde_json::json!({"stats": stats, "request": request})),
            "session_s": session_s,
            "scale": a.scale,
            "decoder_replay": backend.cfg.decoder_replay,
            "ttl_s": a.ttl_s,
            "turns": reports,
            "output_sha256": output_sha256,
        }),
    )?;
    Ok(())
}
