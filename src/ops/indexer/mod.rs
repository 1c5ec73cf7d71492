//! Lightning indexer logits (docs/SPEC.md §2.5).
//!
//! For a query at position p with index Q `q[h, 0..128]` (RoPE'd, h < 32) and head weights `w[h]`
//! (already scaled by `128^-0.5 · 32^-0.5`), the logit of compressed entry j is
//! `logit[j] = Σ_h w[h] · ReLU(q[h] · k_j)` for the visible entries `j < (p + 1) div m`; every other
//! entry is −∞. Keys are MXFP4 index-K records (68 B, the cache format, decoded on the fly by the
//! fast path) or f32 rows. Queries may be fake-quantised first ([`QueryQuant`]).
//!
//! Shapes: `q` (tokens, heads, 128) f32, `w` (tokens, heads) f32, `positions` (tokens) i64, keys
//! (entries, 128) f32 or (entries, 68) u8, logits (tokens, entries) f32.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dot;
pub mod reference;

use crate::error::{Error, Result};
use crate::formats::{RecordFormat, MXFP4_INDEX_BYTES};
use crate::ops::candidates::CandidateParams;
use crate::tensor::{Device, TensorView, TensorViewMut};

/// Index-K / index-Q head dim and the indexer heads of V4.1 (the geometry's,
/// [`crate::geometry::consts`]).
pub use crate::geometry::consts::{INDEX_DIM, INDEX_HEADS};

/// Index keys of one sequence: entry j is row j.
#[derive(Debug, Clone, Copy)]
pub enum IndexKeys<'a> {
    /// f32 rows (entries, 128).
    F32(&'a [f32]),
    /// MXFP4 index-K records (entries, 68): 64 B E2M1 then 4 E8M0 scales.
    Mxfp4(&'a [u8]),
}

impl IndexKeys<'_> {
    /// Number of entries.
    pub fn len(&self) -> usize {
        match self {
            IndexKeys::F32(k) => k.len() / INDEX_DIM,
            IndexKeys::Mxfp4(k) => k.len() / MXFP4_INDEX_BYTES,
        }
    }
    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn check(&self) -> Result<()> {
        let (n, unit, what) = match self {
            IndexKeys::F32(k) => (k.len(), INDEX_DIM, "index keys k (f32)"),
            IndexKeys::Mxfp4(k) => (k.len(), MXFP4_INDEX_BYTES, "index keys k_mxfp4 (u8)"),
        };
        if n % unit != 0 {
            return Err(Error::shape(
                what,
                format!("[N, {unit}]"),
                format!("{n} values"),
            ));
        }
        Ok(())
    }
    /// Entry j as f32 (the exact decoded values for MXFP4).
    pub fn row(&self, j: usize, out: &mut [f32; INDEX_DIM]) {
        match self {
            IndexKeys::F32(k) => out.copy_from_slice(&k[j * INDEX_DIM..][..INDEX_DIM]),
            IndexKeys::Mxfp4(k) => {
                let rec = &k[j * MXFP4_INDEX_BYTES..][..MXFP4_INDEX_BYTES];
                RecordFormat::Mxfp4Index.decode_row(&rec[..64], &rec[64..], out);
            }
        }
    }
}

/// Fake quantisation applied to the index Q before scoring (quantise → dequantise per head row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueryQuant {
    /// f32 Q as given.
    #[default]
    None,
    /// MXFP4 (DeepSeek ceil rule, blocks of 32, E8M0 scales): the V4.1 deployment choice.
    Mxfp4,
    /// E4M3 with one power-of-two scale per (token, head) (the launch-day FP8 index path).
    Fp8,
    /// Rounded to bf16 (RNE; NaN stays NaN): with MXFP4 keys, which are exact in bf16, every
    /// product is exact and the bf16 dot kernel (`vdpbf16ps`) scores it.
    Bf16,
}

