//! Attention on bf16 dot products (`vdpbf16ps`, AVX-512 BF16) with f32 accumulation and the
//! softmax in f32: [`super::AttentionDots::Bf16`].
//!
//! The steps are those of the f32 path ([`super::cpu`]); what changes is the operand precision of
//! the two GEMMs. NVFP4 (E2M1 × E4M3) and MXFP8 (E4M3 × 2^e) row values have at most 6 significant
//! bits and are exact in bf16 (8), so K and V lose nothing, and every product of two bf16 values
//! is exact in f32. The query (with the softmax scale folded in) is split into two bf16 halves,
//! `q ≈ hi + lo` with `hi = bf16(q)` and `lo = bf16(q − hi)` (the difference is exact in f32), and
//! both halves are dotted with each key pair into the same accumulator: the query then carries
//! 16 significant bits (relative error ≤ 2^−17) instead of 8. Rounding q to one bf16 moved each
//! logit by about 2^−9/√3 · ‖q ⊙ k‖ (≈ 1e-3 for unit-variance q and k at 512 dims), which on a
//! single head with sharp logits (σ = 4) put the output at 1 − cos = 2.6e-5, past the table's
//! bound; with the split the logit error is ~2^−8 of that, below the f32 path's own summation
//! error. The score GEMM does twice the `vdpbf16ps` of a single-bf16 query (the P·V GEMM is
//! unchanged). The softmax weights P are rounded to bf16 (RNE, relative error ≤ 2^−9), each
//! weight's error entering the output once, not exponentiated; the tolerance table's
//! [`crate::tolerance::BF16_DOTS_VS_F64`] bounds the result against the f64 reference.
//!
//! `vdpbf16ps` treats inputs below 2^−126 as zero and flushes subnormal results (Intel SDM): a
//! softmax weight below 2^−126 counts as 0, which changes an output by less than 2^−126 · |v|.
//!
//! Layouts (bf16 bit patterns in `u16`): Qᵀ as (256, 2, hp, 2): for dim pair i, the hi halves
//! then the lo halves, dims 2i and 2i + 1 of a head side by side; K as rows of stride [`KBS`]
//! (512 + 32, so a chunk's rows spread over the L1 sets), one 32-bit broadcast a dim pair; V as
//! row pairs, rows 2r and 2r + 1 of a dim side by side, stored per chunk of [`CHUNK`] rows and
//! within it per dim slice of [`SLICE`] ((512 / SLICE, pairs, SLICE, 2): one P·V task reads its
//! slice of a chunk as one 8 KiB piece); P as (n/2, hp, 2) likewise, each chunk's P in the frame
//! of its own maximum (the chunk's factor — its maximum against the token's, over the softmax
//! denominator — multiplies the chunk's P·V partial sums in f32, chunks in order).
//!
//! Per token: the query is converted once; then the row chunks (decode of the chunk's records
//! into K and V — an NVFP4 row's int16 codes, scales and bf16 values in one pass over the record
//! —, scores, the chunk's softmax and its P) and then the output dim slices (P·V, written in
//! place) run as tasks that this thread and up to `threads − 1` pool workers claim from a counter
//! ([`super::crew`]), the chunk merge running once between the two phases. The per-row reduction
//! order depends only on the row's position in the token's row list, never on the thread count,
//! on which thread ran a task, or on other tokens.

use super::cpu::{chunk_softmax, merge_chunks, CHUNK, HEAD_PAD, KS, SLICE};
use super::{int16, KvRows, TokenRows};
use crate::formats::KV_DIM;
use std::cell::RefCell;

