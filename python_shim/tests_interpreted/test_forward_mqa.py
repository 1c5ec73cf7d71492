"""``Csa2DeepseekV4Attention.forward_mqa`` against vLLM's own FlashMLA layer code, on CPU.

What is real vLLM 0.33 code here (its Triton kernels run in Triton's interpreter, see conftest.py):

- the SWA metadata: per-token SWA slot lists from ``_COMPUTE_SWA_INDICES_AND_LENS_KERNEL`` (decode
  and prefill, with bounded replay's ``replay_start``) and the prefill gather lengths from
  ``DeepseekSparseSWAMetadataBuilder._build_deepseek_v4_metadata``;
- the reference: ``DeepseekV4FlashMLAAttention.forward_mqa`` itself, i.e. vLLM's decode path
  (``compute_global_topk_indices_and_lens``) and prefill path (``get_prefill_chunk_plan``,
  ``dequantize_and_gather_k_cache`` of both caches into the bf16 workspace,
  ``combine_topk_swa_indices``). Only its two CUDA kernels are replaced, by float64 torch
  evaluations of their documented contracts: ``flash_mla_sparse_fwd`` (sparse attention over the
  gathered workspace) and ``flash_mla_with_kvcache`` (sparse decode straight from the packed pools,
  whose records the stand-in dequantises with vLLM's own gather kernel). vLLM's CUDA-only CuteDSL
  gather is switched off so that its Triton gather, the same contract, runs.

Ours: the csa2 layer's ``forward_mqa`` on the same layer state, metadata and packed page pools
(strided views into per-block slabs, as vLLM binds them), through ``csa2_attention_pools``. The gathered bf16 rows are exact images of the records (an
NVFP4 value times an E4M3 scale, or an E4M3 value times a power of two, fits bf16), so the two
sides see the same keys; the tolerance is csa2's f32 accumulation against float64.
"""

from __future__ import annotations

import types

import pytest
import torch

from csa2_vllm import _lib
from csa2_vllm import attention as csa2_attention
from csa2_vllm.attention import Csa2DeepseekV4Attention
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.models.deepseek_v41.common.ops import cache_utils
from vllm.models.deepseek_v41.nvidia import flashmla
from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLAMetadata
from vllm.v1.attention.backends.mla import sparse_swa

WINDOW, HEADS, PADDED, TOPK, BLOCK = 128, 8, 64, 24, 64
E4M3_ONE = 0x38


# ---- packed records (independent of csa2's encoders) ---------------------------------------------

def _e4m3_codes(g, n):
    """Random E4M3 codes of magnitude 0.25 .. 1.875 and random sign."""
    c = torch.randint(0x28, 0x40, (n,), generator=g, dtype=torch.int32)
    return (c | (torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 7)).to(torch.uint8)


def _ints(g, lo, hi, shape):
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)


def _records(g, n, width):
    """n random valid records (288 NVFP4, 528 MXFP8, 584 V4) whose values are O(1), so that a
    softmax over them is spread over many rows (a one-hot softmax would hide wrong rows)."""
    r = torch.empty(n, width, dtype=torch.uint8)
    if width == 288:  # 256 B of E2M1 pairs, 32 E4M3 scales 2^-4 .. 0.47
        r[:, :256] = _ints(g, 0, 256, (n, 256))
        r[:, 256:] = _ints(g, 0x18, 0x30, (n, 32))
    elif width == 528:  # 512 E4M3, 16 UE8M0 scales 2^-3 .. 2^1
        r[:, :512] = _e4m3_codes(g, n * 512).reshape(n, 512)
        r[:, 512:] = _ints(g, 124, 129, (n, 16))
    else:  # V4: 448 E4M3, 64 bf16 RoPE dims, 7 UE8M0 scales + a zero pad byte
        r[:, :448] = _e4m3_codes(g, n * 448).reshape(n, 448)
        rope = (torch.randn(n, 64, generator=g) * 0.5).to(torch.bfloat16)
        r[:, 448:576] = rope.view(torch.uint8).reshape(n, 128)
        r[:, 576:583] = _ints(g, 124, 129, (n, 7))
        r[:, 583] = 0
    return r


# ---- float64 stand-ins for FlashMLA's two CUDA kernels -------------------------------------------

