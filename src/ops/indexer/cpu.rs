//! Indexer fast path.
//!
//! Keys are decoded a tile of `L` entries at a time into a transposed f32 tile `[128][L]` (L = 8
//! lanes of AVX2), so that one vector holds the same dim of L keys. For a block of 8 heads the
//! kernel then keeps 8 accumulators of L lanes (`acc[h] += q[h][d] · tile[d]`), and the ReLU and the
//! head weights are applied lane-wise: no horizontal sums. A decoded tile is reused by every query
//! of a query block (prefill); decode (one query) splits the keys across threads instead.

use super::{IndexKeys, IndexerParams, IndexerQueries, INDEX_DIM};
use crate::formats::scalar::{e2m1_decode, e8m0_decode};
use crate::formats::MXFP4_INDEX_BYTES;
use crate::ops::simd::{multiversion, Vf32};
use rayon::prelude::*;

/// Heads scored together (accumulators per lane group).
const HB: usize = 8;
/// Queries sharing one decoded tile in prefill.
const QB: usize = 8;
/// Keys per task when one query's keys are split across threads.
const KEYS_PER_TASK: usize = 8192;

/// Queries after fake quantisation, heads padded to a multiple of [`HB`] with zero weight.
pub struct Prepared {
    q: Vec<[f32; INDEX_DIM]>,
    w: Vec<f32>,
    hp: usize,
    vis: Vec<usize>,
}

impl Prepared {
    /// Copies, fake-quantises and pads the queries; `vis` = visible entries per token.
    pub fn new(p: &IndexerParams, qs: &IndexerQueries, vis: Vec<usize>) -> Prepared {
        let t = vis.len();
        let hp = p.heads.div_ceil(HB) * HB;
        let mut q = vec![[0f32; INDEX_DIM]; t * hp];
        let mut w = vec![0f32; t * hp];
        for ti in 0..t {
            for h in 0..p.heads {
                let row = &mut q[ti * hp + h];
                row.copy_from_slice(&qs.q[(ti * p.heads + h) * INDEX_DIM..][..INDEX_DIM]);
                p.query_quant.apply(row);
                w[ti * hp + h] = qs.w[ti * p.heads + h];
            }
        }
        Prepared { q, w, hp, vis }
    }
    fn tokens(&self) -> usize {
        self.vis.len()
    }
}

/// Dense logits; `out` is (tokens, keys.len()).
pub fn dense(pr: &Prepared, keys: IndexKeys, out: &mut [f32]) {
    let t = pr.tokens();
    let n = keys.len();
    if t == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    if t >= threads * QB {
        // Prefill: query blocks in parallel, each decoding a tile once for all its queries.
        out.par_chunks_mut(QB * n)
            .enumerate()
            .for_each(|(bi, rows)| {
                let t0 = bi * QB;
                let nq = rows.len() / n;
                let max_vis = pr.vis[t0..t0 + nq].iter().copied().max().unwrap_or(0);
                let mut ids = Vec::with_capacity(KEYS_PER_TASK);
                let mut start = 0;
                while start < max_vis {
                    let end = (start + KEYS_PER_TASK).min(max_vis);
                    ids.clear();
                    ids.extend(start as u32..end as u32);
                    let mut outs: Vec<&mut [f32]> =
                        rows.chunks_mut(n).map(|r| &mut r[start..end]).collect();
                    score_ids(pr, t0, &keys, &ids, &mut outs);
                    start = end;
                }
                for r in rows.chunks_mut(n) {
                    r[max_vis..].fill(f32::NEG_INFINITY);
                }
            });
    } else {
        // Decode / short batches: split each query's keys across threads.
        for (ti, row) in out.chunks_mut(n).enumerate() {
            let v = pr.vis[ti];
            row[v..].fill(f32::NEG_INFINITY);
            row[..v]
                .par_chunks_mut(KEYS_PER_TASK)
                .enumerate()
                .for_each(|(c, part)| {
                    let s = c * KEYS_PER_TASK;
                    let ids: Vec<u32> = (s as u32..(s + part.len()) as u32).collect();
                    score_ids(pr, ti, &keys, &ids, &mut [part]);
                });
        }
    }
}

/// Logits only at `pools[t]` (sorted entry ids); −∞ elsewhere. `out` is (tokens, keys.len()).
pub fn pooled(pr: &Prepared, keys: IndexKeys, pools: &[Vec<u32>], out: &mut [f32]) {
    let n = keys.len();
    if pr.tokens() == 0 || n == 0 {
        return;
    }
    out.par_chunks_mut(n).enumerate().for_each(|(ti, row)| {
        let ids = &pools[ti];
        let mut vals = vec![0f32; ids.len()];
        if pr.tokens() == 1 {
            vals.par_chunks_mut(KEYS_PER_TASK)
                .zip(ids.par_chunks(KEYS_PER_TASK))
                .for_each(|(v, id)| score_ids(pr, ti, &keys, id, &mut [v]));
        } else {
            score_ids(pr, ti, &keys, ids, &mut [&mut vals[..]]);
        }
        row.fill(f32::NEG_INFINITY);
        for (&j, &v) in ids.iter().zip(&vals) {
            row[j as usize] = v;
        }
    });
}

