//! The SIMD row codecs, written once over a lane count.
//!
//! Every body here is `#[inline(always)]` and generic over [`Lanes`]; `fast::encode_row` /
//! `fast::decode_row` instantiate it inside an `avx512f` wrapper (16 lanes, `avx512::X16`) and an
//! `avx2` wrapper (8 lanes, `avx2::X8`), so each instance is compiled with its ISA's instructions
//! (the pattern of `ops::simd`'s `multiversion!`). What differs between the ISAs — mask registers
//! against blend vectors, the nibble and byte packing, the table lookups — lives in the two lane
//! files; the block structure (bf16 rounding, amax, scale choice, quantise, pack) lives only here.
//!
//! Each step repeats the scalar reference ([`crate::formats::records`]) operation for operation:
//! the same bf16 rounding, a true IEEE divide where the reference divides, a multiply by an exact
//! power of two where it multiplies, RNE everywhere. Max is exact and order-free on the NaN-free
//! accumulators, so any lane count gives the reference's amax. The records are therefore
//! bit-identical at every lane count (tested in `fast::tests`, over random and special rows).

use crate::formats::records::{RecordFormat, NOPE_DIM};
use crate::formats::scalar::{ceil_log2, e4m3_decode, e4m3_encode, e8m0_decode, pow2, E4M3_MAX};

/// An f32 vector of `L` lanes with the codec steps of docs/SPEC.md §1 (`L` is 8 or 16; a block
/// of every format is a whole number of vectors).
///
/// Slice arguments must hold at least the stated number of elements (a shorter one panics before
/// any vector access). The methods are only ever inlined into code compiled with the lane type's
/// target feature (see the module note); the implementations rely on that.
pub(super) trait Lanes: Copy {
    /// Lanes.
    const L: usize;
    /// All lanes 0.
    fn zero() -> Self;
    /// All lanes `x`.
    fn splat(x: f32) -> Self;
    /// `L` floats from `x[..L]`.
    fn load(x: &[f32]) -> Self;
    /// Writes the lanes to `out[..L]`.
    fn store(self, out: &mut [f32]);
    /// Lane-wise IEEE product.
    fn mul(self, b: Self) -> Self;
    /// Lane-wise IEEE quotient.
    fn div(self, b: Self) -> Self;
    /// Round to the nearest bf16 (ties to even) and back; NaN lanes stay NaN.
    fn bf16_round(self) -> Self;
    /// `max(acc, |x|)` lane-wise, skipping NaN lanes of `x` like `f32::max` (`acc` is never NaN).
    fn amax_acc(acc: Self, x: Self) -> Self;
    /// Largest lane (of a NaN-free vector).
    fn hmax(self) -> f32;
    /// E2M1 codes of the lanes, packed two per byte (element 2i in the low nibble of byte i),
    /// into `out[..L / 2]`.
    fn store_e2m1(self, out: &mut [u8]);
    /// The E2M1 values of `L / 2` packed bytes.
    fn load_e2m1(packed: &[u8]) -> Self;
    /// Saturating E4M3 codes of the lanes into `out[..L]`.
    fn store_e4m3(self, out: &mut [u8]);
    /// The E4M3 values of `b[..L]` (±NaN for 0x7F / 0xFF).
    fn load_e4m3(b: &[u8]) -> Self;
    /// bf16 bit patterns of the lanes (`half::bf16::from_f32`), little-endian, into `out[..2L]`.
    fn store_bf16(self, out: &mut [u8]);
    /// The f32 values of `2L` little-endian bf16 bytes (`half::bf16::to_f32`).
    fn load_bf16(b: &[u8]) -> Self;
}

/// The most vectors one block needs at the narrowest lane count (8): the FP8 index-K row, one
/// block of 128 values.
const MAX_VECTORS: usize = 16;

