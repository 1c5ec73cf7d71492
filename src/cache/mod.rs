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
//! - **Per-request state**: an SWA ring of `window` tokens per layer and the compressor carry of
//!   every KV-source layer (its next position and half-finished group; ratio 2: kv + score, 1024
//!   f32), the one copy the engine and the C ABI share (`carry`).
//! - **Accounting** is measured: [`CacheManager::stats`] sums the lengths of the slabs and rings that
//!   are actually allocated (with [`Backing::Host`]) and of the blocks actually handed out.
//!
//! # Pieces
//! [`CacheManager`] is the one facade over the pieces, each in its own module: the block pool and
//! slabs (`pool`: reference counts, free list, LRU eviction, page and record I/O), the block
//! tables (`table`: slot mapping, entry append and gather), the prefix index ([`prefix`]), the
//! SWA rings (`swa`), the compressor carries (`carry`) and the accounting (`stats`). The C ABI
//! (`csa2_cache_*`) and the engine's `backend::KvCache` both reach the cache through this facade.
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

mod carry;
pub mod layout;
mod pool;
pub mod prefix;
pub mod signature;
pub mod spec;
mod stats;
mod swa;
mod table;

pub use layout::{BlockLayout, PagePlace, RecordKind};
pub use prefix::{PrefixHasher, PrefixKey};
pub use spec::{CacheSpec, PoolSpec, PAGE_ALIGN};
pub use stats::{CacheStats, RequestBytes};

use crate::error::{Error, Result};
use parking_lot::Mutex;
use pool::{BlockPool, Slabs};
use prefix::PrefixIndex;
use serde::Serialize;
use std::sync::Arc;
use table::Tables;

/// A request (sequence) id chosen by the caller; the one request id of the crate (the C ABI's
/// `uint64_t id`, the engine's `SeqStep::req`).
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

/// Per-request state that the attention backend touches every step (behind a per-request lock).
struct SessionState {
    swa: swa::SwaRing,
    carries: carry::Carries,
}

/// Block metadata, behind the one metadata lock: the pool's counts and lists, the prefix index
/// and the block tables change together.
struct Meta {
    pool: BlockPool,
    index: PrefixIndex,
    tables: Tables,
}

/// The paged KV-cache manager. See the module docs for the model, the pieces and thread safety.
pub struct CacheManager {
    spec: CacheSpec,
    config: CacheConfig,
    layout: BlockLayout,
    hasher: PrefixHasher,
    meta: Mutex<Meta>,
    slabs: Slabs,
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
        Ok(CacheManager {
            meta: Mutex::new(Meta {
                pool: BlockPool::new(n)?,
                index: PrefixIndex::default(),
                tables: Tables::default(),
            }),
            slabs: Slabs::new(n, config.backing, layout.slab_bytes)?,
            spec,
            config,
            layout,
            hasher,
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
        let ring = match self.config.backing {
            Backing::Host => self.spec.swa_ring_bytes(),
            Backing::Accounting => 0,
        };
        Ok(SessionState {
            swa: swa::SwaRing::new(self.spec.num_layers, ring)?,
            carries: carry::Carries::new(self.spec.pools.len()),
        })
    }

    /// Registers a new request with an empty block table.
    ///
    /// Errors: [`Error::Invalid`] when the id is already live; [`Error::OutOfMemory`] when its
    /// SWA ring cannot be allocated.
    pub fn add_request(&self, id: RequestId) -> Result<()> {
        let session = Arc::new(Mutex::new(self.new_session()?));
        let mut m = self.meta.lock();
        m.tables.insert(id, self.spec.pools.len(), session)
    }

    /// Frees request `id`: every block loses a reference; published blocks at zero become evictable
    /// (deepest block first in eviction order), the others return to the free list.
    ///
    /// Errors: [`Error::NotFound`] for an unknown id (so a double free is reported, not ignored).
    pub fn free_request(&self, id: RequestId) -> Result<()> {
        let mut guard = self.meta.lock();
        let m = &mut *guard;
        let req = m.tables.remove(id)?;
        // Deepest block first: it gets the oldest tick, so it is evicted before the prefix head.
        for &b in req.table.iter().rev() {
            m.pool.release(id, b)?;
        }
        Ok(())
    }

    fn session(&self, id: RequestId) -> Result<Arc<Mutex<SessionState>>> {
        let m = self.meta.lock();
        m.tables.get(id).map(|r| r.session.clone())
    }
}

#[cfg(test)]
mod tests;
