"""csa2's portable writers of the V4.1 records (csa2_vllm.writers), in Triton's interpreter:
bit-exact to docs/SPEC.md §1's encode rules (checked against csa2's own encoder, the library's
``csa2_encode_rows``) and to vLLM 0.33's writers where both run (vLLM's kernels with their
SM100-only E2M1 packer pointed at the portable one, ``writers.install()``).

The pools are strided views into padded per-block slabs (vLLM's layout, test_pools.py), bytes no
writer touched hold 0xFF, so a write to the wrong place shows up.
"""

from __future__ import annotations

import math

import pytest
import torch

from csa2_vllm import _lib, writers
from vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache import rope_quant_insert
from vllm.models.deepseek_v41.common.ops.indexer_k_store import indexer_k_norm_rope_store
from vllm.triton_utils import tl, triton

from test_pools import _slab



def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


# ---- the quantisers against the docs/SPEC.md §1 rule ----------------------------------------

@triton.jit
def _nvfp4_probe(x, data, scales):
    r = tl.arange(0, 32)[:, None] * 16 + tl.arange(0, 16)[None, :]
    packed, s = writers.nvfp4_tiles(tl.load(x + r))
    tl.store(data + tl.arange(0, 32)[:, None] * 8 + tl.arange(0, 8)[None, :], packed)
    tl.store(scales + tl.arange(0, 32), s)


@triton.jit
def _mxfp4_probe(x, data, scales):
    i = tl.arange(0, 4)[:, None] * 32 + tl.arange(0, 16)[None, :] * 2
    packed, s = writers.mxfp4_blocks(tl.load(x + i), tl.load(x + i + 1), 4)
    tl.store(data + tl.arange(0, 4)[:, None] * 16 + tl.arange(0, 16)[None, :], packed)
    tl.store(scales + tl.arange(0, 4), s)


