"""csa2's SSD store as a secondary tier of vLLM 0.33's ``OffloadingConnector``.

vLLM's ``TieringOffloadingSpec`` keeps offloaded KV in a CPU primary tier (a shared-memory region
of chunks) and cascades it to *secondary tiers*, which move whole chunks between that region and
their own storage; a later prefix lookup that misses the CPU tier asks each secondary tier and
promotes a hit back into the region (``vllm/v1/kv_offload/tiering/base.py``,
``SecondaryTierManager``). :class:`Csa2SsdTier` is such a tier over csa2's SSD store
(``src/store/ssd.rs`` through the C ABI, ``_store.SsdStore``), so any model vLLM offloads gets an
SSD tier that is

* **crash-safe**: append-only segments; a torn tail is truncated on open, so a restart (a new
  engine process) finds every record written before it;
* **checksummed**: every record carries a CRC32C, checked on every read; a damaged record is
  dropped and its load fails (vLLM then recomputes those tokens) — never wrong bytes in the
  primary tier;
* **lifetime-managed**: live-byte capacity with compaction, and a minimum lifetime (72 h by
  default) under which nothing is evicted: a store that would need such an eviction is refused
  (admission control) and counted, instead of silently shortening another entry's life;
* **single-writer**: the directory's lock is held by one engine; a second engine on the same
  directory opens it read-only (serves hits, stores nothing) or, with ``on_locked: "error"``,
  refuses to start. Only that refusal (``STATUS_BUSY``) turns the tier read-only: any other failure
  to open the directory (a damaged or foreign directory, a permission, an I/O error) stops the
  engine with the store's message.

Enabled with (one line, see docs/VLLM.md)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "Csa2SsdTier", "module_path": "csa2_vllm.offload",
                             "ssd_dir": "/var/cache/vllm-kv"}]}}'

Keys. vLLM names a chunk by its ``OffloadKey`` (the chunk's chained block hash + the group index,
36 bytes); csa2's store takes 32-byte keys, so a record's key is
``SHA-256(domain ‖ fingerprint ‖ OffloadKey)``. The fingerprint hashes what makes the bytes
interpretable — vLLM's own storage identity of the run (``FileMapper``'s fields: model, dtype,
tokens per hash, chunk size, parallel layout, KV cache groups) and the chunk's byte length — and
also names the subdirectory, so another model or layout neither hits nor shares a lock. A
subdirectory name longer than a file system allows (a long model path) is shortened to its first
bytes and a SHA-256 of the whole name, so it stays under 255 bytes and stays unique.

Configuration (the tier's entry in ``secondary_tiers``; sizes in bytes):

=====================  =========================================================  ==========
key                    meaning                                                    default
=====================  =========================================================  ==========
``ssd_dir``            root directory of the tier (required)                      —
``capacity_bytes``     live bytes the tier holds                                  64 GiB
``min_lifetime_hours`` minimum lifetime of a record (at least 1 ms)               72
``fsync``              ``"always"`` (survives power loss) or ``"never"``          always
``on_locked``          ``"read_only"`` or ``"error"`` when the directory is held  read_only
``io_threads``         threads doing the tier's reads and writes                  2
``verify_on_open``     check every record's CRC when opening (false: a damaged    true
                       record is found by the read that loads it)
``locality``           vLLM's ``Locality`` of the tier (``"local"``/``"remote"``)  unset
=====================  =========================================================  ==========

Counters (:meth:`Csa2SsdTier.counters`, logged at shutdown): lookups, hits, misses; chunks stored,
already present, refused by admission control, skipped (read-only); chunks loaded, absent at load
time, damaged (CRC); bytes written and read. vLLM's tiering manager also counts the per-job bytes
and times this tier reports (``vllm:kv_offload_tiering_{read,write}_{bytes,time}``).

Threads. vLLM calls every method under its manager's lock and requires them to be non-blocking:
``submit_store``/``submit_load`` queue one task per job on a small thread pool and return; the
tasks run the store's C calls (which release the GIL) and queue their results for
``get_finished_jobs``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium, OffloadKey, ReqContext,
                                     RequestOffloadingContext)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from . import _store
from ._lib import Csa2Error

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("csa2_vllm.offload")

TIER_TYPE = "Csa2SsdTier"
TIER_MODULE = "csa2_vllm.offload"
KEY_DOMAIN = b"csa2/vllm-offload-tier/v1"

_DEFAULTS: dict[str, Any] = {
    "capacity_bytes": 64 << 30,
    "min_lifetime_hours": 72.0,
    "fsync": "always",
    "on_locked": "read_only",
    "io_threads": 2,
    "verify_on_open": True,
}


@dataclass
class TierCounters:
    """What the tier did since it opened (chunks unless named bytes)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    stores: int = 0            # chunks offered by store jobs
    stored: int = 0            # written
    already_present: int = 0   # the key was there (nothing rewritten, recency refreshed)
    refused: int = 0           # admission control: the tier is full of records in their lifetime
    skipped_read_only: int = 0
    store_errors: int = 0      # I/O errors
    loads: int = 0             # chunks asked for by load jobs
    loaded: int = 0
    absent: int = 0            # gone between lookup and load (evicted, removed)
    corrupt: int = 0           # CRC mismatch: dropped, the load fails
    load_errors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


