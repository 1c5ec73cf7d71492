"""A tiny Llama engine on CPU with vLLM 0.33's real ``OffloadingConnector`` (``TieringOffloadingSpec``
with csa2's SSD store as its secondary tier), for ``test_offload_tier.py``.

What is real: vLLM's config, KV planner, ``allocate_kv_cache`` and ``Scheduler``; the
``OffloadingConnector`` on both sides (its scheduler side with the ``TieringOffloadingManager``,
the CPU primary tier in a shared-memory region and :class:`csa2_vllm.offload.Csa2SsdTier`; its
worker side's ``OffloadingConnectorWorker`` over the CPU slab). What stands in: the model (each
token's K/V page rows are a fixed function of the token id and position, written into the
scheduled slots) and the GPU↔CPU copy engine — vLLM's ``CPUOffloadingWorker`` drives CUDA streams
only, so :class:`CpuTieringSpec` (``TieringOffloadingSpec`` with one method replaced) hands the
connector :class:`CpuChunkWorker`, which copies block pages between the CPU slab and the shared
region's chunks. The secondary tier, the part under test, sees exactly what it sees on a GPU host:
chunks of the primary region, keyed by vLLM's block hashes.
"""

from __future__ import annotations

import json
import os

import torch
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                         VllmConfig, set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_planning
from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                         get_request_block_hasher, init_none_hash)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

BLOCK = 16
LAYERS = 2
HEADS = 2
HEAD = 32
NUM_BLOCKS = 64

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD,
    "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS, "head_dim": HEAD, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


