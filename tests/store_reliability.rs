//! Reliability of the persistent tiers: torn tails, flipped bits, restart, minimum lifetime,
//! admission control, TTL expiry, and a reader racing a writer of the same key.

use csa2::cache::PrefixKey;
use csa2::store::ssd::{crash_test_record, synthetic_payload, HEADER_BYTES};
use csa2::store::{
    Clock, DramConfig, DramPool, FsyncPolicy, ManualClock, Snapshot, SsdConfig, SsdStore,
};
use csa2::Error;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

const HOUR: u64 = 3_600_000;

fn cfg(dir: &Path, cap: u64) -> SsdConfig {
    let mut c = SsdConfig::new(dir, cap);
    c.fsync = FsyncPolicy::Never;
    c.segment_bytes = 64 << 10;
    c
}

fn rec(seed: u64, i: u64, max: usize) -> (PrefixKey, Vec<u8>) {
    let (k, len) = crash_test_record(seed, i, max);
    let mut v = Vec::new();
    synthetic_payload(&k, len, &mut v);
    (k, v)
}

fn segments(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    v.sort();
    v
}

#[test]
fn restart_serves_every_entry() {
    let d = tempfile::tempdir().unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(5));
    let recs: Vec<_> = (0..60).map(|i| rec(1, i, 20_000)).collect();
    {
        let (s, rep) = SsdStore::open(cfg(d.path(), 1 << 30), clock.clone()).unwrap();
        assert_eq!(rep.records, 0);
        for (k, v) in &recs {
            assert!(s.put(k, v).unwrap());
        }
        assert!(
            !s.put(&recs[0].0, &recs[0].1).unwrap(),
            "same key: nothing rewritten"
        );
        assert!(
            segments(d.path()).len() > 3,
            "records span several segments"
        );
    }
    let (s, rep) = SsdStore::open(cfg(d.path(), 1 << 30), clock).unwrap();
    assert_eq!(rep.records, 60);
    assert_eq!(rep.corrupt_records, 0);
    for (k, v) in &recs {
        assert_eq!(s.get(k).unwrap().as_deref(), Some(&v[..]));
    }
    assert_eq!(s.get(&rec(2, 0, 10).0).unwrap(), None);
}

#[test]
fn torn_tail_record_is_detected_truncated_and_never_served() {
    let d = tempfile::tempdir().unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
    let recs: Vec<_> = (0..5).map(|i| rec(3, i, 3000)).collect();
    {
        let mut c = cfg(d.path(), 1 << 30);
        c.segment_bytes = 1 << 30;
        let (s, _) = SsdStore::open(c, clock.clone()).unwrap();
        for (k, v) in &recs {
            s.put(k, v).unwrap();
        }
    }
    // Cut the last record in the middle of its payload, as a crash during the write would.
    let seg = segments(d.path()).pop().unwrap();
    let len = std::fs::metadata(&seg).unwrap().len();
    let last = (HEADER_BYTES + recs[4].1.len()) as u64;
    let cut = len - last + HEADER_BYTES as u64 + recs[4].1.len() as u64 / 2;
    OpenOptions::new()
        .write(true)
        .open(&seg)
        .unwrap()
        .set_len(cut)
        .unwrap();
    let (s, rep) = SsdStore::open(cfg(d.path(), 1 << 30), clock.clone()).unwrap();
    assert_eq!(rep.records, 4);
    assert_eq!(rep.torn_bytes_truncated, cut - (len - last));
    assert!(
        rep.notes.iter().any(|n| n.contains("torn record")),
        "{:?}",
        rep.notes
    );
    assert_eq!(s.get(&recs[4].0).unwrap(), None);
    for (k, v) in &recs[..4] {
        assert_eq!(s.get(k).unwrap().as_deref(), Some(&v[..]));
    }
    // The store keeps working after the cut, and a torn header (< 64 bytes) is handled too.
    s.put(&recs[4].0, &recs[4].1).unwrap();
    drop(s);
    let seg = segments(d.path()).pop().unwrap();
    let f = OpenOptions::new().append(true).open(&seg).unwrap();
    f.write_all_at(b"CSA2\x01", std::fs::metadata(&seg).unwrap().len())
        .unwrap();
    let (s, rep) = SsdStore::open(cfg(d.path(), 1 << 30), clock).unwrap();
    assert_eq!(rep.records, 5);
    assert_eq!(rep.torn_bytes_truncated, 5);
    assert_eq!(s.get(&recs[4].0).unwrap().as_deref(), Some(&recs[4].1[..]));
}

