//! Indexer reference: every visible logit in f64, keys decoded exactly, Q fake-quantised with the
//! same quantiser as the fast path.

use super::{visible, IndexKeys, IndexerParams, IndexerQueries, INDEX_DIM};

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
