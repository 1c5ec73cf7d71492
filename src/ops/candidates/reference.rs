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
