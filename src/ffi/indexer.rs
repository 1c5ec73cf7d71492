//! `csa2_indexer_logits` and `csa2_indexer_logits_in_blocks`: the C face of [`crate::ops::indexer`]
//! (conventions: the op section of [`super`]).

use super::dlpack::{check_disjoint, fill_floats, host, DLTensor, DType};
use super::{guarded, Csa2Status};
use crate::error::{Error, Result};
use crate::ops::candidates::CandidateParams;
use crate::ops::indexer::signature::{
    BLOCKS, BLOCK_TABLE, ERROR, KEYS, KEYS_MXFP4, LOGITS_OUT, POSITIONS, Q, REQ, W,
};
use crate::ops::indexer::{IndexKeys, IndexerParams, IndexerQueries, QueryQuant, INDEX_DIM};
use crate::shape::Dims;

/// Arguments of [`csa2_indexer_logits`] (shapes there).
/// Set `struct_size` to `sizeof(Csa2IndexerLogitsArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2IndexerLogitsArgs {
    /// `sizeof(Csa2IndexerLogitsArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `(T, H, 128)` float RoPE'd index Q.
    pub q: *const DLTensor,
    /// `(T, H)` float head weights (already scaled).
    pub w: *const DLTensor,
    /// `(T)` int token positions.
    pub positions: *const DLTensor,
    /// `(N, 128)` float or `(N, 68)` uint8 MXFP4 index-K records.
    pub keys: *const DLTensor,
    /// Compression ratio (≥ 1).
    pub ratio: u32,
    /// Fake quantisation of Q: 0 none, 1 MXFP4 (V4.1), 2 FP8 E4M3 (launch day).
    pub q_quant: i32,
    /// Output `(T, N)` float.
    pub logits_out: *const DLTensor,
}

args_struct!(Csa2IndexerLogitsArgs);

/// Lightning-indexer logits (docs/SPEC.md §2 "Indexer"): `logits[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j)`
/// for the visible entries `j < (positions[t] + 1) div ratio`, −∞ elsewhere.
///
/// `q` `(T, H, 128)` float (RoPE'd index Q), `w` `(T, H)` float (already scaled), `positions` `(T)`
/// int; `keys` either `(N, 128)` float or `(N, 68)` uint8 MXFP4 index-K records; `q_quant`: 0 none,
/// 1 MXFP4 (V4.1), 2 FP8 E4M3 (the launch-day path) fake-quantisation of Q; `logits_out` `(T, N)`
/// float. Errors: `CSA2_ERR_INVALID_ARGUMENT` (ratio 0, `q_quant`, negative position),
/// `CSA2_ERR_SHAPE` (too few keys for a position), plus the common ones.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2IndexerLogitsArgs`. Its members:
/// Each tensor pointer null or a readable `DLTensor` whose memory stays valid and unused by other
/// threads for the call.
#[no_mangle]
pub unsafe extern "C" fn csa2_indexer_logits(args: *const Csa2IndexerLogitsArgs) -> Csa2Status {
    guarded("csa2_indexer_logits", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let Csa2IndexerLogitsArgs {
            struct_size: _,
            q,
            w,
            positions,
            keys,
            ratio,
            q_quant,
            logits_out,
        } = unsafe { super::read_args(args) }?;
        // SAFETY: caller's contract (see above).
        unsafe { indexer(q, w, positions, keys, None, ratio, q_quant, logits_out) }
    })
}

/// Arguments of [`csa2_indexer_logits_in_blocks`] (shapes there).
/// Set `struct_size` to `sizeof(Csa2IndexerLogitsInBlocksArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2IndexerLogitsInBlocksArgs {
    /// `sizeof(Csa2IndexerLogitsInBlocksArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `(T, H, 128)` float RoPE'd index Q.
    pub q: *const DLTensor,
    /// `(T, H)` float head weights (already scaled).
    pub w: *const DLTensor,
    /// `(T)` int token positions.
    pub positions: *const DLTensor,
    /// `(N, 128)` float or `(N, 68)` uint8 MXFP4 index-K records.
    pub keys: *const DLTensor,
    /// `(T, B)` int32 candidate blocks per row (−1 ends the list), from `csa2_candidates`.
    pub blocks: *const DLTensor,
    /// Compression ratio (≥ 1).
    pub ratio: u32,
    /// Entries per candidate block (≥ 1; 8 in V4.1).
    pub block_size: u32,
    /// Fake quantisation of Q: 0 none, 1 MXFP4, 2 FP8 E4M3.
    pub q_quant: i32,
    /// Output `(T, N)` float.
    pub logits_out: *const DLTensor,
}

