"""The ``CSA2_RS`` attention backend class.

For DeepSeek-V4.1 a backend class supplies metadata builders, the KV-cache layout and capability
flags; the attention itself runs in the layer class (``csa2_vllm.attention``). We keep the FlashMLA
V4.1 cache geometry and metadata (so vLLM's paged caches, block tables and SWA metadata are
unchanged) and only rename the backend.
"""

from __future__ import annotations

from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLABackend

from . import BACKEND_NAME


class Csa2SparseMLABackend(DeepseekV4FlashMLABackend):
    """FlashMLA-V4.1-compatible cache layout and metadata; attention by csa2."""

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME
