//! The agentic-session driver behind `csa2 run`: multi-turn requests through the 40-layer stack.
//!
//! Turn k takes request k × `stride` of the trace: `input_length × token_scale` new prompt tokens
//! appended to the context so far, then `min(output_length, decode_max)` generated tokens. Between
//! turns the request ends: its global KV stays cached (the prefix hit of the next turn), its
//! encoder SWA windows and compressor carries go to the DRAM snapshot pool (TTL, `store::dram`),
//! decoder SWA is dropped (never persisted). The next turn arrives after the trace's gap ×
//! `time_scale`; a live snapshot is restored (no replay), an expired one costs an encoder bounded
//! replay of the last window (docs/SPEC.md §3, planned by `replay::plan`).
//!
//! Token ids are deterministic synthetic ids ([`token_at`]: no tokenizer, no LM head), the same
//! ones the replay-error analyzer feeds.

use crate::sim::trace::TraceRequest;
use csa2::backend::cache::SwaSnapshot;
use csa2::backend::stack::StepOutput;
use csa2::backend::timing::Timings;
use csa2::backend::{Backend, KvCache, Phase, SeqStep};
use csa2::cache::prefix::PrefixKey;
use csa2::cache::RequestId;
use csa2::geometry::{Geometry, Role};
use csa2::ops::compressor::CompressorState;
use csa2::replay::{ReplayMode, ReplayPlan};
use csa2::store::clock::{Clock, ManualClock};
use csa2::store::dram::{DramConfig, DramPool, Snapshot};
use csa2::store::TierPolicy;
use csa2::{Error, Result};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// The shape of a session (what `csa2 run`'s flags set).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SessionConfig {
    /// Turns of the session.
    pub turns: usize,
    /// New prompt tokens per turn = trace input_length × this.
    pub token_scale: f64,
    /// Generated tokens per turn are clipped to this.
    pub decode_max: usize,
    /// Session seconds per trace second between turns.
    pub time_scale: f64,
    /// Turn k is trace request k × stride.
    pub stride: usize,
    /// DRAM snapshot time to live, seconds.
    pub ttl_s: u64,
    /// Prefill chunk size in tokens.
    pub chunk: usize,
}

/// Deterministic synthetic token id of position `p` in the session (or run) seeded `seed`.
pub fn token_at(seed: u64, p: usize) -> u32 {
    ((p as u64)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(seed.wrapping_mul(97))
        % 50_000) as u32
}

