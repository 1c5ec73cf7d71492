"""The shim's device route, importable without vLLM: what the library can do on a device, the
per-token lists handed to ``csa2_attention_pools``, the MXFP4 index-Q quantiser, the pooled
indexer score and top-k, and the kernels' error records.

:mod:`csa2_vllm.attention` and :mod:`csa2_vllm.indexer` (which need vLLM) call these functions with
vLLM's metadata objects; the GPU check (tests/gpu/check_shim_route.py) calls the same functions
with plain tensors in their place, on a machine without vLLM.

**Which route.** A tensor on a CUDA device takes the device route when the loaded library can
launch there, decided once per device by :func:`cuda_support` (``csa2_cuda_preload``, which also
loads every kernel function before any CUDA-graph capture):

- ``CSA2_OK``: the device route; the metadata builders may declare ``UNIFORM_BATCH``
  (:func:`graph_support`);
- ``CSA2_ERR_NO_CUDA_BUILD`` (405, a library built without the ``cuda`` feature): attention takes
  the host route (gathers on the GPU, attention on the host; no CUDA graph may capture it, and the
  builders declare ``NEVER``); csa2's SM90 MXFP4 indexer has no host route and refuses to start
  (:func:`require_device_route`);
- anything else on a GPU — ``CSA2_ERR_CUDA_MODULE`` (406: a CUDA build whose kernel module does not
  load on this GPU), ``CSA2_ERR_UNSUPPORTED`` (402: no driver or device) — raises
  :class:`~csa2_vllm._lib.Csa2Error` with the library's message: never a silent host route.

**Error records.** On the device route a bad slot, block, position or request is not raised (the
kernels read no host state): the entry skips it and writes ``(code, row, column, value)`` into an
int32 ``(4,)`` error tensor. :data:`errors` owns one such tensor per (device, producer) —
``attention``, ``indexer``, ``topk`` — at fixed addresses, and :meth:`ErrorRecords.poll` reports
them (a warning on the ``csa2_vllm`` logger and a counter per producer) from the metadata
builders, which run on the host once per step outside any captured region.

**Host tensors as CUDA.** :func:`csa2_vllm._lib.present_host_as_cuda` describes CPU tensors as
``kDLCUDA`` device 0; with a library built with ``--features cuda-emu`` (the host SIMT harness,
docs/ARCHITECTURE.md) that runs every CUDA branch of this module on the CPU, which is how the
CPU tests and the GPU check's ``--emu`` mode exercise it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

import torch

from . import _lib
from . import indices as lists

log = logging.getLogger("csa2_vllm")

#: Values per MXFP4 block (docs/SPEC.md §1), index-head dimension, RoPE'd tail of it.
MXFP4_BLOCK = 32
INDEX_DIM = 128
ROPE_DIM = 64

#: The dtype of the decoded MXFP4 index queries the scorer hands ``csa2_indexer_logits_pool``
#: (:func:`mxfp4_index_q` writes them; every decoded value is exact in it). One contract for
#: both devices: the entry takes f32 and bf16 queries on the host and on CUDA alike.
INDEX_Q_DTYPE = torch.bfloat16

# ---- which route, and whether a graph may capture it -------------------------------------------


class CudaSupport(NamedTuple):
    """What ``csa2_cuda_preload`` answered for one device: ``status`` 0 when csa2's kernels are
    loaded there, else the ``Csa2Status`` and the library's message."""

    ordinal: int
    status: int
    message: str

    @property
    def launches(self) -> bool:
        return self.status == 0

    @property
    def no_cuda_build(self) -> bool:
        return self.status == _lib.CSA2_ERR_NO_CUDA_BUILD

    def describe(self) -> str:
        if self.launches:
            return f"CUDA device {self.ordinal}: csa2's kernels loaded"
        what = {
            _lib.CSA2_ERR_NO_CUDA_BUILD: "library built without the `cuda` feature",
            _lib.CSA2_ERR_CUDA_MODULE: "CUDA build, but its kernel module does not load here",
            _lib.CSA2_ERR_UNSUPPORTED: "no CUDA driver or device",
        }.get(self.status, "preload failed")
        return f"CUDA device {self.ordinal}: {what} (status {self.status}: {self.message})"


_SUPPORT: dict[int, CudaSupport] = {}
_SUPPORT_LOCK = threading.Lock()


