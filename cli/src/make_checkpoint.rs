//! `csa2 make-checkpoint`: a synthetic checkpoint in the released naming, dtypes and shard layout.

use csa2::weights::{synth, Scale};
use csa2::Error;
use std::ops::Range;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Output directory (created if absent).
    #[arg(long)]
    out: PathBuf,
    /// Geometry: tiny (hidden 256, same 40-layer role plan) or full (the release).
    #[arg(long, default_value = "tiny")]
    scale: String,
    /// Seed of the random values.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::out::count::<u64>)]
    seed: u64,
    /// Layers to write: `A..B` (end exclusive), `A-B` (inclusive) or one id; default all.
    #[arg(long)]
    layers: Option<String>,
}

/// Parses `A..B`, `A-B` or `N`.
fn parse_range(s: &str, n: usize) -> csa2::Result<Range<usize>> {
    let bad = || Error::invalid("--layers", format!("expected A..B, A-B or N, found {s:?}"));
    let num = |t: &str| t.trim().parse::<usize>().map_err(|_| bad());
    let r = if let Some((a, b)) = s.split_once("..") {
        num(a)?..num(b)?
    } else if let Some((a, b)) = s.split_once('-') {
        num(a)?..num(b)? + 1
    } else {
        let a = num(s)?;
        a..a + 1
    };
    if r.is_empty() || r.end > n {
        return Err(Error::invalid(
            "--layers",
            format!("{s:?} must be a non-empty range inside 0..{n}"),
        ));
    }
    Ok(r)
}

pub fn run(a: Args) -> csa2::Result<()> {
    let scale = Scale::from_name(&a.scale)?;
    let n = scale.geometry().num_layers;
    let layers = match &a.layers {
        Some(s) => parse_range(s, n)?,
        None => 0..n,
    };
    let w = synth::write_checkpoint(&a.out, scale, a.seed, layers.clone())?;
    println!(
        "wrote {} tensors ({:.1} MB) for layers {}..{} in {} shard(s) to {}",
        w.tensors,
        w.bytes as f64 / 1e6,
        layers.start,
        layers.end,
        w.shards.len(),
        a.out.display()
    );
    Ok(())
}