args_struct!(Csa2IndexerLogitsInBlocksArgs);

/// Candidate-restricted lightning-indexer logits (docs/SPEC.md §2 "Indexer", the Reindex path): as
/// [`csa2_indexer_logits`], but row t scores only the entries inside its candidate blocks
/// `blocks[t, :]` (block b = entries `[b·block_size, (b+1)·block_size)`, −1 ends the list early;
/// only visible entries count); every other entry is −∞. This is `csa2 op indexer` with `blocks`.
///
/// `blocks` `(T, B)` int32 from `csa2_candidates`; `block_size` ≥ 1 (the geometry's
/// `candidate_block_size`, 8). Errors: a block id past the keys (`CSA2_ERR_INVALID_ARGUMENT`),
/// `block_size` 0, plus those of [`csa2_indexer_logits`].
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2IndexerLogitsInBlocksArgs`. Its members:
/// As [`csa2_indexer_logits`].
#[no_mangle]
pub unsafe extern "C" fn csa2_indexer_logits_in_blocks(
    args: *const Csa2IndexerLogitsInBlocksArgs,
) -> Csa2Status {
    guarded("csa2_indexer_logits_in_blocks", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let Csa2IndexerLogitsInBlocksArgs {
            struct_size: _,
            q,
            w,
            positions,
            keys,
            blocks,
            ratio,
            block_size,
            q_quant,
            logits_out,
        } = unsafe { super::read_args(args) }?;
        // SAFETY: a null `blocks` is refused here; the rest is the caller's contract.
        unsafe {
            if blocks.is_null() {
                return Err(Error::NullPointer("blocks"));
            }
            indexer(
                q,
                w,
                positions,
                keys,
                Some((blocks, block_size)),
                ratio,
                q_quant,
                logits_out,
            )
        }
    })
}

/// The body of both indexer exports; `blocks` = (candidate blocks, block size) for the Reindex path.
///
/// # Safety
/// As [`csa2_indexer_logits`].
#[allow(clippy::too_many_arguments)]
unsafe fn indexer(
    q: *const DLTensor,
    w: *const DLTensor,
    positions: *const DLTensor,
    keys: *const DLTensor,
    blocks: Option<(*const DLTensor, u32)>,
    ratio: u32,
    q_quant: i32,
    logits_out: *const DLTensor,
) -> Result<()> {
    let query_quant = query_quant_arg(q_quant)?;
    // SAFETY: caller's contract (see above).
    let (qv, wv, pv, kv, mut out) = unsafe {
        (
            host(q, Q.name)?,
            host(w, W.name)?,
            host(positions, POSITIONS.name)?,
            host(keys, KEYS.name)?,
            host(logits_out, LOGITS_OUT.name)?,
        )
    };
    let mut dims = Dims::default();
    qv.expect(&Q, &mut dims)?;
    wv.expect(&W, &mut dims)?;
    pv.expect(&POSITIONS, &mut dims)?;
    let key_form = if kv.dtype() == DType::U8 {
        &KEYS_MXFP4
    } else {
        &KEYS
    };
    kv.expect(key_form, &mut dims)?;
    out.expect(&LOGITS_OUT, &mut dims)?;
    let bv = match blocks {
        // SAFETY: caller's contract (see above).
        Some((b, _)) => Some(unsafe { host(b, BLOCKS.name) }?),
        None => None,
    };
    if let Some(b) = &bv {
        b.expect(&BLOCKS, &mut dims)?;
    }
    let mut inputs = vec![&qv, &wv, &pv, &kv];
    inputs.extend(bv.as_ref());
    check_disjoint(&inputs, &[&out])?;
    let params = IndexerParams {
        ratio: ratio as usize,
        heads: qv.shape()[1],
        query_quant,
    };
    let (qf, wf, pos) = (qv.f32s()?, wv.f32s()?, pv.i64s()?);
    let kf;
    let keys = if kv.dtype() == DType::U8 {
        IndexKeys::Mxfp4(kv.bytes()?)
    } else {
        kf = kv.f32s()?;
        IndexKeys::F32(&kf)
    };
    let qs = IndexerQueries {
        q: &qf,
        w: &wf,
        positions: &pos,
    };
    match (&bv, blocks) {
        (Some(b), Some((_, block_size))) => {
            let cp = CandidateParams {
                block_size: block_size as usize,
                num_blocks: b.shape()[1].max(1),
            };
            let ids = b.i32s()?;
            fill_floats(&mut out, |o| {
                crate::ops::indexer::logits_in_blocks(&params, &qs, keys, ids, &cp, o)
            })
        }
        _ => fill_floats(&mut out, |o| {
            crate::ops::indexer::logits(&params, &qs, keys, o)
        }),
    }
}

/// Arguments of [`csa2_indexer_logits_pool`] (shapes there).
/// Set `struct_size` to `sizeof(Csa2IndexerLogitsPoolArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2IndexerLogitsPoolArgs {
    /// `sizeof(Csa2IndexerLogitsPoolArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// `(T, H, 128)` float RoPE'd index Q.
    pub q: *const DLTensor,
    /// `(T, H)` float head weights (already scaled).
    pub w: *const DLTensor,
    /// `(T)` int token positions.
    pub positions: *const DLTensor,
    /// `(T)` int32 request of each row (a row of `block_table`).
    pub req: *const DLTensor,
    /// The index-K pool: `[blocks, states_per_page, 68]` uint8 strided view, format 1 (MXFP4),
    /// layout 1 (block-planar), as vLLM 0.33 hands the indexer's cache to the layer.
    pub keys: super::Csa2Pool,
    /// `(R, B)` int32 block table (−1 = unmapped).
    pub block_table: *const DLTensor,
    /// Compression ratio (≥ 1).
    pub ratio: u32,
    /// Fake quantisation of Q: 0 none, 1 MXFP4 (V4.1), 2 FP8 E4M3 (launch day).
    pub q_quant: i32,
    /// Output `(T, N)` float: entries `0..N` of each row's request.
    pub logits_out: *const DLTensor,
    /// `cudaStream_t` / `CUstream` to launch on (CUDA only; 0 = the legacy default stream).
    /// Borrowed: csa2 neither synchronizes nor keeps it.
    pub stream: u64,
    /// Optional `[4]` int32 on the call's device (added after the first version: a caller whose
    /// `struct_size` ends before it passes none). On CUDA the kernel records the first bad value
    /// here — `{1 = request / 2 = block / 3 = position, row, column, value}` — and writes −∞ for
    /// what it touches; the caller zeroes it once and reads it whenever it syncs. On the host bad
    /// values are an error status instead (nothing written) and the tensor is left as it is.
    pub error: *const DLTensor,
}

// SAFETY: #[repr(C)], `struct_size: usize` first, every field a pointer, an integer or a
// `Csa2Pool` of those, so all-zero bytes are a valid value. The first version ended at `error`.
unsafe impl super::ArgsStruct for Csa2IndexerLogitsPoolArgs {
    const NAME: &'static str = "Csa2IndexerLogitsPoolArgs";
    const V1_SIZE: usize = std::mem::offset_of!(Csa2IndexerLogitsPoolArgs, error);
}

impl Default for Csa2IndexerLogitsPoolArgs {
    /// All members zero, `struct_size` set (the C recipe).
    fn default() -> Self {
        super::zeroed_args()
    }
}

/// Lightning-indexer logits over vLLM's paged MXFP4 index-K cache read **in place** (docs/SPEC.md
/// §2 "Indexer"; docs/VLLM.md "890 B/token on Hopper"): row t of request `req[t]` scores entries
/// `0..N` of that request, entry j at slot `block_table[req[t], j / states_per_page] ·
/// states_per_page + j % states_per_page` of `keys` (a strided `[blocks, states_per_page, 68]`
/// block-planar pool whose `stride(0)` is the per-block slab, as in [`super::csa2_attention_pools`]);
/// `logits[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j)` for visible (`j < (positions[t] + 1) div
/// ratio`), mapped entries, −∞ elsewhere. Each record is decoded exactly at use: no gather.
/// Follow with [`super::csa2_topk`] for the top-k entry ids.
///
/// Devices: every tensor (and the pool) `kDLCPU` → the CPU path, in place on the strided pool;
/// all `kDLCUDA` on one device → csa2's kernel (`indexer_logits_pool_f32_q*`, the entry point of
/// `q_quant`) launched on `stream` (asynchronous: returns after the launch; nothing is copied to
/// the host, nothing synchronizes, nothing is allocated; CUDA-graph capturable once the modules
/// are loaded, see
/// [`super::csa2_cuda_preload`]). `q`, `w` and `logits_out` are float32, bfloat16 or float16 on
/// both devices; at most 32 heads on CUDA; bad requests, blocks or positions are not seen on the
/// host but recorded in `error` (the kernel writes −∞ for what they touch). A build without the
/// `cuda` feature returns `CSA2_ERR_NO_CUDA_BUILD` for CUDA tensors.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` (ratio 0, `q_quant`, a pool that is not MXFP4 / block-planar,
/// a request or block outside the table / pool (host), a negative position (host), mixed devices,
/// an output overlapping an input), `CSA2_ERR_SHAPE`, `CSA2_ERR_UNSUPPORTED`, `CSA2_ERR_CUDA`,
/// plus the common ones. Nothing is written on error.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2IndexerLogitsPoolArgs`. Its members:
/// each tensor pointer null or a readable `DLTensor` whose memory stays valid and unused by other
/// threads for the call (on CUDA: until the kernel has run on `stream`); `keys.tensor`'s extent
/// (`(blocks − 1) · stride(0) + page bytes` from `data + byte_offset`) readable on its device.
#[no_mangle]
pub unsafe extern "C" fn csa2_indexer_logits_pool(
    args: *const Csa2IndexerLogitsPoolArgs,
) -> Csa2Status {
    guarded("csa2_indexer_logits_pool", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let a: Csa2IndexerLogitsPoolArgs = unsafe { super::read_args(args) }?;
        // SAFETY: caller's contract (see above).
        unsafe { indexer_pool(&a) }
    })
}

