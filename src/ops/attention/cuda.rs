//! The CUDA side of the attention family (feature `cuda`; `kernels/attention.cu`).
//!
//! - [`attention_pools_launch`]: the kernel behind `csa2_attention_pools` on `kDLCUDA` tensors —
//!   vLLM's strided page pools read in place (V4 584 B planar, NVFP4 288 B and MXFP8 528 B
//!   interleaved), bf16 q / out, launched on the caller's (borrowed) stream with raw device
//!   pointers: no host access to device memory, no allocation, no synchronization, so a CUDA
//!   graph can capture it once the module is loaded ([`preload`]).
//! - [`CudaDevice::sparse_decode_attention`]: the older kernel over csa2's own dense block-planar
//!   pages and block tables (docs/SPEC.md §2 "Attention"), one function over tensor views in host
//!   or device memory.

use super::split_plan::{split_plan, split_workspace_floats, SplitPlan, TILE_KEYS};
use super::{PoolDesc, PoolLayout};
use crate::cuda::device::{as_i32, cfg, check_len, cuda_error, grid_rows, launch, OrNull};
use crate::cuda::shapes::{
    ATTN_COMBINE_HEADS_PER_BLOCK, ATTN_HEADS_PER_BLOCK, ATTN_MMA_HEADS_PER_BLOCK,
    ATTN_SPLIT_H32_HEADS_PER_BLOCK, ATTN_THREADS,
};
use crate::cuda::CudaDevice;
use crate::error::{Error, Result};
use crate::ffi::dlpack::View;
use crate::ffi::Checked;
use crate::formats::{KV_DIM, MXFP8_BYTES, NVFP4_DS_BYTES};
use crate::geometry::consts::ROPE_DIM;
use crate::tensor::{Device, TensorView, TensorViewMut};
use std::sync::Arc;

// The kernels are compiled for the family's head count (one definition: `ops::attention::HEADS`).
use super::HEADS;

/// One of csa2's own paged caches as `sparse_decode_attn_f32` reads it, in host or device memory.
#[derive(Debug, Clone)]
pub struct TablePages<'a> {
    /// Page pool bytes, u8 (n_pages × page_slots × record bytes, block-planar).
    pub pages: TensorView<'a>,
    /// Block table, i32 (requests, max_blocks), −1 = unmapped. Main KV is indexed by entry, SWA
    /// by token position.
    pub block_table: TensorView<'a>,
    /// Records per page.
    pub page_slots: usize,
}

/// A decode batch of T rows, each tensor in host or device memory.
#[derive(Debug, Clone)]
pub struct DecodeBatch<'a> {
    /// Queries f32 (T, 64, 512), RoPE'd at `pos`.
    pub q: TensorView<'a>,
    /// Selected main-KV entries i32 (T, topk_len), −1 = masked.
    pub topk: TensorView<'a>,
    /// Absolute position of each row, i32 (T,).
    pub pos: TensorView<'a>,
    /// Request of each row, i32 (T,) (a row of both block tables).
    pub req: TensorView<'a>,
    /// SWA window floor per row, i32 (T,): the window is [max(p − 127, 0, window_start), p]
    /// (bounded replay, docs/SPEC.md §3; 0 when not replaying).
    pub window_start: TensorView<'a>,
    /// Per-head sink logits f32 (64,), or none (no sink).
    pub sink: Option<TensorView<'a>>,
    /// RoPE inverse frequencies (32,) for the inverse RoPE of output dims 448..511, or none: a
    /// layer constant in host memory (f64 is no tensor dtype), copied per call (256 bytes).
    pub inv_freq: Option<&'a [f64]>,
    /// Softmax scale (512^-0.5 for V4.1).
    pub scale: f32,
}

