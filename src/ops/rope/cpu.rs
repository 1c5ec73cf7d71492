//! RoPE fast path: cos/sin once per token (f64 → f32), shared by all heads; tokens in parallel.

use super::MAX_PAIRS;
use super::{Direction, Rope};
use rayon::prelude::*;

/// Values per parallel task; smaller inputs run on the calling thread.
const VALUES_PER_TASK: usize = 1 << 15;

/// Rotates interleaved pairs of `x` (`2·cos.len()` values) by the given cos/sin.
#[inline]
pub fn rotate_pairs(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for ((p, &c), &s) in x.chunks_exact_mut(2).zip(cos).zip(sin) {
        let (a, b) = (p[0], p[1]);
        p[0] = a * c - b * s;
        p[1] = a * s + b * c;
    }
}

/// Rotates `x` (tokens, heads, dim) in place; shapes already checked by [`Rope::apply`].
pub fn apply(
    rope: &Rope,
    x: &mut [f32],
    heads: usize,
    dim: usize,
    positions: &[i64],
    dir: Direction,
) {
    let token_len = heads * dim;
    if token_len == 0 {
        return;
    }
    let half = rope.rope_dim() / 2;
    let one = |tok: &mut [f32], pos: i64| {
        let mut cos = [0f32; MAX_PAIRS];
        let mut sin = [0f32; MAX_PAIRS];
        let (cos, sin) = (&mut cos[..half], &mut sin[..half]);
        rope.cos_sin(pos as u64, dir, cos, sin);
        for head in tok.chunks_exact_mut(dim) {
            rope.rotate_row(head, cos, sin);
        }
    };
    if x.len() < 2 * VALUES_PER_TASK {
        x.chunks_exact_mut(token_len)
            .zip(positions)
            .for_each(|(t, &p)| one(t, p));
    } else {
        let per = (VALUES_PER_TASK / token_len).max(1);
        x.par_chunks_mut(token_len * per)
            .zip(positions.par_chunks(per))
            .for_each(|(ts, ps)| {
                ts.chunks_exact_mut(token_len)
                    .zip(ps)
                    .for_each(|(t, &p)| one(t, p))
            });
    }
}
