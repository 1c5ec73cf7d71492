//! The CUDA side of the attention family (feature `cuda`; `kernels/attention.cu`).
//!
//! - [`attention_pools_launch`]: the kernel behind `csa2_attention_pools` on `kDLCUDA` tensors —
//!   vLLM's strided page pools read in place (V4 584 B planar, NVFP4 288 B and MXFP8 528 B
//!   interleaved), bf16 q / out, launched on the caller's (borrowed) stream with raw device
//!   pointers: no host access to device memory, no allocation, no synchronization, so a CUDA
//!   graph can capture it once the module is loaded ([`preload`]).
//! - [`Device::sparse_decode_attention`]: the older kernel over csa2's own dense block-planar
//!   pages and block tables (docs/SPEC.md §2 "Attention"), host form and `_dev` form.

use crate::cuda::device::{as_i32, cfg, check_len, cuda_error, launch};
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::ffi::dlpack::View;
use crate::ffi::Checked;
use crate::formats::{RecordFormat, KV_DIM, MXFP8_BYTES, NVFP4_DS_BYTES};
use cudarc::driver::CudaSlice;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

// The kernels are compiled for the family's head count (one definition: `ops::attention::HEADS`).
use super::HEADS;

/// One paged cache as the attention kernel reads it.
#[derive(Debug, Clone, Copy)]
pub struct PagedCache<'a> {
    /// Page pool bytes (n_pages × page_slots × record bytes, block-planar).
    pub pages: &'a [u8],
    /// (requests, max_blocks) i32, -1 = unmapped. Main KV is indexed by entry, SWA by token position.
    pub block_table: &'a [i32],
    /// Columns of the block table.
    pub max_blocks: usize,
    /// Records per page.
    pub page_slots: usize,
}

/// A decode batch.
#[derive(Debug, Clone, Copy)]
pub struct DecodeBatch<'a> {
    /// Queries (T, 64, 512) f32, RoPE'd at `pos`.
    pub q: &'a [f32],
    /// Selected main-KV entries (T, topk_len) i32, -1 = masked.
    pub topk: &'a [i32],
    /// Columns of `topk` (512 for V4.1).
    pub topk_len: usize,
    /// Absolute position of each row (T,) i32.
    pub pos: &'a [i32],
    /// Request of each row (T,) i32 (a row of both block tables).
    pub req: &'a [i32],
    /// SWA window floor per row (T,) i32: the window is [max(p − 127, 0, window_start), p]
    /// (bounded replay, docs/SPEC.md §3; 0 when not replaying).
    pub window_start: &'a [i32],
    /// Per-head sink logits (64,) f32, or none (no sink).
    pub sink: Option<&'a [f32]>,
    /// RoPE inverse frequencies (32,) f64 for the inverse RoPE of output dims 448..511, or none.
    pub inv_freq: Option<&'a [f64]>,
    /// Softmax scale (512^-0.5 for V4.1).
    pub scale: f32,
}

/// Device buffers of a decode batch (shapes as in [`DecodeBatch`] and [`PagedCache`]).
#[derive(Debug)]
#[allow(missing_docs)]
pub struct DecodeDevBatch<'a> {
    pub q: &'a CudaSlice<f32>,
    pub topk: &'a CudaSlice<i32>,
    pub topk_len: usize,
    pub pos: &'a CudaSlice<i32>,
    pub req: &'a CudaSlice<i32>,
    pub window_start: &'a CudaSlice<i32>,
    pub main_pages: &'a CudaSlice<u8>,
    pub main_block_table: &'a CudaSlice<i32>,
    pub main_max_blocks: usize,
    pub main_page_slots: usize,
    pub swa_pages: &'a CudaSlice<u8>,
    pub swa_block_table: &'a CudaSlice<i32>,
    pub swa_max_blocks: usize,
    pub swa_page_slots: usize,
    pub sink: Option<&'a CudaSlice<f32>>,
    pub inv_freq: Option<&'a CudaSlice<f64>>,
    pub scale: f32,
    /// Rows T.
    pub rows: usize,
}

