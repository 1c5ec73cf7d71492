//! Block scores: a max over each block, eight lanes at a time.

/// `scores[b]` = max of `logits[b·bs .. (b+1)·bs]` (last block may be short); NaN is ignored
/// (a block of only NaN / −∞ scores −∞).
pub fn block_scores(logits: &[f32], bs: usize, scores: &mut [f32]) {
    for (s, c) in scores.iter_mut().zip(logits.chunks(bs)) {
        // `f32::max` returns the non-NaN operand, so NaN never wins.
        *s = c.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    }
}
