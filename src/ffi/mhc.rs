//! `csa2_mhc`: the C face of [`crate::ops::mhc`] (conventions: the op section of [`super`]).
//!
//! The export runs [`crate::ops::mhc::boundary_view`]: all tensors on one device — host memory
//! (any float dtype, the fused CPU path), or (feature `cuda`) one GPU, where the Mega-mHC kernel
//! takes `x`, `y`, `x_new`, `layer_in` as bfloat16 and the rest as float32, needs the mix weights
//! and the coefficient outputs, and the V4.1 scalars (else `CSA2_ERR_UNSUPPORTED`); tensors on
//! different devices are `CSA2_ERR_INVALID_ARGUMENT`.

use super::dlpack::{check_disjoint, DLTensor, View};
use super::{guarded, Csa2Status};
use crate::error::Error;
use crate::ops::mhc::signature as sig;
use crate::ops::mhc::{self, BoundaryViews, BoundaryViewsOut, MhcParams};

/// Scalars of [`csa2_mhc`] (docs/SPEC.md §4; config `hc_*`, `rms_norm_eps`). Pass null for the V4.1 values
/// (2.0, 20, 1e-6, 1e-20).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2MhcParams {
    /// Multiplier of the post sigmoid (2.0).
    pub post_mult: f32,
    /// Sinkhorn iterations, counting the first column normalization (20).
    pub sinkhorn_iters: u32,
    /// `hc_eps` (1e-6).
    pub hc_eps: f32,
    /// RMS epsilon of the mix statistic and the input RMSNorm (1e-20).
    pub rms_eps: f32,
}

/// Arguments of [`csa2_mhc`] (shapes there; d = stream width).
/// Set `struct_size` to `sizeof(Csa2MhcArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2MhcArgs {
    /// `sizeof(Csa2MhcArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// Scalars, or null for the V4.1 values.
    pub params: *const Csa2MhcParams,
    /// `(T, 4, d)` float residual streams.
    pub x: *const DLTensor,
    /// Optional `(T, d)` float sublayer output (with `post`, `comb`).
    pub y: *const DLTensor,
    /// Optional `(T, 4)` float post coefficients.
    pub post: *const DLTensor,
    /// Optional `(T, 4, 4)` float combination matrix.
    pub comb: *const DLTensor,
    /// `(T, 4)` float pre coefficients of the previous site.
    pub pre_prev: *const DLTensor,
    /// Optional `(24, 4d)` float coefficient projection (with `hc_base`, `hc_scale`).
    pub hc_fn: *const DLTensor,
    /// Optional `(24)` float.
    pub hc_base: *const DLTensor,
    /// Optional `(3)` float.
    pub hc_scale: *const DLTensor,
    /// `(d)` float RMSNorm weight.
    pub norm: *const DLTensor,
    /// Output `(T, 4, d)` float updated streams.
    pub x_new: *const DLTensor,
    /// Output `(T, d)` float next sublayer input.
    pub layer_in: *const DLTensor,
    /// Output `(T, 4)` float (required with `hc_fn`).
    pub pre_out: *const DLTensor,
    /// Output `(T, 4)` float (required with `hc_fn`).
    pub post_out: *const DLTensor,
    /// Output `(T, 4, 4)` float (required with `hc_fn`).
    pub comb_out: *const DLTensor,
}

args_struct!(Csa2MhcArgs);

