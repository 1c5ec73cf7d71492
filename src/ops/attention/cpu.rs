//! Attention fast path: per token, two small GEMMs around a column-wise softmax.
//!
//! Per token the ≤ 640 attended rows are gathered and decoded to f32 once (the SIMD row codecs,
//! bit-identical to the reference decode) into a (rows, 512) tile shared by all heads (MQA). Then:
//!
//! 1. scores `Sᵀ = K · (scale·Q)ᵀ` as a (rows, heads) tile: the query block is transposed once per
//!    token to (512, heads) so that the heads lie along the vector lanes; the micro-kernel holds
//!    `R` rows × up to 4 vectors of heads in registers and streams 128-dim blocks of `Qᵀ` (32 KiB, L1)
//!    while broadcasting key values, so no horizontal sums are needed;
//! 2. the softmax runs down the columns (all heads at once, no horizontal reductions): each chunk
//!    of [`CHUNK`] rows keeps its own max and sum, which are merged afterwards (the per-chunk
//!    rescale is folded into one pass over `P`);
//! 3. `O = P · V` with the output dims split into slices of [`SLICE`], so that a task reads only its
//!    own columns of the row tile; the micro-kernel keeps `HB` heads × 2 vectors of dims in
//!    registers.
//!
//! A lone decode token runs steps 1 (together with the decode of the chunk's rows) and 3 as rayon
//! tasks of [`CHUNK`] rows / [`SLICE`] dims, so that a step stays balanced when one worker is
//! descheduled on a loaded machine; a prefill batch runs one token per task. Scratch buffers are
//! per-thread and reused across calls.

use super::{AttentionDots, AttentionParams, KvRows, TokenRows};
use crate::formats::{fast, KV_DIM};
use crate::isa::level;
use crate::ops::simd::{multiversion, Vf32};
use rayon::prelude::*;
use std::cell::RefCell;

/// One score task: (its rows of the f32 tile, its rows of Sᵀ), (its chunk max, its chunk sum).
type ScoreChunk<'a> = (
    usize,
    (
        (&'a mut [f32], &'a mut [f32]),
        (&'a mut [f32], &'a mut [f32]),
    ),
);

/// Rows per score task (decoded and scored together while they are hot in cache).
pub(super) const CHUNK: usize = 64;
/// Output dims per P·V task.
pub(super) const SLICE: usize = 64;
/// Heads are padded to a multiple of this (one vector of 16 lanes or two of 8): the kernels take
/// blocks of 4 vectors of heads and then the 1-3 vectors left, so a model or tensor-parallel rank
/// with few heads does not pay for 64.
pub(super) const HEAD_PAD: usize = 16;
/// Dims of `Qᵀ` streamed per pass of the score micro-kernel (64 × 64 heads × 4 B = 16 KiB, L1).
/// Each pass starts fresh accumulators that are then added to the stored partial scores: the
/// 512-term dot products become 8 chains of 64 (one 512-long chain per lane — each lane is one
/// head — lost about 10× more precision on sharp logits).
const DBLOCK: usize = 64;
/// Rows per pass of the P·V micro-kernel: its slice of the row tile, of `P` and of the output
/// (32 × 256 B, 32 × 256 B, 64 × 256 B) stay in L1 while every head block streams them.
const PV_ROWS: usize = 32;
/// Row stride of the f32 row tile: 512 + 16 floats, so that successive rows (2112 B apart) fall in
/// different L1 sets; with a 2 KiB stride the column slices P·V streams alias into a few sets and
/// miss on every pass.
pub(super) const KS: usize = KV_DIM + 16;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's scratch buffer of at least `len` floats (a fresh one when the buffer
/// is already in use further up this thread's stack, e.g. under rayon work stealing).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|c| match c.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < len {
                v.resize(len, 0.0);
            }
            let r = f(&mut v[..len]);
            if v.len() > SCRATCH_KEEP {
                // A one-off long token (up to MAX_TOKEN_ROWS rows, ~150 MB) must not stay pinned
                // to every rayon thread for the life of the process.
                *v = Vec::new();
            }
            r
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// Scratch floats a thread keeps between calls (16 MiB: a 64-head token of ~7,000 rows; V4.1's
/// decode and prefill tokens attend at most top-k + window + image span rows).
const SCRATCH_KEEP: usize = 4 << 20;

