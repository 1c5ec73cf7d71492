//! AVX-512F row codecs: 16 lanes, one NVFP4-DS block per vector.
//!
//! Every function reproduces the scalar reference in [`crate::formats::records`] operation for
//! operation (same bf16 rounding, same IEEE divide / multiply, same RNE), so the records are
//! bit-identical; the tests in `fast::tests` check that over random and special rows.
//!
//! Only the loads and stores are `unsafe`; the intrinsics are safe inside `#[target_feature]`
//! functions. Callers must have checked `Isa::Avx512.is_supported()` ([`crate::isa`]).

use crate::formats::records::{RecordFormat, NOPE_DIM};
use crate::formats::scalar::{ceil_log2, e4m3_decode, e4m3_encode, e8m0_decode, pow2, E4M3_MAX};
use core::arch::x86_64::*;

// ---- loads and stores -----------------------------------------------------------------------

#[inline]
#[target_feature(enable = "avx512f")]
fn load(x: &[f32; 16]) -> __m512 {
    // SAFETY: the reference covers exactly 16 f32; the load is unaligned.
    unsafe { _mm512_loadu_ps(x.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn store(out: &mut [f32; 16], v: __m512) {
    // SAFETY: the reference covers exactly 16 f32; the store is unaligned.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn load_bytes16(b: &[u8; 16]) -> __m128i {
    // SAFETY: the reference covers exactly 16 bytes; the load is unaligned.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn store_bytes16(out: &mut [u8; 16], v: __m128i) {
    // SAFETY: the reference covers exactly 16 bytes; the store is unaligned.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), v) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn load_bytes32(b: &[u8; 32]) -> __m256i {
    // SAFETY: the reference covers exactly 32 bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn store_bytes32(out: &mut [u8; 32], v: __m256i) {
    // SAFETY: the reference covers exactly 32 bytes; the store is unaligned.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) }
}

// ---- lane helpers ---------------------------------------------------------------------------

#[inline]
#[target_feature(enable = "avx512f")]
fn splat_i(v: i32) -> __m512i {
    _mm512_set1_epi32(v)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn abs(x: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_castps_si512(x),
        splat_i(0x7FFF_FFFF),
    ))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn nan_mask(x: __m512) -> __mmask16 {
    _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x)
}

/// Running max of |x| that skips NaN lanes like `f32::max` does: VMAXPS returns its second operand
/// when either is NaN, and the accumulator is never NaN.
#[inline]
#[target_feature(enable = "avx512f")]
fn amax_acc(acc: __m512, x: __m512) -> __m512 {
    _mm512_max_ps(abs(x), acc)
}

/// RNE to bf16 and back, NaN lanes kept as NaN (the integer rounding trick alone could turn a
/// NaN with only low payload bits into ±Inf).
#[inline]
#[target_feature(enable = "avx512f")]
fn bf16_round(x: __m512) -> __m512 {
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), splat_i(1));
    let r = _mm512_add_epi32(_mm512_add_epi32(b, splat_i(0x7FFF)), lsb);
    let r = _mm512_and_si512(r, splat_i(0xFFFF_0000u32 as i32));
    _mm512_mask_blend_ps(nan_mask(x), _mm512_castsi512_ps(r), x)
}

/// bf16 bit patterns (in the low 16 bits of each lane) exactly as `half::bf16::from_f32`:
/// RNE, NaN → high half with the quiet bit set.
#[inline]
#[target_feature(enable = "avx512f")]
fn bf16_bits(x: __m512) -> __m512i {
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), splat_i(1));
    let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(b, splat_i(0x7FFF)), lsb));
    let q = _mm512_or_si512(_mm512_srli_epi32::<16>(b), splat_i(0x40));
    _mm512_mask_blend_epi32(nan_mask(x), r, q)
}

/// bf16 bit patterns → f32 exactly as `half::bf16::to_f32` (NaN gets the quiet bit).
#[inline]
#[target_feature(enable = "avx512f")]
fn bf16_values(b: __m256i) -> __m512 {
    let w = _mm512_cvtepu16_epi32(b);
    let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(w, splat_i(0x7FFF)), splat_i(0x7F80));
    let w = _mm512_mask_or_epi32(w, nan, w, splat_i(0x40));
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
}

