//! `csa2 op NAME --in DIR --out DIR [--reference]`: runs one op on `.npy` inputs and writes `.npy`
//! outputs. Every op file exposes `run(in_dir, out_dir, reference)`; tensor names, shapes and
//! `params.json` fields are documented in docs/OPS.md.

use csa2::{Error, Result};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

mod attention;
mod candidates;
mod compress;
mod indexer;
pub mod mhc;
mod rope;

/// Op names `csa2 op` knows.
pub const OPS: &[&str] = &[
    "compress",
    "indexer",
    "candidates",
    "attention",
    "rope",
    "mhc",
];

#[derive(clap::Args)]
pub struct Args {
    /// The op (tensor names and params.json fields: docs/OPS.md).
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(OPS))]
    name: String,
    /// Folder with the input .npy files and an optional params.json.
    #[arg(long = "in")]
    input: PathBuf,
    /// Folder for the output .npy files (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Run the f64 reference instead of the fast path (outputs rounded to f32).
    #[arg(long)]
    reference: bool,
}

pub fn run(a: Args) -> Result<()> {
    std::fs::create_dir_all(&a.out).map_err(|e| Error::io(&a.out, e))?;
    let (i, o, r) = (a.input.as_path(), a.out.as_path(), a.reference);
    let t0 = std::time::Instant::now();
    match a.name.as_str() {
        "compress" => compress::run(i, o, r),
        "indexer" => indexer::run(i, o, r),
        "candidates" => candidates::run(i, o, r),
        "attention" => attention::run(i, o, r),
        "rope" => rope::run(i, o, r),
        "mhc" => mhc::run(i, o, r),
        other => Err(Error::invalid(
            "op",
            format!("unknown op `{other}` (expected one of {})", OPS.join(", ")),
        )),
    }?;
    let mut written: Vec<String> = std::fs::read_dir(o)
        .map_err(|e| Error::io(o, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".npy"))
        .collect();
    written.sort();
    println!(
        "op {} ({}): {} in {:.3} s → {} in {}",
        a.name,
        if r { "f64 reference" } else { "fast path" },
        i.display(),
        t0.elapsed().as_secs_f64(),
        written.join(", "),
        o.display()
    );
    Ok(())
}

/// `params.json` of an input folder (absent file = no fields).
pub struct Params {
    path: PathBuf,
    map: Map<String, Value>,
}

impl Params {
    pub fn load(dir: &Path) -> Result<Params> {
        let path = dir.join("params.json");
        let map = if path.exists() {
            let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
            match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(m)) => m,
                Ok(v) => {
                    return Err(Error::Parse {
                        path,
                        reason: format!("expected a JSON object, found {v}"),
                    })
                }
                Err(e) => {
                    return Err(Error::Parse {
                        path,
                        reason: e.to_string(),
                    })
                }
            }
        } else {
            Map::new()
        };
        Ok(Params { path, map })
    }
    fn bad(&self, k: &str, reason: String) -> Error {
        Error::Parse {
            path: self.path.clone(),
            reason: format!("field `{k}`: {reason}"),
        }
    }
    pub fn get(&self, k: &str) -> Option<&Value> {
        self.map.get(k).filter(|v| !v.is_null())
    }
    pub fn usize_opt(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.bad(k, format!("expected a non-negative integer, found {v}"))),
        }
    }
    pub fn usize_or(&self, k: &str, default: usize) -> Result<usize> {
        Ok(self.usize_opt(k)?.unwrap_or(default))
    }
    pub fn usize_req(&self, k: &str) -> Result<usize> {
        self.usize_opt(k)?
            .ok_or_else(|| self.bad(k, "is required".into()))
    }
    pub fn f64_or(&self, k: &str, default: f64) -> Result<f64> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.bad(k, format!("expected a number, found {v}"))),
        }
    }
    pub fn bool_or(&self, k: &str, default: bool) -> Result<bool> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.bad(k, format!("expected true or false, found {v}"))),
        }
    }
    pub fn str_or<'a>(&'a self, k: &str, default: &'a str) -> Result<&'a str> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.bad(k, format!("expected a string, found {v}"))),
        }
    }
    /// An int or a list of ints (empty when absent).
    pub fn i64_list(&self, k: &str) -> Result<Vec<i64>> {
        match self.get(k) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|e| {
                    e.as_i64().ok_or_else(|| {
                        self.bad(k, format!("list entries must be integers, found {e}"))
                    })
                })
                .collect(),
            Some(v) => v
                .as_i64()
                .map(|x| vec![x])
                .ok_or_else(|| self.bad(k, format!("expected an integer or a list, found {v}"))),
        }
    }
}

/// Writes `dir/name.npy`.
pub fn save<T: csa2_harness::npy::NpyElement>(
    dir: &Path,
    name: &str,
    shape: &[usize],
    data: &[T],
) -> Result<()> {
    csa2_harness::npy::write(&dir.join(format!("{name}.npy")), shape, data)
}

/// Rounds an f64 reference output to f32.
pub fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Exactly one of two alternative inputs must be present.
pub fn one_of<A, B>(
    dir: &Path,
    a: (&str, Option<A>),
    b: (&str, Option<B>),
) -> Result<std::result::Result<A, B>> {
    match (a.1, b.1) {
        (Some(x), None) => Ok(Ok(x)),
        (None, Some(y)) => Ok(Err(y)),
        (Some(_), Some(_)) => Err(Error::invalid(
            "inputs",
            format!(
                "{}: give either {}.npy or {}.npy, not both",
                dir.display(),
                a.0,
                b.0
            ),
        )),
        (None, None) => Err(Error::invalid(
            "inputs",
            format!(
                "{}: one of {}.npy or {}.npy is required",
                dir.display(),
                a.0,
                b.0
            ),
        )),
    }
}
