//! Accounting: block and byte counts read from the allocator (never computed from a formula),
//! per request and cache-wide, and the allocator's invariants.

use super::{Backing, CacheManager, RequestId};
use crate::error::{Error, Result};
use serde::Serialize;

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

impl CacheManager {
    /// Measured global-KV bytes of request `id`: the slab lengths of its blocks as allocated
    /// (Host) or handed out (Accounting), against the records that exist for its tokens.
    pub fn request_bytes(&self, id: RequestId) -> Result<RequestBytes> {
        let (table, tokens) = {
            let m = self.meta.lock();
            let r = m.tables.get(id)?;
            (r.table.clone(), r.tokens)
        };
        let slab_bytes: usize = match self.config.backing {
            Backing::Host => table.iter().map(|&b| self.slabs.len(b)).sum(),
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
        let used = m.pool.blocks.iter().filter(|b| b.refs > 0).count();
        let cached = m.pool.lru.len();
        let slab = self.layout.slab_bytes;
        let host = self.config.backing == Backing::Host;
        let session_bytes = m
            .tables
            .requests
            .values()
            .map(|r| {
                let st = r.session.lock();
                let ring = if host {
                    st.swa.bytes()
                } else {
                    self.spec.swa_ring_bytes()
                };
                ring + st.carries.bytes()
            })
            .sum();
        CacheStats {
            total_blocks: m.pool.blocks.len(),
            used_blocks: used,
            cached_blocks: cached,
            free_blocks: m.pool.free.len(),
            slab_bytes: slab,
            allocated_bytes: self.slabs.allocated(),
            in_use_bytes: used * slab,
            cached_bytes: cached * slab,
            session_bytes,
            requests: m.tables.requests.len(),
            evictions: m.pool.evictions,
            prefix_hits: m.index.hits,
            prefix_queries: m.index.queries,
        }
    }

    /// Checks the allocator's invariants (for tests and debug builds): every block is exactly one
    /// of free, cached (in the LRU, keyed, no reference) or used; reference counts equal the number
    /// of tables holding the block (plus one while an allocation in flight holds it); the prefix index and block keys agree.
    pub fn check_invariants(&self) -> Result<()> {
        let guard = self.meta.lock();
        let (p, t) = (&guard.pool, &guard.tables);
        let mut refs = vec![0u32; p.blocks.len()];
        for r in t.requests.values() {
            for &b in &r.table {
                refs[b as usize] += 1;
            }
        }
        // Blocks an allocation in flight holds (referenced, not yet in a table).
        for &b in t.reserved.values().flatten() {
            refs[b as usize] += 1;
        }
        let mut in_free = vec![false; p.blocks.len()];
        for &b in &p.free {
            if std::mem::replace(&mut in_free[b as usize], true) {
                return Err(Error::Internal(format!(
                    "block {b} is twice in the free list"
                )));
            }
        }
        for (i, bm) in p.blocks.iter().enumerate() {
            if bm.refs != refs[i] {
                return Err(Error::Internal(format!(
                    "block {i}: count {} but {} tables hold it",
                    bm.refs, refs[i]
                )));
            }
            let cached = bm.tick.is_some_and(|t| p.lru.get(&t) == Some(&(i as u32)));
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
                if guard.index.get(&k) != Some(i as u32) {
                    return Err(Error::Internal(format!(
                        "block {i}'s key is not indexed to it"
                    )));
                }
            }
        }
        if p.lru.len() + p.free.len() + p.blocks.iter().filter(|b| b.refs > 0).count()
            != p.blocks.len()
        {
            return Err(Error::Internal("block states do not add up".into()));
        }
        Ok(())
    }
}