fn check_cache(what: &str, c: &PagedCache, record: usize, requests: usize) -> Result<()> {
    if c.page_slots == 0 {
        return Err(Error::invalid(
            format!("{what} page_slots"),
            "must be at least 1",
        ));
    }
    check_len(
        &format!("{what} block_table"),
        c.block_table.len(),
        requests * c.max_blocks,
    )?;
    let page = c.page_slots * record;
    if !c.pages.len().is_multiple_of(page) {
        return Err(Error::shape(
            format!("{what} page pool bytes"),
            format!("a multiple of {page}"),
            c.pages.len(),
        ));
    }
    let n = (c.pages.len() / page) as i64;
    if let Some(&b) = c.block_table.iter().find(|&&b| b < -1 || b as i64 >= n) {
        return Err(Error::invalid(
            format!("{what} block_table"),
            format!("block {b} is outside the {n} pages"),
        ));
    }
    Ok(())
}

impl Device {
    /// Sparse decode attention. Returns (out (T, 64, 512) f32, lse (T, 64) f32 natural-log
    /// log-sum-exp over the attended keys without the sink, −Inf for an empty row whose output is 0).
    ///
    /// Errors: [`Error::Shape`] / [`Error::Invalid`] for inconsistent inputs, [`Error::Cuda`].
    pub fn sparse_decode_attention(
        &self,
        b: &DecodeBatch,
        main: &PagedCache,
        swa: &PagedCache,
        requests: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let t = b.pos.len();
        check_len("q values", b.q.len(), t * HEADS * KV_DIM)?;
        check_len("topk", b.topk.len(), t * b.topk_len)?;
        check_len("req", b.req.len(), t)?;
        check_len("window_start", b.window_start.len(), t)?;
        if let Some(s) = b.sink {
            check_len("sink", s.len(), HEADS)?;
        }
        if let Some(f) = b.inv_freq {
            check_len("inv_freq", f.len(), 32)?;
        }
        if let Some(&r) = b.req.iter().find(|&&r| r < 0 || r as usize >= requests) {
            return Err(Error::invalid(
                "req",
                format!("request {r} is outside 0..{requests}"),
            ));
        }
        if b.pos.iter().any(|&p| p < 0) {
            return Err(Error::invalid("pos", "positions must be non-negative"));
        }
        check_cache("main KV", main, NVFP4_DS_BYTES, requests)?;
        check_cache("SWA", swa, MXFP8_BYTES, requests)?;
        let dq = self.upload(b.q)?;
        let dtk = self.upload(b.topk)?;
        let dpos = self.upload(b.pos)?;
        let dreq = self.upload(b.req)?;
        let dws = self.upload(b.window_start)?;
        let dmp = self.upload(main.pages)?;
        let dmbt = self.upload(main.block_table)?;
        let dsp = self.upload(swa.pages)?;
        let dsbt = self.upload(swa.block_table)?;
        let dsink = b.sink.map(|s| self.upload(s)).transpose()?;
        let dfreq = b.inv_freq.map(|f| self.upload(f)).transpose()?;
        let mut out = self.zeros::<f32>(t * HEADS * KV_DIM)?;
        let mut lse = self.zeros::<f32>(t * HEADS)?;
        self.sparse_decode_attention_dev(
            &DecodeDevBatch {
                q: &dq,
                topk: &dtk,
                topk_len: b.topk_len,
                pos: &dpos,
                req: &dreq,
                window_start: &dws,
                main_pages: &dmp,
                main_block_table: &dmbt,
                main_max_blocks: main.max_blocks,
                main_page_slots: main.page_slots,
                swa_pages: &dsp,
                swa_block_table: &dsbt,
                swa_max_blocks: swa.max_blocks,
                swa_page_slots: swa.page_slots,
                sink: dsink.as_ref(),
                inv_freq: dfreq.as_ref(),
                scale: b.scale,
                rows: t,
            },
            &mut out,
            &mut lse,
        )?;
        let mut o = self.download(&out)?;
        o.truncate(t * HEADS * KV_DIM);
        let mut l = self.download(&lse)?;
        l.truncate(t * HEADS);
        Ok((o, l))
    }

