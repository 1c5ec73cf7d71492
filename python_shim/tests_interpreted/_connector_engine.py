"""A tiny DeepSeek-V4.1 engine on CPU for the connector tests: vLLM's own config, KV planner,
``allocate_kv_cache`` and ``Scheduler``, with ``Csa2Connector`` on both sides, and a synthetic
forward that fills the slab with vLLM's own writer kernels (run by Triton's interpreter).

What is real: the scheduler (prefix cache, hybrid groups, SWA bounded replay, the connector calls
in vLLM's order), the KV cache groups and the slab layout, the record bytes (vLLM's
``rope_quant_insert`` for the SWA and compressed caches, ``indexer_k_norm_rope_store`` for the
indexer K, ``save_ring_rows`` for the compressor ring). What is synthetic: the model. Each layer's
latent for a token is a fixed random row picked by the token id, so the same tokens at the same
positions give the same bytes, and the sampled tokens are a fixed function of the request and step.

The model (3 layers: SWA-only, ratio-2 KV source, ratio-1 KV source) keeps the
V4.1 roles and record widths (584-B SWA/compressed records, 132-B FP8 indexer K); its groups are
three 32-token SWA groups (bounded replay, 128 tokens), one 256-token prefix-cacheable group
(compressed + indexer pages of both KV sources) and the compressor ring.
"""

from __future__ import annotations

import copy
import json
import os
import pickle

import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                         VllmConfig, set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache import (rope_quant_insert,
                                                                             save_ring_rows)
from vllm.models.deepseek_v41.common.ops.indexer_k_store import indexer_k_norm_rope_store
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_planning
from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                         get_request_block_hasher, init_none_hash)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import CircularBufferSpec, MLAAttentionSpec, SlidingWindowMLASpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from csa2_vllm import connector as conn

BLOCK = 256
RATIOS = [0, 2, 1]
KV_SOURCES = [1, 2]
NUM_BLOCKS = 400
VOCAB = 64  # distinct latent rows per layer


def _asset(name: str) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "assets", name)


def _specs(tc: dict, ratios=None, kv_sources=None, sm100: bool = False) -> dict:
    """Each layer's KV cache spec, as V4.1's layers build them: on SM90 (V4 584-B records, FP8
    indexer K), or with ``sm100`` the V4.1 records (528-B MXFP8 SWA, 288-B NVFP4 compressed,
    68-B MXFP4 indexer K)."""
    ratios = RATIOS if ratios is None else ratios
    kv_sources = KV_SOURCES if kv_sources is None else kv_sources
    if sm100:
        return _specs_sm100(tc, ratios, kv_sources)
    specs = {}
    for layer, r in enumerate(ratios):
        specs[f"model.layers.{layer}.attn.swa_cache"] = SlidingWindowMLASpec(
            bounded_replay=True, block_size=32, num_kv_heads=1, max_tp_shards=1, head_size=512,
            dtype=torch.uint8, sliding_window=tc["sliding_window"], cache_dtype_str="fp8_ds_mla",
            state_content_bytes=584, alignment=576, block_stride_alignment=None,
            model_version="deepseek_v4", kv_quant_mode=None)
        if layer in kv_sources:
            specs[f"model.layers.{layer}.attn"] = MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                tokens_per_state=r, cache_dtype_str="fp8_ds_mla", alignment=576,
                model_version="deepseek_v4", kv_quant_mode=None, state_content_bytes=584)
            specs[f"model.layers.{layer}.attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=132, dtype=torch.uint8,
                tokens_per_state=r, alignment=576, block_stride_alignment=None)
            if r > 1:
                specs[f"model.layers.{layer}.attn.compressor.state_cache"] = CircularBufferSpec(
                    block_size=8, num_kv_heads=1, head_size=1024, head_size_v=0,
                    dtype=torch.float32)
    return specs


