//! Handle-lifecycle and concurrency fuzzing of the C ABI (finding 7): random sequences of
//! calls on a pool of handle *values* — live handles, freed ones, handles of another type, null
//! and garbage — over the cache-management, geometry, replay-plan and compressor-state exports.
//!
//! Invariants checked on every call:
//! - no `CSA2_ERR_PANIC` (and no crash: a use after free used to abort, a double free to segfault);
//! - a call whose handle is null is `CSA2_ERR_NULL_POINTER`; one whose handle is freed, garbage or
//!   of another type is `CSA2_ERR_INVALID_HANDLE`; one on a live handle of the right type never is;
//! - the last error is set exactly when the status is not OK.
//!
//! [`run_sequence`] drives one thread from a [`Source`] (seeded, or a fuzzer's bytes);
//! [`run_concurrent`] runs several seeded threads on shared handles while one of them frees and
//! recreates a shared cache, so calls race the free of the handle they use.

use super::Source;
use csa2::ffi::*;
use rand::{Rng, SeedableRng};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const OK: i32 = 0;
const NULL_POINTER: i32 = 202;
const INVALID_HANDLE: i32 = 203;
const PANIC: i32 = 501;

/// What a handle value is, as far as the harness knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Geometry,
    Cache,
    Plan,
    State,
}

/// One handle value and whether it is live.
#[derive(Clone, Copy, Debug)]
struct Slot {
    value: usize,
    kind: Kind,
    live: bool,
}

/// Counts of one run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    /// Calls made.
    pub calls: u64,
    /// Calls that returned `CSA2_OK`.
    pub ok: u64,
    /// Calls refused with `CSA2_ERR_INVALID_HANDLE`.
    pub invalid_handle: u64,
    /// Calls refused with `CSA2_ERR_NULL_POINTER`.
    pub null_pointer: u64,
    /// Other refusals (argument, not found, out of blocks ...).
    pub other_errors: u64,
}

impl Tally {
    pub fn add(&mut self, o: &Tally) {
        self.calls += o.calls;
        self.ok += o.ok;
        self.invalid_handle += o.invalid_handle;
        self.null_pointer += o.null_pointer;
        self.other_errors += o.other_errors;
    }
}

fn has_last_error() -> bool {
    unsafe { csa2_last_error_message(null_mut(), 0) > 0 }
}

