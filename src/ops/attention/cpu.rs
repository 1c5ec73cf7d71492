//! Attention fast path.
//!
//! Per token the ≤ 640 attended rows are gathered and decoded to f32 once (the SIMD row codecs,
//! bit-identical to the reference decode; a lone token decodes its rows on every thread), then
//! shared by all heads (MQA). Work is split into tasks of [`HB`] heads so that rayon can balance
//! a decode step even when one worker is descheduled on a loaded machine (a fixed two-way split
//! made the step as slow as its slowest half).
//!
//! Scores are register-blocked dot products of 4 query heads × 2 key rows (8 FMA chains, rows read
//! in place, no key transposition); P·V keeps 8 heads × 2 vectors of output dims in registers
//! while streaming the rows. Scratch buffers are per-thread and reused across calls.

use super::{AttentionInputs, AttentionParams, KvRows, TokenRows};
use crate::formats::{fast, KV_DIM};
use crate::ops::simd::{codec_isa, multiversion, Vf32};
use rayon::prelude::*;
use std::cell::RefCell;
use std::thread::LocalKey;

/// Heads per task and per P·V register block.
const HB: usize = 8;
/// Rows decoded per task when a lone token's rows are gathered in parallel.
const GATHER_ROWS: usize = 64;

thread_local! {
    static ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's scratch buffer of at least `len` floats (a fresh one when the buffer
/// is already in use further up this thread's stack, e.g. under rayon work stealing).
fn with_scratch<R>(
    key: &'static LocalKey<RefCell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    key.with(|c| match c.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < len {
                v.resize(len, 0.0);
            }
            f(&mut v[..len])
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// Runs every token; shapes are checked by [`super::attention`].
pub fn attention(
    p: &AttentionParams,
    inp: &AttentionInputs,
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
    let isa = codec_isa();
    let one = |ti: usize, kf: &[f32], n: usize, h0: usize, o: &mut [f32], l: &mut [f32]| {
        let q = &inp.q[(ti * h + h0) * KV_DIM..][..o.len()];
        let sink = &inp.sink[h0..h0 + l.len()];
        with_scratch(&SCORES, l.len() * n, |s| {
            heads_mv(q, kf, n, p.scale, sink, s, o, l)
        });
    };
    if t >= rayon::current_num_threads() {
        out.par_chunks_mut(h * KV_DIM)
            .zip(lse.par_chunks_mut(h))
            .enumerate()
            .for_each(|(ti, (o, l))| {
                let r = &rows[ti];
                let n = r.main.len() + r.swa.len();
                with_scratch(&ROWS, n * KV_DIM, |kf| {
                    gather(isa, r, &main, &swa, 0, kf);
                    one(ti, kf, n, 0, o, l);
                });
            });
    } else {
        for (ti, (o, l)) in out
            .chunks_mut(h * KV_DIM)
            .zip(lse.chunks_mut(h))
            .enumerate()
        {
            let r = &rows[ti];
            let n = r.main.len() + r.swa.len();
            with_scratch(&ROWS, n * KV_DIM, |kf| {
                kf.par_chunks_mut(GATHER_ROWS * KV_DIM)
                    .enumerate()
                    .for_each(|(c, part)| gather(isa, r, &main, &swa, c * GATHER_ROWS, part));
                o.par_chunks_mut(HB * KV_DIM)
                    .zip(l.par_chunks_mut(HB))
                    .enumerate()
                    .for_each(|(c, (o, l))| one(ti, kf, n, c * HB, o, l));
            });
        }
    }
}

/// Decodes a token's attended rows `r0 ..` (main entries, then the window) into `dst`
/// (rows, 512) f32.
fn gather(isa: fast::Isa, r: &TokenRows, main: &KvRows, swa: &KvRows, r0: usize, dst: &mut [f32]) {
    let nm = r.main.len();
    for (i, d) in dst.chunks_exact_mut(KV_DIM).enumerate() {
        let k = r0 + i;
        if k < nm {
            row(isa, main, r.main[k], d);
        } else {
            row(isa, swa, r.swa.start + (k - nm), d);
        }
    }
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
    }
}

multiversion!(
    heads_mv,
    fn(
        q: &[f32],
        kf: &[f32],
        n: usize,
        scale: f32,
        sink: &[f32],
        s: &mut [f32],
        out: &mut [f32],
        lse: &mut [f32],
    ),
    heads_body
);

