//! Dense projections of the attention sublayer (`wq_a`, `wq_b`, `wkv`, compressor `wkv`/`wgate`,
//! indexer `wq_b`/`weights_proj`, grouped `wo_a`, `wo_b`): `y = x · Wᵀ` with the weight in the
//! checkpoint's `[out, in]` row-major layout (PyTorch `nn.Linear`).
//!
//! Two regimes, chosen by the number of rows:
//! - few rows (decode): the step is bound by reading W once, so a rayon GEMV over output rows with a
//!   wide-accumulator dot product streams W at memory speed;
//! - many rows (prefill): the `gemm` crate's packed, cache-blocked AVX-512/AVX2 micro-kernels
//!   parallelised with rayon (measured against a plain blocked rayon GEMM in docs/DESIGN.md).

use crate::error::{Error, Result};
use rayon::prelude::*;

/// Rows at or below which the GEMV path is used: W is re-read once per row there, which still beats
/// packing W for the micro-kernel when the row count is tiny.
const GEMV_MAX_ROWS: usize = 4;

/// `y[rows, out] = x[rows, inp] · w[out, inp]ᵀ`, f32 in and out, f32 accumulation.
///
/// Errors: [`Error::Shape`] naming `what` when a slice length does not match the dimensions.
pub fn linear(
    what: &str,
    x: &[f32],
    rows: usize,
    w: &[f32],
    out: usize,
    inp: usize,
    y: &mut [f32],
) -> Result<()> {
    if x.len() != rows * inp {
        return Err(Error::shape(
            format!("{what}: input"),
            format!("[{rows}, {inp}] = {}", rows * inp),
            x.len(),
        ));
    }
    if w.len() != out * inp {
        return Err(Error::shape(
            format!("{what}: weight"),
            format!("[{out}, {inp}] = {}", out * inp),
            w.len(),
        ));
    }
    if y.len() != rows * out {
        return Err(Error::shape(
            format!("{what}: output"),
            format!("[{rows}, {out}] = {}", rows * out),
            y.len(),
        ));
    }
    if rows == 0 || out == 0 {
        return Ok(());
    }
    if inp == 0 {
        y.fill(0.0);
        return Ok(());
    }
    if rows <= GEMV_MAX_ROWS {
        gemv_rows(x, rows, w, out, inp, y);
    } else {
        gemm_packed(x, rows, w, out, inp, y);
    }
    Ok(())
}

/// One output element per weight row; outputs split in chunks so each rayon task streams a
/// contiguous slab of W.
fn gemv_rows(x: &[f32], rows: usize, w: &[f32], out: usize, inp: usize, y: &mut [f32]) {
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
}

/// Dot product with 16 independent accumulators so the compiler vectorises it (no FMA chain).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, ar) = a.split_at(a.len() / 16 * 16);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(16).zip(bc.chunks_exact(16)) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

fn gemm_packed(x: &[f32], rows: usize, w: &[f32], out: usize, inp: usize, y: &mut [f32]) {
    let threads = rayon::current_num_threads();
    // SAFETY: the three slices were length-checked in `linear`: x is [rows, inp] row-major (row
    // stride inp, column stride 1), w is [out, inp] row-major and is read as the [inp, out] matrix
    // Wᵀ (row stride 1, column stride inp), y is [rows, out] row-major. All strides stay inside the
    // slices; `read_dst = false` so y's previous contents are never read; the borrow of y is unique.
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

/// A plain cache-blocked, rayon-parallel f32 GEMM with the same contract as [`linear`]; kept as the
/// baseline the `gemm` crate is measured against (`csa2 bench-gemm`, docs/DESIGN.md), not used on
/// the hot path.
pub fn linear_blocked(x: &[f32], _rows: usize, w: &[f32], out: usize, inp: usize, y: &mut [f32]) {
    const RB: usize = 8;
    const OB: usize = 64;
    y.par_chunks_mut(RB * out)
        .enumerate()
        .for_each(|(rb, yblk)| {
            let r0 = rb * RB;
            let nr = yblk.len() / out;
            for o0 in (0..out).step_by(OB) {
                for o in o0..(o0 + OB).min(out) {
                    let wr = &w[o * inp..(o + 1) * inp];
                    for r in 0..nr {
                        yblk[r * out + o] = dot(wr, &x[(r0 + r) * inp..(r0 + r + 1) * inp]);
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tolerance::{compare, F32_VS_F64};
    use rand::{Rng, SeedableRng};

    fn reference(x: &[f32], rows: usize, w: &[f32], out: usize, inp: usize) -> Vec<f64> {
        let mut y = vec![0f64; rows * out];
        for r in 0..rows {
            for o in 0..out {
                y[r * out + o] = (0..inp)
                    .map(|k| x[r * inp + k] as f64 * w[o * inp + k] as f64)
                    .sum();
            }
        }
        y
    }

    #[test]
    fn both_regimes_match_f64_reference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(rows, out, inp) in &[
            (1, 37, 129),
            (3, 64, 512),
            (4, 5, 17),
            (5, 70, 300),
            (33, 129, 1000),
        ] {
            let x: Vec<f32> = (0..rows * inp)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let w: Vec<f32> = (0..out * inp)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let mut y = vec![f32::NAN; rows * out];
            linear("t", &x, rows, &w, out, inp, &mut y).unwrap();
            let r = reference(&x, rows, &w, out, inp);
            // f32 sums of `inp` products: scale the bound by sqrt(inp).
            let tol = crate::tolerance::Tolerance {
                abs: 1e-6 * (inp as f64).sqrt() * 4.0,
                ..F32_VS_F64
            };
            let s = compare(&y, &r, &tol);
            assert!(
                s.violations == 0 && s.special_mismatches == 0,
                "{rows}x{out}x{inp}: {s:?}"
            );
            let mut yb = vec![0f32; rows * out];
            linear_blocked(&x, rows, &w, out, inp, &mut yb);
            assert!(compare(&yb, &r, &tol).violations == 0);
        }
    }

    #[test]
    fn shape_errors_name_the_argument() {
        let mut y = vec![0f32; 4];
        let e = linear("wq_a", &[0.0; 5], 2, &[0.0; 6], 2, 3, &mut y).unwrap_err();
        assert!(e.to_string().contains("wq_a: input"), "{e}");
        let e = linear("wq_a", &[0.0; 6], 2, &[0.0; 5], 2, 3, &mut y).unwrap_err();
        assert!(e.to_string().contains("wq_a: weight"), "{e}");
    }
}