/// Floats of this thread's kept scratch buffer.
#[cfg(test)]
pub(super) fn kept_scratch_floats() -> usize {
    SCRATCH.with(|c| c.borrow().len())
}

/// Scratch floats for one token of `n` rows and `h` heads.
fn scratch_len(n: usize, h: usize) -> usize {
    let hp = h.div_ceil(HEAD_PAD) * HEAD_PAD;
    n * KS + n * hp + KV_DIM * hp + 2 * n.div_ceil(CHUNK) * hp + h * KV_DIM
}

/// Runs every token: `q` (tokens, heads, 512), `sink` (heads), `rows` from [`super::plan`] or
/// [`super::plan_indexed`]; shapes are checked by [`super::attention`] /
/// [`super::attention_indexed`].
/// `dots` picks the f32, the bf16 ([`super::bf16`]) or the int16 + bf16 ([`super::int16`])
/// GEMMs; the caller checked that the CPU has the units.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    p: &AttentionParams,
    dots: AttentionDots,
    q: &[f32],
    sink: &[f32],
    rows: &[TokenRows],
    main: KvRows,
    swa: KvRows,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let h = p.heads;
    let t = rows.len();
    if t == 0 {
        return;
    }
    let kv = (main, swa);
    let one = |ti: usize, o: &mut [f32], l: &mut [f32], par: bool| {
        let r = &rows[ti];
        let n = r.main.len() + r.swa.len();
        let q = &q[ti * h * KV_DIM..][..h * KV_DIM];
        with_scratch(scratch_len(n, h), |buf| match dots {
            AttentionDots::F32 => token(p.scale, q, sink, r, &kv, o, l, par, buf),
            AttentionDots::Bf16 => super::bf16::token(p.scale, q, sink, r, &kv, o, l, buf, false),
            AttentionDots::Int16 => super::bf16::token(p.scale, q, sink, r, &kv, o, l, buf, true),
        });
    };
    if t >= rayon::current_num_threads() {
        out.par_chunks_mut(h * KV_DIM)
            .zip(lse.par_chunks_mut(h))
            .enumerate()
            .for_each(|(ti, (o, l))| one(ti, o, l, false));
    } else {
        let all = |out: &mut [f32], lse: &mut [f32]| {
            for (ti, (o, l)) in out
                .chunks_mut(h * KV_DIM)
                .zip(lse.chunks_mut(h))
                .enumerate()
            {
                one(ti, o, l, true);
            }
        };
        // The bf16 / int16 paths run on this thread, also from outside the pool: their crew
        // (`super::crew`) starts the tasks here and never blocks on a worker's wake-up. The f32
        // path's parallel iterators would each inject into the pool and block this thread, so
        // from outside the pool its tokens run as one pool job, whose steps fork and join among
        // the workers.
        if dots == AttentionDots::F32 && rayon::current_thread_index().is_none() {
            rayon::scope(|_| all(out, lse))
        } else {
            all(out, lse)
        }
    }
}