def _parse(tier_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(cfg) - set(_DEFAULTS) - {"ssd_dir", "locality"})
    if unknown:
        raise ValueError(f"{tier_type}: unknown secondary tier keys {unknown}; known: "
                         f"{sorted(set(_DEFAULTS) | {'ssd_dir', 'locality'})}")
    if not cfg.get("ssd_dir"):
        raise ValueError(f"{tier_type}: the tier needs \"ssd_dir\" (its directory)")
    v = {**_DEFAULTS, **cfg}

    def positive(name, conv):
        try:
            x = conv(v[name])
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{tier_type}: {name} must be a number, found {v[name]!r}") from None
        if not x > 0 or not math.isfinite(x):
            raise ValueError(f"{tier_type}: {name} must be a finite number > 0, found {v[name]!r}")
        return x

    lifetime_ms = positive("min_lifetime_hours", float) * 3_600_000
    if lifetime_ms < 1 - 1e-6:  # (a float rounding below 1 ms still means 1 ms)
        # The store reads 0 ms as "the default, 72 h": a tiny lifetime must not become that.
        raise ValueError(f"{tier_type}: min_lifetime_hours must come to at least 1 ms "
                         f"({1 / 3_600_000:g} h), found {v['min_lifetime_hours']!r}")
    if lifetime_ms >= 2**63:
        raise ValueError(f"{tier_type}: min_lifetime_hours is too large, found "
                         f"{v['min_lifetime_hours']!r}")

    fsync = {"always": _store.FSYNC_ALWAYS, "never": _store.FSYNC_NEVER}.get(v["fsync"])
    if fsync is None:
        raise ValueError(f"{tier_type}: fsync must be \"always\" or \"never\", found {v['fsync']!r}")
    if v["on_locked"] not in ("read_only", "error"):
        raise ValueError(f"{tier_type}: on_locked must be \"read_only\" or \"error\", "
                         f"found {v['on_locked']!r}")
    return {
        "ssd_dir": os.fspath(v["ssd_dir"]),
        "capacity_bytes": positive("capacity_bytes", int),
        "min_lifetime_ms": math.ceil(lifetime_ms),
        "fsync": fsync,
        "on_locked": v["on_locked"],
        "io_threads": positive("io_threads", int),
        "verify_on_open": _flag(tier_type, "verify_on_open", v["verify_on_open"]),
    }


def _flag(tier_type: str, name: str, x: Any) -> bool:
    if isinstance(x, bool):
        return x
    raise ValueError(f"{tier_type}: {name} must be true or false, found {x!r}")


def run_fingerprint(offloading_spec: "OffloadingSpec", chunk_bytes: int,
                    root_dir: str) -> tuple[bytes, str]:
    """(32-byte fingerprint, directory) of a run: vLLM's storage identity of the offloaded bytes
    (``FileMapper``: model, dtype, tokens per hash, chunk size, parallel layout, KV cache groups)
    plus the chunk's byte length; the directory is ``FileMapper``'s base path under ``root_dir``
    (``<model>_<digest>``) with ``_c<chunk bytes>`` appended."""
    fm = FileMapper.from_offloading_spec(root_dir=root_dir, offloading_spec=offloading_spec,
                                         blocks_per_file=offloading_spec.blocks_per_chunk)
    ident = dict(fm.get_run_config(), chunk_bytes=int(chunk_bytes))
    canon = json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon).digest(), short_dir(f"{fm.base_path}_c{int(chunk_bytes)}")


#: Most bytes of a directory name this tier creates (file systems allow 255).
MAX_NAME_BYTES = 200


