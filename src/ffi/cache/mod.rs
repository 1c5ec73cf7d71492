//! KV cache manager over the C ABI: the C face of [`crate::cache`] (handle lifecycle, requests,
//! block tables, prefix keys and stats here; record-level access in [`records`]).
//!
//! # Ownership and lifetimes
//! [`csa2_cache_create`] returns a handle owned by the caller; free it once with
//! [`csa2_cache_free`]. A handle does not borrow the geometry it was built from: the geometry may be
//! freed right after the call.
//!
//! # Thread safety
//! A `Csa2Cache` is internally locked (block metadata behind one mutex, each block's slab behind
//! its own lock; see `crate::cache`): every `csa2_cache_*` call may be made concurrently from any
//! number of threads on the same handle. `csa2_cache_free` may race them too: calls already in
//! flight finish on the live cache, later ones get `CSA2_ERR_INVALID_HANDLE` (handles are checked
//! tokens, `super::handle`). A block handed to a request is in its table only once its slab is
//! allocated and zeroed, so record calls racing `csa2_cache_allocate` on the same request see
//! either no block or a ready one.
//!
//! # Output buffers
//! Functions that return a variable-length array (`csa2_cache_prefix_keys`,
//! `csa2_cache_block_table`) follow [`super::sized_out`]'s convention.

mod records;
pub use records::*;

use crate::cache::{Backing, CacheConfig, CacheManager, CacheSpec, PrefixKey, RequestId};
use crate::error::{Error, Result};
use crate::ffi::geometry::geometry;
use crate::ffi::handle;
use crate::ffi::Csa2Status;
use crate::ffi::{
    arg_out, arg_slice, arg_slice_mut, guarded, guarded_free, sized_out, Csa2Geometry,
};
use crate::formats::KvScheme;
use std::sync::Arc;

/// Bytes of one prefix key (SHA-256).
pub const CSA2_PREFIX_KEY_BYTES: usize = 32;

/// Most blocks a cache may have (`num_blocks` of `csa2_cache_create`): 2^24. (Rust only: the C
/// header states the numbers in the function comments.)
pub const CSA2_MAX_NUM_BLOCKS: usize = crate::cache::MAX_NUM_BLOCKS;

/// Most tokens a block may hold (`block_tokens` of `csa2_cache_create`): 2^16.
pub const CSA2_MAX_BLOCK_TOKENS: usize = crate::cache::MAX_BLOCK_TOKENS;

/// Token positions given to the cache (`pos_start` of the SWA calls) are below this: 2^62.
pub const CSA2_MAX_POSITION: u64 = crate::cache::MAX_POSITION as u64;

/// Opaque KV cache manager handle (paged block pool, block tables, prefix index). Free with
/// [`csa2_cache_free`]. Internally locked: see the module docs for what may run concurrently.
pub struct Csa2Cache {
    m: CacheManager,
}

impl std::ops::Deref for Csa2Cache {
    type Target = CacheManager;
    fn deref(&self) -> &CacheManager {
        &self.m
    }
}

handle_type!(Csa2Cache, 0xC2);
/// Cache-wide block and byte counts, measured from the allocator (see `CacheStats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2CacheStats {
    /// Blocks in the pool.
    pub total_blocks: u64,
    /// Blocks referenced by at least one live request.
    pub used_blocks: u64,
    /// Published blocks with no reference (evictable, still findable by prefix key).
    pub cached_blocks: u64,
    /// Blocks holding nothing.
    pub free_blocks: u64,
    /// Bytes of one block's slab.
    pub slab_bytes: u64,
    /// Slab bytes actually allocated so far (slabs are allocated on first use and kept).
    pub allocated_bytes: u64,
    /// `used_blocks × slab_bytes`.
    pub in_use_bytes: u64,
    /// `cached_blocks × slab_bytes`.
    pub cached_bytes: u64,
    /// Per-request state bytes (SWA rings and pending compressor groups).
    pub session_bytes: u64,
    /// Live requests.
    pub requests: u64,
    /// Cached blocks evicted to satisfy allocations.
    pub evictions: u64,
    /// Prefix keys adopted.
    pub prefix_hits: u64,
    /// Prefix keys offered to `csa2_cache_adopt_prefix`.
    pub prefix_queries: u64,
}