def _attend64(q, keys, rows, n, scale, sink):
    """One token: q (H, 512), keys (M, 512) f64, first n entries of rows (−1 skipped)."""
    sel = [int(j) for j in rows[:n] if int(j) >= 0]
    h = q.shape[0]
    if not sel:
        return torch.zeros(h, 512, dtype=torch.float64)
    k = keys[sel]
    z = (q.double() @ k.T) * scale
    a = sink.double()[:, None]
    m = torch.maximum(z.max(1, keepdim=True).values, a)
    e = torch.exp(z - m)
    return (e @ k) / (e.sum(1, keepdim=True) + torch.exp(a - m))


def _pool_rows64(pool):
    """All slots of a packed pool, dequantised by vLLM's own gather kernel, as float64."""
    nb, bs = pool.shape[0], pool.shape[1]
    out = torch.zeros(1, nb * bs, 512, dtype=torch.bfloat16)
    cache_utils.dequantize_and_gather_k_cache_triton(
        out, pool, torch.tensor([nb * bs], dtype=torch.int32), None,
        torch.arange(nb, dtype=torch.int32)[None], bs, 0)
    return out[0].double()


def sparse_fwd64(q, kv, indices, sm_scale, attn_sink, topk_length, out):
    keys = kv.reshape(-1, kv.shape[-1]).double()
    idx = indices.reshape(q.shape[0], -1)
    for t in range(q.shape[0]):
        out[t] = _attend64(q[t], keys, idx[t], int(topk_length[t]), sm_scale,
                           attn_sink).to(out.dtype)


def with_kvcache64(*, q, k_cache, indices, topk_length, softmax_scale, attn_sink, out,
                   extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None,
                   **_):
    swa = _pool_rows64(k_cache.squeeze(-2))
    t = q.shape[0]
    sidx = indices.reshape(t, -1)
    if extra_k_cache is not None:
        main = _pool_rows64(extra_k_cache.squeeze(-2))
        midx = extra_indices_in_kvcache.reshape(t, -1)
    for i in range(t):
        keys, rows, n = swa, sidx[i], int(topk_length[i])
        if extra_k_cache is not None:
            ne = int(extra_topk_length[i])
            keys = torch.cat([main, swa])
            rows = torch.cat([midx[i, :ne], torch.where(sidx[i] >= 0, sidx[i] + main.shape[0], -1)])
            n = ne + n
        out[i, 0] = _attend64(q[i, 0], keys, rows, n, softmax_scale, attn_sink).to(out.dtype)
    return out, None


class _Workspace:
    def get_simultaneous(self, *specs):
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]


# ---- a batch: decodes first, then prefills -------------------------------------------------------

