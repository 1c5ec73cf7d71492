//! Hierarchical candidate pool (docs/SPEC.md §2.6): the candidate source
//! (layer 20) turns its full indexer logits into a set of blocks that the Reindex layers
//! (24, 28, 32, 36) then score inside.
//!
//! For one query with `visible` entries and logits `I[j]`:
//! - block b covers entries `[b·block_size, (b+1)·block_size)`; its score is the max of its visible
//!   logits (invisible and NaN count as −∞);
//! - the block holding the newest visible entry, `(visible − 1) div block_size`, is pinned (+∞);
//! - keep the top `min(num_blocks, nblocks)` blocks whose score is not −∞, ties → smaller block id,
//!   sorted by (score desc, id asc), −1 padded.
//!
//! With `visible ≤ num_blocks · block_size` (16,384) every block with a finite score is kept, so the
//! pool masks nothing that is not already −∞: it is a no-op, as docs/SPEC.md §2.6 states.
//!
//! One output contract on both devices: the view entry ([`select_blocks_view`], the C export
//! `csa2_candidates`; [`select_blocks_view_on_stream`], `csa2_candidates_on_stream`) runs
//! [`select_blocks_rows`] on host tensors and, with feature `cuda`, `candidate_blocks_f32`
//! (`kernels/topk.cu`, [`cuda`]) on CUDA tensors: the same sorted lists, padding and counts,
//! sorted in the kernel (no host step).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod reference;

use crate::error::{Error, Result};
use crate::shape::Dims;
use crate::tensor::{one_device, Device, TensorView, TensorViewMut};
use rayon::prelude::*;

/// Pool parameters (geometry: `candidate_block_size` = 8, `candidate_topk_blocks` = 2048).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CandidateParams {
    /// Entries per block (8).
    pub block_size: usize,
    /// Blocks kept (2048).
    pub num_blocks: usize,
}

impl Default for CandidateParams {
    fn default() -> Self {
        CandidateParams {
            block_size: 8,
            num_blocks: 2048,
        }
    }
}

impl CandidateParams {
    /// Checks both sizes are > 0.
    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 || self.num_blocks == 0 {
            return Err(Error::invalid(
                "candidate params",
                format!(
                    "block_size and num_blocks must be > 0, found {} and {}",
                    self.block_size, self.num_blocks
                ),
            ));
        }
        Ok(())
    }
    /// Entries the pool can hold (16,384).
    pub fn capacity(&self) -> usize {
        self.block_size * self.num_blocks
    }
}

/// Selects the candidate blocks of one logits row (fast path) into `out` (`num_blocks` values;
/// a shorter `out` keeps fewer blocks); returns how many were kept.
pub fn select_blocks(
    p: &CandidateParams,
    logits: &[f32],
    visible: usize,
    out: &mut [i32],
) -> usize {
    let visible = visible.min(logits.len());
    let nblocks = visible.div_ceil(p.block_size);
    let mut scores = vec![0f32; nblocks];
    cpu::block_scores(&logits[..visible], p.block_size, &mut scores);
    if let Some(last) = scores.last_mut() {
        *last = f32::INFINITY;
    }
    let k = p.num_blocks.min(out.len());
    out[k..].fill(-1);
    crate::ops::topk::cpu::select_scored(&scores, &mut out[..k])
}

/// [`select_blocks`] over rows: `logits` (rows, n), `visible` per row, `out` (rows, num_blocks).
///
/// Errors: [`Error::Shape`] on inconsistent lengths, [`Error::Invalid`] on bad params.
pub fn select_blocks_rows(
    p: &CandidateParams,
    logits: &[f32],
    n: usize,
    visible: &[usize],
    out: &mut [i32],
) -> Result<()> {
    p.validate()?;
    let rows = visible.len();
    if logits.len() != rows * n {
        return Err(Error::shape(
            "candidate logits",
            format!("[{rows}, {n}]"),
            format!("{} values", logits.len()),
        ));
    }
    if out.len() != rows * p.num_blocks {
        return Err(Error::shape(
            "candidate blocks",
            format!("[{rows}, {}]", p.num_blocks),
            format!("{} values", out.len()),
        ));
    }
    if n == 0 {
        out.fill(-1);
        return Ok(());
    }
    out.par_chunks_mut(p.num_blocks)
        .zip(logits.par_chunks(n).zip(visible.par_iter()))
        .for_each(|(o, (row, &v))| {
            select_blocks(p, row, v, o);
        });
    Ok(())
}