/// The C ABI's `q_quant` argument (0 none, 1 MXFP4, 2 FP8) as the op's [`QueryQuant`].
fn query_quant_arg(v: i32) -> Result<QueryQuant> {
    match v {
        0 => Ok(QueryQuant::None),
        1 => Ok(QueryQuant::Mxfp4),
        2 => Ok(QueryQuant::Fp8),
        v => Err(Error::invalid(
            "q_quant",
            format!("0 none, 1 mxfp4 or 2 fp8, found {v}"),
        )),
    }
}

/// # Safety
/// As [`csa2_indexer_logits_pool`].
unsafe fn indexer_pool(a: &Csa2IndexerLogitsPoolArgs) -> Result<()> {
    use super::dlpack::View;
    use crate::ops::indexer::{logits_in_pool_view, PoolPlace, PoolQueries};
    let query_quant = query_quant_arg(a.q_quant)?;
    // SAFETY: caller's contract (see above).
    let pool =
        unsafe { super::attention_pools::pool_arg_of(&a.keys, "keys", INDEX_DIM, "1 mxfp4") }?
            .ok_or(Error::NullPointer("keys.tensor"))?;
    // SAFETY: caller's contract (see above).
    let (qv, wv, pv, rv, bv, mut out, mut err) = unsafe {
        (
            View::from_raw(a.q, Q.name)?,
            View::from_raw(a.w, W.name)?,
            View::from_raw(a.positions, POSITIONS.name)?,
            View::from_raw(a.req, REQ.name)?,
            View::from_raw(a.block_table, BLOCK_TABLE.name)?,
            View::from_raw(a.logits_out, LOGITS_OUT.name)?,
            View::from_raw_opt(a.error, ERROR.name)?,
        )
    };
    let mut outs = vec![&out];
    outs.extend(err.as_ref());
    check_disjoint(&[&qv, &wv, &pv, &rv, &bv], &outs)?;
    let heads = qv.shape().get(1).copied().unwrap_or(0);
    let params = IndexerParams {
        ratio: a.ratio as usize,
        heads,
        query_quant,
    };
    // SAFETY: the caller keeps the pool's extent valid on its device for the call.
    let keys = unsafe { PoolPlace::new(pool.desc, pool.addr, pool.device) };
    let call = PoolQueries {
        q: qv.tensor(),
        w: wv.tensor(),
        positions: pv.tensor(),
        req: rv.tensor(),
        block_table: bv.tensor(),
        keys,
    };
    let mut ev = err.as_mut().map(|e| e.tensor_mut()).transpose()?;
    logits_in_pool_view(
        &params,
        &call,
        &mut out.tensor_mut()?,
        ev.as_mut(),
        a.stream,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::dlpack::{K_DL_CUDA, K_DL_UINT};
    use crate::ffi::test_support::{desc, host_tensor, last_error};
    use crate::ops::pool::{PoolDesc, PoolLayout, PoolView};

    /// `csa2_indexer_logits_pool` through the C ABI equals the Rust entry on a strided, offset
    /// slab, for a caller of the first struct version (no `error` member) and of this one; CUDA
    /// tensors among host ones are a mixed-device error.
    #[test]
    fn pool_export_equals_the_rust_entry_for_both_struct_versions() {
        let (spp, blocks) = (4usize, 3usize);
        let (stride, offset) = (spp * 68 + 12, 5usize);
        let mut slab: Vec<u8> = (0..offset + blocks * stride)
            .map(|i| (i % 251) as u8)
            .collect();
        let pd = PoolDesc {
            format: crate::formats::RecordFormat::Mxfp4Index,
            layout: PoolLayout::BlockPlanar,
            blocks,
            states_per_page: spp,
            block_stride: stride,
        };
        for slot in 0..blocks * spp {
            let row: Vec<f32> = (0..INDEX_DIM)
                .map(|i| ((slot * 131 + i * 7) % 23) as f32 / 5.0 - 2.0)
                .collect();
            let mut rec = [0u8; 68];
            crate::formats::encode_rows(crate::formats::RecordFormat::Mxfp4Index, &row, &mut rec)
                .unwrap();
            let (d, s) = pd.offsets(slot);
            slab[offset + d..][..64].copy_from_slice(&rec[..64]);
            slab[offset + s..][..4].copy_from_slice(&rec[64..]);
        }
        let (t, h, mb) = (3usize, 2usize, 2usize);
        let n_cols = mb * spp;
        let mut q: Vec<f32> = (0..t * h * INDEX_DIM)
            .map(|i| ((i * 17) % 29) as f32 / 14.0 - 1.0)
            .collect();
        let mut w = vec![0.5f32, -0.25, 1.0, 0.125, 0.75, 2.0];
        let mut pos = vec![1i64, 6, 7];
        let mut req = vec![0i32, 1, 1];
        let mut table = vec![2i32, -1, 0, 1];
        let view = PoolView::new(pd, &slab[offset..], "keys").unwrap();
        let mut want = vec![0f32; t * n_cols];
        let p = IndexerParams {
            ratio: 1,
            heads: h,
            query_quant: QueryQuant::None,
        };
        let qs = IndexerQueries {
            q: &q,
            w: &w,
            positions: &pos,
        };
        crate::ops::indexer::logits_in_pool(&p, &qs, &req, &view, &table, mb, n_cols, &mut want)
            .unwrap();
        let mut out = vec![9f32; t * n_cols];
        let (mut sq, mut sw, mut sp, mut sr, mut sb, mut so) = (
            [t as i64, h as i64, INDEX_DIM as i64],
            [t as i64, h as i64],
            [t as i64],
            [t as i64],
            [2i64, mb as i64],
            [t as i64, n_cols as i64],
        );
        let (mut ks, mut kst) = ([blocks as i64, spp as i64, 68], [stride as i64, 68, 1]);
        let tq = desc(&mut q, &mut sq, DType::F32);
        let tw = desc(&mut w, &mut sw, DType::F32);
        let tp = desc(&mut pos, &mut sp, DType::I64);
        let tr = desc(&mut req, &mut sr, DType::I32);
        let tb = desc(&mut table, &mut sb, DType::I32);
        let to = desc(&mut out, &mut so, DType::F32);
        let mut tk = host_tensor(
            slab.as_mut_ptr().cast(),
            K_DL_UINT,
            8,
            &mut ks,
            Some(&mut kst),
        );
        tk.byte_offset = offset as u64;
        let args = Csa2IndexerLogitsPoolArgs {
            struct_size: std::mem::size_of::<Csa2IndexerLogitsPoolArgs>(),
            q: &tq,
            w: &tw,
            positions: &tp,
            req: &tr,
            keys: super::super::Csa2Pool {
                tensor: &tk,
                format: 1,
                layout: 1,
            },
            block_table: &tb,
            ratio: 1,
            q_quant: 0,
            logits_out: &to,
            stream: 0,
            error: std::ptr::null(),
        };
        let v1 = Csa2IndexerLogitsPoolArgs {
            struct_size: std::mem::offset_of!(Csa2IndexerLogitsPoolArgs, error),
            ..args
        };
        let mut cuda_q = tq;
        cuda_q.device.device_type = K_DL_CUDA;
        let mixed = Csa2IndexerLogitsPoolArgs { q: &cuda_q, ..args };
        assert_eq!(
            unsafe { csa2_indexer_logits_pool(&mixed) },
            Csa2Status::Csa2ErrInvalidArgument
        );
        assert!(last_error().contains("device"), "{}", last_error());
        assert!(out.iter().all(|&v| v == 9.0), "written on error");
        for a in [v1, args] {
            out.fill(9.0);
            assert_eq!(
                unsafe { csa2_indexer_logits_pool(&a) },
                Csa2Status::Csa2Ok,
                "{}",
                last_error()
            );
            assert_eq!(out, want);
        }
    }
}
