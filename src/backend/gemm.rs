//! Dense projections of the attention sublayer (`wq_a`, `wq_b`, `wkv`, compressor `wkv`/`wgate`,
//! indexer `wq_b`/`weights_proj`, grouped `wo_a`, `wo_b`): `y = x · Wᵀ` with the weight in the
//! checkpoint's `[out, in]` row-major layout (PyTorch `nn.Linear`), kept in its stored dtype.
//!
//! **Batch invariance.** Every output element `y[r, o]` is computed by one fixed sequence of
//! operations that depends only on `inp`, never on how many rows the call holds, which rows share a
//! tile, or how the work is split over threads: 16 lane accumulators, lane `j` summing the products
//! of columns `k ≡ j (mod 16)` in increasing `k` (one FMA each with AVX-512F, a multiply then an add
//! on the portable path), a ragged column tail through zero-padded lanes, then one fixed horizontal
//! sum of the 16 lanes. A prefill of any chunking, a decode row, or a row batched beside other
//! requests' rows therefore gets the same bits (the reduction order is per row, as in
//! batch-invariant inference kernels). The instruction set is chosen once per process
//! ([`crate::isa::level`], `CSA2_ISA` caps it), never by the row count.
//!
//! **Fused dequantization.** Weights stay bf16 or FP8 E4M3 in memory and are widened to f32 inside
//! the kernel, 16 at a time, right before their FMA; accumulation is f32. The widened value is
//! exactly [`WeightView::get`] (`bf16 → f32` is exact; FP8: `E4M3(q) · scale[o/32][k/32]`, one f32
//! rounding, the loader's dequantized value), so an f64 reference over [`WeightView::get`] sees the
//! weights the kernel multiplies.
//!
//! Tiling: rows in tiles of up to 8 (one x vector per row per step), outputs in tiles of 2–8 (the
//! weight vector loaded once per step feeds every row of the tile); rayon tasks over (row block ×
//! output block). Tiles only share loads; they never change an element's arithmetic.

use crate::error::{Error, Result};
use crate::isa::{level, Isa};
use rayon::prelude::*;

/// FP8 weight block edge (`weight_block_size = [32, 32]`).
const FP8_BLOCK: usize = 32;
/// `2^120`: an E4M3 code's 7 magnitude bits placed at f32 bits 26..20 read as f32 equal the E4M3
/// value times `2^-120` (normals and subnormals alike), so the kernel folds `2^120` into the block
/// scale.
pub const E4M3_FOLD: f32 = f32::from_bits((127 + 120) << 23);

/// A weight `[rows, cols]` (row-major, `[out, in]`) in its stored dtype, borrowed.
#[derive(Debug, Clone, Copy)]
pub enum WeightView<'a> {
    /// f32 values.
    F32 {
        /// `rows × cols` values.
        data: &'a [f32],
        /// Columns.
        cols: usize,
    },
    /// bf16 bit patterns (`u16`, the upper half of the f32).
    Bf16 {
        /// `rows × cols` bit patterns.
        data: &'a [u16],
        /// Columns.
        cols: usize,
    },
    /// FP8 E4M3 codes with one scale per 32 × 32 block.
    Fp8 {
        /// `rows × cols` E4M3 codes (no NaN code: the loader rejects them).
        codes: &'a [u8],
        /// Per block `[⌈rows/32⌉ over the whole matrix, ⌈cols/32⌉]`: `scale · 2^120`
        /// ([`E4M3_FOLD`]), finite.
        folded: &'a [f32],
        /// Columns.
        cols: usize,
        /// Row of the whole matrix this view starts at, a multiple of 32 (a row block of a grouped
        /// projection).
        row0: usize,
    },
}

