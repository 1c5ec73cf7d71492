//! The replay error analyzer: what SWA bounded replay (docs/SPEC.md §3) costs in accuracy.
//!
//! The same multi-turn session (same weights, same token ids, same prefix hits and snapshot
//! hits/misses) runs once with the exact replay of docs/SPEC.md §3 (the reference) and once per compared
//! [`Variant`]; the runs advance in lock step, one turn at a time, each through its own cache. After
//! every layer the analyzer compares, row by row at the same absolute position, the attention
//! input `u` and the four hyper-connection streams, and after the last layer the final collapsed
//! output. Rows fall in three classes: **replayed** (`[H − window, H)`, recomputed inside the prefix
//! hit of `H` tokens), **prompt** (the new prompt rows `[H, I)`) and **decode** (the continuation).
//! Per row the error is `‖a − b‖₂ / ‖b‖₂` and the cosine of `a` and `b`; per (layer, class) the
//! analyzer keeps the max and mean of the error and the min and mean of the cosine. Persistence: the
//! error of the final output at every decode step of the continuation, and the first step from which
//! it stays below [`FLOOR`].
//!
//! A turn `t` appends `new_tokens` prompt tokens to the context, then decodes `continuation` tokens;
//! between turns the request ends as in `csa2 run`: global KV stays cached (the next turn's prefix
//! hit), encoder SWA windows and compressor carries go to the snapshot, every live SWA window is
//! dropped. Every run takes its turns on the session driver's loop ([`crate::session::Turns`]: turn
//! start, prefill chunks, decode steps, turn end), so the analyzer measures exactly the steps
//! `csa2 run` takes. Whether the next turn finds the snapshot is the [`SnapshotPolicy`].
//!
//! Placeholders (as in `csa2 run`): synthetic token ids, the stack's embedding and identity FFN.

use crate::session::{Saved, Turns};
use csa2::backend::stack::{LayerView, StepOutput};
use csa2::backend::timing::Timings;
use csa2::backend::{Backend, ContiguousCache};
use csa2::error::{Error, Result};
use csa2::ops::mhc::HC;
use csa2::replay::{plan as replay_plan, ReplayConfig, ReplayMode, ReplayPlan};
use csa2::store::TierPolicy;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Row error (`‖a − b‖ / ‖b‖`) under which two runs count as equal: f32 rounding level
/// (`tolerance::F32_VS_F64.rel`). The exact replay staircase is bit-identical to a cold run on the
/// new prompt rows, the decode rows and the output (tests/replay_error.rs asserts 0); only the GEMM
/// regime (GEMV for ≤ 4 rows, packed GEMM otherwise) moves a row by ~1e-7.
pub const FLOOR: f64 = csa2::tolerance::F32_VS_F64.rel;

/// How a run rebuilds SWA state at a prefix hit and in prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// The exact `L × window` staircase, no decoder trimming (the reference).
    Exact,
    /// Encoder bounded replay on a snapshot miss and decoder bounded replay (the V4.1 default).
    Bounded,
    /// Encoder bounded replay only: decoder layers run every row (`--no-decoder-replay`).
    EncoderOnly,
    /// No prefix cache: every turn prefills its whole prompt from scratch (what the exact replay
    /// must reproduce).
    Cold,
}

impl Variant {
    /// `exact`, `bounded`, `encoder_only`.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Exact => "exact",
            Variant::Bounded => "bounded",
            Variant::EncoderOnly => "encoder_only",
            Variant::Cold => "cold",
        }
    }
    /// Parses `exact`, `bounded`, `encoder_only` or `cold`.
    pub fn from_name(s: &str) -> Result<Variant> {
        [
            Variant::Exact,
            Variant::Bounded,
            Variant::EncoderOnly,
            Variant::Cold,
        ]
        .into_iter()
        .find(|v| v.name() == s)
        .ok_or_else(|| {
            Error::invalid(
                "variant",
                format!("expected exact, bounded, encoder_only or cold, found {s:?}"),
            )
        })
    }
    /// The planner mode of this variant.
    pub fn mode(self) -> ReplayMode {
        match self {
            Variant::Exact => ReplayMode::Exact,
            Variant::Bounded => ReplayMode::Bounded,
            Variant::EncoderOnly | Variant::Cold => ReplayMode::Off,
        }
    }
}

