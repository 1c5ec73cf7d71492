//! The fused Mega-mHC boundary on the GPU (`kernels/mhc.cu`, feature `cuda`; docs/SPEC.md §4, V4.1
//! single-pass shift) over bf16 streams. Reference: [`super::reference::boundary_rounded`] with
//! [`super::reference::Rounding::Bf16`], which the CUDA tests compare against.
//!
//! The kernel takes the same [`MhcParams`] as the CPU; its scalars (post multiplier, Sinkhorn
//! iterations, hc_eps, rms_eps) and the stream count are compiled in from
//! [`crate::geometry::consts`] (V4.1: 2, 20, 1e-6, 1e-20, 4), and d ≤ [`KERNEL_MAX_HIDDEN`] fits its
//! shared memory, so [`kernel_supports`] refuses other parameters.

use super::{MhcParams, HC, MIX};
use crate::cuda::device::{as_i32, cfg, check_lens, launch, OrNull};
use crate::cuda::driver::CudaSlice;
use crate::cuda::shapes::{MHC_THREADS, MHC_TOKENS_PER_BLOCK};
use crate::cuda::CudaDevice;
use crate::error::{Error, Result};
use half::bf16;

/// Largest hidden size the kernel's shared memory holds (the model width).
pub const KERNEL_MAX_HIDDEN: usize = crate::geometry::consts::HIDDEN_SIZE;

/// Errors unless `p` is what the kernel computes: [`Error::Unsupported`] / [`Error::Invalid`]
/// naming the difference.
pub fn kernel_supports(p: &MhcParams) -> Result<()> {
    p.validate()?;
    if p.hidden > KERNEL_MAX_HIDDEN {
        return Err(Error::invalid(
            "hidden",
            format!("{} (the kernel supports 1..={KERNEL_MAX_HIDDEN})", p.hidden),
        ));
    }
    let v41 = MhcParams::new(p.hidden);
    if *p != v41 {
        return Err(Error::Unsupported(format!(
            "the CUDA mHC kernel is built for the V4.1 scalars {v41:?}; found {p:?}"
        )));
    }
    Ok(())
}

/// CudaDevice buffers of one boundary for T tokens (shapes as [`super::BoundaryIn`], streams bf16).
#[derive(Debug)]
pub struct DeviceBoundaryIn<'a> {
    /// Residual streams X (T, 4, d) bf16.
    pub x: &'a CudaSlice<bf16>,
    /// Previous sublayer output y (T, d) bf16, or none for the first sublayer (X' = X, no post-mix).
    pub y: Option<&'a CudaSlice<bf16>>,
    /// Previous site's post (T, 4) f32 (ignored without `y`).
    pub post_prev: &'a CudaSlice<f32>,
    /// Previous site's comb (T, 4, 4) f32 (ignored without `y`).
    pub comb_prev: &'a CudaSlice<f32>,
    /// The pre carried from the previous site (T, 4) f32.
    pub pre_prev: &'a CudaSlice<f32>,
    /// The new site's `hc_fn` (24, 4·d) f32.
    pub hc_fn: &'a CudaSlice<f32>,
    /// `hc_base` (24,) f32.
    pub base: &'a CudaSlice<f32>,
    /// `hc_scale` (3,) f32.
    pub scale: &'a CudaSlice<f32>,
    /// The new site's RMSNorm weight (d,) f32.
    pub norm: &'a CudaSlice<f32>,
    /// Tokens T.
    pub tokens: usize,
}

/// CudaDevice outputs of one boundary.
#[derive(Debug)]
pub struct DeviceBoundaryOut<'a> {
    /// New streams X' (T, 4, d) bf16 (not written without `y`: X' = X).
    pub x_new: &'a mut CudaSlice<bf16>,
    /// Sublayer input (T, d) bf16.
    pub layer_in: &'a mut CudaSlice<bf16>,
    /// pre (T, 4) f32.
    pub pre: &'a mut CudaSlice<f32>,
    /// post (T, 4) f32.
    pub post: &'a mut CudaSlice<f32>,
    /// comb (T, 4, 4) f32.
    pub comb: &'a mut CudaSlice<f32>,
}

/// One Mega-mHC boundary for T tokens.
///
/// Errors: [`Error::Unsupported`] / [`Error::Invalid`] from [`kernel_supports`], [`Error::Shape`]
/// for buffers shorter than T tokens, [`Error::Cuda`].
pub fn boundary(
    dev: &CudaDevice,
    p: &MhcParams,
    a: &DeviceBoundaryIn,
    out: DeviceBoundaryOut,
) -> Result<()> {
    kernel_supports(p)?;
    let (t, d) = (a.tokens, p.hidden);
    if t == 0 {
        return Ok(());
    }
    let DeviceBoundaryOut {
        x_new,
        layer_in,
        pre,
        post,
        comb,
    } = out;
    let y_lens = a.y.iter().flat_map(|y| {
        [
            ("y", y.len(), t * d),
            ("post_prev", a.post_prev.len(), t * HC),
            ("comb_prev", a.comb_prev.len(), t * HC * HC),
        ]
    });
    check_lens(
        "mHC",
        [
            ("x", a.x.len(), t * HC * d),
            ("pre_prev", a.pre_prev.len(), t * HC),
            ("hc_fn", a.hc_fn.len(), MIX * HC * d),
            ("hc_base", a.base.len(), MIX),
            ("hc_scale", a.scale.len(), 3),
            ("norm", a.norm.len(), d),
            ("x_new", x_new.len(), t * HC * d),
            ("layer_in", layer_in.len(), t * d),
            ("pre out", pre.len(), t * HC),
            ("post out", post.len(), t * HC),
            ("comb out", comb.len(), t * HC * HC),
        ]
        .into_iter()
        .chain(y_lens),
    )?;
    let (n, di) = (as_i32("tokens", t)?, as_i32("hidden", d)?);
    let grid = (t.div_ceil(MHC_TOKENS_PER_BLOCK) as u32, 1);
    let y = OrNull(a.y);
    // mega_mhc_bf16(x, y, post_prev, comb_prev, pre_carried, fn, base, scale, norm_w, x_out,
    //   pre_out, post_out, comb_out, x_in, n_tokens, d)
    launch!(
        dev,
        "mhc",
        "mega_mhc_bf16",
        cfg(grid, MHC_THREADS as u32),
        a.x,
        &y,
        a.post_prev,
        a.comb_prev,
        a.pre_prev,
        a.hc_fn,
        a.base,
        a.scale,
        a.norm,
        x_new,
        pre,
        post,
        comb,
        layer_in,
        &n,
        &di
    );
    Ok(())
}
