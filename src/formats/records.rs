//! The five KV record formats of docs/SPEC.md §1, one row at a time.
//!
//! A row codec writes a record's *data* bytes and its *scale* bytes into two separate slices, so the
//! same code fills a standalone record (data then scales, contiguous) and a block-planar cache page
//! (all slots' data, then all slots' scales; see [`super::page`]). Every encoder first rounds its
//! input to bf16 (docs/SPEC.md §1: "inputs are the bf16-rounded, RoPE'd values"); for bf16 inputs that is
//! the identity.

use super::abi;
use super::scalar::*;
use crate::error::{Error, Result};
use serde::Serialize;

/// A KV record format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[repr(i32)]
pub enum RecordFormat {
    /// V4.1 main KV "NVFP4 without global scale": 512 values → 256 B E2M1 + 32 × E4M3 (per 16).
    Nvfp4Ds = abi::FORMAT_NVFP4,
    /// V4.1 index K: 128 values → 64 B E2M1 + 4 × E8M0 (per 32, DeepSeek ceil rule).
    Mxfp4Index = abi::FORMAT_MXFP4_INDEX,
    /// SWA window (and MXFP8 main) KV: 512 values → 512 B E4M3 + 16 × E8M0 (per 32).
    Mxfp8 = abi::FORMAT_MXFP8,
    /// Launch-day V4 main record: 448 E4M3 NoPE + 64 bf16 RoPE values + 7 × E8M0 (per 64) + 1 pad.
    V4Record = abi::FORMAT_V4,
    /// Launch-day index K: 128 E4M3 + one fp32 power-of-two scale.
    Fp8Index = abi::FORMAT_FP8_INDEX,
}

// The widths below and the ids above come from `formats::abi`, which the kernels are compiled
// from too.
/// Bytes of one NVFP4-DS main-KV record (288).
pub const NVFP4_DS_BYTES: usize = RecordFormat::Nvfp4Ds.record_bytes();
/// Bytes of one MXFP4 index-K record (68).
pub const MXFP4_INDEX_BYTES: usize = RecordFormat::Mxfp4Index.record_bytes();
/// Bytes of one MXFP8 record (528).
pub const MXFP8_BYTES: usize = RecordFormat::Mxfp8.record_bytes();
/// Bytes of one V4 record (584).
pub const V4_RECORD_BYTES: usize = RecordFormat::V4Record.record_bytes();
/// Bytes of one FP8 index-K record (132).
pub const FP8_INDEX_BYTES: usize = RecordFormat::Fp8Index.record_bytes();

/// Latent width (values per main-KV / SWA row) and index-K width: the geometry's
/// ([`crate::geometry::consts`]).
pub use crate::geometry::consts::{INDEX_DIM, KV_DIM};
/// NoPE dims of a latent (V4 record).
pub use abi::NOPE_DIM;

impl RecordFormat {
    /// All formats.
    pub const ALL: [RecordFormat; 5] = [
        RecordFormat::Nvfp4Ds,
        RecordFormat::Mxfp4Index,
        RecordFormat::Mxfp8,
        RecordFormat::V4Record,
        RecordFormat::Fp8Index,
    ];

    /// The `Csa2Format` value of this format in the C ABI (the discriminant; the header's enum
    /// names the same numbers, checked by the ffi tests).
    pub const fn abi_id(self) -> i32 {
        self as i32
    }

    /// The format of a `Csa2Format` value.
    ///
    /// Errors: [`Error::Invalid`] (named `what`) for any other value.
    pub fn from_abi_id(v: i32, what: &str) -> Result<RecordFormat> {
        RecordFormat::ALL
            .into_iter()
            .find(|f| f.abi_id() == v)
            .ok_or_else(|| {
                let known: Vec<String> = RecordFormat::ALL
                    .iter()
                    .map(|f| format!("{} {}", f.abi_id(), f.name()))
                    .collect();
                Error::invalid(
                    what,
                    format!("{v} is not a Csa2Format ({})", known.join(", ")),
                )
            })
    }

