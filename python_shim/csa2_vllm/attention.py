"""The csa2 DeepSeek-V4.1 attention layer class (what ``_select_dsv4_attn_cls`` returns when
``CSA2_RS`` is selected).

It keeps everything of vLLM's FlashMLA V4.1 layer that is not the attention kernel — projections,
Q norm/RoPE, KV insertion into the paged caches, indexer, output projection — and replaces the sparse
attention over (top-k compressed entries ∪ SWA window, one softmax with the sink) by csa2's op
through the C ABI.

STATUS (what runs where): constructing the layer checks that the library exports
``csa2_attention`` (else :class:`csa2_vllm._lib.Csa2Error` at model build time, never mid-serving).
The sparse attention kernel itself has a csa2 counterpart, :func:`csa2_sparse_fwd` (the contract of
vLLM's ``flash_mla_sparse_fwd``: gathered KV, per-token index lists with lengths, sink), run through
``csa2_attention`` on host tensors and tested against a float64 evaluation in
``tests/test_parity.py``. ``forward_mqa`` itself is still vLLM's FlashMLA path (paged-cache gather,
CUDA kernels): routing it to csa2 needs the ``cuda`` build of the library and a GPU to test on.
"""

from __future__ import annotations

from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

from . import _lib
from .backend import Csa2SparseMLABackend

REQUIRED_SYMBOLS = ("csa2_attention",)


def csa2_sparse_fwd(q, kv, indices, topk_length, sm_scale: float, attn_sink, out) -> None:
    """Sparse attention with a sink over gathered KV, through ``csa2_attention`` (host tensors).

    The contract of vLLM's ``flash_mla_sparse_fwd``: ``q`` ``(T, H, 512)``, ``kv`` ``(M, 512)`` or
    ``(M, 1, 512)`` (the gathered, dequantised compressed entries and SWA rows), ``indices``
    ``(T, K)`` or ``(T, 1, K)`` int32 rows of ``kv`` (−1 = none), ``topk_length`` ``(T,)`` int32 valid
    length per row (None = all K), ``attn_sink`` ``(H,)``, output into ``out`` ``(T, H, 512)``;
    bfloat16/float16/float32 accepted. Mapping onto csa2's op: the gathered rows are csa2's main KV
    and the index lists its top-k; the SWA part is made empty by a window floor past every position
    (``positions = 0``, ``replay_start = 1``), since vLLM already folded the window into the lists.
    """
    import torch

    t, h = q.shape[0], q.shape[1]
    kv2 = kv.reshape(-1, kv.shape[-1])
    idx = indices.reshape(t, -1).to(torch.int32).contiguous()
    lens = None if topk_length is None else topk_length.to(torch.int32).contiguous()
    lse = torch.empty(t, h, dtype=torch.float32)
    _lib.attention(
        q.contiguous(), kv2.contiguous(), torch.zeros(0, kv2.shape[-1], dtype=kv2.dtype), idx,
        torch.zeros(t, dtype=torch.int64), attn_sink.float().contiguous(), out, lse,
        topk_len=lens, replay_start=torch.ones(1, dtype=torch.int64), window=1,
        scale=float(sm_scale))


class Csa2DeepseekV4Attention(DeepseekV4FlashMLAAttention):
    """DeepSeek-V4.1 attention layer whose sparse attention runs in csa2."""

    backend_cls = Csa2SparseMLABackend
    #: csa2's counterpart of ``flash_mla_sparse_fwd`` (host tensors).
    sparse_fwd = staticmethod(csa2_sparse_fwd)

    def __init__(self, *args, **kwargs) -> None:
        missing = [s for s in REQUIRED_SYMBOLS if not hasattr(_lib.lib(), s)]
        if missing:
            raise _lib.Csa2Error(
                -1,
                f"the csa2 library at {_lib.library_path()} does not export {', '.join(missing)}; "
                "this build cannot serve the CSA2_RS backend (unset CSA2_VLLM_BACKEND / drop the "
                "attention-config backend to use vLLM's own layers)",
            )
        super().__init__(*args, **kwargs)
