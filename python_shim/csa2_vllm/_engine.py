"""ctypes face of the engine exports (``csa2_engine_*`` in include/csa2.h): csa2's own 40-layer
stack (the Rust ``backend::Backend`` that ``csa2 run`` drives) with its KV cache, behind one handle.

``Engine.step`` takes one or more requests' rows (prefill chunks and decode tokens) with one token
id per row and returns the final hidden state of the step's output rows ``[rows, hidden_size]``
with the rows' positions and request ids. Tensors cross as borrowed DLPack descriptors
(``_lib.borrow``): a torch ``int32``/``int64`` token tensor is read where it lies, and the outputs
are written in place into torch tensors (numpy arrays when the tokens are not a torch tensor), or
into a caller's ``out``; nothing is copied on either side. Argument errors raise
:class:`csa2_vllm._lib.Csa2Error` with the library's message and leave the engine unchanged.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from . import _lib
from ._lib import _T, _Handle, _args, borrow, lib

__all__ = ["Engine", "Seq", "PREFILL", "DECODE", "SCALE_TINY", "SCALE_FULL", "CACHE_PAGED",
           "CACHE_CONTIGUOUS", "BACKEND_CSA2", "BACKEND_LAUNCH_DAY"]

SCALE_TINY, SCALE_FULL = 0, 1
BACKEND_CSA2, BACKEND_LAUNCH_DAY = 0, 1
CACHE_PAGED, CACHE_CONTIGUOUS = 0, 1
PREFILL, DECODE = 0, 1

_U64, _I32, _SZ = ctypes.c_uint64, ctypes.c_int32, ctypes.c_size_t
_VP = ctypes.c_void_p

EngineCreateArgs = _args("EngineCreateArgs", [
    ("scale", _I32), ("weights_dir", ctypes.c_char_p), ("seed", _U64), ("backend", _I32),
    ("no_decoder_replay", _I32), ("cache", _I32), ("num_blocks", _SZ)])


class _Seq(ctypes.Structure):
    _fields_ = [("req", _U64), ("first_pos", _U64), ("len", _U64), ("phase", _I32),
                ("prompt_end", _U64), ("prefill_start", _U64), ("replay_start", _U64),
                ("cached_until", _U64)]


EngineStepArgs = _args("EngineStepArgs", [
    ("seqs", ctypes.POINTER(_Seq)), ("n_seqs", _SZ), ("tokens", _T), ("hidden", _T),
    ("positions", _T), ("requests", _T)])


class EngineStats(ctypes.Structure):
    """``Csa2EngineStats``."""
    _fields_ = [(n, _U64) for n in ("requests", "main_bytes", "index_bytes", "global_allocated",
                                    "swa_bytes", "carry_bytes", "total_blocks", "used_blocks",
                                    "suspended")]


class EngineInfo(ctypes.Structure):
    """``Csa2EngineInfo``."""
    _fields_ = [("hidden_size", _U64), ("num_layers", _U64), ("window", _U64),
                ("decoder_replay", _I32), ("backend", _I32)]


_SIGNATURES = {
    "csa2_engine_create": ([ctypes.POINTER(EngineCreateArgs), ctypes.POINTER(_VP)], _I32),
    "csa2_engine_free": ([_VP], _I32),
    "csa2_engine_step": ([_VP, ctypes.POINTER(EngineStepArgs), ctypes.POINTER(_SZ)], _I32),
    "csa2_engine_free_request": ([_VP, _U64], _I32),
    "csa2_engine_suspend": ([_VP, _U64], _I32),
    "csa2_engine_resume": ([_VP, _U64, _I32], _I32),
    "csa2_engine_stats": ([_VP, ctypes.POINTER(EngineStats)], _I32),
    "csa2_engine_info": ([_VP, ctypes.POINTER(EngineInfo)], _I32),
}
_READY = False


def _lib_with_engine() -> ctypes.CDLL:
    global _READY
    h = lib()
    if not _READY:
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(h, name)
            fn.argtypes, fn.restype = args, res
        _READY = True
    return h


@dataclass
class Seq:
    """One request's rows of a step (``Csa2EngineSeq``; see ``replay::SeqStep`` for the rules)."""
    req: int
    first_pos: int
    len: int
    phase: int = PREFILL
    prompt_end: int = 0
    prefill_start: int = 0
    replay_start: int = 0
    cached_until: int = 0

    @staticmethod
    def prefill(req: int, first_pos: int, n: int, prompt_end: int | None = None) -> "Seq":
        """A cold prefill chunk of ``n`` rows at ``first_pos`` of a prompt ending at ``prompt_end``
        (default: the chunk's end)."""
        end = first_pos + n if prompt_end is None else prompt_end
        return Seq(req, first_pos, n, PREFILL, end, 0, 0, 0)

    @staticmethod
    def decode(req: int, pos: int) -> "Seq":
        """One generated token at ``pos``."""
        return Seq(req, pos, 1, DECODE, 0, 0, 0, pos)


