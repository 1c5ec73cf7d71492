//! One-pass top-k: a streaming compare against a running threshold τ, survivors appended to a
//! bounded candidate buffer, and a partial select (which raises τ) whenever the buffer fills.
//!
//! Why one pass is exact: entries are visited in index order, and the buffer always holds the k
//! best entries seen so far (after a partial select). A later entry whose value equals τ has a
//! larger index than the kept k-th entry, so it ranks below it (ties → smaller index); only
//! `v > τ` can enter. NaN and −∞ never pass `v > τ` (τ starts at −∞, compares are ordered).
//!
//! The compare runs 64 entries at a time into a bit mask (AVX-512 `vcmpps` into mask registers,
//! AVX2 `vcmpps` + `vmovmskps`, or a portable loop); the rare non-zero masks are walked bit by bit.
//! With the buffer at 4k entries a random row costs a handful of partial selects over 2k keys, so
//! the time is the read pass plus a small constant.

use crate::isa::{level, Isa};

/// Buffer capacity in units of k.
const CAP_MULT: usize = 4;
/// Entries per compare step.
const STEP: usize = 64;

/// A 64-bit sort key: the value's total order (−0 folded onto +0) above the inverted index, so
/// that a larger key is a better entry (value desc, then index asc).
#[inline(always)]
fn key(v: f32, j: usize) -> u64 {
    let b = if v == 0.0 { 0 } else { v.to_bits() };
    let ord = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    (u64::from(ord) << 32) | u64::from(!(j as u32))
}

#[inline(always)]
fn key_value(k: u64) -> f32 {
    let ord = (k >> 32) as u32;
    f32::from_bits(if ord >> 31 == 1 {
        ord & 0x7FFF_FFFF
    } else {
        !ord
    })
}

#[inline(always)]
fn key_index(k: u64) -> i32 {
    !(k as u32) as i32
}

/// Keeps the best `k` keys of `buf` (unordered) and returns the k-th best value: the new τ.
#[inline(never)]
fn shrink(buf: &mut Vec<u64>, k: usize) -> f32 {
    buf.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    buf.truncate(k);
    key_value(buf[k - 1])
}

