//! The indexer's narrow-dot kernels: MXFP4 × MXFP4 on 8-bit integer dot products (AVX-512 VNNI
//! `vpdpbusd`) and bf16 × bf16 on `vdpbf16ps` (AVX-512 BF16), both with f32 accumulation.
//!
//! **Integer path** (query quantisation `mxfp4`, MXFP4 keys). An E2M1 value times 2 is an integer
//! in [−12, 12], so inside one 32-dim block the dot of a query row and a key row is
//! `(Σ_d 2q_d · 2k_d) · 2^(e_q − 127) · 2^(e_k − 127) / 4`: an exact int32 sum (|Σ| ≤ 32 · 144)
//! times a power of two. `vpdpbusd` multiplies unsigned by signed bytes, and only its signed
//! operand can be a broadcast from memory; so the query (in registers) is stored as `2q + 12` ∈
//! [0, 24] (unsigned), each key's 4-dim group is broadcast as `2k` (signed), and the accumulator
//! of block b of a key starts at `−12 · Σ_{d∈b} 2k_d`, which cancels the offset exactly. Each block's int32 sum
//! is converted to f32 (exact) and scaled by the product of the two block scales (a power of two,
//! exact unless it leaves the f32 range), and the four blocks are summed in f32: the only rounding
//! of the whole dot is those three additions, against 127 for the f32 kernel. ReLU and the head
//! weights follow in f32 as in the f32 kernel.
//!
//! **bf16 path** (query quantisation `bf16`, MXFP4 keys). Every MXFP4 key value `e2m1 · 2^e` has at
//! most two significant bits and is exact in bf16; the query is rounded to bf16 by the query
//! quantiser (the reference applies the same rounding). The products are then exact in f32 and
//! `vdpbf16ps` accumulates pairs of them in f32. The instruction treats bf16 inputs below 2^−126
//! as zero and flushes subnormal results (Intel SDM, VDPBF16PS): only keys whose block scale is
//! 2^−127 (E8M0 byte 0) or queries below 2^−126 are affected.
//!
//! Layout. A key is unpacked into 128 bytes in *kernel order*: bytes 0..64 hold the even dims
//! (low nibbles, dim 2i at byte i) and bytes 64..128 the odd dims (high nibbles), so block b is
//! bytes 16b..16b+16 of each half and no interleave is needed. The query is stored in the same
//! order, transposed so that one 64-byte vector holds the same four dims of 16 heads. An integer
//! sum does not depend on the order of its terms, so this order changes no result.
//!
//! Each key's logit is computed by the same instruction sequence whatever other keys, queries or
//! threads share the call (keys are scored in groups of [`NK`], each with its own accumulators).

use crate::formats::scalar::{e2m1_decode, e8m0_decode};
use crate::formats::{RecordFormat, MXFP4_INDEX_BYTES};

/// Index dim.
const D: usize = 128;
/// MXFP4 block size.
const BLK: usize = 32;
/// Blocks per row.
const NB: usize = D / BLK;
/// 4-dim groups per block (one int32 lane of `vpdpbusd` each).
const NG: usize = BLK / 4;
/// Keys scored together: 6 keys × 2 head vectors = 12 int32 and 12 f32 accumulators (24 of the
/// 32 vector registers), enough independent chains to keep both dot ports busy.
pub(super) const NK: usize = 6;

/// `2 · e2m1(code)` for the 16 codes, as the bytes of i8: the signed key bytes of the integer path.
const KEY_S8: [u8; 16] = {
    let mut t = [0u8; 16];
    let mag = [0i32, 1, 2, 3, 4, 6, 8, 12];
    let mut c = 0;
    while c < 16 {
        let v = if c < 8 { mag[c] } else { -mag[c - 8] };
        t[c] = v as i8 as u8;
        c += 1;
    }
    t
};

