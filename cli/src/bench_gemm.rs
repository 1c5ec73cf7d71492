//! `csa2 bench gemm`: the dense projections on the stack's real shapes, side by side in one run:
//! the previous path (f32 weights; a GEMV for ≤ 4 rows, the `gemm` crate's packed kernels above —
//! not batch-invariant) against the batch-invariant kernel on f32, bf16 and FP8 E4M3 weights.
//! Each figure is the median of `--reps` timed calls after one warm-up call.

use crate::out::JsonOut;
use csa2::backend::gemm::{dot, linear_w, WeightView, E4M3_FOLD};
use csa2::formats::scalar::e8m0_decode;
use csa2::weights::synth::quantize_fp8_block;
use csa2::{Error, Result};
use rayon::prelude::*;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Row counts (tokens) to time.
    #[arg(long, default_value = "1,4,16,128,512")]
    rows: String,
    /// Timed repetitions per figure (the median is reported).
    #[arg(long, default_value_t = 7, allow_negative_numbers = true, value_parser = crate::out::positive_count)]
    reps: usize,
    /// Write every figure as JSON to PATH (`-` = stdout; the table then goes to stderr).
    #[arg(long, value_name = "PATH")]
    json: Option<JsonOut>,
}

fn median(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

pub fn run(a: Args) -> Result<()> {
    crate::out::json_dest(&a.json)?;
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
    say!(
        "threads: {}; median of {} calls, µs",
        rayon::current_num_threads(),
        a.reps.max(1)
    );
    say!(
        "{:<22} {:>5} | {:>10} | {:>10} {:>6} | {:>10} {:>6} | {:>10} {:>6}",
        "projection [out, in]",
        "rows",
        "previous",
        "f32",
        "ratio",
        "bf16",
        "ratio",
        "fp8",
        "ratio"
    );
    for (name, out, inp) in [
        ("wq_a [1024, 5120]", 1024, 5120),
        ("wq_b [32768, 1024]", 32768, 1024),
        ("wkv [512, 5120]", 512, 5120),
        ("wo_b [5120, 8192]", 5120, 8192),
    ] {
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3)
            .collect();
        let bf: Vec<u16> = w
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let (codes, sc) = quantize_fp8_block(&w, out, inp);
        let folded: Vec<f32> = sc.iter().map(|&b| e8m0_decode(b) * E4M3_FOLD).collect();
        let views = [
            WeightView::F32 {
                data: &w,
                cols: inp,
            },
            WeightView::Bf16 {
                data: &bf,
                cols: inp,
            },
            WeightView::Fp8 {
                codes: &codes,
                folded: &folded,
                cols: inp,
                row0: 0,
            },
        ];
        for &r in &rows {
            let x: Vec<f32> = (0..r * inp)
                .map(|i| ((i * 13 % 97) as f32 - 48.0) * 1e-2)
                .collect();
            let mut y = vec![0f32; r * out];
            let t_prev = median(a.reps, || linear_previous(&x, r, &w, out, inp, &mut y));
            let t: Vec<f64> = views
                .iter()
                .map(|v| {
                    median(a.reps, || {
                        linear_w("bench", &x, r, *v, out, &mut y).expect("shapes")
                    })
                })
                .collect();
            figures.push(serde_json::json!({
                "projection": name, "out": out, "in": inp, "rows": r,
                "previous_us": t_prev * 1e6, "f32_us": t[0] * 1e6, "bf16_us": t[1] * 1e6,
                "fp8_us": t[2] * 1e6, "gflop": 2.0 * (r * out * inp) as f64 / 1e9,
            }));
            say!(
                "{:<22} {:>5} | {:>10.1} | {:>10.1} {:>6.2} | {:>10.1} {:>6.2} | {:>10.1} {:>6.2}",
                name,
                r,
                t_prev * 1e6,
                t[0] * 1e6,
                t_prev / t[0],
                t[1] * 1e6,
                t_prev / t[1],
                t[2] * 1e6,
                t_prev / t[2]
            );
        }
    }
    say!("ratio = previous / this (> 1: faster than the previous path).");
    crate::out::write_json(
        &a.json,
        &serde_json::json!({
            "threads": rayon::current_num_threads(), "reps": a.reps, "figures": figures,
        }),
    )?;
    Ok(())
}

/// The projections as they were before the batch-invariant kernel, kept here (not in the library,
/// which never calls it) only as the same-run baseline of this bench: f32 weights, a rayon GEMV over output rows for ≤ 4 rows, the
/// `gemm` crate's packed micro-kernels above. Its reduction order depends on the row count, so it
/// is not batch-invariant and the stack never calls it.
pub fn linear_previous(x: &[f32], rows: usize, w: &[f32], out: usize, inp: usize, y: &mut [f32]) {
    assert!(x.len() == rows * inp && w.len() == out * inp && y.len() == rows * out);
    if rows == 0 || out == 0 || inp == 0 {
        y.fill(0.0);
        return;
    }
    if rows <= 4 {
        const CHUNK: usize = 64;
        let mut yt = vec![0f32; out * rows];
        yt.par_chunks_mut(CHUNK * rows)
            .enumerate()
            .for_each(|(c, ys)| {
                let o0 = c * CHUNK;
                for (k, yk) in ys.chunks_exact_mut(rows).enumerate() {
                    let wr = &w[(o0 + k) * inp..(o0 + k + 1) * inp];
                    for (r, v) in yk.iter_mut().enumerate() {
                        *v = dot(wr, &x[r * inp..(r + 1) * inp]);
                    }
                }
            });
        for r in 0..rows {
            for o in 0..out {
                y[r * out + o] = yt[o * rows + r];
            }
        }
        return;
    }
    let threads = rayon::current_num_threads();
    // SAFETY: lengths asserted above: x is [rows, inp] row-major (row stride inp, column stride 1),
    // w is [out, inp] row-major read as the [inp, out] matrix Wᵀ (row stride 1, column stride inp),
    // y is [rows, out] row-major. All strides stay inside the slices; `read_dst = false` so y's
    // previous contents are never read; the borrow of y is unique.
    unsafe {
        gemm::gemm(
            rows,
            out,
            inp,
            y.as_mut_ptr(),
            1,
            out as isize,
            false,
            x.as_ptr(),
            1,
            inp as isize,
            w.as_ptr(),
            inp as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            if threads > 1 {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            },
        );
    }
}
