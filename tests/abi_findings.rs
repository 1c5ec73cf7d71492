//! C ABI findings 5–10: each test names its finding and failed on the code before the
//! fix (a panic, an abort, a segfault, another tenant's bytes, or a wrong OK); see
//! docs/RELIABILITY.md (C ABI section). New status codes are compared as numbers (203
//! `CSA2_ERR_INVALID_HANDLE`, 404 `CSA2_ERR_OUT_OF_MEMORY`) so the file also builds against the
//! old ABI, where the `_free` functions returned nothing.

use crate::ffi_support::{geometry, last_error};
use csa2::cache::{CacheConfig, CacheManager, CacheSpec, RecordKind};
use csa2::ffi::dlpack::{DLDataType, DLDevice, DLTensor, K_DL_CPU};
use csa2::ffi::*;
use csa2::{Geometry, KvScheme};
use std::ffi::c_void;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const INVALID_HANDLE: i32 = 203;
const PANIC: i32 = 501;

/// A status as a number; `()` (the old `_free` signature) as −1.
trait Code {
    fn code(self) -> i32;
}
impl Code for Csa2Status {
    fn code(self) -> i32 {
        self as i32
    }
}
impl Code for () {
    fn code(self) -> i32 {
        -1
    }
}

#[track_caller]
fn ok(s: Csa2Status) {
    assert_eq!(s, Csa2Status::Csa2Ok, "{}", last_error());
}

fn cache_of(g: *const Csa2Geometry, blocks: usize, block_tokens: usize) -> *mut Csa2Cache {
    let mut c = null_mut();
    ok(unsafe {
        csa2_cache_create(
            &csa2::ffi::Csa2CacheCreateArgs {
                geometry: g,
                layout: 0,
                num_blocks: blocks,
                block_tokens,
                model: null(),
                model_len: 0,
                ..Default::default()
            },
            &mut c,
        )
    });
    c
}

fn cache(blocks: usize, block_tokens: usize) -> *mut Csa2Cache {
    let g = geometry();
    let c = cache_of(g, blocks, block_tokens);
    unsafe { csa2_geometry_free(g) };
    c
}

