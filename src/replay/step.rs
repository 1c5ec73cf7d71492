//! One step of a batch: which rows run through which layers, and where each row's SWA window
//! starts (docs/SPEC.md §3).
//!
//! A step holds prefill chunks and decode tokens of many requests. Rows are laid out request after
//! request (each request's rows contiguous, positions ascending). Two row sets exist:
//! - **all rows**: every layer below the cut runs on them, and the cut layer's compressor (its global
//!   KV is written for every prompt token);
//! - **kept rows** (decoder bounded replay, on by default): the rest of the cut layer and every later
//!   layer run only on the last `min(len, window)` rows of each prompt and on every decode row; a kept
//!   prefill row's window starts at the first kept row. With decoder replay off, kept = all.
//!
//! The cut is derived from the geometry: the first decoder layer (CED split), moved up to the last
//! Full layer if one sits after it (that layer must see every row to write its global KV).

use crate::cache::RequestId;
use crate::error::{Error, Result};
use crate::geometry::{Geometry, Role};
use std::ops::Range;

/// Prefill or decode rows of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Prompt rows (one chunk of a prefill).
    Prefill {
        /// One past the last prompt position (the prompt length).
        prompt_end: usize,
        /// First position this prefill computes (0 cold; H − window on an encoder replay; H on a
        /// prefix hit whose SWA snapshot was restored). Bounds the kept rows' window.
        prefill_start: usize,
    },
    /// One generated token.
    Decode,
}

/// The rows of one request in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqStep {
    /// Request.
    pub req: RequestId,
    /// Absolute position of the first row.
    pub first_pos: usize,
    /// Rows (tokens) in this step (1 for decode).
    pub len: usize,
    /// Prefill chunk or decode token.
    pub phase: Phase,
    /// Window floor from an encoder replay (docs/SPEC.md §3: window start = max(p − 127, 0, replay_start));
    /// 0 when none.
    pub replay_start: usize,
    /// Tokens below this position already have their global entries in the cache (a prefix hit):
    /// entries whose last token is below it are read, never recomputed or overwritten. The same
    /// value for every chunk of a prefill: it may lie past this chunk's rows (a replay chunk inside
    /// the hit) but not past the prompt end; for a decode row, not past the row.
    pub cached_until: usize,
}

/// A set of rows: per row its request (index into the step's sequences), position and window floor,
/// and the contiguous span of each request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowSet {
    /// Request index (into [`StepPlan::seqs`]) of each row.
    pub seq: Vec<usize>,
    /// Absolute position of each row.
    pub pos: Vec<i64>,
    /// Window floor of each row: the window is `[max(p − (window − 1), floor), p]`.
    pub floor: Vec<usize>,
    /// Per request with rows in the set: (request index, row range in this set).
    pub spans: Vec<(usize, Range<usize>)>,
}

impl RowSet {
    /// Rows in the set.
    pub fn len(&self) -> usize {
        self.pos.len()
    }
    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }
    fn push(&mut self, seq: usize, pos: usize, floor: usize) {
        let r = self.pos.len();
        match self.spans.last_mut() {
            Some((s, range)) if *s == seq => range.end = r + 1,
            _ => self.spans.push((seq, r..r + 1)),
        }
        self.seq.push(seq);
        self.pos.push(pos as i64);
        self.floor.push(floor);
    }
}

/// The row plan of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPlan {
    /// The requests of the step, in row order.
    pub seqs: Vec<SeqStep>,
    /// Every row.
    pub all: RowSet,
    /// Rows kept after the cut (equal to `all` when nothing is trimmed).
    pub kept: RowSet,
    /// Index into `all` of each kept row.
    pub kept_idx: Vec<usize>,
    /// Layer where rows are trimmed: its compressor sees `all`, everything after sees `kept`.
    pub cut_layer: usize,
    /// Whether any row was trimmed.
    pub trimmed: bool,
    /// Exact replay (docs/SPEC.md §3, the `L × window` staircase): per layer, the rows it runs and the index
    /// into `all` of each. Empty for every other plan (the layers run `all` or `kept`).
    pub stair: Vec<(RowSet, Vec<usize>)>,
}

