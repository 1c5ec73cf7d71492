//! The fast CPU path of mHC: threads over token tiles (rayon), AVX2+FMA inner loops picked at run
//! time (scalar fallback elsewhere).
//!
//! Both paths share the same inner kernels, so they differ only in how often the streams travel
//! through memory:
//! - [`unfused_boundary`]: post update (read X, y; write X'), coefficient pass (read X'), collapse
//!   (read X', write u), RMSNorm (read u, write the sublayer input): (4n+4)·d values per token.
//! - [`fused_boundary`]: one pass per d-chunk of a token tile computes X' (written once), the shifted
//!   collapse u, its sum of squares, and the `hc_fn · vec(X')` GEMV plus the mix statistic while the
//!   chunk is still in L1; the norm scales u while the tile's rows are still in L2:
//!   (2n+2)·d values per token. `hc_fn` chunks are reused across the tokens of a tile.

// Index loops mirror the (i, j) subscripts of the formulas in SPEC §4.
#![allow(clippy::needless_range_loop)]

use super::{BoundaryIn, BoundaryOut, CoeffsMut, MhcParams, MixWeights, PostUpdate, HC, MIX};
use crate::error::Result;
use rayon::prelude::*;

/// Tokens per tile: one `hc_fn` chunk (24 × 4 × [`CHUNK`] f32 = 96 KiB) serves this many tokens.
const TILE: usize = 8;
/// Dims per chunk of a stream row (all 4 streams of a token chunk = 4 KiB, L1-resident).
const CHUNK: usize = 256;
/// Per-token scratch: the 24 dot products then the sum of squares of X'.
const MIX_ACC: usize = MIX + 1;

// ---- inner kernels: dispatch --------------------------------------------------------------------

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Coefficients of a post update for one token, plus the carried pre for the fused collapse.
#[derive(Clone, Copy)]
struct TokenMix {
    post: [f32; HC],
    comb: [f32; HC * HC],
}

/// X'[j][c0..c1] = post_j·y + Σ_i C[i,j]·X[i]; optionally u = Σ_j pre_j·X'[j] and returns Σ u².
/// `xt`/`xn` are one token's 4 streams (4d), `y`/`u` one token's row (d).
#[allow(clippy::too_many_arguments)]
#[inline]
fn update_collapse(
    d: usize,
    xt: &[f32],
    y: &[f32],
    m: &TokenMix,
    pre: Option<&[f32; HC]>,
    c0: usize,
    c1: usize,
    xn: &mut [f32],
    u: Option<&mut [f32]>,
) -> f32 {
    assert!(xt.len() == HC * d && xn.len() == HC * d && y.len() == d && c0 <= c1 && c1 <= d);
    if let Some(u) = &u {
        assert!(u.len() == d);
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected on this CPU just above; the lengths the kernel
        // indexes (4 rows of d, chunk c0..c1 ≤ d) were asserted above.
        return unsafe { avx2::update_collapse(d, xt, y, m, pre, c0, c1, xn, u) };
    }
    scalar::update_collapse::<false>(d, xt, y, m, pre, c0, c1, xn, u)
}

/// u[c0..c1] = Σ_j pre_j·X[j]; returns Σ u² over the range.
#[inline]
fn collapse(d: usize, xt: &[f32], pre: &[f32; HC], c0: usize, c1: usize, u: &mut [f32]) -> f32 {
    assert!(xt.len() == HC * d && u.len() == d && c0 <= c1 && c1 <= d);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2+FMA detected; lengths asserted above.
        return unsafe { avx2::collapse(d, xt, pre, c0, c1, u) };
    }
    scalar::collapse::<false>(d, xt, pre, c0, c1, u)
}

/// acc[r] += Σ_j Σ_{k∈c0..c1} hc_fn[r, j·d + k]·X[j][k] for r < 24; acc[24] += Σ X².
#[inline]
fn dot_mix(d: usize, hc_fn: &[f32], xt: &[f32], c0: usize, c1: usize, acc: &mut [f32]) {
    assert!(hc_fn.len() == MIX * HC * d && xt.len() == HC * d && acc.len() == MIX_ACC);
    assert!(c0 <= c1 && c1 <= d);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2+FMA detected; lengths asserted above.
        return unsafe { avx2::dot_mix(d, hc_fn, xt, c0, c1, acc) };
    }
    scalar::dot_mix::<false>(d, hc_fn, xt, c0, c1, acc)
}

