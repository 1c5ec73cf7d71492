//! The fast CPU path of mHC: threads over token tiles (rayon), AVX-512 / AVX2+FMA inner loops picked
//! at run time through [`crate::isa::level`] (`CSA2_ISA=avx2|scalar` caps it), scalar fallback.
//!
//! Both paths share the same inner kernels, so they differ only in how often the streams travel
//! through memory:
//! - [`unfused_boundary`]: post update (read X, y; write X'), coefficient pass (read X'), collapse
//!   (read X', write u), RMSNorm (read u, write the sublayer input): (4n+4)·d values per token.
//! - [`fused_boundary`]: per token tile and per d-chunk, one pass computes X' (written once), the
//!   shifted collapse u and its sum of squares, then the `hc_fn · vec(X')` GEMV plus the mix
//!   statistic reads that chunk of the tile's X' back from L1/L2 (≤ 16 tokens × 4 × 2 KiB), and at
//!   the end the norm scales u while the tile's rows are still in L2: (2n+2)·d values per token
//!   through memory. Both paths give the same bits (same kernels, same chunk-wise sums).
//!
//! The coefficient GEMV (`hc_fn [24, 4d] · vec(X')`, 24·4d FMAs per token, ≈ 80 % of the arithmetic)
//! is one kernel, [`mix_block`], called by both paths on the same token tiles and d-chunks: it
//! register-blocks over tokens (4 tokens × 6 rows of accumulators with AVX-512) so one `hc_fn` load
//! feeds 4 FMAs, and each `hc_fn` chunk is streamed once per tile, not once per token.

// Index loops mirror the (i, j) subscripts of the formulas in docs/SPEC.md §4.
#![allow(clippy::needless_range_loop)]

use super::{BoundaryIn, BoundaryOut, CoeffsMut, MhcParams, MixWeights, PostUpdate, HC, MIX};
use crate::error::Result;
use crate::isa::{level, Isa};
use crate::ops::simd::{multiversion, Vf32};
use rayon::prelude::*;

/// Most tokens per tile: one `hc_fn` chunk (24 × 4 × [`CHUNK`] f32 = 192 KiB) serves this many
/// tokens; the tile's X' (`MAX_TILE` × 4·d f32) stays in L2/L3 while the GEMV reads it.
/// (Tuned at d = 5120 against 8/32 tokens and 256/1024 dims, `benches/mhc.rs`.)
const MAX_TILE: usize = 16;
/// Dims per chunk of a stream row (all 4 streams of a token chunk = 4 KiB, L1-resident).
const CHUNK: usize = 512;
/// Per-token scratch: the 24 dot products then the sum of squares of X'.
const MIX_ACC: usize = MIX + 1;

// ---- inner kernels: dispatch --------------------------------------------------------------------

/// Tokens per tile for `t` tokens: at most [`MAX_TILE`], few enough that every rayon thread gets a
/// tile, a multiple of the 4-token GEMV group where that does not starve a thread.
fn tile_for(t: usize) -> usize {
    let per = t.div_ceil(rayon::current_num_threads().max(1)).max(1);
    if per <= 4 {
        per
    } else {
        (per.div_ceil(4) * 4).min(MAX_TILE)
    }
}

/// Coefficients of a post update for one token, plus the carried pre for the fused collapse.
#[derive(Clone, Copy)]
struct TokenMix {
    post: [f32; HC],
    comb: [f32; HC * HC],
}

/// Where the fused path's GEMV wants one token's X' chunk besides the output rows: stream j's
/// dims c0..c1 at `buf[j·stride + (k − c0)]` (the token's column of a [`XTile`]), so the update
/// writes X' there from its registers and the GEMV needs no copy pass over it.
struct ChunkCopy<'a> {
    buf: &'a mut [f32],
    stride: usize,
    c0: usize,
    /// Write X' only here, not to the output rows (the fused path streams the tile out to them
    /// after the GEMV, with non-temporal stores).
    only: bool,
}

/// X'[j][c0..c1] = post_j·y + Σ_i C[i,j]·X[i]; optionally u = Σ_j pre_j·X'[j] and returns Σ u²;
/// optionally also writes X' into `cp`. `xt`/`xn` are one token's 4 streams (4d), `y`/`u` one
/// token's row (d).
///
/// Written once over the lane count ([`multiversion!`]: 16 lanes with AVX-512, 8 with AVX2, the
/// portable 8): every X' and u value is the same FMA chain at any width, and Σ u² is summed in
/// 8-lane blocks in order ([`Vf32::fma_sq8`]), so the 16-lane kernel gives the 8-lane kernel's
/// bits while issuing half the instructions.
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
    cp: Option<&mut ChunkCopy>,
) -> f32 {
    multiversion!(
        uc_mv,
        fn(
            d: usize,
            xt: &[f32],
            y: &[f32],
            m: &TokenMix,
            pre: Option<&[f32; HC]>,
            c0: usize,
            c1: usize,
            xn: &mut [f32],
            u: Option<&mut [f32]>,
            cp: Option<&mut ChunkCopy>,
        ) -> f32,
        update_collapse_body
    );
    assert!(xt.len() == HC * d && xn.len() == HC * d && y.len() == d && c0 <= c1 && c1 <= d);
    if let Some(u) = &u {
        assert!(u.len() == d);
    }
    if let Some(cp) = &cp {
        assert!(cp.c0 <= c0 && (c1 == c0 || cp.buf.len() >= (HC - 1) * cp.stride + c1 - cp.c0));
    }
    uc_mv(d, xt, y, m, pre, c0, c1, xn, u, cp)
}

