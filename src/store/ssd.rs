//! The SSD tier for global KV: append-only segment files keyed by the chained prefix key.
//!
//! # Directory
//! - `seg-NNNNNNNN.log`: segment files, each a sequence of records (below), appended in id order.
//! - `LOCK`: held with an exclusive `flock(2)` by the one process that opened the directory for
//!   writing; it holds that process's pid as decimal text (so a refused opener can name it).
//! - `AGE`: the persisted store age (see "Store age"), 32 bytes: `CSA2AGE1`, the store age in ms
//!   (u64 LE), the wall-clock ms when it was written (u64 LE), the CRC32C of bytes 0..24, 4 zero
//!   bytes. Advisory: a missing or damaged `AGE` only loses the restart credit.
//!
//! # Record format (version 2)
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `CSA2` |
//! | 4 | format version (2) |
//! | 5..8 | zero |
//! | 8..40 | key (32 B) |
//! | 40..48 | creation time: store age in ms (u64 LE; see "Store age") |
//! | 48..52 | payload length (u32 LE) |
//! | 52..56 | CRC32C of the payload |
//! | 56..60 | header CRC32C of bytes 0..56 |
//! | 60..64 | state word: CRC32C of bytes 0..56 followed by ASCII `live` (live) or `dead` (evicted or removed); the only bytes ever rewritten |
//! | 64.. | payload |
//!
//! The state word is bound to its header: any other value (a flipped bit, a zeroed sector, a word
//! copied from another record) is "unknown state", reported as damage, and the record is not
//! indexed. A corrupted state therefore never silently turns a live entry into an evicted one or
//! back. Version 1 (state byte at offset 5, outside every checksum; wall-clock creation times) is
//! refused on open with a clear error: its lifetimes cannot be converted.
//!
//! # Guarantees
//! - **One writer per directory**: [`SsdStore::open`] takes an exclusive lock on `LOCK`; a second
//!   opener (another process, or the same one twice) gets [`Error::Busy`] naming the holder's
//!   pid (a second open inside one process is caught by an in-process
//!   registry; a lock found held is retried for up to 1 s, because a child process spawned by
//!   another thread holds every descriptor of its parent until its `exec`, the lock's too).
//!   [`SsdStore::open_read_only`] takes no lock and never writes, deletes
//!   or truncates anything; its reads re-check the on-disk state, so an entry the writer evicted
//!   or removed is not served. The lock goes with the process (a killed writer leaves no stale
//!   lock).
//! - **Checksums**: every read verifies the header CRC, the key, the state word and the payload
//!   CRC; a damaged record is reported ([`Error::Corrupt`], counted) and dropped from the index,
//!   never returned.
//! - **Recovery**: opening rebuilds the index by scanning every segment in order; the newest record
//!   of a key decides (a later `dead` record hides an earlier `live` copy). A record whose header
//!   fails its checks is skipped by resynchronising on the next position that holds a whole valid
//!   record (magic, version, header CRC, length inside the file, payload CRC), so one damaged
//!   header loses only its own record. Only the tail of the *newest* segment, where a crash cuts
//!   the record being written, is truncated; damage elsewhere is reported and left in place as
//!   dead bytes, which compaction later reclaims.
//! - **Readers never see a record being written**: a record enters the index only after its bytes
//!   are written (and synced, per policy).
//! - **Capacity** counts the bytes of *live* records (64-B header + payload): a write is admitted
//!   when the live bytes plus the record fit `capacity_bytes`. Dead bytes (evicted, removed,
//!   superseded or damaged records) are reclaimed by compaction: a segment whose dead share
//!   reaches `compact_dead_percent` has its live records copied forward to the active segment,
//!   synced, and only then is the old segment deleted (a crash in between leaves two identical
//!   copies; the newer one wins on restart, nothing is lost). The active segment takes part once
//!   its dead bytes pass a quarter of `min(segment_bytes, capacity_bytes)`. The files thus stay
//!   below about `capacity_bytes × 100 / (100 − compact_dead_percent) + 2 × segment_bytes`.
//! - **Minimum lifetime and admission**: an entry younger than `min_lifetime_ms` (default 72 h) is
//!   never evicted. A write that does not fit evicts the least recently used entries past their
//!   lifetime, and only as many as it needs; when even all of those would not make room, the
//!   write is refused ([`Error::Refused`]) *before anything is evicted*, and counted.
//! - **Store age** (lifetimes do not follow wall-clock jumps): creation times are in store age,
//!   which advances with the monotonic clock while the store is open. On reopen it resumes from
//!   the larger of the persisted `AGE` and the newest creation time on disk, plus the wall-clock
//!   time since `AGE` was written, capped at `max_offline_credit_ms` (default 1 h; a clock set
//!   backwards credits nothing). A clock that jumps 80 h between two runs thus ages entries by at
//!   most the cap. The price: downtime beyond the cap does not count towards lifetimes, so
//!   entries live longer than their minimum, never shorter.
//! - **fsync policy** ([`FsyncPolicy`]): with `Always` (the default) a write is acknowledged only
//!   after `fdatasync` of the segment (and of the directory when a segment is created or
//!   deleted); state marks of the evictions a write caused are synced before the write is
//!   acknowledged, and compaction syncs its copies before deleting the source. With `Never` an
//!   acknowledged entry survives a process crash (the data is in the kernel page cache) but not a
//!   power loss; a record torn by power loss is still detected by its checksum. A failed sync
//!   (`EIO`) fails the call: the record is not indexed, and later records go to a fresh segment
//!   (nothing is acknowledged beside bytes whose sync failed). See docs/RELIABILITY.md for what
//!   was and was not tested.
//! - **The directory's contents**: only the exact names this store writes (`seg-NNNNNNNN.log`,
//!   one name per id) are segments; any other file, `seg-1.log` or `seg-+1.log` included, is
//!   reported and left untouched, and a second name of one file (a hard link) is read once.
//!   Recovery reads the whole directory before it changes anything (superseded copies marked
//!   dead, a torn tail cut), so a directory it refuses is left as it was. A record of a newer
//!   format version than this build's (one whose header does not check out as a version-2 header
//!   with a damaged version byte) refuses the open, writable or read-only, naming the version
//!   and the file. A writable open whose highest segment id is 2^31 or more (only a foreign file
//!   gets there) renumbers the segments from 1 in order instead of running out of ids.
//! - **The directory deleted under the store**: a write is acknowledged only after checking that
//!   the directory is still the one opened and the record's segment is still linked in it;
//!   otherwise the call fails naming the cause and the store refuses every later write and
//!   removal (its lock went with the directory, so going on could mean two writers). A read
//!   never serves a record whose segment file was deleted or replaced; a segment deleted by
//!   someone else is forgotten, not copied back by compaction, and its name is never unlinked
//!   again (it may be another file's now).
//!
//! Thread safety: `SsdStore` is `Send + Sync`; metadata sits behind one mutex held for bookkeeping
//! only, writers (put, remove, compaction) are serialized by a second mutex while they do I/O, and
//! readers do their `pread` without holding either.

use super::clock::Clock;
use crate::cache::PrefixKey;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

const MAGIC: &[u8; 4] = b"CSA2";
/// On-disk record format version written and read by this build.
pub const FORMAT_VERSION: u8 = 2;
const V1: u8 = 1;
/// Header bytes before the payload.
pub const HEADER_BYTES: usize = 64;
/// Offset of the state word inside a header.
pub const STATE_OFFSET: usize = 60;
const LOCK_NAME: &str = "LOCK";
const AGE_NAME: &str = "AGE";
const AGE_MAGIC: &[u8; 8] = b"CSA2AGE1";
/// Bytes read per step while searching for the next valid record after damage.
const RESYNC_CHUNK: usize = 1 << 20;

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
    /// Directory of the segment files (created if absent by [`SsdStore::open`]).
    pub dir: PathBuf,
    /// Most bytes of live records (headers included) the tier holds. Dead bytes awaiting
    /// compaction come on top (module docs, "Capacity").
    pub capacity_bytes: u64,
    /// Minimum lifetime of an entry, ms of store age (default 72 h, docs/SPEC.md §0).
    pub min_lifetime_ms: u64,
    /// A segment is closed once it reaches this size (default 16 MiB).
    pub segment_bytes: u64,
    /// Sync policy (default [`FsyncPolicy::Always`]).
    pub fsync: FsyncPolicy,
    /// Records are written in `pwrite` calls of at most this many bytes (default 1 MiB).
    pub io_chunk_bytes: usize,
    /// Verify every payload checksum when opening (default true; headers are always verified).
    pub verify_on_open: bool,
    /// A segment whose dead bytes reach this percentage of its size is compacted (1..=100,
    /// default 50: each compacted byte reclaims at least one dead byte).
    pub compact_dead_percent: u32,
    /// Most wall-clock ms of downtime credited to the store age on reopen (default 1 h).
    pub max_offline_credit_ms: u64,
}