/// Σ v[c0..c1]² (same lane order as the sums inside the other kernels).
#[inline]
fn sumsq(v: &[f32], c0: usize, c1: usize) -> f32 {
    assert!(c0 <= c1 && c1 <= v.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2+FMA detected; range asserted above.
        return unsafe { avx2::sumsq(v, c0, c1) };
    }
    scalar::sumsq::<false>(v, c0, c1)
}

/// v[k] = (v[k]·s)·w[k].
#[inline]
fn scale_by(v: &mut [f32], s: f32, w: &[f32]) {
    assert!(v.len() == w.len());
    for (a, &b) in v.iter_mut().zip(w) {
        *a = *a * s * b;
    }
}

mod scalar {
    use super::{TokenMix, HC, MIX};

    #[inline(always)]
    pub fn madd<const F: bool>(a: f32, b: f32, c: f32) -> f32 {
        if F {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn update_collapse<const F: bool>(
        d: usize,
        xt: &[f32],
        y: &[f32],
        m: &TokenMix,
        pre: Option<&[f32; HC]>,
        c0: usize,
        c1: usize,
        xn: &mut [f32],
        mut u: Option<&mut [f32]>,
    ) -> f32 {
        let mut su = 0.0f32;
        for k in c0..c1 {
            let mut v = [0.0f32; HC];
            for (j, vj) in v.iter_mut().enumerate() {
                let mut a = m.post[j] * y[k];
                for i in 0..HC {
                    a = madd::<F>(m.comb[i * HC + j], xt[i * d + k], a);
                }
                *vj = a;
                xn[j * d + k] = a;
            }
            if let (Some(p), Some(u)) = (pre, u.as_deref_mut()) {
                let mut s = p[0] * v[0];
                for j in 1..HC {
                    s = madd::<F>(p[j], v[j], s);
                }
                u[k] = s;
                su = madd::<F>(s, s, su);
            }
        }
        su
    }

    #[inline(always)]
    pub fn collapse<const F: bool>(
        d: usize,
        xt: &[f32],
        pre: &[f32; HC],
        c0: usize,
        c1: usize,
        u: &mut [f32],
    ) -> f32 {
        let mut su = 0.0f32;
        for k in c0..c1 {
            let mut s = pre[0] * xt[k];
            for j in 1..HC {
                s = madd::<F>(pre[j], xt[j * d + k], s);
            }
            u[k] = s;
            su = madd::<F>(s, s, su);
        }
        su
    }

    #[inline(always)]
    pub fn dot_mix<const F: bool>(
        d: usize,
        hc_fn: &[f32],
        xt: &[f32],
        c0: usize,
        c1: usize,
        acc: &mut [f32],
    ) {
        for (r, a) in acc[..MIX].iter_mut().enumerate() {
            let row = &hc_fn[r * HC * d..(r + 1) * HC * d];
            let mut s = 0.0f32;
            for j in 0..HC {
                for k in c0..c1 {
                    s = madd::<F>(row[j * d + k], xt[j * d + k], s);
                }
            }
            *a += s;
        }
        let mut s = 0.0f32;
        for j in 0..HC {
            for k in c0..c1 {
                s = madd::<F>(xt[j * d + k], xt[j * d + k], s);
            }
        }
        acc[MIX] += s;
    }

    #[inline(always)]
    pub fn sumsq<const F: bool>(v: &[f32], c0: usize, c1: usize) -> f32 {
        v[c0..c1].iter().fold(0.0f32, |s, &x| madd::<F>(x, x, s))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{scalar, TokenMix, HC, MIX};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // Fixed pairing order so every kernel reduces its lanes the same way.
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Vector part ends at the last multiple of 8 after c0; the scalar tail uses the same FMA chain.
    #[inline(always)]
    fn split(c0: usize, c1: usize) -> usize {
        c0 + (c1 - c0) / 8 * 8
    }

    /// SAFETY (callers): AVX2+FMA present; `xt`, `xn` hold 4·d, `y` and `u` hold d, c0 ≤ c1 ≤ d.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn update_collapse(
        d: usize,
        xt: &[f32],
        y: &[f32],
        m: &TokenMix,
        pre: Option<&[f32; HC]>,
        c0: usize,
        c1: usize,
        xn: &mut [f32],
        mut u: Option<&mut [f32]>,
    ) -> f32 {
        let cv = split(c0, c1);
        let xp = xt.as_ptr();
        let yp = y.as_ptr();
        let op = xn.as_mut_ptr();
        let post = [
            _mm256_set1_ps(m.post[0]),
            _mm256_set1_ps(m.post[1]),
            _mm256_set1_ps(m.post[2]),
            _mm256_set1_ps(m.post[3]),
        ];
        let mut cb = [_mm256_setzero_ps(); HC * HC];
        for (c, &v) in cb.iter_mut().zip(&m.comb) {
            *c = _mm256_set1_ps(v);
        }
        let mut acc = _mm256_setzero_ps();
        let pv = pre.map(|p| {
            [
                _mm256_set1_ps(p[0]),
                _mm256_set1_ps(p[1]),
                _mm256_set1_ps(p[2]),
                _mm256_set1_ps(p[3]),
            ]
        });
        let up = u.as_deref_mut().map(|u| u.as_mut_ptr());
        let mut k = c0;
        while k < cv {
            // SAFETY: k + 8 ≤ cv ≤ c1 ≤ d, so every load/store stays inside its row.
            let x = [
                _mm256_loadu_ps(xp.add(k)),
                _mm256_loadu_ps(xp.add(d + k)),
                _mm256_loadu_ps(xp.add(2 * d + k)),
                _mm256_loadu_ps(xp.add(3 * d + k)),
            ];
            let yv = _mm256_loadu_ps(yp.add(k));
            let mut v = [_mm256_setzero_ps(); HC];
            for j in 0..HC {
                let mut a = _mm256_mul_ps(post[j], yv);
                for i in 0..HC {
                    a = _mm256_fmadd_ps(cb[i * HC + j], x[i], a);
                }
                v[j] = a;
                _mm256_storeu_ps(op.add(j * d + k), a);
            }
            if let (Some(p), Some(up)) = (pv, up) {
                let mut s = _mm256_mul_ps(p[0], v[0]);
                for j in 1..HC {
                    s = _mm256_fmadd_ps(p[j], v[j], s);
                }
                _mm256_storeu_ps(up.add(k), s);
                acc = _mm256_fmadd_ps(s, s, acc);
            }
            k += 8;
        }
        let tail = scalar::update_collapse::<true>(d, xt, y, m, pre, cv, c1, xn, u);
        hsum(acc) + tail
    }

    /// SAFETY (callers): AVX2+FMA present; `xt` holds 4·d, `u` holds d, c0 ≤ c1 ≤ d.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn collapse(
        d: usize,
        xt: &[f32],
        pre: &[f32; HC],
        c0: usize,
        c1: usize,
        u: &mut [f32],
    ) -> f32 {
        let cv = split(c0, c1);
        let xp = xt.as_ptr();
        let up = u.as_mut_ptr();
        let p = [
            _mm256_set1_ps(pre[0]),
            _mm256_set1_ps(pre[1]),
            _mm256_set1_ps(pre[2]),
            _mm256_set1_ps(pre[3]),
        ];
        let mut acc = _mm256_setzero_ps();
        let mut k = c0;
        while k < cv {
            // SAFETY: k + 8 ≤ d inside every row.
            let mut s = _mm256_mul_ps(p[0], _mm256_loadu_ps(xp.add(k)));
            for j in 1..HC {
                s = _mm256_fmadd_ps(p[j], _mm256_loadu_ps(xp.add(j * d + k)), s);
            }
            _mm256_storeu_ps(up.add(k), s);
            acc = _mm256_fmadd_ps(s, s, acc);
            k += 8;
        }
        hsum(acc) + scalar::collapse::<true>(d, xt, pre, cv, c1, u)
    }

    /// SAFETY (callers): AVX2+FMA present; `hc_fn` holds 24·4·d, `xt` 4·d, `acc` 25; c0 ≤ c1 ≤ d.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_mix(
        d: usize,
        hc_fn: &[f32],
        xt: &[f32],
        c0: usize,
        c1: usize,
        acc: &mut [f32],
    ) {
        let cv = split(c0, c1);
        let fp = hc_fn.as_ptr();
        let xp = xt.as_ptr();
        let row = HC * d;
        // Eight rows at a time: 8 accumulators + the shared X vector stay in registers.
        for g in 0..MIX / 8 {
            let mut a = [_mm256_setzero_ps(); 8];
            for j in 0..HC {
                let mut k = c0;
                while k < cv {
                    // SAFETY: row (8g+q) < 24 and j·d + k + 8 ≤ 4·d.
                    let xv = _mm256_loadu_ps(xp.add(j * d + k));
                    for (q, aq) in a.iter_mut().enumerate() {
                        let f = _mm256_loadu_ps(fp.add((8 * g + q) * row + j * d + k));
                        *aq = _mm256_fmadd_ps(f, xv, *aq);
                    }
                    k += 8;
                }
            }
            for (q, aq) in a.iter().enumerate() {
                let r = 8 * g + q;
                let mut s = hsum(*aq);
                for j in 0..HC {
                    for k in cv..c1 {
                        s = hc_fn[r * row + j * d + k].mul_add(xt[j * d + k], s);
                    }
                }
                acc[r] += s;
            }
        }
        let mut sq = _mm256_setzero_ps();
        for j in 0..HC {
            let mut k = c0;
            while k < cv {
                // SAFETY: j·d + k + 8 ≤ 4·d.
                let xv = _mm256_loadu_ps(xp.add(j * d + k));
                sq = _mm256_fmadd_ps(xv, xv, sq);
                k += 8;
            }
        }
        let mut s = hsum(sq);
        for j in 0..HC {
            for k in cv..c1 {
                s = xt[j * d + k].mul_add(xt[j * d + k], s);
            }
        }
        acc[MIX] += s;
    }

