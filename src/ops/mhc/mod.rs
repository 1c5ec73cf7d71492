//! mHC: the 4 hyper-connection streams of the residual, mixed per token by learned,
//! Sinkhorn-normalized coefficients (docs/SPEC.md §4; vLLM
//! `vllm/model_executor/kernels/mhc/torch.py`).
//!
//! # The boundary between two sublayers (V4.1 single-pass shift, "Mega-mHC")
//!
//! Every sublayer site s (attention or FFN of a layer) owns mix weights `hc_fn [24, 4d]`,
//! `hc_base [24]`, `hc_scale [3]` and an input RMSNorm weight `[d]`. Its coefficients
//! `(pre_s, post_s, comb_s)` are computed from the streams X_s entering it. V4.1 collapses the input
//! of site s with the pre of the *previous* site, so at the boundary between site s−1 (which just
//! produced y) and site s one pass over the streams does:
//!
//! ```text
//! X_s      = post_{s-1} ⊙ y + comb_{s-1}ᵀ · X_{s-1}                (post update, [T,4,d])
//! layer_in = RMSNorm(Σ_i pre_{s-1,i} · X_s[i], norm_s)            (shifted collapse, [T,d])
//! (pre_s, post_s, comb_s) = coefficients(X_s; hc_fn_s, base_s, scale_s)
//! ```
//!
//! `(pre_s, post_s, comb_s)` are carried to the next boundary. The first site (layer 0 attention)
//! has no post update and collapses with a one-hot pre on stream 0 ([`one_hot_pre`]); after the last
//! site the final hidden state is the collapse with the last pre (no new coefficients: `next` is
//! `None`), normed with the model's final norm.
//!
//! Layouts: streams `[T, 4, d]` f32 token-major (each token's 4 streams of d contiguous);
//! `pre`/`post` `[T, 4]`; `comb` `[T, 4, 4]` with `comb[t][i][j] = C[i, j]`, the weight of input
//! stream i in output stream j (`X'_j = post_j·y + Σ_i C[i,j]·X_i`).
//!
//! Precision: this op is f32 in and out. The model keeps the streams in bf16 and rounds the collapse
//! to bf16 before the norm; that rounding belongs to the caller that stores bf16.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod reference;

use crate::error::{Error, Result};
use crate::geometry::Geometry;
use crate::shape::Dims;
use crate::tensor::{one_device, Device, TensorView, TensorViewMut};

use crate::geometry::consts;
/// Hyper-connection streams (n = 4; `hc_mult` in the config) and mix outputs per token (n pre + n
/// post + n² comb = 24): the geometry's ([`crate::geometry::consts`]).
pub use crate::geometry::consts::{HC, MIX};

/// Scalars of the mHC op (docs/SPEC.md §4; config `hc_*`, `rms_norm_eps`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MhcParams {
    /// Width d of one stream (5120).
    pub hidden: usize,
    /// Multiplier of the post sigmoid (2.0; vLLM `hc_post_mult`).
    pub post_mult: f32,
    /// Sinkhorn iterations, counting the first column normalization (20).
    pub sinkhorn_iters: usize,
    /// `hc_eps`: added to pre, to the softmax and to every Sinkhorn denominator (1e-6).
    pub hc_eps: f32,
    /// RMS epsilon of the mix statistic and of the input RMSNorm (`rms_norm_eps`, 1e-20).
    pub rms_eps: f32,
}

impl MhcParams {
    /// The V4.1 constants for stream width `hidden`.
    pub fn new(hidden: usize) -> MhcParams {
        MhcParams {
            hidden,
            post_mult: consts::HC_POST_MULT as f32,
            sinkhorn_iters: consts::HC_SINKHORN_ITERS,
            hc_eps: consts::HC_EPS as f32,
            rms_eps: consts::RMS_NORM_EPS as f32,
        }
    }

    /// Parameters from a geometry. Errors: [`Error::Unsupported`] when `hc_mult` ≠ 4.
    pub fn from_geometry(g: &Geometry) -> Result<MhcParams> {
        if g.hc_mult != HC {
            return Err(Error::Unsupported(format!(
                "mHC kernels are built for hc_mult = {HC} streams, config has {}",
                g.hc_mult
            )));
        }
        let p = MhcParams {
            hidden: g.hidden_size,
            post_mult: consts::HC_POST_MULT as f32,
            sinkhorn_iters: g.hc_sinkhorn_iters,
            hc_eps: g.hc_eps as f32,
            rms_eps: g.rms_norm_eps as f32,
        };
        p.validate()?;
        Ok(p)
    }