impl WeightView<'_> {
    /// Columns (input features).
    pub fn cols(&self) -> usize {
        match *self {
            WeightView::F32 { cols, .. }
            | WeightView::Bf16 { cols, .. }
            | WeightView::Fp8 { cols, .. } => cols,
        }
    }
    /// Rows (output features).
    pub fn rows(&self) -> usize {
        let c = self.cols().max(1);
        match *self {
            WeightView::F32 { data, .. } => data.len() / c,
            WeightView::Bf16 { data, .. } => data.len() / c,
            WeightView::Fp8 { codes, .. } => codes.len() / c,
        }
    }
    /// The f32 value the kernel multiplies for element `(o, k)`.
    #[inline]
    pub fn get(&self, o: usize, k: usize) -> f32 {
        match *self {
            WeightView::F32 { data, cols } => data[o * cols + k],
            WeightView::Bf16 { data, cols } => bf16_to_f32(data[o * cols + k]),
            WeightView::Fp8 {
                codes,
                folded,
                cols,
                row0,
            } => {
                let bc = cols.div_ceil(FP8_BLOCK);
                e4m3_scaled(
                    codes[o * cols + k],
                    folded[(row0 + o) / FP8_BLOCK * bc + k / FP8_BLOCK],
                )
            }
        }
    }
    /// Every element as f32 (what the kernel multiplies), row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let (r, c) = (self.rows(), self.cols());
        let mut out = vec![0f32; r * c];
        out.par_chunks_mut(c.max(1))
            .enumerate()
            .for_each(|(o, row)| {
                for (k, v) in row.iter_mut().enumerate() {
                    *v = self.get(o, k);
                }
            });
        out
    }
    /// Rows `r0 .. r0 + n` as a view.
    ///
    /// Errors: [`Error::Invalid`] when the range leaves the matrix, or for FP8 when `r0` is not a
    /// multiple of the 32-row scale block.
    pub fn row_block(&self, r0: usize, n: usize) -> Result<Self> {
        let (rows, c) = (self.rows(), self.cols());
        if r0 + n > rows {
            return Err(Error::invalid(
                "weight row block",
                format!("rows {r0}..{} of a matrix of {rows} rows", r0 + n),
            ));
        }
        Ok(match *self {
            WeightView::F32 { data, cols } => WeightView::F32 {
                data: &data[r0 * c..(r0 + n) * c],
                cols,
            },
            WeightView::Bf16 { data, cols } => WeightView::Bf16 {
                data: &data[r0 * c..(r0 + n) * c],
                cols,
            },
            WeightView::Fp8 {
                codes,
                folded,
                cols,
                row0,
            } => {
                if !(row0 + r0).is_multiple_of(FP8_BLOCK) {
                    return Err(Error::invalid(
                        "weight row block",
                        format!(
                            "an FP8 row block starts at a multiple of 32, found {}",
                            row0 + r0
                        ),
                    ));
                }
                WeightView::Fp8 {
                    codes: &codes[r0 * c..(r0 + n) * c],
                    folded,
                    cols,
                    row0: row0 + r0,
                }
            }
        })
    }
    fn len(&self) -> usize {
        match *self {
            WeightView::F32 { data, .. } => data.len(),
            WeightView::Bf16 { data, .. } => data.len(),
            WeightView::Fp8 { codes, .. } => codes.len(),
        }
    }
}

/// bf16 bits → f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `E4M3(c) · scale` from the folded scale `scale · 2^120`: the sign and the 7 magnitude bits moved
/// to f32 bits 31 and 26..20 (the same bit trick the AVX-512 kernel uses), one rounding.
#[inline]
pub fn e4m3_scaled(c: u8, folded: f32) -> f32 {
    let bits = ((c as i8 as i32 as u32) << 20) & 0x87F0_0000;
    f32::from_bits(bits) * folded
}

/// `y[rows, out] = x[rows, inp] · w[out, inp]ᵀ`, f32 weights (see [`linear_w`]).
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
    if w.len() != out * inp {
        return Err(Error::shape(
            format!("{what}: weight"),
            format!("[{out}, {inp}] = {}", out * inp),
            w.len(),
        ));
    }
    linear_w(
        what,
        x,
        rows,
        WeightView::F32 { data: w, cols: inp },
        out,
        y,
    )
}

