"""csa2's lightning indexer for an MXFP4 index K on SM90 (the 890 B/token layout on Hopper).

vLLM 0.33 stores the 68-B MXFP4 index K only on SM100: ``dsa_indexer_uses_fp4``
(``v1/attention/backends/mla/indexer.py:60``) raises for ``indexer_kv_dtype='mxfp4'`` off SM10x
(:94), because its only MXFP4 scorers are DeepGEMM's SM100 FP4 logits kernels, and its MXFP4
writers pack E2M1 with SM100-only PTX. The records themselves need no FP4 hardware. When the
``CSA2_RS`` layer runs on SM90 with ``indexer_kv_dtype='mxfp4'``, this module supplies every piece
vLLM's indexer would run there:

- :func:`accepts_mxfp4_index_k`, a scope in which vLLM's predicate answers "MXFP4" on SM90. It is
  entered only around the construction of csa2's own layers and of csa2's indexer metadata
  builder (:class:`csa2_vllm.backend.Csa2IndexerMetadataBuilder`), and restored on exit, also on an
  error: vLLM's own backends keep vLLM's refusal;
- :class:`Csa2Indexer`, vLLM's ``DeepseekV4Indexer`` with csa2's portable MXFP4 index-K writer
  (:func:`csa2_vllm.writers.mxfp4_index_k_store`), csa2's MXFP4 Q quantiser
  (:func:`mxfp4_index_q`, torch ops only) and csa2's scorer (:class:`Csa2SparseAttnIndexer`);
- :class:`Csa2SparseAttnIndexer`, the scoring op: ``csa2_indexer_logits_pool`` reads the layer's
  index-K pages in place (the strided ``[blocks, states, 68]`` view, block-planar), vLLM's V4.1
  two-level candidate blocks are applied to the logits (:func:`select_candidate_blocks`,
  :func:`apply_candidate_mask`), and ``csa2_topk`` writes the request-local top-k entries into
  ``topk_indices_buffer`` — the buffer ``csa2_vllm.attention.pool_lists`` maps through the block
  table into the global slot lists ``csa2_attention_pools`` reads.

Capture safety: every tensor op here has shapes fixed by the batch's token count and the block
table's width, reads no value on the host and writes into buffers allocated before the first
call (shared by the layers of one device). Host tensors run csa2's CPU entries; CUDA tensors
the CUDA ones on the current stream.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import vllm.models.deepseek_v41.attention as _v41
import vllm.v1.attention.backends.mla.indexer as _vllm_indexer
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v41.attention import DeepseekV4Indexer
from vllm.platforms import current_platform

from . import writers
from .route import (  # noqa: F401  (the device route's pieces, re-exported under their old home)
    INDEX_DIM,
    INDEX_Q_DTYPE,
    LOGITS_BUDGET_BYTES,
    MXFP4_BLOCK,
    ROPE_DIM,
    _Workspace,
    apply_candidate_mask,
    current_ordinal,
    mxfp4_index_q,
    require_device_route,
    score,
    select_candidate_blocks,
)

# ---- which index K csa2's layer asks for --------------------------------------------------------


def _on_sm90() -> bool:
    cap = current_platform.get_device_capability()
    return cap is not None and cap.major == 9


def mxfp4_index_k_requested(vllm_config) -> bool:
    """Whether ``indexer_kv_dtype`` resolves to ``mxfp4`` (vLLM's ``resolve_indexer_kv_dtype``,
    "auto" meaning FP8 as in vLLM)."""
    return vllm_config.attention_config.resolve_indexer_kv_dtype("fp8") == "mxfp4"


def csa2_scores_mxfp4_index_k(vllm_config) -> bool:
    """Whether csa2 writes and scores the MXFP4 index K itself: an SM90 GPU (where vLLM refuses
    it) with ``indexer_kv_dtype='mxfp4'``. On SM100 vLLM's own MXFP4 writer and scorer stay."""
    return _on_sm90() and mxfp4_index_k_requested(vllm_config)


