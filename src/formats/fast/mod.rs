//! The fast row codecs: SIMD chosen at run time, bit-identical to the scalar reference.
//!
//! [`RecordFormat::encode_row`] / [`RecordFormat::decode_row`] stay the readable reference; this
//! module holds the vectorised versions and the dispatch: the row codecs are written once over a
//! lane count (`rows`), instantiated at 16 lanes (AVX-512F, `avx512`) and 8 lanes (AVX2, `avx2`)
//! on x86-64; the scalar code runs elsewhere. Tests below check every format on every ISA the machine has against the reference,
//! byte for byte (records) and bit for bit (decoded floats).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod rows;

use super::RecordFormat;

/// The instruction-set level of the row codecs: the crate's one level ([`crate::isa`]), so that
/// `CSA2_ISA` caps the codecs and the kernels that call them alike.
pub use crate::isa::Isa;

fn check_row(fmt: RecordFormat, values: usize, data: usize, scale: usize) {
    // Internal callers validate user input first; a mismatch here is a bug, and it must stop before
    // the SIMD code indexes past a slice.
    assert!(
        values == fmt.dim() && data == fmt.data_bytes() && scale == fmt.scale_bytes(),
        "{}: row of {values} values, {data} data and {scale} scale bytes",
        fmt.name()
    );
}

