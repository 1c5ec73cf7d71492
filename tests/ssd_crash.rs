//! kill -9 of an SSD-tier writer process at random points, then restart: zero corrupted reads,
//! and every acknowledged entry is served. Cycles: `CSA2_KILL_CYCLES` (default 200).

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