impl CudaDevice {
    /// Sparse decode attention into `out` (T, 64, 512) f32 and `lse` (T, 64) f32 (natural-log
    /// log-sum-exp over the attended keys without the sink; −Inf for an empty row, whose output
    /// is 0). Every tensor may be in host memory (copied to the device; the host outputs are
    /// written back before the call returns) or on this device (used in place; the launch is
    /// queued on [`CudaDevice::stream`] after the work already queued there, and the call returns
    /// without waiting for it).
    ///
    /// The request ids, positions and block tables are checked against the pools when they are in
    /// host memory; device-resident ones are the caller's to validate (the kernel does not
    /// bound-check block ids).
    ///
    /// Errors: [`Error::Shape`] / [`Error::Invalid`] for inconsistent inputs, [`Error::Cuda`].
    pub fn sparse_decode_attention(
        &self,
        b: &DecodeBatch,
        main: &TablePages,
        swa: &TablePages,
        out: &mut TensorViewMut<'_>,
        lse: &mut TensorViewMut<'_>,
    ) -> Result<()> {
        let t = b.pos.numel();
        let grid_y = grid_rows("pos", t)?;
        let (requests, main_max_blocks) = table_shape("main KV", main)?;
        let (swa_requests, swa_max_blocks) = table_shape("SWA", swa)?;
        check_len("SWA block_table rows", swa_requests, requests)?;
        if b.topk.ndim() != 2 || b.topk.shape()[0] != t {
            return Err(Error::shape(
                "topk",
                format!("(T={t}, topk_len) i32"),
                format!("{:?}", b.topk.shape()),
            ));
        }
        let topk_len = b.topk.shape()[1];
        check_len("q values", b.q.numel(), t * HEADS * KV_DIM)?;
        check_len("req", b.req.numel(), t)?;
        check_len("window_start", b.window_start.numel(), t)?;
        if let Some(s) = &b.sink {
            check_len("sink", s.numel(), HEADS)?;
        }
        if let Some(f) = b.inv_freq {
            check_len("inv_freq", f.len(), ROPE_DIM / 2)?;
        }
        check_len("attention output", out.numel(), t * HEADS * KV_DIM)?;
        check_len("attention lse", lse.numel(), t * HEADS)?;
        if b.req.device() == Device::Cpu {
            let req = b.req.as_slice::<i32>("req")?;
            if let Some(&r) = req.iter().find(|&&r| r < 0 || r as usize >= requests) {
                return Err(Error::invalid(
                    "req",
                    format!("request {r} is outside 0..{requests}"),
                ));
            }
        }
        if b.pos.device() == Device::Cpu && b.pos.as_slice::<i32>("pos")?.iter().any(|&p| p < 0) {
            return Err(Error::invalid("pos", "positions must be non-negative"));
        }
        check_cache("main KV", main, NVFP4_DS_BYTES)?;
        check_cache("SWA", swa, MXFP8_BYTES)?;
        if t == 0 {
            return Ok(());
        }

        let q = self.stage::<f32>(&b.q, "q")?;
        let topk = self.stage::<i32>(&b.topk, "topk")?;
        let pos = self.stage::<i32>(&b.pos, "pos")?;
        let req = self.stage::<i32>(&b.req, "req")?;
        let ws = self.stage::<i32>(&b.window_start, "window_start")?;
        let mp = self.stage::<u8>(&main.pages, "main KV pages")?;
        let mbt = self.stage::<i32>(&main.block_table, "main KV block_table")?;
        let sp = self.stage::<u8>(&swa.pages, "SWA pages")?;
        let sbt = self.stage::<i32>(&swa.block_table, "SWA block_table")?;
        let sink = b
            .sink
            .as_ref()
            .map(|s| self.stage::<f32>(s, "sink"))
            .transpose()?;
        let freq = b.inv_freq.map(|f| self.upload(f)).transpose()?;
        let mut o = self.stage_out::<f32>(out, "attention output")?;
        let mut l = self.stage_out::<f32>(lse, "attention lse")?;

        let tl = as_i32("topk_len", topk_len)?;
        let (mmb, mps) = (
            as_i32("main max_blocks", main_max_blocks)?,
            as_i32("main page_slots", main.page_slots)?,
        );
        let (smb, sps) = (
            as_i32("swa max_blocks", swa_max_blocks)?,
            as_i32("swa page_slots", swa.page_slots)?,
        );
        let (sink, freq) = (OrNull(sink.as_deref()), OrNull(freq.as_ref()));
        let grid = ((HEADS / ATTN_HEADS_PER_BLOCK) as u32, grid_y);
        // sparse_decode_attn_f32(q, topk, topk_len, pos, req, window_start, main_pages, main_bt,
        //   main_max_blocks, main_page_slots, swa_pages, swa_bt, swa_max_blocks, swa_page_slots,
        //   sink, inv_freq, scale, out, lse)
        launch!(
            self,
            "attention",
            "sparse_decode_attn_f32",
            cfg(grid, ATTN_THREADS as u32),
            &*q,
            &*topk,
            &tl,
            &*pos,
            &*req,
            &*ws,
            &*mp,
            &*mbt,
            &mmb,
            &mps,
            &*sp,
            &*sbt,
            &smb,
            &sps,
            &sink,
            &freq,
            &b.scale,
            &mut *o,
            &mut *l
        );
        self.unstage(&o, out, "attention output")?;
        self.unstage(&l, lse, "attention lse")
    }
}

/// (requests, max_blocks) of a block table.
fn table_shape(what: &str, c: &TablePages) -> Result<(usize, usize)> {
    match c.block_table.shape() {
        &[r, m] => Ok((r, m)),
        other => Err(Error::shape(
            format!("{what} block_table"),
            "(requests, max_blocks) i32",
            format!("{other:?}"),
        )),
    }
}

/// Whole pages; in host memory, every block id inside the pool.
fn check_cache(what: &str, c: &TablePages, record: usize) -> Result<()> {
    if c.page_slots == 0 {
        return Err(Error::invalid(
            format!("{what} page_slots"),
            "must be at least 1",
        ));
    }
    let page = c.page_slots * record;
    let bytes = c.pages.numel();
    if !bytes.is_multiple_of(page) {
        return Err(Error::shape(
            format!("{what} page pool bytes"),
            format!("a multiple of {page}"),
            bytes,
        ));
    }
    if c.block_table.device() == Device::Cpu {
        let n = (bytes / page) as i64;
        let bt = c
            .block_table
            .as_slice::<i32>(&format!("{what} block_table"))?;
        if let Some(&b) = bt.iter().find(|&&b| b < -1 || b as i64 >= n) {
            return Err(Error::invalid(
                format!("{what} block_table"),
                format!("block {b} is outside the {n} pages"),
            ));
        }
    }
    Ok(())
}