/// One `W::L`-dim step of [`update_collapse`] at dim k; returns the Σ u² accumulator.
///
/// SAFETY (callers): k + W::L ≤ d for the 4 rows at `xp`/`op` (stride d) and the rows at `yp`,
/// `up`; `cp`, when given, holds stream j's dim k at `cp.0 + j·cp.1 + k − c0` for k < c1.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn uc_step<W: Vf32>(
    d: usize,
    xp: *const f32,
    yp: *const f32,
    op: Option<*mut f32>,
    up: Option<*mut f32>,
    cp: Option<(*mut f32, usize, usize)>,
    k: usize,
    post: &[W; HC],
    cb: &[W; HC * HC],
    pv: Option<&[W; HC]>,
    acc: W::A8,
) -> W::A8 {
    // SAFETY: in bounds by the caller's contract.
    unsafe {
        let x = [
            W::load(xp.add(k)),
            W::load(xp.add(d + k)),
            W::load(xp.add(2 * d + k)),
            W::load(xp.add(3 * d + k)),
        ];
        let yv = W::load(yp.add(k));
        let mut v = [yv; HC];
        for j in 0..HC {
            let mut a = W::mul(post[j], yv);
            for i in 0..HC {
                a = W::fmadd(cb[i * HC + j], x[i], a);
            }
            v[j] = a;
            if let Some(op) = op {
                a.store(op.add(j * d + k));
            }
            if let Some((cpb, stride, cc0)) = cp {
                a.store(cpb.add(j * stride + k - cc0));
            }
        }
        if let (Some(p), Some(up)) = (pv, up) {
            let mut s = W::mul(p[0], v[0]);
            for j in 1..HC {
                s = W::fmadd(p[j], v[j], s);
            }
            s.store(up.add(k));
            return s.fma_sq8(acc);
        }
        acc
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn update_collapse_body<V: Vf32>(
    d: usize,
    xt: &[f32],
    y: &[f32],
    m: &TokenMix,
    pre: Option<&[f32; HC]>,
    c0: usize,
    c1: usize,
    xn: &mut [f32],
    mut u: Option<&mut [f32]>,
    mut cp: Option<&mut ChunkCopy>,
) -> f32
where
    V::A8: Vf32<A8 = V::A8>,
{
    let (xp, yp) = (xt.as_ptr(), y.as_ptr());
    let op = (!cp.as_ref().is_some_and(|c| c.only)).then_some(xn.as_mut_ptr());
    let up = u.as_deref_mut().map(|u| u.as_mut_ptr());
    let cpp = cp
        .as_deref_mut()
        .map(|c| (c.buf.as_mut_ptr(), c.stride, c.c0));
    let mut acc = V::A8::splat(0.0);
    let mut k = c0;
    let (post, cb) = (splats::<V, HC>(&m.post), splats::<V, { HC * HC }>(&m.comb));
    let pv = pre.map(splats::<V, HC>);
    while k + V::L <= c1 {
        // SAFETY: k + L ≤ c1 ≤ d inside every row; `cp` was checked by `update_collapse`.
        acc = unsafe { uc_step::<V>(d, xp, yp, op, up, cpp, k, &post, &cb, pv.as_ref(), acc) };
        k += V::L;
    }
    if V::L > 8 && k + 8 <= c1 {
        // The 8-dim remainder of a 16-lane kernel at 8 lanes, as the 8-lane kernel would run it.
        let (post, cb) = (
            splats::<V::A8, HC>(&m.post),
            splats::<V::A8, { HC * HC }>(&m.comb),
        );
        let pv = pre.map(splats::<V::A8, HC>);
        // SAFETY: k + 8 ≤ c1, as above.
        acc = unsafe { uc_step::<V::A8>(d, xp, yp, op, up, cpp, k, &post, &cb, pv.as_ref(), acc) };
        k += 8;
    }
    let tail = if V::FMA {
        scalar::update_collapse::<true>(d, xt, y, m, pre, k, c1, xn, u, cp)
    } else {
        scalar::update_collapse::<false>(d, xt, y, m, pre, k, c1, xn, u, cp)
    };
    acc.hsum() + tail
}

/// Each value broadcast to a vector. (A loop, not `[f32; N]::map`, which the compiler left as an
/// out-of-line call per token and chunk in the update kernel.)
#[inline(always)]
fn splats<V: Vf32, const N: usize>(a: &[f32; N]) -> [V; N] {
    let mut v = [V::splat(0.0); N];
    for (v, &a) in v.iter_mut().zip(a) {
        *v = V::splat(a);
    }
    v
}

/// u[c0..c1] = Σ_j pre_j·X[j]; returns Σ u² over the range (written once over the lane count,
/// as [`update_collapse`]).
#[inline]
fn collapse(d: usize, xt: &[f32], pre: &[f32; HC], c0: usize, c1: usize, u: &mut [f32]) -> f32 {
    multiversion!(
        collapse_mv,
        fn(d: usize, xt: &[f32], pre: &[f32; HC], c0: usize, c1: usize, u: &mut [f32]) -> f32,
        collapse_body
    );
    assert!(xt.len() == HC * d && u.len() == d && c0 <= c1 && c1 <= d);
    collapse_mv(d, xt, pre, c0, c1, u)
}

/// One `W::L`-dim step of [`collapse`]. SAFETY (callers): k + W::L ≤ d.
#[inline(always)]
unsafe fn collapse_step<W: Vf32>(
    d: usize,
    xp: *const f32,
    up: *mut f32,
    k: usize,
    p: &[W; HC],
    acc: W::A8,
) -> W::A8 {
    // SAFETY: k + L ≤ d inside every row (caller's contract).
    unsafe {
        let mut s = W::mul(p[0], W::load(xp.add(k)));
        for j in 1..HC {
            s = W::fmadd(p[j], W::load(xp.add(j * d + k)), s);
        }
        s.store(up.add(k));
        s.fma_sq8(acc)
    }
}

#[inline(always)]
fn collapse_body<V: Vf32>(
    d: usize,
    xt: &[f32],
    pre: &[f32; HC],
    c0: usize,
    c1: usize,
    u: &mut [f32],
) -> f32
where
    V::A8: Vf32<A8 = V::A8>,
{
    let (xp, up) = (xt.as_ptr(), u.as_mut_ptr());
    let mut acc = V::A8::splat(0.0);
    let mut k = c0;
    let p = pre.map(V::splat);
    while k + V::L <= c1 {
        // SAFETY: k + L ≤ c1 ≤ d.
        acc = unsafe { collapse_step::<V>(d, xp, up, k, &p, acc) };
        k += V::L;
    }
    if V::L > 8 && k + 8 <= c1 {
        let p = pre.map(V::A8::splat);
        // SAFETY: k + 8 ≤ c1 ≤ d.
        acc = unsafe { collapse_step::<V::A8>(d, xp, up, k, &p, acc) };
        k += 8;
    }
    let tail = if V::FMA {
        scalar::collapse::<true>(d, xt, pre, k, c1, u)
    } else {
        scalar::collapse::<false>(d, xt, pre, k, c1, u)
    };
    acc.hsum() + tail
}

// ---- the mix GEMV: hc_fn [24, 4d] · vec(X') for a block of tokens ---------------------------------

/// A tile's X' chunk stream-major (`[stream][token][CHUNK]`, 128 KiB at 16 tokens), the form the
/// packed GEMV reads: each token's 2 KiB stream segment is contiguous and the segments of one
/// stream are adjacent, instead of 20–80 KiB apart in the same L1 sets.
#[repr(align(64))]
struct XTile([f32; HC * MAX_TILE * CHUNK]);

impl XTile {
    /// A zeroed tile on the heap (one per fused tile, reused for every chunk).
    fn boxed() -> Box<XTile> {
        let layout = std::alloc::Layout::new::<XTile>();
        // SAFETY: the layout is XTile's own (non-zero size, align 64); all-zero bits are valid
        // f32 values, so the zeroed allocation is an initialized XTile that the Box then owns.
        unsafe {
            let p = std::alloc::alloc_zeroed(layout) as *mut XTile;
            if p.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            Box::from_raw(p)
        }
    }
}

/// Rows per group and lanes per vector of the packed layout (those of the AVX-512 kernel).
#[cfg(target_arch = "x86_64")]
const PACK_RG: usize = avx512::RG;
#[cfg(not(target_arch = "x86_64"))]
const PACK_RG: usize = 6;
const PACK_LANES: usize = 16;

/// `hc_fn [24, 4d]` (f32) rearranged once, in the order the AVX-512 mix kernel reads it: per
/// [`CHUNK`] of d, per group g of 6 rows, per stream j, per 16-dim block kb, the 6 rows' 16 values
/// (`[chunk][g][j][kb][q][16]`, the last block of a ragged chunk zero-padded; 64-byte aligned).
///
/// Why: in row-major `hc_fn` the 6 rows of a group are 4·d·4 B = 80 KiB apart and the streams
/// d·4 B = 20 KiB apart (multiples of 4 KiB at d = 5120), so every vector the kernel loads in one
/// step maps to the same L1 sets and they evict each other and the X' rows; packed, the 6 rows are
/// one sequential 384-byte read per step. Build it at parameter load ([`crate::weights::HcSite`])
/// and pass it as [`MixWeights::packed`]; it changes only where values are read from, not the
/// arithmetic, so results are bit-identical with or without it.
#[derive(Debug)]
pub struct PackedHcFn {
    d: usize,
    buf: Vec<f32>,
    /// Start of the 64-byte-aligned data inside `buf` (depends on where the allocator put `buf`).
    off: usize,
    /// Packed values from `off`.
    len: usize,
}

impl PackedHcFn {
    fn data(&self) -> &[f32] {
        &self.buf[self.off..self.off + self.len]
    }
}

/// Equal tables hold the same values for the same d, wherever their buffers were allocated.
impl PartialEq for PackedHcFn {
    fn eq(&self, other: &PackedHcFn) -> bool {
        self.d == other.d && self.data() == other.data()
    }
}

/// A clone re-aligns its own buffer (a plain copy of `buf` may land at another alignment).
impl Clone for PackedHcFn {
    fn clone(&self) -> PackedHcFn {
        let mut buf = vec![0.0f32; self.len + PACK_LANES];
        let off = buf.as_ptr().align_offset(64).min(PACK_LANES);
        buf[off..off + self.len].copy_from_slice(self.data());
        PackedHcFn {
            d: self.d,
            buf,
            off,
            len: self.len,
        }
    }
}

impl PackedHcFn {
    /// Packs `hc_fn [24, 4·hidden]` row-major f32.
    ///
    /// Errors: [`crate::Error::Shape`] when `hc_fn.len()` ≠ 24·4·hidden or hidden = 0.
    pub fn new(hidden: usize, hc_fn: &[f32]) -> Result<PackedHcFn> {
        let d = hidden;
        if d == 0 || hc_fn.len() != MIX * HC * d {
            return Err(crate::Error::shape(
                "hc_fn",
                format!(
                    "[{MIX}, {}] = {} f32 (hidden = {d} > 0)",
                    HC * d,
                    MIX * HC * d
                ),
                format!("{} f32", hc_fn.len()),
            ));
        }
        let chunks = d.div_ceil(CHUNK);
        let len = (chunks - 1) * MIX * HC * CHUNK
            + MIX * HC * (d - (chunks - 1) * CHUNK).div_ceil(PACK_LANES) * PACK_LANES;
        let mut buf = vec![0.0f32; len + PACK_LANES];
        let off = buf.as_ptr().align_offset(64).min(PACK_LANES);
        let out = &mut buf[off..off + len];
        for ci in 0..chunks {
            let c0 = ci * CHUNK;
            let c1 = (c0 + CHUNK).min(d);
            let nkb = (c1 - c0).div_ceil(PACK_LANES);
            let base = ci * MIX * HC * CHUNK;
            for g in 0..MIX / PACK_RG {
                for j in 0..HC {
                    for kb in 0..nkb {
                        for q in 0..PACK_RG {
                            let o = base + (((g * HC + j) * nkb + kb) * PACK_RG + q) * PACK_LANES;
                            let r = &hc_fn[(g * PACK_RG + q) * HC * d + j * d..][..d];
                            let k0 = c0 + kb * PACK_LANES;
                            let k1 = (k0 + PACK_LANES).min(c1);
                            out[o..o + (k1 - k0)].copy_from_slice(&r[k0..k1]);
                        }
                    }
                }
            }
        }
        Ok(PackedHcFn { d, buf, off, len })
    }

    /// Stream width d the table was packed for.
    pub fn hidden(&self) -> usize {
        self.d
    }

    /// The packed values of dims c0..c1 when that is a chunk of the packing grid of width `d`.
    fn chunk(&self, d: usize, c0: usize, c1: usize) -> Option<&[f32]> {
        if d != self.d || !c0.is_multiple_of(CHUNK) || c1 != (c0 + CHUNK).min(d) || c0 >= d {
            return None;
        }
        let len = MIX * HC * (c1 - c0).div_ceil(PACK_LANES) * PACK_LANES;
        let start = self.off + c0 / CHUNK * MIX * HC * CHUNK;
        Some(&self.buf[start..start + len])
    }
}

/// For every token `tt` of the contiguous block `xs [nt, 4, d]`:
/// `acc[tt·25 + r] += Σ_j Σ_{k∈c0..c1} hc_fn[r, j·d + k]·X[tt][j][k]` (r < 24) and
/// `acc[tt·25 + 24] += Σ_j Σ_k X[tt][j][k]²`.
///
/// The kernels register-block over tokens: each `hc_fn` vector load feeds one FMA per token of a
/// group (4 tokens × 6 rows = 24 accumulators with AVX-512, 3 × 4 with AVX2), so `hc_fn` travels
/// through L1 once per token group instead of once per token.
///
/// With `packed` (the prepared form of the same `hc_fn`) and a chunk of the packing grid
/// (c0 = i·[`CHUNK`], c1 = min(c0 + [`CHUNK`], d)), the AVX-512 kernel reads the packed chunk:
/// same result bits, sequential `hc_fn` loads.
#[inline]
fn mix_block(
    d: usize,
    hc_fn: &[f32],
    packed: Option<&PackedHcFn>,
    xs: &[f32],
    c0: usize,
    c1: usize,
    acc: &mut [f32],
) {
    mix_block_ahead(d, hc_fn, packed, xs, c0, c1, acc, Ahead::NONE)
}

/// Segments of the stream rows the next pass will touch, prefetched into L2 while the GEMV
/// computes (the overlap of the fused path's memory-bound update with its compute-bound GEMV):
/// each pointer starts `lines` cache lines of one row segment. A hint only: no result depends on
/// it, and prefetches never fault.
#[derive(Clone, Copy)]
pub(super) struct Ahead<'a> {
    segs: &'a [*const f32],
    lines: usize,
}

impl Ahead<'_> {
    const NONE: Ahead<'static> = Ahead {
        segs: &[],
        lines: 0,
    };
}

