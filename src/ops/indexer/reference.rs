//! Indexer reference: every visible logit in f64, keys decoded exactly, Q fake-quantised with the
//! same quantiser as the fast path.

use super::{visible, IndexCache, IndexKeys, IndexerParams, IndexerQueries, INDEX_DIM};
use crate::formats::page::{block_table_slot, PageLayout};
use crate::formats::RecordFormat;
use rayon::prelude::*;

/// Dense logits (tokens, entries) in f64; −∞ where not visible, and outside `pools` when given
/// (`pools[t]` = entry ids the query may score).
pub fn logits(
    p: &IndexerParams,
    qs: &IndexerQueries,
    keys: IndexKeys,
    pools: Option<&[Vec<u32>]>,
) -> Vec<f64> {
    let n = keys.len();
    let t = qs.positions.len();
    let mut out = vec![f64::NEG_INFINITY; t * n];
    let mut k = [0f32; INDEX_DIM];
    for ti in 0..t {
        let vis = visible(qs.positions[ti], p.ratio).min(n);
        let q: Vec<[f32; INDEX_DIM]> = (0..p.heads)
            .map(|h| {
                let mut r = [0f32; INDEX_DIM];
                r.copy_from_slice(&qs.q[(ti * p.heads + h) * INDEX_DIM..][..INDEX_DIM]);
                p.query_quant.apply(&mut r);
                r
            })
            .collect();
        let allowed: Option<std::collections::HashSet<u32>> =
            pools.map(|pl| pl[ti].iter().copied().collect());
        for j in 0..vis {
            if let Some(a) = &allowed {
                if !a.contains(&(j as u32)) {
                    continue;
                }
            }
            keys.row(j, &mut k);
            let mut logit = 0f64;
            for (h, qh) in q.iter().enumerate() {
                let dot: f64 = qh.iter().zip(&k).map(|(&a, &b)| a as f64 * b as f64).sum();
                logit += qs.w[ti * p.heads + h] as f64 * dot.max(0.0);
            }
            out[ti * n + j] = logit;
        }
    }
    out
}

/// The batched, paged indexer (the CUDA kernel's contract) in f64: row t (query `qs` row t of
/// request `req[t]`) scores entries `0..n_cols` of its request through the block table with
/// [`logits`]; entries not visible, unmapped, or (with `cand_mask` = (mask (T, stride) u8 per
/// 8-entry block, stride)) outside the pool are −∞. Returns (T, n_cols).
///
/// Panics on inconsistent shapes (a reference: callers check with the op's signature first).
pub fn logits_paged(
    p: &IndexerParams,
    qs: &IndexerQueries,
    req: &[i32],
    cache: &IndexCache,
    cand_mask: Option<(&[u8], usize)>,
    n_cols: usize,
) -> Vec<f64> {
    let layout = PageLayout {
        format: RecordFormat::Mxfp4Index,
        slots: cache.page_slots,
    };
    let t = qs.positions.len();
    let mut out = vec![f64::NEG_INFINITY; t * n_cols];
    out.par_chunks_mut(n_cols.max(1))
        .take(t)
        .enumerate()
        .for_each(|(row, o)| {
            let r = req[row] as usize;
            let bt = &cache.block_table[r * cache.max_blocks..(r + 1) * cache.max_blocks];
            let slots: Vec<Option<usize>> = (0..n_cols)
                .map(|j| block_table_slot(bt, j as i64, cache.page_slots))
                .collect();
            let ids: Vec<i64> = slots.iter().map(|s| s.map_or(-1, |s| s as i64)).collect();
            let mut keys = vec![0f32; n_cols * INDEX_DIM];
            layout
                .decode_from_pages(cache.pages, &ids, &mut keys)
                .expect("block table inside the pool");
            let pool: Vec<u32> = (0..n_cols as u32)
                .filter(|&j| slots[j as usize].is_some())
                .filter(|&j| cand_mask.is_none_or(|(m, s)| m[row * s + j as usize / 8] != 0))
                .collect();
            let h = p.heads;
            let one = IndexerQueries {
                q: &qs.q[row * h * INDEX_DIM..(row + 1) * h * INDEX_DIM],
                w: &qs.w[row * h..(row + 1) * h],
                positions: &qs.positions[row..row + 1],
            };
            let l = logits(p, &one, IndexKeys::F32(&keys), Some(&[pool]));
            o.copy_from_slice(&l);
        });
    out
}
