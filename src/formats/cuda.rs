//! Record encode / decode kernels over block-planar cache pages (`kernels/kv_cache.cu`, feature
//! `cuda`): the GPU twin of [`PageLayout::encode_into_pages`] / [`PageLayout::decode_from_pages`],
//! bit-identical to them (docs/SPEC.md §1; the CUDA tests compare page bytes exactly).
//!
//! Addressing follows vLLM's `reshape_and_cache`: row i goes to `slot_mapping[i] = block ·
//! page_slots + offset`; a slot of −1 skips the row (decode: gives zeros). The kernels do not check
//! slots (a device-side check would need a copy back); callers validate a host slot mapping with
//! [`PageLayout::check_slot_mapping`] first, as [`PageLayout::encode_into_pages`] does.

use super::page::PageLayout;
use super::RecordFormat;
use crate::cuda::device::{as_i32, cfg, launch};
use crate::cuda::driver::{CudaSlice, LaunchConfig};
use crate::cuda::shapes::{KV_ROWS_PER_BLOCK, KV_THREADS};
use crate::cuda::CudaDevice;
use crate::error::{Error, Result};

/// The encode kernel of `fmt` (its ABI id is the format code of `kv_decode_f32`).
fn encode_kernel(fmt: RecordFormat) -> Result<&'static str> {
    match fmt {
        RecordFormat::Nvfp4Ds => Ok("nvfp4ds_encode_f32"),
        RecordFormat::Mxfp4Index => Ok("mxfp4_index_encode_f32"),
        RecordFormat::Mxfp8 => Ok("mxfp8_encode_f32"),
        other => Err(Error::Unsupported(format!(
            "no CUDA kernel for record format `{}` (GPU formats: nvfp4, mxfp4, mxfp8)",
            other.name()
        ))),
    }
}

/// Whether `fmt` has a CUDA codec.
pub fn has_kernel(fmt: RecordFormat) -> bool {
    encode_kernel(fmt).is_ok()
}

/// The launch of one record kernel over `n_rows` rows (one warp per row): checks the buffers
/// (`values` f32 of the rows, `slots` slot-mapping entries, a `pool` of whole pages) and gives
/// (rows, page_slots, config) as the kernel takes them; None for zero rows.
fn row_launch(
    layout: &PageLayout,
    what: &str,
    values: usize,
    slots: usize,
    pool: usize,
    n_rows: usize,
) -> Result<Option<(i32, i32, LaunchConfig)>> {
    layout.pages_in(pool)?;
    if values < n_rows * layout.format.dim() || slots < n_rows {
        return Err(Error::shape(
            format!("{what} buffers"),
            format!("{n_rows} rows of {} values", layout.format.dim()),
            format!("{values} values, {slots} slots"),
        ));
    }
    if n_rows == 0 {
        return Ok(None);
    }
    let grid = n_rows.div_ceil(KV_ROWS_PER_BLOCK) as u32;
    Ok(Some((
        as_i32("n_rows", n_rows)?,
        as_i32("page_slots", layout.slots)?,
        cfg((grid, 1), KV_THREADS as u32),
    )))
}

/// Encodes `n_rows` rows of `x` ((n_rows, dim) f32) into the records at `slot_mapping` (n_rows,)
/// of the page pool `pages` (whole pages of `layout`), in place.
///
/// Errors: [`Error::Unsupported`] for a format without a kernel; [`Error::Shape`] for buffers
/// shorter than `n_rows` or a pool that is not whole pages; [`Error::Cuda`] from the driver.
pub fn encode_into_pages(
    dev: &CudaDevice,
    layout: &PageLayout,
    x: &CudaSlice<f32>,
    slot_mapping: &CudaSlice<i64>,
    pages: &mut CudaSlice<u8>,
    n_rows: usize,
) -> Result<()> {
    let kernel = encode_kernel(layout.format)?;
    let (x_len, s_len, p_len) = (x.len(), slot_mapping.len(), pages.len());
    let Some((n, ps, c)) = row_launch(layout, "encode", x_len, s_len, p_len, n_rows)? else {
        return Ok(());
    };
    // nvfp4ds/mxfp4_index/mxfp8 _encode_f32(x, slot_mapping, pages, n_rows, page_slots)
    launch!(dev, "kv_cache", kernel, c, x, slot_mapping, pages, &n, &ps);
    Ok(())
}

/// Gather-decodes the records at `slot_mapping` (n_rows,) into `out` ((n_rows, dim) f32); slot −1
/// gives zeros.
///
/// Errors: as [`encode_into_pages`].
pub fn decode_from_pages(
    dev: &CudaDevice,
    layout: &PageLayout,
    pages: &CudaSlice<u8>,
    slot_mapping: &CudaSlice<i64>,
    out: &mut CudaSlice<f32>,
    n_rows: usize,
) -> Result<()> {
    encode_kernel(layout.format)?;
    let code = layout.format.abi_id();
    let (o_len, s_len, p_len) = (out.len(), slot_mapping.len(), pages.len());
    let Some((n, ps, c)) = row_launch(layout, "decode", o_len, s_len, p_len, n_rows)? else {
        return Ok(());
    };
    // kv_decode_f32(pages, slot_mapping, out, n_rows, page_slots, format)
    launch!(
        dev,
        "kv_cache",
        "kv_decode_f32",
        c,
        pages,
        slot_mapping,
        out,
        &n,
        &ps,
        &code
    );
    Ok(())
}

/// The CUDA branch of [`PageLayout::encode_into_pages_view`] (signature and devices already
/// checked there): borrows the caller's device memory, waits for the context (the framework may
/// have written the inputs on its own stream), launches, and waits for the kernel.
///
/// Errors: those of [`CudaDevice::of_view`] and [`encode_into_pages`].
pub fn encode_into_pages_view(
    layout: &PageLayout,
    x: &crate::tensor::TensorView<'_>,
    slot_mapping: &crate::tensor::TensorView<'_>,
    pool: &mut crate::tensor::TensorViewMut<'_>,
) -> Result<()> {
    let n = slot_mapping.numel();
    if n == 0 {
        // Nothing to launch, so no device to open (a machine without a driver accepts it too).
        return Ok(());
    }
    let dev = CudaDevice::of_view(x, "x")?;
    // SAFETY: the views' contract: live device memory of this context for the call.
    let (dx, ds, mut dp) = unsafe {
        (
            dev.borrow::<f32>(x, "x")?,
            dev.borrow::<i64>(slot_mapping, "slot_mapping")?,
            dev.borrow::<u8>(&pool.as_view(), "pool")?,
        )
    };
    dev.synchronize_context()?;
    encode_into_pages(&dev, layout, &dx, &ds, &mut dp, n)?;
    dev.synchronize()
}