/// Whether turn `t ≥ 1` finds the SWA snapshot of the previous turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotPolicy {
    /// Never (every hit costs an encoder replay).
    Miss,
    /// Always (no encoder replay; decoder state is never persisted).
    Hit,
    /// Miss on odd turns, hit on even ones.
    Alternate,
}

impl SnapshotPolicy {
    /// Parses `miss`, `hit` or `alternate`.
    pub fn from_name(s: &str) -> Result<SnapshotPolicy> {
        match s {
            "miss" => Ok(SnapshotPolicy::Miss),
            "hit" => Ok(SnapshotPolicy::Hit),
            "alternate" => Ok(SnapshotPolicy::Alternate),
            _ => Err(Error::invalid(
                "snapshot policy",
                format!("expected miss, hit or alternate, found {s:?}"),
            )),
        }
    }
    fn present(self, turn: usize) -> bool {
        match self {
            SnapshotPolicy::Miss => false,
            SnapshotPolicy::Hit => true,
            SnapshotPolicy::Alternate => turn.is_multiple_of(2),
        }
    }
}

/// The session both runs play.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionSpec {
    /// Turns.
    pub turns: usize,
    /// Prompt tokens of turn 0.
    pub first_prompt: usize,
    /// New prompt tokens of every later turn.
    pub new_tokens: usize,
    /// Decode steps after every turn's prefill (the continuation).
    pub continuation: usize,
    /// Prefill chunk, tokens.
    pub chunk: usize,
    /// Snapshot hits and misses.
    pub snapshot: SnapshotPolicy,
    /// Salt of the synthetic token ids.
    pub seed: u64,
}

impl SessionSpec {
    fn check(&self) -> Result<()> {
        for (name, v) in [
            ("turns", self.turns),
            ("first prompt", self.first_prompt),
            ("new tokens", self.new_tokens),
            ("chunk", self.chunk),
        ] {
            if v == 0 {
                return Err(Error::invalid(name, "must be ≥ 1, found 0"));
            }
        }
        Ok(())
    }
}

/// Error statistics of a set of rows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Agg {
    /// Rows compared.
    pub rows: usize,
    /// Largest row error `‖a − b‖ / ‖b‖`.
    pub max_rel: f64,
    /// Mean row error.
    pub mean_rel: f64,
    /// Smallest row cosine (1 when no row).
    pub min_cos: f64,
    /// Mean row cosine (1 when no row).
    pub mean_cos: f64,
}

impl Default for Agg {
    fn default() -> Agg {
        Agg {
            rows: 0,
            max_rel: 0.0,
            mean_rel: 0.0,
            min_cos: 1.0,
            mean_cos: 1.0,
        }
    }
}

impl Agg {
    fn add(&mut self, rel: f64, cos: f64) {
        let n = self.rows as f64;
        self.mean_rel = (self.mean_rel * n + rel) / (n + 1.0);
        self.mean_cos = (self.mean_cos * n + cos) / (n + 1.0);
        self.max_rel = self.max_rel.max(rel);
        self.min_cos = self.min_cos.min(cos);
        self.rows += 1;
    }
}

