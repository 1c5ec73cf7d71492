//! The persistent tiers over the C ABI (`src/ffi/store.rs`): the SSD tier's open / read-only open /
//! put / get / contains / remove / stats / free, the DRAM snapshot pool with its TTL on an injected
//! manual clock, and every refusal (bad arguments, wrong handles, small buffers, damaged records,
//! a second writer) reported as a status with a message, never a panic or wrong bytes.

use crate::ffi_support::last_error;
use csa2::ffi::*;
use std::ffi::CString;
use std::ptr::{null, null_mut};

fn ok(s: Csa2Status) {
    assert_eq!(s, Csa2Status::Csa2Ok, "{}", last_error());
}

fn key(i: u8) -> [u8; 32] {
    let mut k = [0u8; 32];
    k[0] = i;
    k[31] = 0xA5;
    k
}

fn payload(i: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|j| (j as u8).wrapping_mul(31).wrapping_add(i))
        .collect()
}

struct Args {
    _dir: CString,
    a: Csa2SsdOpenArgs,
}

fn args(dir: &std::path::Path, read_only: bool, clock: *const Csa2Clock) -> Args {
    let d = CString::new(dir.to_str().unwrap()).unwrap();
    let a = Csa2SsdOpenArgs {
        struct_size: std::mem::size_of::<Csa2SsdOpenArgs>(),
        dir: d.as_ptr(),
        capacity_bytes: 1 << 20,
        min_lifetime_ms: 0,
        segment_bytes: 0,
        fsync: Csa2Fsync::Csa2FsyncNever as i32,
        verify_on_open: 1,
        read_only: read_only as u8,
        clock,
    };
    Args { _dir: d, a }
}

fn open(a: &Args) -> Result<(*mut Csa2SsdStore, Csa2SsdRecovery), (Csa2Status, String)> {
    let mut out = null_mut();
    let mut rep = Csa2SsdRecovery::default();
    let s = unsafe { csa2_ssd_open(&a.a, &mut rep, &mut out) };
    if s == Csa2Status::Csa2Ok {
        Ok((out, rep))
    } else {
        assert!(out.is_null(), "nothing is written to an output on failure");
        Err((s, last_error()))
    }
}

fn get(st: *const Csa2SsdStore, k: &[u8; 32], cap: usize) -> (Csa2Status, Option<Vec<u8>>) {
    let mut buf = vec![0xEEu8; cap];
    let (mut len, mut found) = (usize::MAX, 9u8);
    let s = unsafe { csa2_ssd_get(st, k.as_ptr(), buf.as_mut_ptr(), cap, &mut len, &mut found) };
    if s != Csa2Status::Csa2Ok {
        assert!(buf.iter().all(|&b| b == 0xEE), "a refused read wrote bytes");
        assert_eq!((len, found), (usize::MAX, 9), "a refused read set outputs");
        return (s, None);
    }
    if found == 0 {
        assert_eq!(len, 0);
        return (s, None);
    }
    buf.truncate(len);
    (s, Some(buf))
}

fn stats(st: *const Csa2SsdStore) -> Csa2SsdStats {
    let mut s = Csa2SsdStats::default();
    ok(unsafe { csa2_ssd_stats(st, &mut s) });
    s
}