def _specs_sm100(tc: dict, ratios, kv_sources) -> dict:
    specs = {}
    for layer, r in enumerate(ratios):
        specs[f"model.layers.{layer}.attn.swa_cache"] = SlidingWindowMLASpec(
            bounded_replay=True, block_size=32, num_kv_heads=1, max_tp_shards=1, head_size=512,
            dtype=torch.uint8, sliding_window=tc["sliding_window"], cache_dtype_str="nvfp4_ds_mla",
            state_content_bytes=528, alignment=512, block_stride_alignment=6336,
            model_version="deepseek_v4", kv_quant_mode=None)
        if layer in kv_sources:
            specs[f"model.layers.{layer}.attn"] = MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                tokens_per_state=r, cache_dtype_str="nvfp4_ds_mla", alignment=512,
                model_version="deepseek_v4", kv_quant_mode=None, state_content_bytes=288)
            specs[f"model.layers.{layer}.attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=68, dtype=torch.uint8,
                tokens_per_state=r, alignment=512, block_stride_alignment=None)
            if r > 1:
                specs[f"model.layers.{layer}.attn.compressor.state_cache"] = CircularBufferSpec(
                    block_size=8, num_kv_heads=1, head_size=1024, head_size_v=0,
                    dtype=torch.float32)
    return specs


class Tiny:
    """The config and KV cache config, built once per process (ModelConfig's inspection of the
    architecture takes about a minute here) and picklable for a second process."""

    def __init__(self, model_dir: str, *, full: bool = False, hbm_bytes: int | None = None,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 8192):
        """``full``: DeepSeek-V4.1-Flash's own 40 backbone layers with the SM100 records (for
        the trace run; no slab is allocated), KV cache sized to ``hbm_bytes``."""
        src = json.load(open(_asset("deepseek_v41_flash_config.json")))
        tc = src["text_config"]
        if full:
            n = tc["num_hidden_layers"]
            ratios, sources, sm100 = tc["compress_ratios"][:n], tc["kv_source_layer_ids"], True
            tc.update(num_nextn_predict_layers=0, dspark_target_layer_ids=[])
        else:
            ratios, sources, sm100 = RATIOS, KV_SOURCES, False
            tc.update(num_hidden_layers=len(RATIOS), num_nextn_predict_layers=0,
                      compress_ratios=RATIOS, kv_source_layer_ids=KV_SOURCES,
                      index_source_layer_ids=KV_SOURCES, candidate_source_layer_id=KV_SOURCES[-1],
                      engram_layer_ids=[], dspark_target_layer_ids=[])
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(src, f)
        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, language_model_only=True,
                         max_model_len=8192 * 4)
        vc = VllmConfig(
            model_config=mc, device_config=DeviceConfig(device="cpu"),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                             max_num_seqs=max_num_seqs, max_model_len=8192 * 4,
                                             is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(
                kv_connector=conn.CONNECTOR_NAME, kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_module_path=conn.CONNECTOR_MODULE,
                kv_connector_extra_config={"ssd_dir": "unset"}))
        # What the engine resolves on a GPU; this platform leaves them unset or off.
        vc.cache_config.kv_cache_layout = "BLHNC"
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        with set_current_vllm_config(vc):
            groups = kv_cache_planning.get_kv_cache_groups(vc, _specs(tc, ratios, sources, sm100))
            probe = kv_cache_planning.get_kv_cache_config_from_groups(vc, groups, 1 << 40)
            per_block = probe.kv_cache_tensors[0].block_stride
            budget = hbm_bytes if hbm_bytes is not None else NUM_BLOCKS * per_block
            cfg = kv_cache_planning.get_kv_cache_config_from_groups(vc, groups, budget)
        vc.cache_config.num_gpu_blocks = cfg.num_blocks
        self.vllm_config = vc
        self.kv_cache_config = cfg
        self.scheduler_kv_cache_config = generate_scheduler_kv_cache_config([cfg])

    def dumps(self) -> bytes:
        return pickle.dumps(self)

    def config_for(self, extra: dict) -> VllmConfig:
        vc = copy.copy(self.vllm_config)
        vc.kv_transfer_config = copy.copy(self.vllm_config.kv_transfer_config)
        vc.kv_transfer_config.kv_connector_extra_config = dict(extra)
        return vc


