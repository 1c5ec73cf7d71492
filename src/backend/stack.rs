//! The stack: 40 attention sublayers with mHC at both sites of every layer (docs/SPEC.md §4), for a step of
//! prefill chunks and decode tokens of many requests, through a [`KvCache`].
//!
//! Per layer ℓ: attention site boundary (post update of the previous site + this site's
//! coefficients + collapse with the carried pre + `attn_norm`) → attention sublayer in its role →
//! FFN site boundary (`ffn_norm`) → FFN placeholder → next layer. After the last site the final
//! hidden state is the collapse with the last pre (final norm weight: ones, the checkpoint's
//! `norm.weight` is outside the attention tensors we load).
//!
//! Out of scope, documented placeholders: the token embedding (a deterministic pseudo-random vector
//! per token id, [`embed`]) and the MoE FFN (identity by default: the FFN site's output is its
//! input, so both mHC sites of every layer still run).

use super::cache::KvCache;
use super::layer::{attention_sublayer, StepBuffers};
use super::timing::{Op, Timings};
use super::BackendConfig;
use crate::error::{Error, Result};
use crate::formats::scalar::e8m0_decode;
use crate::geometry::Geometry;
use crate::ops::mhc::{boundary, one_hot_pre, BoundaryIn, MhcParams, PostUpdate, HC};
use crate::replay::{RowSet, SeqStep, StepPlan};
use crate::weights::synth::{quantize_fp8_block, source_values};
use crate::weights::{layer_specs, Checkpoint, LayerWeights, Matrix, Scale, Stored, TensorSpec};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The MoE FFN placeholder at the FFN site.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FfnPlaceholder {
    /// y = the site input (the normed collapse).
    #[default]
    Identity,
    /// y = 0 (the streams only mix).
    Zero,
}

/// Model weights for the stack.
#[derive(Debug, Clone)]
pub struct Model {
    /// Geometry (roles, dims).
    pub geometry: Geometry,
    /// Per layer weights; layers may share one allocation (synthetic full scale).
    pub layers: Vec<Arc<LayerWeights>>,
    /// Final RMSNorm weight `[d]`.
    pub final_norm: Vec<f32>,
    /// Seed of the synthetic embedding.
    pub embed_seed: u64,
    /// Whether layers share weights (synthetic, to fit real dimensions in host memory).
    pub shared: bool,
}

/// Builds one layer's weights in memory from the `make-checkpoint` generator, stored as a written
/// checkpoint stores them (the release dtypes of docs/SPEC.md §6.1, `weights::layer_specs`): FP8 E4M3 linears with
/// their UE8M0 32 × 32 block scales, bf16 linears and norms, f32 where the release keeps f32. The
/// values are those `make-checkpoint` writes, so a synthetic model and the checkpoint it would
/// write compute the same bits.
pub fn synthetic_layer(g: &Geometry, layer: usize, seed: u64) -> Result<LayerWeights> {
    let specs = layer_specs(g, layer)?;
    let values: HashMap<String, (TensorSpec, Vec<f32>)> = {
        use rayon::prelude::*;
        specs
            .par_iter()
            .map(|s| {
                (
                    s.name.clone(),
                    (s.clone(), source_values(s, g.hidden_size, seed)),
                )
            })
            .collect()
    };
    let take = |suffix: &str| -> Result<&(TensorSpec, Vec<f32>)> {
        let name = format!("layers.{layer}.{suffix}");
        values
            .get(&name)
            .ok_or_else(|| Error::NotFound(format!("synthetic tensor {name}")))
    };
    let get = |suffix: &str| {
        take(suffix).map(|(spec, v)| match spec.stored {
            Stored::Bf16 => v
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect(),
            Stored::F32 => v.clone(),
            Stored::Fp8Block => dequantize_fp8(v, spec.shape[0], spec.shape[1]),
        })
    };
    let mat = |suffix: &str| -> Result<Matrix> {
        let (spec, v) = take(suffix)?;
        let (rows, cols) = (spec.shape[0], spec.shape[1]);
        match spec.stored {
            Stored::Fp8Block => {
                let (codes, scales) = quantize_fp8_block(v, rows, cols);
                Matrix::fp8_block(
                    rows,
                    cols,
                    codes,
                    scales.iter().map(|&b| e8m0_decode(b)).collect(),
                )
            }
            Stored::Bf16 => Ok(Matrix::bf16_from_f32(rows, cols, v)),
            Stored::F32 => Ok(Matrix::f32(rows, cols, v.clone())),
        }
    };
    crate::weights::assemble_layer(g, layer, get, mat)
}

