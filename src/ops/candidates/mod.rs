//! Hierarchical candidate pool (docs/SPEC.md §2.6): the candidate source
//! (layer 20) turns its full indexer logits into a set of blocks that the Reindex layers
//! (24, 28, 32, 36) then score inside.
//!
//! For one query with `visible` entries and logits `I[j]`:
//! - block b covers entries `[b·block_size, (b+1)·block_size)`; its score is the max of its visible
//!   logits (invisible and NaN count as −∞);
//! - the block holding the newest visible entry, `(visible − 1) div block_size`, is pinned (+∞);
//! - keep the top `min(num_blocks, nblocks)` blocks whose score is not −∞, ties → smaller block id,
//!   sorted by (score desc, id asc), −1 padded.
//!
//! With `visible ≤ num_blocks · block_size` (16,384) every block with a finite score is kept, so the
//! pool masks nothing that is not already −∞: it is a no-op, as docs/SPEC.md §2.6 states.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod reference;

use crate::error::{Error, Result};
use rayon::prelude::*;

/// Pool parameters (geometry: `candidate_block_size` = 8, `candidate_topk_blocks` = 2048).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CandidateParams {
    /// Entries per block (8).
    pub block_size: usize,
    /// Blocks kept (2048).
    pub num_blocks: usize,
}

impl Default for CandidateParams {
    fn default() -> Self {
        CandidateParams {
            block_size: 8,
            num_blocks: 2048,
        }
    }
}

impl CandidateParams {
    /// Checks both sizes are > 0.
    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 || self.num_blocks == 0 {
            return Err(Error::invalid(
                "candidate params",
                format!(
                    "block_size and num_blocks must be > 0, found {} and {}",
                    self.block_size, self.num_blocks
                ),
            ));
        }
        Ok(())
    }
    /// Entries the pool can hold (16,384).
    pub fn capacity(&self) -> usize {
        self.block_size * self.num_blocks
    }
}

/// Selects the candidate blocks of one logits row (fast path) into `out` (`num_blocks` values;
/// a shorter `out` keeps fewer blocks); returns how many were kept.
pub fn select_blocks(
    p: &CandidateParams,
    logits: &[f32],
    visible: usize,
    out: &mut [i32],
) -> usize {
    let visible = visible.min(logits.len());
    let nblocks = visible.div_ceil(p.block_size);
    let mut scores = vec![0f32; nblocks];
    cpu::block_scores(&logits[..visible], p.block_size, &mut scores);
    if let Some(last) = scores.last_mut() {
        *last = f32::INFINITY;
    }
    let k = p.num_blocks.min(out.len());
    out[k..].fill(-1);
    crate::ops::topk::cpu::select_scored(&scores, &mut out[..k])
}

/// [`select_blocks`] over rows: `logits` (rows, n), `visible` per row, `out` (rows, num_blocks).
///
/// Errors: [`Error::Shape`] on inconsistent lengths, [`Error::Invalid`] on bad params.
pub fn select_blocks_rows(
    p: &CandidateParams,
    logits: &[f32],
    n: usize,
    visible: &[usize],
    out: &mut [i32],
) -> Result<()> {
    p.validate()?;
    let rows = visible.len();
    if logits.len() != rows * n {
        return Err(Error::shape(
            "candidate logits",
            format!("[{rows}, {n}]"),
            format!("{} values", logits.len()),
        ));
    }
    if out.len() != rows * p.num_blocks {
        return Err(Error::shape(
            "candidate blocks",
            format!("[{rows}, {}]", p.num_blocks),
            format!("{} values", out.len()),
        ));
    }
    if n == 0 {
        out.fill(-1);
        return Ok(());
    }
    out.par_chunks_mut(p.num_blocks)
        .zip(logits.par_chunks(n).zip(visible.par_iter()))
        .for_each(|(o, (row, &v))| {
            select_blocks(p, row, v, o);
        });
    Ok(())
}

/// Sets every logit outside the kept blocks (−1 ends the list) to −∞: the Reindex mask.
pub fn mask_outside(p: &CandidateParams, blocks: &[i32], logits: &mut [f32]) {
    let mut keep = vec![false; logits.len().div_ceil(p.block_size)];
    for &b in blocks.iter().take_while(|&&b| b >= 0) {
        if let Some(k) = keep.get_mut(b as usize) {
            *k = true;
        }
    }
    for (chunk, &k) in logits.chunks_mut(p.block_size).zip(&keep) {
        if !k {
            chunk.fill(f32::NEG_INFINITY);
        }
    }
}

