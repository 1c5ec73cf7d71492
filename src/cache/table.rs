//! Block tables and slot mapping: per request, the blocks covering its tokens and the compressed
//! entries stored through them.
//!
//! Compressed entry `j` of a ratio-m layer lives in block `table[j·m / block_tokens]`, slot
//! `block · S + j mod S` with `S = block_tokens / m` (vLLM's `block_table[i // S]·S + i % S`,
//! docs/SPEC.md §1.6). The C ABI maps slots here (`csa2_cache_slot_mapping`, `csa2_cache_write_entries`);
//! the engine's [`crate::backend::KvCache`] over this manager appends and gathers entries here.

use super::layout::RecordKind;
use super::{CacheManager, RequestId, SessionState};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;

pub(super) struct Request {
    /// Unique per `add_request` (ids may be reused after a free).
    pub(super) serial: u64,
    pub(super) table: Vec<u32>,
    pub(super) tokens: usize,
    /// Per pool (index into `spec.pools`), [main, index]: compressed entries stored in order
    /// through [`CacheManager::append_entries`] (one past the highest written).
    pub(super) entries: Vec<[usize; 2]>,
    pub(super) session: Arc<Mutex<SessionState>>,
}

/// The live requests' tables (under the metadata lock).
#[derive(Default)]
pub(super) struct Tables {
    pub(super) requests: HashMap<RequestId, Request>,
    /// Blocks taken by an `allocate` whose slabs are being prepared (zeroed or allocated) outside
    /// the metadata lock, not yet in any table: ticket → blocks.
    pub(super) reserved: BTreeMap<u64, Vec<u32>>,
    /// Source of request serials and reservation tickets.
    serial: u64,
}

fn not_found(id: RequestId) -> Error {
    Error::NotFound(format!("request {id}"))
}

impl Tables {
    pub(super) fn get(&self, id: RequestId) -> Result<&Request> {
        self.requests.get(&id).ok_or_else(|| not_found(id))
    }

    pub(super) fn get_mut(&mut self, id: RequestId) -> Result<&mut Request> {
        self.requests.get_mut(&id).ok_or_else(|| not_found(id))
    }

    /// Registers `id` with an empty table.
    pub(super) fn insert(
        &mut self,
        id: RequestId,
        pools: usize,
        session: Arc<Mutex<SessionState>>,
    ) -> Result<()> {
        if self.requests.contains_key(&id) {
            return Err(Error::invalid(
                "request",
                format!("id {id} is already live"),
            ));
        }
        self.serial += 1;
        self.requests.insert(
            id,
            Request {
                serial: self.serial,
                table: Vec::new(),
                tokens: 0,
                entries: vec![[0; 2]; pools],
                session,
            },
        );
        Ok(())
    }

    pub(super) fn remove(&mut self, id: RequestId) -> Result<Request> {
        self.requests.remove(&id).ok_or_else(|| not_found(id))
    }

    /// Holds `blocks` for an allocation in flight; returns its ticket.
    pub(super) fn reserve(&mut self, blocks: Vec<u32>) -> u64 {
        self.serial += 1;
        self.reserved.insert(self.serial, blocks);
        self.serial
    }

    pub(super) fn unreserve(&mut self, ticket: u64) {
        self.reserved.remove(&ticket);
    }
}

fn kind_index(kind: RecordKind) -> usize {
    match kind {
        RecordKind::Main => 0,
        RecordKind::Index => 1,
    }
}

impl CacheManager {
    /// The block table of request `id` (block ids, one per `block_tokens` tokens).
    pub fn block_table(&self, id: RequestId) -> Result<Vec<u32>> {
        let m = self.meta.lock();
        m.tables.get(id).map(|r| r.table.clone())
    }

    /// Slots of `entries` of `layer` through request `id`'s table, after `check(cap, ratio)` has
    /// accepted them against the `cap` entries the table covers.
    fn map_entries(
        &self,
        id: RequestId,
        layer: usize,
        entries: impl Iterator<Item = usize>,
        check: impl FnOnce(usize, usize) -> Result<()>,
    ) -> Result<Vec<u64>> {
        let place = *self.place(layer, RecordKind::Main)?;
        let s = place.page.slots;
        let m = self.meta.lock();
        let req = m.tables.get(id)?;
        check(req.table.len() * s, place.ratio)?;
        Ok(entries
            .map(|j| req.table[j / s] as u64 * s as u64 + (j % s) as u64)
            .collect())
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
        let whole = entries.clone();
        self.map_entries(id, layer, entries, |cap, ratio| {
            if whole.end > cap {
                return Err(Error::invalid(
                    "entries",
                    format!(
                        "{whole:?} of layer {layer} (ratio {ratio}) exceeds the {cap} entries allocated for request {id}"
                    ),
                ));
            }
            Ok(())
        })
    }

