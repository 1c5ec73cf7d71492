"""csa2's SSD store as a secondary tier of vLLM 0.33's ``OffloadingConnector``
(``TieringOffloadingSpec``, ``{"type": "Csa2SsdTier", "module_path": "csa2_vllm.offload"}``).

Everything runs through vLLM's own classes on CPU (``_offload_engine.py`` says what stands in for
the GPU): the real ``Scheduler``, the real ``OffloadingConnector`` on both sides with vLLM's
``TieringOffloadingManager`` and CPU primary tier, and the tier from its factory. A tiny Llama (two
full-attention layers, 16-token blocks) is the model — any model vLLM offloads gets this tier.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PROMPT = [(7 * i + 3) % 1000 for i in range(8 * 16 + 5)]  # 8 full blocks + 5 tokens
FULL = 8


def _engine(tmp_path, **tier_kw):
    """An engine of the one tiny model (its directory is part of vLLM's run identity, so every
    engine of a test uses the same one) over the test's SSD tier root."""
    import _offload_engine as E

    extra = E.extra_config(E.tier_config(str(tmp_path / "ssd"), **tier_kw))
    return E.Engine(str(tmp_path / "model"), extra)


def _turn(eng, rid, tokens, max_tokens=3):
    eng.add(rid, tokens, max_tokens)
    eng.run()


def _prompt_bytes(eng, rid):
    return eng.block_bytes(eng.blocks[rid][:FULL])


# ---- loading and configuration --------------------------------------------------------------------

def test_the_factory_finds_the_tier_by_type_and_module_path():
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from csa2_vllm import offload

    cls = SecondaryTierFactory.get_tier_class({"type": offload.TIER_TYPE,
                                               "module_path": offload.TIER_MODULE})
    assert cls is offload.Csa2SsdTier


def test_the_plugin_registers_the_tier_by_name():
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from csa2_vllm import offload, plugin

    plugin.register()
    plugin._register_offload_tier()  # idempotent: our own name is left alone
    assert SecondaryTierFactory.get_tier_class({"type": "Csa2SsdTier"}) is offload.Csa2SsdTier
    assert (plugin.TIER_TYPE, plugin.TIER_MODULE) == (offload.TIER_TYPE, offload.TIER_MODULE)


@pytest.mark.parametrize("bad,word", [
    ({}, "ssd_dir"),
    ({"ssd_dir": "x", "capacity": 1}, "capacity"),
    ({"ssd_dir": "x", "fsync": "sometimes"}, "fsync"),
    ({"ssd_dir": "x", "capacity_bytes": 0}, "capacity_bytes"),
    ({"ssd_dir": "x", "min_lifetime_hours": "long"}, "min_lifetime_hours"),
    ({"ssd_dir": "x", "on_locked": "wait"}, "on_locked"),
    ({"ssd_dir": "x", "verify_on_open": "yes"}, "verify_on_open"),
])
def test_bad_tier_config_is_refused_naming_the_key(bad, word):
    from csa2_vllm.offload import _parse

    with pytest.raises(ValueError, match=word):
        _parse("Csa2SsdTier", bad)


def test_defaults():
    from csa2_vllm import _store
    from csa2_vllm.offload import _parse

    c = _parse("Csa2SsdTier", {"ssd_dir": "d"})
    assert c["min_lifetime_ms"] == 72 * 3_600_000
    assert c["capacity_bytes"] == 64 << 30
    assert c["fsync"] == _store.FSYNC_ALWAYS
    assert c["on_locked"] == "read_only" and c["verify_on_open"] is True


# ---- the tier inside vLLM's OffloadingConnector ----------------------------------------------------

def test_save_reset_hit_from_the_ssd_tier_bytes_identical(tmp_path):
    eng = _engine(tmp_path)
    try:
        _turn(eng, "t1", PROMPT)
        saved = _prompt_bytes(eng, "t1")
        assert eng.computed_at_admission["t1"] == 0
        tier = eng.tier
        c = tier.counters()
        # offload_prompt_only (vLLM's default): the prompt's full blocks, one chunk each.
        assert c["stored"] == FULL and c["refused"] == 0, c
        assert tier.store_stats().entries == FULL

        # HBM prefix cache and the CPU primary tier dropped; the SSD tier keeps its records.
        assert eng.scheduler.reset_prefix_cache(reset_connector=True)
        for t in eng.kv.values():
            t.zero_()  # nothing left in the slab that a missed load could pass for a hit

        _turn(eng, "t2", PROMPT + [11, 12, 13])
        assert eng.computed_at_admission["t2"] == FULL * 16  # the whole prefix came back
        c = tier.counters()
        assert c["hits"] >= FULL and c["loaded"] == FULL and c["corrupt"] == 0, c
        assert c["bytes_read"] == FULL * tier.block_size_bytes
        assert _prompt_bytes(eng, "t2") == saved
        assert eng.blocks["t2"][:FULL] != [] and any(any(b) for b in saved)
    finally:
        eng.close()


