//! Attention fast path.
//!
//! Per token the ≤ 640 attended rows are gathered and decoded to f32 once, then shared by all heads
//! (MQA). Scores use the indexer's layout trick: keys transposed a tile of L at a time so a block of
//! 8 heads keeps 8 × L-lane accumulators; P·V keeps 8 heads × 2 vectors of output dims in
//! registers while streaming the rows. Tokens run in parallel; a lone token (decode) splits its
//! heads across threads instead.

use super::{AttentionInputs, AttentionParams, KvRows, TokenRows};
use crate::formats::KV_DIM;
use crate::ops::simd::multiversion;
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
fn heads_body<const L: usize>(
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
    // Scores (h, n), then probabilities in place.
    let mut s = vec![0f32; h * n];
    let mut tile_buf = vec![[0f32; L]; KV_DIM];
    let tile: &mut [[f32; L]; KV_DIM] = (&mut tile_buf[..]).try_into().expect("KV_DIM rows");
    for c0 in (0..n).step_by(L) {
        let w = L.min(n - c0);
        for (d, t) in tile.iter_mut().enumerate() {
            for l in 0..L {
                t[l] = if l < w {
                    kf[(c0 + l) * KV_DIM + d]
                } else {
                    0.0
                };
            }
        }
        let mut h0 = 0;
        while h0 < h {
            let hb = HB.min(h - h0);
            let mut acc = [[0f32; L]; HB];
            if hb == HB {
                let qb: [&[f32; KV_DIM]; HB] = std::array::from_fn(|i| {
                    q[(h0 + i) * KV_DIM..][..KV_DIM]
                        .try_into()
                        .expect("one head row")
                });
                for d in 0..KV_DIM {
                    let kv = &tile[d];
                    for i in 0..HB {
                        let qv = qb[i][d];
                        for l in 0..L {
                            acc[i][l] = qv.mul_add(kv[l], acc[i][l]);
                        }
                    }
                }
            } else {
                for (i, a) in acc.iter_mut().enumerate().take(hb) {
                    let qr = &q[(h0 + i) * KV_DIM..][..KV_DIM];
                    for d in 0..KV_DIM {
                        for l in 0..L {
                            a[l] = qr[d].mul_add(tile[d][l], a[l]);
                        }
                    }
                }
            }
            for i in 0..hb {
                s[(h0 + i) * n + c0..][..w].copy_from_slice(&acc[i][..w]);
            }
            h0 += hb;
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
        let den = sum + (sink[hi] - mx).exp();
        let inv = 1.0 / den;
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
    // Output: 8 heads × 2L dims of accumulators per pass over the rows.
    let mut h0 = 0;
    while h0 < h {
        let hb = HB.min(h - h0);
        for d0 in (0..KV_DIM).step_by(2 * L) {
            let mut acc = [[[0f32; L]; 2]; HB];
            for j in 0..n {
                let k0 = &kf[j * KV_DIM + d0..][..L];
                let k1 = &kf[j * KV_DIM + d0 + L..][..L];
                for i in 0..hb {
                    let pv = s[(h0 + i) * n + j];
                    for l in 0..L {
                        acc[i][0][l] = pv.mul_add(k0[l], acc[i][0][l]);
                        acc[i][1][l] = pv.mul_add(k1[l], acc[i][1][l]);
                    }
                }
            }
            for i in 0..hb {
                let o = &mut out[(h0 + i) * KV_DIM + d0..][..2 * L];
                o[..L].copy_from_slice(&acc[i][0]);
                o[L..].copy_from_slice(&acc[i][1]);
            }
        }
        h0 += hb;
    }
}