/// The process's handle of device `ordinal` ([`CudaDevice::shared`]: one registry for every
/// family, so a preload serves every launch).
fn device(ordinal: i32) -> Result<Arc<CudaDevice>> {
    let idx = usize::try_from(ordinal)
        .map_err(|_| Error::invalid("CUDA device", format!("ordinal {ordinal} is negative")))?;
    CudaDevice::shared(idx)
}

/// Loads every embedded module on device `ordinal`, resolves every kernel function of each and
/// reserves the split attention workspace ([`reserved_workspace_floats`]) — before a CUDA-graph
/// capture: afterwards no launch of any family loads, JITs, compiles or allocates.
pub fn preload(ordinal: i32) -> Result<()> {
    let dev = device(ordinal)?;
    dev.preload_all()?;
    dev.attention_workspace(reserved_workspace_floats(dev.sm_count()), true)
        .map(|_| ())
}

/// f32 of split-kernel workspace a device reserves (when its modules are preloaded, or at its
/// first split launch): the partials of every plan [`split_plan`] makes for either split kernel on
/// `sm_count` SMs (at most [`MAX_SPLIT_WAVES`](super::split_plan::MAX_SPLIT_WAVES) waves of
/// blocks) — 69.5 MB on 132 SMs. So no launch of a default plan allocates.
pub fn reserved_workspace_floats(sm_count: usize) -> usize {
    PoolsKernel::ALL
        .iter()
        .filter(|k| k.split())
        .map(|k| split_workspace_floats(sm_count, k.heads_per_block(), k.blocks_per_sm(), KV_DIM))
        .max()
        .unwrap_or(0)
}

fn addr_opt(v: &Option<View>) -> u64 {
    v.as_ref().map_or(0, |v| v.addr())
}

/// One pool as the pool kernel reads it: first byte on the device and its addressing.
#[derive(Debug, Clone, Copy)]
pub(super) struct PoolLaunch {
    pub(super) addr: u64,
    pub(super) desc: PoolDesc,
}

/// Every argument of one `attn_pools_bf16` launch (device addresses; 0 = null for the optional
/// ones), checked by the entry that builds it.
pub(crate) struct PoolsLaunch {
    pub(super) ordinal: i32,
    pub(super) tokens: usize,
    pub(super) padded_heads: usize,
    pub(super) heads: usize,
    pub(super) q: u64,
    pub(super) main: Option<PoolLaunch>,
    pub(super) main_idx: (u64, usize),
    pub(super) main_len: u64,
    pub(super) swa: PoolLaunch,
    pub(super) swa_idx: (u64, usize),
    pub(super) swa_len: u64,
    pub(super) sink: u64,
    pub(super) scale: f32,
    pub(super) out: u64,
    pub(super) lse: u64,
    pub(super) err: u64,
}

/// Launches `attn_pools_bf16` for a checked `csa2_attention_pools` call on `stream` (a
/// `CUstream` owned by the caller). Returns after the launch.
///
/// Errors: [`Error::Unsupported`] (no driver / device), [`Error::Cuda`] (module load or launch).
pub(crate) fn attention_pools_launch(c: &Checked, stream: u64) -> Result<()> {
    let ordinal = match c.device {
        crate::ffi::dlpack::Device::Cuda(id) => id,
        crate::ffi::dlpack::Device::Cpu => {
            return Err(Error::Internal(
                "attention_pools_launch on host tensors".into(),
            ))
        }
    };
    let pool = |addr: usize, desc: PoolDesc| PoolLaunch {
        addr: addr as u64,
        desc,
    };
    launch_pools(
        &PoolsLaunch {
            ordinal,
            tokens: c.tokens,
            padded_heads: c.padded_heads,
            heads: c.heads,
            q: c.q.addr(),
            main: c.main.as_ref().map(|p| pool(p.addr, p.desc)),
            main_idx: (c.main_idx.addr(), c.main_idx.shape()[1]),
            main_len: addr_opt(&c.main_len),
            swa: pool(c.swa.addr, c.swa.desc),
            swa_idx: (c.swa_idx.addr(), c.swa_idx.shape()[1]),
            swa_len: addr_opt(&c.swa_len),
            sink: c.sink.addr(),
            scale: c.scale,
            out: c.out.addr(),
            lse: addr_opt(&c.lse),
            err: addr_opt(&c.error),
        },
        stream,
        PoolsKernel::from_env()?,
    )
}

/// The CUDA branch of [`super::attention_indexed_view`] (signature and device checked): each flat
/// record pool `[N, W]` is a pool of N pages holding one record each (`block_stride` W; data then
/// scales, so interleaved and block-planar read the same bytes), and the slot lists are the
/// call's own, so the pool kernel runs unchanged on `stream`. No scratch, no host access.
///
/// Errors: [`Error::Unsupported`] outside the kernel's contract (see the view entry),
/// [`Error::Invalid`] for more than 65 535 tokens, [`Error::Cuda`].
pub(crate) fn attention_indexed_rows(
    p: &super::AttentionParams,
    a: &super::IndexedViews<'_, '_>,
    stream: u64,
    out: &mut TensorViewMut<'_>,
    lse: &mut TensorViewMut<'_>,
) -> Result<()> {
    attention_indexed_rows_with(PoolsKernel::from_env()?, p, a, stream, out, lse)
}

