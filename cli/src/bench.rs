//! `csa2 bench <family>`: kernel benchmarks beside an in-run baseline (`codecs`, `ops`, `gemm`).

use csa2::Result;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Record codecs: fast vs scalar encode/decode.
    Codecs(crate::bench_codecs::Args),
    /// The CSA2 attention ops (indexer, top-k, candidates, attention).
    Ops(crate::bench_ops::Args),
    /// Dense projections: the `gemm` crate vs a plain blocked rayon GEMM.
    Gemm(crate::bench_gemm::Args),
}

pub fn run(a: Args) -> Result<()> {
    match a.what {
        What::Codecs(a) => crate::bench_codecs::run(a),
        What::Ops(a) => crate::bench_ops::run(a),
        What::Gemm(a) => crate::bench_gemm::run(a),
    }
}
