"""csa2's MXFP4 index K on SM90 (the 890 B/token layout on Hopper), on CPU with the capability
reported as 9.0: the real layer built by vLLM's construction code with
``indexer_kv_dtype='mxfp4'`` (which vLLM refuses there), the pages vLLM's planner lays out for it,
csa2's index-K writer filling them through the layer's indexer, the layer's indexer forward
(``Csa2Indexer.forward_q`` → ``Csa2SparseAttnIndexer``: csa2's MXFP4 Q quantiser,
``csa2_indexer_logits_pool`` in place, ``csa2_topk``) against a float64 indexer, the whole
attention half of the layer (``_sparse_indexer_and_attn``: indexer then ``forward_mqa`` over all
three V4.1 records) against a float64 reference, and the quantiser and candidate masks under
FakeTensorMode. Triton kernels run in the interpreter (conftest.py).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from csa2_vllm import _lib, writers
from csa2_vllm import attention as csa2_attention
from csa2_vllm import backend as csa2_backend
from csa2_vllm import indexer as csa2_indexer
from vllm.config import set_current_vllm_config
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.models.deepseek_v41.common.ops import cache_utils

from test_forward_mqa import _attend64
from test_sm90_layer import (FULL, _build, _mxfp4_index_k_rows_f64, _plan, _slab_bytes,
                             model_config)  # noqa: F401  (the fixture)

# src/tolerance.rs F32_VS_F64: csa2's f32 logits against float64 on the same codes.
F32_ABS, F32_REL = 1e-5, 1e-5
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ---- float64 references (this test's own reading of docs/SPEC.md §1 and §2) ----------------------

def _e2m1_f64(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of f64 ``x`` (ties to the even code, saturating at 6, sign kept)."""
    a = x.abs().clamp(max=6.0)
    d = (a[..., None] - E2M1).abs()
    best = d.min(-1, keepdim=True).values
    ties = d == best
    # Among equally near magnitudes, the even code (codes 0, 2, 4, 6 have an even mantissa bit).
    even = torch.tensor([True, False, True, False, True, False, True, False])
    pick = torch.where((ties & even).any(-1, keepdim=True), ties & even, ties)
    mag = E2M1[pick.to(torch.int64).argmax(-1)]
    return torch.where(torch.signbit(x), -mag, mag)


def _mxfp4_q_f64(q_bf16_roped: torch.Tensor) -> torch.Tensor:
    """MXFP4 of (T, H, 128) values in blocks of 32, decoded, in float64."""
    x = q_bf16_roped.double().reshape(*q_bf16_roped.shape[:-1], 4, 32)
    amax = x.abs().amax(-1, keepdim=True).clamp(min=6.0 * 2.0 ** -126)
    # ceil(log2(r)) exactly: r = m·2^x with m in [0.5, 1) is 2^(x−1) when m = 0.5, else above it.
    m, ex = torch.frexp(amax / 6.0)
    e = torch.where(m == 0.5, ex - 1, ex).double().clamp(-127, 127)
    return (_e2m1_f64(x * torch.pow(2.0, -e)) * torch.pow(2.0, e)).reshape(q_bf16_roped.shape)


