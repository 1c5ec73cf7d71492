"""``Csa2Connector`` with vLLM 0.33's real ``Scheduler`` and KV planner, its worker side on a CPU
slab filled by vLLM's writer kernels (Triton interpreter). See ``_connector_engine.py``.

Turn 1 (a 600-token prompt, 3 outputs) runs once per module; its SSD directory is copied for the
tests that need a fresh engine, so each of them pays only for the tokens it adds.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from csa2_vllm import _store
from csa2_vllm import connector as conn
from csa2_vllm._lib import Csa2Error

import _connector_engine as E
from vllm.v1.worker.utils import allocate_kv_cache

PROMPT = [(i * 37 + 11) % 5000 for i in range(600)]
TTL_MS = 300_000
HIT = 512  # two 256-token blocks; the 600-token prompt's third block is partial


def _extra(d: str) -> dict:
    return {"ssd_dir": d, "ssd_capacity_bytes": 1 << 30, "dram_pool_bytes": 256 << 20,
            "dram_ttl_s": TTL_MS / 1000, "fsync": "never"}


def _new_req(engine, rid):
    return next(n for n in engine.new_reqs if n.req_id == rid)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("connector")
    tiny = E.Tiny(str(root / "model"))
    clock = _store.ManualClock(1_000_000)
    conn.use_clock(clock)
    d = str(root / "ssd")
    eng = E.Engine(tiny, _extra(d))
    eng.add("t1", PROMPT, 3)
    so = eng.step()
    assert _new_req(eng, "t1").num_computed_tokens == 0
    # The prompt's blocks as the writers left them, before anything frees them.
    ids = eng.blocks["t1"]
    lay = eng.sched_conn.layout
    saved = {"prefix": eng.slab_rows(ids[lay.prefix_group][:2])}
    win = []
    for gid, bt, w in lay.window_groups:
        win += ids[gid][(HIT - w) // bt:HIT // bt]
    for gid in lay.state_groups:
        win += ids[gid]
    saved["window"] = eng.slab_rows(win)
    assert so.num_scheduled_tokens == {"t1": 600}
    eng.run()
    assert "t1" in eng.finished
    yield {"tiny": tiny, "clock": clock, "engine": eng, "dir": d, "root": root, "saved": saved,
           "turn1": list(eng.requests["t1"].all_token_ids)}
    eng.close()
    conn.use_clock(None)


def _copy_dir(world, name):
    dst = str(world["root"] / name)
    shutil.copytree(world["dir"], dst, ignore=shutil.ignore_patterns("LOCK"))
    return dst


def test_turn1_saved_blocks_and_snapshot(world):
    eng = world["engine"]
    c = eng.worker.counters
    assert c["ssd_saved"] == 2 and c["ssd_refused"] == 0
    assert c["dram_saved"] >= 1
    st = eng.worker.tier_stats()
    assert st["ssd"].entries == 2
    assert st["dram"].entries >= 1
    # The SSD records are vLLM's slab bytes as they were, under the fingerprinted keys.
    keys = eng.sched_conn._block_keys(eng.requests["t1"], 600)
    for j, k in enumerate(keys):
        got = eng.worker._ssd.get(k, eng.sched_conn.layout.block_bytes)
        assert got == bytes(world["saved"]["prefix"][j].numpy())


def test_turn2_takes_the_hit_whole_with_the_window_restored(world):
    eng = world["engine"]
    turn2 = world["turn1"] + [7] * 40
    eng.scheduler.reset_prefix_cache()
    before = dict(eng.sched_conn.counters)
    eng.add("t2", turn2, 2)
    so, nr = eng.step_until_scheduled("t2")
    assert (nr.num_computed_tokens, nr.replay_start) == (HIT, 0)
    assert so.num_scheduled_tokens == {"t2": len(turn2) - HIT}
    after = eng.sched_conn.counters
    assert after["replays_avoided"] == before["replays_avoided"] + 1
    assert after["ssd_hits"] == before["ssd_hits"] + 2
    # Loaded bytes: the prefix blocks and the window/ring blocks hold exactly turn 1's bytes.
    lay = eng.sched_conn.layout
    ids = eng.blocks["t2"]
    assert torch.equal(eng.slab_rows(ids[lay.prefix_group][:2]), world["saved"]["prefix"])
    win = []
    for gid, bt, w in lay.window_groups:
        win += ids[gid][(HIT - w) // bt:HIT // bt]
    # The ring block was rewritten by this step's forward (tokens past the hit); the window was
    # not (no token of this step falls in [HIT - 128, HIT)).
    n_win = len(win)
    assert torch.equal(eng.slab_rows(win), world["saved"]["window"][:n_win])
    eng.run()
    assert "t2" in eng.finished


def test_expired_snapshot_falls_back_to_bounded_replay(world):
    eng = world["engine"]
    world["clock"].advance(TTL_MS + 1)
    eng.scheduler.reset_prefix_cache()
    before = dict(eng.sched_conn.counters)
    turn3 = world["turn1"][:HIT + 20]
    eng.add("t3", turn3, 1)
    _, nr = eng.step_until_scheduled("t3")
    assert (nr.num_computed_tokens, nr.replay_start) == (HIT - 128, HIT - 128)
    after = eng.sched_conn.counters
    assert after["replays_run"] == before["replays_run"] + 1
    assert after["replays_avoided"] == before["replays_avoided"]
    eng.run()


def test_other_fingerprint_gets_no_hits(world):
    d = _copy_dir(world, "ssd-other-model")
    tiny = world["tiny"]
    other = pickle.loads(pickle.dumps(tiny))
    other.vllm_config.model_config.hf_text_config.rope_theta = 20000
    eng = E.Engine(other, _extra(d), worker=False)
    try:
        assert eng.sched_conn._ssd_view.recovery.records == 2
        eng.add("x", world["turn1"][:HIT + 20], 1)
        so = eng.scheduler.schedule()
        assert so.scheduled_new_reqs[0].num_computed_tokens == 0
        # The same directory under the right fingerprint hits (the load itself is not run here).
        same = E.Engine(tiny, _extra(d), worker=False)
        same.add("y", world["turn1"][:HIT + 20], 1)
        assert same.sched_conn.get_num_new_matched_tokens(same.requests["y"], 0) == (HIT, True)
        same.close()
    finally:
        eng.close()


def test_corrupted_record_on_disk_is_a_miss(world):
    d = _copy_dir(world, "ssd-corrupt-before")
    _flip_first_record(d)
    eng = E.Engine(world["tiny"], _extra(d))
    try:
        assert eng.worker._ssd.recovery.corrupt_records == 1
        eng.add("c", world["turn1"][:HIT + 20], 1)
        so = eng.step()
        assert so.num_scheduled_tokens == {"c": HIT + 20}
        # Block 0 is gone, so nothing chains from it: no hit, the prompt is computed.
        assert _new_req(eng, "c").num_computed_tokens == 0
        eng.run()
    finally:
        eng.close()


def test_record_damaged_after_open_fails_the_load_and_vllm_recomputes(world):
    d = _copy_dir(world, "ssd-corrupt-after")
    eng = E.Engine(world["tiny"], _extra(d))
    try:
        _flip_first_record(d)
        eng.add("c", world["turn1"][:HIT + 20], 1)
        so, nr = eng.step_until_scheduled("c")
        assert eng.worker.counters["ssd_corrupt"] == 1
        # vLLM was told the load failed and recomputes the request from its first token; the
        # block's bytes come from the writers again, identical to turn 1's (the synthetic model
        # is deterministic), never the damaged record's.
        assert so.num_scheduled_tokens == {"c": HIT + 20}
        eng.run()
        assert "c" in eng.finished
        lay = eng.sched_conn.layout
        blk = eng.blocks["c"][lay.prefix_group][0]
        assert torch.equal(eng.slab_rows([blk]), world["saved"]["prefix"][0:1])
        del so
    finally:
        eng.close()


def _flip_first_record(d: str) -> None:
    """Flips one payload bit of the first record (block 0 of turn 1) behind the store's back."""
    rank = os.path.join(d, "tp0of1")
    segs = sorted(p for p in os.listdir(rank) if p.endswith(".log"))
    with open(os.path.join(rank, segs[0]), "r+b") as f:
        f.seek(64 + 1000)
        b = f.read(1)
        f.seek(64 + 1000)
        f.write(bytes([b[0] ^ 0x40]))


