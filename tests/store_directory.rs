//! The SSD tier's directory under attack (`cargo test --test suite store_directory::`): a
//! compaction whose copies fill a segment, stray files named like segments, a segment id at the
//! top of the id space, a directory of a newer on-disk format, the directory or a segment deleted
//! under a running writer, and a failing sync. Each test failed on the tier before its fix; each
//! prints what it measured (acknowledged records, records lost, wrong bytes served).

use csa2::cache::PrefixKey;
use csa2::store::ssd::{crash_test_record, synthetic_payload, HEADER_BYTES, STATE_OFFSET};
use csa2::store::{FsyncPolicy, SsdConfig, SsdStore, SystemClock};
use csa2::Error;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn cfg(dir: &Path, seg: u64) -> SsdConfig {
    let mut c = SsdConfig::new(dir, 1 << 30);
    c.fsync = FsyncPolicy::Never;
    c.segment_bytes = seg;
    c
}

fn open(c: &SsdConfig) -> SsdStore {
    SsdStore::open(c.clone(), Arc::new(SystemClock)).unwrap().0
}

/// Record `i` of stream `seed` with a payload of exactly `len` bytes.
fn fixed(seed: u64, i: u64, len: usize) -> (PrefixKey, Vec<u8>) {
    let k = crash_test_record(seed, i, 1).0;
    let mut v = Vec::new();
    synthetic_payload(&k, len, &mut v);
    (k, v)
}

/// Every file of `dir` with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

fn segment_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("seg-"))
        .collect();
    v.sort();
    v
}

/// (served intact, lost, wrong bytes) of `recs` in `s`; a read error counts as lost.
fn audit(s: &SsdStore, recs: &[(PrefixKey, Vec<u8>)]) -> (usize, usize, usize) {
    let (mut ok, mut lost, mut wrong) = (0, 0, 0);
    for (k, v) in recs {
        match s.get(k) {
            Ok(Some(got)) if &got == v => ok += 1,
            Ok(Some(_)) => wrong += 1,
            Ok(None) | Err(_) => lost += 1,
        }
    }
    (ok, lost, wrong)
}

// ---- compaction that fills a segment with its copies ---------------------------------------------

#[test]
fn a_compaction_whose_copies_fill_a_segment_keeps_every_record() {
    let dir = tempfile::tempdir().unwrap();
    // One 64-KiB segment: six live 4-KiB records, then a 40-KiB record at its end.
    let small: Vec<_> = (0..6).map(|i| fixed(1, i, 4096)).collect();
    let big = fixed(1, 99, 40 << 10);
    {
        let s = open(&cfg(dir.path(), 64 << 10));
        for (k, v) in small.iter().chain([&big]) {
            assert!(s.put(k, v).unwrap());
        }
    }
    // Segments lowered to 8 KiB: removing the big record compacts the old segment, and its six
    // copies cross the new segment size twice while they are written.
    let c = cfg(dir.path(), 8 << 10);
    let s = open(&c);
    assert!(s.remove(&big.0).unwrap());
    assert_eq!(s.stats().compactions, 1, "{:?}", s.stats());
    let in_process = audit(&s, &small);
    drop(s);
    let s = open(&c);
    let reopened = audit(&s, &small);
    eprintln!(
        "compaction filling segments: 6 acknowledged; in process (served, lost, wrong) \
         {in_process:?}, after reopen {reopened:?}"
    );
    assert_eq!(in_process, (6, 0, 0));
    assert_eq!(reopened, (6, 0, 0));
}