def _edge_rows(g, dim: int, block: int, top: float) -> torch.Tensor:
    """Rows of bf16-exact values that hit the rule's edges: blocks whose amax makes the scale 1
    (so the values themselves sit on every E2M1 tie), ±0, saturation past the grid, tiny and huge
    blocks (scale clamps), and random blocks."""
    ties = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    rows = []
    for sign in (1.0, -1.0):
        r = torch.tensor((ties * ((dim // len(ties)) + 1))[:dim]) * sign
        r[::block] = top * sign  # each block's amax → scale exactly 1
        rows.append(r)
    rows.append(torch.tensor([-0.0, 0.0] * (dim // 2)))
    rows.append(torch.full((dim,), -1e-30))  # rounds to −0 in every block, scale at its floor
    rows.append(torch.full((dim,), 3e38 / 2**8))  # the scale at its ceiling (NVFP4 448)
    for k in (-3, 0, 5):
        rows.append(torch.randn(dim, generator=g) * 2.0 ** k)
    # amax/6 vs amax·(1/6): magnitudes where the two differ in the last bit
    rows.append(torch.randn(dim, generator=g).sign() * torch.tensor(
        [1.0 + j * 2 ** -7 for j in range(dim)]) * 6 * 2.0 ** 3)
    return _bf16(torch.stack(rows))


def test_nvfp4_tiles_follow_the_spec_rule():
    g = torch.Generator().manual_seed(1)
    x = _edge_rows(g, 512, 16, 6.0)
    for row in x:
        data = torch.empty(256, dtype=torch.uint8)
        scales = torch.empty(32, dtype=torch.uint8)
        _nvfp4_probe[(1,)](row.contiguous(), data, scales)
        want = torch.from_numpy(_lib.encode_rows(_lib.FORMAT_NVFP4, row[None]))[0]
        assert torch.equal(torch.cat([data, scales]), want), row[:16]


def test_mxfp4_blocks_follow_the_spec_rule():
    g = torch.Generator().manual_seed(2)
    x = _edge_rows(g, 128, 32, 6.0)
    for row in x:
        data = torch.empty(64, dtype=torch.uint8)
        scales = torch.empty(4, dtype=torch.uint8)
        _mxfp4_probe[(1,)](row.contiguous(), data, scales)
        want = torch.from_numpy(_lib.encode_rows(_lib.FORMAT_MXFP4, row[None]))[0]
        assert torch.equal(torch.cat([data, scales]), want), row[:16]


# ---- the writers against vLLM's and against the rule ---------------------------------------------

def _cos_sin(g, n: int, exact: bool) -> torch.Tensor:
    """A (n, 64) GPT-J table (cos half, sin half). ``exact``: entries in {0, ±1} (quarter turns),
    so every rotated value is a bf16 latent value — vLLM's f32 RoPE output and the rule's
    bf16-rounded one coincide."""
    if exact:
        turn = torch.randint(0, 4, (n, 32), generator=g)
        c = torch.tensor([1.0, 0.0, -1.0, 0.0])[turn]
        s = torch.tensor([0.0, 1.0, 0.0, -1.0])[turn]
        return torch.cat([c, s], 1).contiguous()
    ang = torch.rand(n, 32, generator=g, dtype=torch.float64) * 2 * math.pi
    return torch.cat([ang.cos(), ang.sin()], 1).float().contiguous()


def _rope_rows(x: torch.Tensor, cs: torch.Tensor, first_pair: int) -> torch.Tensor:
    """GPT-J RoPE of pairs ``first_pair..`` of f32 rows ``x`` with per-row tables ``cs``, in f32
    with the same operations as the kernels; then rounded to bf16 (the rule's inputs)."""
    even, odd = x[:, 0::2].clone(), x[:, 1::2].clone()
    n = even.shape[1] - first_pair
    c, s = cs[:, :n], cs[:, 32:32 + n]
    e, o = even[:, first_pair:], odd[:, first_pair:]
    even[:, first_pair:], odd[:, first_pair:] = e * c - o * s, o * c + e * s
    return _bf16(torch.stack([even, odd], 2).reshape(x.shape))


def _compressed_batch(g, n: int, states: int, blocks: int):
    """Latent rows whose every 16-dim tile has its amax at 6·s for an E4M3 value s, so that the
    scale is exact whichever way amax/6 is computed and no E4M3 rounding happens: Triton's
    interpreter converts f32 to E4M3 with ties up and a lost carry (writers._e4m3_scale_code),
    which would make vLLM's writer differ from its GPU self, not from ours."""
    tiles = n * 32
    s = (1 + torch.randint(0, 8, (tiles,), generator=g) / 8) * 2.0 ** torch.randint(
        -4, 2, (tiles,), generator=g)
    x = (torch.rand(tiles, 16, generator=g) * 2 - 1) * 6 * s[:, None] * 0.99
    top = torch.randint(0, 16, (tiles,), generator=g)
    x[torch.arange(tiles), top] = 6 * s * torch.randint(0, 2, (tiles,), generator=g) * 2 - 6 * s
    latent = x.reshape(n, 512).to(torch.bfloat16)
    latent[3] = 0  # an all-zero entry: scales at their floor, codes 0
    positions = torch.randint(0, 4000, (n,), generator=g, dtype=torch.int64)
    slots = torch.randperm(blocks * states, generator=g)[:n].to(torch.int64)
    slots[5] = -1  # no slot: nothing written
    return latent, positions, slots


@pytest.mark.parametrize("ratio", [1, 2])
def test_nvfp4_insert_equals_vllms_writer_and_the_rule(ratio):
    g = torch.Generator().manual_seed(10 + ratio)
    writers.install()
    blocks, states, n = 4, 64, 40
    latent, positions, slots = _compressed_batch(g, n, states, blocks)
    for exact in (True, False):
        cs = _cos_sin(g, 4096, exact)
        _, (ours,) = _slab(blocks, [(states, 288)], g)
        _, (theirs,) = _slab(blocks, [(states, 288)], g)
        writers.nvfp4_insert(latent, positions, cs, ours, slots, ratio)
        rope_quant_insert(latent, positions, cs, theirs, slots, ratio)
        writes = (slots >= 0) & ((positions + 1) % ratio == 0)
        assert 0 < int(writes.sum()) < n
        flat_o, flat_t = ours.reshape(-1, 288), theirs.reshape(-1, 288)
        untouched = torch.ones(blocks * states, dtype=torch.bool)
        untouched[slots[writes]] = False
        assert bool((flat_o[untouched] == 0xFF).all())  # nothing else in the slab was written
        if exact:  # vLLM's f32 RoPE outputs are bf16 values here: whole records identical
            assert torch.equal(ours, theirs)
        else:  # the NoPE tiles (dims 0..447: 224 data bytes, 28 scales) always coincide
            w = slots[writes]
            assert torch.equal(flat_o[w, :224], flat_t[w, :224])
            assert torch.equal(flat_o[w, 256:284], flat_t[w, 256:284])
        # ... and every record is the rule's encoding of the bf16-rounded RoPE'd latent
        w = slots[writes]
        first = positions[writes] - positions[writes] % ratio
        y = _rope_rows(latent[writes].float(), cs[first], 224)
        want = torch.from_numpy(_lib.encode_rows(_lib.FORMAT_NVFP4, y))
        assert torch.equal(flat_o[w], want)


def _index_pages(view, slots, states):
    """The 68-B records of ``slots`` read out of block-planar index-K pages (state j's 64 data
    bytes at j·64, its 4 scales at states·64 + j·4)."""
    page = view.reshape(view.shape[0], -1)
    out = []
    for slot in slots.tolist():
        p, j = page[slot // states], slot % states
        out.append(torch.cat([p[j * 64:j * 64 + 64], p[states * 64 + j * 4:states * 64 + j * 4 + 4]]))
    return torch.stack(out)


@pytest.mark.parametrize("ratio", [1, 2])
def test_mxfp4_index_k_store_equals_vllms_writer_and_the_rule(ratio):
    g = torch.Generator().manual_seed(20 + ratio)
    writers.install()
    blocks, states, n = 3, 64, 40
    positions = torch.randint(0, 4000, (n,), generator=g, dtype=torch.int64)
    slots = torch.randperm(blocks * states, generator=g)[:n].to(torch.int64)
    slots[7] = -1
    writes = (slots >= 0) & ((positions + 1) % ratio == 0)
    assert 0 < int(writes.sum()) < n
    pages = [(32, 528), (states, 68), (states, 288)]  # the index-K page between two others

    # 1. vLLM's writer, on keys whose pipeline is exact in bf16: rows of ±2^k (RMS 2^k, eps 0:
    # the norm gives ±w exactly) and quarter-turn RoPE. Triton's interpreter truncates f32 →
    # bf16 where a GPU rounds (writers._bf16_rne), so only such keys compare vLLM's kernel as a
    # GPU runs it with ours; the pages must then agree byte for byte, untouched bytes included.
    sign = torch.randint(0, 2, (n, 128), generator=g) * 2 - 1
    k_pre = (sign * 2.0 ** torch.randint(-3, 4, (n, 1), generator=g)).to(torch.bfloat16)
    w = (torch.randn(128, generator=g) * 2).to(torch.bfloat16)
    cs = _cos_sin(g, 4096, True)
    _, (_, ours, _) = _slab(blocks, pages, g)
    _, (_, theirs, _) = _slab(blocks, pages, g)
    writers.mxfp4_index_k_store(k_pre, positions, cs, w, 0.0, ours, slots, ratio)
    indexer_k_norm_rope_store(k_pre, positions, cs, w, 0.0, theirs, slots, ratio, True)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, torch.full_like(ours, 0xFF))

    # 2. The rule on arbitrary keys: each record is the MXFP4 encoding (csa2's encoder) of the
    # bf16-rounded RMSNorm'd, RoPE'd key.
    k_pre = (torch.randn(n, 128, generator=g) * 3).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    cs = _cos_sin(g, 4096, False)
    _, (_, ours, _) = _slab(blocks, pages, g)
    writers.mxfp4_index_k_store(k_pre, positions, cs, w, 1e-6, ours, slots, ratio)
    k = k_pre[writes].float()
    # 1/sqrt as the interpreter's rsqrt (numpy) computes it, in f32
    k = _bf16(k * (1 / torch.sqrt((k * k).sum(1, keepdim=True) / 128 + 1e-6)) * w.float())
    first = positions[writes] - positions[writes] % ratio
    want = torch.from_numpy(_lib.encode_rows(_lib.FORMAT_MXFP4, _rope_rows(k, cs[first], 32)))
    got = _index_pages(ours, slots[writes], states)
    assert torch.equal(got, want)
    untouched = torch.ones(blocks * states, dtype=torch.bool)
    untouched[slots[writes]] = False
    assert bool((_index_pages(ours, torch.nonzero(untouched)[:, 0], states) == 0xFF).all())


def test_writers_refuse_bad_pools_and_write_nothing():
    g = torch.Generator().manual_seed(3)
    _, (pool,) = _slab(2, [(64, 288)], g)
    before = pool.clone()
    latent = torch.zeros(2, 512, dtype=torch.bfloat16)
    pos = torch.tensor([1, 3])
    slots = torch.tensor([0, 1])
    cs = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="288"):
        writers.nvfp4_insert(latent, pos, cs, pool[:, :, :200], slots, 2)
    with pytest.raises(ValueError, match="compress_ratio"):
        writers.nvfp4_insert(latent, pos, cs, pool, slots, 4)
    with pytest.raises(ValueError, match="latent"):
        writers.nvfp4_insert(latent.float(), pos, cs, pool, slots, 2)
    with pytest.raises(ValueError, match="packed rows"):
        writers.nvfp4_insert(latent, pos, cs, pool.as_strided((2, 32, 288), (pool.stride(0), 576, 1)),
                             slots, 2)
    with pytest.raises(ValueError, match="68"):
        writers.mxfp4_index_k_store(torch.zeros(2, 128, dtype=torch.bfloat16), pos, cs,
                                    torch.ones(128), 1e-6, pool, slots, 2)
    assert torch.equal(pool, before)