/// One score task: ((its K rows, (its V row pairs, its P row pairs)), (its rows of Sᵀ, (its
/// chunk max, its chunk sum))).
type ScoreChunk16<'a> = (
    usize,
    (
        (&'a mut [u16], (&'a mut [u16], &'a mut [u16])),
        (&'a mut [f32], (&'a mut [f32], &'a mut [f32])),
    ),
);

/// A buffer shared by a token's tasks: the query tables (written by the prologue, read by the
/// score tasks), the chunk maxima and sums (each score task its own chunk's, the merge between the
/// phases all of them, the P·V tasks only read), V and P (written per chunk by the score tasks,
/// read whole by the P·V tasks) and the output rows (the P·V tasks write disjoint column slices).
struct Shared<T> {
    ptr: *mut T,
    len: usize,
}
impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Shared<T> {}
// SAFETY: the tasks' accesses are disjoint or ordered by the crew's phases (see each use).
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}
impl<T> Shared<T> {
    /// Takes `s`'s place: `s` must not be used while views from this handle are live.
    fn new(s: &mut [T]) -> Self {
        Shared {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }
    /// The start (a method, so closures capture the whole `Sync` handle, not its raw field).
    fn ptr(&self) -> *mut T {
        self.ptr
    }
    /// SAFETY: no thread writes the buffer while the view lives (the crew's phases order it).
    unsafe fn get(&self) -> &[T] {
        // SAFETY: `ptr`, `len` came from a live slice; aliasing as the caller guarantees.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// SAFETY: no other view of the part this one touches is used while it lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut(&self) -> &mut [T] {
        // SAFETY: as `get`, with the caller's exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

thread_local! {
    static SCRATCH16: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// Row stride (u16) of the K rows (bf16 or int16 codes): 512 + 32, so that successive rows
/// (1,088 B apart) fall in different L1 sets. With a 1 KiB stride the score kernels' pass
/// segments of a chunk's 64 rows mapped into 16 of the 64 sets and were evicted before reuse.
pub(super) const KBS: usize = KV_DIM + 32;

/// bf16 scratch (u16) of one token: Qᵀ (hi and lo halves), the int16 query, K rows, V row
/// pairs, P row pairs.
fn scratch16_len(n: usize, hp: usize) -> usize {
    let n2 = n.div_ceil(2) * 2;
    3 * KV_DIM * hp + n2 * KBS + n2 * KV_DIM + n2 * hp
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
        let (qi, rest) = rest.split_at_mut(KV_DIM * hp);
        let (kb, rest) = rest.split_at_mut(n2 * KBS);
        let (vb, pb) = rest.split_at_mut(n2 * KV_DIM);
        // (The f32 path's row tile and Qᵀ regions of `buf` are unused here: rows are decoded
        // pairwise into a stack buffer, Qᵀ lives in the bf16 scratch; the int16 query's head
        // factors take the start of the row tile.)
        let (tile, rest) = buf.split_at_mut(n * KS);
        let qs = &mut tile[..hp.min(n * KS)];
        let (st, rest) = rest.split_at_mut(n * hp);
        let (_, rest) = rest.split_at_mut(KV_DIM * hp);
        let (mx, rest) = rest.split_at_mut(nc * hp);
        let sm = &mut rest[..nc * hp];
        // SAFETY (every call below): `supported()` was asserted (and `int16::supported()` where
        // ni > 0); the slices have the lengths the kernels assert.
        // The query tables are written by the crew's prologue (on this thread, while the helpers
        // wake up) and read by the score tasks after it.
        let (qt, qi, qs) = (Shared::new(qt), Shared::new(qi), Shared::new(qs));
        let prologue = || unsafe {
            // SAFETY: no score task has started (the crew opens them after the prologue).
            if ni < n {
                x86::query_pairs(q, h, hp, scale, qt.get_mut());
            }
            if ni > 0 {
                int16::x86::query_i16(q, h, hp, scale, qi.get_mut(), qs.get_mut());
            }
        };
        let isa = crate::isa::level();
        let score = |(c, ((kb16, (vb16, pb16)), (s, (m, e)))): ScoreChunk16| {
            // SAFETY: the prologue has written the query tables; from here on they are read only.
            let (qt, qi, qs) = unsafe { (qt.get(), qi.get(), qs.get()) };
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
            let pc = vb16.len() / (2 * KV_DIM);
            for p in 0..rows.div_ceil(2) {
                let rr = (rows - 2 * p).min(2);
                let k_from = ci.saturating_sub(2 * p).min(rr);
                // The next pair's records, two pairs ahead (the top-k rows are scattered).
                for e in 4..6 {
                    if 2 * p + e < rows {
                        super::cpu::prefetch_row(r, &kv.0, &kv.1, r0 + 2 * p + e);
                    }
                }
                if k_from == rr {
                    // Both rows NVFP4 and scored on int16: codes, scales and V from the records
                    // in one pass, no f32 rows.
                    let j = 2 * p;
                    let a = int16::parts(&kv.0, r.main[r0 + j]);
                    let b = (rr == 2).then(|| int16::parts(&kv.0, r.main[r0 + j + 1]));
                    unsafe {
                        int16::x86::key_value_pair(
                            a,
                            b,
                            &mut kb16[j * KBS..],
                            &mut ks[j * int16::BLOCKS..],
                            vb16,
                            p,
                            pc,
                        )
                    };
                    continue;
                }
                let two = &mut pair[..rr * KS];
                super::cpu::gather(isa, r, &kv.0, &kv.1, r0 + 2 * p, two);
                for e in 0..k_from {
                    let j = 2 * p + e;
                    let (d, sc) = int16::parts(&kv.0, r.main[r0 + j]);
                    unsafe {
                        int16::x86::key_row(
                            d,
                            sc,
                            &mut kb16[j * KBS..],
                            &mut ks[j * int16::BLOCKS..],
                        )
                    };
                }
                unsafe {
                    x86::rows_to_bf16(two, rr, k_from, &mut kb16[2 * p * KBS..], vb16, p, pc)
                };
            }
            if ci > 0 {
                unsafe {
                    int16::x86::scores(qi, qs, kb16, &ks, ci, hp, &mut s[..ci * hp]);
                }
            }
            if ci < rows {
                unsafe { x86::scores(qt, &kb16[ci * KBS..], rows - ci, hp, &mut s[ci * hp..]) };
            }
            chunk_softmax(s, hp, m, e);
            // P in the chunk's frame (e^(z − chunk max) ≤ 1, to bf16 pairs while hot); the chunk's
            // factor (its max against the token's, over the denominator) is applied to its P·V
            // partial sums in f32.
            unsafe { x86::p_pairs(s, rows, hp, pb16) };
        };
        // The chunks' disjoint pieces, each taken once by whichever thread claims its index. The
        // maxima and sums (`mx`, `sm`) are reached through pointers: the score tasks write them
        // chunk by chunk, the merge between the phases rewrites `mx` into each chunk's factor, and
        // the P·V tasks read the factors.
        let (mx, sm, vb, pb) = (
            Shared::new(mx),
            Shared::new(sm),
            Shared::new(vb),
            Shared::new(pb),
        );
        // SAFETY (the four views): chunk c's task owns its pieces of V, P and of the maxima and
        // sums until phase one ends; the views are dropped with `tasks` before anything reads
        // them whole.
        let tasks: Vec<std::sync::Mutex<Option<ScoreChunk16>>> = unsafe {
            kb.chunks_mut(CHUNK * KBS)
                .zip(
                    vb.get_mut()
                        .chunks_mut(CHUNK * KV_DIM)
                        .zip(pb.get_mut().chunks_mut(CHUNK * hp)),
                )
                .zip(
                    st.chunks_mut(CHUNK * hp)
                        .zip(mx.get_mut().chunks_mut(hp).zip(sm.get_mut().chunks_mut(hp))),
                )
                .enumerate()
                .map(|t| std::sync::Mutex::new(Some(t)))
                .collect()
        };
        // Chunks holding bf16-scored rows (twice the MACs of an int16 chunk) first, so that
        // the last ones claimed are the light ones.
        let heavy = nc - ni / CHUNK;
        let order = |k: usize| if k < heavy { nc - heavy + k } else { k - heavy };
        assert!(out.len() == h * KV_DIM);
        let o = Shared::new(out);
        let task = |k: usize| {
            if k < nc {
                let t = tasks[order(k)]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                score(t.expect("each chunk is claimed once"));
            } else {
                // SAFETY: phase two starts after the merge, which no task overlaps; from then on
                // V, P and the factors are only read. `out` holds h rows of 512; slice `si`
                // writes only dims si · SLICE .. + SLICE of each row, and `out` is not touched
                // otherwise until every task is done.
                unsafe { x86::pv(pb.get(), vb.get(), mx.get(), n, h, hp, k - nc, o.ptr()) }
            }
        };
        // SAFETY: every score task has finished and no P·V task has started (phase order).
        // `mx` becomes each chunk's factor.
        let merge = || unsafe { merge_chunks(mx.get_mut(), sm.get(), sink, h, hp, nc, lse) };
        super::crew::run_phases(prologue, nc, merge, KV_DIM / SLICE, true, task);
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

    /// f32 rows (`rows` ≤ 2 of stride [`KS`]) → bf16 K rows (`kb`, stride [`KBS`]) from row
    /// `k_from` on (the rows before it are the int16 kernel's, coded by the caller) and V row pair
    /// `p` of a chunk of `pc` pairs (`vb`, the chunk's V: [`v_index`]); an odd last row is paired
    /// with zeros.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn rows_to_bf16(
        kf: &[f32],
        rows: usize,
        k_from: usize,
        kb: &mut [u16],
        vb: &mut [u16],
        p: usize,
        pc: usize,
    ) {
        assert!(rows <= 2 && p < pc && vb.len() == pc * 2 * KV_DIM);
        assert!(kf.len() >= rows * KS - (KS - KV_DIM));
        assert!(rows == 0 || kb.len() >= (rows - 1) * KBS + KV_DIM);
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
                    _mm512_storeu_si512(kb.as_mut_ptr().add(j * KBS + d) as *mut _, bits(v));
                }
            }
        }
        if rows == 0 {
            return;
        }
        for d in (0..KV_DIM).step_by(16) {
            // SAFETY: row 0 < rows; row 1 read only when it exists; d + 16 ≤ 512; the store is
            // inside `vb` ([`v_index`] < pc · 1024 − 31).
            unsafe {
                let a = _mm512_loadu_ps(kf.as_ptr().add(d));
                let b = if rows == 2 {
                    _mm512_loadu_ps(kf.as_ptr().add(KS + d))
                } else {
                    zero
                };
                let v = _mm512_permutexvar_epi16(idx, bits(_mm512_cvtne2ps_pbh(b, a)));
                _mm512_storeu_si512(vb.as_mut_ptr().add(v_index(pc, p, d)) as *mut _, v);
            }
        }
    }