/// E2M1 codes (0..15 per lane) of 16 values: count the RNE midpoints passed (`>` where the
/// lower neighbour has the even code and wins the tie, `≥` otherwise), add the sign bit,
/// NaN → 0x7.
#[inline]
#[target_feature(enable = "avx512f")]
fn e2m1_codes(v: __m512) -> __m512i {
    let a = abs(v);
    let one = splat_i(1);
    let mut c = _mm512_setzero_si512();
    macro_rules! passed {
        ($pred:ident, $t:expr) => {
            let m = _mm512_cmp_ps_mask::<$pred>(a, _mm512_set1_ps($t));
            c = _mm512_mask_add_epi32(c, m, c, one);
        };
    }
    passed!(_CMP_GT_OQ, 0.25);
    passed!(_CMP_GE_OQ, 0.75);
    passed!(_CMP_GT_OQ, 1.25);
    passed!(_CMP_GE_OQ, 1.75);
    passed!(_CMP_GT_OQ, 2.5);
    passed!(_CMP_GE_OQ, 3.5);
    passed!(_CMP_GT_OQ, 5.0);
    let sign = _mm512_and_si512(_mm512_srli_epi32::<28>(_mm512_castps_si512(v)), splat_i(8));
    _mm512_mask_blend_epi32(nan_mask(v), _mm512_or_si512(c, sign), splat_i(7))
}

/// Packs 16 nibble codes into 8 bytes, element 2i in the low nibble of byte i.
#[inline]
#[target_feature(enable = "avx512f")]
fn pack_nibbles(c: __m512i) -> [u8; 8] {
    // Each 64-bit lane holds (even, odd); shifting the lane by 28 brings `odd` to bits 4..8.
    let p = _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64::<28>(c)));
    (_mm_cvtsi128_si64(p) as u64).to_le_bytes()
}

/// 8 packed bytes → 16 E2M1 values (signed table lookup).
#[inline]
#[target_feature(enable = "avx512f")]
fn e2m1_values(packed: &[u8; 8]) -> __m512 {
    let b = _mm_cvtsi64_si128(i64::from_le_bytes(*packed));
    // u16 lane i = byte | byte << 4: its low byte has the even code in its low nibble and its
    // high byte is the odd code; VPERMPS only reads the low 4 index bits.
    let w = _mm_cvtepu8_epi16(b);
    let w = _mm_or_si128(w, _mm_slli_epi16::<4>(w));
    let idx = _mm512_cvtepu8_epi32(w);
    let table = _mm512_setr_ps(
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    );
    _mm512_permutexvar_ps(idx, table)
}

/// Saturating E4M3 codes of 16 values, same steps as `scalar::e4m3_encode`.
#[inline]
#[target_feature(enable = "avx512f")]
fn e4m3_codes(v: __m512) -> __m128i {
    let bits = _mm512_castps_si512(v);
    // VMINPS returns 448 for NaN lanes; those are overwritten below.
    let a = _mm512_min_ps(abs(v), _mm512_set1_ps(E4M3_MAX));
    let e = _mm512_sub_epi32(
        _mm512_srli_epi32::<23>(_mm512_castps_si512(a)),
        splat_i(127),
    );
    let e = _mm512_max_epi32(e, splat_i(-6));
    // 2^(3 − e): scales the value to its code step count, exactly.
    let mult = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(splat_i(130), e)));
    let q = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(a, mult),
    );
    let code = _mm512_add_epi32(_mm512_slli_epi32::<3>(_mm512_add_epi32(e, splat_i(6))), q);
    let code = _mm512_or_si512(
        code,
        _mm512_and_si512(_mm512_srli_epi32::<24>(bits), splat_i(0x80)),
    );
    _mm512_cvtepi32_epi8(_mm512_mask_blend_epi32(nan_mask(v), code, splat_i(0x7F)))
}

/// 16 E4M3 bytes → f32, bit-identical to `scalar::E4M3_TABLE` (±NaN for 0x7F / 0xFF).
#[inline]
#[target_feature(enable = "avx512f")]
fn e4m3_values(b: __m128i) -> __m512 {
    let w = _mm512_cvtepu8_epi32(b);
    let m = _mm512_and_si512(w, splat_i(0x7F));
    // Exponent and mantissa dropped into f32's fields, then rebiased by 2^(127−7); exponent 0 lands
    // on an f32 subnormal, which the same multiply scales to m·2^-9 exactly.
    let f = _mm512_mul_ps(
        _mm512_castsi512_ps(_mm512_slli_epi32::<20>(m)),
        _mm512_set1_ps(pow2(120)),
    );
    let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(w, splat_i(0x80)));
    let f = _mm512_or_si512(_mm512_castps_si512(f), sign);
    let nan = _mm512_cmpeq_epi32_mask(m, splat_i(0x7F));
    let qnan = _mm512_or_si512(sign, splat_i(0x7FC0_0000));
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, f, qnan))
}

