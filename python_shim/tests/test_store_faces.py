"""The SSD tier's vLLM faces under attack: an open that fails for another reason than a held lock,
the scheduler's read-only view beside a worker that removes and compacts, the tensor-parallel rank,
and configuration values that used to mean something else (tiny lifetimes and TTLs, the DRAM pool
per worker, a NUL in a path, a model path too long for a directory name)."""

from __future__ import annotations

import os
import sys

import pytest

from csa2_vllm import _store
from csa2_vllm import connector as conn
from csa2_vllm._lib import Csa2Error

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _side(tmp_path, role: str, tp_size: int = 1, **extra) -> conn.Csa2Connector:
    """One side of the connector with only what its tier code reads (no vLLM engine)."""
    c = object.__new__(conn.Csa2Connector)
    c.config = conn.Csa2ConnectorConfig.parse({"ssd_dir": str(tmp_path / "ssd"),
                                               "dram_pool_bytes": 1 << 20, "fsync": "never",
                                               **extra})
    c._tp_size = tp_size
    c._clock = None
    c.counters = {k: 0 for k in conn.COUNTERS}
    c._interval = dict(c.counters)
    if role == "worker":
        c._role = conn.KVConnectorRole.WORKER
        c._init_worker()
    else:
        c._role = conn.KVConnectorRole.SCHEDULER
        c._init_scheduler()
    return c


# ---- only "held by another writer" may turn a tier read-only -------------------------------------

def _lock_is_a_directory(d: str) -> None:
    """A directory whose writable open fails for another reason than a held lock (its LOCK file
    cannot be opened for writing), while a read-only open of it still works."""
    s = _store.SsdStore(d, 1 << 20, fsync=_store.FSYNC_NEVER)
    s.put(_key(1), b"x" * 100)
    s.close()
    os.remove(os.path.join(d, "LOCK"))
    os.mkdir(os.path.join(d, "LOCK"))


def test_the_store_tells_a_held_lock_from_every_other_open_failure(tmp_path):
    d = str(tmp_path / "held")
    s = _store.SsdStore(d, 1 << 20)
    with pytest.raises(Csa2Error) as e:
        _store.SsdStore(d, 1 << 20)
    assert e.value.status == _store.STATUS_BUSY and "pid" in e.value.message
    s.close()
    d = str(tmp_path / "broken")
    _lock_is_a_directory(d)
    with pytest.raises(Csa2Error) as e:
        _store.SsdStore(d, 1 << 20)
    assert e.value.status != _store.STATUS_BUSY and "LOCK" in e.value.message


def test_a_connector_worker_whose_directory_fails_otherwise_does_not_go_read_only(tmp_path):
    w = _side(tmp_path, "worker")
    _lock_is_a_directory(conn.rank_dir(w.config.ssd_dir, 0, 1))
    with pytest.raises(Csa2Error) as e:
        w._open_tiers()
    assert e.value.status != _store.STATUS_BUSY and "LOCK" in e.value.message
    # A held lock still opens read-only, naming the holder.
    d = conn.rank_dir(w.config.ssd_dir, 0, 1)
    os.rmdir(os.path.join(d, "LOCK"))
    holder = _store.SsdStore(d, 1 << 20)
    try:
        w2 = _side(tmp_path, "worker")
        w2._open_tiers()
        assert w2.read_only
        w2.shutdown()
    finally:
        holder.close()


def test_an_offload_tier_whose_directory_fails_otherwise_stops_the_engine(tmp_path):
    import _offload_engine as E

    extra = E.extra_config(E.tier_config(str(tmp_path / "ssd")))
    eng = E.Engine(str(tmp_path / "model"), extra)
    d = eng.tier.directory
    eng.close()
    os.remove(os.path.join(d, "LOCK"))
    os.mkdir(os.path.join(d, "LOCK"))
    with pytest.raises(Csa2Error) as e:
        E.Engine(str(tmp_path / "model"), extra)
    assert e.value.status != _store.STATUS_BUSY and "LOCK" in e.value.message


# ---- the scheduler's read-only view --------------------------------------------------------------

def _deleted_segments_held() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "/seg-" in target and target.endswith("(deleted)"):
            n += 1
    return n


def test_the_scheduler_view_drops_removed_keys_and_deleted_segments(tmp_path):
    sched = _side(tmp_path, "scheduler")
    d = conn.rank_dir(sched.config.ssd_dir, 0, 1)
    # The worker's store, with 64-KiB segments so that its removals compact segments away.
    w = _store.SsdStore(d, 1 << 30, segment_bytes=64 << 10, fsync=_store.FSYNC_NEVER)
    keys = [_key(i) for i in range(256)]
    for k in keys:
        w.put(k, k * 64)  # 2 KiB each
    # A scheduler started after these were written (a restart) sees them all.
    sched.shutdown()
    sched = _side(tmp_path, "scheduler")
    sched._refresh_view()
    assert all(sched._has_block(k) for k in keys)
    before = _deleted_segments_held()
    removed = keys[:128]
    for k in removed:
        assert w.remove(k)
    assert w.stats().compactions > 0
    sched._refresh_view()
    stale = sum(sched._has_block(k) for k in removed)
    kept = sum(sched._has_block(k) for k in keys[128:])
    held = _deleted_segments_held() - before
    print(f"scheduler view: {stale}/128 removed keys answered as hits, {kept}/128 kept keys "
          f"hits, {held} deleted segment files held open, {sched._view_refreshes} refreshes")
    assert stale == 0
    assert kept == 128
    assert held == 0
    w.close()
    sched.shutdown()


