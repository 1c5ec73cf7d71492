//! The host-DRAM pool for encoder SWA snapshots (docs/SPEC.md §0: 10% of the machine's DRAM, a TTL of
//! minutes, fast reclamation; decoder SWA state is never persisted).
//!
//! A snapshot is keyed by the prefix boundary it belongs to. It expires `ttl_ms` after it was
//! stored: an expired snapshot is **never served**, even before it is reclaimed (a read past the
//! deadline removes it and reports a miss). When a new snapshot does not fit, the least recently
//! used ones are evicted; expired ones are reclaimed first.
//!
//! Thread safety: `DramPool` is `Send + Sync`; one mutex guards the map (no I/O under it).

use super::clock::Clock;
use crate::cache::PrefixKey;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

/// Default TTL: 5 minutes.
pub const DEFAULT_TTL_MS: u64 = 5 * 60 * 1000;

/// A stored snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Snapshot {
    /// The bytes (SWA records of the snapshotted layers).
    Bytes(Arc<[u8]>),
    /// Size only, for trace simulation (no memory held).
    Sized(usize),
}

impl Snapshot {
    /// Bytes the snapshot occupies.
    pub fn len(&self) -> usize {
        match self {
            Snapshot::Bytes(b) => b.len(),
            Snapshot::Sized(n) => *n,
        }
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Pool configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DramConfig {
    /// Most bytes held.
    pub capacity_bytes: u64,
    /// Time to live of a snapshot, ms.
    pub ttl_ms: u64,
}

/// Total host memory from `/proc/meminfo` (`MemTotal`), in bytes.
///
/// Errors: [`Error::Unsupported`] when the file is absent or has no `MemTotal` line.
pub fn host_memory_bytes() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| Error::Unsupported(format!("cannot read /proc/meminfo: {e}")))?;
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix("MemTotal:")?;
            let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            Some(kib * 1024)
        })
        .ok_or_else(|| Error::Unsupported("no MemTotal line in /proc/meminfo".into()))
}

impl DramConfig {
    /// The docs/SPEC.md §0.5 defaults: 10% of host memory, 5-minute TTL.
    pub fn host_default() -> Result<DramConfig> {
        Ok(DramConfig {
            capacity_bytes: host_memory_bytes()? / 10,
            ttl_ms: DEFAULT_TTL_MS,
        })
    }
}

/// Counters and sizes of the pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DramStats {
    /// Snapshots stored.
    pub puts: u64,
    /// Reads that returned a snapshot.
    pub hits: u64,
    /// Reads that found nothing (absent or expired).
    pub misses: u64,
    /// Reads that found an expired snapshot (refused, removed; included in `misses`).
    pub expired_on_read: u64,
    /// Expired snapshots reclaimed by a sweep.
    pub expired_reclaimed: u64,
    /// Live snapshots evicted for room (LRU).
    pub evictions: u64,
    /// Snapshots larger than the whole pool.
    pub refused: u64,
    /// Snapshots held.
    pub entries: u64,
    /// Bytes held.
    pub bytes: u64,
}

struct Item {
    snap: Snapshot,
    expires: u64,
    tick: u64,
}

struct Inner {
    map: HashMap<PrefixKey, Item>,
    lru: BTreeMap<u64, PrefixKey>,
    by_expiry: BTreeSet<(u64, PrefixKey)>,
    bytes: u64,
    tick: u64,
    stats: DramStats,
}

/// The DRAM snapshot pool.
pub struct DramPool {
    cfg: DramConfig,
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for DramPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DramPool").field("cfg", &self.cfg).finish()
    }
}

impl Inner {
    fn remove(&mut self, key: &PrefixKey) -> Option<Item> {
        let it = self.map.remove(key)?;
        self.lru.remove(&it.tick);
        self.by_expiry.remove(&(it.expires, *key));
        self.bytes -= it.snap.len() as u64;
        Some(it)
    }
    fn sweep(&mut self, now: u64) {
        while let Some(&(exp, k)) = self.by_expiry.first() {
            if exp > now {
                break;
            }
            self.remove(&k);
            self.stats.expired_reclaimed += 1;
        }
    }
}

