//! `csa2_attention_pools`: sparse attention read in place from vLLM's strided page pools, on the
//! host or on a CUDA device ([`crate::ops::attention::pools`]).
//!
//! One entry for both devices: every tensor of a call is `kDLCPU` (the CPU path, in place on the
//! same strided pools) or `kDLCUDA` on one device (csa2's kernel on the caller's stream; without
//! the `cuda` feature, `CSA2_ERR_NO_CUDA_BUILD`). The arguments travel in a `#[repr(C)]` struct
//! whose first field is its size, so that fields can be added later without breaking callers.

use super::dlpack::{DLTensor, Device, View, K_DL_CPU, K_DL_CUDA, K_DL_UINT};
use super::{guarded, Csa2Status};
use crate::error::{Error, Result};
use crate::formats::{RecordFormat, KV_DIM};
use crate::ops::attention::signature::pools as sig;
use crate::ops::attention::{attention_pools, PoolDesc, PoolInputs, PoolLayout, PoolView};
use crate::shape::Dims;

/// How a pool's pages hold their records (`Csa2Pool::layout`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2PoolLayout {
    /// A state's scale bytes follow its own data bytes (vLLM's V4.1 NVFP4 288 B and MXFP8 528 B).
    Csa2PoolInterleaved = 0,
    /// All data bytes of the page, then all scale bytes (V4 584 B, index K 68 / 132 B).
    Csa2PoolBlockPlanar = 1,
}

/// One strided page pool: a layer's cache view as vLLM 0.33 hands it to the layer.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2Pool {
    /// `[blocks, states_per_page, record_bytes]` uint8, strides `(block_stride, record_bytes, 1)`
    /// bytes: `stride(0)` is the per-block slab size (read, never derived; ≥ one page when there
    /// are two or more blocks), `data + byte_offset` is the layer's offset into the slab. Null
    /// for the compressed pool of an SWA-only layer.
    pub tensor: *const DLTensor,
    /// `Csa2Format` of the records: 0 NVFP4 (288 B), 2 MXFP8 (528 B), 3 V4 (584 B).
    pub format: i32,
    /// `Csa2PoolLayout`.
    pub layout: i32,
}

/// Arguments of [`csa2_attention_pools`]. Set `struct_size = sizeof(Csa2AttentionPoolsArgs)`.
///
/// Shapes (T tokens, Hp = 64 or 128 padded heads, H = `heads` local heads):
/// `q`, `out` `[T, Hp, 512]` bf16; `sink` `[H]` f32; `main_idx` `[T, Km]` and `swa_idx`
/// `[T, Ks]` int32 global slots (page · states_per_page + state; −1 = none), `main_len`,
/// `swa_len` `[T]` int32 valid lengths (null = the whole row); `lse` `[T, H]` f32 or null;
/// `error` `[4]` int32 or null. All compact (row-major) except the pools.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2AttentionPoolsArgs {
    /// `sizeof(Csa2AttentionPoolsArgs)` as the caller compiled it.
    pub struct_size: usize,
    /// RoPE'd queries.
    pub q: *const DLTensor,
    /// The compressed pool (`tensor` null for an SWA-only layer: then `main_idx` must name no slot).
    pub main: Csa2Pool,
    /// Compressed-entry slots per token (FlashMLA `extra_indices_in_kvcache`).
    pub main_idx: *const DLTensor,
    /// Their valid lengths (`extra_topk_length`).
    pub main_len: *const DLTensor,
    /// The SWA pool.
    pub swa: Csa2Pool,
    /// SWA slots per token (`indices`: `decode_swa_indices` / `prefill_swa_indices`).
    pub swa_idx: *const DLTensor,
    /// Their valid lengths (`topk_length`).
    pub swa_len: *const DLTensor,
    /// Per-head sink logits of the local heads.
    pub sink: *const DLTensor,
    /// Local heads H (1..=Hp); heads H..Hp of `out` are written as zeros.
    pub heads: u32,
    /// Softmax scale (not positive and finite → 512^-0.5).
    pub scale: f32,
    /// Output.
    pub out: *const DLTensor,
    /// Optional natural-log LSE without the sink (−∞ for a token that attends nothing).
    pub lse: *const DLTensor,
    /// Optional `[4]` int32 on the call's device. On CUDA the kernel records the first
    /// out-of-range slot here — `{1 = compressed / 2 = SWA, token, column, slot}` — and skips it;
    /// the caller reads it whenever it likes (after a sync). Zero it once before use; the kernel
    /// only ever writes it on a bad slot. On the host a bad slot is an error status instead
    /// (nothing written), and the tensor is left as it is.
    pub error: *const DLTensor,
    /// `cudaStream_t` / `CUstream` to launch on (CUDA only; 0 = the legacy default stream).
    /// Borrowed: csa2 neither synchronizes nor keeps it.
    pub stream: u64,
}

// SAFETY: #[repr(C)], `struct_size: usize` first, every field a pointer, an integer, a float or
// a `Csa2Pool` of those, so all-zero bytes are a valid value.
unsafe impl super::ArgsStruct for Csa2AttentionPoolsArgs {
    const NAME: &'static str = "Csa2AttentionPoolsArgs";
    const V1_SIZE: usize = std::mem::size_of::<Csa2AttentionPoolsArgs>();
}