/// Row error and cosine of `a` against the reference `b` (f64 accumulation). Both all-zero rows
/// compare equal; a non-finite value is an error (never a silent NaN).
pub fn row_error(a: &[f32], b: &[f32]) -> Result<(f64, f64)> {
    let (mut dd, mut bb, mut aa, mut ab) = (0f64, 0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        if !x.is_finite() || !y.is_finite() {
            return Err(Error::invalid(
                "compared row",
                format!("non-finite value (run {x}, reference {y})"),
            ));
        }
        let (x, y) = (x as f64, y as f64);
        dd += (x - y) * (x - y);
        bb += y * y;
        aa += x * x;
        ab += x * y;
    }
    if dd == 0.0 {
        // Identical rows (or both all zero): exactly equal, whatever the rounding of the cosine.
        return Ok((0.0, 1.0));
    }
    let rel = dd.sqrt() / bb.sqrt().max(1e-300);
    let cos = ab / (aa.sqrt() * bb.sqrt()).max(1e-300);
    Ok((rel, cos))
}

/// Statistics per row class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Classes {
    /// Rows recomputed inside the prefix hit.
    pub replayed: Agg,
    /// New prompt rows.
    pub prompt: Agg,
    /// Continuation (decode) rows.
    pub decode: Agg,
}

impl Classes {
    fn class(&mut self, c: RowClass) -> &mut Agg {
        match c {
            RowClass::Replayed => &mut self.replayed,
            RowClass::Prompt => &mut self.prompt,
            RowClass::Decode => &mut self.decode,
        }
    }
    /// The worst row error over the classes.
    pub fn max_rel(&self) -> f64 {
        self.replayed
            .max_rel
            .max(self.prompt.max_rel)
            .max(self.decode.max_rel)
    }
}

#[derive(Debug, Clone, Copy)]
enum RowClass {
    Replayed,
    Prompt,
    Decode,
}

/// One layer of one turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerStats {
    /// Layer index.
    pub layer: usize,
    /// Role (`full`, `reuse`, `reindex`, `swa_only`).
    pub role: String,
    /// Attention input `u` (the collapsed, normed stream the layer sees).
    pub input: Classes,
    /// The four hyper-connection streams after the layer.
    pub streams: Classes,
}

/// One decode step of the continuation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepError {
    /// Step (0 = first generated token).
    pub step: usize,
    /// Error of the final output row.
    pub rel: f64,
    /// Cosine of the final output row.
    pub cos: f64,
    /// Worst stream error over the layers.
    pub max_layer_rel: f64,
}

/// One turn of one variant against the reference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnStats {
    /// Turn.
    pub turn: usize,
    /// Prompt length (whole context).
    pub prompt_tokens: usize,
    /// Prefix tokens adopted from the cache.
    pub hit: usize,
    /// Whether the encoder snapshot was found.
    pub snapshot_hit: bool,
    /// Tokens the variant recomputed inside the hit.
    pub replayed_tokens: usize,
    /// Token-layers the variant ran in prefill / the reference ran.
    pub token_layers: usize,
    /// Token-layers of the reference's prefill.
    pub token_layers_exact: usize,
    /// Per layer.
    pub layers: Vec<LayerStats>,
    /// The final collapsed output.
    pub output: Classes,
    /// Final-output error per decode step.
    pub persistence: Vec<StepError>,
    /// First decode step from which the final-output error stays below [`FLOOR`] (`None`: it does
    /// not within the continuation).
    pub settles_at: Option<usize>,
}

/// A variant's whole session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VariantReport {
    /// The compared variant.
    pub variant: Variant,
    /// Per turn.
    pub turns: Vec<TurnStats>,
}

/// Everything the analyzer measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The session.
    pub spec: SessionSpec,
    /// The reference variant.
    pub reference: Variant,
    /// Row error counted as equal.
    pub floor: f64,
    /// Per compared variant.
    pub variants: Vec<VariantReport>,
}

/// One run of the session through its own cache, on the session driver's turn loop
/// ([`Turns`]: the same turn start, steps and turn end as `csa2 run`).
struct Runner {
    variant: Variant,
    backend: Backend,
    cache: ContiguousCache,
    saved: Option<Saved>,
    turns: Turns,
}

/// One layer's reference rows: position → (input `u`, streams).
type LayerRows = HashMap<usize, (Vec<f32>, Vec<f32>)>;