#[test]
fn flipped_bit_is_detected_on_read_and_on_open() {
    let d = tempfile::tempdir().unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
    let recs: Vec<_> = (0..3).map(|i| rec(4, i, 5000)).collect();
    let mut c = cfg(d.path(), 1 << 30);
    c.segment_bytes = 1 << 30;
    let (s, _) = SsdStore::open(c.clone(), clock.clone()).unwrap();
    for (k, v) in &recs {
        s.put(k, v).unwrap();
    }
    // Flip one payload bit of record 1 behind the store's back.
    let seg = segments(d.path()).pop().unwrap();
    let off = (HEADER_BYTES + recs[0].1.len() + HEADER_BYTES + recs[1].1.len() / 3) as u64;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&seg)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, off).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], off).unwrap();
    match s.get(&recs[1].0) {
        Err(Error::Corrupt { reason, .. }) => assert!(reason.contains("CRC32C"), "{reason}"),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert_eq!(s.get(&recs[1].0).unwrap(), None, "dropped after detection");
    assert_eq!(s.stats().corrupt, 1);
    assert_eq!(s.get(&recs[2].0).unwrap().as_deref(), Some(&recs[2].1[..]));
    drop(s);
    // On open the payload check keeps it out of the index; the neighbours survive.
    let (s, rep) = SsdStore::open(c.clone(), clock.clone()).unwrap();
    assert_eq!((rep.records, rep.corrupt_records), (2, 1));
    assert_eq!(s.get(&recs[1].0).unwrap(), None);
    drop(s);
    // A flipped header bit loses that record only: the scan resynchronises on the next one.
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&seg)
        .unwrap();
    let hoff = (HEADER_BYTES + recs[0].1.len() + 20) as u64;
    f.read_exact_at(&mut b, hoff).unwrap();
    f.write_all_at(&[b[0] ^ 1], hoff).unwrap();
    let (s, rep) = SsdStore::open(c, clock).unwrap();
    assert!(
        rep.notes.iter().any(|n| n.contains("header CRC32C")),
        "{:?}",
        rep.notes
    );
    assert_eq!(s.get(&recs[0].0).unwrap().as_deref(), Some(&recs[0].1[..]));
    assert_eq!(s.get(&recs[1].0).unwrap(), None);
    assert_eq!(s.get(&recs[2].0).unwrap().as_deref(), Some(&recs[2].1[..]));
}