/// Attention of one token: `q` (heads, 512), `out` (heads, 512), `lse` (heads); `par` spreads the
/// row chunks and dim slices over rayon.
#[allow(clippy::too_many_arguments)]
fn token(
    scale: f32,
    q: &[f32],
    sink: &[f32],
    r: &TokenRows,
    kv: &(KvRows, KvRows),
    out: &mut [f32],
    lse: &mut [f32],
    par: bool,
    buf: &mut [f32],
) {
    let h = lse.len();
    let n = r.main.len() + r.swa.len();
    if n == 0 {
        out.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        return;
    }
    let hp = h.div_ceil(HEAD_PAD) * HEAD_PAD;
    let nc = n.div_ceil(CHUNK);
    let (kf, rest) = buf.split_at_mut(n * KS);
    let (st, rest) = rest.split_at_mut(n * hp);
    let (qt, rest) = rest.split_at_mut(KV_DIM * hp);
    let (mx, rest) = rest.split_at_mut(nc * hp);
    let (sm, ot) = rest.split_at_mut(nc * hp);
    // Qᵀ (512, hp) with the softmax scale folded in; padded heads are zero. Transposed in blocks of
    // 16 dims so that both sides stay within a few KiB of L1 (a plain column walk strides 2 KiB).
    if h < hp {
        qt.fill(0.0);
    }
    for d0 in (0..KV_DIM).step_by(16) {
        for hi in 0..h {
            let src = &q[hi * KV_DIM + d0..][..16];
            for (dd, &x) in src.iter().enumerate() {
                qt[(d0 + dd) * hp + hi] = x * scale;
            }
        }
    }
    let isa = level();
    let qt = &*qt;
    let score = |(c, ((k, s), (m, e))): ScoreChunk| {
        gather(isa, r, &kv.0, &kv.1, c * CHUNK, k);
        scores_mv(qt, k, hp, s, m, e);
    };
    if par {
        kf.par_chunks_mut(CHUNK * KS)
            .zip(st.par_chunks_mut(CHUNK * hp))
            .zip(mx.par_chunks_mut(hp).zip(sm.par_chunks_mut(hp)))
            .enumerate()
            .for_each(score);
    } else {
        kf.chunks_mut(CHUNK * KS)
            .zip(st.chunks_mut(CHUNK * hp))
            .zip(mx.chunks_mut(hp).zip(sm.chunks_mut(hp)))
            .enumerate()
            .for_each(score);
    }
    merge_chunks(mx, sm, sink, h, hp, nc, lse);
    rescale_mv(st, mx, hp);
    let (kf, st) = (&*kf, &*st);
    let pv = |(si, o): (usize, &mut [f32])| pv_mv(st, kf, hp, si * SLICE, o);
    if par {
        ot.par_chunks_mut(h * SLICE).enumerate().for_each(pv);
    } else {
        ot.chunks_mut(h * SLICE).enumerate().for_each(pv);
    }
    for (si, o) in ot.chunks_exact(h * SLICE).enumerate() {
        for (hi, src) in o.chunks_exact(SLICE).enumerate() {
            out[hi * KV_DIM + si * SLICE..][..SLICE].copy_from_slice(src);
        }
    }
}

/// Merges the chunks of a token: M = max of the chunk maxima, Σ e^(z − M), `lse` without the sink;
/// the sink enters the denominator only, in the frame of M (e^(a − M) may overflow to ∞, which
/// correctly drives the output to 0). `mx` becomes the factor each chunk's P is scaled by.
#[allow(clippy::too_many_arguments)]
pub(super) fn merge_chunks(
    mx: &mut [f32],
    sm: &[f32],
    sink: &[f32],
    h: usize,
    hp: usize,
    nc: usize,
    lse: &mut [f32],
) {
    for hi in 0..hp {
        if hi >= h {
            (0..nc).for_each(|c| mx[c * hp + hi] = 0.0);
            continue;
        }
        let m = (0..nc).fold(f32::NEG_INFINITY, |a, c| a.max(mx[c * hp + hi]));
        let mut sum = 0.0f32;
        for c in 0..nc {
            let f = (mx[c * hp + hi] - m).exp();
            mx[c * hp + hi] = f;
            sum += sm[c * hp + hi] * f;
        }
        lse[hi] = m + sum.ln();
        let inv = 1.0 / (sum + (sink[hi] - m).exp());
        (0..nc).for_each(|c| mx[c * hp + hi] *= inv);
    }
}

