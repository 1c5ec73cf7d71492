//! Top-k on the GPU (`kernels/topk.cu`, feature `cuda`: radix select, then a bitonic sort of the
//! selection in shared memory). Reference: the CPU path ([`super::select_rows`]), which the CUDA
//! tests compare against exactly.
//!
//! Same selection rules and the same output order as the CPU ([`super`]'s order contract): ties →
//! smaller index; −Inf / NaN never selected; a row with `n_valid ≤ k` selects `0..n_valid`;
//! a scored row comes out by (logit desc, index asc), sorted in the kernel — no host step, so the
//! launch is CUDA-graph capturable. The in-kernel sort holds at most
//! [`TOPK_SORT_MAX`] entries: a larger k is refused ([`Error::Unsupported`]).

use crate::cuda::device::{as_i32, cfg, cuda_error, launch};
use crate::cuda::driver::CudaSlice;
use crate::cuda::shapes::{TOPK_SORT_MAX, TOPK_THREADS};
use crate::cuda::CudaDevice;
use crate::error::{Error, Result};
use crate::tensor::TensorView;

/// Errors unless the kernel can select and order `k` entries per row.
pub fn check_k(k: usize) -> Result<()> {
    if k == 0 {
        return Err(Error::invalid("k", "must be at least 1"));
    }
    if k > TOPK_SORT_MAX {
        return Err(Error::Unsupported(format!(
            "the CUDA top-k orders at most {TOPK_SORT_MAX} entries per row in shared memory; \
             k = {k} (run it on host memory, which has no such bound)"
        )));
    }
    Ok(())
}

/// Top-k of each row of `keys` (rows, n_cols) over its first `n_valid[t]` keys into `out`
/// (rows, k) i32, −1 padded, in the order contract, on the device's own stream.
///
/// Errors: [`Error::Invalid`] for k = 0, [`Error::Unsupported`] for k over [`TOPK_SORT_MAX`],
/// [`Error::Shape`] for buffers shorter than the launch, [`Error::Cuda`].
pub fn select_rows(
    dev: &CudaDevice,
    keys: &CudaSlice<f32>,
    n_cols: usize,
    n_valid: &CudaSlice<i32>,
    k: usize,
    out: &mut CudaSlice<i32>,
    rows: usize,
) -> Result<()> {
    check_k(k)?;
    if rows == 0 {
        return Ok(());
    }
    if out.len() < rows * k || keys.len() < rows * n_cols || n_valid.len() < rows {
        return Err(Error::shape(
            "top-k buffers",
            format!("{rows} rows of {n_cols} keys → {k}"),
            format!(
                "{} keys, {} n_valid, {} out",
                keys.len(),
                n_valid.len(),
                out.len()
            ),
        ));
    }
    let (nc, kk) = (as_i32("n_cols", n_cols)?, as_i32("k", k)?);
    let (null, no_i64, ratio) = (0u64, 0i32, 1i32);
    // topk_f32(keys, n_cols, n_valid, positions, pos_i64, ratio, k, out, counts, err)
    launch!(
        dev,
        "topk",
        "topk_f32",
        cfg((as_i32("rows", rows)? as u32, 1), TOPK_THREADS as u32),
        keys,
        &nc,
        n_valid,
        &null,
        &no_i64,
        &ratio,
        &kk,
        out,
        &null,
        &null
    );
    Ok(())
}

/// Which row kernel of `kernels/topk.cu` a [`RowsLaunch`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowsKernel {
    /// `topk_f32`: the top-k of each row's visible logits (a row with ≤ k visible selects
    /// `0..visible`).
    TopK,
    /// `candidate_blocks_f32`: the candidate pool of each row (`ops::candidates`' contract): the
    /// top-k of its block scores, blocks of `block_size` entries, the newest pinned, every row
    /// sorted.
    CandidateBlocks {
        /// Entries per block (≥ 1).
        block_size: usize,
    },
}