/// Global-KV bytes of one request, measured (see `RequestBytes`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Csa2RequestBytes {
    /// Tokens allocated.
    pub tokens: u64,
    /// Blocks in its table.
    pub blocks: u64,
    /// Slab bytes of those blocks.
    pub slab_bytes: u64,
    /// Bytes of the records that exist for its tokens.
    pub record_bytes: u64,
    /// `slab_bytes − record_bytes` (partial last block, page alignment).
    pub padding_bytes: u64,
    /// `slab_bytes / tokens` (0 with no tokens).
    pub bytes_per_token: f64,
}
/// Prefix keys from `n` × 32 bytes.
///
/// # Safety
/// A non-null `keys` must point to `n * 32` readable bytes.
unsafe fn keys_arg(keys: *const u8, n: usize) -> Result<Vec<PrefixKey>> {
    let len = n
        .checked_mul(CSA2_PREFIX_KEY_BYTES)
        .ok_or_else(|| Error::invalid("n_keys", format!("{n} keys overflow a byte count")))?;
    // SAFETY: `n * 32` readable bytes is the caller's contract.
    let bytes = unsafe { arg_slice(keys, len, "keys") }?;
    Ok(bytes
        .chunks_exact(CSA2_PREFIX_KEY_BYTES)
        .map(|c| PrefixKey(c.try_into().expect("32-byte chunk")))
        .collect())
}

/// The one body of the calls that take a key list and write a block count to `*n_out`
/// ([`csa2_cache_lookup_prefix`], [`csa2_cache_adopt_prefix`], [`csa2_cache_publish`]): checks the
/// handle, the keys and `n_out`, runs `op` and writes its count, all under [`guarded`] as `name`.
///
/// # Safety
/// A non-null `keys` must point to `n_keys × 32` readable bytes; a non-null `n_out` writable.
unsafe fn keys_call(
    name: &'static str,
    c: *const Csa2Cache,
    keys: *const u8,
    n_keys: usize,
    n_out: *mut usize,
    op: impl FnOnce(&Csa2Cache, &[PrefixKey]) -> Result<usize>,
) -> Csa2Status {
    guarded(name, || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, keys, n_out) =
            unsafe { (cache(c)?, keys_arg(keys, n_keys)?, arg_out(n_out, "n_out")?) };
        *n_out = op(&m, &keys)?;
        Ok(())
    })
}

/// The live cache behind handle `c` (null: `CSA2_ERR_NULL_POINTER`; freed, garbage or another
/// handle type: `CSA2_ERR_INVALID_HANDLE`). Derefs to the [`CacheManager`].
///
/// # Safety
/// None (every value is checked); `unsafe` only so the call sites read like the other arguments.
pub(super) unsafe fn cache(c: *const Csa2Cache) -> Result<Arc<Csa2Cache>> {
    handle::get(c, "cache")
}

/// Arguments of [`csa2_cache_create`].
/// Set `struct_size` to `sizeof(Csa2CacheCreateArgs)` (rules: "Args structs", header top).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2CacheCreateArgs {
    /// `sizeof(Csa2CacheCreateArgs)` as the caller was compiled.
    pub struct_size: usize,
    /// Live geometry handle (may be freed after the call).
    pub geometry: *const Csa2Geometry,
    /// `Csa2KvLayout` of the records.
    pub layout: i32,
    /// Blocks in the pool (1 ..= 2^24).
    pub num_blocks: usize,
    /// Tokens per block (1 ..= 2^16, a multiple of every KV-source ratio).
    pub block_tokens: usize,
    /// Extra prefix-key fingerprint (`model_len` bytes), or null with length 0.
    pub model: *const u8,
    /// Bytes at `model`.
    pub model_len: usize,
}

// SAFETY: repr(C), `struct_size: usize` first, every field a raw pointer or a number.
unsafe impl crate::ffi::ArgsStruct for Csa2CacheCreateArgs {
    const NAME: &'static str = "Csa2CacheCreateArgs";
    const V1_SIZE: usize = std::mem::size_of::<Csa2CacheCreateArgs>();
}

impl Default for Csa2CacheCreateArgs {
    /// All members zero, `struct_size` set (the C recipe).
    fn default() -> Self {
        crate::ffi::zeroed_args()
    }
}