/// `y[rows, out] = x[rows, inp] · Wᵀ` with `W [out, inp]` in its stored dtype (`inp = w.cols()`),
/// f32 accumulation, bit-identical per row whatever `rows` is (module docs).
///
/// Errors: [`Error::Shape`] naming `what` when `x`, `w` or `y` does not match `[rows, inp]`,
/// `[out, inp]`, `[rows, out]`.
pub fn linear_w(
    what: &str,
    x: &[f32],
    rows: usize,
    w: WeightView<'_>,
    out: usize,
    y: &mut [f32],
) -> Result<()> {
    let inp = w.cols();
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
    if let WeightView::Fp8 {
        folded, cols, row0, ..
    } = w
    {
        let need = (row0 + out).div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
        if folded.len() < need {
            return Err(Error::shape(
                format!("{what}: FP8 block scales"),
                format!("≥ {need}"),
                folded.len(),
            ));
        }
    }
    run(x, rows, w, out, inp, y);
    Ok(())
}

/// Rows per rayon task (its x block stays in L2 while the task's weight tiles stream).
const ROW_BLOCK: usize = 32;

/// `y` shared by tasks that write disjoint `(row range × output range)` rectangles.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint rectangles of `y` (see `run`); the pointer outlives the scope.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

fn run(x: &[f32], rows: usize, w: WeightView<'_>, out: usize, inp: usize, y: &mut [f32]) {
    let threads = rayon::current_num_threads().max(1);
    let rb = rows.div_ceil(ROW_BLOCK);
    // Output blocks: enough tasks to balance the threads (4 per thread), each a multiple of 8
    // outputs; the split changes which thread computes an element, never how.
    let want = (4 * threads).div_ceil(rb).max(1);
    let ob = (out.div_ceil(want).div_ceil(8) * 8)
        .clamp(8, 512)
        .min(out.div_ceil(8) * 8);
    let nob = out.div_ceil(ob);
    let yp = OutPtr(y.as_mut_ptr());
    let isa = level();
    (0..rb * nob).into_par_iter().for_each(|t| {
        let (bi, bo) = (t / nob, t % nob);
        let r0 = bi * ROW_BLOCK;
        let r1 = (r0 + ROW_BLOCK).min(rows);
        let o0 = bo * ob;
        let o1 = (o0 + ob).min(out);
        // Rebinding makes the closure capture the whole `OutPtr` (which is Send), not its raw
        // pointer field alone (edition 2021 captures disjoint fields).
        #[allow(clippy::redundant_locals)]
        let yp = yp;
        // SAFETY: every task owns rows r0..r1 × outputs o0..o1 of y ([rows, out], row stride
        // `out`); the rectangles of distinct tasks are disjoint and inside y.
        unsafe { block(isa, x, inp, w, out, r0..r1, o0..o1, yp.0) };
    });
}

/// One task's rectangle.
///
/// SAFETY (callers): `y` points at `[rows, out]` f32 with rows ⊇ `rr`, and no other thread writes
/// `rr × or`.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    isa: Isa,
    x: &[f32],
    inp: usize,
    w: WeightView<'_>,
    out: usize,
    rr: std::ops::Range<usize>,
    or: std::ops::Range<usize>,
    y: *mut f32,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        match w {
            WeightView::F32 { data, .. } => {
                avx512::block(x, inp, avx512::WF32(data.as_ptr()), out, rr, or, y)
            }
            WeightView::Bf16 { data, .. } => {
                avx512::block(x, inp, avx512::WBf16(data.as_ptr()), out, rr, or, y)
            }
            WeightView::Fp8 {
                codes,
                folded,
                cols,
                row0,
            } => avx512::block(
                x,
                inp,
                avx512::WFp8 {
                    codes: codes.as_ptr(),
                    folded: folded.as_ptr(),
                    bc: cols.div_ceil(FP8_BLOCK),
                    row0,
                },
                out,
                rr,
                or,
                y,
            ),
        }
        return;
    }
    let _ = isa;
    for r in rr {
        let xr = &x[r * inp..(r + 1) * inp];
        for o in or.clone() {
            *y.add(r * out + o) = portable_dot(xr, &w, o);
        }
    }
}