/// Scores entries `ids` (ascending) for queries `t0 .. t0 + outs.len()`; `outs[i][k]` receives the
/// logit of `ids[k]` for query `t0 + i` (−∞ when `ids[k]` is not visible to it).
pub fn score_ids(pr: &Prepared, t0: usize, keys: &IndexKeys, ids: &[u32], outs: &mut [&mut [f32]]) {
    score_ids_mv(&pr.q, &pr.w, pr.hp, &pr.vis, t0, keys, ids, outs)
}

multiversion!(
    score_ids_mv,
    fn(
        q: &[[f32; INDEX_DIM]],
        w: &[f32],
        hp: usize,
        vis: &[usize],
        t0: usize,
        keys: &IndexKeys<'_>,
        ids: &[u32],
        outs: &mut [&mut [f32]],
    ),
    score_ids_body
);

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn score_ids_body<V: Vf32>(
    q: &[[f32; INDEX_DIM]],
    w: &[f32],
    hp: usize,
    vis: &[usize],
    t0: usize,
    keys: &IndexKeys<'_>,
    ids: &[u32],
    outs: &mut [&mut [f32]],
) {
    // Transposed tile: dim d of key l at `tile[d · L + l]` (L = V::L ≤ 16).
    let mut tile = [0f32; INDEX_DIM * 16];
    let mut lg = [0f32; 16];
    for (ci, chunk) in ids.chunks(V::L).enumerate() {
        decode_tile(V::L, keys, chunk, &mut tile);
        let off = ci * V::L;
        for (qi, out) in outs.iter_mut().enumerate() {
            let t = t0 + qi;
            let dst = &mut out[off..off + chunk.len()];
            if chunk[0] as usize >= vis[t] {
                dst.fill(f32::NEG_INFINITY);
                continue;
            }
            tile_logits::<V>(
                &q[t * hp..(t + 1) * hp],
                &w[t * hp..(t + 1) * hp],
                &tile,
                &mut lg,
            );
            for (k, (d, &j)) in dst.iter_mut().zip(chunk).enumerate() {
                *d = if (j as usize) < vis[t] {
                    lg[k]
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    }
}

/// `Σ_h w[h] · ReLU(q[h] · key_l)` for the V::L keys of `tile` into `out[..V::L]`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // d indexes both the tile rows and every head's q
fn tile_logits<V: Vf32>(
    q: &[[f32; INDEX_DIM]],
    w: &[f32],
    tile: &[f32; INDEX_DIM * 16],
    out: &mut [f32; 16],
) {
    let zero = V::splat(0.0);
    let mut logit = zero;
    for (qb, wb) in q.chunks_exact(HB).zip(w.chunks_exact(HB)) {
        let qb: &[[f32; INDEX_DIM]; HB] = qb.try_into().expect("HB rows");
        let mut acc = [zero; HB];
        for d in 0..INDEX_DIM {
            // SAFETY: d·L + L ≤ 128·16 = tile.len() since L ≤ 16.
            let kv = unsafe { V::load(tile.as_ptr().add(d * V::L)) };
            for h in 0..HB {
                acc[h] = V::fmadd(V::splat(qb[h][d]), kv, acc[h]);
            }
        }
        for h in 0..HB {
            logit = V::fmadd(V::splat(wb[h]), V::max(acc[h], zero), logit);
        }
    }
    // SAFETY: `out` holds 16 ≥ L floats.
    unsafe { logit.store(out.as_mut_ptr()) };
}

/// Decodes entries `ids` into the transposed tile of `l` lanes (missing lanes zero).
#[inline(always)]
fn decode_tile(lanes: usize, keys: &IndexKeys<'_>, ids: &[u32], tile: &mut [f32; INDEX_DIM * 16]) {
    if ids.len() < lanes {
        tile.fill(0.0);
    }
    match keys {
        IndexKeys::F32(k) => {
            for (l, &j) in ids.iter().enumerate() {
                let row = &k[j as usize * INDEX_DIM..][..INDEX_DIM];
                for d in 0..INDEX_DIM {
                    tile[d * lanes + l] = row[d];
                }
            }
        }
        IndexKeys::Mxfp4(k) => {
            for (l, &j) in ids.iter().enumerate() {
                let rec: &[u8; MXFP4_INDEX_BYTES] = k[j as usize * MXFP4_INDEX_BYTES..]
                    [..MXFP4_INDEX_BYTES]
                    .try_into()
                    .unwrap();
                for b in 0..4 {
                    let lut = scaled_lut(e8m0_decode(rec[64 + b]));
                    for i in 0..16 {
                        let byte = rec[b * 16 + i];
                        tile[(b * 32 + 2 * i) * lanes + l] = lut[(byte & 15) as usize];
                        tile[(b * 32 + 2 * i + 1) * lanes + l] = lut[(byte >> 4) as usize];
                    }
                }
            }
        }
    }
}

/// The 16 E2M1 code values times `s`.
#[inline(always)]
fn scaled_lut(s: f32) -> [f32; 16] {
    let mut t = [0f32; 16];
    for (c, v) in t.iter_mut().enumerate() {
        *v = e2m1_decode(c as u8) * s;
    }
    t
}