    /// Index (u16) of dim `d`'s pair in V row pair `p` of a chunk of `pc` pairs: the chunk's V is
    /// slice-major, (512 / [`SLICE`], pc, SLICE, 2), so that one P·V task reads its slice of a
    /// chunk as 8 KiB in one piece.
    #[inline(always)]
    pub(in crate::ops::attention) fn v_index(pc: usize, p: usize, d: usize) -> usize {
        ((d / SLICE) * pc + p) * 2 * SLICE + (d % SLICE) * 2
    }

    /// Scores `st` (rows, hp) = K · (Qᵀ hi + Qᵀ lo), over blocks of 64 dims (each block's sums
    /// added to the stored partial scores, as the f32 path): heads in tiles of 6 rows × 4
    /// vectors of 16 while they last, then the 1-3 vectors left (8 × 1, 8 × 2, 6 × 3). A head's
    /// scores do not depend on the tile shape.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn scores(qt: &[u16], kb: &[u16], rows: usize, hp: usize, st: &mut [f32]) {
        assert!(qt.len() == 2 * KV_DIM * hp && st.len() == rows * hp);
        assert!(rows > 0 && kb.len() >= (rows - 1) * KBS + KV_DIM);
        assert!(hp.is_multiple_of(16));
        let full = hp / 64 * 64;
        // SAFETY (each call): the asserts above; the head ranges are whole tiles inside hp.
        unsafe {
            scores_tiles::<6, 4>(qt, kb, rows, hp, 0..full, st);
            match (hp - full) / 16 {
                1 => scores_tiles::<8, 1>(qt, kb, rows, hp, full..hp, st),
                2 => scores_tiles::<8, 2>(qt, kb, rows, hp, full..hp, st),
                3 => scores_tiles::<6, 3>(qt, kb, rows, hp, full..hp, st),
                _ => {}
            }
        }
    }

    /// [`scores`] over heads `hs` in tiles of `R` rows × `V` vectors of 16 heads.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn scores_tiles<const R: usize, const V: usize>(
        qt: &[u16],
        kb: &[u16],
        rows: usize,
        hp: usize,
        hs: std::ops::Range<usize>,
        st: &mut [f32],
    ) {
        const DB: usize = 64;
        assert!(qt.len() == 2 * KV_DIM * hp && st.len() == rows * hp);
        assert!(rows > 0 && kb.len() >= (rows - 1) * KBS + KV_DIM);
        assert!(hs.end <= hp && (hs.end - hs.start).is_multiple_of(16 * V));
        let zero = _mm512_setzero_ps();
        for h0 in hs.step_by(16 * V) {
            for d0 in (0..KV_DIM).step_by(DB) {
                for j0 in (0..rows).step_by(R) {
                    let jr: [usize; R] = std::array::from_fn(|r| (j0 + r).min(rows - 1));
                    let mut acc = [[zero; V]; R];
                    // Row i2 of Qᵀ is dim pair i2 / 2's hi (even i2) or lo (odd i2) half; both
                    // meet the same key pair and add into the same accumulators.
                    for i2 in d0..d0 + DB {
                        let i = i2 / 2;
                        // SAFETY: i2 < 512, h0 + 16V ≤ hp.
                        let qv: [__m512bh; V] = std::array::from_fn(|v| unsafe {
                            bh(_mm512_loadu_si512(
                                qt.as_ptr().add((i2 * hp + h0 + 16 * v) * 2) as *const _,
                            ))
                        });
                        for r in 0..R {
                            // SAFETY: jr[r] < rows, 2i + 2 ≤ 512.
                            let k = bh(_mm512_set1_epi32(unsafe {
                                std::ptr::read_unaligned(
                                    kb.as_ptr().add(jr[r] * KBS + 2 * i) as *const i32
                                )
                            }));
                            for v in 0..V {
                                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], k, qv[v]);
                            }
                        }
                    }
                    for r in 0..R.min(rows - j0) {
                        for v in 0..V {
                            // SAFETY: j0 + r < rows, h0 + 16V ≤ hp.
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

    /// P row pairs of a chunk: `pb[(r · hp + h) · 2 + e] = bf16(st[2r + e][h])`, 0 past row
    /// `rows`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn p_pairs(st: &[f32], rows: usize, hp: usize, pb: &mut [u16]) {
        assert!(st.len() == rows * hp && pb.len() == rows.div_ceil(2) * 2 * hp);
        let idx: [u16; 32] = std::array::from_fn(|i| ((i % 2) * 16 + i / 2) as u16);
        // SAFETY: reads 32 u16.
        let idx = unsafe { _mm512_loadu_si512(idx.as_ptr() as *const _) };
        for r in 0..rows.div_ceil(2) {
            for h0 in (0..hp).step_by(16) {
                // SAFETY: row 2r < rows; row 2r + 1 read only when it exists; h0 + 16 ≤ hp.
                unsafe {
                    let a = _mm512_loadu_ps(st.as_ptr().add(2 * r * hp + h0));
                    let b = if 2 * r + 1 < rows {
                        _mm512_loadu_ps(st.as_ptr().add((2 * r + 1) * hp + h0))
                    } else {
                        _mm512_setzero_ps()
                    };
                    let v = _mm512_permutexvar_epi16(idx, bits(_mm512_cvtne2ps_pbh(b, a)));
                    _mm512_storeu_si512(pb.as_mut_ptr().add((r * hp + h0) * 2) as *mut _, v);
                }
            }
        }
    }

    /// Dim slice `si` of O = P · V into `out` (h rows of 512; dims si · SLICE .. + SLICE of each
    /// row written, nothing else read or written), chunk by chunk: each chunk's partial sums
    /// (its P in its own frame, [`p_pairs`]) are scaled by the chunk's factor `f[c][h]` and
    /// added to the output in f32, chunks in order. A chunk's slice of V (8 KiB) and its P rows
    /// (8 KiB) stay in L1 while every head block streams them; tiles of 8 heads × 2 vectors of
    /// 16 dims.
    ///
    /// # Safety
    /// AVX-512 BF16; `out` points to h · 512 writable floats that no one else accesses in this
    /// slice's columns during the call.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
    pub(super) unsafe fn pv(
        pb: &[u16],
        vb: &[u16],
        f: &[f32],
        n: usize,
        h: usize,
        hp: usize,
        si: usize,
        out: *mut f32,
    ) {
        const HB: usize = 8;
        let n2 = n.div_ceil(2) * 2;
        let nc = n.div_ceil(CHUNK);
        assert!(pb.len() >= n2 * hp && vb.len() >= n2 * KV_DIM && f.len() == nc * hp);
        assert!((si + 1) * SLICE <= KV_DIM && hp.is_multiple_of(HB) && h <= hp);
        let zero = _mm512_setzero_ps();
        for c in 0..nc {
            let pc = (n - c * CHUNK).min(CHUNK).div_ceil(2);
            // SAFETY: chunk c's V starts at c · CHUNK · 512 and holds pc · 1024 u16; its P rows
            // start at pair c · CHUNK / 2.
            let (vc, pcb) = unsafe {
                (
                    vb.as_ptr()
                        .add(c * CHUNK * KV_DIM + v_index(pc, 0, si * SLICE)),
                    pb.as_ptr().add(c * CHUNK / 2 * hp * 2),
                )
            };
            for h0 in (0..h).step_by(HB) {
                let hr = HB.min(h - h0);
                let fv: [__m512; HB] =
                    std::array::from_fn(|i| _mm512_set1_ps(f[c * hp + (h0 + i).min(hp - 1)]));
                for dd in (0..SLICE).step_by(32) {
                    let mut acc = [[zero; 2]; HB];
                    for r in 0..pc {
                        // SAFETY: r < pc, dd + 32 ≤ SLICE.
                        let (v0, v1) = unsafe {
                            let p = vc.add(r * 2 * SLICE + dd * 2);
                            (
                                bh(_mm512_loadu_si512(p as *const _)),
                                bh(_mm512_loadu_si512(p.add(32) as *const _)),
                            )
                        };
                        for i in 0..HB {
                            // SAFETY: h0 + i < hp, pair c · CHUNK / 2 + r < n2 / 2.
                            let p = bh(_mm512_set1_epi32(unsafe {
                                std::ptr::read_unaligned(
                                    pcb.add((r * hp + h0 + i) * 2) as *const i32
                                )
                            }));
                            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], p, v0);
                            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], p, v1);
                        }
                    }
                    for i in 0..hr {
                        // SAFETY: head h0 + i < h, dims si · SLICE + dd + 32 ≤ 512: inside
                        // `out`, in this task's columns.
                        unsafe {
                            let p = out.add((h0 + i) * KV_DIM + si * SLICE + dd);
                            for k in 0..2 {
                                let x = if c == 0 {
                                    _mm512_mul_ps(acc[i][k], fv[i])
                                } else {
                                    _mm512_fmadd_ps(
                                        acc[i][k],
                                        fv[i],
                                        _mm512_loadu_ps(p.add(16 * k)),
                                    )
                                };
                                _mm512_storeu_ps(p.add(16 * k), x);
                            }
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
    use csa2_rng::{rand_normal, NewRng, Rng};
    use half::bf16;

    /// The vector split of the query (conversion + 16 × 16 transpose) against a scalar one
    /// (`half`'s RNE rounding), every head count class: one head, ragged, whole vectors, past 64.
    #[test]
    fn query_pairs_are_the_scalar_hi_lo_split() {
        if !supported() {
            return;
        }
        let mut rng = Rng::new(3);
        for h in [1usize, 5, 16, 64, 72] {
            let hp = h.div_ceil(HEAD_PAD) * HEAD_PAD;
            let q = rand_normal(&mut rng, h * KV_DIM, 3.0);
            let scale = 0.044;
            let mut qt = vec![0xFFFFu16; 2 * KV_DIM * hp];
            // SAFETY: `supported()` checked; lengths as asserted.
            unsafe { x86::query_pairs(&q, h, hp, scale, &mut qt) };
            for i in 0..KV_DIM / 2 {
                for hh in 0..hp {
                    for e in 0..2 {
                        let (hi, lo) = if hh < h {
                            let x = q[hh * KV_DIM + 2 * i + e] * scale;
                            let hi = bf16::from_f32(x);
                            (hi.to_bits(), bf16::from_f32(x - hi.to_f32()).to_bits())
                        } else {
                            (0, 0)
                        };
                        assert_eq!(
                            qt[((2 * i) * hp + hh) * 2 + e],
                            hi,
                            "hi h {h} i {i} {hh} {e}"
                        );
                        assert_eq!(qt[((2 * i + 1) * hp + hh) * 2 + e], lo, "lo h {h} i {i}");
                    }
                }
            }
        }
    }
}