/// Byte offset, in kernel order, of 4-dim group `g` (0..8) of block `b`: groups 0..4 are even
/// dims, 4..8 odd dims.
#[inline(always)]
const fn group_offset(b: usize, g: usize) -> usize {
    (g / 4) * 64 + b * 16 + (g % 4) * 4
}

/// The dim that byte `p` of a kernel-order row holds.
#[inline(always)]
const fn dim_of(p: usize) -> usize {
    if p < 64 {
        2 * p
    } else {
        2 * (p - 64) + 1
    }
}

/// MXFP4 queries in the integer kernel's layout.
pub(super) struct IntQueries {
    /// (tokens, NB, NG, hp, 4) unsigned `2q + 12`: the four dims of group g of block b for head h
    /// (12, i.e. q = 0, for padded heads: their scale is 0).
    q: Vec<u8>,
    /// (tokens, NB, hp): the query block scale `2^(e − 127) / 2` (0 for padded heads).
    scale: Vec<f32>,
}

impl IntQueries {
    /// Encodes each (token, head) row of `q` (tokens, heads, 128) to MXFP4 with the record
    /// encoder (the same codes the query quantiser's fake quantisation decodes).
    pub(super) fn new(q: &[f32], tokens: usize, heads: usize, hp: usize) -> IntQueries {
        let mut out = IntQueries {
            q: vec![12; tokens * NB * NG * hp * 4],
            scale: vec![0.0; tokens * NB * hp],
        };
        let fmt = RecordFormat::Mxfp4Index;
        let mut rec = [0u8; MXFP4_INDEX_BYTES];
        let mut ints = [0i8; D];
        for t in 0..tokens {
            for h in 0..heads {
                let row = &q[(t * heads + h) * D..][..D];
                let (data, sc) = rec.split_at_mut(fmt.data_bytes());
                fmt.encode_row(row, data, sc);
                for (d, v) in ints.iter_mut().enumerate() {
                    let code = (data[d / 2] >> (4 * (d % 2))) & 0xF;
                    *v = (2.0 * e2m1_decode(code)) as i8;
                }
                for (b, &e) in sc.iter().enumerate() {
                    out.scale[(t * NB + b) * hp + h] = 0.5 * e8m0_decode(e);
                    for g in 0..NG {
                        for j in 0..4 {
                            let dim = dim_of(group_offset(b, g) + j);
                            out.q[(((t * NB + b) * NG + g) * hp + h) * 4 + j] =
                                (ints[dim] + 12) as u8;
                        }
                    }
                }
            }
        }
        out
    }
}

/// bf16 queries: (tokens, 64, hp, 2) bit patterns, dims 2j and 2j + 1 of head h side by side.
pub(super) struct Bf16Queries {
    q: Vec<u16>,
}

impl Bf16Queries {
    /// From the transposed, already bf16-rounded queries `qt` (tokens, 128, hp): exact.
    pub(super) fn new(qt: &[f32], tokens: usize, hp: usize) -> Bf16Queries {
        let mut q = vec![0u16; tokens * D * hp];
        for t in 0..tokens {
            for d in 0..D {
                for h in 0..hp {
                    let v = qt[(t * D + d) * hp + h];
                    q[((t * (D / 2) + d / 2) * hp + h) * 2 + d % 2] = (v.to_bits() >> 16) as u16;
                }
            }
        }
        Bf16Queries { q }
    }
}

/// Whether this CPU runs the integer kernel (AVX-512F/BW + VNNI).
pub(super) fn int8_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU runs the bf16 kernel (AVX-512F/BW + BF16).
pub(super) fn bf16_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// MXFP4 key records unpacked for the integer kernel: kernel-order signed bytes `2k`, block
/// scales `2^(e − 127) / 2` and the accumulator start values `−12 · Σ_{d∈b} 2k_d`.
pub(super) struct IntKeys<const N: usize> {
    pub(super) bytes: [[u8; D]; N],
    pub(super) scale: [[f32; NB]; N],
    pub(super) corr: [[i32; NB]; N],
}