/// The f32 values an FP8 block-quantized `[rows, cols]` tensor holds after quantization.
fn dequantize_fp8(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let (codes, scales) = quantize_fp8_block(v, rows, cols);
    let bc = cols.div_ceil(crate::weights::FP8_BLOCK);
    codes
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let (r, k) = (i / cols, i % cols);
            crate::formats::scalar::e4m3_decode(c)
                * e8m0_decode(
                    scales[r / crate::weights::FP8_BLOCK * bc + k / crate::weights::FP8_BLOCK],
                )
        })
        .collect()
}

impl Model {
    /// Synthetic weights generated in memory (`make-checkpoint`'s generator). With `share`, layers
    /// of the same role and ratio share the weights of the first such layer (real dimensions do not
    /// fit in host memory as 40 distinct f32 layers; the compute is unchanged).
    pub fn synthetic(scale: Scale, seed: u64, share: bool) -> Result<Model> {
        let g = scale.geometry();
        let mut reps: HashMap<(&'static str, usize), Arc<LayerWeights>> = HashMap::new();
        let mut layers = Vec::with_capacity(g.num_layers);
        for lp in &g.layers {
            let key = (lp.role.as_str(), lp.ratio);
            let w = match reps.get(&key) {
                Some(w) if share => w.clone(),
                _ => {
                    let w = Arc::new(synthetic_layer(&g, lp.id, seed)?);
                    reps.entry(key).or_insert_with(|| w.clone());
                    w
                }
            };
            layers.push(w);
        }
        Ok(Model {
            final_norm: vec![1.0; g.hidden_size],
            geometry: g,
            layers,
            embed_seed: seed,
            shared: share,
        })
    }

    /// The same model with every matrix stored as its f32 values (the weights the kernels multiply
    /// do not change, only their bytes in memory: 4 B per value instead of 1–2). The baseline of
    /// `csa2 ab --f32-weights`.
    pub fn with_f32_weights(&self) -> Model {
        let mut seen: HashMap<*const LayerWeights, Arc<LayerWeights>> = HashMap::new();
        let layers = self
            .layers
            .iter()
            .map(|w| {
                seen.entry(Arc::as_ptr(w))
                    .or_insert_with(|| Arc::new(w.as_ref().clone().into_f32()))
                    .clone()
            })
            .collect();
        Model {
            layers,
            ..self.clone()
        }
    }

    /// Loads a checkpoint directory (released naming; see `crate::weights`) for geometry `g`.
    ///
    /// Errors: [`crate::Error::Invalid`] when the directory's `config.json` (if present) describes
    /// another geometry than `g` (e.g. a tiny checkpoint loaded at full scale), naming both; then as
    /// [`Checkpoint::open`] and [`Checkpoint::layer`] (a missing tensor is named).
    pub fn from_checkpoint(dir: &Path, g: Geometry) -> Result<Model> {
        let cfg = dir.join("config.json");
        if cfg.exists() {
            let found = Geometry::from_path(&cfg)?;
            if found != g {
                let dims = |g: &Geometry| {
                    format!(
                        "hidden {}, {} heads, {} layers",
                        g.hidden_size, g.num_heads, g.num_layers
                    )
                };
                return Err(crate::Error::invalid(
                    "checkpoint",
                    format!(
                        "{} describes {}, but the run expects {} (choose the matching scale)",
                        cfg.display(),
                        dims(&found),
                        dims(&g)
                    ),
                ));
            }
        }
        let ck = Checkpoint::open(dir)?;
        let layers = (0..g.num_layers)
            .map(|l| ck.layer(&g, l).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            final_norm: vec![1.0; g.hidden_size],
            geometry: g,
            layers,
            embed_seed: 0,
            shared: false,
        })
    }
}