    /// Values per row (512 or 128).
    pub const fn dim(self) -> usize {
        match self {
            RecordFormat::Mxfp4Index | RecordFormat::Fp8Index => INDEX_DIM,
            _ => KV_DIM,
        }
    }
    /// Data bytes per record (for V4: the E4M3 NoPE bytes and the bf16 RoPE bytes).
    pub const fn data_bytes(self) -> usize {
        match self {
            RecordFormat::Nvfp4Ds => abi::NVFP4_DATA,
            RecordFormat::Mxfp4Index => abi::MXFP4_INDEX_DATA,
            RecordFormat::Mxfp8 => abi::MXFP8_DATA,
            RecordFormat::V4Record => abi::V4_DATA,
            RecordFormat::Fp8Index => abi::FP8_INDEX_DATA,
        }
    }
    /// Scale bytes per record (for V4: 7 E8M0 + 1 pad byte).
    pub const fn scale_bytes(self) -> usize {
        match self {
            RecordFormat::Nvfp4Ds => abi::NVFP4_SCALE,
            RecordFormat::Mxfp4Index => abi::MXFP4_INDEX_SCALE,
            RecordFormat::Mxfp8 => abi::MXFP8_SCALE,
            RecordFormat::V4Record => abi::V4_SCALE,
            RecordFormat::Fp8Index => abi::FP8_INDEX_SCALE,
        }
    }
    /// Bytes per record.
    pub const fn record_bytes(self) -> usize {
        self.data_bytes() + self.scale_bytes()
    }
    /// CLI / JSON name.
    pub fn name(self) -> &'static str {
        match self {
            RecordFormat::Nvfp4Ds => "nvfp4",
            RecordFormat::Mxfp4Index => "mxfp4",
            RecordFormat::Mxfp8 => "mxfp8",
            RecordFormat::V4Record => "v4",
            RecordFormat::Fp8Index => "fp8index",
        }
    }
    /// The vLLM 0.33 setting that selects this record: `--kv-cache-dtype` for the main-KV / SWA
    /// records (`nvfp4_ds_mla`; `fp8_ds_mla`, which is the MXFP8 record on SM100 and the V4 record
    /// elsewhere), `attention_config.indexer_kv_dtype` for index K (`mxfp4`, `fp8`).
    pub const fn vllm_dtype(self) -> &'static str {
        match self {
            RecordFormat::Nvfp4Ds => "nvfp4_ds_mla",
            RecordFormat::Mxfp8 | RecordFormat::V4Record => "fp8_ds_mla",
            RecordFormat::Mxfp4Index => "mxfp4",
            RecordFormat::Fp8Index => "fp8",
        }
    }
    /// Whether vLLM 0.33 stores this record block-planar in its pages (every slot's data bytes,
    /// then every slot's scale bytes: the V4 record and both index-K records) rather than
    /// interleaved (each slot's data then its own scales, so a record is one row of the page: the
    /// V4.1 NVFP4 and MXFP8 records).
    pub const fn vllm_block_planar(self) -> bool {
        matches!(
            self,
            RecordFormat::V4Record | RecordFormat::Mxfp4Index | RecordFormat::Fp8Index
        )
    }
    /// Parses a CLI name (`nvfp4`, `mxfp4`, `mxfp8`, `v4`, `fp8index`).
    pub fn from_name(s: &str) -> Result<RecordFormat> {
        RecordFormat::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| Error::invalid("format", format!("unknown record format `{s}` (expected nvfp4, mxfp4, mxfp8, v4 or fp8index)")))
    }

    /// Encodes one row of `dim()` values into `data` (`data_bytes()`) and `scale` (`scale_bytes()`).
    ///
    /// Panics (debug) on wrong lengths; the checked entry points are [`encode_rows`] and the page API.
    #[inline]
    pub fn encode_row(self, x: &[f32], data: &mut [u8], scale: &mut [u8]) {
        debug_assert_eq!(x.len(), self.dim());
        debug_assert_eq!(data.len(), self.data_bytes());
        debug_assert_eq!(scale.len(), self.scale_bytes());
        match self {
            RecordFormat::Nvfp4Ds => encode_nvfp4_ds(x, data, scale),
            RecordFormat::Mxfp4Index => encode_mxfp4(x, data, scale),
            RecordFormat::Mxfp8 => encode_mxfp8_blocks(x, 32, data, scale),
            RecordFormat::V4Record => encode_v4(x, data, scale),
            RecordFormat::Fp8Index => encode_fp8_index(x, data, scale),
        }
    }

    /// Decodes one record (`data`, `scale`) into `out` (`dim()` values).
    #[inline]
    pub fn decode_row(self, data: &[u8], scale: &[u8], out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.dim());
        match self {
            RecordFormat::Nvfp4Ds => {
                for (b, blk) in out.chunks_exact_mut(16).enumerate() {
                    let s = e4m3_decode(scale[b]);
                    decode_e2m1_block(&data[b * 8..b * 8 + 8], s, blk);
                }
            }
            RecordFormat::Mxfp4Index => {
                for (b, blk) in out.chunks_exact_mut(32).enumerate() {
                    let s = e8m0_decode(scale[b]);
                    decode_e2m1_block(&data[b * 16..b * 16 + 16], s, blk);
                }
            }
            RecordFormat::Mxfp8 => decode_mxfp8_blocks(data, scale, 32, out),
            RecordFormat::V4Record => {
                decode_mxfp8_blocks(
                    &data[..NOPE_DIM],
                    &scale[..NOPE_DIM / 64],
                    64,
                    &mut out[..NOPE_DIM],
                );
                for (i, o) in out[NOPE_DIM..].iter_mut().enumerate() {
                    let b =
                        u16::from_le_bytes([data[NOPE_DIM + 2 * i], data[NOPE_DIM + 2 * i + 1]]);
                    *o = half::bf16::from_bits(b).to_f32();
                }
            }
            RecordFormat::Fp8Index => {
                let s = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
                for (o, &b) in out.iter_mut().zip(data) {
                    *o = e4m3_decode(b) * s;
                }
            }
        }
    }
}

