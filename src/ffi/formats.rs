//! Row codecs and page writes over caller-owned buffers.

use super::{arg_out, arg_slice, arg_slice_mut, guarded, Csa2Status};
use crate::error::{Error, Result};
use crate::formats::page::PageLayout;
use crate::formats::{decode_rows, encode_rows, RecordFormat};

/// KV record format (pass as `int32_t`; docs/SPEC.md §1).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2Format {
    /// 512 values → 288 B: 256 B E2M1 + 32 E4M3 scales (per 16).
    Csa2FormatNvfp4 = 0,
    /// 128 values → 68 B: 64 B E2M1 + 4 UE8M0 scales (per 32).
    Csa2FormatMxfp4 = 1,
    /// 512 values → 528 B: 512 B E4M3 + 16 UE8M0 scales (per 32).
    Csa2FormatMxfp8 = 2,
    /// 512 values → 584 B: 448 E4M3 + 64 bf16 + 7 UE8M0 (per 64) + 1 pad.
    Csa2FormatV4 = 3,
    /// 128 values → 132 B: 128 E4M3 + one fp32 scale.
    Csa2FormatFp8Index = 4,
}

/// Sizes of one record format, from [`csa2_format_info`].
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2FormatInfo {
    /// f32 values per row.
    pub dim: usize,
    /// Data bytes per record.
    pub data_bytes: usize,
    /// Scale bytes per record.
    pub scale_bytes: usize,
    /// Bytes per record (data + scale).
    pub record_bytes: usize,
}

fn format(v: i32) -> Result<RecordFormat> {
    usize::try_from(v)
        .ok()
        .and_then(|i| RecordFormat::ALL.get(i).copied())
        .ok_or_else(|| {
            Error::invalid(
                "format",
                format!("{v} is not a Csa2Format (0 nvfp4, 1 mxfp4, 2 mxfp8, 3 v4, 4 fp8index)"),
            )
        })
}

/// Writes the sizes of `format_id` (a `Csa2Format`) to `*out`.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_format_info(format_id: i32, out: *mut Csa2FormatInfo) -> Csa2Status {
    guarded("csa2_format_info", || {
        let f = format(format_id)?;
        // SAFETY: validity is the caller's contract; null is checked.
        let out = unsafe { arg_out(out, "out") }?;
        *out = Csa2FormatInfo {
            dim: f.dim(),
            data_bytes: f.data_bytes(),
            scale_bytes: f.scale_bytes(),
            record_bytes: f.record_bytes(),
        };
        Ok(())
    })
}

/// Encodes `n_values` f32 (whole rows of `dim`, row-major) into `out_len` bytes of contiguous
/// records (each data then scales). Uses the SIMD path and threads for large inputs.
///
/// Errors: `CSA2_ERR_NULL_POINTER`, `CSA2_ERR_INVALID_ARGUMENT` (format, misaligned `x`),
/// `CSA2_ERR_SHAPE` (not whole rows, or `out_len` ≠ rows × record bytes).
///
/// # Safety
/// `x` must hold `n_values` f32; `out` `out_len` writable bytes, not overlapping `x`.
#[no_mangle]
pub unsafe extern "C" fn csa2_encode_rows(
    format_id: i32,
    x: *const f32,
    n_values: usize,
    out: *mut u8,
    out_len: usize,
) -> Csa2Status {
    guarded("csa2_encode_rows", || {
        let f = format(format_id)?;
        // SAFETY: buffer validity is the caller's contract; null and alignment are checked.
        let (x, out) = unsafe {
            (
                arg_slice(x, n_values, "x")?,
                arg_slice_mut(out, out_len, "out")?,
            )
        };
        encode_rows(f, x, out)
    })
}

/// Decodes `len` bytes of contiguous records into `n_values` f32 (rows × dim).
///
/// Errors: as [`csa2_encode_rows`].
///
/// # Safety
/// `records` must hold `len` bytes; `out` `n_values` writable f32, not overlapping `records`.
#[no_mangle]
pub unsafe extern "C" fn csa2_decode_rows(
    format_id: i32,
    records: *const u8,
    len: usize,
    out: *mut f32,
    n_values: usize,
) -> Csa2Status {
    guarded("csa2_decode_rows", || {
        let f = format(format_id)?;
        // SAFETY: buffer validity is the caller's contract; null and alignment are checked.
        let (r, out) = unsafe {
            (
                arg_slice(records, len, "records")?,
                arg_slice_mut(out, n_values, "out")?,
            )
        };
        decode_rows(f, r, out)
    })
}

/// Encodes `n_rows` rows of `x` straight into a pool of block-planar pages (`pool_len` bytes, a
/// whole number of pages of `slots_per_page` records): row i → slot `slot_mapping[i]`
/// = page · slots_per_page + offset; −1 skips the row (vLLM `slot_mapping`).
///
/// Errors: `CSA2_ERR_SHAPE` (x not `n_rows` rows, pool not whole pages), `CSA2_ERR_INVALID_ARGUMENT`
/// (slot out of range, a slot named twice, `slots_per_page` 0). Nothing is written on error.
///
/// # Safety
/// `x` must hold `n_rows` × dim f32, `slot_mapping` `n_rows` int64, `pool` `pool_len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn csa2_encode_into_pages(
    format_id: i32,
    slots_per_page: usize,
    x: *const f32,
    slot_mapping: *const i64,
    n_rows: usize,
    pool: *mut u8,
    pool_len: usize,
) -> Csa2Status {
    guarded("csa2_encode_into_pages", || {
        let f = format(format_id)?;
        if slots_per_page == 0 {
            return Err(Error::invalid("slots_per_page", "must be > 0, found 0"));
        }
        let n_values = n_rows.checked_mul(f.dim()).ok_or_else(|| {
            Error::invalid(
                "n_rows",
                format!("{n_rows} rows overflow the address space"),
            )
        })?;
        // SAFETY: buffer validity is the caller's contract; null and alignment are checked.
        let (x, map, pool) = unsafe {
            (
                arg_slice(x, n_values, "x")?,
                arg_slice(slot_mapping, n_rows, "slot_mapping")?,
                arg_slice_mut(pool, pool_len, "pool")?,
            )
        };
        PageLayout {
            format: f,
            slots: slots_per_page,
        }
        .encode_into_pages(x, map, pool)
    })
}
