//! Hidden `csa2 ssd-writer`: the child process of the SSD crash test. It appends records to an
//! SSD tier forever and prints `ack <i>` after each acknowledged write, until it is killed.

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
}

pub fn run(a: Args) -> csa2::Result<()> {
    let mut cfg = SsdConfig::new(&a.dir, 1 << 40);
    cfg.fsync = if a.fsync {
        FsyncPolicy::Always
    } else {
        FsyncPolicy::Never
    };
    cfg.io_chunk_bytes = 4096; // many pwrite calls per record: kills land inside records
    cfg.segment_bytes = 1 << 20;
    let (store, _) = SsdStore::open(cfg, Arc::new(SystemClock))?;
    let stdout = std::io::stdout();
    let mut buf = Vec::new();
    let mut i = 0u64;
    while a.count.is_none_or(|c| i < c) {
        let (key, len) = crash_test_record(a.seed, i, a.max_len);
        synthetic_payload(&key, len, &mut buf);
        store.put(&key, &buf)?;
        let mut out = stdout.lock();
        let _ = writeln!(out, "ack {i}");
        let _ = out.flush();
        i += 1;
    }
    Ok(())
}