#[test]
fn a_compaction_into_an_active_segment_of_dead_records_keeps_every_record() {
    // The same hazard in one run with mixed record sizes: the copies land in an active segment
    // whose only record was removed, and cross its end.
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(dir.path(), 16 << 10);
    let s = open(&c);
    // Segment 1: fifteen 1000-B records (15,960 B), then a 16,000-B record at its end.
    let small: Vec<_> = (0..15).map(|i| fixed(2, i, 1000)).collect();
    let big = fixed(2, 100, 16_000);
    let x = fixed(2, 101, 3000);
    for (k, v) in small.iter().chain([&big, &x]) {
        assert!(s.put(k, v).unwrap());
    }
    // Segment 2 (active) holds only `x`; removing it leaves a dead quarter-segment in place.
    assert!(s.remove(&x.0).unwrap());
    assert_eq!(s.stats().compactions, 0);
    // Removing the big record compacts segment 1 into segment 2, past its end.
    assert!(s.remove(&big.0).unwrap());
    assert_eq!(s.stats().compactions, 1);
    let in_process = audit(&s, &small);
    drop(s);
    let s = open(&c);
    let reopened = audit(&s, &small);
    eprintln!(
        "compaction into a dead active segment: 15 acknowledged; in process (served, lost, \
         wrong) {in_process:?}, after reopen {reopened:?}"
    );
    assert_eq!(in_process, (15, 0, 0));
    assert_eq!(reopened, (15, 0, 0));
}

// ---- stray files named like segments -------------------------------------------------------------

#[test]
fn stray_files_named_like_segments_are_ignored_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(dir.path(), 16 << 10);
    let recs: Vec<_> = (0..72)
        .map(|i| fixed(3, i, 900 + (i as usize % 5) * 300))
        .collect();
    {
        let s = open(&c);
        for (k, v) in &recs {
            assert!(s.put(k, v).unwrap());
        }
    }
    let first = dir.path().join("seg-00000001.log");
    assert!(first.exists(), "{:?}", segment_names(dir.path()));
    // A 0-byte file whose name parses to id 1, and two backup copies of segment 1.
    std::fs::write(dir.path().join("seg-+1.log"), b"").unwrap();
    std::fs::copy(&first, dir.path().join("seg-1.log")).unwrap();
    std::fs::copy(&first, dir.path().join("seg-01.log")).unwrap();
    let strays = ["seg-+1.log", "seg-1.log", "seg-01.log"];
    let before: Vec<Vec<u8>> = strays
        .iter()
        .map(|n| std::fs::read(dir.path().join(n)).unwrap())
        .collect();
    let mut results = Vec::new();
    for round in 0..3 {
        let (s, rep) = SsdStore::open(c.clone(), Arc::new(SystemClock)).unwrap();
        for n in strays {
            assert!(
                rep.notes.iter().any(|m| m.contains(n)),
                "open {round}: the report names the stray file {n}: {:?}",
                rep.notes
            );
        }
        assert_eq!(rep.superseded_records, 0, "open {round}: {rep:?}");
        results.push(audit(&s, &recs));
    }
    eprintln!("stray segment names: 72 acknowledged; (served, lost, wrong) per reopen {results:?}");
    assert!(results.iter().all(|&r| r == (72, 0, 0)), "{results:?}");
    for (n, b) in strays.iter().zip(&before) {
        assert_eq!(
            &std::fs::read(dir.path().join(n)).unwrap(),
            b,
            "{n} was changed"
        );
    }
}

#[test]
fn a_second_name_of_a_segment_is_read_once() {
    // A hard link under another canonical name is the same file: its records are not copies of
    // themselves, nothing is marked dead on its account, and its name is never written over.
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(dir.path(), 4 << 10);
    let mut recs: Vec<_> = (0..10).map(|i| fixed(4, i, 500)).collect();
    {
        let s = open(&c);
        for (k, v) in &recs {
            s.put(k, v).unwrap();
        }
    }
    std::fs::hard_link(
        dir.path().join("seg-00000001.log"),
        dir.path().join("seg-00000004.log"),
    )
    .unwrap();
    for round in 0..2u64 {
        let s = open(&c);
        assert_eq!(audit(&s, &recs), (recs.len(), 0, 0));
        // Enough records to roll over the linked name's id.
        for i in 0..30 {
            let r = fixed(4, 100 + round * 100 + i, 500);
            s.put(&r.0, &r.1).unwrap();
            recs.push(r);
        }
        assert_eq!(audit(&s, &recs), (recs.len(), 0, 0));
    }
    let s = open(&c);
    assert_eq!(audit(&s, &recs), (70, 0, 0));
}

