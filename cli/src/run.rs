//! `csa2 run`: a multi-turn agentic session through the stack (the driver is
//! `csa2_harness::session`: turns, prefix hits, DRAM snapshots and bounded replay).
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
use csa2::backend::{Backend, BackendConfig, ContiguousCache, KvCache, Model, PagedCache};
use csa2::cache::CacheManager;
use csa2::weights::Scale;
use csa2::{Error, Result};
use csa2_harness::session::{self, SessionConfig};
use csa2_harness::sim::trace::TraceRequest;
use sha2::{Digest, Sha256};
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
    #[arg(long, default_value_t = 6, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    turns: usize,
    /// Model scale for synthetic weights (`tiny` or `full`).
    #[arg(long, default_value = "tiny")]
    scale: String,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::out::count::<usize>)]
    threads: usize,
    /// Write every number as JSON to PATH (`-` = stdout; the table then goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
    /// New prompt tokens per turn = trace input_length × this.
    #[arg(long, default_value_t = 0.03, allow_negative_numbers = true, value_parser = crate::out::positive_f64)]
    token_scale: f64,
    /// Generated tokens per turn are clipped to this (at least 1: every turn decodes).
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    decode_max: usize,
    /// Session seconds per trace second between turns.
    #[arg(long, default_value_t = 30.0, allow_negative_numbers = true, value_parser = crate::out::non_negative_f64)]
    time_scale: f64,
    /// Turn k is trace request k × stride (spreads the turns over the trace's timeline).
    #[arg(long, default_value_t = 25, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    stride: usize,
    /// DRAM snapshot time to live, seconds (docs/SPEC.md §0: minutes).
    #[arg(long, default_value_t = 300, allow_negative_numbers = true, value_parser = crate::out::count::<u64>)]
    ttl_s: u64,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
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
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::out::count::<usize>)]
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

impl Args {
    /// The session's shape, as the harness's driver takes it.
    pub fn session(&self) -> SessionConfig {
        SessionConfig {
            turns: self.turns,
            token_scale: self.token_scale,
            decode_max: self.decode_max,
            time_scale: self.time_scale,
            stride: self.stride,
            ttl_s: self.ttl_s,
            chunk: self.chunk,
        }
    }
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

pub fn load_trace(a: &Args) -> Result<Vec<TraceRequest>> {
    match &a.trace {
        Some(p) => csa2_harness::sim::trace::read(p),
        None => csa2_harness::sim::trace::parse(
            csa2_harness::sim::trace::EXCERPT,
            std::path::Path::new("assets/mooncake_conversation_excerpt.jsonl"),
        ),
    }
}

pub fn run(a: Args) -> Result<()> {
    crate::out::in_pool(a.threads, || run_in_pool(a))
}

fn run_in_pool(a: Args) -> Result<()> {
    crate::out::json_dest(&a.json)?;
    if a.turns == 0 {
        return Err(Error::invalid("turns", "must be ≥ 1"));
    }
    let reqs = load_trace(&a)?;
    let stride = a.stride;
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
        "csa2 run — {} of an agentic session through the {} backend ({} scale: hidden {}, {} heads, {} layers; {} weights)",
        crate::out::plural(a.turns, "turn"),
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
                0 => session::session_tokens(&a.session(), &reqs).div_ceil(256) + 1,
                n => n,
            };
            let p = PagedCache::host(g, backend.cfg.formats, blocks)?;
            let m = p.manager().clone();
            (Box::new(p), Some(m))
        }
        CacheKind::Contiguous => (Box::new(ContiguousCache::new(g, backend.cfg.formats)), None),
    };
    let t_session = Instant::now();
    let reports = session::run(
        &a.session(),
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
        "{:>4} {:>8} {:>7} {:>7} {:>5} {:>7} {:>7} {:>4} {:>9} {:>8} {:>13} {:>12} {:>11} {:>10} {:>10}",
        "turn", "arrive s", "prompt", "hit", "snap", "replay", "rows", "gen", "prefill s", "decode s",
        "prefill tok/s", "decode tok/s", "global B", "SWA B", "DRAM B"
    );
    for t in &reports {
        say!(
            "{:>4} {:>8.1} {:>7} {:>7} {:>5} {:>7} {:>7} {:>4} {:>9.3} {:>8.3} {:>13.1} {:>12.2} {:>11} {:>10} {:>10}",
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
            "Cache: paged (CacheManager, {} of 256 tokens): {} in use = {} B of slabs measured by the allocator for {} tokens = {:.1} B/token ({} B padding in the last block); SWA rings {} B; session {:.2} s.",
            crate::out::plural(m.total_blocks, "block"),
            crate::out::plural(m.used_blocks, "block"),
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