impl SsdConfig {
    /// Defaults: 72 h minimum lifetime, 16 MiB segments, `fsync` always, verification on open,
    /// compaction at 50 % dead, 1 h offline credit.
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> SsdConfig {
        SsdConfig {
            dir: dir.into(),
            capacity_bytes,
            min_lifetime_ms: 72 * super::clock::HOUR_MS,
            segment_bytes: 16 << 20,
            fsync: FsyncPolicy::Always,
            io_chunk_bytes: 1 << 20,
            verify_on_open: true,
            compact_dead_percent: 50,
            max_offline_credit_ms: super::clock::HOUR_MS,
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
    /// Records marked dead, or superseded by a newer record of the same key.
    pub dead_records: usize,
    /// Of `dead_records`, live records superseded by a newer copy (a crash during compaction
    /// leaves such pairs).
    pub superseded_records: usize,
    /// Bytes cut off the end of the newest segment (a record torn by a crash).
    pub torn_bytes_truncated: u64,
    /// Damaged records (header, state word or payload failed its check; not indexed).
    pub corrupt_records: usize,
    /// Bytes skipped as damaged and left in place (reclaimed by compaction).
    pub damaged_bytes: u64,
    /// Store age when opened, ms.
    pub age_ms: u64,
    /// Wall-clock downtime credited to the store age, ms (≤ `max_offline_credit_ms`).
    pub offline_credit_ms: u64,
    /// Human-readable findings (path, offset, what failed).
    pub notes: Vec<String>,
}

/// What [`SsdStore::refresh`] changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RefreshReport {
    /// Segments dropped because their file was deleted or replaced.
    pub segments_dropped: usize,
    /// Segments created since the open or the last refresh, now read.
    pub segments_added: usize,
    /// Live entries now.
    pub records: usize,
    /// Growth of the live entries (0 when more were dropped than found).
    pub records_added: usize,
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
    /// Entries removed by [`SsdStore::remove`].
    pub removed: u64,
    /// Segments compacted.
    pub compactions: u64,
    /// Bytes copied forward by compaction.
    pub compacted_bytes: u64,
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

impl Entry {
    fn rec_bytes(&self) -> u64 {
        HEADER_BYTES as u64 + self.len as u64
    }
}

struct Segment {
    file: Arc<File>,
    path: PathBuf,
    /// Inode at open: a read-only store notices a segment the writer deleted or replaced.
    ino: u64,
    size: u64,
    live_bytes: u64,
    /// Live records of this segment, by offset.
    records: BTreeMap<u64, PrefixKey>,
    /// Records reserved here and not yet indexed (a put or a compaction copy in flight): a
    /// segment holding any is never deleted as empty.
    pending: u32,
}

impl Segment {
    fn dead_bytes(&self) -> u64 {
        self.size.saturating_sub(self.live_bytes)
    }

    /// Whether nothing in the segment is live or about to be.
    fn unused(&self) -> bool {
        self.records.is_empty() && self.pending == 0
    }
}

struct Inner {
    index: HashMap<PrefixKey, Entry>,
    lru: BTreeMap<u64, PrefixKey>,
    by_created: BTreeSet<(u64, PrefixKey)>,
    segments: BTreeMap<u32, Segment>,
    /// The segment appended to (`None` when read-only).
    active: Option<u32>,
    disk_bytes: u64,
    live_bytes: u64,
    tick: u64,
    stats: SsdStats,
    /// Why the store stopped accepting writes (its directory or active segment was deleted or
    /// replaced under it); `None` while healthy.
    broken: Option<String>,
}

impl Inner {
    fn insert_entry(&mut self, key: PrefixKey, e: Entry) {
        self.lru.insert(e.tick, key);
        self.by_created.insert((e.created, key));
        self.live_bytes += e.rec_bytes();
        if let Some(s) = self.segments.get_mut(&e.seg) {
            if s.records.insert(e.offset, key).is_none() {
                s.live_bytes += e.rec_bytes();
            }
        }
        self.index.insert(key, e);
    }

    fn remove_entry(&mut self, key: &PrefixKey) -> Option<Entry> {
        let e = self.index.remove(key)?;
        self.lru.remove(&e.tick);
        self.by_created.remove(&(e.created, *key));
        self.live_bytes -= e.rec_bytes();
        if let Some(s) = self.segments.get_mut(&e.seg) {
            // The segment counted the record only if it holds it under this key.
            if s.records.get(&e.offset) == Some(key) {
                s.records.remove(&e.offset);
                s.live_bytes -= e.rec_bytes();
            }
        }
        Some(e)
    }

    fn touch(&mut self, key: &PrefixKey) {
        if let Some(e) = self.index.get_mut(key) {
            self.lru.remove(&e.tick);
            self.tick += 1;
            e.tick = self.tick;
            self.lru.insert(self.tick, *key);
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

/// The SSD tier. See the module docs for the format and the guarantees.
pub struct SsdStore {
    cfg: SsdConfig,
    clock: Arc<dyn Clock>,
    read_only: bool,
    /// Store age at open and the monotonic reading then.
    age_base: u64,
    mono_base: u64,
    /// The exclusive lock (writable stores); released when the store is dropped.
    _lock: Option<DirLock>,
    /// Inode of the directory at open: a writer notices the directory deleted or replaced.
    dir_ino: u64,
    age_file: Option<File>,
    inner: Mutex<Inner>,
    writer: Mutex<()>,
    /// Data syncs to let through before an injected failure, or -1 for none
    /// ([`SsdStore::inject_sync_failure`]).
    fail_sync_after: AtomicI64,
}

impl std::fmt::Debug for SsdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdStore")
            .field("cfg", &self.cfg)
            .field("read_only", &self.read_only)
            .finish()
    }
}

fn seg_name(id: u32) -> String {
    format!("seg-{id:08}.log")
}

/// The id of a segment file name, only for the exact names [`seg_name`] writes (so one id has one
/// name: `seg-1.log`, `seg-01.log` or `seg-+1.log` beside `seg-00000001.log` are not segments).
fn parse_seg_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("seg-")?.strip_suffix(".log")?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let id: u32 = digits.parse().ok()?;
    (seg_name(id) == name).then_some(id)
}

/// A writable open whose highest segment id is at least this renumbers the segments from 1
/// (ids only reach it through a foreign file: 2^31 segments are 32 PiB of 16-MiB segments).
const RENUMBER_FROM: u32 = 1 << 31;

/// What recovery changes on disk, collected while the scan only reads and applied once the whole
/// directory has been read and accepted.
#[derive(Default)]
struct ScanFixes {
    /// Older live copies of keys that a newer record superseded: marked dead.
    marks: Vec<(Arc<File>, PathBuf, u64)>,
    /// The newest segment's torn tail: cut at this length.
    truncate: Option<(Arc<File>, PathBuf, u64)>,
    /// The newest creation time found, ms of store age.
    newest_created: u64,
    /// Ids of names skipped as second names of a segment already read (their files stay).
    skipped: Vec<u32>,
}

impl ScanFixes {
    /// Notes that `old` is superseded by the record at `offset` of segment `seg`.
    fn supersede(&mut self, inner: &Inner, old: &Entry, seg: u32, offset: u64, read_only: bool) {
        // A record never supersedes itself (the same record read twice is not two copies).
        if read_only || (old.seg == seg && old.offset == offset) {
            return;
        }
        if let Some(s) = inner.segments.get(&old.seg) {
            self.marks
                .push((s.file.clone(), s.path.clone(), old.offset));
        }
    }

    fn apply(&self, cfg: &SsdConfig) -> Result<()> {
        let mut synced = HashSet::new();
        for (f, p, off) in &self.marks {
            mark_dead(f, *off).map_err(|e| Error::io(p, e))?;
            if cfg.fsync == FsyncPolicy::Always && synced.insert(p.clone()) {
                f.sync_data().map_err(|e| Error::io(p, e))?;
            }
        }
        if let Some((f, p, len)) = &self.truncate {
            f.set_len(*len).map_err(|e| Error::io(p, e))?;
            if cfg.fsync == FsyncPolicy::Always {
                f.sync_data().map_err(|e| Error::io(p, e))?;
            }
        }
        Ok(())
    }
}

fn header_crc(h: &[u8]) -> u32 {
    crc32c::crc32c(&h[..56])
}

fn state_word(hcrc: u32, live: bool) -> u32 {
    crc32c::crc32c_append(hcrc, if live { b"live" } else { b"dead" })
}

fn encode_header(key: &PrefixKey, created: u64, payload: &[u8]) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(MAGIC);
    h[4] = FORMAT_VERSION;
    h[8..40].copy_from_slice(&key.0);
    h[40..48].copy_from_slice(&created.to_le_bytes());
    h[48..52].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    h[52..56].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    let c = header_crc(&h);
    h[56..60].copy_from_slice(&c.to_le_bytes());
    h[60..64].copy_from_slice(&state_word(c, true).to_le_bytes());
    h
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Live,
    Dead,
    Unknown(u32),
}

struct Header {
    state: State,
    hcrc: u32,
    key: PrefixKey,
    created: u64,
    len: u32,
    payload_crc: u32,
}

enum BadHeader {
    /// A whole, valid version-1 header: an old directory, not damage.
    Version1,
    /// A header of a later format version than this build's (a newer build's directory), not a
    /// version-2 header whose version byte was damaged.
    Newer(u8),
    Damaged(String),
}

fn u32_at(h: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"))
}

fn decode_header(h: &[u8]) -> std::result::Result<Header, BadHeader> {
    if &h[..4] != MAGIC {
        return Err(BadHeader::Damaged(format!("bad magic {:02x?}", &h[..4])));
    }
    if h[4] == V1 {
        let c = crc32c::crc32c_append(crc32c::crc32c(&h[..5]), &h[6..60]);
        if c == u32_at(h, 60) {
            return Err(BadHeader::Version1);
        }
    }
    if h[4] != FORMAT_VERSION {
        if h[4] > FORMAT_VERSION {
            // A version-2 header with a damaged version byte still checks out once the byte is
            // put back; anything else under the magic is a newer format, never damage to cut.
            let mut v2 = [0u8; 56];
            v2.copy_from_slice(&h[..56]);
            v2[4] = FORMAT_VERSION;
            if crc32c::crc32c(&v2) != u32_at(h, 56) {
                return Err(BadHeader::Newer(h[4]));
            }
        }
        return Err(BadHeader::Damaged(format!("unknown version {}", h[4])));
    }
    let want = u32_at(h, 56);
    let got = header_crc(h);
    if want != got {
        return Err(BadHeader::Damaged(format!(
            "header CRC32C {got:08x} != stored {want:08x}"
        )));
    }
    let sw = u32_at(h, STATE_OFFSET);
    let state = if sw == state_word(got, true) {
        State::Live
    } else if sw == state_word(got, false) {
        State::Dead
    } else {
        State::Unknown(sw)
    };
    Ok(Header {
        state,
        hcrc: got,
        key: PrefixKey(h[8..40].try_into().expect("32 bytes")),
        created: u64::from_le_bytes(h[40..48].try_into().expect("8 bytes")),
        len: u32_at(h, 48),
        payload_crc: u32_at(h, 52),
    })
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

fn newer_version_error(path: &Path, offset: u64, version: u8) -> Error {
    Error::invalid(
        "ssd tier",
        format!(
            "{} @ {offset} holds a record of on-disk format version {version}, newer than this \
             build's version {FORMAT_VERSION}: the directory was written by a newer build. \
             Nothing was changed; open it with that build, or give this one another directory",
            path.display()
        ),
    )
}

fn version1_error(path: &Path) -> Error {
    Error::invalid(
        "ssd tier",
        format!(
            "{} holds records of on-disk format version 1 (wall-clock lifetimes, unchecked \
             state byte); this build reads version {FORMAT_VERSION} only. The tier is a cache: \
             move the directory away (or delete it) and let it refill",
            path.display()
        ),
    )
}

/// Whether a whole valid record starts at `p`: header checks, length inside `size`, payload CRC.
fn valid_record_at(file: &File, p: u64, size: u64, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    if size - p < HEADER_BYTES as u64 {
        return Ok(false);
    }
    let mut h = [0u8; HEADER_BYTES];
    file.read_exact_at(&mut h, p)?;
    let Ok(hd) = decode_header(&h) else {
        return Ok(false);
    };
    if p + HEADER_BYTES as u64 + hd.len as u64 > size {
        return Ok(false);
    }
    buf.resize(hd.len as usize, 0);
    file.read_exact_at(buf, p + HEADER_BYTES as u64)?;
    Ok(crc32c::crc32c(buf) == hd.payload_crc)
}

/// The first offset in `from..size` where a whole valid record starts.
fn resync(file: &File, from: u64, size: u64) -> std::io::Result<Option<u64>> {
    let mut chunk = vec![0u8; RESYNC_CHUNK + 3];
    let mut payload = Vec::new();
    let mut pos = from;
    while pos + HEADER_BYTES as u64 <= size {
        let n = ((size - pos) as usize).min(chunk.len());
        file.read_exact_at(&mut chunk[..n], pos)?;
        let mut i = 0;
        while i + 4 <= n {
            if &chunk[i..i + 4] == MAGIC
                && valid_record_at(file, pos + i as u64, size, &mut payload)?
            {
                return Ok(Some(pos + i as u64));
            }
            i += 1;
        }
        // The last 3 bytes may begin a magic that continues in the next chunk.
        pos += (n.saturating_sub(3)).max(1) as u64;
    }
    Ok(None)
}

fn read_age_file(dir: &Path) -> Option<(u64, u64)> {
    let b = std::fs::read(dir.join(AGE_NAME)).ok()?;
    if b.len() < 28 || &b[..8] != AGE_MAGIC || crc32c::crc32c(&b[..24]) != u32_at(&b, 24) {
        return None;
    }
    let age = u64::from_le_bytes(b[8..16].try_into().ok()?);
    let wall = u64::from_le_bytes(b[16..24].try_into().ok()?);
    Some((age, wall))
}

fn encode_age(age: u64, wall: u64) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(AGE_MAGIC);
    b[8..16].copy_from_slice(&age.to_le_bytes());
    b[16..24].copy_from_slice(&wall.to_le_bytes());
    let c = crc32c::crc32c(&b[..24]);
    b[24..28].copy_from_slice(&c.to_le_bytes());
    b
}

/// Directories this process has open for writing (canonical paths). `flock` alone cannot tell
/// "open in this process" from "held by a child that inherited the descriptor for the moment
/// between its `fork` and `exec`"; this registry answers the first at once.
static OPEN_HERE: parking_lot::Mutex<Option<HashSet<PathBuf>>> = parking_lot::Mutex::new(None);

/// How long a refused lock is retried: a thread of this process that spawns a child shares every
/// open descriptor with it until the child's `exec` closes them, so a lock just released can look
/// held for a moment.
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(1000);

/// The exclusive lock of a writable store's directory, released (and unregistered) on drop.
struct DirLock {
    _file: File,
    dir: PathBuf,
}

impl Drop for DirLock {
    fn drop(&mut self) {
        if let Some(set) = OPEN_HERE.lock().as_mut() {
            set.remove(&self.dir);
        }
    }
}

/// Takes the directory's exclusive lock and records this process's pid in it.
fn lock_dir(dir: &Path) -> Result<DirLock> {
    let canon = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
    let path = dir.join(LOCK_NAME);
    let busy = |who: String| {
        Error::Busy(format!(
            "the SSD tier {} is open for writing by another owner ({who}); one writer per \
             directory — stop it, use another directory, or open this one with \
             SsdStore::open_read_only",
            dir.display()
        ))
    };
    {
        let mut here = OPEN_HERE.lock();
        // Reserve the directory in the registry; the reservation goes if locking fails.
        if !here.get_or_insert_with(HashSet::new).insert(canon.clone()) {
            return Err(busy(format!(
                "pid {}, this process: the directory is already open here",
                std::process::id()
            )));
        }
    }
    let unregister = || {
        if let Some(set) = OPEN_HERE.lock().as_mut() {
            set.remove(&canon);
        }
    };
    match take_lock(&path, &busy) {
        Ok(f) => Ok(DirLock {
            _file: f,
            dir: canon.clone(),
        }),
        Err(e) => {
            unregister();
            Err(e)
        }
    }
}

fn take_lock(path: &Path, busy: &dyn Fn(String) -> Error) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    let deadline = std::time::Instant::now() + LOCK_RETRY;
    loop {
        match f.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(path)
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok());
                return Err(busy(match holder {
                    Some(pid) if pid == std::process::id() => format!(
                        "pid {pid}, this process, whose earlier store on it is still held by a \
                         child process that inherited the lock"
                    ),
                    Some(pid) => format!("pid {pid}"),
                    None => "a process that has not written its pid yet".to_string(),
                }));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(Error::io(path, e)),
        }
    }
    let pid = format!("{}\n", std::process::id());
    f.set_len(0)
        .and_then(|_| f.write_all_at(pid.as_bytes(), 0))
        .map_err(|e| Error::io(path, e))?;
    Ok(f)
}

