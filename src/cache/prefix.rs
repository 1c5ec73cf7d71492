//! Prefix keys: a chained SHA-256 over the token ids of each full block.
//!
//! Key of block `i` = SHA-256(domain ‖ salt ‖ key of block `i − 1` ‖ token count ‖ token ids as u32 LE).
//! The salt binds the model fingerprint, the KV layout and the block size, so two caches that could
//! not share records never share keys. Chaining makes a key name the whole prefix, not one block, and
//! SHA-256 makes a crafted prompt unable to produce another prompt's key (vLLM's default hash since
//! v0.10.2; docs/SPEC.md §0.5). The seed is deterministic, so keys survive restarts and
//! are shared between processes (vLLM #51875).
//!
//! [`PrefixIndex`] maps published keys to blocks; the facade's [`CacheManager::lookup_prefix`],
//! [`CacheManager::adopt_prefix`] and [`CacheManager::publish`] keep it and the block pool in step.

use super::pool::BlockPool;
use super::{CacheManager, Meta, RequestId};
use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;

/// A 32-byte chained prefix key; names a block *and every block before it*.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrefixKey(pub [u8; 32]);

impl PrefixKey {
    /// Lowercase hex of the key.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for PrefixKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PrefixKey({}…)", &self.hex()[..12])
    }
}

/// Domain-separation tags, so a block key can never equal a salt or a snapshot key.
const DOMAIN_SALT: &[u8] = b"csa2/prefix-salt/v1";
const DOMAIN_BLOCK: &[u8] = b"csa2/prefix-block/v1";

/// Computes chained block keys for one cache configuration.
#[derive(Clone, Debug)]
pub struct PrefixHasher {
    salt: [u8; 32],
    block_tokens: usize,
}

impl PrefixHasher {
    /// A hasher salted with a model fingerprint (e.g. the config digest), the KV layout name and
    /// the block size in tokens.
    pub fn new(model: &[u8], layout: &str, block_tokens: usize) -> PrefixHasher {
        let mut h = Sha256::new();
        h.update(DOMAIN_SALT);
        h.update((model.len() as u64).to_le_bytes());
        h.update(model);
        h.update((layout.len() as u64).to_le_bytes());
        h.update(layout.as_bytes());
        h.update((block_tokens as u64).to_le_bytes());
        PrefixHasher {
            salt: h.finalize().into(),
            block_tokens,
        }
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The key of one block given its parent's key (`None` for the first block).
    pub fn block_key(&self, parent: Option<&PrefixKey>, tokens: &[u32]) -> PrefixKey {
        let mut h = Sha256::new();
        h.update(DOMAIN_BLOCK);
        h.update(self.salt);
        match parent {
            Some(p) => {
                h.update([1u8]);
                h.update(p.0);
            }
            None => h.update([0u8]),
        }
        h.update((tokens.len() as u64).to_le_bytes());
        // Token ids as one contiguous little-endian buffer: one `update` call per block.
        let mut buf = Vec::with_capacity(tokens.len() * 4);
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        h.update(&buf);
        PrefixKey(h.finalize().into())
    }

    /// Keys of every *full* block of `tokens`, in order (a trailing partial block has no key:
    /// only full blocks are shareable, as in vLLM).
    pub fn keys(&self, tokens: &[u32]) -> Vec<PrefixKey> {
        let mut out: Vec<PrefixKey> = Vec::with_capacity(tokens.len() / self.block_tokens);
        for chunk in tokens.chunks_exact(self.block_tokens) {
            let k = self.block_key(out.last(), chunk);
            out.push(k);
        }
        out
    }

    /// The key of a derived object stored at a block boundary (e.g. the SWA snapshot at the end
    /// of the block named `at`); `tag` separates kinds of objects.
    pub fn derived_key(&self, at: &PrefixKey, tag: &str) -> PrefixKey {
        let mut h = Sha256::new();
        h.update(b"csa2/derived/v1");
        h.update((tag.len() as u64).to_le_bytes());
        h.update(tag.as_bytes());
        h.update(at.0);
        PrefixKey(h.finalize().into())
    }
}

/// Published keys → blocks, and the hit counters (under the manager's metadata lock).
#[derive(Default)]
pub(super) struct PrefixIndex {
    map: HashMap<PrefixKey, u32>,
    pub(super) hits: u64,
    pub(super) queries: u64,
}

impl PrefixIndex {
    pub(super) fn get(&self, k: &PrefixKey) -> Option<u32> {
        self.map.get(k).copied()
    }
    pub(super) fn remove(&mut self, k: &PrefixKey) {
        self.map.remove(k);
    }