    /// SAFETY (callers): AVX2+FMA present; c0 ≤ c1 ≤ v.len().
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sumsq(v: &[f32], c0: usize, c1: usize) -> f32 {
        let cv = split(c0, c1);
        let p = v.as_ptr();
        let mut acc = _mm256_setzero_ps();
        let mut k = c0;
        while k < cv {
            // SAFETY: k + 8 ≤ v.len().
            let x = _mm256_loadu_ps(p.add(k));
            acc = _mm256_fmadd_ps(x, x, acc);
            k += 8;
        }
        hsum(acc) + scalar::sumsq::<true>(v, cv, c1)
    }
}

// ---- coefficient epilogue ------------------------------------------------------------------------

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// From the raw dots `acc[0..24]` = hc_fn·vec(X) and `acc[24]` = Σ X² of one token: pre, post and
/// the Sinkhorn-normalized comb (SPEC §4; the last Sinkhorn step normalizes columns).
pub fn coeffs_from_mix(
    p: &MhcParams,
    w: &MixWeights,
    acc: &[f32],
    pre: &mut [f32],
    post: &mut [f32],
    comb: &mut [f32],
) {
    let r = 1.0 / (acc[MIX] / (HC * p.hidden) as f32 + p.rms_eps).sqrt();
    let mix = |i: usize| acc[i] * r;
    for i in 0..HC {
        pre[i] = sigmoid(mix(i) * w.scale[0] + w.base[i]) + p.hc_eps;
        post[i] = p.post_mult * sigmoid(mix(HC + i) * w.scale[1] + w.base[HC + i]);
    }
    let mut c = [[0.0f32; HC]; HC];
    for (i, row) in c.iter_mut().enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            let k = 2 * HC + i * HC + j;
            *v = mix(k) * w.scale[2] + w.base[k];
        }
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut s = 0.0;
        for v in row.iter_mut() {
            *v = (*v - m).exp();
            s += *v;
        }
        for v in row.iter_mut() {
            *v = *v / s + p.hc_eps;
        }
    }
    let cols = |c: &mut [[f32; HC]; HC]| {
        for j in 0..HC {
            let s: f32 = (0..HC).map(|i| c[i][j]).sum::<f32>() + p.hc_eps;
            (0..HC).for_each(|i| c[i][j] /= s);
        }
    };
    cols(&mut c);
    for _ in 1..p.sinkhorn_iters {
        for row in c.iter_mut() {
            let s: f32 = row.iter().sum::<f32>() + p.hc_eps;
            row.iter_mut().for_each(|v| *v /= s);
        }
        cols(&mut c);
    }
    for (i, row) in c.iter().enumerate() {
        comb[i * HC..(i + 1) * HC].copy_from_slice(row);
    }
}

