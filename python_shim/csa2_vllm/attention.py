"""The csa2 DeepSeek-V4.1 attention layer class (what ``_select_dsv4_attn_cls`` returns when
``CSA2_RS`` is selected).

It keeps everything of vLLM's FlashMLA V4.1 layer that is not the attention kernel — projections,
Q norm/RoPE, KV insertion into the paged caches, indexer, output projection — and replaces the sparse
attention over (top-k compressed entries ∪ SWA window, one softmax with the sink) by csa2's op
through the C ABI.

STATUS: the csa2 attention export (``csa2_attention``) is not in the library yet (it is built on the
``ops`` branch). Until it is, constructing this layer raises :class:`csa2_vllm._lib.Csa2Error` naming
the missing symbol, so selecting ``CSA2_RS`` fails at model build time, never silently mid-serving.
"""

from __future__ import annotations

from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

from . import _lib
from .backend import Csa2SparseMLABackend

REQUIRED_SYMBOLS = ("csa2_attention",)


class Csa2DeepseekV4Attention(DeepseekV4FlashMLAAttention):
    """DeepSeek-V4.1 attention layer whose sparse attention runs in csa2."""

    backend_cls = Csa2SparseMLABackend

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
