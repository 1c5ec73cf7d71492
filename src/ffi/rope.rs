//! `csa2_rope`: the C face of [`crate::ops::rope`] (conventions: the op section of [`super`]).

use super::dlpack::{check_disjoint, host, DLTensor, DType};
use super::geometry::layer_plan;
use super::{guarded, Csa2Geometry, Csa2Status};
use crate::error::Error;
use crate::ops::rope::signature::{POSITIONS, X};
use crate::ops::rope::{Direction, Rope};
use crate::shape::Dims;

/// Rotary embedding in place on `x` `(tokens, heads, dim)` float, token t at `positions[t]`
/// (`(tokens)` int, ≥ 0), with the rotary of layer `layer` of `geometry` (θ, YaRN, rope_dim on the
/// trailing dims; docs/SPEC.md §2 "RoPE"). `inverse` = 0 rotates forward (Q, KV), 1 by the negative angle
/// (the attention output).
///
/// `x` is read and written (in place, the only aliasing allowed); `positions` may not overlap it.
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` (layer, `inverse`, negative position), `CSA2_ERR_SHAPE`
/// (dim < rope_dim, T mismatch), plus the common ones.
///
/// # Safety
/// `geometry` must be a live handle; each tensor pointer null or a readable `DLTensor` whose memory
/// stays valid and unused by other threads for the call.
#[no_mangle]
pub unsafe extern "C" fn csa2_rope(
    geometry: *const Csa2Geometry,
    layer: u32,
    x: *const DLTensor,
    positions: *const DLTensor,
    inverse: i32,
) -> Csa2Status {
    guarded("csa2_rope", || {
        let gl = layer_plan(geometry, layer)?;
        let plan = gl.plan();
        let dir = match inverse {
            0 => Direction::Forward,
            1 => Direction::Inverse,
            v => return Err(Error::invalid("inverse", format!("0 or 1, found {v}"))),
        };
        // SAFETY: caller's contract (see above).
        let (mut xv, pv) = unsafe { (host(x, X.name)?, host(positions, POSITIONS.name)?) };
        let mut dims = Dims::default();
        xv.expect(&X, &mut dims)?;
        pv.expect(&POSITIONS, &mut dims)?;
        check_disjoint(&[&pv], &[&xv])?;
        let (h, d) = (xv.shape()[1], xv.shape()[2]);
        let pos = pv.i64s()?;
        let rope = Rope::new(&plan.rope)?;
        if xv.dtype() == DType::F32 {
            rope.apply(xv.f32s_mut()?, h, d, &pos, dir)
        } else {
            let mut vals = xv.f32s()?.into_owned();
            rope.apply(&mut vals, h, d, &pos, dir)?;
            xv.write_f32s(&vals)
        }
    })
}