/// [`attention_indexed_rows`] with the kernel named.
pub(crate) fn attention_indexed_rows_with(
    kernel: PoolsKernel,
    p: &super::AttentionParams,
    a: &super::IndexedViews<'_, '_>,
    stream: u64,
    out: &mut TensorViewMut<'_>,
    lse: &mut TensorViewMut<'_>,
) -> Result<()> {
    use super::signature as sig;
    use crate::tensor::DType;
    let (t, h) = (a.q.shape()[0], a.q.shape()[1]);
    if h != 64 && h != 128 {
        return Err(Error::Unsupported(format!(
            "the CUDA attention kernel takes 64 or 128 query heads, found {h}"
        )));
    }
    for (what, dt, want) in [
        (sig::Q.name, a.q.dtype(), DType::Bf16),
        (sig::OUT.name, out.dtype(), DType::Bf16),
        (sig::SINK.name, a.sink.dtype(), DType::F32),
        (sig::LSE.name, lse.dtype(), DType::F32),
    ] {
        if dt != want {
            return Err(Error::Unsupported(format!(
                "`{what}` is {}; the CUDA attention kernel takes {} here",
                dt.name(),
                want.name()
            )));
        }
    }
    let pool = |kv: &super::KvView<'_, '_>, what: &str| -> Result<PoolLaunch> {
        let f = kv.format.ok_or_else(|| {
            Error::Unsupported(format!(
                "`{what}` holds float rows; the CUDA attention kernel reads record pools \
                 (NVFP4-DS, MXFP8, V4)"
            ))
        })?;
        Ok(PoolLaunch {
            addr: kv.rows.addr() as u64,
            desc: PoolDesc {
                format: f,
                layout: PoolLayout::Interleaved,
                blocks: kv.rows.shape()[0],
                states_per_page: 1,
                block_stride: f.record_bytes(),
            },
        })
    };
    let main = pool(&a.main, sig::MAIN_KV.name)?;
    let swa = pool(&a.swa, sig::SWA_KV.name)?;
    let Device::Cuda(ordinal) = a.q.device() else {
        return Err(Error::Internal(
            "attention_indexed_rows on host tensors".into(),
        ));
    };
    if t == 0 {
        return Ok(());
    }
    let addr = |v: &TensorView<'_>| v.addr() as u64;
    launch_pools(
        &PoolsLaunch {
            ordinal,
            tokens: t,
            padded_heads: h,
            heads: p.heads,
            q: addr(a.q),
            main: (main.desc.blocks > 0).then_some(main),
            main_idx: (addr(a.main_idx), a.main_idx.shape()[1]),
            main_len: a.main_len.map_or(0, addr),
            swa,
            swa_idx: (addr(a.swa_idx), a.swa_idx.shape()[1]),
            swa_len: a.swa_len.map_or(0, addr),
            sink: addr(a.sink),
            scale: p.scale,
            out: out.as_view().addr() as u64,
            lse: lse.as_view().addr() as u64,
            err: 0,
        },
        stream,
        kernel,
    )
}

/// Which pool attention kernel a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolsKernel {
    /// `attn_pools_bf16`: f32 SIMT dots, the reference kernel.
    Simt,
    /// `attn_pools_bf16_mma`: bf16 `mma.sync` tensor-core dots, one block per (token, 64 heads)
    /// (P rounded to bf16: `BF16_DOTS_VS_F64`).
    Mma,
    /// `attn_pools_bf16_split` (+ `attn_pools_combine`): the tensor-core kernel split over keys,
    /// records streamed with `cp.async`, one block per 64 heads; the default. Same numerics class
    /// as [`PoolsKernel::Mma`].
    Split,
    /// `attn_pools_bf16_split_h32` (+ `attn_pools_combine`): [`PoolsKernel::Split`] with 32 heads
    /// per block and each warp a quarter of the dims: half the registers, two blocks per SM, twice
    /// the blocks (each dequantises its keys itself). Same numerics class; other bits than
    /// [`PoolsKernel::Split`] (S is summed over four dim parts instead of two).
    SplitH32,
}

impl PoolsKernel {
    /// Every kernel.
    pub const ALL: [PoolsKernel; 4] = [
        PoolsKernel::Simt,
        PoolsKernel::Mma,
        PoolsKernel::Split,
        PoolsKernel::SplitH32,
    ];

    /// The kernel the entries run: `CSA2_ATTENTION_KERNEL=simt` the reference kernel, `=mma` the
    /// unsplit tensor-core kernel, `=split` (or unset, or empty) the split kernel, `=split-h32`
    /// the split kernel on 32-head blocks. Read per call (no device work), so one process can
    /// compare them.
    ///
    /// Errors: [`Error::Invalid`] for any other value (a misspelt name must not run the default
    /// kernel silently).
    pub fn from_env() -> Result<PoolsKernel> {
        PoolsKernel::from_setting(std::env::var("CSA2_ATTENTION_KERNEL").ok().as_deref())
    }