// ---- segment ids at the top of the id space ------------------------------------------------------

#[test]
fn a_segment_id_at_the_top_of_the_id_space_is_renumbered_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(dir.path(), 4 << 10);
    let mut recs: Vec<_> = (0..20).map(|i| fixed(5, i, 1000)).collect();
    {
        let s = open(&c);
        for (k, v) in &recs {
            s.put(k, v).unwrap();
        }
    }
    // One empty foreign file at the last id, one a little below it holding records.
    std::fs::write(dir.path().join("seg-4294967295.log"), b"").unwrap();
    std::fs::copy(
        dir.path().join("seg-00000001.log"),
        dir.path().join("seg-4294967200.log"),
    )
    .unwrap();
    let (s, rep) = SsdStore::open(c.clone(), Arc::new(SystemClock))
        .unwrap_or_else(|e| panic!("a foreign segment id stops the open: {e}"));
    assert!(
        rep.notes.iter().any(|n| n.contains("renumbered")),
        "{:?}",
        rep.notes
    );
    // Rolls keep working: 20 more records over several segments.
    for i in 20..40 {
        let r = fixed(5, i, 1000);
        s.put(&r.0, &r.1).unwrap();
        recs.push(r);
    }
    assert_eq!(audit(&s, &recs), (40, 0, 0));
    drop(s);
    let s = open(&c);
    assert_eq!(audit(&s, &recs), (40, 0, 0));
    let top = segment_names(dir.path()).pop().unwrap();
    assert!(top.as_str() < "seg-10000000.log", "{top}");
}

// ---- a directory written by a newer on-disk format -----------------------------------------------

/// Rewrites every record header of `seg` as a format-`v` build would stamp it (version byte,
/// header CRC and state word recomputed): a directory that build wrote.
fn restamp(seg: &Path, v: u8) {
    let mut b = std::fs::read(seg).unwrap();
    let mut off = 0usize;
    while off + HEADER_BYTES <= b.len() {
        let len = u32::from_le_bytes(b[off + 48..off + 52].try_into().unwrap()) as usize;
        let sw = u32::from_le_bytes(b[off + 60..off + 64].try_into().unwrap());
        let hcrc = u32::from_le_bytes(b[off + 56..off + 60].try_into().unwrap());
        let live = sw == crc32c::crc32c_append(hcrc, b"live");
        b[off + 4] = v;
        let c = crc32c::crc32c(&b[off..off + 56]);
        b[off + 56..off + 60].copy_from_slice(&c.to_le_bytes());
        let w = crc32c::crc32c_append(c, if live { b"live" } else { b"dead" });
        b[off + STATE_OFFSET..off + STATE_OFFSET + 4].copy_from_slice(&w.to_le_bytes());
        off += HEADER_BYTES + len;
    }
    std::fs::write(seg, b).unwrap();
}

