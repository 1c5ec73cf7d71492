//! kill -9 of an SSD-tier writer process at random points, then restart: zero corrupted reads,
//! and every acknowledged entry is served. Cycles: `CSA2_KILL_CYCLES` (default 200). A second
//! test kills a writer that keeps compaction busy.

use csa2::store::ssd::{crash_test_record, synthetic_payload};
use csa2::store::{SsdConfig, SsdStore, SystemClock};
use rand::{Rng, SeedableRng};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_LEN: usize = 16 * 1024;

#[test]
fn kill_dash_nine_at_random_points() {
    let cycles: u64 = std::env::var("CSA2_KILL_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xC5A2);
    let mut acked: Vec<(u64, u64)> = Vec::new(); // (seed, i)
    let (mut torn_total, mut indexed_unacked) = (0u64, 0usize);
    let started = Instant::now();
    for cycle in 0..cycles {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_csa2"));
        cmd.args(["ssd-writer", "--dir"]).arg(dir.path()).args([
            "--seed",
            &cycle.to_string(),
            "--max-len",
            &MAX_LEN.to_string(),
        ]);
        if cycle % 2 == 0 {
            cmd.arg("--fsync");
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        // Collect acknowledgements on a thread; kill after a random delay.
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(|l| l.ok())
                .filter_map(|l| l.strip_prefix("ack ").and_then(|n| n.parse::<u64>().ok()))
                .collect::<Vec<u64>>()
        });
        std::thread::sleep(Duration::from_micros(rng.random_range(2_000..40_000)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let acks = reader.join().unwrap();
        acked.extend(acks.iter().map(|&i| (cycle, i)));

        // Restart: every acknowledged record is served intact; nothing corrupt is ever returned.
        // Payload checksums on open every 25th cycle (reads are always checked).
        let mut cfg = SsdConfig::new(dir.path(), 1 << 40);
        cfg.verify_on_open = cycle % 25 == 24;
        let (store, rep) = SsdStore::open(cfg, Arc::new(SystemClock)).unwrap();
        torn_total += rep.torn_bytes_truncated;
        assert_eq!(rep.corrupt_records, 0, "cycle {cycle}: {:?}", rep.notes);
        // This cycle's acknowledgements, plus a sample of older ones.
        let mut check: Vec<(u64, u64)> = acks.iter().map(|&i| (cycle, i)).collect();
        for _ in 0..64.min(acked.len()) {
            check.push(acked[rng.random_range(0..acked.len())]);
        }
        verify(&store, &check, cycle);
        // Records after the last acknowledgement (written, killed before the ack): whole or absent.
        let mut buf = Vec::new();
        for i in acks.len() as u64..acks.len() as u64 + 3 {
            let (k, _) = crash_test_record(cycle, i, MAX_LEN);
            if let Some(v) = store.get(&k).unwrap() {
                synthetic_payload(&k, v.len(), &mut buf);
                assert!(
                    v == buf,
                    "cycle {cycle}: unacknowledged record has wrong bytes"
                );
                indexed_unacked += 1;
            }
        }
        assert_eq!(store.stats().corrupt, 0);
    }
    // Final restart with every payload checksum verified: all acknowledged records served.
    let (store, rep) =
        SsdStore::open(SsdConfig::new(dir.path(), 1 << 40), Arc::new(SystemClock)).unwrap();
    assert_eq!(rep.corrupt_records, 0, "{:?}", rep.notes);
    verify(&store, &acked, cycles);
    assert_eq!(store.stats().corrupt, 0);
    eprintln!(
        "{cycles} kill -9 cycles in {:.1} s: {} acknowledged records all served, {indexed_unacked} \
         complete-but-unacknowledged records served, {torn_total} torn bytes truncated",
        started.elapsed().as_secs_f64(),
        acked.len()
    );
    assert!(acked.len() as u64 > cycles / 2, "the writer made progress");
}

fn verify(store: &SsdStore, recs: &[(u64, u64)], cycle: u64) {
    let mut buf = Vec::new();
    for &(seed, i) in recs {
        let (k, len) = crash_test_record(seed, i, MAX_LEN);
        synthetic_payload(&k, len, &mut buf);
        match store.get(&k) {
            Ok(Some(v)) => assert!(v == buf, "cycle {cycle}: record ({seed}, {i}) differs"),
            other => panic!("cycle {cycle}: acknowledged ({seed}, {i}) not served: {other:?}"),
        }
    }
}

/// kill -9 of a writer that removes every odd record, so that compaction (copy forward, sync,
/// delete the old segment) runs constantly and many kills land inside it. After each restart:
/// every acknowledged record not removed is served intact, every acknowledged removal stays
/// removed, nothing corrupt. Cycles: `CSA2_COMPACT_KILL_CYCLES` (default 60).
#[test]
fn kill_dash_nine_during_compaction_loses_nothing() {
    let cycles: u64 = std::env::var("CSA2_COMPACT_KILL_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xC0A1);
    // (seed, i) → Some(removed), or None when killed between the write's ack and its removal.
    let mut acked: Vec<((u64, u64), Option<bool>)> = Vec::new();
    let (mut compactions, mut superseded, mut torn) = (0u64, 0usize, 0u64);
    let started = Instant::now();
    for cycle in 0..cycles {
        let seed = 1_000_000 + cycle;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_csa2"));
        cmd.args(["ssd-writer", "--dir"]).arg(dir.path()).args([
            "--seed",
            &seed.to_string(),
            "--max-len",
            &MAX_LEN.to_string(),
            "--churn",
            "--segment-bytes",
            "65536",
        ]);
        if cycle % 2 == 0 {
            cmd.arg("--fsync");
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut acks, mut dels, mut comp) = (Vec::new(), Vec::new(), 0u64);
            for l in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                let mut w = l.split(' ');
                let (Some(tag), Some(n)) = (w.next(), w.next().and_then(|n| n.parse().ok())) else {
                    continue;
                };
                match tag {
                    "ack" => acks.push(n),
                    "del" => dels.push(n),
                    "compactions" => comp = n,
                    _ => {}
                }
            }
            (acks, dels, comp)
        });
        std::thread::sleep(Duration::from_micros(rng.random_range(5_000..60_000)));
        child.kill().unwrap();
        child.wait().unwrap();
        let (acks, dels, comp) = reader.join().unwrap();
        compactions += comp;
        let dels: std::collections::HashSet<u64> = dels.into_iter().collect();
        let last = acks.last().copied();
        for &i in &acks {
            let removed = dels.contains(&i);
            let unsure = Some(i) == last && i % 2 == 1 && !removed;
            acked.push(((seed, i), (!unsure).then_some(removed)));
        }
        let cfg = SsdConfig::new(dir.path(), 1 << 40);
        let (store, rep) = SsdStore::open(cfg, Arc::new(SystemClock)).unwrap();
        assert_eq!(rep.corrupt_records, 0, "cycle {cycle}: {:?}", rep.notes);
        superseded += rep.superseded_records;
        torn += rep.torn_bytes_truncated;
        let mut buf = Vec::new();
        for &((s, i), removed) in &acked {
            let (k, len) = crash_test_record(s, i, MAX_LEN);
            let got = store.get(&k).unwrap();
            let Some(removed) = removed else { continue };
            if removed {
                assert!(got.is_none(), "cycle {cycle}: removed ({s}, {i}) came back");
            } else {
                synthetic_payload(&k, len, &mut buf);
                assert!(
                    got.as_deref() == Some(&buf[..]),
                    "cycle {cycle}: acknowledged ({s}, {i}) not served intact"
                );
            }
        }
        assert_eq!(store.stats().corrupt, 0);
    }
    let kept = acked.iter().filter(|a| a.1 == Some(false)).count();
    let removed = acked.iter().filter(|a| a.1 == Some(true)).count();
    eprintln!(
        "{cycles} kill -9 cycles with compaction in {:.1} s: {} acknowledged records ({kept} kept, \
         all served; {} removed, none back), {compactions} compactions acknowledged, \
         {superseded} superseded copies found on restart (kills inside a compaction), {torn} torn \
         bytes truncated",
        started.elapsed().as_secs_f64(),
        acked.len(),
        removed
    );
    assert!(compactions > 0, "the writer compacted");
}