/// Writes the dead state word of the record at `offset` (bound to its header CRC).
fn mark_dead(file: &File, offset: u64) -> std::io::Result<()> {
    let mut h = [0u8; HEADER_BYTES];
    file.read_exact_at(&mut h, offset)?;
    let hcrc = u32_at(&h, 56);
    file.write_all_at(
        &state_word(hcrc, false).to_le_bytes(),
        offset + STATE_OFFSET as u64,
    )
}

/// Writes `header` then `payload` at `offset` in `pwrite` calls of at most `chunk` bytes.
fn write_record(
    file: &File,
    offset: u64,
    header: &[u8],
    payload: &[u8],
    chunk: usize,
) -> std::io::Result<()> {
    let total = header.len() + payload.len();
    let mut written = 0usize;
    let mut buf = Vec::new();
    while written < total {
        let n = chunk.min(total - written);
        if written < header.len() {
            let h_end = (written + n).min(header.len());
            buf.clear();
            buf.extend_from_slice(&header[written..h_end]);
            buf.extend_from_slice(&payload[..written + n - h_end]);
            file.write_all_at(&buf, offset + written as u64)?;
        } else {
            let p = written - header.len();
            file.write_all_at(&payload[p..p + n], offset + written as u64)?;
        }
        written += n;
    }
    Ok(())
}

