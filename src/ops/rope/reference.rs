//! RoPE reference in f64: the rotation written out per pair, no tables.

use super::{Direction, Rope};

/// Returns `x` (tokens, heads, dim) with the last `rope_dim` dims of each head rotated, in f64.
pub fn rope(
    rope: &Rope,
    x: &[f32],
    heads: usize,
    dim: usize,
    positions: &[i64],
    dir: Direction,
) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let start = dim - rope.rope_dim();
    for (t, &p) in positions.iter().enumerate() {
        for h in 0..heads {
            let row = &mut out[(t * heads + h) * dim..][..dim];
            rotate_f64(rope, &mut row[start..], p as u64, dir);
        }
    }
    out
}

/// Rotates interleaved pairs of `x` (the rope dims) at position `pos` in f64.
pub fn rotate_f64(rope: &Rope, x: &mut [f64], pos: u64, dir: Direction) {
    let sign = if dir == Direction::Forward { 1.0 } else { -1.0 };
    for (i, pair) in x.chunks_exact_mut(2).enumerate() {
        let angle = sign * pos as f64 * rope.inv_freqs()[i];
        let (s, c) = angle.sin_cos();
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * c - b * s;
        pair[1] = a * s + b * c;
    }
}