#[test]
fn a_directory_of_a_newer_format_is_refused_and_left_untouched() {
    for case in ["every segment", "only the newest segment, torn"] {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(dir.path(), 8 << 10);
        {
            let s = open(&c);
            for i in 0..30 {
                let r = fixed(6, i, 700);
                s.put(&r.0, &r.1).unwrap();
            }
            // Superseded pairs and removals, so a misreading open would have marks to write.
            for i in 0..5 {
                s.remove(&fixed(6, i, 700).0).unwrap();
            }
        }
        let segs = segment_names(dir.path());
        assert!(segs.len() >= 3, "{segs:?}");
        let targets: Vec<&String> = match case {
            "every segment" => segs.iter().collect(),
            _ => vec![segs.last().unwrap()],
        };
        for n in &targets {
            restamp(&dir.path().join(n), 3);
        }
        if case != "every segment" {
            // A tail the newer build was writing when it stopped.
            let p = dir.path().join(segs.last().unwrap());
            let mut b = std::fs::read(&p).unwrap();
            b.extend_from_slice(&[0xAB; 100]);
            std::fs::write(&p, b).unwrap();
        }
        let before = files(dir.path());
        for read_only in [false, true] {
            let got = if read_only {
                SsdStore::open_read_only(c.clone(), Arc::new(SystemClock))
            } else {
                SsdStore::open(c.clone(), Arc::new(SystemClock))
            };
            let msg = match got {
                Err(e @ Error::Invalid { .. }) => e.to_string(),
                Err(e) => panic!("{case}: a newer format must be refused as such, got {e}"),
                Ok(_) => panic!("{case}: a newer format was opened (read_only {read_only})"),
            };
            assert!(msg.contains("version 3"), "{case}: {msg}");
            let after = files(dir.path());
            // The lock file is the writable opener's own; every other byte stays.
            let strip = |m: &BTreeMap<PathBuf, Vec<u8>>| -> BTreeMap<PathBuf, Vec<u8>> {
                m.iter()
                    .filter(|(p, _)| !p.ends_with("LOCK"))
                    .map(|(p, b)| (p.clone(), b.clone()))
                    .collect()
            };
            assert_eq!(strip(&after), strip(&before), "{case}: files changed");
        }
    }
}

// ---- the directory or a segment deleted under a running writer -----------------------------------

#[test]
fn deleting_the_directory_under_a_writer_stops_every_acknowledgement() {
    for how in ["rm -rf", "rm -rf then mkdir"] {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("tier");
        let c = cfg(&root, 8 << 10);
        let s = open(&c);
        let before: Vec<_> = (0..10).map(|i| fixed(7, i, 1500)).collect();
        for (k, v) in &before {
            s.put(k, v).unwrap();
        }
        std::fs::remove_dir_all(&root).unwrap();
        if how.ends_with("mkdir") {
            std::fs::create_dir(&root).unwrap();
        }
        // A removal is refused as well, before any put noticed the deletion.
        let removed = s.remove(&before[0].0);
        let mut acked = 0;
        let mut first_error = None;
        for i in 10..50 {
            let r = fixed(7, i, 1500);
            match s.put(&r.0, &r.1) {
                Ok(_) => acked += 1,
                Err(e) => {
                    first_error.get_or_insert(e.to_string());
                }
            }
        }
        let served = audit(&s, &before).0;
        let msg = first_error.expect("puts after the deletion must fail");
        eprintln!(
            "{how} under a writer: 40 puts after it, {acked} acknowledged; {served} of 10 \
             earlier records still served from unlinked files; error: {msg}"
        );
        assert_eq!(acked, 0, "{how}");
        assert!(msg.contains(&root.display().to_string()), "{msg}");
        assert!(msg.contains("no more writes"), "{msg}");
        assert!(
            removed.is_err(),
            "{how}: a remove after the deletion is refused"
        );
        assert_eq!(served, 0, "{how}: records of deleted files are not served");
        drop(s);
        // A new store on the path starts over, and a writer is possible again.
        let s = open(&c);
        let r = fixed(7, 100, 10);
        s.put(&r.0, &r.1).unwrap();
        assert_eq!(audit(&s, &[r]), (1, 0, 0));
    }
}

