//! `csa2_mhc`: the C face of [`crate::ops::mhc`] (conventions: the op section of [`super`]).

use super::dlpack::{check_disjoint, host, host_opt, DLTensor, FLOATS};
use super::{guarded, Csa2Status};
use crate::error::Error;
use crate::ops::mhc::{self, BoundaryIn, MhcParams, MixWeights, PostUpdate, HC, MIX};
use crate::shape::{Dim, Dims};

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
                host(x, "x")?,
                host_opt(y, "y")?,
                host_opt(post, "post")?,
                host_opt(comb, "comb")?,
                host(pre_prev, "pre_prev")?,
                host_opt(hc_fn, "hc_fn")?,
                host_opt(hc_base, "hc_base")?,
                host_opt(hc_scale, "hc_scale")?,
                host(norm, "norm")?,
            )
        };
        // SAFETY: as above.
        let (mut xo, mut lo, po, qo, co) = unsafe {
            (
                host(x_new, "x_new")?,
                host(layer_in, "layer_in")?,
                host_opt(pre_out, "pre_out")?,
                host_opt(post_out, "post_out")?,
                host_opt(comb_out, "comb_out")?,
            )
        };
        let update = match (yv, postv, combv) {
            (Some(a), Some(b), Some(c)) => Some((a, b, c)),
            (None, None, None) => None,
            _ => {
                return Err(Error::invalid(
                    "y/post/comb",
                    "the post update needs all three tensors (or none at the first site)",
                ))
            }
        };
        let next = match (fnv, basev, scalev) {
            (Some(a), Some(b), Some(c)) => Some((a, b, c)),
            (None, None, None) => None,
            _ => return Err(Error::invalid(
                "hc_fn/hc_base/hc_scale",
                "the next site's mix weights need all three tensors (or none after the last site)",
            )),
        };
        let mut coeff_outs = match (po, qo, co) {
            (Some(a), Some(b), Some(c)) => Some((a, b, c)),
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
        let mut dims = Dims::default();
        normv.expect(FLOATS, &[Dim::Any("d")], &mut dims)?;
        p.validate()?;
        let d = p.hidden;
        let (t3, t4, t44) = (
            [Dim::Any("T"), Dim::Fixed(HC), Dim::Any("d")],
            [Dim::Any("T"), Dim::Fixed(HC)],
            [Dim::Any("T"), Dim::Fixed(HC), Dim::Fixed(HC)],
        );
        xv.expect(FLOATS, &t3, &mut dims)?;
        prev.expect(FLOATS, &t4, &mut dims)?;
        if let Some((a, b, c)) = &update {
            a.expect(FLOATS, &[Dim::Any("T"), Dim::Any("d")], &mut dims)?;
            b.expect(FLOATS, &t4, &mut dims)?;
            c.expect(FLOATS, &t44, &mut dims)?;
        }
        if let Some((a, b, c)) = &next {
            a.expect(FLOATS, &[Dim::Fixed(MIX), Dim::Fixed(HC * d)], &mut dims)?;
            b.expect(FLOATS, &[Dim::Fixed(MIX)], &mut dims)?;
            c.expect(FLOATS, &[Dim::Fixed(3)], &mut dims)?;
        }
        xo.expect(FLOATS, &t3, &mut dims)?;
        lo.expect(FLOATS, &[Dim::Any("T"), Dim::Any("d")], &mut dims)?;
        if let Some((a, b, c)) = &coeff_outs {
            a.expect(FLOATS, &t4, &mut dims)?;
            b.expect(FLOATS, &t4, &mut dims)?;
            c.expect(FLOATS, &t44, &mut dims)?;
        }
        let mut inputs = vec![&xv, &prev, &normv];
        if let Some((a, b, c)) = &update {
            inputs.extend([a, b, c]);
        }
        if let Some((a, b, c)) = &next {
            inputs.extend([a, b, c]);
        }
        let mut outputs = vec![&xo, &lo];
        if let Some((a, b, c)) = &coeff_outs {
            outputs.extend([a, b, c]);
        }
        check_disjoint(&inputs, &outputs)?;
        let (xf, pf, nf) = (xv.f32s()?, prev.f32s()?, normv.f32s()?);
        let upd = update
            .as_ref()
            .map(|(a, b, c)| Ok::<_, Error>((a.f32s()?, b.f32s()?, c.f32s()?)))
            .transpose()?;
        let mix = next
            .as_ref()
            .map(|(a, b, c)| Ok::<_, Error>((a.f32s()?, b.f32s()?, c.f32s()?)))
            .transpose()?;
        let inp = BoundaryIn {
            x: &xf,
            update: upd.as_ref().map(|(a, b, c)| PostUpdate {
                y: a,
                post: b,
                comb: c,
            }),
            pre_prev: &pf,
            next: mix.as_ref().map(|(a, b, c)| MixWeights {
                hc_fn: a,
                base: b,
                scale: c,
                packed: None,
            }),
            norm: &nf,
        };
        let r = mhc::boundary(&p, &inp, mhc::Path::Fused)?;
        xo.write_f32s(&r.x_new)?;
        lo.write_f32s(&r.layer_in)?;
        if let (Some((a, b, c)), Some(k)) = (&mut coeff_outs, &r.coeffs) {
            a.write_f32s(&k.pre)?;
            b.write_f32s(&k.post)?;
            c.write_f32s(&k.comb)?;
        }
        Ok(())
    })
}
