//! `csa2_indexer_logits` and `csa2_indexer_logits_in_blocks`: the C face of [`crate::ops::indexer`]
//! (conventions: the op section of [`super`]).

use super::dlpack::{check_disjoint, fill_floats, host, DLTensor, DType};
use super::{guarded, Csa2Status};
use crate::error::{Error, Result};
use crate::ops::candidates::CandidateParams;
use crate::ops::indexer::signature::{
    BLOCKS, BLOCK_TABLE, KEYS, KEYS_MXFP4, LOGITS_OUT, POSITIONS, Q, REQ, W,
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
    let query_quant = match q_quant {
        0 => QueryQuant::None,
        1 => QueryQuant::Mxfp4,
        2 => QueryQuant::Fp8,
        v => {
            return Err(Error::invalid(
                "q_quant",
                format!("0 none, 1 mxfp4 or 2 fp8, found {v}"),
            ))
        }
    };
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
    /// `cudaStream_t` for a CUDA call (reserved: CUDA pools are refused today, see the entry).
    pub stream: u64,
}

args_struct!(Csa2IndexerLogitsPoolArgs);

/// Lightning-indexer logits over vLLM's paged MXFP4 index-K cache read **in place** (docs/SPEC.md
/// §2 "Indexer"; docs/VLLM.md "890 B/token on Hopper"): row t of request `req[t]` scores entries
/// `0..N` of that request, entry j at slot `block_table[req[t], j / states_per_page] ·
/// states_per_page + j % states_per_page` of `keys` (a strided `[blocks, states_per_page, 68]`
/// block-planar pool whose `stride(0)` is the per-block slab, as in [`super::csa2_attention_pools`]);
/// `logits[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j)` for visible (`j < (positions[t] + 1) div
/// ratio`), mapped entries, −∞ elsewhere. Each record is decoded exactly at use: no gather.
/// Follow with [`super::csa2_topk`] for the top-k entry ids.
///
/// Devices: every tensor `kDLCPU`. CUDA pools answer `CSA2_ERR_UNSUPPORTED` today: csa2's CUDA
/// indexer kernel (`kernels/indexer.cu`) reads compact pages, not a strided slab.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` (ratio 0, `q_quant`, a pool that is not MXFP4 / block-planar,
/// a request or block outside the table / pool, a negative position, an output overlapping an
/// input), `CSA2_ERR_SHAPE`, `CSA2_ERR_UNSUPPORTED`, plus the common ones.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2IndexerLogitsPoolArgs`. Its members:
/// each tensor pointer null or a readable `DLTensor` whose memory stays valid and unused by other
/// threads for the call; `keys.tensor`'s extent (`(blocks − 1) · stride(0) + page bytes` from
/// `data + byte_offset`) readable.
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

/// # Safety
/// As [`csa2_indexer_logits_pool`].
unsafe fn indexer_pool(a: &Csa2IndexerLogitsPoolArgs) -> Result<()> {
    use super::dlpack::Device;
    use crate::ops::attention::{PoolLayout, PoolView};
    let query_quant = match a.q_quant {
        0 => QueryQuant::None,
        1 => QueryQuant::Mxfp4,
        2 => QueryQuant::Fp8,
        v => {
            return Err(Error::invalid(
                "q_quant",
                format!("0 none, 1 mxfp4 or 2 fp8, found {v}"),
            ))
        }
    };
    // SAFETY: caller's contract (see above).
    let pool =
        unsafe { super::attention_pools::pool_arg_of(&a.keys, "keys", INDEX_DIM, "1 mxfp4") }?
            .ok_or(Error::NullPointer("keys.tensor"))?;
    if pool.desc.format != crate::formats::RecordFormat::Mxfp4Index {
        return Err(Error::invalid(
            "keys.format",
            format!(
                "the pooled indexer reads MXFP4 index K (1), found {}",
                a.keys.format
            ),
        ));
    }
    if pool.desc.layout != PoolLayout::BlockPlanar {
        return Err(Error::invalid(
            "keys.layout",
            "vLLM's index-K pages are block-planar (1): all values of a page, then all scales",
        ));
    }
    if pool.device != Device::Cpu {
        return Err(Error::Unsupported(
            "csa2_indexer_logits_pool reads host pools only: csa2's CUDA indexer kernel reads \
             compact pages, not vLLM's strided slab"
                .into(),
        ));
    }
    // SAFETY: caller's contract (see above).
    let (qv, wv, pv, rv, bv, mut out) = unsafe {
        (
            host(a.q, "q")?,
            host(a.w, "w")?,
            host(a.positions, "positions")?,
            host(a.req, "req")?,
            host(a.block_table, "block_table")?,
            host(a.logits_out, "logits_out")?,
        )
    };
    let mut dims = Dims::default();
    qv.expect(&Q, &mut dims)?;
    wv.expect(&W, &mut dims)?;
    pv.expect(&POSITIONS, &mut dims)?;
    rv.expect(&REQ, &mut dims)?;
    bv.expect(&BLOCK_TABLE, &mut dims)?;
    out.expect(&LOGITS_OUT, &mut dims)?;
    check_disjoint(&[&qv, &wv, &pv, &rv, &bv], &[&out])?;
    if super::attention_pools::overlaps(&out.byte_range(), &pool.range()) {
        return Err(Error::invalid(
            "logits_out",
            "overlaps `keys`; outputs must not alias any other argument",
        ));
    }
    // SAFETY: a host pool (checked) whose extent the caller keeps readable, apart from `out`.
    let bytes = unsafe { std::slice::from_raw_parts(pool.addr as *const u8, pool.desc.extent()) };
    let view = PoolView::new(pool.desc, bytes, "keys")?;
    let params = IndexerParams {
        ratio: a.ratio as usize,
        heads: qv.shape()[1],
        query_quant,
    };
    let (qf, wf, pos) = (qv.f32s()?, wv.f32s()?, pv.i64s()?);
    let qs = IndexerQueries {
        q: &qf,
        w: &wf,
        positions: &pos,
    };
    let n_cols = out.shape()[1];
    let max_blocks = bv.shape()[1];
    let (req, table) = (rv.i32s()?, bv.i32s()?);
    fill_floats(&mut out, |o| {
        crate::ops::indexer::logits_in_pool(&params, &qs, req, &view, table, max_blocks, n_cols, o)
    })
}
