//! mHC: the 4 hyper-connection streams of the residual, mixed per token by learned,
//! Sinkhorn-normalized coefficients (docs/SPEC.md §4; vLLM
//! `vllm/model_executor/kernels/mhc/torch.py`).
//!
//! # The boundary between two sublayers (V4.1 single-pass shift, "Mega-mHC")
//!
//! Every sublayer site s (attention or FFN of a layer) owns mix weights `hc_fn [24, 4d]`,
//! `hc_base [24]`, `hc_scale [3]` and an input RMSNorm weight `[d]`. Its coefficients
//! `(pre_s, post_s, comb_s)` are computed from the streams X_s entering it. V4.1 collapses the input
//! of site s with the pre of the *previous* site, so at the boundary between site s−1 (which just
//! produced y) and site s one pass over the streams does:
//!
//! ```text
//! X_s      = post_{s-1} ⊙ y + comb_{s-1}ᵀ · X_{s-1}                (post update, [T,4,d])
//! layer_in = RMSNorm(Σ_i pre_{s-1,i} · X_s[i], norm_s)            (shifted collapse, [T,d])
//! (pre_s, post_s, comb_s) = coefficients(X_s; hc_fn_s, base_s, scale_s)
//! ```
//!
//! `(pre_s, post_s, comb_s)` are carried to the next boundary. The first site (layer 0 attention)
//! has no post update and collapses with a one-hot pre on stream 0 ([`one_hot_pre`]); after the last
//! site the final hidden state is the collapse with the last pre (no new coefficients: `next` is
//! `None`), normed with the model's final norm.
//!
//! Layouts: streams `[T, 4, d]` f32 token-major (each token's 4 streams of d contiguous);
//! `pre`/`post` `[T, 4]`; `comb` `[T, 4, 4]` with `comb[t][i][j] = C[i, j]`, the weight of input
//! stream i in output stream j (`X'_j = post_j·y + Σ_i C[i,j]·X_i`).
//!
//! Precision: this op is f32 in and out. The model keeps the streams in bf16 and rounds the collapse
//! to bf16 before the norm; that rounding belongs to the caller that stores bf16.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod reference;

use crate::error::{Error, Result};
use crate::geometry::Geometry;

use crate::geometry::consts;
/// Hyper-connection streams (n = 4; `hc_mult` in the config) and mix outputs per token (n pre + n
/// post + n² comb = 24): the geometry's ([`crate::geometry::consts`]).
pub use crate::geometry::consts::{HC, MIX};

/// Scalars of the mHC op (docs/SPEC.md §4; config `hc_*`, `rms_norm_eps`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MhcParams {
    /// Width d of one stream (5120).
    pub hidden: usize,
    /// Multiplier of the post sigmoid (2.0; vLLM `hc_post_mult`).
    pub post_mult: f32,
    /// Sinkhorn iterations, counting the first column normalization (20).
    pub sinkhorn_iters: usize,
    /// `hc_eps`: added to pre, to the softmax and to every Sinkhorn denominator (1e-6).
    pub hc_eps: f32,
    /// RMS epsilon of the mix statistic and of the input RMSNorm (`rms_norm_eps`, 1e-20).
    pub rms_eps: f32,
}

impl MhcParams {
    /// The V4.1 constants for stream width `hidden`.
    pub fn new(hidden: usize) -> MhcParams {
        MhcParams {
            hidden,
            post_mult: consts::HC_POST_MULT as f32,
            sinkhorn_iters: consts::HC_SINKHORN_ITERS,
            hc_eps: consts::HC_EPS as f32,
            rms_eps: consts::RMS_NORM_EPS as f32,
        }
    }

    /// Parameters from a geometry. Errors: [`Error::Unsupported`] when `hc_mult` ≠ 4.
    pub fn from_geometry(g: &Geometry) -> Result<MhcParams> {
        if g.hc_mult != HC {
            return Err(Error::Unsupported(format!(
                "mHC kernels are built for hc_mult = {HC} streams, config has {}",
                g.hc_mult
            )));
        }
        let p = MhcParams {
            hidden: g.hidden_size,
            post_mult: consts::HC_POST_MULT as f32,
            sinkhorn_iters: g.hc_sinkhorn_iters,
            hc_eps: g.hc_eps as f32,
            rms_eps: g.rms_norm_eps as f32,
        };
        p.validate()?;
        Ok(p)
    }

    /// Checks the scalars. Errors: [`Error::Invalid`] naming the field and the value.
    pub fn validate(&self) -> Result<()> {
        if self.hidden == 0 {
            return Err(Error::invalid("hidden", "must be > 0, found 0"));
        }
        if self.sinkhorn_iters == 0 {
            return Err(Error::invalid(
                "sinkhorn_iters",
                "must be ≥ 1 (the first column normalization is iteration 1), found 0",
            ));
        }
        for (name, v) in [
            ("post_mult", self.post_mult),
            ("hc_eps", self.hc_eps),
            ("rms_eps", self.rms_eps),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(Error::invalid(
                    name,
                    format!("must be finite and ≥ 0, found {v}"),
                ));
            }
        }
        Ok(())
    }
}

