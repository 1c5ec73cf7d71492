"""kill -9 cycles of a process saving through ``Csa2Connector``'s worker side.

Each cycle forks a child (from a fork server that imported vLLM and torch once, so a cycle costs a
fork, not an interpreter start) that opens the connector's worker tiers on one SSD directory and saves
blocks through ``wait_for_save`` — the worker's own save path, rank keys and all — printing a block's
index once its save came back without the block being reported lost: that is the connector's
acknowledgement. The parent kills the child with SIGKILL after a random number of
acknowledgements, then checks, through a fresh worker and a fresh scheduler view, that every block
acknowledged in any cycle is served byte for byte, and that the first unacknowledged one is whole
or absent. Even cycles use ``fsync: "always"``. ``CSA2_CONNECTOR_KILL_CYCLES`` sets the cycles
(default 30).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import types

import torch

from csa2_vllm import connector as conn

BLOCK_BYTES = 6000
SLAB_BLOCKS = 8


def _key(i: int) -> bytes:
    return hashlib.sha256(b"kill-cycle-block" + i.to_bytes(8, "little")).digest()


def _payload(i: int) -> bytes:
    seed = hashlib.sha256(b"kill-cycle-bytes" + i.to_bytes(8, "little")).digest()
    return (seed * (BLOCK_BYTES // 32 + 1))[:BLOCK_BYTES]


def _side(root: str, role: str, fsync: str) -> conn.Csa2Connector:
    c = object.__new__(conn.Csa2Connector)
    c.config = conn.Csa2ConnectorConfig.parse({"ssd_dir": root, "dram_pool_bytes": 1 << 20,
                                               "fsync": fsync})
    c.layout = types.SimpleNamespace(block_bytes=BLOCK_BYTES, num_blocks=SLAB_BLOCKS)
    c._tp_size = 1
    c._clock = None
    c.counters = {k: 0 for k in conn.COUNTERS}
    c._interval = dict(c.counters)
    if role == "worker":
        c._role = conn.KVConnectorRole.WORKER
        c._init_worker()
        c._slab = torch.zeros((SLAB_BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
        c._open_tiers()
    else:
        c._role = conn.KVConnectorRole.SCHEDULER
        c._init_scheduler()
    return c


def _child(root: str, fsync: str, start: int, out) -> None:
    w = _side(root, "worker", fsync)
    i = start
    while True:
        row = i % SLAB_BLOCKS
        w._slab[row] = torch.frombuffer(bytearray(_payload(i)), dtype=torch.uint8)
        w.bind_connector_metadata(conn.Csa2ConnectorMetadata(
            saves=[conn._Save(f"r{i}", [(row, _key(i))])]))
        w.wait_for_save()
        if _key(i) not in w._lost.lost_ssd_keys:
            out.send_bytes(b"%d" % i)
        i += 1


def _run_cycle(ctx, root: str, fsync: str, start: int, acks_wanted: int) -> list[int]:
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(root, fsync, start, w), daemon=True)
    p.start()
    w.close()
    acked = []
    try:
        while len(acked) < acks_wanted:
            acked.append(int(r.recv_bytes()))
    except EOFError:
        pass  # the child died on its own: its exit code says why
    p.kill()
    p.join()
    assert p.exitcode == -9, f"the child ended before the kill (exit code {p.exitcode})"
    # Acknowledgements already in the pipe when the kill landed count too.
    while r.poll():
        try:
            acked.append(int(r.recv_bytes()))
        except EOFError:
            break
    r.close()
    return acked


def test_kill_dash_nine_of_a_connector_worker_loses_no_acknowledged_block(tmp_path):
    cycles = int(os.environ.get("CSA2_CONNECTOR_KILL_CYCLES", "30"))
    root = str(tmp_path / "ssd")
    rng = random.Random(29)
    # Children fork from a fresh server that has only imported the modules: a child forked from
    # this process after torch has started its threads could deadlock in its first torch call.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "csa2_vllm.connector"])
    acked: list[int] = []
    nxt = 0
    unacked_whole = 0
    for cycle in range(cycles):
        fsync = "always" if cycle % 2 == 0 else "never"
        got = _run_cycle(ctx, root, fsync, nxt, rng.randint(1, 60))
        assert got == list(range(nxt, nxt + len(got))), "acknowledgements out of order"
        acked += got
        nxt += len(got)
        # A fresh worker (the restarted engine's) serves every acknowledged block byte for byte.
        w = _side(root, "worker", fsync)
        check = acked[-len(got):] + rng.sample(acked, min(32, len(acked)))
        for i in check:
            assert w._ssd.get(w._rk(_key(i)), BLOCK_BYTES) == _payload(i), f"block {i} lost"
        # The first unacknowledged block is whole or absent, never wrong.
        tail = w._ssd.get(w._rk(_key(nxt)), BLOCK_BYTES)
        assert tail in (None, _payload(nxt)), f"cycle {cycle}: block {nxt} torn and served"
        unacked_whole += tail is not None
        w.shutdown()
        nxt += 1  # the next cycle starts after the block whose save the kill may have cut
    # Final check of every acknowledged block, and the scheduler's restarted view agrees.
    w = _side(root, "worker", "never")
    lost = [i for i in acked if w._ssd.get(w._rk(_key(i)), BLOCK_BYTES) is None]
    wrong = [i for i in acked
             if (g := w._ssd.get(w._rk(_key(i)), BLOCK_BYTES)) is not None and g != _payload(i)]
    w.shutdown()
    sched = _side(root, "scheduler", "never")
    unseen = [i for i in acked if not sched._has_block(_key(i))]
    sched.shutdown()
    print(f"connector kill -9: {cycles} cycles, {len(acked)} blocks acknowledged, {len(lost)} "
          f"lost, {len(wrong)} wrong, {unacked_whole} unacknowledged but whole, "
          f"{len(unseen)} not seen by the restarted scheduler")
    assert acked, "no cycle acknowledged anything"
    assert (lost, wrong, unseen) == ([], [], [])