impl QueryQuant {
    /// Parses `none`, `mxfp4`, `fp8` or `bf16`.
    pub fn from_name(s: &str) -> Result<QueryQuant> {
        match s {
            "none" => Ok(QueryQuant::None),
            "mxfp4" => Ok(QueryQuant::Mxfp4),
            "fp8" => Ok(QueryQuant::Fp8),
            "bf16" => Ok(QueryQuant::Bf16),
            _ => Err(Error::invalid(
                "q_quant",
                format!("expected none, mxfp4, fp8 or bf16, found `{s}`"),
            )),
        }
    }
    /// Quantises and dequantises one 128-value head row in place.
    pub fn apply(self, row: &mut [f32]) {
        let fmt = match self {
            QueryQuant::None => return,
            QueryQuant::Bf16 => {
                row.iter_mut()
                    .for_each(|v| *v = crate::formats::scalar::bf16_round(*v));
                return;
            }
            QueryQuant::Mxfp4 => RecordFormat::Mxfp4Index,
            QueryQuant::Fp8 => RecordFormat::Fp8Index,
        };
        let mut rec = [0u8; 132];
        let (d, s) = rec[..fmt.record_bytes()].split_at_mut(fmt.data_bytes());
        fmt.encode_row(row, d, s);
        fmt.decode_row(d, s, row);
    }
}

/// Indexer parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexerParams {
    /// Compression ratio m of the key source (1 or 2).
    pub ratio: usize,
    /// Index heads (32).
    pub heads: usize,
    /// Query quantisation.
    pub query_quant: QueryQuant,
}

impl IndexerParams {
    /// V4.1 defaults for a key source of ratio `ratio`.
    pub fn new(ratio: usize) -> IndexerParams {
        IndexerParams {
            ratio,
            heads: INDEX_HEADS,
            query_quant: QueryQuant::None,
        }
    }
}

/// One sequence's index queries.
#[derive(Debug, Clone, Copy)]
pub struct IndexerQueries<'a> {
    /// (tokens, heads, 128) f32, RoPE'd.
    pub q: &'a [f32],
    /// (tokens, heads) f32, already scaled.
    pub w: &'a [f32],
    /// (tokens) absolute positions.
    pub positions: &'a [i64],
}