impl SsdStore {
    /// Opens (or creates) the tier in `cfg.dir` for reading and writing, rebuilding the index from
    /// the segments. Takes the directory's exclusive lock for the life of the store.
    ///
    /// Errors: [`Error::Invalid`] for a zero capacity, segment size or I/O chunk, a
    /// `compact_dead_percent` outside 1..=100, a directory of format version 1 or of a newer
    /// version than this build's, or a segment name that is not a regular file (nothing on disk
    /// is changed then); [`Error::Busy`] when another owner holds the lock (the message names its
    /// pid) — the only error that means "in use"; [`Error::Io`] when the directory or a segment
    /// cannot be read. Damaged records are not errors: they are reported in the
    /// [`RecoveryReport`] and left out of the index.
    pub fn open(cfg: SsdConfig, clock: Arc<dyn Clock>) -> Result<(SsdStore, RecoveryReport)> {
        Self::open_mode(cfg, clock, false)
    }

    /// Opens an existing tier without taking its lock, for inspection while a writer may be
    /// running: nothing on disk is written, truncated or deleted. The index is the directory as it
    /// was at open; every read re-checks that the record's segment still exists and that its
    /// state word still says live. Records written after the open are not seen. Writes return
    /// [`Error::Invalid`].
    ///
    /// Errors: as [`SsdStore::open`], except the lock; [`Error::Io`] when `cfg.dir` is absent.
    pub fn open_read_only(
        cfg: SsdConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<(SsdStore, RecoveryReport)> {
        Self::open_mode(cfg, clock, true)
    }

    fn open_mode(
        cfg: SsdConfig,
        clock: Arc<dyn Clock>,
        read_only: bool,
    ) -> Result<(SsdStore, RecoveryReport)> {
        if cfg.capacity_bytes == 0 || cfg.segment_bytes == 0 || cfg.io_chunk_bytes == 0 {
            return Err(Error::invalid(
                "ssd config",
                format!(
                    "capacity_bytes, segment_bytes and io_chunk_bytes must be > 0, found {}, {}, {}",
                    cfg.capacity_bytes, cfg.segment_bytes, cfg.io_chunk_bytes
                ),
            ));
        }
        if !(1..=100).contains(&cfg.compact_dead_percent) {
            return Err(Error::invalid(
                "ssd config",
                format!(
                    "compact_dead_percent must be in 1..=100, found {}",
                    cfg.compact_dead_percent
                ),
            ));
        }
        let lock = if read_only {
            std::fs::metadata(&cfg.dir).map_err(|e| Error::io(&cfg.dir, e))?;
            None
        } else {
            std::fs::create_dir_all(&cfg.dir).map_err(|e| Error::io(&cfg.dir, e))?;
            Some(lock_dir(&cfg.dir)?)
        };
        let dir_ino = std::fs::metadata(&cfg.dir)
            .map_err(|e| Error::io(&cfg.dir, e))?
            .ino();
        let mut rep = RecoveryReport::default();
        let mut ids = Vec::new();
        for e in std::fs::read_dir(&cfg.dir).map_err(|e| Error::io(&cfg.dir, e))? {
            let e = e.map_err(|e| Error::io(&cfg.dir, e))?;
            let name = e.file_name();
            let name = name.to_string_lossy();
            match parse_seg_name(&name) {
                Some(id) => ids.push(id),
                // Only the names this store writes are segments. Anything else that looks like
                // one (a backup copy `seg-1.log`, `seg-+1.log`) is left alone: reading it as a
                // segment would list an id twice and let a record supersede itself.
                None if name.starts_with("seg-") && name.ends_with(".log") => {
                    rep.notes.push(format!(
                        "{}: not a segment name this store writes (seg-NNNNNNNN.log); ignored and \
                         left untouched",
                        e.path().display()
                    ));
                }
                None => {}
            }
        }
        ids.sort_unstable();
        let mut inner = Inner {
            index: HashMap::new(),
            lru: BTreeMap::new(),
            by_created: BTreeSet::new(),
            segments: BTreeMap::new(),
            active: None,
            disk_bytes: 0,
            live_bytes: 0,
            tick: 0,
            stats: SsdStats::default(),
            broken: None,
        };
        // The scan only reads; what recovery must change on disk (marking superseded copies
        // dead, cutting a torn tail) is collected and done once every segment has been read, so
        // a directory refused half way (an old or newer format) is left exactly as it was.
        let mut fix = ScanFixes::default();
        let mut seen_inodes = HashSet::new();
        for (n, &id) in ids.iter().enumerate() {
            let newest = n + 1 == ids.len();
            let scanned = Self::scan_segment(
                &cfg,
                id,
                newest,
                read_only,
                &mut inner,
                &mut rep,
                &mut fix,
                &mut seen_inodes,
            );
            match scanned {
                // Beside a live writer a segment can go between the listing and the open: its
                // records were evicted, or copied to the active segment (seen if it was listed,
                // otherwise missed like any write after the open).
                Err(Error::Io { source, .. })
                    if read_only && source.kind() == ErrorKind::NotFound =>
                {
                    rep.notes.push(format!(
                        "{}: deleted by the writer while opening",
                        seg_name(id)
                    ));
                }
                other => other?,
            }
        }
        rep.segments = inner.segments.len();
        rep.records = inner.index.len();
        if !read_only {
            fix.apply(&cfg)?;
            // Ids run out only when a foreign file claims one near the top: renumber the
            // segments 1..n (in order) rather than refuse to start or to roll.
            if inner
                .segments
                .last_key_value()
                .is_some_and(|(&id, _)| id >= RENUMBER_FROM)
            {
                Self::renumber(&cfg, &mut inner, &mut rep)?;
            }
        }
        // Store age: resume from what the directory proves, plus a bounded offline credit.
        let wall = clock.now_ms();
        let (persisted, credit) = match read_age_file(&cfg.dir) {
            Some((age, at)) => (age, wall.saturating_sub(at).min(cfg.max_offline_credit_ms)),
            None => (0, 0),
        };
        rep.offline_credit_ms = credit;
        rep.age_ms = persisted.max(fix.newest_created) + credit;
        let mut age_file = None;
        if !read_only {
            // Always append to a fresh segment: never write after bytes a previous process left,
            // and never under a name still taken (a skipped second name keeps its file).
            let top = inner
                .segments
                .last_key_value()
                .map(|(&l, _)| l)
                .into_iter()
                .chain(fix.skipped.iter().copied())
                .max();
            let active = top.map_or(Some(1), |t| t.checked_add(1)).ok_or_else(|| {
                Error::invalid(
                    "ssd tier",
                    format!(
                        "{}: a second name of a segment holds the last segment id; remove it",
                        cfg.dir.display()
                    ),
                )
            })?;
            Self::create_segment(&cfg, active, &mut inner)?;
            // Delete closed segments with no live record.
            let empty: Vec<u32> = inner
                .segments
                .iter()
                .filter(|(&id, s)| s.unused() && id != active)
                .map(|(&id, _)| id)
                .collect();
            for id in empty {
                Self::delete_segment(&cfg, &mut inner, id)?;
            }
            let path = cfg.dir.join(AGE_NAME);
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|e| Error::io(&path, e))?;
            f.write_all_at(&encode_age(rep.age_ms, wall), 0)
                .map_err(|e| Error::io(&path, e))?;
            age_file = Some(f);
        }
        inner.stats.entries = inner.index.len() as u64;
        let mono_base = clock.monotonic_ms();
        let store = SsdStore {
            cfg,
            clock,
            read_only,
            age_base: rep.age_ms,
            mono_base,
            _lock: lock,
            dir_ino,
            age_file,
            inner: Mutex::new(inner),
            writer: Mutex::new(()),
            fail_sync_after: AtomicI64::new(-1),
        };
        Ok((store, rep))
    }

    /// Renames the segments to ids 1..n in their order (a writable open whose highest id is near
    /// the end of the id space). Each rename goes to an id no other segment holds (ids only
    /// shrink and go in ascending order), so a crash part way leaves the order intact.
    fn renumber(cfg: &SsdConfig, inner: &mut Inner, rep: &mut RecoveryReport) -> Result<()> {
        let old = std::mem::take(&mut inner.segments);
        let mut map = HashMap::new();
        for (n, (id, mut s)) in old.into_iter().enumerate() {
            let new = n as u32 + 1;
            if new != id {
                let to = cfg.dir.join(seg_name(new));
                if std::fs::symlink_metadata(&to).is_ok() {
                    return Err(Error::Internal(format!(
                        "renumbering segments: {} exists",
                        to.display()
                    )));
                }
                std::fs::rename(&s.path, &to).map_err(|e| Error::io(&s.path, e))?;
                rep.notes.push(format!(
                    "{} renamed to {} (segment ids renumbered from 1: the highest id was {id} \
                     or above {RENUMBER_FROM})",
                    s.path.display(),
                    to.display()
                ));
                s.path = to;
            }
            map.insert(id, new);
            inner.segments.insert(new, s);
        }
        for e in inner.index.values_mut() {
            e.seg = map[&e.seg];
        }
        sync_dir(&cfg.dir)
    }