class CpuChunkWorker(OffloadingWorker):
    """GPU↔CPU transfers of the OffloadingConnector, done on CPU tensors: chunk ``c`` of the shared
    region holds, for each of the slab's tensors in order, the pages of the chunk's blocks."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region: SharedOffloadRegion):
        self.tensors = [t.tensor.view(torch.uint8).view(t.tensor.shape[0], -1)
                        for t in kv_caches.tensors]
        self.pages = [t.page_size_bytes for t in kv_caches.tensors]
        self.bpc = blocks_per_chunk
        self.region = region
        row = region._row_stride
        self.chunks = region._base.view(torch.uint8).view(region.num_chunks, row)
        assert sum(self.pages) * blocks_per_chunk <= row
        self.done: list[TransferResult] = []

    def _pairs(self, gpu_spec, cpu_spec):
        # One KV group; the chunk's blocks are consecutive in the request (block_indices[0] is
        # the first one's index in the request, a multiple of blocks_per_chunk on a full chunk).
        assert len(gpu_spec.group_sizes) == 1
        blocks = list(map(int, gpu_spec.block_ids))
        chunks = list(map(int, cpu_spec.block_ids))
        skip = int(gpu_spec.block_indices[0]) % self.bpc
        for i, b in enumerate(blocks):
            j = i + skip
            yield b, chunks[j // self.bpc], j % self.bpc

    def _rows(self, chunk: int, slot: int):
        off = 0
        for t, p in zip(self.tensors, self.pages):
            start = off + slot * p
            yield t, p, self.chunks[chunk, start:start + p]
            off += p * self.bpc

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        n = 0
        for b, c, s in self._pairs(src_spec, dst_spec):
            for t, p, dst in self._rows(c, s):
                dst.copy_(t[b, :p])
                n += p
        self.done.append(TransferResult(job_id=job_id, success=True, transfer_size=n,
                                        transfer_time=0.0))
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        n = 0
        for b, c, s in self._pairs(dst_spec, src_spec):
            for t, p, src in self._rows(c, s):
                t[b, :p].copy_(src)
                n += p
        self.done.append(TransferResult(job_id=job_id, success=True, transfer_size=n,
                                        transfer_time=0.0))
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self.done = self.done, []
        return out

    def wait(self, job_ids) -> None:
        return

    def shutdown(self) -> None:
        del self.chunks  # a view of the region: it must go before the region unmaps
        self.region.cleanup()


class CpuTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker copies on CPU (vLLM's refuses a non-GPU platform)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks,
                                         rank=0, kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            self._worker = CpuChunkWorker(kv_caches, self.blocks_per_chunk, region)
        return self._worker


def tier_config(ssd_dir: str, **kw) -> dict:
    return {"type": "Csa2SsdTier", "module_path": "csa2_vllm.offload", "ssd_dir": ssd_dir,
            "fsync": "never", **kw}


def extra_config(tier: dict, cpu_chunks: int = 32) -> dict:
    page = 2 * BLOCK * HEADS * HEAD * 4  # K and V, fp32
    return {"spec_name": "CpuTieringSpec", "spec_module_path": __name__,
            "cpu_bytes_to_use": cpu_chunks * LAYERS * page, "secondary_tiers": [tier]}


def make_config(model_dir: str, extra: dict, model: dict | None = None) -> tuple:
    """(VllmConfig, KVCacheConfig, scheduler KVCacheConfig) of the tiny model with ``extra``."""
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(model or LLAMA, f)
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=4096,
                     dtype="float32")
    vc = VllmConfig(
        model_config=mc, device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8,
                                         max_model_len=4096, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                            kv_role="kv_both",
                                            kv_load_failure_policy="recompute",
                                            kv_connector_extra_config=extra))
    # What the engine core resolves from the attention backends on a GPU (vLLM's standard
    # layout, legacy name NHD); the CPU platform leaves it unset.
    vc.cache_config.kv_cache_layout = "LBNHC"
    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
        for i in range(LAYERS)}
    with set_current_vllm_config(vc):
        groups = kv_cache_planning.get_kv_cache_groups(vc, specs)
        probe = kv_cache_planning.get_kv_cache_config_from_groups(vc, groups, 1 << 40)
        per_block = sum(t.size for t in probe.kv_cache_tensors) // probe.num_blocks
        cfg = kv_cache_planning.get_kv_cache_config_from_groups(vc, groups,
                                                                NUM_BLOCKS * per_block)
    vc.cache_config.num_gpu_blocks = cfg.num_blocks
    return vc, cfg, generate_scheduler_kv_cache_config([cfg])


class Engine:
    """A real Scheduler with the OffloadingConnector's scheduler side, its worker side over a CPU
    slab, and a synthetic forward; stepped by hand."""

    def __init__(self, model_dir: str, extra: dict, model: dict | None = None):
        init_none_hash(sha256)
        self.vllm_config, self.kv_cache_config, sched_cfg = make_config(model_dir, extra, model)
        vc = self.vllm_config
        with set_current_vllm_config(vc):
            self.scheduler = Scheduler(vllm_config=vc, kv_cache_config=sched_cfg,
                                       structured_output_manager=StructuredOutputManager(vc),
                                       block_size=BLOCK)
            self.sched_conn = self.scheduler.connector
            assert isinstance(self.sched_conn, OffloadingConnector)
            self.kv = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                        vc.cache_config.get_resolved_kv_cache_layout())
            self.worker = OffloadingConnector(vc, KVConnectorRole.WORKER, self.kv_cache_config)
            self.worker.register_kv_caches(self.kv)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.requests: dict[str, Request] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed_at_admission: dict[str, int] = {}
        self.finished: set[str] = set()

    @property
    def tier(self):
        """The Csa2SsdTier inside vLLM's tiering manager."""
        return self.sched_conn.scheduler.manager.secondary_tiers[0]

    @staticmethod
    def token_rows(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[n, HEADS, HEAD] float32 rows that depend on (token, position) only."""
        g = tokens[:, None, None].double() * 0.37 + positions[:, None, None].double() * 0.011
        h = torch.arange(HEADS * HEAD, dtype=torch.float64).view(1, HEADS, HEAD)
        return torch.sin(g + h * 0.13).float()

    def add(self, rid: str, tokens: list[int], max_tokens: int) -> Request:
        r = Request(request_id=rid, prompt_token_ids=list(tokens),
                    sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    pooling_params=None, block_hasher=self.hasher)
        self.requests[rid] = r
        self.scheduler.add_request(r)
        return r

    def step(self):
        so = self.scheduler.schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        sampled = self._forward(so)
        w.wait_for_save()
        tr = w.get_transfer_results(so.finished_req_ids)
        kco = KVConnectorOutput(finished_sending=tr.finished_sending or None,
                                finished_recving=tr.finished_recving or None,
                                failed_recving=tr.failed_recving,
                                kv_connector_stats=w.get_kv_connector_stats(),
                                kv_connector_worker_meta=w.build_connector_worker_meta(),
                                invalid_block_ids=w.get_block_ids_with_load_errors())
        w.clear_connector_metadata()
        ids = list(sampled)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[sampled[r] for r in ids],
                                kv_connector_output=kco)
        for eco in self.scheduler.update_from_output(so, mro).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        return so

    def run(self, max_steps: int = 400) -> None:
        """Steps until every request has finished and every offload job is done (the tier's
        jobs run on its own threads: wait for them between steps, never by a timed sleep
        assertion)."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.sched_conn.has_pending_push_work():
                return
            so = self.step()
            # A step that computed nothing is waiting on transfers only (the tier's pushes, or a
            # request parked until its load lands): wait for the tier's in-flight jobs before the
            # next step. A tight loop of idle steps can otherwise outrun the tier's pool threads,
            # which need the GIL back several times per job (5-ms switch interval), and 400 idle
            # steps end before a job finishes (seen in the wheel-mode run, reproduced 3 of 3).
            if not so.total_num_scheduled_tokens:
                self.tier.drain_jobs()
        raise AssertionError("the engine did not drain")

    def _forward(self, so) -> dict[str, list[int]]:
        starts = {}
        for nr in so.scheduled_new_reqs:
            self.blocks[nr.req_id] = list(nr.block_ids[0])
            self.computed_at_admission[nr.req_id] = nr.num_computed_tokens
            starts[nr.req_id] = nr.num_computed_tokens
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            if cr.new_block_ids[i] is not None:
                self.blocks[rid].extend(cr.new_block_ids[i][0])
            starts[rid] = cr.num_computed_tokens[i]
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            start = starts[rid]
            req = self.requests[rid]
            toks = torch.tensor(req.all_token_ids[start:start + n], dtype=torch.int64)
            pos = torch.arange(start, start + n)
            self._write(rid, pos, toks)
            done = start + n >= req.num_tokens
            sampled[rid] = [(sum(map(ord, rid)) * 7 + req.num_output_tokens * 13) % 900 + 50] \
                if done else []
        return sampled

    def _write(self, rid: str, pos: torch.Tensor, toks: torch.Tensor) -> None:
        ids = self.blocks[rid]
        blk = torch.tensor([ids[p // BLOCK] for p in pos.tolist()])
        off = pos % BLOCK
        for layer in range(LAYERS):
            kv = self.kv[f"model.layers.{layer}.self_attn.attn"]
            rows = self.token_rows(toks + 1000 * layer, pos).view(len(pos), HEADS * HEAD)
            # The slab's view for FullAttentionSpec in this layout: [blocks, 2 (K, V), block
            # tokens, heads × head size].
            kv[blk, 0, off] = rows
            kv[blk, 1, off] = -rows

    def block_bytes(self, block_ids: list[int]) -> list[bytes]:
        out = []
        for b in block_ids:
            out.append(b"".join(self.kv[f"model.layers.{l}.self_attn.attn"][b].numpy().tobytes()
                                for l in range(LAYERS)))
        return out

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