/// Tokens of the session's final context: every turn's new prompt tokens and generated tokens.
pub fn session_tokens(a: &SessionConfig, reqs: &[TraceRequest]) -> usize {
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

/// What the end of a turn keeps of a request (the DRAM snapshot): the SWA windows of the
/// snapshot layers and every KV-source layer's compressor carry.
#[derive(Debug, Clone)]
pub struct Saved {
    /// The snapshot layers' windows.
    pub snap: SwaSnapshot,
    /// (KV-source layer, carry).
    pub carries: Vec<(usize, Option<CompressorState>)>,
}

impl Saved {
    /// Bytes the DRAM pool charges: the window records plus 4 KiB per carry slot.
    pub fn bytes(&self) -> usize {
        self.snap.bytes() + self.carries.len() * 4096
    }
}

/// One request's turn loop over a KV cache: how a turn starts (reopen or keep the request,
/// restore a snapshot), the steps of its prefill and decode, and how it ends (snapshot, drop the
/// live windows and carries). [`run`] takes these steps; the replay-error analyzer's runs take the
/// same steps in lock step, each through its own cache and step function.
#[derive(Debug, Clone)]
pub struct Turns {
    /// The request.
    pub req: RequestId,
    /// Salt of the synthetic token ids ([`token_at`]).
    pub seed: u64,
    snapshot_layers: Vec<usize>,
    kv_layers: Vec<usize>,
    all_layers: Vec<usize>,
}

impl Turns {
    /// The turns of request `req` of geometry `g`, token ids salted `seed`; the end of a turn
    /// snapshots `snapshot_layers` (the tier policy's).
    pub fn new(g: &Geometry, req: RequestId, seed: u64, snapshot_layers: Vec<usize>) -> Turns {
        Turns {
            req,
            seed,
            snapshot_layers,
            kv_layers: g.layers_with(Role::Full).map(|l| l.id).collect(),
            all_layers: (0..g.num_layers).collect(),
        }
    }

    /// The start of a turn planned `p`: the request starts from scratch when nothing of it is
    /// usable (not open, or no prefix hit); a used snapshot is restored (windows and carries).
    ///
    /// Errors: the cache's; [`Error::Internal`] when the plan uses a snapshot and none is given.
    pub fn begin(
        &self,
        cache: &mut dyn KvCache,
        p: &ReplayPlan,
        saved: Option<&Saved>,
    ) -> Result<()> {
        let sid = self.req;
        if !cache.contains(sid) || p.hit_used == 0 {
            if cache.contains(sid) {
                cache.close(sid)?;
            }
            cache.open(sid)?;
        }
        if p.snapshot_used {
            let s = saved.ok_or_else(|| Error::Internal("snapshot bytes missing".into()))?;
            cache.swa_restore(sid, &s.snap)?;
            for (l, c) in &s.carries {
                cache.set_carry(sid, *l, c.clone())?;
            }
        }
        Ok(())
    }

    /// The prefill steps of a turn planned `p`, in chunks of `chunk` tokens: (rows, token ids).
    pub fn prefill(&self, p: &ReplayPlan, chunk: usize) -> Vec<(SeqStep, Vec<u32>)> {
        let enc = &p.layers[0];
        let first = enc.rows.start;
        let mut steps = vec![];
        let mut pos = first;
        while pos < p.prompt_len {
            let len = chunk.max(1).min(p.prompt_len - pos);
            let s = SeqStep {
                req: self.req,
                first_pos: pos,
                len,
                phase: Phase::Prefill {
                    prompt_end: p.prompt_len,
                    prefill_start: first,
                },
                replay_start: enc.window_floor,
                cached_until: p.hit_used,
            };
            steps.push((
                s,
                (pos..pos + len).map(|q| token_at(self.seed, q)).collect(),
            ));
            pos += len;
        }
        steps
    }

    /// The decode step of the token at position `q`: (row, token id).
    pub fn decode(&self, q: usize) -> (SeqStep, u32) {
        let s = SeqStep {
            req: self.req,
            first_pos: q,
            len: 1,
            phase: Phase::Decode,
            replay_start: 0,
            cached_until: q,
        };
        (s, token_at(self.seed, q))
    }

    /// The end of a turn: the snapshot layers' windows and the carries are returned (the DRAM
    /// snapshot), then every live window and carry is dropped; global KV stays.
    ///
    /// Errors: the cache's.
    pub fn end(&self, cache: &mut dyn KvCache) -> Result<Saved> {
        let sid = self.req;
        let snap = cache.swa_snapshot(sid, &self.snapshot_layers)?;
        let carries = self
            .kv_layers
            .iter()
            .map(|&l| Ok((l, cache.carry(sid, l)?)))
            .collect::<Result<Vec<_>>>()?;
        cache.swa_drop(sid, &self.all_layers)?;
        cache.carry_drop(sid)?;
        Ok(Saved { snap, carries })
    }
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

/// Runs a session over `cache`: `on_step` sees every step's output (prefill chunks and decode
/// tokens, with the turn index and the phase name), `on_turn` each turn's report.
///
/// Errors: those of the cache, the DRAM pool and the backend's steps; [`Error::Internal`] if a
/// snapshot the pool reports live has no saved state (a bug, not an input error).
pub fn run(
    a: &SessionConfig,
    backend: &Backend,
    reqs: &[TraceRequest],
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
    let turns = Turns::new(&g, sid, sid, policy.snapshot_layers.clone());
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
        turns.begin(cache, &p, saved.get(&k.0))?;
        let first = p.layers[0].rows.start;
        let replayed = p.replayed_tokens();
        // ---- prefill in chunks
        let t0 = Instant::now();
        for (s, toks) in turns.prefill(&p, a.chunk) {
            let mut tm = Timings::default();
            let out = backend.step(&[s], &toks, cache, &mut tm, true)?;
            on_step(turn, "prefill", &out);
        }
        let prefill_s = t0.elapsed().as_secs_f64();
        // ---- decode
        let gen = r.output_length.clamp(1, a.decode_max.max(1));
        let t1 = Instant::now();
        let mut swa_peak = cache.usage().swa_bytes;
        for i in 0..gen {
            let (s, tok) = turns.decode(prompt + i);
            let mut tm = Timings::default();
            let out = backend.step(&[s], &[tok], cache, &mut tm, true)?;
            on_step(turn, "decode", &out);
            swa_peak = swa_peak.max(cache.usage().swa_bytes);
        }
        let decode_s = t1.elapsed().as_secs_f64();
        ctx = prompt + gen;
        // ---- end of turn: snapshot encoder windows + carries, drop live SWA state
        let sv = turns.end(cache)?;
        let k2 = key(sid, ctx);
        pool.put(k2, Snapshot::Sized(sv.bytes()))?;
        saved.insert(k2.0, sv);
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
    c.now_ms()
}
