//! `csa2 op rope`: in `x` f32 [T,H,D], `positions` i64 [T]; params `theta` (10000), `yarn` (false,
//! true = V4.1's, or an object), `inverse` (false), `rope_dim` (64). Out `x` f32 [T,H,D].

use super::{f32s, save, Params};
use csa2::geometry::{RopeParams, Yarn};
use csa2::ops::rope::signature::{POSITIONS, X};
use csa2::ops::rope::{reference, Direction, Rope};
use csa2::{Error, Result};
use csa2_harness::npy::{read_arg, Dims};
use std::path::Path;

/// V4.1's YaRN (docs/SPEC.md §2).
pub const V41_YARN: Yarn = Yarn {
    factor: 16.0,
    original_max_position: 65536.0,
    beta_fast: 32.0,
    beta_slow: 1.0,
};

pub fn run(in_dir: &Path, out_dir: &Path, reference: bool) -> Result<()> {
    let p = Params::load(in_dir)?;
    let mut dims = Dims::default();
    let x = read_arg::<f32>(in_dir, &X, &mut dims)?;
    let pos = read_arg::<i64>(in_dir, &POSITIONS, &mut dims)?;
    let yarn = match p.get("yarn") {
        None | Some(serde_json::Value::Bool(false)) => None,
        Some(serde_json::Value::Bool(true)) => Some(V41_YARN),
        Some(serde_json::Value::Object(o)) => {
            let f = |k: &str, d: f64| o.get(k).and_then(|v| v.as_f64()).unwrap_or(d);
            Some(Yarn {
                factor: f("factor", 16.0),
                original_max_position: f("original_max_position_embeddings", 65536.0),
                beta_fast: f("beta_fast", 32.0),
                beta_slow: f("beta_slow", 1.0),
            })
        }
        Some(v) => {
            return Err(Error::invalid(
                "yarn",
                format!("expected a bool or an object, found {v}"),
            ))
        }
    };
    let rp = RopeParams {
        theta: p.f64_or("theta", 10000.0)?,
        rope_dim: p.usize_or("rope_dim", 64)?,
        yarn,
    };
    let rope = Rope::new(&rp)?;
    let dir = if p.bool_or("inverse", false)? {
        Direction::Inverse
    } else {
        Direction::Forward
    };
    let (h, d) = (x.shape[1], x.shape[2]);
    let mut y = x.data.clone();
    rope.apply(&mut y, h, d, &pos.data, dir)?;
    if reference {
        y = f32s(&reference::rope(&rope, &x.data, h, d, &pos.data, dir));
    }
    save(out_dir, "x", &x.shape, &y)
}
