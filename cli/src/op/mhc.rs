//! `csa2 op mhc`: one mHC boundary on `.npy` files. The contract is written in docs/OPS.md § mHC.

use csa2::ops::mhc::signature as sig;
use csa2::ops::mhc::{
    boundary, one_hot_pre, reference, BoundaryIn, MhcParams, MixWeights, Path as MhcPath,
    PostUpdate, HC,
};
use csa2::Error;
use csa2_harness::npy::{self, Dims};
use std::path::Path;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    #[serde(default = "two")]
    post_mult: f32,
    #[serde(default = "twenty")]
    sinkhorn_iters: usize,
    #[serde(default = "hc_eps")]
    eps: f32,
    #[serde(default = "rms_eps")]
    rms_eps: f32,
    /// "fused" (default) or "unfused".
    #[serde(default)]
    path: Option<String>,
}
fn two() -> f32 {
    2.0
}
fn twenty() -> usize {
    20
}
fn hc_eps() -> f32 {
    1e-6
}
fn rms_eps() -> f32 {
    1e-20
}

fn read_params(dir: &Path) -> csa2::Result<Params> {
    let path = dir.join("params.json");
    if !path.exists() {
        return Ok(serde_json::from_str("{}").expect("defaults"));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Parse {
        path,
        reason: e.to_string(),
    })
}

/// Inputs (f32): `x [T,4,d]`, `y [T,d]`, `post_prev [T,4]`, `comb_prev [T,4,4]`, `pre_prev [T,4]`,
/// `fn [24,4d]`, `base [24]`, `scale [3]`, `norm [d]`. `y`, `post_prev`, `comb_prev` are all present
/// or all absent (first site: no post update); `pre_prev` absent = one-hot on stream 0.
/// Outputs: `x_new [T,4,d]`, `layer_in [T,d]`, `pre`/`post [T,4]`, `comb [T,4,4]`.
pub fn run(in_dir: &Path, out_dir: &Path, reference: bool) -> csa2::Result<()> {
    let prm = read_params(in_dir)?;
    let mut dims = Dims::default();
    // File names are the runner's documented contract (docs/OPS.md § mHC); the shapes are the op's.
    let x = npy::read_arg::<f32>(in_dir, &sig::X, &mut dims)?;
    let (t, d) = (x.shape[0], x.shape[2]);
    let y = npy::read_arg_optional::<f32>(in_dir, &sig::Y, &mut dims)?;
    let post = npy::read_file_optional::<f32>(in_dir, "post_prev", &sig::POST, &mut dims)?;
    let comb = npy::read_file_optional::<f32>(in_dir, "comb_prev", &sig::COMB, &mut dims)?;
    let pre = npy::read_arg_optional::<f32>(in_dir, &sig::PRE_PREV, &mut dims)?;
    let hc_fn = npy::read_file_as::<f32>(in_dir, "fn", &sig::HC_FN, &mut dims)?;
    let base = npy::read_file_as::<f32>(in_dir, "base", &sig::HC_BASE, &mut dims)?;
    let scale = npy::read_file_as::<f32>(in_dir, "scale", &sig::HC_SCALE, &mut dims)?;
    let norm = npy::read_arg::<f32>(in_dir, &sig::NORM, &mut dims)?;

    let update = match (&y, &post, &comb) {
        (Some(y), Some(p), Some(c)) => Some(PostUpdate {
            y: &y.data,
            post: &p.data,
            comb: &c.data,
        }),
        (None, None, None) => None,
        _ => {
            return Err(Error::invalid(
                "y/post_prev/comb_prev",
                "give all three (a post update) or none (first site)",
            ))
        }
    };
    let one_hot;
    let pre_prev = match &pre {
        Some(p) => &p.data[..],
        None => {
            one_hot = one_hot_pre(t);
            &one_hot[..]
        }
    };
    let p = MhcParams {
        hidden: d,
        post_mult: prm.post_mult,
        sinkhorn_iters: prm.sinkhorn_iters,
        hc_eps: prm.eps,
        rms_eps: prm.rms_eps,
    };
    let inp = BoundaryIn {
        x: &x.data,
        update,
        pre_prev,
        next: Some(MixWeights {
            hc_fn: &hc_fn.data,
            base: &base.data,
            scale: &scale.data,
            packed: None,
        }),
        norm: &norm.data,
    };
    let (x_new, layer_in, pre_o, post_o, comb_o) = if reference {
        let r = reference::boundary(&p, &inp)?;
        let (pr, po, co) = r.flat_coeffs();
        let f = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
        (f(&r.x_new), f(&r.layer_in), f(&pr), f(&po), f(&co))
    } else {
        let path = match prm.path.as_deref() {
            None | Some("fused") => MhcPath::Fused,
            Some("unfused") => MhcPath::Unfused,
            Some(other) => {
                return Err(Error::invalid(
                    "params.json path",
                    format!("expected \"fused\" or \"unfused\", found {other:?}"),
                ))
            }
        };
        let b = boundary(&p, &inp, path)?;
        let c = b.coeffs.expect("next weights were given");
        (b.x_new, b.layer_in, c.pre, c.post, c.comb)
    };
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let w = |name: &str, shape: &[usize], data: &[f32]| {
        npy::write(&out_dir.join(format!("{name}.npy")), shape, data)
    };
    w("x_new", &[t, HC, d], &x_new)?;
    w("layer_in", &[t, d], &layer_in)?;
    w("pre", &[t, HC], &pre_o)?;
    w("post", &[t, HC], &post_o)?;
    w("comb", &[t, HC, HC], &comb_o)?;
    Ok(())
}
