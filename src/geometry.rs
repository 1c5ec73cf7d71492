//! Model geometry: a Hugging Face `config.json` → the per-layer CSA2 plan.
//!
//! Rules: docs/SPEC.md §0 (roles) and §2 (RoPE), matching vLLM 0.33
//! `vllm/transformers_utils/configs/deepseek_v41.py` and the layer-mode derivation of the
//! reference (`_active_source`): a compressed layer L uses `kv_source = max{s ∈ kv_source_layer_ids, s ≤ L}`
//! and `index_source = max{s ∈ index_source_layer_ids, s ≤ L}`, both with the same ratio as L.
//! Only the first `num_hidden_layers` entries of `compress_ratios` are backbone layers (the rest
//! belong to the MTP / draft layers).

pub mod consts;

use crate::error::{Error, Result};
use crate::formats::KvScheme;
use serde::Serialize;
use serde_json::Value;

/// The released DeepSeek-V4.1-Flash `config.json`, compiled in as the default geometry.
pub const EMBEDDED_CONFIG: &str = include_str!("../assets/deepseek_v41_flash_config.json");

/// What one attention layer does in CSA2 (docs/SPEC.md §0 table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Ratio 0: sliding-window attention only; no global KV.
    SwaOnly,
    /// A KV source: runs the compressor, owns the main-KV and index-K caches, runs its own indexer.
    Full,
    /// An index source that is not a KV source: own indexer Q and head weights over the index K of its
    /// KV source, its own top-k (inside the candidate pool when it reads one).
    Reindex,
    /// Neither: reads the main KV of its KV source and the top-k of its index source.
    Reuse,
}

impl Role {
    /// The snake_case name used in JSON and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::SwaOnly => "swa_only",
            Role::Full => "full",
            Role::Reindex => "reindex",
            Role::Reuse => "reuse",
        }
    }
}

/// How a layer takes part in the hierarchical candidate pool (docs/SPEC.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CandidateUse {
    /// Does not touch the pool.
    None,
    /// The candidate source (layer 20): publishes block scores → the pool.
    Writes,
    /// A Reindex layer scoring only inside the pool of its KV source.
    Reads,
}

/// YaRN frequency scaling (compressed layers only).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Yarn {
    /// Context extension factor (16).
    pub factor: f64,
    /// Pre-extension context (65536).
    pub original_max_position: f64,
    /// High-frequency boundary in rotations (32).
    pub beta_fast: f64,
    /// Low-frequency boundary in rotations (1).
    pub beta_slow: f64,
}

/// Rotary embedding of one layer: GPT-J interleaved pairs on the last `rope_dim` dims.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RopeParams {
    /// Base θ (10000 for ratio-0 layers, 160000 for compressed layers).
    pub theta: f64,
    /// Rotated dims (64), always the trailing dims of a head.
    pub rope_dim: usize,
    /// YaRN scaling, present on compressed layers; no mscale (docs/SPEC.md §2).
    pub yarn: Option<Yarn>,
}

impl RopeParams {
    /// Per-pair inverse frequencies `freq_i`, i < rope_dim/2, with YaRN applied when present
    /// (docs/SPEC.md §2.2: ramp between `floor(corr(beta_fast))` and `ceil(corr(beta_slow))`).
    pub fn inv_freqs(&self) -> Vec<f64> {
        let d = self.rope_dim as f64;
        let half = self.rope_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| self.theta.powf(-(2.0 * i as f64) / d))
            .collect();
        let Some(y) = self.yarn else { return base };
        let corr = |rot: f64| {
            d * (y.original_max_position / (2.0 * std::f64::consts::PI * rot)).ln()
                / (2.0 * self.theta.ln())
        };
        let low = corr(y.beta_fast).floor().max(0.0);
        let mut high = corr(y.beta_slow).ceil().min(d - 1.0);
        if high == low {
            high += 0.001;
        }
        base.iter()
            .enumerate()
            .map(|(i, &f)| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                f / y.factor * ramp + f * (1.0 - ramp)
            })
            .collect()
    }
}

