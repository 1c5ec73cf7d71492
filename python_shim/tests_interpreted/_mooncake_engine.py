"""The tiny V4.1 engine of ``_connector_engine.py`` with vLLM's ``MultiConnector`` over
[``Csa2Connector``, ``MooncakeStoreConnector``], and a real ``mooncake_master`` on loopback.

What is real: vLLM's ``MultiConnector`` and ``MooncakeStoreConnector`` (scheduler side, worker side,
its lookup server and transfer threads), the Mooncake client (``MooncakeDistributedStore``, TCP
transport) and master from the ``mooncake-transfer-engine-efa-non-cuda`` package, csa2's connector
and tiers. One stand-in: on a CPU-only torch, ``MooncakeStoreWorker.wait_for_save`` creates and
records a ``torch.cuda.Event`` for every save step (vLLM 0.33
``distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py:1968``), which raises without a
CUDA driver. The event fences the forward's GPU writes before the send thread reads the blocks; on
CPU the forward has written them synchronously before ``wait_for_save`` runs, so
``cpu_cuda_event()`` puts in an event whose ``record``/``synchronize`` have nothing to wait for.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import torch

from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

from csa2_vllm import connector as conn

import _connector_engine as E

MOONCAKE_NAME = "MooncakeStoreConnector"


def mooncake_importable() -> str | None:
    """None when the Mooncake client and master are installed, else why not."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        return f"the Mooncake store client does not import ({e})"
    if master_binary() is None:
        return "mooncake_master is not installed beside the Python interpreter or on PATH"
    return None


def master_binary() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if os.access(here, os.X_OK):
        return here
    from shutil import which
    return which("mooncake_master")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """A ``mooncake_master`` with its HTTP metadata server, on loopback ports picked free."""

    def __init__(self, log_path: str):
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics}", "--rpc_thread_num=2"],
            stdout=self.log, stderr=subprocess.STDOUT)
        # Ready when both ports accept a connection (bounded: 300 tries, 0.1 s apart).
        for _ in range(300):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; "
                                   f"log: {log_path}")
            try:
                for p in (self.rpc, self.http):
                    socket.create_connection(("127.0.0.1", p), 0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen; log: {log_path}")

    def client_config(self, path: str, segment_bytes: int = 64 << 20,
                      buffer_bytes: int = 16 << 20) -> str:
        """Writes the JSON that vLLM's ``MooncakeStoreConfig.load_from_config`` reads
        (``MOONCAKE_CONFIG_PATH``): each engine mounts ``segment_bytes`` into the pool."""
        with open(path, "w") as f:
            json.dump({"metadata_server": f"http://127.0.0.1:{self.http}/metadata",
                       "master_server_address": f"127.0.0.1:{self.rpc}", "protocol": "tcp",
                       "device_name": "", "mode": "embedded",
                       "global_segment_size": segment_bytes,
                       "local_buffer_size": buffer_bytes}, f)
        return path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class _CpuEvent:
    """What a CUDA event fences is already done on CPU (see the module docs)."""

    def record(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def cpu_cuda_event() -> None:
    if not torch.cuda.is_available():
        torch.cuda.Event = _CpuEvent  # type: ignore[misc,assignment]


def multi_transfer_config(csa2_extra: dict, lookup_port: int) -> KVTransferConfig:
    """The composition: csa2's local tiers first, Mooncake's distributed pool second."""
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [
            {"kv_connector": conn.CONNECTOR_NAME, "kv_role": "kv_both",
             "kv_connector_module_path": conn.CONNECTOR_MODULE,
             "kv_connector_extra_config": dict(csa2_extra)},
            # lookup_rpc_port only names the scheduler↔worker IPC socket; two engines on one
            # host need two names.
            {"kv_connector": MOONCAKE_NAME, "kv_role": "kv_both",
             "kv_connector_extra_config": {"lookup_rpc_port": lookup_port}},
        ]})


_dist_ready = False


def init_single_rank(vllm_config) -> None:
    """vLLM's parallel groups for one rank on gloo (the Mooncake worker reads TP/PCP/DCP ranks)."""
    global _dist_ready
    if _dist_ready:
        return
    from vllm.distributed import parallel_state as ps
    with set_current_vllm_config(vllm_config):
        ps.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0, backend="gloo")
        ps.initialize_model_parallel(1, 1)
    _dist_ready = True


def shutdown_single_rank() -> None:
    """Undoes ``init_single_rank`` (the other tests of the process run without parallel groups)."""
    global _dist_ready
    if not _dist_ready:
        return
    from vllm.distributed import parallel_state as ps
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    _dist_ready = False