#[test]
fn ssd_put_get_contains_survive_a_reopen_byte_exact() {
    let d = tempfile::tempdir().unwrap();
    let a = args(d.path(), false, null());
    let (st, rep) = open(&a).unwrap();
    assert_eq!(rep.records, 0);
    let mut written = 9u8;
    for i in 0..5u8 {
        let p = payload(i, 1000 + i as usize);
        ok(unsafe { csa2_ssd_put(st, key(i).as_ptr(), p.as_ptr(), p.len(), &mut written) });
        assert_eq!(written, 1);
    }
    // A present key is not rewritten.
    let p = payload(0, 1000);
    ok(unsafe { csa2_ssd_put(st, key(0).as_ptr(), p.as_ptr(), p.len(), &mut written) });
    assert_eq!(written, 0);
    let mut found = 9u8;
    ok(unsafe { csa2_ssd_contains(st, key(3).as_ptr(), &mut found) });
    assert_eq!(found, 1);
    ok(unsafe { csa2_ssd_contains(st, key(9).as_ptr(), &mut found) });
    assert_eq!(found, 0);
    assert_eq!(get(st, &key(9), 4096), (Csa2Status::Csa2Ok, None));
    let s = stats(st);
    assert_eq!(
        (s.puts, s.already_present, s.entries, s.misses),
        (5, 1, 5, 1)
    );
    assert_eq!(s.read_only, 0);
    let mut removed = 9u8;
    ok(unsafe { csa2_ssd_remove(st, key(4).as_ptr(), &mut removed) });
    assert_eq!(removed, 1);
    ok(unsafe { csa2_ssd_free(st) });

    let (st, rep) = open(&a).unwrap();
    assert_eq!(rep.records, 4);
    for i in 0..4u8 {
        let (s, got) = get(st, &key(i), 4096);
        assert_eq!(s, Csa2Status::Csa2Ok);
        assert_eq!(got.unwrap(), payload(i, 1000 + i as usize), "key {i}");
    }
    assert_eq!(
        get(st, &key(4), 4096).1,
        None,
        "a removed key stays removed"
    );
    ok(unsafe { csa2_ssd_free(st) });
}

#[test]
fn ssd_small_buffer_is_a_shape_error_and_writes_nothing() {
    let d = tempfile::tempdir().unwrap();
    let a = args(d.path(), false, null());
    let (st, _) = open(&a).unwrap();
    let p = payload(1, 300);
    ok(unsafe { csa2_ssd_put(st, key(1).as_ptr(), p.as_ptr(), p.len(), null_mut()) });
    let (s, _) = get(st, &key(1), 299);
    assert_eq!(s, Csa2Status::Csa2ErrShape);
    assert!(last_error().contains("300"), "{}", last_error());
    assert_eq!(get(st, &key(1), 300).1.unwrap(), p);
    ok(unsafe { csa2_ssd_free(st) });
}

#[test]
fn ssd_second_writer_is_refused_and_read_only_serves_alongside() {
    let d = tempfile::tempdir().unwrap();
    let a = args(d.path(), false, null());
    let (st, _) = open(&a).unwrap();
    let p = payload(7, 512);
    ok(unsafe { csa2_ssd_put(st, key(7).as_ptr(), p.as_ptr(), p.len(), null_mut()) });
    let (s, msg) = open(&a).unwrap_err();
    assert_eq!(s, Csa2Status::Csa2ErrBusy, "{msg}");
    assert!(msg.contains("csa2_ssd_open"), "{msg}");
    assert!(
        msg.contains(&format!("pid {}", std::process::id())),
        "{msg}"
    );

    let ro = args(d.path(), true, null());
    let (r, rep) = open(&ro).unwrap();
    assert_eq!(rep.records, 1);
    assert_eq!(stats(r).read_only, 1);
    assert_eq!(get(r, &key(7), 512).1.unwrap(), p);
    let s = unsafe { csa2_ssd_put(r, key(8).as_ptr(), p.as_ptr(), p.len(), null_mut()) };
    assert_eq!(
        s,
        Csa2Status::Csa2ErrInvalidArgument,
        "read-only refuses writes"
    );
    let s = unsafe { csa2_ssd_remove(r, key(7).as_ptr(), null_mut()) };
    assert_eq!(s, Csa2Status::Csa2ErrInvalidArgument);
    ok(unsafe { csa2_ssd_free(r) });
    ok(unsafe { csa2_ssd_free(st) });
    // The lock went with the writer: a new writer opens.
    let (st, _) = open(&a).unwrap();
    ok(unsafe { csa2_ssd_free(st) });
}

