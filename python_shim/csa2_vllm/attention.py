"""The csa2 DeepSeek-V4.1 attention layer class (what ``_select_dsv4_attn_cls`` returns when
``CSA2_RS`` is selected).

It keeps everything of vLLM's FlashMLA V4.1 layer that is not the attention kernel — projections,
Q norm/RoPE, KV insertion into the paged caches, the indexer, the output projection — and runs the
sparse attention itself, :meth:`Csa2DeepseekV4Attention.forward_mqa`, in csa2: per token, one softmax
over the selected compressed entries (top-k) ∪ the SWA window plus the sink, read as packed records
straight from vLLM's page pools (NVFP4 288 B, V4.1 MXFP8 528 B or V4 584 B, decoded exactly in
csa2) through ``csa2_attention_indexed``.

Decode and prefill tokens go through the same call: the lists come from vLLM's own metadata (the
indexer's local top-k in ``topk_indices_buffer``, mapped through the compressed block table; the SWA
slot lists ``decode_swa_indices`` / ``prefill_swa_indices``), see :mod:`csa2_vllm.indices`. Nothing
is dequantised into a bf16 workspace and there is no prefill chunking.

Where it runs: the C ABI takes host memory. CPU tensors are used in place; on a GPU the lists are
built and the referenced records gathered on the GPU, and only those records, Q and the output cross
to and from the host (a correct path for validation and A/B accuracy, not a fast one: csa2's CUDA
attention kernel reads its own page layout and is not wired to vLLM's pools yet). The metadata
builders declare no CUDA-graph support, so vLLM keeps this op out of graphs.
"""

from __future__ import annotations

from typing import Any

from vllm.config.cache import CacheDType
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v41.attention import _use_v41_mxfp8_kv_record
from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

from . import _lib
from . import indices as lists
from .backend import Csa2SparseMLABackend, Csa2SparseSWABackend

REQUIRED_SYMBOLS = ("csa2_attention", "csa2_attention_indexed")