@contextlib.contextmanager
def accepts_mxfp4_index_k():
    """While active on SM90, vLLM's ``dsa_indexer_uses_fp4`` answers True for
    ``indexer_kv_dtype='mxfp4'`` (after vLLM's own dtype check) instead of raising; every other
    case still gets vLLM's answer. vLLM reads it by module global at call time in the layer and
    its indexer (``models/deepseek_v41/attention.py:449, :1378``) and in the indexer metadata
    builder (``v1/attention/backends/mla/indexer.py:1028``), so the scope replaces that global in
    those two modules. Restored on exit, also on an error; construction is single-threaded. A
    no-op off SM90."""
    if not _on_sm90():
        yield
        return
    vllm_answer = _vllm_indexer.dsa_indexer_uses_fp4

    def uses_fp4(vllm_config) -> bool:
        if mxfp4_index_k_requested(vllm_config):
            return True
        return vllm_answer(vllm_config)

    saved = [(m, m.dsa_indexer_uses_fp4) for m in (_v41, _vllm_indexer)]
    for m, _ in saved:
        m.dsa_indexer_uses_fp4 = uses_fp4
    try:
        yield
    finally:
        for m, f in saved:
            m.dsa_indexer_uses_fp4 = f


class Csa2SparseAttnIndexer(torch.nn.Module):
    """The scoring op of :class:`Csa2Indexer` (``DeepseekV4Indexer.attn_cls``; the constructor
    takes ``SparseAttnIndexer``'s arguments). Called as ``indexer_op(hidden_states, q_quant, k,
    weights)`` from ``_sparse_indexer_and_attn`` with ``q_quant = (q, positions)`` as
    :meth:`Csa2Indexer.forward_q` returns it: ``q`` (T, 32, 128) decoded MXFP4 queries, positions
    (T,). Writes the request-local top-k entries of the T tokens (decode then prefill) into
    ``topk_indices_buffer[:T, :topk]`` (−1 padded): entries ``< (p + 1) div ratio`` with the
    largest ``Σ_h w·ReLU(q·k)``, all visible ones when they are ≤ topk."""

    def __init__(self, k_cache, quant_block_size: int, scale_fmt: str, topk_tokens: int,
                 head_dim: int, max_model_len: int, max_total_seq_len: int, topk_indices_buffer,
                 skip_k_cache_insert: bool = False, use_fp4_cache: bool = False,
                 compress_ratio: int = 1, candidate_blocks=None, candidate_block_size: int = 0,
                 candidate_write: bool = False):
        super().__init__()
        if not use_fp4_cache or head_dim != INDEX_DIM:
            raise ValueError("csa2's pooled indexer scores the 128-dim MXFP4 index K only")
        self.k_cache = k_cache
        self.topk_tokens = topk_tokens
        self.topk_indices_buffer = topk_indices_buffer
        self.compress_ratio = compress_ratio
        self.candidate_blocks = candidate_blocks
        self.candidate_block_size = candidate_block_size
        self.candidate_write = candidate_write
        #: The SWA cache layer's prefix (its metadata maps tokens to requests); set by the layer.
        self.swa_prefix: str | None = None

    def forward(self, hidden_states, q_quant, k, weights):
        md = get_forward_context().attn_metadata
        if not isinstance(md, dict):  # profile run: nothing bound
            return self.topk_indices_buffer
        q, positions = q_quant
        imd = md[self.k_cache.prefix]
        t = imd.num_decode_tokens + imd.num_prefill_tokens
        if t == 0:
            return self.topk_indices_buffer
        if self.swa_prefix is None:
            raise RuntimeError("Csa2SparseAttnIndexer.swa_prefix was not set by its layer")
        swa_md = md[self.swa_prefix]
        score(self, q[:t], weights[:t], positions[:t], swa_md.token_to_req_indices[:t],
              imd.block_table)
        return self.topk_indices_buffer


