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

use super::{BatchPlan, CompressViews, Compressor, CompressorParams};
use crate::cuda::device::{as_i32, cfg, cuda_error, launch};
use crate::cuda::driver::CudaSlice;
use crate::cuda::shapes::COMPRESSOR_THREADS;
use crate::cuda::CudaDevice;
use crate::error::{Error, Result};
use crate::formats::KV_DIM;
use crate::geometry::consts::{RMS_NORM_EPS, ROPE_DIM};
use crate::tensor::{DType, TensorView, TensorViewMut};

/// Errors unless `c` is what the kernel computes: [`Error::Unsupported`] naming the difference.
pub fn kernel_supports(c: &Compressor) -> Result<()> {
    supports(c.eps, c.rope.rope_dim())
}

/// [`kernel_supports`] of the params of a view call ([`super::compress_view`]).
pub fn params_supported(p: &CompressorParams) -> Result<()> {
    supports(p.eps, p.rope.rope_dim())
}

fn supports(eps: f64, rope_dim: usize) -> Result<()> {
    if eps != RMS_NORM_EPS || rope_dim != ROPE_DIM {
        return Err(Error::Unsupported(format!(
            "the CUDA compressor is built for eps {RMS_NORM_EPS:e} and {ROPE_DIM} rope dims; \
             this compressor has eps {eps:e} and {rope_dim} rope dims"
        )));
    }
    Ok(())
}

/// CudaDevice buffers of one batched call (shapes as [`super::CompressorBatch`]; weights as
/// [`super::PooledWeights`], RoPE inverse frequencies (32,) f64).
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
    dev: &CudaDevice,
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
    //   main_pages, index_pages, ratio, table_base)
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
        &0i64,
    );
    Ok(())
}

