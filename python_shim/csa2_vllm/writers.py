"""Device writers for the V4.1 records on GPUs where vLLM 0.33's own writers cannot run.

What vLLM 0.33 uses to fill the three records of csa2's 890 B/token layout (docs/VLLM.md,
"Writers of the V4.1 records"):

- the 288-B NVFP4 compressed record: ``_rope_quant_insert_nvfp4_kernel``
  (``models/deepseek_v41/common/ops/fused_compress_quant_cache.py``), reached through
  ``rope_quant_insert`` from ``DeepseekCompressor.insert_cache``;
- the 68-B MXFP4 index K: ``_indexer_k_norm_rope_quant_store_kernel`` with ``USE_FP4``
  (``models/deepseek_v41/common/ops/indexer_k_store.py``), from the indexer's ``_produce_k``;
- the 528-B MXFP8 SWA record: the compiled CUDA op
  ``torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(..., kv_mxfp8=True)``.

The first two pack their E2M1 pairs with ``_fp32x2_to_fp4x2``
(``models/deepseek_v4/common/ops/fused_indexer_q.py``), inline PTX
``cvt.rn.satfinite.e2m1x2.f32``, which only SM100-family GPUs have; everything else in them is
plain Triton that SM90 runs (``tl.float8e4nv`` needs SM89+). So this module supplies:

- :func:`fp32x2_to_fp4x2`, a portable E2M1 pair encoder (comparisons only);
- :func:`nvfp4_insert`, our own writer of the 288-B record (same contract as ``rope_quant_insert``
  for a 288-B pool), used by csa2's layer on SM90 (``csa2_vllm.attention``);
- :func:`mxfp4_index_k_store`, our own writer of the 68-B index K (same contract as
  ``indexer_k_norm_rope_store(use_fp4_cache=True)``).

Encode rules: docs/SPEC.md §1 — NVFP4 ``s = E4M3(clamp(amax/6, 2^-9, 448))``, ``q = E2M1(x/s)``
with correctly rounded divisions; MXFP4 ``e = clamp(ceil(log2(max(amax, 6·2^-126)/6)), −127,
127)`` with ``ceil(log2)`` taken exactly from the float bits, ``q = E2M1(x·2^-e)``; E2M1 round to
nearest, ties to the even code, saturating at 6, NaN → +6, the sign of values rounding to zero
kept. Inputs are the bf16-rounded RoPE'd values. Where vLLM's arithmetic differs — ``amax·(1/6)``
instead of ``amax/6``, a float ``log2``, and for NVFP4 f32 (not bf16) RoPE outputs — the bytes
can differ; python_shim/tests_interpreted/test_sm90_writers.py shows where they agree bit for
bit (every NoPE tile, and RoPE tiles whose rotated values are bf16-exact) and that ours follow
the rule exactly (against csa2's own encoder).

The Triton interpreter (CPU tests) cannot run inline PTX at all, so the CPU tests run vLLM's
writers with :func:`install`, which points their ``_fp32x2_to_fp4x2`` at ours.
"""

from __future__ import annotations

try:  # vLLM's view of Triton (placeholders where vLLM keeps Triton off)
    from vllm.triton_utils import tl, triton
except ImportError:  # a GPU check machine with torch and Triton but no vLLM
    import triton
    import triton.language as tl

from . import _lib

# ---- scalar codes -------------------------------------------------------------------------------


@triton.jit
def _e2m1_code(x):
    """E2M1 code (sign in bit 3) of f32 ``x``: RNE with the thresholds of the 8 magnitudes."""
    a = tl.abs(x)
    c = tl.where(a <= 0.25, 0, tl.where(a < 0.75, 1, tl.where(a <= 1.25, 2, tl.where(
        a < 1.75, 3, tl.where(a <= 2.5, 4, tl.where(a < 3.5, 5, tl.where(a <= 5.0, 6, 7)))))))
    sign = (x.to(tl.uint32, bitcast=True) >> 31) & 1
    nan = x != x
    return tl.where(nan, 7, c | (sign << 3).to(tl.int32))


@triton.jit
def fp32x2_to_fp4x2(x_lo, x_hi):
    """Two E2M1 codes in one byte: ``x_lo`` (even element) low nibble, ``x_hi`` high nibble —
    the contract of vLLM's ``_fp32x2_to_fp4x2``, without SM100 instructions."""
    return (_e2m1_code(x_lo) | (_e2m1_code(x_hi) << 4)).to(tl.uint8)