#[test]
fn ssd_open_failures_other_than_a_held_lock_are_not_busy() {
    // Only a held lock may be answered by opening read-only; every other cause has its own status.
    let d = tempfile::tempdir().unwrap();
    // The directory is a regular file.
    let file = d.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let (s, msg) = open(&args(&file, false, null())).unwrap_err();
    assert_eq!(s, Csa2Status::Csa2ErrIo, "{msg}");
    // A read-only open of a directory that is not there.
    let (s, msg) = open(&args(&d.path().join("absent"), true, null())).unwrap_err();
    assert_eq!(s, Csa2Status::Csa2ErrIo, "{msg}");
    // A segment name taken by a directory.
    let t = d.path().join("tier");
    std::fs::create_dir_all(t.join("seg-00000001.log")).unwrap();
    for ro in [false, true] {
        let (s, msg) = open(&args(&t, ro, null())).unwrap_err();
        assert_eq!(s, Csa2Status::Csa2ErrInvalidArgument, "{msg}");
        assert!(msg.contains("seg-00000001.log"), "{msg}");
    }
}

#[test]
fn ssd_damaged_record_is_corrupt_once_then_a_miss_never_wrong_bytes() {
    let d = tempfile::tempdir().unwrap();
    let a = args(d.path(), false, null());
    let (st, _) = open(&a).unwrap();
    let p = payload(2, 4000);
    ok(unsafe { csa2_ssd_put(st, key(2).as_ptr(), p.as_ptr(), p.len(), null_mut()) });
    // Flip one payload bit behind the store's back.
    let seg = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "log"))
        .unwrap();
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[64 + 1234] ^= 0x10;
    std::fs::write(&seg, &bytes).unwrap();
    let (s, got) = get(st, &key(2), 4096);
    assert_eq!((s, got), (Csa2Status::Csa2ErrCorrupt, None));
    assert_eq!(get(st, &key(2), 4096), (Csa2Status::Csa2Ok, None));
    assert_eq!(stats(st).corrupt, 1);
    ok(unsafe { csa2_ssd_free(st) });
    // On reopen the damaged record is found by the scan and not indexed.
    let (st, rep) = open(&a).unwrap();
    assert_eq!((rep.records, rep.corrupt_records), (0, 1));
    ok(unsafe { csa2_ssd_free(st) });
}

#[test]
fn ssd_lifetime_runs_on_the_injected_clock() {
    let d = tempfile::tempdir().unwrap();
    let mut clock = null_mut();
    ok(unsafe { csa2_manual_clock_new(1_000, &mut clock) });
    let mut a = args(d.path(), false, clock);
    // Room for two 1,000-byte records (64-B headers).
    a.a.capacity_bytes = 2 * 1064;
    a.a.min_lifetime_ms = 10_000;
    let (st, _) = open(&a).unwrap();
    let p = payload(0, 1000);
    ok(unsafe { csa2_ssd_put(st, key(0).as_ptr(), p.as_ptr(), p.len(), null_mut()) });
    ok(unsafe { csa2_ssd_put(st, key(1).as_ptr(), p.as_ptr(), p.len(), null_mut()) });
    let s = unsafe { csa2_ssd_put(st, key(2).as_ptr(), p.as_ptr(), p.len(), null_mut()) };
    assert_eq!(s, Csa2Status::Csa2ErrRefused, "inside the minimum lifetime");
    assert_eq!(stats(st).refused, 1);
    ok(unsafe { csa2_manual_clock_advance(clock, 10_001) });
    ok(unsafe { csa2_ssd_put(st, key(2).as_ptr(), p.as_ptr(), p.len(), null_mut()) });
    let s = stats(st);
    assert_eq!((s.evicted, s.entries), (1, 2));
    ok(unsafe { csa2_ssd_free(st) });
    ok(unsafe { csa2_manual_clock_free(clock) });
}