def _batch(seed, ratio, decodes, prefills, main_width, swa_width, replay=None):
    """decodes: seq_lens of 1-token requests; prefills: (seq_len, query_len); replay: per-request
    replay_start (bounded replay), default 0."""
    g = torch.Generator().manual_seed(seed)
    reqs = [(s, 1) for s in decodes] + list(prefills)
    nreq = len(reqs)
    seq = torch.tensor([s for s, _ in reqs], dtype=torch.int32)
    qlen = [n for _, n in reqs]
    qsl = torch.tensor([0] + list(torch.tensor(qlen).cumsum(0)), dtype=torch.int32)
    t = int(qsl[-1])
    t2r = torch.repeat_interleave(torch.arange(nreq, dtype=torch.int32), torch.tensor(qlen))
    positions = torch.cat([torch.arange(s - n, s) for s, n in reqs]).long()
    replay_start = torch.tensor(replay or [0] * nreq, dtype=torch.int32)

    def pool_and_table(tokens_per_block, entries, width):
        need = [max(1, -(-e // tokens_per_block)) for e in entries]
        perm = torch.randperm(sum(need) + 3, generator=g).to(torch.int32)
        table = torch.full((nreq, max(need) + 1), -1, dtype=torch.int32)
        k = 0
        for r, n in enumerate(need):
            table[r, :n] = perm[k:k + n]
            k += n
        pool = _records(g, (sum(need) + 3) * tokens_per_block, width)
        pool = pool.reshape(-1, tokens_per_block, width)
        if width == 584:  # V4 pages are block-planar: all tokens' data, then all their scales
            pool = torch.cat([pool[:, :, :576].flatten(1), pool[:, :, 576:].flatten(1)], 1)
            pool = pool.reshape(-1, tokens_per_block, width)
        # As vLLM hands it: a view into a per-block slab (stride(0) = the slab size, never
        # tokens × width; offset into the slab), the other bytes someone else's (0xFF here).
        nb, page = pool.shape[0], tokens_per_block * width
        offset = 1024
        slab = torch.full((nb, offset + page + 512), 0xFF, dtype=torch.uint8)
        view = slab.as_strided(pool.shape, (slab.stride(0), width, 1), offset)
        view.copy_(pool)
        return view, table

    swa_pool, swa_table = pool_and_table(BLOCK, [int(s) for s in seq], swa_width)
    if ratio:
        cmp_pool, cmp_table = pool_and_table(BLOCK // ratio, [int(s) // ratio for s in seq],
                                             main_width)
    else:
        cmp_pool, cmp_table = None, swa_table.clone()

    # The indexer's local top-k: distinct visible entries, −1 padding (holes too, for prefill).
    topk = torch.full((t, TOPK), -1, dtype=torch.int32)
    for i in range(t):
        vis = int(positions[i] + 1) // ratio if ratio else 0
        n = min(TOPK, vis)
        if n:
            topk[i, :n] = torch.randperm(vis, generator=g)[:n].to(torch.int32)
        if i >= len(decodes) and n > 2:
            topk[i, 1] = -1  # a hole inside a prefill row

    valid = torch.ones(t, dtype=torch.bool)
    nd = len(decodes)
    swa_args = dict(query_start_loc=qsl, seq_lens=seq, token_to_req_indices=t2r,
                    is_valid_token=valid, block_table=swa_table, block_size=BLOCK,
                    replay_start=replay_start)
    dec_idx = torch.full((max(nd, 1), WINDOW), -1, dtype=torch.int32)
    dec_len = torch.zeros(max(nd, 1), dtype=torch.int32)
    pre_idx = torch.full((max(t - nd, 1), 1, WINDOW), -1, dtype=torch.int32)
    pre_len = torch.zeros(max(t - nd, 1), dtype=torch.int32)
    kernel = sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL
    if nd:
        kernel(dec_idx, dec_len, WINDOW, WINDOW, dec_len, dec_len, num_tokens=nd, token_offset=0,
               **swa_args)
    if t > nd:
        kernel(pre_idx, pre_len, WINDOW, WINDOW, pre_len, pre_len, num_tokens=t - nd,
               token_offset=nd, **swa_args)
    builder = types.SimpleNamespace(window_size=WINDOW, max_model_len=4096,
                                    max_num_batched_tokens=256)
    extra = sparse_swa.DeepseekSparseSWAMetadataBuilder._build_deepseek_v4_metadata(
        builder, nd, len(prefills), seq, seq, qsl, qsl, replay_start)
    swa_md = sparse_swa.DeepseekSparseSWAMetadata(
        block_table=swa_table, slot_mapping=torch.zeros(t, dtype=torch.int64), block_size=BLOCK,
        seq_lens=seq, query_start_loc=qsl, query_start_loc_cpu=qsl, is_valid_token=valid,
        token_to_req_indices=t2r, decode_swa_indices=dec_idx[:nd], decode_swa_lens=dec_len[:nd],
        decode_swa_width=WINDOW, prefill_swa_indices=pre_idx[:t - nd],
        prefill_swa_lens=pre_len[:t - nd], replay_start=replay_start, num_decodes=nd,
        num_prefills=len(prefills), num_decode_tokens=nd, num_prefill_tokens=t - nd,
        tile_sched_swaonly=object(), tile_sched_c1a=object(), tile_sched_c2a=object(), **extra)
    cmp_md = DeepseekV4FlashMLAMetadata(
        num_reqs=nreq, max_query_len=max(qlen), max_seq_len=int(seq.max()), num_actual_tokens=t,
        query_start_loc=qsl, slot_mapping=torch.zeros(t, dtype=torch.int64),
        block_table=cmp_table, req_id_per_token=t2r, block_size=BLOCK, topk_tokens=TOPK)

    layer = Csa2DeepseekV4Attention.__new__(Csa2DeepseekV4Attention)
    torch.nn.Module.__init__(layer)
    swa_layer = types.SimpleNamespace(prefix="layers.0.attn.swa", kv_cache=swa_pool)
    layer.__dict__.update(
        compress_ratio=ratio, window_size=WINDOW, n_local_heads=HEADS, padded_heads=PADDED,
        _prefill_num_heads=PADDED, scale=512 ** -0.5, use_pcp=False, max_model_len=4096,
        max_num_batched_tokens=256, topk_indices_buffer=topk, swa_cache_layer=swa_layer,
        compressed_cache_prefix="layers.0.attn" if ratio else None, is_kv_source=True,
        kv_cache=cmp_pool,
    )
    layer.attn_sink = torch.randn(PADDED, generator=g) * 0.5
    md = {swa_layer.prefix: swa_md}
    if ratio:
        md["layers.0.attn"] = cmp_md
    q = torch.zeros(t, PADDED, 512, dtype=torch.bfloat16)
    q[:, :HEADS] = (torch.randn(t, HEADS, 512, generator=g) * 2.0).to(torch.bfloat16)
    return layer, md, q, positions


def _run(layer, md, q, positions, forward):
    out = torch.full_like(q, float("nan"))
    ctx = ForwardContext(no_compile_layers={}, attn_metadata=md, slot_mapping={})
    with override_forward_context(ctx):
        forward(layer, q, None, positions, out)
    return out


def _vllm_reference(monkeypatch, layer, md, q, positions):
    monkeypatch.setattr(flashmla, "flash_mla_sparse_fwd", sparse_fwd64)
    monkeypatch.setattr(flashmla, "flash_mla_with_kvcache", with_kvcache64)
    monkeypatch.setattr(flashmla, "current_workspace_manager", lambda: _Workspace())
    # The CuteDSL gather (CUDA-only) would be chosen for fp8 records when its package is installed;
    # the Triton gather is vLLM's other implementation of the same contract (and its only NVFP4 one).
    monkeypatch.setattr(cache_utils, "has_cutedsl", lambda: False)
    return _run(layer, md, q, positions, flashmla.DeepseekV4FlashMLAAttention.forward_mqa)


CASES = {
    # ratio, decode seq_lens, prefill (seq_len, query_len), main record, SWA record, replay_start
    "v41_nvfp4_ratio2": (2, [130, 40, 129], [(300, 5), (9, 9)], 288, 528, None),
    "v41_mxfp8_ratio1": (1, [128, 257], [(140, 12)], 528, 528, None),
    "v4_records_ratio2": (2, [200], [(129, 3), (64, 64)], 584, 584, None),
    "swa_only": (0, [127, 3], [(131, 4)], 288, 528, None),
    "bounded_replay": (2, [260], [(262, 6), (40, 2)], 288, 528, [0, 250, 30]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_mqa_matches_vllms_flashmla_layer(monkeypatch, case):
    ratio, dec, pre, mw, sw, replay = CASES[case]
    layer, md, q, positions = _batch(hash(case) % 1000, ratio, dec, pre, mw, sw, replay)
    ours = _run(layer, md, q, positions, Csa2DeepseekV4Attention.forward_mqa)
    ref = _vllm_reference(monkeypatch, layer, md, q, positions)
    assert not ours.isnan().any()
    assert torch.equal(ours[:, HEADS:], torch.zeros_like(ours[:, HEADS:]))
    # Both sides round the output to bf16; compare in float against the reference's heads.
    torch.testing.assert_close(ours[:, :HEADS].float(), ref[:, :HEADS].float(),
                               rtol=2 ** -7, atol=2e-3)


def test_case_data_is_not_degenerate(monkeypatch):
    """The comparison above means something: tokens attend both sets, replay shortens windows."""
    layer, md, q, positions = _batch(1, *CASES["bounded_replay"][:5], [0, 250, 30])
    swa_md = md["layers.0.attn.swa"]
    pre_len = swa_md.prefill_swa_lens
    # replaying request (replay_start 250) at positions 256..261: windows of 7..12 rows
    assert pre_len[:6].tolist() == [p - 250 + 1 for p in range(256, 262)]
    assert int(swa_md.decode_swa_lens[0]) == WINDOW
    ours = _run(layer, md, q, positions, Csa2DeepseekV4Attention.forward_mqa)
    layer.topk_indices_buffer.fill_(-1)
    swa_only = _run(layer, md, q, positions, Csa2DeepseekV4Attention.forward_mqa)
    assert (ours[:, :HEADS].float() - swa_only[:, :HEADS].float()).abs().max() > 1e-2


def test_warmup_and_errors():
    layer, md, q, positions = _batch(3, *CASES["v41_nvfp4_ratio2"][:5])
    out = _run(layer, None, q, positions, Csa2DeepseekV4Attention.forward_mqa)
    assert torch.equal(out, torch.zeros_like(out))  # dummy run: zeros, no library call
    bad = dict(md)
    bad["layers.0.attn"] = DeepseekV4FlashMLAMetadata(**{
        **md["layers.0.attn"].__dict__,
        "block_table": torch.full_like(md["layers.0.attn"].block_table, 10_000)})
    with pytest.raises(_lib.Csa2Error, match="outside the pool"):
        _run(layer, bad, q, positions, Csa2DeepseekV4Attention.forward_mqa)
    layer.topk_indices_buffer[0, 0] = 10_000  # past the block table
    with pytest.raises(ValueError, match="past the block table"):
        _run(layer, md, q, positions, Csa2DeepseekV4Attention.forward_mqa)


def test_index_lists_match_vllm_kernels():
    """Our torch index maps against vLLM's Triton ones (decode: compute_global_topk_indices_and_lens)."""
    layer, md, q, positions = _batch(5, *CASES["v41_nvfp4_ratio2"][:5])
    swa_md, cmp_md = md["layers.0.attn.swa"], md["layers.0.attn"]
    nd = swa_md.num_decode_tokens
    bs = BLOCK // 2
    theirs, their_lens = cache_utils.compute_global_topk_indices_and_lens(
        layer.topk_indices_buffer[:nd], swa_md.token_to_req_indices[:nd], cmp_md.block_table, bs,
        swa_md.is_valid_token[:nd])
    ours, our_lens = csa2_attention.lists.decode_topk_slots(
        layer.topk_indices_buffer[:nd], swa_md.token_to_req_indices[:nd], cmp_md.block_table, bs,
        swa_md.is_valid_token[:nd])
    assert torch.equal(ours, theirs) and torch.equal(our_lens, their_lens)


def test_the_comparison_sees_one_missing_row(monkeypatch):
    """One SWA row fewer for one prefill token must break the agreement (the tolerance is tight
    enough to see a single row of ~150)."""
    layer, md, q, positions = _batch(7, *CASES["v41_nvfp4_ratio2"][:5])
    ref = _vllm_reference(monkeypatch, layer, md, q, positions)
    swa_md = md["layers.0.attn.swa"]
    nd = swa_md.num_decode_tokens
    swa_md.prefill_swa_lens[0] -= 1  # drops the token's own row (the window's last)
    ours = _run(layer, md, q, positions, Csa2DeepseekV4Attention.forward_mqa)
    close = torch.isclose(ours[:, :HEADS].float(), ref[:, :HEADS].float(), rtol=2 ** -7, atol=2e-3)
    assert close[:nd].all() and close[nd + 1:].all()
    assert not close[nd].all()


def test_a_padding_decode_token_with_a_stale_topk_row():
    """A padding token (slot_mapping < 0, so is_valid_token False) keeps its top-k row from an
    earlier step; vLLM's kernels give it length 0 and never read the row. Ours must not fail on
    it (entries past the block table) and must leave every other token as it was."""
    layer, md, q, positions = _batch(13, *CASES["v41_nvfp4_ratio2"][:5])
    before = _run(layer, md, q, positions, Csa2DeepseekV4Attention.forward_mqa)
    swa_md = md["layers.0.attn.swa"]
    swa_md.is_valid_token[1] = False  # the second decode token
    swa_md.decode_swa_lens[1] = 0  # what _COMPUTE_SWA_INDICES_AND_LENS_KERNEL writes for it
    swa_md.decode_swa_indices[1] = -1
    layer.topk_indices_buffer[1] = 1 << 20  # stale: far past the block table
    after = _run(layer, md, q, positions, Csa2DeepseekV4Attention.forward_mqa)
    assert torch.equal(after[1], torch.zeros_like(after[1]))
    keep = torch.arange(q.shape[0]) != 1
    assert torch.equal(after[keep], before[keep])
