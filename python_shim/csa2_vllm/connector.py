"""csa2's persistent tiers inside vLLM 0.33: a KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``).

Two tiers, as in DeepSeek-V4.1's design (docs/SPEC.md §0.5, docs/VLLM.md "KV connector"):

* **SSD tier, global KV** (csa2's ``SsdStore``: CRC32C per record, crash recovery, one writer per
  directory, a 72-h minimum lifetime with admission control). One record per block of the
  prefix-cacheable group — the compressed KV and indexer-K pages of every KV-source layer — keyed
  by vLLM's chained block hash salted with the model/geometry fingerprint. The record is vLLM's
  whole block slab, byte for byte.
* **DRAM pool, SWA snapshots** (csa2's ``DramPool``: 10 % of host memory, TTL 5 min). At a block
  boundary H the window blocks ``[H − W, H)`` of every sliding-window group and the compressor
  ring's blocks are saved as one snapshot. A later hit of exactly H whose snapshot is still in the
  pool loads it too and reports every transfer group as loaded
  (``get_loaded_kv_cache_group_ids``), so vLLM's scheduler takes the hit whole
  (``replay_start = 0``, no 128-token rewind): the resumed turn is exact instead of replayed.
  Without a snapshot only the prefix-cacheable group is reported and vLLM's bounded replay runs.

When: full blocks and the snapshot are saved at the prompt's end (the step that computes the last
prompt token) and at the request's end (``request_finished_all_groups``, which delays the free of
the blocks until the worker has copied them). Hits of at most 128 tokens are ignored, as vLLM
does for its own prefix cache.

Processes. The worker side owns the tiers (it moves the bytes): ``register_kv_caches`` keeps the
raw slab (one backing allocation, ``[num_blocks, bytes_per_block]``), ``start_load_kv`` copies
records into it before the forward and ``wait_for_save`` copies out after it (V4.1's attention
layers call no per-layer hooks, so the connector works per step on whole slabs, as vLLM's
``OffloadingConnector`` does for packed DSv4 blocks). On CPU these are plain copies straight
between the slab and the tiers; on CUDA they go through pinned host buffers on a side stream. The
scheduler side decides hits from a read-only view of the SSD directory (taken at start, so a
restart finds the previous run's entries) plus the keys it has scheduled for saving, and mirrors
the DRAM pool with a size-only pool that makes the same capacity/TTL/LRU decisions. The worker
reports keys it could not save or load (``build_connector_worker_meta``) and the scheduler drops
them. Loads are asynchronous in vLLM's sense (the request waits one step for them): a load that
fails (a damaged record, a snapshot gone) is reported as ``failed_recving`` and vLLM recomputes
the request — a damaged record is a miss, never wrong bytes. (With hybrid KV cache groups vLLM
refuses block-level ``invalid_block_ids``; the request-level failure is its supported path.)

Tensor parallelism: each rank saves its own slab, so each rank gets its own directory
``<ssd_dir>/tp<rank>of<size>`` (its own lock), and with more than one rank its keys are salted
with the rank and the size as well (:func:`rank_key`), so a slab of one rank can never be served
to another. A worker whose rank cannot be read from vLLM's parallel state while the tensor-parallel
size is above 1 refuses to start. The scheduler reads rank 0's directory, through a read-only view
that it refreshes whenever the directory changes (segments compacted away or deleted are dropped,
records written since are read) and that re-checks each record's header before it counts as a
hit. Two engines on one directory: the
second one's worker cannot take the lock (``STATUS_BUSY``) and opens read-only (it serves hits and
saves nothing; ``"on_locked": "error"`` refuses to start instead). Any other failure to open the
directory stops the engine with the store's message: it never silently turns the tier read-only.

Configuration (``kv_connector_extra_config``; sizes in bytes, times as named):

=====================  =========================================================  ==========
key                    meaning                                                    default
=====================  =========================================================  ==========
``ssd_dir``            directory of the SSD tier (required)                       —
``ssd_capacity_bytes`` live bytes the SSD tier holds                              64 GiB
``min_lifetime_hours`` minimum lifetime of an SSD entry                           72
``fsync``              ``"always"`` (survives power loss) or ``"never"``          always
``dram_pool_bytes``    bytes of each worker's DRAM snapshot pool                  see below
``dram_ttl_s``         time to live of a snapshot, seconds (at least 0.001)       300
``on_locked``          ``"read_only"`` or ``"error"`` when the directory is held  read_only
=====================  =========================================================  ==========

``dram_pool_bytes`` is per worker (each rank keeps its own window blocks). Its default is 10 % of
the machine's memory shared by the workers on the machine (vLLM's ``local_world_size``: tensor ×
pipeline parallel ranks per node), so the pool of the whole machine is the paper's 10 %.
``min_lifetime_hours`` and ``dram_ttl_s`` must come to at least one millisecond; smaller values
are refused, not rounded to "the default".

Counters (hits and misses per tier, replays avoided and run, bytes moved, admissions refused) go
to the logs every ``log_every_steps`` steps (default 0: off; INFO level) and through
``get_kv_connector_stats`` (worker counters) to vLLM's stats loggers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorTransferResults,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from . import _store
from ._lib import Csa2Error

logger = logging.getLogger("csa2_vllm.connector")

CONNECTOR_NAME = "Csa2Connector"
CONNECTOR_MODULE = "csa2_vllm.connector"
KEY_DOMAIN = b"csa2/vllm-kv-connector/v1"
SNAPSHOT_DOMAIN = b"csa2/swa-snapshot/v1"
RANK_DOMAIN = b"csa2/vllm-kv-connector/rank/v1"

_DEFAULTS = {
    "ssd_capacity_bytes": 64 << 30,
    "min_lifetime_hours": 72.0,
    "fsync": "always",
    "dram_pool_bytes": None,
    "dram_ttl_s": 300.0,
    "on_locked": "read_only",
    "log_every_steps": 0,
}

# Injected time for tests and simulations: a csa2 ManualClock used by every tier this module
# creates while it is set (None: the system clock).
_clock: _store.ManualClock | None = None
_clock_lock = threading.Lock()


def use_clock(clock: _store.ManualClock | None) -> None:
    """Makes every tier created from now on read ``clock`` (None: back to the system clock)."""
    global _clock
    with _clock_lock:
        _clock = clock


@dataclass(frozen=True)
class Csa2ConnectorConfig:
    """The parsed ``kv_connector_extra_config`` (see the module docs)."""

    ssd_dir: str
    ssd_capacity_bytes: int
    min_lifetime_ms: int
    fsync: int
    dram_pool_bytes: int
    dram_ttl_ms: int
    on_locked: str
    log_every_steps: int

    @staticmethod
    def parse(extra: dict[str, Any] | None, workers_per_machine: int = 1) -> "Csa2ConnectorConfig":
        """Validates ``extra``; a missing ``ssd_dir``, an unknown key or a bad value raises
        ``ValueError`` naming it. ``workers_per_machine`` shares the default DRAM pool (10 % of the
        machine's memory) among the workers of one machine."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_DEFAULTS) - {"ssd_dir"})
        if unknown:
            raise ValueError(f"{CONNECTOR_NAME}: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(set(_DEFAULTS) | {'ssd_dir'})}")
        if not extra.get("ssd_dir"):
            raise ValueError(f"{CONNECTOR_NAME}: kv_connector_extra_config needs \"ssd_dir\" "
                             "(the SSD tier's directory)")
        v = {**_DEFAULTS, **extra}

        def positive(name, conv):
            try:
                x = conv(v[name])
            except (TypeError, ValueError, OverflowError):
                raise ValueError(f"{CONNECTOR_NAME}: {name} must be a number, found {v[name]!r}")
            if not x > 0 or not math.isfinite(x):
                raise ValueError(f"{CONNECTOR_NAME}: {name} must be a finite number > 0, found "
                                 f"{v[name]!r}")
            return x

        def millis(name, per_unit: float) -> int:
            ms = positive(name, float) * per_unit
            if ms < 1 - 1e-6:  # (a float rounding below 1 ms still means 1 ms)
                raise ValueError(f"{CONNECTOR_NAME}: {name} must come to at least 1 ms "
                                 f"({1 / per_unit:g}), found {v[name]!r}")
            if ms >= 2**63:
                raise ValueError(f"{CONNECTOR_NAME}: {name} is too large, found {v[name]!r}")
            return math.ceil(ms)

        fsync = {"always": _store.FSYNC_ALWAYS, "never": _store.FSYNC_NEVER}.get(v["fsync"])
        if fsync is None:
            raise ValueError(f"{CONNECTOR_NAME}: fsync must be \"always\" or \"never\", "
                             f"found {v['fsync']!r}")
        if v["on_locked"] not in ("read_only", "error"):
            raise ValueError(f"{CONNECTOR_NAME}: on_locked must be \"read_only\" or \"error\", "
                             f"found {v['on_locked']!r}")
        workers = int(workers_per_machine)
        if workers < 1:
            raise ValueError(f"{CONNECTOR_NAME}: workers_per_machine must be >= 1, found {workers}")
        dram = v["dram_pool_bytes"]
        if dram is None:
            dram = _store.host_memory_bytes() // 10 // workers
        else:
            dram = positive("dram_pool_bytes", int)
        log_every = int(v["log_every_steps"])
        if log_every < 0:
            raise ValueError(f"{CONNECTOR_NAME}: log_every_steps must be >= 0, found {log_every}")
        return Csa2ConnectorConfig(
            ssd_dir=os.fspath(extra["ssd_dir"]),
            ssd_capacity_bytes=positive("ssd_capacity_bytes", int),
            min_lifetime_ms=millis("min_lifetime_hours", 3_600_000),
            fsync=fsync,
            dram_pool_bytes=dram,
            dram_ttl_ms=millis("dram_ttl_s", 1000),
            on_locked=v["on_locked"],
            log_every_steps=log_every,
        )


# ---- layout: which group is which, and the slab ---------------------------------------------------

@dataclass(frozen=True)
class _Layout:
    prefix_group: int
    prefix_block_tokens: int
    window_groups: tuple[tuple[int, int, int], ...]  # (group id, block tokens, window tokens)
    state_groups: tuple[int, ...]
    transfer_groups: tuple[int, ...]
    block_bytes: int
    num_blocks: int
    fingerprint: bytes

    @staticmethod
    def of(vllm_config, kv_cache_config) -> "_Layout":
        pc = tuple(kv_cache_config.prefix_cacheable_group_ids)
        if len(pc) != 1:
            raise ValueError(f"{CONNECTOR_NAME} needs exactly one prefix-cacheable KV cache group "
                             f"(DeepSeek-V4.1's compressed + indexer pages); found {pc}")
        groups = kv_cache_config.kv_cache_groups
        windows, states = [], []
        for gid in kv_cache_config.transfer_group_ids:
            if gid == pc[0]:
                continue
            spec = groups[gid].kv_cache_spec
            w = int(getattr(spec, "prefix_replay_tokens", 0) or 0)
            if w > 0:
                if w % spec.block_size:
                    raise ValueError(f"{CONNECTOR_NAME}: window group {gid} replays {w} tokens, "
                                     f"not a multiple of its {spec.block_size}-token blocks")
                windows.append((gid, spec.block_size, w))
            else:
                states.append(gid)
        strides = {t.block_stride for t in kv_cache_config.kv_cache_tensors}
        sizes = {t.size for t in kv_cache_config.kv_cache_tensors}
        if len(strides) != 1 or len(sizes) != 1:
            raise ValueError(f"{CONNECTOR_NAME} moves whole block slabs of one backing allocation; "
                             f"found block strides {sorted(strides)} and sizes {sorted(sizes)}")
        block_bytes = strides.pop()
        return _Layout(
            prefix_group=pc[0],
            prefix_block_tokens=groups[pc[0]].kv_cache_spec.block_size,
            window_groups=tuple(windows),
            state_groups=tuple(states),
            transfer_groups=tuple(kv_cache_config.transfer_group_ids),
            block_bytes=block_bytes,
            num_blocks=kv_cache_config.num_blocks,
            fingerprint=_fingerprint(vllm_config, kv_cache_config, block_bytes),
        )


def _fingerprint(vllm_config, kv_cache_config, block_bytes: int) -> bytes:
    """32 bytes naming everything that makes two slabs interchangeable: the model (name, revision,
    text config), the cache dtype, the group layout with every layer's spec, the slab size, the
    hash algorithm and the tensor-parallel size. Another model or geometry gets other keys."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    try:
        text = mc.hf_text_config.to_dict()
    except AttributeError:
        text = {}
    text = {k: v for k, v in text.items() if not k.startswith("_")}
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        groups.append({"layers": list(g.layer_names), "spec": repr(g.kv_cache_spec)})
    doc = {
        "model": str(mc.model), "revision": str(getattr(mc, "revision", None)),
        "text_config": text, "cache_dtype": str(cc.cache_dtype),
        "hash": str(getattr(cc, "prefix_caching_hash_algo", "")),
        "tp": int(pc.tensor_parallel_size), "pp": int(pc.pipeline_parallel_size),
        "block_bytes": int(block_bytes), "groups": groups,
    }
    blob = json.dumps(doc, sort_keys=True, default=str).encode()
    return hashlib.sha256(KEY_DOMAIN + blob).digest()


def block_key(fingerprint: bytes, block_hash: bytes) -> bytes:
    """The SSD key of one prefix-cacheable block: vLLM's chained block hash salted with the
    fingerprint (SHA-256)."""
    return hashlib.sha256(KEY_DOMAIN + fingerprint + bytes(block_hash)).digest()


def snapshot_key(boundary_block_key: bytes) -> bytes:
    """The DRAM key of the SWA snapshot at the end of the block whose SSD key is given."""
    return hashlib.sha256(SNAPSHOT_DOMAIN + boundary_block_key).digest()


def rank_dir(base: str, rank: int, size: int) -> str:
    """Each tensor-parallel rank's own directory (each rank saves its own slab)."""
    return os.path.join(base, f"tp{rank}of{size}")


def rank_key(key: bytes, rank: int, size: int) -> bytes:
    """The key rank ``rank`` of ``size`` stores block ``key`` under. With one rank it is ``key``
    itself; with more, a SHA-256 over the rank, the size and ``key``, so a directory (or a
    mistaken rank) of another rank holds nothing under this rank's keys."""
    if size == 1:
        return key
    return hashlib.sha256(RANK_DOMAIN + f"{rank}/{size}/".encode() + bytes(key)).digest()


def local_workers(parallel_config) -> int:
    """Workers of this engine on one machine (tensor × pipeline parallel ranks per node)."""
    n = getattr(parallel_config, "local_world_size", None)
    if n is None:
        n = int(parallel_config.tensor_parallel_size) * int(parallel_config.pipeline_parallel_size)
    return max(1, int(n))


# ---- metadata between the two sides ---------------------------------------------------------------

@dataclass
class _Load:
    req_id: str
    blocks: list[tuple[int, bytes]]            # (block id, SSD key), prefix group, in order
    snapshot: bytes | None = None              # DRAM key
    snapshot_blocks: list[int] = field(default_factory=list)


@dataclass
class _Save:
    req_id: str
    blocks: list[tuple[int, bytes]]
    snapshot: bytes | None = None
    snapshot_blocks: list[int] = field(default_factory=list)
    finishes: bool = False                     # the request waits for this save to free blocks


@dataclass
class Csa2ConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side."""
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


@dataclass
class Csa2WorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers could not do, so the scheduler stops counting on it."""
    lost_ssd_keys: set[bytes] = field(default_factory=set)
    lost_snapshots: set[bytes] = field(default_factory=set)

    def aggregate(self, other: "Csa2WorkerMetadata") -> "Csa2WorkerMetadata":
        return Csa2WorkerMetadata(self.lost_ssd_keys | other.lost_ssd_keys,
                                  self.lost_snapshots | other.lost_snapshots)


COUNTERS = (
    "ssd_hits", "ssd_misses", "ssd_corrupt", "ssd_saved", "ssd_refused", "dram_hits",
    "dram_misses", "dram_saved", "dram_refused", "replays_avoided", "replays_run",
    "bytes_loaded", "bytes_saved", "hit_tokens",
)


@dataclass
class Csa2ConnectorStats(KVConnectorStats):
    """Counters of one interval (sums; ``reduce`` reports them as they are)."""

    def __post_init__(self):
        for k in COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self):
        self.data = {k: 0 for k in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Plan:
    hit_tokens: int
    keys: list[bytes]
    snapshot: bytes | None
    allocated: bool = False


# ---- the connector --------------------------------------------------------------------------------

class Csa2Connector(KVConnectorBase_V1, SupportsHMA):
    """csa2's SSD tier and DRAM SWA-snapshot pool as a vLLM KV connector (see the module docs)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError(f"{CONNECTOR_NAME} needs the KV cache config (vLLM 0.33 passes it)")
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.config = Csa2ConnectorConfig.parse(
            extra, workers_per_machine=local_workers(vllm_config.parallel_config))
        self.layout = _Layout.of(vllm_config, kv_cache_config)
        pc = vllm_config.parallel_config
        self._tp_size = int(pc.tensor_parallel_size)
        with _clock_lock:
            self._clock = _clock
        self.counters = {k: 0 for k in COUNTERS}
        self._interval = {k: 0 for k in COUNTERS}
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n
        self._interval[name] += n

    # ---- scheduler side -------------------------------------------------------------------------

    def _init_scheduler(self) -> None:
        cfg = self.config
        d = rank_dir(cfg.ssd_dir, 0, self._tp_size)
        self._view_dir = d
        self._ssd_view = None
        self._view_sig = None
        self._view_refreshes = 0
        self._refresh_view()
        self._ssd_added: set[bytes] = set()
        self._ssd_lost: set[bytes] = set()
        self._snap_lost: set[bytes] = set()  # the workers lost them; the mirror still counts them
        self._dram_mirror = _store.DramPool(cfg.dram_pool_bytes, cfg.dram_ttl_ms, self._clock)
        self._requests: dict[str, Any] = {}
        self._prompt_saved: set[str] = set()
        self._plans: dict[str, _Plan] = {}
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._delayed: set[str] = set()
        self._unsettled: set[str] = set()
        self._steps = 0
        logger.info("%s scheduler: SSD view %s (%d entries from earlier runs), DRAM pool %d B, "
                    "TTL %d ms", CONNECTOR_NAME, d, self._ssd_view.recovery.records,
                    cfg.dram_pool_bytes, cfg.dram_ttl_ms)

    def _refresh_view(self) -> None:
        """Keeps the read-only view of rank 0's directory current: when the directory changed
        since the last look (a segment created, compacted away or deleted) the view drops the
        segments that went (closing their files) and reads the records written since
        (``SsdStore.refresh``: only what changed); a directory replaced or deleted is opened
        afresh. So the view neither pins deleted files nor answers for records that are gone."""
        d = self._view_dir
        try:
            st = os.stat(d)
        except FileNotFoundError:
            os.makedirs(d, exist_ok=True)
            st = os.stat(d)
        sig = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if self._ssd_view is not None and sig == self._view_sig:
            return
        if self._ssd_view is not None and sig[:2] == self._view_sig[:2]:
            self._ssd_view.refresh()
            self._view_sig = sig
            self._view_refreshes += 1
            return
        cfg = self.config
        view = _store.SsdStore(d, cfg.ssd_capacity_bytes, min_lifetime_ms=cfg.min_lifetime_ms,
                               read_only=True, clock=self._clock)
        old, self._ssd_view, self._view_sig = self._ssd_view, view, sig
        if old is not None:
            old.close()
            self._view_refreshes += 1

    def _has_block(self, key: bytes) -> bool:
        if key in self._ssd_added:
            return True
        if key in self._ssd_lost:
            return False
        # The header is re-read: a record the worker evicted or removed since the view opened is
        # not a hit (it would cost a failed load and a whole-request recompute).
        try:
            return self._ssd_view.probe(rank_key(key, 0, self._tp_size))
        except Csa2Error as e:
            # A header that cannot be read cannot be loaded either: a miss, said once per key.
            self._ssd_lost.add(key)
            logger.warning("%s: SSD view cannot read a record header (%s); counted as a miss",
                           CONNECTOR_NAME, e.message)
            return False

    def _block_keys(self, request, n_tokens: int) -> list[bytes]:
        """SSD keys of the request's full prefix-group blocks within its first ``n_tokens``."""
        hashes = request.block_hashes
        per = self.layout.prefix_block_tokens
        hb = getattr(hashes, "block_size", None) or self._vllm_config.cache_config.block_size
        if per % hb:
            raise ValueError(f"{CONNECTOR_NAME}: the prefix group's {per}-token blocks are not a "
                             f"multiple of vLLM's {hb}-token hash blocks")
        ratio = per // hb
        n = min(n_tokens // per, len(hashes) // ratio)
        fp = self.layout.fingerprint
        return [block_key(fp, hashes[(j + 1) * ratio - 1]) for j in range(n)]

    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._requests.setdefault(request.request_id, request)
        self._plans.pop(request.request_id, None)
        self._refresh_view()
        # Leave at least one prompt token to compute (vLLM needs a forward to sample from).
        keys = self._block_keys(request, request.num_tokens - 1)
        n = 0
        while n < len(keys) and self._has_block(keys[n]):
            n += 1
        per = self.layout.prefix_block_tokens
        hit = n * per
        replay = max((w for _, _, w in self.layout.window_groups), default=0)
        if hit <= num_computed_tokens or hit <= replay:
            if hit <= num_computed_tokens and num_computed_tokens == 0 and keys:
                self._count("ssd_misses")
            return 0, False
        snap = snapshot_key(keys[n - 1])
        if not (self.layout.window_groups and snap not in self._snap_lost
                and self._dram_mirror.contains(snap)):
            snap = None
        self._plans[request.request_id] = _Plan(hit, keys[:n], snap)
        # Asynchronous: vLLM parks the request until the worker reports the load finished (or
        # failed, when vLLM recomputes the request; with hybrid groups that is the only failure
        # path vLLM supports). The plan stays until the request is scheduled again, because vLLM
        # asks get_loaded_kv_cache_group_ids once more when the load has arrived.
        return hit - num_computed_tokens, True

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        plan = self._plans.get(request.request_id)
        if plan is not None and plan.snapshot is not None:
            return self.layout.transfer_groups
        return (self.layout.prefix_group,)

    def _null_block_id(self) -> int:
        m = self._kv_cache_manager
        try:
            return m.block_pool.null_block.block_id
        except AttributeError:
            return 0

    def _window_blocks(self, ids, boundary: int, null: int) -> list[int] | None:
        """Block ids holding the SWA window ``[boundary − W, boundary)`` of every window group,
        then the state groups' blocks; None when one of them is not held."""
        out: list[int] = []
        for gid, bt, w in self.layout.window_groups:
            lo, hi = (boundary - w) // bt, boundary // bt
            g = ids[gid]
            if lo < 0 or hi > len(g):
                return None
            part = g[lo:hi]
            if any(b == null for b in part):
                return None
            out.extend(part)
        for gid in self.layout.state_groups:
            part = [b for b in ids[gid] if b != null]
            if not part:
                return None
            out.extend(part)
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        plan = self._plans.get(request.request_id)
        if num_external_tokens == 0 or plan is None or plan.allocated:
            return
        plan.allocated = True
        # Until the request computes again its blocks hold a load in flight (or a failed one):
        # nothing of it may be saved.
        self._unsettled.add(request.request_id)
        ids = blocks.get_block_ids()
        per = self.layout.prefix_block_tokens
        first = (plan.hit_tokens - num_external_tokens) // per
        load = _Load(request.request_id,
                     [(ids[self.layout.prefix_group][j], plan.keys[j])
                      for j in range(first, len(plan.keys))])
        self._count("ssd_hits", len(load.blocks))
        self._count("hit_tokens", num_external_tokens)
        if plan.snapshot is not None:
            wb = self._window_blocks(ids, plan.hit_tokens, self._null_block_id())
            if wb is None:
                # vLLM already took the hit whole; without the window blocks allocated the load
                # cannot restore it: fail the last block so vLLM recomputes from there.
                logger.warning("%s: request %s: window blocks for %d not allocated; failing the "
                               "load (vLLM recomputes the request)", CONNECTOR_NAME,
                               request.request_id, plan.hit_tokens)
                load.snapshot = plan.snapshot
            else:
                load.snapshot, load.snapshot_blocks = plan.snapshot, wb
            self._dram_mirror.get_into(plan.snapshot, None, 0)  # same recency as the worker's read
            self._count("dram_hits")
            self._count("replays_avoided")
        else:
            if self.layout.window_groups:
                self._count("dram_misses")
                self._count("replays_run")
        self._loads.append(load)

    def _plan_save(self, request, computed: int, ids, finishes: bool) -> _Save | None:
        null = self._null_block_id()
        keys = self._block_keys(request, computed)
        pg = ids[self.layout.prefix_group]
        save = _Save(request.request_id, [], finishes=finishes)
        for j, k in enumerate(keys):
            if j < len(pg) and pg[j] != null and not self._has_block(k):
                save.blocks.append((pg[j], k))
                self._ssd_added.add(k)
                self._ssd_lost.discard(k)
        replay = max((w for _, _, w in self.layout.window_groups), default=0)
        boundary = len(keys) * self.layout.prefix_block_tokens
        if self.layout.window_groups and boundary > replay:
            wb = self._window_blocks(ids, boundary, null)
            snap = snapshot_key(keys[-1])
            nbytes = len(wb or ()) * self.layout.block_bytes
            if wb and nbytes <= self.config.dram_pool_bytes:
                save.snapshot, save.snapshot_blocks = snap, wb
                self._dram_mirror.put_sized(snap, nbytes)
                self._snap_lost.discard(snap)
        if not save.blocks and save.snapshot is None:
            return None
        return save

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self._steps += 1
        # Prompt's end: the step that computes the last prompt token saves its full blocks and the
        # window at the last block boundary (the blocks are the request's, held this step).
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            plan = self._plans.get(rid)
            if plan is not None and plan.allocated and n > 0:
                del self._plans[rid]  # its load has arrived and vLLM has planned the replay
            if n > 0:
                self._unsettled.discard(rid)
            req = self._requests.get(rid)
            if req is None or rid in self._prompt_saved or self._kv_cache_manager is None:
                continue
            if req.num_computed_tokens + n >= req.num_prompt_tokens:
                self._prompt_saved.add(rid)
                ids = self._kv_cache_manager.get_block_ids(rid)
                s = self._plan_save(req, req.num_prompt_tokens, ids, finishes=False)
                if s is not None:
                    self._saves.append(s)
        meta = Csa2ConnectorMetadata(loads=self._loads, saves=self._saves)
        self._loads, self._saves = [], []
        if self.config.log_every_steps and self._steps % self.config.log_every_steps == 0:
            logger.info("%s scheduler counters: %s", CONNECTOR_NAME, self.counters)
        return meta

    def request_finished_all_groups(self, request, block_ids):
        rid = request.request_id
        self._requests.pop(rid, None)
        self._prompt_saved.discard(rid)
        self._plans.pop(rid, None)
        if rid in self._unsettled:
            # Finished (aborted, or failed by vLLM's "fail" load policy) before computing.
            self._unsettled.discard(rid)
            return False, None
        s = self._plan_save(request, request.num_computed_tokens, block_ids, finishes=True)
        if s is None:
            return False, None
        self._saves.append(s)
        self._delayed.add(rid)
        return True, None

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def update_connector_output(self, connector_output) -> None:
        for rid in connector_output.finished_sending or ():
            self._delayed.discard(rid)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, Csa2WorkerMetadata):
            for k in meta.lost_ssd_keys:
                self._ssd_added.discard(k)
                self._ssd_lost.add(k)
            self._snap_lost.update(meta.lost_snapshots)

    def has_pending_push_work(self) -> bool:
        return bool(self._saves or self._delayed)

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return Csa2ConnectorStats(data=dict(data or {}))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        # No per-layer hooks: V4.1's attention layers call none, all work is per step.
        return False

    # ---- worker side ----------------------------------------------------------------------------

    def _init_worker(self) -> None:
        self._slab: torch.Tensor | None = None
        self._ssd: _store.SsdStore | None = None
        self._dram: _store.DramPool | None = None
        self._finished_saving: set[str] = set()
        self._finished_loading: set[str] = set()
        self._failed_loading: set[str] = set()
        self._lost = Csa2WorkerMetadata()
        self._stream = None
        self._rank = 0

    def _tp_rank(self) -> int:
        """This worker's tensor-parallel rank. With one rank it is 0; with more it must come from
        vLLM's parallel state — a guess would let this rank save into, and load from, another
        rank's directory and keys."""
        if self._tp_size == 1:
            return 0
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            rank = int(get_tensor_model_parallel_rank())
        except (AssertionError, ImportError, RuntimeError, AttributeError) as e:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: tensor-parallel size is {self._tp_size} but this worker's rank "
                f"cannot be read from vLLM's parallel state ({type(e).__name__}: {e}); refusing to "
                "open the SSD tier rather than guess a rank") from e
        if not 0 <= rank < self._tp_size:
            raise RuntimeError(f"{CONNECTOR_NAME}: tensor-parallel rank {rank} is outside "
                               f"0..{self._tp_size - 1}")
        return rank

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Keeps the raw slab behind every layer view, ``[num_blocks, bytes_per_block]`` uint8, and
        opens the tiers (this rank's directory; read-only when another engine holds it)."""
        if not kv_caches:
            raise ValueError(f"{CONNECTOR_NAME}: register_kv_caches got no KV caches")
        storages = {t.untyped_storage().data_ptr() for t in kv_caches.values()}
        if len(storages) != 1:
            raise ValueError(f"{CONNECTOR_NAME} needs the layers' views over one backing "
                             f"allocation (vLLM's allocate_kv_cache); found {len(storages)}")
        t0 = next(iter(kv_caches.values()))
        st = t0.untyped_storage()
        lay = self.layout
        need = lay.num_blocks * lay.block_bytes
        if st.nbytes() < need:
            raise ValueError(f"{CONNECTOR_NAME}: the KV backing allocation has {st.nbytes()} B, "
                             f"the config needs {lay.num_blocks} × {lay.block_bytes} = {need} B")
        raw = torch.empty(0, dtype=torch.uint8, device=t0.device)
        raw.set_(st, 0, (need,), (1,))
        self._slab = raw.view(lay.num_blocks, lay.block_bytes)
        base = st.data_ptr()
        for name, t in kv_caches.items():
            off = t.data_ptr() - base
            if off < 0 or t.stride(0) * t.element_size() != lay.block_bytes:
                raise ValueError(f"{CONNECTOR_NAME}: layer {name} is not a per-block view of the "
                                 f"slab (offset {off}, block stride {t.stride(0) * t.element_size()}"
                                 f" B, slab {lay.block_bytes} B)")
        self._open_tiers()
        if self._slab.is_cuda:
            self._stream = torch.cuda.Stream(device=self._slab.device)

    def _open_tiers(self) -> None:
        cfg = self.config
        self._rank = self._tp_rank()
        d = rank_dir(cfg.ssd_dir, self._rank, self._tp_size)
        os.makedirs(d, exist_ok=True)
        kw = dict(min_lifetime_ms=cfg.min_lifetime_ms, fsync=cfg.fsync, clock=self._clock)
        try:
            self._ssd = _store.SsdStore(d, cfg.ssd_capacity_bytes, **kw)
        except Csa2Error as e:
            # Only a directory held by another writer may be read-only; any other cause (a
            # damaged or foreign directory, a permission, an I/O error) stops the engine.
            if e.status != _store.STATUS_BUSY or cfg.on_locked != "read_only":
                raise
            logger.warning("%s: %s is held by another engine (%s); opening it read-only: hits are "
                           "served, nothing is saved", CONNECTOR_NAME, d, e.message)
            self._ssd = _store.SsdStore(d, cfg.ssd_capacity_bytes, read_only=True, **kw)
        self._dram = _store.DramPool(cfg.dram_pool_bytes, cfg.dram_ttl_ms, self._clock)
        r = self._ssd.recovery
        logger.info("%s worker: SSD tier %s%s: %d records, %d damaged records skipped, %d torn "
                    "bytes cut", CONNECTOR_NAME, d, " (read-only)" if self._ssd.read_only else "",
                    r.records, r.corrupt_records, r.torn_bytes_truncated)

    def _rk(self, key: bytes) -> bytes:
        """The key this rank stores block ``key`` under (:func:`rank_key`)."""
        return rank_key(key, self._rank, self._tp_size)

    @property
    def read_only(self) -> bool:
        return self._ssd is not None and self._ssd.read_only

    def _host_rows(self, n: int) -> torch.Tensor:
        pin = self._slab.is_cuda
        return torch.empty((n, self.layout.block_bytes), dtype=torch.uint8, pin_memory=pin)

    def _to_slab(self, ids: list[int], host: torch.Tensor) -> None:
        idx = torch.tensor(ids, dtype=torch.long, device=self._slab.device)
        if self._stream is None:
            self._slab.index_copy_(0, idx, host)
            return
        cur = torch.cuda.current_stream(self._slab.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(cur)
            self._slab.index_copy_(0, idx, host.to(self._slab.device, non_blocking=True))
        cur.wait_stream(self._stream)  # the forward reads the loaded blocks

    def _from_slab(self, ids: list[int]) -> torch.Tensor:
        if self._stream is None:
            return self._slab[ids]  # index with a list: a contiguous copy
        host = self._host_rows(len(ids))
        idx = torch.tensor(ids, dtype=torch.long, device=self._slab.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(torch.cuda.current_stream(self._slab.device))
            host.copy_(self._slab.index_select(0, idx), non_blocking=True)
        self._stream.synchronize()
        return host

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, Csa2ConnectorMetadata) or not meta.loads:
            return
        bb = self.layout.block_bytes
        for load in meta.loads:
            self._finished_loading.add(load.req_id)
            if not self._load(load):
                # All or nothing per request: vLLM recomputes a failed one from its first token.
                self._failed_loading.add(load.req_id)

    def _load(self, load: _Load) -> bool:
        bb = self.layout.block_bytes
        host = self._host_rows(len(load.blocks))
        for i, (_, key) in enumerate(load.blocks):
            try:
                n = self._ssd.get_into(self._rk(key), host[i].data_ptr(), bb)
            except Csa2Error as e:
                n = None
                if e.status == _store.STATUS_CORRUPT:
                    self._count("ssd_corrupt")
                logger.warning("%s: SSD read for request %s failed (%s); vLLM recomputes it",
                               CONNECTOR_NAME, load.req_id, e.message)
            if n != bb:
                self._lost.lost_ssd_keys.add(key)
                self._count("ssd_misses")
                return False
        snap = None
        if load.snapshot is not None:
            n_rows = len(load.snapshot_blocks)
            got = None
            if n_rows:
                snap = self._host_rows(n_rows)
                try:
                    got = self._dram.get_into(load.snapshot, snap.data_ptr(), n_rows * bb)
                except Csa2Error as e:
                    logger.warning("%s: snapshot read failed: %s", CONNECTOR_NAME, e.message)
            if not n_rows or got != n_rows * bb:
                # vLLM was told the window is restored: without it the request is recomputed.
                self._lost.lost_snapshots.add(load.snapshot)
                self._count("dram_misses")
                return False
        if load.blocks:
            self._to_slab([b for b, _ in load.blocks], host)
            self._count("bytes_loaded", len(load.blocks) * bb)
        if snap is not None:
            self._to_slab(load.snapshot_blocks, snap)
            self._count("bytes_loaded", snap.numel())
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load finished in start_load_kv

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # whole slabs are saved per step in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, Csa2ConnectorMetadata):
            return
        bb = self.layout.block_bytes
        for save in meta.saves:
            if save.blocks and not self._ssd.read_only:
                rows = self._from_slab([b for b, _ in save.blocks])
                for i, (_, key) in enumerate(save.blocks):
                    try:
                        if self._ssd.put(self._rk(key), (rows[i].data_ptr(), bb)):
                            self._count("ssd_saved")
                            self._count("bytes_saved", bb)
                    except Csa2Error as e:
                        self._lost.lost_ssd_keys.add(key)
                        if e.status == _store.STATUS_REFUSED:
                            self._count("ssd_refused")
                        else:
                            logger.warning("%s: SSD write failed: %s", CONNECTOR_NAME, e.message)
            elif save.blocks:
                self._lost.lost_ssd_keys.update(k for _, k in save.blocks)
            if save.snapshot is not None:
                rows = self._from_slab(save.snapshot_blocks).contiguous()
                try:
                    self._dram.put(save.snapshot, (rows.data_ptr(), rows.numel()))
                    self._count("dram_saved")
                    self._count("bytes_saved", rows.numel())
                except Csa2Error as e:
                    self._lost.lost_snapshots.add(save.snapshot)
                    self._count("dram_refused")
                    logger.warning("%s: snapshot refused: %s", CONNECTOR_NAME, e.message)
            if save.finishes:
                self._finished_saving.add(save.req_id)

    def get_finished(self, finished_req_ids: set[str]):
        done, self._finished_saving = self._finished_saving, set()
        loaded, self._finished_loading = self._finished_loading, set()
        return (done or None), (loaded or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        failed, self._failed_loading = self._failed_loading, set()
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def build_connector_worker_meta(self):
        if not self._lost.lost_ssd_keys and not self._lost.lost_snapshots:
            return None
        meta, self._lost = self._lost, Csa2WorkerMetadata()
        return meta

    def get_kv_connector_stats(self):
        """This side's counters since the last call (None when nothing happened)."""
        if not any(self._interval.values()):
            return None
        s = Csa2ConnectorStats(data=dict(self._interval))
        self._interval = {k: 0 for k in COUNTERS}
        return s

    def tier_stats(self) -> dict[str, Any]:
        """Footprints and counters of this side's tiers (SSD view / DRAM mirror on the scheduler)."""
        if self._role == KVConnectorRole.SCHEDULER:
            return {"ssd": self._ssd_view.stats(), "dram": self._dram_mirror.stats()}
        return {"ssd": self._ssd.stats() if self._ssd else None,
                "dram": self._dram.stats() if self._dram else None}

    def shutdown(self):
        for name in ("_ssd", "_dram", "_ssd_view", "_dram_mirror"):
            h = getattr(self, name, None)
            if h is not None:
                h.close()
                setattr(self, name, None)
