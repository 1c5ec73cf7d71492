//! SWA bounded replay planning (docs/SPEC.md §3; vLLM `swa_bounded_replay`).
//!
//! Given a prompt of `I` tokens whose first `H` tokens hit the prefix cache (global KV found in HBM
//! or on SSD) and whether the SWA snapshot at `H` is present, a [`ReplayPlan`] says, for one prefill
//! step, which rows every layer runs, the window start of every row, which tokens' global entries
//! are written, and which cached entries a replay recomputes but must not rewrite.
//!
//! Modes ([`ReplayMode`]):
//! - `Bounded` (default): hits of ≤ `window` tokens are not used. With the snapshot present the
//!   encoder runs `[H, I)` (no replay); with it missing the encoder replays `[H − 128, H)` plus the
//!   suffix, and every such row's window starts at `max(p − 127, 0, H − 128)`. The decoder layers
//!   run only the last `min(rows, 128)` rows, whose window starts at the first kept row; the KV
//!   sources still write global KV for every new token.
//! - `Exact`: the `L × 128` staircase for comparison — layer `k` of `L` runs from
//!   `H − (L − k)·128`, which rebuilds every layer's window exactly; no decoder trimming. Skipped
//!   when the snapshot holds every layer's window (the V4 design).
//! - `Off`: the encoder as in `Bounded`, the decoder layers on every row.
//!
//! Decode rows are always kept; this planner covers prefill steps.
//!
//! [`step`] turns one engine step (prefill chunks and decode tokens of many requests) into row
//! sets: the decoder's kept rows (decoder bounded replay), the encoder replay's window floors and
//! the exact staircase's per-layer rows. Every replay decision of the tree is made in this module;
//! the engine (`crate::backend`) only runs the rows it is given.

use crate::error::{Error, Result};
use crate::geometry::{Geometry, Role};
use serde::Serialize;
use std::ops::Range;

pub mod step;
pub use step::{Phase, RowSet, SeqStep, StepPlan};

/// How a prefix hit rebuilds SWA state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayMode {
    /// SWA bounded replay (docs/SPEC.md §3, the default).
    Bounded,
    /// The exact `L × window` staircase.
    Exact,
    /// No decoder trimming (decoder layers run every row); encoder as `Bounded`.
    Off,
}

impl ReplayMode {
    /// Parses `bounded`, `exact` or `off`.
    pub fn from_name(s: &str) -> Result<ReplayMode> {
        match s {
            "bounded" => Ok(ReplayMode::Bounded),
            "exact" => Ok(ReplayMode::Exact),
            "off" => Ok(ReplayMode::Off),
            _ => Err(Error::invalid(
                "replay mode",
                format!("unknown mode `{s}` (expected bounded, exact or off)"),
            )),
        }
    }
}

/// Which layers' SWA windows a snapshot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotScope {
    /// The encoder layers (V4.1: decoder SWA is never persisted).
    Encoder,
    /// Every layer (V4).
    AllLayers,
}

/// The model facts the planner needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplayConfig {
    /// Replay mode.
    pub mode: ReplayMode,
    /// SWA window (128).
    pub window: usize,
    /// Layers in the stack.
    pub num_layers: usize,
    /// First decoder layer (layers below it are the encoder). Equal to `num_layers` for a model
    /// without a CED split.
    pub first_decoder_layer: usize,
    /// What a snapshot holds.
    pub snapshot_scope: SnapshotScope,
    /// `(layer, ratio)` of every KV source.
    pub kv_sources: Vec<(usize, usize)>,
}

impl ReplayConfig {
    /// The CSA2 configuration of `g`: encoder = layers below `first_decoder_layer`, encoder-only
    /// snapshots, KV sources = the Full layers.
    pub fn from_geometry(g: &Geometry, mode: ReplayMode) -> ReplayConfig {
        ReplayConfig {
            mode,
            window: g.window,
            num_layers: g.num_layers,
            first_decoder_layer: g.first_decoder_layer,
            snapshot_scope: SnapshotScope::Encoder,
            kv_sources: g.layers_with(Role::Full).map(|l| (l.id, l.ratio)).collect(),
        }
    }
}

/// What one layer does in this step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerRun {
    /// Rows (absolute positions) the layer runs.
    pub rows: Range<usize>,
    /// The SWA window of row `p` starts at `max(p − (window − 1), window_floor)`.
    pub window_floor: usize,
}