/// Rows of the reference: per layer, position → (input, streams); final output by position.
#[derive(Default)]
struct Capture {
    layers: Vec<LayerRows>,
    output: HashMap<usize, Vec<f32>>,
}

impl Runner {
    fn new(base: &Backend, variant: Variant, seed: u64) -> Runner {
        let mut backend = base.clone();
        backend.cfg = backend.cfg.with_decoder_replay(variant == Variant::Bounded);
        let g = backend.geometry();
        let cache = ContiguousCache::new(g, backend.cfg.formats);
        // The V4.1 tier policy's snapshot: the encoder layers' windows.
        let snapshot_layers = TierPolicy::v41(g, ReplayMode::Bounded).snapshot_layers;
        let turns = Turns::new(g, 1, seed, snapshot_layers);
        Runner {
            variant,
            backend,
            cache,
            saved: None,
            turns,
        }
    }

    fn plan(&self, prompt: usize, hit: usize, snapshot: bool) -> Result<ReplayPlan> {
        let cfg = ReplayConfig::from_geometry(self.backend.geometry(), self.variant.mode());
        let hit = if self.variant == Variant::Cold {
            0
        } else {
            hit
        };
        replay_plan(&cfg, prompt, hit, snapshot && self.saved.is_some())
    }

    /// Prefill of one turn; `on_step` sees every layer of every chunk and the step's output.
    fn prefill(
        &mut self,
        p: &ReplayPlan,
        chunk: usize,
        obs: &mut dyn FnMut(LayerView<'_>),
        out: &mut dyn FnMut(&StepOutput),
    ) -> Result<()> {
        self.turns.begin(&mut self.cache, p, self.saved.as_ref())?;
        let starts: Vec<usize> = p.layers.iter().map(|l| l.rows.start).collect();
        for (s, toks) in self.turns.prefill(p, chunk) {
            let mut tm = Timings::default();
            let o = match self.variant {
                Variant::Exact => self.backend.step_exact(
                    &[s],
                    std::slice::from_ref(&starts),
                    &toks,
                    &mut self.cache,
                    &mut tm,
                    Some(obs),
                )?,
                _ => self
                    .backend
                    .step_observed(&[s], &toks, &mut self.cache, &mut tm, obs)?,
            };
            out(&o);
        }
        Ok(())
    }

    fn decode(&mut self, q: usize, obs: &mut dyn FnMut(LayerView<'_>)) -> Result<StepOutput> {
        let (s, tok) = self.turns.decode(q);
        let mut tm = Timings::default();
        self.backend
            .step_observed(&[s], &[tok], &mut self.cache, &mut tm, obs)
    }

    /// End of a turn: snapshot encoder windows and carries, drop every live SWA window.
    fn end_turn(&mut self) -> Result<()> {
        self.saved = Some(self.turns.end(&mut self.cache)?);
        Ok(())
    }
}

fn class_of(pos: usize, hit: usize, prompt: usize) -> RowClass {
    if pos < hit {
        RowClass::Replayed
    } else if pos < prompt {
        RowClass::Prompt
    } else {
        RowClass::Decode
    }
}

fn output_rows(o: &StepOutput) -> impl Iterator<Item = (usize, &[f32])> {
    let d = o.hidden.len() / o.plan.output_rows().len().max(1);
    o.plan
        .output_rows()
        .pos
        .iter()
        .enumerate()
        .map(move |(i, &p)| (p as usize, &o.hidden[i * d..(i + 1) * d]))
}

fn view_rows<'a>(v: &'a LayerView<'a>) -> impl Iterator<Item = (usize, &'a [f32], &'a [f32])> + 'a {
    let n = v.rows.len().max(1);
    let (d, s) = (v.input.len() / n, v.streams.len() / n);
    debug_assert_eq!(s, d * HC);
    v.rows.pos.iter().enumerate().map(move |(i, &p)| {
        (
            p as usize,
            &v.input[i * d..(i + 1) * d],
            &v.streams[i * s..(i + 1) * s],
        )
    })
}

/// Compares one run's layer views and outputs to the capture, accumulating into `t`.
struct Comparer<'c> {
    cap: &'c Capture,
    hit: usize,
    prompt: usize,
    err: Option<Error>,
    step_max: f64,
}

impl Comparer<'_> {
    fn layer(&mut self, t: &mut TurnStats, v: LayerView<'_>) {
        for (p, u, x) in view_rows(&v) {
            let Some((ru, rx)) = self.cap.layers[v.layer].get(&p) else {
                self.err.get_or_insert(Error::Internal(format!(
                    "layer {} row {p}: the run computed a row the reference did not",
                    v.layer
                )));
                continue;
            };
            let c = class_of(p, self.hit, self.prompt);
            match (row_error(u, ru), row_error(x, rx)) {
                (Ok((r1, c1)), Ok((r2, c2))) => {
                    let ls = &mut t.layers[v.layer];
                    ls.input.class(c).add(r1, c1);
                    ls.streams.class(c).add(r2, c2);
                    self.step_max = self.step_max.max(r2);
                }
                (Err(e), _) | (_, Err(e)) => {
                    self.err.get_or_insert(e);
                }
            }
        }
    }
    fn output(&mut self, t: &mut TurnStats, o: &StepOutput) -> Option<(f64, f64)> {
        let mut last = None;
        for (p, h) in output_rows(o) {
            let Some(rh) = self.cap.output.get(&p) else {
                self.err.get_or_insert(Error::Internal(format!(
                    "output row {p}: the run computed a row the reference did not"
                )));
                continue;
            };
            match row_error(h, rh) {
                Ok((r, c)) => {
                    t.output.class(class_of(p, self.hit, self.prompt)).add(r, c);
                    last = Some((r, c));
                }
                Err(e) => {
                    self.err.get_or_insert(e);
                }
            }
        }
        last
    }
}

