#![allow(dead_code, missing_docs, clippy::all)]
//! DEV ONLY: the pre-session path, for in-process A/B.
// Attention on bf16 dot products (`vdpbf16ps`, AVX-512 BF16) with f32 accumulation and the
// softmax in f32: [`super::AttentionDots::Bf16`].
//
// The steps are those of the f32 path ([`super::cpu`]); what changes is the operand precision of
// the two GEMMs. NVFP4 (E2M1 × E4M3) and MXFP8 (E4M3 × 2^e) row values have at most 6 significant
// bits and are exact in bf16 (8), so K and V lose nothing, and every product of two bf16 values
// is exact in f32. The query (with the softmax scale folded in) is split into two bf16 halves,
// `q ≈ hi + lo` with `hi = bf16(q)` and `lo = bf16(q − hi)` (the difference is exact in f32), and
// both halves are dotted with each key pair into the same accumulator: the query then carries
// 16 significant bits (relative error ≤ 2^−17) instead of 8. Rounding q to one bf16 moved each
// logit by about 2^−9/√3 · ‖q ⊙ k‖ (≈ 1e-3 for unit-variance q and k at 512 dims), which on a
// single head with sharp logits (σ = 4) put the output at 1 − cos = 2.6e-5, past the table's
// bound; with the split the logit error is ~2^−8 of that, below the f32 path's own summation
// error. The score GEMM does twice the `vdpbf16ps` of a single-bf16 query (the P·V GEMM is
// unchanged). The softmax weights P are rounded to bf16 (RNE, relative error ≤ 2^−9), each
// weight's error entering the output once, not exponentiated; the tolerance table's
// [`crate::tolerance::BF16_DOTS_VS_F64`] bounds the result against the f64 reference.
//
// `vdpbf16ps` treats inputs below 2^−126 as zero and flushes subnormal results (Intel SDM): a
// softmax weight below 2^−126 counts as 0, which changes an output by less than 2^−126 · |v|.
//
// Layouts (bf16 bit patterns in `u16`): Qᵀ as (256, 2, hp, 2): for dim pair i, the hi halves
// then the lo halves, dims 2i and 2i + 1 of a head side by side; K as plain rows (n, 512), so one 32-bit broadcast is a dim pair; V as row pairs
// (n/2, 512, 2), rows 2r and 2r + 1 of a dim side by side; P as (n/2, hp, 2) likewise. The
// per-row reduction order depends only on the row's position in the token's row list, never on
// the thread count or on other tokens.

use super::cpu::{chunk_softmax, merge_chunks, CHUNK, HEAD_PAD, KS, SLICE};
use super::{int16_legacy as int16, KvRows, TokenRows};
use crate::formats::KV_DIM;
use std::cell::RefCell;

/// One score task: ((its bf16 K rows, (its V row pairs, its rows of Sᵀ)), (its chunk max, its
/// chunk sum)).
type ScoreChunk16<'a> = (
    usize,
    (
        (&'a mut [u16], (&'a mut [u16], &'a mut [f32])),
        (&'a mut [f32], &'a mut [f32]),
    ),
);