/// Selects the `out.len()` largest selectable entries of `values` (> −∞, not NaN), sorted by
/// (value desc, index asc), −1 padded. Returns how many were selected.
pub fn select_scored(values: &[f32], out: &mut [i32]) -> usize {
    // No more than the row's values can be selected: the scratch is sized by the input the caller
    // holds, never by an output width alone (a [T, 2^40] output once asked for 35 TB here).
    let k = out.len().min(values.len());
    if k == 0 {
        out.fill(-1);
        return 0;
    }
    let cap = CAP_MULT * k + STEP;
    let mut buf: Vec<u64> = Vec::with_capacity(cap + STEP);
    match level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level()` reported AVX-512F (and AVX2) present at run time.
        Isa::Avx512 => unsafe { scan_avx512(values, k, cap, &mut buf) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `level()` reported AVX2 present at run time.
        Isa::Avx2 => unsafe { scan_avx2(values, k, cap, &mut buf) },
        _ => scan::<Portable>(values, k, cap, &mut buf),
    }
    if buf.len() > k {
        shrink(&mut buf, k);
    }
    buf.sort_unstable_by(|a, b| b.cmp(a));
    let m = buf.len();
    for (o, &kk) in out.iter_mut().zip(&buf) {
        *o = key_index(kk);
    }
    out[m..].fill(-1);
    m
}

/// The bit mask of `v > tau` over 64 entries.
trait Mask64 {
    /// # Safety
    /// `p` points to 64 readable f32; the implementation's ISA is available.
    unsafe fn gt(p: *const f32, tau: f32) -> u64;
}

#[inline(always)]
fn scan<M: Mask64>(values: &[f32], k: usize, cap: usize, buf: &mut Vec<u64>) {
    let mut tau = f32::NEG_INFINITY;
    let mut chunks = values.chunks_exact(STEP);
    let mut base = 0usize;
    for c in &mut chunks {
        // SAFETY: `c` holds STEP = 64 floats; the caller selected M for this CPU.
        let mut m = unsafe { M::gt(c.as_ptr(), tau) };
        if m != 0 {
            while m != 0 {
                let i = m.trailing_zeros() as usize;
                buf.push(key(c[i], base + i));
                m &= m - 1;
            }
            if buf.len() >= cap {
                tau = shrink(buf, k);
            }
        }
        base += STEP;
    }
    for (i, &v) in chunks.remainder().iter().enumerate() {
        if v > tau {
            buf.push(key(v, base + i));
        }
    }
}

struct Portable;
impl Mask64 for Portable {
    #[inline(always)]
    unsafe fn gt(p: *const f32, tau: f32) -> u64 {
        // SAFETY: the caller guarantees 64 readable floats.
        let c = unsafe { &*(p as *const [f32; STEP]) };
        c.iter()
            .enumerate()
            .fold(0u64, |m, (i, &v)| m | (u64::from(v > tau) << i))
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Mask64 for Avx512 {
    #[inline(always)]
    unsafe fn gt(p: *const f32, tau: f32) -> u64 {
        use std::arch::x86_64::*;
        // SAFETY: 64 readable floats (caller); AVX-512F enabled in the calling wrapper.
        unsafe {
            let t = _mm512_set1_ps(tau);
            let m = |o: usize| {
                u64::from(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(
                    _mm512_loadu_ps(p.add(o)),
                    t,
                ))
            };
            m(0) | m(16) << 16 | m(32) << 32 | m(48) << 48
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Mask64 for Avx2 {
    #[inline(always)]
    unsafe fn gt(p: *const f32, tau: f32) -> u64 {
        use std::arch::x86_64::*;
        // SAFETY: 64 readable floats (caller); AVX2 enabled in the calling wrapper.
        unsafe {
            let t = _mm256_set1_ps(tau);
            let mut m = 0u64;
            for o in 0..8 {
                let c = _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_loadu_ps(p.add(8 * o)), t);
                m |= u64::from(_mm256_movemask_ps(c) as u8) << (8 * o);
            }
            m
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
fn scan_avx512(values: &[f32], k: usize, cap: usize, buf: &mut Vec<u64>) {
    scan::<Avx512>(values, k, cap, buf)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn scan_avx2(values: &[f32], k: usize, cap: usize, buf: &mut Vec<u64>) {
    scan::<Avx2>(values, k, cap, buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_order_by_value_then_smaller_index() {
        let vals = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-40,
            2.0,
            f32::INFINITY,
        ];
        for w in vals.windows(2) {
            if w[0] == w[1] {
                continue;
            }
            assert!(key(w[1], 9) > key(w[0], 0), "{} vs {}", w[1], w[0]);
        }
        assert_eq!(key(-0.0, 3), key(0.0, 3));
        assert!(key(1.0, 3) > key(1.0, 4));
        for &v in &vals {
            let back = key_value(key(v, 7));
            assert!(back == v && (v != 0.0 || back.to_bits() == 0));
            assert_eq!(key_index(key(v, 7)), 7);
        }
    }

    /// Every compare variant this CPU runs gives the same selections as the reference, including
    /// rows that force many partial selects (ascending) and rows shorter than one step.
    #[test]
    fn every_isa_matches_the_reference() {
        use rand::{Rng, SeedableRng};
        let mut r = rand::rngs::StdRng::seed_from_u64(11);
        for &n in &[1usize, 63, 64, 65, 2047, 2048, 2049, 5000, 70_001] {
            let cont: Vec<f32> = (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect();
            let ties: Vec<f32> = (0..n).map(|_| r.random_range(0..3) as f32).collect();
            let inc: Vec<f32> = (0..n).map(|j| j as f32).collect();
            let mut nan_inf = cont.clone();
            for (j, v) in nan_inf.iter_mut().enumerate() {
                match j % 5 {
                    0 => *v = f32::NAN,
                    1 => *v = f32::NEG_INFINITY,
                    2 => *v = -0.0,
                    _ => {}
                }
            }
            for row in [&cont, &ties, &inc, &nan_inf] {
                for k in [1usize, 7, 512] {
                    let want = crate::ops::topk::reference::select_scored(row, k);
                    let mut runs: Vec<(&str, Vec<i32>)> = Vec::new();
                    let mut go = |name, f: &dyn Fn(&mut Vec<u64>)| {
                        let mut buf = Vec::new();
                        f(&mut buf);
                        if buf.len() > k {
                            shrink(&mut buf, k);
                        }
                        buf.sort_unstable_by(|a, b| b.cmp(a));
                        let mut got: Vec<i32> = buf.iter().map(|&x| key_index(x)).collect();
                        got.resize(k, -1);
                        runs.push((name, got));
                    };
                    let cap = CAP_MULT * k + STEP;
                    go("portable", &|b| scan::<Portable>(row, k, cap, b));
                    #[cfg(target_arch = "x86_64")]
                    {
                        if Isa::Avx2.is_supported() {
                            // SAFETY: AVX2 detected.
                            go("avx2", &|b| unsafe { scan_avx2(row, k, cap, b) });
                        }
                        if Isa::Avx512.is_supported() {
                            // SAFETY: AVX-512F and AVX2 detected.
                            go("avx512", &|b| unsafe { scan_avx512(row, k, cap, b) });
                        }
                    }
                    for (name, got) in runs {
                        assert_eq!(got, want, "{name}: n {n} k {k}");
                    }
                }
            }
        }
    }
}