    /// The kernel a `CSA2_ATTENTION_KERNEL` value names (`None`: unset); see [`Self::from_env`].
    pub fn from_setting(v: Option<&str>) -> Result<PoolsKernel> {
        match v {
            None | Some("") => Ok(PoolsKernel::Split),
            Some(s) => PoolsKernel::ALL
                .into_iter()
                .find(|k| k.setting() == s)
                .ok_or_else(|| {
                    let names: Vec<&str> = PoolsKernel::ALL.iter().map(|k| k.setting()).collect();
                    Error::invalid(
                        "CSA2_ATTENTION_KERNEL",
                        format!("`{s}` is not one of {}", names.join(", ")),
                    )
                }),
        }
    }

    /// The kernel's `CSA2_ATTENTION_KERNEL` value ([`Self::from_setting`]'s inverse).
    pub fn setting(self) -> &'static str {
        match self {
            PoolsKernel::Simt => "simt",
            PoolsKernel::Mma => "mma",
            PoolsKernel::Split => "split",
            PoolsKernel::SplitH32 => "split-h32",
        }
    }

    /// Whether the kernel uses bf16 tensor-core dots (tolerance `BF16_DOTS_VS_F64`).
    pub fn tensor_core(self) -> bool {
        self != PoolsKernel::Simt
    }

    /// Whether the kernel splits over keys (a plan, a workspace and the combine pass).
    pub fn split(self) -> bool {
        matches!(self, PoolsKernel::Split | PoolsKernel::SplitH32)
    }

    /// The kernel's entry point in `kernels/attention.cu`.
    pub fn entry(self) -> &'static str {
        match self {
            PoolsKernel::Simt => "attn_pools_bf16",
            PoolsKernel::Mma => "attn_pools_bf16_mma",
            PoolsKernel::Split => "attn_pools_bf16_split",
            PoolsKernel::SplitH32 => "attn_pools_bf16_split_h32",
        }
    }

    /// Padded heads per block (the grid's x is padded heads / this).
    pub fn heads_per_block(self) -> usize {
        match self {
            PoolsKernel::Simt => ATTN_HEADS_PER_BLOCK,
            PoolsKernel::Mma | PoolsKernel::Split => ATTN_MMA_HEADS_PER_BLOCK,
            PoolsKernel::SplitH32 => ATTN_SPLIT_H32_HEADS_PER_BLOCK,
        }
    }

    /// Blocks of a split kernel one SM holds at a time, as its split plan assumes:
    /// `attn_pools_bf16_split`'s `__launch_bounds__(256, 1)` (254–255 registers per thread, 44 KB
    /// of shared memory) allow one, `attn_pools_bf16_split_h32`'s `(256, 2)` two (a GPU build's
    /// test checks both against the embedded ptxas figures); 1 for the unsplit kernels.
    pub fn blocks_per_sm(self) -> usize {
        match self {
            PoolsKernel::SplitH32 => 2,
            _ => 1,
        }
    }
}

/// The split plan a launch of `c` with the split kernel `kernel` uses on a device of `sm_count`
/// SMs (pure: shapes and the SM count only).
pub(super) fn plan_for(c: &PoolsLaunch, kernel: PoolsKernel, sm_count: usize) -> SplitPlan {
    split_plan(
        c.tokens,
        c.padded_heads / kernel.heads_per_block(),
        c.main_idx.1 + c.swa_idx.1,
        sm_count,
        kernel.blocks_per_sm(),
    )
}

/// Launches the pool attention kernel `kernel` on `stream`; returns after the launch.
pub(super) fn launch_pools(c: &PoolsLaunch, stream: u64, kernel: PoolsKernel) -> Result<()> {
    launch_pools_planned(c, stream, kernel, None)
}