// ---- row codecs -------------------------------------------------------------------------------

#[target_feature(enable = "avx512f")]
fn encode_nvfp4(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    let (xs, _) = x.as_chunks::<16>();
    let (ds, _) = data.as_chunks_mut::<8>();
    for ((xi, di), si) in xs.iter().zip(ds).zip(scale.iter_mut()) {
        let v = bf16_round(load(xi));
        let amax = _mm512_reduce_max_ps(amax_acc(_mm512_setzero_ps(), v));
        let sb = e4m3_encode((amax / 6.0).clamp(pow2(-9), E4M3_MAX));
        *si = sb;
        // True IEEE division, as the reference (a reciprocal multiply misplaces exact ties).
        let q = _mm512_div_ps(v, _mm512_set1_ps(e4m3_decode(sb)));
        *di = pack_nibbles(e2m1_codes(q));
    }
}

#[target_feature(enable = "avx512f")]
fn encode_mxfp4(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    let (xs, _) = x.as_chunks::<32>();
    let (ds, _) = data.as_chunks_mut::<16>();
    for ((xi, di), si) in xs.iter().zip(ds).zip(scale.iter_mut()) {
        let (h, _) = xi.as_chunks::<16>();
        let v0 = bf16_round(load(&h[0]));
        let v1 = bf16_round(load(&h[1]));
        let acc = amax_acc(amax_acc(_mm512_setzero_ps(), v0), v1);
        let a = _mm512_reduce_max_ps(acc).max(6.0 * pow2(-126));
        let e = ceil_log2(a / 6.0).unwrap_or(127).clamp(-127, 127);
        *si = (e + 127) as u8;
        let inv = _mm512_set1_ps(pow2(-e));
        let (d0, d1) = di.split_at_mut(8);
        d0.copy_from_slice(&pack_nibbles(e2m1_codes(_mm512_mul_ps(v0, inv))));
        d1.copy_from_slice(&pack_nibbles(e2m1_codes(_mm512_mul_ps(v1, inv))));
    }
}

/// MXFP8 over blocks of `B` values (32 for MXFP8, 64 for the V4 record's NoPE part).
#[target_feature(enable = "avx512f")]
fn encode_mxfp8<const B: usize>(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    let mut v = [_mm512_setzero_ps(); 4];
    for ((xi, di), si) in x
        .chunks_exact(B)
        .zip(data.chunks_exact_mut(B))
        .zip(scale.iter_mut())
    {
        let (xv, _) = xi.as_chunks::<16>();
        let mut acc = _mm512_setzero_ps();
        for (vk, xk) in v.iter_mut().zip(xv) {
            *vk = bf16_round(load(xk));
            acc = amax_acc(acc, *vk);
        }
        let a = _mm512_reduce_max_ps(acc).max(1e-4);
        let e = ceil_log2(a / E4M3_MAX).unwrap_or(127).clamp(-127, 127);
        *si = (e + 127) as u8;
        let inv = _mm512_set1_ps(pow2(-e));
        let (dv, _) = di.as_chunks_mut::<16>();
        for (dk, vk) in dv.iter_mut().zip(&v) {
            store_bytes16(dk, e4m3_codes(_mm512_mul_ps(*vk, inv)));
        }
    }
}

#[target_feature(enable = "avx512f")]
fn encode_v4(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    encode_mxfp8::<64>(
        &x[..NOPE_DIM],
        &mut data[..NOPE_DIM],
        &mut scale[..NOPE_DIM / 64],
    );
    let (xr, _) = x[NOPE_DIM..].as_chunks::<16>();
    let (dr, _) = data[NOPE_DIM..].as_chunks_mut::<32>();
    for (xi, di) in xr.iter().zip(dr) {
        store_bytes32(di, _mm512_cvtepi32_epi16(bf16_bits(load(xi))));
    }
    scale[NOPE_DIM / 64] = 0;
}