impl StepPlan {
    /// Plans a step.
    ///
    /// Errors: [`Error::Invalid`] for an empty request, a decode step of more than one row, a request
    /// listed twice, a prompt chunk that runs past its prompt end, a replay start that lies after
    /// the rows, or a cached prefix past the prompt end (prefill) or past the row (decode).
    pub fn new(g: &Geometry, seqs: &[SeqStep], decoder_replay: bool) -> Result<StepPlan> {
        let w = g.window;
        let cut_layer = g
            .layers_with(Role::Full)
            .map(|l| l.id)
            .filter(|&id| id >= g.first_decoder_layer)
            .max()
            .unwrap_or(g.first_decoder_layer)
            .max(g.first_decoder_layer);
        let mut all = RowSet::default();
        let mut kept = RowSet::default();
        let mut kept_idx = vec![];
        for (i, s) in seqs.iter().enumerate() {
            let name = format!("request {}", s.req);
            if s.len == 0 {
                return Err(Error::invalid(name, "has no rows in the step"));
            }
            if seqs[..i].iter().any(|o| o.req == s.req) {
                return Err(Error::invalid(name, "appears twice in one step"));
            }
            if s.replay_start > s.first_pos {
                return Err(Error::invalid(
                    name,
                    format!(
                        "replay start {} lies after its first row at {}",
                        s.replay_start, s.first_pos
                    ),
                ));
            }
            // The cached prefix is a property of the request, not of the chunk: an encoder replay
            // (docs/SPEC.md §3) recomputes rows inside the hit, so a replay chunk shorter than the replayed
            // window lies wholly below `cached_until`. Only the prompt (prefill) or the row itself
            // (decode: its own entry cannot be cached yet) bounds it.
            let cached_bound = match s.phase {
                Phase::Prefill { prompt_end, .. } => prompt_end,
                Phase::Decode => s.first_pos + s.len,
            };
            if s.cached_until > cached_bound {
                return Err(Error::invalid(
                    name,
                    match s.phase {
                        Phase::Prefill { prompt_end, .. } => format!(
                            "cached prefix {} ends after the prompt end {prompt_end}",
                            s.cached_until
                        ),
                        Phase::Decode => format!(
                            "cached prefix {} ends after its decode row {}",
                            s.cached_until, s.first_pos
                        ),
                    },
                ));
            }
            let kept_start = match s.phase {
                Phase::Decode => {
                    if s.len != 1 {
                        return Err(Error::invalid(
                            name,
                            format!("a decode step has one row, found {}", s.len),
                        ));
                    }
                    s.first_pos
                }
                Phase::Prefill {
                    prompt_end,
                    prefill_start,
                } => {
                    if s.first_pos + s.len > prompt_end {
                        return Err(Error::invalid(
                            name,
                            format!(
                                "prefill rows {}..{} run past the prompt end {prompt_end}",
                                s.first_pos,
                                s.first_pos + s.len
                            ),
                        ));
                    }
                    if prefill_start > s.first_pos {
                        return Err(Error::invalid(
                            name,
                            format!(
                                "prefill start {prefill_start} lies after the chunk start {}",
                                s.first_pos
                            ),
                        ));
                    }
                    if decoder_replay {
                        prompt_end.saturating_sub(w).max(prefill_start)
                    } else {
                        0
                    }
                }
            };
            for p in s.first_pos..s.first_pos + s.len {
                all.push(i, p, s.replay_start);
                if p >= kept_start {
                    kept_idx.push(all.len() - 1);
                    let floor = match s.phase {
                        Phase::Prefill { .. } if decoder_replay => s.replay_start.max(kept_start),
                        _ => s.replay_start,
                    };
                    kept.push(i, p, floor);
                }
            }
        }
        let trimmed = kept.len() != all.len();
        Ok(StepPlan {
            seqs: seqs.to_vec(),
            all,
            kept,
            kept_idx,
            cut_layer,
            trimmed,
            stair: vec![],
        })
    }

