"""``csa2_attention_pools`` on per-block slabs laid out as vLLM 0.33 lays them out and filled by
vLLM's own writer kernels (Triton interpreter, see conftest.py), the capture-safety of the list
building, and the new ``forward_mqa`` route against the earlier one.

The slabs: every layer's pages of one block id in one slab row; a layer's cache is an
``as_strided`` ``[blocks, states, record bytes]`` view whose ``stride(0)`` is the slab size and
whose storage offset is the layer's page offset (vLLM's ``create_kv_cache_views``). Bytes no writer
touched hold 0xFF (an E8M0 / E4M3 NaN): a read from the wrong place shows up as NaN or a mismatch.

The writers: ``quantize_and_insert_k_cache`` (SWA cache: V4 584 B, V4.1 MXFP8 528 B) and
``rope_quant_insert`` (compressed cache: 584, 528, and the 288-B NVFP4 record with csa2's portable
E2M1 packer, :mod:`csa2_vllm.writers`, since vLLM's uses SM100-only PTX that neither SM90 nor the
interpreter runs). The reference: vLLM's own gather kernel (``dequantize_and_gather_k_cache_triton``)
dequantises every slot of the same views, and a float64 softmax with the sink runs over the
listed rows.
"""

from __future__ import annotations

import pytest
import torch

from csa2_vllm import _lib, writers
from csa2_vllm import attention as csa2_attention
from csa2_vllm.attention import Csa2DeepseekV4Attention
from vllm.models.deepseek_v41.common.ops import cache_utils
from vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache import rope_quant_insert

from test_forward_mqa import CASES, HEADS, _attend64, _batch, _run

ALIGN = 512


def _slab(blocks: int, pages: list[tuple[int, int]], g) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One slab row per block holding ``pages`` = [(states, record bytes)], each page at a
    512-aligned offset, the row padded past the last page; returns (slab, one view per page)."""
    offsets, off = [], 0
    for states, width in pages:
        offsets.append(off)
        off += -(-states * width // ALIGN) * ALIGN
    stride = off + ALIGN  # a padded block stride: never states · width
    slab = torch.full((blocks, stride), 0xFF, dtype=torch.uint8)
    views = [slab.as_strided((blocks, s, w), (stride, w, 1), o)
             for (s, w), o in zip(pages, offsets)]
    return slab, views


def _cos_sin(n: int, g) -> torch.Tensor:
    ang = torch.rand(n, 32, generator=g, dtype=torch.float64) * 6.283
    return torch.cat([ang.cos(), ang.sin()], 1).float()


def _fill_swa(view, g, slots) -> None:
    k = (torch.randn(len(slots), 512, generator=g) * 1.5).to(torch.bfloat16)
    cache_utils.quantize_and_insert_k_cache(
        k, view, torch.tensor(slots, dtype=torch.int64), block_size=view.shape[1],
        bytes_per_token=view.shape[2])


def _fill_compressed(view, g, slots) -> None:
    writers.install()
    n = len(slots)
    latent = (torch.randn(n, 512, generator=g) * 1.5).to(torch.bfloat16)
    positions = torch.arange(n, dtype=torch.int64)
    rope_quant_insert(latent, positions, _cos_sin(n, g), view,
                      torch.tensor(slots, dtype=torch.int64), 1)


def _rows64(view) -> torch.Tensor:
    """Every slot of a (strided) pool dequantised by vLLM's gather kernel, float64."""
    nb, bs = view.shape[0], view.shape[1]
    out = torch.zeros(1, nb * bs, 512, dtype=torch.bfloat16)
    cache_utils.dequantize_and_gather_k_cache_triton(
        out, view, torch.tensor([nb * bs], dtype=torch.int32), None,
        torch.arange(nb, dtype=torch.int32)[None], bs, 0)
    return out[0].double()


