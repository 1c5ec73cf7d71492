//! Readable f64 reference of mHC (docs/SPEC.md §4), token by token, with no
//! tiling or SIMD: the oracle the fast paths are tested against.

// Index loops mirror the (i, j) subscripts of the formulas in docs/SPEC.md §4.
#![allow(clippy::needless_range_loop)]

use super::{BoundaryIn, MhcParams, MixWeights, HC, MIX};
use crate::error::Result;

/// Coefficients of one token in f64.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenCoeffs {
    /// pre_i = sigmoid(mix_i·scale0 + base_i) + hc_eps.
    pub pre: [f64; HC],
    /// post_i = post_mult·sigmoid(mix_{4+i}·scale1 + base_{4+i}).
    pub post: [f64; HC],
    /// comb[i][j]: weight of input stream i in output stream j, after Sinkhorn.
    pub comb: [[f64; HC]; HC],
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Coefficients from one token's 4 streams `x` `[4, d]` (any precision, given as f64).
pub fn token_coefficients(p: &MhcParams, w: &MixWeights, x: &[f64]) -> TokenCoeffs {
    let n = x.len();
    let mean_sq = x.iter().map(|v| v * v).sum::<f64>() / n as f64;
    let r = 1.0 / (mean_sq + p.rms_eps as f64).sqrt();
    let mut mix = [0.0f64; MIX];
    for (k, m) in mix.iter_mut().enumerate() {
        let row = &w.hc_fn[k * n..(k + 1) * n];
        *m = row.iter().zip(x).map(|(&f, &v)| f as f64 * v).sum::<f64>() * r;
    }
    let (s, b) = (|i: usize| w.scale[i] as f64, |i: usize| w.base[i] as f64);
    let eps = p.hc_eps as f64;
    let mut c = TokenCoeffs {
        pre: [0.0; HC],
        post: [0.0; HC],
        comb: [[0.0; HC]; HC],
    };
    for i in 0..HC {
        c.pre[i] = sigmoid(mix[i] * s(0) + b(i)) + eps;
        c.post[i] = p.post_mult as f64 * sigmoid(mix[HC + i] * s(1) + b(HC + i));
    }
    // Row softmax of the 4×4 logits, + eps.
    for i in 0..HC {
        let logits: Vec<f64> = (0..HC)
            .map(|j| mix[2 * HC + i * HC + j] * s(2) + b(2 * HC + i * HC + j))
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        for j in 0..HC {
            c.comb[i][j] = (logits[j] - m).exp() / z + eps;
        }
    }
    let normalize_cols = |cm: &mut [[f64; HC]; HC]| {
        for j in 0..HC {
            let sum: f64 = (0..HC).map(|i| cm[i][j]).sum();
            for row in cm.iter_mut() {
                row[j] /= sum + eps;
            }
        }
    };
    let normalize_rows = |cm: &mut [[f64; HC]; HC]| {
        for row in cm.iter_mut() {
            let sum: f64 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= sum + eps);
        }
    };
    // Iteration 1 is the column step after the softmax; iterations 2..=iters are (rows, cols).
    normalize_cols(&mut c.comb);
    for _ in 1..p.sinkhorn_iters {
        normalize_rows(&mut c.comb);
        normalize_cols(&mut c.comb);
    }
    c
}

/// f64 result of one boundary.
#[derive(Debug, Clone, PartialEq)]
pub struct RefBoundary {
    /// New streams `[T, 4, d]`.
    pub x_new: Vec<f64>,
    /// New site input `[T, d]`.
    pub layer_in: Vec<f64>,
    /// New coefficients per token (empty when `next` is `None`).
    pub coeffs: Vec<TokenCoeffs>,
}

impl RefBoundary {
    /// pre `[T,4]`, post `[T,4]`, comb `[T,4,4]` flattened like the fast path's outputs.
    pub fn flat_coeffs(&self) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let pre = self.coeffs.iter().flat_map(|c| c.pre).collect();
        let post = self.coeffs.iter().flat_map(|c| c.post).collect();
        let comb = self.coeffs.iter().flat_map(|c| c.comb.concat()).collect();
        (pre, post, comb)
    }
}

/// Where the f64 reference rounds to the storage precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// No rounding: the f32-in / f32-out op of this module.
    None,
    /// The model's bf16 streams, as the fused CUDA kernel stores them: X' (after the post update),
    /// the collapse u (before the norm) and the sublayer input are each rounded to bf16 (RNE).
    Bf16,
}

/// One boundary in f64: post update, shifted collapse + RMSNorm, new coefficients from X'.
///
/// Errors: as [`BoundaryIn::validate`].
pub fn boundary(p: &MhcParams, inp: &BoundaryIn) -> Result<RefBoundary> {
    boundary_rounded(p, inp, Rounding::None)
}

/// [`boundary`] with the rounding points of `rounding`.
///
/// Errors: as [`BoundaryIn::validate`].
pub fn boundary_rounded(
    p: &MhcParams,
    inp: &BoundaryIn,
    rounding: Rounding,
) -> Result<RefBoundary> {
    let round = |v: f64| match rounding {
        Rounding::None => v,
        Rounding::Bf16 => crate::formats::scalar::bf16_round(v as f32) as f64,
    };
    let t = inp.validate(p)?;
    let d = p.hidden;
    let mut out = RefBoundary {
        x_new: vec![0.0; t * HC * d],
        layer_in: vec![0.0; t * d],
        coeffs: Vec::new(),
    };
    for tok in 0..t {
        let x = &inp.x[tok * HC * d..(tok + 1) * HC * d];
        let xn = &mut out.x_new[tok * HC * d..(tok + 1) * HC * d];
        // X'_j = post_j·y + Σ_i C[i, j]·X_i
        for j in 0..HC {
            for k in 0..d {
                xn[j * d + k] = match &inp.update {
                    Some(u) => {
                        let post = u.post[tok * HC + j] as f64;
                        let mut v = post * u.y[tok * d + k] as f64;
                        for i in 0..HC {
                            let c = u.comb[tok * HC * HC + i * HC + j] as f64;
                            v += c * x[i * d + k] as f64;
                        }
                        round(v)
                    }
                    None => x[j * d + k] as f64,
                };
            }
        }
        // Shifted collapse with the carried pre, then RMSNorm.
        let li = &mut out.layer_in[tok * d..(tok + 1) * d];
        for (k, v) in li.iter_mut().enumerate() {
            *v = round(
                (0..HC)
                    .map(|j| inp.pre_prev[tok * HC + j] as f64 * xn[j * d + k])
                    .sum(),
            );
        }
        let ms = li.iter().map(|v| v * v).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + p.rms_eps as f64).sqrt();
        for (v, &w) in li.iter_mut().zip(inp.norm) {
            *v = round(*v * r * w as f64);
        }
        if let Some(w) = &inp.next {
            out.coeffs.push(token_coefficients(p, w, xn));
        }
    }
    Ok(out)
}