/// Decodes a token's attended rows `r0 ..` (main entries, then the SWA rows) into `dst`
/// (rows, [`KS`]) f32.
pub(super) fn gather(
    isa: fast::Isa,
    r: &TokenRows,
    main: &KvRows,
    swa: &KvRows,
    r0: usize,
    dst: &mut [f32],
) {
    let nm = r.main.len();
    for (i, d) in dst.chunks_exact_mut(KS).enumerate() {
        let d = &mut d[..KV_DIM];
        let k = r0 + i;
        if k < nm {
            row(isa, main, r.main[k], d);
        } else {
            row(isa, swa, r.swa[k - nm], d);
        }
    }
}

/// Prefetches the record bytes of a token's attended row `k` (main entries, then the SWA rows)
/// into L1 (no-op for f32 rows).
#[inline]
pub(super) fn prefetch_row(r: &TokenRows, main: &KvRows, swa: &KvRows, k: usize) {
    let nm = r.main.len();
    let (kv, i) = if k < nm {
        (main, r.main[k])
    } else {
        (swa, r.swa[k - nm])
    };
    let (d, s): (&[u8], &[u8]) = match kv {
        KvRows::F32(_) => return,
        KvRows::Records(f, b) => {
            let rec = &b[i * f.record_bytes()..][..f.record_bytes()];
            rec.split_at(f.data_bytes())
        }
        KvRows::Pool(p) => p.parts(i),
    };
    #[cfg(target_arch = "x86_64")]
    for part in [d, s] {
        for off in (0..part.len()).step_by(64) {
            // SAFETY: a prefetch of an address inside `part`; it never faults.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    part.as_ptr().add(off) as *const i8,
                )
            };
        }
        // The last line, when the part does not start on a line boundary.
        if let Some(l) = part.last() {
            // SAFETY: as above.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    l as *const u8 as *const i8,
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (d, s);
}

#[inline]
fn row(isa: fast::Isa, kv: &KvRows, i: usize, out: &mut [f32]) {
    match kv {
        KvRows::F32(x) => out.copy_from_slice(&x[i * KV_DIM..][..KV_DIM]),
        KvRows::Records(f, b) => {
            let rec = &b[i * f.record_bytes()..][..f.record_bytes()];
            let (d, s) = rec.split_at(f.data_bytes());
            fast::decode_row(isa, *f, d, s, out);
        }
        KvRows::Pool(p) => {
            let (d, s) = p.parts(i);
            fast::decode_row(isa, p.desc().format, d, s, out);
        }
    }
}

multiversion!(
    scores_mv,
    fn(qt: &[f32], kf: &[f32], hp: usize, st: &mut [f32], mx: &mut [f32], sm: &mut [f32]),
    scores_body
);

/// Scores of a chunk: `st` (rows, hp) = `kf` (rows, 512 of [`KS`]) · `qt` (512, hp); then, per head column,
/// `mx` = the chunk max, `st` ← e^(st − mx) and `sm` = the chunk sum.
#[inline(always)]
fn scores_body<V: Vf32>(
    qt: &[f32],
    kf: &[f32],
    hp: usize,
    st: &mut [f32],
    mx: &mut [f32],
    sm: &mut [f32],
) {
    // Heads in blocks of 4 vectors while they last, then one block of the 1-3 vectors left (a
    // model with few heads, or one tensor-parallel rank's share, pads only to 16 heads). With 16
    // lanes: 6 rows × 4 vectors = 24 accumulators of 32 registers (10 loads per 24 FMAs), 8 × 1
    // or 8 × 2, 6 × 3; with 8 lanes (16 registers): 2 × 4, and 4 × 2 for the 16 heads left.
    let full = hp / (4 * V::L) * (4 * V::L);
    if V::L == 16 {
        score_tiles::<V, 6, 4>(qt, kf, hp, 0..full, st);
        match (hp - full) / V::L {
            1 => score_tiles::<V, 8, 1>(qt, kf, hp, full..hp, st),
            2 => score_tiles::<V, 8, 2>(qt, kf, hp, full..hp, st),
            3 => score_tiles::<V, 6, 3>(qt, kf, hp, full..hp, st),
            _ => {}
        }
    } else {
        score_tiles::<V, 2, 4>(qt, kf, hp, 0..full, st);
        if full < hp {
            score_tiles::<V, 4, 2>(qt, kf, hp, full..hp, st);
        }
    }
    softmax_body::<V>(st, hp, mx, sm);
}

