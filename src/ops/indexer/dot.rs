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
//! 2^−127 (E8M0 byte 0) or queries below 2^−126 are affected. The keys are not unpacked: each
//! data byte (two dims) and its block's scale byte index a 256 × 256 table of bf16 pairs
//! ([`bf16_pair_table`]), whose entry the kernel broadcasts into `vdpbf16ps` straight from the
//! record (one byte load and one broadcast load per pair and key: load ports, not the dot unit).
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
/// Keys scored together: 5 keys × 2 head vectors = 10 int32 and 10 f32 accumulators. Measured
/// (thread CPU time, `csa2 bench ops`' int8 breakdown, 2026-12-01): 5 × 2 scores hot keys at
/// 66–69 % of the probed `vpdpbusd` rate, 6 × 2 at 57–65 %, 4 × 2 and 3 × 2 at 62 %, 8, 6 or 10
/// keys × 1 head vector at 54–55 %, 12 × 1 at 42 % (register spills).
pub(super) const NK: usize = 5;
/// Keys scored together by the bf16 kernel: 6 keys × 2 head vectors = 12 f32 accumulators.
const NKB: usize = 6;

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
    crate::isa::cpu().dots.vnni
}

/// Whether this CPU runs the bf16 kernel (AVX-512F/BW + BF16).
pub(super) fn bf16_supported() -> bool {
    crate::isa::cpu().dots.bf16
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

/// `0.5 · e8m0_decode(e)` = 2^(e − 128) for every scale byte (NaN for 0xFF): the key block scale
/// of the integer kernel, by table (subnormal for e ≤ 1, exact).
const HALF_E8M0: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut e = 0;
    while e < 256 {
        t[e] = f32::from_bits(match e {
            0 => 0x0020_0000,
            1 => 0x0040_0000,
            255 => 0x7FC0_0000,
            _ => ((e as u32) - 1) << 23,
        });
        e += 1;
    }
    t
};

/// Unpacks records `ids[i]` of `k` (entries, 68) into slot i of `dst`. Requires
/// [`int8_supported`].
pub(super) fn unpack_int<const N: usize>(k: &[u8], ids: &[u32], dst: &mut IntKeys<N>) {
    assert!(ids.len() <= N && int8_supported());
    for (i, &j) in ids.iter().enumerate() {
        let rec = record(k, j);
        for b in 0..NB {
            dst.scale[i][b] = HALF_E8M0[rec[64 + b] as usize];
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/BW/VNNI were detected (asserted above).
        unsafe {
            x86::unpack_nibbles(rec, &mut dst.bytes[i], &mut dst.corr[i])
        };
    }
}

/// The bf16 kernel's key table: entry `e · 256 + b` holds, as two bf16 bit patterns, the decoded
/// values of data byte `b` (low nibble = the even dim, in the low half) of a block whose E8M0 scale
/// byte is `e`. The kernel looks every key dim pair up here straight from the record (no unpack
/// pass and no scale step: the values are the exact decoded ones). 256 KiB; a cache of ordinary
/// keys touches the few KiB of its common scale bytes. Built once, from the SIMD row decoder and
/// the bf16 conversion the kernel used before the table (so the values are theirs, bit for bit).
/// Requires [`bf16_supported`].
fn bf16_pair_table() -> &'static [u32] {
    static TABLE: std::sync::OnceLock<Box<[u32]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![0u32; 256 * 256].into_boxed_slice();
        let fmt = RecordFormat::Mxfp4Index;
        let mut f = [0f32; D];
        let mut row = [0u16; D];
        for e in 0..=255u8 {
            // Four records of 64 data bytes cover the 256 byte values.
            for part in 0..4usize {
                let data: [u8; 64] = std::array::from_fn(|i| (64 * part + i) as u8);
                crate::formats::fast::decode_row(
                    crate::formats::fast::Isa::Avx512,
                    fmt,
                    &data,
                    &[e; NB],
                    &mut f,
                );
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512F/BF16 were detected (callers require `bf16_supported`).
                unsafe {
                    x86::to_bf16(&f, &mut row)
                };
                for i in 0..64 {
                    t[e as usize * 256 + 64 * part + i] =
                        u32::from(row[2 * i]) | (u32::from(row[2 * i + 1]) << 16);
                }
            }
        }
        t
    })
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

