//! Fused Mega-mHC boundary (`kernels/mhc.cu`; docs/SPEC.md §4, V4.1 single-pass shift).

use super::device::{as_i32, cfg, check_len, launch, Device};
use crate::error::{Error, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

/// Hyper-connection streams.
pub const STREAMS: usize = 4;
/// Coefficients per site (4 pre + 4 post + 16 comb).
pub const MIX: usize = 24;
/// Largest hidden size the kernel's shared memory holds.
pub const MAX_HIDDEN: usize = 5120;
const TOKENS_PER_BLOCK: usize = 4;

/// Parameters of the next site (fp32, docs/SPEC.md §4).
#[derive(Debug, Clone, Copy)]
pub struct MhcSite<'a> {
    /// `hc_fn` (24, 4·d) f32.
    pub fn_: &'a [f32],
    /// `hc_base` (24,) f32.
    pub base: &'a [f32],
    /// `hc_scale` (3,) f32.
    pub scale: &'a [f32],
    /// The sublayer's RMSNorm weight (d,) f32.
    pub norm_w: &'a [f32],
    /// Hidden size d.
    pub hidden: usize,
}

/// Per-token inputs of one boundary.
#[derive(Debug, Clone, Copy)]
pub struct MhcInputs<'a> {
    /// Residual streams (T, 4, d) bf16.
    pub x: &'a [bf16],
    /// Previous sublayer output (T, d) bf16, or none for the first sublayer (X' = X, no post-mix).
    pub y: Option<&'a [bf16]>,
    /// Previous site's post (T, 4) f32 (ignored without `y`).
    pub post_prev: &'a [f32],
    /// Previous site's comb C (T, 4, 4) f32, C[i][j] row-major (ignored without `y`).
    pub comb_prev: &'a [f32],
    /// The pre carried from the previous site (T, 4) f32 (one-hot stream 0 for the first sublayer).
    pub pre_carried: &'a [f32],
}

/// Outputs of one boundary.
#[derive(Debug, Clone, PartialEq)]
pub struct MhcOutputs {
    /// New residual streams X' (T, 4, d) bf16 (= X when there was no `y`).
    pub x: Vec<bf16>,
    /// This site's pre (T, 4) f32 — carried to the next boundary.
    pub pre: Vec<f32>,
    /// This site's post (T, 4) f32.
    pub post: Vec<f32>,
    /// This site's comb (T, 4, 4) f32.
    pub comb: Vec<f32>,
    /// Sublayer input (T, d) bf16: RMSNorm(bf16(Σ pre_carried_i · X'_i)) · norm_w.
    pub x_in: Vec<bf16>,
}

/// Device buffers of [`Device::mega_mhc_dev`] (shapes as [`MhcSite`], [`MhcInputs`], [`MhcOutputs`]).
#[derive(Debug)]
#[allow(missing_docs)]
pub struct MhcDevArgs<'a> {
    pub x: &'a CudaSlice<bf16>,
    pub y: Option<&'a CudaSlice<bf16>>,
    pub post_prev: &'a CudaSlice<f32>,
    pub comb_prev: &'a CudaSlice<f32>,
    pub pre_carried: &'a CudaSlice<f32>,
    pub fn_: &'a CudaSlice<f32>,
    pub base: &'a CudaSlice<f32>,
    pub scale: &'a CudaSlice<f32>,
    pub norm_w: &'a CudaSlice<f32>,
    pub hidden: usize,
    pub tokens: usize,
}

/// Device output buffers of [`Device::mega_mhc_dev`] (shapes as [`MhcOutputs`]).
#[derive(Debug)]
#[allow(missing_docs)]
pub struct MhcDevOutputs<'a> {
    pub x: &'a mut CudaSlice<bf16>,
    pub pre: &'a mut CudaSlice<f32>,
    pub post: &'a mut CudaSlice<f32>,
    pub comb: &'a mut CudaSlice<f32>,
    pub x_in: &'a mut CudaSlice<bf16>,
}

