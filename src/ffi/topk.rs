//! `csa2_topk`: the C face of [`crate::ops::topk`] (conventions: the op section of [`super`]).

use super::dlpack::{check_disjoint, host, host_opt, DLTensor, DType, FLOATS, INTS};
use super::indexer::visible_rows;
use super::{guarded, Csa2Status};
use crate::shape::{Dim, Dims};

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
                host(logits, "logits")?,
                host(positions, "positions")?,
                host(out, "out")?,
                host_opt(counts_out, "counts_out")?,
            )
        };
        let mut dims = Dims::default();
        lv.expect(FLOATS, &[Dim::Any("T"), Dim::Any("N")], &mut dims)?;
        pv.expect(INTS, &[Dim::Any("T")], &mut dims)?;
        ov.expect(&[DType::I32], &[Dim::Any("T"), Dim::Any("K")], &mut dims)?;
        let mut outs = vec![&ov];
        if let Some(c) = &cv {
            c.expect(&[DType::I32], &[Dim::Any("T")], &mut dims)?;
            outs.push(c);
        }
        check_disjoint(&[&lv, &pv], &outs)?;
        let vis = visible_rows(&pv.i64s()?, ratio)?;
        let lf = lv.f32s()?;
        let n = lv.shape()[1];
        let counts = crate::ops::topk::select_rows(&lf, n, &vis, ov.i32s_mut()?)?;
        if let Some(c) = &mut cv {
            for (o, &k) in c.i32s_mut()?.iter_mut().zip(&counts) {
                *o = k as i32;
            }
        }
        Ok(())
    })
}