/// The embedding placeholder: a deterministic N(0, 1) vector per token id.
pub fn embed(token: u32, seed: u64, d: usize, out: &mut [f32]) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(
        seed ^ (token as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    for v in out.iter_mut().take(d) {
        // Sum of uniforms: cheap, deterministic, unit variance.
        let s: f32 = (0..4).map(|_| rng.random::<f32>()).sum();
        *v = (s - 2.0) * 3f32.sqrt();
    }
}

/// What a step returns.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// The step's row plan (the output rows are `plan.output_rows()`).
    pub plan: StepPlan,
    /// Final hidden state `[kept rows, d]`.
    pub hidden: Vec<f32>,
    /// When traced: each layer's attention input `[rows of that layer, d]` (layer order).
    pub layer_inputs: Vec<Vec<f32>>,
    /// When traced: each layer's attention sublayer output `[rows of that layer, d]` (layer order).
    pub layer_outputs: Vec<Vec<f32>>,
    /// When traced: the top-k `[rows, index_topk]` of every Full and Reindex layer, by layer.
    pub topk: Vec<(usize, Vec<i32>)>,
}

/// What a step shows its observer once layer `layer` is done (both mHC sites applied).
#[derive(Debug, Clone, Copy)]
pub struct LayerView<'a> {
    /// Layer index.
    pub layer: usize,
    /// The rows the layer ran (positions, requests).
    pub rows: &'a RowSet,
    /// The attention input `u` (collapsed, `attn_norm`ed) `[rows, d]`.
    pub input: &'a [f32],
    /// The hyper-connection streams after the layer `[rows, 4, d]` (the FFN placeholder's update
    /// included).
    pub streams: &'a [f32],
}

/// A per-layer observer of a step (the replay error analyzer's probe).
pub type LayerObserver<'o> = dyn FnMut(LayerView<'_>) + 'o;

/// A backend: a model, a configuration (CSA2 or launch day) and its mHC parameters.
#[derive(Debug, Clone)]
pub struct Backend {
    /// Weights.
    pub model: Arc<Model>,
    /// Formats and paths.
    pub cfg: BackendConfig,
    /// FFN placeholder.
    pub ffn: FfnPlaceholder,
    mhc: MhcParams,
}

fn select_rows(x: &[f32], width: usize, idx: &[usize]) -> Vec<f32> {
    idx.iter()
        .flat_map(|&i| x[i * width..(i + 1) * width].iter().copied())
        .collect()
}

impl Backend {
    /// A backend over `model` with `cfg`.
    pub fn new(model: Arc<Model>, cfg: BackendConfig) -> Result<Backend> {
        let mhc = MhcParams::from_geometry(&model.geometry)?;
        Ok(Backend {
            model,
            cfg,
            ffn: FfnPlaceholder::Identity,
            mhc,
        })
    }

    /// Geometry of the model.
    pub fn geometry(&self) -> &Geometry {
        &self.model.geometry
    }

    /// Runs one step: `tokens` holds one token id per row (requests in `seqs` order, each request's
    /// rows in position order). Opens unknown requests in the cache.
    ///
    /// Errors: a bad step (see [`StepPlan::new`]), a token count that does not match the rows, and
    /// any cache or op error, each naming the layer or request.
    pub fn step(
        &self,
        seqs: &[SeqStep],
        tokens: &[u32],
        cache: &mut dyn KvCache,
        tm: &mut Timings,
        trace: bool,
    ) -> Result<StepOutput> {
        let plan = StepPlan::new(&self.model.geometry, seqs, self.cfg.decoder_replay)?;
        self.run_plan(plan, tokens, cache, tm, trace, None)
    }