/// Creates a KV cache manager for geometry `g` with KV layout `layout` (a `Csa2KvLayout`),
/// `num_blocks` blocks of `block_tokens` tokens, backed by host memory (slabs are allocated the
/// first time a block is handed out). The prefix keys are always salted with the whole geometry
/// (every field of the parsed config), the layout and the block size; `model`/`model_len` is an
/// extra fingerprint (e.g. a digest of the weights) added to that salt. Null with length 0 is no
/// extra fingerprint: the geometry alone then separates models, so two checkpoints of one
/// architecture need distinct fingerprints to never share blocks.
///
/// Errors: `CSA2_ERR_NULL_POINTER` (`geometry`, `out`, `model` with a length),
/// `CSA2_ERR_INVALID_HANDLE` (`geometry` not a live geometry handle),
/// `CSA2_ERR_INVALID_ARGUMENT` (unknown layout; `block_tokens` 0, above 2^16 = 65536 or not a
/// multiple of every KV-source ratio; `num_blocks` 0 or above 2^24 = 16777216),
/// `CSA2_ERR_OUT_OF_MEMORY` (the per-block bookkeeping does not fit; the message gives the
/// bytes). `*out` is untouched on error.
///
/// # Safety
/// `args`: `struct_size` readable bytes of a `Csa2CacheCreateArgs`. Its members:
/// `g` must be a live geometry handle; `model` must cover `model_len` bytes; `out` must be a
/// writable pointer slot.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_create(
    args: *const Csa2CacheCreateArgs,
    out: *mut *mut Csa2Cache,
) -> Csa2Status {
    guarded("csa2_cache_create", || {
        // SAFETY: `args` is the caller's (null, alignment and `struct_size` are checked).
        let Csa2CacheCreateArgs {
            struct_size: _,
            geometry: g,
            layout: layout_,
            num_blocks,
            block_tokens,
            model,
            model_len,
        } = unsafe { crate::ffi::read_args(args) }?;
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (g, model, out) = unsafe {
            (
                geometry(g)?,
                arg_slice(model, model_len, "model")?,
                arg_out(out, "out")?,
            )
        };
        let spec = CacheSpec::from_geometry(&g.g, KvScheme::from_abi_id(layout_)?);
        // The whole geometry (not only what the cache stores of it: RoPE, norms and widths change
        // the records too) always salts the keys; the caller's fingerprint is added to it.
        let geo = serde_json::to_vec(&g.g)
            .map_err(|e| Error::Internal(format!("geometry to JSON: {e}")))?;
        let mut salt = Vec::new();
        let len = 16 + geo.len() + model.len();
        salt.try_reserve_exact(len)
            .map_err(|_| Error::oom("prefix salt", len))?;
        salt.extend_from_slice(&(geo.len() as u64).to_le_bytes());
        salt.extend_from_slice(&geo);
        salt.extend_from_slice(&(model.len() as u64).to_le_bytes());
        salt.extend_from_slice(model);
        let m = CacheManager::new(
            spec,
            CacheConfig {
                block_tokens,
                num_blocks,
                backing: Backing::Host,
            },
            &salt,
        )?;
        *out = handle::register(Csa2Cache { m })?;
        Ok(())
    })
}

/// Frees a cache handle and every block and request in it. Null is a no-op (`CSA2_OK`). Calls
/// on the cache still in flight on other threads finish first (the memory goes with the last);
/// every later call with the handle gets `CSA2_ERR_INVALID_HANDLE`.
///
/// Errors: `CSA2_ERR_INVALID_HANDLE` (already freed, garbage, another handle type). A successful
/// free leaves the thread's last error alone.
///
/// # Safety
/// None beyond the C ABI's: any value of `c` is checked (kept `unsafe` for source compatibility).
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_free(c: *mut Csa2Cache) -> Csa2Status {
    guarded_free("csa2_cache_free", || handle::free(c, "cache"))
}

/// Registers request `id` with an empty block table.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` when `id` is already live.
///
/// # Safety
/// `c` must be a live cache handle.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_add_request(c: *const Csa2Cache, id: u64) -> Csa2Status {
    // SAFETY: the caller's contract.
    guarded("csa2_cache_add_request", || {
        unsafe { cache(c) }?.add_request(id as RequestId)
    })
}