/// [`mix_block`], prefetching `ahead` under the packed AVX-512 kernel (ignored elsewhere).
#[allow(clippy::too_many_arguments)]
#[inline]
fn mix_block_ahead(
    d: usize,
    hc_fn: &[f32],
    packed: Option<&PackedHcFn>,
    xs: &[f32],
    c0: usize,
    c1: usize,
    acc: &mut [f32],
    ahead: Ahead,
) {
    assert!(hc_fn.len() == MIX * HC * d && xs.len().is_multiple_of(HC * d));
    assert!(acc.len() == xs.len() / (HC * d) * MIX_ACC && c0 <= c1 && c1 <= d);
    match level() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            if let Some(chunk) = packed.and_then(|pk| pk.chunk(d, c0, c1)) {
                // SAFETY: `level()` reported AVX-512F; `chunk` is the packed c0..c1 of a table of
                // this d (24·4·⌈(c1−c0)/16⌉·16 values, checked by `chunk`); lengths asserted above.
                return unsafe { avx512::mix_block_packed(d, chunk, xs, c0, c1, acc, ahead) };
            }
            // SAFETY: `level()` reported AVX-512F at run time; lengths asserted above.
            unsafe { avx512::mix_block(d, hc_fn, xs, c0, c1, acc) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: `level()` reported AVX2 + FMA at run time; lengths asserted above.
            unsafe { avx2::mix_block(d, hc_fn, xs, c0, c1, acc) }
        }
        _ => scalar::mix_block(d, hc_fn, xs, c0, c1, acc),
    }
}

/// The packed table when the fused path can hand the GEMV its X' tile directly: AVX-512 (the
/// packed kernel's ISA) and a table packed for this d.
fn direct_table<'a>(d: usize, w: &MixWeights<'a>) -> Option<&'a PackedHcFn> {
    let pk = w.packed?;
    (cfg!(target_arch = "x86_64") && level() == Isa::Avx512 && pk.hidden() == d).then_some(pk)
}