    /// Device form of [`Device::sparse_decode_attention`]; `out` (T, 64, 512), `lse` (T, 64).
    pub fn sparse_decode_attention_dev(
        &self,
        b: &DecodeDevBatch,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if b.rows == 0 {
            return Ok(());
        }
        if out.len() < b.rows * HEADS * KV_DIM || lse.len() < b.rows * HEADS {
            return Err(Error::shape(
                "attention output buffers",
                b.rows * HEADS * KV_DIM,
                out.len(),
            ));
        }
        let tl = as_i32("topk_len", b.topk_len)?;
        let (mmb, mps) = (
            as_i32("main max_blocks", b.main_max_blocks)?,
            as_i32("main page_slots", b.main_page_slots)?,
        );
        let (smb, sps) = (
            as_i32("swa max_blocks", b.swa_max_blocks)?,
            as_i32("swa page_slots", b.swa_page_slots)?,
        );
        let null = 0u64;
        let grid = ((HEADS / 16) as u32, as_i32("rows", b.rows)? as u32);
        // sparse_decode_attn_f32(q, topk, topk_len, pos, req, window_start, main_pages, main_bt,
        //   main_max_blocks, main_page_slots, swa_pages, swa_bt, swa_max_blocks, swa_page_slots,
        //   sink, inv_freq, scale, out, lse)
        macro_rules! go {
            ($sink:expr, $freq:expr) => {
                launch!(
                    self,
                    "attention",
                    "sparse_decode_attn_f32",
                    cfg(grid, 256),
                    b.q,
                    b.topk,
                    &tl,
                    b.pos,
                    b.req,
                    b.window_start,
                    b.main_pages,
                    b.main_block_table,
                    &mmb,
                    &mps,
                    b.swa_pages,
                    b.swa_block_table,
                    &smb,
                    &sps,
                    $sink,
                    $freq,
                    &b.scale,
                    out,
                    lse
                )
            };
        }
        match (b.sink, b.inv_freq) {
            (Some(s), Some(f)) => go!(s, f),
            (Some(s), None) => go!(s, &null),
            (None, Some(f)) => go!(&null, f),
            (None, None) => go!(&null, &null),
        }
        Ok(())
    }
}

/// One [`Device`] per ordinal for the pool entry (opened on first use, modules cached in it).
fn device(ordinal: i32) -> Result<Arc<Device>> {
    static DEVICES: OnceLock<Mutex<HashMap<i32, Arc<Device>>>> = OnceLock::new();
    let mut m = DEVICES.get_or_init(|| Mutex::new(HashMap::new())).lock();
    if let Some(d) = m.get(&ordinal) {
        return Ok(d.clone());
    }
    let idx = usize::try_from(ordinal)
        .map_err(|_| Error::invalid("CUDA device", format!("ordinal {ordinal} is negative")))?;
    let d = Arc::new(Device::open(idx)?);
    m.insert(ordinal, d.clone());
    Ok(d)
}

/// Loads every embedded module on device `ordinal` (before a CUDA-graph capture).
pub fn preload(ordinal: i32) -> Result<()> {
    device(ordinal)?.preload_all().map(|_| ())
}