    /// Plans a step of the exact replay staircase (docs/SPEC.md §3 "the exact alternative";
    /// `replay::ReplayMode::Exact`): request `i` runs layer `l` on its rows at positions
    /// `≥ starts[i][l]`, whose window starts at `max(p − (window − 1), starts[i][l], replay_start)`.
    /// Every layer's compressor sees exactly the rows of its layer and no decoder rows are trimmed,
    /// so with `starts` from `replay::plan` every kept row sees the state a cold run would hold.
    ///
    /// `starts[i]` has one entry per layer, non-decreasing (a row must have run every layer below
    /// the ones it runs). A start at or past a request's last row leaves that layer without rows of
    /// the request in this step (a chunk before the layer's first row).
    ///
    /// Errors: those of [`StepPlan::new`]; [`Error::Invalid`] when `starts` does not give one
    /// non-decreasing list of `num_layers` starts per request.
    pub fn staircase(g: &Geometry, seqs: &[SeqStep], starts: &[Vec<usize>]) -> Result<StepPlan> {
        let mut plan = StepPlan::new(g, seqs, false)?;
        if starts.len() != seqs.len() {
            return Err(Error::invalid(
                "staircase starts",
                format!(
                    "one list per request: {} requests, found {}",
                    seqs.len(),
                    starts.len()
                ),
            ));
        }
        for (s, st) in seqs.iter().zip(starts) {
            if st.len() != g.num_layers || st.windows(2).any(|w| w[1] < w[0]) {
                return Err(Error::invalid(
                    format!("request {} staircase", s.req),
                    format!(
                        "expected {} non-decreasing layer starts, found {st:?}",
                        g.num_layers
                    ),
                ));
            }
        }
        plan.stair = (0..g.num_layers)
            .map(|l| {
                let mut set = RowSet::default();
                let mut idx = vec![];
                for i in 0..plan.all.len() {
                    let si = plan.all.seq[i];
                    let start = starts[si][l];
                    let p = plan.all.pos[i] as usize;
                    if p >= start {
                        set.push(si, p, plan.all.floor[i].max(start));
                        idx.push(i);
                    }
                }
                (set, idx)
            })
            .collect();
        Ok(plan)
    }

    /// For each row of `dst`'s row set, its index in `src`'s row set (`src ≤ dst`, a layer's rows
    /// are a subset of every earlier layer's); `None` when both layers run the same rows.
    pub fn select_between(&self, src: usize, dst: usize) -> Option<Vec<usize>> {
        if self.stair.is_empty() {
            let (ks, kd) = (src >= self.cut_layer, dst >= self.cut_layer);
            return (ks != kd && self.trimmed && !ks).then(|| self.kept_idx.clone());
        }
        let (a, b) = (&self.stair[src].1, &self.stair[dst].1);
        if a == b {
            return None;
        }
        let mut at = vec![usize::MAX; self.all.len()];
        for (j, &i) in a.iter().enumerate() {
            at[i] = j;
        }
        Some(b.iter().map(|&i| at[i]).collect())
    }

    /// Rows the last layer runs: the rows of the step's final hidden state.
    pub fn output_rows(&self) -> &RowSet {
        match self.stair.last() {
            Some((set, _)) => set,
            None => &self.kept,
        }
    }

    /// Rows a layer's attention work runs on.
    pub fn rows_for(&self, layer: usize) -> &RowSet {
        if let Some((set, _)) = self.stair.get(layer) {
            return set;
        }
        if layer >= self.cut_layer {
            &self.kept
        } else {
            &self.all
        }
    }