fn last_error() -> String {
    let n = unsafe { csa2_last_error_message(null_mut(), 0) };
    let mut buf = vec![0 as std::ffi::c_char; n.max(1)];
    unsafe { csa2_last_error_message(buf.as_mut_ptr(), buf.len()) };
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// What the status of a call on handle `h` must be, given what `h` is (None: anything but a
/// handle error, the handle being live and of the right type).
fn expected(h: Option<Slot>, want: Kind) -> Option<i32> {
    match h {
        None => Some(NULL_POINTER),
        Some(s) if s.live && s.kind == want => None,
        Some(_) => Some(INVALID_HANDLE),
    }
}

fn record(t: &mut Tally, st: Csa2Status, exp: Option<i32>, what: &str, ctx: &str) {
    let code = st as i32;
    t.calls += 1;
    assert_ne!(
        code,
        PANIC,
        "{ctx}: {what}: panic reached the boundary: {}",
        last_error()
    );
    // A successful `_free` leaves the last error alone (it may hold an earlier failure's).
    if !(what == "free" && code == OK) {
        assert_eq!(
            code != OK,
            has_last_error(),
            "{ctx}: {what}: status {code} but last error {:?}",
            last_error()
        );
    }
    match exp {
        Some(e) => assert_eq!(code, e, "{ctx}: {what}: {}", last_error()),
        None => assert!(
            code != INVALID_HANDLE && code != NULL_POINTER,
            "{ctx}: {what}: a live handle was refused: {}",
            last_error()
        ),
    }
    match code {
        OK => t.ok += 1,
        INVALID_HANDLE => t.invalid_handle += 1,
        NULL_POINTER => t.null_pointer += 1,
        _ => t.other_errors += 1,
    }
}

/// A handle value that no live handle can have: garbage of several shapes.
fn garbage(r: &mut Source<'_>, pool: &[Slot]) -> usize {
    match r.random_range(0..5u32) {
        0 => r.random::<u64>() as usize | 1,
        1 => r.random_range(1..4096usize),
        // A real address (of a stack value): what a confused caller might pass.
        2 => {
            let local = 0u64;
            std::hint::black_box(&local) as *const u64 as usize
        }
        // A live handle with an id bit flipped beyond any id ever issued.
        3 => pool.first().map_or(usize::MAX, |s| s.value | (1 << 54)),
        _ => usize::MAX,
    }
}

/// Picks the handle argument: a pool entry (live or dead, any kind), null, or garbage.
fn pick(r: &mut Source<'_>, pool: &[Slot]) -> Option<Slot> {
    match r.random_range(0..10u32) {
        0 => None,
        1 => Some(Slot {
            value: garbage(r, pool),
            // Garbage is of no kind: `live = false` makes every use an invalid handle.
            kind: Kind::Cache,
            live: false,
        }),
        _ if !pool.is_empty() => Some(pool[r.random_range(0..pool.len())]),
        _ => None,
    }
}

fn value(h: Option<Slot>) -> usize {
    h.map_or(0, |s| s.value)
}

/// One random call using handle `h`. Updates the pool when a handle is created or freed.
fn step(r: &mut Source<'_>, pool: &mut Vec<Slot>, t: &mut Tally, ctx: &str) {
    let h = pick(r, pool);
    let hv = value(h);
    let id = r.random_range(0..4u64);
    let op = r.random_range(0..16u32);
    let c = hv as *mut Csa2Cache;
    let g = hv as *mut Csa2Geometry;
    unsafe {
        match op {
            0 => {
                // Create a geometry or a cache / plan / state from `h` as the geometry.
                let which = r.random_range(0..4u32);
                let exp = if which == 0 {
                    None
                } else {
                    expected(h, Kind::Geometry)
                };
                let mut out = null_mut::<std::ffi::c_void>();
                let st = match which {
                    0 => csa2_geometry_embedded((&mut out as *mut *mut std::ffi::c_void).cast()),
                    1 => csa2_cache_create(
                        &csa2::ffi::Csa2CacheCreateArgs {
                            geometry: g,
                            layout: 0,
                            num_blocks: r.random_range(1..6usize),
                            block_tokens: 256,
                            model: null(),
                            model_len: 0,
                            ..Default::default()
                        },
                        (&mut out as *mut *mut std::ffi::c_void).cast(),
                    ),
                    2 => csa2_replay_plan(
                        g,
                        0,
                        r.random_range(1..2000usize),
                        r.random_range(0..1000usize),
                        0,
                        (&mut out as *mut *mut std::ffi::c_void).cast(),
                    ),
                    _ => csa2_compressor_state_create(
                        g,
                        2,
                        0,
                        (&mut out as *mut *mut std::ffi::c_void).cast(),
                    ),
                };
                record(t, st, exp, "create", ctx);
                if st == Csa2Status::Csa2Ok {
                    let kind =
                        [Kind::Geometry, Kind::Cache, Kind::Plan, Kind::State][which as usize];
                    pool.push(Slot {
                        value: out as usize,
                        kind,
                        live: true,
                    });
                }
            }
            1 => {
                // Free `h` as one of the four types (a double free, a wrong-type free...).
                let kind = [Kind::Geometry, Kind::Cache, Kind::Plan, Kind::State]
                    [r.random_range(0..4usize)];
                let st = match kind {
                    Kind::Geometry => csa2_geometry_free(g),
                    Kind::Cache => csa2_cache_free(c),
                    Kind::Plan => csa2_replay_plan_free(hv as *mut Csa2ReplayPlan),
                    Kind::State => csa2_compressor_state_free(hv as *mut Csa2CompressorState),
                };
                // Freeing null is a no-op.
                let exp = match h {
                    None => Some(OK),
                    _ => expected(h, kind).or(Some(OK)),
                };
                record(t, st, exp, "free", ctx);
                if st == Csa2Status::Csa2Ok {
                    for s in pool.iter_mut().filter(|s| s.value == hv) {
                        s.live = false;
                    }
                }
            }
            2 => record(
                t,
                csa2_cache_add_request(c, id),
                expected(h, Kind::Cache),
                "add_request",
                ctx,
            ),
            3 => record(
                t,
                csa2_cache_allocate(c, id, r.random_range(0..1500usize)),
                expected(h, Kind::Cache),
                "allocate",
                ctx,
            ),
            4 => record(
                t,
                csa2_cache_free_request(c, id),
                expected(h, Kind::Cache),
                "free_request",
                ctx,
            ),
            5 | 6 => {
                let tokens: Vec<u32> = (0..512).map(|i| i + id as u32).collect();
                let mut keys = [0u8; 64];
                let mut n = 0usize;
                let st =
                    csa2_cache_prefix_keys(c, tokens.as_ptr(), 512, keys.as_mut_ptr(), 2, &mut n);
                record(t, st, expected(h, Kind::Cache), "prefix_keys", ctx);
                if st == Csa2Status::Csa2Ok {
                    let k = r.random_range(0..3usize);
                    let st = if op == 5 {
                        csa2_cache_publish(c, id, keys.as_ptr(), k, &mut n)
                    } else {
                        csa2_cache_adopt_prefix(c, id, keys.as_ptr(), k, &mut n)
                    };
                    record(t, st, None, "publish/adopt", ctx);
                    record(
                        t,
                        csa2_cache_lookup_prefix(c, keys.as_ptr(), k, &mut n),
                        None,
                        "lookup",
                        ctx,
                    );
                }
            }
            7 => {
                let mut n = 0usize;
                record(
                    t,
                    csa2_cache_block_table(c, id, null_mut(), 0, &mut n),
                    expected(h, Kind::Cache),
                    "block_table",
                    ctx,
                );
            }
            8 => {
                let mut out = [0i64; 4];
                record(
                    t,
                    csa2_cache_slot_mapping(
                        c,
                        id,
                        2,
                        r.random_range(0..300usize),
                        4,
                        out.as_mut_ptr(),
                    ),
                    expected(h, Kind::Cache),
                    "slot_mapping",
                    ctx,
                );
            }
            9 => {
                let mut s = Csa2CacheStats::default();
                record(
                    t,
                    csa2_cache_stats(c, &mut s),
                    expected(h, Kind::Cache),
                    "stats",
                    ctx,
                );
            }
            10 => {
                let mut o = 0i64;
                record(
                    t,
                    csa2_cache_swa_newest(c, id, 0, &mut o),
                    expected(h, Kind::Cache),
                    "swa_newest",
                    ctx,
                );
            }
            11 => {
                let mut n = 0usize;
                record(
                    t,
                    csa2_geometry_num_layers(g, &mut n),
                    expected(h, Kind::Geometry),
                    "num_layers",
                    ctx,
                );
            }
            12 => {
                let mut s = Csa2ReplaySummary::default();
                record(
                    t,
                    csa2_replay_plan_summary(hv as *const Csa2ReplayPlan, &mut s),
                    expected(h, Kind::Plan),
                    "plan_summary",
                    ctx,
                );
            }
            13 => {
                let (mut a, mut b, mut l) = (0u64, 0u64, 0u32);
                record(
                    t,
                    csa2_compressor_state_query(
                        hv as *const Csa2CompressorState,
                        &mut a,
                        &mut b,
                        &mut l,
                    ),
                    expected(h, Kind::State),
                    "state_query",
                    ctx,
                );
            }
            14 => {
                // Two handles in one call: state and cache.
                let h2 = pick(r, pool);
                let st = csa2_compressor_state_save(
                    hv as *const Csa2CompressorState,
                    value(h2) as *const Csa2Cache,
                    id,
                );
                let exp = expected(h, Kind::State).or(expected(h2, Kind::Cache));
                record(t, st, exp, "state_save", ctx);
            }
            _ => {
                let mut info = Csa2CacheLayerInfo::default();
                record(
                    t,
                    csa2_cache_layer_info(c, r.random_range(0..45u32), &mut info),
                    expected(h, Kind::Cache),
                    "layer_info",
                    ctx,
                );
            }
        }
    }
}

/// Runs `steps` random calls drawn from `r` on a fresh pool (seeded with one geometry and one
/// cache), then frees every handle still live and checks that each is refused afterwards.
pub fn run_sequence(r: &mut Source<'_>, steps: usize, ctx: &str) -> Tally {
    let mut t = Tally::default();
    let mut pool = Vec::new();
    let mut g = null_mut();
    assert_eq!(
        unsafe { csa2_geometry_embedded(&mut g) },
        Csa2Status::Csa2Ok
    );
    let mut c = null_mut();
    assert_eq!(
        unsafe {
            csa2_cache_create(
                &csa2::ffi::Csa2CacheCreateArgs {
                    geometry: g,
                    layout: 0,
                    num_blocks: 4,
                    block_tokens: 256,
                    model: null(),
                    model_len: 0,
                    ..Default::default()
                },
                &mut c,
            )
        },
        Csa2Status::Csa2Ok
    );
    pool.push(Slot {
        value: g as usize,
        kind: Kind::Geometry,
        live: true,
    });
    pool.push(Slot {
        value: c as usize,
        kind: Kind::Cache,
        live: true,
    });
    for _ in 0..steps {
        step(r, &mut pool, &mut t, ctx);
    }
    for s in pool.iter().filter(|s| s.live) {
        let st = unsafe {
            match s.kind {
                Kind::Geometry => csa2_geometry_free(s.value as *mut _),
                Kind::Cache => csa2_cache_free(s.value as *mut _),
                Kind::Plan => csa2_replay_plan_free(s.value as *mut _),
                Kind::State => csa2_compressor_state_free(s.value as *mut _),
            }
        };
        assert_eq!(
            st,
            Csa2Status::Csa2Ok,
            "{ctx}: final free: {}",
            last_error()
        );
    }
    for s in &pool {
        let mut st = Csa2CacheStats::default();
        let code = unsafe { csa2_cache_stats(s.value as *const _, &mut st) } as i32;
        assert_eq!(
            code, INVALID_HANDLE,
            "{ctx}: {s:?} still usable after its free"
        );
    }
    t
}

/// Seeded sequence `seed` of `steps` calls.
pub fn run_seed(seed: u64, steps: usize) -> Tally {
    let mut r = Source::Seeded(Box::new(rand::rngs::StdRng::seed_from_u64(seed)));
    run_sequence(&mut r, steps, &format!("lifecycle seed {seed}"))
}

/// `threads` seeded threads, `steps` calls each, on one shared geometry and two shared caches;
/// thread 0 also frees and recreates shared cache 1 now and then, so the other threads' calls
/// race the free of the very handle they use (each must then be OK-or-ordinary-error while the
/// handle is live and `CSA2_ERR_INVALID_HANDLE` after). Returns the summed tally.
pub fn run_concurrent(seed: u64, threads: usize, steps: usize) -> Tally {
    let mut g = null_mut();
    assert_eq!(
        unsafe { csa2_geometry_embedded(&mut g) },
        Csa2Status::Csa2Ok
    );
    let new_cache = |g: *const Csa2Geometry| {
        let mut c = null_mut();
        assert_eq!(
            unsafe {
                csa2_cache_create(
                    &csa2::ffi::Csa2CacheCreateArgs {
                        geometry: g,
                        layout: 0,
                        num_blocks: 16,
                        block_tokens: 256,
                        model: null(),
                        model_len: 0,
                        ..Default::default()
                    },
                    &mut c,
                )
            },
            Csa2Status::Csa2Ok
        );
        c as usize
    };
    let shared = Arc::new([
        AtomicUsize::new(new_cache(g)),
        AtomicUsize::new(new_cache(g)),
    ]);
    let gv = g as usize;
    let workers: Vec<_> = (0..threads)
        .map(|th| {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let mut r = rand::rngs::StdRng::seed_from_u64(seed ^ ((th as u64) << 32));
                let mut t = Tally::default();
                let ctx = format!("concurrent seed {seed} thread {th}");
                // Each thread re-reads shared cache 1 only every 8 calls, as a caller holding a
                // handle across calls would: after thread 0 frees it, the held copy is stale.
                let mut held = shared[1].load(Ordering::Acquire);
                for i in 0..steps {
                    let which = r.random_range(0..2usize);
                    if i % 8 == 0 {
                        held = shared[1].load(Ordering::Acquire);
                    }
                    let c = if which == 0 {
                        shared[0].load(Ordering::Acquire)
                    } else {
                        held
                    } as *mut Csa2Cache;
                    let id = (th as u64) * 16 + r.random_range(0..4u64);
                    let st = unsafe {
                        match r.random_range(0..8u32) {
                            0 => csa2_cache_add_request(c, id),
                            1 => csa2_cache_allocate(c, id, r.random_range(0..1500usize)),
                            2 => csa2_cache_free_request(c, id),
                            3 => {
                                let mut n = 0usize;
                                csa2_cache_block_table(c, id, null_mut(), 0, &mut n)
                            }
                            4 => {
                                let mut s = Csa2CacheStats::default();
                                csa2_cache_stats(c, &mut s)
                            }
                            5 => {
                                let tokens: Vec<u32> = (0..512).collect();
                                let mut keys = [0u8; 64];
                                let mut n = 0usize;
                                let st = csa2_cache_prefix_keys(
                                    c,
                                    tokens.as_ptr(),
                                    512,
                                    keys.as_mut_ptr(),
                                    2,
                                    &mut n,
                                );
                                if st == Csa2Status::Csa2Ok {
                                    let _ = csa2_cache_publish(c, id, keys.as_ptr(), 2, &mut n);
                                    csa2_cache_adopt_prefix(c, id, keys.as_ptr(), 2, &mut n)
                                } else {
                                    st
                                }
                            }
                            6 => {
                                let mut n = 0usize;
                                csa2_geometry_num_layers(gv as *const Csa2Geometry, &mut n)
                            }
                            _ => {
                                let mut out = [0i64; 2];
                                csa2_cache_slot_mapping(c, id, 2, 0, 2, out.as_mut_ptr())
                            }
                        }
                    };
                    // Cache 1 may be freed under us: then INVALID_HANDLE is the right answer.
                    // Cache 0 and the geometry stay live for the whole run.
                    let exp = None;
                    if which == 1 && st as i32 == INVALID_HANDLE {
                        t.calls += 1;
                        t.invalid_handle += 1;
                    } else {
                        record(&mut t, st, exp, "shared call", &ctx);
                    }
                    if th == 0 && i % 64 == 63 {
                        let fresh = new_cache(gv as *const Csa2Geometry);
                        let old = shared[1].swap(fresh, Ordering::AcqRel);
                        let st = unsafe { csa2_cache_free(old as *mut Csa2Cache) };
                        assert_eq!(st, Csa2Status::Csa2Ok, "{ctx}: {}", last_error());
                        t.calls += 1;
                        t.ok += 1;
                    }
                }
                t
            })
        })
        .collect();
    let mut total = Tally::default();
    for w in workers {
        total.add(&w.join().expect("a worker thread panicked"));
    }
    for c in shared.iter() {
        let st = unsafe { csa2_cache_free(c.load(Ordering::Acquire) as *mut Csa2Cache) };
        assert_eq!(st, Csa2Status::Csa2Ok);
    }
    assert_eq!(unsafe { csa2_geometry_free(g) }, Csa2Status::Csa2Ok);
    total
}