/// [`launch_pools`] with the split kernel's plan given (`None`: [`split_plan`] for the batch and
/// the device; ignored by the other kernels).
pub(crate) fn launch_pools_planned(
    c: &PoolsLaunch,
    stream: u64,
    kernel: PoolsKernel,
    plan: Option<SplitPlan>,
) -> Result<()> {
    let mma = kernel.tensor_core();
    if mma && (!c.q.is_multiple_of(4) || !c.out.is_multiple_of(4)) {
        return Err(Error::invalid(
            "q / out",
            "the tensor-core kernel reads and writes bf16 pairs: q and out must be 4-byte aligned",
        ));
    }
    // One grid row per token (vLLM's batches are far below the bound).
    let grid_y = grid_rows("q", c.tokens)?;
    let dev = device(c.ordinal)?;
    let f = dev.function("attention", kernel.entry())?;
    // SAFETY: `stream` is the caller's live stream of this device's primary context (the
    // entry's contract); the wrapper does not own it and is dropped right after the launch.
    let s = unsafe {
        dev.context()
            .wrap_borrowed_stream(stream as crate::cuda::driver::sys::CUstream)
    };
    let i = |what: &str, v: usize| as_i32(what, v);
    let (hp, nh) = (i("padded heads", c.padded_heads)?, i("heads", c.heads)?);
    let (km, ks) = (
        i("main_idx columns", c.main_idx.1)?,
        i("swa_idx columns", c.swa_idx.1)?,
    );
    let (mp, mstride, mstates, mblocks, mfmt, mlay) = match &c.main {
        Some(p) => (
            p.addr,
            p.desc.block_stride as i64,
            i("main states_per_page", p.desc.states_per_page)?,
            p.desc.blocks as i64,
            p.desc.format.abi_id(),
            p.desc.layout as i32,
        ),
        None => (0u64, 0i64, 1i32, 0i64, 0i32, 0i32),
    };
    let sp = &c.swa;
    let (sstride, sstates, sblocks, sfmt, slay) = (
        sp.desc.block_stride as i64,
        i("swa states_per_page", sp.desc.states_per_page)?,
        sp.desc.blocks as i64,
        sp.desc.format.abi_id(),
        sp.desc.layout as i32,
    );
    let (q, mi, si, sink, out) = (c.q, c.main_idx.0, c.swa_idx.0, c.sink, c.out);
    let (ml, sl, lse, err) = (c.main_len, c.swa_len, c.lse, c.err);
    let swa_base = sp.addr;
    // One block per 16 heads (correctness kernel), per 64 heads (tensor-core kernels) or per 32
    // (the 32-head split kernel) of a token.
    let grid = ((c.padded_heads / kernel.heads_per_block()) as u32, grid_y);
    let mut b = s.launch_builder(&f);
    // attn_pools_bf16(q, hp, n_heads, main_idx, km, main_len, main_pool, main_stride,
    //   main_states, main_blocks, main_fmt, main_layout, swa_idx, ks, swa_len, swa_pool,
    //   swa_stride, swa_states, swa_blocks, swa_fmt, swa_layout, sink, scale, out, lse, err)
    use crate::cuda::driver::PushKernelArg;
    b.arg(&q).arg(&hp).arg(&nh);
    b.arg(&mi).arg(&km).arg(&ml);
    b.arg(&mp)
        .arg(&mstride)
        .arg(&mstates)
        .arg(&mblocks)
        .arg(&mfmt)
        .arg(&mlay);
    b.arg(&si).arg(&ks).arg(&sl);
    b.arg(&swa_base)
        .arg(&sstride)
        .arg(&sstates)
        .arg(&sblocks)
        .arg(&sfmt)
        .arg(&slay);
    b.arg(&sink).arg(&c.scale).arg(&out).arg(&lse).arg(&err);
    if !kernel.split() {
        // SAFETY: the arguments follow the kernel's signature above in order and type; every
        // tensor was checked (shape, dtype, device, compact, disjoint outputs) by the entry, and
        // the kernel bounds-checks every slot against blocks · states before reading a pool.
        unsafe { b.launch(cfg(grid, ATTN_THREADS as u32)) }
            .map_err(|e| cuda_error(format!("launch {}", kernel.entry()), e))?;
        return Ok(());
    }
    // The split kernel: (chunk, splits, workspace) after the common arguments, grid z = splits.
    let plan = plan.unwrap_or_else(|| plan_for(c, kernel, dev.sm_count()));
    if plan.chunk_keys == 0 || !plan.chunk_keys.is_multiple_of(TILE_KEYS) || plan.splits == 0 {
        return Err(Error::Internal(format!("split plan {plan:?}")));
    }
    // The device's one workspace: reserved at preload (or here, at the first split launch) with
    // room for every default plan; only a pinned plan larger than that grows it, never while the
    // stream is being captured (a clear error then, not another plan).
    let _pair = dev.split_launch_lock();
    let capturing = !s.capture_status().is_ok_and(|st| {
        st == crate::cuda::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    });
    let ws = match plan.workspace_floats(c.tokens, c.padded_heads, KV_DIM) {
        0 => 0u64,
        n => {
            dev.attention_workspace(n.max(reserved_workspace_floats(dev.sm_count())), !capturing)?
        }
    };
    let splits = grid_rows("key splits", plan.splits)?;
    let (chunk, nsplit) = (i("chunk", plan.chunk_keys)?, splits as i32);
    b.arg(&chunk).arg(&nsplit).arg(&ws);
    let split_cfg = crate::cuda::driver::LaunchConfig {
        grid_dim: (grid.0, grid.1, splits),
        block_dim: (ATTN_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above, plus (chunk, splits, ws): ws holds workspace_floats(..) f32 for this plan,
    // the device's one workspace, held by this launch pair (split_launch_lock).
    unsafe { b.launch(split_cfg) }
        .map_err(|e| cuda_error(format!("launch {}", kernel.entry()), e))?;
    if plan.splits > 1 {
        let fc = dev.function("attention", "attn_pools_combine")?;
        let mut b = s.launch_builder(&fc);
        // attn_pools_combine(ws, splits, hp, n_heads, sink, out, lse)
        b.arg(&ws).arg(&nsplit).arg(&hp).arg(&nh);
        b.arg(&sink).arg(&out).arg(&lse);
        let grid = (
            (c.padded_heads / ATTN_COMBINE_HEADS_PER_BLOCK) as u32,
            grid_y,
        );
        // SAFETY: the signature above; ws was written by the split launch queued before on the
        // same stream.
        unsafe { b.launch(cfg(grid, ATTN_THREADS as u32)) }
            .map_err(|e| cuda_error("launch attn_pools_combine", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::view_tests::flat;
    use super::super::{
        attention_indexed_view, plan_indexed, reference, AttentionParams, IndexedInputs,
        IndexedViews, KvRows, KvView,
    };
    use super::{attention_indexed_rows_with, PoolsKernel};
    use crate::cuda::CudaDevice;
    use crate::formats::{RecordFormat, KV_DIM, MXFP8_BYTES, NVFP4_DS_BYTES};
    use crate::tolerance::{compare, BF16_DOTS_VS_F64, GPU_BF16_VS_F64, GPU_F32_VS_F64};
    use half::bf16;

    /// The flat indexed form on the GPU (bf16 q / out) against the one f64 reference on the same
    /// bf16 queries, the output rounded to bf16 where the kernel rounds it (the CPU twin:
    /// `view_tests::indexed_view_on_host_is_the_fast_path`): the SIMT kernel through the view
    /// entry, the tensor-core kernel through the same launch with the kernel named.
    #[test]
    fn indexed_view_on_cuda_matches_the_reference() {
        if !CudaDevice::driver_present() {
            println!("SKIPPED: no CUDA driver");
            return;
        }
        for kernel in PoolsKernel::ALL {
            indexed_view_matches_the_reference(kernel);
        }
    }

    /// `CSA2_ATTENTION_KERNEL` names one of the four kernels; unset or empty is the split kernel,
    /// and any other value is an error naming the choices (a misspelt name used to run the
    /// default kernel without a word).
    #[test]
    fn cuda_kernel_setting_names_a_kernel_or_is_an_error() {
        let k = PoolsKernel::from_setting;
        assert_eq!(k(None).unwrap(), PoolsKernel::Split);
        assert_eq!(k(Some("")).unwrap(), PoolsKernel::Split);
        assert_eq!(k(Some("split")).unwrap(), PoolsKernel::Split);
        assert_eq!(k(Some("simt")).unwrap(), PoolsKernel::Simt);
        assert_eq!(k(Some("mma")).unwrap(), PoolsKernel::Mma);
        assert_eq!(k(Some("split-h32")).unwrap(), PoolsKernel::SplitH32);
        for kernel in PoolsKernel::ALL {
            assert_eq!(k(Some(kernel.setting())).unwrap(), kernel);
        }
        for bad in ["splitt", "SPLIT", "h32", "split_h32"] {
            let e = k(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("split-h32"), "{e}");
        }
    }

    /// More rows than `gridDim.y` allows is a typed error before anything is read or launched
    /// (the views below point at no memory).
    #[test]
    fn more_rows_than_a_grid_allows_is_refused_first() {
        use super::{DecodeBatch, TablePages};
        use crate::tensor::{DType, Device, TensorView, TensorViewMut};
        if !CudaDevice::driver_present() {
            println!("SKIPPED: no CUDA driver");
            return;
        }
        let dev = CudaDevice::shared(0).unwrap();
        let nowhere = std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8;
        // SAFETY: never read: the call must fail on the row count first.
        let v = |shape: &[usize], dt: DType| unsafe {
            TensorView::from_raw_parts(
                nowhere,
                shape,
                &crate::tensor::row_major_strides(shape),
                dt,
                Device::Cuda(0),
            )
            .unwrap()
        };
        let rows = crate::cuda::device::MAX_GRID_Y + 1;
        let b = DecodeBatch {
            q: v(&[1], DType::F32),
            topk: v(&[rows, 1], DType::I32),
            pos: v(&[rows], DType::I32),
            req: v(&[rows], DType::I32),
            window_start: v(&[rows], DType::I32),
            sink: None,
            inv_freq: None,
            scale: 1.0,
        };
        let pages = TablePages {
            pages: v(&[1], DType::U8),
            block_table: v(&[1, 1], DType::I32),
            page_slots: 1,
        };
        // SAFETY: as above.
        let (mut out, mut lse) = unsafe {
            (
                TensorViewMut::from_raw_parts(nowhere, &[1], &[1], DType::F32, Device::Cuda(0))
                    .unwrap(),
                TensorViewMut::from_raw_parts(nowhere, &[1], &[1], DType::F32, Device::Cuda(0))
                    .unwrap(),
            )
        };
        let e = dev
            .sparse_decode_attention(&b, &pages, &pages, &mut out, &mut lse)
            .unwrap_err();
        assert!(
            matches!(&e, crate::Error::Invalid { .. }) && e.to_string().contains("65535"),
            "{e}"
        );
    }

    /// The device reports its SM count (132 on the emulated device, an H100 SXM's / H200's) and
    /// the split plan of the model's batch 32 uses it: four chunks of 160 keys, 128 blocks.
    #[test]
    fn the_split_plan_takes_the_devices_sm_count() {
        use super::super::split_plan::{split_plan, SplitPlan};
        if !CudaDevice::driver_present() {
            println!("SKIPPED: no CUDA driver");
            return;
        }
        let dev = CudaDevice::shared(0).unwrap();
        #[cfg(feature = "cuda-emu")]
        assert_eq!(dev.sm_count(), 132);
        if dev.sm_count() == 132 {
            assert_eq!(
                split_plan(
                    32,
                    1,
                    640,
                    dev.sm_count(),
                    PoolsKernel::Split.blocks_per_sm()
                ),
                SplitPlan {
                    chunk_keys: 160,
                    splits: 4
                }
            );
        }
    }

    /// Mutation check: `indexed_view_on_cuda_matches_the_reference`, run in a child process on a
    /// deliberately broken build of the tensor-core kernel (two A fragments swapped; the tile
    /// barrier removed), must fail.
    #[cfg(feature = "cuda-emu")]
    #[test]
    fn broken_tensor_core_kernels_fail_the_reference_test() {
        for mutant in ["mma_a_registers_swapped", "mma_tile_barrier_removed"] {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "ops::attention::cuda::tests::indexed_view_on_cuda_matches_the_reference",
                    "--test-threads",
                    "1",
                ])
                .env("CSA2_EMU_MUTANT", format!("attention:{mutant}"))
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            // A sanitizer build (scripts/simt-sanitizers.sh) may stop at its report instead.
            let caught = text.contains("1 failed") || text.contains("Sanitizer");
            assert!(
                !out.status.success() && caught,
                "the {mutant} build passed the reference test:\n{text}"
            );
            assert!(
                text.contains("Mma") || text.contains("Sanitizer"),
                "{mutant}: failed outside the mma kernel:\n{text}"
            );
        }
    }

    fn indexed_view_matches_the_reference(kernel: PoolsKernel) {
        let dev = CudaDevice::shared(0).unwrap();
        let (t, h) = (5, 64);
        let f = flat(73, t, h);
        let qb: Vec<bf16> = f.q.iter().map(|&v| bf16::from_f32(v)).collect();
        let qf: Vec<f32> = qb.iter().map(|v| v.to_f32()).collect();
        let (n, s) = (f.main.len() / NVFP4_DS_BYTES, f.swa.len() / MXFP8_BYTES);
        let (dq, dsink) = (dev.upload(&qb).unwrap(), dev.upload(&f.sink).unwrap());
        let (dm, ds) = (dev.upload(&f.main).unwrap(), dev.upload(&f.swa).unwrap());
        let (dmi, dml, dsi) = (
            dev.upload(&f.main_idx).unwrap(),
            dev.upload(&f.main_len).unwrap(),
            dev.upload(&f.swa_idx).unwrap(),
        );
        let dout = dev.zeros::<bf16>(t * h * KV_DIM).unwrap();
        let dlse = dev.zeros::<f32>(t * h).unwrap();
        let (q, sink) = (
            dev.test_view(&dq, &[t, h, KV_DIM]),
            dev.test_view(&dsink, &[h]),
        );
        let (mv, sv) = (
            dev.test_view(&dm, &[n, NVFP4_DS_BYTES]),
            dev.test_view(&ds, &[s, MXFP8_BYTES]),
        );
        let (mi, ml, si) = (
            dev.test_view(&dmi, &[t, f.km]),
            dev.test_view(&dml, &[t]),
            dev.test_view(&dsi, &[t, f.ks]),
        );
        let views = IndexedViews {
            q: &q,
            main: KvView {
                rows: &mv,
                format: Some(RecordFormat::Nvfp4Ds),
            },
            main_idx: &mi,
            main_len: Some(&ml),
            swa: KvView {
                rows: &sv,
                format: Some(RecordFormat::Mxfp8),
            },
            swa_idx: &si,
            swa_len: None,
            sink: &sink,
        };
        let p = AttentionParams {
            heads: h,
            ..Default::default()
        };
        dev.synchronize_context().unwrap();
        let (mut o, mut l) = (
            dev.test_view_mut(&dout, &[t, h, KV_DIM]),
            dev.test_view_mut(&dlse, &[t, h]),
        );
        // The default kernel through the view entry, the others through the same launch named.
        if kernel == PoolsKernel::from_env().unwrap() {
            attention_indexed_view(&p, &views, 0, &mut o, &mut l)
        } else {
            attention_indexed_rows_with(kernel, &p, &views, 0, &mut o, &mut l)
        }
        .unwrap();
        dev.synchronize_context().unwrap();
        let out: Vec<f32> = dev
            .download(&dout)
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let lse = dev.download(&dlse).unwrap();
        let (main, swa) = (
            KvRows::Records(RecordFormat::Nvfp4Ds, &f.main),
            KvRows::Records(RecordFormat::Mxfp8, &f.swa),
        );
        let inp = IndexedInputs {
            q: &qf,
            sink: &f.sink,
            main_idx: &f.main_idx,
            main_len: Some(&f.main_len),
            swa_idx: &f.swa_idx,
            swa_len: None,
        };
        let rows = plan_indexed(&p, &inp, &main, &swa).unwrap();
        let (ro, rl) = reference::attention_rows(&p, &qf, &f.sink, &rows, main, swa);
        let ro: Vec<f64> = ro.iter().map(|&v| bf16::from_f64(v).to_f64()).collect();
        // The tensor-core kernel rounds the softmax weights to bf16 before P·V.
        let (tol_out, tol_lse) = if kernel.tensor_core() {
            (BF16_DOTS_VS_F64, BF16_DOTS_VS_F64)
        } else {
            (GPU_BF16_VS_F64, GPU_F32_VS_F64)
        };
        let st = compare(&out, &ro, &tol_out);
        assert!(st.ok(&tol_out), "{kernel:?} out: {st:?}");
        let st = compare(&lse, &rl, &tol_lse);
        assert!(st.ok(&tol_lse), "{kernel:?} lse: {st:?}");
    }
}