class Engine(_Handle):
    """``Csa2Engine``: synthetic weights (``seed``) or a checkpoint directory, CSA2 or launch-day
    backend, paged (``num_blocks`` of 256 tokens) or contiguous cache."""

    _free = "csa2_engine_free"

    def __init__(self, *, scale: int = SCALE_TINY, weights_dir: str | None = None, seed: int = 1,
                 backend: int = BACKEND_CSA2, decoder_replay: bool = True,
                 cache: int = CACHE_PAGED, num_blocks: int = 64):
        h = _lib_with_engine()
        args = EngineCreateArgs(scale=scale, weights_dir=weights_dir.encode() if weights_dir else None,
                                seed=seed, backend=backend, no_decoder_replay=int(not decoder_replay),
                                cache=cache, num_blocks=num_blocks)
        out = _VP()
        _lib.check(h.csa2_engine_create(ctypes.byref(args), ctypes.byref(out)), "csa2_engine_create")
        super().__init__(out.value)

    def info(self) -> EngineInfo:
        i = EngineInfo()
        _lib.check(_lib_with_engine().csa2_engine_info(self.handle, ctypes.byref(i)),
                   "csa2_engine_info")
        return i

    def stats(self) -> EngineStats:
        s = EngineStats()
        _lib.check(_lib_with_engine().csa2_engine_stats(self.handle, ctypes.byref(s)),
                   "csa2_engine_stats")
        return s

    def step(self, seqs: list[Seq], tokens, *, out=None):
        """Runs one step; returns (hidden ``[rows, d]``, positions ``int64 [rows]``, request ids
        ``[rows]``) of the output rows.

        ``tokens``: ``[T]`` int32 or int64 ids, compact (a torch tensor or numpy array, read in
        place; other numpy integer arrays and sequences become an int64 copy); the library refuses
        other dtypes and strides.
        ``out``: an optional ``[rows, d]`` float32 / bfloat16 / float16 tensor to write the hidden
        state into (then no count-only call is made); by default a float32 tensor of the tokens'
        kind is made. Request ids come back as ``uint64`` for numpy and as ``int64`` (the same
        bits) for torch."""
        h = _lib_with_engine()
        arr = (_Seq * len(seqs))(*[_Seq(s.req, s.first_pos, s.len, s.phase, s.prompt_end,
                                        s.prefill_start, s.replay_start, s.cached_until)
                                   for s in seqs])
        torch_kind = type(tokens).__module__.startswith("torch")
        if not torch_kind:
            tokens = np.asarray(tokens)
            if tokens.dtype.kind in "ui" and tokens.dtype not in (np.int32, np.int64):
                # uint32 ids (or a list): the library reads int32 / int64, so this one copies.
                tokens = tokens.astype(np.int64)
        tok = borrow(tokens)
        args = EngineStepArgs(seqs=arr, n_seqs=len(seqs), tokens=tok.ptr)
        rows = _SZ()
        if out is None:
            _lib.check(h.csa2_engine_step(self.handle, ctypes.byref(args), ctypes.byref(rows)),
                       "csa2_engine_step")
            n, d = rows.value, self.info().hidden_size
            out = _empty((n, d), "float32", torch_kind)
        n = out.shape[0] if len(out.shape) else 0
        pos, req = _empty((n,), "int64", torch_kind), _empty((n,), "int64", torch_kind)
        keep = [borrow(out), borrow(pos), borrow(req)]
        args.hidden, args.positions, args.requests = (b.ptr for b in keep)
        _lib.check(h.csa2_engine_step(self.handle, ctypes.byref(args), ctypes.byref(rows)),
                   "csa2_engine_step")
        return out, pos, (req if torch_kind else req.view(np.uint64))

    def free_request(self, req: int) -> None:
        _lib.check(_lib_with_engine().csa2_engine_free_request(self.handle, req),
                   "csa2_engine_free_request")

    def suspend(self, req: int) -> None:
        """End of a turn: keep the encoder windows and carries aside, drop the live ones."""
        _lib.check(_lib_with_engine().csa2_engine_suspend(self.handle, req), "csa2_engine_suspend")

    def resume(self, req: int, restore: bool) -> None:
        """Next turn: restore what ``suspend`` kept (a snapshot hit) or discard it (a miss)."""
        _lib.check(_lib_with_engine().csa2_engine_resume(self.handle, req, int(restore)),
                   "csa2_engine_resume")


def _empty(shape: tuple, dtype: str, torch_kind: bool):
    """An uninitialised output the library fills (every element is written on success)."""
    if torch_kind:
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype))
    return np.empty(shape, dtype=dtype)