    /// Checks the scalars. Errors: [`Error::Invalid`] naming the field and the value.
    pub fn validate(&self) -> Result<()> {
        if self.hidden == 0 {
            return Err(Error::invalid("hidden", "must be > 0, found 0"));
        }
        if self.sinkhorn_iters == 0 {
            return Err(Error::invalid(
                "sinkhorn_iters",
                "must be ≥ 1 (the first column normalization is iteration 1), found 0",
            ));
        }
        for (name, v) in [
            ("post_mult", self.post_mult),
            ("hc_eps", self.hc_eps),
            ("rms_eps", self.rms_eps),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(Error::invalid(
                    name,
                    format!("must be finite and ≥ 0, found {v}"),
                ));
            }
        }
        Ok(())
    }
}

/// One site's mix weights (checkpoint `layers.{L}.hc_{attn|ffn}_{fn,base,scale}`, fp32).
#[derive(Debug, Clone, Copy)]
pub struct MixWeights<'a> {
    /// `hc_fn [24, 4d]` row-major: row r is dotted with the flattened 4 streams.
    pub hc_fn: &'a [f32],
    /// `hc_base [24]`.
    pub base: &'a [f32],
    /// `hc_scale [3]`: multipliers of the pre, post and comb mixes.
    pub scale: &'a [f32],
    /// The same `hc_fn` prepared once for the CPU kernel ([`cpu::PackedHcFn::new`]); `None`
    /// reads `hc_fn` directly (same results; slower GEMV). It must be packed from this `hc_fn`;
    /// one packed for another d is an error ([`MixWeights::validate`]).
    pub packed: Option<&'a cpu::PackedHcFn>,
}

/// The post update of the previous sublayer: its output and its (post, comb).
#[derive(Debug, Clone, Copy)]
pub struct PostUpdate<'a> {
    /// Sublayer output y `[T, d]`.
    pub y: &'a [f32],
    /// `post [T, 4]` of the site that produced y.
    pub post: &'a [f32],
    /// `comb [T, 4, 4]` of the site that produced y (`comb[t][i][j]` = weight of stream i in j).
    pub comb: &'a [f32],
}

/// Inputs of one boundary (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct BoundaryIn<'a> {
    /// Streams X `[T, 4, d]` entering the previous site (or the embedding broadcast at the first site).
    pub x: &'a [f32],
    /// The previous site's post update; `None` at the first site (then `X_s = X`).
    pub update: Option<PostUpdate<'a>>,
    /// Carried `pre [T, 4]` of the previous site (one-hot on stream 0 at the first site).
    pub pre_prev: &'a [f32],
    /// The new site's mix weights; `None` after the last site (no new coefficients).
    pub next: Option<MixWeights<'a>>,
    /// RMSNorm weight `[d]` of the new site's input (`attn_norm` / `ffn_norm`, or the final `norm`).
    pub norm: &'a [f32],
}

/// Mutable views of per-token coefficients.
#[derive(Debug)]
pub struct CoeffsMut<'a> {
    /// `pre [T, 4]`.
    pub pre: &'a mut [f32],
    /// `post [T, 4]`.
    pub post: &'a mut [f32],
    /// `comb [T, 4, 4]`.
    pub comb: &'a mut [f32],
}

/// Owned per-token coefficients `pre [T,4]`, `post [T,4]`, `comb [T,4,4]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Coeffs {
    /// `pre [T, 4]`.
    pub pre: Vec<f32>,
    /// `post [T, 4]`.
    pub post: Vec<f32>,
    /// `comb [T, 4, 4]`.
    pub comb: Vec<f32>,
}

impl Coeffs {
    /// Zeroed coefficients for `tokens` tokens.
    pub fn zeros(tokens: usize) -> Coeffs {
        Coeffs {
            pre: vec![0.0; tokens * HC],
            post: vec![0.0; tokens * HC],
            comb: vec![0.0; tokens * HC * HC],
        }
    }
    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.pre.len() / HC
    }
    /// Mutable views, for [`BoundaryOut::coeffs`].
    pub fn as_mut(&mut self) -> CoeffsMut<'_> {
        CoeffsMut {
            pre: &mut self.pre,
            post: &mut self.post,
            comb: &mut self.comb,
        }
    }
}

/// Outputs of one boundary.
#[derive(Debug)]
pub struct BoundaryOut<'a> {
    /// New streams `X_s [T, 4, d]`.
    pub x_new: &'a mut [f32],
    /// Input of the new site `[T, d]`: `RMSNorm(Σ_i pre_prev_i · X_s[i], norm)`.
    pub layer_in: &'a mut [f32],
    /// The new site's coefficients; required when `next` is `Some`, ignored otherwise.
    pub coeffs: Option<CoeffsMut<'a>>,
}

