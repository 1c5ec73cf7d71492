//! The paged KV-cache manager (the HBM tier; host memory on the CPU build).
//!
//! - **Pools**: only the KV-source (Full) layers own global KV ([`spec::CacheSpec`]). A block id
//!   names `block_tokens` tokens; its slab holds one block-planar main-KV page and one index-K page
//!   per KV-source layer ([`layout::BlockLayout`]), so a ratio-2 page holds `block_tokens / 2`
//!   entries and a ratio-1 page `block_tokens`.
//! - **Block tables and slot mapping**: each request has a block table; compressed entry `j` of a
//!   ratio-m layer lives in block `table[j·m / block_tokens]`, slot
//!   `block · (block_tokens/m) + j mod (block_tokens/m)` (vLLM's `block_table[i // S]·S + i % S`,
//!   docs/SPEC.md §1.6).
//! - **Prefix sharing**: full blocks are published under chained SHA-256 keys
//!   ([`prefix::PrefixHasher`]); a later request adopts them (reference count + 1). Published blocks
//!   are sealed: their slots can no longer be written, so a replay can never overwrite a shared
//!   entry (docs/SPEC.md §3 "never recomputed or overwritten").
//! - **Eviction**: a block whose count drops to zero stays cached (still findable by key) in an LRU
//!   list; allocation takes never-used blocks first, then evicts the least recently used cached
//!   block. A finished request's blocks enter the LRU deepest-first, so a prefix's tail goes before
//!   its head (vLLM's free-block queue). When nothing is free or evictable, allocation returns
//!   [`Error::OutOfBlocks`] and changes nothing.
//! - **Per-request state**: an SWA ring of `window` tokens per layer and the half-finished
//!   compressor group of every ratio > 1 layer (ratio 2: kv + score, 1024 f32).
//! - **Accounting** is measured: [`CacheManager::stats`] sums the lengths of the slabs and rings that
//!   are actually allocated (with [`Backing::Host`]) and of the blocks actually handed out.
//!
//! # Thread safety
//! [`CacheManager`] is `Send + Sync` and meant to be shared (`Arc`). Block metadata (free list, LRU,
//! prefix index, block tables) sits behind one `parking_lot::Mutex`, held only for bookkeeping, never
//! during record I/O. Each block's slab has its own `RwLock`, so record reads and writes on different
//! blocks run in parallel and never wait on allocation. A request's SWA ring and compressor state
//! sit behind a per-request mutex. A caller must not use a slot after freeing the request that
//! mapped it (the block may already belong to someone else), as with any paged allocator.
//!
//! [`CacheManager::allocate`] puts a block into a table only after its slab exists and is zeroed
//! (done outside the metadata lock), so record access racing an allocation on the same request
//! never meets a half-made block, and a reused block never shows its previous owner's records.
//! Record access to a block never handed out is [`Error::NotFound`], never a panic.
//!
//! # Limits
//! `num_blocks` ≤ [`MAX_NUM_BLOCKS`], `block_tokens` ≤ [`MAX_BLOCK_TOKENS`], token positions <
//! [`MAX_POSITION`]; buffers sized by the caller are allocated fallibly ([`Error::OutOfMemory`]).

pub mod layout;
pub mod prefix;
pub mod spec;

pub use layout::{BlockLayout, PagePlace, RecordKind};
pub use prefix::{PrefixHasher, PrefixKey};
pub use spec::{CacheSpec, PoolSpec, PAGE_ALIGN};

use crate::error::{try_vec, Error, Result};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// A request (sequence) id chosen by the caller.
pub type RequestId = u64;

/// Most blocks one pool may have (2^24 = 16 777 216, i.e. 4.3 G tokens of 256-token blocks).
/// The per-block bookkeeping (about 130 bytes a block) is allocated up front, so a larger count is
/// refused as an argument error before anything is allocated; a count below it whose bookkeeping
/// does not fit in memory is [`Error::OutOfMemory`].
pub const MAX_NUM_BLOCKS: usize = 1 << 24;

/// Most tokens one block may hold (2^16). Keeps every slab size computation far from overflow.
pub const MAX_BLOCK_TOKENS: usize = 1 << 16;

/// Positions (absolute token indices) are below 2^62, so that `position + window` and the newest
/// position + 1 never overflow and fit the C ABI's `int64_t`.
pub const MAX_POSITION: usize = 1 << 62;

fn check_position(what: &str, pos: usize) -> Result<()> {
    if pos >= MAX_POSITION {
        return Err(Error::invalid(
            what,
            format!("token position {pos} is not below the maximum 2^62 ({MAX_POSITION})"),
        ));
    }
    Ok(())
}

/// Where block slabs live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Backing {
    /// Real host memory: a slab is allocated (zeroed) the first time its block is handed out and
    /// kept for reuse; records can be written and read.
    Host,
    /// Bookkeeping only, for trace simulation: blocks, tables, keys and byte counts behave exactly as
    /// with `Host`, but no slab memory exists and record access returns [`Error::Unsupported`].
    Accounting,
}

/// Cache-manager configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// Tokens per block (default 256); a multiple of every KV-source ratio.
    pub block_tokens: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Slab backing.
    pub backing: Backing,
}