/// Grows request `id`'s block table to cover `tokens` tokens (never shrinks), taking free blocks
/// first, then evicting the least recently used cached block.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (unknown request), `CSA2_ERR_OUT_OF_BLOCKS` (the pool cannot
/// supply the blocks: nothing changed, so free, preempt or retry).
///
/// # Safety
/// `c` must be a live cache handle.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_allocate(
    c: *const Csa2Cache,
    id: u64,
    tokens: usize,
) -> Csa2Status {
    // SAFETY: the caller's contract.
    guarded("csa2_cache_allocate", || {
        unsafe { cache(c) }?.allocate(id, tokens)
    })
}

/// Frees request `id`: its published blocks become evictable (still findable by key), the others
/// return to the free list. Slots it mapped must not be used afterwards.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (unknown request, including a double free).
///
/// # Safety
/// `c` must be a live cache handle.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_free_request(c: *const Csa2Cache, id: u64) -> Csa2Status {
    // SAFETY: the caller's contract.
    guarded("csa2_cache_free_request", || {
        unsafe { cache(c) }?.free_request(id)
    })
}

/// Chained prefix keys (32 bytes each, SHA-256 salted with the model, layout and block size) of
/// every *full* block of `tokens` (`n` token ids); a trailing partial block has no key. Writes
/// `n / block_tokens` keys to `out_keys` (`cap` keys = `cap × 32` bytes) and their count to
/// `*n_out`; see the module docs for `out_keys = NULL, cap = 0`.
///
/// Errors: `CSA2_ERR_NULL_POINTER` (`tokens` with `n > 0`, `n_out`), `CSA2_ERR_INVALID_ARGUMENT`
/// (`cap` too small: the message gives the count needed).
///
/// # Safety
/// `tokens` must cover `n` ids; `out_keys` must have room for `cap × 32` bytes; `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_prefix_keys(
    c: *const Csa2Cache,
    tokens: *const u32,
    n: usize,
    out_keys: *mut u8,
    cap: usize,
    n_out: *mut usize,
) -> Csa2Status {
    guarded("csa2_cache_prefix_keys", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, tokens, n_out) = unsafe {
            (
                cache(c)?,
                arg_slice(tokens, n, "tokens")?,
                arg_out(n_out, "n_out")?,
            )
        };
        let need = n / m.config().block_tokens;
        let byte_cap = cap
            .checked_mul(CSA2_PREFIX_KEY_BYTES)
            .ok_or_else(|| Error::invalid("cap", format!("{cap} keys overflow a byte count")))?;
        // Size check in keys, not bytes, so the message speaks the caller's unit.
        if !(out_keys.is_null() && cap == 0) && cap < need {
            return Err(Error::invalid(
                "cap",
                format!("prefix keys need {need} keys ({need} × 32 bytes), cap is {cap}"),
            ));
        }
        // SAFETY: room for `cap × 32` bytes is the caller's contract.
        let out =
            unsafe { sized_out(out_keys, byte_cap, need * CSA2_PREFIX_KEY_BYTES, "out_keys") }?;
        if let Some(out) = out {
            for (dst, k) in out
                .chunks_exact_mut(CSA2_PREFIX_KEY_BYTES)
                .zip(m.hasher().keys(tokens))
            {
                dst.copy_from_slice(&k.0);
            }
        }
        *n_out = need;
        Ok(())
    })
}

/// Writes to `*n_out` the longest run of leading keys (`n_keys` × 32 bytes at `keys`) present in
/// the cache. Changes nothing.
///
/// # Safety
/// `keys` must cover `n_keys × 32` bytes; `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_lookup_prefix(
    c: *const Csa2Cache,
    keys: *const u8,
    n_keys: usize,
    n_out: *mut usize,
) -> Csa2Status {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        keys_call(
            "csa2_cache_lookup_prefix",
            c,
            keys,
            n_keys,
            n_out,
            |m, k| m.lookup_prefix(k),
        )
    }
}