    /// Length of the leading run of `keys` that is cached as one chain: key `i` is indexed and
    /// its block was published with key `i − 1` as parent (key 0 with none).
    ///
    /// Errors: [`Error::Invalid`] when a cached key's parent is not the key before it (the keys
    /// were not computed from one token sequence, e.g. two prompts' keys spliced together).
    fn chain_run(&self, pool: &BlockPool, keys: &[PrefixKey]) -> Result<usize> {
        let mut parent: Option<&PrefixKey> = None;
        for (i, k) in keys.iter().enumerate() {
            let Some(&b) = self.map.get(k) else {
                return Ok(i);
            };
            if pool.blocks[b as usize].parent.as_ref() != parent {
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

impl CacheManager {
    /// Longest run of leading `keys` present in the cache (no state change). Only a chain counts:
    /// key `i` must have been published right after key `i − 1` (key 0 as a prefix head).
    ///
    /// Errors: [`Error::Invalid`] when `keys` repeats a key.
    pub fn lookup_prefix(&self, keys: &[PrefixKey]) -> Result<usize> {
        check_distinct(keys)?;
        let m = self.meta.lock();
        m.index.chain_run(&m.pool, keys)
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
        let m: &mut Meta = &mut guard;
        let req = m.tables.get(id)?;
        if !req.table.is_empty() {
            return Err(Error::invalid(
                "request",
                format!(
                    "{id} already holds {} blocks; adopt a prefix before allocating",
                    req.table.len()
                ),
            ));
        }
        let run = m.index.chain_run(&m.pool, keys)?;
        let mut adopted = Vec::new();
        for k in &keys[..run] {
            let b = m.index.get(k).expect("in the chain run");
            m.pool.adopt(b);
            adopted.push(b);
        }
        m.index.queries += keys.len() as u64;
        m.index.hits += adopted.len() as u64;
        let n = adopted.len();
        let req = m.tables.get_mut(id)?;
        req.table = adopted;
        req.tokens = n * self.config.block_tokens;
        Ok(n)
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
        let m: &mut Meta = &mut guard;
        let req = m.tables.get(id)?;
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
            let bm = &mut m.pool.blocks[b as usize];
            if bm.key.is_some() || m.index.map.contains_key(k) {
                continue;
            }
            bm.key = Some(*k);
            bm.parent = i.checked_sub(1).map(|p| keys[p]);
            m.index.map.insert(*k, b);
            self.slabs.seal(b, true);
            n += 1;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_share_keys_and_diverge_after() {
        let h = PrefixHasher::new(b"m", "nvfp4", 4);
        let a = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let b = [1, 2, 3, 4, 5, 6, 7, 9, 9];
        let (ka, kb) = (h.keys(&a), h.keys(&b));
        assert_eq!(ka.len(), 2, "the partial third block has no key");
        assert_eq!(ka[0], kb[0]);
        assert_ne!(ka[1], kb[1]);
    }

    #[test]
    fn chaining_binds_the_whole_prefix() {
        let h = PrefixHasher::new(b"m", "nvfp4", 2);
        // Same second block, different first block → different second key.
        let k1 = h.keys(&[1, 2, 3, 4]);
        let k2 = h.keys(&[9, 9, 3, 4]);
        assert_ne!(k1[1], k2[1]);
    }

    #[test]
    fn salt_separates_layouts_models_and_block_sizes() {
        let t: Vec<u32> = (0..8).collect();
        let base = PrefixHasher::new(b"m", "nvfp4", 4).keys(&t)[0];
        assert_ne!(base, PrefixHasher::new(b"m", "v4", 4).keys(&t)[0]);
        assert_ne!(base, PrefixHasher::new(b"n", "nvfp4", 4).keys(&t)[0]);
        assert_ne!(
            PrefixHasher::new(b"m", "nvfp4", 8).keys(&t)[0],
            PrefixHasher::new(b"m", "nvfp4", 4).keys(&t)[0]
        );
    }

    #[test]
    fn deterministic_across_hashers() {
        let t: Vec<u32> = (0..16).collect();
        assert_eq!(
            PrefixHasher::new(b"m", "nvfp4", 4).keys(&t),
            PrefixHasher::new(b"m", "nvfp4", 4).keys(&t)
        );
        let h = PrefixHasher::new(b"m", "nvfp4", 4);
        let k = h.keys(&t)[0];
        assert_ne!(h.derived_key(&k, "swa"), k);
        assert_ne!(h.derived_key(&k, "swa"), h.derived_key(&k, "other"));
    }
}
