"""ctypes face of csa2's persistent tiers (``src/ffi/store.rs`` in ``include/csa2.h``).

* :class:`SsdStore` — the SSD tier for global KV: append-only segments, CRC32C per record, one
  writer per directory (an exclusive lock; a second opener is refused and may open read-only),
  live-byte capacity with compaction, a minimum lifetime (72 h by default) with admission control.
* :class:`DramPool` — the host-DRAM pool for SWA snapshots: capacity, TTL, LRU; an expired
  snapshot is never served. :meth:`DramPool.put_sized` records a snapshot's size only, so a
  scheduler can mirror a pool that lives in a worker process and make the same decisions.
* :class:`ManualClock` — injected time for tests and simulations.

Keys are 32 bytes; payloads are bytes-like objects or raw ``(address, length)`` pairs (a CPU torch
tensor's ``data_ptr()``), copied during the call only.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, fields

from ._lib import Csa2Error, _Handle, check, lib

__all__ = ["ManualClock", "SsdStore", "DramPool", "SsdStats", "DramStats", "SsdRecovery",
           "host_memory_bytes", "FSYNC_ALWAYS", "FSYNC_NEVER", "STATUS_CORRUPT", "STATUS_REFUSED",
           "STATUS_IO", "STATUS_BUSY"]

FSYNC_ALWAYS, FSYNC_NEVER = 0, 1
STATUS_CORRUPT, STATUS_REFUSED, STATUS_BUSY, STATUS_IO = 301, 303, 304, 400

_P = ctypes.c_void_p
_U8P = ctypes.POINTER(ctypes.c_uint8)
_SZP = ctypes.POINTER(ctypes.c_size_t)
_S = ctypes.c_int32


class _OpenArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("dir", ctypes.c_char_p),
                ("capacity_bytes", ctypes.c_uint64), ("min_lifetime_ms", ctypes.c_uint64),
                ("segment_bytes", ctypes.c_uint64), ("fsync", ctypes.c_int32),
                ("verify_on_open", ctypes.c_uint8), ("read_only", ctypes.c_uint8),
                ("clock", _P)]


class _Recovery(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "segments", "records", "dead_records", "corrupt_records", "torn_bytes_truncated",
        "damaged_bytes", "age_ms", "offline_credit_ms")]


class _SsdStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "puts", "put_bytes", "already_present", "refused", "refused_bytes", "evicted", "removed",
        "compactions", "hits", "misses", "corrupt", "entries", "live_bytes", "disk_bytes")] + [
        ("read_only", ctypes.c_uint8)]


class _DramStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "puts", "hits", "misses", "expired_on_read", "expired_reclaimed", "evictions", "refused",
        "entries", "bytes")]


_SIGNATURES = {
    "csa2_manual_clock_new": [ctypes.c_uint64, ctypes.POINTER(_P)],
    "csa2_manual_clock_advance": [_P, ctypes.c_uint64],
    "csa2_manual_clock_now": [_P, ctypes.POINTER(ctypes.c_uint64)],
    "csa2_manual_clock_free": [_P],
    "csa2_ssd_open": [ctypes.POINTER(_OpenArgs), ctypes.POINTER(_Recovery), ctypes.POINTER(_P)],
    "csa2_ssd_free": [_P],
    "csa2_ssd_put": [_P, _P, _P, ctypes.c_size_t, _U8P],
    "csa2_ssd_get": [_P, _P, _P, ctypes.c_size_t, _SZP, _U8P],
    "csa2_ssd_contains": [_P, _P, _U8P],
    "csa2_ssd_probe": [_P, _P, _U8P],
    "csa2_ssd_refresh": [_P, ctypes.POINTER(ctypes.c_uint64)],
    "csa2_ssd_remove": [_P, _P, _U8P],
    "csa2_ssd_stats": [_P, ctypes.POINTER(_SsdStats)],
    "csa2_host_memory_bytes": [ctypes.POINTER(ctypes.c_uint64)],
    "csa2_dram_pool_new": [ctypes.c_uint64, ctypes.c_uint64, _P, ctypes.POINTER(_P)],
    "csa2_dram_pool_free": [_P],
    "csa2_dram_pool_put": [_P, _P, _P, ctypes.c_size_t],
    "csa2_dram_pool_put_sized": [_P, _P, ctypes.c_uint64],
    "csa2_dram_pool_get": [_P, _P, _P, ctypes.c_size_t, _SZP, _U8P],
    "csa2_dram_pool_contains": [_P, _P, _U8P],
    "csa2_dram_pool_sweep": [_P],
    "csa2_dram_pool_stats": [_P, ctypes.POINTER(_DramStats)],
}
_bound = False


def _lib():
    global _bound
    h = lib()
    if not _bound:
        for name, args in _SIGNATURES.items():
            fn = getattr(h, name)
            fn.argtypes = args
            fn.restype = _S
        _bound = True
    return h


def _call(name: str, *args) -> None:
    check(getattr(_lib(), name)(*args), name)


def _key(k: bytes) -> ctypes.Array:
    if len(k) != 32:
        raise ValueError(f"a csa2 store key is 32 bytes, found {len(k)}")
    return ctypes.create_string_buffer(bytes(k), 32)


def _src(data) -> tuple[int | None, int, object]:
    """(address, length, keep-alive) of bytes-like ``data`` or an ``(address, length)`` pair."""
    if isinstance(data, tuple):
        addr, n = data
        return int(addr), int(n), None
    mv = memoryview(data).cast("B")
    n = mv.nbytes
    if n == 0:
        return None, 0, None
    if mv.readonly:
        buf = (ctypes.c_char * n).from_buffer_copy(mv)
    else:
        buf = (ctypes.c_char * n).from_buffer(mv)
    return ctypes.addressof(buf), n, buf


def _struct_dict(s) -> dict:
    return {n: getattr(s, n) for n, _ in s._fields_}


@dataclass(frozen=True)
class SsdRecovery:
    """What opening an SSD tier found (``Csa2SsdRecovery``)."""
    segments: int
    records: int
    dead_records: int
    corrupt_records: int
    torn_bytes_truncated: int
    damaged_bytes: int
    age_ms: int
    offline_credit_ms: int


@dataclass(frozen=True)
class SsdStats:
    """Counters since open and sizes of an SSD tier (``Csa2SsdStats``)."""
    puts: int
    put_bytes: int
    already_present: int
    refused: int
    refused_bytes: int
    evicted: int
    removed: int
    compactions: int
    hits: int
    misses: int
    corrupt: int
    entries: int
    live_bytes: int
    disk_bytes: int
    read_only: int


@dataclass(frozen=True)
class DramStats:
    """Counters and sizes of a DRAM pool (``Csa2DramStats``)."""
    puts: int
    hits: int
    misses: int
    expired_on_read: int
    expired_reclaimed: int
    evictions: int
    refused: int
    entries: int
    bytes: int


def host_memory_bytes() -> int:
    """Total host memory (``MemTotal``), bytes."""
    v = ctypes.c_uint64()
    _call("csa2_host_memory_bytes", ctypes.byref(v))
    return v.value


class ManualClock(_Handle):
    """``Csa2Clock``: a millisecond clock moved only by :meth:`advance`."""

    _free = "csa2_manual_clock_free"

    def __init__(self, start_ms: int = 0):
        h = _P()
        _call("csa2_manual_clock_new", int(start_ms), ctypes.byref(h))
        super().__init__(h.value)

    def advance(self, ms: int) -> None:
        _call("csa2_manual_clock_advance", self.handle, int(ms))

    def now_ms(self) -> int:
        v = ctypes.c_uint64()
        _call("csa2_manual_clock_now", self.handle, ctypes.byref(v))
        return v.value


class _KeyedTier(_Handle):
    """What both tiers read the same way: ``get`` over the tier's ``get_into``, and ``contains``
    through the export named by ``_contains``."""

    _contains = ""

    def get_into(self, key: bytes, addr: int, cap: int) -> int | None:
        raise NotImplementedError

    def get(self, key: bytes, cap: int) -> bytes | None:
        """The payload of ``key`` (at most ``cap`` bytes), or None on a miss."""
        buf = ctypes.create_string_buffer(max(cap, 1))
        n = self.get_into(key, ctypes.addressof(buf), cap)
        return None if n is None else buf.raw[:n]

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is held (the DRAM pool: and not expired); no I/O, no recency or
        counter change."""
        f = ctypes.c_uint8()
        _call(self._contains, self.handle, _key(key), ctypes.byref(f))
        return bool(f.value)