fn epilogue(p: &MhcParams, w: &MixWeights, acc: &[f32], out: &mut CoeffsMut) {
    out.pre
        .par_chunks_mut(HC)
        .zip(out.post.par_chunks_mut(HC))
        .zip(out.comb.par_chunks_mut(HC * HC))
        .zip(acc.par_chunks(MIX_ACC))
        .for_each(|(((pre, post), comb), a)| coeffs_from_mix(p, w, a, pre, post, comb));
}

fn token_mix(upd: &Option<PostUpdate>, t: usize) -> TokenMix {
    match upd {
        Some(u) => {
            let mut m = TokenMix {
                post: [0.0; HC],
                comb: [0.0; HC * HC],
            };
            m.post.copy_from_slice(&u.post[t * HC..(t + 1) * HC]);
            m.comb
                .copy_from_slice(&u.comb[t * HC * HC..(t + 1) * HC * HC]);
            m
        }
        None => unreachable!("callers handle the first site without an update"),
    }
}

fn pre_of(pre: &[f32], t: usize) -> [f32; HC] {
    let mut p = [0.0; HC];
    p.copy_from_slice(&pre[t * HC..(t + 1) * HC]);
    p
}

// ---- the fused single pass -----------------------------------------------------------------------

/// One boundary in a single pass over the streams (Mega-mHC order, SPEC §4): reads X and y once,
/// writes X' and the new site input once; the coefficient GEMV runs on X' chunks while they are in
/// L1. See the module docs of [`super`] for the math and shapes.
///
/// Errors: [`crate::Error::Shape`] / [`crate::Error::Invalid`] for bad shapes or parameters.
pub fn fused_boundary(p: &MhcParams, inp: &BoundaryIn, out: &mut BoundaryOut) -> Result<()> {
    let t = inp.validate(p)?;
    out.validate(p, t, inp.next.is_some())?;
    let d = p.hidden;
    // Raw dots + sum of squares per token (100 B each); zipped even when unused to keep one loop.
    let mut acc = vec![0.0f32; t * MIX_ACC];
    let tiles = out
        .x_new
        .par_chunks_mut(TILE * HC * d)
        .zip(out.layer_in.par_chunks_mut(TILE * d))
        .zip(acc.par_chunks_mut(TILE * MIX_ACC))
        .enumerate();
    tiles.for_each(|(ti, ((xn_tile, u_tile), acc_tile))| {
        let t0 = ti * TILE;
        let nt = u_tile.len() / d;
        let mut su = [0.0f32; TILE];
        let mut c0 = 0;
        while c0 < d {
            let c1 = (c0 + CHUNK).min(d);
            for tt in 0..nt {
                let tok = t0 + tt;
                let xt = &inp.x[tok * HC * d..(tok + 1) * HC * d];
                let xn = &mut xn_tile[tt * HC * d..(tt + 1) * HC * d];
                let u = &mut u_tile[tt * d..(tt + 1) * d];
                let pre = pre_of(inp.pre_prev, tok);
                su[tt] += match &inp.update {
                    Some(upd) => {
                        let m = token_mix(&inp.update, tok);
                        let y = &upd.y[tok * d..(tok + 1) * d];
                        update_collapse(d, xt, y, &m, Some(&pre), c0, c1, xn, Some(u))
                    }
                    None => {
                        for j in 0..HC {
                            xn[j * d + c0..j * d + c1].copy_from_slice(&xt[j * d + c0..j * d + c1]);
                        }
                        collapse(d, xn, &pre, c0, c1, u)
                    }
                };
                if let Some(w) = &inp.next {
                    let a = &mut acc_tile[tt * MIX_ACC..(tt + 1) * MIX_ACC];
                    dot_mix(d, w.hc_fn, xn, c0, c1, a);
                }
            }
            c0 = c1;
        }
        for (tt, &s) in su.iter().enumerate().take(nt) {
            let r = 1.0 / (s / d as f32 + p.rms_eps).sqrt();
            scale_by(&mut u_tile[tt * d..(tt + 1) * d], r, inp.norm);
        }
    });
    if let (Some(w), Some(c)) = (&inp.next, out.coeffs.as_mut()) {
        epilogue(p, w, &acc, c);
    }
    Ok(())
}