    #[allow(clippy::too_many_arguments)]
    fn scan_segment(
        cfg: &SsdConfig,
        id: u32,
        newest: bool,
        read_only: bool,
        inner: &mut Inner,
        rep: &mut RecoveryReport,
        fix: &mut ScanFixes,
        seen_inodes: &mut HashSet<(u64, u64)>,
    ) -> Result<()> {
        let path = cfg.dir.join(seg_name(id));
        let not_a_file = |path: &Path| {
            Error::invalid(
                "ssd tier",
                format!(
                    "{} is not a regular file; move it out of the directory",
                    path.display()
                ),
            )
        };
        if std::fs::metadata(&path).is_ok_and(|m| !m.is_file()) {
            return Err(not_a_file(&path));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
        if !meta.is_file() {
            return Err(not_a_file(&path));
        }
        if !seen_inodes.insert((meta.dev(), meta.ino())) {
            // A second name (hard link) of a segment already read: its records are those records.
            rep.notes.push(format!(
                "{}: another name of a segment already read (same inode); ignored",
                path.display()
            ));
            fix.skipped.push(id);
            return Ok(());
        }
        let size = meta.len();
        let file = Arc::new(file);
        inner.segments.insert(
            id,
            Segment {
                file: file.clone(),
                path: path.clone(),
                ino: meta.ino(),
                size,
                live_bytes: 0,
                records: BTreeMap::new(),
                pending: 0,
            },
        );
        let (size, end) = Self::scan_records(
            cfg, id, &file, &path, 0, size, newest, read_only, inner, rep, fix,
        )?;
        // A read-only store remembers where its scan stopped: a refresh reads on from there.
        let size = if read_only { end } else { size };
        if let Some(s) = inner.segments.get_mut(&id) {
            s.size = size;
        }
        inner.disk_bytes += size;
        Ok(())
    }

    /// Reads the records of segment `id` in `from..size`, indexing the whole valid ones. Returns
    /// the segment's size after a torn tail was cut (writable stores, newest segment) and the
    /// offset the scan stopped at (the end, or the start of a damaged tail it could not skip).
    #[allow(clippy::too_many_arguments)]
    fn scan_records(
        cfg: &SsdConfig,
        id: u32,
        file: &Arc<File>,
        path: &Path,
        from: u64,
        size: u64,
        newest: bool,
        read_only: bool,
        inner: &mut Inner,
        rep: &mut RecoveryReport,
        fix: &mut ScanFixes,
    ) -> Result<(u64, u64)> {
        let io = |e| Error::io(path, e);
        let mut size = size;
        let mut off = from;
        let mut h = [0u8; HEADER_BYTES];
        let mut payload = Vec::new();
        while off < size {
            let bad = |why: String| format!("{} @ {off}: {why}", path.display());
            let why = if size - off < HEADER_BYTES as u64 {
                format!("torn header ({} bytes)", size - off)
            } else {
                file.read_exact_at(&mut h, off).map_err(io)?;
                match decode_header(&h) {
                    Err(BadHeader::Version1) => return Err(version1_error(path)),
                    Err(BadHeader::Newer(v)) => return Err(newer_version_error(path, off, v)),
                    Err(BadHeader::Damaged(why)) => why,
                    Ok(hd) => {
                        let end = off + HEADER_BYTES as u64 + hd.len as u64;
                        if end > size {
                            format!(
                                "torn record: {} payload bytes of {} present",
                                size - off - HEADER_BYTES as u64,
                                hd.len
                            )
                        } else {
                            Self::index_scanned(
                                cfg,
                                file,
                                id,
                                off,
                                &hd,
                                read_only,
                                inner,
                                rep,
                                &mut payload,
                                fix,
                            )
                            .map_err(io)?;
                            off = end;
                            continue;
                        }
                    }
                }
            };
            // A bad header, or a record running past the end of the file: its length cannot be
            // trusted, so look for the next whole valid record.
            match resync(file, off + 1, size).map_err(io)? {
                Some(next) => {
                    rep.notes.push(bad(format!(
                        "{why}; {} damaged bytes skipped to the next valid record at {next}",
                        next - off
                    )));
                    rep.corrupt_records += 1;
                    rep.damaged_bytes += next - off;
                    off = next;
                    continue;
                }
                None if newest && !read_only => {
                    // The newest segment's tail: the record a crash cut. Cut it off (once the
                    // whole directory has been read).
                    rep.notes.push(bad(format!(
                        "{why}; torn tail of {} bytes truncated",
                        size - off
                    )));
                    fix.truncate = Some((file.clone(), path.to_path_buf(), off));
                    rep.torn_bytes_truncated += size - off;
                    size = off;
                }
                None if newest => {
                    rep.notes.push(bad(format!(
                        "{why}; torn tail of {} bytes ignored (read-only)",
                        size - off
                    )));
                }
                None => {
                    rep.notes.push(bad(format!(
                        "{why}; damaged tail of {} bytes left in place (not the newest segment)",
                        size - off
                    )));
                    rep.corrupt_records += 1;
                    rep.damaged_bytes += size - off;
                }
            }
            break;
        }
        Ok((size, off))
    }

    /// Indexes one whole record found by the scan (the newest record of a key decides).
    #[allow(clippy::too_many_arguments)]
    fn index_scanned(
        cfg: &SsdConfig,
        file: &File,
        id: u32,
        off: u64,
        hd: &Header,
        read_only: bool,
        inner: &mut Inner,
        rep: &mut RecoveryReport,
        payload: &mut Vec<u8>,
        fix: &mut ScanFixes,
    ) -> std::io::Result<()> {
        let path = inner.segments[&id].path.clone();
        let note = |why: String| format!("{} @ {off}: {why}", path.display());
        fix.newest_created = fix.newest_created.max(hd.created);
        match hd.state {
            State::Unknown(w) => {
                let n = note(format!(
                    "state word {w:08x} is neither live nor dead for this header (record not \
                     indexed)"
                ));
                rep.notes.push(n);
                rep.corrupt_records += 1;
            }
            State::Dead => {
                if let Some(old) = inner.remove_entry(&hd.key) {
                    fix.supersede(inner, &old, id, off, read_only);
                    rep.superseded_records += 1;
                    rep.dead_records += 1;
                }
                rep.dead_records += 1;
            }
            State::Live => {
                if cfg.verify_on_open {
                    payload.resize(hd.len as usize, 0);
                    file.read_exact_at(payload, off + HEADER_BYTES as u64)?;
                    let c = crc32c::crc32c(payload);
                    if c != hd.payload_crc {
                        let n = note(format!(
                            "payload CRC32C {c:08x} != stored {:08x}",
                            hd.payload_crc
                        ));
                        rep.notes.push(n);
                        rep.corrupt_records += 1;
                        return Ok(());
                    }
                }
                if let Some(old) = inner.remove_entry(&hd.key) {
                    fix.supersede(inner, &old, id, off, read_only);
                    rep.superseded_records += 1;
                    rep.dead_records += 1;
                }
                let tick = inner.next_tick();
                inner.insert_entry(
                    hd.key,
                    Entry {
                        seg: id,
                        offset: off,
                        len: hd.len,
                        created: hd.created,
                        tick,
                    },
                );
            }
        }
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
        let ino = file.metadata().map_err(|e| Error::io(&path, e))?.ino();
        inner.segments.insert(
            id,
            Segment {
                file: Arc::new(file),
                path,
                ino,
                size: 0,
                live_bytes: 0,
                records: BTreeMap::new(),
                pending: 0,
            },
        );
        inner.active = Some(id);
        Ok(())
    }

    /// Deletes segment `id` when nothing in it is live or in flight. A segment whose name no
    /// longer leads to its file (deleted or replaced under the store) is only forgotten: the
    /// name may now be another file's.
    fn delete_segment(cfg: &SsdConfig, inner: &mut Inner, id: u32) -> Result<()> {
        if !inner.segments.get(&id).is_some_and(Segment::unused) {
            return Ok(());
        }
        if let Some(s) = inner.segments.remove(&id) {
            inner.disk_bytes -= s.size;
            if !Self::still_linked(&s.path, s.ino) {
                return Ok(());
            }
            // Readers holding the file keep reading it; the name goes now.
            match std::fs::remove_file(&s.path) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(Error::io(&s.path, e)),
            }
            if cfg.fsync == FsyncPolicy::Always {
                sync_dir(&cfg.dir)?;
            }
        }
        Ok(())
    }

    /// Closes the active segment and opens the next one; a closed segment with no live record goes.
    fn roll_segment(&self, inner: &mut Inner) -> Result<()> {
        self.check_dir(inner)?;
        let prev = inner.active.expect("writable store has an active segment");
        let next = prev.checked_add(1).ok_or_else(|| {
            Error::invalid(
                "ssd tier",
                format!(
                    "segment ids exhausted in {}: reopen the store (it renumbers its segments)",
                    self.cfg.dir.display()
                ),
            )
        })?;
        Self::create_segment(&self.cfg, next, inner)?;
        Self::delete_segment(&self.cfg, inner, prev)?;
        Ok(())
    }

