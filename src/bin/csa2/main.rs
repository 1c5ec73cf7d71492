//! `csa2` — the command-line face of the csa2 backend.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod bench;
mod check;
mod codec;
mod geometry;
mod op;

#[derive(Parser)]
#[command(
    name = "csa2",
    version,
    about = "CSA2 attention, FP4 KV cache and bounded replay for DeepSeek-V4.1-Flash"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the per-layer CSA2 plan, KV bytes per token and a capacity plan.
    Geometry(geometry::Args),
    /// Encode f32 rows to KV records or decode records to f32 rows.
    Codec(codec::Args),
    /// Run one CSA2 op on .npy inputs (fast path or --reference); formats in docs/OPS.md.
    Op(op::Args),
    /// Benchmark the CPU fast paths (`csa2 bench ops`).
    Bench(bench::Args),
    /// Run every op fast vs reference on random edge-case inputs; non-zero exit on failure.
    Check(check::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Geometry(a) => geometry::run(a),
        Cmd::Codec(a) => codec::run(a),
        Cmd::Op(a) => op::run(a),
        Cmd::Check(a) => check::run(a),
        Cmd::Bench(a) => bench::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Loads the geometry from `--config` or the embedded default.
pub fn load_geometry(path: Option<&std::path::Path>) -> csa2::Result<csa2::Geometry> {
    match path {
        Some(p) => csa2::Geometry::from_path(p),
        None => Ok(csa2::Geometry::embedded()),
    }
}
