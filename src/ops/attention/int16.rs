//! NVFP4 keys' scores on int16 dot products (`vpdpwssd`, AVX-512 VNNI):
//! [`super::AttentionDots::Int16`].
//!
//! An NVFP4-DS row is 32 blocks of 16 E2M1 codes times one E4M3 scale per block. Twice an E2M1
//! value is an integer in [−12, 12], so a block's dot product with an integer query is an exact
//! int32 sum: the query row of each head is quantised once per token to int16,
//! `qi = round(x · 32767 / max|x|)` with `x = scale · q` (absolute error ≤ 2^−16 of the row's
//! largest |x|, the same order as the bf16 hi + lo split's 2^−17 relative), and
//! `z = (max|x| / 32767) · Σ_b (s_b / 2) · Σ_{d ∈ b} qi_d · (2 e_d)`, the inner sum exact in
//! int32 (|sum| ≤ 16 · 32767 · 12 < 2^23, so also exact as f32), one f32 multiply-add per block.
//! That is one `vpdpwssd` pass over the 512 dims where the bf16 split needs two `vdpbf16ps`
//! passes (hi and lo). The MXFP8 window rows (E4M3 values are not int16-exact) and the P·V GEMM
//! stay on bf16 ([`super::bf16`]).
//!
//! Layouts: the quantised query as int16 pairs (256, hp, 2) — dims 2i and 2i + 1 of a head side
//! by side, heads along the lanes — and a key row as 512 int16 codes (one 32-bit broadcast is a
//! dim pair) with its 32 block scales in f32. A row's score depends only on the row and the
//! query (fixed block order), never on the batch or the thread count.

use super::KvRows;
use crate::formats::scalar::e4m3_decode;
use crate::formats::{RecordFormat, KV_DIM};

/// Dims per NVFP4 scale block.
pub(super) const BLOCK: usize = 16;
/// Scale blocks per row.
pub(super) const BLOCKS: usize = KV_DIM / BLOCK;

/// Whether this CPU has the units of the int16 path (VNNI for the keys, BF16 for the rest).
pub(super) fn supported() -> bool {
    let u = crate::isa::cpu().dots;
    u.vnni && u.bf16
}

/// Whether `kv`'s rows are NVFP4-DS records (the rows the int16 kernel scores).
pub(super) fn is_nvfp4(kv: &KvRows) -> bool {
    match kv {
        KvRows::Records(f, _) => *f == RecordFormat::Nvfp4Ds,
        KvRows::Pool(p) => p.desc().format == RecordFormat::Nvfp4Ds,
        KvRows::F32(_) => false,
    }
}

/// (E2M1 codes, E4M3 scales) of NVFP4 row `i` of `kv` ([`is_nvfp4`] holds).
#[inline]
pub(super) fn parts<'a>(kv: &KvRows<'a>, i: usize) -> (&'a [u8], &'a [u8]) {
    match *kv {
        KvRows::Records(f, b) => {
            b[i * f.record_bytes()..][..f.record_bytes()].split_at(f.data_bytes())
        }
        KvRows::Pool(p) => p.parts(i),
        KvRows::F32(_) => unreachable!("the int16 kernel only reads NVFP4 rows"),
    }
}

/// A key row's block scales: `ks[b] = E4M3(scale[b]) / 2` (the codes are twice the E2M1 values;
/// halving an E4M3 value is exact in f32).
#[inline]
pub(super) fn block_scales(scale: &[u8], ks: &mut [f32]) {
    for (d, &b) in ks[..BLOCKS].iter_mut().zip(&scale[..BLOCKS]) {
        *d = e4m3_decode(b) * 0.5;
    }
}