/// A `(n)` int64 or `(n, w)` uint8 host tensor over `data` (which must outlive the descriptor).
fn desc<E>(data: &mut [E], shape: &mut [i64], code: u8, bits: u8) -> DLTensor {
    DLTensor {
        data: data.as_mut_ptr() as *mut c_void,
        device: DLDevice {
            device_type: K_DL_CPU,
            device_id: 0,
        },
        ndim: shape.len() as i32,
        dtype: DLDataType {
            code,
            bits,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: null_mut(),
        byte_offset: 0,
    }
}

/// Layer 2 of the released geometry: a ratio-2 KV source (main KV: NVFP4-DS records).
const KV_LAYER: u32 = 2;

fn main_record_bytes(c: *const Csa2Cache) -> usize {
    let mut i = Csa2CacheLayerInfo::default();
    ok(unsafe { csa2_cache_layer_info(c, KV_LAYER, &mut i) });
    i.main_record_bytes as usize
}

fn entries_per_block(c: *const Csa2Cache) -> usize {
    let mut i = Csa2CacheLayerInfo::default();
    ok(unsafe { csa2_cache_layer_info(c, KV_LAYER, &mut i) });
    i.entries_per_block as usize
}

/// Writes raw records `rec` (n × record bytes) to entries `ids` of request `id`.
fn write_raw(c: *const Csa2Cache, id: u64, ids: &[i64], rec: &mut [u8]) -> Csa2Status {
    let rb = (rec.len() / ids.len()) as i64;
    let mut e = ids.to_vec();
    let (mut se, mut sr) = ([ids.len() as i64], [ids.len() as i64, rb]);
    let te = desc(&mut e, &mut se, 0, 64);
    let tr = desc(rec, &mut sr, 1, 8);
    unsafe { csa2_cache_write_entries(c, id, KV_LAYER, 0, &te, &tr) }
}

/// Reads raw records of entries `ids` of request `id` into `out`.
fn read_raw(c: *const Csa2Cache, id: u64, ids: &[i64], out: &mut [u8]) -> Csa2Status {
    let rb = (out.len() / ids.len()) as i64;
    let mut e = ids.to_vec();
    let (mut se, mut so) = ([ids.len() as i64], [ids.len() as i64, rb]);
    let te = desc(&mut e, &mut se, 0, 64);
    let to = desc(out, &mut so, 1, 8);
    unsafe { csa2_cache_read_entries(c, id, KV_LAYER, 0, &te, &to) }
}

/// Finding 5, Rust side: a valid in-pool slot of a block never handed out is an error, not a
/// panic (the slab does not exist yet).
#[test]
fn finding5_record_io_on_a_never_allocated_block_is_an_error_not_a_panic() {
    let g = Geometry::embedded();
    let c = CacheManager::new(
        CacheSpec::from_geometry(&g, KvScheme::CSA2),
        CacheConfig::host(4),
        b"",
    )
    .unwrap();
    let rb = c
        .block_layout()
        .place(KV_LAYER as usize, RecordKind::Main)
        .unwrap()
        .page
        .format
        .record_bytes();
    let slots = c
        .block_layout()
        .place(KV_LAYER as usize, RecordKind::Main)
        .unwrap()
        .page
        .slots as u64;
    let slot = 3 * slots + 1; // block 3: in the pool, never allocated
    let mut out = vec![0u8; rb];
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (
            c.read_record(KV_LAYER as usize, RecordKind::Main, slot, &mut out)
                .is_err(),
            c.write_record(KV_LAYER as usize, RecordKind::Main, slot, &out)
                .is_err(),
            c.read_slab(3).is_err(),
        )
    }));
    assert_eq!(r.ok(), Some((true, true, true)), "panicked or succeeded");
}

/// Finding 5, C side: real threads growing requests block by block while others write and read
/// the newest entries of the same requests. Every status is OK or an argument / not-found error;
/// none is `CSA2_ERR_PANIC`. Bounded to about 2 s.
#[test]
fn finding5_concurrent_allocate_and_entry_io_never_panic() {
    // Small blocks (8 tokens, 4 main-KV entries of the ratio-2 layer) so that many blocks are used
    // for the first time, which is when the slab used to appear after the block.
    let bt = 8;
    let blocks = 6000;
    let c = cache(blocks, bt) as usize;
    let s = entries_per_block(c as *const _);
    let rb = main_record_bytes(c as *const _);
    let stop = Arc::new(AtomicBool::new(false));
    let panics = Arc::new(AtomicU64::new(0));
    let calls = Arc::new(AtomicU64::new(0));
    let requests = 4u64;
    let mut threads = Vec::new();
    // Growers: request r grows by 1–4 blocks per call; when the pool is full every request is
    // freed and re-added (blocks then come back zeroed, not fresh).
    for r in 0..requests {
        let (stop, panics, calls) = (stop.clone(), panics.clone(), calls.clone());
        threads.push(std::thread::spawn(move || {
            let c = c as *const Csa2Cache;
            let mut tokens = 0usize;
            ok(unsafe { csa2_cache_add_request(c, r) });
            while !stop.load(Ordering::Relaxed) {
                tokens += bt * (1 + (tokens / bt) % 4);
                let st = unsafe { csa2_cache_allocate(c, r, tokens) };
                calls.fetch_add(1, Ordering::Relaxed);
                match st.code() {
                    0 => {}
                    300 => {
                        ok(unsafe { csa2_cache_free_request(c, r) });
                        ok(unsafe { csa2_cache_add_request(c, r) });
                        tokens = 0;
                    }
                    PANIC => {
                        panics.fetch_add(1, Ordering::Relaxed);
                    }
                    other => panic!("allocate: status {other}: {}", last_error()),
                }
            }
        }));
    }
    // Record I/O: the newest entry of each request's table, as soon as the table shows it.
    for th in 0..2u64 {
        let (stop, panics, calls) = (stop.clone(), panics.clone(), calls.clone());
        threads.push(std::thread::spawn(move || {
            let c = c as *const Csa2Cache;
            let mut rec = vec![0x5au8; rb];
            let mut out = vec![0u8; rb];
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let r = (i + th) % requests;
                i += 1;
                let mut n = 0usize;
                if unsafe { csa2_cache_block_table(c, r, null_mut(), 0, &mut n) }
                    != Csa2Status::Csa2Ok
                    || n == 0
                {
                    continue;
                }
                let e = [(n * s - 1) as i64];
                for st in [write_raw(c, r, &e, &mut rec), read_raw(c, r, &e, &mut out)] {
                    calls.fetch_add(1, Ordering::Relaxed);
                    match st.code() {
                        // OK; not found (request re-added meanwhile); entry past a table that
                        // was just reset.
                        0 | 302 | 201 => {}
                        PANIC => {
                            panics.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("entry I/O: status {other}: {}", last_error()),
                    }
                }
            }
        }));
    }
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let n = calls.load(Ordering::Relaxed);
    eprintln!("finding 5: {n} concurrent calls");
    assert!(n > 1000, "only {n} calls ran");
    assert_eq!(panics.load(Ordering::Relaxed), 0, "CSA2_ERR_PANIC returned");
    unsafe { csa2_cache_free(c as *mut Csa2Cache) };
}