impl<const N: usize> IntKeys<N> {
    pub(super) fn new() -> Self {
        IntKeys {
            bytes: [[0; D]; N],
            scale: [[0.0; NB]; N],
            corr: [[0; NB]; N],
        }
    }
}

/// MXFP4 record `j` of the records `k` (entries, 68).
#[inline(always)]
fn record(k: &[u8], j: u32) -> &[u8; MXFP4_INDEX_BYTES] {
    k[j as usize * MXFP4_INDEX_BYTES..][..MXFP4_INDEX_BYTES]
        .try_into()
        .expect("68-byte record")
}

/// Unpacks records `ids[i]` of `k` (entries, 68) into slot i of `dst`. Requires
/// [`int8_supported`].
pub(super) fn unpack_int<const N: usize>(k: &[u8], ids: &[u32], dst: &mut IntKeys<N>) {
    assert!(ids.len() <= N && int8_supported());
    for (i, &j) in ids.iter().enumerate() {
        let rec = record(k, j);
        for b in 0..NB {
            dst.scale[i][b] = 0.5 * e8m0_decode(rec[64 + b]);
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/BW/VNNI were detected (asserted above).
        unsafe {
            x86::unpack_nibbles(rec, &mut dst.bytes[i], &mut dst.corr[i])
        };
    }
}

/// bf16 key rows (bit patterns, natural dim order).
pub(super) type Bf16Row = [u16; D];

/// Decodes records `ids` of `k` (entries, 68) into exact bf16 rows. Requires [`bf16_supported`].
pub(super) fn unpack_bf16(k: &[u8], ids: &[u32], dst: &mut [Bf16Row]) {
    assert!(ids.len() <= dst.len() && bf16_supported());
    let fmt = RecordFormat::Mxfp4Index;
    let mut f = [0f32; D];
    for (&j, o) in ids.iter().zip(dst.iter_mut()) {
        let rec = record(k, j);
        crate::formats::fast::decode_row(
            crate::formats::fast::Isa::Avx512,
            fmt,
            &rec[..64],
            &rec[64..68],
            &mut f,
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/BF16 were detected (asserted above).
        unsafe {
            x86::to_bf16(&f, o)
        };
    }
}

/// Integer-kernel logits of query `t` against `n` unpacked keys:
/// `out[k] = Σ_h w[h] · ReLU(q_t[h] · k)` (heads padded to `hp` with zero weight).
pub(super) fn int_logits<const N: usize>(
    iq: &IntQueries,
    t: usize,
    w: &[f32],
    hp: usize,
    keys: &IntKeys<N>,
    n: usize,
    out: &mut [f32],
) {
    assert!(int8_supported() && hp.is_multiple_of(32) && w.len() == hp && out.len() == n);
    assert!(n <= N && iq.scale.len() >= (t + 1) * NB * hp);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F/BW/VNNI were detected (asserted above); lengths checked.
    unsafe {
        x86::int_logits(
            &iq.q[t * NB * NG * hp * 4..][..NB * NG * hp * 4],
            &iq.scale[t * NB * hp..][..NB * hp],
            w,
            hp,
            &keys.bytes[..n],
            &keys.scale[..n],
            &keys.corr[..n],
            out,
        )
    };
}

/// bf16-kernel logits of query `t` against `keys`.
pub(super) fn bf16_logits(
    bq: &Bf16Queries,
    t: usize,
    w: &[f32],
    hp: usize,
    keys: &[Bf16Row],
    out: &mut [f32],
) {
    assert!(bf16_supported() && hp.is_multiple_of(32) && w.len() == hp);
    assert!(out.len() == keys.len() && bq.q.len() >= (t + 1) * D * hp);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F/BW/BF16 were detected (asserted above); lengths checked.
    unsafe {
        x86::bf16_logits(&bq.q[t * D * hp..][..D * hp], w, hp, keys, out)
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// 64 nibble bytes → 128 kernel-order key bytes `2k` and the four `−12 · Σ_{d∈b} 2k_d`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) fn unpack_nibbles(
        rec: &[u8; MXFP4_INDEX_BYTES],
        out: &mut [u8; D],
        corr: &mut [i32; NB],
    ) {
        // SAFETY: `rec` has ≥ 64 readable bytes, `out` 128 writable ones.
        let sums = unsafe {
            let x = _mm512_loadu_si512(rec.as_ptr() as *const _);
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(KEY_S8.as_ptr() as *const _));
            let m = _mm512_set1_epi8(0x0F);
            let lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(x, m));
            let hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(x), m));
            _mm512_storeu_si512(out.as_mut_ptr() as *mut _, lo);
            _mm512_storeu_si512(out.as_mut_ptr().add(64) as *mut _, hi);
            // 128-bit lane b of both halves is block b; |lo + hi| ≤ 24 per byte. Sum the bytes
            // in fours (ones · s), then the four lanes of each 128-bit lane.
            let s = _mm512_add_epi8(lo, hi);
            let s4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), s);
            let s2 = _mm512_add_epi32(s4, _mm512_shuffle_epi32::<0b10_11_00_01>(s4));
            _mm512_add_epi32(s2, _mm512_shuffle_epi32::<0b01_00_11_10>(s2))
        };
        let mut lanes = [0i32; 16];
        // SAFETY: 16 writable i32.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, sums) };
        for (b, c) in corr.iter_mut().enumerate() {
            *c = -12 * lanes[4 * b];
        }
    }

    /// f32 row (exact in bf16) → bf16 bit patterns.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) fn to_bf16(f: &[f32; D], out: &mut Bf16Row) {
        for c in 0..D / 32 {
            // SAFETY: c·32 + 32 ≤ 128 for both rows.
            unsafe {
                let a = _mm512_loadu_ps(f.as_ptr().add(32 * c));
                let b = _mm512_loadu_ps(f.as_ptr().add(32 * c + 16));
                // cvtne2ps: the second operand fills the low half.
                let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
                _mm512_storeu_si512(out.as_mut_ptr().add(32 * c) as *mut _, v);
            }
        }
    }

    #[inline(always)]
    fn bcast_u32(p: &[u8; D], off: usize) -> __m512i {
        // SAFETY: off + 4 ≤ 128 (group offsets), unaligned read; AVX-512F is enabled by callers.
        unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p.as_ptr().add(off) as *const i32)) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    pub(super) fn int_logits(
        q: &[u8],
        qscale: &[f32],
        w: &[f32],
        hp: usize,
        keys: &[[u8; D]],
        kscale: &[[f32; NB]],
        kcorr: &[[i32; NB]],
        out: &mut [f32],
    ) {
        let zero = _mm512_setzero_ps();
        let n = keys.len();
        for (g0, dst) in out.chunks_mut(NK).enumerate() {
            // A short last group repeats its last key; the extra results are not stored.
            let ix: [usize; NK] = std::array::from_fn(|i| (g0 * NK + i).min(n - 1));
            let kr: [&[u8; D]; NK] = std::array::from_fn(|i| &keys[ix[i]]);
            let sr: [&[f32; NB]; NK] = std::array::from_fn(|i| &kscale[ix[i]]);
            let cr: [&[i32; NB]; NK] = std::array::from_fn(|i| &kcorr[ix[i]]);
            let mut lv = [zero; NK];
            for h0 in (0..hp).step_by(32) {
                let mut f = [[zero; 2]; NK];
                for b in 0..NB {
                    // SAFETY: (b · hp + h0 + 32) ≤ NB · hp = qscale.len().
                    let (s0, s1) = unsafe {
                        let ps = qscale.as_ptr().add(b * hp + h0);
                        (_mm512_loadu_ps(ps), _mm512_loadu_ps(ps.add(16)))
                    };
                    let mut acc: [[__m512i; 2]; NK] = std::array::from_fn(|i| {
                        let c = _mm512_set1_epi32(cr[i][b]);
                        [c, c]
                    });
                    for g in 0..NG {
                        // SAFETY: ((b · NG + g) · hp + h0 + 32) · 4 ≤ q.len().
                        let (q0, q1) = unsafe {
                            let p = q.as_ptr().add(((b * NG + g) * hp + h0) * 4);
                            (
                                _mm512_loadu_si512(p as *const _),
                                _mm512_loadu_si512(p.add(64) as *const _),
                            )
                        };
                        let off = group_offset(b, g);
                        for i in 0..NK {
                            // The signed operand: a broadcast the instruction can take from memory.
                            let kv = bcast_u32(kr[i], off);
                            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], q0, kv);
                            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], q1, kv);
                        }
                    }
                    for i in 0..NK {
                        let sk = _mm512_set1_ps(sr[i][b]);
                        f[i][0] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(acc[i][0]),
                            _mm512_mul_ps(s0, sk),
                            f[i][0],
                        );
                        f[i][1] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(acc[i][1]),
                            _mm512_mul_ps(s1, sk),
                            f[i][1],
                        );
                    }
                }
                // SAFETY: h0 + 32 ≤ hp = w.len().
                let (w0, w1) = unsafe {
                    (
                        _mm512_loadu_ps(w.as_ptr().add(h0)),
                        _mm512_loadu_ps(w.as_ptr().add(h0 + 16)),
                    )
                };
                for i in 0..NK {
                    // max(x, 0) returns 0 for NaN, as the f32 kernel's ReLU.
                    lv[i] = _mm512_fmadd_ps(w0, _mm512_max_ps(f[i][0], zero), lv[i]);
                    lv[i] = _mm512_fmadd_ps(w1, _mm512_max_ps(f[i][1], zero), lv[i]);
                }
            }
            for (o, v) in dst.iter_mut().zip(lv) {
                *o = _mm512_reduce_add_ps(v);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::needless_range_loop)]
    pub(super) fn bf16_logits(q: &[u16], w: &[f32], hp: usize, keys: &[Bf16Row], out: &mut [f32]) {
        let zero = _mm512_setzero_ps();
        for (kk, dst) in keys.chunks(NK).zip(out.chunks_mut(NK)) {
            let kr: [&Bf16Row; NK] = std::array::from_fn(|i| &kk[i.min(kk.len() - 1)]);
            let mut lv = [zero; NK];
            for h0 in (0..hp).step_by(32) {
                let mut acc = [[zero; 2]; NK];
                for j in 0..D / 2 {
                    // SAFETY: ((j · hp + h0 + 32) · 2 ≤ 64 · hp · 2 = q.len().
                    let (q0, q1) = unsafe {
                        let p = q.as_ptr().add((j * hp + h0) * 2);
                        (
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                                p as *const _,
                            )),
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                                p.add(32) as *const _
                            )),
                        )
                    };
                    for i in 0..NK {
                        // SAFETY: 2j + 2 ≤ 128.
                        let kv: __m512bh = unsafe {
                            std::mem::transmute(_mm512_set1_epi32(std::ptr::read_unaligned(
                                kr[i].as_ptr().add(2 * j) as *const i32,
                            )))
                        };
                        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], kv, q0);
                        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], kv, q1);
                    }
                }
                // SAFETY: h0 + 32 ≤ hp = w.len().
                let (w0, w1) = unsafe {
                    (
                        _mm512_loadu_ps(w.as_ptr().add(h0)),
                        _mm512_loadu_ps(w.as_ptr().add(h0 + 16)),
                    )
                };
                for i in 0..NK {
                    lv[i] = _mm512_fmadd_ps(w0, _mm512_max_ps(acc[i][0], zero), lv[i]);
                    lv[i] = _mm512_fmadd_ps(w1, _mm512_max_ps(acc[i][1], zero), lv[i]);
                }
            }
            for (o, v) in dst.iter_mut().zip(lv) {
                *o = _mm512_reduce_add_ps(v);
            }
        }
    }
}
