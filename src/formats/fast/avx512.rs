//! AVX-512F lanes of the row codecs: 16 f32 lanes, one NVFP4-DS block per vector.
//!
//! The codec steps at this width (mask registers, `vpermps` table lookups, down-converting
//! stores); the row codecs themselves are written once in `fast::rows`. Every step reproduces the
//! scalar reference in [`crate::formats::records`] operation for operation (same bf16 rounding,
//! same IEEE divide / multiply, same RNE), so the records are bit-identical; the tests in
//! `fast::tests` check that over random and special rows.

use super::rows::Lanes;
use crate::formats::scalar::{pow2, E4M3_MAX};
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

// ---- the lane type ----------------------------------------------------------------------------

/// 16 lanes of AVX-512F (one NVFP4-DS block per vector): the row codecs of `fast::rows` at this
/// width.
#[derive(Clone, Copy)]
pub(super) struct X16(__m512);

// SAFETY (every `unsafe` block below): the helpers need AVX-512F, and these methods are only
// inlined into `fast::encode_row_avx512` / `fast::decode_row_avx512`, which enable it and are
// only called after `Isa::Avx512.is_supported()`. The array conversions check the slice lengths
// first.
impl Lanes for X16 {
    const L: usize = 16;
    #[inline(always)]
    fn zero() -> Self {
        X16(unsafe { _mm512_setzero_ps() })
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        X16(unsafe { _mm512_set1_ps(x) })
    }
    #[inline(always)]
    fn load(x: &[f32]) -> Self {
        X16(unsafe { load(x.first_chunk().expect("16 floats")) })
    }
    #[inline(always)]
    fn store(self, out: &mut [f32]) {
        unsafe { store(out.first_chunk_mut().expect("16 floats"), self.0) }
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        X16(unsafe { _mm512_mul_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn div(self, b: Self) -> Self {
        X16(unsafe { _mm512_div_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn bf16_round(self) -> Self {
        X16(unsafe { bf16_round(self.0) })
    }
    #[inline(always)]
    fn amax_acc(acc: Self, x: Self) -> Self {
        X16(unsafe { amax_acc(acc.0, x.0) })
    }
    #[inline(always)]
    fn hmax(self) -> f32 {
        unsafe { _mm512_reduce_max_ps(self.0) }
    }
    #[inline(always)]
    fn store_e2m1(self, out: &mut [u8]) {
        *out.first_chunk_mut::<8>().expect("8 bytes") = unsafe { pack_nibbles(e2m1_codes(self.0)) };
    }
    #[inline(always)]
    fn load_e2m1(packed: &[u8]) -> Self {
        X16(unsafe { e2m1_values(packed.first_chunk().expect("8 bytes")) })
    }
    #[inline(always)]
    fn store_e4m3(self, out: &mut [u8]) {
        let out = out.first_chunk_mut().expect("16 bytes");
        unsafe { store_bytes16(out, e4m3_codes(self.0)) }
    }
    #[inline(always)]
    fn load_e4m3(b: &[u8]) -> Self {
        X16(unsafe { e4m3_values(load_bytes16(b.first_chunk().expect("16 bytes"))) })
    }
    #[inline(always)]
    fn store_bf16(self, out: &mut [u8]) {
        let out = out.first_chunk_mut().expect("32 bytes");
        unsafe { store_bytes32(out, _mm512_cvtepi32_epi16(bf16_bits(self.0))) }
    }
    #[inline(always)]
    fn load_bf16(b: &[u8]) -> Self {
        X16(unsafe { bf16_values(load_bytes32(b.first_chunk().expect("32 bytes"))) })
    }
}
