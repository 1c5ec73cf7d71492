//! The C face of [`crate::formats`]: the record-format table, row codecs and page writes over
//! caller-owned buffers.

use super::{arg_out, arg_slice, arg_slice_mut, guarded, Csa2Status};
use crate::error::Error;
use crate::formats::page::PageLayout;
use crate::formats::{decode_rows, encode_rows, RecordFormat};
use crate::ops::pool::PoolLayout;
use std::ffi::c_char;

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

/// One row of the record-format table, from [`csa2_record_formats`]: everything a caller needs to
/// recognise and address a record without a table of its own.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2RecordFormatEntry {
    /// The `Csa2Format` value.
    pub format_id: i32,
    /// csa2's name (`nvfp4`, `mxfp4`, `mxfp8`, `v4`, `fp8index`): static, NUL-terminated.
    pub name: *const c_char,
    /// The vLLM 0.33 setting value that selects this record: `--kv-cache-dtype` for main KV / SWA
    /// (`nvfp4_ds_mla`, `fp8_ds_mla`), `indexer_kv_dtype` for index K (`mxfp4`, `fp8`). Static,
    /// NUL-terminated.
    pub vllm_dtype: *const c_char,
    /// f32 values per row (512 or 128).
    pub dim: usize,
    /// Data bytes per record.
    pub data_bytes: usize,
    /// Scale bytes per record.
    pub scale_bytes: usize,
    /// Bytes per record (data + scale).
    pub record_bytes: usize,
    /// 1 when vLLM's pages hold this record block-planar (all slots' data, then all slots'
    /// scales: V4 record, index K); 0 when interleaved (a record is one row of the page: NVFP4,
    /// MXFP8).
    pub vllm_block_planar: u8,
    /// The `Csa2PoolLayout` of vLLM's pages for this record (the id that `vllm_block_planar`
    /// selects), to pass in `Csa2Pool::layout` without a table of the caller's own. Added in the
    /// second version of this struct, in what was the first version's tail padding (the size is
    /// unchanged, so a first-version caller still gets exactly the members it knows).
    pub vllm_pool_layout: i32,
}

/// The first version's `sizeof(Csa2RecordFormatEntry)` (up to `vllm_block_planar`, padded to the
/// struct's 8-byte alignment), the smallest `entry_size` accepted.
const RECORD_FORMAT_ENTRY_V1: usize =
    (std::mem::offset_of!(Csa2RecordFormatEntry, vllm_block_planar) + 1).next_multiple_of(8);

fn c_name(f: RecordFormat) -> *const c_char {
    let s: &'static std::ffi::CStr = match f {
        RecordFormat::Nvfp4Ds => c"nvfp4",
        RecordFormat::Mxfp4Index => c"mxfp4",
        RecordFormat::Mxfp8 => c"mxfp8",
        RecordFormat::V4Record => c"v4",
        RecordFormat::Fp8Index => c"fp8index",
    };
    debug_assert_eq!(s.to_str(), Ok(f.name()));
    s.as_ptr()
}

fn c_vllm_dtype(f: RecordFormat) -> *const c_char {
    let s: &'static std::ffi::CStr = match f.vllm_dtype() {
        "nvfp4_ds_mla" => c"nvfp4_ds_mla",
        "fp8_ds_mla" => c"fp8_ds_mla",
        "mxfp4" => c"mxfp4",
        _ => c"fp8",
    };
    debug_assert_eq!(s.to_str(), Ok(f.vllm_dtype()));
    s.as_ptr()
}