impl CacheConfig {
    /// `num_blocks` blocks of 256 tokens in host memory.
    pub fn host(num_blocks: usize) -> CacheConfig {
        CacheConfig {
            block_tokens: 256,
            num_blocks,
            backing: Backing::Host,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct BlockMeta {
    refs: u32,
    key: Option<PrefixKey>,
    /// The key of the block before this one in the chain it was published in (None: the first
    /// block of a prefix). Lets `adopt_prefix` refuse keys that are not one chain.
    parent: Option<PrefixKey>,
    /// LRU tick while evictable (refs == 0 and key set).
    tick: Option<u64>,
}

/// Per-request state that the attention backend touches every step.
struct SessionState {
    /// `num_layers × window` SWA records (Host backing), ring slot = position mod window.
    swa: Vec<u8>,
    /// Newest SWA position written + 1, per layer (positions `[hi − window, hi)` are readable).
    swa_hi: Vec<Option<usize>>,
    /// Half-finished compressor group per pool with ratio > 1 (None = no pending rows).
    compressor: Vec<Option<Vec<f32>>>,
}

struct Request {
    /// Unique per `add_request` (ids may be reused after a free).
    serial: u64,
    table: Vec<u32>,
    tokens: usize,
    session: Arc<Mutex<SessionState>>,
}

struct Meta {
    blocks: Vec<BlockMeta>,
    /// Blocks that hold nothing (never used, or evicted), popped from the end.
    free: Vec<u32>,
    /// Evictable cached blocks: tick → block.
    lru: BTreeMap<u64, u32>,
    index: HashMap<PrefixKey, u32>,
    requests: HashMap<RequestId, Request>,
    /// Blocks taken by an `allocate` whose slabs are being prepared (zeroed or allocated) outside
    /// this lock, not yet in any table: ticket → blocks.
    reserved: BTreeMap<u64, Vec<u32>>,
    /// Source of request serials and reservation tickets.
    serial: u64,
    tick: u64,
    evictions: u64,
    prefix_hits: u64,
    prefix_queries: u64,
}

/// Errors with [`Error::Invalid`] naming the first key that repeats an earlier one.
fn check_distinct(keys: &[PrefixKey]) -> Result<()> {
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    for (i, k) in keys.iter().enumerate() {
        if !seen.insert(k) {
            return Err(Error::invalid(
                "keys",
                format!("key {i} ({k:?}) repeats an earlier key; prefix keys are one chain"),
            ));
        }
    }
    Ok(())
}

/// Length of the leading run of `keys` that is cached as one chain: key `i` is indexed and its
/// block was published with key `i − 1` as parent (key 0 with none).
///
/// Errors: [`Error::Invalid`] when a cached key's parent is not the key before it (the keys were
/// not computed from one token sequence, e.g. two prompts' keys spliced together).
fn chain_run(m: &Meta, keys: &[PrefixKey]) -> Result<usize> {
    let mut parent: Option<&PrefixKey> = None;
    for (i, k) in keys.iter().enumerate() {
        let Some(&b) = m.index.get(k) else {
            return Ok(i);
        };
        if m.blocks[b as usize].parent.as_ref() != parent {
            let place = match i {
                0 => "is cached as a later block of a chain, not its head".to_string(),
                _ => format!("is cached but does not follow key {} in its chain", i - 1),
            };
            return Err(Error::invalid("keys", format!("key {i} ({k:?}) {place}")));
        }
        parent = Some(k);
    }
    Ok(keys.len())
}

/// Byte and block counts, measured from the allocator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CacheStats {
    /// Blocks in the pool.
    pub total_blocks: usize,
    /// Blocks referenced by at least one live request.
    pub used_blocks: usize,
    /// Unreferenced blocks still holding a published prefix (evictable).
    pub cached_blocks: usize,
    /// Blocks holding nothing.
    pub free_blocks: usize,
    /// Bytes of one block slab.
    pub slab_bytes: usize,
    /// Slab bytes allocated from the host (Host backing) or handed out so far (Accounting).
    pub allocated_bytes: usize,
    /// Slab bytes of referenced blocks.
    pub in_use_bytes: usize,
    /// Slab bytes of cached, unreferenced blocks.
    pub cached_bytes: usize,
    /// Bytes of live SWA rings and compressor states.
    pub session_bytes: usize,
    /// Live requests.
    pub requests: usize,
    /// Cached blocks evicted so far.
    pub evictions: u64,
    /// Prefix blocks found by [`CacheManager::adopt_prefix`] so far.
    pub prefix_hits: u64,
    /// Prefix blocks asked for by [`CacheManager::adopt_prefix`] so far.
    pub prefix_queries: u64,
}

/// Measured global-KV footprint of one request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RequestBytes {
    /// Tokens the request's table covers.
    pub tokens: usize,
    /// Blocks in its table.
    pub blocks: usize,
    /// Slab bytes of those blocks, read from the allocator.
    pub slab_bytes: usize,
    /// Bytes of the records that exist for `tokens` tokens.
    pub record_bytes: usize,
    /// `slab_bytes − record_bytes`: page alignment plus the unfilled tail of the last block.
    pub padding_bytes: usize,
    /// `slab_bytes / tokens`.
    pub bytes_per_token: f64,
}

/// The paged KV-cache manager. See the module docs for the model and thread safety.
pub struct CacheManager {
    spec: CacheSpec,
    config: CacheConfig,
    layout: BlockLayout,
    hasher: PrefixHasher,
    meta: Mutex<Meta>,
    slabs: Vec<RwLock<Vec<u8>>>,
    sealed: Vec<AtomicBool>,
    touched: Vec<AtomicBool>,
    allocated: AtomicUsize,
    /// Index of each pool with ratio > 1 in `SessionState::compressor`.
    comp_slot: Vec<Option<usize>>,
}

impl std::fmt::Debug for CacheManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheManager")
            .field("spec", &self.spec.name)
            .field("config", &self.config)
            .finish()
    }
}

impl CacheManager {
    /// A manager for `spec` with `config`. `model` is a fingerprint of the model (e.g. the config
    /// file's bytes) that salts the prefix keys.
    ///
    /// The prefix keys are salted with the whole `spec` (layers, ratios, formats, window) as well
    /// as `model`, so two caches whose records could differ never share keys even when `model`
    /// is empty.
    ///
    /// Errors: [`Error::Invalid`] when `block_tokens` is 0, above [`MAX_BLOCK_TOKENS`] or not a
    /// multiple of a KV-source ratio, or when `num_blocks` is 0 or above [`MAX_NUM_BLOCKS`];
    /// [`Error::OutOfMemory`] when the per-block bookkeeping cannot be allocated.
    pub fn new(spec: CacheSpec, config: CacheConfig, model: &[u8]) -> Result<CacheManager> {
        spec.check_block_tokens(config.block_tokens)?;
        if config.block_tokens > MAX_BLOCK_TOKENS {
            return Err(Error::invalid(
                "block_tokens",
                format!(
                    "{} is above the maximum {MAX_BLOCK_TOKENS}",
                    config.block_tokens
                ),
            ));
        }
        if config.num_blocks == 0 || config.num_blocks > MAX_NUM_BLOCKS {
            return Err(Error::invalid(
                "num_blocks",
                format!(
                    "must be in 1..={MAX_NUM_BLOCKS} (2^24), found {}",
                    config.num_blocks
                ),
            ));
        }
        let layout = BlockLayout::new(&spec, config.block_tokens);
        let hasher = PrefixHasher::new(
            &Self::salt(&spec, model)?,
            &spec.layout,
            config.block_tokens,
        );
        let n = config.num_blocks;
        // Every per-block array is allocated fallibly: `n` comes from the caller.
        let blocks = try_vec(n, BlockMeta::default(), "block metadata")?;
        let mut free = Vec::new();
        free.try_reserve_exact(n)
            .map_err(|_| Error::oom("free list", n * 4))?;
        // Popped from the end: hand out low ids first.
        free.extend((0..n as u32).rev());
        let mut slabs = Vec::new();
        slabs
            .try_reserve_exact(n)
            .map_err(|_| Error::oom("slab table", n * std::mem::size_of::<RwLock<Vec<u8>>>()))?;
        slabs.extend((0..n).map(|_| RwLock::new(Vec::new())));
        let mut sealed = Vec::new();
        sealed
            .try_reserve_exact(n)
            .map_err(|_| Error::oom("sealed flags", n))?;
        sealed.extend((0..n).map(|_| AtomicBool::new(false)));
        let mut touched = Vec::new();
        touched
            .try_reserve_exact(n)
            .map_err(|_| Error::oom("touched flags", n))?;
        touched.extend((0..n).map(|_| AtomicBool::new(false)));
        let mut comp_slot = Vec::new();
        let mut k = 0;
        for p in &spec.pools {
            if p.ratio > 1 {
                comp_slot.push(Some(k));
                k += 1;
            } else {
                comp_slot.push(None);
            }
        }
        Ok(CacheManager {
            meta: Mutex::new(Meta {
                blocks,
                free,
                lru: BTreeMap::new(),
                index: HashMap::new(),
                requests: HashMap::new(),
                reserved: BTreeMap::new(),
                serial: 0,
                tick: 0,
                evictions: 0,
                prefix_hits: 0,
                prefix_queries: 0,
            }),
            slabs,
            sealed,
            touched,
            allocated: AtomicUsize::new(0),
            spec,
            config,
            layout,
            hasher,
            comp_slot,
        })
    }