// ---- the unfused passes --------------------------------------------------------------------------

/// Pass 1: X' = post ⊙ y + combᵀ·X for every token (`x` `[T,4,d]` → `x_new` `[T,4,d]`).
pub fn post_update(p: &MhcParams, x: &[f32], upd: &PostUpdate, x_new: &mut [f32]) {
    let d = p.hidden;
    let u = Some(*upd);
    x_new
        .par_chunks_mut(HC * d)
        .zip(x.par_chunks(HC * d))
        .enumerate()
        .for_each(|(tok, (xn, xt))| {
            let m = token_mix(&u, tok);
            let y = &upd.y[tok * d..(tok + 1) * d];
            let mut c0 = 0;
            while c0 < d {
                let c1 = (c0 + CHUNK).min(d);
                update_collapse(d, xt, y, &m, None, c0, c1, xn, None);
                c0 = c1;
            }
        });
}

/// Pass 2: the new coefficients of every token of `x` `[T,4,d]` (GEMV `hc_fn·vec(X)`, the RMS
/// statistic, sigmoids and Sinkhorn).
pub fn coefficients(p: &MhcParams, w: &MixWeights, x: &[f32], out: &mut CoeffsMut) {
    let d = p.hidden;
    let t = x.len() / (HC * d);
    let mut acc = vec![0.0f32; t * MIX_ACC];
    acc.par_chunks_mut(TILE * MIX_ACC)
        .zip(x.par_chunks(TILE * HC * d))
        .for_each(|(a, xs)| {
            let nt = xs.len() / (HC * d);
            let mut c0 = 0;
            while c0 < d {
                let c1 = (c0 + CHUNK).min(d);
                for tt in 0..nt {
                    let xt = &xs[tt * HC * d..(tt + 1) * HC * d];
                    dot_mix(
                        d,
                        w.hc_fn,
                        xt,
                        c0,
                        c1,
                        &mut a[tt * MIX_ACC..(tt + 1) * MIX_ACC],
                    );
                }
                c0 = c1;
            }
        });
    epilogue(p, w, &acc, out);
}

