//! Top-k selection for the lightning indexer (docs/SPEC.md §2 "Indexer", docs/SPEC.md §2.5).
//!
//! Rules, one row at a time:
//! - the k largest logits among the visible entries, ties → the smaller index;
//! - −∞ (masked) and NaN logits are never selected; a row with fewer than k selectable entries is
//!   padded with −1;
//! - when `visible ≤ k` every visible entry is selected, in index order, without looking at the
//!   logits (vLLM fills `0..compress_len` directly; the set is the same).
//!
//! Scored selections come out sorted by (logit desc, index asc). The fast path
//! ([`cpu::select_scored`]) is one streaming pass against a running threshold with a bounded
//! candidate buffer (see its module docs).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod reference;

use crate::error::{Error, Result};
use rayon::prelude::*;

/// The indexer's k (docs/SPEC.md §2: 512).
pub const INDEX_TOPK: usize = 512;

/// Top-k of one logits row (fast path). `out.len()` is k; returns the number of selected entries
/// (the rest of `out` is −1). Entries at `visible..` are ignored.
pub fn select(logits: &[f32], visible: usize, out: &mut [i32]) -> usize {
    let visible = visible.min(logits.len());
    let k = out.len();
    if visible <= k {
        for (j, o) in out.iter_mut().enumerate() {
            *o = if j < visible { j as i32 } else { -1 };
        }
        return visible;
    }
    cpu::select_scored(&logits[..visible], out)
}

/// One row's work item in [`select_rows`]: (output, count) and (logits, visible).
type RowJob<'a> = ((&'a mut [i32], &'a mut usize), (&'a [f32], &'a usize));