impl RowsKernel {
    fn name(self) -> &'static str {
        match self {
            RowsKernel::TopK => "topk_f32",
            RowsKernel::CandidateBlocks { .. } => "candidate_blocks_f32",
        }
    }
}

/// One row-kernel launch over raw device addresses (the tensor-view entry, checked there): row t
/// sees `(positions[t] + 1) div ratio` entries of `logits`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowsLaunch {
    pub kernel: RowsKernel,
    /// `(rows, n_cols)` f32.
    pub logits: u64,
    pub n_cols: usize,
    /// `(rows,)` i32 or i64 (`pos_i64`).
    pub positions: u64,
    pub pos_i64: bool,
    pub ratio: usize,
    /// `(rows, k)` i32.
    pub out: u64,
    pub k: usize,
    /// `(rows,)` i32 or 0.
    pub counts: u64,
    /// `[4]` i32 or 0: the first negative position `{1, row, 0, position}`.
    pub err: u64,
    pub rows: usize,
}

/// Launches `a.kernel` for `a` on `stream` (a `CUstream` of `dev`'s context owned by the caller,
/// borrowed for the launch; 0 = the legacy default stream). Returns after the launch: nothing is
/// allocated, copied or synchronized.
///
/// k = 0 is allowed for top-k (counts are written as 0); the candidate kernel sorts every row, so
/// its k is checked whatever the rows.
///
/// Errors: as [`select_rows`]; [`Error::Invalid`] for ratio or block size 0; [`Error::Cuda`]
/// for the module or the launch.
pub(crate) fn select_rows_launch(dev: &CudaDevice, a: &RowsLaunch, stream: u64) -> Result<()> {
    let block_size = match a.kernel {
        RowsKernel::TopK => None,
        RowsKernel::CandidateBlocks { block_size } => Some(block_size),
    };
    if a.k > 0 || block_size.is_some() {
        check_k(a.k)?;
    }
    if block_size == Some(0) {
        return Err(Error::invalid("block_size", "must be ≥ 1, found 0"));
    }
    if a.rows == 0 {
        return Ok(());
    }
    if a.ratio == 0 {
        return Err(Error::invalid("ratio", "must be ≥ 1, found 0"));
    }
    let (nc, kk, ratio) = (
        as_i32("n_cols", a.n_cols)?,
        as_i32("k", a.k)?,
        as_i32("ratio", a.ratio)?,
    );
    let bs = block_size.map(|b| as_i32("block_size", b)).transpose()?;
    let rows = as_i32("rows", a.rows)? as u32;
    let pos_i64 = i32::from(a.pos_i64);
    let name = a.kernel.name();
    let f = dev.function("topk", name)?;
    // SAFETY: `stream` is a live stream of this device's context (the entry's contract); the
    // wrapper does not own it and is dropped after the launch.
    let s = unsafe {
        dev.context()
            .wrap_borrowed_stream(stream as crate::cuda::driver::sys::CUstream)
    };
    let null = 0u64;
    let mut b = s.launch_builder(&f);
    use crate::cuda::driver::PushKernelArg;
    // topk_f32(keys, n_cols, n_valid, positions, pos_i64, ratio, k, out, counts, err)
    // candidate_blocks_f32(the same, block_size)
    b.arg(&a.logits).arg(&nc).arg(&null);
    b.arg(&a.positions).arg(&pos_i64).arg(&ratio).arg(&kk);
    b.arg(&a.out).arg(&a.counts).arg(&a.err);
    if let Some(bs) = &bs {
        b.arg(bs);
    }
    // SAFETY: the arguments follow the kernel's signature in order and type; the entry checked
    // every tensor's shape, dtype, device and density against `a`, so every access is in bounds.
    unsafe { b.launch(cfg((rows, 1), TOPK_THREADS as u32)) }
        .map_err(|e| cuda_error(format!("launch {name}"), e))?;
    Ok(())
}