# ---- the indexer module -------------------------------------------------------------------------


class Csa2Indexer(DeepseekV4Indexer):
    """vLLM's V4.1 indexer with csa2's MXFP4 pieces (see the module note): built inside
    :func:`accepts_mxfp4_index_k` by csa2's layer, it keeps vLLM's projections, short-context
    path and metadata, and swaps the three SM100-only parts."""

    attn_cls = Csa2SparseAttnIndexer

    def __init__(self, vllm_config, *args, **kwargs):
        if vllm_config.attention_config.indexer_sparse_logits:
            raise ValueError(
                "attention_config.indexer_sparse_logits runs DeepGEMM's SM100 sparse MQA "
                "logits; csa2's SM90 MXFP4 indexer scores the whole context and masks the "
                "candidate blocks instead (same selection): drop indexer_sparse_logits")
        ordinal = current_ordinal()
        if ordinal is not None:  # on a GPU: no host route for this scorer, so say so at start-up
            require_device_route(ordinal, "csa2's MXFP4 index K on SM90 (indexer_kv_dtype "
                                          "'mxfp4', which vLLM refuses there)")
        super().__init__(vllm_config, *args, **kwargs)
        self._q_dtype = INDEX_Q_DTYPE
        self._max_tokens = vllm_config.scheduler_config.max_num_batched_tokens

    def _produce_k(self, latent, positions, rotary_emb) -> None:
        """``k_norm(wk(latent))`` at group-boundary tokens into the 68-B MXFP4 index K, with
        csa2's portable writer (vLLM's packs E2M1 with SM100-only PTX)."""
        md = get_forward_context().attn_metadata
        if not isinstance(md, dict) or latent is None:
            return
        k_pre, _ = self.wk(latent)
        writers.mxfp4_index_k_store(
            k_pre, positions, rotary_emb.cos_sin_cache, self.k_norm.weight,
            self.k_norm.variance_epsilon, self.k_cache.kv_cache,
            md[self.k_cache.prefix].slot_mapping, self.compress_ratio)

    def forward_q(self, qr, qr_scale, indexer_weights, positions, rotary_emb):
        """``wq_b`` then :func:`mxfp4_index_q` into the shared workspace. Returns ``(q,
        positions, weights)`` in the places of vLLM's ``(q, q_scale, weights)``: csa2's MXFP4 Q
        is its decoded values, so there is no scale tensor, and the second member carries the
        positions the in-place scorer needs (``_sparse_indexer_and_attn`` hands the pair to
        :class:`Csa2SparseAttnIndexer` as ``q_quant``)."""
        q = self._wq_b_proj(qr, qr_scale).view(-1, self.n_head, self.head_dim)
        t = q.shape[0]
        rows = max(t, self._max_tokens)
        q_out = _Workspace.get("q", (rows, self.n_head, self.head_dim), self._q_dtype, q.device)
        w_out = _Workspace.get("w", (rows, self.n_head), torch.float32, q.device)
        mxfp4_index_q(q, positions, rotary_emb.cos_sin_cache, indexer_weights,
                      self.softmax_scale, self.n_head ** -0.5, q_out, w_out)
        return q_out[:t], positions[:t], w_out[:t]


def indexer_cls_for(k_cache) -> type[DeepseekV4Indexer] | None:
    """:class:`Csa2Indexer` when csa2 scores this layer's index K (SM90, ``mxfp4``), else None
    (vLLM's choice stays). Asked during the layer's construction (vLLM's config is current)."""
    return Csa2Indexer if csa2_scores_mxfp4_index_k(get_current_vllm_config()) else None


def wire(layer: Any) -> None:
    """Gives a csa2 layer's scorer the SWA cache prefix whose metadata maps tokens to requests."""
    ind = getattr(layer, "indexer", None)
    if ind is not None and isinstance(ind.indexer_op, Csa2SparseAttnIndexer):
        ind.indexer_op.swa_prefix = layer.swa_cache_layer.prefix