/// Per head, the int16 quantisation of `x = scale · q[h]`: (`pre`, `c`, `s`) with
/// `qi = round((x · pre) · c)` and the int32 sums taken back by `s`; `c` and `s` are 0 for an
/// all-zero row. A row whose largest |x| is below 2^−100 is first scaled by `pre` = 2^100 (exact),
/// so that `c` = 32767 / max|x · pre| stays finite (else `pre` = 1).
pub(super) fn head_factors(x_max: f32) -> (f32, f32, f32) {
    if x_max == 0.0 {
        return (1.0, 0.0, 0.0);
    }
    let pre = if x_max < f32::powi(2.0, -100) {
        f32::powi(2.0, 100)
    } else {
        1.0
    };
    let m = x_max * pre;
    (pre, 32767.0 / m, (m / 32767.0) / pre)
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::*;
    use crate::ops::attention::bf16::KBS;
    use std::arch::x86_64::*;

    /// `acc += vpdpwssd(a, b)` as one instruction: LLVM's machine combiner otherwise splits a
    /// chain of `_mm512_dpwssd_epi32` into `vpmaddwd` + `vpaddd` pairs (two instructions per 32
    /// MACs) on targets it does not tune for VNNI.
    macro_rules! dpwssd {
        ($acc:expr, $a:expr, $b:expr) => {
            // SAFETY: register-only AVX-512 VNNI instruction; the caller enables the feature.
            unsafe {
                std::arch::asm!(
                    "vpdpwssd {acc}, {a}, {b}",
                    acc = inout(zmm_reg) $acc,
                    a = in(zmm_reg) $a,
                    b = in(zmm_reg) $b,
                    options(pure, nomem, nostack, preserves_flags)
                )
            }
        };
    }

    /// Quantised Qᵀ pairs: with `x = scale · q[h][2i + e]`, `qi[(i · hp + h) · 2 + e] =
    /// round(x · c_h)` and `qs[h] = 1 / c_h` ([`head_factors`]); padded heads 0.
    ///
    /// Per block of 16 heads × 32 dims, each head's 16 pairs fill one vector, and a 16 × 16
    /// transpose of 32-bit lanes turns them into 16 vectors of one pair × 16 heads.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(in super::super) unsafe fn query_i16(
        q: &[f32],
        h: usize,
        hp: usize,
        scale: f32,
        qi: &mut [u16],
        qs: &mut [f32],
    ) {
        assert!(q.len() == h * KV_DIM && qi.len() == KV_DIM * hp && hp.is_multiple_of(16));
        assert!(h <= hp && qs.len() == hp);
        let sc = _mm512_set1_ps(scale);
        // (pre, c) per head.
        let mut cs = vec![(1f32, 0f32); hp];
        for (k, (c, s)) in cs.iter_mut().zip(qs.iter_mut()).enumerate() {
            if k >= h {
                *s = 0.0;
                continue;
            }
            let mut m = _mm512_setzero_ps();
            for d in (0..KV_DIM).step_by(16) {
                // SAFETY: head k < h, d + 16 ≤ 512.
                let v = unsafe { _mm512_loadu_ps(q.as_ptr().add(k * KV_DIM + d)) };
                m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_mul_ps(v, sc)));
            }
            let (pre, cq, sq) = head_factors(_mm512_reduce_max_ps(m));
            (*c, *s) = ((pre, cq), sq);
        }
        let zero = _mm512_setzero_si512();
        for h0 in (0..hp).step_by(16) {
            for d0 in (0..KV_DIM).step_by(32) {
                let mut w = [zero; 16];
                for k in 0..16.min(h.saturating_sub(h0)) {
                    let (pre, c) = (_mm512_set1_ps(cs[h0 + k].0), _mm512_set1_ps(cs[h0 + k].1));
                    let sc = _mm512_mul_ps(sc, pre);
                    // SAFETY: head h0 + k < h, d0 + 32 ≤ 512.
                    unsafe {
                        let p = q.as_ptr().add((h0 + k) * KV_DIM + d0);
                        // (x · c rounds once more in f32; |x · c| ≤ 32767 (1 + 2^−23) rounds to
                        // at most 32767, and the conversion saturates regardless.)
                        let a = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(p), sc), c);
                        let b = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(p.add(16)), sc), c);
                        let a = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(a));
                        let b = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(b));
                        // 32-bit lane m: dims d0 + 2m, d0 + 2m + 1.
                        w[k] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
                    }
                }
                let w = super::super::bf16::x86::transpose16(w);
                for (m, v) in w.iter().enumerate() {
                    let i = d0 / 2 + m;
                    // SAFETY: i < 256 and h0 + 16 ≤ hp.
                    unsafe {
                        let base = qi.as_mut_ptr() as *mut u32;
                        _mm512_storeu_si512(base.add(i * hp + h0) as *mut _, *v);
                    }
                }
            }
        }
    }

    /// One NVFP4 row's codes as int16 (twice the E2M1 values, dim order) into `kb` (512) and its
    /// block scales into `ks` (32, [`block_scales`]).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(in super::super) unsafe fn key_row(
        data: &[u8],
        scale: &[u8],
        kb: &mut [u16],
        ks: &mut [f32],
    ) {
        assert!(data.len() >= KV_DIM / 2 && kb.len() >= KV_DIM);
        block_scales(scale, ks);
        for c in 0..KV_DIM / 32 {
            // SAFETY: 32 u16 at 32c < 512.
            unsafe {
                let v = codes32(data, c);
                _mm512_storeu_si512(kb.as_mut_ptr().add(32 * c) as *mut _, v);
            }
        }
    }

    /// Dims 32c .. 32c + 32 of an NVFP4 row's data as int16 codes (twice the E2M1 values).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn codes32(data: &[u8], c: usize) -> __m512i {
        assert!(16 * c + 16 <= data.len());
        // 2 · E2M1 by code: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the negatives.
        let table = _mm256_setr_epi8(
            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8, 12, 0,
            -1, -2, -3, -4, -6, -8, -12,
        );
        let lo4 = _mm256_set1_epi16(0x000F);
        let hi4 = _mm256_set1_epi16(0x00F0);
        // SAFETY: 16 bytes at 16c, inside `data` (asserted).
        let b = unsafe { _mm_loadu_si128(data.as_ptr().add(16 * c) as *const _) };
        let w = _mm256_cvtepu8_epi16(b);
        // u16 lane i: low byte the even dim's code, high byte the odd dim's.
        let w = _mm256_or_si256(
            _mm256_and_si256(w, lo4),
            _mm256_slli_epi16::<4>(_mm256_and_si256(w, hi4)),
        );
        _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, w))
    }

    /// A pair of NVFP4 rows (`a`, and `b` when present; (data, scale) each) in one pass: their
    /// int16 codes into `kb` (rows 0 and 1, stride [`KBS`]), their halved block scales into `ks`
    /// (32 each), and their values in bf16 (codes × halved scales, exact in f32 and in bf16) as V
    /// row pair `p` of a chunk of `pc` pairs (`vb`, [`super::super::bf16::x86::v_index`]); an
    /// absent `b` is zeros in V. The V values equal those of the f32 decode (up to the sign of
    /// a zero, which no sum of the P·V kernel can show: its accumulators start at +0).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(in super::super) unsafe fn key_value_pair(
        a: (&[u8], &[u8]),
        b: Option<(&[u8], &[u8])>,
        kb: &mut [u16],
        ks: &mut [f32],
        vb: &mut [u16],
        p: usize,
        pc: usize,
    ) {
        use super::super::bf16::x86::v_index;
        let two = b.is_some();
        assert!(kb.len() >= if two { KBS + KV_DIM } else { KV_DIM });
        assert!(ks.len() >= if two { 2 * BLOCKS } else { BLOCKS });
        assert!(p < pc && vb.len() == pc * 2 * KV_DIM && a.0.len() >= KV_DIM / 2);
        block_scales(a.1, ks);
        if let Some(b) = b {
            assert!(b.0.len() >= KV_DIM / 2);
            block_scales(b.1, &mut ks[BLOCKS..]);
        }
        // Interleave the low (row a) and high (row b) halves of a cvtne2ps result.
        let idx: [u16; 32] = std::array::from_fn(|i| ((i % 2) * 16 + i / 2) as u16);
        // SAFETY: reads 32 u16.
        let idx = unsafe { _mm512_loadu_si512(idx.as_ptr() as *const _) };
        let zero = _mm512_setzero_ps();
        let f32s = |v: __m256i, s: f32| {
            _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(v)),
                _mm512_set1_ps(s),
            )
        };
        for c in 0..KV_DIM / 32 {
            // SAFETY: 32c + 32 ≤ 512: inside row 0 (and row 1) of `kb`.
            let va = codes32(a.0, c);
            unsafe { _mm512_storeu_si512(kb.as_mut_ptr().add(32 * c) as *mut _, va) };
            let vbv = match b {
                Some(b) => {
                    let v = codes32(b.0, c);
                    // SAFETY: as above, row 1.
                    unsafe { _mm512_storeu_si512(kb.as_mut_ptr().add(KBS + 32 * c) as *mut _, v) };
                    Some(v)
                }
                None => None,
            };
            for half in 0..2 {
                let blk = 2 * c + half;
                let pick = |v: __m512i| {
                    if half == 0 {
                        _mm512_castsi512_si256(v)
                    } else {
                        _mm512_extracti64x4_epi64::<1>(v)
                    }
                };
                let fa = f32s(pick(va), ks[blk]);
                let fb = match vbv {
                    Some(v) => f32s(pick(v), ks[BLOCKS + blk]),
                    None => zero,
                };
                let v = _mm512_permutexvar_epi16(
                    idx,
                    std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(fb, fa)),
                );
                // SAFETY: v_index(pc, p, d) + 32 ≤ pc · 1024 for d < 512, d a multiple of 16.
                unsafe {
                    _mm512_storeu_si512(
                        vb.as_mut_ptr().add(v_index(pc, p, 32 * c + 16 * half)) as *mut _,
                        v,
                    )
                };
            }
        }
    }

    /// Scores `st` (rows, hp) of `rows` int16 key rows (`kb`, stride [`KBS`]; block scales `ks`,
    /// stride 32) against the quantised Qᵀ pairs (`qi`, per-head factors `qs`): tiles of `R` rows ×
    /// `V` vectors of 16 heads; each 16-dim block's exact int32 sums are scaled into f32
    /// accumulators, blocks in order; the query is streamed in passes of [`DB`] dims (16 KiB of it
    /// for 64 heads, L1), the partial scores kept in `st` between passes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::needless_range_loop)]
    pub(in super::super) unsafe fn scores(
        qi: &[u16],
        qs: &[f32],
        kb: &[u16],
        ks: &[f32],
        rows: usize,
        hp: usize,
        st: &mut [f32],
    ) {
        // 3 rows × 4 vectors: 12 int32 block accumulators + 12 f32 accumulators + 4 query
        // vectors + the broadcasts fill the 32 registers; then the 1-3 vectors of heads left
        // (8 × 1, 6 × 2, 4 × 3). A head's scores do not depend on the tile shape.
        assert!(hp.is_multiple_of(16));
        let full = hp / 64 * 64;
        // SAFETY (each call): same contract; the head ranges are whole tiles inside hp.
        unsafe {
            scores_tiles::<3, 4>(qi, qs, kb, ks, rows, hp, 0..full, st);
            match (hp - full) / 16 {
                1 => scores_tiles::<8, 1>(qi, qs, kb, ks, rows, hp, full..hp, st),
                2 => scores_tiles::<6, 2>(qi, qs, kb, ks, rows, hp, full..hp, st),
                3 => scores_tiles::<4, 3>(qi, qs, kb, ks, rows, hp, full..hp, st),
                _ => {}
            }
        }
    }

    /// Dims of the query per pass of [`scores`].
    const DB: usize = 128;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
    unsafe fn scores_tiles<const R: usize, const V: usize>(
        qi: &[u16],
        qs: &[f32],
        kb: &[u16],
        ks: &[f32],
        rows: usize,
        hp: usize,
        hs: std::ops::Range<usize>,
        st: &mut [f32],
    ) {
        assert!(qi.len() == KV_DIM * hp && qs.len() == hp && st.len() == rows * hp);
        assert!(rows > 0 && kb.len() >= (rows - 1) * KBS + KV_DIM && ks.len() >= rows * BLOCKS);
        assert!(hs.end <= hp && (hs.end - hs.start).is_multiple_of(16 * V));
        let zf = _mm512_setzero_ps();
        let zi = _mm512_setzero_si512();
        let q32 = qi.as_ptr() as *const u32;
        for h0 in hs.step_by(16 * V) {
            // SAFETY: h0 + 16V ≤ hp.
            let sv: [__m512; V] =
                std::array::from_fn(|v| unsafe { _mm512_loadu_ps(qs.as_ptr().add(h0 + 16 * v)) });
            for d0 in (0..KV_DIM).step_by(DB) {
                let last = d0 + DB == KV_DIM;
                for j0 in (0..rows).step_by(R) {
                    let jr: [usize; R] = std::array::from_fn(|r| (j0 + r).min(rows - 1));
                    let mut f = [[zf; V]; R];
                    if d0 > 0 {
                        for r in 0..R {
                            for v in 0..V {
                                // SAFETY: jr[r] < rows, h0 + 16V ≤ hp.
                                f[r][v] = unsafe {
                                    _mm512_loadu_ps(st.as_ptr().add(jr[r] * hp + h0 + 16 * v))
                                };
                            }
                        }
                    }
                    for b in d0 / BLOCK..(d0 + DB) / BLOCK {
                        let mut a = [[zi; V]; R];
                        for i in b * BLOCK / 2..(b + 1) * BLOCK / 2 {
                            // SAFETY: pair i < 256, h0 + 16V ≤ hp.
                            let qv: [__m512i; V] = std::array::from_fn(|v| unsafe {
                                _mm512_loadu_si512(q32.add(i * hp + h0 + 16 * v) as *const _)
                            });
                            for r in 0..R {
                                // SAFETY: jr[r] < rows, 2i + 2 ≤ 512.
                                let k = _mm512_set1_epi32(unsafe {
                                    std::ptr::read_unaligned(
                                        kb.as_ptr().add(jr[r] * KBS + 2 * i) as *const i32
                                    )
                                });
                                for v in 0..V {
                                    dpwssd!(a[r][v], k, qv[v]);
                                }
                            }
                        }
                        for r in 0..R {
                            // SAFETY: jr[r] < rows, b < 32.
                            let s =
                                _mm512_set1_ps(unsafe { *ks.get_unchecked(jr[r] * BLOCKS + b) });
                            for v in 0..V {
                                f[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][v]), s, f[r][v]);
                            }
                        }
                    }
                    for r in 0..R.min(rows - j0) {
                        for v in 0..V {
                            let x = if last {
                                _mm512_mul_ps(f[r][v], sv[v])
                            } else {
                                f[r][v]
                            };
                            // SAFETY: j0 + r < rows, h0 + 16V ≤ hp.
                            unsafe {
                                _mm512_storeu_ps(
                                    st.as_mut_ptr().add((j0 + r) * hp + h0 + 16 * v),
                                    x,
                                )
                            };
                        }
                    }
                }
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::formats::{encode_rows, NVFP4_DS_BYTES};
    use csa2_rng::{rand_normal, NewRng, Rng};

    /// The vector quantisation of the query (conversion, saturating pack, 16 × 16 transpose)
    /// against a scalar one, every head count class, and a zero head and a tiny head.
    #[test]
    fn query_i16_is_the_scalar_quantisation() {
        if !supported() {
            return;
        }
        let mut rng = Rng::new(5);
        for h in [1usize, 5, 16, 64, 72] {
            let hp = h.div_ceil(16) * 16;
            let mut q = rand_normal(&mut rng, h * KV_DIM, 3.0);
            if h >= 5 {
                q[KV_DIM..2 * KV_DIM].fill(0.0);
                q[2 * KV_DIM..3 * KV_DIM]
                    .iter_mut()
                    .for_each(|v| *v *= 1e-38);
            }
            let scale = 0.044;
            let mut qi = vec![0xFFFFu16; KV_DIM * hp];
            let mut qs = vec![f32::NAN; hp];
            // SAFETY: `supported()` checked; lengths as asserted.
            unsafe { x86::query_i16(&q, h, hp, scale, &mut qi, &mut qs) };
            for hh in 0..hp {
                let (pre, c, s) = if hh < h {
                    let m = q[hh * KV_DIM..][..KV_DIM]
                        .iter()
                        .fold(0f32, |a, &v| a.max((v * scale).abs()));
                    head_factors(m)
                } else {
                    (1.0, 0.0, 0.0)
                };
                assert_eq!(qs[hh].to_bits(), s.to_bits(), "h {h} head {hh}");
                for d in 0..KV_DIM {
                    let want = if hh < h {
                        ((q[hh * KV_DIM + d] * (scale * pre)) * c).round_ties_even() as i16
                    } else {
                        0
                    };
                    let got = qi[((d / 2) * hp + hh) * 2 + d % 2] as i16;
                    assert_eq!(got, want, "h {h} head {hh} dim {d}");
                }
                if hh < h && c != 0.0 {
                    let m = (0..KV_DIM)
                        .map(|d| (qi[((d / 2) * hp + hh) * 2 + d % 2] as i16).unsigned_abs())
                        .max()
                        .unwrap();
                    assert_eq!(m, 32767, "h {h} head {hh}: the row max maps to 32767");
                }
            }
        }
    }

    /// The int16 codes and halved scales of a row, against the scalar decode: code · scale = the
    /// decoded value, every code of the E2M1 table.
    #[test]
    fn key_row_codes_times_scales_are_the_decoded_row() {
        if !supported() {
            return;
        }
        let mut rng = Rng::new(6);
        let mut x = rand_normal(&mut rng, 4 * KV_DIM, 2.0);
        x[..16].copy_from_slice(&[
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ]);
        let mut rec = vec![0u8; 4 * NVFP4_DS_BYTES];
        encode_rows(RecordFormat::Nvfp4Ds, &x, &mut rec).unwrap();
        for r in rec.chunks_exact(NVFP4_DS_BYTES) {
            let (d, s) = r.split_at(256);
            let mut want = vec![0f32; KV_DIM];
            RecordFormat::Nvfp4Ds.decode_row(d, s, &mut want);
            let mut kb = vec![0u16; KV_DIM];
            let mut ks = vec![0f32; BLOCKS];
            // SAFETY: `supported()` checked; lengths as asserted.
            unsafe { x86::key_row(d, s, &mut kb, &mut ks) };
            for (i, &w) in want.iter().enumerate() {
                let got = (kb[i] as i16) as f32 * ks[i / BLOCK];
                assert_eq!(got, w, "dim {i}");
            }
        }
    }
}
