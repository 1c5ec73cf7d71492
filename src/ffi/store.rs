//! The persistent tiers over the C ABI: the SSD tier for global KV ([`crate::store::ssd`]) and the
//! host-DRAM pool for encoder SWA snapshots ([`crate::store::dram`]), plus a manual clock that
//! tests and simulations inject into both.
//!
//! # Keys and payloads
//! A key is 32 bytes (`const uint8_t key[32]`), chosen by the caller: csa2 treats it as the name
//! of the content (a put of a present key writes nothing). Payloads are opaque bytes: the SSD tier
//! adds its CRC32C, lifetime and admission control around them and returns them byte for byte.
//!
//! # Reads
//! `csa2_ssd_get` / `csa2_dram_pool_get` copy the payload into a caller buffer of `cap` bytes and
//! set `*found` (1 hit, 0 miss) and `*len` (the payload's length, 0 on a miss). A miss is not an
//! error. A buffer too small for the payload is `CSA2_ERR_SHAPE` (the message gives the length)
//! and nothing is written. A damaged SSD record is `CSA2_ERR_CORRUPT`: it is never returned, and
//! the next read of that key is a miss.
//!
//! # Clocks
//! Every constructor takes an optional `Csa2Clock` (null: the system clock). A manual clock moves
//! only when `csa2_manual_clock_advance` is called, so a test can expire a DRAM snapshot (TTL) or
//! age SSD entries past their minimum lifetime without waiting.
//!
//! # Thread safety
//! Every handle may be used from several threads at once (the tiers lock internally).

use super::handle;
use super::{arg_out, arg_slice, arg_slice_mut, guarded, guarded_free, Csa2Status};
use crate::cache::PrefixKey;
use crate::error::{Error, Result};
use crate::store::{
    Clock, DramConfig, DramPool, DramStats, FsyncPolicy, ManualClock, RecoveryReport, Snapshot,
    SsdConfig, SsdStats, SsdStore, SystemClock,
};
use std::ffi::{c_char, CStr};
use std::sync::Arc;

/// Opaque manual clock handle (milliseconds; never goes backwards). Free with
/// [`csa2_manual_clock_free`]; the tiers built on it keep their own reference.
pub struct Csa2Clock {
    c: Arc<ManualClock>,
}

/// Opaque SSD-tier handle. Free with [`csa2_ssd_free`] (this releases the directory's lock).
pub struct Csa2SsdStore {
    s: SsdStore,
}

/// Opaque DRAM snapshot pool handle. Free with [`csa2_dram_pool_free`].
pub struct Csa2DramPool {
    p: DramPool,
}

handle_type!(Csa2Clock, 0xC5);

handle_type!(Csa2SsdStore, 0xC6);

handle_type!(Csa2DramPool, 0xC7);

/// When SSD writes reach stable storage (pass as `int32_t`; see `FsyncPolicy`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csa2Fsync {
    /// `fdatasync` before every acknowledgement (survives power loss).
    Csa2FsyncAlways = 0,
    /// No sync: survives a process crash, not a power loss.
    Csa2FsyncNever = 1,
}

/// Arguments of [`csa2_ssd_open`], under the header's args-struct rules: set `struct_size =
/// sizeof(Csa2SsdOpenArgs)`; a shorter struct (at least up to `capacity_bytes`) is read up to its
/// own size, the members past it taking their defaults; bytes past this build's size are ignored.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Csa2SsdOpenArgs {
    /// `sizeof(Csa2SsdOpenArgs)` as the caller compiled it.
    pub struct_size: usize,
    /// The directory, a NUL-terminated UTF-8 path (created if absent, unless read-only).
    pub dir: *const c_char,
    /// Most bytes of live records (64-B headers included), > 0.
    pub capacity_bytes: u64,
    /// Minimum lifetime of an entry in ms of store age; 0 means the default, 72 h.
    pub min_lifetime_ms: u64,
    /// Segment file size in bytes; 0 means the default, 16 MiB.
    pub segment_bytes: u64,
    /// A `Csa2Fsync` value.
    pub fsync: i32,
    /// 1: verify every payload checksum on open (the default behaviour); 0: headers only.
    pub verify_on_open: u8,
    /// 1: open without the lock, never writing (puts are refused); 0: the one writer.
    pub read_only: u8,
    /// Time source, or null for the system clock.
    pub clock: *const Csa2Clock,
}