def test_second_engine_on_the_directory_is_read_only(world):
    eng = world["engine"]
    other = E.Engine(world["tiny"], _extra(world["dir"]))
    try:
        assert other.worker.read_only and not eng.worker.read_only
        other.add("r", world["turn1"][:HIT + 8], 1)
        _, nr = other.step_until_scheduled("r")
        assert nr.num_computed_tokens == HIT - 128
        lay = other.sched_conn.layout
        assert torch.equal(other.slab_rows(other.blocks["r"][lay.prefix_group][:2]),
                           world["saved"]["prefix"])
        other.run()
        assert other.worker.counters["ssd_saved"] == 0
    finally:
        other.close()
    with pytest.raises(Csa2Error) as e:
        E.Engine(world["tiny"], {**_extra(world["dir"]), "on_locked": "error"})
    assert e.value.status == _store.STATUS_BUSY


def test_tensor_parallel_ranks_get_their_own_directories(world, tmp_path, monkeypatch):
    tiny = world["tiny"]
    vc = tiny.config_for(_extra(str(tmp_path)))
    vc.parallel_config = pickle.loads(pickle.dumps(vc.parallel_config))
    vc.parallel_config.tensor_parallel_size = 2
    workers = []
    for rank in (0, 1):
        monkeypatch.setattr(conn.Csa2Connector, "_tp_rank", lambda self, r=rank: r)
        w = conn.Csa2Connector(vc, conn.KVConnectorRole.WORKER, tiny.kv_cache_config)
        w.register_kv_caches(allocate_kv_cache(tiny.kv_cache_config, torch.device("cpu"),
                                               vc.cache_config.get_resolved_kv_cache_layout()))
        workers.append(w)
    assert sorted(os.listdir(tmp_path)) == ["tp0of2", "tp1of2"]
    assert not workers[0].read_only and not workers[1].read_only
    for w in workers:
        w.shutdown()


