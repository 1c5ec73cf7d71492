"""csa2's layer on an SM90 GPU, on CPU with the capability reported as 9.0: the KV specs the real
layer (``Csa2DeepseekV4Attention.__init__``, vLLM's own construction code) requests, the pages
vLLM's real KV planner and ``allocate_kv_cache`` build from them, the global bytes per token as
docs/SPEC.md counts them, csa2's writers and vLLM's filling those pages (Triton interpreter), and
``csa2_attention_pools`` reading them in place against a float64 softmax. A capability-10.0
control runs the same code where vLLM itself picks the V4.1 records and writes them.

The model: DeepSeek-V4.1-Flash's own config (assets/) without its weight quantisation (the FP8
linear layers need a GPU to be built), layers 0 (SWA-only) and the four KV sources 2, 8, 14, 20
(ratios 2, 2, 2, 1: the layers that store global KV).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from csa2_vllm import _lib, writers
from csa2_vllm import attention as csa2_attention
from csa2_vllm import indexer as csa2_indexer
from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.models.deepseek_v41.common.ops import cache_utils
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.core import kv_cache_planning
from vllm.v1.worker.utils import allocate_kv_cache

from test_forward_mqa import _attend64
from test_sm90_writers import _cos_sin

LAYERS = [0, 2, 8, 14, 20]
FULL = {2: 2, 8: 2, 14: 2, 20: 1}  # KV-source layer → compress ratio
BLOCK = 256
NUM_BLOCKS = 6


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    here = os.path.dirname(os.path.abspath(__file__))
    src = json.load(open(os.path.join(here, "..", "..", "assets", "deepseek_v41_flash_config.json")))
    src.pop("quantization_config", None)
    src["text_config"].pop("quantization_config", None)
    src["text_config"].update(num_nextn_predict_layers=0, dspark_target_layer_ids=[])
    d = tmp_path_factory.mktemp("sm90") / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(src))
    mc = ModelConfig(model=str(d), skip_tokenizer_init=True, language_model_only=True,
                     max_model_len=32768)
    tc = mc.hf_text_config
    assert [tc.compress_ratios[i] for i in FULL] == list(FULL.values())
    assert list(tc.kv_source_layer_ids) == list(FULL)
    return mc


def _distributed(vc) -> None:
    """A one-process gloo group (the layers' linear layers ask for the TP group), through a file
    rendezvous: no port to collide with other runs on the machine."""
    import tempfile

    from vllm.distributed import (init_distributed_environment, initialize_model_parallel,
                                  model_parallel_is_initialized)

    if not model_parallel_is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="csa2-sm90-"), "rendezvous")
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{path}", backend="gloo")
        initialize_model_parallel(1, 1)


def _build(mc, monkeypatch, major: int, indexer_kv_dtype: str = "auto"):
    """Our layer class built by vLLM's construction code with the capability ``major``.0; returns
    (vllm config, layers by id, the specs every cache object of the layers requests)."""
    cap = DeviceCapability(major, 0)
    # On the class: vLLM's is_device_capability(_family) are classmethods asking cls.
    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: cap))
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                    cache_config=CacheConfig(block_size=BLOCK),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=16,
                                                     max_model_len=32768,
                                                     is_encoder_decoder=False))
    vc.attention_config.indexer_kv_dtype = indexer_kv_dtype
    vc.cache_config.kv_cache_layout = "BLHNC"
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    layers = {}
    with set_current_vllm_config(vc), torch.device("cpu"):
        _distributed(vc)
        topk = torch.zeros(8192, 512, dtype=torch.int32)
        cand = torch.zeros(8192, 64, dtype=torch.int32)
        for i in LAYERS:
            layers[i] = csa2_attention.Csa2DeepseekV4Attention(
                vc, prefix=f"model.layers.{i}.attn", topk_indices_buffer=topk,
                candidate_block_buffer=cand)
        specs = {}
        for name, mod in vc.compilation_config.static_forward_context.items():
            spec = mod.get_kv_cache_spec(vc) if hasattr(mod, "get_kv_cache_spec") else None
            if spec is not None:
                specs[name] = spec
    return vc, layers, specs


def _plan(vc, specs, num_blocks: int = NUM_BLOCKS):
    with set_current_vllm_config(vc):
        groups = kv_cache_planning.get_kv_cache_groups(vc, specs)
        probe = kv_cache_planning.get_kv_cache_config_from_groups(vc, groups, 1 << 40)
        per_block = probe.kv_cache_tensors[0].block_stride
        cfg = kv_cache_planning.get_kv_cache_config_from_groups(vc, groups, num_blocks * per_block)
        kv = allocate_kv_cache(cfg, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout())
    return cfg, kv


def _slab_bytes(kv) -> torch.Tensor:
    """The one backing allocation every view of ``kv`` shares, as bytes (the compressor's state
    views are float32: filling those would write 255.0, not 0xFF bytes)."""
    storages = {t.untyped_storage().data_ptr() for t in kv.values()}
    assert len(storages) == 1
    return torch.empty(0, dtype=torch.uint8).set_(next(iter(kv.values())).untyped_storage())


def _global_bytes_per_token(specs) -> float:
    """docs/SPEC.md's headline: per KV-source layer, (main record + index-K record) per compressed
    entry, divided by the tokens per entry; summed over the KV-source layers."""
    total = 0.0
    for i, ratio in FULL.items():
        main = specs[f"model.layers.{i}.attn"]
        index = specs[f"model.layers.{i}.attn.indexer.k_cache"]
        assert main.tokens_per_state == index.tokens_per_state == ratio
        total += (main.state_content_bytes + index.head_size) / ratio
    return total


RECORDS = {  # capability major, indexer dtype → (SWA, compressed, index K, cache dtype, B/token)
    (9, "auto"): (528, 288, 132, "nvfp4_ds_mla", 3 * (288 + 132) / 2 + (288 + 132)),
    (10, "auto"): (528, 288, 132, "nvfp4_ds_mla", 3 * (288 + 132) / 2 + (288 + 132)),
    (10, "mxfp4"): (528, 288, 68, "nvfp4_ds_mla", 890),
    # csa2's layer on SM90 accepts the MXFP4 index K vLLM refuses there (csa2_vllm.indexer).
    (9, "mxfp4"): (528, 288, 68, "nvfp4_ds_mla", 890),
}
#: The per-block slab vLLM's planner lays out for this layer set (docs/VLLM.md).
SLAB = {132: 269_280, 68: 228_096}


@pytest.mark.parametrize("major,idx", list(RECORDS))
def test_layer_requests_the_v41_records_and_the_planner_lays_them_out(model_config, monkeypatch,
                                                                      major, idx):
    swa_w, main_w, index_w, dtype, per_token = RECORDS[(major, idx)]
    vc, layers, specs = _build(model_config, monkeypatch, major, idx)
    assert vc.cache_config.cache_dtype == dtype
    for i, layer in layers.items():
        assert layer.kv_cache_dtype == dtype and layer.kv_mxfp8
        assert layer.swa_bytes_per_token == swa_w and layer.kv_page_alignment == 512
        s = specs[f"model.layers.{i}.attn.swa_cache"]
        assert (s.state_content_bytes, s.block_size, s.alignment) == (swa_w, 32, 512)
        assert s.block_stride_alignment == math.lcm(528, 288)
        if i in FULL:
            m = specs[f"model.layers.{i}.attn"]
            assert (m.state_content_bytes, m.cache_dtype_str, m.alignment) == (main_w, dtype, 512)
            x = specs[f"model.layers.{i}.attn.indexer.k_cache"]
            assert (x.head_size, x.alignment) == (index_w, 512)
            # csa2's writer publishes the 288-B entries on SM90 only; SM100 keeps vLLM's.
            assert isinstance(layer.compressor, csa2_attention.Csa2Compressor) == (major == 9)
        # csa2 writes and scores the index K itself only where vLLM cannot: MXFP4 on SM90.
        ours = (major, idx) == (9, "mxfp4")
        if layer.indexer is not None:
            assert isinstance(layer.indexer, csa2_indexer.Csa2Indexer) == ours
            assert isinstance(layer.indexer.indexer_op, csa2_indexer.Csa2SparseAttnIndexer) == ours
            assert layer.indexer.use_fp4_kv == (idx == "mxfp4")
            assert layer.indexer.k_cache.csa2_scores == ours
    assert _global_bytes_per_token(specs) == per_token

    cfg, kv = _plan(vc, specs)
    stride = cfg.kv_cache_tensors[0].block_stride
    assert stride == SLAB[index_w]
    for name, t in kv.items():
        v = t.squeeze(1)
        # every page of a block id lives in one slab row: stride(0) in bytes is the slab
        assert v.stride(0) * v.element_size() == stride, name
    for i in LAYERS:
        swa = kv[f"model.layers.{i}.attn.swa_cache"].squeeze(1)
        assert tuple(swa.shape[1:]) == (32, swa_w) and swa.stride(1) == swa_w
        assert swa.storage_offset() % 512 == 0
        if i in FULL:
            main = kv[f"model.layers.{i}.attn"].squeeze(1)
            idx_k = kv[f"model.layers.{i}.attn.indexer.k_cache"].squeeze(1)
            assert tuple(main.shape[1:]) == (BLOCK // FULL[i], main_w)
            assert tuple(idx_k.shape[1:]) == (BLOCK // FULL[i], index_w)
            assert main.storage_offset() % 512 == 0 and idx_k.storage_offset() % 512 == 0
    # Groups alias from byte 0: the SWA pages (one group per layer's window) and the compressed
    # + index-K pages (the full-attention group) both start at the slab row's first byte; block
    # ids, not offsets, keep them apart.
    swa_off = [kv[f"model.layers.{i}.attn.swa_cache"].storage_offset() for i in LAYERS]
    full_off = [kv[f"model.layers.{i}.attn"].storage_offset() for i in FULL]
    assert min(swa_off) == 0 and min(full_off) == 0
    # The facts docs/VLLM.md records for this layer set.
    print(f"\n{major}.0 {idx}: slab {stride} B per block id, {len(kv)} views, "
          f"{per_token} B/token global")


def test_vllms_own_layer_keeps_its_refusal_of_the_mxfp4_index_k_on_sm90(model_config,
                                                                         monkeypatch):
    """vLLM scores an MXFP4 index K only on SM100 (DeepGEMM's FP4 logits), so
    ``dsa_indexer_uses_fp4`` refuses it elsewhere. csa2's layer accepts it on SM90 for itself
    (the planner test above: 890 B/token); vLLM's own FlashMLA layer, built in the same process
    after csa2's, still gets vLLM's refusal, and so does the predicate itself."""
    from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention
    from vllm.v1.attention.backends.mla import indexer as vllm_indexer

    vc, _, _ = _build(model_config, monkeypatch, 9, "mxfp4")
    with pytest.raises(ValueError, match="indexer_kv_dtype='mxfp4' requires Blackwell"):
        vllm_indexer.dsa_indexer_uses_fp4(vc)
    with set_current_vllm_config(vc), torch.device("cpu"):
        with pytest.raises(ValueError, match="indexer_kv_dtype='mxfp4' requires Blackwell"):
            DeepseekV4FlashMLAAttention(
                vc, prefix="model.layers.24.attn", topk_indices_buffer=torch.zeros(
                    8192, 512, dtype=torch.int32),
                candidate_block_buffer=torch.zeros(8192, 64, dtype=torch.int32))


def test_records_outside_csa2s_layer_are_vllms(model_config, monkeypatch):
    """The record choice is scoped to csa2's own layer: vLLM's predicate is unchanged after
    construction, so vLLM's layers built in the same process keep vLLM's choice."""
    from vllm.models.deepseek_v41 import attention as v41

    _build(model_config, monkeypatch, 9)
    assert v41._use_v41_mxfp8_kv_record() is False
    assert csa2_attention.v41_records() is True


@pytest.mark.parametrize("major", [9, 10])
def test_writers_fill_the_planned_pages_and_the_entry_reads_them(model_config, monkeypatch,
                                                                 major):
    """On the planner's pages of layer 2 (ratio 2): the compressed cache filled by the layer's
    compressor writer (csa2's on 9.0; vLLM's, with the portable packer the interpreter needs, on
    10.0), the SWA cache by vLLM's Triton MXFP8 writer; then csa2_attention_pools on those views
    against a float64 softmax over the rows vLLM's gather kernel dequantises."""
    writers.install()
    vc, layers, specs = _build(model_config, monkeypatch, major)
    cfg, kv = _plan(vc, specs)
    layer = layers[2]
    main = kv["model.layers.2.attn"].squeeze(1)
    swa = kv["model.layers.2.attn.swa_cache"].squeeze(1)
    idx_k = kv["model.layers.2.attn.indexer.k_cache"].squeeze(1)
    _slab_bytes(kv).fill_(0xFF)
    g = torch.Generator().manual_seed(major)
    # The SWA group and the compressed group alias the slab from byte 0 (the planner test), so
    # they get disjoint block ids, as vLLM's block pools hand them out: compressed entries in
    # the first half of the blocks, SWA rows in the second.
    half = main.shape[0] // 2
    cmp_slots = [s for s in range(half * main.shape[1]) if s % 5 != 1]
    swa_slots = [s for s in range(half * swa.shape[1], swa.shape[0] * swa.shape[1]) if s % 7 != 3]
    # compressed entries: through the layer's compressor object's writer (ratio 2: the group's
    # last token writes; positions 1, 3, 5, ...)
    latent = (torch.randn(len(cmp_slots), 512, generator=g) * 1.5).to(torch.bfloat16)
    positions = torch.arange(len(cmp_slots), dtype=torch.int64) * 2 + 1
    cos_sin = _cos_sin(g, 2 * len(cmp_slots) + 2, False)

    class _Rope:
        cos_sin_cache = cos_sin

    class _Md:
        slot_mapping = torch.tensor(cmp_slots, dtype=torch.int64)

    layer.bind_kv_cache(kv["model.layers.2.attn"])
    from vllm.forward_context import ForwardContext, override_forward_context

    ctx = ForwardContext(no_compile_layers={}, attn_metadata={"model.layers.2.attn": _Md()},
                         slot_mapping={})
    with override_forward_context(ctx):
        layer.compressor.insert_cache(latent, positions, _Rope())
    assert bool((idx_k == 0xFF).all())  # the index-K page between is not the writer's
    k = (torch.randn(len(swa_slots), 512, generator=g) * 1.5).to(torch.bfloat16)
    cache_utils.quantize_and_insert_k_cache(k, swa, torch.tensor(swa_slots, dtype=torch.int64),
                                            block_size=swa.shape[1], bytes_per_token=528)

    def rows64(view):
        nb, bs = view.shape[0], view.shape[1]
        out = torch.zeros(1, nb * bs, 512, dtype=torch.bfloat16)
        cache_utils.dequantize_and_gather_k_cache_triton(
            out, view, torch.tensor([nb * bs], dtype=torch.int32), None,
            torch.arange(nb, dtype=torch.int32)[None], bs, 0)
        return out[0].double()

    main64, swa64 = rows64(main), rows64(swa)
    assert not main64[cmp_slots].isnan().any() and not swa64[swa_slots].isnan().any()
    t, heads, padded = 4, 64, 64
    m_idx = torch.tensor(cmp_slots, dtype=torch.int32)[
        torch.randint(0, len(cmp_slots), (t, 20), generator=g)]
    s_idx = torch.tensor(swa_slots, dtype=torch.int32)[
        torch.randint(0, len(swa_slots), (t, 24), generator=g)]
    m_idx[0, 3] = -1
    q = (torch.randn(t, padded, 512, generator=g) * 2).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g) * 0.5
    out = torch.full_like(q, float("nan"))
    _lib.attention_pools(q, main, m_idx, None, swa, s_idx, None, sink, heads, 512 ** -0.5, out)
    for i in range(t):
        keys = torch.cat([main64[[int(j) for j in m_idx[i] if int(j) >= 0]],
                          swa64[s_idx[i].long()]])
        ref = _attend64(q[i], keys, torch.arange(len(keys)), len(keys), 512 ** -0.5, sink)
        torch.testing.assert_close(out[i].float(), ref.float(), rtol=2 ** -7, atol=1e-3)


def test_mxfp4_writer_fills_the_planned_index_k_page(model_config, monkeypatch):
    """The 890 layout's planned index-K page (10.0, ``indexer_kv_dtype='mxfp4'``): csa2's MXFP4
    writer and vLLM's fill two copies of the same slab byte for byte (keys whose pipeline is
    exact in bf16, see test_sm90_writers.py), and nothing outside the index-K page changes."""
    from vllm.models.deepseek_v41.common.ops.indexer_k_store import indexer_k_norm_rope_store

    writers.install()
    vc, layers, specs = _build(model_config, monkeypatch, 10, "mxfp4")
    name = "model.layers.2.attn.indexer.k_cache"
    slabs = []
    for writer in ("csa2", "vllm"):
        cfg, kv = _plan(vc, specs)
        _slab_bytes(kv).fill_(0xFF)
        view = kv[name].squeeze(1)
        g = torch.Generator().manual_seed(77)
        n = view.shape[0] * view.shape[1]
        slots = torch.arange(0, n, 3, dtype=torch.int64)
        positions = torch.arange(len(slots), dtype=torch.int64) * 2 + 1
        sign = torch.randint(0, 2, (len(slots), 128), generator=g) * 2 - 1
        k_pre = (sign * 2.0 ** torch.randint(-3, 4, (len(slots), 1), generator=g)).to(torch.bfloat16)
        w = (torch.randn(128, generator=g) * 2).to(torch.bfloat16)
        cs = _cos_sin(g, 2 * len(slots) + 2, True)
        if writer == "csa2":
            writers.mxfp4_index_k_store(k_pre, positions, cs, w, 0.0, view, slots, 2)
        else:
            indexer_k_norm_rope_store(k_pre, positions, cs, w, 0.0, view, slots, 2, True)
        slab = _slab_bytes(kv)
        slabs.append((slab.clone(), view.storage_offset(), view.shape[1] * 68, view.stride(0)))
    (a, off, page, stride), (b, _, _, _) = slabs
    assert torch.equal(a, b)
    rows = a[: (len(a) // stride) * stride].reshape(-1, stride)
    outside = torch.cat([rows[:, :off], rows[:, off + page:]], 1)
    assert bool((outside == 0xFF).all()) and not bool((rows[:, off:off + page] == 0xFF).all())


@pytest.mark.parametrize("major,inside", [(9, True), (10, True), (8, False), (12, False)])
def test_the_record_scope_is_restored_also_on_an_error(monkeypatch, major, inside):
    """Inside the construction scope vLLM's predicate says what csa2's layer uses (V4.1 records on
    SM90 and SM100, not elsewhere); after it, also when the construction raised, vLLM's own
    answer is back."""
    from vllm.models.deepseek_v41 import attention as v41

    cap = DeviceCapability(major, 0)
    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: cap))
    own = v41._use_v41_mxfp8_kv_record()
    assert own == (major == 10)
    with pytest.raises(RuntimeError, match="construction failed"):
        with csa2_attention._vllm_sees_v41_records():
            assert v41._use_v41_mxfp8_kv_record() is inside
            raise RuntimeError("construction failed")
    assert v41._use_v41_mxfp8_kv_record() is own


def _mxfp4_index_k_rows_f64(view, block: int):
    """The 128-value keys of one planned index-K page, decoded in float64 from its bytes by this
    test's own reading of the layout (block-planar: the page's 64-B E2M1 values, low nibble first,
    then its 4-B E8M0 scales, one per 32 values)."""
    spp = view.shape[1]
    page = view[block].reshape(-1).to(torch.int64)
    data, scales = page[: spp * 64].reshape(spp, 64), page[spp * 64:].reshape(spp, 4)
    codes = torch.stack([data & 0xF, data >> 4], -1).reshape(spp, 128)
    mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)[codes & 7]
    vals = torch.where(codes & 8 != 0, -mag, mag)
    return vals * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, 1)


