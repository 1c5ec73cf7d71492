//! AVX2 lanes of the row codecs: 8 f32 lanes, for x86-64 CPUs without AVX-512.
//!
//! The codec steps at this width (mask-free compares counted by subtraction, blend vectors,
//! 128-bit packs); the row codecs themselves are written once in `fast::rows`. Same operation
//! order as the scalar reference in [`crate::formats::records`] (bit-identical records; tested in
//! `fast::tests`). `_mm256_cvtps_epi32` rounds with MXCSR, which Rust code always runs at its
//! default (RNE).

use super::rows::Lanes;
use crate::formats::scalar::{pow2, E4M3_MAX};
use core::arch::x86_64::*;

// ---- loads and stores -----------------------------------------------------------------------

#[inline]
#[target_feature(enable = "avx2")]
fn load(x: &[f32; 8]) -> __m256 {
    // SAFETY: the reference covers exactly 8 f32; the load is unaligned.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn store(out: &mut [f32; 8], v: __m256) {
    // SAFETY: the reference covers exactly 8 f32; the store is unaligned.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load_bytes16(b: &[u8; 16]) -> __m128i {
    // SAFETY: the reference covers exactly 16 bytes; the load is unaligned.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn store_bytes16(out: &mut [u8; 16], v: __m128i) {
    // SAFETY: the reference covers exactly 16 bytes; the store is unaligned.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), v) }
}

// ---- lane helpers ---------------------------------------------------------------------------

#[inline]
#[target_feature(enable = "avx2")]
fn splat_i(v: i32) -> __m256i {
    _mm256_set1_epi32(v)
}

#[inline]
#[target_feature(enable = "avx2")]
fn abs(x: __m256) -> __m256 {
    _mm256_and_ps(x, _mm256_castsi256_ps(splat_i(0x7FFF_FFFF)))
}

#[inline]
#[target_feature(enable = "avx2")]
fn nan_mask(x: __m256) -> __m256 {
    _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x)
}

/// Running max of |x| skipping NaN lanes (VMAXPS returns the second operand on NaN).
#[inline]
#[target_feature(enable = "avx2")]
fn amax_acc(acc: __m256, x: __m256) -> __m256 {
    _mm256_max_ps(abs(x), acc)
}

#[inline]
#[target_feature(enable = "avx2")]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    _mm_cvtss_f32(m)
}

/// RNE to bf16 and back; NaN lanes stay NaN.
#[inline]
#[target_feature(enable = "avx2")]
fn bf16_round(x: __m256) -> __m256 {
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), splat_i(1));
    let r = _mm256_add_epi32(_mm256_add_epi32(b, splat_i(0x7FFF)), lsb);
    let r = _mm256_and_si256(r, splat_i(0xFFFF_0000u32 as i32));
    _mm256_blendv_ps(_mm256_castsi256_ps(r), x, nan_mask(x))
}

/// bf16 bit patterns as `half::bf16::from_f32` (RNE; NaN → high half | quiet bit).
#[inline]
#[target_feature(enable = "avx2")]
fn bf16_bits(x: __m256) -> __m256i {
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), splat_i(1));
    let r = _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(b, splat_i(0x7FFF)), lsb));
    let q = _mm256_or_si256(_mm256_srli_epi32::<16>(b), splat_i(0x40));
    _mm256_blendv_epi8(r, q, _mm256_castps_si256(nan_mask(x)))
}

/// 8 bf16 patterns → f32 as `half::bf16::to_f32` (NaN gets the quiet bit).
#[inline]
#[target_feature(enable = "avx2")]
fn bf16_values(b: __m128i) -> __m256 {
    let w = _mm256_cvtepu16_epi32(b);
    let nan = _mm256_cmpgt_epi32(_mm256_and_si256(w, splat_i(0x7FFF)), splat_i(0x7F80));
    let w = _mm256_or_si256(w, _mm256_and_si256(nan, splat_i(0x40)));
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
}