_CHILD = r"""
import hashlib, json, os, pickle, sys
sys.path.insert(0, sys.argv[3])
import _connector_engine as E
tiny = pickle.loads(open(sys.argv[1], "rb").read())
extra = json.loads(sys.argv[2])
eng = E.Engine(tiny, extra)
turn = json.loads(open(sys.argv[4]).read())
eng.add("after-restart", turn, 1)
_, nr = eng.step_until_scheduled("after-restart")
lay = eng.sched_conn.layout
rows = eng.slab_rows(eng.blocks["after-restart"][lay.prefix_group][:2])
print(json.dumps({"computed": nr.num_computed_tokens, "replay_start": nr.replay_start,
                  "sha": hashlib.sha256(rows.numpy().tobytes()).hexdigest(),
                  "records": eng.worker._ssd.recovery.records}))
eng.close()
"""


def test_restart_in_a_new_process_finds_the_ssd_entries(world, tmp_path):
    d = _copy_dir(world, "ssd-restart")
    pk = tmp_path / "tiny.pkl"
    pk.write_bytes(world["tiny"].dumps())
    turn = tmp_path / "turn.json"
    turn.write_text(json.dumps(world["turn1"][:HIT + 8]))
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(pk), json.dumps(_extra(d)), here,
                          str(turn)], capture_output=True, text=True, timeout=600,
                         # Not the source tree's directory: `python -c` puts the working directory
                         # first on sys.path, and there `csa2_vllm` is the source package without the
                         # bundled library the installed wheel carries.
                         cwd=str(tmp_path),
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [here] + [p for p in sys.path if p])})
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["records"] == 2
    # A new process has an empty DRAM pool: an SSD hit with vLLM's bounded replay.
    assert (res["computed"], res["replay_start"]) == (HIT - 128, HIT - 128)
    want = hashlib.sha256(world["saved"]["prefix"].numpy().tobytes()).hexdigest()
    assert res["sha"] == want