def csa2_sparse_fwd(q, kv, indices, topk_length, sm_scale: float, attn_sink, out) -> None:
    """Sparse attention with a sink over gathered KV, through ``csa2_attention`` (host tensors).

    Not on the serving path (``forward_mqa`` below reads the page pools directly); a drop-in for
    code written against FlashMLA's gathered-workspace prefill kernel.

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
    # A caller may hand a head slice of its output (as vLLM's prefill passes FlashMLA's
    # out=output[a:b, :prefill heads]): the C ABI takes
    # compact tensors only, so a strided view is written through a compact copy.
    dst = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
    _lib.attention(
        q.contiguous(), kv2.contiguous(), torch.zeros(0, kv2.shape[-1], dtype=kv2.dtype), idx,
        torch.zeros(t, dtype=torch.int64), attn_sink.float().contiguous(), dst, lse,
        topk_len=lens, replay_start=torch.ones(1, dtype=torch.int64), window=1,
        scale=float(sm_scale))
    if dst is not out:
        out.copy_(dst)


class Csa2DeepseekV4Attention(DeepseekV4FlashMLAAttention):
    """DeepSeek-V4.1 attention layer whose sparse attention runs in csa2."""

    backend_cls = Csa2SparseMLABackend
    swa_backend_cls = Csa2SparseSWABackend

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

    @property
    def packed_kv_cache_dtype(self) -> CacheDType:
        """csa2's FP4 compressed cache where vLLM's V4.1 records exist (SM100: 288-B NVFP4 entries
        beside the 528-B MXFP8 SWA record); elsewhere the V4 584-B record, which csa2 reads too."""
        return "nvfp4_ds_mla" if _use_v41_mxfp8_kv_record() else "fp8_ds_mla"

    def forward_mqa(self, q, kv, positions, output) -> None:
        """Sparse attention of the batch into ``output`` (T, padded heads, 512), q's dtype.

        ``q`` (T, padded heads, 512) RoPE'd queries; ``kv`` is unused (vLLM inserted it into the
        caches before this call); ``positions`` (T,) absolute positions. Decode tokens come first
        (vLLM reorders the batch). Heads past ``n_local_heads`` are written as zeros.
        """
        if output.shape != q.shape or output.dtype != q.dtype:
            raise ValueError(
                f"output {tuple(output.shape)} {output.dtype} must match q {tuple(q.shape)} {q.dtype}")
        md = get_forward_context().attn_metadata
        if md is None:  # warm-up dummy run: nothing to attend
            output.zero_()
            return
        if not isinstance(md, dict):
            raise TypeError(f"expected per-layer attention metadata (dict), got {type(md).__name__}")
        swa_md = md.get(self.swa_cache_layer.prefix)
        if swa_md is None:
            raise KeyError(f"no SWA metadata for {self.swa_cache_layer.prefix}")
        cmp_md = md.get(self.compressed_cache_prefix) if self.compressed_cache_prefix else None
        t = swa_md.num_decode_tokens + swa_md.num_prefill_tokens
        output[t:].zero_()
        if t == 0:
            return
        _check_not_capturing(q)
        csa2_attend(self, q[:t], positions[:t], swa_md, cmp_md, output[:t])


def _check_not_capturing(x) -> None:
    import torch

    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise _lib.Csa2Error(
            -1,
            "csa2's attention runs through the host C ABI and cannot be captured in a CUDA graph; "
            "its metadata builders declare AttentionCGSupport.NEVER — if a full-graph mode was "
            "forced, use --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' or --enforce-eager",
        )


def _swa_lists(swa_md) -> tuple[Any, Any]:
    """(T, W) SWA slots and (T,) lengths for the decode then prefill tokens."""
    import torch

    nd, npf = swa_md.num_decode_tokens, swa_md.num_prefill_tokens
    parts = []
    if nd:
        parts.append((swa_md.decode_swa_indices[:nd].reshape(nd, -1), swa_md.decode_swa_lens[:nd]))
    if npf:
        if swa_md.prefill_swa_indices is None or swa_md.prefill_swa_lens is None:
            raise ValueError("SWA metadata without prefill_swa_indices/lens for prefill tokens")
        parts.append((swa_md.prefill_swa_indices[:npf].reshape(npf, -1),
                      swa_md.prefill_swa_lens[:npf]))
    width = max(i.shape[1] for i, _ in parts)
    idx = torch.cat([torch.nn.functional.pad(i.to(torch.int32), (0, width - i.shape[1]), value=-1)
                     for i, _ in parts])
    return idx, torch.cat([n.to(torch.int32) for _, n in parts])


def _topk_lists(layer, positions, swa_md, cmp_md) -> tuple[Any, Any]:
    """(T, K) compressed-cache slots and (T,) lengths for the decode then prefill tokens."""
    import torch

    nd, npf = swa_md.num_decode_tokens, swa_md.num_prefill_tokens
    ratio = layer.compress_ratio
    bs = cmp_md.block_size // ratio
    local = layer.topk_indices_buffer[: nd + npf]
    req = swa_md.token_to_req_indices[: nd + npf]
    valid = swa_md.is_valid_token[: nd + npf]
    slots, lens = [], []
    if nd:
        s, n = lists.decode_topk_slots(local[:nd], req[:nd], cmp_md.block_table, bs, valid[:nd])
        slots.append(s)
        lens.append(n)
    if npf:
        # A prefill entry must lie in its request's compressed prefix (combine_topk_swa_indices).
        n_entries = swa_md.seq_lens.long() // ratio
        s, n = lists.prefill_topk_slots(local[nd:], req[nd:], positions[nd:], n_entries,
                                          cmp_md.block_table, bs, ratio, valid[nd:])
        slots.append(s)
        lens.append(n)
    return torch.cat(slots), torch.cat(lens)


def csa2_attend(layer, q, positions, swa_md, cmp_md, output) -> None:
    """The attention of ``forward_mqa`` for ``T`` tokens (decode first) through
    ``csa2_attention_indexed``; ``layer`` supplies ``compress_ratio``, ``n_local_heads``, ``scale``,
    ``attn_sink``, ``topk_indices_buffer``, ``swa_cache_layer.kv_cache`` and
    ``_compressed_kv_cache()``. Writes ``output`` (T, padded heads, 512)."""
    import torch

    t, h = q.shape[0], layer.n_local_heads
    swa_pool = layer.swa_cache_layer.kv_cache
    swa_fmt = lists.record_format(swa_pool, "SWA cache")
    swa_slots, swa_lens = _swa_lists(swa_md)
    swa_rec, swa_rows = lists.compact(swa_pool, swa_slots, swa_lens, "SWA cache")
    if layer.compress_ratio > 0:
        if cmp_md is None:
            raise KeyError(f"no compressed-cache metadata for {layer.compressed_cache_prefix}")
        pool = layer._compressed_kv_cache()
        main_fmt = lists.record_format(pool, "compressed cache")
        if pool.shape[1] * layer.compress_ratio != cmp_md.block_size:
            raise ValueError(
                f"compressed cache holds {pool.shape[1]} entries per block, expected "
                f"{cmp_md.block_size} // {layer.compress_ratio}")
        main_slots, main_lens = _topk_lists(layer, positions, swa_md, cmp_md)
        main_rec, main_rows = lists.compact(pool, main_slots, main_lens, "compressed cache")
        main_lens = main_lens.cpu()
    else:  # SWA-only layer
        main_fmt = _lib.FORMAT_NVFP4
        main_rec = torch.zeros(0, _lib.format_info(main_fmt).record_bytes, dtype=torch.uint8)
        main_rows = torch.full((t, 1), -1, dtype=torch.int32)
        main_lens = torch.zeros(t, dtype=torch.int32)
    qh = q[:, :h].cpu().contiguous()
    out = torch.empty_like(qh)
    lse = torch.empty(t, h, dtype=torch.float32)
    _lib.attention_indexed(
        qh, main_rec, main_rows, swa_rec, swa_rows,
        layer.attn_sink[:h].detach().float().cpu().contiguous(), out, lse,
        main_len=main_lens, swa_len=swa_lens.cpu(), main_format=main_fmt, swa_format=swa_fmt,
        scale=float(layer.scale))
    output[:, :h].copy_(out)
    output[:, h:].zero_()
