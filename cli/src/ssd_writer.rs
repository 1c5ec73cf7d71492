//! Hidden `csa2 ssd-writer`: the child process of the SSD crash and locking tests. It appends
//! records to an SSD tier forever and prints `ack <i>` after each acknowledged write, until it is
//! killed. With `--churn` it also removes every odd record right after writing it (printing
//! `del <i>` once the removal returned), so segments fill with dead bytes and compaction (copy
//! forward, sync, delete) runs all the time; it prints `compactions <n>` when that count moves.

use csa2::store::ssd::{crash_test_record, synthetic_payload};
use csa2::store::{FsyncPolicy, SsdConfig, SsdStore, SystemClock};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    /// SSD tier directory.
    #[arg(long)]
    dir: PathBuf,
    /// Stream seed (keys are SHA-256(seed, i)).
    #[arg(long)]
    seed: u64,
    /// Largest payload, bytes.
    #[arg(long, default_value_t = 65536)]
    max_len: usize,
    /// Sync every write.
    #[arg(long)]
    fsync: bool,
    /// Stop after this many records (default: run until killed).
    #[arg(long)]
    count: Option<u64>,
    /// Remove every odd record after writing it (compaction under kill -9).
    #[arg(long)]
    churn: bool,
    /// Segment size, bytes.
    #[arg(long, default_value_t = 1 << 20)]
    segment_bytes: u64,
}

pub fn run(a: Args) -> csa2::Result<()> {
    let mut cfg = SsdConfig::new(&a.dir, 1 << 40);
    cfg.fsync = if a.fsync {
        FsyncPolicy::Always
    } else {
        FsyncPolicy::Never
    };
    cfg.io_chunk_bytes = 4096; // many pwrite calls per record: kills land inside records
    cfg.segment_bytes = a.segment_bytes;
    let (store, _) = SsdStore::open(cfg, Arc::new(SystemClock))?;
    let stdout = std::io::stdout();
    let say = |line: String| {
        let mut out = stdout.lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    let mut buf = Vec::new();
    let mut i = 0u64;
    let mut compactions = 0;
    while a.count.is_none_or(|c| i < c) {
        let (key, len) = crash_test_record(a.seed, i, a.max_len);
        synthetic_payload(&key, len, &mut buf);
        store.put(&key, &buf)?;
        say(format!("ack {i}"));
        if a.churn && i % 2 == 1 {
            store.remove(&key)?;
            say(format!("del {i}"));
        }
        let c = store.stats().compactions;
        if c != compactions {
            compactions = c;
            say(format!("compactions {c}"));
        }
        i += 1;
    }
    Ok(())
}
