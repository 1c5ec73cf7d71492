//! Scalar codecs: E2M1 (FP4), E4M3 (OCP FP8 "fn", saturating), E8M0 (UE8M0 scale bytes).
//!
//! Bit rules: docs/SPEC.md §1.1–§1.3 (NVIDIA `__nv_cvt_float_to_fp4`,
//! `cvt.rn.satfinite.e4m3x2.f32`, `__nv_cvt_float_to_e8m0(…, RoundPosInf)`). All encoders round to
//! nearest, ties to even code.

/// Magnitudes of the 8 E2M1 codes (bit 3 is the sign).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Encodes one f32 as an E2M1 nibble (low 4 bits of the result).
///
/// RNE on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}; |x| > 6 and ±Inf saturate to ±6; NaN → 0x7 (+6);
/// a negative input that rounds to zero keeps its sign (0x8).
#[inline]
pub fn e2m1_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7;
    }
    let sign = if x.is_sign_negative() { 0x8 } else { 0 };
    let a = x.abs();
    // Midpoints between neighbouring grid values; `<=` where the lower code is even (wins the tie).
    let c = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    sign | c
}

/// Decodes the low nibble of `code` as E2M1.
#[inline]
pub fn e2m1_decode(code: u8) -> f32 {
    let m = E2M1_VALUES[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Encodes one f32 as E4M3 (bias 7, OCP "fn"), saturating: |x| > 448 and ±Inf → ±448 (0x7E/0xFE),
/// NaN → 0x7F. RNE; subnormals down to 2^-9.
#[inline]
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Unbiased exponent of a (normal f32), floored at E4M3's minimum normal exponent −6: below it the
    // quantum stays 2^-9 and the code counts subnormal steps, which runs on into the normals.
    let bits = a.to_bits();
    let e = ((bits >> 23) & 0xFF) as i32 - 127;
    let e_eff = e.max(-6);
    // Scaling by a power of two is exact in f32 for this range.
    let q = (a * pow2(3 - e_eff)).round_ties_even() as i32;
    sign | ((e_eff + 6) * 8 + q) as u8
}

/// Decodes an E4M3 byte (0x7F / 0xFF → NaN).
#[inline]
pub fn e4m3_decode(b: u8) -> f32 {
    E4M3_TABLE[b as usize]
}

/// All 256 E4M3 values, for table-driven decode.
pub static E4M3_TABLE: [f32; 256] = build_e4m3_table();

const fn build_e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        let exp = ((b >> 3) & 0xF) as i32;
        let man = (b & 7) as i32;
        let mag = if exp == 15 && man == 7 {
            f32::NAN
        } else if exp == 0 {
            // man · 2^-9
            man as f32 / 512.0
        } else {
            let m = (8 + man) as f32 / 8.0;
            let mut v = m;
            let mut k = exp - 7;
            while k > 0 {
                v *= 2.0;
                k -= 1;
            }
            while k < 0 {
                v /= 2.0;
                k += 1;
            }
            v
        };
        t[b] = if b & 0x80 != 0 { -mag } else { mag };
        b += 1;
    }
    t
}

/// 2^k as f32 for k in [-149, 127], exact (subnormal powers included).
#[inline]
pub fn pow2(k: i32) -> f32 {
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (k + 149))
    }
}

/// `ceil(log2(v))` computed exactly from the float bits (docs/SPEC.md §1): unbiased exponent, +1 when the
/// mantissa is non-zero. For v ≤ 0 returns −127 − 23 lower bound of the f32 range (callers clamp);
/// +Inf → 128; NaN → None.
#[inline]
pub fn ceil_log2(v: f32) -> Option<i32> {
    if v.is_nan() {
        return None;
    }
    if v <= 0.0 {
        return Some(-150);
    }
    if v.is_infinite() {
        return Some(128);
    }
    let bits = v.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32;
    let man = bits & 0x7F_FFFF;
    if exp == 0 {
        // Subnormal: v = man · 2^-149.
        let floor = 31 - man.leading_zeros() as i32 - 149;
        let exact = man.is_power_of_two();
        return Some(if exact { floor } else { floor + 1 });
    }
    Some(exp - 127 + i32::from(man != 0))
}

/// E8M0 byte of `2^ceil(log2(v))` (round toward +∞), saturating to [2^-127, 2^127]; NaN → 0xFF,
/// v ≤ 0 → 0x00.
#[inline]
pub fn e8m0_encode_ceil(v: f32) -> u8 {
    match ceil_log2(v) {
        None => 0xFF,
        Some(e) => (e.clamp(-127, 127) + 127) as u8,
    }
}

/// Decodes an E8M0 byte: 2^(e−127); 0xFF → NaN.
#[inline]
pub fn e8m0_decode(b: u8) -> f32 {
    if b == 0xFF {
        f32::NAN
    } else {
        pow2(b as i32 - 127)
    }
}

/// Rounds an f32 to the nearest bf16 (RNE) and back: the precision every record encoder starts from.
#[inline]
pub fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_golden() {
        let cases: [(f32, u8); 14] = [
            (0.25, 0x0),
            (0.2500001, 0x1),
            (-0.25, 0x8),
            (0.75, 0x2),
            (1.25, 0x2),
            (1.75, 0x4),
            (2.5, 0x4),
            (3.5, 0x6),
            (5.0, 0x6),
            (5.0001, 0x7),
            (6.5, 0x7),
            (f32::INFINITY, 0x7),
            (f32::NAN, 0x7),
            (-0.0, 0x8),
        ];
        for (x, c) in cases {
            assert_eq!(e2m1_encode(x), c, "e2m1({x})");
        }
        assert_eq!(e2m1_encode(f32::NEG_INFINITY), 0xF);
    }

    #[test]
    fn e4m3_golden_and_roundtrip() {
        for x in [449.0f32, 464.0, 465.0, f32::INFINITY] {
            assert_eq!(e4m3_encode(x), 0x7E, "{x}");
        }
        assert_eq!(e4m3_encode(f32::NAN), 0x7F);
        assert_eq!(e4m3_encode(-f32::INFINITY), 0xFE);
        assert_eq!(e4m3_encode(2f32.powi(-9)), 0x01);
        assert_eq!(e4m3_encode(2f32.powi(-10)), 0x00); // tie → even (0)
        assert_eq!(e4m3_encode(1.5 * 2f32.powi(-10)), 0x01);
        for b in 0u8..=255 {
            let v = e4m3_decode(b);
            if v.is_nan() {
                continue;
            }
            assert_eq!(e4m3_encode(v), b, "code {b:#x} value {v}");
        }
    }

    #[test]
    fn e8m0_golden() {
        assert_eq!(e8m0_encode_ceil(1.0), 0x7F);
        assert_eq!(e8m0_encode_ceil(1.5), 0x80);
        assert_eq!(e8m0_encode_ceil(3.0), 0x81);
        assert_eq!(e8m0_encode_ceil(0.75), 0x7F);
        assert_eq!(e8m0_encode_ceil(0.0), 0x00);
        assert_eq!(e8m0_encode_ceil(f32::NAN), 0xFF);
        assert_eq!(ceil_log2(f32::from_bits(1)), Some(-149));
        assert_eq!(ceil_log2(f32::from_bits(3)), Some(-147));
        assert!(e8m0_decode(0xFF).is_nan());
        assert_eq!(e8m0_decode(0x7F), 1.0);
    }
}
