//! The block pool: who holds each block (reference counts, the free list, the LRU of cached
//! blocks, eviction) and the block slabs themselves (block-planar pages, sealing, record I/O).
//!
//! [`BlockPool`] is pure bookkeeping and lives under the manager's metadata lock; [`Slabs`] holds
//! the bytes, one `RwLock` per block, so record I/O on different blocks never waits on each other
//! or on allocation. The facade ([`CacheManager`]) composes the two with the block tables and the
//! prefix index.

use super::layout::{PagePlace, RecordKind};
use super::prefix::PrefixKey;
use super::{Backing, CacheManager, RequestId};
use crate::error::{try_vec, Error, Result};
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

#[derive(Debug, Clone, Default)]
pub(super) struct BlockMeta {
    pub(super) refs: u32,
    pub(super) key: Option<PrefixKey>,
    /// The key of the block before this one in the chain it was published in (None: the first
    /// block of a prefix). Lets `adopt_prefix` refuse keys that are not one chain.
    pub(super) parent: Option<PrefixKey>,
    /// LRU tick while evictable (refs == 0 and key set).
    pub(super) tick: Option<u64>,
}

/// Reference counts, free list and LRU of one pool (under the metadata lock).
pub(super) struct BlockPool {
    pub(super) blocks: Vec<BlockMeta>,
    /// Blocks that hold nothing (never used, or evicted), popped from the end.
    pub(super) free: Vec<u32>,
    /// Evictable cached blocks: tick → block.
    pub(super) lru: BTreeMap<u64, u32>,
    tick: u64,
    pub(super) evictions: u64,
}

impl BlockPool {
    /// `n` free blocks, handed out lowest id first. Allocated fallibly: `n` comes from the caller.
    pub(super) fn new(n: usize) -> Result<BlockPool> {
        let blocks = try_vec(n, BlockMeta::default(), "block metadata")?;
        let mut free = Vec::new();
        free.try_reserve_exact(n)
            .map_err(|_| Error::oom("free list", n * 4))?;
        // Popped from the end: hand out low ids first.
        free.extend((0..n as u32).rev());
        Ok(BlockPool {
            blocks,
            free,
            lru: BTreeMap::new(),
            tick: 0,
            evictions: 0,
        })
    }

    /// Blocks an allocation may take now (free + evictable).
    pub(super) fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Takes one block with a reference count of 1: a free one first, else the least recently
    /// used cached block, whose key is returned so the caller can drop it from the prefix index.
    /// The caller has checked [`BlockPool::available`].
    pub(super) fn take(&mut self) -> (u32, Option<PrefixKey>) {
        let (b, evicted) = match self.free.pop() {
            Some(b) => (b, None),
            None => {
                let (_, b) = self.lru.pop_first().expect("counted by the caller");
                let bm = &mut self.blocks[b as usize];
                bm.tick = None;
                bm.parent = None;
                self.evictions += 1;
                (b, bm.key.take())
            }
        };
        self.blocks[b as usize].refs = 1;
        (b, evicted)
    }

    /// Returns blocks taken by an allocation that did not complete (no table holds them).
    pub(super) fn give_back(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            self.blocks[b as usize].refs = 0;
            self.free.push(b);
        }
    }

    /// One more reference to cached or used block `b` (an adopted prefix block leaves the LRU).
    pub(super) fn adopt(&mut self, b: u32) {
        let bm = &mut self.blocks[b as usize];
        if let Some(t) = bm.tick.take() {
            self.lru.remove(&t);
        }
        bm.refs += 1;
    }

    /// Drops one reference of request `id`'s block `b`; at zero a published block becomes
    /// evictable (newest tick) and any other block free.
    pub(super) fn release(&mut self, id: RequestId, b: u32) -> Result<()> {
        let bm = &mut self.blocks[b as usize];
        if bm.refs == 0 {
            return Err(Error::Internal(format!(
                "block {b} of request {id} already has no reference"
            )));
        }
        bm.refs -= 1;
        if bm.refs == 0 {
            if bm.key.is_some() {
                self.tick += 1;
                bm.tick = Some(self.tick);
                self.lru.insert(self.tick, b);
            } else {
                self.free.push(b);
            }
        }
        Ok(())
    }
}

/// The block slabs (one block-planar slab per block) and their sealed flags.
pub(super) struct Slabs {
    slabs: Vec<RwLock<Vec<u8>>>,
    sealed: Vec<AtomicBool>,
    touched: Vec<AtomicBool>,
    allocated: AtomicUsize,
    backing: Backing,
    slab_bytes: usize,
}

impl Slabs {
    /// `n` empty slabs of `slab_bytes` each (allocated on first use). Fallible: `n` is the caller's.
    pub(super) fn new(n: usize, backing: Backing, slab_bytes: usize) -> Result<Slabs> {
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
        Ok(Slabs {
            slabs,
            sealed,
            touched,
            allocated: AtomicUsize::new(0),
            backing,
            slab_bytes,
        })
    }

    /// Slab bytes allocated from the host (Host) or handed out so far (Accounting).
    pub(super) fn allocated(&self) -> usize {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Bytes of block `b`'s slab as allocated (0 before first use; Host backing).
    pub(super) fn len(&self, b: u32) -> usize {
        self.slabs[b as usize].read().len()
    }

    pub(super) fn read(&self, b: usize) -> RwLockReadGuard<'_, Vec<u8>> {
        self.slabs[b].read()
    }