/// A parsed pool argument.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolArg {
    pub desc: PoolDesc,
    pub device: Device,
    /// Address of the pool's first byte (`data + byte_offset`).
    pub addr: usize,
}

impl PoolArg {
    pub(super) fn range(&self) -> std::ops::Range<usize> {
        self.addr..self.addr + self.desc.extent()
    }
}

/// Reads and checks a strided pool descriptor (uint8, 3-d, inner strides `(record_bytes, 1)`).
///
/// # Safety
/// `p.tensor` null or a readable `DLTensor` whose `shape` / `strides` hold `ndim` values.
unsafe fn pool_arg(p: &Csa2Pool, what: &'static str) -> Result<Option<PoolArg>> {
    // SAFETY: forwarded caller contract.
    unsafe { pool_arg_of(p, what, KV_DIM, "0 nvfp4, 2 mxfp8, 3 v4") }
}

/// [`pool_arg`] for records of `dim` values (`formats_named` lists the accepted `Csa2Format`s for
/// the error): 512 for the KV pools, 128 for the index-K pool of `csa2_indexer_logits_pool`.
///
/// # Safety
/// As [`pool_arg`].
pub(super) unsafe fn pool_arg_of(
    p: &Csa2Pool,
    what: &'static str,
    dim: usize,
    formats_named: &str,
) -> Result<Option<PoolArg>> {
    if p.tensor.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null and readable per the contract; plain data.
    let t = unsafe { std::ptr::read_unaligned(p.tensor) };
    let format = usize::try_from(p.format)
        .ok()
        .and_then(|i| RecordFormat::ALL.get(i).copied())
        .filter(|f| f.dim() == dim)
        .ok_or_else(|| {
            Error::invalid(
                format!("{what}.format"),
                format!(
                    "{} is not a {dim}-value Csa2Format ({formats_named})",
                    p.format
                ),
            )
        })?;
    let layout = PoolLayout::from_abi(p.layout)?;
    if t.ndim != 3 || t.shape.is_null() {
        return Err(Error::shape(
            format!("{what}.ndim"),
            "3 ([blocks, states_per_page, record_bytes])",
            t.ndim,
        ));
    }
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) != (K_DL_UINT, 8, 1) {
        return Err(Error::shape(
            format!("{what}.dtype"),
            "uint8",
            format!(
                "code {} bits {} lanes {}",
                t.dtype.code, t.dtype.bits, t.dtype.lanes
            ),
        ));
    }
    // SAFETY: `shape` holds 3 readable i64s per the contract (checked non-null).
    let shape: [i64; 3] =
        std::array::from_fn(|i| unsafe { std::ptr::read_unaligned(t.shape.add(i)) });
    let strides: [i64; 3] = if t.strides.is_null() {
        [shape[1].saturating_mul(shape[2]), shape[2], 1]
    } else {
        // SAFETY: non-null `strides` holds 3 readable i64s per the contract.
        std::array::from_fn(|i| unsafe { std::ptr::read_unaligned(t.strides.add(i)) })
    };
    let w = format.record_bytes() as i64;
    if shape[0] < 0 || shape[1] < 1 || shape[2] != w {
        return Err(Error::shape(
            format!("{what}.shape"),
            format!("[blocks ≥ 0, states_per_page ≥ 1, {w}] ({})", format.name()),
            format!("{shape:?}"),
        ));
    }
    let inner_ok = strides[2] == 1 && (strides[1] == w || shape[1] == 1);
    if !inner_ok || strides[0] < 0 {
        return Err(Error::shape(
            format!("{what}.strides"),
            format!("(block_stride ≥ 0, {w}, 1) bytes: records packed inside a page"),
            format!("{strides:?}"),
        ));
    }
    let device = match t.device.device_type {
        K_DL_CPU => Device::Cpu,
        K_DL_CUDA => Device::Cuda(t.device.device_id),
        other => {
            return Err(Error::Unsupported(format!(
                "{what}: DLPack device type {other}; csa2 reads kDLCPU or kDLCUDA pools"
            )))
        }
    };
    let desc = PoolDesc {
        format,
        layout,
        blocks: shape[0] as usize,
        states_per_page: shape[1] as usize,
        block_stride: strides[0] as usize,
    };
    desc.check(what)?;
    let addr = (t.data as usize)
        .checked_add(t.byte_offset as usize)
        .filter(|a| a.checked_add(desc.extent()).is_some())
        .ok_or_else(|| {
            Error::shape(
                format!("{what}.byte_offset"),
                "an address in range",
                t.byte_offset,
            )
        })?;
    if desc.blocks > 0 && t.data.is_null() {
        return Err(Error::NullPointer(what));
    }
    Ok(Some(PoolArg { desc, device, addr }))
}