/// One-hot `pre [T, 4]` selecting stream 0: the carried pre of the very first site (docs/SPEC.md §4).
pub fn one_hot_pre(tokens: usize) -> Vec<f32> {
    let mut p = vec![0.0; tokens * HC];
    p.iter_mut().step_by(HC).for_each(|v| *v = 1.0);
    p
}

fn check_len(what: &str, shape: &str, expected: usize, found: usize) -> Result<()> {
    if expected != found {
        return Err(Error::shape(
            what,
            format!("{shape} = {expected} f32"),
            format!("{found} f32"),
        ));
    }
    Ok(())
}

impl BoundaryIn<'_> {
    /// Validates every shape against `p` and returns T (tokens).
    ///
    /// Errors: [`Error::Shape`] naming the argument, the expected and the found length.
    pub fn validate(&self, p: &MhcParams) -> Result<usize> {
        p.validate()?;
        let d = p.hidden;
        if !self.x.len().is_multiple_of(HC * d) {
            return Err(Error::shape(
                "x",
                format!("[T, {HC}, {d}] (a multiple of {} f32)", HC * d),
                format!("{} f32", self.x.len()),
            ));
        }
        let t = self.x.len() / (HC * d);
        if let Some(u) = &self.update {
            check_len("y", &format!("[T={t}, {d}]"), t * d, u.y.len())?;
            check_len("post", &format!("[T={t}, {HC}]"), t * HC, u.post.len())?;
            check_len(
                "comb",
                &format!("[T={t}, {HC}, {HC}]"),
                t * HC * HC,
                u.comb.len(),
            )?;
        }
        check_len(
            "pre_prev",
            &format!("[T={t}, {HC}]"),
            t * HC,
            self.pre_prev.len(),
        )?;
        check_len("norm", &format!("[{d}]"), d, self.norm.len())?;
        if let Some(w) = &self.next {
            w.validate(p)?;
        }
        Ok(t)
    }
}

impl MixWeights<'_> {
    /// Checks `hc_fn [24, 4d]`, `base [24]`, `scale [3]`.
    pub fn validate(&self, p: &MhcParams) -> Result<()> {
        check_len(
            "hc_fn",
            &format!("[{MIX}, {}]", HC * p.hidden),
            MIX * HC * p.hidden,
            self.hc_fn.len(),
        )?;
        check_len("hc_base", &format!("[{MIX}]"), MIX, self.base.len())?;
        check_len("hc_scale", "[3]", 3, self.scale.len())?;
        match self.packed {
            Some(pk) if pk.hidden() != p.hidden => Err(Error::shape(
                "packed hc_fn",
                format!("packed for d = {}", p.hidden),
                format!("packed for d = {}", pk.hidden()),
            )),
            _ => Ok(()),
        }
    }
}

impl BoundaryOut<'_> {
    /// Checks the output buffers for T tokens.
    pub fn validate(&self, p: &MhcParams, t: usize, want_coeffs: bool) -> Result<()> {
        let d = p.hidden;
        check_len(
            "x_new",
            &format!("[T={t}, {HC}, {d}]"),
            t * HC * d,
            self.x_new.len(),
        )?;
        check_len(
            "layer_in",
            &format!("[T={t}, {d}]"),
            t * d,
            self.layer_in.len(),
        )?;
        match (&self.coeffs, want_coeffs) {
            (Some(c), true) => {
                check_len("pre out", &format!("[T={t}, {HC}]"), t * HC, c.pre.len())?;
                check_len("post out", &format!("[T={t}, {HC}]"), t * HC, c.post.len())?;
                check_len(
                    "comb out",
                    &format!("[T={t}, {HC}, {HC}]"),
                    t * HC * HC,
                    c.comb.len(),
                )
            }
            (None, true) => Err(Error::invalid(
                "coeffs",
                "the new site's mix weights are given, so coefficient outputs are required",
            )),
            _ => Ok(()),
        }
    }
}

/// Owned result of a boundary, from [`boundary`].
#[derive(Debug, Clone, PartialEq)]
pub struct Boundary {
    /// New streams `[T, 4, d]`.
    pub x_new: Vec<f32>,
    /// New site input `[T, d]`.
    pub layer_in: Vec<f32>,
    /// New coefficients (`None` when `next` was `None`).
    pub coeffs: Option<Coeffs>,
}

/// Which CPU path to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// One pass over the streams (Mega-mHC order).
    Fused,
    /// Four passes as vLLM runs it on Hopper: post update, coefficients, collapse, RMSNorm.
    Unfused,
}