/// What opening an SSD tier found (see `RecoveryReport`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2SsdRecovery {
    /// Segment files scanned.
    pub segments: u64,
    /// Live records indexed.
    pub records: u64,
    /// Records marked dead or superseded.
    pub dead_records: u64,
    /// Damaged records (not indexed).
    pub corrupt_records: u64,
    /// Bytes cut off the newest segment (a record torn by a crash).
    pub torn_bytes_truncated: u64,
    /// Damaged bytes left in place for compaction.
    pub damaged_bytes: u64,
    /// Store age at open, ms.
    pub age_ms: u64,
    /// Downtime credited to the store age, ms.
    pub offline_credit_ms: u64,
}

impl From<&RecoveryReport> for Csa2SsdRecovery {
    fn from(r: &RecoveryReport) -> Self {
        Csa2SsdRecovery {
            segments: r.segments as u64,
            records: r.records as u64,
            dead_records: r.dead_records as u64,
            corrupt_records: r.corrupt_records as u64,
            torn_bytes_truncated: r.torn_bytes_truncated,
            damaged_bytes: r.damaged_bytes,
            age_ms: r.age_ms,
            offline_credit_ms: r.offline_credit_ms,
        }
    }
}

/// Counters (monotonic since open) and sizes of an SSD tier (see `SsdStats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2SsdStats {
    /// Records written.
    pub puts: u64,
    /// Bytes written (headers included).
    pub put_bytes: u64,
    /// Puts of a key already present (nothing written).
    pub already_present: u64,
    /// Writes refused by admission control (every entry still inside its minimum lifetime).
    pub refused: u64,
    /// Bytes of refused writes.
    pub refused_bytes: u64,
    /// Entries evicted past their minimum lifetime.
    pub evicted: u64,
    /// Entries removed.
    pub removed: u64,
    /// Segments compacted.
    pub compactions: u64,
    /// Reads that returned data.
    pub hits: u64,
    /// Reads of absent keys.
    pub misses: u64,
    /// Reads that found a damaged record (never returned).
    pub corrupt: u64,
    /// Live entries.
    pub entries: u64,
    /// Bytes of live records.
    pub live_bytes: u64,
    /// Bytes of the segment files.
    pub disk_bytes: u64,
    /// 1 when the store was opened read-only.
    pub read_only: u8,
}

impl Csa2SsdStats {
    fn of(s: &SsdStats, read_only: bool) -> Self {
        Csa2SsdStats {
            puts: s.puts,
            put_bytes: s.put_bytes,
            already_present: s.already_present,
            refused: s.refused,
            refused_bytes: s.refused_bytes,
            evicted: s.evicted,
            removed: s.removed,
            compactions: s.compactions,
            hits: s.hits,
            misses: s.misses,
            corrupt: s.corrupt,
            entries: s.entries,
            live_bytes: s.live_bytes,
            disk_bytes: s.disk_bytes,
            read_only: read_only as u8,
        }
    }
}

/// Counters and sizes of a DRAM pool (see `DramStats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Csa2DramStats {
    /// Snapshots stored.
    pub puts: u64,
    /// Reads that returned a snapshot.
    pub hits: u64,
    /// Reads that found nothing (absent or expired).
    pub misses: u64,
    /// Of `misses`, reads that found an expired snapshot (refused and removed).
    pub expired_on_read: u64,
    /// Expired snapshots reclaimed by a sweep or a put.
    pub expired_reclaimed: u64,
    /// Live snapshots evicted for room (least recently used first).
    pub evictions: u64,
    /// Snapshots larger than the whole pool (refused).
    pub refused: u64,
    /// Snapshots held.
    pub entries: u64,
    /// Bytes held.
    pub bytes: u64,
}

impl From<&DramStats> for Csa2DramStats {
    fn from(s: &DramStats) -> Self {
        Csa2DramStats {
            puts: s.puts,
            hits: s.hits,
            misses: s.misses,
            expired_on_read: s.expired_on_read,
            expired_reclaimed: s.expired_reclaimed,
            evictions: s.evictions,
            refused: s.refused,
            entries: s.entries,
            bytes: s.bytes,
        }
    }
}

