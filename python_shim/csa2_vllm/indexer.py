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

from . import _lib, writers

#: Values per MXFP4 block (docs/SPEC.md §1), index-head dimension, RoPE'd tail of it.
MXFP4_BLOCK = 32
INDEX_DIM = 128
ROPE_DIM = 64

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


# ---- the MXFP4 Q quantiser ----------------------------------------------------------------------

# E2M1 magnitudes (docs/SPEC.md §1) and the round-to-nearest-even decision points between them:
# a value on a midpoint goes to the code with an even mantissa bit (0, 1, 2, 4 ↔ codes 0, 2, 4, 6).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_round(a: torch.Tensor) -> torch.Tensor:
    """|x| (f32, already divided by the block scale) → the E2M1 magnitude it rounds to, RNE,
    saturating at 6; elementwise comparisons only."""
    out = torch.full_like(a, 6.0)
    # From the top down, so each test overwrites with the next smaller magnitude.
    for bound, le, mag in ((5.0, True, 4.0), (3.5, False, 3.0), (2.5, True, 2.0),
                           (1.75, False, 1.5), (1.25, True, 1.0), (0.75, False, 0.5),
                           (0.25, True, 0.0)):
        hit = a <= bound if le else a < bound
        out = torch.where(hit, torch.full_like(a, mag), out)
    return out


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(v))`` of positive normal f32 ``v``, exactly, from the bits (the unbiased
    exponent, +1 when the mantissa is not zero; a float ``log2`` can round onto an integer just
    above a power of two)."""
    bits = v.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as f32 for int32 ``k`` in [−127, 127], exactly: the exponent field for k ≥ −126 and the
    subnormal 2^-127 below (a float ``exp2`` may be approximate on a GPU)."""
    normal = ((k.clamp(min=-126) + 127) << 23).view(torch.float32)
    return torch.where(k < -126, torch.full_like(normal, 2.0 ** -127), normal)


