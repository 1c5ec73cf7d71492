//! The batched compressor on the GPU (`kernels/compressor.cu`, feature `cuda`): the same
//! [`Compressor`] (ratio, weights, RoPE) and [`CompressorBatch`] signature as the CPU and the
//! reference ([`super::reference::compress_paged`], which the CUDA tests compare against).
//!
//! Per compressed entry j of a request (tokens [j·m, j·m + m)): pool (ratio 2: per-channel softmax
//! gate of the two scores; ratio 1: the token itself) → RMSNorm(norm) → bf16 latent; main KV =
//! NVFP4-DS(RoPE(latent) at j·m); index K = MXFP4(RoPE(RMSNorm(wk · latent, k_norm)) at j·m). The
//! kernel is built for the geometry's kv and index-K widths, rope dims and RMSNorm epsilon
//! ([`crate::geometry::consts`]: 512, 128, 64, 1e-20; its defines); [`kernel_supports`] refuses a
//! compressor configured otherwise.

use super::{BatchPlan, Compressor};
use crate::cuda::device::{as_i32, cfg, launch};
use crate::cuda::shapes::COMPRESSOR_THREADS;
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::geometry::consts::{RMS_NORM_EPS, ROPE_DIM};
use cudarc::driver::CudaSlice;

/// Errors unless `c` is what the kernel computes: [`Error::Unsupported`] naming the difference.
pub fn kernel_supports(c: &Compressor) -> Result<()> {
    if c.eps != RMS_NORM_EPS || c.rope.rope_dim() != ROPE_DIM {
        return Err(Error::Unsupported(format!(
            "the CUDA compressor is built for eps {RMS_NORM_EPS:e} and {ROPE_DIM} rope dims; \
             this compressor has eps {:e} and {} rope dims",
            c.eps,
            c.rope.rope_dim()
        )));
    }
    Ok(())
}

/// Device buffers of one batched call (shapes as [`super::CompressorBatch`]; weights as
/// [`super::CompressorWeights`], RoPE inverse frequencies (32,) f64).
#[derive(Debug)]
pub struct DeviceBatch<'a> {
    /// (tokens, 512) f32.
    pub kv: &'a CudaSlice<f32>,
    /// (tokens, 512) f32; for ratio 1 any buffer (unused).
    pub score: &'a CudaSlice<f32>,
    /// (requests + 1,) i32.
    pub cu_tokens: &'a CudaSlice<i32>,
    /// (requests,) i32.
    pub start_pos: &'a CudaSlice<i32>,
    /// (requests, max_blocks) i32.
    pub block_table: &'a CudaSlice<i32>,
    /// Columns of the block table.
    pub max_blocks: usize,
    /// Records per page.
    pub page_slots: usize,
    /// (512,) f32 — the compressor's `norm` on the device.
    pub norm: &'a CudaSlice<f32>,
    /// (128, 512) f32 — `wk`.
    pub wk: &'a CudaSlice<f32>,
    /// (128,) f32 — `k_norm`.
    pub k_norm: &'a CudaSlice<f32>,
    /// (32,) f64 — the compressor's RoPE inverse frequencies.
    pub inv_freq: &'a CudaSlice<f64>,
}

/// Runs the compressor over a batch, writing main-KV records into `main_pages` (NVFP4-DS) and
/// index-K records into `index_pages` (MXFP4), reading the ratio-2 carry from `state_in` and
/// writing it to `state_out` ((requests, 1024) f32 and (requests,) i32 each; distinct buffers; not
/// touched for ratio 1).
///
/// `plan` is [`super::CompressorBatch::plan`] of the host-side description of the same batch:
/// the kernel does not check block ids or carried positions, so the caller validates first.
///
/// Errors: [`Error::Unsupported`] from [`kernel_supports`], [`Error::Invalid`] for a count that
/// does not fit the kernel's `int`, [`Error::Cuda`] from the driver.
#[allow(clippy::too_many_arguments)]
pub fn compress(
    dev: &Device,
    c: &Compressor,
    plan: &BatchPlan,
    b: &DeviceBatch,
    state_in: (&CudaSlice<f32>, &CudaSlice<i32>),
    state_out: (&mut CudaSlice<f32>, &mut CudaSlice<i32>),
    main_pages: &mut CudaSlice<u8>,
    index_pages: &mut CudaSlice<u8>,
) -> Result<()> {
    kernel_supports(c)?;
    if plan.requests == 0 {
        return Ok(());
    }
    let ratio = as_i32("ratio", c.ratio)?;
    let mb = as_i32("max_blocks", b.max_blocks)?;
    let ps = as_i32("page_slots", b.page_slots)?;
    let grid = (
        as_i32("entries", plan.max_entries + 1)? as u32,
        as_i32("requests", plan.requests)? as u32,
    );
    let (st_out, pos_out) = state_out;
    // compressor_f32(kv, score, cu_tokens, start_pos, state_in, state_pos_in, state_out,
    //   state_pos_out, norm_w, wk, k_norm_w, inv_freq, block_table, max_blocks, page_slots,
    //   main_pages, index_pages, ratio)
    launch!(
        dev,
        "compressor",
        "compressor_f32",
        cfg(grid, COMPRESSOR_THREADS as u32),
        b.kv,
        b.score,
        b.cu_tokens,
        b.start_pos,
        state_in.0,
        state_in.1,
        st_out,
        pos_out,
        b.norm,
        b.wk,
        b.k_norm,
        b.inv_freq,
        b.block_table,
        &mb,
        &ps,
        main_pages,
        index_pages,
        &ratio,
    );
    Ok(())
}