class Engine:
    """One engine: a real Scheduler (with the connector's scheduler side) and the connector's
    worker side over a fresh CPU slab, stepped by hand."""

    def __init__(self, tiny: Tiny, extra: dict, *, worker: bool = True):
        init_none_hash(sha256)
        self.tiny = tiny
        self.vllm_config = vc = tiny.config_for(extra)
        with set_current_vllm_config(vc):
            self.scheduler = Scheduler(vllm_config=vc,
                                       kv_cache_config=tiny.scheduler_kv_cache_config,
                                       structured_output_manager=StructuredOutputManager(vc),
                                       block_size=BLOCK)
        self.sched_conn = self.scheduler.connector
        assert isinstance(self.sched_conn, conn.Csa2Connector)
        self.kv = None
        self.worker = None
        if worker:
            self.kv = allocate_kv_cache(tiny.kv_cache_config, torch.device("cpu"),
                                        vc.cache_config.get_resolved_kv_cache_layout())
            self.worker = conn.Csa2Connector(vc, KVConnectorRole.WORKER, tiny.kv_cache_config)
            self.worker.register_kv_caches(self.kv)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.requests: dict[str, Request] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        self.new_reqs = []  # NewRequestData seen, for the tests' replay_start checks
        self.finished: set[str] = set()
        self.steps = 0
        g = torch.Generator().manual_seed(1234)
        self.latent = {l: (torch.randn(VOCAB, 512, generator=g) * 0.5).to(torch.bfloat16)
                       for l in range(len(RATIOS))}
        self.k_pre = {l: (torch.randn(VOCAB, 128, generator=g) * 0.5).to(torch.bfloat16)
                      for l in KV_SOURCES}
        self.ring_rows = (torch.randn(VOCAB, 1024, generator=g)).float()
        pos = torch.arange(8192, dtype=torch.float32)[:, None]
        freqs = 1.0 / (10000.0 ** (torch.arange(0, 32, dtype=torch.float32) / 32))
        ang = pos * freqs[None, :]
        self.cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
        self.k_norm = torch.ones(128, dtype=torch.bfloat16)

    # ---- requests ---------------------------------------------------------------------------

    def add(self, rid: str, tokens: list[int], max_tokens: int) -> Request:
        r = Request(request_id=rid, prompt_token_ids=list(tokens),
                    sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    pooling_params=None, block_hasher=self.hasher)
        self.requests[rid] = r
        self.scheduler.add_request(r)
        return r

    @staticmethod
    def sampled(rid: str, n: int) -> int:
        return (sum(map(ord, rid)) * 7 + n * 13) % 50000 + 100

    def run(self, max_steps: int = 200) -> None:
        """Steps until every request has finished and every delayed save is done."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.sched_conn.has_pending_push_work():
                return
            self.step()
        raise AssertionError("the engine did not drain")

    # ---- one step -----------------------------------------------------------------------------

    def step(self):
        so = self.scheduler.schedule()
        self.steps += 1
        w = self.worker
        if w is not None:
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.start_load_kv(None)
        sampled = self._forward(so)
        kco = None
        if w is not None:
            w.wait_for_save()
            tr = w.get_transfer_results(so.finished_req_ids)
            kco = KVConnectorOutput(
                finished_sending=tr.finished_sending, finished_recving=tr.finished_recving,
                failed_recving=tr.failed_recving,
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
                invalid_block_ids=w.get_block_ids_with_load_errors())
            w.clear_connector_metadata()
        elif self.sched_conn is not None:
            # No worker: report every load as finished, so parked requests move on.
            meta = so.kv_connector_metadata
            done = {ld.req_id for ld in getattr(meta, "loads", [])}
            sent = {sv.req_id for sv in getattr(meta, "saves", []) if sv.finishes}
            kco = KVConnectorOutput(finished_recving=done or None, finished_sending=sent or None)
        ids = list(sampled)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[sampled[r] for r in ids],
                                kv_connector_output=kco)
        outs = self.scheduler.update_from_output(so, mro)
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        return so

    def _forward(self, so) -> dict[str, list[int]]:
        starts = {}
        for nr in so.scheduled_new_reqs:
            self.new_reqs.append(nr)
            self.blocks[nr.req_id] = [list(b) for b in nr.block_ids]
            hit = nr.replay_start + 128 if nr.replay_start > 0 else nr.num_computed_tokens
            starts[nr.req_id] = (nr.num_computed_tokens, hit)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if nb is not None:
                for g, b in enumerate(nb):
                    self.blocks[rid][g].extend(b)
            starts[rid] = (cr.num_computed_tokens[i], cr.num_computed_tokens[i])
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            start, hit = starts[rid]
            req = self.requests[rid]
            toks = req.all_token_ids[start:start + n]
            if self.kv is not None:
                self._write(rid, list(range(start, start + n)), toks, hit)
            if start + n >= req.num_tokens:
                sampled[rid] = [self.sampled(rid, req.num_output_tokens)]
            else:
                sampled[rid] = []
        return sampled

    def _write(self, rid: str, positions: list[int], tokens: list[int], hit: int) -> None:
        """The KV writes of one request's scheduled tokens, through vLLM's writer kernels.
        Replayed tokens (below ``hit``) rebuild only the SWA window, as vLLM's model runner pads
        their slots in the prefix-cacheable groups."""
        if not positions:
            return
        layout = self.sched_conn.layout
        ids = self.blocks[rid]
        pos = torch.tensor(positions, dtype=torch.int64)
        tok = torch.tensor(tokens, dtype=torch.int64) % VOCAB
        for gi, (gid, bt, _) in enumerate(layout.window_groups):
            layer = gi  # one SWA group per layer, in layer order
            slots = torch.tensor([ids[gid][p // bt] * bt + p % bt for p in positions])
            cache = self.kv[f"model.layers.{layer}.attn.swa_cache"].squeeze(1)
            rope_quant_insert(self.latent[layer][tok].contiguous(), pos, self.cos_sin, cache,
                              slots, 1)
        fresh = [i for i, p in enumerate(positions) if p >= hit]
        if not fresh:
            return
        fpos = pos[fresh]
        ftok = tok[fresh]
        pg = ids[layout.prefix_group]
        for layer in KV_SOURCES:
            r = RATIOS[layer]
            per = BLOCK // r
            slots = torch.tensor([pg[(p // r) // per] * per + (p // r) % per
                                  if (p + 1) % r == 0 else -1 for p in fpos.tolist()])
            cache = self.kv[f"model.layers.{layer}.attn"].squeeze(1)
            rope_quant_insert(self.latent[layer][ftok].contiguous(), fpos, self.cos_sin, cache,
                              slots, r)
            kc = self.kv[f"model.layers.{layer}.attn.indexer.k_cache"].squeeze(1)
            indexer_k_norm_rope_store(self.k_pre[layer][ftok].contiguous(), fpos, self.cos_sin,
                                      self.k_norm, 1e-6, kc, slots, r, False)
        for gid in layout.state_groups:
            ring = self.kv["model.layers.1.attn.compressor.state_cache"].squeeze(1)
            b = ids[gid][0]
            slots = torch.tensor([b * 8 + p % 8 for p in fpos.tolist()])
            save_ring_rows(self.ring_rows[ftok].contiguous(), slots, ring)

    def step_until_scheduled(self, rid: str, max_steps: int = 5):
        """Steps until ``rid`` is scheduled with tokens (an external hit waits one step for its
        load); returns that step's SchedulerOutput and the request's NewRequestData."""
        for _ in range(max_steps):
            so = self.step()
            if so.num_scheduled_tokens.get(rid):
                nr = [n for n in so.scheduled_new_reqs if n.req_id == rid]
                return so, (nr[0] if nr else None)
        raise AssertionError(f"{rid} was not scheduled in {max_steps} steps")

    # ---- inspection -----------------------------------------------------------------------------

    def slab_rows(self, block_ids: list[int]) -> torch.Tensor:
        return self.worker._slab[block_ids].clone()

    def close(self) -> None:
        self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