/// Pass 3: u = Σ_i pre_i·X_i for every token (`x` `[T,4,d]`, `pre` `[T,4]` → `u` `[T,d]`).
pub fn collapse_pass(p: &MhcParams, x: &[f32], pre: &[f32], u: &mut [f32]) {
    let d = p.hidden;
    u.par_chunks_mut(d)
        .zip(x.par_chunks(HC * d))
        .enumerate()
        .for_each(|(tok, (ur, xt))| {
            let pr = pre_of(pre, tok);
            let mut c0 = 0;
            while c0 < d {
                let c1 = (c0 + CHUNK).min(d);
                collapse(d, xt, &pr, c0, c1, ur);
                c0 = c1;
            }
        });
}

/// Pass 4: RMSNorm in place, `u[t] = u[t]·rsqrt(mean(u[t]²) + eps)·w` (`u` `[T,d]`, `w` `[d]`).
pub fn rms_norm_pass(p: &MhcParams, u: &mut [f32], w: &[f32]) {
    let d = p.hidden;
    u.par_chunks_mut(d).for_each(|row| {
        let mut s = 0.0f32;
        let mut c0 = 0;
        while c0 < d {
            let c1 = (c0 + CHUNK).min(d);
            s += sumsq(row, c0, c1);
            c0 = c1;
        }
        let r = 1.0 / (s / d as f32 + p.rms_eps).sqrt();
        scale_by(row, r, w);
    });
}

/// One boundary as four separate passes (vLLM's unfused Hopper path): post update, coefficients
/// of X', shifted collapse, RMSNorm. Same contract as [`fused_boundary`].
///
/// Errors: as [`fused_boundary`].
pub fn unfused_boundary(p: &MhcParams, inp: &BoundaryIn, out: &mut BoundaryOut) -> Result<()> {
    let t = inp.validate(p)?;
    out.validate(p, t, inp.next.is_some())?;
    match &inp.update {
        Some(upd) => post_update(p, inp.x, upd, out.x_new),
        None => out.x_new.copy_from_slice(inp.x),
    }
    if let (Some(w), Some(c)) = (&inp.next, out.coeffs.as_mut()) {
        coefficients(p, w, out.x_new, c);
    }
    collapse_pass(p, out.x_new, inp.pre_prev, out.layer_in);
    rms_norm_pass(p, out.layer_in, inp.norm);
    Ok(())
}