#[test]
fn minimum_lifetime_admission_and_lru_eviction() {
    let d = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(0));
    let dyn_clock: Arc<dyn Clock> = clock.clone();
    // 16 KiB segments, 64 KiB of live records: 8 records of 8 KiB (header included).
    let mut c = cfg(d.path(), 64 << 10);
    c.segment_bytes = 16 << 10;
    let (s, _) = SsdStore::open(c.clone(), dyn_clock.clone()).unwrap();
    let payload = |i: u64| {
        let k = crash_test_record(9, i, 1).0;
        let mut v = Vec::new();
        synthetic_payload(&k, 8192 - HEADER_BYTES, &mut v);
        (k, v)
    };
    let mut stored = Vec::new();
    for i in 0..8 {
        let (k, v) = payload(i);
        s.put(&k, &v).unwrap();
        stored.push((k, v));
        clock.advance(1000);
    }
    // Full of entries younger than 72 h: the next write is refused and counted, nothing evicted.
    let (k8, v8) = payload(8);
    assert!(matches!(s.put(&k8, &v8), Err(Error::Refused(_))));
    assert_eq!(s.stats().refused, 1);
    assert_eq!(s.stats().evicted, 0);
    for (k, v) in &stored {
        assert_eq!(s.get(k).unwrap().as_deref(), Some(&v[..]));
    }
    // Touch the two oldest so record 2 becomes least recently used.
    s.get(&stored[0].0).unwrap();
    s.get(&stored[1].0).unwrap();
    clock.advance(72 * HOUR);
    s.put(&k8, &v8).unwrap();
    let st = s.stats();
    assert_eq!(
        st.evicted, 1,
        "one record's room: the least recently used entry went"
    );
    assert!(st.live_bytes <= 64 << 10);
    assert_eq!(s.get(&stored[2].0).unwrap(), None, "evicted: never served");
    assert!(s.get(&stored[3].0).unwrap().is_some());
    assert!(s.get(&stored[0].0).unwrap().is_some());
    // Two more: records 4 and 5 go (3 was just read); record 4's segment stays (5 lives on
    // until evicted, then the segment is empty and deleted or compacted).
    let (k9, v9) = payload(9);
    s.put(&k9, &v9).unwrap();
    assert_eq!(s.get(&stored[4].0).unwrap(), None);
    let (k10, v10) = payload(10);
    s.put(&k10, &v10).unwrap();
    assert_eq!(s.stats().evicted, 3);
    assert_eq!(s.get(&stored[5].0).unwrap(), None);
    drop(s);
    // Evicted entries stay evicted across a restart, and the survivors are served.
    let (s, _) = SsdStore::open(c, dyn_clock).unwrap();
    for i in [2, 4, 5] {
        assert_eq!(s.get(&stored[i].0).unwrap(), None, "record {i} came back");
    }
    for i in [0, 1, 3, 6, 7] {
        assert_eq!(
            s.get(&stored[i].0).unwrap().as_deref(),
            Some(&stored[i].1[..])
        );
    }
    for k in [&k8, &k9, &k10] {
        assert!(s.get(k).unwrap().is_some());
    }
    assert!(s.stats().live_bytes <= 64 << 10);
}

#[test]
fn a_reader_racing_a_writer_sees_nothing_or_the_whole_record() {
    let d = tempfile::tempdir().unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
    let mut c = cfg(d.path(), 1 << 30);
    c.io_chunk_bytes = 512; // many small writes per record widen the race window
    let s = Arc::new(SsdStore::open(c, clock).unwrap().0);
    let mut complete_reads = 0;
    for i in 0..30 {
        let (k, v) = rec(11, i, 100_000);
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (s, done) = (s.clone(), done.clone());
            std::thread::spawn(move || {
                let mut seen = 0;
                let mut want = Vec::new();
                // Poll until the writer is done, then once more.
                loop {
                    let finished = done.load(std::sync::atomic::Ordering::Acquire);
                    if let Some(got) = s.get(&k).unwrap() {
                        synthetic_payload(&k, got.len(), &mut want);
                        assert_eq!(got, want, "a partial or wrong record was served");
                        seen += 1;
                    }
                    if finished {
                        return seen;
                    }
                }
            })
        };
        s.put(&k, &v).unwrap();
        done.store(true, std::sync::atomic::Ordering::Release);
        complete_reads += reader.join().unwrap();
        assert_eq!(s.get(&k).unwrap().as_deref(), Some(&v[..]));
    }
    assert!(
        complete_reads >= 30,
        "the final read of every round sees the record"
    );
    assert_eq!(s.stats().corrupt, 0);
}

#[test]
fn ttl_expired_snapshot_is_never_served() {
    let clock = Arc::new(ManualClock::new(0));
    let pool = DramPool::new(
        DramConfig {
            capacity_bytes: 1000,
            ttl_ms: 300_000,
        },
        clock.clone(),
    )
    .unwrap();
    let k = |i| crash_test_record(20, i, 1).0;
    pool.put(k(0), Snapshot::Bytes(vec![7u8; 400].into()))
        .unwrap();
    clock.advance(299_999);
    assert!(pool.get(&k(0)).is_some(), "1 ms before expiry");
    clock.advance(1);
    assert_eq!(
        pool.get(&k(0)),
        None,
        "at the deadline: not served, although not reclaimed"
    );
    assert_eq!(pool.stats().expired_on_read, 1);
    assert_eq!(pool.stats().bytes, 0);
    // LRU: a, b fit; touching a makes b the victim for c.
    pool.put(k(1), Snapshot::Sized(400)).unwrap();
    pool.put(k(2), Snapshot::Sized(400)).unwrap();
    assert!(pool.get(&k(1)).is_some());
    pool.put(k(3), Snapshot::Sized(400)).unwrap();
    assert_eq!(pool.get(&k(2)), None);
    assert!(pool.get(&k(1)).is_some());
    assert_eq!(pool.stats().evictions, 1);
    // Expired snapshots are reclaimed before live ones are evicted.
    clock.advance(300_000);
    pool.put(k(4), Snapshot::Sized(900)).unwrap();
    assert_eq!(pool.stats().evictions, 1);
    assert_eq!(pool.stats().expired_reclaimed, 2);
    assert!(matches!(
        pool.put(k(5), Snapshot::Sized(1001)),
        Err(Error::Refused(_))
    ));
}