class SsdStore(_KeyedTier):
    """``Csa2SsdStore``: the SSD tier in ``directory`` (see the module docs).

    ``read_only=False`` takes the directory's lock: a second writer raises :class:`Csa2Error` with
    status ``STATUS_BUSY`` naming the holder's pid — the only status that means "held by another
    writer"; every other failure (a missing or unreadable directory, a damaged or foreign one, a
    directory of another format) has another status. ``min_lifetime_ms`` / ``segment_bytes`` 0
    take the defaults (72 h, 16 MiB). ``clock`` None is the system clock. A path holding a NUL
    character is refused (``ValueError``): the C ABI would read it cut at the NUL.
    """

    _free = "csa2_ssd_free"
    _contains = "csa2_ssd_contains"

    def __init__(self, directory: str, capacity_bytes: int, *, min_lifetime_ms: int = 0,
                 segment_bytes: int = 0, fsync: int = FSYNC_ALWAYS, verify_on_open: bool = True,
                 read_only: bool = False, clock: ManualClock | None = None):
        path = os.fspath(directory)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if "\0" in path:
            raise ValueError(f"an SSD tier directory cannot contain a NUL character: {path!r}")
        self._dir = path.encode("utf-8")
        a = _OpenArgs(struct_size=ctypes.sizeof(_OpenArgs), dir=self._dir,
                      capacity_bytes=int(capacity_bytes), min_lifetime_ms=int(min_lifetime_ms),
                      segment_bytes=int(segment_bytes), fsync=int(fsync),
                      verify_on_open=int(bool(verify_on_open)), read_only=int(bool(read_only)),
                      clock=clock.handle if clock is not None else None)
        rep = _Recovery()
        h = _P()
        _call("csa2_ssd_open", ctypes.byref(a), ctypes.byref(rep), ctypes.byref(h))
        super().__init__(h.value)
        self._clock = clock  # the store keeps its own reference; this one keeps the handle alive
        self.recovery = SsdRecovery(**_struct_dict(rep))
        self.read_only = bool(read_only)

    def put(self, key: bytes, data) -> bool:
        """Stores ``data`` under ``key``; False when the key was present (nothing rewritten).
        Raises :class:`Csa2Error` (``STATUS_REFUSED``) when admission control refuses it."""
        k = _key(key)
        addr, n, keep = _src(data)
        w = ctypes.c_uint8()
        _call("csa2_ssd_put", self.handle, k, addr, n, ctypes.byref(w))
        del keep
        return bool(w.value)

    def get_into(self, key: bytes, addr: int, cap: int) -> int | None:
        """Reads ``key``'s payload into ``cap`` bytes at ``addr``; its length, or None on a miss.
        Raises :class:`Csa2Error` (``STATUS_CORRUPT``) for a damaged record (dropped: the next
        read misses) and for a payload longer than ``cap``."""
        k = _key(key)
        n, f = ctypes.c_size_t(), ctypes.c_uint8()
        _call("csa2_ssd_get", self.handle, k, addr, cap, ctypes.byref(n), ctypes.byref(f))
        return n.value if f.value else None

    def probe(self, key: bytes) -> bool:
        """Whether ``key`` is live on disk now (its segment file is still there and its record's
        header says live; 64 bytes read). A stale key is dropped, and a deleted segment with all
        its keys (its file closed). For a read-only view beside a writer."""
        f = ctypes.c_uint8()
        _call("csa2_ssd_probe", self.handle, _key(key), ctypes.byref(f))
        return bool(f.value)

    def refresh(self) -> int:
        """Read-only stores: brings the index up to the directory now (segments deleted since are
        dropped and their files closed; records written since are indexed, headers only).
        Returns the live entries."""
        n = ctypes.c_uint64()
        _call("csa2_ssd_refresh", self.handle, ctypes.byref(n))
        return n.value

    def remove(self, key: bytes) -> bool:
        f = ctypes.c_uint8()
        _call("csa2_ssd_remove", self.handle, _key(key), ctypes.byref(f))
        return bool(f.value)

    def stats(self) -> SsdStats:
        s = _SsdStats()
        _call("csa2_ssd_stats", self.handle, ctypes.byref(s))
        return SsdStats(**_struct_dict(s))


