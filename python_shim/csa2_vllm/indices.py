"""Per-token attention lists from vLLM's DeepSeek-V4.1 metadata, and compact record gathers.

vLLM hands a V4.1 attention layer its inputs as paged coordinates: the index-source layer's
indexer leaves *local* top-k entries (compressed-entry numbers of the request, −1 = none) in
``topk_indices_buffer``; the SWA metadata holds per-token SWA slot lists (``decode_swa_indices`` /
``prefill_swa_indices`` with their lengths). FlashMLA reads both straight out of the page pools. The
functions here turn them into what ``csa2_attention_indexed`` takes: two compact uint8 record arrays
(the referenced compressed entries and SWA rows, each gathered once) and per-token row lists into them.

Every function is plain torch on the tensors' own device, so the same code runs for CPU tensors and,
on a GPU node, gathers on the GPU and moves only the referenced records to the host.

Rules mirrored (vLLM 0.33, ``models/deepseek_v41/common/ops/cache_utils.py``):

- decode top-k (``compute_global_topk_indices_and_lens``): every entry ``j ≥ 0`` of the row maps to
  slot ``block_table[req, j // bs] · bs + j % bs`` (``bs`` = compressed entries per block); the
  length is the number of such entries, 0 for a padding token;
- prefill top-k (``combine_topk_swa_indices``): only the first ``min((p + 1) // ratio, K)`` entries
  count, an entry outside ``[0, N)`` (N = the request's compressed entries, ``seq_len // ratio``)
  is −1; the SWA part comes from ``prefill_swa_indices`` (the paged-coordinate lists vLLM builds for
  its paged-direct prefill), which already apply the window, bounded replay's floor and image spans.
"""

from __future__ import annotations

import torch

from . import _lib


def _by_width(dim: int | None = None) -> dict[int, "_lib.RecordFormat"]:
    """Record width (bytes per token) → the library's record format (``csa2_record_formats``;
    every width is distinct), optionally only the formats of ``dim`` values per row."""
    return {f.record_bytes: f for f in _lib.record_formats() if dim in (None, f.dim)}


def _pool_format(pool: torch.Tensor, what: str, dim: int | None = None) -> "_lib.RecordFormat":
    if pool.dtype != torch.uint8 or pool.dim() != 3:
        raise ValueError(
            f"{what}: expected a packed page pool (blocks, slots, record bytes) uint8, got "
            f"{tuple(pool.shape)} {pool.dtype}")
    known = _by_width(dim)
    fmt = known.get(pool.shape[-1])
    if fmt is None:
        raise ValueError(
            f"{what}: record width {pool.shape[-1]} B is none of "
            + ", ".join(f"{w} ({f.name}, {f.vllm_dtype})" for w, f in known.items()))
    return fmt


def record_format(pool: torch.Tensor, what: str) -> int:
    """The ``Csa2Format`` of a packed page pool ``(blocks, slots, record bytes)`` uint8 of 512-value
    records (the compressed and SWA caches: NVFP4 288 B, MXFP8 528 B, V4 584 B)."""
    return _pool_format(pool, what, dim=512).format_id


def request_rows(req: torch.Tensor, rows: int) -> torch.Tensor:
    """The one rule for a token's request id as a row of a per-request table (block table,
    entry counts) of ``rows`` rows: clamped into ``[0, rows)`` (int64), elementwise, no host
    read. An id outside the table belongs to a padding token (vLLM 0.33 maps padding to request
    0 today; a padded batch may carry −1 or a row past the table): its lists have length 0, so
    the row it reads is never used, and the gather stays inside the table on every device."""
    return req.long().clamp(0, max(rows, 1) - 1)


#: Slot value for a live entry that maps to no page (past the block table, or a −1 block): the
#: attention entry refuses it on the host and the CUDA kernel skips it and records it in its error
#: flag. Any value below −1 would do; −2 keeps the message short.
BAD_SLOT = -2


def _slots(local: torch.Tensor, live: torch.Tensor, req: torch.Tensor,
           block_table: torch.Tensor, bs: int, check: bool = True) -> torch.Tensor:
    """Global slots of local entries (−1 where not live).

    ``check=True`` (host tensors) raises ``ValueError`` for a live entry past the block table.
    ``check=False`` reads no value on the host (capture-safe: only elementwise ops and a gather
    with fixed shapes): such an entry, and one whose block-table entry is negative, becomes
    :data:`BAD_SLOT` for the attention entry to report."""
    j = torch.where(live, local, torch.zeros_like(local)).long()
    col = j // bs
    if check and live.any() and int(col.max()) >= block_table.shape[1]:
        raise ValueError(
            f"top-k entry {int(j.max())} is past the block table ({block_table.shape[1]} blocks of "
            f"{bs} compressed entries)")
    inside = col < block_table.shape[1]
    row = request_rows(req, block_table.shape[0])
    blocks = block_table[row[:, None], torch.where(inside, col, torch.zeros_like(col))].long()
    slots = blocks * bs + j % bs
    slots = torch.where(inside & (blocks >= 0), slots, torch.full_like(slots, BAD_SLOT))
    return torch.where(live, slots, torch.full_like(slots, -1)).to(torch.int32)