    /// Runs one step of the exact replay staircase (docs/SPEC.md §3, [`StepPlan::staircase`]): request `i`
    /// runs layer `l` on its rows at positions `≥ starts[i][l]`; no decoder rows are trimmed
    /// whatever the configuration says.
    ///
    /// Errors: as [`Backend::step`] and [`StepPlan::staircase`].
    pub fn step_exact(
        &self,
        seqs: &[SeqStep],
        starts: &[Vec<usize>],
        tokens: &[u32],
        cache: &mut dyn KvCache,
        tm: &mut Timings,
        observe: Option<&mut LayerObserver<'_>>,
    ) -> Result<StepOutput> {
        let plan = StepPlan::staircase(&self.model.geometry, seqs, starts)?;
        self.run_plan(plan, tokens, cache, tm, false, observe)
    }

    /// [`Backend::step`] with an observer called after every layer.
    pub fn step_observed(
        &self,
        seqs: &[SeqStep],
        tokens: &[u32],
        cache: &mut dyn KvCache,
        tm: &mut Timings,
        observe: &mut LayerObserver<'_>,
    ) -> Result<StepOutput> {
        let plan = StepPlan::new(&self.model.geometry, seqs, self.cfg.decoder_replay)?;
        self.run_plan(plan, tokens, cache, tm, false, Some(observe))
    }

