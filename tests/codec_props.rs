//! Property tests of the record codecs (docs/SPEC.md §1) through the public bulk API (SIMD path):
//! canonical records survive decode → encode, and decode(encode(x)) stays within half an ulp of
//! the element format, relative to each block's scale. Plus edge rows with spec-derived results.
//!
//! Case counts are small for CI; raise them with PROPTEST_CASES.

use csa2::formats::scalar::{bf16_round, e2m1_decode, e4m3_decode, e8m0_decode, pow2, E2M1_VALUES};
use csa2::formats::{decode_rows, encode_rows, RecordFormat};
use proptest::prelude::*;

fn encode(fmt: RecordFormat, x: &[f32]) -> Vec<u8> {
    let mut r = vec![0u8; x.len() / fmt.dim() * fmt.record_bytes()];
    encode_rows(fmt, x, &mut r).unwrap();
    r
}

fn decode(fmt: RecordFormat, r: &[u8]) -> Vec<f32> {
    let mut x = vec![0f32; r.len() / fmt.record_bytes() * fmt.dim()];
    decode_rows(fmt, r, &mut x).unwrap();
    x
}

// ---- canonical records ------------------------------------------------------------------------

/// Nibbles of one E2M1 block with at least one ±6 (so the encoder's scale rule gives back the
/// block scale exactly).
fn e2m1_block(n: usize) -> impl Strategy<Value = Vec<u8>> {
    (prop::collection::vec(0u8..16, n), 0..n, any::<bool>()).prop_map(|(mut c, at, neg)| {
        c[at] = if neg { 0xF } else { 0x7 };
        c
    })
}

fn pack(codes: &[u8]) -> Vec<u8> {
    codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect()
}

/// E4M3 codes of one block, no NaN, at least one ±448.
fn e4m3_block(n: usize) -> impl Strategy<Value = Vec<u8>> {
    (prop::collection::vec(0u8..=255, n), 0..n, any::<bool>()).prop_map(|(mut c, at, neg)| {
        for b in c.iter_mut() {
            if *b & 0x7F == 0x7F {
                *b &= 0xFE;
            }
        }
        c[at] = if neg { 0xFE } else { 0x7E };
        c
    })
}

fn canonical(fmt: RecordFormat) -> BoxedStrategy<Vec<u8>> {
    match fmt {
        // Scale: a positive, non-zero, non-NaN E4M3 code.
        RecordFormat::Nvfp4Ds => (
            prop::collection::vec(e2m1_block(16), 32),
            prop::collection::vec(1u8..0x7F, 32),
        )
            .prop_map(|(blocks, scales)| {
                let mut r: Vec<u8> = blocks.iter().flat_map(|b| pack(b)).collect();
                r.extend(scales);
                r
            })
            .boxed(),
        // e in [-126, 125]: the 6·2^-126 floor and f32's range bound the rest.
        RecordFormat::Mxfp4Index => (
            prop::collection::vec(e2m1_block(32), 4),
            prop::collection::vec(1u8..=252, 4),
        )
            .prop_map(|(blocks, scales)| {
                let mut r: Vec<u8> = blocks.iter().flat_map(|b| pack(b)).collect();
                r.extend(scales);
                r
            })
            .boxed(),
        // e in [-22, 119]: the 1e-4 amax floor and f32's range.
        RecordFormat::Mxfp8 => (
            prop::collection::vec(e4m3_block(32), 16),
            prop::collection::vec(105u8..=246, 16),
        )
            .prop_map(|(blocks, scales)| {
                let mut r: Vec<u8> = blocks.concat();
                r.extend(scales);
                r
            })
            .boxed(),
        RecordFormat::V4Record => (
            prop::collection::vec(e4m3_block(64), 7),
            prop::collection::vec(any::<u16>(), 64),
            prop::collection::vec(105u8..=246, 7),
        )
            .prop_map(|(blocks, rope, scales)| {
                let mut r: Vec<u8> = blocks.concat();
                for b in rope {
                    // A signalling-NaN bf16 comes back quieted; keep to canonical patterns.
                    let b = if b & 0x7FFF > 0x7F80 { b | 0x40 } else { b };
                    r.extend(b.to_le_bytes());
                }
                r.extend(scales);
                r.push(0);
                r
            })
            .boxed(),
        RecordFormat::Fp8Index => (e4m3_block(128), -22i32..=119)
            .prop_map(|(mut data, e)| {
                data.extend(pow2(e).to_le_bytes());
                data
            })
            .boxed(),
    }
}

// ---- half-ulp bound ---------------------------------------------------------------------------