/// The GEMV of one chunk c0..c1 (on the packing grid) of `nt` ≤ [`MAX_TILE`] tokens whose X' is
/// already in `xc`: [`mix_block_ahead`]'s packed AVX-512 kernel, same bits, no copy pass.
#[allow(clippy::too_many_arguments)]
fn mix_tile(
    d: usize,
    pk: &PackedHcFn,
    xc: &XTile,
    nt: usize,
    c0: usize,
    c1: usize,
    acc: &mut [f32],
    ahead: Ahead,
) {
    let chunk = pk
        .chunk(d, c0, c1)
        .expect("fused chunks lie on the packing grid");
    assert!(nt <= MAX_TILE && acc.len() == nt * MIX_ACC);
    #[cfg(target_arch = "x86_64")]
    {
        assert!(level() == Isa::Avx512);
        // SAFETY: AVX-512F reported by `level()`; `chunk` is the packed c0..c1 of this d; `xc`
        // holds the nt tokens' X' of c0..c1 at (j·MAX_TILE + tt)·CHUNK (written by the update).
        unsafe { avx512::mix_tile_packed(chunk, xc, nt, c1 - c0, acc, ahead) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "direct_table is None off x86_64: {:?}",
        (xc.0.len(), chunk.len(), ahead.lines)
    )
}

/// The ends of the output rows' chunk segments that [`rows_from_tile`] has not written yet: per
/// token and stream (`tt·4 + j`), the previous chunk's last values that share a cache line with
/// the next chunk's first ones.
struct RowCarry {
    vals: [[f32; 16]; HC * MAX_TILE],
    len: [usize; HC * MAX_TILE],
}

impl RowCarry {
    fn new() -> RowCarry {
        RowCarry {
            vals: [[0.0; 16]; HC * MAX_TILE],
            len: [0; HC * MAX_TILE],
        }
    }
}

/// X' of chunk c0..c1 from the GEMV tile to the output rows (`rows` = the tile's `[nt, 4, d]`),
/// with non-temporal stores: X' is not read again in this boundary (the next one reads it after
/// the whole sublayer), so its lines go to memory without being read for ownership first and
/// without evicting the streams still to be updated. Values are copied, not recomputed.
///
/// A row need not start on a cache line, so a chunk boundary inside a row can fall inside a line:
/// the chunk's last values of that line wait in `carry` and go out with the next chunk's first
/// ones as one whole-line non-temporal store (ordinary stores of partial lines would first read
/// the line from memory). Only the lines at the ends of a row, which it shares with the
/// neighbouring rows, are written with ordinary stores. Chunks must come in order, c1 = d last.
#[allow(clippy::too_many_arguments)]
fn rows_from_tile(
    d: usize,
    xc: &XTile,
    nt: usize,
    c0: usize,
    c1: usize,
    rows: &mut [f32],
    carry: &mut RowCarry,
) {
    assert!(nt <= MAX_TILE && rows.len() >= nt * HC * d && c0 <= c1 && c1 - c0 <= CHUNK && c1 <= d);
    for tt in 0..nt {
        for j in 0..HC {
            let w = c1 - c0;
            let src = &xc.0[(j * MAX_TILE + tt) * CHUNK..][..w];
            let row = &mut rows[(tt * HC + j) * d..][..d];
            #[cfg(target_arch = "x86_64")]
            if level() == Isa::Avx512 {
                let r = tt * HC + j;
                let cn = carry.len[r];
                // Values from c0 to the row's next 64-byte line boundary (an f32 pointer is
                // 4-byte aligned, so the boundaries are 16 values apart).
                let hh = row[c0..].as_ptr().align_offset(64) % 16;
                let a = (c0 + hh).min(c1);
                if cn > 0 && cn + hh == 16 && c0 + hh <= c1 {
                    let mut line = [0.0f32; 16];
                    line[..cn].copy_from_slice(&carry.vals[r][..cn]);
                    line[cn..].copy_from_slice(&src[..hh]);
                    // SAFETY: AVX-512F reported by `level()`; row[c0 − cn..c0 + hh] is one
                    // 64-byte-aligned line inside the row.
                    unsafe { avx512::stream_line(&line, &mut row[c0 - cn..c0 + hh]) };
                } else {
                    row[c0 - cn..c0].copy_from_slice(&carry.vals[r][..cn]);
                    row[c0..a].copy_from_slice(&src[..a - c0]);
                }
                let e = a + (c1 - a) / 16 * 16;
                // SAFETY: AVX-512F reported by `level()`; equal lengths (row[a..e] starts on a
                // line, so every store is non-temporal).
                unsafe { avx512::copy_nt(&src[a - c0..e - c0], &mut row[a..e]) };
                if c1 < d && e < c1 {
                    carry.vals[r][..c1 - e].copy_from_slice(&src[e - c0..]);
                    carry.len[r] = c1 - e;
                } else {
                    row[e..c1].copy_from_slice(&src[e - c0..]);
                    carry.len[r] = 0;
                }
                continue;
            }
            let _ = &carry;
            row[c0..c1].copy_from_slice(src);
        }
    }
}

/// Orders this thread's non-temporal stores before whatever it does next (the rayon join that
/// publishes the tile's rows).
fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Σ v[c0..c1]² in 8-lane blocks (the order of the sums inside [`update_collapse`] and
/// [`collapse`], so the unfused RMSNorm pass and the fused path agree bit for bit).
#[inline]
fn sumsq(v: &[f32], c0: usize, c1: usize) -> f32 {
    multiversion!(
        sumsq_mv,
        fn(v: &[f32], c0: usize, c1: usize) -> f32,
        sumsq_body
    );
    assert!(c0 <= c1 && c1 <= v.len());
    sumsq_mv(v, c0, c1)
}

#[inline(always)]
fn sumsq_body<V: Vf32>(v: &[f32], c0: usize, c1: usize) -> f32
where
    V::A8: Vf32<A8 = V::A8>,
{
    let p = v.as_ptr();
    let mut acc = V::A8::splat(0.0);
    let mut k = c0;
    while k + V::L <= c1 {
        // SAFETY: k + L ≤ c1 ≤ v.len().
        acc = unsafe { V::load(p.add(k)) }.fma_sq8(acc);
        k += V::L;
    }
    if V::L > 8 && k + 8 <= c1 {
        // SAFETY: k + 8 ≤ c1 ≤ v.len().
        acc = unsafe { V::A8::load(p.add(k)) }.fma_sq8(acc);
        k += 8;
    }
    let tail = if V::FMA {
        scalar::sumsq::<true>(v, k, c1)
    } else {
        scalar::sumsq::<false>(v, k, c1)
    };
    acc.hsum() + tail
}

/// v[k] = (v[k]·s)·w[k] (two roundings per value at any lane count).
#[inline]
fn scale_by(v: &mut [f32], s: f32, w: &[f32]) {
    multiversion!(scale_mv, fn(v: &mut [f32], s: f32, w: &[f32]), scale_body);
    assert!(v.len() == w.len());
    scale_mv(v, s, w)
}

#[inline(always)]
fn scale_body<V: Vf32>(v: &mut [f32], s: f32, w: &[f32]) {
    let n = v.len() / V::L * V::L;
    let (vp, wp, sv) = (v.as_mut_ptr(), w.as_ptr(), V::splat(s));
    let mut k = 0;
    while k < n {
        // SAFETY: k + L ≤ n ≤ v.len() = w.len().
        unsafe { V::mul(V::mul(V::load(vp.add(k)), sv), V::load(wp.add(k))).store(vp.add(k)) };
        k += V::L;
    }
    for (a, &b) in v[n..].iter_mut().zip(&w[n..]) {
        *a = *a * s * b;
    }
}

mod scalar {
    use super::{ChunkCopy, TokenMix, HC, MIX, MIX_ACC};

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
        mut cp: Option<&mut ChunkCopy>,
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
                match cp.as_deref_mut() {
                    Some(cp) => {
                        cp.buf[j * cp.stride + k - cp.c0] = a;
                        if !cp.only {
                            xn[j * d + k] = a;
                        }
                    }
                    None => xn[j * d + k] = a,
                }
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

    /// Portable [`super::mix_block`]: one token at a time, sequential sums.
    pub fn mix_block(d: usize, hc_fn: &[f32], xs: &[f32], c0: usize, c1: usize, acc: &mut [f32]) {
        for (xt, a) in xs.chunks_exact(HC * d).zip(acc.chunks_exact_mut(MIX_ACC)) {
            for (r, ar) in a[..MIX].iter_mut().enumerate() {
                let row = &hc_fn[r * HC * d..(r + 1) * HC * d];
                let mut s = 0.0f32;
                for j in 0..HC {
                    for k in c0..c1 {
                        s += row[j * d + k] * xt[j * d + k];
                    }
                }
                *ar += s;
            }
            let mut s = 0.0f32;
            for j in 0..HC {
                for k in c0..c1 {
                    s += xt[j * d + k] * xt[j * d + k];
                }
            }
            a[MIX] += s;
        }
    }

    #[inline(always)]
    pub fn sumsq<const F: bool>(v: &[f32], c0: usize, c1: usize) -> f32 {
        v[c0..c1].iter().fold(0.0f32, |s, &x| madd::<F>(x, x, s))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{HC, MIX, MIX_ACC};
    use crate::ops::simd::F32x8;
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

    /// Rows per accumulator group and tokens per group of the AVX2 GEMV: 4 × 3 accumulators + 3
    /// X vectors + 1 `hc_fn` vector = the 16 ymm registers.
    const RG: usize = 4;
    const TB: usize = 3;

    /// SAFETY (callers): AVX2+FMA present; `hc_fn` holds 24·4·d, `xs` nt·4·d, `acc` nt·25,
    /// c0 ≤ c1 ≤ d.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn mix_block(
        d: usize,
        hc_fn: &[f32],
        xs: &[f32],
        c0: usize,
        c1: usize,
        acc: &mut [f32],
    ) {
        let nt = xs.len() / (HC * d);
        let mut t = 0;
        while t < nt {
            let b = (nt - t).min(TB);
            let x = &xs[t * HC * d..(t + b) * HC * d];
            let a = &mut acc[t * MIX_ACC..(t + b) * MIX_ACC];
            match b {
                3 => group::<3>(d, hc_fn, x, c0, c1, a),
                2 => group::<2>(d, hc_fn, x, c0, c1, a),
                _ => group::<1>(d, hc_fn, x, c0, c1, a),
            }
            t += b;
        }
    }

    #[inline(always)]
    unsafe fn group<const B: usize>(
        d: usize,
        hc_fn: &[f32],
        xs: &[f32],
        c0: usize,
        c1: usize,
        acc: &mut [f32],
    ) {
        let row = HC * d;
        let cv = split(c0, c1);
        let fp = hc_fn.as_ptr();
        let xp = xs.as_ptr();
        for g in 0..MIX / RG {
            let fg = fp.add(g * RG * row);
            let mut a = [[_mm256_setzero_ps(); B]; RG];
            let mut tail = [[0.0f32; B]; RG];
            for j in 0..HC {
                let mut k = j * d + c0;
                while k < j * d + cv {
                    // SAFETY: k + 8 ≤ j·d + c1 ≤ 4·d inside each token's and each row's 4·d.
                    let mut x = [_mm256_setzero_ps(); B];
                    for (bb, xv) in x.iter_mut().enumerate() {
                        *xv = _mm256_loadu_ps(xp.add(bb * row + k));
                    }
                    for (q, aq) in a.iter_mut().enumerate() {
                        let f = _mm256_loadu_ps(fg.add(q * row + k));
                        for (ab, xv) in aq.iter_mut().zip(&x) {
                            *ab = _mm256_fmadd_ps(f, *xv, *ab);
                        }
                    }
                    k += 8;
                }
                for k in j * d + cv..j * d + c1 {
                    for (q, tq) in tail.iter_mut().enumerate() {
                        for (bb, tb) in tq.iter_mut().enumerate() {
                            *tb = hc_fn[(g * RG + q) * row + k].mul_add(xs[bb * row + k], *tb);
                        }
                    }
                }
            }
            for q in 0..RG {
                for bb in 0..B {
                    acc[bb * MIX_ACC + g * RG + q] += hsum(a[q][bb]) + tail[q][bb];
                }
            }
        }
        for bb in 0..B {
            let xt = &xs[bb * row..(bb + 1) * row];
            let mut s = 0.0;
            for j in 0..HC {
                s += super::sumsq_body::<F32x8>(xt, j * d + c0, j * d + c1);
            }
            acc[bb * MIX_ACC + MIX] += s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{HC, MIX, MIX_ACC};
    use std::arch::x86_64::*;

    /// Rows per accumulator group and tokens per group: 6 × 4 accumulators + 4 X vectors + 1
    /// `hc_fn` vector = 29 of the 32 zmm registers; 10 loads feed 24 FMAs.
    pub(super) const RG: usize = 6;
    const TB: usize = 4;

    /// SAFETY (callers): AVX-512F present; `hc_fn` holds 24·4·d, `xs` nt·4·d, `acc` nt·25,
    /// c0 ≤ c1 ≤ d.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn mix_block(
        d: usize,
        hc_fn: &[f32],
        xs: &[f32],
        c0: usize,
        c1: usize,
        acc: &mut [f32],
    ) {
        blocks::<false>(d, hc_fn.as_ptr(), xs, c0, c1, acc, super::Ahead::NONE)
    }

    /// [`mix_block`] reading `hc_fn` from one chunk of a [`super::PackedHcFn`] (`chunk` = the
    /// packed values of c0..c1, laid out `[g][j][kb][q][16]`): the same FMAs in the same order, so
    /// the same bits, but the 6 rows of a group arrive as one sequential stream.
    ///
    /// SAFETY (callers): AVX-512F present; `chunk` holds 24·4·⌈(c1−c0)/16⌉·16 values, `xs` nt·4·d,
    /// `acc` nt·25, c0 ≤ c1 ≤ d.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn mix_block_packed(
        d: usize,
        chunk: &[f32],
        xs: &[f32],
        c0: usize,
        c1: usize,
        acc: &mut [f32],
        ahead: super::Ahead,
    ) {
        blocks::<true>(d, chunk.as_ptr(), xs, c0, c1, acc, ahead)
    }

    /// Tokens of one pass of [`tile_packed`] (the fused path's tile cap).
    const TILE: usize = super::MAX_TILE;
    use super::XTile;

    #[inline(always)]
    unsafe fn blocks<const P: bool>(
        d: usize,
        fp: *const f32,
        xs: &[f32],
        c0: usize,
        c1: usize,
        acc: &mut [f32],
        ahead: super::Ahead,
    ) {
        let nt = xs.len() / (HC * d);
        let row = HC * d;
        let w = c1 - c0;
        if P && w <= super::CHUNK {
            for t in (0..nt).step_by(TILE) {
                let tn = (nt - t).min(TILE);
                tile_packed(
                    d,
                    fp,
                    &xs[t * row..(t + tn) * row],
                    c0,
                    c1,
                    &mut acc[t * MIX_ACC..(t + tn) * MIX_ACC],
                    if t == 0 { ahead } else { super::Ahead::NONE },
                );
            }
            return;
        }
        // (A packed chunk is wider than CHUNK only for tables packed on another grid, which
        // `PackedHcFn::chunk` refuses; kept for completeness, in place.)
        let mut t = 0;
        while t < nt {
            let b = (nt - t).min(TB);
            let a = &mut acc[t * MIX_ACC..(t + b) * MIX_ACC];
            let (xp, ts, js, xc0) = (xs.as_ptr().add(t * row), row, d, c0);
            match b {
                4 => group::<4, P>(d, fp, xp, ts, js, xc0, c0, c1, a),
                3 => group::<3, P>(d, fp, xp, ts, js, xc0, c0, c1, a),
                2 => group::<2, P>(d, fp, xp, ts, js, xc0, c0, c1, a),
                _ => group::<1, P>(d, fp, xp, ts, js, xc0, c0, c1, a),
            }
            t += b;
        }
    }

    /// The packed-table GEMV of ≤ [`TILE`] tokens over one chunk, loops reordered for reuse:
    /// per stream j, per row group g, every 4-token group runs its 6 × B accumulators over the
    /// chunk, spilling them to `sp` between streams. The `hc_fn` slab of (g, j) (6 rows × 512
    /// dims, 12 KiB) then serves all the tile's tokens from L1, and the tile's X' of stream j
    /// (16 × 2 KiB) serves all 4 row groups: per tile and chunk ≈ 320 KiB come from L2 instead of
    /// ≈ 900 KiB when each 4-token group streamed the whole 192 KiB chunk of `hc_fn` itself. Each
    /// accumulator sees the same FMAs in the same order (j, then dims) as in [`group`], so the
    /// result bits are those of the row-major kernel.
    ///
    /// The `ahead` segments are spread over the slab calls, one cache line of each of a call's
    /// segments per 16-dim step, so the prefetches trickle out beside the FMAs.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn tile_packed(
        d: usize,
        fp: *const f32,
        xs: &[f32],
        c0: usize,
        c1: usize,
        acc: &mut [f32],
        ahead: super::Ahead,
    ) {
        const CH: usize = super::CHUNK;
        let nt = xs.len() / (HC * d);
        debug_assert!(nt <= TILE && c1 - c0 <= CH);
        let row = HC * d;
        let w = c1 - c0;
        // On the stack: this runs once per chunk, and a 128 KiB heap block would be mmapped.
        let mut xc = XTile([0.0; HC * TILE * CH]);
        for tt in 0..nt {
            for j in 0..HC {
                xc.0[(j * TILE + tt) * CH..][..w]
                    .copy_from_slice(&xs[tt * row + j * d + c0..][..w]);
            }
        }
        tile_gemv(fp, &xc, nt, w, acc, ahead)
    }

    /// `dst = src` with 64-byte non-temporal stores where `dst` is line-aligned (ordinary stores
    /// for the unaligned head and the tail).
    ///
    /// SAFETY (callers): AVX-512F present; `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn copy_nt(src: &[f32], dst: &mut [f32]) {
        let n = dst.len();
        debug_assert_eq!(src.len(), n);
        let head = (dst.as_ptr().align_offset(64)).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let mut k = head;
        while k + 16 <= n {
            // SAFETY: k + 16 ≤ n for both slices; dst + k is 64-byte aligned (head, then steps of
            // 64 bytes).
            _mm512_stream_ps(
                dst.as_mut_ptr().add(k),
                _mm512_loadu_ps(src.as_ptr().add(k)),
            );
            k += 16;
        }
        dst[k..].copy_from_slice(&src[k..]);
    }

    /// One 64-byte line `dst = v` with a non-temporal store.
    ///
    /// SAFETY (callers): AVX-512F present; `dst` is 16 values starting on a 64-byte boundary.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn stream_line(v: &[f32; 16], dst: &mut [f32]) {
        debug_assert!(dst.len() == 16 && dst.as_ptr().align_offset(64) == 0);
        _mm512_stream_ps(dst.as_mut_ptr(), _mm512_loadu_ps(v.as_ptr()));
    }

    /// [`tile_packed`] on a tile whose X' chunk is already in `xc` (the fused path's update
    /// writes it there): the same FMAs in the same order, without the copy pass.
    ///
    /// SAFETY (callers): AVX-512F present; `chunk` is the packed chunk of width w = c1 − c0 ≤
    /// [`super::CHUNK`] (24·4·⌈w/16⌉·16 values), `xc` holds each token tt < nt ≤ [`TILE`] at
    /// `(j·TILE + tt)·CHUNK`, dims 0..w, `acc` holds nt·25.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn mix_tile_packed(
        chunk: &[f32],
        xc: &XTile,
        nt: usize,
        w: usize,
        acc: &mut [f32],
        ahead: super::Ahead,
    ) {
        tile_gemv(chunk.as_ptr(), xc, nt, w, acc, ahead)
    }

    #[inline(always)]
    unsafe fn tile_gemv(
        fp: *const f32,
        xc: &XTile,
        nt: usize,
        w: usize,
        acc: &mut [f32],
        ahead: super::Ahead,
    ) {
        const CH: usize = super::CHUNK;
        debug_assert!(nt <= TILE && w <= CH && acc.len() >= nt * MIX_ACC);
        let nfull = w / 16;
        let rem = w - nfull * 16;
        let mask: __mmask16 = ((1u32 << rem) - 1) as __mmask16;
        let nkb = w.div_ceil(16);
        let ng = nt.div_ceil(TB);
        let calls = HC * (MIX / RG) * ng;
        let ns = ahead.segs.len();
        let mut call = 0;
        let mut sp = [[[_mm512_setzero_ps(); TB]; RG]; (MIX / RG) * (TILE / TB)];
        for j in 0..HC {
            for g in 0..MIX / RG {
                // The packed (g, j) slab: [kb][q][16].
                let fj = fp.add((g * HC + j) * nkb * RG * 16);
                for tg in 0..ng {
                    let t = tg * TB;
                    let b = (nt - t).min(TB);
                    let xj = xc.0.as_ptr().add((j * TILE + t) * CH);
                    let a = &mut sp[g * (TILE / TB) + tg];
                    let pf = &ahead.segs[call * ns / calls..(call + 1) * ns / calls];
                    let pl = ahead.lines;
                    call += 1;
                    match b {
                        4 => slab::<4>(fj, xj, nfull, mask, a, pf, pl),
                        3 => slab::<3>(fj, xj, nfull, mask, a, pf, pl),
                        2 => slab::<2>(fj, xj, nfull, mask, a, pf, pl),
                        _ => slab::<1>(fj, xj, nfull, mask, a, pf, pl),
                    }
                }
            }
        }
        for tg in 0..ng {
            let t = tg * TB;
            let b = (nt - t).min(TB);
            for g in 0..MIX / RG {
                let a = &sp[g * (TILE / TB) + tg];
                for q in 0..RG {
                    for bb in 0..b {
                        acc[(t + bb) * MIX_ACC + g * RG + q] += _mm512_reduce_add_ps(a[q][bb]);
                    }
                }
            }
            // Σ X'² per token, in the order of [`group`]'s (streams, then dims).
            for bb in 0..b {
                let mut s = _mm512_setzero_ps();
                for j in 0..HC {
                    let xp = xc.0.as_ptr().add((j * TILE + t + bb) * CH);
                    for kb in 0..nfull {
                        // SAFETY: 16·(kb + 1) ≤ w ≤ CHUNK: inside the copied segment.
                        let x = _mm512_loadu_ps(xp.add(kb * 16));
                        s = _mm512_fmadd_ps(x, x, s);
                    }
                    if mask != 0 {
                        let x = _mm512_maskz_loadu_ps(mask, xp.add(nfull * 16));
                        s = _mm512_fmadd_ps(x, x, s);
                    }
                }
                acc[(t + bb) * MIX_ACC + MIX] += _mm512_reduce_add_ps(s);
            }
        }
    }

    /// B tokens × 6 rows of one (g, j) slab: `fj` = the slab (`[kb][q][16]`, whole 16-lane
    /// blocks), `xj` = token bb's stream-j segment at `xj + bb·CHUNK`; adds to `a[q][bb]`.
    /// At step kb < `pl`, line kb of each segment of `pf` is prefetched into L2.
    #[inline(always)]
    unsafe fn slab<const B: usize>(
        fj: *const f32,
        xj: *const f32,
        nfull: usize,
        mask: __mmask16,
        sp: &mut [[__m512; TB]; RG],
        pf: &[*const f32],
        pl: usize,
    ) {
        const CH: usize = super::CHUNK;
        let mut a = [[_mm512_setzero_ps(); B]; RG];
        for q in 0..RG {
            for bb in 0..B {
                a[q][bb] = sp[q][bb];
            }
        }
        for kb in 0..nfull {
            if kb < pl {
                for &p in pf {
                    // A prefetch never faults; the address is only computed, never read.
                    _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(kb * 16) as *const i8);
                }
            }
            // SAFETY: 16·(kb + 1) ≤ the chunk width: inside each token's copied segment and the
            // slab.
            let mut x = [_mm512_setzero_ps(); B];
            for (bb, x) in x.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(xj.add(bb * CH + kb * 16));
            }
            for (q, aq) in a.iter_mut().enumerate() {
                let f = _mm512_loadu_ps(fj.add((kb * RG + q) * 16));
                for (ab, x) in aq.iter_mut().zip(&x) {
                    *ab = _mm512_fmadd_ps(f, *x, *ab);
                }
            }
        }
        if mask != 0 {
            // SAFETY: masked lanes are not read; the slab's last block is whole (zero-padded).
            let mut x = [_mm512_setzero_ps(); B];
            for (bb, x) in x.iter_mut().enumerate() {
                *x = _mm512_maskz_loadu_ps(mask, xj.add(bb * CH + nfull * 16));
            }
            for (q, aq) in a.iter_mut().enumerate() {
                let f = _mm512_maskz_loadu_ps(mask, fj.add((nfull * RG + q) * 16));
                for (ab, x) in aq.iter_mut().zip(&x) {
                    *ab = _mm512_fmadd_ps(f, *x, *ab);
                }
            }
        }
        for q in 0..RG {
            for bb in 0..B {
                sp[q][bb] = a[q][bb];
            }
        }
    }

    /// One group of B ≤ 4 tokens over the chunk c0..c1 of each of the 4 streams; the ragged end of
    /// the chunk (< 16 dims) runs through masked loads, whose zero lanes add nothing.
    ///
    /// `fp` is `hc_fn [24, 4d]` (P = false: row q of group g at `(6g+q)·4d`, stream j at `j·d`) or
    /// one packed chunk (P = true: `[g][j][kb][q][16]`, zero-padded to whole 16-lane blocks). The
    /// X' value of token bb, stream j, dim c0 + i is at `xp + bb·ts + j·js + xc0 + i` (in place or
    /// a contiguous copy). Only addresses differ between the variants; the arithmetic is the same.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn group<const B: usize, const P: bool>(
        d: usize,
        fp: *const f32,
        xp: *const f32,
        ts: usize,
        js: usize,
        xc0: usize,
        c0: usize,
        c1: usize,
        acc: &mut [f32],
    ) {
        let row = HC * d;
        let nfull = (c1 - c0) / 16;
        let rem = (c1 - c0) - nfull * 16;
        let mask: __mmask16 = ((1u32 << rem) - 1) as __mmask16;
        let nkb = (c1 - c0).div_ceil(16);
        // Address of the `hc_fn` vector of row q (of group g), stream j, dims c0 + 16·kb...
        let fv = |g: usize, j: usize, kb: usize, q: usize| {
            if P {
                fp.add((((g * HC + j) * nkb + kb) * RG + q) * 16)
            } else {
                fp.add((g * RG + q) * row + j * d + c0 + kb * 16)
            }
        };
        // ... and of the X' vector of token bb, stream j, dims c0 + 16·kb...
        let xv = |bb: usize, j: usize, kb: usize| xp.add(bb * ts + j * js + xc0 + kb * 16);
        for g in 0..MIX / RG {
            let mut a = [[_mm512_setzero_ps(); B]; RG];
            for j in 0..HC {
                for kb in 0..nfull {
                    // SAFETY: 16·(kb + 1) ≤ c1 − c0: inside each token's stream segment and each
                    // `hc_fn` row; the packed vector (g, j, kb, q) lies inside the chunk.
                    let mut x = [_mm512_setzero_ps(); B];
                    for (bb, x) in x.iter_mut().enumerate() {
                        *x = _mm512_loadu_ps(xv(bb, j, kb));
                    }
                    for (q, aq) in a.iter_mut().enumerate() {
                        let f = _mm512_loadu_ps(fv(g, j, kb, q));
                        for (ab, x) in aq.iter_mut().zip(&x) {
                            *ab = _mm512_fmadd_ps(f, *x, *ab);
                        }
                    }
                }
                if mask != 0 {
                    // SAFETY: masked lanes are not read; the unmasked ones end at dim c1 (the
                    // packed block kb = nkb − 1 is whole, its padding lanes zero and unread).
                    let mut x = [_mm512_setzero_ps(); B];
                    for (bb, x) in x.iter_mut().enumerate() {
                        *x = _mm512_maskz_loadu_ps(mask, xv(bb, j, nfull));
                    }
                    for (q, aq) in a.iter_mut().enumerate() {
                        let f = _mm512_maskz_loadu_ps(mask, fv(g, j, nfull, q));
                        for (ab, x) in aq.iter_mut().zip(&x) {
                            *ab = _mm512_fmadd_ps(f, *x, *ab);
                        }
                    }
                }
            }
            for q in 0..RG {
                for bb in 0..B {
                    acc[bb * MIX_ACC + g * RG + q] += _mm512_reduce_add_ps(a[q][bb]);
                }
            }
        }
        let mut s = [_mm512_setzero_ps(); B];
        for j in 0..HC {
            for kb in 0..nfull {
                for (bb, sb) in s.iter_mut().enumerate() {
                    // SAFETY: as in the GEMV loop.
                    let x = _mm512_loadu_ps(xv(bb, j, kb));
                    *sb = _mm512_fmadd_ps(x, x, *sb);
                }
            }
            if mask != 0 {
                for (bb, sb) in s.iter_mut().enumerate() {
                    // SAFETY: as in the masked GEMV tail.
                    let x = _mm512_maskz_loadu_ps(mask, xv(bb, j, nfull));
                    *sb = _mm512_fmadd_ps(x, x, *sb);
                }
            }
        }
        for (bb, sb) in s.iter().enumerate() {
            acc[bb * MIX_ACC + MIX] += _mm512_reduce_add_ps(*sb);
        }
    }
}