def cuda_support(ordinal: int) -> CudaSupport:
    """``csa2_cuda_preload(ordinal)``'s answer, asked once per device and process (a success
    loads every kernel function, so nothing loads later inside a capture)."""
    with _SUPPORT_LOCK:
        got = _SUPPORT.get(ordinal)
        if got is None:
            try:
                _lib.cuda_preload(ordinal)
                got = CudaSupport(ordinal, 0, "")
            except _lib.Csa2Error as e:
                got = CudaSupport(ordinal, e.status, e.message)
            _SUPPORT[ordinal] = got
        return got


def on_device(x) -> bool:
    """Whether ``x`` is handed to the library as a CUDA tensor (a CUDA tensor, or a host tensor
    while :func:`csa2_vllm._lib.present_host_as_cuda` is active)."""
    return bool(x.is_cuda) or (x.device.type == "cpu" and _lib.presenting_host_as_cuda())


def ordinal_of(x) -> int:
    if x.is_cuda:
        return x.device.index if x.device.index is not None else torch.cuda.current_device()
    return 0


def stream_of(x) -> int:
    """The raw ``cudaStream_t`` of torch's current stream on ``x``'s device (0 for host tensors
    presented as CUDA: the emulated device's default stream)."""
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0


def device_route(x) -> bool:
    """Whether the call on ``x`` takes the device route (True), or the host route (False: host
    tensors, or a library built without the ``cuda`` feature). Raises for a GPU this CUDA build
    cannot launch on (see the module note)."""
    if not on_device(x):
        return False
    sup = cuda_support(ordinal_of(x))
    if sup.launches:
        return True
    if sup.no_cuda_build:
        return False
    raise _lib.Csa2Error(
        sup.status,
        f"{sup.describe()}; the csa2 library at {_lib.library_path()} cannot run its CUDA "
        "kernels on this GPU, and csa2 does not fall back to the host on a GPU (python -m "
        "csa2_vllm.doctor shows what was built and what the device is)")


def require_device_route(ordinal: int, what: str) -> None:
    """Raises unless csa2's kernels launch on CUDA device ``ordinal``: for pieces that have no
    host route (csa2's SM90 MXFP4 indexer), asked when the layer is built."""
    sup = cuda_support(ordinal)
    if not sup.launches:
        hint = ("install the plugin with its CUDA build (pip install ./python_shim with a CUDA "
                "compiler available, docs/VLLM.md) or set CSA2_LIB to a `--features cuda` build"
                if sup.no_cuda_build else "python -m csa2_vllm.doctor shows why")
        raise _lib.Csa2Error(
            sup.status, f"{what} runs on csa2's CUDA kernels only: {sup.describe()}; {hint}")


def current_ordinal() -> int | None:
    """The CUDA device in use, or None without one."""
    try:
        if torch.cuda.is_available():
            return torch.cuda.current_device()
    except Exception:  # noqa: BLE001  (a broken driver install reads as "no device")
        return None
    return None


def graph_support() -> str:
    """``"UNIFORM_BATCH"`` when csa2's kernels launch on the CUDA device in use (capture-safe
    lists, no host work), ``"NEVER"`` otherwise (no device, or the host route, which copies).
    The name of vLLM's ``AttentionCGSupport`` member the metadata builders declare."""
    ordinal = current_ordinal()
    if ordinal is None:
        return "NEVER"
    return "UNIFORM_BATCH" if cuda_support(ordinal).launches else "NEVER"


# ---- the kernels' error records ----------------------------------------------------------------


#: What ``code`` (error[0]) means per producer (kernels/attention.cu ``slot_of``, indexer.cu
#: ``pool_flag``, topk.cu).
_CODES = {
    "attention": {1: "compressed slot outside its pool", 2: "SWA slot outside its pool"},
    "indexer": {},
    "topk": {1: "negative position"},
}