def decode_topk_slots(local: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor, bs: int,
                      valid: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows: ``local`` (T, K) int32 → (slots (T, K) int32, lens (T,) int32).

    A padding token (``valid`` False) gets length 0 and no slots: its row may hold stale entries
    of an earlier step, which vLLM's kernel never reads (it only zeroes the length). ``check`` as
    in :func:`_slots`."""
    live = (local >= 0) & valid[:, None]
    slots = _slots(local, live, req, block_table, bs, check)
    return slots, live.sum(1).to(torch.int32)


def prefill_topk_slots(local: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
                       n_entries: torch.Tensor, block_table: torch.Tensor, bs: int, ratio: int,
                       valid: torch.Tensor, check: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill rows: ``local`` (T, K) int32, ``req`` (T,) row of ``block_table`` and of
    ``n_entries`` (compressed entries per request) → (slots (T, K) int32, lens (T,) int32)."""
    k = local.shape[1]
    lens = ((positions.long() + 1) // ratio).clamp(0, k)
    lens = torch.where(valid, lens, torch.zeros_like(lens))
    col = torch.arange(k, device=local.device)
    n = n_entries.long()[request_rows(req, n_entries.shape[0])]
    live = (col[None, :] < lens[:, None]) & (local >= 0) & (local.long() < n[:, None])
    return _slots(local, live, req, block_table, bs, check), lens.to(torch.int32)


def compact(pool: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, what: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers the records a batch references, each once.

    ``pool`` (blocks, slots_per_block, record bytes) uint8 (any block stride), ``slots`` (T, K) int32
    global slots (−1 = none), ``lens`` (T,) valid length per row → ``(records (M, record bytes)
    uint8, rows (T, K) int32)`` on the host, ``rows`` indexing ``records`` (−1 = none, and every
    entry at or past the row's length). A listed slot outside the pool or below −1 raises
    ``ValueError``.
    """
    t, k = slots.shape
    col = torch.arange(k, device=slots.device)
    listed = col[None, :] < lens.long()[:, None]
    if bool((listed & (slots < -1)).any()):
        bad = int(slots[listed & (slots < -1)][0])
        raise ValueError(
            f"{what}: slot {bad} is negative (−1 is the only 'none'; a −1 block-table entry?)")
    live = (slots >= 0) & listed
    picked = slots[live].long()
    per_block = pool.shape[1]
    capacity = pool.shape[0] * per_block
    if picked.numel() and int(picked.max()) >= capacity:
        raise ValueError(
            f"{what}: slot {int(picked.max())} is outside the pool ({pool.shape[0]} blocks × "
            f"{per_block} slots)")
    uniq, inverse = torch.unique(picked, return_inverse=True)
    rows = torch.full_like(slots, -1)
    rows[live] = inverse.to(torch.int32)
    return gather_records(pool, uniq).cpu().contiguous(), rows.cpu().contiguous()


def _words(pool: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The pool's bytes as the widest integer words the view allows (the main/SWA widths and their
    data/scale parts are multiples of 8, the index-K ones of 4), so an indexed copy moves words,
    not single bytes; falls back to bytes when the pool's offset or strides do not allow it."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        try:
            return pool.view(dtype), size
        except RuntimeError:
            continue
    return pool, 1


def gather_records(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Records of ``slots`` (M,) int64 from a packed pool, as ``(M, record bytes)`` uint8 in csa2's
    record layout (data bytes, then scale bytes).

    The library's format table says how vLLM lays each record out: the V4.1 records (288, 528 B)
    are interleaved, each token's scales after its own data, so a record is one row of the pool.
    The V4 584-B page (and the index-K pages) are block-planar: the data bytes of every token of
    the block, then the scale bytes of every token (``_dequantize_and_gather_k_kernel``); the two
    parts are read from their regions and joined. Only the referenced bytes are read (no copy of
    the pool); block strides may be padded. An unknown width raises ``ValueError``.
    """
    fmt = _pool_format(pool, "pool")
    per_block, width = pool.shape[1], pool.shape[2]
    words, size = _words(pool)
    block, slot = slots // per_block, slots % per_block
    if not fmt.vllm_block_planar:
        if words.is_contiguous():
            flat = words.reshape(-1, words.shape[-1])
            return flat.index_select(0, slots).view(torch.uint8)
        return words[block, slot].view(torch.uint8)
    # The block's words as one row (the block stride may be padded past per_block × 584 bytes).
    row = per_block * width // size
    flat = words.as_strided((words.shape[0], row), (words.stride(0), 1))
    d, sc = fmt.data_bytes // size, fmt.scale_bytes // size
    data = slot[:, None] * d + torch.arange(d, device=pool.device)
    scale = per_block * d + slot[:, None] * sc + torch.arange(sc, device=pool.device)
    return flat[block[:, None], torch.cat([data, scale], 1)].view(torch.uint8)