fn capture_layer(cap: &mut Capture, lo: usize, v: LayerView<'_>) {
    for (p, u, x) in view_rows(&v) {
        if p >= lo {
            cap.layers[v.layer].insert(p, (u.to_vec(), x.to_vec()));
        }
    }
}

fn capture_output(cap: &mut Capture, lo: usize, o: &StepOutput) {
    for (p, h) in output_rows(o) {
        if p >= lo {
            cap.output.insert(p, h.to_vec());
        }
    }
}

/// Runs the session with `reference` and every variant of `compare` in lock step and measures the
/// error of each against the reference. `progress` is told what ran (`"turn 2 prefill"`, …).
///
/// Errors: a bad spec ([`Error::Invalid`] naming the field), any stack error, a non-finite hidden
/// state, or a row the run computed and the reference did not (the reference must run a superset).
pub fn analyze(
    backend: &Backend,
    spec: &SessionSpec,
    reference: Variant,
    compare: &[Variant],
    progress: &mut dyn FnMut(&str),
) -> Result<Report> {
    spec.check()?;
    let g = backend.geometry().clone();
    let mut refr = Runner::new(backend, reference, spec.seed);
    let mut runs: Vec<Runner> = compare
        .iter()
        .map(|&v| Runner::new(backend, v, spec.seed))
        .collect();
    let mut reports: Vec<VariantReport> = compare
        .iter()
        .map(|&variant| VariantReport {
            variant,
            turns: vec![],
        })
        .collect();
    let mut ctx = 0usize;
    for turn in 0..spec.turns {
        let new = if turn == 0 {
            spec.first_prompt
        } else {
            spec.new_tokens
        };
        let prompt = ctx + new;
        let snap = turn > 0 && spec.snapshot.present(turn);
        // ---- prefill: the reference first, captured from the first row any run computes.
        progress(&format!("turn {turn} prefill ({})", reference.name()));
        let rp = refr.plan(prompt, ctx, snap)?;
        let lo = runs
            .iter()
            .map(|r| r.plan(prompt, ctx, snap).map(|p| p.layers[0].rows.start))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .min()
            .unwrap_or(0);
        let mut cap = Capture {
            layers: vec![HashMap::new(); g.num_layers],
            output: HashMap::new(),
        };
        {
            let cap_cell = std::cell::RefCell::new(&mut cap);
            refr.prefill(
                &rp,
                spec.chunk,
                &mut |v| capture_layer(&mut cap_cell.borrow_mut(), lo, v),
                &mut |o| capture_output(&mut cap_cell.borrow_mut(), lo, o),
            )?;
        }
        let mut stats = vec![];
        for r in runs.iter_mut() {
            progress(&format!("turn {turn} prefill ({})", r.variant.name()));
            let p = r.plan(prompt, ctx, snap)?;
            let mut t = TurnStats {
                turn,
                prompt_tokens: prompt,
                hit: p.hit_used,
                snapshot_hit: p.snapshot_used,
                replayed_tokens: p.replayed_tokens(),
                token_layers: p.token_layers(0..g.num_layers),
                token_layers_exact: rp.token_layers(0..g.num_layers),
                layers: g
                    .layers
                    .iter()
                    .map(|lp| LayerStats {
                        layer: lp.id,
                        role: lp.role.as_str().to_string(),
                        input: Classes::default(),
                        streams: Classes::default(),
                    })
                    .collect(),
                output: Classes::default(),
                persistence: vec![],
                settles_at: None,
            };
            let cmp = std::cell::RefCell::new(Comparer {
                cap: &cap,
                hit: p.hit_used,
                prompt,
                err: None,
                step_max: 0.0,
            });
            let tc = std::cell::RefCell::new(&mut t);
            r.prefill(
                &p,
                spec.chunk,
                &mut |v| cmp.borrow_mut().layer(&mut tc.borrow_mut(), v),
                &mut |o| {
                    cmp.borrow_mut().output(&mut tc.borrow_mut(), o);
                },
            )?;
            if let Some(e) = cmp.into_inner().err {
                return Err(e);
            }
            stats.push(t);
        }
        // ---- continuation, one step at a time.
        if spec.continuation > 0 {
            progress(&format!("turn {turn} decode"));
        }
        for i in 0..spec.continuation {
            let q = prompt + i;
            let mut cap = Capture {
                layers: vec![HashMap::new(); g.num_layers],
                output: HashMap::new(),
            };
            let o = refr.decode(q, &mut |v| capture_layer(&mut cap, q, v))?;
            capture_output(&mut cap, q, &o);
            for (r, t) in runs.iter_mut().zip(stats.iter_mut()) {
                let mut cmp = Comparer {
                    cap: &cap,
                    hit: ctx,
                    prompt,
                    err: None,
                    step_max: 0.0,
                };
                let o = r.decode(q, &mut |v| cmp.layer(t, v))?;
                let last = cmp.output(t, &o);
                if let Some(e) = cmp.err {
                    return Err(e);
                }
                let (rel, cos) = last.ok_or_else(|| {
                    Error::Internal(format!("decode step at {q} returned no output row"))
                })?;
                t.persistence.push(StepError {
                    step: i,
                    rel,
                    cos,
                    max_layer_rel: cmp.step_max,
                });
            }
        }
        for t in stats.iter_mut() {
            t.settles_at = settles_at(&t.persistence, FLOOR);
        }
        refr.end_turn()?;
        for r in runs.iter_mut() {
            r.end_turn()?;
        }
        for (rep, t) in reports.iter_mut().zip(stats) {
            rep.turns.push(t);
        }
        ctx = prompt + spec.continuation;
    }
    Ok(Report {
        spec: spec.clone(),
        reference,
        floor: FLOOR,
        variants: reports,
    })
}

/// The first step from which every later step's error is below `floor`.
pub fn settles_at(steps: &[StepError], floor: f64) -> Option<usize> {
    let mut at = None;
    for s in steps {
        if s.rel < floor {
            at.get_or_insert(s.step);
        } else {
            at = None;
        }
    }
    at
}