#[test]
fn ssd_bad_arguments_are_refused_with_a_status() {
    let d = tempfile::tempdir().unwrap();
    let mut a = args(d.path(), false, null());
    let mut out = null_mut();
    assert_eq!(
        unsafe { csa2_ssd_open(null(), null_mut(), &mut out) },
        Csa2Status::Csa2ErrNullPointer
    );
    a.a.struct_size = 4;
    assert_eq!(open(&a).unwrap_err().0, Csa2Status::Csa2ErrInvalidArgument);
    a.a.struct_size = std::mem::size_of::<Csa2SsdOpenArgs>();
    a.a.fsync = 7;
    let (s, msg) = open(&a).unwrap_err();
    assert_eq!(s, Csa2Status::Csa2ErrInvalidArgument);
    assert!(msg.contains("fsync"), "{msg}");
    a.a.fsync = 0;
    a.a.capacity_bytes = 0;
    assert_eq!(open(&a).unwrap_err().0, Csa2Status::Csa2ErrInvalidArgument);
    a.a.capacity_bytes = 1 << 20;
    a.a.dir = null();
    assert_eq!(open(&a).unwrap_err().0, Csa2Status::Csa2ErrNullPointer);

    // An older caller's shorter struct: the fields past its size take their defaults.
    let b = args(d.path(), false, null());
    let mut short = b.a;
    short.struct_size = std::mem::offset_of!(Csa2SsdOpenArgs, min_lifetime_ms);
    short.fsync = 99; // past the declared size: never read
    let mut out = null_mut();
    ok(unsafe { csa2_ssd_open(&short, null_mut(), &mut out) });

    // Wrong and stale handles, null pointers.
    let mut pool = null_mut();
    ok(unsafe { csa2_dram_pool_new(1 << 10, 1000, null(), &mut pool) });
    let mut found = 0u8;
    let s = unsafe { csa2_ssd_contains(pool.cast(), key(0).as_ptr(), &mut found) };
    assert_eq!(s, Csa2Status::Csa2ErrInvalidHandle);
    assert!(last_error().contains("Csa2DramPool"), "{}", last_error());
    let s = unsafe { csa2_ssd_contains(out, null(), &mut found) };
    assert_eq!(s, Csa2Status::Csa2ErrNullPointer);
    let s = unsafe { csa2_ssd_put(out, key(0).as_ptr(), null(), 5, null_mut()) };
    assert_eq!(s, Csa2Status::Csa2ErrNullPointer);
    ok(unsafe { csa2_ssd_free(out) });
    assert_eq!(
        unsafe { csa2_ssd_free(out) },
        Csa2Status::Csa2ErrInvalidHandle
    );
    assert_eq!(
        unsafe { csa2_ssd_contains(out, key(0).as_ptr(), &mut found) },
        Csa2Status::Csa2ErrInvalidHandle
    );
    ok(unsafe { csa2_dram_pool_free(pool) });
}

fn dram_get(p: *const Csa2DramPool, k: &[u8; 32], cap: usize) -> (Csa2Status, Option<Vec<u8>>) {
    let mut buf = vec![0xEEu8; cap];
    let (mut len, mut found) = (usize::MAX, 9u8);
    let s =
        unsafe { csa2_dram_pool_get(p, k.as_ptr(), buf.as_mut_ptr(), cap, &mut len, &mut found) };
    if s != Csa2Status::Csa2Ok {
        assert!(buf.iter().all(|&b| b == 0xEE));
        return (s, None);
    }
    if found == 0 {
        return (s, None);
    }
    buf.truncate(len);
    (s, Some(buf))
}

fn dram_stats(p: *const Csa2DramPool) -> Csa2DramStats {
    let mut s = Csa2DramStats::default();
    ok(unsafe { csa2_dram_pool_stats(p, &mut s) });
    s
}

