//! Lightning-indexer logits on the GPU (`kernels/indexer.cu`, feature `cuda`) over a paged MXFP4
//! index-K cache ([`super::IndexCache`]); reference: [`super::reference::logits_paged`], which the
//! CUDA tests compare against.
//!
//! The kernel is built for [`INDEX_HEADS`] heads of [`INDEX_DIM`] dims (32 × 128; lane h keeps
//! head h's query in registers) and scores unquantised f32 queries; [`kernel_supports`] refuses
//! other [`IndexerParams`].

use super::{IndexerParams, QueryQuant, INDEX_DIM, INDEX_HEADS};
use crate::cuda::device::{as_i32, cfg, grid_rows, launch, OrNull};
use crate::cuda::driver::CudaSlice;
use crate::cuda::shapes::{INDEXER_ENTRIES_PER_BLOCK, INDEXER_THREADS};
use crate::cuda::CudaDevice;
use crate::error::{Error, Result};

/// Errors unless `p` is what the kernel computes: [`Error::Unsupported`] naming the difference.
pub fn kernel_supports(p: &IndexerParams) -> Result<()> {
    if p.heads != INDEX_HEADS || p.query_quant != QueryQuant::None || p.ratio == 0 {
        return Err(Error::Unsupported(format!(
            "the CUDA indexer is built for {INDEX_HEADS} heads, unquantised queries and ratio ≥ 1; \
             found {} heads, {:?}, ratio {}",
            p.heads, p.query_quant, p.ratio
        )));
    }
    Ok(())
}

/// CudaDevice buffers of one indexer call: T query rows of any requests.
#[derive(Debug)]
pub struct DeviceQueries<'a> {
    /// (T, 32, 128) f32, RoPE'd.
    pub q: &'a CudaSlice<f32>,
    /// (T, 32) f32, already scaled.
    pub w: &'a CudaSlice<f32>,
    /// (T,) i32 absolute positions.
    pub pos: &'a CudaSlice<i32>,
    /// (T,) i32 request of each row (a row of the block table).
    pub req: &'a CudaSlice<i32>,
    /// Rows T.
    pub rows: usize,
}

/// The paged index-K cache on the device (shapes as [`super::IndexCache`]).
#[derive(Debug)]
pub struct DeviceIndexCache<'a> {
    /// Page pool bytes.
    pub pages: &'a CudaSlice<u8>,
    /// (requests, max_blocks) i32.
    pub block_table: &'a CudaSlice<i32>,
    /// Columns of the block table.
    pub max_blocks: usize,
    /// Records per page.
    pub page_slots: usize,
}