# ---- the tensor-parallel rank --------------------------------------------------------------------

def test_an_unknown_rank_with_tensor_parallelism_is_refused(tmp_path, monkeypatch):
    import vllm.distributed.parallel_state as ps

    def not_initialised():
        raise AssertionError("tensor model parallel group is not initialized")

    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", not_initialised)
    w = _side(tmp_path, "worker", tp_size=2)
    with pytest.raises(RuntimeError, match="rank"):
        w._open_tiers()
    assert not os.path.exists(tmp_path / "ssd" / "tp0of2")
    # One rank needs no parallel state.
    one = _side(tmp_path, "worker", tp_size=1)
    one._open_tiers()
    assert one._rank == 0
    one.shutdown()


def test_ranks_store_under_their_own_keys_and_directories(tmp_path, monkeypatch):
    import vllm.distributed.parallel_state as ps

    workers = []
    for rank in (0, 1):
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda r=rank: r)
        w = _side(tmp_path, "worker", tp_size=2)
        w._open_tiers()
        workers.append(w)
    k = _key(7)
    keys = {conn.rank_key(k, r, 2) for r in (0, 1)} | {k}
    assert len(keys) == 3 and conn.rank_key(k, 0, 1) == k
    for r, w in enumerate(workers):
        w._ssd.put(w._rk(k), bytes([r]) * 64)
    # Rank 1's store does not hold rank 0's key even if both were pointed at one directory.
    assert workers[1]._ssd.get(conn.rank_key(k, 0, 2), 64) is None
    assert workers[0]._ssd.get(workers[0]._rk(k), 64) == b"\0" * 64
    assert sorted(os.listdir(tmp_path / "ssd")) == ["tp0of2", "tp1of2"]
    # The scheduler probes rank 0's key in rank 0's directory.
    sched = _side(tmp_path, "scheduler", tp_size=2)
    assert sched._has_block(k)
    for w in workers:
        w.shutdown()
    sched.shutdown()


# ---- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad,word", [
    ({"min_lifetime_hours": 1e-7}, "min_lifetime_hours"),
    ({"min_lifetime_hours": float("inf")}, "min_lifetime_hours"),
    ({"min_lifetime_hours": float("nan")}, "min_lifetime_hours"),
    ({"dram_ttl_s": 0.0001}, "dram_ttl_s"),
    ({"dram_ttl_s": 1e300}, "dram_ttl_s"),
])
def test_tiny_or_unbounded_times_are_refused_by_the_connector(bad, word):
    with pytest.raises(ValueError, match=word):
        conn.Csa2ConnectorConfig.parse({"ssd_dir": "x", **bad})


def test_the_smallest_times_the_connector_takes_are_one_millisecond():
    c = conn.Csa2ConnectorConfig.parse({"ssd_dir": "x", "min_lifetime_hours": 1 / 3_600_000,
                                        "dram_ttl_s": 0.001})
    assert (c.min_lifetime_ms, c.dram_ttl_ms) == (1, 1)


@pytest.mark.parametrize("bad", [{"min_lifetime_hours": 1e-7}, {"min_lifetime_hours": 1e400}])
def test_tiny_or_unbounded_lifetimes_are_refused_by_the_offload_tier(bad):
    from csa2_vllm.offload import _parse

    with pytest.raises(ValueError, match="min_lifetime_hours"):
        _parse("Csa2SsdTier", {"ssd_dir": "x", **bad})


def test_the_default_dram_pool_is_ten_percent_of_the_machine_shared_by_its_workers():
    host = _store.host_memory_bytes()
    for n in (1, 2, 8):
        c = conn.Csa2ConnectorConfig.parse({"ssd_dir": "x"}, workers_per_machine=n)
        assert c.dram_pool_bytes == host // 10 // n
    given = conn.Csa2ConnectorConfig.parse({"ssd_dir": "x", "dram_pool_bytes": 12345},
                                           workers_per_machine=8)
    assert given.dram_pool_bytes == 12345

    class PC:
        tensor_parallel_size, pipeline_parallel_size = 4, 2

    assert conn.local_workers(PC()) == 8


def test_a_nul_in_a_store_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="NUL"):
        _store.SsdStore(str(tmp_path / "a\0b"), 1 << 20)
    assert os.listdir(tmp_path) == []


def test_long_directory_names_are_shortened_uniquely():
    from csa2_vllm.offload import MAX_NAME_BYTES, short_dir

    a, b = "/r/" + "é" * 200 + "_x_c4096", "/r/" + "é" * 200 + "_y_c4096"
    sa, sb = short_dir(a), short_dir(b)
    assert sa != sb and os.path.dirname(sa) == "/r"
    assert all(len(os.fsencode(os.path.basename(s))) <= MAX_NAME_BYTES for s in (sa, sb))
    assert short_dir("/r/short_c1") == "/r/short_c1"


def test_an_offload_tier_for_a_long_model_path_starts(tmp_path):
    import _offload_engine as E

    model = tmp_path / ("m" * 200)
    extra = E.extra_config(E.tier_config(str(tmp_path / "ssd")))
    eng = E.Engine(str(model), extra)
    try:
        name = os.path.basename(eng.tier.directory)
        assert len(os.fsencode(name)) <= 255 and os.path.isdir(eng.tier.directory)
        assert not eng.tier.read_only
    finally:
        eng.close()