/// The tensor signature of the candidate pool (`csa2_candidates`, `csa2 op candidates`): the
/// top-k op's `logits [T, N]` and `positions [T]`, output `blocks_out [T, B]` int32 (B = blocks
/// kept).
pub mod signature {
    pub use crate::ops::topk::signature::{LOGITS, POSITIONS};
    use crate::shape::{Arg, Dim, Signature};
    use crate::tensor::DType;

    /// `[T, B]` int32 kept blocks, sorted by (score desc, id asc), −1 padded.
    pub const BLOCKS_OUT: Arg =
        Arg::write("blocks_out", &[DType::I32], &[Dim::Any("T"), Dim::Any("B")]);
    /// `csa2_candidates`.
    pub const CANDIDATES: Signature = Signature {
        op: "candidates",
        args: &[LOGITS, POSITIONS, BLOCKS_OUT],
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn both(p: &CandidateParams, row: &[f32], visible: usize) -> Vec<i32> {
        let mut fast = vec![0i32; p.num_blocks];
        let n = select_blocks(p, row, visible, &mut fast);
        let r = reference::select_blocks(p, row, visible);
        assert_eq!(fast, r, "visible {visible}");
        assert_eq!(n, r.iter().filter(|&&b| b >= 0).count());
        fast
    }

    #[test]
    fn pool_is_a_no_op_at_16384_and_drops_one_block_at_16385() {
        let p = CandidateParams::default();
        let mut r = rand::rngs::StdRng::seed_from_u64(3);
        let row: Vec<f32> = (0..16_400).map(|_| r.random_range(-5.0f32..5.0)).collect();
        let kept = both(&p, &row, 16_384);
        assert_eq!(kept.iter().filter(|&&b| b >= 0).count(), 2048);
        let mut masked = row[..16_384].to_vec();
        mask_outside(&p, &kept, &mut masked);
        assert_eq!(masked, row[..16_384].to_vec(), "no-op below the pool size");
        let kept = both(&p, &row, 16_385);
        assert_eq!(kept.iter().filter(|&&b| b >= 0).count(), 2048);
        assert_eq!(kept[0], 2048, "the newest block is pinned first");
        // Exactly one old block (the one with the smallest max, ties → larger id) is dropped.
        let dropped: Vec<usize> = (0..2048).filter(|b| !kept.contains(&(*b as i32))).collect();
        assert_eq!(dropped.len(), 1);
        let maxes: Vec<f32> = row[..16_384]
            .chunks(8)
            .map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max))
            .collect();
        let min = maxes.iter().copied().fold(f32::INFINITY, f32::min);
        assert_eq!(maxes[dropped[0]], min);
    }

    #[test]
    fn all_minus_inf_blocks_are_never_kept_but_the_newest_is_pinned() {
        let p = CandidateParams {
            block_size: 8,
            num_blocks: 4,
        };
        let row = vec![f32::NEG_INFINITY; 40];
        let kept = both(&p, &row, 37);
        assert_eq!(kept, vec![4, -1, -1, -1]);
        let mut row = row;
        row[9] = 0.5; // block 1
        row[30] = 0.5; // block 3: tie with block 1 → block 1 first
        let kept = both(&p, &row, 37);
        assert_eq!(kept, vec![4, 1, 3, -1]);
        assert_eq!(both(&p, &row, 0), vec![-1; 4]);
    }

    #[test]
    fn pool_mask_marks_exactly_the_selected_blocks() {
        let p = CandidateParams {
            block_size: 8,
            num_blocks: 3,
        };
        let mut row = vec![0f32; 2 * 40];
        row[9] = 5.0; // row 0: block 1 best; block 4 (newest of 37 visible) pinned
        row[17] = 4.0; // block 2 next
        let m = reference::pool_mask(&p, &row, 40, &[37, 0]);
        assert_eq!(&m[..5], &[0, 1, 1, 0, 1]);
        assert_eq!(&m[5..], &[0; 5], "a row with nothing visible keeps nothing");
    }

    #[test]
    fn random_rows_match_reference() {
        let mut r = rand::rngs::StdRng::seed_from_u64(9);
        let p = CandidateParams {
            block_size: 8,
            num_blocks: 64,
        };
        for n in [1usize, 7, 8, 9, 511, 512, 513, 2000] {
            let row: Vec<f32> = (0..n).map(|_| r.random_range(0..6) as f32).collect();
            for v in [n, n / 2, n.saturating_sub(1)] {
                both(&p, &row, v);
            }
        }
    }
}