/// Indexer logits (T, n_cols) f32 into `logits`: `Σ_h w[t,h] · ReLU(q[t,h] · k_j)` for visible j,
/// −Inf elsewhere; with `cand_mask` ((T, stride) u8 per 8-entry block, 1 = in the pool) entries
/// outside the pool are −Inf too (Reindex layers). The kernel does not check block ids: validate
/// the host description with [`super::IndexCache::check`] first.
///
/// Errors: [`Error::Unsupported`] from [`kernel_supports`], [`Error::Shape`] for buffers shorter
/// than the launch, [`Error::Cuda`].
pub fn logits(
    dev: &CudaDevice,
    p: &IndexerParams,
    qs: &DeviceQueries,
    cache: &DeviceIndexCache,
    cand_mask: Option<(&CudaSlice<u8>, usize)>,
    logits: &mut CudaSlice<f32>,
    n_cols: usize,
) -> Result<()> {
    kernel_supports(p)?;
    let rows = qs.rows;
    let grid_y = grid_rows("q", rows)?;
    if rows == 0 || n_cols == 0 {
        return Ok(());
    }
    if logits.len() < rows * n_cols || qs.q.len() < rows * INDEX_HEADS * INDEX_DIM {
        return Err(Error::shape(
            "indexer logits buffers",
            format!("{rows} rows × {n_cols}"),
            logits.len(),
        ));
    }
    if let Some((m, s)) = cand_mask {
        if s * 8 < n_cols || m.len() < rows * s {
            return Err(Error::shape(
                "candidate mask",
                format!("(T={rows}, ≥ {}) u8", n_cols.div_ceil(8)),
                format!("{} bytes, stride {s}", m.len()),
            ));
        }
    }
    let (mb, ps, ra, nc) = (
        as_i32("max_blocks", cache.max_blocks)?,
        as_i32("page_slots", cache.page_slots)?,
        as_i32("ratio", p.ratio)?,
        as_i32("n_cols", n_cols)?,
    );
    let grid = (n_cols.div_ceil(INDEXER_ENTRIES_PER_BLOCK) as u32, grid_y);
    let stride = as_i32("mask stride", cand_mask.map_or(0, |m| m.1))?;
    let mask = OrNull(cand_mask.map(|m| m.0));
    // indexer_logits_f32(q, w, pos, req, block_table, max_blocks, page_slots, index_pages, ratio,
    //   cand_mask, mask_stride, logits, n_cols)
    launch!(
        dev,
        "indexer",
        "indexer_logits_f32",
        cfg(grid, INDEXER_THREADS as u32),
        qs.q,
        qs.w,
        qs.pos,
        qs.req,
        cache.block_table,
        &mb,
        &ps,
        cache.pages,
        &ra,
        &mask,
        &stride,
        logits,
        &nc
    );
    Ok(())
}