/// Finding 6: a pool of 2^32 − 1 blocks used to pass validation and abort the process on a
/// 240 GB bookkeeping allocation; now it is refused above the documented bound (2^24) and
/// nothing is allocated.
#[test]
fn finding6_num_blocks_above_the_bound_is_refused_not_an_abort() {
    let g = geometry();
    for nb in [u32::MAX as usize, (1 << 24) + 1, usize::MAX] {
        let mut c = null_mut();
        let st = unsafe {
            csa2_cache_create(
                &csa2::ffi::Csa2CacheCreateArgs {
                    geometry: g,
                    layout: 0,
                    num_blocks: nb,
                    block_tokens: 256,
                    model: null(),
                    model_len: 0,
                    ..Default::default()
                },
                &mut c,
            )
        };
        assert_eq!(
            st,
            Csa2Status::Csa2ErrInvalidArgument,
            "{nb}: {}",
            last_error()
        );
        assert!(last_error().contains("num_blocks"), "{}", last_error());
        assert!(c.is_null());
    }
    // block_tokens is bounded too (2^16), so slab sizes cannot overflow.
    let mut c = null_mut();
    let st = unsafe {
        csa2_cache_create(
            &csa2::ffi::Csa2CacheCreateArgs {
                geometry: g,
                layout: 0,
                num_blocks: 4,
                block_tokens: 1 << 40,
                model: null(),
                model_len: 0,
                ..Default::default()
            },
            &mut c,
        )
    };
    assert_eq!(st, Csa2Status::Csa2ErrInvalidArgument, "{}", last_error());
    unsafe { csa2_geometry_free(g) };
}