    pub(super) fn write(&self, b: usize) -> RwLockWriteGuard<'_, Vec<u8>> {
        self.slabs[b].write()
    }

    pub(super) fn seal(&self, b: u32, sealed: bool) {
        self.sealed[b as usize].store(sealed, Ordering::Release);
    }

    pub(super) fn is_sealed(&self, b: usize) -> bool {
        self.sealed[b].load(Ordering::Acquire)
    }

    /// Makes block `b`'s slab exist (first use: allocated fallibly, Host) and hold only zeros
    /// (reuse: the previous owner's records are cleared). Accounting backing only counts bytes.
    pub(super) fn prepare(&self, b: u32) -> Result<()> {
        let b = b as usize;
        let bytes = self.slab_bytes;
        if self.backing == Backing::Accounting {
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

    /// Errors with [`Error::NotFound`] when block `block`'s slab was never allocated: the block
    /// was never handed out, so no slot of it holds a record.
    pub(super) fn check_ready(slab: &[u8], block: usize) -> Result<()> {
        if slab.is_empty() {
            return Err(Error::NotFound(format!(
                "block {block} has never been allocated to a request: none of its slots holds a record"
            )));
        }
        Ok(())
    }
}

/// Record and page I/O on the slabs.
impl CacheManager {
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
            let req = m.tables.get(id)?;
            let (have, serial) = (req.table.len(), req.serial);
            let extra = need_blocks.saturating_sub(have);
            if extra == 0 {
                let req = m.tables.get_mut(id)?;
                req.tokens = req.tokens.max(tokens);
                return Ok(());
            }
            if extra > m.pool.available() {
                return Err(Error::OutOfBlocks {
                    requested: extra,
                    free: m.pool.free.len(),
                    evictable: m.pool.lru.len(),
                });
            }
            let mut fresh = Vec::with_capacity(extra);
            for _ in 0..extra {
                let (b, evicted) = m.pool.take();
                if let Some(k) = evicted {
                    m.index.remove(&k);
                    self.slabs.seal(b, false);
                }
                fresh.push(b);
            }
            let ticket = m.tables.reserve(fresh.clone());
            (ticket, serial, fresh)
        };
        // Phase 2 (no metadata lock): make every slab exist and hold zeros.
        let prepared = fresh.iter().try_for_each(|&b| self.slabs.prepare(b));
        // Phase 3 (locked): publish into the table, or give the blocks back.
        let mut guard = self.meta.lock();
        let m = &mut *guard;
        m.tables.unreserve(ticket);
        let live = m.tables.get(id).is_ok_and(|r| r.serial == serial);
        if let (Ok(()), true) = (&prepared, live) {
            let req = m.tables.get_mut(id)?;
            req.table.extend_from_slice(&fresh);
            req.tokens = req.tokens.max(tokens);
            return Ok(());
        }
        m.pool.give_back(&fresh);
        prepared?;
        Err(Error::NotFound(format!(
            "request {id} (freed while its blocks were being allocated)"
        )))
    }

    pub(super) fn place(&self, layer: usize, kind: RecordKind) -> Result<&PagePlace> {
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

    pub(super) fn split_slot(&self, place: &PagePlace, slot: u64) -> Result<(usize, usize)> {
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

    pub(super) fn host_only(&self) -> Result<()> {
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
        let mut slab = self.slabs.write(block);
        Slabs::check_ready(&slab, block)?;
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

    fn check_unsealed(&self, block: usize, slot: u64) -> Result<()> {
        if self.slabs.is_sealed(block) {
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
        let slab = self.slabs.read(block);
        Slabs::check_ready(&slab, block)?;
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
        let mut slab = self.slabs.write(block);
        Slabs::check_ready(&slab, block)?;
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
        let slab = self.slabs.read(block);
        Slabs::check_ready(&slab, block)?;
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
        self.check_block(block)?;
        let slab = self.slabs.read(block as usize);
        Slabs::check_ready(&slab, block as usize)?;
        Ok(f(&slab[place.range()]))
    }

    fn check_block(&self, block: u32) -> Result<()> {
        if block as usize >= self.config.num_blocks {
            return Err(Error::invalid(
                "block",
                format!("{block} is past the pool of {}", self.config.num_blocks),
            ));
        }
        Ok(())
    }

    /// Copies a whole block slab out (all layers' pages) — the unit the SSD tier stores.
    pub fn read_slab(&self, block: u32) -> Result<Vec<u8>> {
        self.host_only()?;
        self.check_block(block)?;
        let b = block as usize;
        let slab = self.slabs.read(b);
        Slabs::check_ready(&slab, b)?;
        Ok(slab.clone())
    }

    /// Fills a block slab from a persisted copy (a prefix loaded back from the SSD tier) before it
    /// is published.
    ///
    /// Errors: [`Error::Shape`] when `bytes` is not one slab; [`Error::Invalid`] when the block is sealed.
    pub fn write_slab(&self, block: u32, bytes: &[u8]) -> Result<()> {
        self.host_only()?;
        self.check_block(block)?;
        let b = block as usize;
        if bytes.len() != self.layout.slab_bytes {
            return Err(Error::shape(
                "slab bytes",
                self.layout.slab_bytes,
                bytes.len(),
            ));
        }
        if self.slabs.is_sealed(b) {
            return Err(Error::invalid(
                "block",
                format!("{block} is a published prefix block (read-only)"),
            ));
        }
        let mut slab = self.slabs.write(b);
        Slabs::check_ready(&slab, b)?;
        slab.copy_from_slice(bytes);
        Ok(())
    }
}