/// Half the gap of the E2M1 grid around magnitude `a`, or the overshoot when `a` saturates.
fn e2m1_half_gap(a: f64) -> f64 {
    let g = E2M1_VALUES;
    for w in g.windows(2) {
        if a <= w[1] as f64 {
            return (w[1] - w[0]) as f64 / 2.0;
        }
    }
    a - 6.0
}

/// Half an E4M3 ulp at magnitude `a` ≤ 448 (subnormal quantum 2^-9).
fn e4m3_half_ulp(a: f64) -> f64 {
    let k = if a > 0.0 {
        a.log2().floor().max(-6.0)
    } else {
        -6.0
    };
    2f64.powf(k - 4.0)
}

fn check_bound(fmt: RecordFormat, x: &[f32], rec: &[u8], y: &[f32]) -> Result<(), TestCaseError> {
    let db = fmt.data_bytes();
    let xb: Vec<f64> = x.iter().map(|&v| bf16_round(v) as f64).collect();
    let (block, scales): (usize, Vec<f64>) = match fmt {
        RecordFormat::Nvfp4Ds => (
            16,
            rec[db..].iter().map(|&b| e4m3_decode(b) as f64).collect(),
        ),
        RecordFormat::Mxfp4Index | RecordFormat::Mxfp8 => (
            32,
            rec[db..].iter().map(|&b| e8m0_decode(b) as f64).collect(),
        ),
        RecordFormat::V4Record => (
            64,
            rec[db..db + 7]
                .iter()
                .map(|&b| e8m0_decode(b) as f64)
                .collect(),
        ),
        RecordFormat::Fp8Index => (
            128,
            vec![f32::from_le_bytes(rec[db..db + 4].try_into().unwrap()) as f64],
        ),
    };
    let fp4 = matches!(fmt, RecordFormat::Nvfp4Ds | RecordFormat::Mxfp4Index);
    for (i, (&xv, &yv)) in xb.iter().zip(y).enumerate() {
        let yv = yv as f64;
        if fmt == RecordFormat::V4Record && i >= 448 {
            prop_assert_eq!(xv, yv, "rope value {} is stored as bf16 exactly", i);
            continue;
        }
        let s = scales[i / block];
        let a = xv.abs() / s;
        let half = if fp4 {
            e2m1_half_gap(a)
        } else {
            e4m3_half_ulp(a.min(448.0)) + (a - 448.0).max(0.0)
        };
        // 2^-20 relative slack for the f32 rounding of x / s.
        let bound = half * s * (1.0 + 1e-6) + xv.abs() * 2f64.powi(-20);
        prop_assert!(
            (xv - yv).abs() <= bound,
            "{:?} value {}: x {} decoded {} scale {} bound {}",
            fmt,
            i,
            xv,
            yv,
            s,
            bound
        );
    }
    Ok(())
}

fn row(dim: usize) -> impl Strategy<Value = Vec<f32>> {
    (-30i32..30).prop_flat_map(move |k| {
        let m = pow2(k);
        prop::collection::vec((-1.0f32..1.0).prop_map(move |v| v * m), dim)
    })
}