pub(super) fn overlaps(a: &std::ops::Range<usize>, b: &std::ops::Range<usize>) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// Every argument of one call, checked (shapes, dtypes, one device, outputs disjoint from
/// everything else). Slot values are not read here: on the host [`attention_pools`] checks them,
/// on a GPU the kernel does.
pub(crate) struct Checked<'a> {
    pub q: View<'a>,
    pub main: Option<PoolArg>,
    pub main_idx: View<'a>,
    pub main_len: Option<View<'a>>,
    pub swa: PoolArg,
    pub swa_idx: View<'a>,
    pub swa_len: Option<View<'a>>,
    pub sink: View<'a>,
    pub out: View<'a>,
    pub lse: Option<View<'a>>,
    /// Only the CUDA kernel writes it (the host path reports a bad slot as its status).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub error: Option<View<'a>>,
    pub heads: usize,
    pub padded_heads: usize,
    pub tokens: usize,
    pub scale: f32,
    pub device: Device,
}

/// # Safety
/// `a` readable; its tensor pointers as in [`View::from_raw`].
unsafe fn check_args<'a>(a: &Csa2AttentionPoolsArgs) -> Result<Checked<'a>> {
    // SAFETY (whole block): forwarded caller contract.
    let (q, main_idx, main_len, swa_idx, swa_len, sink, out, lse, error) = unsafe {
        (
            View::from_raw(a.q, sig::Q.name)?,
            View::from_raw(a.main_idx, sig::MAIN_IDX.name)?,
            View::from_raw_opt(a.main_len, sig::MAIN_LEN.name)?,
            View::from_raw(a.swa_idx, sig::SWA_IDX.name)?,
            View::from_raw_opt(a.swa_len, sig::SWA_LEN.name)?,
            View::from_raw(a.sink, sig::SINK.name)?,
            View::from_raw(a.out, sig::OUT.name)?,
            View::from_raw_opt(a.lse, sig::LSE.name)?,
            View::from_raw_opt(a.error, sig::ERROR.name)?,
        )
    };
    // SAFETY: forwarded caller contract.
    let main = unsafe { pool_arg(&a.main, "main")? };
    let swa = unsafe { pool_arg(&a.swa, "swa")? }.ok_or(Error::NullPointer("swa.tensor"))?;
    let mut dims = Dims::default();
    q.expect(&sig::Q, &mut dims)?;
    out.expect(&sig::OUT, &mut dims)?;
    let (t, hp) = (q.shape()[0], q.shape()[1]);
    if hp != 64 && hp != 128 {
        return Err(Error::shape("q padded heads (q.shape[1])", "64 or 128", hp));
    }
    let h = a.heads as usize;
    if h == 0 || h > hp {
        return Err(Error::invalid(
            "heads",
            format!("{h} local heads must be in 1..={hp} (q.shape[1])"),
        ));
    }
    dims.bind("h", h);
    sink.expect(&sig::SINK, &mut dims)?;
    main_idx.expect(&sig::MAIN_IDX, &mut dims)?;
    swa_idx.expect(&sig::SWA_IDX, &mut dims)?;
    if let Some(l) = &main_len {
        l.expect(&sig::MAIN_LEN, &mut dims)?;
    }
    if let Some(l) = &swa_len {
        l.expect(&sig::SWA_LEN, &mut dims)?;
    }
    if let Some(l) = &lse {
        l.expect(&sig::LSE, &mut dims)?;
    }
    if let Some(e) = &error {
        e.expect(&sig::ERROR, &mut dims)?;
    }
    // One device for everything.
    let device = q.device();
    let mut devices: Vec<(&str, Device)> = vec![
        ("main_idx", main_idx.device()),
        ("swa_idx", swa_idx.device()),
        ("sink", sink.device()),
        ("out", out.device()),
        ("swa", swa.device),
    ];
    devices.extend(main.map(|m| ("main", m.device)));
    for v in [&main_len, &swa_len, &lse, &error].into_iter().flatten() {
        devices.push((v.name(), v.device()));
    }
    if let Some((name, d)) = devices.iter().find(|(_, d)| *d != device) {
        return Err(Error::invalid(
            *name,
            format!("is on {d:?} but `q` is on {device:?}; all tensors of one call share a device"),
        ));
    }
    // Outputs apart from every other argument (pools included: they are read while out is written).
    let mut reads: Vec<(&str, std::ops::Range<usize>)> = vec![
        ("q", q.byte_range()),
        ("main_idx", main_idx.byte_range()),
        ("swa_idx", swa_idx.byte_range()),
        ("sink", sink.byte_range()),
        ("swa", swa.range()),
    ];
    reads.extend(main.map(|m| ("main", m.range())));
    for v in [&main_len, &swa_len].into_iter().flatten() {
        reads.push((v.name(), v.byte_range()));
    }
    let mut writes: Vec<(&str, std::ops::Range<usize>)> = vec![("out", out.byte_range())];
    for v in [&lse, &error].into_iter().flatten() {
        writes.push((v.name(), v.byte_range()));
    }
    for (i, (wn, wr)) in writes.iter().enumerate() {
        let others = reads.iter().chain(&writes[i + 1..]);
        if let Some((rn, _)) = others.clone().find(|(_, r)| overlaps(wr, r)) {
            return Err(Error::invalid(
                *wn,
                format!("overlaps `{rn}`; outputs must not alias any other argument"),
            ));
        }
    }
    let scale = if a.scale.is_finite() && a.scale > 0.0 {
        a.scale
    } else {
        (KV_DIM as f32).sqrt().recip()
    };
    Ok(Checked {
        q,
        main,
        main_idx,
        main_len,
        swa,
        swa_idx,
        swa_len,
        sink,
        out,
        lse,
        error,
        heads: h,
        padded_heads: hp,
        tokens: t,
        scale,
        device,
    })
}