fn addr_opt(v: &Option<View>) -> u64 {
    v.as_ref().map_or(0, |v| v.addr())
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
    // CSA2_ATTENTION_KERNEL=mma selects the tensor-core variant (bf16 mma.sync, P rounded to
    // bf16: BF16_DOTS_VS_F64); anything else, or unset, the f32 correctness kernel. Read per call
    // (no device work), so one process can compare both.
    let mma = std::env::var("CSA2_ATTENTION_KERNEL").is_ok_and(|v| v == "mma");
    if mma && (!c.q.addr().is_multiple_of(4) || !c.out.addr().is_multiple_of(4)) {
        return Err(Error::invalid(
            "q / out",
            "the tensor-core kernel reads and writes bf16 pairs: q and out must be 4-byte aligned",
        ));
    }
    let dev = device(ordinal)?;
    let f = dev.function(
        "attention",
        if mma {
            "attn_pools_bf16_mma"
        } else {
            "attn_pools_bf16"
        },
    )?;
    // SAFETY: `stream` is the caller's live stream of this device's primary context (the
    // entry's contract); the wrapper does not own it and is dropped right after the launch.
    let s = unsafe {
        dev.context()
            .wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream)
    };
    let i = |what: &str, v: usize| as_i32(what, v);
    let (hp, nh) = (i("padded heads", c.padded_heads)?, i("heads", c.heads)?);
    let (km, ks) = (
        i("main_idx columns", c.main_idx.shape()[1])?,
        i("swa_idx columns", c.swa_idx.shape()[1])?,
    );
    let (mp, mstride, mstates, mblocks, mfmt, mlay) = match &c.main {
        Some(p) => (
            p.addr as u64,
            p.desc.block_stride as i64,
            i("main states_per_page", p.desc.states_per_page)?,
            p.desc.blocks as i64,
            format_id(p.desc.format),
            p.desc.layout as i32,
        ),
        None => (0u64, 0i64, 1i32, 0i64, 0i32, 0i32),
    };
    let sp = &c.swa;
    let (sstride, sstates, sblocks, sfmt, slay) = (
        sp.desc.block_stride as i64,
        i("swa states_per_page", sp.desc.states_per_page)?,
        sp.desc.blocks as i64,
        format_id(sp.desc.format),
        sp.desc.layout as i32,
    );
    let (q, mi, si, sink, out) = (
        c.q.addr(),
        c.main_idx.addr(),
        c.swa_idx.addr(),
        c.sink.addr(),
        c.out.addr(),
    );
    let (ml, sl, lse, err) = (
        addr_opt(&c.main_len),
        addr_opt(&c.swa_len),
        addr_opt(&c.lse),
        addr_opt(&c.error),
    );
    let swa_base = sp.addr as u64;
    if c.tokens > 65_535 {
        // One grid row per token; CUDA caps gridDim.y at 65,535 (vLLM's batches are far below).
        return Err(Error::invalid(
            "q",
            format!(
                "{} tokens in one call; the kernel takes at most 65,535",
                c.tokens
            ),
        ));
    }
    // One block per 16 heads (correctness kernel) or per 64 heads (tensor-core kernel) of a token.
    let grid = (
        (c.padded_heads / if mma { 64 } else { 16 }) as u32,
        c.tokens as u32,
    );
    let mut b = s.launch_builder(&f);
    // attn_pools_bf16(q, hp, n_heads, main_idx, km, main_len, main_pool, main_stride,
    //   main_states, main_blocks, main_fmt, main_layout, swa_idx, ks, swa_len, swa_pool,
    //   swa_stride, swa_states, swa_blocks, swa_fmt, swa_layout, sink, scale, out, lse, err)
    use cudarc::driver::PushKernelArg;
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
    // SAFETY: the arguments follow the kernel's signature above in order and type; every
    // tensor was checked (shape, dtype, device, compact, disjoint outputs) by the entry, and the
    // kernel bounds-checks every slot against blocks · states before reading a pool.
    unsafe { b.launch(cfg(grid, 256)) }.map_err(|e| cuda_error("launch attn_pools_bf16", e))?;
    Ok(())
}

/// The `Csa2Format` id the kernel switches on (0 NVFP4, 2 MXFP8, 3 V4).
fn format_id(f: RecordFormat) -> i32 {
    match f {
        RecordFormat::Nvfp4Ds => 0,
        RecordFormat::Mxfp4Index => 1,
        RecordFormat::Mxfp8 => 2,
        RecordFormat::V4Record => 3,
        RecordFormat::Fp8Index => 4,
    }
}