/// The portable element: 16 lane sums in increasing column order (multiply, then add), the ragged
/// tail in the low lanes, then a fixed pairwise sum of the lanes.
#[allow(clippy::needless_range_loop)] // j is the lane: it indexes acc, x and the weight row alike
fn portable_dot(x: &[f32], w: &WeightView<'_>, o: usize) -> f32 {
    let inp = x.len();
    let mut acc = [0f32; 16];
    let full = inp / 16 * 16;
    let mut k = 0;
    match *w {
        WeightView::F32 { data, cols } => {
            let wr = &data[o * cols..(o + 1) * cols];
            while k < full {
                for j in 0..16 {
                    acc[j] += x[k + j] * wr[k + j];
                }
                k += 16;
            }
        }
        _ => {
            while k < full {
                for j in 0..16 {
                    acc[j] += x[k + j] * w.get(o, k + j);
                }
                k += 16;
            }
        }
    }
    for j in 0..inp - full {
        acc[j] += x[full + j] * w.get(o, full + j);
    }
    hsum16(&acc)
}

/// Fixed pairwise sum of 16 lanes: (l, l + 8), then (l, l + 4), (l, l + 2), (l, l + 1).
#[allow(clippy::needless_range_loop)] // v[j] += v[j + n]: two lanes per step
#[inline]
fn hsum16(a: &[f32; 16]) -> f32 {
    let mut v = *a;
    let mut n = 8;
    while n > 0 {
        for j in 0..n {
            v[j] += v[j + n];
        }
        n /= 2;
    }
    v[0]
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// 16 weights of row `o`, columns `k .. k + 16` (`k` a multiple of 16), as f32.
    pub trait Load: Copy {
        /// SAFETY (callers): AVX-512F present; `k + 16 ≤ cols`, `o` inside the view.
        unsafe fn load(self, o: usize, k: usize, cols: usize) -> __m512;
        /// The same with only the first `n < 16` columns, the other lanes zero.
        /// SAFETY (callers): as `load` with `k + n ≤ cols`.
        unsafe fn load_tail(self, o: usize, k: usize, n: usize, cols: usize) -> __m512;
    }

    #[derive(Clone, Copy)]
    pub struct WF32(pub *const f32);
    #[derive(Clone, Copy)]
    pub struct WBf16(pub *const u16);
    #[derive(Clone, Copy)]
    pub struct WFp8 {
        pub codes: *const u8,
        pub folded: *const f32,
        pub bc: usize,
        pub row0: usize,
    }

    impl Load for WF32 {
        #[inline(always)]
        unsafe fn load(self, o: usize, k: usize, cols: usize) -> __m512 {
            _mm512_loadu_ps(self.0.add(o * cols + k))
        }
        #[inline(always)]
        unsafe fn load_tail(self, o: usize, k: usize, n: usize, cols: usize) -> __m512 {
            _mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, self.0.add(o * cols + k))
        }
    }

    impl Load for WBf16 {
        #[inline(always)]
        unsafe fn load(self, o: usize, k: usize, cols: usize) -> __m512 {
            let b = _mm256_loadu_si256(self.0.add(o * cols + k) as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(b)))
        }
        #[inline(always)]
        unsafe fn load_tail(self, o: usize, k: usize, n: usize, cols: usize) -> __m512 {
            let mut t = [0u16; 16];
            std::ptr::copy_nonoverlapping(self.0.add(o * cols + k), t.as_mut_ptr(), n);
            let b = _mm256_loadu_si256(t.as_ptr() as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(b)))
        }
    }

    impl WFp8 {
        #[inline(always)]
        unsafe fn widen(self, c: __m128i, o: usize, k: usize) -> __m512 {
            // Sign-extended code << 20: bit 31 = sign, bits 26..20 = the 7 magnitude bits; the
            // copies of the sign in bits 30..27 are cleared. Read as f32 that is E4M3 · 2^-120.
            let v = _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(c));
            let v = _mm512_and_si512(v, _mm512_set1_epi32(0x87F0_0000u32 as i32));
            let s = *self
                .folded
                .add((self.row0 + o) / super::FP8_BLOCK * self.bc + k / super::FP8_BLOCK);
            _mm512_mul_ps(_mm512_castsi512_ps(v), _mm512_set1_ps(s))
        }
    }

    impl Load for WFp8 {
        #[inline(always)]
        unsafe fn load(self, o: usize, k: usize, cols: usize) -> __m512 {
            let c = _mm_loadu_si128(self.codes.add(o * cols + k) as *const __m128i);
            self.widen(c, o, k)
        }
        #[inline(always)]
        unsafe fn load_tail(self, o: usize, k: usize, n: usize, cols: usize) -> __m512 {
            let mut t = [0u8; 16];
            std::ptr::copy_nonoverlapping(self.codes.add(o * cols + k), t.as_mut_ptr(), n);
            self.widen(_mm_loadu_si128(t.as_ptr() as *const __m128i), o, k)
        }
    }

    /// Columns per pass over a row block (x tile 8 × 512 f32 = 16 KiB, L1) when the block has
    /// more than 4 rows; a multiple of 16, so only the last pass has a ragged tail.
    const KC: usize = 512;
    /// Outputs per panel: the panel's weights for one pass (≤ 64 × 512 values) stay in L2 while
    /// every row tile of the block runs over them.
    const PANEL: usize = 64;

    /// A task's rectangle: output panels of [`PANEL`]; per panel, passes of [`KC`] columns (all
    /// columns at once for ≤ 4 rows: decode streams each weight row once); per pass, row tiles of
    /// 8 (the ragged end in one smaller tile) against output tiles of 2 (8 for a single row, 4
    /// for 2–4 rows), ragged outputs one at a time. Between passes the 16-lane accumulators wait
    /// in `acc` unreduced, so every element still sees one FMA per lane and column in increasing
    /// column order and one final reduction: the passes change the memory traffic, not the sums.
    ///
    /// SAFETY (callers): AVX-512F present; `x` is `[rows ⊇ rr, inp]`, `w` `[out ⊇ or, inp]`, `y`
    /// `[rows, out]` with `rr × or` written by this call only.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn block<W: Load>(
        x: &[f32],
        inp: usize,
        w: W,
        out: usize,
        rr: std::ops::Range<usize>,
        or: std::ops::Range<usize>,
        y: *mut f32,
    ) {
        let kc = if rr.len() <= 4 { inp } else { KC };
        let mut acc = if kc < inp {
            vec![0f32; rr.len() * PANEL * 16]
        } else {
            vec![]
        };
        let mut p0 = or.start;
        while p0 < or.end {
            let p1 = (p0 + PANEL).min(or.end);
            let mut k0 = 0;
            while k0 < inp {
                let k1 = (k0 + kc).min(inp);
                let pass = Pass {
                    k0,
                    k1,
                    first: k0 == 0,
                    last: k1 == inp,
                    r0: rr.start,
                    p0,
                    acc: acc.as_mut_ptr(),
                };
                let mut r = rr.start;
                while r < rr.end {
                    let mr = (rr.end - r).min(8);
                    match mr {
                        8 => cols_of::<8, 2, W>(x, inp, w, out, r, p0..p1, &pass, y),
                        7 => cols_of::<7, 2, W>(x, inp, w, out, r, p0..p1, &pass, y),
                        6 => cols_of::<6, 2, W>(x, inp, w, out, r, p0..p1, &pass, y),
                        5 => cols_of::<5, 2, W>(x, inp, w, out, r, p0..p1, &pass, y),
                        4 => cols_of::<4, 4, W>(x, inp, w, out, r, p0..p1, &pass, y),
                        3 => cols_of::<3, 4, W>(x, inp, w, out, r, p0..p1, &pass, y),
                        2 => cols_of::<2, 4, W>(x, inp, w, out, r, p0..p1, &pass, y),
                        _ => cols_of::<1, 8, W>(x, inp, w, out, r, p0..p1, &pass, y),
                    }
                    r += mr;
                }
                k0 = k1;
            }
            p0 = p1;
        }
    }

    /// One pass: columns `k0..k1`; whether it starts the sums and whether it ends them; the
    /// unreduced accumulators `[rows of the block][PANEL][16]` of the panel starting at `p0`.
    struct Pass {
        k0: usize,
        k1: usize,
        first: bool,
        last: bool,
        r0: usize,
        p0: usize,
        acc: *mut f32,
    }

    /// `MR` rows from `r` against every output of `or`, `NR` at a time, then the ragged outputs.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn cols_of<const MR: usize, const NR: usize, W: Load>(
        x: &[f32],
        inp: usize,
        w: W,
        out: usize,
        r: usize,
        or: std::ops::Range<usize>,
        pass: &Pass,
        y: *mut f32,
    ) {
        let mut o = or.start;
        while o + NR <= or.end {
            tile::<MR, NR, W>(x, inp, w, out, r, o, pass, y);
            o += NR;
        }
        while o < or.end {
            tile::<MR, 1, W>(x, inp, w, out, r, o, pass, y);
            o += 1;
        }
    }

    /// The micro-kernel: `MR × NR` accumulators of 16 lanes over the pass's columns, one FMA per
    /// lane and column, then (last pass) one `_mm512_reduce_add_ps` per element. The sequence for
    /// each element is the same for every `MR`, `NR` and pass split (the batch-invariance
    /// contract).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn tile<const MR: usize, const NR: usize, W: Load>(
        x: &[f32],
        inp: usize,
        w: W,
        out: usize,
        r: usize,
        o: usize,
        pass: &Pass,
        y: *mut f32,
    ) {
        let xp = x.as_ptr().add(r * inp);
        // SAFETY (slot): (row − r0) < rows of the block and (o + j − p0) < PANEL, inside `acc`.
        let slot = |i: usize, j: usize| {
            pass.acc
                .add((((r + i - pass.r0) * PANEL) + (o + j - pass.p0)) * 16)
        };
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        if !pass.first {
            for (i, a) in acc.iter_mut().enumerate() {
                for (j, aj) in a.iter_mut().enumerate() {
                    *aj = _mm512_loadu_ps(slot(i, j));
                }
            }
        }
        let full = pass.k0 + (pass.k1 - pass.k0) / 16 * 16;
        let mut k = pass.k0;
        while k < full {
            let mut wv = [_mm512_setzero_ps(); NR];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = w.load(o + j, k, inp);
            }
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(xp.add(i * inp + k));
                for (aj, wj) in a.iter_mut().zip(&wv) {
                    *aj = _mm512_fmadd_ps(xv, *wj, *aj);
                }
            }
            k += 16;
        }
        let n = pass.k1 - full;
        if n > 0 {
            let m = ((1u32 << n) - 1) as __mmask16;
            let mut wv = [_mm512_setzero_ps(); NR];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = w.load_tail(o + j, k, n, inp);
            }
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(m, xp.add(i * inp + k));
                for (aj, wj) in a.iter_mut().zip(&wv) {
                    *aj = _mm512_fmadd_ps(xv, *wj, *aj);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            for (j, aj) in a.iter().enumerate() {
                if pass.last {
                    *y.add((r + i) * out + o + j) = _mm512_reduce_add_ps(*aj);
                } else {
                    _mm512_storeu_ps(slot(i, j), *aj);
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tolerance::{compare, F32_VS_F64};
    use rand::{Rng, SeedableRng};

    fn reference(x: &[f32], rows: usize, w: &WeightView, out: usize, inp: usize) -> Vec<f64> {
        let mut y = vec![0f64; rows * out];
        for r in 0..rows {
            for o in 0..out {
                y[r * out + o] = (0..inp)
                    .map(|k| x[r * inp + k] as f64 * w.get(o, k) as f64)
                    .sum();
            }
        }
        y
    }

    fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    /// Owned weights of every stored dtype for one random `[out, inp]` matrix.
    struct Owned {
        f32: Vec<f32>,
        bf16: Vec<u16>,
        codes: Vec<u8>,
        folded: Vec<f32>,
        cols: usize,
    }

    impl Owned {
        fn new(rng: &mut rand::rngs::StdRng, out: usize, inp: usize) -> Owned {
            let f32 = rand_vec(rng, out * inp);
            let bf16 = f32
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let (codes, s) = crate::weights::synth::quantize_fp8_block(&f32, out, inp);
            let folded = s
                .iter()
                .map(|&b| crate::formats::scalar::e8m0_decode(b) * E4M3_FOLD)
                .collect();
            Owned {
                f32,
                bf16,
                codes,
                folded,
                cols: inp,
            }
        }
        fn views(&self) -> [(&'static str, WeightView<'_>); 3] {
            [
                (
                    "f32",
                    WeightView::F32 {
                        data: &self.f32,
                        cols: self.cols,
                    },
                ),
                (
                    "bf16",
                    WeightView::Bf16 {
                        data: &self.bf16,
                        cols: self.cols,
                    },
                ),
                (
                    "fp8",
                    WeightView::Fp8 {
                        codes: &self.codes,
                        folded: &self.folded,
                        cols: self.cols,
                        row0: 0,
                    },
                ),
            ]
        }
    }

    #[test]
    fn every_dtype_matches_the_f64_reference_on_its_dequantized_weights() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(rows, out, inp) in &[
            (1, 37, 129),
            (3, 64, 512),
            (4, 5, 17),
            (5, 70, 300),
            (33, 129, 1000),
        ] {
            let x = rand_vec(&mut rng, rows * inp);
            let ow = Owned::new(&mut rng, out, inp);
            for (name, w) in ow.views() {
                let mut y = vec![f32::NAN; rows * out];
                linear_w("t", &x, rows, w, out, &mut y).unwrap();
                let r = reference(&x, rows, &w, out, inp);
                // f32 sums of `inp` products: scale the bound by sqrt(inp).
                let tol = crate::tolerance::Tolerance {
                    abs: 1e-6 * (inp as f64).sqrt() * 4.0,
                    ..F32_VS_F64
                };
                let s = compare(&y, &r, &tol);
                assert!(
                    s.violations == 0 && s.special_mismatches == 0,
                    "{name} {rows}x{out}x{inp}: {s:?}"
                );
            }
        }
    }

    /// Batch-dependent bits: steps of 1–4 rows took a GEMV path and larger ones the `gemm`
    /// crate's packed kernels, so a row's bits depended on how many rows shared its call.
    #[test]
    fn a_row_gets_the_same_bits_in_any_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for &(out, inp) in &[(70, 300), (64, 512), (33, 1000), (9, 17)] {
            let rows = 41;
            let x = rand_vec(&mut rng, rows * inp);
            let ow = Owned::new(&mut rng, out, inp);
            for (name, w) in ow.views() {
                let mut all = vec![0f32; rows * out];
                linear_w("t", &x, rows, w, out, &mut all).unwrap();
                // Every split of the rows into consecutive calls of 1..=rows rows.
                for step in [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 40] {
                    let mut r0 = 0;
                    while r0 < rows {
                        let n = step.min(rows - r0);
                        let mut part = vec![0f32; n * out];
                        linear_w("t", &x[r0 * inp..(r0 + n) * inp], n, w, out, &mut part).unwrap();
                        for (i, (a, b)) in part.iter().zip(&all[r0 * out..]).enumerate() {
                            assert!(
                                a.to_bits() == b.to_bits(),
                                "{name} [{out}, {inp}] rows {r0}..{} by {step}: element {i} {a} vs {b}",
                                r0 + n
                            );
                        }
                        r0 += n;
                    }
                }
                // A different thread count splits the work differently; same bits.
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(3)
                    .build()
                    .unwrap();
                let mut three = vec![0f32; rows * out];
                pool.install(|| linear_w("t", &x, rows, w, out, &mut three))
                    .unwrap();
                assert!(
                    three
                        .iter()
                        .zip(&all)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name} threads"
                );
            }
        }
    }

    #[test]
    fn fp8_widening_is_the_loaders_dequantized_value() {
        use crate::formats::scalar::e4m3_decode;
        for c in 0..=255u8 {
            if c & 0x7F == 0x7F {
                continue;
            }
            for s in [1.0f32, 2f32.powi(-12), 2f32.powi(7), 2f32.powi(-126), 0.3] {
                let want = e4m3_decode(c) * s;
                let got = e4m3_scaled(c, s * E4M3_FOLD);
                assert_eq!(got.to_bits(), want.to_bits(), "code {c:#x} scale {s}");
            }
        }
    }

    #[test]
    fn row_blocks_of_fp8_keep_their_scales() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (out, inp) = (96, 64);
        let ow = Owned::new(&mut rng, out, inp);
        let [_, _, (_, w)] = ow.views();
        let b = w.row_block(32, 64).unwrap();
        for o in 0..64 {
            for k in 0..inp {
                assert_eq!(b.get(o, k).to_bits(), w.get(o + 32, k).to_bits());
            }
        }
        assert!(w
            .row_block(16, 32)
            .unwrap_err()
            .to_string()
            .contains("multiple of 32"));
        assert!(w.row_block(64, 64).is_err());
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