#[test]
fn a_segment_deleted_under_a_writer_is_not_served_and_the_writer_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(dir.path(), 8 << 10);
    let s = open(&c);
    let recs: Vec<_> = (0..40).map(|i| fixed(8, i, 1500)).collect();
    for (k, v) in &recs {
        s.put(k, v).unwrap();
    }
    // An operator deletes the oldest (closed) segment.
    let gone = dir.path().join("seg-00000001.log");
    let in_it = {
        let b = std::fs::read(&gone).unwrap();
        recs.iter()
            .filter(|(k, _)| b.windows(32).any(|w| w == k.0))
            .count()
    };
    std::fs::remove_file(&gone).unwrap();
    let (ok, lost, wrong) = audit(&s, &recs);
    assert_eq!((ok, lost, wrong), (40 - in_it, in_it, 0));
    // The writer keeps acknowledging, and compaction of what is left keeps working.
    let more: Vec<_> = (40..80).map(|i| fixed(8, i, 1500)).collect();
    for (k, v) in &more {
        s.put(k, v).unwrap();
    }
    for (k, _) in &more[..30] {
        s.remove(k).unwrap();
    }
    assert_eq!(audit(&s, &more[30..]), (10, 0, 0));
    drop(s);
    let s = open(&c);
    assert_eq!(audit(&s, &more[30..]), (10, 0, 0));
    assert_eq!(audit(&s, &recs), (40 - in_it, in_it, 0));
}

// ---- a failing sync ----------------------------------------------------------------------------

#[test]
fn a_failed_sync_acknowledges_nothing_and_later_records_go_to_a_fresh_segment() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cfg(dir.path(), 1 << 20);
    c.fsync = FsyncPolicy::Always;
    let s = open(&c);
    let mut acked = Vec::new();
    let mut failed = Vec::new();
    for i in 0..30u64 {
        let r = fixed(9, i, 2000);
        if i % 10 == 5 {
            s.inject_sync_failure(0);
        }
        match s.put(&r.0, &r.1) {
            Ok(true) => acked.push(r),
            Ok(false) => unreachable!(),
            Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::EIO) => {
                assert!(!s.contains(&r.0), "an unsynced record is not indexed");
                assert_eq!(s.get(&r.0).unwrap(), None);
                failed.push(r);
            }
            Err(e) => panic!("put {i}: {e}"),
        }
    }
    assert_eq!((acked.len(), failed.len()), (27, 3));
    // Each failure closed its segment: the next records went to a fresh one.
    let segs = segment_names(dir.path());
    assert_eq!(segs.len(), 4, "{segs:?}");
    assert_eq!(audit(&s, &acked), (27, 0, 0));
    drop(s);
    let s = open(&c);
    let after = audit(&s, &acked);
    // What a failed put left is a whole record (the page cache kept it) or nothing, never wrong.
    let (_, _, wrong_failed) = audit(&s, &failed);
    eprintln!(
        "injected sync failures: 30 puts, 3 failed with EIO (not acknowledged), 27 acknowledged; \
         after reopen (served, lost, wrong) {after:?}; wrong bytes among the failed: {wrong_failed}"
    );
    assert_eq!(after, (27, 0, 0));
    assert_eq!(wrong_failed, 0);
}

#[test]
fn a_failed_sync_of_compaction_copies_keeps_every_record() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cfg(dir.path(), 16 << 10);
    c.fsync = FsyncPolicy::Always;
    let s = open(&c);
    // Segment 1 holds records 0..8 (8 × 2064 B crosses 16 KiB), segment 2 the rest.
    let recs: Vec<_> = (0..12).map(|i| fixed(10, i, 2000)).collect();
    for (k, v) in &recs {
        s.put(k, v).unwrap();
    }
    for (k, _) in &recs[..3] {
        s.remove(k).unwrap();
    }
    assert_eq!(s.stats().compactions, 0);
    // The fourth removal reaches 50 % dead: its mark's sync goes through, the copies' fails.
    s.inject_sync_failure(1);
    let err = s.remove(&recs[3].0).unwrap_err().to_string();
    assert!(err.contains("Input/output error"), "{err}");
    assert_eq!(s.stats().compactions, 0);
    let kept = &recs[4..];
    assert_eq!(audit(&s, kept), (8, 0, 0));
    // The next write compacts again, with syncs that work.
    let more = fixed(10, 50, 2000);
    s.put(&more.0, &more.1).unwrap();
    assert!(s.stats().compactions >= 1);
    let mut all = kept.to_vec();
    all.push(more);
    assert_eq!(audit(&s, &all), (9, 0, 0));
    drop(s);
    let s = open(&c);
    assert_eq!(audit(&s, &all), (9, 0, 0));
    assert!(
        !s.contains(&recs[3].0),
        "the acknowledged-dead mark was synced"
    );
}

