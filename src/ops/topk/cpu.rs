//! Threshold top-k: sample → threshold → one filtering read pass → exact selection among the few
//! survivors. Costs about one read of the row when the threshold estimate holds (the usual case);
//! otherwise one more exact pass.

use super::order;

/// Rows shorter than this skip sampling: a single exact pass is as cheap.
const SMALL: usize = 8192;
/// Sampled entries for the threshold estimate.
const SAMPLES: usize = 2048;
/// Entries per filtering chunk: a vectorised compare-and-count decides whether to look closer.
const CHUNK: usize = 64;

/// Selects the `out.len()` largest selectable entries of `values` (> −∞, not NaN), sorted by
/// (value desc, index asc), −1 padded. Returns how many were selected.
pub fn select_scored(values: &[f32], out: &mut [i32]) -> usize {
    let k = out.len();
    let n = values.len();
    if k == 0 {
        return 0;
    }
    let mut cand: Vec<i32> = Vec::new();
    if n > SMALL && k * 16 < n {
        if let Some(tau) = estimate_threshold(values, k) {
            collect_at_least(values, tau, &mut cand);
            if cand.len() < k {
                cand.clear();
            }
        }
    }
    if cand.is_empty() {
        cand.extend((0..n as i32).filter(|&j| values[j as usize] > f32::NEG_INFINITY));
    }
    let cmp = |a: &i32, b: &i32| order(values[*a as usize], *a, values[*b as usize], *b);
    if cand.len() > k {
        cand.select_nth_unstable_by(k - 1, cmp);
        cand.truncate(k);
    }
    cand.sort_unstable_by(cmp);
    let m = cand.len();
    out[..m].copy_from_slice(&cand);
    out[m..].fill(-1);
    m
}

/// A threshold that about 4·k + 64 entries are expected to reach, from a strided sample; None when
/// the sample has too few selectable entries to say.
fn estimate_threshold(values: &[f32], k: usize) -> Option<f32> {
    let n = values.len();
    let stride = n / SAMPLES;
    let mut s: Vec<f32> = (0..SAMPLES)
        .map(|i| values[i * stride + (i * 7919) % stride.max(1)])
        .filter(|v| *v > f32::NEG_INFINITY)
        .collect();
    // Rank in the sample that corresponds to about 4k entries of the row, plus slack for noise.
    let rank = (4 * k * SAMPLES).div_ceil(n) + 16;
    if s.len() <= rank {
        return None;
    }
    let (_, t, _) = s.select_nth_unstable_by(rank, |a, b| b.total_cmp(a));
    Some(*t)
}

/// Appends every index whose value is ≥ `tau` (tau finite).
fn collect_at_least(values: &[f32], tau: f32, cand: &mut Vec<i32>) {
    let mut base = 0usize;
    let mut chunks = values.chunks_exact(CHUNK);
    for c in &mut chunks {
        // Counting (not branching) per element lets the compiler vectorise the common, empty case.
        let hits: u32 = c.iter().map(|&v| u32::from(v >= tau)).sum();
        if hits != 0 {
            for (i, &v) in c.iter().enumerate() {
                if v >= tau {
                    cand.push((base + i) as i32);
                }
            }
        }
        base += CHUNK;
    }
    for (i, &v) in chunks.remainder().iter().enumerate() {
        if v >= tau {
            cand.push((base + i) as i32);
        }
    }
}