/// This machine's f32 FMA throughput with the vector width the mix GEMV uses, measured on every
/// rayon thread at the same time ([`rayon::broadcast`]) and summed (GFLOP/s, 2 flop per FMA): the
/// ceiling the benchmark compares the GEMV's GFLOP/s to. Each thread runs
/// [`crate::ops::simd::fma_peak_gflops`] for about `millis` ms of its own CPU time, so time slices
/// lost to other processes do not count; compare it with GEMV times on the same clock
/// (`CSA2_BENCH_CLOCK=cpu`), or expect a wall-clock GEMV on a loaded machine to fall short of it.
///
/// Why not wall clock: the previous probe timed its own loop by wall clock on `into_par_iter`
/// items, so it measured the share of the cores this process got, not the cores: on the shared
/// machine it read 144.8 GFLOP/s for two threads where one thread alone does 238.6 by CPU time
/// (and 47.1 against this probe's 472.4 at load 19), and a GEMV compared to it looked 89–92 %
/// "of peak" while it ran at ≈ 30 % of the cores' FMA rate.
pub fn fma_peak_gflops(millis: u64) -> f64 {
    rayon::broadcast(|_| crate::ops::simd::fma_peak_gflops(millis))
        .into_iter()
        .sum()
}

// ---- coefficient epilogue ------------------------------------------------------------------------

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// From the raw dots `acc[0..24]` = hc_fn·vec(X) and `acc[24]` = Σ X² of one token: pre, post and
/// the Sinkhorn-normalized comb (docs/SPEC.md §4; the last Sinkhorn step normalizes columns).
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