    /// Store age now, ms.
    pub fn age_ms(&self) -> u64 {
        self.age_base + self.clock.monotonic_ms().saturating_sub(self.mono_base)
    }

    fn persist_age(&self) {
        if let Some(f) = &self.age_file {
            // Advisory (module docs, "Store age"): a failed write only loses restart credit.
            let _ = f.write_all_at(&encode_age(self.age_ms(), self.clock.now_ms()), 0);
        }
    }

    /// Removes `key` from the index and, when `mark`, writes its record's dead state word.
    /// Returns the file to sync when a mark was written. Deletes a closed segment left with no
    /// live record.
    fn drop_entry(&self, inner: &mut Inner, key: &PrefixKey, mark: bool) -> Result<Option<u32>> {
        let Some(e) = inner.remove_entry(key) else {
            return Ok(None);
        };
        inner.stats.entries = inner.index.len() as u64;
        if self.read_only {
            return Ok(None);
        }
        let Some(seg) = inner.segments.get(&e.seg) else {
            return Ok(None);
        };
        let mut synced = None;
        let goes = seg.unused() && Some(e.seg) != inner.active;
        if mark && !goes {
            mark_dead(&seg.file, e.offset).map_err(|err| Error::io(&seg.path, err))?;
            synced = Some(e.seg);
        }
        if goes {
            // Deleting the file removes the record for good; no mark needed.
            Self::delete_segment(&self.cfg, inner, e.seg)?;
        }
        Ok(synced)
    }

    /// Makes one data sync of this store (a record's, a state mark's or a compaction's copies')
    /// fail with `EIO` without syncing, as a failing device reports it: the one after
    /// `after_successful` more syncs have gone through. For tests of what a sync failure leaves
    /// behind; the store never calls it itself.
    #[doc(hidden)]
    pub fn inject_sync_failure(&self, after_successful: u32) {
        self.fail_sync_after
            .store(after_successful as i64, Ordering::SeqCst);
    }