def test_csa2s_indexer_reads_the_planned_mxfp4_index_k_in_place(model_config, monkeypatch):
    """``csa2_indexer_logits_pool`` on the 890 layout's planned index-K cache (10.0,
    ``indexer_kv_dtype='mxfp4'``; a strided view into the per-block slab) filled by csa2's MXFP4
    writer: logits through a block table (shuffled blocks, an unmapped one, two requests, rows
    whose visible range ends inside, at and past the table) match a float64 indexer over this
    test's own decoding of the page bytes (tolerance ``F32_VS_F64`` of src/tolerance.rs), top-k
    sets included; an MXFP4-exact Q gives the same logits with ``q_quant`` MXFP4."""
    writers.install()
    vc, layers, specs = _build(model_config, monkeypatch, 10, "mxfp4")
    cfg, kv = _plan(vc, specs)
    _slab_bytes(kv).fill_(0xFF)
    view = kv["model.layers.2.attn.indexer.k_cache"].squeeze(1)
    spp, ratio = view.shape[1], FULL[2]
    assert view.stride(0) > spp * 68  # a strided view: other layers' pages between its pages
    table = torch.tensor([[3, 1], [4, -1]], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    slots = torch.tensor([b * spp + s for b in (3, 1, 4) for s in range(spp)], dtype=torch.int64)
    k_pre = torch.randn(len(slots), 128, generator=g).to(torch.bfloat16)
    w_norm = (torch.randn(128, generator=g) * 2).to(torch.bfloat16)
    positions_k = torch.arange(len(slots), dtype=torch.int64) * ratio + 1
    cs = _cos_sin(g, ratio * len(slots) + 2, True)
    writers.mxfp4_index_k_store(k_pre, positions_k, cs, w_norm, 0.0, view, slots, ratio)

    n_cols = table.shape[1] * spp
    req = torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.int32)
    pos = torch.tensor([1, 2 * spp - 1, 2 * spp, 4 * spp + 50, 9, 2 * spp + 7], dtype=torch.int64)
    t, h = len(pos), 32
    # Q exact in MXFP4 (E2M1 magnitudes, each 32-block's largest 6 → scale 1), so that the MXFP4
    # fake quantisation of Q is the identity and both calls meet one reference.
    e2m1 = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    q = e2m1[torch.randint(0, 7, (t, h, 128), generator=g)]
    q = q * (torch.randint(0, 2, q.shape, generator=g) * 2 - 1)
    q[..., ::32] = 6.0
    w = torch.randn(t, h, generator=g) / math.sqrt(128 * 32)

    keys = {b: _mxfp4_index_k_rows_f64(view, b) for b in (3, 1, 4)}
    ref = torch.full((t, n_cols), -math.inf, dtype=torch.float64)
    for i in range(t):
        vis = min((int(pos[i]) + 1) // ratio, n_cols)
        for j in range(vis):
            blk = int(table[int(req[i]), j // spp])
            if blk < 0:
                continue
            dots = q[i].double() @ keys[blk][j % spp]
            ref[i, j] = float((w[i].double() * dots.clamp(min=0)).sum())
    for q_quant in (0, 1):
        out = torch.zeros(t, n_cols)
        _lib.indexer_logits_pool(q, w, pos, req, view, table, ratio, q_quant, out)
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(out), fin), q_quant
        assert bool((out[~fin] == -math.inf).all())
        err = (out.double()[fin] - ref[fin]).abs()
        assert bool((err <= 1e-5 + 1e-5 * ref[fin].abs()).all()), (q_quant, float(err.max()))
        a, b = out.double()[fin], ref[fin]
        assert 1 - float(a @ b / (a.norm() * b.norm())) <= 1e-9
        for i in range(t):
            k = min(16, int(fin[i].sum()))
            top = set(torch.topk(out[i], k).indices.tolist())
            rs = torch.sort(ref[i], descending=True).values
            if k < int(fin[i].sum()) and float(rs[k - 1] - rs[k]) <= 2e-5 * float(rs[0].abs()):
                continue  # a near-tie at the k-th place: either choice is within the tolerance
            assert top == set(torch.topk(ref[i], k).indices.tolist()), (q_quant, i)
    # Bad input is a clear error and writes nothing: a block past the pool, a request past the table.
    for bad_table, bad_req, msg in [
        (torch.tensor([[3, 1], [view.shape[0], -1]], dtype=torch.int32), req, "outside the pool"),
        (table, torch.tensor([0, 0, 0, 0, 1, 2], dtype=torch.int32), "outside the block table"),
    ]:
        out = torch.zeros(t, n_cols)
        with pytest.raises(_lib.Csa2Error, match=msg):
            _lib.indexer_logits_pool(q, w, pos, bad_req, view, bad_table, ratio, 0, out)
        assert bool((out == 0).all())