/// One boundary in a single pass over the streams (Mega-mHC order, docs/SPEC.md §4): reads X and y once,
/// writes X' and the new site input once; the coefficient GEMV runs on each X' chunk right after it
/// is written, while it is in L1/L2. See the module docs of [`super`] for the math and shapes.
///
/// Errors: [`crate::Error::Shape`] / [`crate::Error::Invalid`] for bad shapes or parameters.
pub fn fused_boundary(p: &MhcParams, inp: &BoundaryIn, out: &mut BoundaryOut) -> Result<()> {
    let t = inp.validate(p)?;
    out.validate(p, t, inp.next.is_some())?;
    let d = p.hidden;
    let tile = tile_for(t);
    // Raw dots + sum of squares per token (100 B each); zipped even when unused to keep one loop.
    let mut acc = vec![0.0f32; t * MIX_ACC];
    let tiles = out
        .x_new
        .par_chunks_mut(tile * HC * d)
        .zip(out.layer_in.par_chunks_mut(tile * d))
        .zip(acc.par_chunks_mut(tile * MIX_ACC))
        .enumerate();
    // With the packed table on AVX-512 the update also writes each X' chunk into the GEMV's
    // stream-major tile (`XTile`) from its registers, so the GEMV reads it from L1/L2 with no copy
    // pass over X' (`tile_packed` copies it when the GEMV runs alone).
    let direct = inp.next.as_ref().and_then(|w| direct_table(d, w));
    tiles.for_each(|(ti, ((xn_tile, u_tile), acc_tile))| {
        let t0 = ti * tile;
        let nt = u_tile.len() / d;
        let mut su = vec![0.0f32; nt];
        let mut segs: Vec<*const f32> = Vec::with_capacity(nt * (2 * HC + 2));
        let mut xc = direct.map(|_| XTile::boxed());
        let mut carry = RowCarry::new();
        // Chunk-major: the update of one CHUNK of every token of the tile (X' chunk: ≤ 16 × 4 ×
        // 2 KiB = 128 KiB) is followed at once by the GEMV on that chunk, so the GEMV reads X' from
        // L1/L2 instead of L3 (the whole tile's X', 16 × 80 KiB at d = 5120, exceeds a 1 MiB L2),
        // and the memory-bound update of the next chunk alternates with the compute-bound GEMV.
        // Σu² is summed per chunk in the order of the unfused RMSNorm pass, so both paths give
        // the same bits; the chunk grid depends on d only (batch invariance).
        let mut c0 = 0;
        while c0 < d {
            let c1 = (c0 + CHUNK).min(d);
            for tt in 0..nt {
                let tok = t0 + tt;
                let xt = &inp.x[tok * HC * d..(tok + 1) * HC * d];
                let xn = &mut xn_tile[tt * HC * d..(tt + 1) * HC * d];
                let u = &mut u_tile[tt * d..(tt + 1) * d];
                let pre = pre_of(inp.pre_prev, tok);
                let mut cp = xc.as_deref_mut().map(|x| ChunkCopy {
                    buf: &mut x.0[tt * CHUNK..],
                    stride: MAX_TILE * CHUNK,
                    c0,
                    only: true,
                });
                su[tt] += match &inp.update {
                    Some(upd) => {
                        let m = token_mix(&inp.update, tok);
                        let y = &upd.y[tok * d..(tok + 1) * d];
                        update_collapse(d, xt, y, &m, Some(&pre), c0, c1, xn, Some(u), cp.as_mut())
                    }
                    None => {
                        // X' = X: into the tile (streamed out after the GEMV) or the rows;
                        // u from X itself, the same values.
                        for j in 0..HC {
                            let seg = &xt[j * d + c0..j * d + c1];
                            match cp.as_mut() {
                                Some(cp) => cp.buf[j * cp.stride..][..c1 - c0].copy_from_slice(seg),
                                None => xn[j * d + c0..j * d + c1].copy_from_slice(seg),
                            }
                        }
                        collapse(d, xt, &pre, c0, c1, u)
                    }
                };
            }
            if let Some(w) = &inp.next {
                // The next chunk's rows of this tile (X and y read, X' and u written by the
                // update), prefetched while the GEMV runs on this chunk.
                segs.clear();
                if c1 < d {
                    for tt in 0..nt {
                        let tok = t0 + tt;
                        for j in 0..HC {
                            segs.push(inp.x[(tok * HC + j) * d + c1..].as_ptr());
                            if direct.is_none() {
                                segs.push(xn_tile[(tt * HC + j) * d + c1..].as_ptr());
                            }
                        }
                        if let Some(upd) = &inp.update {
                            segs.push(upd.y[tok * d + c1..].as_ptr());
                        }
                        segs.push(u_tile[tt * d + c1..].as_ptr());
                    }
                }
                let ahead = Ahead {
                    segs: &segs,
                    lines: (d - c1).min(CHUNK).div_ceil(16),
                };
                match (direct, xc.as_deref()) {
                    (Some(pk), Some(xc)) => {
                        mix_tile(d, pk, xc, nt, c0, c1, acc_tile, ahead);
                        rows_from_tile(d, xc, nt, c0, c1, xn_tile, &mut carry);
                    }
                    _ => mix_block_ahead(d, w.hc_fn, w.packed, xn_tile, c0, c1, acc_tile, ahead),
                }
            }
            c0 = c1;
        }
        if xc.is_some() {
            stream_fence();
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
                update_collapse(d, xt, y, &m, None, c0, c1, xn, None, None);
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
    let tile = tile_for(t);
    acc.par_chunks_mut(tile * MIX_ACC)
        .zip(x.par_chunks(tile * HC * d))
        .for_each(|(a, xs)| {
            let mut c0 = 0;
            while c0 < d {
                let c1 = (c0 + CHUNK).min(d);
                mix_block(d, w.hc_fn, w.packed, xs, c0, c1, a);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tolerance::{compare, F32_VS_F64};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// `acc` of [`mix_block`] in f64, straight from its definition.
    fn mix_f64(d: usize, hc_fn: &[f32], xs: &[f32], c0: usize, c1: usize) -> Vec<f64> {
        let mut out = vec![];
        for xt in xs.chunks_exact(HC * d) {
            for r in 0..=MIX {
                let mut s = 0.0f64;
                for j in 0..HC {
                    for k in c0..c1 {
                        let x = xt[j * d + k] as f64;
                        let w = if r < MIX {
                            hc_fn[r * HC * d + j * d + k] as f64
                        } else {
                            x
                        };
                        s += w * x;
                    }
                }
                out.push(s);
            }
        }
        out
    }

    type Kernel = fn(usize, &[f32], &[f32], usize, usize, &mut [f32]);

    /// Every compiled variant this CPU can run, named.
    fn kernels() -> Vec<(&'static str, Kernel)> {
        let mut k: Vec<(&'static str, Kernel)> = vec![("portable", scalar::mix_block)];
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::Avx2.is_supported() {
                // SAFETY: AVX2 + FMA detected just above.
                k.push(("avx2", |d, f, x, c0, c1, a| unsafe {
                    avx2::mix_block(d, f, x, c0, c1, a)
                }));
            }
            if Isa::Avx512.is_supported() {
                // SAFETY: AVX-512F detected just above.
                k.push(("avx512", |d, f, x, c0, c1, a| unsafe {
                    avx512::mix_block(d, f, x, c0, c1, a)
                }));
            }
        }
        k
    }

    #[test]
    fn mix_block_variants_match_f64_on_ragged_tokens_and_chunks() {
        let mut rng = StdRng::seed_from_u64(5);
        for d in [1, 15, 16, 17, 40, 100, 520] {
            let sd = 1.0 / ((HC * d) as f32).sqrt();
            let hc_fn: Vec<f32> = (0..MIX * HC * d)
                .map(|_| rng.random_range(-sd..sd))
                .collect();
            // 1..9 tokens: every remainder of the 4-token (AVX-512) and 3-token (AVX2) groups.
            for nt in 1..=9 {
                let xs: Vec<f32> = (0..nt * HC * d)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                for (c0, c1) in [(0, d), (d / 3, d), (1.min(d), d - d / 4), (d, d)] {
                    let want = mix_f64(d, &hc_fn, &xs, c0, c1);
                    for (name, k) in kernels() {
                        // Start from non-zero partials: the kernels accumulate across chunks.
                        let mut acc = vec![0.5f32; nt * MIX_ACC];
                        k(d, &hc_fn, &xs, c0, c1, &mut acc);
                        let got: Vec<f32> = acc.iter().map(|v| v - 0.5).collect();
                        let s = compare(&got, &want, &F32_VS_F64);
                        assert!(s.ok(&F32_VS_F64), "{name} d={d} nt={nt} {c0}..{c1}: {s:?}");
                    }
                }
            }
        }
    }

    /// The packed table changes where `hc_fn` is read from, never the arithmetic: the packed
    /// kernel gives the same bits as the row-major one on every chunk of the grid, including a
    /// ragged last chunk and a chunk width that is not a multiple of 16, and for every remainder
    /// of the 4-token group.
    #[test]
    fn packed_hc_fn_gives_the_row_major_bits_on_every_chunk() {
        let mut rng = StdRng::seed_from_u64(11);
        for d in [1, 16, 37, CHUNK, CHUNK + 9, 2 * CHUNK + 16] {
            let hc_fn: Vec<f32> = (0..MIX * HC * d)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let pk = PackedHcFn::new(d, &hc_fn).unwrap();
            for nt in 1..=9 {
                let xs: Vec<f32> = (0..nt * HC * d)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let (mut a, mut b) = (vec![0.25f32; nt * MIX_ACC], vec![0.25f32; nt * MIX_ACC]);
                let mut c0 = 0;
                while c0 < d {
                    let c1 = (c0 + CHUNK).min(d);
                    assert!(
                        pk.chunk(d, c0, c1).is_some(),
                        "d={d} {c0}..{c1} is on the grid"
                    );
                    mix_block(d, &hc_fn, None, &xs, c0, c1, &mut a);
                    mix_block(d, &hc_fn, Some(&pk), &xs, c0, c1, &mut b);
                    #[cfg(target_arch = "x86_64")]
                    if Isa::Avx512.is_supported() {
                        let mut r = vec![0.25f32; nt * MIX_ACC];
                        let mut q = vec![0.25f32; nt * MIX_ACC];
                        let ch = pk.chunk(d, c0, c1).unwrap();
                        // SAFETY: AVX-512F detected just above; `ch` is the packed c0..c1.
                        unsafe {
                            avx512::mix_block(d, &hc_fn, &xs, c0, c1, &mut r);
                            avx512::mix_block_packed(d, ch, &xs, c0, c1, &mut q, Ahead::NONE);
                        }
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&r), bits(&q), "avx512 d={d} nt={nt} {c0}..{c1}");
                    }
                    c0 = c1;
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "dispatch d={d} nt={nt}");
            }
            // Off the grid (and for another d) the packed table is not used.
            assert!(pk.chunk(d, 1.min(d - 1), d).is_none() || d == 1);
            assert!(pk.chunk(d + 1, 0, (d + 1).min(CHUNK)).is_none());
        }
    }

    /// Finding: the derived equality compared the raw buffer and the alignment offset, so two
    /// packs of the same `hc_fn` (a loaded and a synthetic layer) compared unequal whenever the
    /// allocator aligned their buffers differently.
    #[test]
    fn packed_tables_of_the_same_hc_fn_are_equal_wherever_allocated() {
        let d = 40;
        let hc_fn: Vec<f32> = (0..MIX * HC * d).map(|i| i as f32).collect();
        let a = PackedHcFn::new(d, &hc_fn).unwrap();
        // The same values at another offset inside a differently placed buffer.
        let off = if a.off == 3 { 5 } else { 3 };
        let mut buf = vec![-1.0f32; a.len + PACK_LANES];
        buf[off..off + a.len].copy_from_slice(a.data());
        let b = PackedHcFn {
            d,
            buf,
            off,
            len: a.len,
        };
        assert_eq!(a, b);
        let c = b.clone();
        assert_eq!(c, a);
        assert_eq!(c.data().as_ptr() as usize % 64, 0, "a clone is re-aligned");
        let other: Vec<f32> = hc_fn.iter().map(|v| v + 1.0).collect();
        assert_ne!(a, PackedHcFn::new(d, &other).unwrap());
    }

    #[test]
    fn packed_hc_fn_of_the_wrong_length_is_a_shape_error() {
        let e = PackedHcFn::new(8, &[0.0; MIX * HC * 8 - 1]).unwrap_err();
        assert!(matches!(e, crate::Error::Shape { .. }), "{e}");
        assert!(PackedHcFn::new(0, &[]).is_err());
    }

    /// The stream kernels written once over the lane count give the 8-lane (AVX2) kernel's bits
    /// when they run 16 lanes wide: X', u and Σ u² (summed in 8-lane blocks), the collapse and
    /// the RMS sum, on ranges whose lengths leave every remainder of 16 and of 8, and with the
    /// copy into the GEMV tile equal to the rows.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn stream_kernels_give_the_same_bits_at_16_and_8_lanes() {
        use crate::ops::simd::{F32x16, F32x8};
        if !Isa::Avx512.is_supported() {
            return;
        }
        /// X', u, the collapse's u, the tile, and the three sums.
        type Outs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, [f32; 3]);
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f,avx2,fma")]
        fn run<V: Vf32>(
            d: usize,
            xt: &[f32],
            y: &[f32],
            m: &TokenMix,
            pre: &[f32; HC],
            c0: usize,
            c1: usize,
        ) -> Outs
        where
            V::A8: Vf32<A8 = V::A8>,
        {
            let (mut xn, mut u, mut u2) = (vec![0.0; HC * d], vec![0.0; d], vec![0.0; d]);
            let mut tile = vec![0.0; HC * CHUNK];
            let mut cp = ChunkCopy {
                buf: &mut tile,
                stride: CHUNK,
                c0,
                only: false,
            };
            let a = update_collapse_body::<V>(
                d,
                xt,
                y,
                m,
                Some(pre),
                c0,
                c1,
                &mut xn,
                Some(&mut u),
                Some(&mut cp),
            );
            let b = collapse_body::<V>(d, xt, pre, c0, c1, &mut u2);
            let c = sumsq_body::<V>(xt, c0, c1);
            (xn, u, u2, tile, [a, b, c])
        }
        let mut rng = StdRng::seed_from_u64(23);
        let d = 2 * CHUNK + 29;
        let xt: Vec<f32> = (0..HC * d).map(|_| rng.random_range(-1.0..1.0)).collect();
        let y: Vec<f32> = (0..d).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut m = TokenMix {
            post: [0.0; HC],
            comb: [0.0; HC * HC],
        };
        m.post
            .iter_mut()
            .for_each(|v| *v = rng.random_range(0.0..2.0));
        m.comb
            .iter_mut()
            .for_each(|v| *v = rng.random_range(0.0..0.5));
        let pre: [f32; HC] = std::array::from_fn(|_| rng.random_range(0.0..1.0));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (c0, c1) in [
            (0, CHUNK),
            (CHUNK, 2 * CHUNK),
            (2 * CHUNK, d),
            (3, 3 + 24),
            (5, 12),
        ] {
            for len in [c1 - c0, (c1 - c0) / 2 + 7, 1, 0] {
                let c1 = c0 + len;
                // SAFETY: AVX-512F (and so AVX2 + FMA) detected above.
                let (w, n) = unsafe {
                    (
                        run::<F32x16>(d, &xt, &y, &m, &pre, c0, c1),
                        run::<F32x8>(d, &xt, &y, &m, &pre, c0, c1),
                    )
                };
                let tag = format!("{c0}..{c1}");
                assert_eq!(bits(&w.0), bits(&n.0), "X' {tag}");
                assert_eq!(bits(&w.1), bits(&n.1), "u {tag}");
                assert_eq!(bits(&w.2), bits(&n.2), "collapse {tag}");
                assert_eq!(bits(&w.3), bits(&n.3), "tile {tag}");
                assert_eq!(bits(&w.4), bits(&n.4), "sums {tag}");
                for j in 0..HC {
                    let row = &w.0[j * d + c0..j * d + c1];
                    assert_eq!(bits(&w.3[j * CHUNK..j * CHUNK + len]), bits(row), "{tag}");
                }
            }
        }
    }

    #[test]
    fn tiles_split_tokens_over_two_threads_up_to_the_cap() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let tiles: Vec<usize> = pool.install(|| [1, 3, 8, 10, 16, 17, 4096].map(tile_for).to_vec());
        // ≤ 4 per thread: as many as that; above: rounded up to the 4-token group, capped at 16.
        assert_eq!(tiles, vec![1, 2, 4, 8, 8, 12, MAX_TILE]);
    }
}