    /// `fdatasync` of `f`, or the injected failure.
    fn sync_file(&self, f: &File) -> std::io::Result<()> {
        let before = self
            .fail_sync_after
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n >= 0).then_some(n - 1)
            });
        if before == Ok(0) {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        f.sync_data()
    }

    fn sync_segments(&self, ids: &BTreeSet<u32>) -> Result<()> {
        if self.cfg.fsync != FsyncPolicy::Always || ids.is_empty() {
            return Ok(());
        }
        let files: Vec<(Arc<File>, PathBuf)> = {
            let inner = self.inner.lock();
            ids.iter()
                .filter_map(|id| inner.segments.get(id))
                .map(|s| (s.file.clone(), s.path.clone()))
                .collect()
        };
        for (f, p) in files {
            self.sync_file(&f).map_err(|e| Error::io(&p, e))?;
        }
        Ok(())
    }

    /// The least recently used entries past their minimum lifetime whose records free at least
    /// `excess` bytes, or `None` when all of them together would not.
    fn plan_eviction(&self, inner: &Inner, excess: u64) -> Option<Vec<PrefixKey>> {
        if excess == 0 {
            return Some(Vec::new());
        }
        let now = self.age_ms();
        let old_enough = |created: u64| created.saturating_add(self.cfg.min_lifetime_ms) <= now;
        // Fast refusal: nothing is old enough when the oldest entry is not.
        match inner.by_created.first() {
            Some(&(c, _)) if old_enough(c) => {}
            _ => return None,
        }
        let mut victims = Vec::new();
        let mut freed = 0u64;
        for k in inner.lru.values() {
            let e = &inner.index[k];
            if old_enough(e.created) {
                victims.push(*k);
                freed += e.rec_bytes();
                if freed >= excess {
                    return Some(victims);
                }
            }
        }
        None
    }

    /// The segment most worth compacting now, if any.
    fn compaction_candidate(&self, inner: &Inner) -> Option<u32> {
        let pct = self.cfg.compact_dead_percent as u64;
        let active_floor = self.cfg.segment_bytes.min(self.cfg.capacity_bytes) / 4;
        inner
            .segments
            .iter()
            .filter(|(&id, s)| {
                s.size > 0
                    && s.dead_bytes() * 100 >= pct * s.size
                    && (Some(id) != inner.active || s.dead_bytes() >= active_floor.max(1))
            })
            .max_by_key(|(_, s)| s.dead_bytes())
            .map(|(&id, _)| id)
    }

    /// Compacts segments past the dead-share threshold. Caller holds the writer lock.
    fn compact_all(&self) -> Result<()> {
        // Each round removes one segment; bounded by the number of segments now plus the ones
        // the copies fill.
        for _ in 0..1024 {
            let Some(id) = self.compaction_candidate(&self.inner.lock()) else {
                return Ok(());
            };
            self.compact_segment(id)?;
        }
        Ok(())
    }

    /// Copies the live records of segment `id` to the active segment, syncs them, repoints the
    /// index and deletes `id`. A crash at any point leaves every live record in at least one
    /// whole, valid copy (module docs, "Capacity"). The copies are reserved as in flight, so a
    /// segment they fill is never deleted as empty before the index points at them.
    fn compact_segment(&self, id: u32) -> Result<()> {
        let (src, src_path, live) = {
            let mut guard = self.inner.lock();
            let inner = &mut *guard;
            if inner.active == Some(id) {
                self.roll_segment(inner)?;
            }
            let Some(s) = inner.segments.get(&id) else {
                return Ok(());
            };
            if !Self::still_linked(&s.path, s.ino) {
                // Deleted under the store: its records went with the file; never copy them back.
                let keys: Vec<PrefixKey> = s.records.values().copied().collect();
                for k in keys {
                    inner.remove_entry(&k);
                }
                inner.stats.entries = inner.index.len() as u64;
                Self::delete_segment(&self.cfg, inner, id)?;
                return Ok(());
            }
            let live: Vec<(u64, PrefixKey)> = s.records.iter().map(|(&o, &k)| (o, k)).collect();
            (s.file.clone(), s.path.clone(), live)
        };
        // key, old offset, new segment, new offset: each reserved (in flight) until the end.
        let mut moved: Vec<(PrefixKey, u64, u32, u64)> = Vec::new();
        let mut written = BTreeSet::new();
        let mut copied = 0u64;
        let res = self.copy_forward(id, &src, &src_path, live, &mut moved, &mut written);
        let res = res.and_then(|c| {
            copied = c;
            self.sync_segments(&written)
        });
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        for (_, _, seg, _) in &moved {
            if let Some(s) = inner.segments.get_mut(seg) {
                s.pending -= 1;
            }
        }
        if let Err(e) = res {
            // The copies may not be on disk: the index keeps the source, and later records go to a
            // fresh segment (nothing is acknowledged beside bytes whose sync failed).
            if inner.active.is_some_and(|a| written.contains(&a)) {
                self.roll_segment(inner)?;
            }
            return Err(e);
        }
        for (key, old_off, seg, at) in moved {
            let still = inner
                .index
                .get(&key)
                .is_some_and(|e| e.seg == id && e.offset == old_off);
            if still {
                let mut e = inner.remove_entry(&key).expect("present");
                e.seg = seg;
                e.offset = at;
                inner.insert_entry(key, e);
            }
        }
        // Anything left (a concurrent read dropped an entry in between) is no longer indexed.
        let left: Vec<PrefixKey> = inner
            .segments
            .get(&id)
            .map(|s| s.records.values().copied().collect())
            .unwrap_or_default();
        for k in left {
            inner.remove_entry(&k);
        }
        Self::delete_segment(&self.cfg, inner, id)?;
        inner.stats.compactions += 1;
        inner.stats.compacted_bytes += copied;
        Ok(())
    }

    /// Writes a copy of each still-indexed live record of segment `id` at the end of the active
    /// segment; returns the bytes copied. Every reserved copy is pushed to `moved` before it is
    /// written, so the caller can release the reservations whatever happens.
    fn copy_forward(
        &self,
        id: u32,
        src: &File,
        src_path: &Path,
        live: Vec<(u64, PrefixKey)>,
        moved: &mut Vec<(PrefixKey, u64, u32, u64)>,
        written: &mut BTreeSet<u32>,
    ) -> Result<u64> {
        let mut buf = Vec::new();
        let mut copied = 0u64;
        for (off, key) in live {
            let len = match self.inner.lock().index.get(&key) {
                Some(e) if e.seg == id && e.offset == off => e.len,
                _ => continue,
            };
            buf.resize(HEADER_BYTES + len as usize, 0);
            src.read_exact_at(&mut buf, off)
                .map_err(|e| Error::io(src_path, e))?;
            let ok = decode_header(&buf[..HEADER_BYTES]).is_ok_and(|h| {
                h.state == State::Live
                    && h.key == key
                    && h.len == len
                    && crc32c::crc32c(&buf[HEADER_BYTES..]) == h.payload_crc
            });
            if !ok {
                // Never copy damage forward: the entry goes, as a read would drop it.
                let mut inner = self.inner.lock();
                inner.stats.corrupt += 1;
                inner.remove_entry(&key);
                inner.stats.entries = inner.index.len() as u64;
                continue;
            }
            let (file, path, seg, at, _) = self.reserve(buf.len() as u64)?;
            moved.push((key, off, seg, at));
            written.insert(seg);
            write_record(&file, at, &buf, &[], self.cfg.io_chunk_bytes)
                .map_err(|e| Error::io(&path, e))?;
            copied += buf.len() as u64;
        }
        Ok(copied)
    }

    /// Reserves `rec` bytes at the end of the active segment (rolling it when full), as a record
    /// in flight: the caller releases it (`pending`) once the record is indexed or abandoned.
    fn reserve(&self, rec: u64) -> Result<(Arc<File>, PathBuf, u32, u64, u64)> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let full = inner
            .active
            .and_then(|a| inner.segments.get(&a))
            .is_none_or(|s| s.size >= self.cfg.segment_bytes);
        if full {
            self.roll_segment(inner)?;
        }
        let active = inner
            .active
            .ok_or_else(|| Error::Internal("a writable store without an active segment".into()))?;
        let s = inner
            .segments
            .get_mut(&active)
            .ok_or_else(|| Error::Internal(format!("active segment {active} is not open")))?;
        let offset = s.size;
        s.size += rec;
        s.pending += 1;
        let out = (s.file.clone(), s.path.clone(), active, offset, s.ino);
        inner.disk_bytes += rec;
        Ok(out)
    }

    /// Releases a reservation of segment `seg` made by [`SsdStore::reserve`].
    fn release(inner: &mut Inner, seg: u32) {
        if let Some(s) = inner.segments.get_mut(&seg) {
            s.pending -= 1;
        }
    }

    fn refuse_read_only(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::invalid(
                "ssd tier",
                format!(
                    "{} was opened read-only (SsdStore::open_read_only): writes are refused",
                    self.cfg.dir.display()
                ),
            ));
        }
        Ok(())
    }

    /// The error of a store that stopped accepting writes.
    fn broken_error(&self, why: &str) -> Error {
        Error::io(
            &self.cfg.dir,
            std::io::Error::new(
                ErrorKind::NotFound,
                format!(
                    "{why}; the store accepts no more writes (nothing written since was \
                     acknowledged). Reopen it to start over: the records of deleted files are \
                     gone with them"
                ),
            ),
        )
    }

    /// Refuses when the store stopped accepting writes, and stops it (naming why) when its
    /// directory is no longer the one it opened: a directory deleted, or deleted and made again,
    /// has lost the lock too, so writing on could mean two writers.
    fn check_dir(&self, inner: &mut Inner) -> Result<()> {
        if inner.broken.is_none() {
            match std::fs::metadata(&self.cfg.dir) {
                Ok(m) if m.ino() == self.dir_ino => return Ok(()),
                Ok(_) => {
                    inner.broken = Some(format!(
                        "the SSD tier's directory {} was replaced by another directory while \
                         the store was open",
                        self.cfg.dir.display()
                    ))
                }
                Err(e) => {
                    inner.broken = Some(format!(
                        "the SSD tier's directory {} is gone while the store was open ({e})",
                        self.cfg.dir.display()
                    ))
                }
            }
        }
        Err(self.broken_error(inner.broken.as_deref().unwrap_or_default()))
    }

    /// Stores `payload` under `key`. Returns `true` when written, `false` when the key was already
    /// present (keys name content, so nothing is rewritten; the entry's recency is refreshed).
    ///
    /// Errors: [`Error::Refused`] when the live records plus this one exceed the capacity even
    /// after evicting every entry past its minimum lifetime — nothing is evicted then (counted in
    /// [`SsdStats::refused`]); [`Error::Invalid`] for a payload over 4 GiB or larger than the
    /// whole tier, or on a read-only store; [`Error::Io`], also when the directory or the segment
    /// written was deleted or replaced while the store was open (the record is not acknowledged,
    /// and the store refuses every later write).
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
        self.refuse_read_only()?;
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
        let marked = {
            let mut guard = self.inner.lock();
            let inner = &mut *guard;
            if let Some(why) = &inner.broken {
                return Err(self.broken_error(why));
            }
            if inner.index.contains_key(key) {
                inner.touch(key);
                inner.stats.already_present += 1;
                return Ok(false);
            }
            let excess = (inner.live_bytes + rec).saturating_sub(self.cfg.capacity_bytes);
            let Some(victims) = self.plan_eviction(inner, excess) else {
                inner.stats.refused += 1;
                inner.stats.refused_bytes += rec;
                return Err(Error::Refused(format!(
                    "SSD tier full: {} of {} live bytes used, {} needed, and the entries past \
                     their {} h minimum lifetime would not free enough (nothing was evicted)",
                    inner.live_bytes,
                    self.cfg.capacity_bytes,
                    rec,
                    self.cfg.min_lifetime_ms as f64 / 3.6e6
                )));
            };
            let mut marked = BTreeSet::new();
            for k in victims {
                if let Some(seg) = self.drop_entry(inner, &k, true)? {
                    marked.insert(seg);
                }
                inner.stats.evicted += 1;
            }
            marked
        };
        self.sync_segments(&marked)?;
        self.compact_all()?;
        // Admitted. Only this writer adds bytes, so the room made above stays available while the
        // payload is produced outside the metadata lock.
        let mut owned = Vec::with_capacity(len);
        fill(&mut owned);
        if owned.len() != len {
            return Err(Error::shape("payload from fill", len, owned.len()));
        }
        let payload = &owned[..];
        let (file, path, seg, offset, ino) = self.reserve(rec)?;
        let created = self.age_ms();
        let header = encode_header(key, created, payload);
        // Header and payload go out in bounded pwrite calls; the index learns of the record only
        // after the last byte (and the sync), so no reader can see it half written.
        let mut res = write_record(&file, offset, &header, payload, self.cfg.io_chunk_bytes);
        if res.is_ok() && self.cfg.fsync == FsyncPolicy::Always {
            res = self.sync_file(&file);
        }
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        Self::release(inner, seg);
        if let Err(e) = res {
            // Later records go to a new segment (never beside bytes whose write or sync failed);
            // the recovery scan resynchronises past the gap.
            if inner.active == Some(seg) {
                self.roll_segment(inner)?;
            }
            return Err(Error::io(&path, e));
        }
        // Acknowledge only a record whose file is still where the store's directory has it: a
        // directory or segment deleted under the store would take it along unnoticed.
        self.check_dir(inner)?;
        if !Self::still_linked(&path, ino) {
            let why = format!(
                "the active segment {} was deleted or replaced while the store was open",
                path.display()
            );
            inner.broken = Some(why.clone());
            return Err(self.broken_error(&why));
        }
        let tick = inner.next_tick();
        inner.insert_entry(
            *key,
            Entry {
                seg,
                offset,
                len: len as u32,
                created,
                tick,
            },
        );
        inner.stats.puts += 1;
        inner.stats.put_bytes += rec;
        inner.stats.entries = inner.index.len() as u64;
        drop(guard);
        self.persist_age();
        Ok(true)
    }

    /// Removes `key` (its record is marked dead on disk, synced under [`FsyncPolicy::Always`]).
    /// Returns whether it was present. Segments left mostly dead are compacted.
    ///
    /// Errors: [`Error::Invalid`] on a read-only store; [`Error::Io`] (also once the store stopped
    /// accepting writes, see [`SsdStore::put`]).
    pub fn remove(&self, key: &PrefixKey) -> Result<bool> {
        self.refuse_read_only()?;
        let _w = self.writer.lock();
        let (present, marked) = {
            let mut inner = self.inner.lock();
            // A removal into a directory deleted under the store would be acknowledged for
            // nothing: refuse it as a put is refused.
            self.check_dir(&mut inner)?;
            let present = inner.index.contains_key(key);
            let seg = self.drop_entry(&mut inner, key, true)?;
            if present {
                inner.stats.removed += 1;
            }
            (present, seg.into_iter().collect::<BTreeSet<u32>>())
        };
        self.sync_segments(&marked)?;
        self.compact_all()?;
        self.persist_age();
        Ok(present)
    }

    /// Whether `key` is indexed (no I/O, no recency change).
    pub fn contains(&self, key: &PrefixKey) -> bool {
        self.inner.lock().index.contains_key(key)
    }

    /// Whether `key` is live on disk now: its segment is still the file the store opened and
    /// its record's header (64 bytes, read now) holds the key in the live state. The payload is
    /// not read (a read checks it). A key that fails is dropped from the index; a segment found
    /// deleted or replaced is dropped whole, with every entry in it, and its file closed. For a
    /// read-only store beside a writer, whose index is otherwise the directory at its open.
    ///
    /// Errors: [`Error::Io`] when the header cannot be read.
    pub fn probe(&self, key: &PrefixKey) -> Result<bool> {
        let (file, path, ino, e) = {
            let inner = self.inner.lock();
            let Some(e) = inner.index.get(key).cloned() else {
                return Ok(false);
            };
            let Some(s) = inner.segments.get(&e.seg) else {
                return Ok(false);
            };
            (s.file.clone(), s.path.clone(), s.ino, e)
        };
        if !Self::still_linked(&path, ino) {
            let mut guard = self.inner.lock();
            let inner = &mut *guard;
            if inner.segments.get(&e.seg).is_some_and(|s| s.ino == ino) && self.read_only {
                if let Some(s) = inner.segments.remove(&e.seg) {
                    inner.disk_bytes -= s.size;
                    for k in s.records.values() {
                        inner.remove_entry(k);
                    }
                }
                inner.stats.entries = inner.index.len() as u64;
            } else {
                drop(guard);
                self.forget(key, &e);
            }
            return Ok(false);
        }
        let mut h = [0u8; HEADER_BYTES];
        let live = match file.read_exact_at(&mut h, e.offset) {
            Ok(()) => decode_header(&h)
                .is_ok_and(|h| h.key == *key && h.len == e.len && h.state == State::Live),
            Err(err) if err.kind() == ErrorKind::UnexpectedEof => false,
            Err(err) => return Err(Error::io(&path, err)),
        };
        if !live {
            let mut inner = self.inner.lock();
            if inner
                .index
                .get(key)
                .is_some_and(|cur| cur.seg == e.seg && cur.offset == e.offset)
            {
                inner.remove_entry(key);
                inner.stats.entries = inner.index.len() as u64;
            }
        }
        Ok(live)
    }

    /// Brings a read-only store's index up to the directory now, reading only what changed since
    /// its open or its last refresh: segments deleted or replaced are dropped (entries and open
    /// file), records appended to a segment it knows and segments created after it are indexed
    /// (headers only; a read checks the payload), newest record of a key deciding as on open.
    /// Records marked dead in place are not re-read here ([`SsdStore::probe`] does that per key).
    ///
    /// Errors: [`Error::Invalid`] on a writable store (its index is the directory);
    /// [`Error::Io`] when the directory cannot be listed or a segment read.
    pub fn refresh(&self) -> Result<RefreshReport> {
        if !self.read_only {
            return Err(Error::invalid(
                "ssd tier",
                "refresh is for a store opened read-only; a writable store's index is the directory",
            ));
        }
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let mut out = RefreshReport::default();
        let gone: Vec<u32> = inner
            .segments
            .iter()
            .filter(|(_, s)| !Self::still_linked(&s.path, s.ino))
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(s) = inner.segments.remove(&id) {
                inner.disk_bytes -= s.size;
                for k in s.records.values() {
                    inner.remove_entry(k);
                }
                out.segments_dropped += 1;
            }
        }
        let mut ids = Vec::new();
        for e in std::fs::read_dir(&self.cfg.dir).map_err(|e| Error::io(&self.cfg.dir, e))? {
            let e = e.map_err(|e| Error::io(&self.cfg.dir, e))?;
            if let Some(id) = parse_seg_name(&e.file_name().to_string_lossy()) {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        let top = inner.segments.last_key_value().map(|(&id, _)| id);
        let mut cfg = self.cfg.clone();
        cfg.verify_on_open = false;
        let mut rep = RecoveryReport::default();
        let mut fix = ScanFixes::default();
        let before = inner.index.len();
        for id in ids {
            if let Some(s) = inner.segments.get(&id) {
                let (file, path, from) = (s.file.clone(), s.path.clone(), s.size);
                let len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
                if len > from {
                    let (_, end) = Self::scan_records(
                        &cfg, id, &file, &path, from, len, false, true, inner, &mut rep, &mut fix,
                    )?;
                    if let Some(s) = inner.segments.get_mut(&id) {
                        s.size = end;
                    }
                    inner.disk_bytes += end - from;
                }
            } else if top.is_none_or(|t| id > t) {
                // A segment created since: its records are newer than every one indexed.
                match Self::scan_segment(
                    &cfg,
                    id,
                    false,
                    true,
                    inner,
                    &mut rep,
                    &mut fix,
                    &mut HashSet::new(),
                ) {
                    Ok(()) => out.segments_added += 1,
                    Err(Error::Io { source, .. }) if source.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            // An unknown id below the ones known was deleted before this store's open (or is a
            // foreign file); its records are not newer than those indexed, so it is not read.
        }
        inner.stats.entries = inner.index.len() as u64;
        out.records = inner.index.len();
        out.records_added = inner.index.len().saturating_sub(before);
        Ok(out)
    }

    /// Whether the file at `path` is still the segment opened as inode `ino`.
    fn still_linked(path: &Path, ino: u64) -> bool {
        std::fs::metadata(path).is_ok_and(|m| m.ino() == ino)
    }

    /// Reads the payload of `key`. `Ok(None)` when absent (or, read-only, when the writer has
    /// since evicted, removed or compacted it away; or when its segment file was deleted or
    /// replaced under the store).
    ///
    /// Errors: [`Error::Corrupt`] when the record fails a check (bad header, another key, unknown
    /// state word, payload CRC mismatch, short read); the entry is then dropped, so the next read
    /// is a miss. [`Error::Io`] for other I/O failures.
    pub fn get(&self, key: &PrefixKey) -> Result<Option<Vec<u8>>> {
        let (file, path, ino, e) = {
            let mut guard = self.inner.lock();
            let inner = &mut *guard;
            let Some(e) = inner.index.get(key).cloned() else {
                inner.stats.misses += 1;
                return Ok(None);
            };
            let Some(s) = inner.segments.get(&e.seg) else {
                return Err(Error::Internal(format!(
                    "the index points at segment {} which is not open",
                    e.seg
                )));
            };
            let found = (s.file.clone(), s.path.clone(), s.ino, e);
            inner.touch(key);
            found
        };
        // A segment deleted or replaced under the store (by the writer when this store is
        // read-only, or by anyone else) no longer holds the entry: never serve it.
        if !Self::still_linked(&path, ino) {
            return Ok(self.forget(key, &e));
        }
        let mut buf = vec![0u8; HEADER_BYTES + e.len as usize];
        let check = match file.read_exact_at(&mut buf, e.offset) {
            Ok(()) => match decode_header(&buf[..HEADER_BYTES]) {
                Err(BadHeader::Damaged(why)) => Err(why),
                Err(BadHeader::Version1) => Err("a version-1 header".to_string()),
                Err(BadHeader::Newer(v)) => Err(format!("a version-{v} header")),
                Ok(h) if h.key != *key => Err(format!("record holds key {:?}, not {key:?}", h.key)),
                Ok(h) if h.len != e.len => Err(format!("length {} != indexed {}", h.len, e.len)),
                Ok(h) => match h.state {
                    State::Dead => Ok(false),
                    State::Unknown(w) => Err(format!(
                        "state word {w:08x} is neither live nor dead (header CRC {:08x})",
                        h.hcrc
                    )),
                    State::Live => {
                        let c = crc32c::crc32c(&buf[HEADER_BYTES..]);
                        if c != h.payload_crc {
                            Err(format!(
                                "payload CRC32C {c:08x} != stored {:08x}",
                                h.payload_crc
                            ))
                        } else {
                            Ok(true)
                        }
                    }
                },
            },
            Err(err) if err.kind() == ErrorKind::UnexpectedEof => {
                Err("short read: record truncated".to_string())
            }
            Err(err) => return Err(Error::io(&path, err)),
        };
        match check {
            Ok(true) if Self::still_linked(&path, ino) => {
                self.inner.lock().stats.hits += 1;
                buf.drain(..HEADER_BYTES);
                Ok(Some(buf))
            }
            // Marked dead on disk (by this store's concurrent remove, or by the writer while this
            // store is read-only), or its segment went while we read: not served.
            Ok(_) => Ok(self.forget(key, &e)),
            Err(reason) => {
                let mut inner = self.inner.lock();
                inner.stats.corrupt += 1;
                // Drop the entry only if it still points at the record we read.
                if inner
                    .index
                    .get(key)
                    .is_some_and(|cur| cur.seg == e.seg && cur.offset == e.offset)
                {
                    self.drop_entry(&mut inner, key, false)?;
                }
                Err(Error::Corrupt {
                    path,
                    reason: format!("record at offset {}: {reason}", e.offset),
                })
            }
        }
    }

    /// Drops `key` from the index if it still points at `e` (the record is gone or dead on disk);
    /// counts a miss.
    fn forget(&self, key: &PrefixKey, e: &Entry) -> Option<Vec<u8>> {
        let mut inner = self.inner.lock();
        inner.stats.misses += 1;
        if inner
            .index
            .get(key)
            .is_some_and(|cur| cur.seg == e.seg && cur.offset == e.offset)
        {
            inner.remove_entry(key);
            inner.stats.entries = inner.index.len() as u64;
        }
        None
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

    /// Whether the store was opened with [`SsdStore::open_read_only`].
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }
}

impl Drop for SsdStore {
    fn drop(&mut self) {
        self.persist_age();
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