@triton.jit
def _ceil_log2(v):
    """``ceil(log2(v))`` of a positive normal f32, exactly, from its bits (docs/SPEC.md §1: the
    unbiased exponent, +1 when the mantissa is not zero). A float ``log2`` can land on an integer
    for a value just above a power of two and so lose the +1."""
    bits = v.to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _bf16_rne(x):
    """f32 ``x`` rounded to the nearest bf16 (ties to even), kept as f32; finite inputs. (Not
    ``.to(tl.bfloat16)``: Triton's interpreter truncates; a GPU's cvt rounds to nearest.)"""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_scale_code(v):
    """E4M3 code of a positive f32 ``v`` in [2^-9, 448], round to nearest, ties to even, from
    the bits. (Not ``.to(tl.float8e4nv)``: Triton's interpreter rounds ties up and loses the
    carry when the mantissa rounds over, e.g. 0.0309 → 2^-6 instead of 2^-5; a GPU's cvt is
    right, but one exact encoder serves both.)"""
    bits = v.to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    m = (bits & 0x7FFFFF).to(tl.int32)
    # Normal range (e ≥ −6): keep 3 mantissa bits; a round-over carries into the exponent.
    rest = m & 0xFFFFF
    q = (m >> 20) + ((rest > 0x80000) | ((rest == 0x80000) & (((m >> 20) & 1) == 1))).to(tl.int32)
    normal = ((e + 7) << 3) + q
    # Subnormal range: v / 2^-9 in [1, 8), rounded to the nearest integer, ties to even.
    y = v * 512.0
    n = tl.floor(y)
    f = y - n
    ni = n.to(tl.int32)
    sub = ni + ((f > 0.5) | ((f == 0.5) & ((ni & 1) == 1))).to(tl.int32)
    return tl.minimum(tl.where(e >= -6, normal, sub), 0x7E)


@triton.jit
def _e4m3_value(code):
    """The f32 value of a positive E4M3 code (< 0x7F)."""
    e = code >> 3
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.uint32).to(tl.float32, bitcast=True)
    return tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)


@triton.jit
def nvfp4_tiles(x):
    """NVFP4-DS of ``x`` (32, 16) f32 → (packed (32, 8) uint8, E4M3 scale codes (32,) uint8)."""
    amax = tl.max(tl.abs(x), 1)
    # 2^-9 is the smallest E4M3 magnitude the rule allows, 448 the largest; both divisions are
    # the correctly rounded ones (Triton's default f32 divide on a GPU is approximate).
    ratio = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    code = _e4m3_scale_code(tl.minimum(tl.maximum(ratio, 0.001953125), 448.0))
    s = tl.reshape(_e4m3_value(code), (32, 1))
    q = tl.math.div_rn(x, tl.broadcast_to(s, (32, 16)))
    lo, hi = tl.split(tl.reshape(q, (32, 8, 2)))
    return fp32x2_to_fp4x2(lo, hi), code.to(tl.uint8)


@triton.jit
def mxfp4_blocks(even, odd, N: tl.constexpr):
    """MXFP4 of ``N`` blocks of 32 values given as their even and odd halves (N, 16) f32 →
    (packed (N, 16) uint8, E8M0 scale codes (N,) uint8)."""
    amax = tl.maximum(tl.max(tl.abs(even), 1), tl.max(tl.abs(odd), 1))
    amax = tl.maximum(amax, 6.0 * 2.0 ** -126)
    ratio = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    e = tl.minimum(tl.maximum(_ceil_log2(ratio), -127), 127)
    # 2^-e from its exponent bits (exact; no exp2 approximation on a GPU). 2^-127 is subnormal,
    # so e = 127 multiplies by 2^-126 and then by 1/2: both steps exact for these magnitudes.
    inv = ((127 - tl.minimum(e, 126)) << 23).to(tl.uint32).to(tl.float32, bitcast=True)
    inv = tl.reshape(inv, (N, 1))
    half = tl.reshape(tl.where(e == 127, 0.5, 1.0), (N, 1))
    return (fp32x2_to_fp4x2(even * inv * half, odd * inv * half), (e + 127).to(tl.uint8))


# ---- writers ------------------------------------------------------------------------------------


@triton.jit
def _gptj_rope(even, odd, row, FIRST_PAIR: tl.constexpr, PAIRS: tl.constexpr,
               HALF: tl.constexpr):
    """GPT-J RoPE of the pairs ``FIRST_PAIR..PAIRS`` (the others untouched) with the cos half
    then the sin half of the row at ``row``; returns the rotated (even, odd) f32."""
    k = tl.arange(0, PAIRS) - FIRST_PAIR
    rot = k >= 0
    c = tl.load(row + tl.maximum(k, 0), mask=rot, other=1.0).to(tl.float32)
    s = tl.load(row + HALF + tl.maximum(k, 0), mask=rot, other=0.0).to(tl.float32)
    return even * c - odd * s, odd * c + even * s


