//! `csa2 paper` (in progress).
use crate::out::JsonOut;

#[derive(clap::Args)]
pub struct Args {
    /// Write every figure as JSON to PATH (`-` = stdout; the table then goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
}

pub fn run(a: Args) -> csa2::Result<()> {
    crate::out::json_dest(&a.json);
    Err(csa2::Error::Internal("paper: not yet".into()))
}