/// The bf16-rounded vectors of one block `x` (a whole number of vectors, at most
/// [`MAX_VECTORS`] · 8 values) and the block's amax.
///
/// The array is a fixed size because a length of `x.len() / V::L` cannot be a type yet; only the
/// first `x.len() / V::L` entries are written and read, and the compiler keeps those in registers.
#[inline(always)]
fn load_block<V: Lanes>(x: &[f32]) -> ([V; MAX_VECTORS], f32) {
    let mut v = [V::zero(); MAX_VECTORS];
    let mut acc = V::zero();
    for (vk, xk) in v.iter_mut().zip(x.chunks_exact(V::L)) {
        *vk = V::load(xk).bf16_round();
        acc = V::amax_acc(acc, *vk);
    }
    (v, acc.hmax())
}

/// NVFP4-DS: per 16 values, one E4M3 scale `amax / 6` and 16 E2M1 codes of `v / scale`.
#[inline(always)]
fn encode_nvfp4<V: Lanes>(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    for ((xi, di), si) in x
        .chunks_exact(16)
        .zip(data.chunks_exact_mut(8))
        .zip(scale.iter_mut())
    {
        let (v, amax) = load_block::<V>(xi);
        let sb = e4m3_encode((amax / 6.0).clamp(pow2(-9), E4M3_MAX));
        *si = sb;
        // True IEEE division, as the reference (a reciprocal multiply misplaces exact ties).
        let s = V::splat(e4m3_decode(sb));
        for (vk, dk) in v.iter().zip(di.chunks_exact_mut(V::L / 2)) {
            vk.div(s).store_e2m1(dk);
        }
    }
}

/// MXFP4 index K: per 32 values, one UE8M0 scale 2^⌈log2(amax / 6)⌉ and 32 E2M1 codes.
#[inline(always)]
fn encode_mxfp4<V: Lanes>(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    for ((xi, di), si) in x
        .chunks_exact(32)
        .zip(data.chunks_exact_mut(16))
        .zip(scale.iter_mut())
    {
        let (v, amax) = load_block::<V>(xi);
        let a = amax.max(6.0 * pow2(-126));
        let e = ceil_log2(a / 6.0).unwrap_or(127).clamp(-127, 127);
        *si = (e + 127) as u8;
        let inv = V::splat(pow2(-e));
        for (vk, dk) in v.iter().zip(di.chunks_exact_mut(V::L / 2)) {
            vk.mul(inv).store_e2m1(dk);
        }
    }
}

/// MXFP8 over blocks of `B` values (32 for MXFP8, 64 for the V4 record's NoPE part): one UE8M0
/// scale 2^⌈log2(amax / 448)⌉ and `B` E4M3 codes per block.
#[inline(always)]
fn encode_mxfp8<V: Lanes, const B: usize>(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    for ((xi, di), si) in x
        .chunks_exact(B)
        .zip(data.chunks_exact_mut(B))
        .zip(scale.iter_mut())
    {
        let (v, amax) = load_block::<V>(xi);
        let a = amax.max(1e-4);
        let e = ceil_log2(a / E4M3_MAX).unwrap_or(127).clamp(-127, 127);
        *si = (e + 127) as u8;
        let inv = V::splat(pow2(-e));
        for (vk, dk) in v.iter().zip(di.chunks_exact_mut(V::L)) {
            vk.mul(inv).store_e4m3(dk);
        }
    }
}

/// V4: MXFP8 (per 64) NoPE part, bf16 RoPE part, 7 scales + one zero pad byte.
#[inline(always)]
fn encode_v4<V: Lanes>(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    encode_mxfp8::<V, 64>(
        &x[..NOPE_DIM],
        &mut data[..NOPE_DIM],
        &mut scale[..NOPE_DIM / 64],
    );
    for (xi, di) in x[NOPE_DIM..]
        .chunks_exact(V::L)
        .zip(data[NOPE_DIM..].chunks_exact_mut(2 * V::L))
    {
        V::load(xi).store_bf16(di);
    }
    scale[NOPE_DIM / 64] = 0;
}