#[inline]
fn amax(x: &[f32]) -> f32 {
    // f32::max ignores NaN, so a NaN element does not poison the block scale.
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

#[inline]
fn decode_e2m1_block(packed: &[u8], s: f32, out: &mut [f32]) {
    for (i, &b) in packed.iter().enumerate() {
        out[2 * i] = e2m1_decode(b & 0xF) * s;
        out[2 * i + 1] = e2m1_decode(b >> 4) * s;
    }
}

fn encode_nvfp4_ds(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    let mut buf = [0f32; 16];
    for b in 0..KV_DIM / 16 {
        for (d, &v) in buf.iter_mut().zip(&x[b * 16..b * 16 + 16]) {
            *d = bf16_round(v);
        }
        let sb = e4m3_encode((amax(&buf) / 6.0).clamp(pow2(-9), E4M3_MAX));
        scale[b] = sb;
        let s = e4m3_decode(sb);
        for i in 0..8 {
            // True IEEE division (vLLM uses div_rn: an approximate divide misplaces exact ties).
            let lo = e2m1_encode(buf[2 * i] / s);
            let hi = e2m1_encode(buf[2 * i + 1] / s);
            data[b * 8 + i] = lo | (hi << 4);
        }
    }
}

/// DeepSeek MXFP4 (ceil scale rule, docs/SPEC.md §1.5) for any number of 32-blocks.
fn encode_mxfp4(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    let mut buf = [0f32; 32];
    for b in 0..x.len() / 32 {
        for (d, &v) in buf.iter_mut().zip(&x[b * 32..b * 32 + 32]) {
            *d = bf16_round(v);
        }
        let a = amax(&buf).max(6.0 * pow2(-126));
        let e = ceil_log2(a / 6.0).unwrap_or(127).clamp(-127, 127);
        scale[b] = (e + 127) as u8;
        let inv = pow2(-e);
        for i in 0..16 {
            let lo = e2m1_encode(buf[2 * i] * inv);
            let hi = e2m1_encode(buf[2 * i + 1] * inv);
            data[b * 16 + i] = lo | (hi << 4);
        }
    }
}

/// MXFP8 over blocks of `block` values: amax floored at 1e-4, e = ceil(log2(amax/448)).
fn encode_mxfp8_blocks(x: &[f32], block: usize, data: &mut [u8], scale: &mut [u8]) {
    let mut buf = [0f32; 64];
    for b in 0..x.len() / block {
        let buf = &mut buf[..block];
        for (d, &v) in buf.iter_mut().zip(&x[b * block..(b + 1) * block]) {
            *d = bf16_round(v);
        }
        let a = amax(buf).max(1e-4);
        let e = ceil_log2(a / E4M3_MAX).unwrap_or(127).clamp(-127, 127);
        scale[b] = (e + 127) as u8;
        let inv = pow2(-e);
        for (i, &v) in buf.iter().enumerate() {
            data[b * block + i] = e4m3_encode((v * inv).clamp(-E4M3_MAX, E4M3_MAX));
        }
    }
}

fn decode_mxfp8_blocks(data: &[u8], scale: &[u8], block: usize, out: &mut [f32]) {
    for (b, blk) in out.chunks_exact_mut(block).enumerate() {
        let s = e8m0_decode(scale[b]);
        for (o, &q) in blk.iter_mut().zip(&data[b * block..]) {
            *o = e4m3_decode(q) * s;
        }
    }
}

fn encode_v4(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    encode_mxfp8_blocks(
        &x[..NOPE_DIM],
        64,
        &mut data[..NOPE_DIM],
        &mut scale[..NOPE_DIM / 64],
    );
    for (i, &v) in x[NOPE_DIM..].iter().enumerate() {
        let b = half::bf16::from_f32(v).to_bits().to_le_bytes();
        data[NOPE_DIM + 2 * i] = b[0];
        data[NOPE_DIM + 2 * i + 1] = b[1];
    }
    scale[7] = 0;
}

fn encode_fp8_index(x: &[f32], data: &mut [u8], scale: &mut [u8]) {
    let mut buf = [0f32; INDEX_DIM];
    for (d, &v) in buf.iter_mut().zip(x) {
        *d = bf16_round(v);
    }
    let a = amax(&buf).max(1e-4);
    let e = ceil_log2(a / E4M3_MAX).unwrap_or(127).clamp(-126, 127);
    let inv = pow2(-e);
    for (d, &v) in data.iter_mut().zip(&buf) {
        *d = e4m3_encode((v * inv).clamp(-E4M3_MAX, E4M3_MAX));
    }
    scale.copy_from_slice(&pow2(e).to_le_bytes());
}

fn check_rows(fmt: RecordFormat, values: usize, bytes: usize) -> Result<usize> {
    if !values.is_multiple_of(fmt.dim()) {
        return Err(Error::shape(
            format!("{} input values", fmt.name()),
            format!("a multiple of {} (whole rows)", fmt.dim()),
            values,
        ));
    }
    let rows = values / fmt.dim();
    if bytes != rows * fmt.record_bytes() {
        return Err(Error::shape(
            format!("{} record buffer bytes", fmt.name()),
            format!(
                "{} ({} rows × {} B)",
                rows * fmt.record_bytes(),
                rows,
                fmt.record_bytes()
            ),
            bytes,
        ));
    }
    Ok(rows)
}

/// Encodes `x` (rows × dim f32, row-major) into contiguous records (each: data bytes, then scale
/// bytes). Errors: [`Error::Shape`] when `x` is not whole rows or `out` has the wrong length.
pub fn encode_rows(fmt: RecordFormat, x: &[f32], out: &mut [u8]) -> Result<()> {
    encode_rows_with(super::fast::Isa::best(), fmt, x, out)
}

/// [`encode_rows`] on a chosen instruction set (benchmarks, A/B tests).
/// Errors: as [`encode_rows`], plus [`Error::Unsupported`] when this CPU lacks `isa`.
pub fn encode_rows_with(
    isa: super::fast::Isa,
    fmt: RecordFormat,
    x: &[f32],
    out: &mut [u8],
) -> Result<()> {
    isa.check()?;
    check_rows(fmt, x.len(), out.len())?;
    super::parallel_rows(fmt.dim(), fmt.record_bytes(), x, out, |row, rec| {
        let (d, s) = rec.split_at_mut(fmt.data_bytes());
        super::fast::encode_row(isa, fmt, row, d, s);
    });
    Ok(())
}

/// Decodes contiguous records into `out` (rows × dim f32).
/// Errors: [`Error::Shape`] on mismatched lengths.
pub fn decode_rows(fmt: RecordFormat, records: &[u8], out: &mut [f32]) -> Result<()> {
    decode_rows_with(super::fast::Isa::best(), fmt, records, out)
}

/// [`decode_rows`] on a chosen instruction set (benchmarks, A/B tests).
/// Errors: as [`decode_rows`], plus [`Error::Unsupported`] when this CPU lacks `isa`.
pub fn decode_rows_with(
    isa: super::fast::Isa,
    fmt: RecordFormat,
    records: &[u8],
    out: &mut [f32],
) -> Result<()> {
    isa.check()?;
    check_rows(fmt, out.len(), records.len())?;
    super::parallel_rows_mut(fmt.dim(), fmt.record_bytes(), out, records, |row, rec| {
        let (d, s) = rec.split_at(fmt.data_bytes());
        super::fast::decode_row(isa, fmt, d, s, row);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOLDEN: [f32; 32] = [
        -0.789062, -0.808594, -0.175781, -0.304688, 0.59375, 0.484375, -0.22168, -1.484375,
        0.225586, -0.882812, 0.245117, 0.21582, 0.083984, 0.867188, 0.78125, -0.172852, -0.945312,
        -1.1875, 0.396484, 0.554688, 0.419922, -1.085938, -0.239258, 1.296875, 0.523438, -0.410156,
        -0.121582, 0.128906, 0.972656, 1.109375, 0.664062, -0.589844,
    ];

    fn row512() -> Vec<f32> {
        let mut x = vec![0.0f32; 512];
        x[..32].copy_from_slice(&GOLDEN);
        x
    }

    #[test]
    fn golden_nvfp4() {
        let mut rec = [0u8; NVFP4_DS_BYTES];
        encode_rows(RecordFormat::Nvfp4Ds, &row512(), &mut rec).unwrap();
        assert_eq!(rec[256], 0x28);
        assert_eq!(rec[257], 0x26);
        assert_eq!(&rec[..8], &[0xdd, 0xa9, 0x44, 0xfa, 0xe2, 0x22, 0x51, 0x95]);
        assert_eq!(
            &rec[8..16],
            &[0xfe, 0x54, 0xe4, 0x7a, 0xc4, 0x19, 0x76, 0xd5]
        );
    }

    #[test]
    fn golden_mxfp4() {
        let mut x = vec![0.0f32; 128];
        x[..32].copy_from_slice(&GOLDEN);
        let mut rec = [0u8; MXFP4_INDEX_BYTES];
        encode_rows(RecordFormat::Mxfp4Index, &x, &mut rec).unwrap();
        assert_eq!(rec[64], 0x7d);
        assert_eq!(
            &rec[..16],
            &[
                0xdd, 0xa9, 0x44, 0xfa, 0xe2, 0x22, 0x51, 0x95, 0xee, 0x43, 0xe3, 0x7a, 0xb4, 0x19,
                0x66, 0xc5
            ]
        );
    }

    #[test]
    fn golden_mxfp8() {
        let mut rec = [0u8; MXFP8_BYTES];
        encode_rows(RecordFormat::Mxfp8, &row512(), &mut rec).unwrap();
        assert_eq!(rec[512], 0x77);
        assert_eq!(&rec[..8], &[0xf5, 0xf5, 0xe3, 0xea, 0x72, 0x70, 0xe6, 0xfc]);
    }

    /// docs/SPEC.md §1.7: the scale bytes of the all-zero blocks after the golden block
    /// (NVFP4 clamps at 2^-9 → 0x01; MXFP4 floors amax at 6·2^-126 → e = −126 → 0x01; MXFP8
    /// floors amax at 1e-4 → e = ceil(log2(1e-4 / 448)) = −22 → 0x69).
    #[test]
    fn golden_zero_blocks() {
        let mut rec = [0u8; NVFP4_DS_BYTES];
        encode_rows(RecordFormat::Nvfp4Ds, &row512(), &mut rec).unwrap();
        assert!(rec[258..].iter().all(|&b| b == 0x01));
        assert!(rec[16..256].iter().all(|&b| b == 0));
        let mut x = vec![0.0f32; 128];
        x[..32].copy_from_slice(&GOLDEN);
        let mut rec = [0u8; MXFP4_INDEX_BYTES];
        encode_rows(RecordFormat::Mxfp4Index, &x, &mut rec).unwrap();
        assert_eq!(&rec[64..], &[0x7d, 0x01, 0x01, 0x01]);
        let mut rec = [0u8; MXFP8_BYTES];
        encode_rows(RecordFormat::Mxfp8, &row512(), &mut rec).unwrap();
        assert!(rec[513..].iter().all(|&b| b == 0x69));
    }

    /// docs/SPEC.md §1.7: the launch-day records on the golden row. Block 0 of the V4 record and
    /// the single FP8-index block have the golden block's amax (1.484375), so e = −8 and the
    /// E4M3 bytes equal MXFP8's; the V4 RoPE dims are zero bf16, its zero NoPE blocks get 0x69
    /// and the pad byte is 0; the FP8 index scale is the f32 2^-8.
    #[test]
    fn golden_v4_and_fp8_index() {
        let head = [0xf5, 0xf5, 0xe3, 0xea, 0x72, 0x70, 0xe6, 0xfc];
        let mut rec = [0u8; V4_RECORD_BYTES];
        encode_rows(RecordFormat::V4Record, &row512(), &mut rec).unwrap();
        assert_eq!(&rec[..8], &head);
        assert!(rec[448..576].iter().all(|&b| b == 0));
        assert_eq!(
            &rec[576..],
            &[0x77, 0x69, 0x69, 0x69, 0x69, 0x69, 0x69, 0x00]
        );
        let mut x = vec![0.0f32; 128];
        x[..32].copy_from_slice(&GOLDEN);
        let mut rec = [0u8; FP8_INDEX_BYTES];
        encode_rows(RecordFormat::Fp8Index, &x, &mut rec).unwrap();
        assert_eq!(&rec[..8], &head);
        assert_eq!(&rec[128..], &[0x00, 0x00, 0x80, 0x3b]);
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut rec = [0u8; 10];
        assert!(encode_rows(RecordFormat::Mxfp8, &[0.0; 511], &mut rec).is_err());
        assert!(encode_rows(RecordFormat::Mxfp8, &[0.0; 512], &mut rec).is_err());
        let mut out = [0f32; 512];
        assert!(decode_rows(RecordFormat::Mxfp8, &rec, &mut out).is_err());
    }
}