/// Encodes one row with `isa`; an unsupported `isa` falls back to the scalar reference.
///
/// Panics when the slice lengths are not `fmt.dim()`, `fmt.data_bytes()`, `fmt.scale_bytes()`
/// (crate-internal callers check them first).
#[inline]
pub(crate) fn encode_row(
    isa: Isa,
    fmt: RecordFormat,
    x: &[f32],
    data: &mut [u8],
    scale: &mut [u8],
) {
    check_row(fmt, x.len(), data.len(), scale.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if isa.is_supported() => {
            // SAFETY: AVX-512F was detected just above; lengths were checked.
            unsafe { encode_row_avx512(fmt, x, data, scale) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if isa.is_supported() => {
            // SAFETY: AVX2 was detected just above; lengths were checked.
            unsafe { encode_row_avx2(fmt, x, data, scale) }
        }
        _ => fmt.encode_row(x, data, scale),
    }
}

/// Decodes one record with `isa`; an unsupported `isa` falls back to the scalar reference.
///
/// Panics on wrong slice lengths, as [`encode_row`].
#[inline]
pub(crate) fn decode_row(isa: Isa, fmt: RecordFormat, data: &[u8], scale: &[u8], out: &mut [f32]) {
    check_row(fmt, out.len(), data.len(), scale.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if isa.is_supported() => {
            // SAFETY: AVX-512F was detected just above; lengths were checked.
            unsafe { decode_row_avx512(fmt, data, scale, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if isa.is_supported() => {
            // SAFETY: AVX2 was detected just above; lengths were checked.
            unsafe { decode_row_avx2(fmt, data, scale, out) }
        }
        _ => fmt.decode_row(data, scale, out),
    }
}

// The generic bodies compiled per ISA: `rows` is `#[inline(always)]` throughout, so each wrapper
// holds the whole codec built with its target feature.

/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn encode_row_avx512(fmt: RecordFormat, x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    rows::encode_row::<avx512::X16>(fmt, x, data, scale)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn encode_row_avx2(fmt: RecordFormat, x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    rows::encode_row::<avx2::X8>(fmt, x, data, scale)
}

/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_row_avx512(fmt: RecordFormat, data: &[u8], scale: &[u8], out: &mut [f32]) {
    rows::decode_row::<avx512::X16>(fmt, data, scale, out)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_row_avx2(fmt: RecordFormat, data: &[u8], scale: &[u8], out: &mut [f32]) {
    rows::decode_row::<avx2::X8>(fmt, data, scale, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::scalar::pow2;
    use rand::{Rng, SeedableRng};

    /// Values that sit on every rounding decision of every format: E2M1 midpoints at many block
    /// scales, E4M3 midpoints, bf16 ties, powers of two around the scale clamps, specials.
    fn special_values() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001), // NaN with only a low payload bit (bf16 rounding trap)
            f32::from_bits(0xFF80_0001),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            448.0,
            464.0,
            465.0,
            1e-4,
            1e-5,
            6.0 * pow2(-126),
            f32::from_bits(0x3F80_8000), // bf16 tie, even → down
            f32::from_bits(0x3F81_8000), // bf16 tie, odd → up
            f32::from_bits(0x7F7F_FFFF), // rounds to +Inf in bf16
        ];
        for k in -12..=10 {
            for m in [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0] {
                v.push(m * pow2(k));
                v.push(-m * pow2(k));
            }
        }
        v
    }

    fn rows(fmt: RecordFormat, n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let specials = special_values();
        let dim = fmt.dim();
        let mut x = Vec::with_capacity(n * dim);
        for r in 0..n {
            // Each row gets its own magnitude, so the block scales sweep their whole range.
            let mag = pow2(rng.random_range(-20..12));
            for _ in 0..dim {
                let v = match r % 4 {
                    0 => rng.random_range(-1.0f32..1.0) * mag,
                    1 => specials[rng.random_range(0..specials.len())],
                    2 if rng.random_bool(0.2) => specials[rng.random_range(0..specials.len())],
                    _ => f32::from_bits(rng.random::<u32>()),
                };
                x.push(v);
            }
        }
        x
    }

    #[test]
    fn every_isa_matches_the_scalar_reference_bit_for_bit() {
        for fmt in RecordFormat::ALL {
            let n = 400;
            let x = rows(fmt, n, 7 + fmt as u64);
            let (rb, db, dim) = (fmt.record_bytes(), fmt.data_bytes(), fmt.dim());
            let mut want = vec![0u8; n * rb];
            for (row, rec) in x.chunks_exact(dim).zip(want.chunks_exact_mut(rb)) {
                let (d, s) = rec.split_at_mut(db);
                fmt.encode_row(row, d, s);
            }
            let mut want_dec = vec![0f32; n * dim];
            for (rec, out) in want.chunks_exact(rb).zip(want_dec.chunks_exact_mut(dim)) {
                fmt.decode_row(&rec[..db], &rec[db..], out);
            }
            for isa in Isa::supported() {
                let mut got = vec![0u8; n * rb];
                for (row, rec) in x.chunks_exact(dim).zip(got.chunks_exact_mut(rb)) {
                    let (d, s) = rec.split_at_mut(db);
                    encode_row(isa, fmt, row, d, s);
                }
                for (r, (g, w)) in got.chunks(rb).zip(want.chunks(rb)).enumerate() {
                    assert_eq!(g, w, "{fmt:?} {isa:?} encode, row {r}");
                }
                // Decode every byte pattern too, not only the ones an encoder produces.
                let mut dec_in = want.clone();
                let mut rng = rand::rngs::StdRng::seed_from_u64(99);
                for rec in dec_in.chunks_exact_mut(rb).skip(n / 2) {
                    rng.fill(rec);
                }
                let mut want2 = vec![0f32; n * dim];
                let mut got2 = vec![0f32; n * dim];
                for ((rec, w), g) in dec_in
                    .chunks_exact(rb)
                    .zip(want2.chunks_exact_mut(dim))
                    .zip(got2.chunks_exact_mut(dim))
                {
                    fmt.decode_row(&rec[..db], &rec[db..], w);
                    decode_row(isa, fmt, &rec[..db], &rec[db..], g);
                }
                // Bit-identical, except that any NaN equals any NaN: Rust leaves the sign and
                // payload of a NaN produced by arithmetic unspecified (the compiler may swap the
                // operands of a multiply).
                for (i, (g, w)) in got2.iter().zip(&want2).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{fmt:?} {isa:?} decode, value {i}: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// The bulk entry points (threads above 512 rows) at every ISA level this CPU has give the
    /// same record bytes and the same decoded floats as each other and as the scalar level, over
    /// uniformly random f32 bit patterns (every exponent, NaN payloads, subnormals) and random
    /// record bytes, for several seeds and row counts on both sides of the threading threshold.
    #[test]
    fn every_isa_level_writes_the_same_bytes_over_random_inputs() {
        use crate::formats::{decode_rows_with, encode_rows_with};
        let levels = Isa::supported();
        assert_eq!(levels[0], Isa::Scalar);
        for fmt in RecordFormat::ALL {
            for (seed, n) in [
                (1u64, 3usize),
                (2, 97),
                (3, 2 * crate::formats::ROWS_PER_TASK + 5),
            ] {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed * 31 + fmt as u64);
                let x: Vec<f32> = (0..n * fmt.dim())
                    .map(|_| f32::from_bits(rng.random::<u32>()))
                    .collect();
                let mut recs: Vec<u8> = vec![0; n * fmt.record_bytes()];
                rng.fill(&mut recs[..]);
                let mut first: Option<(Vec<u8>, Vec<f32>)> = None;
                for &isa in &levels {
                    let mut enc = vec![0u8; n * fmt.record_bytes()];
                    encode_rows_with(isa, fmt, &x, &mut enc).unwrap();
                    let mut dec = vec![0f32; n * fmt.dim()];
                    decode_rows_with(isa, fmt, &recs, &mut dec).unwrap();
                    match &first {
                        None => first = Some((enc, dec)),
                        Some((e0, d0)) => {
                            let bad = enc.iter().zip(e0).position(|(a, b)| a != b);
                            assert!(bad.is_none(), "{fmt:?} {isa:?} seed {seed}: byte {bad:?}");
                            // Any NaN equals any NaN (see the test above); all else bit for bit.
                            for (i, (a, b)) in dec.iter().zip(d0).enumerate() {
                                assert!(
                                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                                    "{fmt:?} {isa:?} seed {seed}: value {i}: {a} vs {b}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