/// The clock behind an optional handle (null: the system clock).
fn clock_arg(p: *const Csa2Clock) -> Result<Arc<dyn Clock>> {
    if p.is_null() {
        return Ok(Arc::new(SystemClock));
    }
    let c = handle::get(p, "clock")?;
    Ok(c.c.clone() as Arc<dyn Clock>)
}

/// The 32-byte key at `p`.
///
/// # Safety
/// A non-null `p` must point to 32 readable bytes.
unsafe fn key_arg(p: *const u8) -> Result<PrefixKey> {
    // SAFETY: length 32 is this function's contract with the caller.
    let s = unsafe { arg_slice(p, 32, "key") }?;
    let mut k = [0u8; 32];
    k.copy_from_slice(s);
    Ok(PrefixKey(k))
}

/// The live handle `h` (named `what` in errors) and the 32-byte key at `key`: the two checks every
/// keyed call of both tiers starts with.
///
/// # Safety
/// A non-null `key` must point to 32 readable bytes.
unsafe fn keyed<T: handle::Handle>(
    h: *const T,
    what: &'static str,
    key: *const u8,
) -> Result<(Arc<T>, PrefixKey)> {
    let h = handle::get(h, what)?;
    // SAFETY: this function's contract.
    Ok((h, unsafe { key_arg(key) }?))
}

/// Writes `v` to the optional output `p`; a null `p` means the caller does not want it.
///
/// # Safety
/// `p` must be null or writable.
unsafe fn write_opt<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: non-null and writable by contract.
        unsafe { *p = v };
    }
}

/// Copies `payload` into the caller's buffer, or refuses (nothing written) when it does not fit.
///
/// # Safety
/// `buf` must have room for `cap` bytes; `len` and `found` must be null or writable.
unsafe fn copy_out(
    payload: Option<&[u8]>,
    size: usize,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
    found: *mut u8,
) -> Result<()> {
    // SAFETY: the caller's contract, checked for null here.
    let len = unsafe { arg_out(len, "len") }?;
    let found = unsafe { arg_out(found, "found") }?;
    if let Some(bytes) = payload {
        if bytes.len() > cap {
            return Err(Error::shape("buf (cap, payload bytes)", bytes.len(), cap));
        }
        // SAFETY: room for `cap` ≥ bytes.len() bytes is the caller's contract.
        let out = unsafe { arg_slice_mut(buf, bytes.len(), "buf") }?;
        out.copy_from_slice(bytes);
    }
    *len = size;
    *found = (size > 0 || payload.is_some()) as u8;
    Ok(())
}

// ---- manual clock -------------------------------------------------------------------------------

/// Creates a manual clock reading `start_ms` (its wall and monotonic readings are the same value).
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_manual_clock_new(
    start_ms: u64,
    out: *mut *mut Csa2Clock,
) -> Csa2Status {
    guarded("csa2_manual_clock_new", || {
        // SAFETY: the caller's contract.
        let out = unsafe { arg_out(out, "out") }?;
        *out = handle::register(Csa2Clock {
            c: Arc::new(ManualClock::new(start_ms)),
        })?;
        Ok(())
    })
}

/// Moves a manual clock forward by `ms` milliseconds (saturating at 2^64 − 1).
///
/// # Safety
/// None beyond a valid or null handle (anything else is refused, not undefined).
#[no_mangle]
pub unsafe extern "C" fn csa2_manual_clock_advance(clock: *const Csa2Clock, ms: u64) -> Csa2Status {
    guarded("csa2_manual_clock_advance", || {
        let c = handle::get(clock, "clock")?;
        let now = c.c.now_ms();
        c.c.set(now.saturating_add(ms));
        Ok(())
    })
}

/// The clock's reading in ms into `*now_ms`.
///
/// # Safety
/// `now_ms` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_manual_clock_now(
    clock: *const Csa2Clock,
    now_ms: *mut u64,
) -> Csa2Status {
    guarded("csa2_manual_clock_now", || {
        let c = handle::get(clock, "clock")?;
        // SAFETY: the caller's contract.
        *unsafe { arg_out(now_ms, "now_ms") }? = c.c.now_ms();
        Ok(())
    })
}

/// Frees a clock handle (null is a no-op). Tiers built on it keep working with it.
///
/// # Safety
/// None beyond a valid or null handle.
#[no_mangle]
pub unsafe extern "C" fn csa2_manual_clock_free(clock: *mut Csa2Clock) -> Csa2Status {
    guarded_free("csa2_manual_clock_free", || handle::free(clock, "clock"))
}