/// The entry of `f` as the bytes of a C `Csa2RecordFormatEntry` (padding zero), written member by
/// member at its offset so the caller's buffer needs no alignment.
fn entry_bytes(f: RecordFormat) -> [u8; std::mem::size_of::<Csa2RecordFormatEntry>()] {
    use std::mem::offset_of;
    type E = Csa2RecordFormatEntry;
    let mut b = [0u8; std::mem::size_of::<E>()];
    let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
    put(offset_of!(E, format_id), &f.abi_id().to_ne_bytes());
    put(offset_of!(E, name), &(c_name(f) as usize).to_ne_bytes());
    put(
        offset_of!(E, vllm_dtype),
        &(c_vllm_dtype(f) as usize).to_ne_bytes(),
    );
    put(offset_of!(E, dim), &f.dim().to_ne_bytes());
    put(offset_of!(E, data_bytes), &f.data_bytes().to_ne_bytes());
    put(offset_of!(E, scale_bytes), &f.scale_bytes().to_ne_bytes());
    put(offset_of!(E, record_bytes), &f.record_bytes().to_ne_bytes());
    put(
        offset_of!(E, vllm_block_planar),
        &[f.vllm_block_planar() as u8],
    );
    put(
        offset_of!(E, vllm_pool_layout),
        &PoolLayout::vllm(f).abi_id().to_ne_bytes(),
    );
    b
}

/// The record-format table: one [`Csa2RecordFormatEntry`] per `Csa2Format`, in id order, so a
/// binding (the Python shim) asks the library instead of keeping its own width table.
///
/// `entry_size` is the caller's `sizeof(Csa2RecordFormatEntry)`: entries are written at that
/// stride, each with the first `min(entry_size, sizeof)` bytes of the library's entry (members are
/// only ever appended, so an older caller gets the members it knows). `out` has room for `cap`
/// entries; the count goes to `*n_out`; `out = NULL, cap = 0` asks for the count only (a `cap`
/// below the count is `CSA2_ERR_INVALID_ARGUMENT` and writes nothing). The names are static
/// strings (never free them).
///
/// Errors: `CSA2_ERR_NULL_POINTER` (`n_out`, or `out` with `cap > 0`), `CSA2_ERR_INVALID_ARGUMENT`
/// (`cap` too small: the message gives the count; `entry_size` below the first version's size).
///
/// # Safety
/// A non-null `out` must have room for `cap × entry_size` writable bytes; `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_record_formats(
    out: *mut std::ffi::c_void,
    cap: usize,
    entry_size: usize,
    n_out: *mut usize,
) -> Csa2Status {
    guarded("csa2_record_formats", || {
        if entry_size < RECORD_FORMAT_ENTRY_V1 {
            return Err(Error::invalid(
                "entry_size",
                format!(
                    "{entry_size} is smaller than the first version of Csa2RecordFormatEntry \
                     ({RECORD_FORMAT_ENTRY_V1} bytes): pass sizeof(Csa2RecordFormatEntry)"
                ),
            ));
        }
        let all = RecordFormat::ALL;
        // SAFETY: null is checked; validity is the caller's contract.
        let n_out = unsafe { arg_out(n_out, "n_out") }?;
        if !(out.is_null() && cap == 0) {
            if cap < all.len() {
                return Err(Error::invalid(
                    "cap",
                    format!("the table has {} formats, cap is {cap}", all.len()),
                ));
            }
            let bytes = all.len() * entry_size;
            // SAFETY: room for `cap × entry_size` ≥ `bytes` bytes is the caller's contract; null
            // is checked (u8 needs no alignment).
            let dst = unsafe { arg_slice_mut(out.cast::<u8>(), bytes, "out") }?;
            for (f, slot) in all.into_iter().zip(dst.chunks_exact_mut(entry_size)) {
                let e = entry_bytes(f);
                let known = e.len().min(entry_size);
                slot[..known].copy_from_slice(&e[..known]);
            }
        }
        *n_out = all.len();
        Ok(())
    })
}