/// Launches `indexer_logits_pool_f32_q*` ([`pool_kernel`] of the query quantisation) for a checked [`super::logits_in_pool_view`] call on
/// `stream` (a `CUstream` of device `ordinal`, owned by the caller; 0 = the legacy default
/// stream). Returns after the launch: no allocation, no copy, no synchronization.
///
/// Errors: [`Error::Unsupported`] for more than 32 heads or no usable device, [`Error::Shape`]
/// for a tensor that is not dense or not of the kernel's dtype, [`Error::Invalid`] for ratio 0 or
/// a dimension past `i32`, [`Error::Cuda`] for the module or the launch.
pub(crate) fn logits_in_pool_launch(
    ordinal: i32,
    p: &IndexerParams,
    a: &super::PoolQueries<'_>,
    out: &mut crate::tensor::TensorViewMut<'_>,
    error: Option<&mut crate::tensor::TensorViewMut<'_>>,
    stream: u64,
) -> Result<()> {
    use super::signature::{BLOCK_TABLE, ERROR, LOGITS_OUT, POSITIONS, Q, REQ, W};
    use crate::cuda::device::dense_device_addr as dense;
    use crate::cuda::shapes::{DTYPE_BF16, DTYPE_F16, DTYPE_F32};
    use crate::tensor::{DType, FLOATS};
    if p.ratio == 0 {
        return Err(Error::invalid(
            "ratio",
            "the indexer needs a compressed layer (ratio ≥ 1), found 0",
        ));
    }
    if p.heads == 0 || p.heads > 32 {
        return Err(Error::Unsupported(format!(
            "the CUDA pooled indexer keeps one head per lane of a warp: 1..=32 heads, found {}",
            p.heads
        )));
    }
    // One dtype contract for both devices: the signature's float types (f32, bf16, f16).
    let code = |d: DType| -> i32 {
        (match d {
            DType::Bf16 => DTYPE_BF16,
            DType::F16 => DTYPE_F16,
            _ => DTYPE_F32,
        }) as i32
    };
    let q = dense(a.q, FLOATS, Q.name)?;
    let w = dense(a.w, FLOATS, W.name)?;
    let (q_dt, w_dt, lo_dt) = (code(a.q.dtype()), code(a.w.dtype()), code(out.dtype()));
    let pos = dense(a.positions, &[DType::I32, DType::I64], POSITIONS.name)?;
    let pos_i64 = i32::from(a.positions.dtype() == DType::I64);
    let req = dense(a.req, &[DType::I32], REQ.name)?;
    let bt = dense(a.block_table, &[DType::I32], BLOCK_TABLE.name)?;
    let lo = dense(&out.as_view(), FLOATS, LOGITS_OUT.name)?;
    let err = match &error {
        Some(e) => dense(&e.as_view(), &[DType::I32], ERROR.name)?,
        None => 0,
    };
    let (rows, n_cols) = (a.q.shape()[0], out.shape()[1]);
    let (n_req, max_blocks) = (a.block_table.shape()[0], a.block_table.shape()[1]);
    if rows == 0 || n_cols == 0 {
        return Ok(());
    }
    let desc = *a.keys.desc();
    let i = |what: &str, v: usize| as_i32(what, v);
    let (rows_i, nc, nr, mb) = (
        i("rows", rows)?,
        i("n_cols", n_cols)?,
        i("block_table rows", n_req)?,
        i("max_blocks", max_blocks)?,
    );
    let (states, ratio, heads) = (
        i("states_per_page", desc.states_per_page)?,
        i("ratio", p.ratio)?,
        i("heads", p.heads)?,
    );
    let (pool, stride, blocks) = (
        a.keys.addr() as u64,
        desc.block_stride as i64,
        desc.blocks as i64,
    );
    let idx = usize::try_from(ordinal)
        .map_err(|_| Error::invalid(Q.name, format!("CUDA device {ordinal} does not exist")))?;
    let dev = CudaDevice::shared(idx)?;
    let kernel = pool_kernel(p.query_quant);
    let f = dev.function("indexer", kernel)?;
    // SAFETY: `stream` is the caller's live stream of this device's context (the entry's
    // contract); the wrapper does not own it and is dropped after the launch.
    let s = unsafe {
        dev.context()
            .wrap_borrowed_stream(stream as crate::cuda::driver::sys::CUstream)
    };
    let grid = (
        n_cols.div_ceil(INDEXER_ENTRIES_PER_BLOCK) as u32,
        rows.min(crate::cuda::device::MAX_GRID_Y) as u32,
    );
    use crate::cuda::driver::PushKernelArg;
    let mut b = s.launch_builder(&f);
    // indexer_logits_pool_f32_q*(q, q_dtype, w, w_dtype, pos, pos_i64, req, n_req, block_table,
    //   max_blocks, pool, block_stride, states, blocks, ratio, heads, logits, logits_dtype,
    //   n_cols, rows, err)
    b.arg(&q)
        .arg(&q_dt)
        .arg(&w)
        .arg(&w_dt)
        .arg(&pos)
        .arg(&pos_i64);
    b.arg(&req).arg(&nr).arg(&bt).arg(&mb);
    b.arg(&pool).arg(&stride).arg(&states).arg(&blocks);
    b.arg(&ratio).arg(&heads);
    b.arg(&lo).arg(&lo_dt).arg(&nc).arg(&rows_i).arg(&err);
    // SAFETY: the arguments follow the kernel's signature above in order and type; the entry
    // checked every tensor's shape, dtype, device and density, and the kernel checks every
    // request, block and position it reads against n_req, blocks and 0 before using it.
    unsafe { b.launch(cfg(grid, INDEXER_THREADS as u32)) }
        .map_err(|e| crate::cuda::device::cuda_error(format!("launch {kernel}"), e))?;
    Ok(())
}

/// The entry point of `kernels/indexer.cu`'s pooled indexer for a query quantisation: one per
/// mode, each compiled with only its own quantiser.
pub fn pool_kernel(q: QueryQuant) -> &'static str {
    match q {
        QueryQuant::None => "indexer_logits_pool_f32_qnone",
        QueryQuant::Mxfp4 => "indexer_logits_pool_f32_qmxfp4",
        QueryQuant::Fp8 => "indexer_logits_pool_f32_qfp8",
        QueryQuant::Bf16 => "indexer_logits_pool_f32_qbf16",
    }
}