    /// Rows of the whole step.
    pub fn total_rows(&self) -> usize {
        self.all.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefill(req: RequestId, first: usize, len: usize, end: usize) -> SeqStep {
        SeqStep {
            req,
            first_pos: first,
            len,
            phase: Phase::Prefill {
                prompt_end: end,
                prefill_start: 0,
            },
            replay_start: 0,
            cached_until: first,
        }
    }

    #[test]
    fn decoder_replay_keeps_the_last_window_rows_and_every_decode_row() {
        let g = Geometry::embedded();
        assert_eq!(g.window, 128);
        let dec = SeqStep {
            req: 3,
            first_pos: 500,
            len: 1,
            phase: Phase::Decode,
            replay_start: 0,
            cached_until: 500,
        };
        // Lengths around the window: 127, 128, 129, 300.
        for len in [1usize, 127, 128, 129, 300] {
            let p = StepPlan::new(&g, &[prefill(1, 0, len, len), dec], true).unwrap();
            assert_eq!(p.cut_layer, 20);
            assert_eq!(p.all.len(), len + 1);
            let keep = len.min(128);
            assert_eq!(p.kept.len(), keep + 1);
            assert_eq!(p.trimmed, len > 128);
            assert_eq!(p.kept.pos[0] as usize, len - keep);
            assert!(p.kept.floor[..keep].iter().all(|&f| f == len - keep));
            assert_eq!(*p.kept.pos.last().unwrap(), 500);
            assert_eq!(*p.kept.floor.last().unwrap(), 0);
            assert_eq!(p.kept.spans, vec![(0, 0..keep), (1, keep..keep + 1)]);
            for (k, &i) in p.kept_idx.iter().enumerate() {
                assert_eq!(p.all.pos[i], p.kept.pos[k]);
            }
            let off = StepPlan::new(&g, &[prefill(1, 0, len, len), dec], false).unwrap();
            assert_eq!(off.kept, off.all);
            assert!(!off.trimmed);
        }
    }

    #[test]
    fn chunked_prompt_keeps_rows_only_in_its_last_window() {
        let g = Geometry::embedded();
        // Prompt of 1000 in chunks of 400: kept rows are 872..1000.
        let a = StepPlan::new(&g, &[prefill(1, 0, 400, 1000)], true).unwrap();
        assert!(a.kept.is_empty());
        let b = StepPlan::new(&g, &[prefill(1, 800, 200, 1000)], true).unwrap();
        assert_eq!(b.kept.pos[0], 872);
        assert_eq!(b.kept.floor[0], 872);
        // Encoder replay after a miss: rows from H − 128 = 872, global KV cached below 1000.
        let mut s = prefill(1, 872, 300, 1172);
        s.replay_start = 872;
        s.cached_until = 1000;
        s.phase = Phase::Prefill {
            prompt_end: 1172,
            prefill_start: 872,
        };
        let c = StepPlan::new(&g, &[s], true).unwrap();
        assert_eq!(c.all.floor[0], 872);
        assert_eq!(c.kept.pos[0], 1044);
        assert_eq!(c.kept.floor[0], 1044);
    }

    #[test]
    fn staircase_rows_follow_the_replay_planner() {
        use crate::replay::{plan, ReplayConfig, ReplayMode};
        let g = Geometry::embedded();
        // A hit of 5,300 tokens (past the 40 × 128 staircase), 300 new tokens, in two chunks.
        let (h, i) = (5300usize, 5600usize);
        let rp = plan(
            &ReplayConfig::from_geometry(&g, ReplayMode::Exact),
            i,
            h,
            false,
        )
        .unwrap();
        let starts: Vec<usize> = rp.layers.iter().map(|l| l.rows.start).collect();
        assert_eq!(starts[0], h - 40 * 128);
        assert_eq!(starts[39], h - 128);
        let mut ran = vec![0usize; g.num_layers];
        for (first, len) in [(starts[0], 2000), (starts[0] + 2000, i - starts[0] - 2000)] {
            let mut s = prefill(1, first, len, i);
            s.replay_start = starts[0];
            let p = StepPlan::staircase(&g, &[s], std::slice::from_ref(&starts)).unwrap();
            assert!(!p.trimmed);
            for l in 0..g.num_layers {
                let r = p.rows_for(l);
                ran[l] += r.len();
                if let Some(&p0) = r.pos.first() {
                    assert!(p0 as usize >= starts[l]);
                    assert!(r.floor.iter().all(|&f| f == starts[l]), "layer {l}");
                }
                if l > 0 {
                    // Each layer's rows are a subset of the previous layer's, mapped by position.
                    if let Some(idx) = p.select_between(l - 1, l) {
                        let prev = p.rows_for(l - 1);
                        for (k, &j) in idx.iter().enumerate() {
                            assert_eq!(prev.pos[j], r.pos[k]);
                        }
                    }
                }
            }
            assert_eq!(p.output_rows(), p.rows_for(39));
        }
        for (l, (n, run)) in ran.iter().zip(&rp.layers).enumerate() {
            assert_eq!(*n, run.rows.len(), "layer {l}");
        }
        // Starts must be one non-decreasing list per request and layer.
        let s = prefill(1, 0, 10, 10);
        let mut bad = starts.clone();
        bad[5] = bad[4] - 1;
        assert!(StepPlan::staircase(&g, &[s], &[bad]).is_err());
        assert!(StepPlan::staircase(&g, &[s], &[starts[..39].to_vec()]).is_err());
        assert!(StepPlan::staircase(&g, &[s], &[]).is_err());
    }

    #[test]
    fn bad_steps_are_errors() {
        let g = Geometry::embedded();
        let mut d = prefill(1, 0, 2, 2);
        d.phase = Phase::Decode;
        assert!(StepPlan::new(&g, &[d], true).is_err());
        assert!(StepPlan::new(&g, &[prefill(1, 0, 0, 5)], true).is_err());
        assert!(StepPlan::new(&g, &[prefill(1, 0, 6, 5)], true).is_err());
        assert!(StepPlan::new(&g, &[prefill(1, 0, 2, 5), prefill(1, 2, 2, 5)], true).is_err());
        let mut r = prefill(1, 10, 2, 20);
        r.replay_start = 11;
        let e = StepPlan::new(&g, &[r], true).unwrap_err();
        assert!(e.to_string().contains("replay start 11"), "{e}");
    }
}