/// Runs one boundary on the CPU and returns owned outputs (allocating convenience over
/// [`cpu::fused_boundary`] / [`cpu::unfused_boundary`]).
pub fn boundary(p: &MhcParams, inp: &BoundaryIn, path: Path) -> Result<Boundary> {
    let t = inp.validate(p)?;
    let mut x_new = vec![0.0; t * HC * p.hidden];
    let mut layer_in = vec![0.0; t * p.hidden];
    let mut coeffs = inp.next.map(|_| Coeffs::zeros(t));
    let mut out = BoundaryOut {
        x_new: &mut x_new,
        layer_in: &mut layer_in,
        coeffs: coeffs.as_mut().map(Coeffs::as_mut),
    };
    match path {
        Path::Fused => cpu::fused_boundary(p, inp, &mut out)?,
        Path::Unfused => cpu::unfused_boundary(p, inp, &mut out)?,
    }
    Ok(Boundary {
        x_new,
        layer_in,
        coeffs,
    })
}

/// One boundary's input tensors ([`signature::MHC`]; groups as in [`BoundaryIn`]).
#[derive(Debug, Clone, Copy)]
pub struct BoundaryViews<'r, 'a> {
    /// `x [T, 4, d]`.
    pub x: &'r TensorView<'a>,
    /// `(y [T, d], post [T, 4], comb [T, 4, 4])`, or `None` at the first site.
    pub update: Option<[&'r TensorView<'a>; 3]>,
    /// `pre_prev [T, 4]`.
    pub pre_prev: &'r TensorView<'a>,
    /// `(hc_fn [24, 4·d], hc_base [24], hc_scale [3])`, or `None` after the last site.
    pub next: Option<[&'r TensorView<'a>; 3]>,
    /// `norm [d]`.
    pub norm: &'r TensorView<'a>,
}

/// One boundary's output tensors.
#[derive(Debug)]
pub struct BoundaryViewsOut<'r, 'a> {
    /// `x_new [T, 4, d]`.
    pub x_new: &'r mut TensorViewMut<'a>,
    /// `layer_in [T, d]`.
    pub layer_in: &'r mut TensorViewMut<'a>,
    /// `(pre_out, post_out [T, 4], comb_out [T, 4, 4])`; required with `next`.
    pub coeffs: Option<[&'r mut TensorViewMut<'a>; 3]>,
}

/// One boundary over tensor views, dispatched on their device: host memory runs the fused CPU
/// path ([`boundary`], floats converted to f32 and the outputs rounded to their dtype); CUDA
/// memory the Mega-mHC kernel (`kernels/mhc.cu`, feature `cuda`), which takes the streams
/// (`x`, `y`, `x_new`, `layer_in`) as bfloat16 and everything else as float32, needs the next
/// site's weights and its coefficient outputs, and the V4.1 scalars ([`cuda::kernel_supports`]).
///
/// Errors: [`Error::Shape`] for a tensor off the signature; [`Error::Invalid`] for a partial
/// group, missing coefficient outputs or tensors on different devices; [`Error::NoCudaBuild`] for
/// CUDA tensors in a build without the `cuda` feature; on a GPU [`Error::Unsupported`] for what
/// the kernel does not compute and [`Error::Cuda`]; those of [`boundary`] on the host.
pub fn boundary_view(p: &MhcParams, a: &BoundaryViews, o: BoundaryViewsOut) -> Result<()> {
    use signature as sig;
    let mut dims = Dims::default();
    a.norm.expect(&sig::NORM, &mut dims)?;
    p.validate()?;
    if dims.get("d") != Some(p.hidden) {
        return Err(Error::shape(
            "norm",
            format!("[d={}] (the params' hidden size)", p.hidden),
            format!("{:?}", a.norm.shape()),
        ));
    }
    a.x.expect(&sig::X, &mut dims)?;
    a.pre_prev.expect(&sig::PRE_PREV, &mut dims)?;
    let mut devices = vec![
        (sig::NORM.name, a.norm.device()),
        (sig::X.name, a.x.device()),
        (sig::PRE_PREV.name, a.pre_prev.device()),
    ];
    for (group, args) in [
        (a.update, [&sig::Y, &sig::POST, &sig::COMB]),
        (a.next, [&sig::HC_FN, &sig::HC_BASE, &sig::HC_SCALE]),
    ] {
        for (v, arg) in group.into_iter().flatten().zip(args) {
            v.expect(arg, &mut dims)?;
            devices.push((arg.name, v.device()));
        }
    }
    o.x_new.expect(&sig::X_NEW, &mut dims)?;
    o.layer_in.expect(&sig::LAYER_IN, &mut dims)?;
    devices.push((sig::X_NEW.name, o.x_new.device()));
    devices.push((sig::LAYER_IN.name, o.layer_in.device()));
    if let Some(c) = &o.coeffs {
        for (v, arg) in c
            .iter()
            .zip([&sig::PRE_OUT, &sig::POST_OUT, &sig::COMB_OUT])
        {
            v.expect(arg, &mut dims)?;
            devices.push((arg.name, v.device()));
        }
    }
    if a.next.is_some() && o.coeffs.is_none() {
        return Err(Error::invalid(
            "pre_out/post_out/comb_out",
            "the mix weights are given, so the coefficient outputs are required",
        ));
    }
    match one_device(&devices)? {
        Device::Cpu => boundary_host(p, a, o),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => boundary_cuda(ordinal, p, a, o),
        #[cfg(not(feature = "cuda"))]
        d @ Device::Cuda(_) => Err(crate::tensor::no_cuda_build(sig::X.name, d)),
    }
}