fn for_each_format(
    f: impl Fn(RecordFormat) -> Result<(), TestCaseError>,
) -> Result<(), TestCaseError> {
    for fmt in RecordFormat::ALL {
        f(fmt)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn canonical_nvfp4_survives_decode_encode(r in canonical(RecordFormat::Nvfp4Ds)) {
        let f = RecordFormat::Nvfp4Ds;
        prop_assert_eq!(encode(f, &decode(f, &r)), r);
    }
    #[test]
    fn canonical_mxfp4_survives_decode_encode(r in canonical(RecordFormat::Mxfp4Index)) {
        let f = RecordFormat::Mxfp4Index;
        prop_assert_eq!(encode(f, &decode(f, &r)), r);
    }
    #[test]
    fn canonical_mxfp8_survives_decode_encode(r in canonical(RecordFormat::Mxfp8)) {
        let f = RecordFormat::Mxfp8;
        prop_assert_eq!(encode(f, &decode(f, &r)), r);
    }
    #[test]
    fn canonical_v4_survives_decode_encode(r in canonical(RecordFormat::V4Record)) {
        let f = RecordFormat::V4Record;
        prop_assert_eq!(encode(f, &decode(f, &r)), r);
    }
    #[test]
    fn canonical_fp8index_survives_decode_encode(r in canonical(RecordFormat::Fp8Index)) {
        let f = RecordFormat::Fp8Index;
        prop_assert_eq!(encode(f, &decode(f, &r)), r);
    }

    #[test]
    fn decode_of_encode_is_within_half_an_ulp(x512 in row(512), x128 in row(128)) {
        for_each_format(|fmt| {
            let x = if fmt.dim() == 512 { &x512 } else { &x128 };
            let rec = encode(fmt, x);
            check_bound(fmt, x, &rec, &decode(fmt, &rec))
        })?;
    }
}

// ---- edge rows, expectations derived from docs/SPEC.md §1 --------------------------------------------

fn nibbles(rec: &[u8], n: usize) -> Vec<u8> {
    rec[..n / 2]
        .iter()
        .flat_map(|b| [b & 0xF, b >> 4])
        .collect()
}

#[test]
fn edge_rows_follow_the_spec() {
    use RecordFormat::*;
    let fill = |v: f32, n: usize| vec![v; n];
    // zeros: the smallest scales, zero codes (−0 keeps its sign in E2M1 and E4M3).
    let r = encode(Nvfp4Ds, &fill(0.0, 512));
    assert!(r[..256].iter().all(|&b| b == 0) && r[256..].iter().all(|&b| b == 0x01));
    let r = encode(Nvfp4Ds, &fill(-0.0, 512));
    assert!(r[..256].iter().all(|&b| b == 0x88));
    let r = encode(Mxfp4Index, &fill(0.0, 128));
    assert!(r[64..].iter().all(|&b| b == 1)); // e = ceil(log2(2^-126)) = −126
    let r = encode(Mxfp8, &fill(-0.0, 512));
    assert!(r[..512].iter().all(|&b| b == 0x80));
    // NaN: ignored by amax; E2M1 → +6 (0x7), E4M3 → 0x7F.
    let r = encode(Nvfp4Ds, &fill(f32::NAN, 512));
    assert!(r[..256].iter().all(|&b| b == 0x77) && r[256..].iter().all(|&b| b == 0x01));
    let r = encode(Mxfp8, &fill(f32::NAN, 512));
    assert!(r[..512].iter().all(|&b| b == 0x7F));
    // ±Inf saturate the scale and the element.
    let r = encode(Nvfp4Ds, &fill(f32::NEG_INFINITY, 512));
    assert!(r[..256].iter().all(|&b| b == 0xFF) && r[256..].iter().all(|&b| b == 0x7E));
    let r = encode(Mxfp4Index, &fill(f32::INFINITY, 128));
    assert!(r[..64].iter().all(|&b| b == 0x77) && r[64..].iter().all(|&b| b == 254));
    let r = encode(Mxfp8, &fill(f32::INFINITY, 512));
    assert!(r[..512].iter().all(|&b| b == 0x7E) && r[512..].iter().all(|&b| b == 254));
    // Huge finite (3e38): the NVFP4 scale saturates at 448, the values at ±6.
    let r = encode(Nvfp4Ds, &fill(3e38, 512));
    assert!(r[..256].iter().all(|&b| b == 0x77) && r[256..].iter().all(|&b| b == 0x7E));
    // Tiny (f32 subnormal): floors, zero codes, and it decodes to 0.
    let r = encode(Mxfp8, &fill(1e-40, 512));
    assert!(r[..512].iter().all(|&b| b == 0) && decode(Mxfp8, &r).iter().all(|&v| v == 0.0));
    // E2M1 ties at scale 1 (a 6.0 in the block pins e = 0): each tie goes to the even code.
    let mut x = vec![0.0f32; 128];
    let ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0];
    x[..ties.len()].copy_from_slice(&ties);
    let r = encode(Mxfp4Index, &x);
    assert_eq!(r[64], 127);
    assert_eq!(
        &nibbles(&r, 128)[..ties.len()],
        &[7, 0, 2, 2, 4, 4, 6, 6, 8, 14]
    );
    let d = decode(Mxfp4Index, &r);
    for (i, &c) in [7u8, 0, 2, 2, 4, 4, 6, 6, 8, 14].iter().enumerate() {
        assert_eq!(d[i].to_bits(), e2m1_decode(c).to_bits());
    }
    // E4M3 ties at scale 1 (448 pins e = 0): 464 is not reachable, 17 → 16, 19 → 20, 2^-10 → 0.
    let mut x = vec![0.0f32; 512];
    let e4 = [448.0, 17.0, 19.0, pow2(-10), 1.5 * pow2(-10), -2.5];
    x[..e4.len()].copy_from_slice(&e4);
    let r = encode(Mxfp8, &x);
    assert_eq!(r[512], 127);
    assert_eq!(&r[..e4.len()], &[0x7E, 0x58, 0x5A, 0x00, 0x01, 0xC2]);
    // A NaN scale byte decodes to NaN for the block only.
    let mut r = encode(Mxfp8, &fill(1.0, 512));
    r[512] = 0xFF;
    let d = decode(Mxfp8, &r);
    assert!(d[..32].iter().all(|v| v.is_nan()) && d[32..].iter().all(|&v| v == 1.0));
}
