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
use crate::cuda::Device;
use crate::error::{Error, Result};
use cudarc::driver::CudaSlice;

const ROWS_PER_BLOCK: usize = 4;

/// The encode kernel of `fmt` and the format code of `kv_decode_f32`.
fn kernel_format(fmt: RecordFormat) -> Result<(&'static str, i32)> {
    match fmt {
        RecordFormat::Nvfp4Ds => Ok(("nvfp4ds_encode_f32", 0)),
        RecordFormat::Mxfp4Index => Ok(("mxfp4_index_encode_f32", 1)),
        RecordFormat::Mxfp8 => Ok(("mxfp8_encode_f32", 2)),
        other => Err(Error::Unsupported(format!(
            "no CUDA kernel for record format `{}` (GPU formats: nvfp4, mxfp4, mxfp8)",
            other.name()
        ))),
    }
}

/// Whether `fmt` has a CUDA codec.
pub fn has_kernel(fmt: RecordFormat) -> bool {
    kernel_format(fmt).is_ok()
}

fn check(
    layout: &PageLayout,
    what: &str,
    values: usize,
    slots: usize,
    pool: usize,
    n_rows: usize,
) -> Result<()> {
    layout.pages_in(pool)?;
    if values < n_rows * layout.format.dim() || slots < n_rows {
        return Err(Error::shape(
            format!("{what} buffers"),
            format!("{n_rows} rows of {} values", layout.format.dim()),
            format!("{values} values, {slots} slots"),
        ));
    }
    Ok(())
}

/// Encodes `n_rows` rows of `x` ((n_rows, dim) f32) into the records at `slot_mapping` (n_rows,)
/// of the page pool `pages` (whole pages of `layout`), in place.
///
/// Errors: [`Error::Unsupported`] for a format without a kernel; [`Error::Shape`] for buffers
/// shorter than `n_rows` or a pool that is not whole pages; [`Error::Cuda`] from the driver.
pub fn encode_into_pages(
    dev: &Device,
    layout: &PageLayout,
    x: &CudaSlice<f32>,
    slot_mapping: &CudaSlice<i64>,
    pages: &mut CudaSlice<u8>,
    n_rows: usize,
) -> Result<()> {
    let (kernel, _) = kernel_format(layout.format)?;
    check(
        layout,
        "encode",
        x.len(),
        slot_mapping.len(),
        pages.len(),
        n_rows,
    )?;
    if n_rows == 0 {
        return Ok(());
    }
    let n = as_i32("n_rows", n_rows)?;
    let ps = as_i32("page_slots", layout.slots)?;
    let grid = n_rows.div_ceil(ROWS_PER_BLOCK) as u32;
    // nvfp4ds/mxfp4_index/mxfp8 _encode_f32(x, slot_mapping, pages, n_rows, page_slots)
    launch!(
        dev,
        "kv_cache",
        kernel,
        cfg((grid, 1), 128),
        x,
        slot_mapping,
        pages,
        &n,
        &ps
    );
    Ok(())
}

/// Gather-decodes the records at `slot_mapping` (n_rows,) into `out` ((n_rows, dim) f32); slot −1
/// gives zeros.
///
/// Errors: as [`encode_into_pages`].
pub fn decode_from_pages(
    dev: &Device,
    layout: &PageLayout,
    pages: &CudaSlice<u8>,
    slot_mapping: &CudaSlice<i64>,
    out: &mut CudaSlice<f32>,
    n_rows: usize,
) -> Result<()> {
    let (_, code) = kernel_format(layout.format)?;
    check(
        layout,
        "decode",
        out.len(),
        slot_mapping.len(),
        pages.len(),
        n_rows,
    )?;
    if n_rows == 0 {
        return Ok(());
    }
    let n = as_i32("n_rows", n_rows)?;
    let ps = as_i32("page_slots", layout.slots)?;
    let grid = n_rows.div_ceil(ROWS_PER_BLOCK) as u32;
    // kv_decode_f32(pages, slot_mapping, out, n_rows, page_slots, format)
    launch!(
        dev,
        "kv_cache",
        "kv_decode_f32",
        cfg((grid, 1), 128),
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
/// Errors: those of [`Device::shared`] and [`encode_into_pages`].
pub fn encode_into_pages_view(
    layout: &PageLayout,
    x: &crate::tensor::TensorView<'_>,
    slot_mapping: &crate::tensor::TensorView<'_>,
    pool: &mut crate::tensor::TensorViewMut<'_>,
) -> Result<()> {
    let crate::tensor::Device::Cuda(ordinal) = x.device() else {
        return Err(Error::Internal(
            "CUDA branch called with host tensors".into(),
        ));
    };
    let ordinal = usize::try_from(ordinal)
        .map_err(|_| Error::invalid("x", format!("CUDA device {ordinal} does not exist")))?;
    let n = slot_mapping.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = Device::shared(ordinal)?;
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