#[test]
fn dram_snapshot_expires_on_the_injected_clock_and_is_never_served_after() {
    let mut clock = null_mut();
    ok(unsafe { csa2_manual_clock_new(0, &mut clock) });
    let mut pool = null_mut();
    ok(unsafe { csa2_dram_pool_new(10_000, 300_000, clock, &mut pool) });
    let p = payload(3, 2500);
    ok(unsafe { csa2_dram_pool_put(pool, key(3).as_ptr(), p.as_ptr(), p.len()) });
    assert_eq!(dram_get(pool, &key(3), 2500).1.unwrap(), p);
    assert_eq!(dram_get(pool, &key(3), 2499).0, Csa2Status::Csa2ErrShape);
    ok(unsafe { csa2_manual_clock_advance(clock, 299_999) });
    let mut found = 0u8;
    ok(unsafe { csa2_dram_pool_contains(pool, key(3).as_ptr(), &mut found) });
    assert_eq!(found, 1);
    ok(unsafe { csa2_manual_clock_advance(clock, 1) });
    ok(unsafe { csa2_dram_pool_contains(pool, key(3).as_ptr(), &mut found) });
    assert_eq!(found, 0, "expired at exactly the TTL");
    let before = dram_stats(pool);
    assert_eq!(dram_get(pool, &key(3), 2500), (Csa2Status::Csa2Ok, None));
    let after = dram_stats(pool);
    assert_eq!(after.expired_on_read, before.expired_on_read + 1);
    assert_eq!((after.entries, after.bytes), (0, 0));
    let mut now = 0;
    ok(unsafe { csa2_manual_clock_now(clock, &mut now) });
    assert_eq!(now, 300_000);
    ok(unsafe { csa2_dram_pool_free(pool) });
    ok(unsafe { csa2_manual_clock_free(clock) });
}

#[test]
fn dram_sized_mirror_makes_the_same_lru_decisions_as_the_byte_pool() {
    let mut clock = null_mut();
    ok(unsafe { csa2_manual_clock_new(0, &mut clock) });
    let (mut bytes_pool, mut sized_pool) = (null_mut(), null_mut());
    ok(unsafe { csa2_dram_pool_new(3000, 1_000, clock, &mut bytes_pool) });
    ok(unsafe { csa2_dram_pool_new(3000, 1_000, clock, &mut sized_pool) });
    // The same sequence of puts and reads on both: the sized pool predicts every hit.
    let ops: [(bool, u8, usize); 9] = [
        (true, 0, 1000),
        (true, 1, 1000),
        (false, 0, 0),
        (true, 2, 1000),
        (true, 3, 1000), // evicts 1 (0 was read after 1 was stored)
        (false, 1, 0),
        (false, 0, 0),
        (true, 4, 2500), // evicts 2, 3, 0 in LRU order until it fits
        (false, 3, 0),
    ];
    for (put, i, n) in ops {
        if put {
            let p = payload(i, n);
            ok(unsafe { csa2_dram_pool_put(bytes_pool, key(i).as_ptr(), p.as_ptr(), n) });
            ok(unsafe { csa2_dram_pool_put_sized(sized_pool, key(i).as_ptr(), n as u64) });
        } else {
            let real = dram_get(bytes_pool, &key(i), 4096).1;
            let (mut len, mut found) = (0usize, 0u8);
            ok(unsafe {
                csa2_dram_pool_get(
                    sized_pool,
                    key(i).as_ptr(),
                    null_mut(),
                    0,
                    &mut len,
                    &mut found,
                )
            });
            assert_eq!(real.is_some(), found == 1, "key {i}");
            if let Some(r) = real {
                assert_eq!(r.len(), len);
            }
        }
    }
    assert_eq!(dram_stats(bytes_pool), dram_stats(sized_pool));
    assert_eq!(dram_stats(bytes_pool).evictions, 4);
    // Larger than the whole pool: refused, nothing evicted.
    let big = vec![0u8; 3001];
    let s = unsafe { csa2_dram_pool_put(bytes_pool, key(9).as_ptr(), big.as_ptr(), big.len()) };
    assert_eq!(s, Csa2Status::Csa2ErrRefused);
    assert_eq!(dram_stats(bytes_pool).entries, 1);
    ok(unsafe { csa2_dram_pool_sweep(bytes_pool) });
    ok(unsafe { csa2_manual_clock_advance(clock, 1_000) });
    ok(unsafe { csa2_dram_pool_sweep(bytes_pool) });
    assert_eq!(dram_stats(bytes_pool).entries, 0);
    let s = unsafe { csa2_dram_pool_new(0, 1, null(), &mut sized_pool) };
    assert_eq!(s, Csa2Status::Csa2ErrInvalidArgument);
    ok(unsafe { csa2_dram_pool_free(bytes_pool) });
    let mut hm = 0u64;
    ok(unsafe { csa2_host_memory_bytes(&mut hm) });
    assert!(hm > 0);
}