class DramPool(_KeyedTier):
    """``Csa2DramPool``: SWA snapshots in host memory, ``capacity_bytes`` with a TTL of ``ttl_ms``."""

    _free = "csa2_dram_pool_free"
    _contains = "csa2_dram_pool_contains"

    def __init__(self, capacity_bytes: int, ttl_ms: int, clock: ManualClock | None = None):
        h = _P()
        _call("csa2_dram_pool_new", int(capacity_bytes), int(ttl_ms),
              clock.handle if clock is not None else None, ctypes.byref(h))
        super().__init__(h.value)
        self._clock = clock
        self.capacity_bytes = int(capacity_bytes)
        self.ttl_ms = int(ttl_ms)

    def put(self, key: bytes, data) -> None:
        """Stores a copy of ``data``. Raises ``STATUS_REFUSED`` when larger than the pool."""
        k = _key(key)
        addr, n, keep = _src(data)
        _call("csa2_dram_pool_put", self.handle, k, addr, n)
        del keep

    def put_sized(self, key: bytes, nbytes: int) -> None:
        """Records a snapshot of ``nbytes`` without bytes (same capacity/TTL/LRU decisions)."""
        _call("csa2_dram_pool_put_sized", self.handle, _key(key), int(nbytes))

    def get_into(self, key: bytes, addr: int | None, cap: int) -> int | None:
        """Copies the snapshot into ``cap`` bytes at ``addr``; its length, or None (absent or
        expired). A size-only snapshot returns its length and copies nothing."""
        n, f = ctypes.c_size_t(), ctypes.c_uint8()
        _call("csa2_dram_pool_get", self.handle, _key(key), addr, cap, ctypes.byref(n),
              ctypes.byref(f))
        return n.value if f.value else None

    def sweep(self) -> None:
        _call("csa2_dram_pool_sweep", self.handle)

    def stats(self) -> DramStats:
        s = _DramStats()
        _call("csa2_dram_pool_stats", self.handle, ctypes.byref(s))
        return DramStats(**_struct_dict(s))


assert [f.name for f in fields(SsdStats)] == [n for n, _ in _SsdStats._fields_]
assert [f.name for f in fields(DramStats)] == [n for n, _ in _DramStats._fields_]
_ = Csa2Error  # re-exported for callers that catch store failures