/// One mHC boundary between two sublayer sites (docs/SPEC.md §4, V4.1 single-pass shift; fused CPU path):
///
/// ```text
/// x_new    = post ⊙ y + combᵀ · x                   (skipped when y/post/comb are null: x_new = x)
/// layer_in = RMSNorm(Σ_i pre_prev_i · x_new[i], norm)
/// (pre_out, post_out, comb_out) = coefficients(x_new; hc_fn, hc_base, hc_scale)   (when given)
/// ```
///
/// Shapes (d = stream width, from `norm`): `x` `(T, 4, d)`, `y` `(T, d)`, `post` `(T, 4)`, `comb`
/// `(T, 4, 4)` (`comb[t][i][j]` = weight of stream i in output j), `pre_prev` `(T, 4)`, `hc_fn`
/// `(24, 4d)`, `hc_base` `(24)`, `hc_scale` `(3)`, `norm` `(d)`, all float; outputs `x_new`
/// `(T, 4, d)`, `layer_in` `(T, d)`, `pre_out`/`post_out` `(T, 4)`, `comb_out` `(T, 4, 4)` float.
/// `y`, `post`, `comb` are given together or not at all; so are `hc_fn`, `hc_base`, `hc_scale`,
/// and then the three coefficient outputs are required.
///
/// Errors: a partial group, bad params (`CSA2_ERR_INVALID_ARGUMENT`), plus the common ones.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2MhcArgs`. Its members:
/// `params` null or readable; tensors as in [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_mhc(args: *const Csa2MhcArgs) -> Csa2Status {
    guarded("csa2_mhc", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let Csa2MhcArgs {
            struct_size: _,
            params,
            x,
            y,
            post,
            comb,
            pre_prev,
            hc_fn,
            hc_base,
            hc_scale,
            norm,
            x_new,
            layer_in,
            pre_out,
            post_out,
            comb_out,
        } = unsafe { super::read_args(args) }?;
        // SAFETY: caller's contract (see above).
        let (xv, yv, postv, combv, prev, fnv, basev, scalev, normv) = unsafe {
            (
                View::from_raw(x, sig::X.name)?,
                View::from_raw_opt(y, sig::Y.name)?,
                View::from_raw_opt(post, sig::POST.name)?,
                View::from_raw_opt(comb, sig::COMB.name)?,
                View::from_raw(pre_prev, sig::PRE_PREV.name)?,
                View::from_raw_opt(hc_fn, sig::HC_FN.name)?,
                View::from_raw_opt(hc_base, sig::HC_BASE.name)?,
                View::from_raw_opt(hc_scale, sig::HC_SCALE.name)?,
                View::from_raw(norm, sig::NORM.name)?,
            )
        };
        // SAFETY: as above.
        let (mut xo, mut lo, po, qo, co) = unsafe {
            (
                View::from_raw(x_new, sig::X_NEW.name)?,
                View::from_raw(layer_in, sig::LAYER_IN.name)?,
                View::from_raw_opt(pre_out, sig::PRE_OUT.name)?,
                View::from_raw_opt(post_out, sig::POST_OUT.name)?,
                View::from_raw_opt(comb_out, sig::COMB_OUT.name)?,
            )
        };
        let update = match (yv, postv, combv) {
            (Some(a), Some(b), Some(c)) => Some([a, b, c]),
            (None, None, None) => None,
            _ => {
                return Err(Error::invalid(
                    "y/post/comb",
                    "the post update needs all three tensors (or none at the first site)",
                ))
            }
        };
        let next = match (fnv, basev, scalev) {
            (Some(a), Some(b), Some(c)) => Some([a, b, c]),
            (None, None, None) => None,
            _ => return Err(Error::invalid(
                "hc_fn/hc_base/hc_scale",
                "the next site's mix weights need all three tensors (or none after the last site)",
            )),
        };
        let mut coeff_outs = match (po, qo, co) {
            (Some(a), Some(b), Some(c)) => Some([a, b, c]),
            (None, None, None) => None,
            _ => {
                return Err(Error::invalid(
                    "pre_out/post_out/comb_out",
                    "give all three coefficient outputs or none",
                ))
            }
        };
        if next.is_some() && coeff_outs.is_none() {
            return Err(Error::invalid(
                "pre_out/post_out/comb_out",
                "the mix weights are given, so the coefficient outputs are required",
            ));
        }
        // SAFETY: null or readable (caller's contract).
        let p = match unsafe { params.as_ref() } {
            None => MhcParams::new(normv.shape().first().copied().unwrap_or(0)),
            Some(c) => MhcParams {
                hidden: normv.shape().first().copied().unwrap_or(0),
                post_mult: c.post_mult,
                sinkhorn_iters: c.sinkhorn_iters as usize,
                hc_eps: c.hc_eps,
                rms_eps: c.rms_eps,
            },
        };
        let mut inputs = vec![&xv, &prev, &normv];
        inputs.extend(update.iter().flatten());
        inputs.extend(next.iter().flatten());
        let mut outputs = vec![&xo, &lo];
        outputs.extend(coeff_outs.iter().flatten());
        check_disjoint(&inputs, &outputs)?;
        let views = BoundaryViews {
            x: xv.tensor(),
            update: update
                .as_ref()
                .map(|[a, b, c]| [a.tensor(), b.tensor(), c.tensor()]),
            pre_prev: prev.tensor(),
            next: next
                .as_ref()
                .map(|[a, b, c]| [a.tensor(), b.tensor(), c.tensor()]),
            norm: normv.tensor(),
        };
        let (mut xm, mut lm) = (xo.tensor_mut()?, lo.tensor_mut()?);
        let mut cm = match &mut coeff_outs {
            Some([a, b, c]) => Some([a.tensor_mut()?, b.tensor_mut()?, c.tensor_mut()?]),
            None => None,
        };
        mhc::boundary_view(
            &p,
            &views,
            BoundaryViewsOut {
                x_new: &mut xm,
                layer_in: &mut lm,
                coeffs: cm.as_mut().map(|[a, b, c]| [a, b, c]),
            },
        )
    })
}