    /// Physical slots of the compressed entries `entries` (any order, repeats allowed) of KV-source
    /// `layer` for request `id`: [`CacheManager::slot_mapping`] for a gather list.
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (not a KV-source layer, or an entry
    /// past the request's allocated tokens, naming the first such entry).
    pub fn slots_of(&self, id: RequestId, layer: usize, entries: &[usize]) -> Result<Vec<u64>> {
        self.map_entries(id, layer, entries.iter().copied(), |cap, ratio| {
            if let Some((i, &j)) = entries.iter().enumerate().find(|(_, &j)| j >= cap) {
                return Err(Error::invalid(
                    "entries",
                    format!(
                        "entry {j} (at index {i}) of layer {layer} (ratio {ratio}) is past the {cap} entries allocated for request {id}"
                    ),
                ));
            }
            Ok(())
        })
    }

    /// Writes standalone `records` (data then scales, one per slot, in order) into `slots` of
    /// `layer`'s `kind` cache, all or nothing: every slot is checked writable before the first
    /// byte is copied.
    fn write_slots(
        &self,
        layer: usize,
        kind: RecordKind,
        slots: &[u64],
        records: &[u8],
    ) -> Result<()> {
        let rb = self.place(layer, kind)?.page.format.record_bytes();
        if records.len() != slots.len() * rb {
            return Err(Error::shape(
                format!("layer {layer} {kind:?} records"),
                slots.len() * rb,
                records.len(),
            ));
        }
        self.check_writable(layer, kind, slots)?;
        for (slot, r) in slots.iter().zip(records.chunks_exact(rb)) {
            self.write_record(layer, kind, *slot, r)?;
        }
        Ok(())
    }

    /// Appends (or rewrites the tail of) request `id`'s compressed entries `first ..` of `layer`'s
    /// `kind` cache: grows the block table to cover them (entry `j` of a ratio-m layer covers
    /// tokens `[j·m, j·m + m)`), then writes `records` (standalone records, all or nothing), and
    /// counts them ([`CacheManager::stored_entries`]). A full pool fails with
    /// [`Error::OutOfBlocks`] before any slot is touched.
    ///
    /// Errors: [`Error::Invalid`] when `first` would leave a gap after the stored entries; those
    /// of [`CacheManager::allocate`], [`CacheManager::check_writable`] and
    /// [`CacheManager::write_record`]; [`Error::Shape`] when `records` is not whole records.
    pub fn append_entries(
        &self,
        id: RequestId,
        layer: usize,
        kind: RecordKind,
        first: usize,
        records: &[u8],
    ) -> Result<()> {
        let (pool, place) = self.pool_of(layer, kind)?;
        let rb = place.page.format.record_bytes();
        if !records.len().is_multiple_of(rb) {
            return Err(Error::shape(
                format!("layer {layer} {kind:?} records"),
                format!("a multiple of {rb}"),
                records.len(),
            ));
        }
        let n = records.len() / rb;
        let count = self.stored_entries(id, layer, kind)?;
        if first > count {
            return Err(Error::invalid(
                "first",
                format!(
                    "layer {layer} {kind:?}: entry {first} would leave a gap after {count} stored entries"
                ),
            ));
        }
        if records.is_empty() {
            return Ok(());
        }
        self.allocate(id, (first + n) * place.ratio)?;
        let slots = self.slot_mapping(id, layer, first..first + n)?;
        self.write_slots(layer, kind, &slots, records)?;
        let mut m = self.meta.lock();
        let c = &mut m.tables.get_mut(id)?.entries[pool][kind_index(kind)];
        *c = (*c).max(first + n);
        Ok(())
    }

    /// Entries stored through [`CacheManager::append_entries`] for request `id` in `layer`'s
    /// `kind` cache.
    ///
    /// Errors: [`Error::NotFound`] (request), [`Error::Invalid`] (not a KV-source layer).
    pub fn stored_entries(&self, id: RequestId, layer: usize, kind: RecordKind) -> Result<usize> {
        let (pool, _) = self.pool_of(layer, kind)?;
        let m = self.meta.lock();
        Ok(m.tables.get(id)?.entries[pool][kind_index(kind)])
    }

    /// Gathers the standalone records of entries `range` of request `id`'s `kind` cache of `layer`
    /// in entry order (one page lock per run of entries in the same block).
    ///
    /// Errors: those of [`CacheManager::slot_mapping`] and [`CacheManager::with_page`].
    pub fn gather_entries(
        &self,
        id: RequestId,
        layer: usize,
        kind: RecordKind,
        range: Range<usize>,
    ) -> Result<Vec<u8>> {
        let place = *self.place(layer, kind)?;
        let (page, slots_per_block) = (place.page, place.page.slots as u64);
        let fmt = page.format;
        let (rb, db) = (fmt.record_bytes(), fmt.data_bytes());
        let slots = self.slot_mapping(id, layer, range)?;
        let mut out = vec![0u8; slots.len() * rb];
        // Consecutive entries share a block until the page is full: one page lock per block run.
        let mut i = 0;
        while i < slots.len() {
            let block = slots[i] / slots_per_block;
            let run = slots[i..]
                .iter()
                .take_while(|&&s| s / slots_per_block == block)
                .count();
            let dst = &mut out[i * rb..(i + run) * rb];
            self.with_page(layer, kind, block as u32, |pg| {
                for (s, o) in slots[i..i + run].iter().zip(dst.chunks_exact_mut(rb)) {
                    let (d, sc) = page.slot_ranges((s % slots_per_block) as usize);
                    o[..db].copy_from_slice(&pg[d]);
                    o[db..].copy_from_slice(&pg[sc]);
                }
            })?;
            i += run;
        }
        Ok(out)
    }

    /// The index into `spec.pools` and the page place of `layer`'s `kind` cache.
    fn pool_of(&self, layer: usize, kind: RecordKind) -> Result<(usize, super::PagePlace)> {
        let place = *self.place(layer, kind)?;
        let pool = self
            .spec
            .pools
            .iter()
            .position(|p| p.layer == layer)
            .ok_or_else(|| Error::Internal(format!("layer {layer} has a page but no pool")))?;
        Ok((pool, place))
    }
}