    /// Runs a planned step (see [`Backend::step`]); `observe` sees every layer's rows, input and
    /// output streams.
    pub fn run_plan(
        &self,
        plan: StepPlan,
        tokens: &[u32],
        cache: &mut dyn KvCache,
        tm: &mut Timings,
        trace: bool,
        mut observe: Option<&mut LayerObserver<'_>>,
    ) -> Result<StepOutput> {
        let g = &self.model.geometry;
        let seqs = &plan.seqs[..];
        let t = plan.total_rows();
        if tokens.len() != t {
            return Err(Error::shape(
                "step tokens",
                format!("{t} (one per row)"),
                tokens.len(),
            ));
        }
        for s in seqs.iter() {
            if !cache.contains(s.req) {
                cache.open(s.req)?;
            }
        }
        let d = g.hidden_size;
        // Embedding broadcast to the 4 streams.
        let mut x = vec![0f32; t * HC * d];
        for (i, &tok) in tokens.iter().enumerate() {
            let row = &mut x[i * HC * d..(i + 1) * HC * d];
            embed(tok, self.model.embed_seed, d, &mut row[..d]);
            let (first, rest) = row.split_at_mut(d);
            for c in rest.chunks_exact_mut(d) {
                c.copy_from_slice(first);
            }
        }
        let mut pre = one_hot_pre(t);
        let mut pending: Option<(Vec<f32>, Vec<f32>, Vec<f32>)> = None;
        let mut bufs = StepBuffers::default();
        let mut layer_inputs = vec![];
        let mut layer_outputs = vec![];
        let mut rows = t;
        // The previous layer's input, kept for the observer until its output streams exist.
        let mut prev_u: Option<Vec<f32>> = None;
        for l in 0..g.num_layers {
            let w = &self.model.layers[l];
            let role = g.layers[l].role;
            // ---- attention site
            let b = tm.time(role, Op::Mhc, || {
                boundary(
                    &self.mhc,
                    &BoundaryIn {
                        x: &x,
                        update: pending.as_ref().map(|(y, post, comb)| PostUpdate {
                            y,
                            post,
                            comb,
                        }),
                        pre_prev: &pre,
                        next: Some(w.hc_attn.mix()),
                        norm: &w.attn_norm,
                    },
                    self.cfg.mhc,
                )
            })?;
            let co = b.coeffs.expect("next given");
            let (mut xs, mut u, mut co) = (b.x_new, b.layer_in, co);
            if let (Some(obs), Some(pu)) = (observe.as_mut(), prev_u.take()) {
                obs(LayerView {
                    layer: l - 1,
                    rows: plan.rows_for(l - 1),
                    input: &pu,
                    streams: &xs,
                });
            }
            let mut u_all = None;
            if l == plan.cut_layer && plan.trimmed {
                let k = &plan.kept_idx;
                xs = select_rows(&xs, HC * d, k);
                co.pre = select_rows(&co.pre, HC, k);
                co.post = select_rows(&co.post, HC, k);
                co.comb = select_rows(&co.comb, HC * HC, k);
                let uk = select_rows(&u, d, k);
                u_all = Some(std::mem::replace(&mut u, uk));
                rows = k.len();
            } else if let Some(k) = plan
                .stair
                .get(l)
                .and(plan.select_between(l.saturating_sub(1), l))
            {
                // One step up the exact-replay staircase: drop the rows this layer does not run.
                xs = select_rows(&xs, HC * d, &k);
                co.pre = select_rows(&co.pre, HC, &k);
                co.post = select_rows(&co.post, HC, &k);
                co.comb = select_rows(&co.comb, HC * HC, &k);
                u = select_rows(&u, d, &k);
                rows = k.len();
            }
            if observe.is_some() {
                prev_u = Some(u.clone());
            }
            if trace {
                layer_inputs.push(u.clone());
            }
            let y = attention_sublayer(
                g,
                &self.cfg,
                w,
                &plan,
                l,
                u_all.as_deref(),
                &u,
                cache,
                &mut bufs,
                tm,
            )
            .map_err(|e| annotate(e, l))?;
            if trace {
                layer_outputs.push(y.clone());
            }
            x = xs;
            pre = co.pre;
            // ---- FFN site
            let b = tm.time(role, Op::Mhc, || {
                boundary(
                    &self.mhc,
                    &BoundaryIn {
                        x: &x,
                        update: Some(PostUpdate {
                            y: &y,
                            post: &co.post,
                            comb: &co.comb,
                        }),
                        pre_prev: &pre,
                        next: Some(w.hc_ffn.mix()),
                        norm: &w.ffn_norm,
                    },
                    self.cfg.mhc,
                )
            })?;
            let cf = b.coeffs.expect("next given");
            x = b.x_new;
            let y_ffn = match self.ffn {
                FfnPlaceholder::Identity => b.layer_in,
                FfnPlaceholder::Zero => vec![0.0; rows * d],
            };
            pre = cf.pre;
            pending = Some((y_ffn, cf.post, cf.comb));
        }
        let role = g.layers[g.num_layers - 1].role;
        let b = tm.time(role, Op::Mhc, || {
            boundary(
                &self.mhc,
                &BoundaryIn {
                    x: &x,
                    update: pending
                        .as_ref()
                        .map(|(y, post, comb)| PostUpdate { y, post, comb }),
                    pre_prev: &pre,
                    next: None,
                    norm: &self.model.final_norm,
                },
                self.cfg.mhc,
            )
        })?;
        if let (Some(obs), Some(pu)) = (observe.as_mut(), prev_u.take()) {
            obs(LayerView {
                layer: g.num_layers - 1,
                rows: plan.rows_for(g.num_layers - 1),
                input: &pu,
                streams: &b.x_new,
            });
        }
        let mut topk: Vec<(usize, Vec<i32>)> = if trace {
            bufs.topk.into_iter().map(|(l, (_, t))| (l, t)).collect()
        } else {
            vec![]
        };
        topk.sort_unstable_by_key(|t| t.0);
        Ok(StepOutput {
            plan,
            hidden: b.layer_in,
            layer_inputs,
            layer_outputs,
            topk,
        })
    }
}

fn annotate(e: Error, layer: usize) -> Error {
    match e {
        Error::Invalid { name, reason } => Error::Invalid {
            name: format!("layer {layer}: {name}"),
            reason,
        },
        Error::Shape {
            what,
            expected,
            found,
        } => Error::Shape {
            what: format!("layer {layer}: {what}"),
            expected,
            found,
        },
        other => other,
    }
}