/// Attaches the longest cached run of leading keys to request `id` (whose table must be empty) and
/// writes the blocks adopted to `*n_out` (the hit covers `n_out × block_tokens` tokens).
///
/// Errors: `CSA2_ERR_NOT_FOUND` (unknown request), `CSA2_ERR_INVALID_ARGUMENT` (table not empty).
///
/// # Safety
/// `keys` must cover `n_keys × 32` bytes; `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_adopt_prefix(
    c: *const Csa2Cache,
    id: u64,
    keys: *const u8,
    n_keys: usize,
    n_out: *mut usize,
) -> Csa2Status {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        keys_call("csa2_cache_adopt_prefix", c, keys, n_keys, n_out, |m, k| {
            m.adopt_prefix(id, k)
        })
    }
}

/// Publishes the first `n_keys` full blocks of request `id` under `keys` once their records are
/// written; they become sealed and shareable. Writes the blocks newly published to `*n_out`.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (unknown request), `CSA2_ERR_INVALID_ARGUMENT` (more keys than
/// full blocks).
///
/// # Safety
/// `keys` must cover `n_keys × 32` bytes; `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_publish(
    c: *const Csa2Cache,
    id: u64,
    keys: *const u8,
    n_keys: usize,
    n_out: *mut usize,
) -> Csa2Status {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        keys_call("csa2_cache_publish", c, keys, n_keys, n_out, |m, k| {
            m.publish(id, k)
        })
    }
}

/// Copies request `id`'s block table (block ids, one per `block_tokens` tokens) to `out` (`cap`
/// entries) and its length to `*n_out`; see the module docs for `out = NULL, cap = 0`.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (unknown request), `CSA2_ERR_INVALID_ARGUMENT` (`cap` too small;
/// the message gives the length needed).
///
/// # Safety
/// `out` must have room for `cap` entries; `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_block_table(
    c: *const Csa2Cache,
    id: u64,
    out: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> Csa2Status {
    guarded("csa2_cache_block_table", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, n_out) = unsafe { (cache(c)?, arg_out(n_out, "n_out")?) };
        let table = m.block_table(id)?;
        // SAFETY: room for `cap` entries is the caller's contract.
        if let Some(dst) = unsafe { sized_out(out, cap, table.len(), "block table") }? {
            dst.copy_from_slice(&table);
        }
        *n_out = table.len();
        Ok(())
    })
}

/// Writes the physical slots of compressed entries `[start, start + count)` of KV-source `layer`
/// for request `id` to `out` (`count` entries, `int64_t` as vLLM's `slot_mapping` tensor): slot =
/// `block · S + j mod S` with `S = block_tokens / ratio` and block = `table[j / S]`.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (unknown request), `CSA2_ERR_INVALID_ARGUMENT` (not a KV-source
/// layer, or entries past the request's allocated tokens).
///
/// # Safety
/// `out` must have room for `count` entries.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_slot_mapping(
    c: *const Csa2Cache,
    id: u64,
    layer: usize,
    start: usize,
    count: usize,
    out: *mut i64,
) -> Csa2Status {
    guarded("csa2_cache_slot_mapping", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, out) = unsafe { (cache(c)?, arg_slice_mut(out, count, "out")?) };
        let end = start.checked_add(count).ok_or_else(|| {
            Error::invalid("count", format!("start {start} + count {count} overflows"))
        })?;
        let slots = m.slot_mapping(id, layer, start..end)?;
        for (d, s) in out.iter_mut().zip(slots) {
            *d = i64::try_from(s)
                .map_err(|_| Error::Internal(format!("slot {s} does not fit int64_t")))?;
        }
        Ok(())
    })
}

/// Writes the cache-wide block and byte counts to `*out`.
///
/// # Safety
/// `c` must be a live cache handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_stats(
    c: *const Csa2Cache,
    out: *mut Csa2CacheStats,
) -> Csa2Status {
    guarded("csa2_cache_stats", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, out) = unsafe { (cache(c)?, arg_out(out, "out")?) };
        let s = m.stats();
        *out = Csa2CacheStats {
            total_blocks: s.total_blocks as u64,
            used_blocks: s.used_blocks as u64,
            cached_blocks: s.cached_blocks as u64,
            free_blocks: s.free_blocks as u64,
            slab_bytes: s.slab_bytes as u64,
            allocated_bytes: s.allocated_bytes as u64,
            in_use_bytes: s.in_use_bytes as u64,
            cached_bytes: s.cached_bytes as u64,
            session_bytes: s.session_bytes as u64,
            requests: s.requests as u64,
            evictions: s.evictions,
            prefix_hits: s.prefix_hits,
            prefix_queries: s.prefix_queries,
        };
        Ok(())
    })
}