def short_dir(path: str) -> str:
    """``path`` with its last component cut to at most :data:`MAX_NAME_BYTES` bytes when longer:
    its first bytes (whole characters), ``_h`` and 32 hex digits of the SHA-256 of the whole
    name, so two long names stay apart."""
    head, name = os.path.split(path)
    raw = os.fsencode(name)
    if len(raw) <= MAX_NAME_BYTES:
        return path
    digest = hashlib.sha256(raw).hexdigest()[:32]
    keep = raw[:MAX_NAME_BYTES - len(digest) - 2].decode("utf-8", "ignore")
    return os.path.join(head, f"{keep}_h{digest}")


class Csa2SsdTier(SecondaryTierManager):
    """csa2's SSD store as a ``SecondaryTierManager`` (see the module docs)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview,
                 tier_type: str, backpressure_detector: "BackpressureDetector | None" = None,
                 locality: str | None = None, **config: Any):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        cfg = _parse(tier_type, config)
        view = primary_kv_view
        if view.ndim != 2 or not view.c_contiguous:
            raise ValueError(f"{tier_type}: the primary tier's view must be a C-contiguous "
                             f"(chunks, bytes) array, found ndim {view.ndim}")
        self._num_chunks = view.shape[0]
        # The chunk's address in the shared region (zero-copy: the C store reads and writes it).
        self._base = int(np.asarray(view).ctypes.data)
        self._writable = not view.readonly
        self.fingerprint, self.directory = run_fingerprint(offloading_spec, self.block_size_bytes,
                                                           cfg["ssd_dir"])
        os.makedirs(self.directory, exist_ok=True)
        kw = dict(min_lifetime_ms=cfg["min_lifetime_ms"], fsync=cfg["fsync"],
                  verify_on_open=cfg["verify_on_open"])
        try:
            self._store = _store.SsdStore(self.directory, cfg["capacity_bytes"], **kw)
        except Csa2Error as e:
            # Only a directory held by another writer may be read-only; any other cause (a
            # damaged or foreign directory, a permission, an I/O error) stops the engine.
            if e.status != _store.STATUS_BUSY or cfg["on_locked"] == "error":
                raise
            logger.warning("%s: %s is held by another engine (%s); opening it read-only: hits "
                           "are served, nothing is stored", tier_type, self.directory, e)
            self._store = _store.SsdStore(self.directory, cfg["capacity_bytes"], read_only=True,
                                          **kw)
        self.read_only = self._store.read_only
        rec = self._store.recovery
        logger.info("%s: %s opened%s: %d records in %d segments (%d corrupt dropped, %d torn "
                    "bytes truncated)", tier_type, self.directory,
                    " read-only" if self.read_only else "", rec.records, rec.segments,
                    rec.corrupt_records, rec.torn_bytes_truncated)
        self._counters = TierCounters()
        self._lock = threading.Lock()  # counters and the finished queue (pool threads write them)
        self._finished: collections.deque[JobResult] = collections.deque()
        self._inflight: dict[int, Future] = {}  # job id -> its task
        self._pool = ThreadPoolExecutor(max_workers=cfg["io_threads"],
                                        thread_name_prefix="csa2_ssd_tier")
        self._closed = False

    # ---- keys and addresses -------------------------------------------------------------------

    def store_key(self, key: OffloadKey) -> bytes:
        """The csa2 store key of vLLM's ``key`` in this run (32 bytes)."""
        return hashlib.sha256(KEY_DOMAIN + self.fingerprint + bytes(key)).digest()

    def _chunk(self, chunk_id: int) -> tuple[int, int]:
        c = int(chunk_id)
        if not 0 <= c < self._num_chunks:
            raise IndexError(f"{self.tier_type}: primary chunk {c} outside 0..{self._num_chunks}")
        return self._base + c * self.block_size_bytes, self.block_size_bytes

    def _count(self, **d: int) -> None:
        with self._lock:
            for k, v in d.items():
                setattr(self._counters, k, getattr(self._counters, k) + v)

    # ---- SecondaryTierManager -------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # The index is in memory: no I/O here. A record found damaged on its read fails the load.
        hit = self._store.contains(self.store_key(key))
        self._count(lookups=1, hits=int(hit), misses=int(not hit))
        return LookupResult.HIT if hit else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, chunks = list(job_metadata.keys), list(job_metadata.chunk_ids)
        if len(keys) != len(chunks):
            raise ValueError(f"{self.tier_type}: {len(keys)} keys but {len(chunks)} chunks")
        self._submit(job_metadata.job_id, self._store_task, keys, chunks)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, chunks = list(job_metadata.keys), list(job_metadata.chunk_ids)
        if len(keys) != len(chunks):
            raise ValueError(f"{self.tier_type}: {len(keys)} keys but {len(chunks)} chunks")
        if not self._writable:
            raise ValueError(f"{self.tier_type}: the primary tier's view is read-only")
        self._submit(job_metadata.job_id, self._load_task, keys, chunks)

    def get_finished_jobs(self) -> list[JobResult]:
        out = []
        with self._lock:
            while self._finished:
                out.append(self._finished.popleft())
        return out

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight or self._finished)

    def touch(self, keys, req_context: ReqContext) -> None:
        # The store's recency moves on its own reads and re-puts; a lookup-time touch needs no I/O.
        return

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        while True:
            with self._lock:
                pending = list(self._inflight.values())
            if not pending:
                return
            for f in pending:
                f.exception()  # waits; the task itself queued its result

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        # Let go of the primary region's view: vLLM unmaps the region after its tiers shut down,
        # and cannot while a view of it is exported.
        self._primary_kv_view = None
        self._base = 0
        logger.info("%s: closing %s; counters %s; store %s", self.tier_type, self.directory,
                    asdict(self._counters), self._store.stats())
        self._store.close()

    def config_info(self):
        return {}

    # ---- the tier's own ------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        with self._lock:
            return asdict(self._counters)

    def store_stats(self) -> _store.SsdStats:
        return self._store.stats()

    # ---- the jobs ----------------------------------------------------------------------------

    def _submit(self, job_id: int, task, keys: list, chunks: list) -> None:
        if self._closed:
            raise RuntimeError(f"{self.tier_type}: job {job_id} submitted after shutdown")
        with self._lock:
            # Registered under the lock the task takes to finish, so it is there before it goes.
            self._inflight[job_id] = self._pool.submit(self._run, job_id, task, keys, chunks)

    def _run(self, job_id: int, task, keys: list, chunks: list) -> None:
        t0 = time.monotonic()
        try:
            res = task(job_id, keys, chunks)
        except Exception:  # a bug, not a tier outcome: the job fails, the engine goes on
            logger.exception("%s: job %d failed", self.tier_type, job_id)
            res = JobResult(job_id=job_id, success=False)
        res.transfer_time = time.monotonic() - t0
        with self._lock:
            self._finished.append(res)
            self._inflight.pop(job_id, None)

    def _store_task(self, job_id: int, keys: list, chunks: list) -> JobResult:
        n = len(keys)
        if self.read_only:
            self._count(stores=n, skipped_read_only=n)
            return JobResult(job_id=job_id, success=False, transfer_bytes=0)
        written = present = refused = errors = 0
        for key, cid in zip(keys, chunks):
            try:
                if self._store.put(self.store_key(key), self._chunk(cid)):
                    written += 1
                else:
                    present += 1
            except Csa2Error as e:
                if e.status == _store.STATUS_REFUSED:
                    refused += 1
                else:
                    errors += 1
                    logger.warning("%s: storing a chunk failed: %s", self.tier_type, e)
        nbytes = written * self.block_size_bytes
        self._count(stores=n, stored=written, already_present=present, refused=refused,
                    store_errors=errors, bytes_written=nbytes)
        return JobResult(job_id=job_id, success=written + present == n, transfer_bytes=nbytes)

    def _load_task(self, job_id: int, keys: list, chunks: list) -> JobResult:
        ok, absent, corrupt, errors = [], 0, 0, 0
        for key, cid in zip(keys, chunks):
            addr, cap = self._chunk(cid)
            try:
                got = self._store.get_into(self.store_key(key), addr, cap)
            except Csa2Error as e:
                if e.status == _store.STATUS_CORRUPT:
                    corrupt += 1
                    logger.warning("%s: a damaged record was dropped (its tokens are "
                                   "recomputed): %s", self.tier_type, e)
                else:
                    errors += 1
                    logger.warning("%s: loading a chunk failed: %s", self.tier_type, e)
                continue
            if got is None:
                absent += 1
            elif got != cap:
                # A record of another length under this run's key cannot happen unless the
                # directory was written by a different build; never hand out a partial chunk.
                errors += 1
                logger.warning("%s: a record of %d bytes where the chunk is %d", self.tier_type,
                               got, cap)
            else:
                ok.append(key)
        nbytes = len(ok) * self.block_size_bytes
        self._count(loads=len(keys), loaded=len(ok), absent=absent, corrupt=corrupt,
                    load_errors=errors, bytes_read=nbytes)
        full = len(ok) == len(keys)
        return JobResult(job_id=job_id, success=full,
                         successful_keys=None if full or not ok else tuple(ok),
                         transfer_bytes=nbytes)