def _lists(g, t, k, written, holes=True):
    """(T, k) int32 slot lists drawn from ``written`` with −1 holes, and lengths ≤ k."""
    idx = torch.full((t, k), -1, dtype=torch.int32)
    lens = torch.randint(1, k + 1, (t,), generator=g, dtype=torch.int32)
    w = torch.tensor(written, dtype=torch.int32)
    for i in range(t):
        pick = w[torch.randperm(len(written), generator=g)[:k]]
        idx[i, :len(pick)] = pick
        if holes and k > 3:
            idx[i, 2] = -1
    return idx, lens


KINDS = {  # compressed record (None = SWA-only layer), SWA record
    "sm90_v4_584": (584, 584),
    "sm100_nvfp4_288": (288, 528),
    "v41_mxfp8_528": (528, 528),
    "swa_only_528": (None, 528),
    "swa_only_584": (None, 584),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("padded,heads", [(64, 64), (128, 16)])
def test_entry_reads_vllm_written_slabs_in_place(kind, padded, heads):
    main_w, swa_w = KINDS[kind]
    g = torch.Generator().manual_seed(hash((kind, padded)) % 1000)
    blocks, swa_states, cmp_states = 5, 32, 16
    pages = [(swa_states, swa_w)] + ([(cmp_states, main_w), (cmp_states, 68)] if main_w else [])
    slab, views = _slab(blocks, pages, g)
    swa = views[0]
    # The written slots skip some of every page (those keep 0xFF, never listed).
    swa_slots = [s for s in range(blocks * swa_states) if s % 7 != 3]
    _fill_swa(swa, g, swa_slots)
    main = None
    if main_w:
        main = views[1]
        cmp_slots = [s for s in range(blocks * cmp_states) if s % 5 != 1]
        _fill_compressed(main, g, cmp_slots)
        # The index-K page between is untouched by the attention writers: still 0xFF.
        assert bool((views[2] == 0xFF).all())
    t = 6
    s_idx, s_len = _lists(g, t, 40, swa_slots)
    s_len[1] = 0  # a token with no SWA row
    if main is not None:
        m_idx, m_len = _lists(g, t, 24, cmp_slots)
        m_len[1] = 0  # ... and no compressed entry: attends nothing
    else:
        m_idx, m_len = s_idx[:, :0], None
    q = torch.zeros(t, padded, 512, dtype=torch.bfloat16)
    q[:, :heads] = (torch.randn(t, heads, 512, generator=g) * 2).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g) * 0.5
    out = torch.full_like(q, float("nan"))
    lse = torch.full((t, heads), float("nan"))
    _lib.attention_pools(q, main, m_idx, m_len, swa, s_idx, s_len, sink, heads, 512 ** -0.5, out,
                         lse=lse)

    swa64 = _rows64(swa)
    main64 = _rows64(main) if main is not None else None
    assert not swa64[swa_slots].isnan().any()
    for i in range(t):
        rows = [swa64[int(j)] for j in s_idx[i, :int(s_len[i])] if int(j) >= 0]
        if main is not None:
            rows = [main64[int(j)] for j in m_idx[i, :int(m_len[i])] if int(j) >= 0] + rows
        if not rows:
            assert torch.equal(out[i].float(), torch.zeros(padded, 512))
            assert bool((lse[i] == float("-inf")).all())
            continue
        keys = torch.stack(rows)
        ref = _attend64(q[i, :heads], keys, torch.arange(len(rows)), len(rows), 512 ** -0.5, sink)
        torch.testing.assert_close(out[i, :heads].float(), ref.float(), rtol=2 ** -7, atol=1e-3)
        z = (q[i, :heads].double() @ keys.T) * 512 ** -0.5
        torch.testing.assert_close(lse[i].double(), torch.logsumexp(z, 1), rtol=1e-5, atol=1e-4)
    assert torch.equal(out[:, heads:], torch.zeros_like(out[:, heads:]))


