//! Prefix keys: a chained SHA-256 over the token ids of each full block.
//!
//! Key of block `i` = SHA-256(domain ‖ salt ‖ key of block `i − 1` ‖ token count ‖ token ids as u32 LE).
//! The salt binds the model fingerprint, the KV layout and the block size, so two caches that could
//! not share records never share keys. Chaining makes a key name the whole prefix, not one block, and
//! SHA-256 makes a crafted prompt unable to produce another prompt's key (vLLM's default hash since
//! v0.10.2; docs/SPEC.md §0.5). The seed is deterministic, so keys survive restarts and
//! are shared between processes (vLLM #51875).

use sha2::{Digest, Sha256};
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