def mxfp4_index_q(q, positions, cos_sin_cache, weights, softmax_scale: float, head_scale: float,
                  q_out, w_out) -> None:
    """RoPE + MXFP4 quantisation of the indexer queries, and the head weights, into preallocated
    outputs — what vLLM's ``fused_indexer_q_rope_quant(use_fp4=True)``
    (``models/deepseek_v4/common/ops/fused_indexer_q.py:549``) computes, with torch ops only.

    ``q`` (T, H, 128) bf16/f32 ``wq_b(qr)``; ``positions`` (T,) int; ``cos_sin_cache`` (max_pos,
    64) cos half then sin half; ``weights`` (T, H) ``weights_proj`` output. GPT-J RoPE on dims
    64..127 in f32, rounded to bf16 (as vLLM); then per block of 32 values (docs/SPEC.md §1)
    ``e = clamp(ceil(log2(max(amax, 6·2^-126) / 6)), −127, 127)`` and each value rounded to E2M1
    of ``x·2^-e`` (nearest, ties to even, saturating at 6, the sign kept).

    Writes ``q_out[:T]`` (T, H, 128) bf16 or f32: the MXFP4 values decoded (``E2M1 · 2^e``, exact
    in both dtypes), which csa2's scorer takes with ``q_quant = 0``; and ``w_out[:T]`` (T, H) f32
    ``= weights · softmax_scale · head_scale`` (MXFP4 folds no Q scale into the weights).
    Capture-safe: no value is read on the host and the output shapes are q's."""
    t, h, d = q.shape
    if d != INDEX_DIM or cos_sin_cache.shape[-1] != ROPE_DIM:
        raise ValueError(f"indexer q (T, H, {INDEX_DIM}) and a ({ROPE_DIM})-wide cos/sin cache "
                         f"expected, got q {tuple(q.shape)}, cos/sin {tuple(cos_sin_cache.shape)}")
    if tuple(q_out.shape[1:]) != (h, d) or q_out.shape[0] < t or w_out.shape[0] < t \
            or tuple(w_out.shape[1:]) != (h,):
        raise ValueError(f"outputs {tuple(q_out.shape)} / {tuple(w_out.shape)} cannot hold "
                         f"q {tuple(q.shape)}")
    x = q.float()
    half = ROPE_DIM // 2
    cs = cos_sin_cache[positions.long()].float()  # (T, 64)
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    even, odd = x[..., d - ROPE_DIM::2], x[..., d - ROPE_DIM + 1::2]
    r_even = (even * cos - odd * sin).to(torch.bfloat16).float()
    r_odd = (odd * cos + even * sin).to(torch.bfloat16).float()
    rope = torch.stack([r_even, r_odd], -1).reshape(t, h, ROPE_DIM)
    y = torch.cat([x[..., : d - ROPE_DIM], rope], -1).reshape(t, h, d // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = y.abs().amax(-1, keepdim=True).clamp_min(6.0 * 2.0 ** -126)
    e = _ceil_log2(amax / 6.0).clamp(-127, 127)
    scaled = y * _pow2(-e)
    mag = _e2m1_round(scaled.abs())
    signed = torch.where(torch.signbit(scaled), -mag, mag)
    signed = torch.where(torch.isnan(y), torch.full_like(y, 6.0), signed)
    q_out[:t].copy_((signed * _pow2(e)).reshape(t, h, d))
    w_out[:t].copy_(weights.float() * (softmax_scale * head_scale))


# ---- V4.1 two-level candidate blocks on the logits ----------------------------------------------


def select_candidate_blocks(logits, visible, block_size: int, out) -> None:
    """The candidate-source layer's blocks (vLLM's ``select_candidate_blocks``,
    ``model_executor/kernels/attention/dsa/candidate_blocks.py``, with its full-width rule): per
    row, blocks of ``block_size`` columns scored by their largest logit among the ``visible``
    ones, the row's newest block pinned first, the best ``out.shape[1]`` kept, −1 for blocks with
    no finite score. ``logits`` (T, N) f32 (N a multiple of ``block_size``), ``visible`` (T,)
    int, ``out`` (≥T, B) int32 rows overwritten. Torch ops, fixed shapes."""
    t, n = logits.shape
    nblocks = n // block_size
    col = torch.arange(n, device=logits.device)
    vis = visible.long()[:, None]
    masked = torch.where(col[None, :] < vis, logits, torch.full_like(logits, -float("inf")))
    scores = masked.reshape(t, nblocks, block_size).amax(-1)
    newest = (vis - 1).div(block_size, rounding_mode="floor")
    blocks = torch.arange(nblocks, device=logits.device)[None, :]
    scores = torch.where((vis > 0) & (blocks == newest), torch.full_like(scores, float("inf")),
                         scores)
    k = min(out.shape[1], nblocks)
    top = scores.topk(k, dim=-1)
    picked = torch.where(top.values != -float("inf"), top.indices,
                         torch.full_like(top.indices, -1)).to(torch.int32)
    out[:t, :k].copy_(picked)
    out[:t, k:].fill_(-1)


def apply_candidate_mask(logits, visible, candidates, block_size: int) -> None:
    """A consumer layer's mask (vLLM's ``apply_candidate_mask``): ``logits`` (T, N) keeps the
    visible columns of the row's candidate blocks (``candidates`` (≥T, B) int32, −1 = none) and
    becomes −∞ elsewhere, in place. Torch ops, fixed shapes."""
    t, n = logits.shape
    nblocks = n // block_size
    cand = candidates[:t].long()
    # One flag per block, plus a dump slot for −1 (and any id past the width).
    slot = torch.where((cand >= 0) & (cand < nblocks), cand, torch.full_like(cand, nblocks))
    flags = torch.zeros(t, nblocks + 1, dtype=torch.bool, device=logits.device)
    flags.scatter_(1, slot, torch.ones_like(slot, dtype=torch.bool))
    col = torch.arange(n, device=logits.device)
    keep = flags[:, :nblocks].repeat_interleave(block_size, 1) & (col[None, :] < visible.long()[:, None])
    logits.masked_fill_(~keep, -float("inf"))


# ---- the scorer ---------------------------------------------------------------------------------

#: Bytes of logits one scoring call writes at most: prefill rows are scored in chunks of rows so
#: that a long context (N = block-table width × states per page columns) stays within it.
LOGITS_BUDGET_BYTES = 64 << 20


class _Workspace:
    """Buffers shared by the csa2 indexers of one device, allocated on first use (vLLM's warm-up
    run comes before any CUDA-graph capture) and then reused at fixed addresses."""

    _buffers: dict[tuple, torch.Tensor] = {}

    @classmethod
    def get(cls, name: str, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
        key = (name, tuple(shape), dtype, str(device))
        buf = cls._buffers.get(key)
        if buf is None:
            buf = cls._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf


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


def score(op, q, w, positions, req, block_table) -> None:
    """Logits of T tokens over ``op.k_cache.kv_cache`` in place, candidates, then top-k into
    ``op.topk_indices_buffer`` (see :class:`Csa2SparseAttnIndexer`). ``req`` (T,) the block-table
    row of each token; ``block_table`` (R, B) int32 of the index-K cache's group."""
    pool = op.k_cache.kv_cache
    t = q.shape[0]
    ratio = op.compress_ratio
    n = block_table.shape[1] * pool.shape[1]
    device = q.device
    on_gpu = q.is_cuda
    stream = torch.cuda.current_stream(device).cuda_stream if on_gpu else 0
    # Elementwise guards instead of host checks: a padding token's request row and position are
    # clamped into range (its top-k is never read: its list length is 0).
    req32 = req.clamp(0, block_table.shape[0] - 1).to(torch.int32)
    pos = positions.clamp_min(0).to(torch.int64)
    table = block_table.to(torch.int32)
    visible = ((pos + 1) // ratio).clamp(max=n)
    topk = op.topk_indices_buffer
    # One workspace per (device, width): its row count depends on the width only, so every
    # batch reuses the same buffer (fixed addresses under graph capture).
    rows = max(1, LOGITS_BUDGET_BYTES // (4 * max(n, 1)))
    logits = _Workspace.get("logits", (rows, n), torch.float32, device)
    out = _Workspace.get("topk", (rows, op.topk_tokens), torch.int32, device) \
        if topk.shape[1] != op.topk_tokens else None
    extra = {"stream": stream} if on_gpu else {}
    for lo in range(0, t, rows):
        hi = min(t, lo + rows)
        lg = logits[: hi - lo]
        _lib.indexer_logits_pool(q[lo:hi].contiguous(), w[lo:hi].contiguous(), pos[lo:hi],
                                 req32[lo:hi], pool, table, ratio, 0, lg, **extra)
        if op.candidate_blocks is not None:
            cand = op.candidate_blocks[lo:hi]
            if op.candidate_write:
                select_candidate_blocks(lg, visible[lo:hi], op.candidate_block_size, cand)
            else:
                apply_candidate_mask(lg, visible[lo:hi], cand, op.candidate_block_size)
        dst = topk[lo:hi] if out is None else out[: hi - lo]
        if on_gpu:  # no host check of positions: capturable on the current stream
            _lib.topk_on_stream(lg, pos[lo:hi], ratio, dst, stream=stream)
        else:
            _lib.topk(lg, pos[lo:hi], ratio, dst)
        if out is not None:
            topk[lo:hi, : op.topk_tokens].copy_(dst)


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
        super().__init__(vllm_config, *args, **kwargs)
        self._q_dtype = torch.bfloat16
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