/// The host path: in place on the strided pools.
fn run_host(c: &mut Checked) -> Result<()> {
    // SAFETY: the pools are host memory (checked), the caller's contract keeps `extent` bytes
    // from `addr` readable for the call, and no output overlaps them (checked).
    let pool =
        |p: &PoolArg| unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.desc.extent()) };
    let swa = PoolView::new(c.swa.desc, pool(&c.swa), "swa")?;
    let main = c
        .main
        .as_ref()
        .map(|m| PoolView::new(m.desc, pool(m), "main"))
        .transpose()?;
    let q = c.q.bf16s()?;
    let sink = c.sink.f32s()?;
    let inp = PoolInputs {
        q,
        padded_heads: c.padded_heads,
        heads: c.heads,
        sink: &sink,
        main_idx: c.main_idx.i32s()?,
        main_len: c.main_len.as_ref().map(|l| l.i32s()).transpose()?,
        swa_idx: c.swa_idx.i32s()?,
        swa_len: c.swa_len.as_ref().map(|l| l.i32s()).transpose()?,
        scale: c.scale,
    };
    let out = c.out.bf16s_mut()?;
    let lse = c.lse.as_mut().map(|l| l.f32s_mut()).transpose()?;
    attention_pools(&inp, main, swa, out, lse)
}

/// Sparse attention with a sink, in place on vLLM's strided page pools (FlashMLA's sparse
/// decode / prefill contract; docs/VLLM.md "The GPU serving route"): for each token `t` and local
/// head `h`, one softmax over the compressed entries `main_idx[t, :main_len[t]]` then the SWA
/// slots `swa_idx[t, :swa_len[t]]` (−1 skipped), plus `sink[h]` in the denominator only; scores
/// `scale · q·k`, K = V = the decoded 512-value latent. Shapes in [`Csa2AttentionPoolsArgs`].
///
/// Devices: all tensors `kDLCPU` → the CPU path (f32 sums, exact decode, bf16 output); all
/// `kDLCUDA` on one device → csa2's CUDA kernel launched on `stream` (asynchronous: returns
/// after the launch; nothing is copied to the host, nothing synchronizes; CUDA-graph capturable
/// once the modules are loaded, see [`csa2_cuda_preload`]). A build without the `cuda` feature
/// returns `CSA2_ERR_NO_CUDA_BUILD` for CUDA tensors.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` for `struct_size` below the first version (the args-struct
/// rules of the header's preamble), a
/// bad format / layout / heads, mixed devices, an output aliasing another argument, and (host)
/// a slot outside `-1..blocks·states_per_page` of its pool, a non-finite q / sink, or a token
/// over 65 536 rows; `CSA2_ERR_SHAPE` for shapes, dtypes or strides; `CSA2_ERR_CUDA` for a
/// failed launch. Nothing is written on error.
///
/// # Safety
/// `args` null or readable; each tensor pointer in it null (where optional) or a readable
/// `DLTensor` whose memory stays valid, and unwritten by others, for the call (on CUDA: until
/// the kernel has run on `stream`).
#[no_mangle]
pub unsafe extern "C" fn csa2_attention_pools(args: *const Csa2AttentionPoolsArgs) -> Csa2Status {
    guarded("csa2_attention_pools", || {
        // SAFETY: `args` null or readable per the contract (checked by `read_args`).
        let a = unsafe { super::read_args(args) }?;
        // SAFETY: forwarded caller contract.
        let mut c = unsafe { check_args(&a)? };
        if c.tokens == 0 {
            return Ok(());
        }
        match c.device {
            Device::Cpu => run_host(&mut c),
            Device::Cuda(_id) => run_cuda(&c, a.stream),
        }
    })
}

#[cfg(feature = "cuda")]
fn run_cuda(c: &Checked, stream: u64) -> Result<()> {
    crate::ops::attention::cuda::attention_pools_launch(c, stream)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_c: &Checked, _stream: u64) -> Result<()> {
    Err(Error::Unsupported(
        "the tensors are on a CUDA device, but this csa2 build has no CUDA support (build with \
         --features cuda)"
            .into(),
    ))
}

/// Loads every embedded CUDA module on device `ordinal` now, resolves every kernel function of
/// every op family and reserves the split attention kernel's workspace (`4 waves × SMs × 64 heads
/// × 514` f32: 69.5 MB on 132 SMs). Call it before capturing a CUDA graph: no launch afterwards
/// loads, JITs, compiles or allocates (a split launch captured without it is refused with
/// `CSA2_ERR_INVALID_ARGUMENT`, never run on another plan). `CSA2_ERR_NO_CUDA_BUILD` without the
/// `cuda` feature; `CSA2_ERR_UNSUPPORTED` without a driver or device; `CSA2_ERR_CUDA_MODULE` when
/// this GPU cannot load the kernels (the message says what was tried) — a GPU machine must not
/// fall back to the host on that one.
#[no_mangle]
pub extern "C" fn csa2_cuda_preload(ordinal: i32) -> Csa2Status {
    guarded("csa2_cuda_preload", || preload(ordinal))
}

