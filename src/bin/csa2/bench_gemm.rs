//! `csa2 bench gemm`: the dense projections through the `gemm` crate (the hot path) against a plain
//! cache-blocked rayon GEMM with the same contract, on the stack's real shapes.

use crate::out::JsonOut;
use csa2::backend::gemm::{linear, linear_blocked};
use csa2::{Error, Result};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Row counts (tokens) to time.
    #[arg(long, default_value = "1,16,128,512")]
    rows: String,
    /// Repetitions per figure (the best is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Write every figure as JSON to PATH (`-` = stdout; the table then goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
}

fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

pub fn run(a: Args) -> Result<()> {
    crate::out::json_dest(&a.json);
    if a.reps == 0 {
        return Err(Error::invalid("reps", "must be ≥ 1"));
    }
    let rows: Vec<usize> = a
        .rows
        .split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| Error::invalid("rows", format!("`{}` is not a list of integers", a.rows)))?;
    if rows.contains(&0) {
        return Err(Error::invalid("rows", "row counts must be ≥ 1"));
    }
    let mut figures = vec![];
    say!("threads: {}", rayon::current_num_threads());
    say!(
        "{:<22} {:>5} | {:>11} {:>9} | {:>11} {:>9} | {:>6}",
        "projection [out, in]",
        "rows",
        "gemm µs",
        "GFLOP/s",
        "blocked µs",
        "GFLOP/s",
        "ratio"
    );
    for (name, out, inp) in [
        ("wq_a [1280, 5120]", 1280, 5120),
        ("wkv [512, 5120]", 512, 5120),
        ("wo_b [5120, 8192]", 5120, 8192),
    ] {
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3)
            .collect();
        for &r in &rows {
            let x: Vec<f32> = (0..r * inp)
                .map(|i| ((i * 13 % 97) as f32 - 48.0) * 1e-2)
                .collect();
            let mut y = vec![0f32; r * out];
            let t_gemm = best(a.reps, || {
                linear("bench", &x, r, &w, out, inp, &mut y).expect("shapes")
            });
            let t_blk = best(a.reps, || linear_blocked(&x, r, &w, out, inp, &mut y));
            let fl = 2.0 * (r * out * inp) as f64;
            figures.push(serde_json::json!({
                "projection": name, "out": out, "in": inp, "rows": r,
                "gemm_us": t_gemm * 1e6, "gemm_gflops": fl / t_gemm / 1e9,
                "blocked_us": t_blk * 1e6, "blocked_gflops": fl / t_blk / 1e9,
                "ratio_blocked_to_gemm": t_blk / t_gemm,
            }));
            say!(
                "{:<22} {:>5} | {:>11.1} {:>9.2} | {:>11.1} {:>9.2} | {:>6.2}",
                name,
                r,
                t_gemm * 1e6,
                fl / t_gemm / 1e9,
                t_blk * 1e6,
                fl / t_blk / 1e9,
                t_blk / t_gemm
            );
        }
    }
    crate::out::write_json(
        &a.json,
        &serde_json::json!({
            "threads": rayon::current_num_threads(), "reps": a.reps, "figures": figures,
        }),
    )?;
    Ok(())
}