/// FP8 index K: one block of 128 E4M3 codes and one fp32 power-of-two scale.
#[inline(always)]
fn encode_fp8_index<V: Lanes>(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    let (v, amax) = load_block::<V>(x);
    let a = amax.max(1e-4);
    let e = ceil_log2(a / E4M3_MAX).unwrap_or(127).clamp(-126, 127);
    let inv = V::splat(pow2(-e));
    for (vk, dk) in v.iter().zip(data.chunks_exact_mut(V::L)) {
        vk.mul(inv).store_e4m3(dk);
    }
    scale.copy_from_slice(&pow2(e).to_le_bytes());
}

/// E2M1 data with one decoded scale per `B` values.
#[inline(always)]
fn decode_e2m1_blocks<V: Lanes, const B: usize>(data: &[u8], scales: &[f32], out: &mut [f32]) {
    let per_block = B / V::L;
    for (i, (di, oi)) in data
        .chunks_exact(V::L / 2)
        .zip(out.chunks_exact_mut(V::L))
        .enumerate()
    {
        let s = V::splat(scales[i / per_block]);
        V::load_e2m1(di).mul(s).store(oi);
    }
}

/// E4M3 data with one UE8M0 scale per `B` values.
#[inline(always)]
fn decode_mxfp8<V: Lanes, const B: usize>(data: &[u8], scale: &[u8], out: &mut [f32]) {
    for ((di, oi), &sb) in data.chunks_exact(B).zip(out.chunks_exact_mut(B)).zip(scale) {
        let s = V::splat(e8m0_decode(sb));
        for (dk, ok) in di.chunks_exact(V::L).zip(oi.chunks_exact_mut(V::L)) {
            V::load_e4m3(dk).mul(s).store(ok);
        }
    }
}

/// Encodes one row at `V`'s lane count. Lengths are checked by the caller (`fast::encode_row`).
#[inline(always)]
pub(super) fn encode_row<V: Lanes>(
    fmt: RecordFormat,
    x: &[f32],
    data: &mut [u8],
    scale: &mut [u8],
) {
    match fmt {
        RecordFormat::Nvfp4Ds => encode_nvfp4::<V>(x, data, scale),
        RecordFormat::Mxfp4Index => encode_mxfp4::<V>(x, data, scale),
        RecordFormat::Mxfp8 => encode_mxfp8::<V, 32>(x, data, scale),
        RecordFormat::V4Record => encode_v4::<V>(x, data, scale),
        RecordFormat::Fp8Index => encode_fp8_index::<V>(x, data, scale),
    }
}

/// Decodes one record at `V`'s lane count. Lengths are checked by the caller (`fast::decode_row`).
#[inline(always)]
pub(super) fn decode_row<V: Lanes>(fmt: RecordFormat, data: &[u8], scale: &[u8], out: &mut [f32]) {
    match fmt {
        RecordFormat::Nvfp4Ds => {
            let mut s = [0f32; 32];
            for (d, &b) in s.iter_mut().zip(scale) {
                *d = e4m3_decode(b);
            }
            decode_e2m1_blocks::<V, 16>(data, &s, out);
        }
        RecordFormat::Mxfp4Index => {
            let mut s = [0f32; 4];
            for (d, &b) in s.iter_mut().zip(scale) {
                *d = e8m0_decode(b);
            }
            decode_e2m1_blocks::<V, 32>(data, &s, out);
        }
        RecordFormat::Mxfp8 => decode_mxfp8::<V, 32>(data, scale, out),
        RecordFormat::V4Record => {
            decode_mxfp8::<V, 64>(
                &data[..NOPE_DIM],
                &scale[..NOPE_DIM / 64],
                &mut out[..NOPE_DIM],
            );
            for (di, oi) in data[NOPE_DIM..]
                .chunks_exact(2 * V::L)
                .zip(out[NOPE_DIM..].chunks_exact_mut(V::L))
            {
                V::load_bf16(di).store(oi);
            }
        }
        RecordFormat::Fp8Index => {
            let s = V::splat(f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]));
            for (dk, ok) in data.chunks_exact(V::L).zip(out.chunks_exact_mut(V::L)) {
                V::load_e4m3(dk).mul(s).store(ok);
            }
        }
    }
}
