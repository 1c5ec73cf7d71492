//! Candidate-pool reference: block maxima written out, then a full sort.

use super::CandidateParams;

/// The kept blocks of one row, sorted by (score desc, id asc), −1 padded to `num_blocks`.
pub fn select_blocks(p: &CandidateParams, logits: &[f32], visible: usize) -> Vec<i32> {
    let visible = visible.min(logits.len());
    let nblocks = visible.div_ceil(p.block_size);
    let mut scores: Vec<f32> = (0..nblocks)
        .map(|b| {
            let mut m = f32::NEG_INFINITY;
            for &v in &logits[b * p.block_size..((b + 1) * p.block_size).min(visible)] {
                if !v.is_nan() && v > m {
                    m = v;
                }
            }
            m
        })
        .collect();
    if nblocks > 0 {
        scores[nblocks - 1] = f32::INFINITY;
    }
    crate::ops::topk::reference::select_scored(&scores, p.num_blocks)
}

/// The candidate pool of every row as a block mask (rows, ceil(n_cols / block_size)) u8, 1 = kept:
/// [`select_blocks`] of each row's first `n_valid[t]` logits (the CUDA kernel's output form).
pub fn pool_mask(p: &CandidateParams, logits: &[f32], n_cols: usize, n_valid: &[i32]) -> Vec<u8> {
    let nb = n_cols.div_ceil(p.block_size);
    let mut mask = vec![0u8; n_valid.len() * nb];
    for (t, &nv) in n_valid.iter().enumerate() {
        let row = &logits[t * n_cols..(t + 1) * n_cols];
        for b in select_blocks(p, row, (nv.max(0) as usize).min(n_cols)) {
            if b >= 0 {
                mask[t * nb + b as usize] = 1;
            }
        }
    }
    mask
}