/// Sets every logit outside the kept blocks (−1 ends the list) to −∞: the Reindex mask.
pub fn mask_outside(p: &CandidateParams, blocks: &[i32], logits: &mut [f32]) {
    let mut keep = vec![false; logits.len().div_ceil(p.block_size)];
    for &b in blocks.iter().take_while(|&&b| b >= 0) {
        if let Some(k) = keep.get_mut(b as usize) {
            *k = true;
        }
    }
    for (chunk, &k) in logits.chunks_mut(p.block_size).zip(&keep) {
        if !k {
            chunk.fill(f32::NEG_INFINITY);
        }
    }
}

/// The candidate pool over tensor views ([`signature::CANDIDATES`]), dispatched on their device
/// (all on one): host memory runs [`select_blocks_rows`]; CUDA memory (feature `cuda`) the kernel
/// `candidate_blocks_f32` of `kernels/topk.cu`, which writes the same lists in the same order
/// itself. Row t sees `(positions[t] + 1) div ratio` logits (clamped to N); `blocks_out` `[T, B]`
/// receives its kept blocks (B = `p.num_blocks`), `counts_out`, when given, how many.
///
/// Synchronous on both devices: on CUDA it waits for the device's work, reads `positions` back to
/// check them (T values), launches on csa2's own stream and waits for it. For a launch on the
/// caller's stream with no host access (CUDA-graph capture), use [`select_blocks_view_on_stream`].
///
/// Errors: [`Error::Shape`] for a tensor off the signature or a B other than `p.num_blocks`;
/// [`Error::Invalid`] for bad params, tensors on different devices (naming the odd one), ratio 0
/// or a negative position; [`Error::NoCudaBuild`] for CUDA tensors in a build without the `cuda`
/// feature; [`Error::Unsupported`] for a CUDA B over `cuda::shapes::TOPK_SORT_MAX` (4096) and
/// [`Error::Shape`] for CUDA tensors that are not dense float32 logits / int positions;
/// [`Error::Cuda`] on a GPU. Nothing is written on error.
pub fn select_blocks_view(
    p: &CandidateParams,
    logits: &TensorView<'_>,
    positions: &TensorView<'_>,
    ratio: usize,
    blocks_out: &mut TensorViewMut<'_>,
    counts_out: Option<&mut TensorViewMut<'_>>,
) -> Result<()> {
    select_blocks_view_impl(
        p, logits, positions, ratio, blocks_out, counts_out, None, None,
    )
}

/// [`select_blocks_view`] for a caller that owns a CUDA stream: on CUDA tensors the kernel is
/// launched on `stream` (a `CUstream` of the tensors' device, borrowed; 0 = the legacy default
/// stream) and the call returns after the launch — nothing is allocated, copied to or from the
/// host, or synchronized, so it can be captured in a CUDA graph once the modules are loaded
/// (`csa2_cuda_preload`). Positions are not read on the host there: a negative one keeps nothing
/// for its row (all −1, count 0) and is recorded in `error` (`[4]` int32 on the device, zeroed by
/// the caller, written only on a bad position: `{1, row, 0, position}`, first one wins). On host
/// tensors this is [`select_blocks_view`] (`stream` unused, `error` left as it is; a bad position
/// is the error).
///
/// Errors: as [`select_blocks_view`], minus the negative position on CUDA.
#[allow(clippy::too_many_arguments)]
pub fn select_blocks_view_on_stream(
    p: &CandidateParams,
    logits: &TensorView<'_>,
    positions: &TensorView<'_>,
    ratio: usize,
    blocks_out: &mut TensorViewMut<'_>,
    counts_out: Option<&mut TensorViewMut<'_>>,
    error: Option<&mut TensorViewMut<'_>>,
    stream: u64,
) -> Result<()> {
    select_blocks_view_impl(
        p,
        logits,
        positions,
        ratio,
        blocks_out,
        counts_out,
        error,
        Some(stream),
    )
}

