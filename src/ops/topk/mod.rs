//! Top-k selection for the lightning indexer (docs/SPEC.md §2 "Indexer", docs/SPEC.md §2.5).
//!
//! Rules, one row at a time:
//! - the k largest logits among the visible entries, ties → the smaller index;
//! - −∞ (masked) and NaN logits are never selected; a row with fewer than k selectable entries is
//!   padded with −1;
//! - when `visible ≤ k` every visible entry is selected, in index order, without looking at the
//!   logits (vLLM fills `0..compress_len` directly; the set is the same).
//!
//! # The order contract (CPU and CUDA alike)
//!
//! A row's selection, then its −1 padding, comes out in one defined order:
//! - a row with `visible > k` (scored): sorted by (logit desc, index asc), [`order`];
//! - a row with `visible ≤ k`: `0..visible` ascending (which is the index order of the same set).
//!
//! The engine feeds the list to attention in this order, so it is part of the result (the f32
//! sums of attention follow it). The fast path ([`cpu::select_scored`]) produces it directly: one
//! streaming pass against a running threshold with a bounded candidate buffer (see its module
//! docs). The CUDA kernel (`kernels/topk.cu`) selects by radix select and sorts the selection in
//! shared memory into the same order, so a CUDA result needs no host step. The tests compare the
//! CPU path with [`reference::select`] under this contract, and the GPU tests (`tests/cuda.rs`)
//! the CUDA path with the CPU path.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod reference;

use crate::error::{Error, Result};
use crate::shape::Dims;
use crate::tensor::{one_device, Device, TensorView, TensorViewMut};
use rayon::prelude::*;

/// The indexer's k (docs/SPEC.md §2: 512).
pub const INDEX_TOPK: usize = 512;

/// Top-k of one logits row (fast path). `out.len()` is k; returns the number of selected entries
/// (the rest of `out` is −1). Entries at `visible..` are ignored.
pub fn select(logits: &[f32], visible: usize, out: &mut [i32]) -> usize {
    let visible = visible.min(logits.len());
    let k = out.len();
    if visible <= k {
        for (j, o) in out.iter_mut().enumerate() {
            *o = if j < visible { j as i32 } else { -1 };
        }
        return visible;
    }
    cpu::select_scored(&logits[..visible], out)
}

/// One row's work item in [`select_rows`]: (output, count) and (logits, visible).
type RowJob<'a> = ((&'a mut [i32], &'a mut usize), (&'a [f32], &'a usize));