def test_entry_refuses_bad_slots_and_pools():
    g = torch.Generator().manual_seed(9)
    _, (swa,) = _slab(2, [(32, 528)], g)
    q = torch.zeros(1, 64, 512, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    sink = torch.zeros(64)
    idx = torch.tensor([[0, 64]], dtype=torch.int32)
    with pytest.raises(_lib.Csa2Error, match="outside the pool"):
        _lib.attention_pools(q, None, idx[:, :0], None, swa, idx, None, sink, 64, 0.0, out)
    with pytest.raises(_lib.Csa2Error, match="SWA-only"):
        _lib.attention_pools(q, None, idx[:, :1], None, swa, idx[:, :1], None, sink, 64, 0.0, out)
    with pytest.raises(ValueError, match="record width"):
        _lib.attention_pools(q, None, idx[:, :0], None, swa[:, :, :100], idx[:, :1], None, sink,
                             64, 0.0, out)
    # A pool view whose records are not packed inside the page is refused, not misread.
    bad = swa.as_strided((2, 16, 528), (swa.stride(0), 1056, 1), swa.storage_offset())
    with pytest.raises(_lib.Csa2Error, match="strides"):
        _lib.attention_pools(q, None, idx[:, :0], None, bad, idx[:, :1], None, sink, 64, 0.0, out)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("case", list(CASES))
def test_new_route_equals_the_compacting_route(case):
    """``forward_mqa`` (in place, csa2_attention_pools) gives bit for bit what the earlier route
    (compact gather + csa2_attention_indexed, still :func:`csa2_attention.csa2_attend`) gives on
    the interpreted FlashMLA layer cases: the same decode, the same f32 sums, the same rounding."""
    ratio, dec, pre, mw, sw, replay = CASES[case]
    layer, md, q, positions = _batch(hash(case) % 1000, ratio, dec, pre, mw, sw, replay)
    new = _run(layer, md, q, positions, Csa2DeepseekV4Attention.forward_mqa)

    def old_route(layer, q, kv, positions, output):
        swa_md = md[layer.swa_cache_layer.prefix]
        cmp_md = md.get(layer.compressed_cache_prefix) if layer.compressed_cache_prefix else None
        t = swa_md.num_decode_tokens + swa_md.num_prefill_tokens
        output.zero_()
        csa2_attention.csa2_attend(layer, q[:t], positions[:t], swa_md, cmp_md, output[:t])

    old = _run(layer, md, q, positions, old_route)
    assert not new.isnan().any()
    assert torch.equal(new, old)


def _fake_copy(obj, mode):
    """A shallow copy of a metadata object whose tensors are fake tensors of ``mode``."""
    import copy

    c = copy.copy(obj)
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            object.__setattr__(c, k, mode.from_tensor(v))
    return c


@pytest.mark.parametrize("case", ["v41_nvfp4_ratio2", "v4_records_ratio2", "swa_only"])
def test_list_building_is_capture_safe_under_fake_tensors(case):
    """The GPU route's list building (``pool_lists(check=False)``) runs under FakeTensorMode, where
    any op that needs a tensor's values on the host (``.item()``, ``bool()``, ``.cpu()`` data,
    ``unique``, ``nonzero``, data-dependent shapes) raises; the earlier compacting route does not."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )

    ratio, dec, pre, mw, sw, replay = CASES[case]
    layer, md, q, positions = _batch(3, ratio, dec, pre, mw, sw, replay)
    swa_md = md[layer.swa_cache_layer.prefix]
    cmp_md = md.get("layers.0.attn")
    real = csa2_attention.pool_lists(layer, positions, swa_md, cmp_md, check=False)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fswa, fcmp = _fake_copy(swa_md, mode), cmp_md and _fake_copy(cmp_md, mode)
    flayer = type("L", (), {})()
    flayer.compress_ratio = layer.compress_ratio
    flayer.topk_indices_buffer = mode.from_tensor(layer.topk_indices_buffer)
    fpos = mode.from_tensor(positions)
    with mode:
        fake = csa2_attention.pool_lists(flayer, fpos, fswa, fcmp, check=False)
        assert [p[:2] for p in fake] == [p[:2] for p in real]
        for f, r in zip(fake, real):
            for a, b in zip(f[2:], r[2:]):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.shape == b.shape and a.dtype == b.dtype == torch.int32
    # The check is real: the host-checking variant and the earlier route's compaction raise.
    refused = (DataDependentOutputException, DynamicOutputShapeException)
    if ratio:
        with mode, pytest.raises(refused):
            csa2_attention.pool_lists(flayer, fpos, fswa, fcmp, check=True)
    fpool = mode.from_tensor(torch.zeros(4, 32, 528, dtype=torch.uint8))
    slots = fswa.decode_swa_indices.reshape(fswa.decode_swa_indices.shape[0], -1)
    with mode, pytest.raises(refused):
        csa2_attention.lists.compact(fpool, slots, fswa.decode_swa_lens, "SWA")


def test_bad_topk_entries_become_flagged_slots_on_the_gpu_route():
    """With ``check=False`` a live top-k entry past the block table is BAD_SLOT (the entry then
    refuses it on the host, and the kernel flags it on a GPU); valid entries are unchanged."""
    layer, md, q, positions = _batch(5, *CASES["v41_nvfp4_ratio2"][:5])
    swa_md, cmp_md = md["layers.0.attn.swa"], md["layers.0.attn"]
    before = csa2_attention.pool_lists(layer, positions, swa_md, cmp_md, check=False)
    layer.topk_indices_buffer[0, 0] = 10_000
    after = csa2_attention.pool_lists(layer, positions, swa_md, cmp_md, check=False)
    assert int(after[0][2][0, 0]) == csa2_attention.lists.BAD_SLOT
    assert torch.equal(after[0][2][0, 1:], before[0][2][0, 1:])
    with pytest.raises(_lib.Csa2Error, match="outside the pool"):
        layer.topk_indices_buffer[0, 0] = 10_000
        out = torch.zeros_like(q)
        lo, hi, mi, ml, si, sl = after[0]
        _lib.attention_pools(q[lo:hi].contiguous(), layer.kv_cache, mi, ml,
                             layer.swa_cache_layer.kv_cache, si, sl,
                             layer.attn_sink[:HEADS].float().contiguous(), HEADS, 0.0, out[lo:hi])


def test_portable_e2m1_packer_matches_the_rule():
    """csa2_vllm.writers.fp32x2_to_fp4x2 (the SM90-capable stand-in for vLLM's SM100-only PTX
    packer) against the E2M1 rule of docs/SPEC.md §1 on every tie, both signs, ±0, saturation and
    NaN: round to nearest, ties to even, |x| > 6 → 6, the sign kept on values rounding to zero."""
    from vllm.triton_utils import tl, triton

    @triton.jit
    def pack(lo, hi, out, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out + i, writers.fp32x2_to_fp4x2(tl.load(lo + i), tl.load(hi + i)))

    mags = [0.0, 0.1, 0.25, 0.26, 0.5, 0.75, 0.76, 1.0, 1.25, 1.3, 1.5, 1.75, 2.0, 2.5, 2.6, 3.0,
            3.5, 3.6, 4.0, 5.0, 5.1, 6.0, 7.0, 1e9, float("inf")]
    vals = [s * m for m in mags for s in (1.0, -1.0)] + [float("nan")] * 2
    vals += [0.0] * (64 - len(vals))
    x = torch.tensor(vals, dtype=torch.float32)
    lo, hi = x.clone(), x.flip(0).contiguous()
    out = torch.empty(64, dtype=torch.uint8)
    pack[(1,)](lo, hi, out, N=64)

    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    def code(v: float) -> int:
        if v != v:
            return 0x7
        a = min(abs(v), 6.0)
        best = min(range(8), key=lambda c: (abs(grid[c] - a), c % 2))  # ties to the even code
        sign = 8 if (v < 0 or (v == 0 and str(v).startswith("-"))) else 0
        return best | sign

    want = [code(float(a)) | (code(float(b)) << 4) for a, b in zip(lo, hi)]
    assert out.tolist() == want