// ---- SSD tier -----------------------------------------------------------------------------------

// SAFETY: repr(C), `struct_size: usize` first, every field a raw pointer or a number. The first
// version a caller must pass covers `dir` and `capacity_bytes`.
unsafe impl super::ArgsStruct for Csa2SsdOpenArgs {
    const NAME: &'static str = "Csa2SsdOpenArgs";
    const V1_SIZE: usize = std::mem::offset_of!(Csa2SsdOpenArgs, min_lifetime_ms);
}

/// `args` under the shared args-struct rules ([`super::read_args`]); a member past the caller's
/// `struct_size` reads as zero, which means its default for every member but `verify_on_open`,
/// whose default (verify) is 1.
///
/// # Safety
/// As [`super::read_args`].
unsafe fn read_open_args(args: *const Csa2SsdOpenArgs) -> Result<Csa2SsdOpenArgs> {
    // SAFETY: forwarded from the caller's contract.
    let mut v = unsafe { super::read_args(args) }?;
    if v.struct_size <= std::mem::offset_of!(Csa2SsdOpenArgs, verify_on_open) {
        v.verify_on_open = 1;
    }
    Ok(v)
}

/// Opens the SSD tier in `args->dir` (see `Csa2SsdOpenArgs`), rebuilding its index from the
/// segment files. A writable open takes the directory's exclusive lock; a second writer (another
/// process, or this one twice) is `CSA2_ERR_BUSY` naming the holder's pid, and may open read-only
/// instead. `CSA2_ERR_BUSY` means only that: any other failure (a missing or unreadable
/// directory, a segment that cannot be read, a directory of another format) is another status.
/// `report` (may be null) receives what recovery found (damaged records are not errors).
///
/// Errors: `CSA2_ERR_NULL_POINTER`; `CSA2_ERR_BUSY`; `CSA2_ERR_INVALID_ARGUMENT` (bad
/// `struct_size`, zero capacity, non-UTF-8 path, unknown `fsync`, a directory of format version 1
/// or of a newer version than this build's, a segment name that is not a regular file);
/// `CSA2_ERR_IO`.
///
/// # Safety
/// `args` must point to a `Csa2SsdOpenArgs` of `struct_size` bytes whose `dir` is NUL-terminated;
/// `report` and `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_ssd_open(
    args: *const Csa2SsdOpenArgs,
    report: *mut Csa2SsdRecovery,
    out: *mut *mut Csa2SsdStore,
) -> Csa2Status {
    guarded("csa2_ssd_open", || {
        // SAFETY: the caller's contract.
        let a = unsafe { read_open_args(args) }?;
        let out = unsafe { arg_out(out, "out") }?;
        if a.dir.is_null() {
            return Err(Error::NullPointer("args.dir"));
        }
        // SAFETY: NUL-terminated by contract.
        let dir = unsafe { CStr::from_ptr(a.dir) }
            .to_str()
            .map_err(|e| Error::invalid("args.dir", format!("not UTF-8: {e}")))?;
        let mut cfg = SsdConfig::new(dir, a.capacity_bytes);
        if a.min_lifetime_ms > 0 {
            cfg.min_lifetime_ms = a.min_lifetime_ms;
        }
        if a.segment_bytes > 0 {
            cfg.segment_bytes = a.segment_bytes;
        }
        cfg.fsync = match a.fsync {
            0 => FsyncPolicy::Always,
            1 => FsyncPolicy::Never,
            v => {
                return Err(Error::invalid(
                    "args.fsync",
                    format!("must be 0 (always) or 1 (never), found {v}"),
                ))
            }
        };
        cfg.verify_on_open = a.verify_on_open != 0;
        let clock = clock_arg(a.clock)?;
        let (s, rep) = if a.read_only != 0 {
            SsdStore::open_read_only(cfg, clock)?
        } else {
            SsdStore::open(cfg, clock)?
        };
        // SAFETY: null or writable is the caller's contract.
        unsafe { write_opt(report, Csa2SsdRecovery::from(&rep)) };
        *out = handle::register(Csa2SsdStore { s })?;
        Ok(())
    })
}