impl DramPool {
    /// A pool with `cfg`, reading time from `clock` (its monotonic reading: a wall-clock jump
    /// neither expires nor prolongs a snapshot).
    ///
    /// Errors: [`Error::Invalid`] when the capacity or the TTL is zero.
    pub fn new(cfg: DramConfig, clock: Arc<dyn Clock>) -> Result<DramPool> {
        if cfg.capacity_bytes == 0 || cfg.ttl_ms == 0 {
            return Err(Error::invalid(
                "dram config",
                format!(
                    "capacity_bytes and ttl_ms must be > 0, found {} and {}",
                    cfg.capacity_bytes, cfg.ttl_ms
                ),
            ));
        }
        Ok(DramPool {
            cfg,
            clock,
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                lru: BTreeMap::new(),
                by_expiry: BTreeSet::new(),
                bytes: 0,
                tick: 0,
                stats: DramStats::default(),
            }),
        })
    }

    /// Stores `snap` under `key` (replacing an older one), expiring `ttl_ms` from now. Expired
    /// snapshots are reclaimed first, then least recently used ones until it fits.
    ///
    /// Errors: [`Error::Refused`] when the snapshot is larger than the whole pool.
    pub fn put(&self, key: PrefixKey, snap: Snapshot) -> Result<()> {
        let now = self.clock.monotonic_ms();
        let len = snap.len() as u64;
        let mut inner = self.inner.lock();
        if len > self.cfg.capacity_bytes {
            inner.stats.refused += 1;
            return Err(Error::Refused(format!(
                "snapshot of {len} bytes is larger than the DRAM pool ({} bytes)",
                self.cfg.capacity_bytes
            )));
        }
        inner.remove(&key);
        inner.sweep(now);
        while inner.bytes + len > self.cfg.capacity_bytes {
            let k = *inner
                .lru
                .values()
                .next()
                .expect("bytes > 0 implies an entry");
            inner.remove(&k);
            inner.stats.evictions += 1;
        }
        inner.tick += 1;
        let tick = inner.tick;
        let expires = now.saturating_add(self.cfg.ttl_ms);
        inner.lru.insert(tick, key);
        inner.by_expiry.insert((expires, key));
        inner.bytes += len;
        inner.map.insert(
            key,
            Item {
                snap,
                expires,
                tick,
            },
        );
        inner.stats.puts += 1;
        Ok(())
    }

    /// The snapshot under `key` if present and not expired. An expired one is removed and never
    /// returned.
    pub fn get(&self, key: &PrefixKey) -> Option<Snapshot> {
        let now = self.clock.monotonic_ms();
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let expired = match inner.map.get(key) {
            None => {
                inner.stats.misses += 1;
                return None;
            }
            Some(it) => it.expires <= now,
        };
        if expired {
            inner.remove(key);
            inner.stats.expired_on_read += 1;
            inner.stats.misses += 1;
            return None;
        }
        inner.tick += 1;
        let tick = inner.tick;
        let it = inner.map.get_mut(key).expect("present");
        let old = std::mem::replace(&mut it.tick, tick);
        let snap = it.snap.clone();
        inner.lru.remove(&old);
        inner.lru.insert(tick, *key);
        inner.stats.hits += 1;
        Some(snap)
    }

    /// Whether `key` holds a snapshot that has not expired. Changes nothing (no recency, no
    /// counter): for a planner that decides before it reads.
    pub fn contains(&self, key: &PrefixKey) -> bool {
        let now = self.clock.monotonic_ms();
        self.inner
            .lock()
            .map
            .get(key)
            .is_some_and(|it| it.expires > now)
    }

    /// Reclaims every expired snapshot now.
    pub fn sweep(&self) {
        let now = self.clock.monotonic_ms();
        self.inner.lock().sweep(now);
    }

    /// Counters and sizes now.
    pub fn stats(&self) -> DramStats {
        let inner = self.inner.lock();
        DramStats {
            entries: inner.map.len() as u64,
            bytes: inner.bytes,
            ..inner.stats
        }
    }

    /// The configuration.
    pub fn config(&self) -> &DramConfig {
        &self.cfg
    }
}