#[allow(clippy::too_many_arguments)]
fn select_blocks_view_impl(
    p: &CandidateParams,
    logits: &TensorView<'_>,
    positions: &TensorView<'_>,
    ratio: usize,
    out: &mut TensorViewMut<'_>,
    counts_out: Option<&mut TensorViewMut<'_>>,
    error: Option<&mut TensorViewMut<'_>>,
    stream: Option<u64>,
) -> Result<()> {
    use signature::{BLOCKS_OUT, COUNTS_OUT, ERROR, LOGITS, POSITIONS};
    p.validate()?;
    let mut dims = Dims::default();
    logits.expect(&LOGITS, &mut dims)?;
    positions.expect(&POSITIONS, &mut dims)?;
    out.expect(&BLOCKS_OUT, &mut dims)?;
    if out.shape()[1] != p.num_blocks {
        return Err(Error::shape(
            BLOCKS_OUT.name,
            format!("[T, B={}] (B = num_blocks)", p.num_blocks),
            format!("{:?}", out.shape()),
        ));
    }
    let mut devices = vec![
        (LOGITS.name, logits.device()),
        (POSITIONS.name, positions.device()),
        (BLOCKS_OUT.name, out.device()),
    ];
    crate::tensor::expect_optional(counts_out.as_deref(), &COUNTS_OUT, &mut dims, &mut devices)?;
    crate::tensor::expect_optional(error.as_deref(), &ERROR, &mut dims, &mut devices)?;
    match one_device(&devices)? {
        Device::Cpu => {
            let vis = crate::ops::topk::visible_counts(&positions.to_i64(POSITIONS.name)?, ratio)?;
            let lf = logits.to_f32(LOGITS.name)?;
            let n = logits.shape()[1];
            // Every output is checked writable before anything is written.
            let blocks = out.as_mut_slice::<i32>(BLOCKS_OUT.name)?;
            let counts = match counts_out {
                Some(c) => Some(c.as_mut_slice::<i32>(COUNTS_OUT.name)?),
                None => None,
            };
            select_blocks_rows(p, &lf, n, &vis, blocks)?;
            if let Some(c) = counts {
                for (o, row) in c.iter_mut().zip(blocks.chunks(p.num_blocks)) {
                    *o = row.iter().take_while(|&&b| b >= 0).count() as i32;
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
            let v = crate::ops::topk::cuda::RowsViews {
                logits,
                positions,
                out: &o,
                out_name: BLOCKS_OUT.name,
                counts: c.as_ref(),
                error: e.as_ref(),
            };
            cuda::select_blocks_views(ordinal, p, &v, ratio, stream)
        }
        #[cfg(not(feature = "cuda"))]
        d @ Device::Cuda(_) => {
            let _ = (error, stream);
            Err(crate::tensor::no_cuda_build(LOGITS.name, d))
        }
    }
}

/// The tensor signature of the candidate pool (`csa2_candidates`, `csa2 op candidates`): the
/// top-k op's `logits [T, N]` and `positions [T]`, output `blocks_out [T, B]` int32 (B = blocks
/// kept); the stream form adds the top-k's optional `counts_out [T]` and `error [4]`.
pub mod signature {
    pub use crate::ops::topk::signature::{COUNTS_OUT, ERROR, LOGITS, POSITIONS};
    use crate::shape::{Arg, Dim, Signature};
    use crate::tensor::DType;

    /// `[T, B]` int32 kept blocks, sorted by (score desc, id asc), −1 padded.
    pub const BLOCKS_OUT: Arg =
        Arg::write("blocks_out", &[DType::I32], &[Dim::Any("T"), Dim::Any("B")]);
    /// `csa2_candidates`.
    pub const CANDIDATES: Signature = Signature {
        op: "candidates",
        args: &[LOGITS, POSITIONS, BLOCKS_OUT],
    };
    /// `csa2_candidates_on_stream`.
    pub const CANDIDATES_ON_STREAM: Signature = Signature {
        op: "candidates_on_stream",
        args: &[LOGITS, POSITIONS, BLOCKS_OUT, COUNTS_OUT, ERROR],
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn both(p: &CandidateParams, row: &[f32], visible: usize) -> Vec<i32> {
        let mut fast = vec![0i32; p.num_blocks];
        let n = select_blocks(p, row, visible, &mut fast);
        let r = reference::select_blocks(p, row, visible);
        assert_eq!(fast, r, "visible {visible}");
        assert_eq!(n, r.iter().filter(|&&b| b >= 0).count());
        fast
    }

    #[test]
    fn pool_is_a_no_op_at_16384_and_drops_one_block_at_16385() {
        let p = CandidateParams::default();
        let mut r = rand::rngs::StdRng::seed_from_u64(3);
        let row: Vec<f32> = (0..16_400).map(|_| r.random_range(-5.0f32..5.0)).collect();
        let kept = both(&p, &row, 16_384);
        assert_eq!(kept.iter().filter(|&&b| b >= 0).count(), 2048);
        let mut masked = row[..16_384].to_vec();
        mask_outside(&p, &kept, &mut masked);
        assert_eq!(masked, row[..16_384].to_vec(), "no-op below the pool size");
        let kept = both(&p, &row, 16_385);
        assert_eq!(kept.iter().filter(|&&b| b >= 0).count(), 2048);
        assert_eq!(kept[0], 2048, "the newest block is pinned first");
        // Exactly one old block (the one with the smallest max, ties → larger id) is dropped.
        let dropped: Vec<usize> = (0..2048).filter(|b| !kept.contains(&(*b as i32))).collect();
        assert_eq!(dropped.len(), 1);
        let maxes: Vec<f32> = row[..16_384]
            .chunks(8)
            .map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max))
            .collect();
        let min = maxes.iter().copied().fold(f32::INFINITY, f32::min);
        assert_eq!(maxes[dropped[0]], min);
    }

    #[test]
    fn all_minus_inf_blocks_are_never_kept_but_the_newest_is_pinned() {
        let p = CandidateParams {
            block_size: 8,
            num_blocks: 4,
        };
        let row = vec![f32::NEG_INFINITY; 40];
        let kept = both(&p, &row, 37);
        assert_eq!(kept, vec![4, -1, -1, -1]);
        let mut row = row;
        row[9] = 0.5; // block 1
        row[30] = 0.5; // block 3: tie with block 1 → block 1 first
        let kept = both(&p, &row, 37);
        assert_eq!(kept, vec![4, 1, 3, -1]);
        assert_eq!(both(&p, &row, 0), vec![-1; 4]);
    }

    #[test]
    fn pool_mask_marks_exactly_the_selected_blocks() {
        let p = CandidateParams {
            block_size: 8,
            num_blocks: 3,
        };
        let mut row = vec![0f32; 2 * 40];
        row[9] = 5.0; // row 0: block 1 best; block 4 (newest of 37 visible) pinned
        row[17] = 4.0; // block 2 next
        let m = reference::pool_mask(&p, &row, 40, &[37, 0]);
        assert_eq!(&m[..5], &[0, 1, 1, 0, 1]);
        assert_eq!(&m[5..], &[0; 5], "a row with nothing visible keeps nothing");
    }

    #[test]
    fn random_rows_match_reference() {
        let mut r = rand::rngs::StdRng::seed_from_u64(9);
        let p = CandidateParams {
            block_size: 8,
            num_blocks: 64,
        };
        for n in [1usize, 7, 8, 9, 511, 512, 513, 2000] {
            let row: Vec<f32> = (0..n).map(|_| r.random_range(0..6) as f32).collect();
            for v in [n, n / 2, n.saturating_sub(1)] {
                both(&p, &row, v);
            }
        }
    }

    /// `kernels/topk.cu`'s `BlockKey` and the selection's `(key << 32) | !id` sort words,
    /// written again here: the kernel keeps the largest non-zero words, sorted descending, so
    /// that model must give exactly the reference's lists (pin, NaN / −∞ blocks, +∞ ties, signed
    /// zeros, short rows, rows with nothing visible). The GPU tests check the kernel itself
    /// (`tests/cuda.rs`, `candidates_on_stream_match_cpu_and_reference`).
    fn kernel_model(p: &CandidateParams, row: &[f32], visible: usize) -> Vec<i32> {
        let sort_key = |f: f32| -> u32 {
            if f.is_nan() || f == f32::NEG_INFINITY {
                return 0;
            }
            let b = if f == 0.0 { 0 } else { f.to_bits() };
            if b & 0x8000_0000 != 0 {
                !b
            } else {
                b | 0x8000_0000
            }
        };
        let n = visible.min(row.len());
        let blocks = n.div_ceil(p.block_size);
        let mut words: Vec<u64> = (0..blocks)
            .map(|b| {
                let key = if b + 1 == blocks {
                    sort_key(f32::INFINITY)
                } else {
                    // fmaxf: the non-NaN operand wins, as `f32::max`.
                    let c = &row[b * p.block_size..(b + 1) * p.block_size];
                    sort_key(c.iter().copied().fold(f32::NEG_INFINITY, f32::max))
                };
                (u64::from(key) << 32) | u64::from(!(b as u32))
            })
            .filter(|w| w >> 32 != 0)
            .collect();
        words.sort_unstable_by(|a, b| b.cmp(a));
        let mut out: Vec<i32> = words
            .iter()
            .take(p.num_blocks)
            .map(|&w| !(w as u32) as i32)
            .collect();
        out.resize(p.num_blocks, -1);
        out
    }

    #[test]
    fn kernel_block_keys_give_the_contract() {
        let mut r = rand::rngs::StdRng::seed_from_u64(13);
        for (bs, b) in [(8usize, 16usize), (4, 64), (1, 100), (16, 3), (8, 1)] {
            let p = CandidateParams {
                block_size: bs,
                num_blocks: b,
            };
            let n = 900;
            for case in 0..6 {
                let row: Vec<f32> = (0..n)
                    .map(|j| match (case, j % 9) {
                        (0, _) => r.random_range(0..3) as f32,
                        (1, 0) => -0.0,
                        (1, 1) => 0.0,
                        (1, 2) => f32::NAN,
                        (1, 3) => f32::NEG_INFINITY,
                        (2, _) => f32::NEG_INFINITY,
                        (3, _) => f32::NAN,
                        (4, 4) => f32::INFINITY,
                        _ => r.random_range(-2.0f32..2.0),
                    })
                    .collect();
                for v in [0usize, 1, bs - 1, bs, bs + 1, bs * b, bs * b + 1, 64, 65, n] {
                    assert_eq!(
                        kernel_model(&p, &row, v),
                        reference::select_blocks(&p, &row, v),
                        "bs {bs} B {b} case {case} visible {v}"
                    );
                }
            }
        }
    }

    fn host<'a, T: crate::tensor::Element>(v: &'a [T], shape: &[usize]) -> TensorView<'a> {
        TensorView::from_host_slice(v, shape).unwrap()
    }

    /// A fake CUDA view (never dereferenced: the entries refuse it before any access).
    fn fake_cuda(shape: &[usize], dt: crate::tensor::DType) -> TensorView<'static> {
        crate::tensor::fake::cuda(0x1000, shape, dt)
    }

    fn fake_cuda_mut(shape: &[usize], dt: crate::tensor::DType) -> TensorViewMut<'static> {
        crate::tensor::fake::cuda_mut(0x2000, shape, dt)
    }

    /// On host views both entries are [`select_blocks_rows`] bit for bit (int32 and int64
    /// positions), with the kept count per row; the stream form leaves `error` alone.
    #[test]
    fn view_entries_on_the_host_are_select_blocks_rows() {
        let mut r = rand::rngs::StdRng::seed_from_u64(21);
        let (t, n) = (6usize, 700usize);
        for (bs, b, ratio) in [(8usize, 16usize, 4usize), (4, 200, 1), (8, 2048, 2)] {
            let p = CandidateParams {
                block_size: bs,
                num_blocks: b,
            };
            let mut logits: Vec<f32> = (0..t * n).map(|_| r.random_range(-3.0f32..3.0)).collect();
            logits[n..2 * n].fill(f32::NEG_INFINITY);
            logits[2 * n + 5] = f32::NAN;
            logits[3 * n + 17] = f32::INFINITY;
            let pos = [2799i64, 400, 127, 3, 0, 5000];
            let vis = crate::ops::topk::visible_counts(&pos, ratio).unwrap();
            let mut want = vec![0i32; t * b];
            select_blocks_rows(&p, &logits, n, &vis, &mut want).unwrap();
            let want_c: Vec<i32> = want
                .chunks(b)
                .map(|row| row.iter().filter(|&&x| x >= 0).count() as i32)
                .collect();
            let pos32: Vec<i32> = pos.iter().map(|&v| v as i32).collect();
            for i64_pos in [true, false] {
                let pv = if i64_pos {
                    host(&pos, &[t])
                } else {
                    host(&pos32, &[t])
                };
                let lv = host(&logits, &[t, n]);
                let (mut out, mut cnt, mut err) = (vec![9i32; t * b], vec![9i32; t], vec![5i32; 4]);
                {
                    let mut ov = TensorViewMut::from_host_slice(&mut out, &[t, b]).unwrap();
                    let mut cv = TensorViewMut::from_host_slice(&mut cnt, &[t]).unwrap();
                    let mut ev = TensorViewMut::from_host_slice(&mut err, &[4]).unwrap();
                    select_blocks_view_on_stream(
                        &p,
                        &lv,
                        &pv,
                        ratio,
                        &mut ov,
                        Some(&mut cv),
                        Some(&mut ev),
                        0,
                    )
                    .unwrap();
                }
                assert_eq!((&out, &cnt, &err), (&want, &want_c, &vec![5; 4]));
                let mut out2 = vec![9i32; t * b];
                let mut ov = TensorViewMut::from_host_slice(&mut out2, &[t, b]).unwrap();
                select_blocks_view(&p, &lv, &pv, ratio, &mut ov, None).unwrap();
                assert_eq!(out2, want);
            }
            assert_eq!(
                &want[b..b + 2],
                &[((vis[1] - 1) / bs) as i32, -1],
                "−∞ row: the pin"
            );
        }
    }

    /// Refusals, whatever the build: bad params, a B other than `num_blocks`, a counts length off
    /// T, ratio 0, a negative position (nothing written), a CUDA tensor among host ones (named).
    #[test]
    fn view_entry_refusals_name_the_argument() {
        let p = CandidateParams {
            block_size: 4,
            num_blocks: 3,
        };
        let (t, n) = (2usize, 40usize);
        let logits = vec![0.5f32; t * n];
        let pos = [39i64, 7];
        let (lv, pv) = (host(&logits, &[t, n]), host(&pos, &[t]));
        let mut out = vec![42i32; t * 3];
        let mut ov = TensorViewMut::from_host_slice(&mut out, &[t, 3]).unwrap();
        let zero = CandidateParams { block_size: 0, ..p };
        let e = select_blocks_view(&zero, &lv, &pv, 1, &mut ov, None).unwrap_err();
        assert!(e.to_string().contains("block_size"), "{e}");
        let wide = CandidateParams { num_blocks: 4, ..p };
        let e = select_blocks_view(&wide, &lv, &pv, 1, &mut ov, None).unwrap_err();
        assert!(
            matches!(e, Error::Shape { .. }) && e.to_string().contains("blocks_out"),
            "{e}"
        );
        let mut short = vec![0i32; 1];
        let mut cv = TensorViewMut::from_host_slice(&mut short, &[1]).unwrap();
        let e = select_blocks_view(&p, &lv, &pv, 1, &mut ov, Some(&mut cv)).unwrap_err();
        assert!(e.to_string().contains("counts_out"), "{e}");
        let e = select_blocks_view(&p, &lv, &pv, 0, &mut ov, None).unwrap_err();
        assert!(e.to_string().contains("ratio"), "{e}");
        let neg = [39i64, -2];
        let e = select_blocks_view(&p, &lv, &host(&neg, &[t]), 1, &mut ov, None).unwrap_err();
        assert!(matches!(e, Error::Invalid { .. }), "{e}");
        drop(ov);
        assert!(out.iter().all(|&v| v == 42), "written on error");
        let mut ov = TensorViewMut::from_host_slice(&mut out, &[t, 3]).unwrap();
        let dpos = fake_cuda(&[t], crate::tensor::DType::I64);
        let e = select_blocks_view(&p, &lv, &dpos, 1, &mut ov, None).unwrap_err();
        assert!(
            matches!(e, Error::Invalid { .. }) && e.to_string().contains("positions"),
            "{e}"
        );
        let mut derr = fake_cuda_mut(&[4], crate::tensor::DType::I32);
        let e = select_blocks_view_on_stream(&p, &lv, &pv, 1, &mut ov, None, Some(&mut derr), 0)
            .unwrap_err();
        assert!(
            matches!(e, Error::Invalid { .. }) && e.to_string().contains("error"),
            "{e}"
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_views_without_the_cuda_feature_are_no_cuda_build_errors() {
        use crate::tensor::DType;
        let p = CandidateParams {
            block_size: 8,
            num_blocks: 4,
        };
        let lv = fake_cuda(&[2, 10], DType::F32);
        let pv = fake_cuda(&[2], DType::I64);
        let mut ov = fake_cuda_mut(&[2, 4], DType::I32);
        let e = select_blocks_view(&p, &lv, &pv, 1, &mut ov, None).unwrap_err();
        assert!(matches!(e, Error::NoCudaBuild(_)), "{e:?}");
        let mut cv = fake_cuda_mut(&[2], DType::I32);
        let e = select_blocks_view_on_stream(&p, &lv, &pv, 1, &mut ov, Some(&mut cv), None, 0)
            .unwrap_err();
        assert!(matches!(e, Error::NoCudaBuild(_)), "{e:?}");
    }
}