thread_local! {
    static SCRATCH16: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// bf16 scratch (u16) of one token: Qᵀ (hi and lo halves), K rows, V row pairs, P row pairs.
fn scratch16_len(n: usize, hp: usize) -> usize {
    let n2 = n.div_ceil(2) * 2;
    2 * KV_DIM * hp + n2 * KV_DIM + n2 * KV_DIM + n2 * hp
}

/// Whether this CPU runs the bf16 path.
pub(super) fn supported() -> bool {
    crate::isa::cpu().dots.bf16
}

/// One token on bf16 dots; same contract as the f32 path's `token` (`buf` is its f32 scratch).
/// With `int16` (and the CPU's VNNI, [`super::int16::supported`]), NVFP4 main rows are scored on
/// int16 dots ([`super::int16`]) and only the other rows on the bf16 split query.
#[allow(clippy::too_many_arguments)]
pub(super) fn token(
    scale: f32,
    q: &[f32],
    sink: &[f32],
    r: &TokenRows,
    kv: &(KvRows, KvRows),
    out: &mut [f32],
    lse: &mut [f32],
    par: bool,
    buf: &mut [f32],
    int16: bool,
) {
    assert!(supported(), "bf16 attention needs AVX-512 BF16");
    let h = lse.len();
    let n = r.main.len() + r.swa.len();
    if n == 0 {
        out.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        return;
    }
    let hp = h.div_ceil(HEAD_PAD) * HEAD_PAD;
    let n2 = n.div_ceil(2) * 2;
    let nc = n.div_ceil(CHUNK);
    // Rows 0 .. ni (the main rows, listed first) take the int16 kernel. Its per-head factors live
    // in the f32 path's row-tile region of `buf`, unused here (n · KS floats; a head count past
    // 496 per row would not fit, and those tokens stay on bf16).
    let ni = if int16 && int16::supported() && int16::is_nvfp4(&kv.0) && hp <= n * KS {
        r.main.len()
    } else {
        0
    };
    let mut local = Vec::new();
    SCRATCH16.with(|c| {
        let mut guard = c.try_borrow_mut();
        let b16: &mut Vec<u16> = match guard.as_deref_mut() {
            Ok(v) => v,
            Err(_) => &mut local,
        };
        let need = scratch16_len(n, hp);
        if b16.len() < need {
            b16.resize(need, 0);
        }
        let (qt, rest) = b16[..need].split_at_mut(2 * KV_DIM * hp);
        let (kb, rest) = rest.split_at_mut(n2 * KV_DIM);
        let (vb, pb) = rest.split_at_mut(n2 * KV_DIM);
        // (The f32 path's row tile and Qᵀ regions of `buf` are unused here: rows are decoded
        // pairwise into a stack buffer, Qᵀ lives in the bf16 scratch; the int16 query's head
        // factors take the start of the row tile.)
        let (tile, rest) = buf.split_at_mut(n * KS);
        let qs = &mut tile[..hp.min(n * KS)];
        let (st, rest) = rest.split_at_mut(n * hp);
        let (_, rest) = rest.split_at_mut(KV_DIM * hp);
        let (mx, rest) = rest.split_at_mut(nc * hp);
        let (sm, ot) = rest.split_at_mut(nc * hp);
        // The int16 query (256 pairs × hp × 2) takes the first half of the bf16 split's region
        // when every row is an int16 row, else its own space.
        let mut qi_own = Vec::new();
        let (qt, qi): (&mut [u16], &mut [u16]) = if ni == 0 {
            (qt, &mut [])
        } else if ni == n {
            let (a, b) = qt.split_at_mut(KV_DIM * hp);
            (b, a)
        } else {
            qi_own.resize(KV_DIM * hp, 0u16);
            (qt, &mut qi_own[..])
        };
        // SAFETY (every call below): `supported()` was asserted (and `int16::supported()` where
        // ni > 0); the slices have the lengths the kernels assert.
        if ni < n {
            unsafe { x86::query_pairs(q, h, hp, scale, qt) };
        }
        if ni > 0 {
            unsafe { int16::x86::query_i16(q, h, hp, scale, qi, qs) };
        }
        let (qt, qi, qs) = (&*qt, &*qi, &*qs);
        let isa = crate::isa::level();
        let score = |(c, ((kb16, (vb16, s)), (m, e))): ScoreChunk16| {
            let rows = s.len() / hp;
            let r0 = c * CHUNK;
            // This chunk's int16 rows: its first `ci`.
            let ci = ni.saturating_sub(r0).min(rows);
            let mut ks = [0f32; CHUNK * int16::BLOCKS];
            // Two rows at a time: decoded to f32 in an L1-resident pair buffer and converted at
            // once to the K rows and the V row pair, so no f32 tile of the chunk (135 KiB, past
            // L1) is written and read back twice. An int16 row's K is its codes, read from the
            // record.
            let mut pair = [0f32; 2 * KS];
            for p in 0..rows.div_ceil(2) {
                let rr = (rows - 2 * p).min(2);
                let two = &mut pair[..rr * KS];
                super::cpu::gather(isa, r, &kv.0, &kv.1, r0 + 2 * p, two);
                let k_from = ci.saturating_sub(2 * p).min(rr);
                for e in 0..k_from {
                    let j = 2 * p + e;
                    let (d, sc) = int16::parts(&kv.0, r.main[r0 + j]);
                    unsafe {
                        int16::x86::key_row(
                            d,
                            sc,
                            &mut kb16[j * KV_DIM..],
                            &mut ks[j * int16::BLOCKS..],
                        )
                    };
                }
                unsafe {
                    x86::rows_to_bf16(
                        two,
                        rr,
                        k_from,
                        &mut kb16[2 * p * KV_DIM..],
                        &mut vb16[2 * p * KV_DIM..],
                    )
                };
            }
            if ci > 0 {
                unsafe {
                    int16::x86::scores(qi, qs, kb16, &ks, ci, hp, &mut s[..ci * hp]);
                }
            }
            if ci < rows {
                unsafe { x86::scores(qt, &kb16[ci * KV_DIM..], rows - ci, hp, &mut s[ci * hp..]) };
            }
            chunk_softmax(s, hp, m, e);
        };
        {
            use rayon::prelude::*;
            let it = kb
                .par_chunks_mut(CHUNK * KV_DIM)
                .zip(
                    vb.par_chunks_mut(CHUNK * KV_DIM)
                        .zip(st.par_chunks_mut(CHUNK * hp)),
                )
                .zip(mx.par_chunks_mut(hp).zip(sm.par_chunks_mut(hp)))
                .enumerate();
            // A prefill token already runs as one rayon task (`par` false): its chunks then run on
            // this thread unless another is idle; the results are the same either way.
            it.for_each(score);
        }
        merge_chunks(mx, sm, sink, h, hp, nc, lse);
        // The chunk rescale is folded into the conversion of P (one pass over Sᵀ instead of two).
        unsafe { x86::p_pairs(st, mx, n, hp, pb) };
        let (vb, pb) = (&*vb, &*pb);
        let pv =
            |(si, o): (usize, &mut [f32])| unsafe { x86::pv(pb, vb, n2, h, hp, si * SLICE, o) };
        {
            use rayon::prelude::*;
            if par {
                ot.par_chunks_mut(h * SLICE).enumerate().for_each(pv);
            } else {
                ot.chunks_mut(h * SLICE).enumerate().for_each(pv);
            }
        }
        for (si, o) in ot.chunks_exact(h * SLICE).enumerate() {
            for (hi, src) in o.chunks_exact(SLICE).enumerate() {
                out[hi * KV_DIM + si * SLICE..][..SLICE].copy_from_slice(src);
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    fn bits(v: __m512bh) -> __m512i {
        // SAFETY: same size, plain bit patterns.
        unsafe { std::mem::transmute(v) }
    }

    #[inline(always)]
    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: same size, plain bit patterns.
        unsafe { std::mem::transmute(v) }
    }

    /// Qᵀ pairs, split: with `x = scale · q[h][2i + e]`, `hi = bf16(x)` (RNE) and
    /// `lo = bf16(x − hi)`, `qt[((2i) · hp + h) · 2 + e] = hi` and `qt[((2i + 1) · hp + h) · 2 + e]
    /// = lo`; padded heads 0.
    ///
    /// Per block of 16 heads × 32 dims, each head's 16 hi (lo) pairs fill one vector, and a 16 × 16
    /// transpose of 32-bit lanes turns them into 16 vectors of one pair × 16 heads, stored whole.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn query_pairs(q: &[f32], h: usize, hp: usize, scale: f32, qt: &mut [u16]) {
        assert!(q.len() == h * KV_DIM && qt.len() == 2 * KV_DIM * hp && hp.is_multiple_of(16));
        assert!(h <= hp);
        let sc = _mm512_set1_ps(scale);
        // bf16 (low / high 16 lanes of a 32-lane vector) → f32: a 16-bit left shift.
        let widen =
            |v: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
        let zero = _mm512_setzero_si512();
        for h0 in (0..hp).step_by(16) {
            for d0 in (0..KV_DIM).step_by(32) {
                let mut hi = [zero; 16];
                let mut lo = [zero; 16];
                for k in 0..16.min(h.saturating_sub(h0)) {
                    // SAFETY: head h0 + k < h, d0 + 32 ≤ 512: inside `q`.
                    unsafe {
                        let p = q.as_ptr().add((h0 + k) * KV_DIM + d0);
                        let a = _mm512_mul_ps(_mm512_loadu_ps(p), sc);
                        let b = _mm512_mul_ps(_mm512_loadu_ps(p.add(16)), sc);
                        // Lanes 2m, 2m + 1 of `hv` are dims d0 + 2m, d0 + 2m + 1: pair m.
                        let hv = bits(_mm512_cvtne2ps_pbh(b, a));
                        let (ha, hb) = (
                            widen(_mm512_castsi512_si256(hv)),
                            widen(_mm512_extracti64x4_epi64::<1>(hv)),
                        );
                        // x − hi is exact in f32.
                        let lv = _mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha));
                        hi[k] = hv;
                        lo[k] = bits(lv);
                    }
                }
                let (hi, lo) = (transpose16(hi), transpose16(lo));
                for m in 0..16 {
                    let i = d0 / 2 + m;
                    // SAFETY: i < 256 and h0 + 16 ≤ hp: rows 2i and 2i + 1 of Qᵀ hold hp pairs.
                    unsafe {
                        let base = qt.as_mut_ptr() as *mut u32;
                        _mm512_storeu_si512(base.add(2 * i * hp + h0) as *mut _, hi[m]);
                        _mm512_storeu_si512(base.add((2 * i + 1) * hp + h0) as *mut _, lo[m]);
                    }
                }
            }
        }
    }

    /// Transpose of a 16 × 16 matrix of 32-bit lanes (`r[i]` lane j → result `[j]` lane i):
    /// 32-bit then 64-bit unpacks inside 128-bit lanes, then two rounds of 128-bit lane shuffles.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::ops::attention) fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        let mut t = [_mm512_setzero_si512(); 16];
        for k in 0..8 {
            t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
            t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
        }
        // u[4m + c], 128-bit lane l: rows 4m..4m + 4 of column 4l + c.
        let mut u = [_mm512_setzero_si512(); 16];
        for m in 0..4 {
            let b = 4 * m;
            u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
            u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
            u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
            u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
        }
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0x44>(u[c], u[4 + c]);
            let v1 = _mm512_shuffle_i32x4::<0xEE>(u[c], u[4 + c]);
            let w0 = _mm512_shuffle_i32x4::<0x44>(u[8 + c], u[12 + c]);
            let w1 = _mm512_shuffle_i32x4::<0xEE>(u[8 + c], u[12 + c]);
            out[c] = _mm512_shuffle_i32x4::<0x88>(v0, w0);
            out[4 + c] = _mm512_shuffle_i32x4::<0xDD>(v0, w0);
            out[8 + c] = _mm512_shuffle_i32x4::<0x88>(v1, w1);
            out[12 + c] = _mm512_shuffle_i32x4::<0xDD>(v1, w1);
        }
        out
    }

    /// f32 rows (`rows` of stride [`KS`]) → bf16 K rows (`kb`, stride 512) from row `k_from` on
    /// (the rows before it are the int16 kernel's, coded by the caller) and V row pairs (`vb`);
    /// an odd last row is paired with zeros.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn rows_to_bf16(
        kf: &[f32],
        rows: usize,
        k_from: usize,
        kb: &mut [u16],
        vb: &mut [u16],
    ) {
        assert!(kf.len() >= rows * KS - (KS - KV_DIM) && kb.len() >= rows * KV_DIM);
        assert!(vb.len() >= rows.div_ceil(2) * 2 * KV_DIM);
        // Interleave the low (row 2r) and high (row 2r + 1) halves of a cvtne2ps result.
        let idx: [u16; 32] = std::array::from_fn(|i| ((i % 2) * 16 + i / 2) as u16);
        // SAFETY: reads 32 u16.
        let idx = unsafe { _mm512_loadu_si512(idx.as_ptr() as *const _) };
        let zero = _mm512_setzero_ps();
        for j in k_from..rows {
            for d in (0..KV_DIM).step_by(32) {
                // SAFETY: j < rows, d + 32 ≤ 512.
                unsafe {
                    let p = kf.as_ptr().add(j * KS + d);
                    let v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p.add(16)), _mm512_loadu_ps(p));
                    _mm512_storeu_si512(kb.as_mut_ptr().add(j * KV_DIM + d) as *mut _, bits(v));
                }
            }
        }
        for r in 0..rows.div_ceil(2) {
            for d in (0..KV_DIM).step_by(16) {
                // SAFETY: row 2r < rows; row 2r + 1 read only when it exists; d + 16 ≤ 512.
                unsafe {
                    let a = _mm512_loadu_ps(kf.as_ptr().add(2 * r * KS + d));
                    let b = if 2 * r + 1 < rows {
                        _mm512_loadu_ps(kf.as_ptr().add((2 * r + 1) * KS + d))
                    } else {
                        zero
                    };
                    let v = _mm512_permutexvar_epi16(idx, bits(_mm512_cvtne2ps_pbh(b, a)));
                    _mm512_storeu_si512(vb.as_mut_ptr().add((r * KV_DIM + d) * 2) as *mut _, v);
                }
            }
        }
    }

    /// Scores `st` (rows, hp) = K · (Qᵀ hi + Qᵀ lo): tiles of 6 rows × 4 vectors of 16 heads, over blocks of
    /// 64 dims (each block's sums added to the stored partial scores, as the f32 path).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::needless_range_loop)]
    pub(super) unsafe fn scores(qt: &[u16], kb: &[u16], rows: usize, hp: usize, st: &mut [f32]) {
        const R: usize = 6;
        const DB: usize = 64;
        assert!(qt.len() == 2 * KV_DIM * hp && kb.len() >= rows * KV_DIM && st.len() == rows * hp);
        assert!(hp.is_multiple_of(64) && rows > 0);
        let zero = _mm512_setzero_ps();
        for h0 in (0..hp).step_by(64) {
            for d0 in (0..KV_DIM).step_by(DB) {
                for j0 in (0..rows).step_by(R) {
                    let jr: [usize; R] = std::array::from_fn(|r| (j0 + r).min(rows - 1));
                    let mut acc = [[zero; 4]; R];
                    // Row i2 of Qᵀ is dim pair i2 / 2's hi (even i2) or lo (odd i2) half; both
                    // meet the same key pair and add into the same accumulators.
                    for i2 in d0..d0 + DB {
                        let i = i2 / 2;
                        // SAFETY: i2 < 512, h0 + 64 ≤ hp.
                        let qv: [__m512bh; 4] = std::array::from_fn(|v| unsafe {
                            bh(_mm512_loadu_si512(
                                qt.as_ptr().add((i2 * hp + h0 + 16 * v) * 2) as *const _,
                            ))
                        });
                        for r in 0..R {
                            // SAFETY: jr[r] < rows, 2i + 2 ≤ 512.
                            let k = bh(_mm512_set1_epi32(unsafe {
                                std::ptr::read_unaligned(
                                    kb.as_ptr().add(jr[r] * KV_DIM + 2 * i) as *const i32
                                )
                            }));
                            for v in 0..4 {
                                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], k, qv[v]);
                            }
                        }
                    }
                    for r in 0..R.min(rows - j0) {
                        for v in 0..4 {
                            // SAFETY: j0 + r < rows, h0 + 64 ≤ hp.
                            unsafe {
                                let p = st.as_mut_ptr().add((j0 + r) * hp + h0 + 16 * v);
                                let a = if d0 > 0 {
                                    _mm512_add_ps(_mm512_loadu_ps(p), acc[r][v])
                                } else {
                                    acc[r][v]
                                };
                                _mm512_storeu_ps(p, a);
                            }
                        }
                    }
                }
            }
        }
    }

    /// P row pairs: `pb[(r · hp + h) · 2 + e] = bf16(st[2r + e][h] · f[(2r + e) / CHUNK][h])`
    /// (the chunk's rescale factor), 0 past row n. Rows 2r and 2r + 1 share a chunk (CHUNK is
    /// even).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn p_pairs(st: &[f32], f: &[f32], n: usize, hp: usize, pb: &mut [u16]) {
        assert!(st.len() == n * hp && pb.len() >= n.div_ceil(2) * 2 * hp);
        assert!(CHUNK.is_multiple_of(2) && f.len() == n.div_ceil(CHUNK) * hp);
        let idx: [u16; 32] = std::array::from_fn(|i| ((i % 2) * 16 + i / 2) as u16);
        // SAFETY: reads 32 u16.
        let idx = unsafe { _mm512_loadu_si512(idx.as_ptr() as *const _) };
        for r in 0..n.div_ceil(2) {
            for h0 in (0..hp).step_by(16) {
                // SAFETY: row 2r < n; row 2r + 1 read only when it exists; h0 + 16 ≤ hp.
                unsafe {
                    let fc = _mm512_loadu_ps(f.as_ptr().add((2 * r / CHUNK) * hp + h0));
                    let a = _mm512_mul_ps(_mm512_loadu_ps(st.as_ptr().add(2 * r * hp + h0)), fc);
                    let b = if 2 * r + 1 < n {
                        _mm512_mul_ps(_mm512_loadu_ps(st.as_ptr().add((2 * r + 1) * hp + h0)), fc)
                    } else {
                        _mm512_setzero_ps()
                    };
                    let v = _mm512_permutexvar_epi16(idx, bits(_mm512_cvtne2ps_pbh(b, a)));
                    _mm512_storeu_si512(pb.as_mut_ptr().add((r * hp + h0) * 2) as *mut _, v);
                }
            }
        }
    }

    /// One dim slice of O = P · V: `o` (h, SLICE) over the `n2 / 2` row pairs; tiles of 8 heads ×
    /// 2 vectors of 16 dims.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::needless_range_loop)]
    pub(super) unsafe fn pv(
        pb: &[u16],
        vb: &[u16],
        n2: usize,
        h: usize,
        hp: usize,
        d0: usize,
        o: &mut [f32],
    ) {
        const HB: usize = 8;
        assert!(pb.len() >= n2 * hp && vb.len() >= n2 * KV_DIM && o.len() == h * SLICE);
        assert!(d0 + SLICE <= KV_DIM && hp.is_multiple_of(HB) && h <= hp);
        let zero = _mm512_setzero_ps();
        for h0 in (0..h).step_by(HB) {
            for dd in (0..SLICE).step_by(32) {
                let mut acc = [[zero; 2]; HB];
                for r in 0..n2 / 2 {
                    // SAFETY: r < n2 / 2, d0 + dd + 32 ≤ 512.
                    let (v0, v1) = unsafe {
                        let p = vb.as_ptr().add((r * KV_DIM + d0 + dd) * 2);
                        (
                            bh(_mm512_loadu_si512(p as *const _)),
                            bh(_mm512_loadu_si512(p.add(32) as *const _)),
                        )
                    };
                    for i in 0..HB {
                        // SAFETY: h0 + i < hp, r < n2 / 2.
                        let p = bh(_mm512_set1_epi32(unsafe {
                            std::ptr::read_unaligned(
                                pb.as_ptr().add((r * hp + h0 + i) * 2) as *const i32
                            )
                        }));
                        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], p, v0);
                        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], p, v1);
                    }
                }
                for i in 0..HB.min(h - h0) {
                    // SAFETY: (h0 + i) · SLICE + dd + 32 ≤ o.len().
                    unsafe {
                        let p = o.as_mut_ptr().add((h0 + i) * SLICE + dd);
                        _mm512_storeu_ps(p, acc[i][0]);
                        _mm512_storeu_ps(p.add(16), acc[i][1]);
                    }
                }
            }
        }
    }
}