/// E2M1 codes (0..15 per lane): count the RNE midpoints passed, add the sign, NaN → 0x7.
#[inline]
#[target_feature(enable = "avx2")]
fn e2m1_codes(v: __m256) -> __m256i {
    let a = abs(v);
    let mut c = _mm256_setzero_si256();
    macro_rules! passed {
        ($pred:ident, $t:expr) => {
            // A true compare is all ones (−1): subtracting it counts the midpoint.
            let m = _mm256_cmp_ps::<$pred>(a, _mm256_set1_ps($t));
            c = _mm256_sub_epi32(c, _mm256_castps_si256(m));
        };
    }
    passed!(_CMP_GT_OQ, 0.25);
    passed!(_CMP_GE_OQ, 0.75);
    passed!(_CMP_GT_OQ, 1.25);
    passed!(_CMP_GE_OQ, 1.75);
    passed!(_CMP_GT_OQ, 2.5);
    passed!(_CMP_GE_OQ, 3.5);
    passed!(_CMP_GT_OQ, 5.0);
    let sign = _mm256_and_si256(_mm256_srli_epi32::<28>(_mm256_castps_si256(v)), splat_i(8));
    _mm256_blendv_epi8(
        _mm256_or_si256(c, sign),
        splat_i(7),
        _mm256_castps_si256(nan_mask(v)),
    )
}

/// Packs 8 nibble codes into 4 bytes, element 2i in the low nibble of byte i.
#[inline]
#[target_feature(enable = "avx2")]
fn pack_nibbles(c: __m256i) -> [u8; 4] {
    let p = _mm256_or_si256(c, _mm256_srli_epi64::<28>(c));
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    let lo = _mm256_castsi256_si128(p);
    let b = _mm_packus_epi16(_mm_packus_epi32(lo, lo), _mm_setzero_si128());
    _mm_cvtsi128_si32(b).to_le_bytes()
}

/// 4 packed bytes → 8 E2M1 values.
#[inline]
#[target_feature(enable = "avx2")]
fn e2m1_values(packed: &[u8; 4]) -> __m256 {
    let b = _mm_cvtsi32_si128(i32::from_le_bytes(*packed));
    let w = _mm_cvtepu8_epi16(b);
    let w = _mm_or_si128(w, _mm_slli_epi16::<4>(w));
    let idx = _mm256_cvtepu8_epi32(w);
    let table = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
    let mag = _mm256_permutevar8x32_ps(table, idx);
    let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(idx, splat_i(8)));
    _mm256_or_ps(mag, _mm256_castsi256_ps(sign))
}

/// Saturating E4M3 codes of 8 values (low 8 bytes of the result).
#[inline]
#[target_feature(enable = "avx2")]
fn e4m3_codes(v: __m256) -> [u8; 8] {
    let bits = _mm256_castps_si256(v);
    let a = _mm256_min_ps(abs(v), _mm256_set1_ps(E4M3_MAX));
    let e = _mm256_sub_epi32(
        _mm256_srli_epi32::<23>(_mm256_castps_si256(a)),
        splat_i(127),
    );
    let e = _mm256_max_epi32(e, splat_i(-6));
    let mult = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_sub_epi32(splat_i(130), e)));
    let q = _mm256_cvtps_epi32(_mm256_mul_ps(a, mult));
    let code = _mm256_add_epi32(_mm256_slli_epi32::<3>(_mm256_add_epi32(e, splat_i(6))), q);
    let code = _mm256_or_si256(
        code,
        _mm256_and_si256(_mm256_srli_epi32::<24>(bits), splat_i(0x80)),
    );
    let code = _mm256_blendv_epi8(code, splat_i(0x7F), _mm256_castps_si256(nan_mask(v)));
    let w = _mm_packus_epi32(
        _mm256_castsi256_si128(code),
        _mm256_extracti128_si256::<1>(code),
    );
    (_mm_cvtsi128_si64(_mm_packus_epi16(w, w)) as u64).to_le_bytes()
}

