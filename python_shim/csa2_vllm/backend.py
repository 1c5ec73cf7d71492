"""The ``CSA2_RS`` attention backend classes.

For DeepSeek-V4.1 a backend class supplies metadata builders, the KV-cache layout and capability
flags; the attention itself runs in the layer class (``csa2_vllm.attention``). We keep the FlashMLA
V4.1 cache geometry and metadata (so vLLM's paged caches, block tables and SWA metadata are
unchanged) with two differences:

- ``nvfp4_ds_mla`` is a supported KV-cache dtype: on SM100 our layer prefers the 288-B NVFP4
  compressed record (csa2's FP4 cache), which vLLM otherwise lets only its mega-attention kernel read;
- the metadata builders declare ``AttentionCGSupport.UNIFORM_BATCH`` when — and only when — the
  loaded csa2 library launches its CUDA kernels on the device in use (:func:`graph_support`, which
  asks ``csa2_cuda_preload`` once per device): then csa2's attention entry
  (``csa2_attention_pools``) reads vLLM's pools in place on the current stream with no host work,
  so a uniform decode batch can be captured in a full CUDA graph (mixed batches run piecewise,
  where V4.1's attention already sits in an eager break: ``@eager_break_during_capture`` on
  ``_sparse_indexer_and_attn`` / ``_prepare_and_attn_eager`` in ``models/deepseek_v41/attention.py``).
  Otherwise (no GPU; a library without the ``cuda`` feature, whose host route copies) they declare
  ``NEVER``, and vLLM downgrades full graphs at start-up. vLLM's own FlashMLA builders say
  ``ALWAYS``; we claim the narrower mode that was checked (capture-safe list building,
  python_shim/tests_interpreted/test_pools.py).
- the SWA builder, which runs on the host once per step outside any captured region, reports the
  error records of csa2's CUDA entries (:meth:`csa2_vllm.route.ErrorRecords.poll`).
"""

from __future__ import annotations

from typing import ClassVar

from vllm.config.cache import CacheDType
from vllm.models.deepseek_v41.nvidia.flashmla import (
    DeepseekSparseSWAFlashMLABackend,
    DeepseekSparseSWAFlashMLAMetadataBuilder,
)
from vllm.models.deepseek_v41.sparse_mla import (
    DeepseekV4FlashMLABackend,
    DeepseekV4FlashMLAMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mla.indexer import (
    DeepseekV32IndexerMetadataBuilder,
    DeepseekV41IndexerBackend,
)

from . import BACKEND_NAME, route
from .indexer import accepts_mxfp4_index_k


def graph_support() -> AttentionCGSupport:
    """What csa2's metadata builders declare: ``UNIFORM_BATCH`` where csa2's kernels launch on
    the CUDA device in use, ``NEVER`` elsewhere (:func:`csa2_vllm.route.graph_support`)."""
    return AttentionCGSupport[route.graph_support()]


class Csa2MetadataBuilder(DeepseekV4FlashMLAMetadataBuilder):
    """FlashMLA V4.1 compressed-cache metadata; uniform decode batches may be graph-captured
    where csa2's kernels launch (:func:`graph_support`)."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return graph_support()


class Csa2SWAMetadataBuilder(DeepseekSparseSWAFlashMLAMetadataBuilder):
    """vLLM's SWA metadata (per-token SWA slot lists in paged coordinates, persistent buffers);
    uniform decode batches may be graph-captured where csa2's kernels launch. Each build (host,
    once per step, outside any capture) reports csa2's kernel error records."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return graph_support()

    def build(self, *args, **kwargs):
        route.errors.poll()
        return super().build(*args, **kwargs)


class Csa2SparseMLABackend(DeepseekV4FlashMLABackend):
    """FlashMLA-V4.1-compatible cache layout and metadata; attention by csa2."""

    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        *DeepseekV4FlashMLABackend.supported_kv_cache_dtypes,
        "nvfp4_ds_mla",
    ]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def supports_pcp(cls) -> bool:
        return False  # see csa2_vllm.model.select_attn_cls

    @staticmethod
    def get_builder_cls() -> type[Csa2MetadataBuilder]:
        return Csa2MetadataBuilder


class Csa2SparseSWABackend(DeepseekSparseSWAFlashMLABackend):
    """The SWA cache backend of csa2's layers (vLLM's, with :class:`Csa2SWAMetadataBuilder`)."""

    @staticmethod
    def get_builder_cls() -> type[Csa2SWAMetadataBuilder]:
        return Csa2SWAMetadataBuilder

    @classmethod
    def supports_pcp(cls) -> bool:
        return False


class Csa2IndexerMetadataBuilder(DeepseekV32IndexerMetadataBuilder):
    """vLLM's indexer metadata for a csa2-scored MXFP4 index K on SM90. vLLM's builder asks
    ``dsa_indexer_uses_fp4`` in ``__init__`` (``v1/attention/backends/mla/indexer.py:1028``),
    which refuses ``mxfp4`` off SM100; it is built here inside csa2's scope
    (:func:`csa2_vllm.indexer.accepts_mxfp4_index_k`), and the metadata is vLLM's unchanged
    (csa2's scorer reads ``block_table`` and the token counts). Uniform decode batches may be
    graph-captured where csa2's kernels launch (:func:`graph_support`): csa2's indexer forward
    has fixed shapes and no host work
    (python_shim/tests_interpreted/test_sm90_indexer.py)."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return graph_support()

    def __init__(self, *args, **kwargs) -> None:
        with accepts_mxfp4_index_k():
            super().__init__(*args, **kwargs)


class Csa2IndexerBackend(DeepseekV41IndexerBackend):
    """vLLM's V4.1 indexer backend (same name, page layout and kernel block sizes) with
    :class:`Csa2IndexerMetadataBuilder`; chosen by csa2's index-K cache only where csa2 scores it
    (``Csa2IndexerCache.csa2_scores``)."""

    @staticmethod
    def get_builder_cls() -> type[Csa2IndexerMetadataBuilder]:
        return Csa2IndexerMetadataBuilder