#[target_feature(enable = "avx512f")]
fn encode_fp8_index(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    let (xs, _) = x.as_chunks::<16>();
    let mut v = [_mm512_setzero_ps(); 8];
    let mut acc = _mm512_setzero_ps();
    for (vk, xk) in v.iter_mut().zip(xs) {
        *vk = bf16_round(load(xk));
        acc = amax_acc(acc, *vk);
    }
    let a = _mm512_reduce_max_ps(acc).max(1e-4);
    let e = ceil_log2(a / E4M3_MAX).unwrap_or(127).clamp(-126, 127);
    let inv = _mm512_set1_ps(pow2(-e));
    let (dv, _) = data.as_chunks_mut::<16>();
    for (dk, vk) in dv.iter_mut().zip(&v) {
        store_bytes16(dk, e4m3_codes(_mm512_mul_ps(*vk, inv)));
    }
    scale.copy_from_slice(&pow2(e).to_le_bytes());
}

#[target_feature(enable = "avx512f")]
fn decode_e2m1_blocks<const B: usize>(data: &[u8], scales: &[f32], out: &mut [f32]) {
    let (ds, _) = data.as_chunks::<8>();
    let (os, _) = out.as_chunks_mut::<16>();
    let per_block = B / 16;
    for (i, (di, oi)) in ds.iter().zip(os).enumerate() {
        let s = _mm512_set1_ps(scales[i / per_block]);
        store(oi, _mm512_mul_ps(e2m1_values(di), s));
    }
}

#[target_feature(enable = "avx512f")]
fn decode_mxfp8<const B: usize>(data: &[u8], scale: &[u8], out: &mut [f32]) {
    for ((di, oi), &sb) in data.chunks_exact(B).zip(out.chunks_exact_mut(B)).zip(scale) {
        let s = _mm512_set1_ps(e8m0_decode(sb));
        let (dv, _) = di.as_chunks::<16>();
        let (ov, _) = oi.as_chunks_mut::<16>();
        for (dk, ok) in dv.iter().zip(ov) {
            store(ok, _mm512_mul_ps(e4m3_values(load_bytes16(dk)), s));
        }
    }
}

/// Encodes one row. Lengths are checked by the caller (`fast::encode_row`).
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn encode_row(fmt: RecordFormat, x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    match fmt {
        RecordFormat::Nvfp4Ds => encode_nvfp4(x, data, scale),
        RecordFormat::Mxfp4Index => encode_mxfp4(x, data, scale),
        RecordFormat::Mxfp8 => encode_mxfp8::<32>(x, data, scale),
        RecordFormat::V4Record => encode_v4(x, data, scale),
        RecordFormat::Fp8Index => encode_fp8_index(x, data, scale),
    }
}

/// Decodes one record. Lengths are checked by the caller (`fast::decode_row`).
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn decode_row(fmt: RecordFormat, data: &[u8], scale: &[u8], out: &mut [f32]) {
    match fmt {
        RecordFormat::Nvfp4Ds => {
            let mut s = [0f32; 32];
            for (d, &b) in s.iter_mut().zip(scale) {
                *d = e4m3_decode(b);
            }
            decode_e2m1_blocks::<16>(data, &s, out);
        }
        RecordFormat::Mxfp4Index => {
            let mut s = [0f32; 4];
            for (d, &b) in s.iter_mut().zip(scale) {
                *d = e8m0_decode(b);
            }
            decode_e2m1_blocks::<32>(data, &s, out);
        }
        RecordFormat::Mxfp8 => decode_mxfp8::<32>(data, scale, out),
        RecordFormat::V4Record => {
            decode_mxfp8::<64>(&data[..NOPE_DIM], &scale[..7], &mut out[..NOPE_DIM]);
            let (dr, _) = data[NOPE_DIM..].as_chunks::<32>();
            let (or, _) = out[NOPE_DIM..].as_chunks_mut::<16>();
            for (di, oi) in dr.iter().zip(or) {
                store(oi, bf16_values(load_bytes32(di)));
            }
        }
        RecordFormat::Fp8Index => {
            let s = _mm512_set1_ps(f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]));
            let (dv, _) = data.as_chunks::<16>();
            let (ov, _) = out.as_chunks_mut::<16>();
            for (dk, ok) in dv.iter().zip(ov) {
                store(ok, _mm512_mul_ps(e4m3_values(load_bytes16(dk)), s));
            }
        }
    }
}