class ErrorRecords:
    """The device error tensors of the CUDA entries, and their reading.

    ``tensor(producer, device)`` is a zeroed int32 ``(4,)`` tensor (one row of a per-device
    ``(producers, 4)`` buffer allocated on first use — vLLM's warm-up runs before any capture —
    and kept at its address). ``poll()`` runs on the host outside any capture: for a CUDA buffer
    it reads the pinned host copy made by the previous poll once that copy's event has completed
    (vLLM waits on each step's sampled tokens, so it has; nothing here synchronises), then
    enqueues the next copy and zeroes the buffer on the current stream; host buffers are read
    directly. A non-zero record is logged (``csa2_vllm`` logger, warning) and counted in
    ``counts[producer]``."""

    PRODUCERS = ("attention", "indexer", "topk")

    def __init__(self):
        self._lock = threading.Lock()
        self._buf: dict[str, torch.Tensor] = {}
        self._mirror: dict[str, tuple[torch.Tensor, Any]] = {}
        self.counts = {p: 0 for p in self.PRODUCERS}
        self.last: dict[str, tuple[int, int, int, int]] = {}

    def tensor(self, producer: str, device) -> torch.Tensor:
        key = str(device)
        buf = self._buf.get(key)
        if buf is None:
            with self._lock:
                buf = self._buf.get(key)
                if buf is None:
                    buf = torch.zeros(len(self.PRODUCERS), 4, dtype=torch.int32, device=device)
                    self._buf[key] = buf
        return buf[self.PRODUCERS.index(producer)]

    def _report(self, rows) -> list[tuple[str, tuple[int, int, int, int]]]:
        seen = []
        for producer, rec in zip(self.PRODUCERS, rows):
            rec = tuple(int(v) for v in rec)
            if rec[0] == 0:
                continue
            self.counts[producer] += 1
            self.last[producer] = rec
            what = _CODES[producer].get(rec[0], "bad value")
            log.warning("csa2 %s kernel skipped an entry: %s (code %d, row %d, column %d, "
                        "value %d); the host route raises for it", producer, what, *rec)
            seen.append((producer, rec))
        return seen

    def poll(self) -> list[tuple[str, tuple[int, int, int, int]]]:
        """Reports the records written since the last poll that are readable without a sync;
        returns ``[(producer, (code, row, column, value))]``. A no-op inside a capture."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return []
        seen = []
        with self._lock:
            for key, buf in self._buf.items():
                if not buf.is_cuda:
                    seen += self._report(buf.tolist())
                    buf.zero_()
                    continue
                torch.cuda.set_device(buf.device)
                pending = self._mirror.get(key)
                if pending is not None:
                    host, done = pending
                    if not done.query():
                        continue  # the previous copy has not run yet: read it next time
                    seen += self._report(host.tolist())
                else:
                    host = torch.zeros(buf.shape, dtype=buf.dtype, pin_memory=True)
                host.copy_(buf, non_blocking=True)
                buf.zero_()
                done = torch.cuda.Event()
                done.record()
                self._mirror[key] = (host, done)
        return seen


errors = ErrorRecords()

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



def score(op, q, w, positions, req, block_table) -> None:
    """Logits of T tokens over ``op.k_cache.kv_cache`` in place, candidates, then top-k into
    ``op.topk_indices_buffer`` (see :class:`csa2_vllm.indexer.Csa2SparseAttnIndexer`). ``req``
    (T,) the block-table row of each token (:func:`csa2_vllm.indices.request_rows`' rule);
    ``block_table`` (R, B) int32 of the index-K cache's group. ``q`` is :data:`INDEX_Q_DTYPE` as
    :func:`mxfp4_index_q` leaves it (f32 is taken too). On the device route the kernels record a
    bad request, block or position in :data:`errors` instead of raising."""
    pool = op.k_cache.kv_cache
    t = q.shape[0]
    ratio = op.compress_ratio
    n = block_table.shape[1] * pool.shape[1]
    device = q.device
    on_gpu = device_route(q)
    stream = stream_of(q) if on_gpu else 0
    # Elementwise guards instead of host checks: a padding token's request row and position are
    # clamped into range (its top-k is never read: its list length is 0).
    req32 = lists.request_rows(req, block_table.shape[0]).to(torch.int32)
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
    extra = {"stream": stream, "error": errors.tensor("indexer", device)} if on_gpu else {}
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
            _lib.topk_on_stream(lg, pos[lo:hi], ratio, dst, stream=stream,
                                error=errors.tensor("topk", device))
        else:
            _lib.topk(lg, pos[lo:hi], ratio, dst)
        if out is not None:
            topk[lo:hi, : op.topk_tokens].copy_(dst)


def pool_lists(layer, positions, swa_md, cmp_md, check: bool):
    """The per-token lists of ``csa2_attention_pools`` for the decode tokens, then the prefill
    tokens: ``[(lo, hi, main_idx, main_len, swa_idx, swa_len)]`` for token rows ``lo..hi``;
    ``main_*`` None for an SWA-only layer.

    Capture-safe when ``check`` is False: views of vLLM's persistent metadata buffers and
    elementwise torch ops with shapes fixed by the batch; no value is read on the host (a live
    top-k entry past the block table becomes ``indices.BAD_SLOT``, which the entry reports).
    ``check=True`` (host tensors) raises ``ValueError`` for such an entry instead."""
    nd, npf = swa_md.num_decode_tokens, swa_md.num_prefill_tokens
    ratio = layer.compress_ratio
    bs = cmp_md.block_size // ratio if ratio else 0
    req = swa_md.token_to_req_indices
    valid = swa_md.is_valid_token
    local = layer.topk_indices_buffer
    parts = []
    if nd:
        swa_idx = swa_md.decode_swa_indices[:nd].reshape(nd, -1)
        swa_len = swa_md.decode_swa_lens[:nd]
        m_idx = m_len = None
        if ratio:
            m_idx, m_len = lists.decode_topk_slots(local[:nd], req[:nd], cmp_md.block_table, bs,
                                                   valid[:nd], check)
        parts.append((0, nd, m_idx, m_len, swa_idx, swa_len))
    if npf:
        if swa_md.prefill_swa_indices is None or swa_md.prefill_swa_lens is None:
            raise ValueError("SWA metadata without prefill_swa_indices/lens for prefill tokens")
        swa_idx = swa_md.prefill_swa_indices[:npf].reshape(npf, -1)
        swa_len = swa_md.prefill_swa_lens[:npf]
        m_idx = m_len = None
        if ratio:
            # A prefill entry must lie in its request's compressed prefix (combine_topk_swa_indices).
            n_entries = swa_md.seq_lens.long() // ratio
            m_idx, m_len = lists.prefill_topk_slots(
                local[nd:nd + npf], req[nd:nd + npf], positions[nd:nd + npf], n_entries,
                cmp_md.block_table, bs, ratio, valid[nd:nd + npf], check)
        parts.append((nd, nd + npf, m_idx, m_len, swa_idx, swa_len))
    return [(lo, hi, mi, ml, _i32(si), _i32(sl)) for lo, hi, mi, ml, si, sl in parts]


def _i32(x):
    """``x`` as a compact int32 tensor (a no-op for vLLM's int32 metadata buffers)."""
    return x.to(torch.int32).contiguous()


def csa2_attend_pools(layer, q, positions, swa_md, cmp_md, output) -> None:
    """The attention of ``forward_mqa`` for ``T`` tokens (decode first), in place on the pools
    through ``csa2_attention_pools``; ``layer`` as in :func:`csa2_vllm.attention.csa2_attend`. Writes ``output``
    (T, padded heads, 512) bf16 (heads past ``n_local_heads`` zero)."""
    h = layer.n_local_heads
    swa_pool = layer.swa_cache_layer.kv_cache
    pool = None
    if layer.compress_ratio > 0:
        if cmp_md is None:
            raise KeyError(f"no compressed-cache metadata for {layer.compressed_cache_prefix}")
        pool = layer._compressed_kv_cache()
        if pool.shape[1] * layer.compress_ratio != cmp_md.block_size:
            raise ValueError(
                f"compressed cache holds {pool.shape[1]} entries per block, expected "
                f"{cmp_md.block_size} // {layer.compress_ratio}")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"csa2_attention_pools takes bf16 queries, got {q.dtype}")
    on_gpu = device_route(q)
    stream = stream_of(q) if on_gpu else 0
    error = errors.tensor("attention", q.device) if on_gpu else None
    sink = layer.attn_sink[:h].detach().float().contiguous()
    for lo, hi, m_idx, m_len, s_idx, s_len in pool_lists(layer, positions, swa_md, cmp_md,
                                                          check=not on_gpu):
        qs = q[lo:hi].contiguous()
        dst = output[lo:hi]
        tmp = dst if dst.is_contiguous() else torch.empty_like(qs)
        if m_idx is None:  # SWA-only layer: an empty compressed list (a view, no allocation)
            m_idx = s_idx[:, :0]
        _lib.attention_pools(qs, pool, m_idx, m_len, swa_pool, s_idx, s_len, sink, h,
                             float(layer.scale), tmp, error=error, stream=stream)
        if tmp is not dst:
            dst.copy_(tmp)