#[cfg(feature = "cuda")]
fn preload(ordinal: i32) -> Result<()> {
    crate::ops::attention::cuda::preload(ordinal)
}

#[cfg(not(feature = "cuda"))]
fn preload(_ordinal: i32) -> Result<()> {
    Err(Error::NoCudaBuild(
        "csa2_cuda_preload: this csa2 build has no CUDA support (build with --features cuda)"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::dlpack::K_DL_FLOAT;
    use crate::ffi::test_support::{host_tensor, last_error};
    use half::bf16;

    fn tensor<T>(
        data: &mut [T],
        shape: &mut [i64],
        strides: Option<&mut [i64]>,
        code: u8,
        bits: u8,
    ) -> DLTensor {
        host_tensor(data.as_mut_ptr().cast(), code, bits, shape, strides)
    }

    /// The arguments of an SWA-only call on an MXFP8 interleaved pool, no error record, stream 0:
    /// `[q, swa pool, swa_idx, swa_len, main_idx (no columns), sink, out, lse]` and the heads.
    fn swa_only_args(t: [&DLTensor; 8], heads: usize) -> Csa2AttentionPoolsArgs {
        let [q, swa, swa_idx, swa_len, main_idx, sink, out, lse] = t;
        Csa2AttentionPoolsArgs {
            struct_size: std::mem::size_of::<Csa2AttentionPoolsArgs>(),
            q,
            main: Csa2Pool {
                tensor: std::ptr::null(),
                format: 0,
                layout: 0,
            },
            main_idx,
            main_len: std::ptr::null(),
            swa: Csa2Pool {
                tensor: swa,
                format: 2,
                layout: 0,
            },
            swa_idx,
            swa_len,
            sink,
            heads: heads as u32,
            scale: 0.0,
            out,
            lse,
            error: std::ptr::null(),
            stream: 0,
        }
    }

    /// `csa2_cuda_preload` resolves every kernel function of every family on the one device
    /// registry the launches use (it used to fill a registry of the attention family only, so the
    /// indexer's, top-k's and candidates' first launch loaded its module — inside a graph capture
    /// if one was running). A build without the feature says so with its own status.
    #[test]
    fn cuda_preload_resolves_every_kernel_of_every_family() {
        #[cfg(feature = "cuda")]
        {
            use crate::cuda::{CudaDevice, EXPECTED_KERNELS};
            if !CudaDevice::driver_present() {
                println!("SKIPPED: no CUDA driver");
                return;
            }
            assert_eq!(csa2_cuda_preload(0), Csa2Status::Csa2Ok, "{}", last_error());
            let mut want: Vec<String> = EXPECTED_KERNELS
                .iter()
                .flat_map(|(m, ks)| ks.iter().map(move |k| format!("{m}::{k}")))
                .collect();
            want.sort();
            let got = CudaDevice::shared(0).unwrap().resolved_functions();
            assert_eq!(got, want);
        }
        #[cfg(not(feature = "cuda"))]
        {
            assert_eq!(csa2_cuda_preload(0), Csa2Status::Csa2ErrNoCudaBuild);
            assert!(last_error().contains("--features cuda"), "{}", last_error());
        }
    }

    /// Through the C ABI on a strided, offset SWA pool (MXFP8, interleaved) of an SWA-only layer:
    /// the same values as the Rust entry; struct_size, device and layout errors are refused and
    /// write nothing.
    #[test]
    fn c_abi_on_host_and_cuda_tensors_matches_the_rust_entry_and_refuses_bad_args() {
        let (blocks, states, w) = (3usize, 4usize, 528usize);
        let (offset, stride) = (64usize, 4 * 528 + 200);
        let mut slab = vec![0x7Fu8; offset + blocks * stride];
        let rows: Vec<f32> = (0..blocks * states * 512)
            .map(|i| ((i * 7919) % 613) as f32 / 300.0 - 1.0)
            .collect();
        let desc = PoolDesc {
            format: RecordFormat::Mxfp8,
            layout: PoolLayout::Interleaved,
            blocks,
            states_per_page: states,
            block_stride: stride,
        };
        for s in 0..blocks * states {
            let (d, _) = desc.offsets(s);
            crate::formats::encode_rows(
                RecordFormat::Mxfp8,
                &rows[s * 512..][..512],
                &mut slab[offset + d..][..w],
            )
            .unwrap();
        }
        let (t, hp, h) = (2usize, 64usize, 8usize);
        let mut q: Vec<bf16> = (0..t * hp * 512)
            .map(|i| bf16::from_f32(((i % 97) as f32 - 48.0) / 40.0))
            .collect();
        let mut sink = vec![0.25f32; h];
        let mut sidx = vec![0i32, 5, 11, -1, 3, 3, 7, 2];
        let mut slen = vec![3i32, 4];
        let mut midx: Vec<i32> = vec![];
        let mut out = vec![bf16::from_f32(9.0); t * hp * 512];
        let mut lse = vec![0f32; t * h];
        let mut want = vec![bf16::ZERO; out.len()];
        let mut want_lse = vec![0f32; t * h];
        let pool = PoolView::new(desc, &slab[offset..], "swa").unwrap();
        let inp = PoolInputs {
            q: &q,
            padded_heads: hp,
            heads: h,
            sink: &sink,
            main_idx: &[],
            main_len: None,
            swa_idx: &sidx,
            swa_len: Some(&slen),
            scale: (512f32).sqrt().recip(),
        };
        attention_pools(&inp, None, pool, &mut want, Some(&mut want_lse)).unwrap();

        let (mut sq, mut sp, mut spst) = (
            [t as i64, hp as i64, 512],
            [blocks as i64, states as i64, w as i64],
            [stride as i64, w as i64, 1],
        );
        let (mut ss, mut si, mut sl, mut sm, mut so, mut sle) = (
            [h as i64],
            [t as i64, 4],
            [t as i64],
            [t as i64, 0],
            [t as i64, hp as i64, 512],
            [t as i64, h as i64],
        );
        let qd = tensor(&mut q, &mut sq, None, 4, 16);
        let mut pd = tensor(&mut slab, &mut sp, Some(&mut spst), K_DL_UINT, 8);
        pd.byte_offset = offset as u64;
        let sinkd = tensor(&mut sink, &mut ss, None, K_DL_FLOAT, 32);
        let sid = tensor(&mut sidx, &mut si, None, 0, 32);
        let sld = tensor(&mut slen, &mut sl, None, 0, 32);
        let mid = tensor(&mut midx, &mut sm, None, 0, 32);
        let od = tensor(&mut out, &mut so, None, 4, 16);
        let ld = tensor(&mut lse, &mut sle, None, K_DL_FLOAT, 32);
        let args = swa_only_args([&qd, &pd, &sid, &sld, &mid, &sinkd, &od, &ld], h);
        let run = |a: &Csa2AttentionPoolsArgs| unsafe { csa2_attention_pools(a) };
        // Refusals first: nothing may be written.
        let small = Csa2AttentionPoolsArgs {
            struct_size: 8,
            ..args
        };
        assert_eq!(run(&small), Csa2Status::Csa2ErrInvalidArgument);
        assert!(last_error().contains("struct_size"), "{}", last_error());
        let planar = Csa2AttentionPoolsArgs {
            swa: Csa2Pool {
                layout: 7,
                ..args.swa
            },
            ..args
        };
        assert_eq!(run(&planar), Csa2Status::Csa2ErrInvalidArgument);
        let mut cuda_q = qd;
        cuda_q.device.device_type = K_DL_CUDA;
        let mixed = Csa2AttentionPoolsArgs { q: &cuda_q, ..args };
        assert_eq!(run(&mixed), Csa2Status::Csa2ErrInvalidArgument);
        assert!(last_error().contains("share a device"), "{}", last_error());
        // What a descriptor can be checked for: the record width and the inner strides.
        let mut bad_strides = [stride as i64, 1056, 1];
        let mut skewed = pd;
        skewed.strides = bad_strides.as_mut_ptr();
        let sk = Csa2AttentionPoolsArgs {
            swa: Csa2Pool {
                tensor: &skewed,
                ..args.swa
            },
            ..args
        };
        assert_eq!(run(&sk), Csa2Status::Csa2ErrShape);
        assert!(last_error().contains("strides"), "{}", last_error());
        // A shape whose byte count wraps (2^59 + 1 states of 528 B) is refused, not a panic.
        let (mut huge_shape, mut huge_strides) = (
            [1i64, (1 << 59) + 1, w as i64],
            [stride as i64, w as i64, 1],
        );
        let mut huge = pd;
        huge.shape = huge_shape.as_mut_ptr();
        huge.strides = huge_strides.as_mut_ptr();
        let hg = Csa2AttentionPoolsArgs {
            swa: Csa2Pool {
                tensor: &huge,
                ..args.swa
            },
            ..args
        };
        let st = run(&hg);
        assert!(
            matches!(
                st,
                Csa2Status::Csa2ErrInvalidArgument | Csa2Status::Csa2ErrShape
            ),
            "{st:?}: {}",
            last_error()
        );
        let aliased = Csa2AttentionPoolsArgs { out: &qd, ..args };
        assert_eq!(run(&aliased), Csa2Status::Csa2ErrInvalidArgument);
        assert!(last_error().contains("overlaps"), "{}", last_error());
        assert!(out.iter().all(|v| v.to_f32() == 9.0), "written on error");
        // The call itself.
        assert_eq!(run(&args), Csa2Status::Csa2Ok, "{}", last_error());
        assert_eq!(out, want);
        assert_eq!(lse, want_lse);

        // The same call with every tensor presented as CUDA memory: on the emulated device
        // (feature `cuda-emu`) the kernel runs through the CUDA route's own launch, against the
        // host route's result; a slot past the pool lands in the error record, not in memory.
        #[cfg(feature = "cuda-emu")]
        {
            use crate::tolerance::{compare, BF16_DOTS_VS_F64};
            let cuda = |mut d: DLTensor| {
                d.device.device_type = K_DL_CUDA;
                d
            };
            let mut out_g = vec![bf16::from_f32(9.0); out.len()];
            let mut lse_g = vec![0f32; lse.len()];
            let mut err = [0i32; 4];
            let mut se = [4i64];
            let (qg, pg, sinkg, sig, slg, mig) = (
                cuda(qd),
                cuda(pd),
                cuda(sinkd),
                cuda(sid),
                cuda(sld),
                cuda(mid),
            );
            let og = cuda(tensor(&mut out_g, &mut so, None, 4, 16));
            let lg = cuda(tensor(&mut lse_g, &mut sle, None, K_DL_FLOAT, 32));
            let eg = cuda(tensor(&mut err, &mut se, None, 0, 32));
            let gargs = Csa2AttentionPoolsArgs {
                q: &qg,
                main_idx: &mig,
                swa: Csa2Pool {
                    tensor: &pg,
                    ..args.swa
                },
                swa_idx: &sig,
                swa_len: &slg,
                sink: &sinkg,
                out: &og,
                lse: &lg,
                error: &eg,
                ..args
            };
            assert_eq!(run(&gargs), Csa2Status::Csa2Ok, "{}", last_error());
            let (g, w): (Vec<f32>, Vec<f64>) = out_g
                .iter()
                .zip(&want)
                .map(|(a, b)| (a.to_f32(), b.to_f64()))
                .unzip();
            let st = compare(&g, &w, &BF16_DOTS_VS_F64);
            assert!(st.ok(&BF16_DOTS_VS_F64), "CUDA route out: {st:?}");
            let wl: Vec<f64> = want_lse.iter().map(|&v| v as f64).collect();
            let st = compare(&lse_g, &wl, &BF16_DOTS_VS_F64);
            assert!(st.ok(&BF16_DOTS_VS_F64), "CUDA route lse: {st:?}");
            assert_eq!(err, [0; 4], "a clean call leaves the error record alone");
            // Slot 12 is past the 3 × 4 states of the pool.
            sidx[1] = 12;
            assert_eq!(run(&gargs), Csa2Status::Csa2Ok, "{}", last_error());
            assert_ne!(err[0], 0, "an out-of-pool slot must be recorded: {err:?}");
        }
    }

    /// The decode call captured in a CUDA graph after `csa2_cuda_preload` alone, as vLLM captures
    /// it (emulated device: the capture refuses allocation, host copies, synchronisation and
    /// module loads, as the driver does): the call records the split kernel and its combine pass
    /// and writes nothing; the graph replays bit for bit as the same call run eagerly, and reads
    /// new queries and lists at the captured addresses. Before the device reserved its split
    /// workspace at preload, such a capture ran the launch unsplit: other bits than eager.
    #[cfg(feature = "cuda-emu")]
    #[test]
    fn cuda_decode_call_captured_after_preload_alone_replays_as_eager() {
        use crate::cuda::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        use crate::cuda::CudaDevice;
        use crate::ops::attention::cuda::reserved_workspace_floats;
        assert_eq!(csa2_cuda_preload(0), Csa2Status::Csa2Ok, "{}", last_error());
        let dev = CudaDevice::shared(0).unwrap();
        assert!(dev.attention_workspace_len() >= reserved_workspace_floats(dev.sm_count()));
        // An SWA-only layer: 8 pages of 16 MXFP8 states, lists of 128 columns (8 tiles), so the
        // default plan cuts each of the 3 tokens' lists into 4 chunks of 32 keys.
        let (blocks, states, w, ks) = (8usize, 16usize, 528usize, 128usize);
        let desc = PoolDesc {
            format: RecordFormat::Mxfp8,
            layout: PoolLayout::Interleaved,
            blocks,
            states_per_page: states,
            block_stride: states * w,
        };
        let mut slab = vec![0u8; blocks * states * w];
        for s in 0..blocks * states {
            let row: Vec<f32> = (0..512)
                .map(|i| ((s * 131 + i * 7919) % 613) as f32 / 300.0 - 1.0)
                .collect();
            let (d, _) = desc.offsets(s);
            crate::formats::encode_rows(RecordFormat::Mxfp8, &row, &mut slab[d..][..w]).unwrap();
        }
        let (t, hp, h) = (3usize, 64usize, 16usize);
        let qv = |seed: usize| -> Vec<bf16> {
            (0..t * hp * 512)
                .map(|i| bf16::from_f32((((i * 31 + seed) % 97) as f32 - 48.0) / 40.0))
                .collect()
        };
        let lists = |seed: usize| -> (Vec<i32>, Vec<i32>) {
            let idx = (0..t * ks)
                .map(|i| ((i * 37 + seed) % (blocks * states)) as i32)
                .collect();
            (idx, vec![ks as i32, 70, 5])
        };
        let mut q = qv(0);
        let (mut sidx, mut slen) = lists(0);
        let mut sink = vec![0.25f32; h];
        let mut midx: Vec<i32> = vec![];
        let mut out = vec![bf16::from_f32(9.0); t * hp * 512];
        let mut lse = vec![0f32; t * h];
        let mut err = [0i32; 4];
        let cuda = |mut d: DLTensor| {
            d.device.device_type = K_DL_CUDA;
            d
        };
        let (mut sq, mut sp, mut ss, mut si, mut sl, mut sm, mut sle, mut se) = (
            [t as i64, hp as i64, 512],
            [blocks as i64, states as i64, w as i64],
            [h as i64],
            [t as i64, ks as i64],
            [t as i64],
            [t as i64, 0],
            [t as i64, h as i64],
            [4i64],
        );
        let mut so = sq;
        let qd = cuda(tensor(&mut q, &mut sq, None, 4, 16));
        let pd = cuda(tensor(&mut slab, &mut sp, None, K_DL_UINT, 8));
        let sinkd = cuda(tensor(&mut sink, &mut ss, None, K_DL_FLOAT, 32));
        let sid = cuda(tensor(&mut sidx, &mut si, None, 0, 32));
        let sld = cuda(tensor(&mut slen, &mut sl, None, 0, 32));
        let mid = cuda(tensor(&mut midx, &mut sm, None, 0, 32));
        let od = cuda(tensor(&mut out, &mut so, None, 4, 16));
        let ld = cuda(tensor(&mut lse, &mut sle, None, K_DL_FLOAT, 32));
        let ed = cuda(tensor(&mut err, &mut se, None, 0, 32));
        let stream = dev.context().new_stream().unwrap();
        let args = Csa2AttentionPoolsArgs {
            error: &ed,
            stream: stream.cu_stream() as u64,
            ..swa_only_args([&qd, &pd, &sid, &sld, &mid, &sinkd, &od, &ld], h)
        };
        // The buffers are read and written through the descriptors' pointers from here on.
        let (qp, sip, slp, op, lp) = (
            qd.data as *mut bf16,
            sid.data as *mut i32,
            sld.data as *mut i32,
            od.data as *mut bf16,
            ld.data as *mut f32,
        );
        // SAFETY: each pointer is its live Vec's buffer, of these lengths; no call runs meanwhile.
        let read = || unsafe {
            (
                std::slice::from_raw_parts(op, t * hp * 512).to_vec(),
                std::slice::from_raw_parts(lp, t * h).to_vec(),
            )
        };
        let run = |a: &Csa2AttentionPoolsArgs| unsafe { csa2_attention_pools(a) };
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .unwrap();
        assert_eq!(run(&args), Csa2Status::Csa2Ok, "{}", last_error());
        let graph = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
            .expect("the capture holds no host work")
            .unwrap();
        assert_eq!(
            graph.kernel_names(),
            ["attn_pools_bf16_split", "attn_pools_combine"]
        );
        assert!(
            read().0.iter().all(|v| v.to_f32() == 9.0),
            "a captured call runs nothing"
        );
        for round in 0..2 {
            if round == 1 {
                // New queries and lists written in place: the graph reads them at its addresses.
                let (ni, nl) = lists(5);
                // SAFETY: the same buffers and lengths as above.
                unsafe {
                    std::ptr::copy_nonoverlapping(qv(11).as_ptr(), qp, t * hp * 512);
                    std::ptr::copy_nonoverlapping(ni.as_ptr(), sip, t * ks);
                    std::ptr::copy_nonoverlapping(nl.as_ptr(), slp, t);
                }
            }
            {
                // A replay's split and combine pair shares the device's workspace as an eager
                // launch pair does: the other tests' split launches wait, as they wait for eager
                // pairs.
                let _pair = dev.split_launch_lock();
                graph.launch().unwrap();
            }
            let replayed = read();
            assert!(replayed.0.iter().any(|v| v.to_f32() != 9.0));
            assert_eq!(run(&args), Csa2Status::Csa2Ok, "{}", last_error());
            let eager = read();
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&replayed.0), bits(&eager.0), "round {round}: out");
            let fbits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(fbits(&replayed.1), fbits(&eager.1), "round {round}: lse");
        }
        assert_eq!(err, [0; 4]);
    }

    /// What a capture refuses on the emulated device (the driver's rules the capture test relies
    /// on): an allocation on the capturing thread fails and invalidates the capture, whose end
    /// names it; a split launch that would need a larger workspace while its stream is captured
    /// is refused with the remedy, not run on another plan.
    #[cfg(feature = "cuda-emu")]
    #[test]
    fn cuda_capture_refuses_host_work_and_a_missing_workspace() {
        use crate::cuda::driver::sys::{
            CUgraphInstantiate_flags as F, CUstreamCaptureMode as M, CUstreamCaptureStatus as S,
        };
        use crate::cuda::CudaDevice;
        let dev = CudaDevice::shared(0).unwrap();
        let stream = dev.context().new_stream().unwrap();
        assert!(dev
            .stream()
            .begin_capture(M::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .is_err());
        stream
            .begin_capture(M::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .unwrap();
        let e = dev.zeros::<f32>(4).unwrap_err().to_string();
        assert!(e.contains("STREAM_CAPTURE_UNSUPPORTED"), "{e}");
        assert_eq!(
            stream.capture_status().unwrap(),
            S::CU_STREAM_CAPTURE_STATUS_INVALIDATED
        );
        let e = stream
            .end_capture(F::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
            .unwrap_err()
            .to_string();
        assert!(e.contains("INVALIDATED") && e.contains("cuMemAlloc"), "{e}");
        // More than any buffer of the device (whose size other tests may grow meanwhile).
        let e = dev
            .attention_workspace(1 << 40, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("csa2_cuda_preload"), "{e}");
    }
}