/// The plan of one backbone layer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerPlan {
    /// Layer index, 0-based.
    pub id: usize,
    /// CSA2 role.
    pub role: Role,
    /// Compression ratio m (0 = no global branch).
    pub ratio: usize,
    /// Layer whose main-KV cache this layer attends over (None for SWA-only).
    pub kv_source: Option<usize>,
    /// Layer whose top-k this layer uses (itself for Full/Reindex, None for SWA-only).
    pub index_source: Option<usize>,
    /// Candidate-pool participation.
    pub candidates: CandidateUse,
    /// Rotary parameters.
    pub rope: RopeParams,
    /// Encoder (prefill-side) or decoder half of the CED stack.
    pub encoder: bool,
}

/// The full model geometry needed by the attention path.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Geometry {
    /// Backbone layers.
    pub num_layers: usize,
    /// Model width d (5120).
    pub hidden_size: usize,
    /// Query heads (64).
    pub num_heads: usize,
    /// Latent / head dim (512) = nope + rope.
    pub head_dim: usize,
    /// Rotated dims at the end of each head (64).
    pub rope_dim: usize,
    /// q-LoRA rank (1280).
    pub q_lora_rank: usize,
    /// Output LoRA rank per group (1024).
    pub o_lora_rank: usize,
    /// Output groups (8).
    pub o_groups: usize,
    /// RMSNorm epsilon (1e-20).
    pub rms_norm_eps: f64,
    /// SWA window in tokens (128).
    pub window: usize,
    /// Indexer heads (32).
    pub index_heads: usize,
    /// Indexer head dim (128).
    pub index_head_dim: usize,
    /// Top-k of the indexer (512).
    pub index_topk: usize,
    /// Candidate source layer (20), if any.
    pub candidate_source: Option<usize>,
    /// Blocks kept in the candidate pool (2048).
    pub candidate_topk_blocks: usize,
    /// Entries per candidate block (8).
    pub candidate_block_size: usize,
    /// Hyper-connection streams (4).
    pub hc_mult: usize,
    /// Sinkhorn iterations (20).
    pub hc_sinkhorn_iters: usize,
    /// Sinkhorn epsilon (1e-6).
    pub hc_eps: f64,
    /// Maximum context (1,048,576).
    pub max_position: usize,
    /// First decoder layer of the CED split (num_layers / 2 = 20).
    pub first_decoder_layer: usize,
    /// Per-layer plans.
    pub layers: Vec<LayerPlan>,
}

struct Cfg<'a> {
    root: &'a serde_json::Map<String, Value>,
    prefix: &'static str,
}

impl<'a> Cfg<'a> {
    fn path(&self, k: &str) -> String {
        format!("{}{}", self.prefix, k)
    }
    fn get(&self, k: &str) -> Result<&'a Value> {
        self.root.get(k).ok_or_else(|| Error::ConfigMissing {
            field: self.path(k),
        })
    }
    fn bad(&self, k: &str, reason: impl Into<String>) -> Error {
        Error::ConfigInvalid {
            field: self.path(k),
            reason: reason.into(),
        }
    }
    fn uint(&self, k: &str) -> Result<usize> {
        let v = self.get(k)?;
        v.as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.bad(k, format!("expected a non-negative integer, found {v}")))
    }
    fn uint_or(&self, k: &str, default: usize) -> Result<usize> {
        if self.root.contains_key(k) {
            self.uint(k)
        } else {
            Ok(default)
        }
    }
    fn positive(&self, k: &str) -> Result<usize> {
        let x = self.uint(k)?;
        if x == 0 {
            return Err(self.bad(k, "must be > 0, found 0"));
        }
        Ok(x)
    }
    fn float(&self, k: &str) -> Result<f64> {
        let v = self.get(k)?;
        let x = v
            .as_f64()
            .ok_or_else(|| self.bad(k, format!("expected a number, found {v}")))?;
        if !x.is_finite() {
            return Err(self.bad(k, format!("must be finite, found {x}")));
        }
        Ok(x)
    }
    fn uint_list(&self, k: &str) -> Result<Vec<usize>> {
        let v = self.get(k)?;
        let arr = v
            .as_array()
            .ok_or_else(|| self.bad(k, format!("expected a list, found {v}")))?;
        arr.iter()
            .enumerate()
            .map(|(i, e)| {
                e.as_u64().map(|x| x as usize).ok_or_else(|| {
                    self.bad(
                        k,
                        format!("entry {i} must be a non-negative integer, found {e}"),
                    )
                })
            })
            .collect()
    }
}