/// Finding 7: handle misuse — double free, use after free, a handle of another type, garbage,
/// null — is refused with `CSA2_ERR_INVALID_HANDLE` (null: `CSA2_ERR_NULL_POINTER`). Before,
/// the double free crashed the process.
#[test]
fn finding7_handle_misuse_is_refused() {
    let g = geometry();
    let c = cache_of(g, 4, 256);
    ok(unsafe { csa2_cache_add_request(c, 1) });
    // Wrong type: a geometry passed as a cache, a cache as a geometry.
    let st = unsafe { csa2_cache_add_request(g as *const Csa2Cache, 2) };
    assert_eq!(st.code(), INVALID_HANDLE, "{}", last_error());
    assert!(last_error().contains("Csa2Geometry"), "{}", last_error());
    let mut n = 0usize;
    let st = unsafe { csa2_geometry_num_layers(c as *const Csa2Geometry, &mut n) };
    assert_eq!(st.code(), INVALID_HANDLE, "{}", last_error());
    // Garbage values, including a real address of something else.
    let local = 7u64;
    for bad in [
        0xdead_beef_usize,
        1,
        usize::MAX,
        &local as *const u64 as usize,
        // A cache token whose id no handle can have.
        (c as usize) | (1 << 55),
    ] {
        let st = unsafe { csa2_cache_allocate(bad as *const Csa2Cache, 1, 10) };
        assert_eq!(st.code(), INVALID_HANDLE, "{bad:#x}: {}", last_error());
        assert_eq!(
            unsafe { csa2_cache_free(bad as *mut Csa2Cache) }.code(),
            INVALID_HANDLE
        );
    }
    // Null.
    assert_eq!(
        unsafe { csa2_cache_allocate(null(), 1, 10) },
        Csa2Status::Csa2ErrNullPointer
    );
    // Free, then use after free and double free.
    assert_eq!(unsafe { csa2_cache_free(c) }.code(), 0);
    let st = unsafe { csa2_cache_add_request(c, 3) };
    assert_eq!(st.code(), INVALID_HANDLE, "{}", last_error());
    assert!(last_error().contains("freed"), "{}", last_error());
    assert_eq!(unsafe { csa2_cache_free(c) }.code(), INVALID_HANDLE);
    // The geometry outlives the cache built from it, and is freed once only.
    ok(unsafe { csa2_geometry_num_layers(g, &mut n) });
    assert_eq!(unsafe { csa2_geometry_free(g) }.code(), 0);
    assert_eq!(unsafe { csa2_geometry_free(g) }.code(), INVALID_HANDLE);
    assert_eq!(
        unsafe { csa2_geometry_num_layers(g, &mut n) }.code(),
        INVALID_HANDLE
    );
    // Replay plans and compressor states are checked the same way.
    let g = geometry();
    let mut p = null_mut();
    ok(unsafe { csa2_replay_plan(g, 0, 1000, 512, 0, &mut p) });
    let mut s = null_mut();
    ok(unsafe { csa2_compressor_state_create(g, KV_LAYER, 0, &mut s) });
    let mut sum = Csa2ReplaySummary::default();
    assert_eq!(
        unsafe { csa2_replay_plan_summary(s as *const Csa2ReplayPlan, &mut sum) }.code(),
        INVALID_HANDLE
    );
    assert_eq!(
        unsafe { csa2_compressor_state_reset(p as *const Csa2CompressorState, 0) }.code(),
        INVALID_HANDLE
    );
    assert_eq!(unsafe { csa2_replay_plan_free(p) }.code(), 0);
    assert_eq!(unsafe { csa2_replay_plan_free(p) }.code(), INVALID_HANDLE);
    assert_eq!(unsafe { csa2_compressor_state_free(s) }.code(), 0);
    assert_eq!(
        unsafe { csa2_compressor_state_free(s) }.code(),
        INVALID_HANDLE
    );
    unsafe { csa2_geometry_free(g) };
}

/// Finding 7: a free racing calls on the same handle from other threads. Each call either runs
/// on the live cache or is refused as an invalid handle; nothing crashes.
#[test]
fn finding7_free_racing_calls_on_other_threads_is_safe() {
    for round in 0..20u64 {
        let c = cache(8, 256) as usize;
        let go = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..3u64)
            .map(|t| {
                let go = go.clone();
                std::thread::spawn(move || {
                    let c = c as *const Csa2Cache;
                    while !go.load(Ordering::Acquire) {
                        std::hint::spin_loop();
                    }
                    let mut refused = 0;
                    for i in 0..200u64 {
                        let id = round * 10_000 + t * 1000 + i;
                        let st = unsafe { csa2_cache_add_request(c, id) };
                        match st.code() {
                            0 => {
                                let _ = unsafe { csa2_cache_allocate(c, id, 300) };
                                let _ = unsafe { csa2_cache_free_request(c, id) };
                            }
                            INVALID_HANDLE => refused += 1,
                            other => panic!("status {other}: {}", last_error()),
                        }
                    }
                    refused
                })
            })
            .collect();
        go.store(true, Ordering::Release);
        std::thread::yield_now();
        assert_eq!(unsafe { csa2_cache_free(c as *mut Csa2Cache) }.code(), 0);
        for w in workers {
            w.join().unwrap();
        }
    }
}