/// bf16-kernel logits of query `t` against MXFP4 records `ids` of `k` (entries, 68): `out[i]`
/// for `ids[i]`.
pub(super) fn bf16_logits(
    bq: &Bf16Queries,
    t: usize,
    w: &[f32],
    hp: usize,
    k: &[u8],
    ids: &[u32],
    out: &mut [f32],
) {
    assert!(bf16_supported() && hp.is_multiple_of(32) && w.len() == hp);
    assert!(out.len() == ids.len() && bq.q.len() >= (t + 1) * D * hp);
    let entries = k.len() / MXFP4_INDEX_BYTES;
    assert!(
        ids.iter().all(|&j| (j as usize) < entries),
        "key id out of range"
    );
    if ids.is_empty() {
        return;
    }
    let table = bf16_pair_table();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F/BW/BF16 were detected (asserted above); lengths and ids checked, the table
    // has 256 · 256 entries.
    unsafe {
        x86::bf16_logits_k::<NKB>(
            bq.q[t * D * hp..].as_ptr(),
            w.as_ptr(),
            hp,
            table.as_ptr(),
            k.as_ptr(),
            ids.as_ptr(),
            ids.len(),
            out.as_mut_ptr(),
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table is `0.5 · e8m0_decode` for every byte, bit for bit (the scalar form it replaced).
    #[test]
    fn half_e8m0_table_is_the_decoder_halved() {
        for e in 0..=255u8 {
            let want = 0.5 * e8m0_decode(e);
            let got = HALF_E8M0[e as usize];
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "e = {e}: {got:e} vs {want:e}"
            );
        }
    }

    /// The table kernel gives the logits of the kernel it replaced (rows decoded by the SIMD row
    /// decoder, converted to bf16, then scored) bit for bit: every scale byte 0..=255 (subnormal
    /// 2^-127 and 2^-126, NaN), every code, 1–13 keys per call (short groups), ids out of order,
    /// 32 and 64 padded heads.
    #[test]
    fn bf16_table_kernel_is_the_row_kernel_bit_for_bit() {
        use crate::formats::fast::{decode_row, Isa};
        use rand::{Rng as _, SeedableRng};
        if !bf16_supported() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let n = 600;
        let mut k = vec![0u8; n * MXFP4_INDEX_BYTES];
        for (r, rec) in k.chunks_mut(MXFP4_INDEX_BYTES).enumerate() {
            rng.fill(&mut rec[..64]);
            for b in 0..NB {
                // Row r < 256 puts every scale byte in block r % 4; the rest near 127.
                rec[64 + b] = if r < 256 && b == r % NB {
                    r as u8
                } else {
                    rng.random_range(110..=140)
                };
            }
        }
        for hp in [32usize, 64] {
            let tokens = 2;
            let qf: Vec<f32> = (0..tokens * D * hp)
                .map(|_| crate::formats::scalar::bf16_round(rng.random_range(-2.0f32..2.0)))
                .collect();
            let bq = Bf16Queries::new(&qf, tokens, hp);
            let w: Vec<f32> = (0..hp).map(|_| rng.random_range(-0.1f32..0.1)).collect();
            let mut start = 0;
            let mut len = 1;
            while start < n {
                let end = (start + len).min(n);
                // Reversed order, so a group's ids are not consecutive.
                let ids: Vec<u32> = (start as u32..end as u32).rev().collect();
                let rows: Vec<[u16; D]> = ids
                    .iter()
                    .map(|&j| {
                        let rec = &k[j as usize * MXFP4_INDEX_BYTES..][..MXFP4_INDEX_BYTES];
                        let mut f = [0f32; D];
                        let mut o = [0u16; D];
                        decode_row(
                            Isa::Avx512,
                            RecordFormat::Mxfp4Index,
                            &rec[..64],
                            &rec[64..],
                            &mut f,
                        );
                        // SAFETY: bf16_supported checked above.
                        unsafe { x86::to_bf16(&f, &mut o) };
                        o
                    })
                    .collect();
                for t in 0..tokens {
                    let mut want = vec![0f32; ids.len()];
                    let mut got = vec![0f32; ids.len()];
                    // SAFETY: bf16_supported checked above; q holds token t's 64 · hp · 2 values.
                    unsafe {
                        x86::bf16_logits_rows(
                            &bq.q[t * D * hp..][..D * hp],
                            &w,
                            hp,
                            &rows,
                            &mut want,
                        )
                    };
                    bf16_logits(&bq, t, &w, hp, &k, &ids, &mut got);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            a.to_bits() == b.to_bits(),
                            "hp {hp} token {t} entry {}: {a:e} vs {b:e}",
                            ids[i]
                        );
                    }
                }
                start = end;
                len = len % 13 + 1;
            }
        }
    }
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
            let s1 = _mm512_add_epi32(s2, _mm512_shuffle_epi32::<0b01_00_11_10>(s2));
            // Lanes 0, 4, 8, 12 hold the four block sums: gather them, times −12, one store.
            let idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
            let c = _mm512_castsi512_si128(_mm512_permutexvar_epi32(idx, s1));
            _mm_mullo_epi32(c, _mm_set1_epi32(-12))
        };
        // SAFETY: `corr` holds 4 writable i32.
        unsafe { _mm_storeu_si128(corr.as_mut_ptr() as *mut _, sums) };
    }

    /// f32 row (exact in bf16) → bf16 bit patterns.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) fn to_bf16(f: &[f32; D], out: &mut [u16; D]) {
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

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
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
        let n = keys.len();
        assert!(kscale.len() == n && kcorr.len() == n && out.len() == n && n > 0);
        assert!(q.len() == NB * NG * hp * 4 && qscale.len() == NB * hp && w.len() == hp);
        assert!(hp.is_multiple_of(32));
        let (q, qs, w, k, ks, kc, o) = (
            q.as_ptr(),
            qscale.as_ptr(),
            w.as_ptr(),
            keys.as_ptr(),
            kscale.as_ptr(),
            kcorr.as_ptr(),
            out.as_mut_ptr(),
        );
        // SAFETY: lengths asserted above; the features are enabled on this function.
        unsafe { int_logits_k::<NK, 2>(q, qs, w, hp, k, ks, kc, n, o) }
    }

    /// `K` keys × `HV` 16-head vectors per pass. Every key's logit is the same instruction
    /// sequence whatever `K`, `HV` or the other keys of its group: per head lane, the four block
    /// terms are added in block order and the head terms in head order.
    ///
    /// SAFETY: `q` (NB·NG·hp·4), `qscale` (NB·hp), `w` (hp) readable; `keys`, `kscale`, `kcorr`
    /// hold `n ≥ 1` entries; `out` has `n` writable floats; hp a multiple of 16·HV.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn int_logits_k<const K: usize, const HV: usize>(
        q: *const u8,
        qscale: *const f32,
        w: *const f32,
        hp: usize,
        keys: *const [u8; D],
        kscale: *const [f32; NB],
        kcorr: *const [i32; NB],
        n: usize,
        out: *mut f32,
    ) {
        let zero = _mm512_setzero_ps();
        let mut g0 = 0;
        while g0 < n {
            // A short last group repeats its last key; the extra results are not stored.
            let ix: [usize; K] = std::array::from_fn(|i| (g0 + i).min(n - 1));
            // SAFETY (whole body): every index below is < n or inside the lengths above.
            unsafe {
                let kp: [*const u8; K] = std::array::from_fn(|i| keys.add(ix[i]) as *const u8);
                let sp: [*const f32; K] = std::array::from_fn(|i| kscale.add(ix[i]) as *const f32);
                let cp: [*const i32; K] = std::array::from_fn(|i| kcorr.add(ix[i]) as *const i32);
                let mut lv = [zero; K];
                let mut h0 = 0;
                while h0 < hp {
                    let mut f = [[zero; HV]; K];
                    for b in 0..NB {
                        let mut acc: [[__m512i; HV]; K] =
                            std::array::from_fn(|i| [_mm512_set1_epi32(*cp[i].add(b)); HV]);
                        for g in 0..NG {
                            let qv: [__m512i; HV] = std::array::from_fn(|j| {
                                _mm512_loadu_si512(
                                    q.add(((b * NG + g) * hp + h0 + 16 * j) * 4) as *const _
                                )
                            });
                            let off = group_offset(b, g);
                            for i in 0..K {
                                // The signed operand: a broadcast the instruction can take from
                                // memory.
                                let kv = _mm512_set1_epi32(std::ptr::read_unaligned(
                                    kp[i].add(off) as *const i32,
                                ));
                                for j in 0..HV {
                                    acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], qv[j], kv);
                                }
                            }
                        }
                        let sq: [__m512; HV] = std::array::from_fn(|j| {
                            _mm512_loadu_ps(qscale.add(b * hp + h0 + 16 * j))
                        });
                        for i in 0..K {
                            let sk = _mm512_set1_ps(*sp[i].add(b));
                            for j in 0..HV {
                                f[i][j] = _mm512_fmadd_ps(
                                    _mm512_cvtepi32_ps(acc[i][j]),
                                    _mm512_mul_ps(sq[j], sk),
                                    f[i][j],
                                );
                            }
                        }
                    }
                    for j in 0..HV {
                        let wv = _mm512_loadu_ps(w.add(h0 + 16 * j));
                        for i in 0..K {
                            // max(x, 0) returns 0 for NaN, as the f32 kernel's ReLU.
                            lv[i] = _mm512_fmadd_ps(wv, _mm512_max_ps(f[i][j], zero), lv[i]);
                        }
                    }
                    h0 += 16 * HV;
                }
                for i in 0..K.min(n - g0) {
                    *out.add(g0 + i) = _mm512_reduce_add_ps(lv[i]);
                }
            }
            g0 += K;
        }
    }

    /// `K` keys × 2 head vectors per pass, every key dim pair looked up in `table` (see
    /// [`bf16_pair_table`]) from its record byte and the block's scale byte. Each key's logit is
    /// the same instruction sequence whatever `K` or the other keys of its group: per head lane,
    /// 64 `vdpbf16ps` steps in dim order, then ReLU and the head weights in head order.
    ///
    /// SAFETY: `q` has 64 · hp · 2 readable u16, `w` hp floats; `table` 256 · 256 entries;
    /// `ids[0..n]` (n ≥ 1) index 68-byte records of `recs`; `out` has n writable floats; hp a
    /// multiple of 32.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    pub(super) unsafe fn bf16_logits_k<const K: usize>(
        q: *const u16,
        w: *const f32,
        hp: usize,
        table: *const u32,
        recs: *const u8,
        ids: *const u32,
        n: usize,
        out: *mut f32,
    ) {
        let zero = _mm512_setzero_ps();
        let mut g0 = 0;
        while g0 < n {
            // SAFETY (whole body): every index below is < n or inside the lengths above.
            unsafe {
                // A short last group repeats its last key; the extra results are not stored.
                let kr: [*const u8; K] = std::array::from_fn(|i| {
                    recs.add(*ids.add((g0 + i).min(n - 1)) as usize * MXFP4_INDEX_BYTES)
                });
                // The records two groups ahead (both ends of each 68-byte record): scattered
                // pool entries would otherwise wait on memory. A hint only.
                for i in 0..K {
                    let g = g0 + 2 * K + i;
                    if g < n {
                        let p = recs.add(*ids.add(g) as usize * MXFP4_INDEX_BYTES) as *const i8;
                        _mm_prefetch::<_MM_HINT_T0>(p);
                        _mm_prefetch::<_MM_HINT_T0>(p.add(MXFP4_INDEX_BYTES - 1));
                    }
                }
                let mut lv = [zero; K];
                let mut h0 = 0;
                while h0 < hp {
                    let mut acc = [[zero; 2]; K];
                    for b in 0..NB {
                        let tb: [*const u32; K] =
                            std::array::from_fn(|i| table.add(*kr[i].add(64 + b) as usize * 256));
                        for jj in 0..BLK / 2 {
                            let j = b * (BLK / 2) + jj;
                            let p = q.add((j * hp + h0) * 2);
                            let q0: __m512bh =
                                std::mem::transmute(_mm512_loadu_si512(p as *const _));
                            let q1: __m512bh =
                                std::mem::transmute(_mm512_loadu_si512(p.add(32) as *const _));
                            for i in 0..K {
                                let pair = *tb[i].add(*kr[i].add(j) as usize);
                                let kv: __m512bh =
                                    std::mem::transmute(_mm512_set1_epi32(pair as i32));
                                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], kv, q0);
                                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], kv, q1);
                            }
                        }
                    }
                    let w0 = _mm512_loadu_ps(w.add(h0));
                    let w1 = _mm512_loadu_ps(w.add(h0 + 16));
                    for i in 0..K {
                        lv[i] = _mm512_fmadd_ps(w0, _mm512_max_ps(acc[i][0], zero), lv[i]);
                        lv[i] = _mm512_fmadd_ps(w1, _mm512_max_ps(acc[i][1], zero), lv[i]);
                    }
                    h0 += 32;
                }
                for i in 0..K.min(n - g0) {
                    *out.add(g0 + i) = _mm512_reduce_add_ps(lv[i]);
                }
            }
            g0 += K;
        }
    }

    /// The kernel before the table (bf16 rows decoded and converted first, 6 keys × 2 head
    /// vectors): the tests' bit-for-bit reference for [`bf16_logits_k`].
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::needless_range_loop)]
    pub(super) fn bf16_logits_rows(
        q: &[u16],
        w: &[f32],
        hp: usize,
        keys: &[[u16; D]],
        out: &mut [f32],
    ) {
        let zero = _mm512_setzero_ps();
        for (kk, dst) in keys.chunks(NKB).zip(out.chunks_mut(NKB)) {
            let kr: [&[u16; D]; NKB] = std::array::from_fn(|i| &kk[i.min(kk.len() - 1)]);
            let mut lv = [zero; NKB];
            for h0 in (0..hp).step_by(32) {
                let mut acc = [[zero; 2]; NKB];
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
                    for i in 0..NKB {
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
                for i in 0..NKB {
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