/// The host branch of [`boundary_view`] (signature and device checked).
fn boundary_host<'a>(p: &MhcParams, a: &BoundaryViews<'_, 'a>, o: BoundaryViewsOut) -> Result<()> {
    use signature as sig;
    let f = |v: &TensorView<'a>, name: &str| v.to_f32(name);
    let (xf, pf, nf) = (
        f(a.x, sig::X.name)?,
        f(a.pre_prev, sig::PRE_PREV.name)?,
        f(a.norm, sig::NORM.name)?,
    );
    let upd = a
        .update
        .map(|[y, po, co]| {
            Ok::<_, Error>((
                f(y, sig::Y.name)?,
                f(po, sig::POST.name)?,
                f(co, sig::COMB.name)?,
            ))
        })
        .transpose()?;
    let mix = a
        .next
        .map(|[w, b, s]| {
            Ok::<_, Error>((
                f(w, sig::HC_FN.name)?,
                f(b, sig::HC_BASE.name)?,
                f(s, sig::HC_SCALE.name)?,
            ))
        })
        .transpose()?;
    let inp = BoundaryIn {
        x: &xf,
        update: upd
            .as_ref()
            .map(|(y, post, comb)| PostUpdate { y, post, comb }),
        pre_prev: &pf,
        next: mix.as_ref().map(|(hc_fn, base, scale)| MixWeights {
            hc_fn,
            base,
            scale,
            packed: None,
        }),
        norm: &nf,
    };
    let r = boundary(p, &inp, Path::Fused)?;
    o.x_new.write_f32s(sig::X_NEW.name, &r.x_new)?;
    o.layer_in.write_f32s(sig::LAYER_IN.name, &r.layer_in)?;
    if let (Some([pre, post, comb]), Some(k)) = (o.coeffs, &r.coeffs) {
        pre.write_f32s(sig::PRE_OUT.name, &k.pre)?;
        post.write_f32s(sig::POST_OUT.name, &k.post)?;
        comb.write_f32s(sig::COMB_OUT.name, &k.comb)?;
    }
    Ok(())
}