impl Device {
    /// One Mega-mHC boundary for T tokens.
    ///
    /// Errors: [`Error::Shape`] for inconsistent lengths, [`Error::Invalid`] for d > 5120,
    /// [`Error::Cuda`].
    pub fn mega_mhc(&self, site: &MhcSite, inp: &MhcInputs) -> Result<MhcOutputs> {
        let d = site.hidden;
        if d == 0 || d > MAX_HIDDEN {
            return Err(Error::invalid(
                "hidden",
                format!("{d} (the kernel supports 1..={MAX_HIDDEN})"),
            ));
        }
        let t = inp.pre_carried.len() / STREAMS;
        check_len("pre_carried", inp.pre_carried.len(), t * STREAMS)?;
        check_len("residual streams", inp.x.len(), t * STREAMS * d)?;
        if let Some(y) = inp.y {
            check_len("sublayer output", y.len(), t * d)?;
            check_len("post_prev", inp.post_prev.len(), t * STREAMS)?;
            check_len("comb_prev", inp.comb_prev.len(), t * STREAMS * STREAMS)?;
        }
        check_len("hc_fn", site.fn_.len(), MIX * STREAMS * d)?;
        check_len("hc_base", site.base.len(), MIX)?;
        check_len("hc_scale", site.scale.len(), 3)?;
        check_len("norm weight", site.norm_w.len(), d)?;
        let dx = self.upload(inp.x)?;
        let dy = inp.y.map(|y| self.upload(y)).transpose()?;
        let dpp = self.upload(inp.post_prev)?;
        let dcp = self.upload(inp.comb_prev)?;
        let dpc = self.upload(inp.pre_carried)?;
        let dfn = self.upload(site.fn_)?;
        let dbase = self.upload(site.base)?;
        let dscale = self.upload(site.scale)?;
        let dnorm = self.upload(site.norm_w)?;
        let mut xo = self.zeros::<bf16>(t * STREAMS * d)?;
        let mut pre = self.zeros::<f32>(t * STREAMS)?;
        let mut post = self.zeros::<f32>(t * STREAMS)?;
        let mut comb = self.zeros::<f32>(t * STREAMS * STREAMS)?;
        let mut xin = self.zeros::<bf16>(t * d)?;
        self.mega_mhc_dev(
            &MhcDevArgs {
                x: &dx,
                y: dy.as_ref(),
                post_prev: &dpp,
                comb_prev: &dcp,
                pre_carried: &dpc,
                fn_: &dfn,
                base: &dbase,
                scale: &dscale,
                norm_w: &dnorm,
                hidden: d,
                tokens: t,
            },
            MhcDevOutputs {
                x: &mut xo,
                pre: &mut pre,
                post: &mut post,
                comb: &mut comb,
                x_in: &mut xin,
            },
        )?;
        let take = |v: Vec<f32>, n: usize| v.into_iter().take(n).collect::<Vec<_>>();
        Ok(MhcOutputs {
            x: if inp.y.is_some() {
                self.download(&xo)?
                    .into_iter()
                    .take(t * STREAMS * d)
                    .collect()
            } else {
                inp.x.to_vec()
            },
            pre: take(self.download(&pre)?, t * STREAMS),
            post: take(self.download(&post)?, t * STREAMS),
            comb: take(self.download(&comb)?, t * STREAMS * STREAMS),
            x_in: self.download(&xin)?.into_iter().take(t * d).collect(),
        })
    }

    /// Device form of [`Device::mega_mhc`]; outputs (x_out, pre, post, comb, x_in). `x_out` is not
    /// written when `y` is none.
    pub fn mega_mhc_dev(&self, a: &MhcDevArgs, out: MhcDevOutputs) -> Result<()> {
        if a.tokens == 0 {
            return Ok(());
        }
        if a.hidden == 0 || a.hidden > MAX_HIDDEN {
            return Err(Error::invalid(
                "hidden",
                format!("{} (the kernel supports 1..={MAX_HIDDEN})", a.hidden),
            ));
        }
        let MhcDevOutputs {
            x: xo,
            pre,
            post,
            comb,
            x_in: xin,
        } = out;
        if xin.len() < a.tokens * a.hidden || pre.len() < a.tokens * STREAMS {
            return Err(Error::shape(
                "mHC output buffers",
                a.tokens * a.hidden,
                xin.len(),
            ));
        }
        let (n, d) = (as_i32("tokens", a.tokens)?, as_i32("hidden", a.hidden)?);
        let grid = (a.tokens.div_ceil(TOKENS_PER_BLOCK) as u32, 1);
        let null = 0u64;
        // mega_mhc_bf16(x, y, post_prev, comb_prev, pre_carried, fn, base, scale, norm_w, x_out,
        //   pre_out, post_out, comb_out, x_in, n_tokens, d)
        match a.y {
            Some(y) => launch!(
                self,
                "mhc",
                "mega_mhc_bf16",
                cfg(grid, 256),
                a.x,
                y,
                a.post_prev,
                a.comb_prev,
                a.pre_carried,
                a.fn_,
                a.base,
                a.scale,
                a.norm_w,
                xo,
                pre,
                post,
                comb,
                xin,
                &n,
                &d
            ),
            None => launch!(
                self,
                "mhc",
                "mega_mhc_bf16",
                cfg(grid, 256),
                a.x,
                &null,
                a.post_prev,
                a.comb_prev,
                a.pre_carried,
                a.fn_,
                a.base,
                a.scale,
                a.norm_w,
                xo,
                pre,
                post,
                comb,
                xin,
                &n,
                &d
            ),
        }
        Ok(())
    }
}