impl IndexerQueries<'_> {
    /// A NaN or ±∞ in `q` or `w` is an [`Error::Invalid`] naming the token and head: the score's
    /// ReLU (`max(x, 0)`) would turn a NaN dot into a silent 0 instead of failing. (Shapes are
    /// checked before this.)
    pub fn check_finite(&self, heads: usize) -> Result<()> {
        for (what, v, row) in [
            ("indexer q", self.q, heads * INDEX_DIM),
            ("indexer w", self.w, heads),
        ] {
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                let per_head = row / heads.max(1);
                return Err(Error::invalid(
                    what,
                    format!(
                        "non-finite value {} at token {}, head {}",
                        v[i],
                        i / row.max(1),
                        (i % row.max(1)) / per_head.max(1)
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A paged MXFP4 index-K cache as the batched (CUDA) indexer reads it: entry j of request r is
/// at slot [`block_table_slot`](crate::formats::page::block_table_slot)`(block_table[r], j,
/// page_slots)`; an unmapped entry scores −∞.
#[derive(Debug, Clone, Copy)]
pub struct IndexCache<'a> {
    /// The page pool (n_pages × page_slots × 68 B, block-planar).
    pub pages: &'a [u8],
    /// (requests, max_blocks) i32, -1 = unmapped.
    pub block_table: &'a [i32],
    /// Columns of the block table.
    pub max_blocks: usize,
    /// Records per page.
    pub page_slots: usize,
}

impl IndexCache<'_> {
    /// Requests (rows of the block table).
    pub fn requests(&self) -> usize {
        self.block_table.len() / self.max_blocks.max(1)
    }
    /// Checks the pool and the table: whole pages, whole table rows, every block in the pool.
    ///
    /// Errors: [`Error::Shape`] / [`Error::Invalid`] naming the argument.
    pub fn check(&self) -> Result<()> {
        if self.page_slots == 0 {
            return Err(Error::invalid("page_slots", "must be at least 1"));
        }
        if self.block_table.len() != self.requests() * self.max_blocks {
            return Err(Error::shape(
                "index block_table",
                format!("[requests, max_blocks={}]", self.max_blocks),
                format!("{} values", self.block_table.len()),
            ));
        }
        let page = self.page_slots * MXFP4_INDEX_BYTES;
        if !self.pages.len().is_multiple_of(page) {
            return Err(Error::shape(
                "index page pool bytes",
                format!("a multiple of {page}"),
                self.pages.len(),
            ));
        }
        let n_pages = self.pages.len() / page;
        if let Some(&b) = self
            .block_table
            .iter()
            .find(|&&b| b < -1 || b as i64 >= n_pages as i64)
        {
            return Err(Error::invalid(
                "index block_table",
                format!("block {b} is outside the {n_pages} pages"),
            ));
        }
        Ok(())
    }
}

pub use crate::ops::visible;

/// Validates shapes; returns the per-token visible counts.
fn check(
    p: &IndexerParams,
    qs: &IndexerQueries,
    keys: &IndexKeys,
    out_len: usize,
) -> Result<Vec<usize>> {
    if p.ratio == 0 {
        return Err(Error::invalid(
            "ratio",
            "the indexer needs a compressed layer (ratio ≥ 1), found 0",
        ));
    }
    if p.heads == 0 {
        return Err(Error::invalid("heads", "must be > 0"));
    }
    keys.check()?;
    let t = qs.positions.len();
    if qs.q.len() != t * p.heads * INDEX_DIM {
        return Err(Error::shape(
            "indexer q",
            format!("[T={t}, {}, {INDEX_DIM}]", p.heads),
            format!("{} values", qs.q.len()),
        ));
    }
    if qs.w.len() != t * p.heads {
        return Err(Error::shape(
            "indexer w",
            format!("[T={t}, {}]", p.heads),
            format!("{} values", qs.w.len()),
        ));
    }
    let n = keys.len();
    if out_len != t * n {
        return Err(Error::shape(
            "indexer logits",
            format!("[T={t}, N={n}]"),
            format!("{out_len} values"),
        ));
    }
    crate::ops::rope::check_positions(qs.positions)?;
    qs.check_finite(p.heads)?;
    let vis: Vec<usize> = qs
        .positions
        .iter()
        .map(|&pos| visible(pos, p.ratio))
        .collect();
    if let Some((i, &v)) = vis.iter().enumerate().find(|(_, &v)| v > n) {
        return Err(Error::shape(
            "index keys",
            format!(
                "at least {v} entries (token {i} at position {} with ratio {})",
                qs.positions[i], p.ratio
            ),
            format!("{n} entries"),
        ));
    }
    Ok(vis)
}

/// Dense logits (tokens, entries) of one sequence (fast path): −∞ where not visible.
///
/// Errors: [`Error::Shape`] for inconsistent shapes or too few keys for a query's visible range,
/// [`Error::Invalid`] for ratio 0 or a negative position.
pub fn logits(
    p: &IndexerParams,
    qs: &IndexerQueries,
    keys: IndexKeys,
    out: &mut [f32],
) -> Result<()> {
    let vis = check(p, qs, &keys, out.len())?;
    let prepared = cpu::Prepared::new(p, qs, vis);
    cpu::dense(&prepared, keys, out);
    Ok(())
}

/// Dense logits scored only inside candidate blocks: `blocks` (tokens, B) lists each query's pool
/// (block ids, −1 ends the list, any order); entries outside it are −∞ (the Reindex rule).
///
/// Errors: as [`logits`], plus [`Error::Shape`] when `blocks` is not (tokens, B) and
/// [`Error::Invalid`] for a block id past the keys.
pub fn logits_in_blocks(
    p: &IndexerParams,
    qs: &IndexerQueries,
    keys: IndexKeys,
    blocks: &[i32],
    cp: &CandidateParams,
    out: &mut [f32],
) -> Result<()> {
    let vis = check(p, qs, &keys, out.len())?;
    let pools = pools_of(qs.positions.len(), keys.len(), blocks, cp, &vis)?;
    let prepared = cpu::Prepared::new(p, qs, vis);
    cpu::pooled(&prepared, keys, &pools, out);
    Ok(())
}

/// Turns block lists (T, B) into sorted, visible entry ids per token (the Reindex pool).
///
/// Errors: [`Error::Shape`] when `blocks` is not (T, B), [`Error::Invalid`] for a block past the keys.
pub fn pools_of(
    t: usize,
    n: usize,
    blocks: &[i32],
    cp: &CandidateParams,
    vis: &[usize],
) -> Result<Vec<Vec<u32>>> {
    cp.validate()?;
    if t == 0 {
        return Ok(Vec::new());
    }
    if !blocks.len().is_multiple_of(t) {
        return Err(Error::shape(
            "candidate blocks",
            format!("[T={t}, B]"),
            format!("{} values", blocks.len()),
        ));
    }
    let b = blocks.len() / t;
    let nblocks = n.div_ceil(cp.block_size);
    (0..t)
        .map(|i| {
            let mut ids: Vec<i32> = blocks[i * b..(i + 1) * b]
                .iter()
                .copied()
                .take_while(|&x| x >= 0)
                .collect();
            if let Some(&bad) = ids.iter().find(|&&x| x as usize >= nblocks) {
                return Err(Error::invalid(
                    "blocks",
                    format!(
                        "token {i}: block {bad} is past the {n} keys ({nblocks} blocks of {})",
                        cp.block_size
                    ),
                ));
            }
            ids.sort_unstable();
            ids.dedup();
            Ok(ids
                .iter()
                .flat_map(|&blk| {
                    let s = blk as usize * cp.block_size;
                    (s..(s + cp.block_size).min(vis[i])).map(|j| j as u32)
                })
                .collect())
        })
        .collect()
}

/// The tensor signatures of the indexer (`csa2_indexer_logits`, `csa2_indexer_logits_in_blocks`,
/// `csa2 op indexer`). `keys` has two forms (float rows or MXFP4 records), declared once each.
pub mod signature {
    use crate::formats::MXFP4_INDEX_BYTES;
    pub use crate::ops::topk::signature::POSITIONS;
    use crate::shape::{Arg, Dim, Signature};
    use crate::tensor::{DType, FLOATS};

    /// `[T, H, 128]` float index queries, RoPE'd.
    pub const Q: Arg = Arg::read(
        "q",
        FLOATS,
        &[Dim::Any("T"), Dim::Any("H"), Dim::Fixed(super::INDEX_DIM)],
    );
    /// `[T, H]` float head weights, already scaled.
    pub const W: Arg = Arg::read("w", FLOATS, &[Dim::Any("T"), Dim::Any("H")]);
    /// `[N, 128]` float index keys (entry j = row j).
    pub const KEYS: Arg = Arg::read(
        "keys",
        FLOATS,
        &[Dim::Any("N"), Dim::Fixed(super::INDEX_DIM)],
    );
    /// `[N, 68]` uint8 MXFP4 index-K records: the other form of [`KEYS`].
    pub const KEYS_MXFP4: Arg = Arg::read(
        "keys",
        &[DType::U8],
        &[Dim::Any("N"), Dim::Fixed(MXFP4_INDEX_BYTES)],
    );
    /// `[T, B]` int32 candidate blocks (the Reindex path), −1 ends a row.
    pub const BLOCKS: Arg = Arg::read("blocks", &[DType::I32], &[Dim::Any("T"), Dim::Any("B")]);
    /// `[T, N]` float logits, −∞ where not visible (or outside the pool).
    pub const LOGITS_OUT: Arg = Arg::write("logits_out", FLOATS, &[Dim::Any("T"), Dim::Any("N")]);
    /// `csa2_indexer_logits` (either form of `keys`).
    pub const LOGITS: Signature = Signature {
        op: "indexer_logits",
        args: &[Q, W, POSITIONS, KEYS, KEYS_MXFP4, LOGITS_OUT],
    };
    /// `csa2_indexer_logits_in_blocks`.
    pub const LOGITS_IN_BLOCKS: Signature = Signature {
        op: "indexer_logits_in_blocks",
        args: &[Q, W, POSITIONS, KEYS, KEYS_MXFP4, BLOCKS, LOGITS_OUT],
    };
    /// `[T]` int32 request of each query row (a row of [`BLOCK_TABLE`]).
    pub const REQ: Arg = Arg::read("req", &[DType::I32], &[Dim::Any("T")]);
    /// `[R, B]` int32 block table of the index-K pool, −1 = unmapped.
    pub const BLOCK_TABLE: Arg = Arg::read(
        "block_table",
        &[DType::I32],
        &[Dim::Any("R"), Dim::Any("B")],
    );
    /// `csa2_indexer_logits_pool` (the index-K pool itself is a strided pool descriptor,
    /// checked by [`crate::ops::pool::PoolView`]).
    pub const LOGITS_POOL: Signature = Signature {
        op: "indexer_logits_pool",
        args: &[Q, W, POSITIONS, REQ, BLOCK_TABLE, LOGITS_OUT, ERROR],
    };
    /// `[4]` int32 error record of a CUDA call (see [`super::logits_in_pool_view`]).
    pub const ERROR: Arg = Arg::write("error", &[DType::I32], &[Dim::Fixed(4)]).optional();
}

/// Logits (T, `n_cols`) of T query rows of any requests over an MXFP4 index-K pool read **in
/// place** (vLLM 0.33's index-K pages: a strided `[blocks, states_per_page, 68]` view whose
/// `stride(0)` is the per-block slab, block-planar records; [`PoolView`](crate::ops::pool::PoolView)).
/// Row t belongs to request `req[t]`; its entry j lives at slot
/// [`block_table_slot`](crate::formats::page::block_table_slot)`(block_table[req[t]], j,
/// states_per_page)`. `logits[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j)` for visible (`j < (p + 1)
/// div ratio`) and mapped entries, −∞ elsewhere. Each listed record is decoded exactly at use (no
/// gather of the pool); dot products and sums in f32 ([`crate::tolerance::F32_VS_F64`] against
/// [`reference::logits_paged`] on the same codes).
///
/// Shapes: `block_table` (requests, `max_blocks`) i32 (−1 = unmapped), `req` (T) i32, `out`
/// (T, `n_cols`) f32, q/w as [`IndexerQueries`].
///
/// Errors (nothing written): [`Error::Invalid`] for ratio 0, no heads, a pool that is not MXFP4
/// index K, a request or block outside the table / pool, a negative position; [`Error::Shape`] for
/// inconsistent shapes.
#[allow(clippy::too_many_arguments)]
pub fn logits_in_pool(
    p: &IndexerParams,
    qs: &IndexerQueries,
    req: &[i32],
    pool: &crate::ops::pool::PoolView,
    block_table: &[i32],
    max_blocks: usize,
    n_cols: usize,
    out: &mut [f32],
) -> Result<()> {
    use rayon::prelude::*;
    if p.ratio == 0 {
        return Err(Error::invalid(
            "ratio",
            "the indexer needs a compressed layer (ratio ≥ 1), found 0",
        ));
    }
    if p.heads == 0 {
        return Err(Error::invalid("heads", "must be > 0"));
    }
    let desc = *pool.desc();
    if desc.format != RecordFormat::Mxfp4Index {
        return Err(Error::invalid(
            "index-K pool format",
            format!(
                "the pooled indexer reads MXFP4 index K, found {}",
                desc.format.name()
            ),
        ));
    }
    let t = qs.positions.len();
    for (what, got, want) in [
        ("indexer q", qs.q.len(), t * p.heads * INDEX_DIM),
        ("indexer w", qs.w.len(), t * p.heads),
        ("indexer req", req.len(), t),
        ("indexer logits", out.len(), t * n_cols),
    ] {
        if got != want {
            return Err(Error::shape(
                what,
                format!("{want} values (T={t}, {} heads, {n_cols} columns)", p.heads),
                format!("{got} values"),
            ));
        }
    }
    if max_blocks == 0 && !block_table.is_empty()
        || max_blocks > 0 && !block_table.len().is_multiple_of(max_blocks)
    {
        return Err(Error::shape(
            "index block_table",
            format!("[requests, max_blocks={max_blocks}]"),
            format!("{} values", block_table.len()),
        ));
    }
    let requests = block_table.len().checked_div(max_blocks).unwrap_or(0);
    if let Some((i, &r)) = req
        .iter()
        .enumerate()
        .find(|(_, &r)| r < 0 || r as usize >= requests)
    {
        return Err(Error::invalid(
            "indexer req",
            format!("row {i}: request {r} is outside the block table's {requests} rows"),
        ));
    }
    if let Some(&b) = block_table
        .iter()
        .find(|&&b| b < -1 || b as i64 >= desc.blocks as i64)
    {
        return Err(Error::invalid(
            "index block_table",
            format!("block {b} is outside the pool's {} blocks", desc.blocks),
        ));
    }
    crate::ops::rope::check_positions(qs.positions)?;
    qs.check_finite(p.heads)?;
    let spp = desc.states_per_page;
    out.par_chunks_mut(n_cols.max(1))
        .take(t)
        .enumerate()
        .for_each(|(row, o)| {
            let vis = visible(qs.positions[row], p.ratio).min(n_cols);
            let bt = &block_table[req[row] as usize * max_blocks..][..max_blocks];
            let q: Vec<[f32; INDEX_DIM]> = (0..p.heads)
                .map(|h| {
                    let mut r = [0f32; INDEX_DIM];
                    r.copy_from_slice(&qs.q[(row * p.heads + h) * INDEX_DIM..][..INDEX_DIM]);
                    p.query_quant.apply(&mut r);
                    r
                })
                .collect();
            let w = &qs.w[row * p.heads..][..p.heads];
            let mut k = [0f32; INDEX_DIM];
            for (j, oj) in o.iter_mut().enumerate() {
                *oj = f32::NEG_INFINITY;
                if j >= vis {
                    continue;
                }
                let Some(slot) = crate::formats::page::block_table_slot(bt, j as i64, spp) else {
                    continue;
                };
                // In range: every block of the table is inside the pool (checked above).
                let (d, s) = pool.parts(slot);
                RecordFormat::Mxfp4Index.decode_row(d, s, &mut k);
                let mut logit = 0f32;
                for (qh, &wh) in q.iter().zip(w) {
                    let dot: f32 = qh.iter().zip(&k).map(|(a, b)| a * b).sum();
                    logit += wh * dot.max(0.0);
                }
                *oj = logit;
            }
        });
    Ok(())
}

/// An index-K pool as [`logits_in_pool_view`] takes it: the strided descriptor and the address of
/// its first byte (`data + byte_offset` of vLLM's view), in host or device memory.
#[derive(Debug, Clone, Copy)]
pub struct PoolPlace {
    desc: crate::ops::pool::PoolDesc,
    addr: usize,
    device: Device,
}

impl PoolPlace {
    /// A pool of `desc.extent()` bytes at `addr` on `device`.
    ///
    /// # Safety
    /// Those bytes stay allocated, and unwritten by others, for every call the value is passed to
    /// (on CUDA: until the launch has run on its stream); on [`Device::Cpu`] they are readable.
    pub unsafe fn new(desc: crate::ops::pool::PoolDesc, addr: usize, device: Device) -> Self {
        PoolPlace { desc, addr, device }
    }
    /// The descriptor.
    pub fn desc(&self) -> &crate::ops::pool::PoolDesc {
        &self.desc
    }
    /// The address of the first byte.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Where the bytes live.
    pub fn device(&self) -> Device {
        self.device
    }
    fn range(&self) -> std::ops::Range<usize> {
        self.addr..self.addr + self.desc.extent()
    }
}

/// The tensors of one pooled indexer call ([`signature::LOGITS_POOL`]): shapes as
/// [`logits_in_pool`] (q `[T, H, 128]` and w `[T, H]` float, positions `[T]` int, req `[T]` and
/// block_table `[R, B]` int32).
#[derive(Debug, Clone, Copy)]
pub struct PoolQueries<'a> {
    /// RoPE'd index Q.
    pub q: &'a TensorView<'a>,
    /// Head weights, already scaled.
    pub w: &'a TensorView<'a>,
    /// Token positions.
    pub positions: &'a TensorView<'a>,
    /// Request (block-table row) of each query row.
    pub req: &'a TensorView<'a>,
    /// Block table of the index-K pool, −1 = unmapped.
    pub block_table: &'a TensorView<'a>,
    /// The index-K pool (MXFP4, block-planar).
    pub keys: PoolPlace,
}

/// [`logits_in_pool`] over tensor views, dispatched on their device (all on one): host memory
/// runs [`logits_in_pool`] in place on the strided pool; CUDA memory (feature `cuda`) launches
/// `indexer_logits_pool_f32_q*` (`kernels/indexer.cu`, one entry point per [`QueryQuant`]) on
/// `stream` — a `CUstream` of that device,
/// borrowed (0 = the legacy default stream) — and returns after the launch: nothing is allocated,
/// copied to or from the host, or synchronized, so a CUDA graph can capture it once the modules
/// are loaded (`csa2_cuda_preload`). The kernel scores 1..=32 heads of queries (quantised as
/// [`QueryQuant::apply`], bit for bit), the sums in f32 in another order than the CPU's (both within
/// [`crate::tolerance::F32_VS_F64`] of [`reference::logits_paged`]).
///
/// On CUDA the values are not read on the host: a negative position, a request outside the
/// table or a block outside the pool is written as −∞ for the entries it touches and recorded in
/// `error` (`[4]` int32 on the device, zeroed by the caller, written only on bad input:
/// `{1 request | 2 block | 3 position, row, column, value}`, the first one wins). On the host
/// those are the error (nothing written) and `error` is left as it is.
///
/// Errors: those of [`logits_in_pool`] (host); [`Error::Shape`] for a tensor off the signature
/// or (CUDA) not dense; [`Error::Invalid`] for mixed devices, a pool that is not
/// MXFP4 block-planar, an output overlapping an input; [`Error::Unsupported`] for more than 32
/// heads on CUDA; [`Error::NoCudaBuild`] for CUDA tensors without the `cuda` feature;
/// [`Error::Cuda`].
pub fn logits_in_pool_view(
    p: &IndexerParams,
    a: &PoolQueries<'_>,
    out: &mut TensorViewMut<'_>,
    error: Option<&mut TensorViewMut<'_>>,
    stream: u64,
) -> Result<()> {
    use crate::ops::pool::PoolLayout;
    use signature::{BLOCK_TABLE, ERROR, LOGITS_OUT, POSITIONS, Q, REQ, W};
    let desc = *a.keys.desc();
    if desc.format != RecordFormat::Mxfp4Index {
        return Err(Error::invalid(
            "keys.format",
            format!(
                "the pooled indexer reads MXFP4 index K, found {}",
                desc.format.name()
            ),
        ));
    }
    if desc.layout != PoolLayout::BlockPlanar {
        return Err(Error::invalid(
            "keys.layout",
            "vLLM's index-K pages are block-planar: all values of a page, then all scales",
        ));
    }
    let mut dims = crate::shape::Dims::default();
    a.q.expect(&Q, &mut dims)?;
    a.w.expect(&W, &mut dims)?;
    a.positions.expect(&POSITIONS, &mut dims)?;
    a.req.expect(&REQ, &mut dims)?;
    a.block_table.expect(&BLOCK_TABLE, &mut dims)?;
    out.expect(&LOGITS_OUT, &mut dims)?;
    if a.q.shape()[1] != p.heads {
        return Err(Error::shape(
            Q.name,
            format!("[T, H={}, {INDEX_DIM}]", p.heads),
            format!("{:?}", a.q.shape()),
        ));
    }
    let mut devices = vec![
        (Q.name, a.q.device()),
        (W.name, a.w.device()),
        (POSITIONS.name, a.positions.device()),
        (REQ.name, a.req.device()),
        (BLOCK_TABLE.name, a.block_table.device()),
        ("keys", a.keys.device()),
        (LOGITS_OUT.name, out.device()),
    ];
    crate::tensor::expect_optional(error.as_deref(), &ERROR, &mut dims, &mut devices)?;
    let device = crate::tensor::one_device(&devices)?;
    let overlaps = |x: &std::ops::Range<usize>, y: &std::ops::Range<usize>| {
        !x.is_empty() && !y.is_empty() && x.start < y.end && y.start < x.end
    };
    let mut writes = vec![(LOGITS_OUT.name, out.byte_range())];
    if let Some(e) = &error {
        writes.push((ERROR.name, e.byte_range()));
    }
    let reads = [
        (Q.name, a.q.byte_range()),
        (W.name, a.w.byte_range()),
        (POSITIONS.name, a.positions.byte_range()),
        (REQ.name, a.req.byte_range()),
        (BLOCK_TABLE.name, a.block_table.byte_range()),
        ("keys", a.keys.range()),
    ];
    for (i, (wn, wr)) in writes.iter().enumerate() {
        let others = reads.iter().chain(&writes[i + 1..]);
        if let Some((rn, _)) = others.clone().find(|(_, r)| overlaps(wr, r)) {
            return Err(Error::invalid(
                *wn,
                format!("overlaps `{rn}`; outputs must not alias any other argument"),
            ));
        }
    }
    match device {
        Device::Cpu => {
            // SAFETY: a host pool (checked above) whose extent the `PoolPlace` contract keeps
            // readable; no output overlaps it (checked above).
            let bytes =
                unsafe { std::slice::from_raw_parts(a.keys.addr() as *const u8, desc.extent()) };
            let view = crate::ops::pool::PoolView::new(desc, bytes, "keys")?;
            let (qf, wf, pos) = (
                a.q.to_f32(Q.name)?,
                a.w.to_f32(W.name)?,
                a.positions.to_i64(POSITIONS.name)?,
            );
            let qs = IndexerQueries {
                q: &qf,
                w: &wf,
                positions: &pos,
            };
            let req = a.req.as_slice::<i32>(REQ.name)?;
            let table = a.block_table.as_slice::<i32>(BLOCK_TABLE.name)?;
            let (n_cols, max_blocks) = (out.shape()[1], a.block_table.shape()[1]);
            let mut o = vec![0f32; out.numel()];
            logits_in_pool(p, &qs, req, &view, table, max_blocks, n_cols, &mut o)?;
            out.write_f32s(LOGITS_OUT.name, &o)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => cuda::logits_in_pool_launch(ordinal, p, a, out, error, stream),
        #[cfg(not(feature = "cuda"))]
        d @ Device::Cuda(_) => {
            let _ = (error, stream);
            Err(crate::tensor::no_cuda_build(Q.name, d))
        }
    }
}

#[cfg(test)]
mod tests;
