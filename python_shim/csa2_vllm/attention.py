"""The csa2 DeepSeek-V4.1 attention layer class (what ``_select_dsv4_attn_cls`` returns when
``CSA2_RS`` is selected).

It keeps everything of vLLM's FlashMLA V4.1 layer that is not the attention kernel — projections,
Q norm/RoPE, KV insertion into the paged caches, the indexer, the output projection — and runs the
sparse attention itself, :meth:`Csa2DeepseekV4Attention.forward_mqa`, in csa2: per token, one softmax
over the selected compressed entries (top-k) ∪ the SWA window plus the sink, read as packed records
in place from vLLM's page pools (NVFP4 288 B and V4.1 MXFP8 528 B interleaved, V4 584 B
block-planar; decoded exactly in csa2) through ``csa2_attention_pools``.

Decode and prefill tokens go through the same entry (one call for the decode tokens, one for the
prefill tokens, each into its own rows of ``output``): the lists come from vLLM's own metadata
(the indexer's local top-k in ``topk_indices_buffer``, mapped through the compressed block table;
the SWA slot lists ``decode_swa_indices`` / ``prefill_swa_indices``), see :mod:`csa2_vllm.indices`.
Nothing is gathered, compacted or dequantised into a workspace, and there is no prefill chunking.

Where it runs: the entry takes tensors on either device. CPU tensors run csa2's CPU path in place
on the strided pools; CUDA tensors run csa2's CUDA kernel on the current stream with raw device
pointers — the lists are built with elementwise torch ops and fixed shapes only (no ``.item()``,
``.cpu()``, ``unique`` or ``nonzero``), so the layer can be captured in a full CUDA graph, and the
metadata builders declare ``UNIFORM_BATCH`` when the loaded library launches on the device
(:func:`csa2_vllm.route.graph_support`). A slot outside its pool is refused on the host; on the GPU
the kernel skips it and records it in :data:`csa2_vllm.route.errors`, reported once per step.
Which route a GPU tensor takes (and why a CUDA build that cannot launch here raises instead of
falling back): :mod:`csa2_vllm.route`.
:func:`csa2_attend` (the earlier route: compact gather, host call) stays for A/B comparison.
"""

from __future__ import annotations

import contextlib
from typing import Any

import vllm.models.deepseek_v41.attention as _v41
from vllm.config.cache import CacheDType
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v41.attention import DeepseekV4IndexerCache
from vllm.models.deepseek_v41.compressor import DeepseekCompressor
from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention
from vllm.platforms import current_platform

from . import _lib, route, writers
from . import indexer as csa2_indexer
from . import indices as lists
from .backend import Csa2IndexerBackend, Csa2SparseMLABackend, Csa2SparseSWABackend
from .route import _i32, csa2_attend_pools, pool_lists  # noqa: F401  (the device route)

REQUIRED_SYMBOLS = ("csa2_attention", "csa2_attention_indexed", "csa2_attention_pools")

# ---- which records the layer asks for ----------------------------------------------------------
#
# vLLM 0.33 picks the V4.1 records (528-B MXFP8 SWA, and with ``nvfp4_ds_mla`` the 288-B NVFP4
# compressed entry) only where ``models/deepseek_v41/attention.py::_use_v41_mxfp8_kv_record()``
# says so: SM100-family GPUs, because FlashMLA decodes them only there. Every place that turns
# the choice into bytes reads that one function at call time: ``DeepseekV4Attention.__init__``
# (``kv_mxfp8``, the SWA and compressed record widths, the page alignment, the SWA block-stride
# alignment, and the refusal of ``nvfp4_ds_mla`` without V4.1 records) and
# ``DeepseekV4IndexerCache.get_kv_cache_spec`` (the index-K page's alignments, asked when the KV
# planner runs). csa2's kernel reads the V4.1 records on SM90 too, so csa2's layer answers that
# question itself on SM90 — for its own construction and its own index-K cache's spec only
# (:func:`_vllm_sees_v41_records`), never for vLLM's layers — and fills, with
# :mod:`csa2_vllm.writers`, the records whose vLLM writers an SM90 GPU cannot run. The index K is
# vLLM's ``indexer_kv_dtype`` choice; where that is ``mxfp4`` on SM90 (which vLLM refuses: it scores
# an MXFP4 index K only with DeepGEMM's SM100 kernels), csa2's layer accepts it for itself
# (:func:`csa2_vllm.indexer.accepts_mxfp4_index_k`) and writes and scores it with
# :class:`csa2_vllm.indexer.Csa2Indexer`: the paper's 890 B/token on Hopper.


def v41_records_by_csa2() -> bool:
    """Whether csa2's layer asks for the V4.1 records where vLLM would not: an SM90 GPU (H100,
    H200; csa2's CUDA kernels are built for sm_90a and sm_100a)."""
    cap = current_platform.get_device_capability()
    return cap is not None and cap.major == 9


def v41_records() -> bool:
    """Whether csa2's layer uses the V4.1 records: vLLM's own choice (SM100) or csa2's (SM90)."""
    return _v41._use_v41_mxfp8_kv_record() or v41_records_by_csa2()


def _yes() -> bool:
    return True


