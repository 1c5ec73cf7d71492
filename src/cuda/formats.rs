//! Record encode / decode kernels over block-planar cache pages (`kernels/kv_cache.cu`).
//!
//! Bit-identical to [`crate::formats::page::PageLayout::write`] / `read` (docs/SPEC.md §1): the GPU tests
//! compare page bytes exactly. Addressing follows vLLM's `reshape_and_cache`: row i goes to
//! `slot_mapping[i] = block · page_slots + offset`; a slot of -1 skips the row.

use super::device::{as_i32, cfg, check_len, launch, Device};
use crate::error::{Error, Result};
use crate::formats::RecordFormat;
use cudarc::driver::CudaSlice;

const ROWS_PER_BLOCK: usize = 4;

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

fn check_slots(slots: &[i64], capacity: usize) -> Result<()> {
    if let Some((i, &s)) = slots
        .iter()
        .enumerate()
        .find(|(_, &s)| s < -1 || s >= capacity as i64)
    {
        return Err(Error::invalid(
            "slot_mapping",
            format!("entry {i} is {s}; expected -1 or a slot in 0..{capacity}"),
        ));
    }
    Ok(())
}

fn pool_slots(fmt: RecordFormat, pool_bytes: usize, page_slots: usize) -> Result<usize> {
    if page_slots == 0 {
        return Err(Error::invalid("page_slots", "must be at least 1"));
    }
    let page = page_slots * fmt.record_bytes();
    if !pool_bytes.is_multiple_of(page) {
        return Err(Error::shape(
            format!("{} page pool bytes", fmt.name()),
            format!(
                "a multiple of {page} ({page_slots} slots × {} B)",
                fmt.record_bytes()
            ),
            pool_bytes,
        ));
    }
    Ok(pool_bytes / page * page_slots)
}

impl Device {
    /// Encodes `x` (rows, dim) f32 into records at `slot_mapping` (rows,) of the page pool `pages`
    /// (n_pages × page_slots × record bytes, block-planar), in place.
    ///
    /// Formats: NVFP4-DS main KV (dim 512), MXFP4 index K (128), MXFP8 SWA (512).
    /// Errors: [`Error::Unsupported`] for other formats; [`Error::Shape`] / [`Error::Invalid`] for
    /// inconsistent lengths or out-of-pool slots; [`Error::Cuda`] from the driver.
    pub fn encode_pages(
        &self,
        fmt: RecordFormat,
        x: &[f32],
        slot_mapping: &[i64],
        pages: &mut [u8],
        page_slots: usize,
    ) -> Result<()> {
        let cap = pool_slots(fmt, pages.len(), page_slots)?;
        check_len(
            &format!("{} input values", fmt.name()),
            x.len(),
            slot_mapping.len() * fmt.dim(),
        )?;
        check_slots(slot_mapping, cap)?;
        let dx = self.upload(x)?;
        let ds = self.upload(slot_mapping)?;
        let mut dp = self.upload(pages)?;
        self.encode_pages_dev(fmt, &dx, &ds, &mut dp, slot_mapping.len(), page_slots)?;
        pages.copy_from_slice(&self.download(&dp)?);
        Ok(())
    }

    /// Device form of [`Device::encode_pages`]: `n_rows` rows; the caller guarantees the slots are in
    /// the pool (the kernel does not check).
    pub fn encode_pages_dev(
        &self,
        fmt: RecordFormat,
        x: &CudaSlice<f32>,
        slot_mapping: &CudaSlice<i64>,
        pages: &mut CudaSlice<u8>,
        n_rows: usize,
        page_slots: usize,
    ) -> Result<()> {
        let (kernel, _) = kernel_format(fmt)?;
        if x.len() < n_rows * fmt.dim() || slot_mapping.len() < n_rows {
            return Err(Error::shape(
                "encode_pages_dev buffers",
                format!("{n_rows} rows"),
                x.len() / fmt.dim(),
            ));
        }
        pool_slots(fmt, pages.len(), page_slots)?;
        if n_rows == 0 {
            return Ok(());
        }
        let n = as_i32("n_rows", n_rows)?;
        let ps = as_i32("page_slots", page_slots)?;
        let grid = n_rows.div_ceil(ROWS_PER_BLOCK) as u32;
        // nvfp4ds/mxfp4_index/mxfp8 _encode_f32(x, slot_mapping, pages, n_rows, page_slots)
        launch!(
            self,
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

    /// Gather-decodes the records at `slot_mapping` (rows,) into (rows, dim) f32; slot -1 → zeros.
    pub fn decode_pages(
        &self,
        fmt: RecordFormat,
        pages: &[u8],
        slot_mapping: &[i64],
        page_slots: usize,
    ) -> Result<Vec<f32>> {
        let cap = pool_slots(fmt, pages.len(), page_slots)?;
        check_slots(slot_mapping, cap)?;
        let dp = self.upload(pages)?;
        let ds = self.upload(slot_mapping)?;
        let mut out = self.zeros::<f32>(slot_mapping.len() * fmt.dim())?;
        self.decode_pages_dev(fmt, &dp, &ds, &mut out, slot_mapping.len(), page_slots)?;
        let mut v = self.download(&out)?;
        v.truncate(slot_mapping.len() * fmt.dim());
        Ok(v)
    }

    /// Device form of [`Device::decode_pages`].
    pub fn decode_pages_dev(
        &self,
        fmt: RecordFormat,
        pages: &CudaSlice<u8>,
        slot_mapping: &CudaSlice<i64>,
        out: &mut CudaSlice<f32>,
        n_rows: usize,
        page_slots: usize,
    ) -> Result<()> {
        let (_, code) = kernel_format(fmt)?;
        if out.len() < n_rows * fmt.dim() || slot_mapping.len() < n_rows {
            return Err(Error::shape(
                "decode_pages_dev buffers",
                format!("{n_rows} rows"),
                out.len() / fmt.dim(),
            ));
        }
        pool_slots(fmt, pages.len(), page_slots)?;
        if n_rows == 0 {
            return Ok(());
        }
        let n = as_i32("n_rows", n_rows)?;
        let ps = as_i32("page_slots", page_slots)?;
        let grid = n_rows.div_ceil(ROWS_PER_BLOCK) as u32;
        // kv_decode_f32(pages, slot_mapping, out, n_rows, page_slots, format)
        launch!(
            self,
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
}