multiversion!(
    softmax_mv,
    fn(st: &mut [f32], hp: usize, mx: &mut [f32], sm: &mut [f32]),
    softmax_body
);

/// Per head column of a chunk's scores `st` (rows, hp): `mx` = the chunk max, `st` ← e^(st − mx)
/// and `sm` = the chunk sum.
pub(super) fn chunk_softmax(st: &mut [f32], hp: usize, mx: &mut [f32], sm: &mut [f32]) {
    softmax_mv(st, hp, mx, sm);
}

#[inline(always)]
fn softmax_body<V: Vf32>(st: &mut [f32], hp: usize, mx: &mut [f32], sm: &mut [f32]) {
    let l = V::L;
    let n = st.len() / hp;
    let one = V::splat(1.0);
    for c in (0..hp).step_by(l) {
        let mut m = V::splat(f32::NEG_INFINITY);
        for j in 0..n {
            // SAFETY: c + L ≤ hp, j < n.
            m = V::max(m, unsafe { V::load(st.as_ptr().add(j * hp + c)) });
        }
        let mut s = V::splat(0.0);
        // SAFETY: mx holds hp floats.
        unsafe { m.store(mx.as_mut_ptr().add(c)) };
        let neg = V::fmadd(m, V::splat(-1.0), V::splat(0.0));
        for j in 0..n {
            // SAFETY: as above.
            unsafe {
                let p = st.as_mut_ptr().add(j * hp + c);
                let e = V::fmadd(V::load(p), one, neg).exp();
                e.store(p);
                s = V::fmadd(e, one, s);
            }
        }
        // SAFETY: sm holds hp floats.
        unsafe { s.store(sm.as_mut_ptr().add(c)) };
    }
}

/// The score GEMM over heads `hs` in tiles of `R` rows × `NV` vectors of heads, over blocks of
/// [`DBLOCK`] dims (each block's sums are added to the stored partial scores); a short last tile
/// repeats its last row. A head's scores do not depend on the tile shape: each lane sums its
/// own dims in the same order.
#[inline(always)]
fn score_tiles<V: Vf32, const R: usize, const NV: usize>(
    qt: &[f32],
    kf: &[f32],
    hp: usize,
    hs: std::ops::Range<usize>,
    st: &mut [f32],
) {
    let l = V::L;
    let n = st.len() / hp;
    assert!(kf.len() == n * KS && qt.len() == KV_DIM * hp && hs.end <= hp);
    assert!((hs.end - hs.start).is_multiple_of(NV * l));
    let (zero, one) = (V::splat(0.0), V::splat(1.0));
    for h0 in hs.step_by(NV * l) {
        for d0 in (0..KV_DIM).step_by(DBLOCK) {
            for j0 in (0..n).step_by(R) {
                let jr: [usize; R] = std::array::from_fn(|r| (j0 + r).min(n - 1));
                let mut acc = [[zero; NV]; R];
                for d in d0..d0 + DBLOCK {
                    // SAFETY: d < 512 and h0 + NV·L ≤ hp.
                    let qv: [V; NV] = std::array::from_fn(|v| unsafe {
                        V::load(qt.as_ptr().add(d * hp + h0 + v * l))
                    });
                    for r in 0..R {
                        // SAFETY: jr[r] < n, d < 512.
                        let k = V::splat(unsafe { *kf.get_unchecked(jr[r] * KS + d) });
                        for v in 0..NV {
                            acc[r][v] = V::fmadd(k, qv[v], acc[r][v]);
                        }
                    }
                }
                for (r, ar) in acc.iter().enumerate().take(n - j0) {
                    for (v, &a) in ar.iter().enumerate() {
                        // SAFETY: j0 + r < n and h0 + NV·L ≤ hp.
                        unsafe {
                            let p = st.as_mut_ptr().add((j0 + r) * hp + h0 + v * l);
                            let a = if d0 > 0 {
                                V::fmadd(V::load(p), one, a)
                            } else {
                                a
                            };
                            a.store(p);
                        }
                    }
                }
            }
        }
    }
}