@contextlib.contextmanager
def _vllm_sees_v41_records():
    """While active on SM90, vLLM's record predicate answers True (see the note above); a no-op
    where vLLM already picks the V4.1 records or csa2 does not ask for them. Restored on exit,
    also on an error; layer construction and KV planning are single-threaded."""
    if not v41_records_by_csa2() or _v41._use_v41_mxfp8_kv_record():
        yield
        return
    saved = _v41._use_v41_mxfp8_kv_record
    _v41._use_v41_mxfp8_kv_record = _yes
    try:
        yield
    finally:
        _v41._use_v41_mxfp8_kv_record = saved


class Csa2IndexerCache(DeepseekV4IndexerCache):
    """vLLM's index-K cache of a csa2 layer: its page takes the V4.1 records' alignment where
    csa2 uses them, so that it shares the block slab's alignment with the layer's other pages;
    where csa2 scores it (an MXFP4 index K on SM90, ``csa2_scores``), its metadata comes from
    csa2's indexer backend, whose builder accepts ``mxfp4`` there."""

    #: Set by the layer when :class:`csa2_vllm.indexer.Csa2Indexer` writes and scores this cache.
    csa2_scores = False

    def get_kv_cache_spec(self, vllm_config):
        with _vllm_sees_v41_records():
            return super().get_kv_cache_spec(vllm_config)

    def get_attn_backend(self):
        return Csa2IndexerBackend if self.csa2_scores else super().get_attn_backend()


class Csa2Compressor(DeepseekCompressor):
    """vLLM's V4.1 compressor, publishing 288-B NVFP4 entries with csa2's portable writer
    (:func:`csa2_vllm.writers.nvfp4_insert`): vLLM's own packs E2M1 with SM100-only PTX. Other
    record widths go to vLLM's ``rope_quant_insert`` (portable Triton)."""

    def insert_cache(self, latent, positions, rotary_emb) -> None:
        import torch

        if latent is None:
            return
        kv_cache = self._static_forward_context[self.k_cache_prefix].kv_cache
        nvfp4 = _lib.record_format_named("nvfp4").record_bytes
        if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != nvfp4:
            return super().insert_cache(latent, positions, rotary_emb)
        md = get_forward_context().attn_metadata[self.k_cache_prefix]
        writers.nvfp4_insert(latent, positions, rotary_emb.cos_sin_cache, kv_cache,
                             md.slot_mapping, self.compress_ratio)


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
        with _vllm_sees_v41_records(), csa2_indexer.accepts_mxfp4_index_k():
            super().__init__(*args, **kwargs)
        if v41_records_by_csa2() and self.compressor is not None:
            # The compressor was built by vLLM's __init__; only its cache writer changes.
            self.compressor.__class__ = Csa2Compressor
        csa2_indexer.wire(self)

    def _indexer_cls(self, k_cache):
        # vLLM's index-K cache object, built just before this call, is this layer's; its spec is
        # asked later by the KV planner, outside the construction scope above.
        if k_cache is not None and type(k_cache) is DeepseekV4IndexerCache:
            k_cache.__class__ = Csa2IndexerCache
        ours = csa2_indexer.indexer_cls_for(k_cache)
        if ours is None:
            return super()._indexer_cls(k_cache)
        if isinstance(k_cache, Csa2IndexerCache):
            k_cache.csa2_scores = True
        return ours

    @property
    def packed_kv_cache_dtype(self) -> CacheDType:
        """What ``--kv-cache-dtype auto|fp8`` resolves to: csa2's FP4 compressed cache
        (``nvfp4_ds_mla``: 288-B NVFP4 entries beside the 528-B MXFP8 SWA record) on SM100 and
        SM90 (:func:`v41_records`); elsewhere the V4 584-B record, which csa2 reads too."""
        return "nvfp4_ds_mla" if v41_records() else "fp8_ds_mla"

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
        if md is None:  # warm-up dummy run (before any capture): nothing to attend
            self._csa2_warm_up(q)
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
        if q.is_cuda and not route.device_route(q):
            # A library built without the `cuda` feature (CSA2_ERR_NO_CUDA_BUILD): the earlier
            # host route, which no CUDA graph may capture (the metadata builders then declare
            # NEVER). Any other preload failure on a GPU has already raised in device_route.
            _check_not_capturing(q)
            csa2_attend(self, q[:t], positions[:t], swa_md, cmp_md, output[:t])
            return
        csa2_attend_pools(self, q[:t], positions[:t], swa_md, cmp_md, output[:t])

    def _csa2_warm_up(self, q) -> None:
        """On a GPU: loads every csa2 kernel function (``csa2_cuda_preload``) and allocates the
        error records now, so that neither happens inside a CUDA-graph capture; a CUDA build
        that cannot launch on this GPU raises here."""
        if q.is_cuda and route.device_route(q):
            for producer in route.errors.PRODUCERS:
                route.errors.tensor(producer, q.device)


def _check_not_capturing(x) -> None:
    import torch

    if torch.cuda.is_current_stream_capturing():
        raise _lib.Csa2Error(
            _lib.CSA2_ERR_NO_CUDA_BUILD,
            "this csa2 library was built without the `cuda` feature, so CSA2_RS attends on the "
            "host through copies, which a CUDA graph cannot capture; install the plugin with its "
            "CUDA build (docs/VLLM.md) or run with --compilation-config "
            "'{\"cudagraph_mode\": \"PIECEWISE\"}' or --enforce-eager",
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
