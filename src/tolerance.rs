//! The one tolerance table every numeric test and `csa2 check` uses, and the comparison statistics
//! (FlashMLA / DeepGEMM style: special values first, then element bounds and cosine).

/// Allowed error of a path against its reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Elementwise: |a − b| ≤ abs + rel·|b|.
    pub abs: f64,
    /// Relative part of the element bound.
    pub rel: f64,
    /// Upper bound on 1 − cosine(a, b) over the whole tensor.
    pub cos_diff: f64,
}

/// Fast f32 path against the f64 reference on the same (already quantized) inputs.
pub const F32_VS_F64: Tolerance = Tolerance {
    abs: 1e-5,
    rel: 1e-5,
    cos_diff: 1e-9,
};
/// The integer indexer kernel (MXFP4 × MXFP4: each 32-dim block dot is an exact int32 sum times a
/// power of two) against the f64 reference on the same codes: only the 4-block sum, the ReLU'd
/// head-weighted sum and its lane reduction round, about 40 f32 roundings of values of the
/// logit's size, none inside the 128-long dot products (the f32 kernel rounds 127 times there).
pub const INT_DOT_VS_F64: Tolerance = Tolerance {
    abs: 1e-6,
    rel: 1e-6,
    cos_diff: 1e-12,
};
/// Attention on bf16 dots (`AttentionDots::Bf16`) against the f64 reference on the same rows: the
/// scaled query and the softmax weights are rounded to bf16 (relative error ≤ 2^-9 each; K and V
/// are exact). A logit z moves by about 2^-9/√3 · ‖q ⊙ k‖/√512 · √512 ≈ 1.1e-3 · σ(z), so a weight
/// moves by ~1e-3 · σ(z) of itself: measured 1 − cos ≤ 7e-6 and |Δ| ≤ 0.03 at σ(z) = 3 over
/// 1–72 heads and 62–640 rows (src/ops/attention/tests.rs), with this bound about 2× above.
/// The same bound holds for `AttentionDots::Int16` (NVFP4 keys' scores on an int16 query: error
/// ≤ 2^-16 of each head row's largest value, exact int32 block sums), checked by the same tests.
pub const BF16_DOTS_VS_F64: Tolerance = Tolerance {
    abs: 5e-2,
    rel: 5e-2,
    cos_diff: 2e-5,
};
/// Quantized path against quantize→dequantize reference (tight: same codes, f32 accumulation).
pub const QUANT_VS_QDQ: Tolerance = Tolerance {
    abs: 1e-4,
    rel: 1e-4,
    cos_diff: 1e-8,
};
/// Quantized path against the unquantized reference (loose: FP4 / FP8 rounding noise).
pub const QUANT_VS_EXACT: Tolerance = Tolerance {
    abs: 0.25,
    rel: 0.25,
    cos_diff: 2e-2,
};

/// An output rounded to bf16 (the compressor latent) against its f64 reference: an f32 difference
/// of one ulp before the rounding may move the value by one bf16 step (2^-7 relative at worst).
pub const BF16_ROUNDED: Tolerance = Tolerance {
    abs: 1e-6,
    rel: 1.0 / 128.0,
    cos_diff: 1e-7,
};
/// A GPU f32 kernel against the f64 reference on the same (already quantized) inputs: f32
/// accumulation over long dot products (640 keys × 512 dims in attention, 20,480-long mHC rows) in
/// a different summation order than the CPU.
pub const GPU_F32_VS_F64: Tolerance = Tolerance {
    abs: 1e-4,
    rel: 1e-4,
    cos_diff: 1e-9,
};
/// bf16 outputs of a GPU kernel against an f64 reference rounded to bf16 at the same points: where
/// the f32 and f64 values straddle a bf16 rounding boundary they differ by one bf16 ulp (2^-8).
pub const GPU_BF16_VS_F64: Tolerance = Tolerance {
    abs: 1e-6,
    rel: 8e-3,
    cos_diff: 1e-6,
};

/// Comparison statistics of `actual` against `expected`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Stats {
    /// Largest |a − b|.
    pub max_abs: f64,
    /// Largest |a − b| / max(|b|, tiny).
    pub max_rel: f64,
    /// 1 − cos(a, b) (0 for identical; defined as 0 when both are all zero).
    pub cos_diff: f64,
    /// Index of the worst element against the tolerance bound.
    pub worst: usize,
    /// Largest |a − b| / (abs + rel·|b|) over the finite elements: the element criterion passes
    /// when this is ≤ 1 (`csa2 check` prints it as the margin that decided the verdict).
    pub worst_bound_ratio: f64,
    /// Elements outside the bound.
    pub violations: usize,
    /// Positions where NaN/±Inf differ between the two (checked first).
    pub special_mismatches: usize,
}

impl Stats {
    /// Whether the comparison passed the tolerance.
    pub fn ok(&self, tol: &Tolerance) -> bool {
        self.special_mismatches == 0 && self.violations == 0 && self.cos_diff <= tol.cos_diff
    }
}

/// Compares `actual` to `expected` under `tol`. Lengths must match (panics otherwise: test helper).
pub fn compare<A: Into<f64> + Copy, B: Into<f64> + Copy>(
    actual: &[A],
    expected: &[B],
    tol: &Tolerance,
) -> Stats {
    assert_eq!(actual.len(), expected.len(), "compare: length mismatch");
    let mut s = Stats::default();
    let (mut dot, mut na, mut nb) = (0.0f64, 0.0f64, 0.0f64);
    let mut worst_ratio = -1.0f64;
    for (i, (&a, &b)) in actual.iter().zip(expected).enumerate() {
        let (a, b): (f64, f64) = (a.into(), b.into());
        if !a.is_finite() || !b.is_finite() {
            let same = (a.is_nan() && b.is_nan()) || a == b;
            if !same {
                s.special_mismatches += 1;
            }
            continue;
        }
        let d = (a - b).abs();
        let bound = tol.abs + tol.rel * b.abs();
        s.max_abs = s.max_abs.max(d);
        s.max_rel = s.max_rel.max(d / b.abs().max(1e-30));
        if d > bound {
            s.violations += 1;
        }
        if d / bound > worst_ratio {
            worst_ratio = d / bound;
            s.worst = i;
        }
        dot += a * b;
        na += a * a;
        nb += b * b;
    }
    s.worst_bound_ratio = worst_ratio.max(0.0);
    s.cos_diff = if na == 0.0 && nb == 0.0 {
        0.0
    } else {
        (1.0 - dot / (na.sqrt() * nb.sqrt()).max(1e-300)).max(0.0)
    };
    s
}
