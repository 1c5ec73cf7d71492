//! Rotary position embedding (docs/SPEC.md §2 "RoPE"): GPT-J interleaved pairs `(2i, 2i+1)` on the last
//! `rope_dim` (64) dims of every head, frequencies from [`RopeParams::inv_freqs`] (θ = 160000 with
//! YaRN on compressed layers, θ = 10000 plain on ratio-0 layers; no mscale).
//!
//! Forward rotation at position p by angle `p·freq_i`:
//! `(x₀, x₁) → (x₀·cos − x₁·sin, x₀·sin + x₁·cos)`; the inverse rotates by `−p·freq_i` (used on the
//! attention output, dims 448–511). Angles are formed in f64 (p up to 1M makes `p·freq` lose digits
//! in f32) and cos/sin are rounded to f32 once per token, then shared by every head.

pub mod cpu;
pub mod reference;

use crate::error::{Error, Result};
use crate::geometry::{LayerPlan, RopeParams};

/// Most rotated pairs supported (CSA2 uses 32); lets the fast path keep cos/sin on the stack.
pub const MAX_PAIRS: usize = 128;

/// Rotation direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Rotate by `+p·freq` (Q, KV, index Q/K).
    Forward,
    /// Rotate by `−p·freq` (the attention output before the output projection).
    Inverse,
}

/// A layer's rotary embedding, ready to apply.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    inv_freqs: Vec<f64>,
    rope_dim: usize,
}

impl Rope {
    /// Builds the rotary of `params`.
    ///
    /// Errors: [`Error::Invalid`] when `rope_dim` is zero, odd or above 256, or θ is not finite and > 1.
    pub fn new(params: &RopeParams) -> Result<Rope> {
        if params.rope_dim == 0
            || !params.rope_dim.is_multiple_of(2)
            || params.rope_dim > 2 * MAX_PAIRS
        {
            return Err(Error::invalid(
                "rope_dim",
                format!(
                    "must be even, > 0 and ≤ {}, found {}",
                    2 * MAX_PAIRS,
                    params.rope_dim
                ),
            ));
        }
        if !(params.theta.is_finite() && params.theta > 1.0) {
            return Err(Error::invalid(
                "theta",
                format!("must be finite and > 1, found {}", params.theta),
            ));
        }
        Ok(Rope {
            inv_freqs: params.inv_freqs(),
            rope_dim: params.rope_dim,
        })
    }

    /// The rotary of one layer of the geometry.
    pub fn for_layer(plan: &LayerPlan) -> Rope {
        Rope::new(&plan.rope).expect("geometry validates its rope parameters")
    }

    /// Rotated dims (64).
    pub fn rope_dim(&self) -> usize {
        self.rope_dim
    }

    /// Per-pair inverse frequencies (`rope_dim / 2` values, YaRN applied).
    pub fn inv_freqs(&self) -> &[f64] {
        &self.inv_freqs
    }

    /// cos and sin of `pos·freq_i` for every pair, computed in f64 and rounded to f32.
    /// `cos` and `sin` must hold `rope_dim / 2` values.
    pub fn cos_sin(&self, pos: u64, dir: Direction, cos: &mut [f32], sin: &mut [f32]) {
        let sign = match dir {
            Direction::Forward => 1.0,
            Direction::Inverse => -1.0,
        };
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freqs) {
            let (sn, cs) = (pos as f64 * f).sin_cos();
            *c = cs as f32;
            *s = (sign * sn) as f32;
        }
    }

    /// Rotates the last `rope_dim` dims of one head row (`row.len()` ≥ `rope_dim`) with
    /// precomputed [`Rope::cos_sin`] values.
    #[inline]
    pub fn rotate_row(&self, row: &mut [f32], cos: &[f32], sin: &[f32]) {
        let start = row.len() - self.rope_dim;
        cpu::rotate_pairs(&mut row[start..], cos, sin);
    }

    /// Rotates `x` (tokens, heads, dim) in place, token t at `positions[t]` (fast path).
    ///
    /// Errors: [`Error::Shape`] when `x.len() != tokens·heads·dim` or `dim < rope_dim`;
    /// [`Error::Invalid`] for a negative position.
    pub fn apply(
        &self,
        x: &mut [f32],
        heads: usize,
        dim: usize,
        positions: &[i64],
        dir: Direction,
    ) -> Result<()> {
        self.check(x.len(), heads, dim, positions)?;
        cpu::apply(self, x, heads, dim, positions, dir);
        Ok(())
    }

    pub(crate) fn check(
        &self,
        len: usize,
        heads: usize,
        dim: usize,
        positions: &[i64],
    ) -> Result<()> {
        if dim < self.rope_dim {
            return Err(Error::shape(
                "rope head dim",
                format!("at least rope_dim = {}", self.rope_dim),
                dim,
            ));
        }
        let want = positions.len() * heads * dim;
        if len != want {
            return Err(Error::shape(
                "rope input x",
                format!(
                    "[T={}, H={heads}, D={dim}] = {want} values",
                    positions.len()
                ),
                format!("{len} values"),
            ));
        }
        check_positions(positions)
    }
}