/// The plan of one prefill step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplayPlan {
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Prefix tokens adopted from the cache (0 when the hit is too short to use).
    pub hit_used: usize,
    /// Whether the SWA snapshot was used (no replay of the hit's window).
    pub snapshot_used: bool,
    /// Per layer, in order.
    pub layers: Vec<LayerRun>,
    /// Tokens whose global KV entries are computed and written: `[hit_used, prompt_len)`.
    pub kv_write: Range<usize>,
    /// Tokens recomputed although their global entries are cached: read them, never rewrite them.
    pub protected: Range<usize>,
    /// Per KV source `(layer, entries)`: the cached compressed entries the replay must not rewrite.
    pub protected_entries: Vec<(usize, Range<usize>)>,
    /// The half-finished compressor group at `hit_used` must come from saved state (the hit ends
    /// inside a group and nothing before it is replayed).
    pub needs_compressor_state: bool,
    window: usize,
}

impl ReplayPlan {
    /// Window start of row `p` in `layer`: `max(p − (window − 1), floor)`.
    pub fn window_start(&self, layer: usize, p: usize) -> usize {
        p.saturating_sub(self.window - 1)
            .max(self.layers[layer].window_floor)
    }
    /// Rows the first layer recomputes inside the hit (the replay).
    pub fn replayed_tokens(&self) -> usize {
        self.layers
            .first()
            .map_or(0, |l| self.hit_used.saturating_sub(l.rows.start))
    }
    /// Σ rows over layers in `range` (work in token-layers).
    pub fn token_layers(&self, range: Range<usize>) -> usize {
        self.layers[range].iter().map(|l| l.rows.len()).sum()
    }
}

/// Plans one prefill step: `prompt_len` tokens, a prefix hit of `hit_tokens`, snapshot present or not.
///
/// A hit covering the whole prompt is shortened by one token (one row must run to produce logits).
///
/// Errors: [`Error::Invalid`] when `prompt_len` is 0, `hit_tokens > prompt_len`, the window is 0 or
/// `first_decoder_layer > num_layers`.
pub fn plan(
    cfg: &ReplayConfig,
    prompt_len: usize,
    hit_tokens: usize,
    snapshot: bool,
) -> Result<ReplayPlan> {
    let (w, l, fd) = (cfg.window, cfg.num_layers, cfg.first_decoder_layer);
    if prompt_len == 0 {
        return Err(Error::invalid("prompt_len", "must be > 0, found 0"));
    }
    if hit_tokens > prompt_len {
        return Err(Error::invalid(
            "hit_tokens",
            format!("{hit_tokens} exceeds the prompt of {prompt_len} tokens"),
        ));
    }
    if w == 0 || fd > l {
        return Err(Error::invalid(
            "replay config",
            format!("window {w} must be > 0 and first_decoder_layer {fd} ≤ num_layers {l}"),
        ));
    }
    let i = prompt_len;
    // Hits of ≤ window tokens are not used (docs/SPEC.md §3); a full hit keeps one row to compute.
    let h = if hit_tokens > w {
        hit_tokens.min(i - 1)
    } else {
        0
    };
    let enc_has_state = snapshot && h > 0;
    let all_have_state = enc_has_state && cfg.snapshot_scope == SnapshotScope::AllLayers;
    let mut layers = Vec::with_capacity(l);
    match cfg.mode {
        ReplayMode::Exact if !all_have_state => {
            for k in 0..l {
                let start = if h == 0 {
                    0
                } else {
                    h.saturating_sub((l - k) * w)
                };
                layers.push(LayerRun {
                    rows: start..i,
                    window_floor: start,
                });
            }
        }
        _ => {
            let (enc_start, enc_floor) = if h == 0 {
                (0, 0)
            } else if enc_has_state {
                (h, 0)
            } else {
                (h - w, h - w)
            };
            for _ in 0..fd {
                layers.push(LayerRun {
                    rows: enc_start..i,
                    window_floor: enc_floor,
                });
            }
            for _ in fd..l {
                let run = match cfg.mode {
                    ReplayMode::Bounded if !all_have_state => {
                        let s = i.saturating_sub(w).max(enc_start);
                        LayerRun {
                            rows: s..i,
                            window_floor: s,
                        }
                    }
                    _ => LayerRun {
                        rows: enc_start..i,
                        window_floor: if all_have_state { 0 } else { enc_start },
                    },
                };
                layers.push(run);
            }
        }
    }
    let first = layers.first().map_or(h, |r| r.rows.start);
    let protected = first.min(h)..h;
    let protected_entries = cfg
        .kv_sources
        .iter()
        .map(|&(layer, m)| (layer, protected.start / m..h / m))
        .collect();
    let needs_compressor_state =
        first >= h && h > 0 && cfg.kv_sources.iter().any(|&(_, m)| m > 1 && h % m != 0);
    Ok(ReplayPlan {
        prompt_len: i,
        hit_used: h,
        snapshot_used: h > 0 && first >= h,
        layers,
        kv_write: h..i,
        protected,
        protected_entries,
        needs_compressor_state,
        window: w,
    })
}

#[cfg(test)]
mod tests;