/// Attention of `lse.len()` heads (q rows `q`, output rows `out`) over the `n` rows of `kf`;
/// `s` is (heads, n) scratch.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn heads_body<V: Vf32>(
    q: &[f32],
    kf: &[f32],
    n: usize,
    scale: f32,
    sink: &[f32],
    s: &mut [f32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    let h = lse.len();
    if n == 0 {
        out.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        return;
    }
    assert!(q.len() == h * KV_DIM && out.len() == h * KV_DIM && kf.len() >= n * KV_DIM);
    assert!(s.len() == h * n);
    let l = V::L;
    let zero = V::splat(0.0);
    // Scores: 4 heads × 2 rows per register block; a short block repeats its last head / row.
    for h0 in (0..h).step_by(4) {
        let hr: [usize; 4] = std::array::from_fn(|i| (h0 + i).min(h - 1));
        for j0 in (0..n).step_by(2) {
            let jr = [j0, (j0 + 1).min(n - 1)];
            let mut acc = [[zero; 2]; 4];
            for d in (0..KV_DIM).step_by(l) {
                // SAFETY: every head row index < h and row index < n; d + L ≤ 512.
                let (k0, k1) = unsafe {
                    (
                        V::load(kf.as_ptr().add(jr[0] * KV_DIM + d)),
                        V::load(kf.as_ptr().add(jr[1] * KV_DIM + d)),
                    )
                };
                for i in 0..4 {
                    // SAFETY: as above.
                    let qv = unsafe { V::load(q.as_ptr().add(hr[i] * KV_DIM + d)) };
                    acc[i][0] = V::fmadd(qv, k0, acc[i][0]);
                    acc[i][1] = V::fmadd(qv, k1, acc[i][1]);
                }
            }
            for i in 0..4.min(h - h0) {
                s[(h0 + i) * n + j0] = acc[i][0].hsum();
                if j0 + 1 < n {
                    s[(h0 + i) * n + j0 + 1] = acc[i][1].hsum();
                }
            }
        }
    }
    // Softmax rows, L lanes at a time (the vector exp is within 2 ulp of e^x).
    let mut lanes = [0f32; 16];
    let vscale = V::splat(scale);
    let one = V::splat(1.0);
    for (hi, row) in s.chunks_exact_mut(n).enumerate() {
        let (body, tail) = row.split_at_mut(n - n % l);
        let mut vmx = V::splat(f32::NEG_INFINITY);
        for c in body.chunks_exact_mut(l) {
            // SAFETY: `c` holds L floats.
            unsafe {
                let v = V::fmadd(V::load(c.as_ptr()), vscale, zero);
                v.store(c.as_mut_ptr());
                vmx = V::max(vmx, v);
            }
        }
        // SAFETY: `lanes` holds 16 ≥ L floats.
        unsafe { vmx.store(lanes.as_mut_ptr()) };
        let mut mx = lanes[..l].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        for v in tail.iter_mut() {
            *v *= scale;
            mx = mx.max(*v);
        }
        let neg_mx = V::splat(-mx);
        let mut vsum = zero;
        for c in body.chunks_exact_mut(l) {
            // SAFETY: `c` holds L floats.
            unsafe {
                let e = V::fmadd(V::load(c.as_ptr()), one, neg_mx).exp();
                e.store(c.as_mut_ptr());
                vsum = V::fmadd(e, one, vsum);
            }
        }
        let mut sum = vsum.hsum();
        for v in tail.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v;
        }
        lse[hi] = mx + sum.ln();
        // Sink in the denominator only, in the frame of the row max (e^(a − mx) may overflow to ∞,
        // which correctly drives the output to 0).
        let inv = 1.0 / (sum + (sink[hi] - mx).exp());
        let vinv = V::splat(inv);
        for c in body.chunks_exact_mut(l) {
            // SAFETY: `c` holds L floats.
            unsafe { V::fmadd(V::load(c.as_ptr()), vinv, zero).store(c.as_mut_ptr()) };
        }
        for v in tail.iter_mut() {
            *v *= inv;
        }
    }
    // Output: HB heads × 2L dims of accumulators per pass over the rows.
    for h0 in (0..h).step_by(HB) {
        let hb = HB.min(h - h0);
        for d0 in (0..KV_DIM).step_by(2 * l) {
            let mut acc = [[zero; 2]; HB];
            for j in 0..n {
                let row = &kf[j * KV_DIM + d0..][..2 * l];
                // SAFETY: `row` holds 2L floats.
                let (k0, k1) = unsafe { (V::load(row.as_ptr()), V::load(row.as_ptr().add(l))) };
                for (i, a) in acc.iter_mut().enumerate().take(hb) {
                    let p = V::splat(s[(h0 + i) * n + j]);
                    a[0] = V::fmadd(p, k0, a[0]);
                    a[1] = V::fmadd(p, k1, a[1]);
                }
            }
            for (i, a) in acc.iter().enumerate().take(hb) {
                let o = &mut out[(h0 + i) * KV_DIM + d0..][..2 * l];
                // SAFETY: `o` holds 2L writable floats.
                unsafe {
                    a[0].store(o.as_mut_ptr());
                    a[1].store(o.as_mut_ptr().add(l));
                }
            }
        }
    }
}