/// The CUDA branch of [`boundary_view`] (signature and device checked): borrows the caller's
/// device memory, waits for the context (a framework may have written the inputs on its own
/// stream), launches, and waits for the kernel.
#[cfg(feature = "cuda")]
fn boundary_cuda(
    ordinal: i32,
    p: &MhcParams,
    a: &BoundaryViews,
    o: BoundaryViewsOut,
) -> Result<()> {
    use half::bf16;
    use signature as sig;
    let ordinal = usize::try_from(ordinal).map_err(|_| {
        Error::invalid(sig::X.name, format!("CUDA device {ordinal} does not exist"))
    })?;
    cuda::kernel_supports(p)?;
    let (Some([hc_fn, base, scale]), Some([pre_out, post_out, comb_out])) = (a.next, o.coeffs)
    else {
        return Err(Error::Unsupported(
            "the CUDA mHC kernel always computes the next site's coefficients: give hc_fn, \
             hc_base, hc_scale and the three coefficient outputs"
                .into(),
        ));
    };
    let dev = crate::cuda::CudaDevice::shared(ordinal)?;
    // SAFETY (every borrow): the views' contract — live device memory of this context, unused by
    // others for the call; `borrow` checks each dtype (bf16 streams, f32 the rest) and density.
    let (x, pre_prev, norm) = unsafe {
        (
            dev.borrow::<bf16>(a.x, sig::X.name)?,
            dev.borrow::<f32>(a.pre_prev, sig::PRE_PREV.name)?,
            dev.borrow::<f32>(a.norm, sig::NORM.name)?,
        )
    };
    let (w, b, s) = unsafe {
        (
            dev.borrow::<f32>(hc_fn, sig::HC_FN.name)?,
            dev.borrow::<f32>(base, sig::HC_BASE.name)?,
            dev.borrow::<f32>(scale, sig::HC_SCALE.name)?,
        )
    };
    let upd = match a.update {
        Some([y, po, co]) => Some(unsafe {
            (
                dev.borrow::<bf16>(y, sig::Y.name)?,
                dev.borrow::<f32>(po, sig::POST.name)?,
                dev.borrow::<f32>(co, sig::COMB.name)?,
            )
        }),
        None => None,
    };
    let (mut x_new, mut layer_in, mut pre, mut post, mut comb) = unsafe {
        (
            dev.borrow::<bf16>(&o.x_new.as_view(), sig::X_NEW.name)?,
            dev.borrow::<bf16>(&o.layer_in.as_view(), sig::LAYER_IN.name)?,
            dev.borrow::<f32>(&pre_out.as_view(), sig::PRE_OUT.name)?,
            dev.borrow::<f32>(&post_out.as_view(), sig::POST_OUT.name)?,
            dev.borrow::<f32>(&comb_out.as_view(), sig::COMB_OUT.name)?,
        )
    };
    dev.synchronize_context()?;
    let tokens = a.x.shape()[0];
    let inp = cuda::DeviceBoundaryIn {
        x: &x,
        y: upd.as_ref().map(|u| &*u.0),
        // Ignored without `y` (the kernel reads them only for the post update).
        post_prev: upd.as_ref().map_or(&*pre_prev, |u| &*u.1),
        comb_prev: upd.as_ref().map_or(&*pre_prev, |u| &*u.2),
        pre_prev: &pre_prev,
        hc_fn: &w,
        base: &b,
        scale: &s,
        norm: &norm,
        tokens,
    };
    if upd.is_none() && tokens > 0 {
        // Without a post update the kernel leaves x_new alone: X' = X.
        dev.stream()
            .memcpy_dtod(&*x, &mut *x_new)
            .map_err(|e| crate::cuda::device::cuda_error("copy x → x_new", e))?;
    }
    cuda::boundary(
        &dev,
        p,
        &inp,
        cuda::DeviceBoundaryOut {
            x_new: &mut x_new,
            layer_in: &mut layer_in,
            pre: &mut pre,
            post: &mut post,
            comb: &mut comb,
        },
    )?;
    dev.synchronize()
}

/// The tensor signature of one mHC boundary (`csa2_mhc`, `csa2 op mhc`), d = stream width (from
/// `norm`). `y`/`post`/`comb` come together or not at all; so do `hc_fn`/`hc_base`/`hc_scale` and
/// the three coefficient outputs.
pub mod signature {
    use super::{HC, MIX};
    use crate::shape::{Arg, Dim, Signature};
    use crate::tensor::FLOATS;

