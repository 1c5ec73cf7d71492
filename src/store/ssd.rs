//! The SSD tier for global KV: append-only segment files keyed by the chained prefix key.
//!
//! # On-disk format
//! A directory of segment files `seg-NNNNNNNN.log`, each a sequence of records:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `CSA2` |
//! | 4 | format version (1) |
//! | 5 | state: `0xA5` live, `0x00` evicted (the only byte ever rewritten; not covered by the CRC) |
//! | 6..8 | zero |
//! | 8..40 | key (32 B) |
//! | 40..48 | creation time, ms (u64 LE, from the injected [`Clock`]) |
//! | 48..52 | payload length (u32 LE) |
//! | 52..56 | CRC32C of the payload |
//! | 56..60 | zero |
//! | 60..64 | CRC32C of bytes 0..5 and 6..60 |
//! | 64.. | payload |
//!
//! # Guarantees
//! - **Checksums**: every read verifies the header CRC, the key and the payload CRC; a corrupt or
//!   torn record is reported ([`Error::Corrupt`], counted) and dropped from the index, never returned.
//! - **Recovery**: [`SsdStore::open`] rebuilds the index by scanning every segment in order (newest
//!   record of a key wins) and verifies payload checksums; a torn tail (a record cut by a crash) is
//!   truncated away. A restarted process serves every entry whose write was acknowledged. A new
//!   process always appends to a fresh segment.
//! - **Readers never see a record being written**: a record enters the index only after its bytes
//!   are written (and synced, per policy).
//! - **Minimum lifetime**: an entry younger than `min_lifetime_ms` (default 72 h) is never evicted.
//!   When the tier is full and nothing is old enough, a new write is refused
//!   ([`Error::Refused`]) and counted — admission control, not early eviction. Among entries past
//!   their lifetime, the least recently used goes first; eviction marks the record's state byte
//!   (so a restart does not bring it back) and deletes a segment once all its records are evicted.
//! - **fsync policy** ([`FsyncPolicy`]): with `Always` (the default) a write is acknowledged only
//!   after `fdatasync` of the segment (and of the directory when a segment is created), so an
//!   acknowledged entry survives power loss. With `Never` an acknowledged entry survives a process
//!   crash (the data is in the kernel page cache) but not a power loss; a torn record left by power
//!   loss is still detected by its checksum. Eviction marks are not synced: losing one only brings
//!   back an entry that was valid and past its lifetime.
//! - **Capacity** counts the bytes of the segment files on disk (live and evicted records), so the
//!   directory never grows past `capacity_bytes`.
//!
//! One process owns a directory at a time (not enforced). Thread safety: `SsdStore` is `Send +
//! Sync`; metadata sits behind one mutex held for bookkeeping only, writers are serialized by a
//! second mutex while they do I/O, and readers do their `pread` without holding either.

use super::clock::Clock;
use crate::cache::PrefixKey;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MAGIC: &[u8; 4] = b"CSA2";
const VERSION: u8 = 1;
const LIVE: u8 = 0xA5;
const DEAD: u8 = 0x00;
/// Header bytes before the payload.
pub const HEADER_BYTES: usize = 64;

/// When writes reach stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FsyncPolicy {
    /// `fdatasync` before every acknowledgement (survives power loss).
    Always,
    /// No sync (survives process crashes; a power loss may drop recent acknowledged entries).
    Never,
}

/// SSD-tier configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SsdConfig {
    /// Directory of the segment files (created if absent).
    pub dir: PathBuf,
    /// Most bytes the segment files may occupy.
    pub capacity_bytes: u64,
    /// Minimum lifetime of an entry, ms (default 72 h, docs/SPEC.md §0).
    pub min_lifetime_ms: u64,
    /// A segment is closed once it reaches this size (default 16 MiB).
    pub segment_bytes: u64,
    /// Sync policy (default [`FsyncPolicy::Always`]).
    pub fsync: FsyncPolicy,
    /// Records are written in `pwrite` calls of at most this many bytes (default 1 MiB).
    pub io_chunk_bytes: usize,
    /// Verify every payload checksum when opening (default true; headers are always verified).
    pub verify_on_open: bool,
}