fn strictly_increasing(cfg: &Cfg, k: &str, ids: &[usize], n: usize) -> Result<()> {
    for (i, &id) in ids.iter().enumerate() {
        if id >= n {
            return Err(cfg.bad(k, format!("layer id {id} is out of range 0..{n}")));
        }
        if i > 0 && ids[i - 1] >= id {
            return Err(cfg.bad(
                k,
                format!(
                    "ids must be strictly increasing, found {} then {id}",
                    ids[i - 1]
                ),
            ));
        }
    }
    Ok(())
}

impl Geometry {
    /// The geometry of the released DeepSeek-V4.1-Flash (the embedded config).
    pub fn embedded() -> Geometry {
        Geometry::from_json_str(EMBEDDED_CONFIG).expect("embedded config is valid")
    }

    /// Reads a geometry from a file path.
    ///
    /// Errors: [`Error::Io`] when the file cannot be read, then as [`Geometry::from_json_str`].
    pub fn from_path(path: &std::path::Path) -> Result<Geometry> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Geometry::from_json_str(&text)
    }

    /// Parses a Hugging Face `config.json` (fields under `text_config` or at top level).
    ///
    /// Errors: [`Error::ConfigJson`] for non-JSON input, [`Error::ConfigMissing`] and
    /// [`Error::ConfigInvalid`] naming the field and the bad value otherwise. Never panics.
    pub fn from_json_str(text: &str) -> Result<Geometry> {
        let v: Value = serde_json::from_str(text).map_err(|e| Error::ConfigJson(e.to_string()))?;
        let top = v.as_object().ok_or_else(|| {
            Error::ConfigJson(format!("top level must be an object, found {}", kind(&v)))
        })?;
        let cfg = match top.get("text_config") {
            Some(Value::Object(m)) => Cfg {
                root: m,
                prefix: "text_config.",
            },
            Some(other) => {
                return Err(Error::ConfigInvalid {
                    field: "text_config".into(),
                    reason: format!("expected an object, found {}", kind(other)),
                })
            }
            None => Cfg {
                root: top,
                prefix: "",
            },
        };
        Geometry::from_cfg(&cfg)
    }

    fn from_cfg(cfg: &Cfg) -> Result<Geometry> {
        let n = cfg.positive("num_hidden_layers")?;
        let hidden_size = cfg.positive("hidden_size")?;
        let num_heads = cfg.positive("num_attention_heads")?;
        let head_dim = cfg.positive("head_dim")?;
        let rope_dim = cfg.positive("qk_rope_head_dim")?;
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(cfg.bad(
                "qk_rope_head_dim",
                format!("must be even and ≤ head_dim {head_dim}, found {rope_dim}"),
            ));
        }
        let kv_heads = cfg.uint_or("num_key_value_heads", 1)?;
        if kv_heads != 1 {
            return Err(cfg.bad(
                "num_key_value_heads",
                format!("CSA2 is MQA on one latent: expected 1, found {kv_heads}"),
            ));
        }
        let q_lora_rank = cfg.positive("q_lora_rank")?;
        let o_lora_rank = cfg.positive("o_lora_rank")?;
        let o_groups = cfg.positive("o_groups")?;
        if num_heads % o_groups != 0 {
            return Err(cfg.bad(
                "o_groups",
                format!("must divide num_attention_heads {num_heads}, found {o_groups}"),
            ));
        }
        let rms_norm_eps = cfg.float("rms_norm_eps")?;
        if rms_norm_eps < 0.0 {
            return Err(cfg.bad("rms_norm_eps", format!("must be ≥ 0, found {rms_norm_eps}")));
        }
        let window = cfg.positive("sliding_window")?;
        let rope_theta = cfg.float("rope_theta")?;
        let compress_theta = cfg.float("compress_rope_theta")?;
        for (k, t) in [
            ("rope_theta", rope_theta),
            ("compress_rope_theta", compress_theta),
        ] {
            if t <= 1.0 {
                return Err(cfg.bad(k, format!("must be > 1, found {t}")));
            }
        }
        let yarn = match cfg.root.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => {
                let sub = Cfg {
                    root: m,
                    prefix: if cfg.prefix.is_empty() {
                        "rope_scaling."
                    } else {
                        "text_config.rope_scaling."
                    },
                };
                let y = Yarn {
                    factor: sub.float("factor")?,
                    original_max_position: sub.float("original_max_position_embeddings")?,
                    beta_fast: sub.float("beta_fast")?,
                    beta_slow: sub.float("beta_slow")?,
                };
                if y.factor < 1.0 {
                    return Err(sub.bad("factor", format!("must be ≥ 1, found {}", y.factor)));
                }
                if y.original_max_position <= 0.0 || y.beta_fast <= 0.0 || y.beta_slow <= 0.0 {
                    return Err(sub.bad(
                        "beta_fast",
                        "original_max_position_embeddings, beta_fast and beta_slow must be > 0",
                    ));
                }
                Some(y)
            }
            Some(other) => {
                return Err(cfg.bad(
                    "rope_scaling",
                    format!("expected an object or null, found {}", kind(other)),
                ))
            }
        };
        let ratios_all = cfg.uint_list("compress_ratios")?;
        if ratios_all.len() < n {
            return Err(cfg.bad(
                "compress_ratios",
                format!(
                    "has {} entries, fewer than num_hidden_layers = {n}",
                    ratios_all.len()
                ),
            ));
        }
        let ratios = &ratios_all[..n];
        for (l, &r) in ratios.iter().enumerate() {
            if r > 1024 {
                return Err(cfg.bad(
                    "compress_ratios",
                    format!("entry {l} = {r} is not a plausible ratio (0..=1024)"),
                ));
            }
        }
        let kv_src = cfg.uint_list("kv_source_layer_ids")?;
        strictly_increasing(cfg, "kv_source_layer_ids", &kv_src, n)?;
        let ix_src = cfg.uint_list("index_source_layer_ids")?;
        strictly_increasing(cfg, "index_source_layer_ids", &ix_src, n)?;
        for &s in &kv_src {
            if ratios[s] == 0 {
                return Err(cfg.bad(
                    "kv_source_layer_ids",
                    format!("layer {s} has compress ratio 0 and cannot be a KV source"),
                ));
            }
            if !ix_src.contains(&s) {
                return Err(cfg.bad(
                    "index_source_layer_ids",
                    format!("KV source layer {s} runs its own indexer and must be listed"),
                ));
            }
        }
        for &s in &ix_src {
            if ratios[s] == 0 {
                return Err(cfg.bad(
                    "index_source_layer_ids",
                    format!("layer {s} has compress ratio 0 and cannot be an index source"),
                ));
            }
        }
        let index_heads = cfg.positive("index_n_heads")?;
        let index_head_dim = cfg.positive("index_head_dim")?;
        if rope_dim > index_head_dim {
            return Err(cfg.bad(
                "index_head_dim",
                format!("must be ≥ qk_rope_head_dim {rope_dim}, found {index_head_dim}"),
            ));
        }
        let index_topk = cfg.positive("index_topk")?;
        let candidate_source = match cfg.root.get("candidate_source_layer_id") {
            None | Some(Value::Null) => None,
            Some(_) => Some(cfg.uint("candidate_source_layer_id")?),
        };
        let candidate_topk_blocks = cfg.uint_or("candidate_topk_blocks", 2048)?;
        let candidate_block_size = cfg.uint_or("candidate_block_size", 8)?;
        if let Some(c) = candidate_source {
            if c >= n {
                return Err(cfg.bad(
                    "candidate_source_layer_id",
                    format!("layer id {c} is out of range 0..{n}"),
                ));
            }
            if !kv_src.contains(&c) {
                return Err(cfg.bad(
                    "candidate_source_layer_id",
                    format!("layer {c} is not a Full layer (not in kv_source_layer_ids)"),
                ));
            }
            if candidate_topk_blocks == 0 || candidate_block_size == 0 {
                return Err(cfg.bad(
                    "candidate_topk_blocks",
                    "candidate_topk_blocks and candidate_block_size must be > 0",
                ));
            }
            if candidate_topk_blocks * candidate_block_size < index_topk {
                return Err(cfg.bad(
                    "candidate_topk_blocks",
                    format!("pool of {candidate_topk_blocks} × {candidate_block_size} entries is smaller than index_topk {index_topk}"),
                ));
            }
        }
        let hc_mult = cfg.uint_or("hc_mult", 4)?;
        let hc_sinkhorn_iters = cfg.uint_or("hc_sinkhorn_iters", 20)?;
        let hc_eps = if cfg.root.contains_key("hc_eps") {
            cfg.float("hc_eps")?
        } else {
            1e-6
        };
        let max_position = cfg.positive("max_position_embeddings")?;

        let mut layers = Vec::with_capacity(n);
        for (l, &ratio) in ratios.iter().enumerate() {
            let encoder = l < n / 2;
            if ratio == 0 {
                layers.push(LayerPlan {
                    id: l,
                    role: Role::SwaOnly,
                    ratio,
                    kv_source: None,
                    index_source: None,
                    candidates: CandidateUse::None,
                    rope: RopeParams {
                        theta: rope_theta,
                        rope_dim,
                        yarn: None,
                    },
                    encoder,
                });
                continue;
            }
            let kv = kv_src
                .iter()
                .copied()
                .filter(|&s| s <= l)
                .max()
                .ok_or_else(|| {
                    cfg.bad(
                        "kv_source_layer_ids",
                        format!(
                            "layer {l} has compress ratio {ratio} but no KV source at or below it"
                        ),
                    )
                })?;
            if ratios[kv] != ratio {
                return Err(cfg.bad(
                    "kv_source_layer_ids",
                    format!(
                        "layer {l} (ratio {ratio}) would read KV source {kv} of ratio {}",
                        ratios[kv]
                    ),
                ));
            }
            let ix = ix_src.iter().copied().filter(|&s| s <= l).max().ok_or_else(|| {
                cfg.bad("index_source_layer_ids", format!("layer {l} has compress ratio {ratio} but no index source at or below it"))
            })?;
            if ratios[ix] != ratio {
                return Err(cfg.bad(
                    "index_source_layer_ids",
                    format!(
                        "layer {l} (ratio {ratio}) would read index source {ix} of ratio {}",
                        ratios[ix]
                    ),
                ));
            }
            let role = if kv == l {
                Role::Full
            } else if ix == l {
                Role::Reindex
            } else {
                Role::Reuse
            };
            let candidates = match (candidate_source, role) {
                (Some(c), Role::Full) if c == l => CandidateUse::Writes,
                (Some(c), Role::Reindex) if c == kv => CandidateUse::Reads,
                _ => CandidateUse::None,
            };
            layers.push(LayerPlan {
                id: l,
                role,
                ratio,
                kv_source: Some(kv),
                index_source: Some(ix),
                candidates,
                rope: RopeParams {
                    theta: compress_theta,
                    rope_dim,
                    yarn,
                },
                encoder,
            });
        }
        Ok(Geometry {
            num_layers: n,
            hidden_size,
            num_heads,
            head_dim,
            rope_dim,
            q_lora_rank,
            o_lora_rank,
            o_groups,
            rms_norm_eps,
            window,
            index_heads,
            index_head_dim,
            index_topk,
            candidate_source,
            candidate_topk_blocks,
            candidate_block_size,
            hc_mult,
            hc_sinkhorn_iters,
            hc_eps,
            max_position,
            first_decoder_layer: n / 2,
            layers,
        })
    }

    /// Layers of a given role, in order.
    pub fn layers_with(&self, role: Role) -> impl Iterator<Item = &LayerPlan> {
        self.layers.iter().filter(move |l| l.role == role)
    }

    /// Global (compressed) KV bytes per original token in a layout: Σ over Full layers of
    /// (main record + index record) / ratio. 890 for the released config in NVFP4 (docs/SPEC.md §0).
    pub fn global_kv_bytes_per_token(&self, layout: KvScheme) -> f64 {
        let rec = (layout.main_record_bytes() + layout.index_record_bytes()) as f64;
        self.layers_with(Role::Full)
            .map(|l| rec / l.ratio as f64)
            .sum()
    }

    /// Fixed SWA bytes of one live request: every layer keeps `window` token records.
    pub fn swa_bytes_per_request(&self, layout: KvScheme) -> usize {
        self.num_layers * self.window * layout.swa_record_bytes()
    }

    /// How many concurrent sessions of `context` tokens fit in `gpu_bytes − weight_bytes` of memory
    /// in a layout (global KV at its per-token rate plus one SWA state each). Zero if nothing fits.
    pub fn sessions_that_fit(&self, layout: KvScheme, free_bytes: f64, context: usize) -> u64 {
        let per = self.global_kv_bytes_per_token(layout) * context as f64
            + self.swa_bytes_per_request(layout) as f64;
        if free_bytes <= 0.0 || per <= 0.0 {
            return 0;
        }
        (free_bytes / per).floor() as u64
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_roles() {
        let g = Geometry::embedded();
        assert_eq!(g.num_layers, 40);
        let ids = |r| g.layers_with(r).map(|l| l.id).collect::<Vec<_>>();
        assert_eq!(ids(Role::Full), vec![2, 8, 14, 20]);
        assert_eq!(ids(Role::Reindex), vec![24, 28, 32, 36]);
        assert_eq!(ids(Role::SwaOnly), vec![0, 1]);
        assert_eq!(ids(Role::Reuse).len(), 30);
        assert_eq!(g.layers[5].kv_source, Some(2));
        assert_eq!(g.layers[27].kv_source, Some(20));
        assert_eq!(g.layers[27].index_source, Some(24));
        assert_eq!(g.layers[20].candidates, CandidateUse::Writes);
        assert_eq!(g.layers[24].candidates, CandidateUse::Reads);
        assert_eq!(g.layers[8].candidates, CandidateUse::None);
        assert_eq!(g.global_kv_bytes_per_token(KvScheme::CSA2), 890.0);
        assert_eq!(g.global_kv_bytes_per_token(KvScheme::MXFP8), 1490.0);
        assert_eq!(g.global_kv_bytes_per_token(KvScheme::LAUNCH_DAY), 1790.0);
        assert_eq!(g.swa_bytes_per_request(KvScheme::CSA2), 40 * 128 * 528);
    }

    /// The compile-time constants (what the kernels are built with) are the released config's.
    #[test]
    fn consts_are_the_embedded_geometry() {
        let g = Geometry::embedded();
        assert_eq!(g.num_heads, consts::HEADS);
        assert_eq!(g.head_dim, consts::KV_DIM);
        assert_eq!(g.rope_dim, consts::ROPE_DIM);
        assert_eq!(g.window, consts::WINDOW);
        assert_eq!(g.index_heads, consts::INDEX_HEADS);
        assert_eq!(g.index_head_dim, consts::INDEX_DIM);
        assert_eq!(g.hidden_size, consts::HIDDEN_SIZE);
        assert_eq!(g.hc_mult, consts::HC);
        assert_eq!(g.hc_sinkhorn_iters, consts::HC_SINKHORN_ITERS);
        assert_eq!(g.hc_eps, consts::HC_EPS);
        assert_eq!(g.rms_norm_eps, consts::RMS_NORM_EPS);
        assert_eq!(g.candidate_block_size, consts::CANDIDATE_BLOCK_SIZE);
        for l in g.layers.iter().filter(|l| l.ratio > 0) {
            assert_eq!(l.rope.rope_dim, consts::ROPE_DIM, "layer {}", l.id);
        }
    }

    /// The kernels' -D values are C literals of the constants (floats as f32 literals that read
    /// back as the same f32).
    #[test]
    fn kernel_defines_are_c_literals() {
        use consts::KernelDefine;
        for d in consts::KERNEL_DEFINES {
            assert!(d.name().starts_with("CSA2_"), "{}", d.name());
            let v = d.c_value();
            match *d {
                KernelDefine::Int(_, n) => assert_eq!(v, n.to_string()),
                KernelDefine::Float(_, x) => {
                    let lit = v.strip_suffix('f').expect("an f32 literal ends in f");
                    assert!(
                        lit.contains('.') || lit.contains('e'),
                        "{v} is not a float literal"
                    );
                    assert_eq!(lit.parse::<f32>().unwrap(), x as f32);
                }
            }
        }
        let names: std::collections::HashSet<_> =
            consts::KERNEL_DEFINES.iter().map(|d| d.name()).collect();
        assert_eq!(names.len(), consts::KERNEL_DEFINES.len(), "a define twice");
    }

    #[test]
    fn yarn_keeps_high_frequencies_and_divides_low() {
        let g = Geometry::embedded();
        let plain = RopeParams {
            yarn: None,
            ..g.layers[2].rope
        };
        let (a, b) = (g.layers[2].rope.inv_freqs(), plain.inv_freqs());
        assert_eq!(a[0], b[0]);
        assert!((a[31] - b[31] / 16.0).abs() < 1e-18);
        assert_eq!(g.layers[0].rope.yarn, None);
        assert_eq!(g.layers[0].rope.theta, 10000.0);
    }
}