/// The tensors of one row-kernel call on device `ordinal`, checked against their op's signature
/// by its view entry (`ops::topk`, `ops::candidates`): `logits` `[T, N]` float32, `positions`
/// `[T]` int32 / int64, `out` `[T, K]` int32 (named `out_name` in errors), optional `counts`
/// `[T]` and `error` `[4]` int32; all dense.
#[derive(Clone, Copy)]
pub(crate) struct RowsViews<'a> {
    pub logits: &'a TensorView<'a>,
    pub positions: &'a TensorView<'a>,
    pub out: &'a TensorView<'a>,
    pub out_name: &'static str,
    pub counts: Option<&'a TensorView<'a>>,
    pub error: Option<&'a TensorView<'a>>,
}

/// Runs `kernel` over `v` (the CUDA branch of the row ops' view entries). With `stream`, the
/// launch goes on the caller's stream and returns at once (no host access; a negative position
/// is recorded in `error`). Without, the call is synchronous: it waits for the device's work,
/// reads `positions` back to refuse a negative one before writing anything (as on the host),
/// launches on csa2's own stream and waits for it (`error` is not written).
///
/// Errors: [`Error::Shape`] for a tensor that is not dense or not of the kernel's dtype;
/// [`Error::Invalid`] for ratio 0, a device that does not exist, a negative position
/// (synchronous); [`Error::Unsupported`] for a k the kernel cannot order; [`Error::Cuda`].
pub(crate) fn run_rows_views(
    ordinal: i32,
    kernel: RowsKernel,
    v: &RowsViews<'_>,
    ratio: usize,
    stream: Option<u64>,
) -> Result<()> {
    use super::signature::{COUNTS_OUT, ERROR, LOGITS, POSITIONS};
    use crate::cuda::device::dense_device_addr as dense;
    use crate::tensor::DType;
    let ordinal = usize::try_from(ordinal).map_err(|_| {
        Error::invalid(LOGITS.name, format!("CUDA device {ordinal} does not exist"))
    })?;
    let (t, n, k) = (v.logits.shape()[0], v.logits.shape()[1], v.out.shape()[1]);
    let a = RowsLaunch {
        kernel,
        logits: dense(v.logits, &[DType::F32], LOGITS.name)?,
        n_cols: n,
        positions: dense(v.positions, &[DType::I32, DType::I64], POSITIONS.name)?,
        pos_i64: v.positions.dtype() == DType::I64,
        ratio,
        out: dense(v.out, &[DType::I32], v.out_name)?,
        k,
        counts: match v.counts {
            Some(c) => dense(c, &[DType::I32], COUNTS_OUT.name)?,
            None => 0,
        },
        err: match (v.error, stream) {
            (Some(e), Some(_)) => dense(e, &[DType::I32], ERROR.name)?,
            _ => 0,
        },
        rows: t,
    };
    if ratio == 0 {
        return Err(Error::invalid("ratio", "must be ≥ 1, found 0"));
    }
    if k > 0 || kernel != RowsKernel::TopK {
        check_k(k)?;
    }
    if t == 0 {
        return Ok(());
    }
    let dev = CudaDevice::shared(ordinal)?;
    match stream {
        Some(s) => select_rows_launch(&dev, &a, s),
        None => {
            dev.synchronize_context()?;
            // The synchronous entry refuses a negative position before writing anything, as on
            // the host. SAFETY: the view's contract — live device memory of this context.
            let pos: Vec<i64> = if a.pos_i64 {
                dev.download(&*unsafe { dev.borrow::<i64>(v.positions, POSITIONS.name)? })?
            } else {
                dev.download(&*unsafe { dev.borrow::<i32>(v.positions, POSITIONS.name)? })?
                    .into_iter()
                    .map(i64::from)
                    .collect()
            };
            crate::ops::rope::check_positions(&pos[..t])?;
            select_rows_launch(&dev, &a, dev.stream().cu_stream() as u64)?;
            dev.synchronize()
        }
    }
}