/// Finding 8: a block reused by a new request used to hold the previous request's records, and a
/// never-written entry returned them. Blocks are zeroed on reuse.
#[test]
fn finding8_a_reused_block_does_not_show_the_previous_requests_records() {
    let c = cache(1, 256);
    let s = entries_per_block(c);
    let rb = main_record_bytes(c);
    let ids: Vec<i64> = (0..s as i64).collect();
    ok(unsafe { csa2_cache_add_request(c, 1) });
    ok(unsafe { csa2_cache_allocate(c, 1, 256) });
    let mut secret: Vec<u8> = (0..s * rb).map(|i| (i % 251) as u8 + 1).collect();
    ok(write_raw(c, 1, &ids, &mut secret));
    ok(unsafe { csa2_cache_free_request(c, 1) });
    // Tenant 2 gets the only block, the same one.
    ok(unsafe { csa2_cache_add_request(c, 2) });
    ok(unsafe { csa2_cache_allocate(c, 2, 256) });
    let mut out = vec![0xffu8; s * rb];
    ok(read_raw(c, 2, &ids, &mut out));
    assert!(
        out.iter().all(|&b| b == 0),
        "tenant 2 read {} non-zero bytes of tenant 1's KV",
        out.iter().filter(|&&b| b != 0).count()
    );
    unsafe { csa2_cache_free(c) };
}

/// Finding 9: with an empty fingerprint two different configs (here only the compressed layers'
/// RoPE θ differs, which changes every compressed record) used to get identical prefix keys.
#[test]
fn finding9_prefix_keys_bind_the_geometry_without_a_fingerprint() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../assets/deepseek_v41_flash_config.json"
    ))
    .unwrap();
    let mut other: serde_json::Value = serde_json::from_str(&text).unwrap();
    other["text_config"]["compress_rope_theta"] = serde_json::json!(320000);
    let other = serde_json::to_string(&other).unwrap();
    let keys = |json: &str| {
        let mut g = null_mut();
        ok(unsafe { csa2_geometry_from_json(json.as_ptr().cast(), json.len(), &mut g) });
        let c = cache_of(g, 4, 256);
        let tokens: Vec<u32> = (0..512).collect();
        let mut k = vec![0u8; 64];
        let mut n = 0usize;
        ok(unsafe { csa2_cache_prefix_keys(c, tokens.as_ptr(), 512, k.as_mut_ptr(), 2, &mut n) });
        unsafe { csa2_cache_free(c) };
        unsafe { csa2_geometry_free(g) };
        k
    };
    let (a, a2, b) = (keys(&text), keys(&text), keys(&other));
    assert_eq!(a, a2, "keys are deterministic");
    assert_ne!(a, b, "two configs share prefix keys");
}