/// 8 E4M3 bytes → f32, bit-identical to `scalar::E4M3_TABLE`.
#[inline]
#[target_feature(enable = "avx2")]
fn e4m3_values(b: &[u8; 8]) -> __m256 {
    let w = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(*b)));
    let m = _mm256_and_si256(w, splat_i(0x7F));
    let f = _mm256_mul_ps(
        _mm256_castsi256_ps(_mm256_slli_epi32::<20>(m)),
        _mm256_set1_ps(pow2(120)),
    );
    let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(w, splat_i(0x80)));
    let f = _mm256_or_si256(_mm256_castps_si256(f), sign);
    let nan = _mm256_cmpeq_epi32(m, splat_i(0x7F));
    let qnan = _mm256_or_si256(sign, splat_i(0x7FC0_0000));
    _mm256_castsi256_ps(_mm256_blendv_epi8(f, qnan, nan))
}

// ---- the lane type ----------------------------------------------------------------------------

/// 8 lanes of AVX2: the row codecs of `fast::rows` at this width.
#[derive(Clone, Copy)]
pub(super) struct X8(__m256);

// SAFETY (every `unsafe` block below): the helpers need AVX2, and these methods are only inlined
// into `fast::encode_row_avx2` / `fast::decode_row_avx2`, which enable it and are only called after
// `Isa::Avx2.is_supported()`. The array conversions check the slice lengths first.
impl Lanes for X8 {
    const L: usize = 8;
    #[inline(always)]
    fn zero() -> Self {
        X8(unsafe { _mm256_setzero_ps() })
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        X8(unsafe { _mm256_set1_ps(x) })
    }
    #[inline(always)]
    fn load(x: &[f32]) -> Self {
        X8(unsafe { load(x.first_chunk().expect("8 floats")) })
    }
    #[inline(always)]
    fn store(self, out: &mut [f32]) {
        unsafe { store(out.first_chunk_mut().expect("8 floats"), self.0) }
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        X8(unsafe { _mm256_mul_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn div(self, b: Self) -> Self {
        X8(unsafe { _mm256_div_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn bf16_round(self) -> Self {
        X8(unsafe { bf16_round(self.0) })
    }
    #[inline(always)]
    fn amax_acc(acc: Self, x: Self) -> Self {
        X8(unsafe { amax_acc(acc.0, x.0) })
    }
    #[inline(always)]
    fn hmax(self) -> f32 {
        unsafe { hmax(self.0) }
    }
    #[inline(always)]
    fn store_e2m1(self, out: &mut [u8]) {
        *out.first_chunk_mut::<4>().expect("4 bytes") = unsafe { pack_nibbles(e2m1_codes(self.0)) };
    }
    #[inline(always)]
    fn load_e2m1(packed: &[u8]) -> Self {
        X8(unsafe { e2m1_values(packed.first_chunk().expect("4 bytes")) })
    }
    #[inline(always)]
    fn store_e4m3(self, out: &mut [u8]) {
        *out.first_chunk_mut::<8>().expect("8 bytes") = unsafe { e4m3_codes(self.0) };
    }
    #[inline(always)]
    fn load_e4m3(b: &[u8]) -> Self {
        X8(unsafe { e4m3_values(b.first_chunk().expect("8 bytes")) })
    }
    #[inline(always)]
    fn store_bf16(self, out: &mut [u8]) {
        let out = out.first_chunk_mut().expect("16 bytes");
        unsafe {
            let b = bf16_bits(self.0);
            let w = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
            store_bytes16(out, w);
        }
    }
    #[inline(always)]
    fn load_bf16(b: &[u8]) -> Self {
        X8(unsafe { bf16_values(load_bytes16(b.first_chunk().expect("16 bytes"))) })
    }
}