/// Writes request `id`'s measured global-KV bytes to `*out`.
///
/// Errors: `CSA2_ERR_NOT_FOUND` (unknown request).
///
/// # Safety
/// `c` must be a live cache handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_cache_request_bytes(
    c: *const Csa2Cache,
    id: u64,
    out: *mut Csa2RequestBytes,
) -> Csa2Status {
    guarded("csa2_cache_request_bytes", || {
        // SAFETY: pointer validity is the caller's contract; nulls are checked.
        let (m, out) = unsafe { (cache(c)?, arg_out(out, "out")?) };
        let b = m.request_bytes(id)?;
        *out = Csa2RequestBytes {
            tokens: b.tokens as u64,
            blocks: b.blocks as u64,
            slab_bytes: b.slab_bytes as u64,
            record_bytes: b.record_bytes as u64,
            padding_bytes: b.padding_bytes as u64,
            bytes_per_token: b.bytes_per_token,
        };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::csa2_geometry_free;
    use crate::ffi::test_support::{geometry, last_error};
    use std::ptr::{null, null_mut};

    fn new_cache(num_blocks: usize) -> *mut Csa2Cache {
        let g = geometry();
        let mut c = null_mut();
        let s = unsafe {
            csa2_cache_create(
                &crate::ffi::Csa2CacheCreateArgs {
                    geometry: g,
                    layout: 0,
                    num_blocks,
                    block_tokens: 256,
                    model: null(),
                    model_len: 0,
                    ..Default::default()
                },
                &mut c,
            )
        };
        unsafe { csa2_geometry_free(g) };
        assert_eq!(s, Csa2Status::Csa2Ok, "{}", last_error());
        c
    }

    #[test]
    fn create_rejects_bad_arguments_and_leaves_out_untouched() {
        let g = geometry();
        let sentinel = 0x10 as *mut Csa2Cache;
        let mut c = sentinel;
        let cases: [(i32, usize, usize, Csa2Status, &str); 4] = [
            (9, 4, 256, Csa2Status::Csa2ErrInvalidArgument, "layout"),
            (0, 0, 256, Csa2Status::Csa2ErrInvalidArgument, "num_blocks"),
            (0, 4, 0, Csa2Status::Csa2ErrInvalidArgument, "block"),
            (0, 4, 3, Csa2Status::Csa2ErrInvalidArgument, "block"),
        ];
        for (lay, nb, bt, want, needle) in cases {
            let s = unsafe {
                csa2_cache_create(
                    &crate::ffi::Csa2CacheCreateArgs {
                        geometry: g,
                        layout: lay,
                        num_blocks: nb,
                        block_tokens: bt,
                        model: null(),
                        model_len: 0,
                        ..Default::default()
                    },
                    &mut c,
                )
            };
            assert_eq!(s, want, "{lay} {nb} {bt}: {}", last_error());
            assert!(last_error().contains(needle), "{}", last_error());
            assert_eq!(c, sentinel);
        }
        let s = unsafe {
            csa2_cache_create(
                &crate::ffi::Csa2CacheCreateArgs {
                    geometry: null(),
                    layout: 0,
                    num_blocks: 4,
                    block_tokens: 256,
                    model: null(),
                    model_len: 0,
                    ..Default::default()
                },
                &mut c,
            )
        };
        assert_eq!(s, Csa2Status::Csa2ErrNullPointer);
        let s = unsafe {
            csa2_cache_create(
                &crate::ffi::Csa2CacheCreateArgs {
                    geometry: g,
                    layout: 0,
                    num_blocks: 4,
                    block_tokens: 256,
                    model: null(),
                    model_len: 3,
                    ..Default::default()
                },
                &mut c,
            )
        };
        assert_eq!(s, Csa2Status::Csa2ErrNullPointer);
        assert!(last_error().contains("model"));
        let s = unsafe {
            csa2_cache_create(
                &crate::ffi::Csa2CacheCreateArgs {
                    geometry: g,
                    layout: 0,
                    num_blocks: 4,
                    block_tokens: 256,
                    model: null(),
                    model_len: 0,
                    ..Default::default()
                },
                null_mut(),
            )
        };
        assert_eq!(s, Csa2Status::Csa2ErrNullPointer);
        unsafe { csa2_geometry_free(g) };
    }

    #[test]
    fn allocate_table_slots_and_error_paths() {
        let c = new_cache(3);
        unsafe {
            assert_eq!(csa2_cache_allocate(c, 7, 10), Csa2Status::Csa2ErrNotFound);
            assert!(last_error().contains("request 7"), "{}", last_error());
            assert_eq!(csa2_cache_add_request(c, 7), Csa2Status::Csa2Ok);
            assert_eq!(
                csa2_cache_add_request(c, 7),
                Csa2Status::Csa2ErrInvalidArgument
            );
            assert_eq!(csa2_cache_allocate(c, 7, 513), Csa2Status::Csa2Ok);

            // Count-only, too small, exact.
            let mut n = 99usize;
            assert_eq!(
                csa2_cache_block_table(c, 7, null_mut(), 0, &mut n),
                Csa2Status::Csa2Ok
            );
            assert_eq!(n, 3);
            let mut t = [u32::MAX; 3];
            let mut n2 = 99usize;
            assert_eq!(
                csa2_cache_block_table(c, 7, t.as_mut_ptr(), 2, &mut n2),
                Csa2Status::Csa2ErrInvalidArgument
            );
            assert!(last_error().contains("needs 3"), "{}", last_error());
            assert_eq!((n2, t), (99, [u32::MAX; 3]));
            assert_eq!(
                csa2_cache_block_table(c, 7, t.as_mut_ptr(), 3, &mut n2),
                Csa2Status::Csa2Ok
            );
            assert_eq!((n2, t), (3, [0, 1, 2]));
            assert_eq!(
                csa2_cache_block_table(c, 7, t.as_mut_ptr(), 3, null_mut()),
                Csa2Status::Csa2ErrNullPointer
            );

            // Layer 2 is a ratio-2 KV source: S = 128 entries per block.
            let mut slots = [-1i64; 4];
            assert_eq!(
                csa2_cache_slot_mapping(c, 7, 2, 126, 4, slots.as_mut_ptr()),
                Csa2Status::Csa2Ok,
                "{}",
                last_error()
            );
            let want = m_slots(c, 7, 2, 126..130);
            assert_eq!(slots.to_vec(), want);
            assert_eq!(slots, [126, 127, 128, 129]);
            assert_eq!(
                csa2_cache_slot_mapping(c, 7, 0, 0, 1, slots.as_mut_ptr()),
                Csa2Status::Csa2ErrInvalidArgument
            );
            assert_eq!(
                csa2_cache_slot_mapping(c, 7, 2, 380, 5, slots.as_mut_ptr()),
                Csa2Status::Csa2ErrInvalidArgument
            );
            assert_eq!(
                csa2_cache_slot_mapping(c, 7, 2, 0, 5, null_mut()),
                Csa2Status::Csa2ErrNullPointer
            );

            // Out of blocks: nothing changes.
            assert_eq!(csa2_cache_add_request(c, 8), Csa2Status::Csa2Ok);
            assert_eq!(csa2_cache_allocate(c, 8, 1), Csa2Status::Csa2ErrOutOfBlocks);
            let mut st = Csa2CacheStats::default();
            assert_eq!(csa2_cache_stats(c, &mut st), Csa2Status::Csa2Ok);
            assert_eq!((st.total_blocks, st.used_blocks, st.requests), (3, 3, 2));
            assert_eq!(st.in_use_bytes, 3 * st.slab_bytes);
            assert_eq!(st.allocated_bytes, 3 * st.slab_bytes);

            let mut rb = Csa2RequestBytes::default();
            assert_eq!(csa2_cache_request_bytes(c, 7, &mut rb), Csa2Status::Csa2Ok);
            assert_eq!(
                (rb.tokens, rb.blocks, rb.slab_bytes),
                (513, 3, 3 * st.slab_bytes)
            );
            assert_eq!(
                csa2_cache_request_bytes(c, 9, &mut rb),
                Csa2Status::Csa2ErrNotFound
            );

            assert_eq!(csa2_cache_free_request(c, 7), Csa2Status::Csa2Ok);
            assert_eq!(csa2_cache_free_request(c, 7), Csa2Status::Csa2ErrNotFound);
            assert_eq!(csa2_cache_allocate(c, 8, 1), Csa2Status::Csa2Ok);
            cache(c).unwrap().check_invariants().unwrap();
            csa2_cache_free(c);
            csa2_cache_free(null_mut());
            assert_eq!(
                csa2_cache_allocate(null(), 1, 1),
                Csa2Status::Csa2ErrNullPointer
            );
        }
    }

    fn m_slots(c: *const Csa2Cache, id: u64, layer: usize, r: std::ops::Range<usize>) -> Vec<i64> {
        unsafe { cache(c) }
            .unwrap()
            .slot_mapping(id, layer, r)
            .unwrap()
            .into_iter()
            .map(|s| s as i64)
            .collect()
    }

    #[test]
    fn prefix_keys_publish_adopt_round_trip() {
        let c = new_cache(8);
        let tokens: Vec<u32> = (0..600).collect();
        unsafe {
            let mut n = 0usize;
            assert_eq!(
                csa2_cache_prefix_keys(c, tokens.as_ptr(), 600, null_mut(), 0, &mut n),
                Csa2Status::Csa2Ok
            );
            assert_eq!(n, 2);
            let mut keys = vec![0u8; 64];
            assert_eq!(
                csa2_cache_prefix_keys(c, tokens.as_ptr(), 600, keys.as_mut_ptr(), 1, &mut n),
                Csa2Status::Csa2ErrInvalidArgument
            );
            assert!(last_error().contains("need 2 keys"), "{}", last_error());
            assert_eq!(
                csa2_cache_prefix_keys(c, null(), 600, keys.as_mut_ptr(), 2, &mut n),
                Csa2Status::Csa2ErrNullPointer
            );
            assert_eq!(
                csa2_cache_prefix_keys(c, tokens.as_ptr(), 600, keys.as_mut_ptr(), 2, &mut n),
                Csa2Status::Csa2Ok
            );
            let want = cache(c).unwrap().hasher().keys(&tokens);
            assert_eq!(&keys[..32], &want[0].0);
            assert_eq!(&keys[32..], &want[1].0);

            assert_eq!(csa2_cache_add_request(c, 1), Csa2Status::Csa2Ok);
            assert_eq!(csa2_cache_allocate(c, 1, 600), Csa2Status::Csa2Ok);
            assert_eq!(
                csa2_cache_lookup_prefix(c, keys.as_ptr(), 2, &mut n),
                Csa2Status::Csa2Ok
            );
            assert_eq!(n, 0);
            assert_eq!(
                csa2_cache_publish(c, 1, keys.as_ptr(), 2, &mut n),
                Csa2Status::Csa2Ok
            );
            assert_eq!(n, 2);
            assert_eq!(
                csa2_cache_publish(c, 9, keys.as_ptr(), 2, &mut n),
                Csa2Status::Csa2ErrNotFound
            );
            assert_eq!(
                csa2_cache_lookup_prefix(c, keys.as_ptr(), 2, &mut n),
                Csa2Status::Csa2Ok
            );
            assert_eq!(n, 2);
            assert_eq!(
                csa2_cache_lookup_prefix(c, null(), 2, &mut n),
                Csa2Status::Csa2ErrNullPointer
            );
            assert_eq!(csa2_cache_free_request(c, 1), Csa2Status::Csa2Ok);

            assert_eq!(csa2_cache_add_request(c, 2), Csa2Status::Csa2Ok);
            assert_eq!(
                csa2_cache_adopt_prefix(c, 2, keys.as_ptr(), 2, &mut n),
                Csa2Status::Csa2Ok
            );
            assert_eq!(n, 2);
            assert_eq!(
                csa2_cache_adopt_prefix(c, 2, keys.as_ptr(), 2, &mut n),
                Csa2Status::Csa2ErrInvalidArgument
            );
            let mut st = Csa2CacheStats::default();
            assert_eq!(csa2_cache_stats(c, &mut st), Csa2Status::Csa2Ok);
            assert_eq!(
                (st.prefix_hits, st.prefix_queries, st.used_blocks),
                (2, 2, 2)
            );
            cache(c).unwrap().check_invariants().unwrap();
            csa2_cache_free(c);
        }
    }
}