/// Closes the tier (pending state marks are synced per the fsync policy; the lock is released when
/// the last in-flight call on the handle returns). Null is a no-op.
///
/// # Safety
/// None beyond a valid or null handle.
#[no_mangle]
pub unsafe extern "C" fn csa2_ssd_free(store: *mut Csa2SsdStore) -> Csa2Status {
    guarded_free("csa2_ssd_free", || handle::free(store, "store"))
}

/// Stores `len` bytes under `key`. `*written` (may be null) is 1 when written, 0 when the key was
/// already present (nothing rewritten; its recency is refreshed).
///
/// Errors: `CSA2_ERR_REFUSED` when the tier is full of entries still inside their minimum lifetime
/// (nothing was evicted); `CSA2_ERR_INVALID_ARGUMENT` for a read-only store or a payload over
/// 4 GiB or larger than the tier; `CSA2_ERR_IO`, also when the directory or the segment written
/// was deleted or replaced under the open store (nothing is acknowledged then, and every later
/// put and remove is refused the same way until the store is reopened).
///
/// # Safety
/// `key` must point to 32 bytes, `data` to `len` bytes; `written` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_ssd_put(
    store: *const Csa2SsdStore,
    key: *const u8,
    data: *const u8,
    len: usize,
    written: *mut u8,
) -> Csa2Status {
    guarded("csa2_ssd_put", || {
        // SAFETY: the caller's contract.
        let (st, k) = unsafe { keyed(store, "store", key) }?;
        let d = unsafe { arg_slice(data, len, "data") }?;
        let w = st.s.put(&k, d)?;
        // SAFETY: null or writable is the caller's contract.
        unsafe { write_opt(written, w as u8) };
        Ok(())
    })
}

/// Reads the payload of `key` into `buf` (module docs, "Reads").
///
/// Errors: `CSA2_ERR_CORRUPT` (damaged record, dropped: the next read misses); `CSA2_ERR_SHAPE`
/// when `cap` is smaller than the payload; `CSA2_ERR_IO`.
///
/// # Safety
/// `key` must point to 32 bytes, `buf` to `cap` writable bytes; `len`, `found` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_ssd_get(
    store: *const Csa2SsdStore,
    key: *const u8,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
    found: *mut u8,
) -> Csa2Status {
    guarded("csa2_ssd_get", || {
        // SAFETY: the caller's contract.
        let (st, k) = unsafe { keyed(store, "store", key) }?;
        let got = st.s.get(&k)?;
        let n = got.as_ref().map_or(0, Vec::len);
        // SAFETY: the caller's contract.
        unsafe { copy_out(got.as_deref(), n, buf, cap, len, found) }
    })
}

/// `*found` = 1 when `key` is indexed (no I/O, no recency change).
///
/// # Safety
/// `key` must point to 32 bytes; `found` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_ssd_contains(
    store: *const Csa2SsdStore,
    key: *const u8,
    found: *mut u8,
) -> Csa2Status {
    guarded("csa2_ssd_contains", || {
        // SAFETY: the caller's contract.
        let (st, k) = unsafe { keyed(store, "store", key) }?;
        *unsafe { arg_out(found, "found") }? = st.s.contains(&k) as u8;
        Ok(())
    })
}

/// `*found` = 1 when `key` is live on disk now: its segment file is still the one opened and
/// its record's header (64 bytes, read now; not the payload) holds the key in the live state. A
/// key that fails is dropped, and a segment found deleted or replaced is dropped whole (its file
/// closed). For a read-only store beside a writer, whose index is otherwise the directory as it
/// was at open.
///
/// Errors: `CSA2_ERR_IO` when the header cannot be read.
///
/// # Safety
/// `key` must point to 32 bytes; `found` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_ssd_probe(
    store: *const Csa2SsdStore,
    key: *const u8,
    found: *mut u8,
) -> Csa2Status {
    guarded("csa2_ssd_probe", || {
        // SAFETY: the caller's contract.
        let (st, k) = unsafe { keyed(store, "store", key) }?;
        let out = unsafe { arg_out(found, "found") }?;
        *out = st.s.probe(&k)? as u8;
        Ok(())
    })
}