@triton.jit(do_not_specialize=["page_stride"])
def _nvfp4_insert_kernel(latent, positions, cos_sin, cache, slots, cos_stride, page_stride,
                         STATES: tl.constexpr, RATIO: tl.constexpr, DATA: tl.constexpr,
                         SCALE: tl.constexpr, REC: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    position = tl.load(positions + t)
    # A compressed entry is published by the last token of its group; −1 = no slot.
    if (slot >= 0) & ((position + 1) % RATIO == 0):
        x = tl.load(latent + t.to(tl.int64) * 512 + tl.arange(0, 512)).to(tl.float32)
        even, odd = tl.split(tl.reshape(x, (256, 2)))
        # The entry stands for its group's first token: RoPE at that position, dims 448..511.
        row = cos_sin + (position - position % RATIO) * cos_stride
        even, odd = _gptj_rope(even, odd, row, 224, 256, 32)
        # docs/SPEC.md §1: the record encodes the bf16-rounded RoPE'd values.
        y = _bf16_rne(tl.interleave(even, odd))
        packed, scales = nvfp4_tiles(tl.reshape(y, (32, 16)))
        # Interleaved page: each state's data bytes, then its own scale bytes (widths from the
        # library's record table).
        rec = cache + (slot // STATES).to(tl.int64) * page_stride + (slot % STATES) * REC
        tl.store(rec + tl.arange(0, DATA), tl.reshape(packed, (DATA,)))
        tl.store(rec + DATA + tl.arange(0, SCALE), scales)


def _check_pool(cache, width: int, what: str) -> None:
    import torch

    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != width:
        raise ValueError(f"{what}: expected a uint8 [blocks, states, {width}] pool, got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    if cache.stride(2) != 1 or cache.stride(1) != width:
        raise ValueError(f"{what}: records must be packed rows of the page (strides "
                         f"{cache.stride()})")


def nvfp4_insert(latent, positions, cos_sin_cache, kv_cache, slot_mapping, compress_ratio: int
                 ) -> None:
    """Publishes compressed entries as 288-B NVFP4 records (interleaved: 256 B E2M1 pairs, then
    32 E4M3 scales) into a strided pool view.

    ``latent`` bf16 (N, 512) contiguous, the normed compressor output; ``positions`` int64 (≥ T);
    ``cos_sin_cache`` (max_pos, 64) f32/bf16, the cos half then the sin half (GPT-J, the
    compress-RoPE table); ``kv_cache`` uint8 (blocks, states, 288) whose ``stride(0)`` is vLLM's
    block slab stride; ``slot_mapping`` int64 (T,), −1 = skip; ``compress_ratio`` 1 or 2 (only the
    group's last token writes, RoPE at the group's first position). Same contract as vLLM's
    ``rope_quant_insert`` for a 288-B pool. Raises ``ValueError`` on a bad shape or dtype, writing
    nothing."""
    import torch

    fmt = _lib.record_format_named("nvfp4")
    _check_pool(kv_cache, fmt.record_bytes, "NVFP4 compressed cache")
    t = slot_mapping.numel()
    if compress_ratio not in (1, 2):
        raise ValueError(f"compress_ratio must be 1 or 2, got {compress_ratio}")
    if latent.dtype != torch.bfloat16 or latent.dim() != 2 or latent.shape[1] != 512 \
            or not latent.is_contiguous():
        raise ValueError(f"latent: expected contiguous bf16 (N, 512), got {latent.dtype} "
                         f"{tuple(latent.shape)}")
    if t > latent.shape[0] or t > positions.numel():
        raise ValueError(f"{t} slots but {latent.shape[0]} latent rows and {positions.numel()} "
                         "positions")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != 64 or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache: expected (max_pos, 64) with unit inner stride, got "
                         f"{tuple(cos_sin_cache.shape)}")
    if t == 0:
        return
    _nvfp4_insert_kernel[(t,)](latent, positions, cos_sin_cache, kv_cache, slot_mapping,
                               cos_sin_cache.stride(0), kv_cache.stride(0),
                               STATES=kv_cache.shape[1], RATIO=compress_ratio,
                               DATA=fmt.data_bytes, SCALE=fmt.scale_bytes, REC=fmt.record_bytes,
                               num_warps=4)


@triton.jit(do_not_specialize=["page_stride", "eps"])
def _mxfp4_index_k_kernel(k_pre, k_stride, positions, norm_w, eps, cos_sin, cos_stride, cache,
                          slots, page_stride, STATES: tl.constexpr, RATIO: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    position = tl.load(positions + t)
    if (slot >= 0) & ((position + 1) % RATIO == 0):
        d = tl.arange(0, 128)
        k = tl.load(k_pre + t.to(tl.int64) * k_stride + d).to(tl.float32)
        w = tl.load(norm_w + d).to(tl.float32)
        # k_norm in f32, rounded to bf16 (the model's activation dtype).
        k = _bf16_rne(k * tl.rsqrt(tl.sum(k * k, 0) / 128 + eps) * w)
        even, odd = tl.split(tl.reshape(k, (64, 2)))
        row = cos_sin + (position - position % RATIO) * cos_stride
        even, odd = _gptj_rope(even, odd, row, 32, 64, 32)  # dims 64..127
        even = _bf16_rne(even)
        odd = _bf16_rne(odd)
        packed, scales = mxfp4_blocks(tl.reshape(even, (4, 16)), tl.reshape(odd, (4, 16)), 4)
        # Block-planar page: every state's 64 data bytes, then every state's 4 scale bytes.
        page = cache + (slot // STATES).to(tl.int64) * page_stride
        tl.store(page + (slot % STATES) * 64 + tl.arange(0, 64), tl.reshape(packed, (64,)))
        tl.store(page + STATES * 64 + (slot % STATES) * 4 + tl.arange(0, 4), scales)


def mxfp4_index_k_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps: float,
                        k_cache, slot_mapping, compress_ratio: int) -> None:
    """Publishes index keys as 68-B MXFP4 records into a block-planar indexer page (64 B E2M1
    pairs of every state, then 4 E8M0 scales of every state).

    ``k_pre`` bf16 (N, 128) with unit inner stride, ``wk(latent)``; ``positions`` int64;
    ``cos_sin_cache`` (max_pos, 64) cos half then sin half; ``rms_norm_weight`` (128,) k_norm;
    ``k_cache`` uint8 (blocks, states, 68) whose ``stride(0)`` is the slab stride (the page is
    ``states · 68`` contiguous bytes from the view's start); ``slot_mapping`` int64 (T,), −1 =
    skip; ``compress_ratio`` 1 or 2. Same contract as vLLM's
    ``indexer_k_norm_rope_store(..., use_fp4_cache=True)``."""
    import torch

    rec = _lib.record_format_named("mxfp4").record_bytes
    if k_cache.dtype != torch.uint8 or k_cache.dim() != 3 or k_cache.shape[2] != rec:
        raise ValueError(f"index K cache: expected a uint8 [blocks, states, {rec}] pool, got "
                         f"{k_cache.dtype} {tuple(k_cache.shape)}")
    if k_cache.stride(2) != 1 or k_cache.stride(1) != rec:
        raise ValueError(f"index K cache: the page must be contiguous (strides "
                         f"{k_cache.stride()})")
    if k_pre.dtype != torch.bfloat16 or k_pre.dim() != 2 or k_pre.shape[1] != 128 \
            or k_pre.stride(1) != 1:
        raise ValueError(f"k_pre: expected bf16 (N, 128) with unit inner stride, got "
                         f"{k_pre.dtype} {tuple(k_pre.shape)}")
    if compress_ratio not in (1, 2):
        raise ValueError(f"compress_ratio must be 1 or 2, got {compress_ratio}")
    t = slot_mapping.numel()
    if t > k_pre.shape[0] or t > positions.numel():
        raise ValueError(f"{t} slots but {k_pre.shape[0]} key rows and {positions.numel()} "
                         "positions")
    if t == 0:
        return
    _mxfp4_index_k_kernel[(t,)](k_pre, k_pre.stride(0), positions, rms_norm_weight,
                                float(rms_norm_eps), cos_sin_cache, cos_sin_cache.stride(0),
                                k_cache, slot_mapping, k_cache.stride(0),
                                STATES=k_cache.shape[1], RATIO=compress_ratio, num_warps=1)


def install() -> None:
    """Points vLLM's own E2M1 pair packer at :func:`fp32x2_to_fp4x2` in every module that binds
    it (the NVFP4 record writer, the MXFP4 index-K writer, the MXFP4 indexer Q quantiser), so
    that those kernels run in Triton's interpreter. For CPU tests; the layer uses this module's
    writers instead. Call before their first launch (Triton binds globals when it compiles a
    kernel). Idempotent."""
    import importlib

    for name in ("vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache",
                 "vllm.models.deepseek_v4.common.ops.fused_indexer_q",
                 "vllm.models.deepseek_v41.common.ops",
                 "vllm.models.deepseek_v41.common.ops.indexer_k_store",
                 "vllm.models.deepseek_v41.nvidia.specialized_decode.attention.indexer_k_store"):
        try:
            mod = importlib.import_module(name)
        except ImportError:  # an optional module this build of vLLM cannot import
            continue
        if hasattr(mod, "_fp32x2_to_fp4x2"):
            mod._fp32x2_to_fp4x2 = fp32x2_to_fp4x2