/// One site's mix weights (checkpoint `layers.{L}.hc_{attn|ffn}_{fn,base,scale}`, fp32).
#[derive(Debug, Clone, Copy)]
pub struct MixWeights<'a> {
    /// `hc_fn [24, 4d]` row-major: row r is dotted with the flattened 4 streams.
    pub hc_fn: &'a [f32],
    /// `hc_base [24]`.
    pub base: &'a [f32],
    /// `hc_scale [3]`: multipliers of the pre, post and comb mixes.
    pub scale: &'a [f32],
    /// The same `hc_fn` prepared once for the CPU kernel ([`cpu::PackedHcFn::new`]); `None`
    /// reads `hc_fn` directly (same results; slower GEMV). It must be packed from this `hc_fn`;
    /// one packed for another d is an error ([`MixWeights::validate`]).
    pub packed: Option<&'a cpu::PackedHcFn>,
}

/// The post update of the previous sublayer: its output and its (post, comb).
#[derive(Debug, Clone, Copy)]
pub struct PostUpdate<'a> {
    /// Sublayer output y `[T, d]`.
    pub y: &'a [f32],
    /// `post [T, 4]` of the site that produced y.
    pub post: &'a [f32],
    /// `comb [T, 4, 4]` of the site that produced y (`comb[t][i][j]` = weight of stream i in j).
    pub comb: &'a [f32],
}

/// Inputs of one boundary (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct BoundaryIn<'a> {
    /// Streams X `[T, 4, d]` entering the previous site (or the embedding broadcast at the first site).
    pub x: &'a [f32],
    /// The previous site's post update; `None` at the first site (then `X_s = X`).
    pub update: Option<PostUpdate<'a>>,
    /// Carried `pre [T, 4]` of the previous site (one-hot on stream 0 at the first site).
    pub pre_prev: &'a [f32],
    /// The new site's mix weights; `None` after the last site (no new coefficients).
    pub next: Option<MixWeights<'a>>,
    /// RMSNorm weight `[d]` of the new site's input (`attn_norm` / `ffn_norm`, or the final `norm`).
    pub norm: &'a [f32],
}

/// Mutable views of per-token coefficients.
#[derive(Debug)]
pub struct CoeffsMut<'a> {
    /// `pre [T, 4]`.
    pub pre: &'a mut [f32],
    /// `post [T, 4]`.
    pub post: &'a mut [f32],
    /// `comb [T, 4, 4]`.
    pub comb: &'a mut [f32],
}

/// Owned per-token coefficients `pre [T,4]`, `post [T,4]`, `comb [T,4,4]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Coeffs {
    /// `pre [T, 4]`.
    pub pre: Vec<f32>,
    /// `post [T, 4]`.
    pub post: Vec<f32>,
    /// `comb [T, 4, 4]`.
    pub comb: Vec<f32>,
}

impl Coeffs {
    /// Zeroed coefficients for `tokens` tokens.
    pub fn zeros(tokens: usize) -> Coeffs {
        Coeffs {
            pre: vec![0.0; tokens * HC],
            post: vec![0.0; tokens * HC],
            comb: vec![0.0; tokens * HC * HC],
        }
    }
    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.pre.len() / HC
    }
    /// Mutable views, for [`BoundaryOut::coeffs`].
    pub fn as_mut(&mut self) -> CoeffsMut<'_> {
        CoeffsMut {
            pre: &mut self.pre,
            post: &mut self.post,
            comb: &mut self.comb,
        }
    }
}

/// Outputs of one boundary.
#[derive(Debug)]
pub struct BoundaryOut<'a> {
    /// New streams `X_s [T, 4, d]`.
    pub x_new: &'a mut [f32],
    /// Input of the new site `[T, d]`: `RMSNorm(Σ_i pre_prev_i · X_s[i], norm)`.
    pub layer_in: &'a mut [f32],
    /// The new site's coefficients; required when `next` is `Some`, ignored otherwise.
    pub coeffs: Option<CoeffsMut<'a>>,
}

/// One-hot `pre [T, 4]` selecting stream 0: the carried pre of the very first site (docs/SPEC.md §4).
pub fn one_hot_pre(tokens: usize) -> Vec<f32> {
    let mut p = vec![0.0; tokens * HC];
    p.iter_mut().step_by(HC).for_each(|v| *v = 1.0);
    p
}

fn check_len(what: &str, shape: &str, expected: usize, found: usize) -> Result<()> {
    if expected != found {
        return Err(Error::shape(
            what,
            format!("{shape} = {expected} f32"),
            format!("{found} f32"),
        ));
    }
    Ok(())
}

