"""Device writers csa2 supplies where vLLM 0.33's own need SM100.

vLLM's V4.1 NVFP4 record writer (``_rope_quant_insert_nvfp4_kernel`` in
``models/deepseek_v41/common/ops/fused_compress_quant_cache.py``) packs its E2M1 pairs with
``_fp32x2_to_fp4x2`` (``models/deepseek_v4/common/ops/fused_indexer_q.py``), an inline PTX
``cvt.rn.satfinite.e2m1x2.f32`` that only SM100-family GPUs have; the same helper quantises the
MXFP4 index K (``_quantize_mxfp4_pair``). Everything else in those writers is plain Triton
(float8e4nv casts, exp2/log2, loads and stores), which SM90 runs. So on Hopper the 288-B NVFP4
compressed record and the MXFP4 index K need only a portable E2M1 pair encoder:
:func:`fp32x2_to_fp4x2` computes the same codes from comparisons (round to nearest, ties to even
on {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at 6, the sign of −0 and of values rounding to zero
kept, NaN → 0x7 as csa2's codec, docs/SPEC.md §1) and :func:`install` swaps it in for vLLM's.
The Triton interpreter (CPU tests) cannot run inline PTX at all, so the CPU tests use it too.
"""

from __future__ import annotations

from vllm.triton_utils import tl, triton


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


def install() -> None:
    """Makes vLLM's NVFP4 record writer (and the MXFP4 index-K quantiser) use
    :func:`fp32x2_to_fp4x2`. Call before their first launch (Triton binds globals when it compiles
    a kernel). Idempotent."""
    import importlib

    for name in ("vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache",
                 "vllm.models.deepseek_v4.common.ops.fused_indexer_q"):
        mod = importlib.import_module(name)
        if hasattr(mod, "_fp32x2_to_fp4x2"):
            mod._fp32x2_to_fp4x2 = fp32x2_to_fp4x2
