//! `csa2_topk`: the C face of [`crate::ops::topk`] (conventions: the op section of [`super`]).
//!
//! The export runs [`crate::ops::topk::select_rows_view`]: all tensors on one device — host
//! memory, or (feature `cuda`) one GPU with float32 logits — and one output order on both
//! (`ops::topk`'s order contract: a scored row by (logit desc, index asc), a row with ≤ K visible
//! entries `0..visible`).

use super::dlpack::{check_disjoint, DLTensor, View};
use super::{guarded, Csa2Status};
use crate::ops::topk::signature::{COUNTS_OUT, LOGITS, OUT, POSITIONS};

/// Top-k of indexer logits (docs/SPEC.md §2 "Indexer"): for row t, the K largest of
/// `logits[t, 0 .. (positions[t] + 1) div ratio]` (ties → smaller index; −∞/NaN never chosen; all
/// visible entries in index order when they are ≤ K), −1 padded.
///
/// `logits` `(T, N)` float, `positions` `(T)` int, `out` `(T, K)` int32, `counts_out` (optional)
/// `(T)` int32 = entries selected per row. Errors: ratio 0, negative position, plus the common ones.
///
/// # Safety
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_topk(
    logits: *const DLTensor,
    positions: *const DLTensor,
    ratio: u32,
    out: *const DLTensor,
    counts_out: *const DLTensor,
) -> Csa2Status {
    guarded("csa2_topk", || {
        // SAFETY: caller's contract (see above).
        let (lv, pv, mut ov, mut cv) = unsafe {
            (
                View::from_raw(logits, LOGITS.name)?,
                View::from_raw(positions, POSITIONS.name)?,
                View::from_raw(out, OUT.name)?,
                View::from_raw_opt(counts_out, COUNTS_OUT.name)?,
            )
        };
        let mut outs = vec![&ov];
        outs.extend(cv.as_ref());
        check_disjoint(&[&lv, &pv], &outs)?;
        let mut counts = cv.as_mut().map(|c| c.tensor_mut()).transpose()?;
        crate::ops::topk::select_rows_view(
            lv.tensor(),
            pv.tensor(),
            ratio as usize,
            &mut ov.tensor_mut()?,
            counts.as_mut(),
        )
    })
}