/// Brings a read-only store's index up to its directory now, reading only what changed: segments
/// deleted or replaced since are dropped (their files closed), records written since (appended
/// to a known segment or in a new one) are indexed, headers only (a read checks the payload).
/// `*records` (may be null) receives the live entries after it.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` on a writable store; `CSA2_ERR_IO`.
///
/// # Safety
/// `records` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_ssd_refresh(
    store: *const Csa2SsdStore,
    records: *mut u64,
) -> Csa2Status {
    guarded("csa2_ssd_refresh", || {
        let st = handle::get(store, "store")?;
        let r = st.s.refresh()?;
        // SAFETY: null or writable is the caller's contract.
        unsafe { write_opt(records, r.records as u64) };
        Ok(())
    })
}

/// Removes `key` (marked dead on disk). `*removed` (may be null) is 1 when it was present.
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` on a read-only store; `CSA2_ERR_IO`.
///
/// # Safety
/// `key` must point to 32 bytes; `removed` null or writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_ssd_remove(
    store: *const Csa2SsdStore,
    key: *const u8,
    removed: *mut u8,
) -> Csa2Status {
    guarded("csa2_ssd_remove", || {
        // SAFETY: the caller's contract.
        let (st, k) = unsafe { keyed(store, "store", key) }?;
        let r = st.s.remove(&k)?;
        // SAFETY: null or writable is the caller's contract.
        unsafe { write_opt(removed, r as u8) };
        Ok(())
    })
}

/// Counters and sizes of the tier now.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_ssd_stats(
    store: *const Csa2SsdStore,
    out: *mut Csa2SsdStats,
) -> Csa2Status {
    guarded("csa2_ssd_stats", || {
        let st = handle::get(store, "store")?;
        // SAFETY: the caller's contract.
        *unsafe { arg_out(out, "out") }? = Csa2SsdStats::of(&st.s.stats(), st.s.is_read_only());
        Ok(())
    })
}

// ---- DRAM snapshot pool -------------------------------------------------------------------------

/// Total host memory in bytes (`MemTotal` of `/proc/meminfo`), for the default pool size of 10 %.
///
/// Errors: `CSA2_ERR_UNSUPPORTED` when it cannot be read.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_host_memory_bytes(out: *mut u64) -> Csa2Status {
    guarded("csa2_host_memory_bytes", || {
        // SAFETY: the caller's contract.
        *unsafe { arg_out(out, "out") }? = crate::store::dram::host_memory_bytes()?;
        Ok(())
    })
}

/// Creates a DRAM snapshot pool of `capacity_bytes` whose snapshots expire `ttl_ms` after they
/// were stored (an expired snapshot is never served), on `clock` (null: the system clock).
///
/// Errors: `CSA2_ERR_INVALID_ARGUMENT` for a zero capacity or TTL.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_dram_pool_new(
    capacity_bytes: u64,
    ttl_ms: u64,
    clock: *const Csa2Clock,
    out: *mut *mut Csa2DramPool,
) -> Csa2Status {
    guarded("csa2_dram_pool_new", || {
        // SAFETY: the caller's contract.
        let out = unsafe { arg_out(out, "out") }?;
        let p = DramPool::new(
            DramConfig {
                capacity_bytes,
                ttl_ms,
            },
            clock_arg(clock)?,
        )?;
        *out = handle::register(Csa2DramPool { p })?;
        Ok(())
    })
}

/// Frees a pool and every snapshot it holds (null is a no-op).
///
/// # Safety
/// None beyond a valid or null handle.
#[no_mangle]
pub unsafe extern "C" fn csa2_dram_pool_free(pool: *mut Csa2DramPool) -> Csa2Status {
    guarded_free("csa2_dram_pool_free", || handle::free(pool, "pool"))
}

/// Stores a copy of `len` bytes under `key` (replacing an older snapshot), expiring TTL from now.
/// Expired snapshots are reclaimed first, then the least recently used until it fits.
///
/// Errors: `CSA2_ERR_REFUSED` for a snapshot larger than the whole pool (nothing evicted);
/// `CSA2_ERR_OUT_OF_MEMORY` when the copy cannot be allocated.
///
/// # Safety
/// `key` must point to 32 bytes, `data` to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn csa2_dram_pool_put(
    pool: *const Csa2DramPool,
    key: *const u8,
    data: *const u8,
    len: usize,
) -> Csa2Status {
    guarded("csa2_dram_pool_put", || {
        // SAFETY: the caller's contract.
        let (p, k) = unsafe { keyed(pool, "pool", key) }?;
        let d = unsafe { arg_slice(data, len, "data") }?;
        if len as u64 > p.p.config().capacity_bytes {
            // Refused by the pool below without copying; skip the allocation.
            return p.p.put(k, Snapshot::Sized(len));
        }
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|_| Error::oom("DRAM snapshot copy", len))?;
        v.extend_from_slice(d);
        p.p.put(k, Snapshot::Bytes(v.into()))
    })
}

/// Records a snapshot of `len` bytes under `key` without holding any bytes: the pool's capacity,
/// TTL and LRU decisions are made exactly as for [`csa2_dram_pool_put`]. For a scheduler that
/// mirrors a pool living in another process, and for simulations.
///
/// Errors: as [`csa2_dram_pool_put`].
///
/// # Safety
/// `key` must point to 32 bytes.
#[no_mangle]
pub unsafe extern "C" fn csa2_dram_pool_put_sized(
    pool: *const Csa2DramPool,
    key: *const u8,
    len: u64,
) -> Csa2Status {
    guarded("csa2_dram_pool_put_sized", || {
        // SAFETY: the caller's contract.
        let (p, k) = unsafe { keyed(pool, "pool", key) }?;
        let len = usize::try_from(len)
            .map_err(|_| Error::invalid("len", format!("{len} does not fit usize")))?;
        p.p.put(k, Snapshot::Sized(len))
    })
}

/// Reads the snapshot under `key` into `buf` (module docs, "Reads"); an expired one is removed and
/// reported as a miss. A size-only snapshot ([`csa2_dram_pool_put_sized`]) is a hit with `*len` set
/// and nothing copied (`buf` may then be null). A hit refreshes the snapshot's recency.
///
/// Errors: `CSA2_ERR_SHAPE` when `cap` is smaller than the snapshot (the snapshot stays).
///
/// # Safety
/// `key` must point to 32 bytes, `buf` to `cap` writable bytes; `len`, `found` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_dram_pool_get(
    pool: *const Csa2DramPool,
    key: *const u8,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
    found: *mut u8,
) -> Csa2Status {
    guarded("csa2_dram_pool_get", || {
        // SAFETY: the caller's contract.
        let (p, k) = unsafe { keyed(pool, "pool", key) }?;
        match p.p.get(&k) {
            None => unsafe { copy_out(None, 0, buf, cap, len, found) },
            Some(Snapshot::Sized(n)) => {
                // SAFETY: the caller's contract.
                let len = unsafe { arg_out(len, "len") }?;
                let found = unsafe { arg_out(found, "found") }?;
                *len = n;
                *found = 1;
                Ok(())
            }
            // SAFETY: the caller's contract.
            Some(Snapshot::Bytes(b)) => unsafe {
                copy_out(Some(&b), b.len(), buf, cap, len, found)
            },
        }
    })
}

/// `*found` = 1 when `key` holds a snapshot that has not expired (no recency or counter change).
///
/// # Safety
/// `key` must point to 32 bytes; `found` writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_dram_pool_contains(
    pool: *const Csa2DramPool,
    key: *const u8,
    found: *mut u8,
) -> Csa2Status {
    guarded("csa2_dram_pool_contains", || {
        // SAFETY: the caller's contract.
        let (p, k) = unsafe { keyed(pool, "pool", key) }?;
        *unsafe { arg_out(found, "found") }? = p.p.contains(&k) as u8;
        Ok(())
    })
}

/// Reclaims every expired snapshot now.
///
/// # Safety
/// None beyond a valid or null handle.
#[no_mangle]
pub unsafe extern "C" fn csa2_dram_pool_sweep(pool: *const Csa2DramPool) -> Csa2Status {
    guarded("csa2_dram_pool_sweep", || {
        handle::get(pool, "pool")?.p.sweep();
        Ok(())
    })
}

/// Counters and sizes of the pool now.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn csa2_dram_pool_stats(
    pool: *const Csa2DramPool,
    out: *mut Csa2DramStats,
) -> Csa2Status {
    guarded("csa2_dram_pool_stats", || {
        let p = handle::get(pool, "pool")?;
        // SAFETY: the caller's contract.
        *unsafe { arg_out(out, "out") }? = Csa2DramStats::from(&p.p.stats());
        Ok(())
    })
}