/// Checks every position is ≥ 0; [`Error::Invalid`] names the first bad token.
pub fn check_positions(positions: &[i64]) -> Result<()> {
    if let Some((t, &p)) = positions.iter().enumerate().find(|(_, &p)| p < 0) {
        return Err(Error::invalid(
            "positions",
            format!("position of token {t} must be ≥ 0, found {p}"),
        ));
    }
    Ok(())
}

/// The tensor signature of the rotary op (`csa2_rope`, `csa2 op rope`): `x [T, H, D]` float rotated
/// in place, token t at `positions[t]` (`[T]` int, ≥ 0); D ≥ `rope_dim` is checked by [`Rope::apply`].
pub mod signature {
    use crate::shape::{Arg, Dim, Signature};
    use crate::tensor::{FLOATS, INTS};

    /// `[T, H, D]` float, rotated in place.
    pub const X: Arg = Arg::read_write("x", FLOATS, &[Dim::Any("T"), Dim::Any("H"), Dim::Any("D")]);
    /// `[T]` int token positions (≥ 0).
    pub const POSITIONS: Arg = Arg::read("positions", INTS, &[Dim::Any("T")]);
    /// `csa2_rope`.
    pub const ROPE: Signature = Signature {
        op: "rope",
        args: &[X, POSITIONS],
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Geometry;
    use crate::tolerance::{compare, F32_VS_F64};

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| r.random_range(-2.0f32..2.0)).collect()
    }

    #[test]
    fn fast_matches_reference_and_inverse_undoes_forward() {
        let g = Geometry::embedded();
        for layer in [0usize, 2, 20] {
            let rope = Rope::for_layer(&g.layers[layer]);
            let positions = [0i64, 1, 127, 128, 65_535, 65_536, 1_048_575];
            let (h, d) = (3, 512);
            let x = rand_vec(positions.len() * h * d, layer as u64);
            let mut y = x.clone();
            rope.apply(&mut y, h, d, &positions, Direction::Forward)
                .unwrap();
            let r = reference::rope(&rope, &x, h, d, &positions, Direction::Forward);
            let s = compare(&y, &r, &F32_VS_F64);
            assert!(s.ok(&F32_VS_F64), "layer {layer}: {s:?}");
            // NoPE dims untouched.
            assert_eq!(&y[..448], &x[..448]);
            rope.apply(&mut y, h, d, &positions, Direction::Inverse)
                .unwrap();
            let s = compare(&y, &x, &F32_VS_F64);
            assert!(s.ok(&F32_VS_F64), "roundtrip layer {layer}: {s:?}");
        }
    }

    #[test]
    fn position_zero_is_identity_and_pairs_are_interleaved() {
        let g = Geometry::embedded();
        let rope = Rope::for_layer(&g.layers[0]);
        let mut x: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let x0 = x.clone();
        rope.apply(&mut x, 1, 64, &[0], Direction::Forward).unwrap();
        assert_eq!(x, x0);
        // Pair 0 has freq 1 (θ^0): at p = 1 it rotates (x0, x1) by one radian.
        let mut x = vec![0f32; 64];
        x[0] = 1.0;
        rope.apply(&mut x, 1, 64, &[1], Direction::Forward).unwrap();
        assert!((x[0] - 1f32.cos()).abs() < 1e-7 && (x[1] - 1f32.sin()).abs() < 1e-7);
        assert!(x[2..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn bad_shapes_and_positions_are_errors() {
        let g = Geometry::embedded();
        let rope = Rope::for_layer(&g.layers[2]);
        let mut x = vec![0f32; 100];
        assert!(rope.apply(&mut x, 1, 100, &[0], Direction::Forward).is_ok());
        assert!(rope.apply(&mut x, 1, 50, &[0], Direction::Forward).is_err());
        assert!(rope
            .apply(&mut x, 1, 100, &[-1], Direction::Forward)
            .is_err());
        assert!(rope
            .apply(&mut x, 2, 100, &[0], Direction::Forward)
            .is_err());
    }
}