multiversion!(
    rescale_mv,
    fn(st: &mut [f32], f: &[f32], hp: usize),
    rescale_body
);

/// `st` (rows, hp) row j ← row j ⊙ `f` row (j / CHUNK).
#[inline(always)]
fn rescale_body<V: Vf32>(st: &mut [f32], f: &[f32], hp: usize) {
    let zero = V::splat(0.0);
    for (j, row) in st.chunks_exact_mut(hp).enumerate() {
        let fr = &f[(j / CHUNK) * hp..][..hp];
        for (x, y) in row.chunks_exact_mut(V::L).zip(fr.chunks_exact(V::L)) {
            // SAFETY: both chunks hold L floats.
            unsafe {
                V::fmadd(V::load(x.as_ptr()), V::load(y.as_ptr()), zero).store(x.as_mut_ptr())
            };
        }
    }
}

multiversion!(
    pv_mv,
    fn(pt: &[f32], kf: &[f32], hp: usize, d0: usize, o: &mut [f32]),
    pv_body
);

/// One dim slice of `O = P · V`: `o` (heads, SLICE) = `pt`ᵀ (hp, rows) · `kf`[:, d0 .. d0 + SLICE].
#[inline(always)]
fn pv_body<V: Vf32>(pt: &[f32], kf: &[f32], hp: usize, d0: usize, o: &mut [f32]) {
    // 8 heads × 2 vectors = 16 accumulators with 16 lanes; 4 × 2 with 8 lanes.
    if V::L == 16 {
        pv_tiles::<V, 8>(pt, kf, hp, d0, o);
    } else {
        pv_tiles::<V, 4>(pt, kf, hp, d0, o);
    }
}

#[inline(always)]
fn pv_tiles<V: Vf32, const HB: usize>(pt: &[f32], kf: &[f32], hp: usize, d0: usize, o: &mut [f32]) {
    let l = V::L;
    let h = o.len() / SLICE;
    let n = pt.len() / hp;
    assert!(kf.len() == n * KS && d0 + SLICE <= KV_DIM && hp.is_multiple_of(HB) && h <= hp);
    let zero = V::splat(0.0);
    for j0 in (0..n).step_by(PV_ROWS) {
        for h0 in (0..h).step_by(HB) {
            for dd in (0..SLICE).step_by(2 * l) {
                let mut acc = [[zero; 2]; HB];
                if j0 > 0 {
                    for (i, a) in acc.iter_mut().enumerate().take(h - h0) {
                        // SAFETY: (h0 + i) * SLICE + dd + 2L ≤ o.len().
                        unsafe {
                            let p = o.as_ptr().add((h0 + i) * SLICE + dd);
                            *a = [V::load(p), V::load(p.add(l))];
                        }
                    }
                }
                for j in j0..(j0 + PV_ROWS).min(n) {
                    // SAFETY: j < n and d0 + dd + 2L ≤ 512.
                    let (k0, k1) = unsafe {
                        let p = kf.as_ptr().add(j * KS + d0 + dd);
                        (V::load(p), V::load(p.add(l)))
                    };
                    for (i, a) in acc.iter_mut().enumerate() {
                        // SAFETY: h0 + i < hp (hp is a multiple of HB) and j < n.
                        let p = V::splat(unsafe { *pt.get_unchecked(j * hp + h0 + i) });
                        a[0] = V::fmadd(p, k0, a[0]);
                        a[1] = V::fmadd(p, k1, a[1]);
                    }
                }
                for (i, a) in acc.iter().enumerate().take(h - h0) {
                    let dst = &mut o[(h0 + i) * SLICE + dd..][..2 * l];
                    // SAFETY: `dst` holds 2L writable floats.
                    unsafe {
                        a[0].store(dst.as_mut_ptr());
                        a[1].store(dst.as_mut_ptr().add(l));
                    }
                }
            }
        }
    }
}