    /// The prefix-key salt input: the spec (as JSON: every layer, ratio, format and the window)
    /// then the caller's model fingerprint, each length-prefixed so no two pairs collide.
    fn salt(spec: &CacheSpec, model: &[u8]) -> Result<Vec<u8>> {
        let json = serde_json::to_vec(spec)
            .map_err(|e| Error::Internal(format!("cache spec to JSON: {e}")))?;
        let len = 34 + json.len() + model.len();
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|_| Error::oom("prefix salt", len))?;
        v.extend_from_slice(b"csa2/cache-spec/v1");
        v.extend_from_slice(&(json.len() as u64).to_le_bytes());
        v.extend_from_slice(&json);
        v.extend_from_slice(&(model.len() as u64).to_le_bytes());
        v.extend_from_slice(model);
        Ok(v)
    }

    /// The cache spec.
    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }
    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }
    /// The slab layout of one block.
    pub fn block_layout(&self) -> &BlockLayout {
        &self.layout
    }
    /// The prefix hasher (salted with this cache's model, layout and block size).
    pub fn hasher(&self) -> &PrefixHasher {
        &self.hasher
    }

    fn new_session(&self) -> Result<SessionState> {
        let host = self.config.backing == Backing::Host;
        Ok(SessionState {
            swa: if host {
                try_vec(self.spec.swa_ring_bytes(), 0u8, "SWA ring")?
            } else {
                Vec::new()
            },
            swa_hi: vec![None; self.spec.num_layers],
            compressor: vec![None; self.comp_slot.iter().flatten().count()],
        })
    }

    /// Registers a new request with an empty block table.
    ///
    /// Errors: [`Error::Invalid`] when the id is already live; [`Error::OutOfMemory`] when its
    /// SWA ring cannot be allocated.
    pub fn add_request(&self, id: RequestId) -> Result<()> {
        let session = Arc::new(Mutex::new(self.new_session()?));
        let mut m = self.meta.lock();
        if m.requests.contains_key(&id) {
            return Err(Error::invalid(
                "request",
                format!("id {id} is already live"),
            ));
        }
        m.serial += 1;
        let serial = m.serial;
        m.requests.insert(
            id,
            Request {
                serial,
                table: Vec::new(),
                tokens: 0,
                session,
            },
        );
        Ok(())
    }

    /// Longest run of leading `keys` present in the cache (no state change). Only a chain counts:
    /// key `i` must have been published right after key `i − 1` (key 0 as a prefix head).
    ///
    /// Errors: [`Error::Invalid`] when `keys` repeats a key.
    pub fn lookup_prefix(&self, keys: &[PrefixKey]) -> Result<usize> {
        check_distinct(keys)?;
        let m = self.meta.lock();
        chain_run(&m, keys)
    }

    /// Attaches the longest cached run of leading `keys` to request `id`, whose table must be empty;
    /// each adopted block gains a reference and leaves the LRU. Returns the blocks adopted (the hit
    /// covers `blocks × block_tokens` tokens).
    ///
    /// Only a chain is adopted (as [`CacheManager::lookup_prefix`]): the run stops at the first
    /// key that is absent or was not published right after the key before it.
    ///
    /// Errors: [`Error::NotFound`] for an unknown id; [`Error::Invalid`] when its table is not
    /// empty or `keys` repeats a key (which would alias one block several times in a table).
    pub fn adopt_prefix(&self, id: RequestId, keys: &[PrefixKey]) -> Result<usize> {
        check_distinct(keys)?;
        let mut guard = self.meta.lock();
        let m = &mut *guard;
        let req = m
            .requests
            .get(&id)
            .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
        if !req.table.is_empty() {
            return Err(Error::invalid(
                "request",
                format!(
                    "{id} already holds {} blocks; adopt a prefix before allocating",
                    req.table.len()
                ),
            ));
        }
        let run = chain_run(m, keys)?;
        let mut adopted = Vec::new();
        for k in &keys[..run] {
            let b = m.index[k];
            let bm = &mut m.blocks[b as usize];
            if let Some(t) = bm.tick.take() {
                m.lru.remove(&t);
            }
            bm.refs += 1;
            adopted.push(b);
        }
        m.prefix_queries += keys.len() as u64;
        m.prefix_hits += adopted.len() as u64;
        let n = adopted.len();
        let req = m.requests.get_mut(&id).expect("checked above");
        req.table = adopted;
        req.tokens = n * self.config.block_tokens;
        Ok(n)
    }

    /// Grows request `id`'s block table to cover `tokens` tokens (never shrinks). New blocks come
    /// from the free list first, then by evicting the least recently used cached block.
    ///
    /// A new block enters the table only once its slab exists and is zeroed: a block reused from
    /// an earlier request never shows that request's records (the slab is cleared here, outside
    /// the metadata lock; the cost is measured in docs/PERF.md), and a concurrent record read or
    /// write on the request sees either no block or a ready one.
    ///
    /// Errors: [`Error::NotFound`] for an unknown id (also when the request is freed while this
    /// call runs); [`Error::OutOfBlocks`] when the pool cannot supply the blocks — then nothing
    /// changes, so the caller can free, preempt or retry; [`Error::OutOfMemory`] when a slab cannot
    /// be allocated — the table is unchanged, and cached blocks evicted for the call are free.
    pub fn allocate(&self, id: RequestId, tokens: usize) -> Result<()> {
        let need_blocks = tokens.div_ceil(self.config.block_tokens);
        // Phase 1 (locked): take the blocks, counted as referenced but in no table yet.
        let (ticket, serial, fresh) = {
            let mut guard = self.meta.lock();
            let m = &mut *guard;
            let req = m
                .requests
                .get(&id)
                .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
            let (have, serial) = (req.table.len(), req.serial);
            let extra = need_blocks.saturating_sub(have);
            if extra == 0 {
                let req = m.requests.get_mut(&id).expect("checked above");
                req.tokens = req.tokens.max(tokens);
                return Ok(());
            }
            if extra > m.free.len() + m.lru.len() {
                return Err(Error::OutOfBlocks {
                    requested: extra,
                    free: m.free.len(),
                    evictable: m.lru.len(),
                });
            }
            let mut fresh = Vec::with_capacity(extra);
            for _ in 0..extra {
                let b = match m.free.pop() {
                    Some(b) => b,
                    None => {
                        let (_, b) = m.lru.pop_first().expect("counted above");
                        let bm = &mut m.blocks[b as usize];
                        bm.tick = None;
                        bm.parent = None;
                        if let Some(k) = bm.key.take() {
                            m.index.remove(&k);
                        }
                        self.sealed[b as usize].store(false, Ordering::Release);
                        m.evictions += 1;
                        b
                    }
                };
                m.blocks[b as usize].refs = 1;
                fresh.push(b);
            }
            m.serial += 1;
            let ticket = m.serial;
            m.reserved.insert(ticket, fresh.clone());
            (ticket, serial, fresh)
        };
        // Phase 2 (no metadata lock): make every slab exist and hold zeros.
        let prepared = fresh.iter().try_for_each(|&b| self.prepare_slab(b));
        // Phase 3 (locked): publish into the table, or give the blocks back.
        let mut guard = self.meta.lock();
        let m = &mut *guard;
        m.reserved.remove(&ticket);
        let live = m.requests.get(&id).is_some_and(|r| r.serial == serial);
        if let (Ok(()), true) = (&prepared, live) {
            let req = m.requests.get_mut(&id).expect("checked above");
            req.table.extend_from_slice(&fresh);
            req.tokens = req.tokens.max(tokens);
            return Ok(());
        }
        for &b in fresh.iter().rev() {
            m.blocks[b as usize].refs = 0;
            m.free.push(b);
        }
        prepared?;
        Err(Error::NotFound(format!(
            "request {id} (freed while its blocks were being allocated)"
        )))
    }

    /// Makes block `b`'s slab exist (first use: allocated fallibly, Host) and hold only zeros
    /// (reuse: the previous owner's records are cleared). Accounting backing only counts bytes.
    fn prepare_slab(&self, b: u32) -> Result<()> {
        let b = b as usize;
        let bytes = self.layout.slab_bytes;
        if self.config.backing == Backing::Accounting {
            if !self.touched[b].swap(true, Ordering::AcqRel) {
                self.allocated.fetch_add(bytes, Ordering::Relaxed);
            }
            return Ok(());
        }
        let mut slab = self.slabs[b].write();
        if slab.is_empty() {
            slab.try_reserve_exact(bytes)
                .map_err(|_| Error::oom(format!("the slab of block {b}"), bytes))?;
            slab.resize(bytes, 0);
            self.touched[b].store(true, Ordering::Release);
            self.allocated.fetch_add(bytes, Ordering::Relaxed);
        } else {
            slab.fill(0);
        }
        Ok(())
    }

    /// Publishes the first `keys.len()` full blocks of request `id` under `keys` (the chained keys of
    /// its tokens, [`PrefixHasher::keys`]) after their records are written; they become sealed and
    /// shareable. Blocks already published (adopted) are skipped; a key already owned by another
    /// block keeps that block (this one stays private, as vLLM allows duplicates). Returns the blocks
    /// newly published.
    ///
    /// Errors: [`Error::NotFound`] for an unknown id; [`Error::Invalid`] when `keys` names more full
    /// blocks than the request's tokens fill.
    pub fn publish(&self, id: RequestId, keys: &[PrefixKey]) -> Result<usize> {
        check_distinct(keys)?;
        let mut guard = self.meta.lock();
        let m = &mut *guard;
        let req = m
            .requests
            .get(&id)
            .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
        let full = req.tokens / self.config.block_tokens;
        if keys.len() > full.min(req.table.len()) {
            return Err(Error::invalid(
                "keys",
                format!(
                    "{} keys for request {id}, which fills only {full} full blocks",
                    keys.len()
                ),
            ));
        }
        let table = req.table[..keys.len()].to_vec();
        let mut n = 0;
        for (i, (k, b)) in keys.iter().zip(table).enumerate() {
            if m.blocks[b as usize].key.is_some() || m.index.contains_key(k) {
                continue;
            }
            m.blocks[b as usize].key = Some(*k);
            m.blocks[b as usize].parent = i.checked_sub(1).map(|p| keys[p]);
            m.index.insert(*k, b);
            self.sealed[b as usize].store(true, Ordering::Release);
            n += 1;
        }
        Ok(n)
    }

    /// Frees request `id`: every block loses a reference; published blocks at zero become evictable
    /// (deepest block first in eviction order), the others return to the free list.
    ///
    /// Errors: [`Error::NotFound`] for an unknown id (so a double free is reported, not ignored).
    pub fn free_request(&self, id: RequestId) -> Result<()> {
        let mut guard = self.meta.lock();
        let m = &mut *guard;
        let req = m
            .requests
            .remove(&id)
            .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
        // Deepest block first: it gets the oldest tick, so it is evicted before the prefix head.
        for &b in req.table.iter().rev() {
            let bm = &mut m.blocks[b as usize];
            if bm.refs == 0 {
                return Err(Error::Internal(format!(
                    "block {b} of request {id} already has no reference"
                )));
            }
            bm.refs -= 1;
            if bm.refs == 0 {
                if bm.key.is_some() {
                    m.tick += 1;
                    bm.tick = Some(m.tick);
                    m.lru.insert(m.tick, b);
                } else {
                    m.free.push(b);
                }
            }
        }
        Ok(())
    }

    /// The block table of request `id` (block ids, one per `block_tokens` tokens).
    pub fn block_table(&self, id: RequestId) -> Result<Vec<u32>> {
        let m = self.meta.lock();
        m.requests
            .get(&id)
            .map(|r| r.table.clone())
            .ok_or_else(|| Error::NotFound(format!("request {id}")))
    }

    fn place(&self, layer: usize, kind: RecordKind) -> Result<&PagePlace> {
        self.layout.place(layer, kind).ok_or_else(|| {
            Error::invalid(
                "layer",
                format!(
                    "layer {layer} has no {kind:?} cache (KV-source layers: {:?})",
                    self.spec.pools.iter().map(|p| p.layer).collect::<Vec<_>>()
                ),
            )
        })
    }

    /// Physical slots of compressed entries `entries` of KV-source `layer` for request `id`
    /// (vLLM slot mapping): slot = block · S + j mod S with S = `block_tokens / ratio`, block =
    /// `table[j / S]`. Entry `j` covers tokens `[j·m, j·m + m)`.
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (not a KV-source layer, or entries
    /// past the request's allocated tokens).
    pub fn slot_mapping(
        &self,
        id: RequestId,
        layer: usize,
        entries: Range<usize>,
    ) -> Result<Vec<u64>> {
        let place = *self.place(layer, RecordKind::Main)?;
        let s = place.page.slots;
        let m = self.meta.lock();
        let req = m
            .requests
            .get(&id)
            .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
        let cap = req.table.len() * s;
        if entries.end > cap {
            return Err(Error::invalid(
                "entries",
                format!(
                    "{entries:?} of layer {layer} (ratio {}) exceeds the {cap} entries allocated for request {id}",
                    place.ratio
                ),
            ));
        }
        Ok(entries
            .map(|j| req.table[j / s] as u64 * s as u64 + (j % s) as u64)
            .collect())
    }

    /// Physical slots of the compressed entries `entries` (any order, repeats allowed) of KV-source
    /// `layer` for request `id`: [`CacheManager::slot_mapping`] for a gather list.
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (not a KV-source layer, or an entry
    /// past the request's allocated tokens, naming the first such entry).
    pub fn slots_of(&self, id: RequestId, layer: usize, entries: &[usize]) -> Result<Vec<u64>> {
        let place = *self.place(layer, RecordKind::Main)?;
        let s = place.page.slots;
        let m = self.meta.lock();
        let req = m
            .requests
            .get(&id)
            .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
        let cap = req.table.len() * s;
        if let Some((i, &j)) = entries.iter().enumerate().find(|(_, &j)| j >= cap) {
            return Err(Error::invalid(
                "entries",
                format!(
                    "entry {j} (at index {i}) of layer {layer} (ratio {}) is past the {cap} entries allocated for request {id}",
                    place.ratio
                ),
            ));
        }
        Ok(entries
            .iter()
            .map(|&j| req.table[j / s] as u64 * s as u64 + (j % s) as u64)
            .collect())
    }

    /// Checks that every slot of `layer`'s `kind` cache in `slots` may be written: inside the pool
    /// and not in a published prefix block. A batched write calls this first so that a refused
    /// batch changes nothing.
    ///
    /// Errors: [`Error::Invalid`] naming the first slot that is past the pool or read-only.
    pub fn check_writable(&self, layer: usize, kind: RecordKind, slots: &[u64]) -> Result<()> {
        let place = *self.place(layer, kind)?;
        for &slot in slots {
            let (block, _) = self.split_slot(&place, slot)?;
            self.check_unsealed(block, slot)?;
        }
        Ok(())
    }

    fn split_slot(&self, place: &PagePlace, slot: u64) -> Result<(usize, usize)> {
        let s = place.page.slots as u64;
        let block = (slot / s) as usize;
        if block >= self.config.num_blocks {
            return Err(Error::invalid(
                "slot",
                format!(
                    "{slot} is past the pool ({} blocks × {s} slots)",
                    self.config.num_blocks
                ),
            ));
        }
        Ok((block, (slot % s) as usize))
    }

    fn host_only(&self) -> Result<()> {
        match self.config.backing {
            Backing::Host => Ok(()),
            Backing::Accounting => Err(Error::Unsupported(
                "record access on an accounting-only cache".into(),
            )),
        }
    }

    /// Writes one standalone record (data then scales, `format.record_bytes()` bytes) into `slot`
    /// of `layer`'s `kind` cache, scattering it into the block-planar page.
    ///
    /// Errors: [`Error::Shape`] (record length), [`Error::Invalid`] (layer, slot, or a sealed slot:
    /// published prefix blocks are read-only), [`Error::Unsupported`] (accounting backing).
    pub fn write_record(
        &self,
        layer: usize,
        kind: RecordKind,
        slot: u64,
        record: &[u8],
    ) -> Result<()> {
        let (place, block, s) = self.locate_record(layer, kind, slot, record.len())?;
        let fmt = place.page.format;
        self.check_unsealed(block, slot)?;
        let (d, sc) = place.page.slot_ranges(s);
        let mut slab = self.slabs[block].write();
        Self::check_ready(&slab, block)?;
        let page = &mut slab[place.range()];
        let db = fmt.data_bytes();
        page[d].copy_from_slice(&record[..db]);
        page[sc].copy_from_slice(&record[db..]);
        Ok(())
    }

    /// The page place, block and slot-in-block of a standalone record of `len` bytes at `slot`
    /// (the checks [`CacheManager::write_record`] and [`CacheManager::read_record`] share).
    fn locate_record(
        &self,
        layer: usize,
        kind: RecordKind,
        slot: u64,
        len: usize,
    ) -> Result<(PagePlace, usize, usize)> {
        self.host_only()?;
        let place = *self.place(layer, kind)?;
        let fmt = place.page.format;
        if len != fmt.record_bytes() {
            return Err(Error::shape(
                format!("{} record", fmt.name()),
                fmt.record_bytes(),
                len,
            ));
        }
        let (block, s) = self.split_slot(&place, slot)?;
        Ok((place, block, s))
    }

    /// Errors with [`Error::NotFound`] when block `block`'s slab was never allocated: the block
    /// was never handed out, so no slot of it holds a record.
    fn check_ready(slab: &[u8], block: usize) -> Result<()> {
        if slab.is_empty() {
            return Err(Error::NotFound(format!(
                "block {block} has never been allocated to a request: none of its slots holds a record"
            )));
        }
        Ok(())
    }

    fn check_unsealed(&self, block: usize, slot: u64) -> Result<()> {
        if self.sealed[block].load(Ordering::Acquire) {
            return Err(Error::invalid(
                "slot",
                format!("{slot} is in block {block}, a published prefix block (read-only)"),
            ));
        }
        Ok(())
    }

    /// Reads `slot` of `layer`'s `kind` cache as a standalone record into `out`.
    ///
    /// Errors as [`CacheManager::write_record`] (sealed slots are readable).
    pub fn read_record(
        &self,
        layer: usize,
        kind: RecordKind,
        slot: u64,
        out: &mut [u8],
    ) -> Result<()> {
        let (place, block, s) = self.locate_record(layer, kind, slot, out.len())?;
        let fmt = place.page.format;
        let (d, sc) = place.page.slot_ranges(s);
        let slab = self.slabs[block].read();
        Self::check_ready(&slab, block)?;
        let page = &slab[place.range()];
        let db = fmt.data_bytes();
        out[..db].copy_from_slice(&page[d]);
        out[db..].copy_from_slice(&page[sc]);
        Ok(())
    }

    /// Encodes `row` (`format.dim()` f32 values, RoPE'd) into `slot` (see [`CacheManager::write_record`]).
    pub fn write_row(&self, layer: usize, kind: RecordKind, slot: u64, row: &[f32]) -> Result<()> {
        self.host_only()?;
        let place = *self.place(layer, kind)?;
        let (block, s) = self.split_slot(&place, slot)?;
        self.check_unsealed(block, slot)?;
        let mut slab = self.slabs[block].write();
        Self::check_ready(&slab, block)?;
        place.page.write(&mut slab[place.range()], s, row)
    }

    /// Decodes `slot` into `out` (`format.dim()` f32 values).
    pub fn read_row(
        &self,
        layer: usize,
        kind: RecordKind,
        slot: u64,
        out: &mut [f32],
    ) -> Result<()> {
        self.host_only()?;
        let place = *self.place(layer, kind)?;
        let (block, s) = self.split_slot(&place, slot)?;
        let slab = self.slabs[block].read();
        Self::check_ready(&slab, block)?;
        place.page.read(&slab[place.range()], s, out)
    }

    /// Runs `f` on the whole block-planar page of `(layer, kind)` in `block` (read-only), e.g. to
    /// copy a block out to a persistent tier. Returns `f`'s result.
    pub fn with_page<T>(
        &self,
        layer: usize,
        kind: RecordKind,
        block: u32,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<T> {
        self.host_only()?;
        let place = *self.place(layer, kind)?;
        if block as usize >= self.config.num_blocks {
            return Err(Error::invalid(
                "block",
                format!("{block} is past the pool of {}", self.config.num_blocks),
            ));
        }
        let slab = self.slabs[block as usize].read();
        Self::check_ready(&slab, block as usize)?;
        Ok(f(&slab[place.range()]))
    }

    /// Copies a whole block slab out (all layers' pages) — the unit the SSD tier stores.
    pub fn read_slab(&self, block: u32) -> Result<Vec<u8>> {
        self.host_only()?;
        let b = block as usize;
        if b >= self.config.num_blocks {
            return Err(Error::invalid(
                "block",
                format!("{block} is past the pool of {}", self.config.num_blocks),
            ));
        }
        let slab = self.slabs[b].read();
        Self::check_ready(&slab, b)?;
        Ok(slab.clone())
    }

    /// Fills a block slab from a persisted copy (a prefix loaded back from the SSD tier) before it
    /// is published.
    ///
    /// Errors: [`Error::Shape`] when `bytes` is not one slab; [`Error::Invalid`] when the block is sealed.
    pub fn write_slab(&self, block: u32, bytes: &[u8]) -> Result<()> {
        self.host_only()?;
        let b = block as usize;
        if b >= self.config.num_blocks {
            return Err(Error::invalid(
                "block",
                format!("{block} is past the pool of {}", self.config.num_blocks),
            ));
        }
        if bytes.len() != self.layout.slab_bytes {
            return Err(Error::shape(
                "slab bytes",
                self.layout.slab_bytes,
                bytes.len(),
            ));
        }
        if self.sealed[b].load(Ordering::Acquire) {
            return Err(Error::invalid(
                "block",
                format!("{block} is a published prefix block (read-only)"),
            ));
        }
        let mut slab = self.slabs[b].write();
        Self::check_ready(&slab, b)?;
        slab.copy_from_slice(bytes);
        Ok(())
    }

    fn session(&self, id: RequestId) -> Result<Arc<Mutex<SessionState>>> {
        let m = self.meta.lock();
        m.requests
            .get(&id)
            .map(|r| r.session.clone())
            .ok_or_else(|| Error::NotFound(format!("request {id}")))
    }

    fn swa_offset(&self, layer: usize, pos: usize) -> Result<Range<usize>> {
        if layer >= self.spec.num_layers {
            return Err(Error::invalid(
                "layer",
                format!("{layer} is out of range 0..{}", self.spec.num_layers),
            ));
        }
        let rec = self.spec.swa_format.record_bytes();
        let o = (layer * self.spec.window + pos % self.spec.window) * rec;
        Ok(o..o + rec)
    }

    /// Writes the SWA record of token `pos` for `layer` into request `id`'s ring (slot `pos mod
    /// window`). Positions must not go backwards by more than the window.
    ///
    /// Errors: [`Error::NotFound`], [`Error::Invalid`] (layer, `pos` older than the ring keeps or
    /// not below [`MAX_POSITION`]), [`Error::Shape`] (record length), [`Error::Unsupported`]
    /// (accounting backing).
    pub fn swa_write(&self, id: RequestId, layer: usize, pos: usize, record: &[u8]) -> Result<()> {
        self.host_only()?;
        check_position("pos", pos)?;
        let rec = self.spec.swa_format.record_bytes();
        if record.len() != rec {
            return Err(Error::shape("SWA record", rec, record.len()));
        }
        let r = self.swa_offset(layer, pos)?;
        let s = self.session(id)?;
        let mut st = s.lock();
        let hi = st.swa_hi[layer].unwrap_or(0);
        if pos.saturating_add(self.spec.window) < hi {
            return Err(Error::invalid(
                "pos",
                format!(
                    "{pos} is older than layer {layer}'s window (newest {})",
                    hi - 1
                ),
            ));
        }
        st.swa[r].copy_from_slice(record);
        st.swa_hi[layer] = Some(hi.max(pos + 1));
        Ok(())
    }

    /// Reads the SWA record of token `pos` for `layer` from request `id`'s ring.
    ///
    /// Errors: [`Error::NotFound`] when `pos` is not in the window `[newest − window + 1, newest]` or
    /// nothing was written; otherwise as [`CacheManager::swa_write`].
    pub fn swa_read(&self, id: RequestId, layer: usize, pos: usize, out: &mut [u8]) -> Result<()> {
        self.host_only()?;
        let rec = self.spec.swa_format.record_bytes();
        if out.len() != rec {
            return Err(Error::shape("SWA record", rec, out.len()));
        }
        let r = self.swa_offset(layer, pos)?;
        let s = self.session(id)?;
        let st = s.lock();
        match st.swa_hi[layer] {
            Some(hi) if pos < hi && pos.saturating_add(self.spec.window) >= hi => {
                out.copy_from_slice(&st.swa[r]);
                Ok(())
            }
            hi => Err(Error::NotFound(format!(
                "SWA position {pos} of layer {layer} (window ends at {hi:?})"
            ))),
        }
    }

    /// Writes the SWA records of tokens `pos_start ..` (`records.len() / record_bytes` of them, in
    /// position order) for `layer` into request `id`'s ring, all or nothing: every check runs before
    /// the first byte is copied. With more tokens than the window, only the newest `window` survive,
    /// as with one [`CacheManager::swa_write`] per token.
    ///
    /// Errors: as [`CacheManager::swa_write`]; [`Error::Shape`] when `records` is not whole records.
    pub fn swa_write_rows(
        &self,
        id: RequestId,
        layer: usize,
        pos_start: usize,
        records: &[u8],
    ) -> Result<()> {
        self.host_only()?;
        let rec = self.spec.swa_format.record_bytes();
        if !records.len().is_multiple_of(rec) {
            return Err(Error::shape(
                "SWA records",
                format!("a multiple of {rec} bytes"),
                records.len(),
            ));
        }
        let n = records.len() / rec;
        let end = pos_start
            .checked_add(n)
            .filter(|&e| e <= MAX_POSITION)
            .ok_or_else(|| {
                Error::invalid(
                    "pos",
                    format!(
                        "tokens {pos_start} + {n} reach past the maximum position 2^62 ({MAX_POSITION})"
                    ),
                )
            })?;
        self.swa_offset(layer, pos_start)?;
        let s = self.session(id)?;
        let mut st = s.lock();
        let hi = st.swa_hi[layer].unwrap_or(0);
        if pos_start.saturating_add(self.spec.window) < hi {
            return Err(Error::invalid(
                "pos",
                format!(
                    "{pos_start} is older than layer {layer}'s window (newest {})",
                    hi - 1
                ),
            ));
        }
        // Only the newest `window` tokens of the batch can survive in the ring.
        let skip = n.saturating_sub(self.spec.window);
        for (i, r) in records.chunks_exact(rec).enumerate().skip(skip) {
            let o = self.swa_offset(layer, pos_start + i)?;
            st.swa[o].copy_from_slice(r);
        }
        if n > 0 {
            st.swa_hi[layer] = Some(hi.max(end));
        }
        Ok(())
    }

    /// Reads the SWA records of tokens `pos_start ..` (`out.len() / record_bytes` of them) of
    /// `layer` from request `id`'s ring. Every position must be inside the window; `out` is written
    /// only when all are.
    ///
    /// Errors: as [`CacheManager::swa_read`]; [`Error::Shape`] when `out` is not whole records.
    pub fn swa_read_rows(
        &self,
        id: RequestId,
        layer: usize,
        pos_start: usize,
        out: &mut [u8],
    ) -> Result<()> {
        self.host_only()?;
        let rec = self.spec.swa_format.record_bytes();
        if !out.len().is_multiple_of(rec) {
            return Err(Error::shape(
                "SWA records",
                format!("a multiple of {rec} bytes"),
                out.len(),
            ));
        }
        let n = out.len() / rec;
        self.swa_offset(layer, pos_start)?;
        let s = self.session(id)?;
        let st = s.lock();
        let hi = st.swa_hi[layer];
        let inside =
            |p: usize| matches!(hi, Some(h) if p < h && p.saturating_add(self.spec.window) >= h);
        if n > 0 && !(inside(pos_start) && pos_start.checked_add(n - 1).is_some_and(inside)) {
            return Err(Error::NotFound(format!(
                "SWA positions {pos_start}..{} of layer {layer} (window ends at {hi:?})",
                pos_start.saturating_add(n)
            )));
        }
        for (i, o) in out.chunks_exact_mut(rec).enumerate() {
            let r = self.swa_offset(layer, pos_start + i)?;
            o.copy_from_slice(&st.swa[r]);
        }
        Ok(())
    }

    /// The newest SWA position written + 1 for `layer` of request `id` (`None` before any write):
    /// positions `[newest − window, newest)` are readable.
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (layer).
    pub fn swa_newest(&self, id: RequestId, layer: usize) -> Result<Option<usize>> {
        self.swa_offset(layer, 0)?;
        let s = self.session(id)?;
        let st = s.lock();
        Ok(st.swa_hi[layer])
    }

    /// Forgets `layer`'s SWA window of request `id` (the ring bytes stay allocated): the next
    /// write may start at any position, e.g. a window restart on a replay or a dropped decoder
    /// window (`backend::paged::PagedCache`).
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (layer).
    pub fn swa_clear(&self, id: RequestId, layer: usize) -> Result<()> {
        self.swa_offset(layer, 0)?;
        let s = self.session(id)?;
        s.lock().swa_hi[layer] = None;
        Ok(())
    }

    /// Copies the SWA windows of the snapshotted layers (`spec.snapshot_layers`) of request `id`,
    /// in layer order, each window in ring order rotated so the oldest token comes first. This is
    /// the DRAM-tier snapshot (V4.1: the encoder layers only).
    pub fn swa_snapshot(&self, id: RequestId) -> Result<Vec<u8>> {
        self.host_only()?;
        let rec = self.spec.swa_format.record_bytes();
        let w = self.spec.window;
        let s = self.session(id)?;
        let st = s.lock();
        let mut out = Vec::with_capacity(self.spec.snapshot_bytes());
        for &l in &self.spec.snapshot_layers {
            let hi = st.swa_hi[l].unwrap_or(0);
            let base = l * w * rec;
            for i in 0..w {
                let slot = (hi + i) % w;
                out.extend_from_slice(&st.swa[base + slot * rec..base + (slot + 1) * rec]);
            }
        }
        Ok(out)
    }

    /// Sets (Some) or clears (None) the half-finished compressor group of KV-source `layer` for
    /// request `id`: `(ratio − 1) × 1024` f32 (ratio 2: one token's kv[512] then score[512]).
    ///
    /// Errors: [`Error::Invalid`] when `layer` has ratio ≤ 1 or is not a KV source; [`Error::Shape`].
    pub fn set_compressor_state(
        &self,
        id: RequestId,
        layer: usize,
        state: Option<&[f32]>,
    ) -> Result<()> {
        let (k, floats) = self.comp_index(layer)?;
        if let Some(v) = state {
            if v.len() != floats {
                return Err(Error::shape("compressor state", floats, v.len()));
            }
        }
        let s = self.session(id)?;
        s.lock().compressor[k] = state.map(<[f32]>::to_vec);
        Ok(())
    }

    /// The half-finished compressor group of `layer` for request `id`, if any.
    pub fn compressor_state(&self, id: RequestId, layer: usize) -> Result<Option<Vec<f32>>> {
        let (k, _) = self.comp_index(layer)?;
        let s = self.session(id)?;
        let st = s.lock();
        Ok(st.compressor[k].clone())
    }

    fn comp_index(&self, layer: usize) -> Result<(usize, usize)> {
        self.spec
            .pools
            .iter()
            .zip(&self.comp_slot)
            .find(|(p, _)| p.layer == layer)
            .and_then(|(p, k)| k.map(|k| (k, p.compressor_state_floats())))
            .ok_or_else(|| {
                Error::invalid(
                    "layer",
                    format!("layer {layer} is not a KV source with compression ratio > 1"),
                )
            })
    }

    /// Measured global-KV bytes of request `id`: the slab lengths of its blocks as allocated
    /// (Host) or handed out (Accounting), against the records that exist for its tokens.
    pub fn request_bytes(&self, id: RequestId) -> Result<RequestBytes> {
        let (table, tokens) = {
            let m = self.meta.lock();
            let r = m
                .requests
                .get(&id)
                .ok_or_else(|| Error::NotFound(format!("request {id}")))?;
            (r.table.clone(), r.tokens)
        };
        let slab_bytes: usize = match self.config.backing {
            Backing::Host => table
                .iter()
                .map(|&b| self.slabs[b as usize].read().len())
                .sum(),
            Backing::Accounting => table.len() * self.layout.slab_bytes,
        };
        let bt = self.config.block_tokens;
        let record_bytes = (tokens / bt) * self.layout.record_bytes_for(bt)
            + self.layout.record_bytes_for(tokens % bt);
        Ok(RequestBytes {
            tokens,
            blocks: table.len(),
            slab_bytes,
            record_bytes,
            padding_bytes: slab_bytes.saturating_sub(record_bytes),
            bytes_per_token: if tokens == 0 {
                0.0
            } else {
                slab_bytes as f64 / tokens as f64
            },
        })
    }

    /// Block and byte counts now.
    pub fn stats(&self) -> CacheStats {
        let m = self.meta.lock();
        let used = m.blocks.iter().filter(|b| b.refs > 0).count();
        let cached = m.lru.len();
        let slab = self.layout.slab_bytes;
        let host = self.config.backing == Backing::Host;
        let session_bytes = m
            .requests
            .values()
            .map(|r| {
                let st = r.session.lock();
                let ring = if host {
                    st.swa.len()
                } else {
                    self.spec.swa_ring_bytes()
                };
                ring + st
                    .compressor
                    .iter()
                    .flatten()
                    .map(|v| v.len() * 4)
                    .sum::<usize>()
            })
            .sum();
        CacheStats {
            total_blocks: m.blocks.len(),
            used_blocks: used,
            cached_blocks: cached,
            free_blocks: m.free.len(),
            slab_bytes: slab,
            allocated_bytes: self.allocated.load(Ordering::Relaxed),
            in_use_bytes: used * slab,
            cached_bytes: cached * slab,
            session_bytes,
            requests: m.requests.len(),
            evictions: m.evictions,
            prefix_hits: m.prefix_hits,
            prefix_queries: m.prefix_queries,
        }
    }

    /// Checks the allocator's invariants (for tests and debug builds): every block is exactly one
    /// of free, cached (in the LRU, keyed, no reference) or used; reference counts equal the number
    /// of tables holding the block (plus one while an allocation in flight holds it); the prefix index and block keys agree.
    pub fn check_invariants(&self) -> Result<()> {
        let m = self.meta.lock();
        let mut refs = vec![0u32; m.blocks.len()];
        for r in m.requests.values() {
            for &b in &r.table {
                refs[b as usize] += 1;
            }
        }
        // Blocks an allocation in flight holds (referenced, not yet in a table).
        for &b in m.reserved.values().flatten() {
            refs[b as usize] += 1;
        }
        let mut in_free = vec![false; m.blocks.len()];
        for &b in &m.free {
            if std::mem::replace(&mut in_free[b as usize], true) {
                return Err(Error::Internal(format!(
                    "block {b} is twice in the free list"
                )));
            }
        }
        for (i, bm) in m.blocks.iter().enumerate() {
            if bm.refs != refs[i] {
                return Err(Error::Internal(format!(
                    "block {i}: count {} but {} tables hold it",
                    bm.refs, refs[i]
                )));
            }
            let cached = bm.tick.is_some_and(|t| m.lru.get(&t) == Some(&(i as u32)));
            let states = [in_free[i], cached, bm.refs > 0]
                .iter()
                .filter(|&&x| x)
                .count();
            if states != 1 {
                return Err(Error::Internal(format!(
                    "block {i} is in {states} states (free {}, cached {cached}, refs {})",
                    in_free[i], bm.refs
                )));
            }
            if in_free[i] && bm.key.is_some() {
                return Err(Error::Internal(format!("free block {i} still has a key")));
            }
            if let Some(k) = bm.key {
                if m.index.get(&k) != Some(&(i as u32)) {
                    return Err(Error::Internal(format!(
                        "block {i}'s key is not indexed to it"
                    )));
                }
            }
        }
        if m.lru.len() + m.free.len() + m.blocks.iter().filter(|b| b.refs > 0).count()
            != m.blocks.len()
        {
            return Err(Error::Internal("block states do not add up".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