impl BoundaryIn<'_> {
    /// Validates every shape against `p` and returns T (tokens).
    ///
    /// Errors: [`Error::Shape`] naming the argument, the expected and the found length.
    pub fn validate(&self, p: &MhcParams) -> Result<usize> {
        p.validate()?;
        let d = p.hidden;
        if !self.x.len().is_multiple_of(HC * d) {
            return Err(Error::shape(
                "x",
                format!("[T, {HC}, {d}] (a multiple of {} f32)", HC * d),
                format!("{} f32", self.x.len()),
            ));
        }
        let t = self.x.len() / (HC * d);
        if let Some(u) = &self.update {
            check_len("y", &format!("[T={t}, {d}]"), t * d, u.y.len())?;
            check_len("post", &format!("[T={t}, {HC}]"), t * HC, u.post.len())?;
            check_len(
                "comb",
                &format!("[T={t}, {HC}, {HC}]"),
                t * HC * HC,
                u.comb.len(),
            )?;
        }
        check_len(
            "pre_prev",
            &format!("[T={t}, {HC}]"),
            t * HC,
            self.pre_prev.len(),
        )?;
        check_len("norm", &format!("[{d}]"), d, self.norm.len())?;
        if let Some(w) = &self.next {
            w.validate(p)?;
        }
        Ok(t)
    }
}

impl MixWeights<'_> {
    /// Checks `hc_fn [24, 4d]`, `base [24]`, `scale [3]`.
    pub fn validate(&self, p: &MhcParams) -> Result<()> {
        check_len(
            "hc_fn",
            &format!("[{MIX}, {}]", HC * p.hidden),
            MIX * HC * p.hidden,
            self.hc_fn.len(),
        )?;
        check_len("hc_base", &format!("[{MIX}]"), MIX, self.base.len())?;
        check_len("hc_scale", "[3]", 3, self.scale.len())?;
        match self.packed {
            Some(pk) if pk.hidden() != p.hidden => Err(Error::shape(
                "packed hc_fn",
                format!("packed for d = {}", p.hidden),
                format!("packed for d = {}", pk.hidden()),
            )),
            _ => Ok(()),
        }
    }
}

impl BoundaryOut<'_> {
    /// Checks the output buffers for T tokens.
    pub fn validate(&self, p: &MhcParams, t: usize, want_coeffs: bool) -> Result<()> {
        let d = p.hidden;
        check_len(
            "x_new",
            &format!("[T={t}, {HC}, {d}]"),
            t * HC * d,
            self.x_new.len(),
        )?;
        check_len(
            "layer_in",
            &format!("[T={t}, {d}]"),
            t * d,
            self.layer_in.len(),
        )?;
        match (&self.coeffs, want_coeffs) {
            (Some(c), true) => {
                check_len("pre out", &format!("[T={t}, {HC}]"), t * HC, c.pre.len())?;
                check_len("post out", &format!("[T={t}, {HC}]"), t * HC, c.post.len())?;
                check_len(
                    "comb out",
                    &format!("[T={t}, {HC}, {HC}]"),
                    t * HC * HC,
                    c.comb.len(),
                )
            }
            (None, true) => Err(Error::invalid(
                "coeffs",
                "the new site's mix weights are given, so coefficient outputs are required",
            )),
            _ => Ok(()),
        }
    }
}

/// Owned result of a boundary, from [`boundary`].
#[derive(Debug, Clone, PartialEq)]
pub struct Boundary {
    /// New streams `[T, 4, d]`.
    pub x_new: Vec<f32>,
    /// New site input `[T, d]`.
    pub layer_in: Vec<f32>,
    /// New coefficients (`None` when `next` was `None`).
    pub coeffs: Option<Coeffs>,
}

/// Which CPU path to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// One pass over the streams (Mega-mHC order).
    Fused,
    /// Four passes as vLLM runs it on Hopper: post update, coefficients, collapse, RMSNorm.
    Unfused,
}

/// Runs one boundary on the CPU and returns owned outputs (allocating convenience over
/// [`cpu::fused_boundary`] / [`cpu::unfused_boundary`]).
pub fn boundary(p: &MhcParams, inp: &BoundaryIn, path: Path) -> Result<Boundary> {
    let t = inp.validate(p)?;
    let mut x_new = vec![0.0; t * HC * p.hidden];
    let mut layer_in = vec![0.0; t * p.hidden];
    let mut coeffs = inp.next.map(|_| Coeffs::zeros(t));
    let mut out = BoundaryOut {
        x_new: &mut x_new,
        layer_in: &mut layer_in,
        coeffs: coeffs.as_mut().map(Coeffs::as_mut),
    };
    match path {
        Path::Fused => cpu::fused_boundary(p, inp, &mut out)?,
        Path::Unfused => cpu::unfused_boundary(p, inp, &mut out)?,
    }
    Ok(Boundary {
        x_new,
        layer_in,
        coeffs,
    })
}