def test_another_model_gets_no_hits_and_its_own_directory(tmp_path):
    import _offload_engine as E

    eng = _engine(tmp_path)
    try:
        _turn(eng, "t1", PROMPT)
        first_dir = eng.tier.directory
    finally:
        eng.close()
    other = dict(E.LLAMA, intermediate_size=256)  # another model: other run identity
    extra = E.extra_config(E.tier_config(str(tmp_path / "ssd")))
    eng = E.Engine(str(tmp_path / "model-other"), extra, model=other)
    try:
        assert eng.tier.directory != first_dir
        _turn(eng, "t2", PROMPT)
        assert eng.computed_at_admission["t2"] == 0
        assert eng.tier.counters()["hits"] == 0
    finally:
        eng.close()


_RESTART = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import _offload_engine as E
eng = E.Engine(sys.argv[3], E.extra_config(E.tier_config(sys.argv[2])))
prompt = json.loads(sys.argv[4])
eng.add("t2", prompt, 3)
eng.run()
out = {"computed": eng.computed_at_admission["t2"], "counters": eng.tier.counters(),
       "recovered": eng.tier._store.recovery.records,
       "bytes": [b.hex() for b in eng.block_bytes(eng.blocks["t2"][:8])]}
eng.close()
print("RESULT " + json.dumps(out))
"""


def test_a_restart_in_a_new_process_finds_the_records(tmp_path):
    eng = _engine(tmp_path)
    try:
        _turn(eng, "t1", PROMPT)
        saved = _prompt_bytes(eng, "t1")
    finally:
        eng.close()  # closes the tier: the directory's lock goes with it
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-c", _RESTART, HERE, str(tmp_path / "ssd"),
                        str(tmp_path / "model"), json.dumps(PROMPT)],
                       capture_output=True, text=True, env=env, timeout=900,
                       # `python -c` puts the working directory on sys.path: run the child
                       # outside the source tree, so in wheel mode it imports the installed
                       # package (with its bundled library), not python_shim/csa2_vllm.
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-4000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    assert out["recovered"] == FULL
    assert out["computed"] == FULL * 16
    assert out["counters"]["loaded"] == FULL
    assert [bytes.fromhex(h) for h in out["bytes"]] == saved


@pytest.mark.parametrize("verify_on_open", [True, False])
def test_a_corrupted_record_is_a_miss_never_wrong_bytes(tmp_path, verify_on_open):
    eng = _engine(tmp_path)
    try:
        _turn(eng, "t1", PROMPT)
        saved = _prompt_bytes(eng, "t1")
        directory = eng.tier.directory
        first = _store_key(eng, "t1", 0)
    finally:
        eng.close()
    # Flip one payload byte of the prefix's first block's record (found by its key, bytes 8..40
    # of the record header; the payload follows the 64-B header).
    hits = []
    for seg in sorted(glob.glob(os.path.join(directory, "seg-*.log"))):
        data = open(seg, "rb").read()
        at = data.find(first)
        if at >= 0:
            hits.append((seg, at - 8))
    assert len(hits) == 1, hits
    seg, rec = hits[0]
    with open(seg, "r+b") as f:
        f.seek(rec + 64 + 1000)
        b = f.read(1)
        f.seek(rec + 64 + 1000)
        f.write(bytes([b[0] ^ 0x5A]))

    eng = _engine(tmp_path, verify_on_open=verify_on_open)
    try:
        tier = eng.tier
        if verify_on_open:
            assert tier._store.recovery.corrupt_records == 1
            assert tier._store.recovery.records == FULL - 1
        _turn(eng, "t2", PROMPT)
        c = tier.counters()
        # The chain breaks at its first block: nothing of the prefix is a hit.
        assert eng.computed_at_admission["t2"] == 0
        if not verify_on_open:
            assert c["corrupt"] == 1, c  # found by the load's CRC check, dropped
        # The recomputed block was offloaded again: a good record replaces the damaged one.
        assert c["stored"] >= 1, c
        assert tier._store.get(first, tier.block_size_bytes) is not None
        # What the request holds is what it computed, identical to turn 1.
        assert _prompt_bytes(eng, "t2") == saved
    finally:
        eng.close()


def _store_key(eng, rid, block):
    """The store key of a request's block: vLLM's OffloadKey (block hash, KV group 0) through the
    tier's keying."""
    from vllm.v1.kv_offload.base import make_offload_key

    h = eng.requests[rid].block_hashes[block]
    return eng.tier.store_key(make_offload_key(h, 0))


def test_a_second_engine_on_the_directory_is_read_only_or_refused(tmp_path):
    a = _engine(tmp_path)
    try:
        assert not a.tier.read_only
        b = _engine(tmp_path)
        try:
            assert b.tier.read_only
            _turn(b, "t1", PROMPT)
            c = b.tier.counters()
            assert c["stored"] == 0 and c["skipped_read_only"] == FULL, c
        finally:
            b.close()
        with pytest.raises(Exception, match="(?i)lock|held|pid"):
            _engine(tmp_path, on_locked="error")
    finally:
        a.close()