impl SsdConfig {
    /// Defaults: 72 h minimum lifetime, 16 MiB segments, `fsync` always, verification on open.
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> SsdConfig {
        SsdConfig {
            dir: dir.into(),
            capacity_bytes,
            min_lifetime_ms: 72 * super::clock::HOUR_MS,
            segment_bytes: 16 << 20,
            fsync: FsyncPolicy::Always,
            io_chunk_bytes: 1 << 20,
            verify_on_open: true,
        }
    }
}

/// What [`SsdStore::open`] found.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RecoveryReport {
    /// Segment files scanned.
    pub segments: usize,
    /// Live records indexed.
    pub records: usize,
    /// Records marked evicted, or superseded by a newer record of the same key.
    pub dead_records: usize,
    /// Bytes cut off the end of segments (torn tail records).
    pub torn_bytes_truncated: u64,
    /// Records whose header or payload failed its checksum (not indexed).
    pub corrupt_records: usize,
    /// Human-readable findings (path, offset, what failed).
    pub notes: Vec<String>,
}

/// Counters of the tier (monotonic) and its current size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SsdStats {
    /// Records written.
    pub puts: u64,
    /// Payload + header bytes written.
    pub put_bytes: u64,
    /// Puts of a key already present (nothing written).
    pub already_present: u64,
    /// Writes refused by admission control.
    pub refused: u64,
    /// Bytes of refused writes.
    pub refused_bytes: u64,
    /// Entries evicted (past their minimum lifetime).
    pub evicted: u64,
    /// Reads that returned data.
    pub hits: u64,
    /// Reads of absent keys.
    pub misses: u64,
    /// Reads that found a corrupt or torn record (reported, not returned).
    pub corrupt: u64,
    /// Live entries.
    pub entries: u64,
    /// Bytes of live records (headers included).
    pub live_bytes: u64,
    /// Bytes of the segment files.
    pub disk_bytes: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    seg: u32,
    offset: u64,
    len: u32,
    created: u64,
    tick: u64,
}

struct Segment {
    file: Arc<File>,
    path: PathBuf,
    size: u64,
    live: u32,
}

struct Inner {
    index: HashMap<PrefixKey, Entry>,
    lru: BTreeMap<u64, PrefixKey>,
    by_created: BTreeSet<(u64, PrefixKey)>,
    segments: BTreeMap<u32, Segment>,
    active: u32,
    disk_bytes: u64,
    live_bytes: u64,
    tick: u64,
    stats: SsdStats,
}

/// The SSD tier. See the module docs for the format and the guarantees.
pub struct SsdStore {
    cfg: SsdConfig,
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
    writer: Mutex<()>,
}

impl std::fmt::Debug for SsdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdStore").field("cfg", &self.cfg).finish()
    }
}

fn seg_name(id: u32) -> String {
    format!("seg-{id:08}.log")
}

fn header_crc(h: &[u8]) -> u32 {
    let c = crc32c::crc32c(&h[..5]);
    crc32c::crc32c_append(c, &h[6..60])
}

fn encode_header(key: &PrefixKey, created: u64, payload: &[u8]) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(MAGIC);
    h[4] = VERSION;
    h[5] = LIVE;
    h[8..40].copy_from_slice(&key.0);
    h[40..48].copy_from_slice(&created.to_le_bytes());
    h[48..52].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    h[52..56].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    let c = header_crc(&h);
    h[60..64].copy_from_slice(&c.to_le_bytes());
    h
}

struct Header {
    live: bool,
    key: PrefixKey,
    created: u64,
    len: u32,
    payload_crc: u32,
}

