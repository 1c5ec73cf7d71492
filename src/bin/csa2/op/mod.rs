//! `csa2 op <family> --in DIR --out DIR [--reference]`: run one op on `.npy` inputs, write `.npy`
//! outputs (parity harness for the Python tests and `csa2 check`).

use std::path::PathBuf;

pub mod mhc;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    op: Op,
}

#[derive(clap::Subcommand)]
enum Op {
    /// One mHC boundary (post update + shifted collapse + RMSNorm + new coefficients).
    Mhc(Io),
}

#[derive(clap::Args)]
struct Io {
    /// Directory of input `.npy` files (and `params.json`).
    #[arg(long = "in")]
    input: PathBuf,
    /// Directory for the output `.npy` files (created if absent).
    #[arg(long)]
    out: PathBuf,
    /// Run the f64 reference instead of the fast CPU path.
    #[arg(long)]
    reference: bool,
}

pub fn run(a: Args) -> csa2::Result<()> {
    match a.op {
        Op::Mhc(io) => mhc::run(&io.input, &io.out, io.reference),
    }
}