/// Writes the sizes of `format_id` (a `Csa2Format`) to `*out`.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_format_info(format_id: i32, out: *mut Csa2FormatInfo) -> Csa2Status {
    guarded("csa2_format_info", || {
        let f = RecordFormat::from_abi_id(format_id, "format")?;
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
        let f = RecordFormat::from_abi_id(format_id, "format")?;
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
        let f = RecordFormat::from_abi_id(format_id, "format")?;
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

/// Arguments of [`csa2_encode_into_pages`].
/// Set `struct_size` to `sizeof(Csa2EncodeIntoPagesArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2EncodeIntoPagesArgs {
    /// `sizeof(Csa2EncodeIntoPagesArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `Csa2Format` of the records.
    pub format_id: i32,
    /// Records per page (> 0).
    pub slots_per_page: usize,
    /// `n_rows` × dim f32 rows.
    pub x: *const f32,
    /// `n_rows` slots (−1 skips the row).
    pub slot_mapping: *const i64,
    /// Rows in `x` and `slot_mapping`.
    pub n_rows: usize,
    /// The page pool, `pool_len` writable bytes.
    pub pool: *mut u8,
    /// Bytes of `pool`, a whole number of pages.
    pub pool_len: usize,
}

args_struct!(Csa2EncodeIntoPagesArgs);

/// Encodes `n_rows` rows of `x` straight into a pool of block-planar pages (`pool_len` bytes, a
/// whole number of pages of `slots_per_page` records): row i → slot `slot_mapping[i]`
/// = page · slots_per_page + offset; −1 skips the row (vLLM `slot_mapping`).
///
/// Errors: `CSA2_ERR_SHAPE` (x not `n_rows` rows, pool not whole pages), `CSA2_ERR_INVALID_ARGUMENT`
/// (slot out of range, a slot named twice, `slots_per_page` 0). Nothing is written on error.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2EncodeIntoPagesArgs`. Its members:
/// `x` must hold `n_rows` × dim f32, `slot_mapping` `n_rows` int64, `pool` `pool_len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn csa2_encode_into_pages(
    args: *const Csa2EncodeIntoPagesArgs,
) -> Csa2Status {
    guarded("csa2_encode_into_pages", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let Csa2EncodeIntoPagesArgs {
            struct_size: _,
            format_id,
            slots_per_page,
            x,
            slot_mapping,
            n_rows,
            pool,
            pool_len,
        } = unsafe { super::read_args(args) }?;
        let f = RecordFormat::from_abi_id(format_id, "format")?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::{Csa2KvLayout, Csa2PoolLayout};
    use crate::formats::KvScheme;

    #[test]
    fn header_enums_name_the_abi_ids() {
        let formats = [
            (Csa2Format::Csa2FormatNvfp4, RecordFormat::Nvfp4Ds),
            (Csa2Format::Csa2FormatMxfp4, RecordFormat::Mxfp4Index),
            (Csa2Format::Csa2FormatMxfp8, RecordFormat::Mxfp8),
            (Csa2Format::Csa2FormatV4, RecordFormat::V4Record),
            (Csa2Format::Csa2FormatFp8Index, RecordFormat::Fp8Index),
        ];
        assert_eq!(formats.len(), RecordFormat::ALL.len());
        for (c, f) in formats {
            assert_eq!(c as i32, f.abi_id(), "{f:?}");
            assert_eq!(RecordFormat::from_abi_id(c as i32, "format").unwrap(), f);
        }
        assert!(RecordFormat::from_abi_id(5, "format").is_err());
        for (c, l) in [
            (Csa2PoolLayout::Csa2PoolInterleaved, PoolLayout::Interleaved),
            (Csa2PoolLayout::Csa2PoolBlockPlanar, PoolLayout::BlockPlanar),
        ] {
            assert_eq!(c as i32, l.abi_id(), "{l:?}");
            assert_eq!(PoolLayout::from_abi(c as i32).unwrap(), l);
        }
        assert!(PoolLayout::from_abi(2).is_err());
        let layouts = [
            (Csa2KvLayout::Csa2LayoutNvfp4, KvScheme::CSA2),
            (Csa2KvLayout::Csa2LayoutMxfp8, KvScheme::MXFP8),
            (Csa2KvLayout::Csa2LayoutV4, KvScheme::LAUNCH_DAY),
        ];
        assert_eq!(layouts.len(), KvScheme::ALL.len());
        for (c, s) in layouts {
            assert_eq!(c as i32, s.abi_id(), "{}", s.name);
        }
    }

    #[test]
    fn record_format_table_is_the_library_s_and_checks_its_sizes() {
        let n_all = RecordFormat::ALL.len();
        let size = std::mem::size_of::<Csa2RecordFormatEntry>();
        let mut n = 0usize;
        let st = unsafe { csa2_record_formats(std::ptr::null_mut(), 0, size, &mut n) };
        assert_eq!((st, n), (Csa2Status::Csa2Ok, n_all));
        let mut table: Vec<Csa2RecordFormatEntry> = (0..n_all)
            .map(|_| Csa2RecordFormatEntry {
                format_id: -1,
                name: std::ptr::null(),
                vllm_dtype: std::ptr::null(),
                dim: 0,
                data_bytes: 0,
                scale_bytes: 0,
                record_bytes: 0,
                vllm_block_planar: 9,
                vllm_pool_layout: -1,
            })
            .collect();
        let st = unsafe { csa2_record_formats(table.as_mut_ptr().cast(), n_all, size, &mut n) };
        assert_eq!(st, Csa2Status::Csa2Ok);
        for (e, f) in table.iter().zip(RecordFormat::ALL) {
            let name = unsafe { std::ffi::CStr::from_ptr(e.name) }
                .to_str()
                .unwrap();
            let vllm = unsafe { std::ffi::CStr::from_ptr(e.vllm_dtype) };
            assert_eq!(
                (e.format_id, name, vllm.to_str().unwrap()),
                (f.abi_id(), f.name(), f.vllm_dtype())
            );
            assert_eq!(
                (e.dim, e.data_bytes, e.scale_bytes, e.record_bytes),
                (f.dim(), f.data_bytes(), f.scale_bytes(), f.record_bytes())
            );
            assert_eq!(e.vllm_block_planar, f.vllm_block_planar() as u8);
            assert_eq!(e.vllm_pool_layout, PoolLayout::vllm(f).abi_id());
            let planar = PoolLayout::vllm(f) == PoolLayout::BlockPlanar;
            assert_eq!(planar, f.vllm_block_planar(), "{f:?}");
        }
        let widths: Vec<_> = table.iter().map(|e| e.record_bytes).collect();
        assert_eq!(widths, [288, 68, 528, 584, 132]);
        // A newer caller's larger entries: the library fills the members it knows, at the
        // caller's stride, and leaves the rest alone.
        let big = size + 16;
        let mut raw = vec![0xAAu8; n_all * big];
        let st = unsafe { csa2_record_formats(raw.as_mut_ptr().cast(), n_all, big, &mut n) };
        assert_eq!(st, Csa2Status::Csa2Ok);
        for (i, f) in RecordFormat::ALL.into_iter().enumerate() {
            let at = i * big + std::mem::offset_of!(Csa2RecordFormatEntry, record_bytes);
            let rb = usize::from_ne_bytes(raw[at..at + 8].try_into().unwrap());
            assert_eq!(rb, f.record_bytes());
            assert!(raw[i * big + size..(i + 1) * big]
                .iter()
                .all(|&b| b == 0xAA));
        }
        // Too small a cap or entry size: refused, nothing written.
        n = 77;
        let st = unsafe { csa2_record_formats(table.as_mut_ptr().cast(), n_all - 1, size, &mut n) };
        assert_eq!((st, n), (Csa2Status::Csa2ErrInvalidArgument, 77));
        let st = unsafe { csa2_record_formats(table.as_mut_ptr().cast(), n_all, size - 8, &mut n) };
        assert_eq!((st, n), (Csa2Status::Csa2ErrInvalidArgument, 77));
        // The member added in the second version sits in the first version's padding: a
        // first-version caller's entry size is still accepted.
        assert_eq!(RECORD_FORMAT_ENTRY_V1, size);
    }
}