/// Top-k of every row of `logits` (rows, n) with per-row `visible` counts into `out` (rows, k), rows
/// in parallel. Returns the per-row counts.
///
/// Errors: [`Error::Shape`] when the lengths disagree.
pub fn select_rows(
    logits: &[f32],
    n: usize,
    visible: &[usize],
    out: &mut [i32],
) -> Result<Vec<usize>> {
    let rows = visible.len();
    if logits.len() != rows * n {
        return Err(Error::shape(
            "top-k logits",
            format!("[{rows}, {n}]"),
            format!("{} values", logits.len()),
        ));
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    if !out.len().is_multiple_of(rows) {
        return Err(Error::shape(
            "top-k output",
            format!("{rows} rows"),
            format!("{} values", out.len()),
        ));
    }
    let k = out.len() / rows;
    if k == 0 {
        return Ok(vec![0; rows]);
    }
    let mut counts = vec![0usize; rows];
    let work = |((o, c), (row, &v)): RowJob| {
        *c = select(row, v, o);
    };
    let go_parallel = n >= 1 << 14 || rows * n >= 1 << 16;
    if n == 0 {
        out.fill(-1);
    } else if go_parallel {
        out.par_chunks_mut(k)
            .zip(counts.par_iter_mut())
            .zip(logits.par_chunks(n).zip(visible.par_iter()))
            .for_each(work);
    } else {
        out.chunks_mut(k)
            .zip(counts.iter_mut())
            .zip(logits.chunks(n).zip(visible.iter()))
            .for_each(work);
    }
    Ok(counts)
}

/// Sorts a selection (−1 padding last) by (logit desc, index asc): the canonical order of `csa2 op`.
/// −∞ logits sort after finite ones; −1 entries stay at the end.
pub fn sort_selection(logits: &[f32], sel: &mut [i32]) {
    let n = sel.iter().position(|&i| i < 0).unwrap_or(sel.len());
    sel[..n].sort_unstable_by(|&a, &b| order(logits[a as usize], a, logits[b as usize], b));
}

/// The selection order: larger value first, then smaller index; NaN ranks as −∞ and −0 equals +0
/// (a numeric tie, so the index decides).
#[inline]
pub fn order(va: f32, ia: i32, vb: f32, ib: i32) -> std::cmp::Ordering {
    let key = |v: f32| {
        if v.is_nan() {
            f32::NEG_INFINITY
        } else if v == 0.0 {
            0.0
        } else {
            v
        }
    };
    key(vb).total_cmp(&key(va)).then(ia.cmp(&ib))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn check_row(logits: &[f32], visible: usize, k: usize) {
        let mut fast = vec![0i32; k];
        let nf = select(logits, visible, &mut fast);
        let refr = reference::select(logits, visible, k);
        assert_eq!(&fast[..], &refr[..], "visible {visible} k {k}");
        assert_eq!(nf, refr.iter().filter(|&&i| i >= 0).count());
    }

    #[test]
    fn fast_equals_reference_on_random_and_tied_rows() {
        let mut r = rand::rngs::StdRng::seed_from_u64(7);
        for &n in &[0usize, 1, 511, 512, 513, 1000, 4096, 100_003] {
            let cont: Vec<f32> = (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect();
            let ties: Vec<f32> = (0..n).map(|_| r.random_range(0..4) as f32).collect();
            let inc: Vec<f32> = (0..n).map(|j| j as f32).collect();
            let mut masked = cont.clone();
            for (j, v) in masked.iter_mut().enumerate() {
                if j % 3 != 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
            for row in [&cont, &ties, &inc, &masked] {
                for vis in [n, n.saturating_sub(1), n / 2] {
                    check_row(row, vis, 512);
                }
                check_row(row, n, 7);
            }
        }
    }

    #[test]
    fn visible_512_selects_all_and_513_scores() {
        // 512 visible: all of them in index order even though some are −∞.
        let mut logits = vec![f32::NEG_INFINITY; 600];
        logits[3] = 1.0;
        let mut out = vec![0i32; 512];
        assert_eq!(select(&logits, 512, &mut out), 512);
        assert_eq!(out, (0..512).collect::<Vec<i32>>());
        // 513 visible: scored; only finite entries are selectable.
        let row: Vec<f32> = (0..513).map(|j| (j % 7) as f32).collect();
        assert_eq!(select(&row, 513, &mut out), 512);
        // The single dropped entry is the smallest value with the largest index: value 0 at 511.
        assert!(!out.contains(&511) && out.contains(&0) && out.contains(&512));
        assert_eq!(select(&logits, 513, &mut out), 1);
        assert_eq!(out[0], 3);
        assert!(out[1..].iter().all(|&i| i == -1));
    }

    #[test]
    fn ties_go_to_the_smaller_index_and_nan_is_never_selected() {
        let mut row = vec![1.0f32; 2000];
        row[1500] = f32::NAN;
        row[1999] = 2.0;
        let mut out = vec![0i32; 512];
        select(&row, 2000, &mut out);
        assert_eq!(out[0], 1999);
        assert_eq!(&out[1..], &(0..511).collect::<Vec<i32>>()[..]);
        let all_nan = vec![f32::NAN; 1000];
        assert_eq!(select(&all_nan, 1000, &mut out), 0);
        assert!(out.iter().all(|&i| i == -1));
    }

    #[test]
    fn signed_zeros_are_a_tie() {
        // −0 and +0 are equal logits: the smaller index must win, whatever the sign bit.
        let mut row = vec![-1.0f32; 600];
        row[10] = -0.0;
        row[5] = 0.0;
        let mut out = vec![0i32; 513];
        let mut small = vec![0i32; 2];
        select(&row, 600, &mut out);
        assert_eq!(&out[..2], &[5, 10]);
        row[5] = -0.0;
        row[10] = 0.0;
        select(&row, 600, &mut out);
        assert_eq!(&out[..2], &[5, 10]);
        assert_eq!(cpu::select_scored(&row, &mut small), 2);
        assert_eq!(small, vec![5, 10]);
        assert_eq!(reference::select(&row, 600, 2), vec![5, 10]);
    }

    #[test]
    fn index_order_rows_are_the_selection_sorted_by_index() {
        // The CUDA kernel's contract: the same set as `select`, ascending, −1 padded; a row with
        // n_valid ≤ k takes 0..n_valid even when those keys are −∞.
        let mut r = rand::rngs::StdRng::seed_from_u64(5);
        let n = 700;
        let mut keys: Vec<f32> = (0..3 * n).map(|_| r.random_range(0..9) as f32).collect();
        keys[n + 3] = f32::NAN;
        keys[2 * n..]
            .iter_mut()
            .for_each(|v| *v = f32::NEG_INFINITY);
        let got = reference::select_rows_index_order(&keys, n, &[n as i32, 600, 5], 512);
        for (t, &nv) in [n, 600, 5].iter().enumerate() {
            let mut want = reference::select(&keys[t * n..(t + 1) * n], nv, 512);
            let c = want.iter().filter(|&&i| i >= 0).count();
            want[..c].sort_unstable();
            assert_eq!(&got[t * 512..(t + 1) * 512], &want[..]);
        }
        assert!(
            !got[512..1024].contains(&3),
            "the NaN key of row 1 is never selected"
        );
        assert_eq!(&got[1024..1029], &[0, 1, 2, 3, 4]);
        assert!(got[1029..1536].iter().all(|&i| i == -1));
    }

    #[test]
    fn rows_api_checks_shapes() {
        let logits = vec![0f32; 10];
        let mut out = vec![0i32; 4];
        assert!(select_rows(&logits, 5, &[5, 5], &mut out).is_ok());
        assert_eq!(out, vec![0, 1, 0, 1]);
        assert!(select_rows(&logits, 4, &[5, 5], &mut out).is_err());
    }
}