// ---- a read-only view beside a writer --------------------------------------------------------------

#[test]
fn a_read_only_probe_sees_removals_and_deleted_segments_and_lets_their_files_go() {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(dir.path(), 8 << 10);
    let w = open(&c);
    let recs: Vec<_> = (0..24).map(|i| fixed(11, i, 1500)).collect();
    for (k, v) in &recs {
        w.put(k, v).unwrap();
    }
    let (view, _) = SsdStore::open_read_only(c.clone(), Arc::new(SystemClock)).unwrap();
    assert!(recs.iter().all(|(k, _)| view.probe(k).unwrap()));
    // Removed in place (state word), then a whole segment compacted away and deleted.
    w.remove(&recs[20].0).unwrap();
    for (k, _) in &recs[..5] {
        w.remove(k).unwrap();
    }
    assert!(w.stats().compactions >= 1);
    let disk_before = view.stats().disk_bytes;
    let stale: Vec<usize> = (0..24).filter(|&i| i < 5 || i == 20).collect();
    for &i in &stale {
        assert!(
            view.contains(&recs[i].0),
            "the index alone still answers yes"
        );
    }
    for &i in &stale {
        assert!(!view.probe(&recs[i].0).unwrap(), "record {i} is gone");
        assert!(!view.contains(&recs[i].0));
    }
    // The deleted segment was dropped whole: its file is no longer held.
    assert!(view.stats().disk_bytes < disk_before);
    // What the writer copied forward is a miss for the view (records after its open are not seen),
    // never a wrong byte; the rest is served.
    for (i, (k, v)) in recs.iter().enumerate() {
        match view.get(k).unwrap() {
            Some(got) => assert_eq!(&got, v, "record {i}"),
            None => assert!(!stale.contains(&i) || !view.contains(k)),
        }
    }
}

#[test]
fn a_read_only_refresh_follows_the_writer_reading_only_what_changed() {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(dir.path(), 8 << 10);
    let w = open(&c);
    let mut live: Vec<(PrefixKey, Vec<u8>)> = (0..20).map(|i| fixed(12, i, 1500)).collect();
    for (k, v) in &live {
        w.put(k, v).unwrap();
    }
    let (view, _) = SsdStore::open_read_only(c.clone(), Arc::new(SystemClock)).unwrap();
    // The writer appends to its active segment, rolls to new ones, and compacts old ones away.
    let more: Vec<_> = (20..60).map(|i| fixed(12, i, 1500)).collect();
    for (k, v) in &more {
        w.put(k, v).unwrap();
    }
    live.extend(more);
    let removed: Vec<_> = live.drain(..12).collect();
    for (k, _) in &removed {
        w.remove(k).unwrap();
    }
    assert!(w.stats().compactions > 0);
    let r = view.refresh().unwrap();
    assert!(r.segments_dropped > 0 && r.segments_added > 0, "{r:?}");
    assert_eq!(r.records, live.len(), "{r:?}");
    assert_eq!(audit(&view, &live), (live.len(), 0, 0));
    for (k, _) in &removed {
        assert_eq!(view.get(k).unwrap(), None);
    }
    // A refresh with nothing changed changes nothing; a writable store refuses it.
    assert_eq!(view.refresh().unwrap().records, live.len());
    assert!(matches!(w.refresh(), Err(Error::Invalid { .. })));
}