/// Top-k of every row of `logits` (rows, n) with per-row `visible` counts into `out` (rows, k), rows
/// in parallel. Returns the per-row counts.
///
/// Errors: [`Error::Shape`] when the lengths disagree.
pub fn select_rows(
    logits: &[f32],
    n: usize,
    visible: &[usize],
    out: &mut [i32],
) -> Result<Vec<usize>> {
    let rows = visible.len();
    if logits.len() != rows * n {
        return Err(Error::shape(
            "top-k logits",
            format!("[{rows}, {n}]"),
            format!("{} values", logits.len()),
        ));
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    if !out.len().is_multiple_of(rows) {
        return Err(Error::shape(
            "top-k output",
            format!("{rows} rows"),
            format!("{} values", out.len()),
        ));
    }
    let k = out.len() / rows;
    if k == 0 {
        return Ok(vec![0; rows]);
    }
    let mut counts = vec![0usize; rows];
    let work = |((o, c), (row, &v)): RowJob| {
        *c = select(row, v, o);
    };
    let go_parallel = n >= 1 << 14 || rows * n >= 1 << 16;
    if n == 0 {
        out.fill(-1);
    } else if go_parallel {
        out.par_chunks_mut(k)
            .zip(counts.par_iter_mut())
            .zip(logits.par_chunks(n).zip(visible.par_iter()))
            .for_each(work);
    } else {
        out.chunks_mut(k)
            .zip(counts.iter_mut())
            .zip(logits.chunks(n).zip(visible.iter()))
            .for_each(work);
    }
    Ok(counts)
}

/// The visible entries of each row, `(p + 1) div ratio` (shared by top-k and the candidate pool).
///
/// Errors: [`Error::Invalid`] for ratio 0 or a negative position (naming the token).
pub fn visible_counts(positions: &[i64], ratio: usize) -> Result<Vec<usize>> {
    if ratio == 0 {
        return Err(Error::invalid("ratio", "must be ≥ 1, found 0"));
    }
    crate::ops::rope::check_positions(positions)?;
    Ok(positions
        .iter()
        .map(|&p| crate::ops::visible(p, ratio))
        .collect())
}

/// Top-k over tensor views ([`signature::TOPK`]), dispatched on their device: host memory runs
/// [`select_rows`]; CUDA memory the kernel of `kernels/topk.cu` (feature `cuda`), which gives
/// the order of the module's contract itself. Row t sees `(positions[t] + 1) div ratio` entries
/// (clamped to N). `counts_out`, when given, receives the entries selected per row.
///
/// Synchronous on both devices: on CUDA it waits for the device's work, reads `positions` back
/// to check them (T values), launches on csa2's own stream and waits for it. For a launch on the
/// caller's stream with no host access (CUDA-graph capture), use [`select_rows_view_on_stream`].
///
/// Errors: [`Error::Shape`] for a tensor off the signature; [`Error::Invalid`] for tensors on
/// different devices, ratio 0 or a negative position; [`Error::NoCudaBuild`] for CUDA tensors in
/// a build without the `cuda` feature; [`Error::Unsupported`] for a CUDA k over
/// `cuda::shapes::TOPK_SORT_MAX` (4096); [`Error::Cuda`] on a GPU. Nothing is written on error.
pub fn select_rows_view(
    logits: &TensorView<'_>,
    positions: &TensorView<'_>,
    ratio: usize,
    out: &mut TensorViewMut<'_>,
    counts_out: Option<&mut TensorViewMut<'_>>,
) -> Result<()> {
    select_rows_view_impl(logits, positions, ratio, out, counts_out, None, None)
}

/// [`select_rows_view`] for a caller that owns a CUDA stream: on CUDA tensors the kernel is
/// launched on `stream` (a `CUstream` of the tensors' device, borrowed; 0 = the legacy default
/// stream) and the call returns after the launch — nothing is allocated, copied to or from the
/// host, or synchronized, so it can be captured in a CUDA graph once the modules are loaded
/// (`csa2_cuda_preload`). Positions are not read on the host there: a negative one selects nothing
/// for its row and is recorded in `error` (`[4]` int32 on the device, zeroed by the caller,
/// written only on a bad position: `{1, row, 0, position}`, first one wins). On host tensors this
/// is [`select_rows_view`] (`stream` unused, `error` left as it is; a bad position is the error).
///
/// Errors: as [`select_rows_view`], minus the negative position on CUDA.
pub fn select_rows_view_on_stream(
    logits: &TensorView<'_>,
    positions: &TensorView<'_>,
    ratio: usize,
    out: &mut TensorViewMut<'_>,
    counts_out: Option<&mut TensorViewMut<'_>>,
    error: Option<&mut TensorViewMut<'_>>,
    stream: u64,
) -> Result<()> {
    select_rows_view_impl(
        logits,
        positions,
        ratio,
        out,
        counts_out,
        error,
        Some(stream),
    )
}

fn select_rows_view_impl(
    logits: &TensorView<'_>,
    positions: &TensorView<'_>,
    ratio: usize,
    out: &mut TensorViewMut<'_>,
    counts_out: Option<&mut TensorViewMut<'_>>,
    error: Option<&mut TensorViewMut<'_>>,
    stream: Option<u64>,
) -> Result<()> {
    use signature::{COUNTS_OUT, ERROR, LOGITS, OUT, POSITIONS};
    let mut dims = Dims::default();
    logits.expect(&LOGITS, &mut dims)?;
    positions.expect(&POSITIONS, &mut dims)?;
    out.expect(&OUT, &mut dims)?;
    let mut devices = vec![
        (LOGITS.name, logits.device()),
        (POSITIONS.name, positions.device()),
        (OUT.name, out.device()),
    ];
    crate::tensor::expect_optional(counts_out.as_deref(), &COUNTS_OUT, &mut dims, &mut devices)?;
    crate::tensor::expect_optional(error.as_deref(), &ERROR, &mut dims, &mut devices)?;
    match one_device(&devices)? {
        Device::Cpu => {
            let vis = visible_counts(&positions.to_i64(POSITIONS.name)?, ratio)?;
            let lf = logits.to_f32(LOGITS.name)?;
            let n = logits.shape()[1];
            let counts = select_rows(&lf, n, &vis, out.as_mut_slice::<i32>(OUT.name)?)?;
            if let Some(c) = counts_out {
                for (o, &k) in c
                    .as_mut_slice::<i32>(COUNTS_OUT.name)?
                    .iter_mut()
                    .zip(&counts)
                {
                    *o = k as i32;
                }
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            let (o, c, e) = (
                out.as_view(),
                counts_out.map(|c| c.as_view()),
                error.map(|e| e.as_view()),
            );
            let v = cuda::RowsViews {
                logits,
                positions,
                out: &o,
                out_name: OUT.name,
                counts: c.as_ref(),
                error: e.as_ref(),
            };
            cuda::run_rows_views(ordinal, cuda::RowsKernel::TopK, &v, ratio, stream)
        }
        #[cfg(not(feature = "cuda"))]
        d @ Device::Cuda(_) => {
            let _ = (error, stream);
            Err(crate::tensor::no_cuda_build(LOGITS.name, d))
        }
    }
}

/// Sorts a selection (−1 padding last) by (logit desc, index asc): the canonical order of `csa2 op`.
/// −∞ logits sort after finite ones; −1 entries stay at the end.
pub fn sort_selection(logits: &[f32], sel: &mut [i32]) {
    let n = sel.iter().position(|&i| i < 0).unwrap_or(sel.len());
    sel[..n].sort_unstable_by(|&a, &b| order(logits[a as usize], a, logits[b as usize], b));
}

/// The selection order: larger value first, then smaller index; NaN ranks as −∞ and −0 equals +0
/// (a numeric tie, so the index decides).
#[inline]
pub fn order(va: f32, ia: i32, vb: f32, ib: i32) -> std::cmp::Ordering {
    let key = |v: f32| {
        if v.is_nan() {
            f32::NEG_INFINITY
        } else if v == 0.0 {
            0.0
        } else {
            v
        }
    };
    key(vb).total_cmp(&key(va)).then(ia.cmp(&ib))
}

/// The tensor signature of the top-k op (`csa2_topk`, [`select_rows_view`]): `logits [T, N]`
/// float, `positions [T]` int (row t sees `(positions[t] + 1) div ratio` entries), outputs
/// `out [T, K]` int32 and, optionally, `counts_out [T]` int32.
pub mod signature {
    use crate::shape::{Arg, Dim, Signature};
    use crate::tensor::{DType, FLOATS, INTS};

    /// `[T, N]` float indexer logits (also the candidate pool's input).
    pub const LOGITS: Arg = Arg::read("logits", FLOATS, &[Dim::Any("T"), Dim::Any("N")]);
    /// `[T]` int token positions (≥ 0).
    pub const POSITIONS: Arg = Arg::read("positions", INTS, &[Dim::Any("T")]);
    /// `[T, K]` int32 selection, −1 padded, in the order of [`super`]'s contract.
    pub const OUT: Arg = Arg::write("out", &[DType::I32], &[Dim::Any("T"), Dim::Any("K")]);
    /// `[T]` int32 entries selected per row.
    pub const COUNTS_OUT: Arg =
        Arg::write("counts_out", &[DType::I32], &[Dim::Any("T")]).optional();
    /// `[4]` int32 error record of a launch on the caller's stream (CUDA only; see
    /// [`super::select_rows_view_on_stream`]).
    pub const ERROR: Arg = Arg::write("error", &[DType::I32], &[Dim::Fixed(4)]).optional();
    /// `csa2_topk`.
    pub const TOPK: Signature = Signature {
        op: "topk",
        args: &[LOGITS, POSITIONS, OUT, COUNTS_OUT],
    };
    /// `csa2_topk_on_stream`.
    pub const TOPK_ON_STREAM: Signature = Signature {
        op: "topk_on_stream",
        args: &[LOGITS, POSITIONS, OUT, COUNTS_OUT, ERROR],
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn check_row(logits: &[f32], visible: usize, k: usize) {
        let mut fast = vec![0i32; k];
        let nf = select(logits, visible, &mut fast);
        let refr = reference::select(logits, visible, k);
        assert_eq!(&fast[..], &refr[..], "visible {visible} k {k}");
        assert_eq!(nf, refr.iter().filter(|&&i| i >= 0).count());
    }

    #[test]
    fn fast_equals_reference_on_random_and_tied_rows() {
        let mut r = rand::rngs::StdRng::seed_from_u64(7);
        for &n in &[0usize, 1, 511, 512, 513, 1000, 4096, 100_003] {
            let cont: Vec<f32> = (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect();
            let ties: Vec<f32> = (0..n).map(|_| r.random_range(0..4) as f32).collect();
            let inc: Vec<f32> = (0..n).map(|j| j as f32).collect();
            let mut masked = cont.clone();
            for (j, v) in masked.iter_mut().enumerate() {
                if j % 3 != 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
            for row in [&cont, &ties, &inc, &masked] {
                for vis in [n, n.saturating_sub(1), n / 2] {
                    check_row(row, vis, 512);
                }
                check_row(row, n, 7);
            }
        }
    }

    #[test]
    fn visible_512_selects_all_and_513_scores() {
        // 512 visible: all of them in index order even though some are −∞.
        let mut logits = vec![f32::NEG_INFINITY; 600];
        logits[3] = 1.0;
        let mut out = vec![0i32; 512];
        assert_eq!(select(&logits, 512, &mut out), 512);
        assert_eq!(out, (0..512).collect::<Vec<i32>>());
        // 513 visible: scored; only finite entries are selectable.
        let row: Vec<f32> = (0..513).map(|j| (j % 7) as f32).collect();
        assert_eq!(select(&row, 513, &mut out), 512);
        // The single dropped entry is the smallest value with the largest index: value 0 at 511.
        assert!(!out.contains(&511) && out.contains(&0) && out.contains(&512));
        assert_eq!(select(&logits, 513, &mut out), 1);
        assert_eq!(out[0], 3);
        assert!(out[1..].iter().all(|&i| i == -1));
    }

    #[test]
    fn ties_go_to_the_smaller_index_and_nan_is_never_selected() {
        let mut row = vec![1.0f32; 2000];
        row[1500] = f32::NAN;
        row[1999] = 2.0;
        let mut out = vec![0i32; 512];
        select(&row, 2000, &mut out);
        assert_eq!(out[0], 1999);
        assert_eq!(&out[1..], &(0..511).collect::<Vec<i32>>()[..]);
        let all_nan = vec![f32::NAN; 1000];
        assert_eq!(select(&all_nan, 1000, &mut out), 0);
        assert!(out.iter().all(|&i| i == -1));
    }

    #[test]
    fn signed_zeros_are_a_tie() {
        // −0 and +0 are equal logits: the smaller index must win, whatever the sign bit.
        let mut row = vec![-1.0f32; 600];
        row[10] = -0.0;
        row[5] = 0.0;
        let mut out = vec![0i32; 513];
        let mut small = vec![0i32; 2];
        select(&row, 600, &mut out);
        assert_eq!(&out[..2], &[5, 10]);
        row[5] = -0.0;
        row[10] = 0.0;
        select(&row, 600, &mut out);
        assert_eq!(&out[..2], &[5, 10]);
        assert_eq!(cpu::select_scored(&row, &mut small), 2);
        assert_eq!(small, vec![5, 10]);
        assert_eq!(reference::select(&row, 600, 2), vec![5, 10]);
    }

    #[test]
    fn reference_rows_follow_the_contract() {
        // The CUDA kernel's reference: `select` per row with n_valid clamped; a row with
        // n_valid ≤ k takes 0..n_valid even when those keys are −∞.
        let mut r = rand::rngs::StdRng::seed_from_u64(5);
        let n = 700;
        let mut keys: Vec<f32> = (0..3 * n).map(|_| r.random_range(0..9) as f32).collect();
        keys[n + 3] = f32::NAN;
        keys[2 * n..]
            .iter_mut()
            .for_each(|v| *v = f32::NEG_INFINITY);
        let got = reference::select_rows(&keys, n, &[n as i32 + 5, 600, 5], 512);
        for (t, &nv) in [n, 600, 5].iter().enumerate() {
            let want = reference::select(&keys[t * n..(t + 1) * n], nv, 512);
            assert_eq!(&got[t * 512..(t + 1) * 512], &want[..]);
        }
        assert!(
            !got[512..1024].contains(&3),
            "the NaN key of row 1 is never selected"
        );
        assert_eq!(&got[1024..1029], &[0, 1, 2, 3, 4]);
        assert!(got[1029..1536].iter().all(|&i| i == -1));
    }

    #[test]
    fn rows_api_checks_shapes() {
        let logits = vec![0f32; 10];
        let mut out = vec![0i32; 4];
        assert!(select_rows(&logits, 5, &[5, 5], &mut out).is_ok());
        assert_eq!(out, vec![0, 1, 0, 1]);
        assert!(select_rows(&logits, 4, &[5, 5], &mut out).is_err());
    }

    /// `kernels/topk.cu`'s `sort_key` and its `(key << 32) | !index` sort word, written again
    /// here: the kernel's order is one descending sort of those words, so sorting a selection by
    /// them must give exactly the CPU's order (signed zeros one value, NaN / −∞ unselectable).
    /// The GPU tests check the kernel itself (`tests/cuda.rs`).
    fn kernel_sort_word(v: f32, i: i32) -> u64 {
        let key = if v.is_nan() || v == f32::NEG_INFINITY {
            0
        } else {
            let b = if v == 0.0 { 0 } else { v.to_bits() };
            if b & 0x8000_0000 != 0 {
                !b
            } else {
                b | 0x8000_0000
            }
        };
        (u64::from(key) << 32) | u64::from(!(i as u32))
    }

    #[test]
    fn kernel_sort_words_give_the_contract_order() {
        let mut r = rand::rngs::StdRng::seed_from_u64(11);
        let n = 900;
        let k = 64;
        for case in 0..4 {
            let row: Vec<f32> = (0..n)
                .map(|j| match (case, j % 7) {
                    (0, _) => r.random_range(0..5) as f32,
                    (1, 0) => -0.0,
                    (1, 1) => 0.0,
                    (1, 2) => f32::NAN,
                    (2, 3) => f32::NEG_INFINITY,
                    _ => r.random_range(-2.0f32..2.0),
                })
                .collect();
            let want = reference::select(&row, n, k);
            let c = want.iter().filter(|&&i| i >= 0).count();
            let mut words: Vec<u64> = want[..c]
                .iter()
                .map(|&i| kernel_sort_word(row[i as usize], i))
                .collect();
            assert!(
                words.iter().all(|&w| w >> 32 != 0),
                "a selected key maps to 0"
            );
            words.sort_unstable_by(|a, b| b.cmp(a));
            let got: Vec<i32> = words.iter().map(|&w| !(w as u32) as i32).collect();
            assert_eq!(&got[..], &want[..c], "case {case}");
        }
        assert!(kernel_sort_word(f32::NAN, 0) >> 32 == 0);
        assert_eq!(
            kernel_sort_word(-0.0, 3) >> 32,
            kernel_sort_word(0.0, 3) >> 32
        );
    }

    #[test]
    fn view_entry_follows_the_contract_and_checks_devices() {
        let (t, n, k) = (3usize, 700usize, 16usize);
        let mut r = rand::rngs::StdRng::seed_from_u64(2);
        let logits: Vec<f32> = (0..t * n).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let pos = [699i64, 9, 1397];
        let mut out = vec![0i32; t * k];
        let mut counts = vec![0i32; t];
        let lv = TensorView::from_host_slice(&logits, &[t, n]).unwrap();
        let pv = TensorView::from_host_slice(&pos, &[t]).unwrap();
        {
            let mut ov = TensorViewMut::from_host_slice(&mut out, &[t, k]).unwrap();
            let mut cv = TensorViewMut::from_host_slice(&mut counts, &[t]).unwrap();
            select_rows_view(&lv, &pv, 2, &mut ov, Some(&mut cv)).unwrap();
        }
        for (row, &p) in pos.iter().enumerate() {
            let vis = ((p + 1) / 2) as usize;
            let want = reference::select(&logits[row * n..(row + 1) * n], vis, k);
            assert_eq!(&out[row * k..(row + 1) * k], &want[..], "row {row}");
            assert_eq!(counts[row] as usize, vis.min(k));
        }
        // Wrong K binding: counts_out [T] must agree with logits' T.
        let mut short = vec![0i32; 2];
        let mut ov = TensorViewMut::from_host_slice(&mut out, &[t, k]).unwrap();
        let mut cv = TensorViewMut::from_host_slice(&mut short, &[2]).unwrap();
        let e = select_rows_view(&lv, &pv, 2, &mut ov, Some(&mut cv))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("counts_out") && e.contains("T=3") && e.contains("[2]"),
            "{e}"
        );
        // A CUDA tensor among host ones is a mixed-device error, whatever the build.
        let dpos = crate::tensor::fake::cuda(0x1000, &[t], crate::tensor::DType::I64);
        let e = select_rows_view(&lv, &dpos, 2, &mut ov, None).unwrap_err();
        assert!(
            matches!(e, Error::Invalid { .. }) && e.to_string().contains("positions"),
            "{e}"
        );
        let e = select_rows_view(&lv, &pv, 0, &mut ov, None).unwrap_err();
        assert!(e.to_string().contains("ratio"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_views_without_the_cuda_feature_are_no_cuda_build_errors() {
        let dev = |shape: &[usize], dt| crate::tensor::fake::cuda(0x1000, shape, dt);
        let lv = dev(&[2, 10], crate::tensor::DType::F32);
        let pv = dev(&[2], crate::tensor::DType::I64);
        let mut ov = crate::tensor::fake::cuda_mut(0x2000, &[2, 4], crate::tensor::DType::I32);
        let e = select_rows_view(&lv, &pv, 1, &mut ov, None).unwrap_err();
        assert!(matches!(e, Error::NoCudaBuild(_)), "{e:?}");
    }
}
