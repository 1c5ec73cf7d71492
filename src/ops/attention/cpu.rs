//! Attention fast path.
//!
//! Per token the ≤ 640 attended rows are gathered and decoded to f32 once, then shared by all heads
//! (MQA). Scores use the indexer's layout trick: keys transposed a tile of L at a time so a block of
//! 8 heads keeps 8 × L-lane accumulators; P·V keeps 8 heads × 2 vectors of output dims in
//! registers while streaming the rows. Tokens run in parallel; a lone token (decode) splits its
//! heads across threads instead.

use super::{AttentionInputs, AttentionParams, KvRows, TokenRows};
use crate::formats::KV_DIM;
use crate::ops::simd::{multiversion, Vf32};
use rayon::prelude::*;

/// Heads per register block.
const HB: usize = 8;

/// Runs every token; shapes are checked by [`super::attention`].
pub fn attention(
    p: &AttentionParams,
    inp: &AttentionInputs,
    rows: &[TokenRows],
    main: KvRows,
    swa: KvRows,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let h = p.heads;
    let t = rows.len();
    if t == 0 {
        return;
    }
    let one = |ti: usize, kf: &[f32], n: usize, h0: usize, o: &mut [f32], l: &mut [f32]| {
        let q = &inp.q[(ti * h + h0) * KV_DIM..][..o.len()];
        let sink = &inp.sink[h0..h0 + l.len()];
        heads_mv(q, kf, n, p.scale, sink, o, l);
    };
    if t >= rayon::current_num_threads() {
        out.par_chunks_mut(h * KV_DIM)
            .zip(lse.par_chunks_mut(h))
            .enumerate()
            .for_each(|(ti, (o, l))| {
                let (kf, n) = gather(&rows[ti], &main, &swa);
                one(ti, &kf, n, 0, o, l);
            });
    } else {
        let per = h.div_ceil(rayon::current_num_threads()).div_ceil(HB) * HB;
        for (ti, (o, l)) in out
            .chunks_mut(h * KV_DIM)
            .zip(lse.chunks_mut(h))
            .enumerate()
        {
            let (kf, n) = gather(&rows[ti], &main, &swa);
            o.par_chunks_mut(per * KV_DIM)
                .zip(l.par_chunks_mut(per))
                .enumerate()
                .for_each(|(c, (o, l))| one(ti, &kf, n, c * per, o, l));
        }
    }
}

/// Decodes a token's attended rows (main entries, then the window) into (n, 512) f32.
fn gather(r: &TokenRows, main: &KvRows, swa: &KvRows) -> (Vec<f32>, usize) {
    let n = r.main.len() + r.swa.len();
    let mut kf = vec![0f32; n * KV_DIM];
    let (a, b) = kf.split_at_mut(r.main.len() * KV_DIM);
    for (dst, &j) in a.chunks_exact_mut(KV_DIM).zip(&r.main) {
        main.row(j, dst);
    }
    for (dst, s) in b.chunks_exact_mut(KV_DIM).zip(r.swa.clone()) {
        swa.row(s, dst);
    }
    (kf, n)
}

multiversion!(
    heads_mv,
    fn(q: &[f32], kf: &[f32], n: usize, scale: f32, sink: &[f32], out: &mut [f32], lse: &mut [f32]),
    heads_body
);

/// Attention of `lse.len()` heads (q rows `q`, output rows `out`) over the `n` rows of `kf`.
#[inline(always)]
fn heads_body<V: Vf32>(
    q: &[f32],
    kf: &[f32],
    n: usize,
    scale: f32,
    sink: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    let h = lse.len();
    if n == 0 {
        out.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        return;
    }
    let l = V::L;
    let zero = V::splat(0.0);
    // Scores (h, n), then probabilities in place. Keys transposed a tile of L at a time.
    let mut s = vec![0f32; h * n];
    let mut tile = vec![0f32; KV_DIM * l];
    let mut lanes = [0f32; 16];
    for c0 in (0..n).step_by(l) {
        let w = l.min(n - c0);
        for j in 0..l {
            for d in 0..KV_DIM {
                tile[d * l + j] = if j < w {
                    kf[(c0 + j) * KV_DIM + d]
                } else {
                    0.0
                };
            }
        }
        for h0 in (0..h).step_by(HB) {
            let hb = HB.min(h - h0);
            let mut acc = [zero; HB];
            let rows: [usize; HB] = std::array::from_fn(|i| (h0 + i.min(hb - 1)) * KV_DIM);
            for d in 0..KV_DIM {
                // SAFETY: (d + 1)·L ≤ tile.len() = 512·L.
                let kv = unsafe { V::load(tile.as_ptr().add(d * l)) };
                for i in 0..HB {
                    acc[i] = V::fmadd(V::splat(q[rows[i] + d]), kv, acc[i]);
                }
            }
            for (i, a) in acc.iter().enumerate().take(hb) {
                // SAFETY: `lanes` holds 16 ≥ L floats.
                unsafe { a.store(lanes.as_mut_ptr()) };
                s[(h0 + i) * n + c0..][..w].copy_from_slice(&lanes[..w]);
            }
        }
    }
    for (hi, row) in s.chunks_exact_mut(n).enumerate() {
        let mut mx = f32::NEG_INFINITY;
        for v in row.iter_mut() {
            *v *= scale;
            mx = mx.max(*v);
        }
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v;
        }
        lse[hi] = mx + sum.ln();
        // Sink in the denominator only, in the frame of the row max (e^(a − mx) may overflow to ∞,
        // which correctly drives the output to 0).
        let inv = 1.0 / (sum + (sink[hi] - mx).exp());
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
    // Output: HB heads × 2L dims of accumulators per pass over the rows.
    for h0 in (0..h).step_by(HB) {
        let hb = HB.min(h - h0);
        for d0 in (0..KV_DIM).step_by(2 * l) {
            let mut acc = [[zero; 2]; HB];
            for j in 0..n {
                let row = &kf[j * KV_DIM + d0..][..2 * l];
                // SAFETY: `row` holds 2L floats.
                let (k0, k1) = unsafe { (V::load(row.as_ptr()), V::load(row.as_ptr().add(l))) };
                for (i, a) in acc.iter_mut().enumerate().take(hb) {
                    let p = V::splat(s[(h0 + i) * n + j]);
                    a[0] = V::fmadd(p, k0, a[0]);
                    a[1] = V::fmadd(p, k1, a[1]);
                }
            }
            for (i, a) in acc.iter().enumerate().take(hb) {
                let o = &mut out[(h0 + i) * KV_DIM + d0..][..2 * l];
                // SAFETY: `o` holds 2L writable floats.
                unsafe {
                    a[0].store(o.as_mut_ptr());
                    a[1].store(o.as_mut_ptr().add(l));
                }
            }
        }
    }
}
