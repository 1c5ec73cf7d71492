//! `csa2_candidates`: the C face of [`crate::ops::candidates`] (conventions: the op section of
//! [`super`]).

use super::dlpack::{check_disjoint, host, DLTensor};
use super::{guarded, Csa2Status};
use crate::ops::candidates::signature::{BLOCKS_OUT, LOGITS, POSITIONS};
use crate::ops::candidates::CandidateParams;
use crate::shape::Dims;

/// Hierarchical candidate pool of the candidate-source layer (docs/SPEC.md §2 "Candidate pool"): per row,
/// blocks of `block_size` entries scored by their max visible logit, the newest block pinned, the
/// best `B` kept sorted (score desc, id asc), −1 padded.
///
/// `logits` `(T, N)` float, `positions` `(T)` int (visible = `(p + 1) div ratio`), `blocks_out`
/// `(T, B)` int32 (B = blocks kept, 2048 in V4.1). Errors: ratio/block_size/B of 0, negative
/// position, plus the common ones.
///
/// # Safety
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_candidates(
    logits: *const DLTensor,
    positions: *const DLTensor,
    ratio: u32,
    block_size: u32,
    blocks_out: *const DLTensor,
) -> Csa2Status {
    guarded("csa2_candidates", || {
        // SAFETY: caller's contract (see above).
        let (lv, pv, mut ov) = unsafe {
            (
                host(logits, LOGITS.name)?,
                host(positions, POSITIONS.name)?,
                host(blocks_out, BLOCKS_OUT.name)?,
            )
        };
        let mut dims = Dims::default();
        lv.expect(&LOGITS, &mut dims)?;
        pv.expect(&POSITIONS, &mut dims)?;
        ov.expect(&BLOCKS_OUT, &mut dims)?;
        check_disjoint(&[&lv, &pv], &[&ov])?;
        let p = CandidateParams {
            block_size: block_size as usize,
            num_blocks: ov.shape()[1],
        };
        p.validate()?;
        let vis = crate::ops::topk::visible_counts(&pv.i64s()?, ratio as usize)?;
        let lf = lv.f32s()?;
        crate::ops::candidates::select_blocks_rows(&p, &lf, lv.shape()[1], &vis, ov.i32s_mut()?)
    })
}