fn decode_header(h: &[u8]) -> std::result::Result<Header, String> {
    if &h[..4] != MAGIC {
        return Err(format!("bad magic {:02x?}", &h[..4]));
    }
    if h[4] != VERSION {
        return Err(format!("unknown version {}", h[4]));
    }
    let want = u32::from_le_bytes(h[60..64].try_into().expect("4 bytes"));
    let got = header_crc(h);
    if want != got {
        return Err(format!("header CRC32C {got:08x} != stored {want:08x}"));
    }
    let live = match h[5] {
        LIVE => true,
        DEAD => false,
        s => return Err(format!("unknown state byte {s:#04x}")),
    };
    Ok(Header {
        live,
        key: PrefixKey(h[8..40].try_into().expect("32 bytes")),
        created: u64::from_le_bytes(h[40..48].try_into().expect("8 bytes")),
        len: u32::from_le_bytes(h[48..52].try_into().expect("4 bytes")),
        payload_crc: u32::from_le_bytes(h[52..56].try_into().expect("4 bytes")),
    })
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

impl SsdStore {
    /// Opens (or creates) the tier in `cfg.dir`, rebuilding the index from the segments.
    ///
    /// Errors: [`Error::Invalid`] for a zero capacity or segment size; [`Error::Io`] when the
    /// directory or a segment cannot be read. Corrupt records are not errors: they are reported in
    /// the [`RecoveryReport`] and left out of the index.
    pub fn open(cfg: SsdConfig, clock: Arc<dyn Clock>) -> Result<(SsdStore, RecoveryReport)> {
        if cfg.capacity_bytes == 0 || cfg.segment_bytes == 0 || cfg.io_chunk_bytes == 0 {
            return Err(Error::invalid(
                "ssd config",
                format!(
                    "capacity_bytes, segment_bytes and io_chunk_bytes must be > 0, found {}, {}, {}",
                    cfg.capacity_bytes, cfg.segment_bytes, cfg.io_chunk_bytes
                ),
            ));
        }
        std::fs::create_dir_all(&cfg.dir).map_err(|e| Error::io(&cfg.dir, e))?;
        let mut ids: Vec<u32> = std::fs::read_dir(&cfg.dir)
            .map_err(|e| Error::io(&cfg.dir, e))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let n = e.file_name().into_string().ok()?;
                n.strip_prefix("seg-")?.strip_suffix(".log")?.parse().ok()
            })
            .collect();
        ids.sort_unstable();
        let mut rep = RecoveryReport::default();
        let mut inner = Inner {
            index: HashMap::new(),
            lru: BTreeMap::new(),
            by_created: BTreeSet::new(),
            segments: BTreeMap::new(),
            active: 0,
            disk_bytes: 0,
            live_bytes: 0,
            tick: 0,
            stats: SsdStats::default(),
        };
        for &id in &ids {
            Self::scan_segment(&cfg, id, &mut inner, &mut rep)?;
        }
        rep.segments = ids.len();
        rep.records = inner.index.len();
        // Always append to a fresh segment: never write after bytes a previous process left.
        let active = ids.last().map_or(1, |&l| l + 1);
        Self::create_segment(&cfg, active, &mut inner)?;
        // Delete segments whose records are all dead.
        let empty: Vec<u32> = inner
            .segments
            .iter()
            .filter(|(&id, s)| s.live == 0 && id != active)
            .map(|(&id, _)| id)
            .collect();
        for id in empty {
            Self::delete_segment(&mut inner, id)?;
        }
        inner.stats.entries = inner.index.len() as u64;
        let store = SsdStore {
            cfg,
            clock,
            inner: Mutex::new(inner),
            writer: Mutex::new(()),
        };
        Ok((store, rep))
    }

    fn scan_segment(
        cfg: &SsdConfig,
        id: u32,
        inner: &mut Inner,
        rep: &mut RecoveryReport,
    ) -> Result<()> {
        let path = cfg.dir.join(seg_name(id));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        let mut size = file.metadata().map_err(|e| Error::io(&path, e))?.len();
        let mut off = 0u64;
        let mut h = [0u8; HEADER_BYTES];
        let mut live = 0u32;
        let mut payload = Vec::new();
        while off < size {
            let bad = |why: String| format!("{} @ {off}: {why}", path.display());
            if size - off < HEADER_BYTES as u64 {
                rep.notes
                    .push(bad(format!("torn header ({} bytes)", size - off)));
                break;
            }
            file.read_exact_at(&mut h, off)
                .map_err(|e| Error::io(&path, e))?;
            let hd = match decode_header(&h) {
                Ok(hd) => hd,
                Err(why) => {
                    // Lengths past a bad header cannot be trusted: the rest of the segment is lost.
                    rep.notes.push(bad(why));
                    rep.corrupt_records += 1;
                    break;
                }
            };
            let end = off + HEADER_BYTES as u64 + hd.len as u64;
            if end > size {
                rep.notes.push(bad(format!(
                    "torn record: {} payload bytes of {} present",
                    size - off - HEADER_BYTES as u64,
                    hd.len
                )));
                break;
            }
            if cfg.verify_on_open && hd.live {
                payload.resize(hd.len as usize, 0);
                file.read_exact_at(&mut payload, off + HEADER_BYTES as u64)
                    .map_err(|e| Error::io(&path, e))?;
                let c = crc32c::crc32c(&payload);
                if c != hd.payload_crc {
                    rep.notes.push(bad(format!(
                        "payload CRC32C {c:08x} != stored {:08x}",
                        hd.payload_crc
                    )));
                    rep.corrupt_records += 1;
                    off = end;
                    continue;
                }
            }
            if hd.live {
                // Log order: a later record of the same key supersedes the earlier one.
                if let Some(old) = inner.index.remove(&hd.key) {
                    inner.lru.remove(&old.tick);
                    inner.by_created.remove(&(old.created, hd.key));
                    inner.live_bytes -= HEADER_BYTES as u64 + old.len as u64;
                    if old.seg == id {
                        live -= 1;
                    } else if let Some(s) = inner.segments.get_mut(&old.seg) {
                        s.live -= 1;
                    }
                    rep.dead_records += 1;
                }
                inner.tick += 1;
                inner.index.insert(
                    hd.key,
                    Entry {
                        seg: id,
                        offset: off,
                        len: hd.len,
                        created: hd.created,
                        tick: inner.tick,
                    },
                );
                inner.lru.insert(inner.tick, hd.key);
                inner.by_created.insert((hd.created, hd.key));
                inner.live_bytes += HEADER_BYTES as u64 + hd.len as u64;
                live += 1;
            } else {
                rep.dead_records += 1;
            }
            off = end;
        }
        if off < size {
            // A torn or unreadable tail: cut it so the directory holds only whole records.
            file.set_len(off).map_err(|e| Error::io(&path, e))?;
            rep.torn_bytes_truncated += size - off;
            size = off;
        }
        inner.disk_bytes += size;
        inner.segments.insert(
            id,
            Segment {
                file: Arc::new(file),
                path,
                size,
                live,
            },
        );
        Ok(())
    }

    fn create_segment(cfg: &SsdConfig, id: u32, inner: &mut Inner) -> Result<()> {
        let path = cfg.dir.join(seg_name(id));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        if cfg.fsync == FsyncPolicy::Always {
            sync_dir(&cfg.dir)?;
        }
        inner.segments.insert(
            id,
            Segment {
                file: Arc::new(file),
                path,
                size: 0,
                live: 0,
            },
        );
        inner.active = id;
        Ok(())
    }

    fn delete_segment(inner: &mut Inner, id: u32) -> Result<()> {
        if let Some(s) = inner.segments.remove(&id) {
            // Readers holding the file keep reading it; the name goes now.
            std::fs::remove_file(&s.path).map_err(|e| Error::io(&s.path, e))?;
            inner.disk_bytes -= s.size;
        }
        Ok(())
    }

    /// Closes the active segment and opens the next one; a closed segment with no live record goes.
    fn roll_segment(&self, inner: &mut Inner) -> Result<()> {
        let prev = inner.active;
        Self::create_segment(&self.cfg, prev + 1, inner)?;
        if inner.segments.get(&prev).is_some_and(|s| s.live == 0) {
            Self::delete_segment(inner, prev)?;
        }
        Ok(())
    }

    /// Removes `key` from the index and marks its record dead on disk.
    fn drop_entry(inner: &mut Inner, key: &PrefixKey, mark: bool) -> Result<()> {
        let Some(e) = inner.index.remove(key) else {
            return Ok(());
        };
        inner.lru.remove(&e.tick);
        inner.by_created.remove(&(e.created, *key));
        inner.live_bytes -= HEADER_BYTES as u64 + e.len as u64;
        inner.stats.entries = inner.index.len() as u64;
        let active = inner.active;
        let Some(seg) = inner.segments.get_mut(&e.seg) else {
            return Ok(());
        };
        seg.live -= 1;
        if mark {
            seg.file
                .write_all_at(&[DEAD], e.offset + 5)
                .map_err(|err| Error::io(&seg.path, err))?;
        }
        if seg.live == 0 && e.seg != active {
            Self::delete_segment(inner, e.seg)?;
        }
        Ok(())
    }

    /// Evicts LRU entries past their minimum lifetime until `need` more bytes fit. Returns whether
    /// they fit.
    fn make_room(&self, inner: &mut Inner, need: u64) -> Result<bool> {
        let now = self.clock.now_ms();
        let old_enough = |created: u64| created.saturating_add(self.cfg.min_lifetime_ms) <= now;
        while inner.disk_bytes + need > self.cfg.capacity_bytes {
            // Fast refusal: nothing is old enough when the oldest entry is not.
            match inner.by_created.first() {
                Some(&(c, _)) if old_enough(c) => {}
                _ => return Ok(false),
            }
            let victim = inner
                .lru
                .values()
                .find(|k| old_enough(inner.index[*k].created))
                .copied();
            let Some(k) = victim else { return Ok(false) };
            Self::drop_entry(inner, &k, true)?;
            inner.stats.evicted += 1;
        }
        Ok(true)
    }

    /// Stores `payload` under `key`. Returns `true` when written, `false` when the key was already
    /// present (keys name content, so nothing is rewritten; the entry's recency is refreshed).
    ///
    /// Errors: [`Error::Refused`] when the tier is full of entries younger than their minimum
    /// lifetime (counted in [`SsdStats::refused`]); [`Error::Invalid`] for a payload over 4 GiB or
    /// larger than a whole tier; [`Error::Io`].
    pub fn put(&self, key: &PrefixKey, payload: &[u8]) -> Result<bool> {
        self.put_with(key, payload.len(), |buf| buf.extend_from_slice(payload))
    }

    /// As [`SsdStore::put`] for a payload of `len` bytes that `fill` appends to an empty buffer,
    /// called only once the record is admitted (a refused or duplicate write costs no payload work).
    ///
    /// Errors: as [`SsdStore::put`]; [`Error::Shape`] when `fill` produces another length.
    pub fn put_with(
        &self,
        key: &PrefixKey,
        len: usize,
        fill: impl FnOnce(&mut Vec<u8>),
    ) -> Result<bool> {
        let rec = HEADER_BYTES as u64 + len as u64;
        if len > u32::MAX as usize || rec > self.cfg.capacity_bytes {
            return Err(Error::invalid(
                "payload",
                format!(
                    "{len} bytes cannot fit a tier of {} bytes (records are < 4 GiB)",
                    self.cfg.capacity_bytes
                ),
            ));
        }
        let _w = self.writer.lock();
        {
            let mut guard = self.inner.lock();
            let inner = &mut *guard;
            if let Some(e) = inner.index.get_mut(key) {
                inner.lru.remove(&e.tick);
                inner.tick += 1;
                e.tick = inner.tick;
                inner.lru.insert(inner.tick, *key);
                inner.stats.already_present += 1;
                return Ok(false);
            }
            if !self.make_room(inner, rec)? {
                inner.stats.refused += 1;
                inner.stats.refused_bytes += rec;
                return Err(Error::Refused(format!(
                    "SSD tier full: {} of {} bytes used, {} needed, no entry past its {} h minimum lifetime",
                    inner.disk_bytes,
                    self.cfg.capacity_bytes,
                    rec,
                    self.cfg.min_lifetime_ms as f64 / 3.6e6
                )));
            }
        }
        // Admitted. Only this writer adds bytes, so the room made above stays available while the
        // payload is produced outside the metadata lock.
        let mut owned = Vec::with_capacity(len);
        fill(&mut owned);
        if owned.len() != len {
            return Err(Error::shape("payload from fill", len, owned.len()));
        }
        let payload = &owned[..];
        let (file, path, offset, seg) = {
            let mut guard = self.inner.lock();
            let inner = &mut *guard;
            if inner.segments[&inner.active].size >= self.cfg.segment_bytes {
                self.roll_segment(inner)?;
            }
            let active = inner.active;
            let s = inner.segments.get_mut(&active).expect("active segment");
            let offset = s.size;
            // Reserve the bytes now so capacity holds even if the write fails half way.
            s.size += rec;
            inner.disk_bytes += rec;
            (s.file.clone(), s.path.clone(), offset, active)
        };
        let created = self.clock.now_ms();
        let header = encode_header(key, created, payload);
        let mut written = 0usize;
        let total = rec as usize;
        let chunk = self.cfg.io_chunk_bytes;
        // Header and payload go out in bounded pwrite calls; the index learns of the record only
        // after the last byte (and the sync), so no reader can see it half written.
        let mut res = Ok(());
        while written < total && res.is_ok() {
            let n = chunk.min(total - written);
            res = if written < HEADER_BYTES {
                let mut buf = Vec::with_capacity(n);
                let h_end = (written + n).min(HEADER_BYTES);
                buf.extend_from_slice(&header[written..h_end]);
                buf.extend_from_slice(&payload[..written + n - h_end]);
                file.write_all_at(&buf, offset + written as u64)
            } else {
                let p = written - HEADER_BYTES;
                file.write_all_at(&payload[p..p + n], offset + written as u64)
            };
            written += n;
        }
        if res.is_ok() && self.cfg.fsync == FsyncPolicy::Always {
            res = file.sync_data();
        }
        if let Err(e) = res {
            // A failed record leaves a gap no scan can cross: later records go to a new segment.
            let mut inner = self.inner.lock();
            if inner.active == seg {
                self.roll_segment(&mut inner)?;
            }
            return Err(Error::io(&path, e));
        }
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        inner.tick += 1;
        inner.index.insert(
            *key,
            Entry {
                seg,
                offset,
                len: payload.len() as u32,
                created,
                tick: inner.tick,
            },
        );
        inner.lru.insert(inner.tick, *key);
        inner.by_created.insert((created, *key));
        if let Some(s) = inner.segments.get_mut(&seg) {
            s.live += 1;
        }
        inner.live_bytes += rec;
        inner.stats.puts += 1;
        inner.stats.put_bytes += rec;
        inner.stats.entries = inner.index.len() as u64;
        Ok(true)
    }

    /// Whether `key` is indexed (no I/O, no recency change).
    pub fn contains(&self, key: &PrefixKey) -> bool {
        self.inner.lock().index.contains_key(key)
    }

    /// Reads the payload of `key`. `Ok(None)` when absent.
    ///
    /// Errors: [`Error::Corrupt`] when the record fails a check (bad header, another key, payload
    /// CRC mismatch, short read); the entry is then dropped, so the next read is a miss.
    /// [`Error::Io`] for other I/O failures.
    pub fn get(&self, key: &PrefixKey) -> Result<Option<Vec<u8>>> {
        let (file, path, e) = {
            let mut guard = self.inner.lock();
            let inner = &mut *guard;
            let Some(e) = inner.index.get_mut(key) else {
                inner.stats.misses += 1;
                return Ok(None);
            };
            inner.lru.remove(&e.tick);
            inner.tick += 1;
            e.tick = inner.tick;
            inner.lru.insert(inner.tick, *key);
            let e = e.clone();
            let s = &inner.segments[&e.seg];
            (s.file.clone(), s.path.clone(), e)
        };
        let mut buf = vec![0u8; HEADER_BYTES + e.len as usize];
        let check = match file.read_exact_at(&mut buf, e.offset) {
            Ok(()) => decode_header(&buf[..HEADER_BYTES]).and_then(|h| {
                if h.key != *key {
                    Err(format!("record holds key {:?}, not {key:?}", h.key))
                } else if h.len != e.len {
                    Err(format!("length {} != indexed {}", h.len, e.len))
                } else {
                    let c = crc32c::crc32c(&buf[HEADER_BYTES..]);
                    if c != h.payload_crc {
                        Err(format!(
                            "payload CRC32C {c:08x} != stored {:08x}",
                            h.payload_crc
                        ))
                    } else {
                        Ok(())
                    }
                }
            }),
            Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err("short read: record truncated".to_string())
            }
            Err(err) => return Err(Error::io(&path, err)),
        };
        let mut inner = self.inner.lock();
        match check {
            Ok(()) => {
                inner.stats.hits += 1;
                buf.drain(..HEADER_BYTES);
                Ok(Some(buf))
            }
            Err(reason) => {
                inner.stats.corrupt += 1;
                // Drop the entry only if it still points at the record we read.
                if inner
                    .index
                    .get(key)
                    .is_some_and(|cur| cur.seg == e.seg && cur.offset == e.offset)
                {
                    Self::drop_entry(&mut inner, key, false)?;
                }
                Err(Error::Corrupt {
                    path,
                    reason: format!("record at offset {}: {reason}", e.offset),
                })
            }
        }
    }

    /// All live keys (unordered).
    pub fn keys(&self) -> Vec<PrefixKey> {
        self.inner.lock().index.keys().copied().collect()
    }

    /// Counters and sizes now.
    pub fn stats(&self) -> SsdStats {
        let inner = self.inner.lock();
        SsdStats {
            entries: inner.index.len() as u64,
            live_bytes: inner.live_bytes,
            disk_bytes: inner.disk_bytes,
            ..inner.stats
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SsdConfig {
        &self.cfg
    }
}

/// Deterministic filler of `len` bytes derived from `key`: the payload of the trace simulator's
/// records and of the crash tests (real sizes, content a reader can re-derive and compare).
pub fn synthetic_payload(key: &PrefixKey, len: usize, out: &mut Vec<u8>) {
    out.clear();
    out.resize(len, 0);
    let mut s = u64::from_le_bytes(key.0[..8].try_into().expect("8 bytes"));
    for chunk in out.chunks_mut(8) {
        // splitmix64 step
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}

/// Key `i` of the crash-test writer stream `seed` (SHA-256 of both), and its payload length
/// (1 B to `max_len`).
pub fn crash_test_record(seed: u64, i: u64, max_len: usize) -> (PrefixKey, usize) {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"csa2/crash-test/v1");
    h.update(seed.to_le_bytes());
    h.update(i.to_le_bytes());
    let key = PrefixKey(h.finalize().into());
    let len = 1
        + (u32::from_le_bytes(key.0[8..12].try_into().expect("4 bytes")) as usize) % max_len.max(1);
    (key, len)
}