/// Finding 10: SWA positions near 2^64 were accepted on write, not found on read (`p + window`
/// wrapped) and `csa2_cache_swa_newest` then returned a negative value. Positions must be below
/// 2^62 (`CSA2_MAX_POSITION`); the rejected write changes nothing.
#[test]
fn finding10_swa_positions_past_the_maximum_are_refused() {
    let c = cache(2, 256);
    ok(unsafe { csa2_cache_add_request(c, 1) });
    let mut i = Csa2CacheLayerInfo::default();
    ok(unsafe { csa2_cache_layer_info(c, 0, &mut i) });
    let rb = i.swa_record_bytes as i64;
    let mut rec = vec![7u8; rb as usize];
    let mut shape = [1i64, rb];
    for pos in [u64::MAX, u64::MAX - 98, 1 << 63, 1 << 62] {
        let t = desc(&mut rec, &mut shape, 1, 8);
        let st = unsafe { csa2_cache_swa_write(c, 1, 0, pos, &t) };
        assert_eq!(
            st,
            Csa2Status::Csa2ErrInvalidArgument,
            "{pos}: {}",
            last_error()
        );
        let mut newest = 0i64;
        ok(unsafe { csa2_cache_swa_newest(c, 1, 0, &mut newest) });
        assert_eq!(newest, -1, "a refused write moved the window");
    }
    // The last position below the maximum works end to end.
    let pos = (1u64 << 62) - 1;
    let t = desc(&mut rec, &mut shape, 1, 8);
    ok(unsafe { csa2_cache_swa_write(c, 1, 0, pos, &t) });
    let mut newest = 0i64;
    ok(unsafe { csa2_cache_swa_newest(c, 1, 0, &mut newest) });
    assert_eq!(newest, 1i64 << 62);
    let mut out = vec![0u8; rb as usize];
    let t = desc(&mut out, &mut shape, 1, 8);
    ok(unsafe { csa2_cache_swa_read(c, 1, 0, pos, &t) });
    assert_eq!(out, rec);
    unsafe { csa2_cache_free(c) };
}

/// Finding 10: `adopt_prefix` accepted a repeated key (one block aliased three times in a table)
/// and keys of two different prompts spliced together; both are refused and change nothing.
#[test]
fn finding10_adopt_prefix_refuses_repeated_or_unchained_keys() {
    let c = cache(8, 256);
    let prompt = |seed: u32| (0..512).map(|t| t * 3 + seed).collect::<Vec<u32>>();
    let mut keys = Vec::new();
    for (id, seed) in [(1u64, 0u32), (2, 1)] {
        let tokens = prompt(seed);
        let mut k = vec![0u8; 64];
        let mut n = 0usize;
        ok(unsafe { csa2_cache_prefix_keys(c, tokens.as_ptr(), 512, k.as_mut_ptr(), 2, &mut n) });
        ok(unsafe { csa2_cache_add_request(c, id) });
        ok(unsafe { csa2_cache_allocate(c, id, 512) });
        ok(unsafe { csa2_cache_publish(c, id, k.as_ptr(), 2, &mut n) });
        assert_eq!(n, 2);
        keys.push(k);
    }
    let (a0, a1, b1) = (&keys[0][..32], &keys[0][32..], &keys[1][32..]);
    let cases: [(&str, Vec<u8>); 4] = [
        ("repeated", [a0, a0, a0].concat()),
        ("spliced", [a0, b1].concat()),
        ("tail as head", a1.to_vec()),
        ("repeated publish", [a0, a0].concat()),
    ];
    ok(unsafe { csa2_cache_add_request(c, 3) });
    for (what, k) in &cases {
        let mut n = 99usize;
        let st = if *what == "repeated publish" {
            unsafe { csa2_cache_publish(c, 1, k.as_ptr(), k.len() / 32, &mut n) }
        } else {
            unsafe { csa2_cache_adopt_prefix(c, 3, k.as_ptr(), k.len() / 32, &mut n) }
        };
        assert_eq!(
            st,
            Csa2Status::Csa2ErrInvalidArgument,
            "{what}: {}",
            last_error()
        );
        assert_eq!(n, 99, "{what}: output written");
        let mut t = 0usize;
        ok(unsafe { csa2_cache_block_table(c, 3, null_mut(), 0, &mut t) });
        assert_eq!(t, 0, "{what}: blocks adopted");
    }
    // The real chain is adopted whole.
    let mut n = 0usize;
    ok(unsafe { csa2_cache_adopt_prefix(c, 3, keys[0].as_ptr(), 2, &mut n) });
    assert_eq!(n, 2);
    let mut st = Csa2CacheStats::default();
    ok(unsafe { csa2_cache_stats(c, &mut st) });
    assert_eq!(st.used_blocks, 4);
    unsafe { csa2_cache_free(c) };
}