class MultiEngine(E.Engine):
    """``E.Engine`` with the MultiConnector on both sides. ``csa2`` / ``csa2_worker`` are the
    csa2 children (layout, counters, slab); ``mooncake_worker`` the Mooncake child."""

    def __init__(self, tiny: E.Tiny, csa2_extra: dict, lookup_port: int):
        init_none_hash(sha256)
        self.tiny = tiny
        vc = tiny.config_for(csa2_extra)
        vc.kv_transfer_config = multi_transfer_config(csa2_extra, lookup_port)
        self.vllm_config = vc
        init_single_rank(vc)
        with set_current_vllm_config(vc):
            # The worker first: its rank-0 lookup server is what the scheduler side asks.
            self.kv = allocate_kv_cache(tiny.kv_cache_config, torch.device("cpu"),
                                        vc.cache_config.get_resolved_kv_cache_layout())
            self.worker = MultiConnector(vc, KVConnectorRole.WORKER, tiny.kv_cache_config)
            self.worker.register_kv_caches(self.kv)
            self.scheduler = Scheduler(vllm_config=vc,
                                       kv_cache_config=tiny.scheduler_kv_cache_config,
                                       structured_output_manager=StructuredOutputManager(vc),
                                       block_size=E.BLOCK)
        self.multi = self.scheduler.connector
        assert isinstance(self.multi, MultiConnector)
        self.csa2, self.mooncake = self.multi.sub_connectors
        self.csa2_worker, self.mooncake_worker = self.worker.sub_connectors
        assert isinstance(self.csa2, conn.Csa2Connector)
        self.sched_conn = self.csa2  # E.Engine's writers read the csa2 layout from here
        self.hasher = get_request_block_hasher(E.BLOCK, sha256)
        self.requests, self.blocks, self.new_reqs = {}, {}, []
        self.finished: set[str] = set()
        self.steps = 0
        self._synthetic_model()
        # Every worker stats interval, per child connector, as MultiConnector reports them:
        # E.Engine.step hands them to the scheduler once per step; keep a copy for the tests.
        self.stats: list[dict] = []
        report = self.worker.get_kv_connector_stats

        def keep():
            s = report()
            if s is not None:
                self.stats.append({k: v.reduce() for k, v in s.data.items()})
            return s

        self.worker.get_kv_connector_stats = keep

    def _synthetic_model(self) -> None:
        # E.Engine's synthetic model (the same seed and draws, so the same tokens give the same
        # bytes in every engine of the test).
        g = torch.Generator().manual_seed(1234)
        self.latent = {l: (torch.randn(E.VOCAB, 512, generator=g) * 0.5).to(torch.bfloat16)
                       for l in range(len(E.RATIOS))}
        self.k_pre = {l: (torch.randn(E.VOCAB, 128, generator=g) * 0.5).to(torch.bfloat16)
                      for l in E.KV_SOURCES}
        self.ring_rows = (torch.randn(E.VOCAB, 1024, generator=g)).float()
        pos = torch.arange(8192, dtype=torch.float32)[:, None]
        freqs = 1.0 / (10000.0 ** (torch.arange(0, 32, dtype=torch.float32) / 32))
        ang = pos * freqs[None, :]
        self.cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
        self.k_norm = torch.ones(128, dtype=torch.bfloat16)

    def counted(self, connector: str, key: str) -> int:
        return sum(int(s.get(connector, {}).get(key, 0)) for s in self.stats)

    def run(self, max_steps: int = 2000) -> None:
        """Steps until every request finished and both children's saves are done (the Mooncake
        send thread reports its jobs on later steps; bounded, 5 ms apart)."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.multi.has_pending_push_work():
                return
            self.step()
            time.sleep(0.005)
        raise AssertionError("the engine did not drain")

    def step_until_scheduled(self, rid: str, max_steps: int = 2000):
        """Like ``E.Engine.step_until_scheduled``; a Mooncake load arrives from its receive thread
        after some steps (bounded, 5 ms apart)."""
        for _ in range(max_steps):
            so = self.step()
            if so.num_scheduled_tokens.get(rid):
                nr = [n for n in so.scheduled_new_reqs if n.req_id == rid]
                return so, (nr[0] if nr else None)
            time.sleep(0.005)
        raise AssertionError(f"{rid} was not scheduled in {max_steps} steps")

    def slab_rows(self, block_ids: list[int]) -> torch.Tensor:
        return self.csa2_worker._slab[block_ids].clone()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.scheduler.shutdown()
        # vLLM 0.33 closes neither end of the Mooncake lookup channel (see stop_lookup_server).
        client = self.mooncake.connector_scheduler.client
        client.close()
        client.ctx.term()
        stop_lookup_server(self.mooncake_worker.connector_worker.lookup_server)
        self.worker.shutdown()


def stop_lookup_server(server) -> None:
    """Stops the Mooncake worker's lookup server thread and frees its ZMQ context.

    vLLM 0.33 never stops it (``MooncakeStoreWorker.close`` leaves ``lookup_server`` alone,
    ``mooncake/store/worker.py:2266``; the thread is a daemon, ended with the engine process), nor
    closes the scheduler's ``LookupKeyClient`` (its ``close``, line 2462, has no caller). In a
    process that goes on — this test process — the garbage collector later finalizes their
    ``zmq.Context``s, whose ``term()`` waits forever for a socket still open (found hanging in
    test_pools.py after this module, stuck in ``Context.__del__``). So: clear ``running``, wake the thread with one request (an unknown message,
    answered with an error), join it, then close the socket and the context."""
    if server is None:
        return
    import zmq
    server.running = False
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.REQ)
        s.connect("ipc://" + server._ipc_path)
        s.send(b"csa2-test-stop")
        s.recv()
        s.close(linger=0)
    finally:
        ctx.term()
    server.thread.join()
    server.close()
    server.ctx.term()