/// The CUDA branch of [`super::compress_view`] (signature, ratio, alignment and device checked):
/// the batched kernel over one request whose "pages" are the output rows themselves. A page of one
/// slot holds a record's data then its scales, which is the row form of both record formats, so
/// the block table is `0 .. E` and `table_base` (the kernel's first table entry) is the call's
/// first entry `start_pos / ratio`. Launched on `stream` (the caller's `CUstream`, 0 = the legacy
/// default stream) with the caller's memory as raw device pointers; the few scratch buffers (the
/// request's token range, the table, the RoPE frequencies, the ratio-2 carry the kernel writes)
/// are allocated and freed on the same stream, so nothing waits on the host.
///
/// Errors: [`Error::Unsupported`] for params the kernel was not built for, a tensor other than
/// float32 / uint8, or a last position past 2³¹ − 1; [`Error::Cuda`].
pub(crate) fn compress_rows(
    p: &CompressorParams,
    a: &CompressViews<'_, '_>,
    start_pos: i64,
    stream: u64,
    main_out: &mut TensorViewMut<'_>,
    index_out: &mut TensorViewMut<'_>,
) -> Result<()> {
    use super::signature::{KV, K_NORM, NORM, SCORE, WK};
    params_supported(p)?;
    let mut inputs = vec![(KV.name, a.kv), (NORM.name, a.norm), (WK.name, a.wk)];
    inputs.push((K_NORM.name, a.k_norm));
    if let Some(s) = a.score {
        inputs.push((SCORE.name, s));
    }
    if let Some((what, v)) = inputs.iter().find(|(_, v)| v.dtype() != DType::F32) {
        return Err(Error::Unsupported(format!(
            "`{what}` is {}; the CUDA compressor reads float32",
            v.dtype().name()
        )));
    }
    let (t, e) = (a.kv.shape()[0], main_out.shape()[0]);
    if e == 0 {
        return Ok(());
    }
    let last = start_pos + t as i64 - 1;
    let (s0, te, ee) = match (i32::try_from(start_pos), i32::try_from(last)) {
        (Ok(s0), Ok(_)) => (s0, as_i32("T", t)?, as_i32("E", e)?),
        _ => {
            return Err(Error::Unsupported(format!(
                "tokens {start_pos} ..= {last}: the CUDA compressor takes positions below 2^31"
            )))
        }
    };
    let dev = CudaDevice::of_view(&main_out.as_view(), "main_kv_out")?;
    let f = dev.function("compressor", "compressor_f32")?;
    // SAFETY: `stream` is a live stream of this device's primary context (the caller's contract,
    // documented on the export); the wrapper does not own it.
    let s = unsafe {
        dev.context()
            .wrap_borrowed_stream(stream as crate::cuda::driver::sys::CUstream)
    };
    let up =
        |what: &str, e: crate::cuda::driver::DriverError| cuda_error(format!("upload {what}"), e);
    // [cu_tokens[0], cu_tokens[1], start_pos[0]] of the one request.
    let req = s
        .clone_htod(&[0, te, s0])
        .map_err(|e| up("request range", e))?;
    let table: Vec<i32> = (0..ee).collect();
    let table = s.clone_htod(&table).map_err(|e| up("block table", e))?;
    let freq = s
        .clone_htod(p.rope.inv_freqs())
        .map_err(|e| up("RoPE frequencies", e))?;
    // Carry in (nothing: a stateless call starts on a group boundary) and out (discarded).
    let carry = s
        .alloc_zeros::<f32>(4 * KV_DIM)
        .map_err(|e| up("carry", e))?;
    let carry_pos = s.clone_htod(&[-1i32, -1]).map_err(|e| up("carry", e))?;
    let addr = |v: &TensorView<'_>| v.addr() as u64;
    let (kv, norm, wk, k_norm) = (addr(a.kv), addr(a.norm), addr(a.wk), addr(a.k_norm));
    // Ratio 1 never reads the score; any valid pointer will do.
    let score = a.score.map_or(kv, addr);
    let (main, index) = (
        main_out.as_view().addr() as u64,
        index_out.as_view().addr() as u64,
    );
    let (req_p, table_p, freq_p, carry_p, carry_pos_p) = {
        use crate::cuda::driver::DevicePtr;
        (
            req.device_ptr(&s).0,
            table.device_ptr(&s).0,
            freq.device_ptr(&s).0,
            carry.device_ptr(&s).0,
            carry_pos.device_ptr(&s).0,
        )
    };
    let (i32b, f32b) = (4u64, 4u64);
    let ratio = as_i32("ratio", p.ratio)?;
    let table_base = start_pos / p.ratio as i64;
    let (one, grid) = (1i32, (ee as u32 + 1, 1u32));
    let mut b = s.launch_builder(&f);
    use crate::cuda::driver::PushKernelArg;
    // compressor_f32(kv, score, cu_tokens, start_pos, state_in, state_pos_in, state_out,
    //   state_pos_out, norm_w, wk, k_norm_w, inv_freq, block_table, max_blocks, page_slots,
    //   main_pages, index_pages, ratio, table_base)
    let (start_p, carry_out_p, carry_pos_out_p) = (
        req_p + 2 * i32b,
        carry_p + 2 * KV_DIM as u64 * f32b,
        carry_pos_p + i32b,
    );
    b.arg(&kv).arg(&score).arg(&req_p).arg(&start_p);
    b.arg(&carry_p)
        .arg(&carry_pos_p)
        .arg(&carry_out_p)
        .arg(&carry_pos_out_p);
    b.arg(&norm).arg(&wk).arg(&k_norm).arg(&freq_p);
    b.arg(&table_p).arg(&ee).arg(&one);
    b.arg(&main).arg(&index).arg(&ratio).arg(&table_base);
    // SAFETY: the arguments follow the kernel's signature above in order and type. The caller's
    // tensors were checked against the signature (dense, shapes, dtypes, one device) by the
    // view entry: kv / score hold T rows, the outputs E = T / ratio records; the table maps
    // entries `table_base .. table_base + E` to output rows `0 .. E` and the kernel skips any
    // entry past it; the carry buffers are distinct halves of one allocation.
    unsafe { b.launch(cfg(grid, COMPRESSOR_THREADS as u32)) }
        .map_err(|e| cuda_error("launch compressor_f32 (rows)", e))?;
    // The scratch buffers are freed on `s` after the kernel (stream order).
    drop((req, table, freq, carry, carry_pos));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::{cw, params, records_close, weights};
    use super::super::{compress_view, reference, CompressViews};
    use crate::cuda::CudaDevice;
    use crate::formats::{decode_rows, RecordFormat, INDEX_DIM, KV_DIM};
    use crate::formats::{MXFP4_INDEX_BYTES, NVFP4_DS_BYTES};
    use crate::tolerance::{compare, QUANT_VS_EXACT};
    use csa2_rng::{rand_normal, NewRng, Rng};

    /// The row form on the GPU against the one f64 reference (the CPU twin's test:
    /// `compress_view_on_host_is_the_compressor`), both ratios, a start past 0.
    #[test]
    fn compress_view_on_cuda_matches_the_reference() {
        if !CudaDevice::driver_present() {
            println!("SKIPPED: no CUDA driver");
            return;
        }
        let dev = CudaDevice::shared(0).unwrap();
        for (m, t, start, seed) in [(2usize, 64usize, 1000i64, 51u64), (1, 33, 7, 52)] {
            let mut rng = Rng::new(seed);
            let w = weights(&mut rng);
            let kv = rand_normal(&mut rng, t * KV_DIM, 1.0);
            let score = rand_normal(&mut rng, t * KV_DIM, 2.0);
            let e = t / m;
            let up = |v: &[f32]| dev.upload(v).unwrap();
            let (dkv, dsc, dn, dw, dk) =
                (up(&kv), up(&score), up(&w.norm), up(&w.wk), up(&w.k_norm));
            let (dmain, dindex) = (
                dev.zeros::<u8>(e * NVFP4_DS_BYTES).unwrap(),
                dev.zeros::<u8>(e * MXFP4_INDEX_BYTES).unwrap(),
            );
            let (kvv, sv) = (
                dev.test_view(&dkv, &[t, KV_DIM]),
                dev.test_view(&dsc, &[t, KV_DIM]),
            );
            let (nv, wv, kn) = (
                dev.test_view(&dn, &[KV_DIM]),
                dev.test_view(&dw, &[INDEX_DIM, KV_DIM]),
                dev.test_view(&dk, &[INDEX_DIM]),
            );
            let views = CompressViews {
                kv: &kvv,
                score: (m == 2).then_some(&sv),
                norm: &nv,
                wk: &wv,
                k_norm: &kn,
            };
            dev.synchronize_context().unwrap();
            compress_view(
                &params(m),
                &views,
                start,
                0,
                &mut dev.test_view_mut(&dmain, &[e, NVFP4_DS_BYTES]),
                &mut dev.test_view_mut(&dindex, &[e, MXFP4_INDEX_BYTES]),
            )
            .unwrap();
            dev.synchronize_context().unwrap();
            let (main, index) = (
                dev.download(&dmain).unwrap(),
                dev.download(&dindex).unwrap(),
            );
            let sc = (m == 2).then_some(&score[..]);
            let r =
                reference::compress(m, 1e-20, &params(m).rope, &cw(&w), &kv, sc, start as usize);
            records_close(RecordFormat::Nvfp4Ds, &main, &r.f32.main_kv_nvfp4);
            records_close(RecordFormat::Mxfp4Index, &index, &r.f32.index_k_mxfp4);
            let mut dec = vec![0f32; e * KV_DIM];
            decode_rows(RecordFormat::Nvfp4Ds, &main, &mut dec).unwrap();
            let s = compare(&dec, &r.main_kv, &QUANT_VS_EXACT);
            assert!(
                s.cos_diff < QUANT_VS_EXACT.cos_diff,
                "m={m} nvfp4 vs exact: {s:?}"
            );
        }
    }
}