#[test]
fn host_memory_is_read() {
    let m = csa2::store::dram::host_memory_bytes().unwrap();
    assert!(m > 64 << 20, "{m}");
    let c = DramConfig::host_default().unwrap();
    assert_eq!(c.capacity_bytes, m / 10);
    assert_eq!(c.ttl_ms, 300_000);
}

/// Spawns `csa2 ssd-writer` on `dir` and returns it with a channel of its acknowledgements.
fn spawn_writer(
    dir: &Path,
    seed: u64,
) -> (
    std::process::Child,
    std::sync::mpsc::Receiver<u64>,
    std::thread::JoinHandle<Vec<u64>>,
) {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_csa2"))
        .args(["ssd-writer", "--dir"])
        .arg(dir)
        .args(["--seed", &seed.to_string(), "--max-len", "8192", "--fsync"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let out = child.stdout.take().unwrap();
    let h = std::thread::spawn(move || {
        let mut acks = Vec::new();
        for l in BufReader::new(out).lines().map_while(|l| l.ok()) {
            if let Some(i) = l.strip_prefix("ack ").and_then(|n| n.parse::<u64>().ok()) {
                acks.push(i);
                let _ = tx.send(i);
            }
        }
        acks
    });
    (child, rx, h)
}

#[test]
fn read_only_opener_reads_beside_a_live_writer_and_changes_nothing() {
    let d = tempfile::tempdir().unwrap();
    let (mut child, rx, h) = spawn_writer(d.path(), 17);
    let mut seen = Vec::new();
    for _ in 0..15 {
        seen.push(
            rx.recv_timeout(std::time::Duration::from_secs(60))
                .expect("the writer acknowledges"),
        );
    }
    // Beside the live writer: a read-only open works and serves what was acknowledged before it.
    let (ro, _) = SsdStore::open_read_only(
        SsdConfig::new(d.path(), 1 << 40),
        Arc::new(csa2::store::SystemClock) as Arc<dyn Clock>,
    )
    .unwrap();
    assert!(ro.is_read_only());
    let mut buf = Vec::new();
    for &i in &seen {
        let (k, len) = crash_test_record(17, i, 8192);
        synthetic_payload(&k, len, &mut buf);
        assert_eq!(ro.get(&k).unwrap().as_deref(), Some(&buf[..]), "record {i}");
    }
    let (k, v) = rec(18, 0, 100);
    match ro.put(&k, &v) {
        Err(Error::Invalid { reason, .. }) => assert!(reason.contains("read-only"), "{reason}"),
        other => panic!("a read-only store must refuse writes: {other:?}"),
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let acks = h.join().unwrap();
    // A torn tail left by the kill is not truncated by a read-only open.
    let sizes = |d: &Path| -> Vec<u64> {
        segments(d)
            .iter()
            .map(|p| std::fs::metadata(p).unwrap().len())
            .collect()
    };
    let before = sizes(d.path());
    let (ro2, _) = SsdStore::open_read_only(
        SsdConfig::new(d.path(), 1 << 40),
        Arc::new(ManualClock::new(0)) as Arc<dyn Clock>,
    )
    .unwrap();
    assert_eq!(sizes(d.path()), before, "read-only open changed a segment");
    drop(ro2);
    // The writer's successor removes a record: the read-only store re-checks the disk and does not
    // serve it any more.
    let (w, _) = SsdStore::open(
        SsdConfig::new(d.path(), 1 << 40),
        Arc::new(ManualClock::new(0)) as Arc<dyn Clock>,
    )
    .unwrap();
    let (k0, _) = crash_test_record(17, seen[0], 8192);
    assert!(w.remove(&k0).unwrap());
    assert_eq!(
        ro.get(&k0).unwrap(),
        None,
        "removed by the writer: not served"
    );
    for &i in &acks {
        let (k, len) = crash_test_record(17, i, 8192);
        synthetic_payload(&k, len, &mut buf);
        let want = if i == seen[0] { None } else { Some(&buf[..]) };
        assert_eq!(w.get(&k).unwrap().as_deref(), want, "record {i}");
    }
}

#[test]
fn a_second_open_in_the_same_process_is_refused_and_the_lock_goes_with_the_store() {
    let d = tempfile::tempdir().unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
    let (s, _) = SsdStore::open(cfg(d.path(), 1 << 20), clock.clone()).unwrap();
    let err = SsdStore::open(cfg(d.path(), 1 << 20), clock.clone()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("pid {}", std::process::id())) && msg.contains("this process"),
        "{msg}"
    );
    drop(s);
    SsdStore::open(cfg(d.path(), 1 << 20), clock).unwrap();
}

#[test]
fn compaction_copies_live_records_forward_and_keeps_them_across_restart() {
    let d = tempfile::tempdir().unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
    let mut c = cfg(d.path(), 1 << 30);
    c.segment_bytes = 16 << 10;
    let recs: Vec<_> = (0..120).map(|i| rec(23, i, 3000)).collect();
    {
        let (s, _) = SsdStore::open(c.clone(), clock.clone()).unwrap();
        for (i, (k, v)) in recs.iter().enumerate() {
            s.put(k, v).unwrap();
            if i % 3 != 0 {
                assert!(s.remove(k).unwrap());
            }
        }
        let st = s.stats();
        assert!(st.compactions > 0, "{st:?}");
        assert!(st.removed == 80);
        // Closed segments keep at least half live bytes.
        assert!(
            st.disk_bytes <= 2 * st.live_bytes + 2 * (16 << 10),
            "{st:?}"
        );
    }
    let (s, rep) = SsdStore::open(c, clock).unwrap();
    assert_eq!(rep.corrupt_records, 0, "{:?}", rep.notes);
    for (i, (k, v)) in recs.iter().enumerate() {
        let want = (i % 3 == 0).then_some(&v[..]);
        assert_eq!(s.get(k).unwrap().as_deref(), want, "record {i}");
    }
}

#[test]
fn version_1_directory_is_refused_with_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    // A version-1 header: magic, version 1, state 0xA5 at byte 5, CRC of bytes 0..5 and 6..60.
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(b"CSA2");
    h[4] = 1;
    h[5] = 0xA5;
    let c = crc32c::crc32c_append(crc32c::crc32c(&h[..5]), &h[6..60]);
    h[60..64].copy_from_slice(&c.to_le_bytes());
    std::fs::write(d.path().join("seg-00000001.log"), h).unwrap();
    let err = SsdStore::open(cfg(d.path(), 1 << 20), Arc::new(ManualClock::new(0)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("format version 1"), "{err}");
    assert_eq!(
        std::fs::metadata(d.path().join("seg-00000001.log"))
            .unwrap()
            .len(),
        64
    );
}

/// Copies the segment files of `from` into a fresh directory.
fn snapshot(from: &Path) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for p in segments(from) {
        std::fs::copy(&p, d.path().join(p.file_name().unwrap())).unwrap();
    }
    d
}

/// Writes the documented dead state word (CRC32C of header bytes 0..56, then `dead`) of the
/// record at `off`.
fn mark_dead_by_hand(seg: &Path, off: u64) {
    let f = OpenOptions::new().read(true).write(true).open(seg).unwrap();
    let mut h = [0u8; HEADER_BYTES];
    f.read_exact_at(&mut h, off).unwrap();
    let w = crc32c::crc32c_append(crc32c::crc32c(&h[..56]), b"dead");
    f.write_all_at(&w.to_le_bytes(), off + 60).unwrap();
}

#[test]
fn a_crash_inside_compaction_loses_nothing() {
    // 8 records of 2064 B per 16 KiB segment; segment 1 holds records 0..8. Removing 0..4 makes
    // it half dead, so the fourth removal compacts it: 4..8 are copied to a new segment, synced,
    // and segment 1 is deleted. The crash states in between are rebuilt from snapshots.
    let d = tempfile::tempdir().unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
    let mut c = cfg(d.path(), 1 << 30);
    c.segment_bytes = 16 << 10;
    let len = 2000;
    let recb = (HEADER_BYTES + len) as u64;
    let recs: Vec<_> = (0..24)
        .map(|i| {
            let k = crash_test_record(29, i, 1).0;
            let mut v = Vec::new();
            synthetic_payload(&k, len, &mut v);
            (k, v)
        })
        .collect();
    let (s, _) = SsdStore::open(c.clone(), clock.clone()).unwrap();
    for (k, v) in &recs {
        s.put(k, v).unwrap();
    }
    for (k, _) in &recs[..3] {
        s.remove(k).unwrap();
    }
    assert_eq!(s.stats().compactions, 0);
    let before = snapshot(d.path());
    s.remove(&recs[3].0).unwrap();
    assert_eq!(s.stats().compactions, 1);
    let after = snapshot(d.path());
    drop(s);
    let seg1 = "seg-00000001.log";
    assert!(before.path().join(seg1).exists() && !after.path().join(seg1).exists());
    // The removal of record 3 is marked before the compaction starts.
    mark_dead_by_hand(&before.path().join(seg1), 3 * recb);
    let copies = segments(after.path()).pop().unwrap();
    assert_eq!(std::fs::metadata(&copies).unwrap().len(), 4 * recb);
    let check = |dir: &Path, removed: &[usize]| {
        let mut c2 = c.clone();
        c2.dir = dir.to_path_buf();
        let (s, rep) = SsdStore::open(c2, clock.clone()).unwrap();
        assert_eq!(rep.corrupt_records, 0, "{:?}", rep.notes);
        for (i, (k, v)) in recs.iter().enumerate() {
            let want = (!removed.contains(&i)).then_some(&v[..]);
            assert_eq!(s.get(k).unwrap().as_deref(), want, "record {i}");
        }
        (s, rep)
    };
    // State A: the copies are complete, the old segment is not yet deleted.
    let a = snapshot(before.path());
    std::fs::copy(&copies, a.path().join(copies.file_name().unwrap())).unwrap();
    let (s, rep) = check(a.path(), &[0, 1, 2, 3]);
    assert_eq!(
        rep.superseded_records, 4,
        "both copies found; the newer wins"
    );
    // A removal after the restart stays removed, although an older copy was on disk.
    s.remove(&recs[5].0).unwrap();
    drop(s);
    check(a.path(), &[0, 1, 2, 3, 5]);
    // State B: killed while writing the third copy.
    let b = snapshot(before.path());
    let torn = b.path().join(copies.file_name().unwrap());
    std::fs::copy(&copies, &torn).unwrap();
    OpenOptions::new()
        .write(true)
        .open(&torn)
        .unwrap()
        .set_len(2 * recb + 700)
        .unwrap();
    let (_, rep) = check(b.path(), &[0, 1, 2, 3]);
    assert_eq!(rep.torn_bytes_truncated, 700);
    assert_eq!(rep.superseded_records, 2);
}

#[test]
fn reopening_while_another_thread_spawns_children_is_not_refused() {
    // A child spawned by any thread shares the parent's descriptors, the directory lock's too,
    // until its exec: a store closed and reopened meanwhile must not be refused as "in use".
    let d = tempfile::tempdir().unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spawner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut n = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::process::Command::new("true").status().unwrap();
                n += 1;
            }
            n
        })
    };
    let mut refused = Vec::new();
    for i in 0..150u64 {
        match SsdStore::open(cfg(d.path(), 1 << 20), clock.clone()) {
            Ok((s, _)) => {
                let (k, v) = rec(27, i, 64);
                s.put(&k, &v).unwrap();
            }
            Err(e) => refused.push(format!("open {i}: {e}")),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let spawned = spawner.join().unwrap();
    assert!(
        refused.is_empty(),
        "{} of 150 reopens refused while {spawned} children were spawned: {:?}",
        refused.len(),
        &refused[..refused.len().min(2)]
    );
}
