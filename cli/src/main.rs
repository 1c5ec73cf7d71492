//! `csa2` — the command-line face of the csa2 backend.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[macro_use]
mod out;

mod ab;
mod bench;
mod bench_codecs;
mod bench_gemm;
mod bench_ops;
mod check;
mod codec;
mod geometry;
mod make_checkpoint;
mod op;
mod paper;
mod replay_error;
mod run;
mod ssd_writer;
mod trace;

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
    /// Replay a Mooncake trace through the KV cache, the SSD/DRAM tiers and the replay planner.
    Trace(trace::Args),
    /// Crash-test child: append SSD records until killed (used by tests/ssd_crash.rs).
    #[command(hide = true)]
    SsdWriter(ssd_writer::Args),
    /// Write a synthetic checkpoint in the released naming, dtypes and shard layout.
    MakeCheckpoint(make_checkpoint::Args),
    /// Run a multi-turn agentic session through the 40-layer stack (prefix hits, snapshots, replay).
    Run(run::Args),
    /// Exact vs bounded replay on the same session: per layer and per turn error, and persistence.
    ReplayError(replay_error::Args),
    /// A/B: the CSA2 backend vs the launch-day backend on identical inputs (bytes, decode, prefill).
    Ab(ab::Args),
    /// Run one CSA2 op on .npy inputs (fast path or --reference); formats in docs/OPS.md.
    Op(op::Args),
    /// Measure a kernel family against a baseline run in the same process (`bench codecs`, `bench ops`, `bench gemm`).
    Bench(bench::Args),
    /// Run every op fast vs reference on random edge-case inputs; non-zero exit on failure.
    Check(check::Args),
    /// Derive the technical report's KV-cache figures from config.json alone, beside the report's.
    Paper(paper::Args),
}

fn main() -> ExitCode {
    restore_sigpipe();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Geometry(a) => geometry::run(a),
        Cmd::Codec(a) => codec::run(a),
        Cmd::Trace(a) => trace::run(a),
        Cmd::SsdWriter(a) => ssd_writer::run(a),
        Cmd::MakeCheckpoint(a) => make_checkpoint::run(a),
        Cmd::Run(a) => run::run(a),
        Cmd::ReplayError(a) => replay_error::run(a),
        Cmd::Ab(a) => ab::run(a),
        Cmd::Op(a) => op::run(a),
        Cmd::Check(a) => check::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Paper(a) => paper::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Rust ignores SIGPIPE, so a write to a closed pipe (`csa2 geometry --json - | head`) fails and
/// `println!` panics. A command-line tool should end quietly instead, as `cat` does: restore the
/// default action, which ends the process when the reader has gone.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first in main, before any thread starts; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Loads the geometry from `--config` or the embedded default.
pub fn load_geometry(path: Option<&std::path::Path>) -> csa2::Result<csa2::Geometry> {
    match path {
        Some(p) => csa2::Geometry::from_path(p),
        None => Ok(csa2::Geometry::embedded()),
    }
}
