"""Scale-out: vLLM 0.33's ``MultiConnector`` over [``Csa2Connector``, ``MooncakeStoreConnector``]
against a real ``mooncake_master`` started and stopped here, on loopback ports picked free.

Engine 1 (this process) computes a 520-token prompt: csa2 saves its two full 256-token blocks to
its SSD tier and Mooncake puts them into the distributed pool (engine 1's mounted segment). Engine
2 — another process, with its own, empty SSD directory (the prefix is not in its local tiers) —
gets the prefix from the pool: csa2 misses, Mooncake's lookup hits, vLLM takes the hit with its
bounded replay (Mooncake restores the prefix-cacheable group only) and the blocks hold engine 1's
bytes exactly. Engine 2 saved them to its own SSD tier on the way; the same prefix again is a local
hit (csa2 is asked first and wins): no remote get, the window restored from csa2's DRAM pool.
See ``_mooncake_engine.py`` for what is real (everything but a CPU stand-in for a CUDA event).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

import _mooncake_engine as M

_why = M.mooncake_importable()
if _why is not None:
    # A missing prerequisite fails the run (a passing test command has run every test).
    pytest.fail(f"Mooncake store unavailable: {_why}. It needs the system libraries libfabric1 and "
                "libibverbs1 (`sudo apt-get install libfabric1 libibverbs1`) and the pip package "
                "mooncake-transfer-engine-efa-non-cuda==0.3.13.post1, which python_shim/run_tests.sh "
                "installs", pytrace=False)

import _connector_engine as E  # noqa: E402

PROMPT = [(i * 37 + 11) % 5000 for i in range(520)]
HIT = 512


def _extra(d: str) -> dict:
    return {"ssd_dir": d, "ssd_capacity_bytes": 1 << 30, "dram_pool_bytes": 256 << 20,
            "fsync": "never"}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("mooncake")
    saved_env = {k: os.environ.get(k)
                 for k in ("MOONCAKE_CONFIG_PATH", "VLLM_HOST_IP", "MC_TCP_BIND_ADDRESS")}
    master = M.Master(str(root / "master.log"))
    eng = None
    try:
        os.environ["MOONCAKE_CONFIG_PATH"] = master.client_config(str(root / "mooncake.json"))
        # The addresses each engine's transfer engine announces (its segment name, its RPC
        # endpoint): loopback, not the machine's outward interface. (Mooncake 0.3.13 still listens
        # on every interface; the traffic goes to 127.0.0.1.)
        os.environ["VLLM_HOST_IP"] = "127.0.0.1"
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        M.cpu_cuda_event()
        tiny = E.Tiny(str(root / "model"))
        eng = M.MultiEngine(tiny, _extra(str(root / "ssd-engine1")), lookup_port=M.free_port())
        eng.add("t1", PROMPT, 1)
        eng.step()
        lay = eng.csa2.layout
        prefix = eng.slab_rows(eng.blocks["t1"][lay.prefix_group][:2])
        eng.run()
        yield {"root": root, "tiny": tiny, "engine": eng, "master": master, "prefix": prefix}
    finally:
        if eng is not None:
            eng.close()
        M.shutdown_single_rank()
        master.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_engine1_saves_to_both_tiers(pool):
    eng = pool["engine"]
    assert eng.csa2_worker.counters["ssd_saved"] == 2
    # MooncakeStoreConnector's own counters (its worker stats, through MultiConnector).
    assert eng.counted(M.MOONCAKE_NAME, "save_put_total_keys") == 2
    assert eng.counted(M.MOONCAKE_NAME, "save_put_failed_keys") == 0
    assert eng.counted(M.MOONCAKE_NAME, "save_put_total_bytes") > 0


_CHILD = r"""
import hashlib, json, os, pickle, sys
sys.path.insert(0, sys.argv[1])
args = json.loads(open(sys.argv[2]).read())
import _mooncake_engine as M
M.cpu_cuda_event()
tiny = pickle.loads(open(args["tiny"], "rb").read())
eng = M.MultiEngine(tiny, args["extra"], lookup_port=args["lookup_port"])
out = {"local_records": eng.csa2_worker._ssd.recovery.records}
lay = eng.csa2.layout
turn = args["turn"]
for rid in ("remote", "local"):
    eng.scheduler.reset_prefix_cache()
    before = {k: eng.counted(M.MOONCAKE_NAME, k) for k in ("load_get_count", "load_get_total_keys")}
    ssd_hits = eng.csa2.counters["ssd_hits"]
    eng.add(rid, turn, 1)
    _, nr = eng.step_until_scheduled(rid)
    rows = eng.slab_rows(eng.blocks[rid][lay.prefix_group][:2])
    eng.run()
    out[rid] = {"computed": nr.num_computed_tokens, "replay_start": nr.replay_start,
                "sha": hashlib.sha256(rows.numpy().tobytes()).hexdigest(),
                "csa2_ssd_hits": eng.csa2.counters["ssd_hits"] - ssd_hits,
                **{k: eng.counted(M.MOONCAKE_NAME, k) - v for k, v in before.items()}}
out["csa2_worker"] = dict(eng.csa2_worker.counters)
import csa2_vllm
out["csa2_vllm"] = os.path.dirname(os.path.abspath(csa2_vllm.__file__))
eng.close()
M.shutdown_single_rank()
print(json.dumps(out))
"""


def test_second_engine_process_gets_the_prefix_from_the_pool_then_locally(pool, tmp_path):
    pk = tmp_path / "tiny.pkl"
    pk.write_bytes(pool["tiny"].dumps())
    args = tmp_path / "args.json"
    args.write_text(json.dumps({
        "tiny": str(pk), "extra": _extra(str(tmp_path / "ssd-engine2")),
        "lookup_port": M.free_port(), "turn": PROMPT}))
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, here, str(args)], capture_output=True, text=True,
        timeout=600,
        # Not the source tree's directory (`python -c` puts the working directory first on
        # sys.path; there `csa2_vllm` is the source package without the wheel's bundled library).
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": os.pathsep.join([here] + [p for p in sys.path if p])})
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    want = hashlib.sha256(pool["prefix"].numpy().tobytes()).hexdigest()
    if os.environ.get("CSA2_EXPECT_WHEEL") == "1":
        # run_tests.sh's wheel mode: the second engine runs the installed package too.
        src = os.path.join(os.path.dirname(here), "csa2_vllm")
        assert not os.path.samefile(res["csa2_vllm"], src), res["csa2_vllm"]
    assert res["local_records"] == 0  # engine 2's local tiers do not hold the prefix
    remote, local = res["remote"], res["local"]
    # From the distributed pool: two blocks fetched by Mooncake, csa2 missed; Mooncake restores
    # the prefix-cacheable group only, so vLLM replays the window (H − 128).
    assert remote["csa2_ssd_hits"] == 0
    assert (remote["load_get_count"], remote["load_get_total_keys"]) == (1, 2)
    assert (remote["computed"], remote["replay_start"]) == (HIT - 128, HIT - 128)
    assert remote["sha"] == want
    # Engine 2 saved the blocks to its own SSD tier (and its DRAM pool) while serving them; now
    # the local tier answers first: csa2 hits, Mooncake gets nothing, the hit is taken whole.
    assert res["csa2_worker"]["ssd_saved"] == 2
    assert local["csa2_ssd_hits"] == 2
    assert (local["load_get_count"], local["load_get_total_keys"]) == (0, 0)
    assert (local["computed"], local["replay_start"]) == (HIT, 0)
    assert local["sha"] == want