def _rope_bf16(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE of dims 64..127 in f32, rounded to bf16 (the indexer Q rule)."""
    x = q.float().clone()
    cs = cos_sin[positions.long()].float()
    cos, sin = cs[:, None, :32], cs[:, None, 32:]
    ev, od = x[..., 64::2].clone(), x[..., 65::2].clone()
    x[..., 64::2] = (ev * cos - od * sin).to(torch.bfloat16).float()
    x[..., 65::2] = (od * cos + ev * sin).to(torch.bfloat16).float()
    return x.to(torch.bfloat16)


def _logits_f64(q64, w, positions, req, table, keys, ratio):
    """Σ_h w·ReLU(q·k) over the visible mapped entries of each row's request, −∞ elsewhere."""
    spp = next(iter(keys.values())).shape[0]
    t, n = q64.shape[0], table.shape[1] * spp
    ref = torch.full((t, n), -math.inf, dtype=torch.float64)
    for i in range(t):
        for j in range(min((int(positions[i]) + 1) // ratio, n)):
            blk = int(table[int(req[i]), j // spp])
            if blk >= 0:
                dots = q64[i] @ keys[blk][j % spp]
                ref[i, j] = float((w[i].double() * dots.clamp(min=0)).sum())
    return ref


def _assert_topk(got_row, ref_row, k, vis, what):
    """The top-k set of a row against the reference: all ``vis`` visible entries in index order
    when they are ≤ k; otherwise the k best, a near-tie at the k-th place allowing either."""
    got = [int(x) for x in got_row[:k]]
    if vis <= k:
        assert got == list(range(vis)) + [-1] * (k - vis), what
        return
    assert got.count(-1) == 0, what
    top = set(got)
    rs = torch.sort(ref_row, descending=True).values
    if float(rs[k - 1] - rs[k]) <= 4 * (F32_ABS + F32_REL * float(rs[0].abs())):
        return
    assert top == set(torch.topk(ref_row, k).indices.tolist()), what


# ---- the layer's pieces on the planned 890 slab ----------------------------------------------------

def _layer(model_config, monkeypatch, num_blocks, seed=0):  # noqa: F811
    writers.install()
    vc, layers, specs = _build(model_config, monkeypatch, 9, "mxfp4")
    cfg, kv = _plan(vc, specs, num_blocks)
    assert cfg.kv_cache_tensors[0].block_stride == 228_096
    _slab_bytes(kv).fill_(0xFF)
    layer = layers[2]
    g = torch.Generator().manual_seed(seed)
    ind = layer.indexer
    # Weights in the model's activation dtype (bf16, as a checkpoint loads them; the CPU build
    # leaves float32 placeholders).
    with torch.no_grad():
        for lin in (ind.wq_b, ind.wk):
            lin.weight.data = (torch.randn(lin.weight.shape, generator=g) * 0.05).to(torch.bfloat16)
        ind.k_norm.weight.copy_(1 + 0.3 * torch.randn(128, generator=g))
    for name in ("model.layers.2.attn", "model.layers.2.attn.swa_cache",
                 "model.layers.2.attn.indexer.k_cache"):
        vc.compilation_config.static_forward_context[name].bind_kv_cache(kv[name])
    return vc, layer, kv, g


def _write_index_k(layer, g, slots, ratio):
    """Keys through the layer's indexer (``Csa2Indexer._produce_k``: wk, k_norm, RoPE, csa2's
    MXFP4 writer) at the group-boundary positions of the given index-K slots."""
    latent = torch.randn(len(slots), 512, generator=g).to(torch.bfloat16)
    positions = torch.arange(len(slots), dtype=torch.int64) * ratio + ratio - 1
    md = {layer.indexer.k_cache.prefix: types.SimpleNamespace(
        slot_mapping=torch.tensor(slots, dtype=torch.int64))}
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata=md,
                                                 slot_mapping={})):
        layer.indexer._produce_k(latent, positions, layer.indexer_rotary_emb)
    return latent, positions


def test_builder_and_scope_accept_mxfp4_on_sm90_only_for_csa2(model_config, monkeypatch):  # noqa: F811
    """csa2's indexer metadata builder constructs on 9.0 with ``mxfp4`` (vLLM's refuses in its
    ``__init__``), declares UNIFORM_BATCH, and the scope is restored after it, also on an error."""
    from vllm.v1.attention.backends.mla import indexer as vllm_indexer

    vc, layers, specs = _build(model_config, monkeypatch, 9, "mxfp4")
    name = "model.layers.2.attn.indexer.k_cache"
    cache = vc.compilation_config.static_forward_context[name]
    assert cache.get_attn_backend() is csa2_backend.Csa2IndexerBackend
    builder_cls = cache.get_attn_backend().get_builder_cls()
    args = (specs[name], [name], vc, torch.device("cpu"))
    # The builder sizes its decode split by the GPU's SM count (an H100 has 132).
    from vllm.platforms import current_platform
    monkeypatch.setattr(type(current_platform), "num_compute_units",
                        classmethod(lambda cls, device_id=0: 132), raising=False)
    with set_current_vllm_config(vc):
        with pytest.raises(ValueError, match="requires Blackwell"):
            vllm_indexer.DeepseekV32IndexerMetadataBuilder(*args, block_table_width=128)
        b = builder_cls(*args, block_table_width=128)
    assert b.indexer_uses_fp4 is True
    from csa2_vllm import route  # UNIFORM_BATCH only where csa2's kernels launch: NEVER here

    assert builder_cls.get_cudagraph_support(vc, specs[name]).name == route.graph_support()
    with pytest.raises(RuntimeError, match="boom"):
        with csa2_indexer.accepts_mxfp4_index_k():
            assert vllm_indexer.dsa_indexer_uses_fp4(vc) is True
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match="requires Blackwell"):
        vllm_indexer.dsa_indexer_uses_fp4(vc)
    # On 9.0 with the FP8 index K, csa2's layer keeps vLLM's indexer and backend.
    vc8, layers8, _ = _build(model_config, monkeypatch, 9, "auto")
    c8 = vc8.compilation_config.static_forward_context[name]
    assert c8.get_attn_backend() is not csa2_backend.Csa2IndexerBackend
    assert not isinstance(layers8[2].indexer, csa2_indexer.Csa2Indexer)


def test_layer_indexer_writes_the_planned_index_k_page(model_config, monkeypatch):  # noqa: F811
    """The layer's ``_produce_k`` on 9.0 fills the planned MXFP4 index-K page with csa2's writer:
    the bytes are those of ``mxfp4_index_k_store`` on ``k_norm``'s input ``wk(latent)``, their
    decoding is within MXFP4's step of the f64 keys, and nothing outside the page changes."""
    vc, layer, kv, g = _layer(model_config, monkeypatch, 6)
    view = kv["model.layers.2.attn.indexer.k_cache"].squeeze(1)
    spp = view.shape[1]
    slots = [b * spp + s for b in (1, 3) for s in range(0, spp, 3)]
    latent, positions = _write_index_k(layer, g, slots, FULL[2])
    slab = _slab_bytes(kv).clone()
    # The same keys through the writer directly, on a second copy of the slab.
    _slab_bytes(kv).fill_(0xFF)
    k_pre, _ = layer.indexer.wk(latent)
    writers.mxfp4_index_k_store(k_pre, positions, layer.indexer_rotary_emb.cos_sin_cache,
                                layer.indexer.k_norm.weight, layer.indexer.k_norm.variance_epsilon,
                                view, torch.tensor(slots, dtype=torch.int64), FULL[2])
    assert torch.equal(slab, _slab_bytes(kv))
    stride, off, page = view.stride(0), view.storage_offset(), spp * 68
    rows = slab[: (len(slab) // stride) * stride].reshape(-1, stride)
    assert bool((torch.cat([rows[:, :off], rows[:, off + page:]], 1) == 0xFF).all())
    # Decoded keys against k_norm(wk(latent)) RoPE'd in f64: within half an MXFP4 step.
    k = k_pre.double()
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + layer.indexer.k_norm.variance_epsilon)
    k = k * layer.indexer.k_norm.weight.double()
    cs = layer.indexer_rotary_emb.cos_sin_cache[positions - positions % FULL[2]].double()
    ev, od = k[:, 64::2].clone(), k[:, 65::2].clone()
    k[:, 64::2], k[:, 65::2] = ev * cs[:, :32] - od * cs[:, 32:], od * cs[:, :32] + ev * cs[:, 32:]
    dec = {b: _mxfp4_index_k_rows_f64(view, b) for b in (1, 3)}
    got = torch.stack([dec[s // spp][s % spp] for s in slots])
    # E2M1 rounds to within half its widest gap (4 → 6, i.e. 2^e with 2^e < amax / 3), plus the
    # bf16 roundings before the encoder.
    amax = k.abs().reshape(-1, 4, 32).amax(-1, keepdim=True)
    assert bool(((got - k).abs().reshape(-1, 4, 32) <= amax * (1 / 3 + 0.02)).all())


# Positions (ratio 2) whose visible entries (p + 1) div 2 sit at 0, 1, the ratio boundary, around
# the top-k size 512 and beyond, in two requests (one with an unmapped block).
POSITIONS = [0, 1, 2, 3, 1021, 1022, 1023, 1024, 1025, 1199, 1279, 5, 700]
REQS = [0] * 11 + [1, 1]


def test_layer_indexer_forward_matches_the_f64_indexer(model_config, monkeypatch):  # noqa: F811
    """``Csa2Indexer.forward_q`` (wq_b, csa2's MXFP4 Q quantiser) then the layer's scorer
    (``indexer_op``: ``csa2_indexer_logits_pool`` on the planned pages in place, ``csa2_topk`` into
    ``topk_indices_buffer``) against a float64 indexer over the page bytes with a float64 MXFP4 Q:
    logits within F32_VS_F64, the top-k sets equal (up to near-ties at the k-th place), short
    rows all visible entries in order, −1 padded. The quantised Q equals what the library's own
    MXFP4 Q path computes from the RoPE'd bf16 Q (same logits bit for bit)."""
    vc, layer, kv, g = _layer(model_config, monkeypatch, 6, seed=1)
    ratio, ind = FULL[2], layer.indexer
    view = kv["model.layers.2.attn.indexer.k_cache"].squeeze(1)
    spp = view.shape[1]
    table = torch.tensor([[4, 0, 2, 5, 1], [3, -1, 0, 0, 0]], dtype=torch.int32)
    blocks = (4, 0, 2, 5, 1, 3)
    _write_index_k(layer, g, [b * spp + s for b in blocks for s in range(spp)], ratio)

    t = len(POSITIONS)
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    req = torch.tensor(REQS, dtype=torch.int32)
    qr = (torch.randn(t, ind.q_lora_rank, generator=g)).to(torch.bfloat16)
    iw = (torch.randn(t, ind.n_head, generator=g)).to(torch.bfloat16)
    q_dec, pos_out, w = ind.forward_q(qr, None, iw, positions, layer.indexer_rotary_emb)
    assert q_dec.shape == (t, 32, 128) and torch.equal(pos_out, positions)

    # f64 side: the same wq_b output, RoPE'd and MXFP4-quantised by this test's reference.
    q_lin = ind.wq_b(qr)[0].view(t, 32, 128)
    roped = _rope_bf16(q_lin, positions, layer.indexer_rotary_emb.cos_sin_cache)
    q64 = _mxfp4_q_f64(roped)
    assert torch.equal(q_dec.double(), q64)
    w_ref = iw.float() * (ind.softmax_scale * 32 ** -0.5)
    assert torch.equal(w, w_ref)
    keys = {b: _mxfp4_index_k_rows_f64(view, b) for b in blocks}
    ref = _logits_f64(q64, w, positions, req, table, keys, ratio)

    # The library's MXFP4 Q path on the RoPE'd bf16 Q meets the same logits.
    n = table.shape[1] * spp
    a, b = torch.zeros(t, n), torch.zeros(t, n)
    _lib.indexer_logits_pool(q_dec, w, positions, req, view, table, ratio, 0, a)
    _lib.indexer_logits_pool(roped, w, positions, req, view, table, ratio, 1, b)
    assert torch.equal(a, b)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(a), fin)
    err = (a.double()[fin] - ref[fin]).abs()
    assert bool((err <= F32_ABS + F32_REL * ref[fin].abs()).all()), float(err.max())

    # The layer's scorer, called as _sparse_indexer_and_attn calls it.
    ind.topk_indices_buffer.fill_(77)
    md = {ind.k_cache.prefix: types.SimpleNamespace(num_decode_tokens=t, num_prefill_tokens=0,
                                                     block_table=table),
          layer.swa_cache_layer.prefix: types.SimpleNamespace(token_to_req_indices=req)}
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata=md,
                                                 slot_mapping={})):
        ind.indexer_op(None, (q_dec, positions), None, w)
    k = ind.topk_tokens
    top = ind.topk_indices_buffer[:t, :k]
    assert bool((ind.topk_indices_buffer[t:] == 77).all())
    for i in range(t):
        vis = min((POSITIONS[i] + 1) // ratio, n)
        if vis > k:
            assert bool(torch.isfinite(a[i, top[i].long()]).all()), i
        _assert_topk(top[i], ref[i], k, vis, i)
    # The same tokens split into decode and prefill rows and scored 3 rows at a time (the
    # logits budget of long prefills): the same top-k.
    first = ind.topk_indices_buffer[:t].clone()
    monkeypatch.setattr(csa2_indexer, "LOGITS_BUDGET_BYTES", 4 * n * 3)
    ind.topk_indices_buffer.fill_(77)
    md[ind.k_cache.prefix] = types.SimpleNamespace(num_decode_tokens=2, num_prefill_tokens=t - 2,
                                                    block_table=table)
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata=md,
                                                 slot_mapping={})):
        ind.indexer_op(None, (q_dec, positions), None, w)
    assert torch.equal(ind.topk_indices_buffer[:t], first)


def test_layer_attention_half_on_sm90_matches_the_host_reference(model_config, monkeypatch):  # noqa: F811
    """The layer's ``_sparse_indexer_and_attn`` on 9.0 over all three V4.1 records of the planned
    890 slab (288-B NVFP4 compressed entries by the layer's compressor writer, 528-B MXFP8 SWA
    rows by vLLM's writer, 68-B MXFP4 index K by the layer's indexer): csa2's indexer picks the
    top-512 of up to 640 visible entries, ``forward_mqa`` attends over them plus the SWA window;
    the output matches a float64 reference (f64 indexer on the page bytes → top-k → f64 softmax
    over the rows vLLM's gather kernel dequantises)."""
    vc, layer, kv, g = _layer(model_config, monkeypatch, 12, seed=2)
    ratio, ind = FULL[2], layer.indexer
    main = kv["model.layers.2.attn"].squeeze(1)
    swa = kv["model.layers.2.attn.swa_cache"].squeeze(1)
    idx_k = kv["model.layers.2.attn.indexer.k_cache"].squeeze(1)
    spp, nb = main.shape[1], main.shape[0]
    # Full-attention group (compressed + index K) on blocks 0..5, the SWA group on 6..11.
    table = torch.tensor([[3, 0, 5, 1, 4], [2, -1, 0, 0, 0]], dtype=torch.int32)
    cmp_blocks = (3, 0, 5, 1, 4, 2)
    slots = [b * spp + s for b in cmp_blocks for s in range(spp)]
    # The compressed entries through the layer's compressor writer (csa2's NVFP4 on 9.0).
    latent = (torch.randn(len(slots), 512, generator=g) * 1.5).to(torch.bfloat16)
    pos_w = torch.arange(len(slots), dtype=torch.int64) * ratio + ratio - 1
    md_w = {"model.layers.2.attn": types.SimpleNamespace(
        slot_mapping=torch.tensor(slots, dtype=torch.int64))}
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata=md_w,
                                                 slot_mapping={})):
        layer.compressor.insert_cache(latent, pos_w, layer.rotary_emb)
    _write_index_k(layer, g, slots, ratio)
    swa_spp = swa.shape[1]
    swa_slots = list(range((nb // 2) * swa_spp, nb * swa_spp))
    kswa = (torch.randn(len(swa_slots), 512, generator=g) * 1.5).to(torch.bfloat16)
    cache_utils.quantize_and_insert_k_cache(kswa, swa, torch.tensor(swa_slots, dtype=torch.int64),
                                            block_size=swa_spp, bytes_per_token=528)

    positions = torch.tensor([1279, 1024, 200, 9], dtype=torch.int64)
    req = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    t, heads, padded = len(positions), layer.n_local_heads, layer.padded_heads
    swa_idx = torch.tensor(swa_slots, dtype=torch.int32)[
        torch.randint(0, len(swa_slots), (t, 128), generator=g)]
    swa_len = torch.tensor([128, 100, 128, 10], dtype=torch.int32)
    swa_md = types.SimpleNamespace(
        num_decode_tokens=t, num_prefill_tokens=0, token_to_req_indices=req,
        is_valid_token=torch.ones(t, dtype=torch.bool), decode_swa_indices=swa_idx,
        decode_swa_lens=swa_len, prefix=layer.swa_cache_layer.prefix)
    cmp_md = types.SimpleNamespace(block_size=256, block_table=table)
    imd = types.SimpleNamespace(num_decode_tokens=t, num_prefill_tokens=0, block_table=table,
                                max_seq_len=int(positions.max()) + 1)
    md = {layer.swa_cache_layer.prefix: swa_md, "model.layers.2.attn": cmp_md,
          ind.k_cache.prefix: imd}

    qr = torch.randn(t, ind.q_lora_rank, generator=g).to(torch.bfloat16)
    iw = torch.randn(t, ind.n_head, generator=g).to(torch.bfloat16)
    q = torch.zeros(t, padded, 512, dtype=torch.bfloat16)
    q[:, :heads] = (torch.randn(t, heads, 512, generator=g) * 2).to(torch.bfloat16)
    with torch.no_grad():
        layer.attn_sink.copy_(torch.randn(layer.attn_sink.shape, generator=g) * 0.5)
    out = torch.full_like(q, float("nan"))
    ctx = ForwardContext(no_compile_layers={}, attn_metadata=md, slot_mapping={})
    with override_forward_context(ctx):
        index_q, index_pos, index_w = ind.forward_q(qr, None, iw, positions,
                                                    layer.indexer_rotary_emb)
        layer._sparse_indexer_and_attn(None, index_q, index_pos, index_w, q, None, positions,
                                       out)

    # Reference: f64 indexer → top-512 → f64 attention over the decoded rows.
    keys = {b: _mxfp4_index_k_rows_f64(idx_k, b) for b in cmp_blocks}
    q_lin = ind.wq_b(qr)[0].view(t, 32, 128)
    q64 = _mxfp4_q_f64(_rope_bf16(q_lin, positions, layer.indexer_rotary_emb.cos_sin_cache))
    w = iw.float() * (ind.softmax_scale * 32 ** -0.5)
    ref_logits = _logits_f64(q64, w, positions, req, table, keys, ratio)

    def rows64(view):
        n_b, bs = view.shape[0], view.shape[1]
        o = torch.zeros(1, n_b * bs, 512, dtype=torch.bfloat16)
        cache_utils.dequantize_and_gather_k_cache_triton(
            o, view, torch.tensor([n_b * bs], dtype=torch.int32), None,
            torch.arange(n_b, dtype=torch.int32)[None], bs, 0)
        return o[0].double()

    main64, swa64 = rows64(main), rows64(swa)
    k = ind.topk_tokens
    got_top = ind.topk_indices_buffer[:t, :k]
    for i in range(t):
        vis = (int(positions[i]) + 1) // ratio
        _assert_topk(got_top[i], ref_logits[i], k, vis, i)
        if vis > k:
            entries = torch.topk(ref_logits[i], k).indices.tolist()
            if set(entries) != set(got_top[i].tolist()):
                entries = got_top[i].tolist()  # a near-tie at the k-th place (checked above)
        else:
            entries = list(range(vis))
        main_slots = [int(table[int(req[i]), j // spp]) * spp + j % spp for j in entries
                      if int(table[int(req[i]), j // spp]) >= 0]
        keys_i = torch.cat([main64[main_slots], swa64[swa_idx[i, :int(swa_len[i])].long()]])
        ref = _attend64(q[i, :heads], keys_i, torch.arange(len(keys_i)), len(keys_i),
                        layer.scale, layer.attn_sink[:heads].float())
        torch.testing.assert_close(out[i, :heads].float(), ref.float(), rtol=2 ** -7, atol=1e-3)
        assert bool((out[i, heads:] == 0).all())


def test_q_quantiser_and_candidate_masks_are_capture_safe_under_fake_tensors():
    """The route's tensor ops (``mxfp4_index_q``, ``select_candidate_blocks``,
    ``apply_candidate_mask``) run under FakeTensorMode, where an op that needs a value on the host
    raises (shown by ``nonzero``), writing only into their preallocated outputs."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException, FakeTensorMode)

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    t, h = 5, 32
    with mode:
        q = torch.empty(t, h, 128, dtype=torch.bfloat16)
        pos = torch.zeros(t, dtype=torch.int64)
        cs = torch.empty(4096, 64)
        w = torch.empty(t, h, dtype=torch.bfloat16)
        q_out = torch.empty(16, h, 128, dtype=torch.bfloat16)
        w_out = torch.empty(16, h)
        csa2_indexer.mxfp4_index_q(q, pos, cs, w, 0.1, 0.2, q_out, w_out)
        logits = torch.empty(t, 64)
        cand = torch.empty(8, 4, dtype=torch.int32)
        vis = torch.zeros(t, dtype=torch.int64)
        csa2_indexer.select_candidate_blocks(logits, vis, 8, cand)
        csa2_indexer.apply_candidate_mask(logits, vis, cand, 8)
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
            torch.nonzero(vis)


def test_candidate_blocks_follow_vllms_rule():
    """Candidate selection and masking (V4.1's two-level filter) on small logits against this
    test's own reading of vLLM's rule: blocks scored by their best visible logit, the newest
    visible block pinned, −1 for blocks with nothing visible; the mask keeps exactly the visible
    columns of the listed blocks."""
    g = torch.Generator().manual_seed(9)
    t, n, bs, kb = 4, 48, 8, 3
    logits = torch.randn(t, n, generator=g)
    vis = torch.tensor([0, 5, 30, 48])
    cand = torch.full((t + 2, kb), 9, dtype=torch.int32)
    csa2_indexer.select_candidate_blocks(logits, vis, bs, cand)
    assert bool((cand[t:] == 9).all())
    for i in range(t):
        v = int(vis[i])
        if v == 0:
            assert cand[i].tolist() == [-1] * kb
            continue
        nvis = -(-v // bs)
        scores = [max(float(x) for x in logits[i, b * bs:min(v, (b + 1) * bs)]) for b in range(nvis)]
        newest = nvis - 1
        order = [newest] + sorted((b for b in range(nvis) if b != newest), key=lambda b: -scores[b])
        want = (order + [-1] * kb)[:kb]
        assert sorted(cand[i].tolist()) == sorted(want), i
    masked = logits.clone()
    csa2_indexer.apply_candidate_mask(masked, vis, cand, bs)
    for i in range(t):
        for j in range(n):
            keep = j < int(vis[i]) and (j // bs) in cand[i].tolist()
            assert (masked[i, j] == logits[i, j]) if keep else masked[i, j] == -math.inf, (i, j)