    /// `[T, 4, d]` float residual streams.
    pub const X: Arg = Arg::read("x", FLOATS, &[Dim::Any("T"), Dim::Fixed(HC), Dim::Any("d")]);
    /// `[T, d]` float sublayer output.
    pub const Y: Arg = Arg::read("y", FLOATS, &[Dim::Any("T"), Dim::Any("d")]).optional();
    /// `[T, 4]` float post coefficients of the site that produced `y`.
    pub const POST: Arg = Arg::read("post", FLOATS, &[Dim::Any("T"), Dim::Fixed(HC)]).optional();
    /// `[T, 4, 4]` float combination matrix of that site.
    pub const COMB: Arg = Arg::read(
        "comb",
        FLOATS,
        &[Dim::Any("T"), Dim::Fixed(HC), Dim::Fixed(HC)],
    )
    .optional();
    /// `[T, 4]` float pre coefficients of the previous site.
    pub const PRE_PREV: Arg = Arg::read("pre_prev", FLOATS, &[Dim::Any("T"), Dim::Fixed(HC)]);
    /// `[24, 4·d]` float coefficient projection of the next site.
    pub const HC_FN: Arg =
        Arg::read("hc_fn", FLOATS, &[Dim::Fixed(MIX), Dim::Times(HC, "d")]).optional();
    /// `[24]` float.
    pub const HC_BASE: Arg = Arg::read("hc_base", FLOATS, &[Dim::Fixed(MIX)]).optional();
    /// `[3]` float multipliers of the pre, post and comb mixes.
    pub const HC_SCALE: Arg = Arg::read("hc_scale", FLOATS, &[Dim::Fixed(3)]).optional();
    /// `[d]` float RMSNorm weight.
    pub const NORM: Arg = Arg::read("norm", FLOATS, &[Dim::Any("d")]);
    /// `[T, 4, d]` float updated streams.
    pub const X_NEW: Arg = Arg::write(
        "x_new",
        FLOATS,
        &[Dim::Any("T"), Dim::Fixed(HC), Dim::Any("d")],
    );
    /// `[T, d]` float next sublayer input.
    pub const LAYER_IN: Arg = Arg::write("layer_in", FLOATS, &[Dim::Any("T"), Dim::Any("d")]);
    /// `[T, 4]` float pre coefficients of the next site.
    pub const PRE_OUT: Arg =
        Arg::write("pre_out", FLOATS, &[Dim::Any("T"), Dim::Fixed(HC)]).optional();
    /// `[T, 4]` float post coefficients of the next site.
    pub const POST_OUT: Arg =
        Arg::write("post_out", FLOATS, &[Dim::Any("T"), Dim::Fixed(HC)]).optional();
    /// `[T, 4, 4]` float combination matrix of the next site.
    pub const COMB_OUT: Arg = Arg::write(
        "comb_out",
        FLOATS,
        &[Dim::Any("T"), Dim::Fixed(HC), Dim::Fixed(HC)],
    )
    .optional();
    /// `csa2_mhc`.
    pub const MHC: Signature = Signature {
        op: "mhc",
        args: &[
            X, Y, POST, COMB, PRE_PREV, HC_FN, HC_BASE, HC_SCALE, NORM, X_NEW, LAYER_IN, PRE_OUT,
            POST_OUT, COMB_OUT,
        ],
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;
    use rand::{Rng, SeedableRng};

    fn rand(n: usize, r: &mut rand::rngs::StdRng) -> Vec<f32> {
        (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
    }

    /// The view entry runs exactly the fused CPU boundary on host views, rounds to the output
    /// dtype, and refuses mixed devices and (without the feature) CUDA memory.
    #[test]
    fn view_entry_is_the_fused_boundary_on_host_views() {
        let (t, d) = (3usize, 16usize);
        let mut r = rand::rngs::StdRng::seed_from_u64(4);
        let x = rand(t * HC * d, &mut r);
        let y = rand(t * d, &mut r);
        let post: Vec<f32> = rand(t * HC, &mut r).iter().map(|v| v.abs()).collect();
        let comb: Vec<f32> = rand(t * HC * HC, &mut r)
            .iter()
            .map(|v| v.abs() / 4.0)
            .collect();
        let pre = one_hot_pre(t);
        let hc_fn = rand(MIX * HC * d, &mut r);
        let base = rand(MIX, &mut r);
        let scale = vec![0.5f32, 1.0, 2.0];
        let norm = rand(d, &mut r);
        let p = MhcParams::new(d);
        let want = boundary(
            &p,
            &BoundaryIn {
                x: &x,
                update: Some(PostUpdate {
                    y: &y,
                    post: &post,
                    comb: &comb,
                }),
                pre_prev: &pre,
                next: Some(MixWeights {
                    hc_fn: &hc_fn,
                    base: &base,
                    scale: &scale,
                    packed: None,
                }),
                norm: &norm,
            },
            Path::Fused,
        )
        .unwrap();
        let v = |data: &'static [f32], shape: &[usize]| TensorView::from_host_slice(data, shape);
        let leak = |v: Vec<f32>| -> &'static [f32] { Box::leak(v.into_boxed_slice()) };
        let (xv, yv, pov, cov, prv) = (
            v(leak(x), &[t, HC, d]).unwrap(),
            v(leak(y), &[t, d]).unwrap(),
            v(leak(post), &[t, HC]).unwrap(),
            v(leak(comb), &[t, HC, HC]).unwrap(),
            v(leak(pre), &[t, HC]).unwrap(),
        );
        let (fv, bv, sv, nv) = (
            v(leak(hc_fn), &[MIX, HC * d]).unwrap(),
            v(leak(base), &[MIX]).unwrap(),
            v(leak(scale), &[3]).unwrap(),
            v(leak(norm), &[d]).unwrap(),
        );
        let views = BoundaryViews {
            x: &xv,
            update: Some([&yv, &pov, &cov]),
            pre_prev: &prv,
            next: Some([&fv, &bv, &sv]),
            norm: &nv,
        };
        // x_new in bfloat16 (rounded), the rest f32 (exact).
        let mut xn = vec![half::bf16::ZERO; t * HC * d];
        let (mut li, mut po, mut qo, mut co) = (
            vec![0f32; t * d],
            vec![0f32; t * HC],
            vec![0f32; t * HC],
            vec![0f32; t * HC * HC],
        );
        {
            let mut xm = TensorViewMut::from_host_slice(&mut xn, &[t, HC, d]).unwrap();
            let mut lm = TensorViewMut::from_host_slice(&mut li, &[t, d]).unwrap();
            let mut pm = TensorViewMut::from_host_slice(&mut po, &[t, HC]).unwrap();
            let mut qm = TensorViewMut::from_host_slice(&mut qo, &[t, HC]).unwrap();
            let mut cm = TensorViewMut::from_host_slice(&mut co, &[t, HC, HC]).unwrap();
            let out = BoundaryViewsOut {
                x_new: &mut xm,
                layer_in: &mut lm,
                coeffs: Some([&mut pm, &mut qm, &mut cm]),
            };
            boundary_view(&p, &views, out).unwrap();
        }
        let k = want.coeffs.as_ref().unwrap();
        assert_eq!(li, want.layer_in);
        assert_eq!((&po, &qo, &co), (&k.pre, &k.post, &k.comb));
        let rounded: Vec<half::bf16> = want
            .x_new
            .iter()
            .map(|&v| half::bf16::from_f32(v))
            .collect();
        assert_eq!(xn, rounded);

        // hc_fn [24, 4·d] must agree with norm's d.
        let wrong = v(leak(vec![0f32; MIX * (HC * d + 4)]), &[MIX, HC * d + 4]).unwrap();
        let bad = BoundaryViews {
            next: Some([&wrong, &bv, &sv]),
            ..views
        };
        let mut lm = TensorViewMut::from_host_slice(&mut li, &[t, d]).unwrap();
        let mut xm = TensorViewMut::from_host_slice(&mut xn, &[t, HC, d]).unwrap();
        let mut pm = TensorViewMut::from_host_slice(&mut po, &[t, HC]).unwrap();
        let mut qm = TensorViewMut::from_host_slice(&mut qo, &[t, HC]).unwrap();
        let mut cm = TensorViewMut::from_host_slice(&mut co, &[t, HC, HC]).unwrap();
        let e = boundary_view(
            &p,
            &bad,
            BoundaryViewsOut {
                x_new: &mut xm,
                layer_in: &mut lm,
                coeffs: Some([&mut pm, &mut qm, &mut cm]),
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("hc_fn") && e.contains("4·d=64") && e.contains("[24, 68]"),
            "{e}"
        );

        // A norm on a GPU next to host streams: one call, one device.
        // SAFETY: never dereferenced (the device check fails first).
        let dnorm = unsafe {
            TensorView::from_raw_parts(0x1000 as *const u8, &[d], &[1], DType::F32, Device::Cuda(0))
        }
        .unwrap();
        let mixed = BoundaryViews {
            norm: &dnorm,
            ..views
        };
        let e = boundary_view(
            &p,
            &mixed,
            BoundaryViewsOut {
                x_new: &mut xm,
                layer_in: &mut lm,
                coeffs: Some([&mut pm, &mut qm, &mut cm]),
            },
        )
        .unwrap_err();
        assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_views_without_the_cuda_feature_are_no_cuda_build_errors() {
        let (t, d) = (2usize, 8usize);
        let dv = |shape: &[usize], addr: usize| {
            // SAFETY: never dereferenced: the build refuses CUDA memory first.
            unsafe {
                TensorView::from_raw_parts(
                    addr as *const u8,
                    shape,
                    &crate::tensor::row_major_strides(shape),
                    DType::F32,
                    Device::Cuda(0),
                )
            }
            .unwrap()
        };
        let dm = |shape: &[usize], addr: usize| {
            // SAFETY: as above.
            unsafe {
                TensorViewMut::from_raw_parts(
                    addr as *mut u8,
                    shape,
                    &crate::tensor::row_major_strides(shape),
                    DType::F32,
                    Device::Cuda(0),
                )
            }
            .unwrap()
        };
        let (x, pre, norm) = (
            dv(&[t, HC, d], 0x1000),
            dv(&[t, HC], 0x2000),
            dv(&[d], 0x3000),
        );
        let (mut xn, mut li) = (dm(&[t, HC, d], 0x4000), dm(&[t, d], 0x5000));
        let e = boundary_view(
            &MhcParams::new(d),
            &BoundaryViews {
                x: &x,
                update: None,
                pre_prev: &pre,
                next: None,
                norm: &norm,
            },
            BoundaryViewsOut {
                x_new: &mut xn,
                layer_in: &mut li,
                coeffs: None,
            },
        )
        .unwrap_err();
        assert!(matches!(e, Error::NoCudaBuild(_)), "{e:?}");
    }
}
