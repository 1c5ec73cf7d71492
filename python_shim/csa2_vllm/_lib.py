"""ctypes face of the csa2 C ABI (``include/csa2.h``) and the DLPack descriptors it takes.

The library is loaded once per process, on first use: ``$CSA2_LIB`` if set (a path to another
``libcsa2.so`` build, e.g. one with the ``cuda`` feature), otherwise the copy bundled in this package
by ``pip install``. Every fallible call returns a status; a non-zero status raises :class:`Csa2Error`
carrying the library's own message (read from its thread-local last error on the calling thread).

Tensors cross the boundary as borrowed ``DLTensor`` descriptors built here from numpy arrays or
torch tensors. The descriptor and its shape array live in a :class:`Borrowed` object that the caller
keeps alive for the duration of the call; csa2 never retains a pointer past the call. Host memory
(numpy, CPU tensors) always works; CUDA tensors are described as ``kDLCUDA`` and are refused with a
clear error by a build without CUDA support.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading
from typing import Any, NamedTuple, Sequence

__all__ = [
    "Csa2Error",
    "CSA2_OK",
    "CSA2_ERR_UNSUPPORTED",
    "CSA2_ERR_NO_CUDA_BUILD",
    "CSA2_ERR_CUDA_MODULE",
    "present_host_as_cuda",
    "presenting_host_as_cuda",
    "DLDevice",
    "DLDataType",
    "DLTensor",
    "Borrowed",
    "borrow",
    "lib",
    "library_path",
    "version",
    "Geometry",
    "Cache",
    "CacheLayerInfo",
    "CompressorState",
    "RECORD_MAIN",
    "RECORD_INDEX",
    "compress",
    "indexer_logits",
    "indexer_logits_in_blocks",
    "attention",
    "attention_indexed",
    "FORMAT_NVFP4",
    "FORMAT_MXFP8",
    "FORMAT_V4",
    "format_info",
    "RecordFormat",
    "record_formats",
    "record_format_named",
    "encode_rows",
    "decode_rows",
]


class Csa2Error(RuntimeError):
    """A csa2 call failed. ``status`` is the ``Csa2Status`` code, ``message`` the library's text
    (it names the function, the argument, what was expected and what was found)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"[csa2 status {status}] {message}")
        self.status = status
        self.message = message


#: ``Csa2Status`` codes the shim tells apart (include/csa2.h).
CSA2_OK = 0
CSA2_ERR_UNSUPPORTED = 402  # no CUDA driver or device, or an input the build does not take
CSA2_ERR_NO_CUDA_BUILD = 405  # the library was built without the `cuda` feature
CSA2_ERR_CUDA_MODULE = 406  # a CUDA build whose kernel module does not load on this GPU

_HOST_AS_CUDA = threading.local()


@contextlib.contextmanager
def present_host_as_cuda():
    """While active (on this thread), CPU torch tensors are described to the library as
    ``kDLCUDA`` device 0. With a library built with ``--features cuda-emu`` (the host SIMT harness,
    whose "device memory" is host memory) the CUDA branch of every entry then runs for real on the
    CPU; :mod:`csa2_vllm.route` takes its device route for such tensors. For tests and the GPU
    check's ``--emu`` mode; a real CUDA build refuses the host pointers."""
    saved = getattr(_HOST_AS_CUDA, "on", False)
    _HOST_AS_CUDA.on = True
    try:
        yield
    finally:
        _HOST_AS_CUDA.on = saved


def presenting_host_as_cuda() -> bool:
    return getattr(_HOST_AS_CUDA, "on", False)


# ---- DLPack mirror (dlpack.h v1.x; checked against the header by the crate's tests) -------------

K_DL_CPU = 1
K_DL_CUDA = 2
K_DL_INT, K_DL_UINT, K_DL_FLOAT, K_DL_BFLOAT = 0, 1, 2, 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class Borrowed:
    """A ``DLTensor`` describing someone else's memory, plus everything that must outlive the call
    (the shape/stride arrays and a reference to the array or tensor itself)."""

    __slots__ = ("desc", "_shape", "_strides", "_owner")

    def __init__(self, data: int, shape: Sequence[int], strides: Sequence[int] | None,
                 code: int, bits: int, device_type: int, device_id: int, owner: Any):
        nd = len(shape)
        self._shape = (ctypes.c_int64 * max(nd, 1))(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * max(nd, 1))(*strides)
        self._owner = owner
        self.desc = DLTensor(
            data=data or None,
            device=DLDevice(device_type, device_id),
            ndim=nd,
            dtype=DLDataType(code, bits, 1),
            shape=ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64)),
            strides=(None if self._strides is None
                     else ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))),
            byte_offset=0,
        )

    @property
    def ptr(self) -> "ctypes._Pointer[DLTensor]":
        """``DLTensor*`` to pass to a csa2 function."""
        return ctypes.pointer(self.desc)


_NP_CODES = {
    "float32": (K_DL_FLOAT, 32), "float16": (K_DL_FLOAT, 16), "bfloat16": (K_DL_BFLOAT, 16),
    "uint8": (K_DL_UINT, 8), "int32": (K_DL_INT, 32), "int64": (K_DL_INT, 64),
}


def borrow(x: Any) -> Borrowed:
    """Describes a numpy array or a torch tensor as a ``DLTensor`` (no copy).

    Strides are passed through as they are: csa2 requires compact row-major layout and says so
    (naming the argument) when it is not met, rather than this layer copying silently.
    Raises ``TypeError`` for anything else and for element types csa2 does not read.
    """
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch  # only when a tensor is actually passed

        name = str(x.dtype).removeprefix("torch.")
        if name not in _NP_CODES:
            raise TypeError(f"csa2 does not take torch.{name} tensors (takes {sorted(_NP_CODES)})")
        code, bits = _NP_CODES[name]
        dev = x.device
        if dev.type == "cpu":
            dt, di = (K_DL_CUDA, 0) if presenting_host_as_cuda() else (K_DL_CPU, 0)
        elif dev.type == "cuda":
            dt, di = K_DL_CUDA, dev.index if dev.index is not None else torch.cuda.current_device()
        else:
            raise TypeError(f"csa2 does not take tensors on device {dev}")
        # data_ptr() already includes the storage offset, so byte_offset stays 0.
        return Borrowed(x.data_ptr(), list(x.shape), list(x.stride()), code, bits, dt, di, x)
    if mod == "numpy":
        name = x.dtype.name
        if name not in _NP_CODES:
            raise TypeError(f"csa2 does not take numpy {name} arrays (takes {sorted(_NP_CODES)})")
        code, bits = _NP_CODES[name]
        item = x.dtype.itemsize
        if any(s % item for s in x.strides):
            raise TypeError(f"numpy strides {x.strides} are not multiples of the item size {item}")
        return Borrowed(x.ctypes.data, list(x.shape), [s // item for s in x.strides],
                        code, bits, K_DL_CPU, 0, x)
    raise TypeError(f"expected a numpy array or a torch tensor, got {type(x).__name__}")


# ---- the library -------------------------------------------------------------------------------

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_PATH: str | None = None

_T = ctypes.POINTER(DLTensor)
_C_STATUS = ctypes.c_int32

_U32, _I32, _SZ = ctypes.c_uint32, ctypes.c_int32, ctypes.c_size_t


class _Args(ctypes.Structure):
    """Base of the ``Csa2*Args`` mirrors (include/csa2.h, "Args structs"): every member starts at
    zero and ``struct_size`` is this mirror's size, so the library reads exactly the members named
    here. Members are keyword arguments; a tensor member takes a ``DLTensor*`` (or ``None``)."""

    def __init__(self, **members: Any):
        super().__init__(**members)
        self.struct_size = ctypes.sizeof(self)


def _args(name: str, members: list) -> type:
    return type(name, (_Args,), {"_fields_": [("struct_size", _SZ)] + members,
                                 "__doc__": f"``Csa2{name}`` (include/csa2.h)."})


AttentionArgs = _args("AttentionArgs", [
    ("q", _T), ("main_kv", _T), ("main_format", _I32), ("swa", _T), ("swa_format", _I32),
    ("topk", _T), ("topk_len", _T), ("positions", _T), ("replay_start", _T), ("sink", _T),
    ("window", _U32), ("ratio", _U32), ("scale", ctypes.c_float), ("out", _T), ("lse", _T)])
AttentionIndexedArgs = _args("AttentionIndexedArgs", [
    ("q", _T), ("main_kv", _T), ("main_format", _I32), ("main_idx", _T), ("main_len", _T),
    ("swa_kv", _T), ("swa_format", _I32), ("swa_idx", _T), ("swa_len", _T), ("sink", _T),
    ("scale", ctypes.c_float), ("out", _T), ("lse", _T)])
MhcArgs = _args("MhcArgs", [("params", ctypes.c_void_p)] + [(n, _T) for n in (
    "x", "y", "post", "comb", "pre_prev", "hc_fn", "hc_base", "hc_scale", "norm", "x_new",
    "layer_in", "pre_out", "post_out", "comb_out")])
CompressArgs = _args("CompressArgs", [
    ("geometry", ctypes.c_void_p), ("layer", _U32), ("kv", _T), ("score", _T), ("norm", _T),
    ("wk", _T), ("k_norm", _T), ("start_pos", ctypes.c_int64), ("main_kv_out", _T),
    ("index_k_out", _T)])
CompressStepArgs = _args("CompressStepArgs", [
    ("geometry", ctypes.c_void_p), ("layer", _U32), ("state", ctypes.c_void_p), ("kv", _T),
    ("score", _T), ("norm", _T), ("wk", _T), ("k_norm", _T), ("main_kv_out", _T),
    ("index_k_out", _T), ("first_entry", ctypes.POINTER(ctypes.c_uint64))])
IndexerLogitsArgs = _args("IndexerLogitsArgs", [
    ("q", _T), ("w", _T), ("positions", _T), ("keys", _T), ("ratio", _U32), ("q_quant", _I32),
    ("logits_out", _T)])
IndexerLogitsInBlocksArgs = _args("IndexerLogitsInBlocksArgs", [
    ("q", _T), ("w", _T), ("positions", _T), ("keys", _T), ("blocks", _T), ("ratio", _U32),
    ("block_size", _U32), ("q_quant", _I32), ("logits_out", _T)])
CacheCreateArgs = _args("CacheCreateArgs", [
    ("geometry", ctypes.c_void_p), ("layout", _I32), ("num_blocks", _SZ), ("block_tokens", _SZ),
    ("model", ctypes.c_char_p), ("model_len", _SZ)])


def _p(struct: type) -> Any:
    return ctypes.POINTER(struct)


# name -> (argtypes, restype). Mirrors include/csa2.h; tests/test_lib.py checks each symbol exists.
SIGNATURES: dict[str, tuple[list, Any]] = {
    "csa2_version": ([], ctypes.c_char_p),
    "csa2_last_error_message": ([ctypes.c_char_p, ctypes.c_size_t], ctypes.c_size_t),
    "csa2_dlpack_describe": ([_T, ctypes.c_char_p, ctypes.c_size_t], _C_STATUS),
    "csa2_geometry_embedded": ([ctypes.POINTER(ctypes.c_void_p)], _C_STATUS),
    "csa2_geometry_free": ([ctypes.c_void_p], _C_STATUS),
    "csa2_rope": ([ctypes.c_void_p, ctypes.c_uint32, _T, _T, ctypes.c_int32], _C_STATUS),
    "csa2_compress": ([_p(CompressArgs)], _C_STATUS),
    "csa2_indexer_logits": ([_p(IndexerLogitsArgs)], _C_STATUS),
    "csa2_topk": ([_T, _T, ctypes.c_uint32, _T, _T], _C_STATUS),
    "csa2_candidates": ([_T, _T, ctypes.c_uint32, ctypes.c_uint32, _T], _C_STATUS),
    "csa2_attention": ([_p(AttentionArgs)], _C_STATUS),
    "csa2_attention_indexed": ([_p(AttentionIndexedArgs)], _C_STATUS),
    "csa2_mhc": ([_p(MhcArgs)], _C_STATUS),
    "csa2_indexer_logits_in_blocks": ([_p(IndexerLogitsInBlocksArgs)], _C_STATUS),
    # KV cache manager (src/ffi/cache.rs) and its record-level access (src/ffi/records.rs).
    "csa2_cache_create": ([_p(CacheCreateArgs), ctypes.POINTER(ctypes.c_void_p)], _C_STATUS),
    "csa2_cache_free": ([ctypes.c_void_p], _C_STATUS),
    "csa2_cache_add_request": ([ctypes.c_void_p, ctypes.c_uint64], _C_STATUS),
    "csa2_cache_allocate": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t], _C_STATUS),
    "csa2_cache_free_request": ([ctypes.c_void_p, ctypes.c_uint64], _C_STATUS),
    "csa2_cache_prefix_keys": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_size_t,
                                ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
                               _C_STATUS),
    "csa2_cache_publish": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t,
                            ctypes.POINTER(ctypes.c_size_t)], _C_STATUS),
    "csa2_cache_adopt_prefix": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p,
                                 ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)], _C_STATUS),
    "csa2_cache_slot_mapping": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                 ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64)],
                                _C_STATUS),
    "csa2_cache_layer_info": ([ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p], _C_STATUS),
    "csa2_cache_write_entries": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                                  ctypes.c_int32, _T, _T], _C_STATUS),
    "csa2_cache_read_entries": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                                 ctypes.c_int32, _T, _T], _C_STATUS),
    "csa2_cache_swa_write": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64,
                              _T], _C_STATUS),
    "csa2_cache_swa_read": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64,
                             _T], _C_STATUS),
    "csa2_cache_swa_newest": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                               ctypes.POINTER(ctypes.c_int64)], _C_STATUS),
    "csa2_cache_set_compressor_state": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, _T],
                                        _C_STATUS),
    "csa2_cache_get_compressor_state": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, _T,
                                         ctypes.POINTER(ctypes.c_int32)], _C_STATUS),
    # Stateful compressor (src/ffi/compressor.rs).
    "csa2_compressor_state_create": ([ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64,
                                      ctypes.POINTER(ctypes.c_void_p)], _C_STATUS),
    "csa2_compressor_state_free": ([ctypes.c_void_p], _C_STATUS),
    "csa2_compressor_state_reset": ([ctypes.c_void_p, ctypes.c_uint64], _C_STATUS),
    "csa2_compressor_state_query": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                                     ctypes.POINTER(ctypes.c_uint64),
                                     ctypes.POINTER(ctypes.c_uint32)], _C_STATUS),
    "csa2_compress_step": ([_p(CompressStepArgs)], _C_STATUS),
    "csa2_compressor_state_save": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64], _C_STATUS),
    "csa2_compressor_state_load": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
                                    ctypes.c_uint64], _C_STATUS),
    # Record formats and codecs (src/ffi/formats.rs).
    "csa2_record_formats": ([ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                             ctypes.POINTER(ctypes.c_size_t)], _C_STATUS),
    "csa2_format_info": ([ctypes.c_int32, ctypes.c_void_p], _C_STATUS),
    "csa2_encode_rows": ([ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                          ctypes.c_size_t], _C_STATUS),
    "csa2_decode_rows": ([ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                          ctypes.c_size_t], _C_STATUS),
}


def library_path() -> str:
    """Path of the library that is (or would be) loaded: ``$CSA2_LIB``, else the bundled copy."""
    env = os.environ.get("CSA2_LIB")
    if env:
        if not os.path.isfile(env):
            raise Csa2Error(-1, f"CSA2_LIB={env!r} is not a file")
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_csa2*.so")) + glob.glob(os.path.join(here, "_csa2*.dylib")))
    if not found:
        raise Csa2Error(-1, "no bundled csa2 library next to csa2_vllm (install with `pip install "
                            "./python_shim` from the csa2 repository, or set CSA2_LIB)")
    return found[0]


def lib() -> ctypes.CDLL:
    """The loaded library (loaded once, thread-safely), with every signature in ``SIGNATURES``."""
    global _LIB, _PATH
    if _LIB is not None:
        return _LIB
    with _LOCK:
        if _LIB is None:
            path = library_path()
            handle = ctypes.CDLL(path)
            for name, (args, res) in SIGNATURES.items():
                fn = getattr(handle, name)
                fn.argtypes = args
                fn.restype = res
            _PATH, _LIB = path, handle
    return _LIB


def last_error() -> str:
    """The calling thread's last csa2 error text ('' if none)."""
    f = lib().csa2_last_error_message
    n = f(None, 0)
    if n == 0:
        return ""
    buf = ctypes.create_string_buffer(n)
    f(buf, n)
    return buf.value.decode("utf-8", errors="replace")


def check(status: int, fn: str) -> None:
    """Raises :class:`Csa2Error` with the library's message when ``status`` is not ``CSA2_OK``."""
    if status != 0:
        raise Csa2Error(status, last_error() or f"{fn} failed with status {status} (no message)")


def call(fn: str, *args: Any) -> None:
    """Calls ``fn`` (a status-returning export) and raises on failure."""
    check(getattr(lib(), fn)(*args), fn)


def version() -> str:
    """The library version string."""
    return lib().csa2_version().decode()


def describe(x: Any) -> str:
    """What csa2 sees for ``x`` after its DLPack validation, e.g. ``"float32[2, 3] host"``.

    Raises :class:`Csa2Error` with csa2's reason when the descriptor would be refused by an op."""
    b = borrow(x)
    buf = ctypes.create_string_buffer(256)
    call("csa2_dlpack_describe", b.ptr, buf, len(buf))
    return buf.value.decode()


# ---- ops (src/ffi/ops.rs; shapes and conventions are documented there and in include/csa2.h) -----

class MhcParams(ctypes.Structure):
    """``Csa2MhcParams``: pass ``None`` instead for the V4.1 values (2.0, 20, 1e-6, 1e-20)."""

    _fields_ = [("post_mult", ctypes.c_float), ("sinkhorn_iters", ctypes.c_uint32),
                ("hc_eps", ctypes.c_float), ("rms_eps", ctypes.c_float)]


def _ptr(x: Any) -> tuple[Any, Any]:
    """(keep-alive, ``DLTensor*`` or None) for an optional tensor."""
    if x is None:
        return None, None
    b = borrow(x)
    return b, b.ptr


def _call_tensors(fn: str, build) -> None:
    keep: list = []

    def t(x):
        b, p = _ptr(x)
        keep.append(b)
        return p

    call(fn, *build(t))


def indexer_logits(q, w, positions, keys, ratio: int, q_quant: int, out) -> None:
    """``csa2_indexer_logits`` into ``out`` (T, N). ``q_quant``: 0 none, 1 MXFP4, 2 FP8."""
    _call_tensors("csa2_indexer_logits", lambda t: (ctypes.byref(IndexerLogitsArgs(
        q=t(q), w=t(w), positions=t(positions), keys=t(keys), ratio=ratio, q_quant=q_quant,
        logits_out=t(out))),))


def mhc(x, pre_prev, norm, x_new, layer_in, *, y=None, post=None, comb=None, hc_fn=None,
        hc_base=None, hc_scale=None, pre_out=None, post_out=None, comb_out=None,
        params: MhcParams | None = None) -> None:
    """``csa2_mhc``: one mHC boundary (post update when ``y/post/comb`` are given, shifted collapse +
    RMSNorm into ``layer_in``, next coefficients when ``hc_fn/hc_base/hc_scale`` are given)."""
    pp = None if params is None else ctypes.addressof(params)
    _call_tensors("csa2_mhc", lambda t: (ctypes.byref(MhcArgs(
        params=pp, x=t(x), y=t(y), post=t(post), comb=t(comb), pre_prev=t(pre_prev),
        hc_fn=t(hc_fn), hc_base=t(hc_base), hc_scale=t(hc_scale), norm=t(norm), x_new=t(x_new),
        layer_in=t(layer_in), pre_out=t(pre_out), post_out=t(post_out),
        comb_out=t(comb_out))),))


def attention(q, main_kv, swa, topk, positions, sink, out, lse, *, main_format: int = 0,
              swa_format: int = 2, topk_len=None, replay_start=None, window: int = 128,
              ratio: int = 0, scale: float = 0.0) -> None:
    """``csa2_attention`` into ``out`` (T, H, 512) and ``lse`` (T, H)."""
    _call_tensors("csa2_attention", lambda t: (ctypes.byref(AttentionArgs(
        q=t(q), main_kv=t(main_kv), main_format=main_format, swa=t(swa), swa_format=swa_format,
        topk=t(topk), topk_len=t(topk_len), positions=t(positions),
        replay_start=t(replay_start), sink=t(sink), window=window, ratio=ratio, scale=scale,
        out=t(out), lse=t(lse))),))


def attention_indexed(q, main_kv, main_idx, swa_kv, swa_idx, sink, out, lse, *, main_len=None,
                      swa_len=None, main_format: int = 0, swa_format: int = 2,
                      scale: float = 0.0) -> None:
    """``csa2_attention_indexed`` into ``out`` (T, H, 512) and ``lse`` (T, H): FlashMLA's sparse
    contract over explicit slot lists. Per token, one softmax over ``main_kv[main_idx[t,
    :main_len[t]]]`` then ``swa_kv[swa_idx[t, :swa_len[t]]]`` (int32 lists, −1 skipped, lengths
    clamped to [0, K], ``None`` = whole row) plus the sink in the denominator. Pools are float
    ``(N, 512)`` or uint8 ``(N, record_bytes)`` records in ``main_format`` / ``swa_format``
    (``FORMAT_*``); either may have 0 rows. ``scale`` ≤ 0 means 512^-0.5."""
    _call_tensors("csa2_attention_indexed", lambda t: (ctypes.byref(AttentionIndexedArgs(
        q=t(q), main_kv=t(main_kv), main_format=main_format, main_idx=t(main_idx),
        main_len=t(main_len), swa_kv=t(swa_kv), swa_format=swa_format, swa_idx=t(swa_idx),
        swa_len=t(swa_len), sink=t(sink), scale=scale, out=t(out), lse=t(lse))),))


# ---- record codecs (the Csa2Format values of include/csa2.h) -----------------------------------

# ``FORMAT_NVFP4``, ``FORMAT_MXFP8``, ``FORMAT_V4`` (and ``POOL_INTERLEAVED`` /
# ``POOL_BLOCK_PLANAR`` below) are the library's own numbers, read from its record-format table on
# first use (module ``__getattr__`` at the end of this section), never written here.
_FORMAT_CONSTANTS = {"FORMAT_NVFP4": "nvfp4", "FORMAT_MXFP8": "mxfp8", "FORMAT_V4": "v4",
                     "FORMAT_MXFP4": "mxfp4", "FORMAT_FP8_INDEX": "fp8index"}


class FormatInfo(ctypes.Structure):
    """``Csa2FormatInfo``: values per row and bytes per record of one ``Csa2Format``."""

    _fields_ = [("dim", ctypes.c_size_t), ("data_bytes", ctypes.c_size_t),
                ("scale_bytes", ctypes.c_size_t), ("record_bytes", ctypes.c_size_t)]


class _RecordFormatEntry(ctypes.Structure):
    """``Csa2RecordFormatEntry`` (include/csa2.h)."""

    _fields_ = [("format_id", ctypes.c_int32), ("name", ctypes.c_char_p),
                ("vllm_dtype", ctypes.c_char_p), ("dim", ctypes.c_size_t),
                ("data_bytes", ctypes.c_size_t), ("scale_bytes", ctypes.c_size_t),
                ("record_bytes", ctypes.c_size_t), ("vllm_block_planar", ctypes.c_uint8),
                ("vllm_pool_layout", ctypes.c_int32)]


class RecordFormat(NamedTuple):
    """One row of the library's record-format table (``csa2_record_formats``)."""

    format_id: int
    """The ``Csa2Format`` value."""
    name: str
    """csa2's name: ``nvfp4``, ``mxfp4``, ``mxfp8``, ``v4``, ``fp8index``."""
    vllm_dtype: str
    """The vLLM setting that selects the record (``nvfp4_ds_mla``, ``fp8_ds_mla``, ``mxfp4``,
    ``fp8``)."""
    dim: int
    data_bytes: int
    scale_bytes: int
    record_bytes: int
    vllm_block_planar: bool
    """True when vLLM's pages hold the record block-planar (all slots' data, then all slots'
    scales); False when a record is one row of the page."""
    vllm_pool_layout: int
    """The ``Csa2PoolLayout`` of vLLM's pages for this record (``Csa2Pool.layout``)."""


_FORMATS: list[RecordFormat] | None = None


def record_formats() -> list[RecordFormat]:
    """The library's record-format table, in ``Csa2Format`` order (asked once per process)."""
    global _FORMATS
    if _FORMATS is None:
        n = ctypes.c_size_t()
        size = ctypes.sizeof(_RecordFormatEntry)
        call("csa2_record_formats", None, 0, size, ctypes.byref(n))
        table = (_RecordFormatEntry * n.value)()
        call("csa2_record_formats", table, n.value, size, ctypes.byref(n))
        _FORMATS = [RecordFormat(e.format_id, e.name.decode(), e.vllm_dtype.decode(), e.dim,
                                 e.data_bytes, e.scale_bytes, e.record_bytes,
                                 bool(e.vllm_block_planar), e.vllm_pool_layout) for e in table]
    return _FORMATS


def record_format_named(name: str) -> RecordFormat:
    """The library's table row of the record called ``name`` (``nvfp4``, ``mxfp4``, ``mxfp8``,
    ``v4``, ``fp8index``); ``KeyError`` naming the known ones otherwise."""
    for f in record_formats():
        if f.name == name:
            return f
    raise KeyError(f"no record format {name!r} in the library's table "
                   f"({', '.join(f.name for f in record_formats())})")


def _pool_layout(block_planar: bool) -> int:
    """The ``Csa2PoolLayout`` id the library gives vLLM pages that are (not) block-planar."""
    return next(f.vllm_pool_layout for f in record_formats()
                if f.vllm_block_planar == block_planar)


def __getattr__(name: str) -> int:
    # PEP 562: the id constants are asked of the library when first read, so importing this
    # module still loads nothing.
    if name in _FORMAT_CONSTANTS:
        return record_format_named(_FORMAT_CONSTANTS[name]).format_id
    if name == "POOL_INTERLEAVED":
        return _pool_layout(False)
    if name == "POOL_BLOCK_PLANAR":
        return _pool_layout(True)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def format_info(format_id: int) -> FormatInfo:
    """``csa2_format_info``."""
    info = FormatInfo()
    call("csa2_format_info", format_id, ctypes.byref(info))
    return info


def encode_rows(format_id: int, x):
    """``csa2_encode_rows``: float32 rows ``(n, dim)`` (numpy or CPU torch) → a new uint8 numpy
    array ``(n, record_bytes)`` of records."""
    import numpy as np

    info = format_info(format_id)
    a = np.ascontiguousarray(x.numpy() if hasattr(x, "numpy") else x, dtype=np.float32)
    out = np.empty((a.size // max(info.dim, 1), info.record_bytes), np.uint8)
    call("csa2_encode_rows", format_id, a.ctypes.data, a.size, out.ctypes.data, out.size)
    return out


def decode_rows(format_id: int, records):
    """``csa2_decode_rows``: uint8 records ``(n, record_bytes)`` → a new float32 numpy array
    ``(n, dim)`` (exact: what every csa2 op computes with)."""
    import numpy as np

    info = format_info(format_id)
    r = np.ascontiguousarray(records.numpy() if hasattr(records, "numpy") else records,
                             dtype=np.uint8)
    out = np.empty((r.size // max(info.record_bytes, 1), info.dim), np.float32)
    call("csa2_decode_rows", format_id, r.ctypes.data, r.size, out.ctypes.data, out.size)
    return out


def indexer_logits_in_blocks(q, w, positions, keys, blocks, ratio: int, block_size: int,
                             q_quant: int, out) -> None:
    """``csa2_indexer_logits_in_blocks`` (the Reindex path): as :func:`indexer_logits`, but row t
    scores only the entries of its candidate blocks ``blocks[t]`` ((T, B) int32, −1 padded)."""
    _call_tensors("csa2_indexer_logits_in_blocks", lambda t: (ctypes.byref(
        IndexerLogitsInBlocksArgs(q=t(q), w=t(w), positions=t(positions), keys=t(keys),
                                  blocks=t(blocks), ratio=ratio, block_size=block_size,
                                  q_quant=q_quant, logits_out=t(out))),))


def compress(geometry: "Geometry", layer: int, kv, score, norm, wk, k_norm, start_pos: int,
             main_out, index_out) -> None:
    """``csa2_compress`` (stateless: ``start_pos`` and T multiples of the layer's ratio)."""
    _call_tensors("csa2_compress", lambda t: (ctypes.byref(CompressArgs(
        geometry=geometry.handle.value, layer=layer, kv=t(kv), score=t(score), norm=t(norm),
        wk=t(wk), k_norm=t(k_norm), start_pos=start_pos, main_kv_out=t(main_out),
        index_k_out=t(index_out))),))


# ---- handles: geometry, KV cache, compressor state --------------------------------------------

class _Handle:
    """Owns one opaque csa2 handle; frees it once (``close()`` or garbage collection)."""

    _free = ""

    def __init__(self, handle: int):
        self.handle = ctypes.c_void_p(handle)

    def close(self) -> None:
        """Frees the handle once; a second ``close()`` is a no-op. The library checks every handle
        (a freed or foreign one is ``CSA2_ERR_INVALID_HANDLE``), so a failure here is raised."""
        if self.handle:
            h, self.handle = self.handle, ctypes.c_void_p(None)
            check(getattr(lib(), self._free)(h), self._free)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Geometry(_Handle):
    """``Csa2Geometry``: the embedded DeepSeek-V4.1-Flash geometry."""

    _free = "csa2_geometry_free"

    def __init__(self):
        out = ctypes.c_void_p()
        call("csa2_geometry_embedded", ctypes.byref(out))
        super().__init__(out.value)


class CacheLayerInfo(ctypes.Structure):
    """``Csa2CacheLayerInfo`` (format ids are ``Csa2Format`` values, −1 = none)."""

    _fields_ = [("kv_source", ctypes.c_uint8), ("ratio", ctypes.c_uint32),
                ("main_format", ctypes.c_int32), ("main_record_bytes", ctypes.c_uint64),
                ("index_format", ctypes.c_int32), ("index_record_bytes", ctypes.c_uint64),
                ("entries_per_block", ctypes.c_uint64),
                ("compressor_state_floats", ctypes.c_uint64), ("swa_format", ctypes.c_int32),
                ("swa_record_bytes", ctypes.c_uint64), ("window", ctypes.c_uint64)]


RECORD_MAIN, RECORD_INDEX = 0, 1


class Cache(_Handle):
    """``Csa2Cache``: the paged KV cache manager (host memory), driven record by record.

    Row tensors are float ``(n, dim)`` (encoded / decoded) or uint8 ``(n, record_bytes)`` (raw
    records); see ``include/csa2.h`` for every rule. All methods raise :class:`Csa2Error`.

    ``model`` is an extra fingerprint for the prefix keys (e.g. a digest of the weights). The keys
    are always salted with the whole geometry, the layout and the block size, so the default
    ``b""`` already keeps two different configs apart; pass a fingerprint to keep two checkpoints
    of the same architecture apart."""

    _free = "csa2_cache_free"

    def __init__(self, geometry: Geometry, num_blocks: int, block_tokens: int = 256,
                 layout: int = 0, model: bytes = b""):
        out = ctypes.c_void_p()
        args = CacheCreateArgs(geometry=geometry.handle.value, layout=layout, num_blocks=num_blocks,
                               block_tokens=block_tokens, model=model or None,
                               model_len=len(model))
        call("csa2_cache_create", ctypes.byref(args), ctypes.byref(out))
        super().__init__(out.value)

    def add_request(self, rid: int) -> None:
        call("csa2_cache_add_request", self.handle, rid)

    def allocate(self, rid: int, tokens: int) -> None:
        call("csa2_cache_allocate", self.handle, rid, tokens)

    def free_request(self, rid: int) -> None:
        call("csa2_cache_free_request", self.handle, rid)

    def prefix_keys(self, tokens: Sequence[int]) -> bytes:
        """Chained 32-byte keys of every full block of ``tokens``, concatenated."""
        arr = (ctypes.c_uint32 * max(len(tokens), 1))(*tokens)
        n = ctypes.c_size_t()
        call("csa2_cache_prefix_keys", self.handle, arr, len(tokens), None, 0, ctypes.byref(n))
        buf = ctypes.create_string_buffer(32 * n.value)
        call("csa2_cache_prefix_keys", self.handle, arr, len(tokens), buf, n.value, ctypes.byref(n))
        return buf.raw

    def publish(self, rid: int, keys: bytes) -> int:
        n = ctypes.c_size_t()
        call("csa2_cache_publish", self.handle, rid, keys, len(keys) // 32, ctypes.byref(n))
        return n.value

    def adopt_prefix(self, rid: int, keys: bytes) -> int:
        n = ctypes.c_size_t()
        call("csa2_cache_adopt_prefix", self.handle, rid, keys, len(keys) // 32, ctypes.byref(n))
        return n.value

    def slot_mapping(self, rid: int, layer: int, start: int, count: int) -> list[int]:
        out = (ctypes.c_int64 * max(count, 1))()
        call("csa2_cache_slot_mapping", self.handle, rid, layer, start, count, out)
        return list(out[:count])

    def layer_info(self, layer: int) -> CacheLayerInfo:
        info = CacheLayerInfo()
        call("csa2_cache_layer_info", self.handle, layer, ctypes.byref(info))
        return info

    def write_entries(self, rid: int, layer: int, kind: int, entries, src) -> None:
        _call_tensors("csa2_cache_write_entries",
                      lambda t: (self.handle, rid, layer, kind, t(entries), t(src)))

    def read_entries(self, rid: int, layer: int, kind: int, entries, dst) -> None:
        _call_tensors("csa2_cache_read_entries",
                      lambda t: (self.handle, rid, layer, kind, t(entries), t(dst)))

    def swa_write(self, rid: int, layer: int, pos_start: int, src) -> None:
        _call_tensors("csa2_cache_swa_write", lambda t: (self.handle, rid, layer, pos_start, t(src)))

    def swa_read(self, rid: int, layer: int, pos_start: int, dst) -> None:
        _call_tensors("csa2_cache_swa_read", lambda t: (self.handle, rid, layer, pos_start, t(dst)))

    def swa_newest(self, rid: int, layer: int) -> int:
        out = ctypes.c_int64()
        call("csa2_cache_swa_newest", self.handle, rid, layer, ctypes.byref(out))
        return out.value

    def set_compressor_state(self, rid: int, layer: int, state) -> None:
        _call_tensors("csa2_cache_set_compressor_state",
                      lambda t: (self.handle, rid, layer, t(state)))

    def get_compressor_state(self, rid: int, layer: int, out) -> bool:
        present = ctypes.c_int32()
        _call_tensors("csa2_cache_get_compressor_state",
                      lambda t: (self.handle, rid, layer, t(out), ctypes.byref(present)))
        return bool(present.value)


class CompressorState(_Handle):
    """``Csa2CompressorState``: one request's compressor of one Full layer across calls."""

    _free = "csa2_compressor_state_free"

    def __init__(self, geometry: Geometry, layer: int, start_pos: int = 0):
        out = ctypes.c_void_p()
        call("csa2_compressor_state_create", geometry.handle, layer, start_pos, ctypes.byref(out))
        super().__init__(out.value)
        self.geometry, self.layer = geometry, layer

    def query(self) -> tuple[int, int]:
        """(next position, tokens carried in the open group)."""
        nxt, pend = ctypes.c_uint64(), ctypes.c_uint64()
        call("csa2_compressor_state_query", self.handle, ctypes.byref(nxt), ctypes.byref(pend),
             None)
        return nxt.value, pend.value

    def reset(self, start_pos: int) -> None:
        call("csa2_compressor_state_reset", self.handle, start_pos)

    def step(self, kv, score, norm, wk, k_norm, main_out, index_out) -> int:
        """``csa2_compress_step``; returns the first entry id written (outputs hold
        ``(pending + T) // ratio`` rows)."""
        first = ctypes.c_uint64()
        _call_tensors("csa2_compress_step", lambda t: (ctypes.byref(CompressStepArgs(
            geometry=self.geometry.handle.value, layer=self.layer, state=self.handle.value,
            kv=t(kv), score=t(score), norm=t(norm), wk=t(wk), k_norm=t(k_norm),
            main_kv_out=t(main_out), index_k_out=t(index_out),
            first_entry=ctypes.pointer(first))),))
        return first.value

    def save(self, cache: Cache, rid: int) -> None:
        call("csa2_compressor_state_save", self.handle, cache.handle, rid)

    def load(self, cache: Cache, rid: int, next_pos: int) -> None:
        call("csa2_compressor_state_load", self.handle, cache.handle, rid, next_pos)


# ---- attention in place on vLLM's strided page pools (src/ffi/attention_pools.rs) ---------------

# ``POOL_INTERLEAVED`` / ``POOL_BLOCK_PLANAR`` (``Csa2PoolLayout``: a state's scales follow its
# own data, as vLLM's V4.1 NVFP4 / MXFP8 pages; or all data of the page first, then all scales, as
# the V4 and index-K pages) come from the library's table (``__getattr__`` above).


class Csa2Pool(ctypes.Structure):
    """``Csa2Pool``: a ``[blocks, states_per_page, record_bytes]`` uint8 view (any block stride)."""

    _fields_ = [("tensor", _T), ("format", ctypes.c_int32), ("layout", ctypes.c_int32)]


class Csa2AttentionPoolsArgs(ctypes.Structure):
    """``Csa2AttentionPoolsArgs`` (include/csa2.h); ``struct_size`` is filled in by
    :func:`attention_pools`."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("q", _T), ("main", Csa2Pool), ("main_idx", _T),
        ("main_len", _T), ("swa", Csa2Pool), ("swa_idx", _T), ("swa_len", _T), ("sink", _T),
        ("heads", ctypes.c_uint32), ("scale", ctypes.c_float), ("out", _T), ("lse", _T),
        ("error", _T), ("stream", ctypes.c_uint64),
    ]


SIGNATURES.update({
    "csa2_attention_pools": ([ctypes.POINTER(Csa2AttentionPoolsArgs)], _C_STATUS),
    "csa2_cuda_preload": ([ctypes.c_int32], _C_STATUS),
})
__all__ += ["POOL_INTERLEAVED", "POOL_BLOCK_PLANAR", "pool_format", "attention_pools",
            "cuda_preload"]


def pool_format(pool: Any, what: str) -> tuple[int, int]:
    """(``Csa2Format``, ``Csa2PoolLayout``) of a packed pool of 512-value records, from its record
    width and the library's record table (``csa2_record_formats``: which records vLLM's pages
    hold block-planar)."""
    width = int(pool.shape[-1]) if len(pool.shape) else -1
    for f in record_formats():
        if f.dim == 512 and f.record_bytes == width:
            return f.format_id, f.vllm_pool_layout
    raise ValueError(
        f"{what}: record width {width} B is none of "
        + ", ".join(f"{f.record_bytes} ({f.name})" for f in record_formats() if f.dim == 512))


def attention_pools(q, main_pool, main_idx, main_len, swa_pool, swa_idx, swa_len, sink, heads: int,
                    scale: float, out, *, lse=None, error=None, stream: int = 0) -> None:
    """``csa2_attention_pools``: sparse attention read in place from the pools.

    ``q``/``out`` ``(T, 64|128, 512)`` bf16; pools ``(blocks, states, record bytes)`` uint8 views
    as vLLM hands them (strided: ``stride(0)`` = the per-block slab), ``main_pool`` None for an
    SWA-only layer; ``*_idx`` ``(T, K)`` int32 global slots, ``*_len`` ``(T,)`` int32 (or None);
    ``sink`` ``(heads,)`` float32. All on one device; ``stream`` is the CUDA stream handle for CUDA
    tensors (``torch.cuda.current_stream().cuda_stream``). Nothing here touches tensor data: the
    call is as capturable as the library call itself.
    """
    keep = []

    def t(x):
        b, p = _ptr(x)
        keep.append(b)
        return p

    def pool(p, what):
        if p is None:
            return Csa2Pool(None, 0, 0)
        fmt, layout = pool_format(p, what)
        return Csa2Pool(t(p), fmt, layout)

    args = Csa2AttentionPoolsArgs(
        ctypes.sizeof(Csa2AttentionPoolsArgs), t(q), pool(main_pool, "compressed pool"),
        t(main_idx), t(main_len), pool(swa_pool, "SWA pool"), t(swa_idx), t(swa_len), t(sink),
        int(heads), float(scale), t(out), t(lse), t(error), int(stream))
    call("csa2_attention_pools", ctypes.byref(args))


def cuda_preload(ordinal: int) -> None:
    """Loads csa2's CUDA modules and every kernel function on device ``ordinal`` (before any
    CUDA-graph capture). Raises :class:`Csa2Error`: ``CSA2_ERR_NO_CUDA_BUILD`` (a build without
    the ``cuda`` feature), ``CSA2_ERR_CUDA_MODULE`` (a CUDA build whose module does not load on
    this GPU), ``CSA2_ERR_UNSUPPORTED`` (no driver or device)."""
    call("csa2_cuda_preload", int(ordinal))


# ---- indexer in place on vLLM's strided MXFP4 index-K pages (src/ffi/indexer.rs) ---------------


class Csa2IndexerLogitsPoolArgs(ctypes.Structure):
    """``Csa2IndexerLogitsPoolArgs`` (include/csa2.h); ``struct_size`` is filled in by
    :func:`indexer_logits_pool`."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("q", _T), ("w", _T), ("positions", _T), ("req", _T),
        ("keys", Csa2Pool), ("block_table", _T), ("ratio", ctypes.c_uint32),
        ("q_quant", ctypes.c_int32), ("logits_out", _T), ("stream", ctypes.c_uint64),
        ("error", _T),
    ]


SIGNATURES.update({
    "csa2_indexer_logits_pool": ([ctypes.POINTER(Csa2IndexerLogitsPoolArgs)], _C_STATUS),
})
__all__ += ["indexer_logits_pool"]


def indexer_logits_pool(q, w, positions, req, keys, block_table, ratio: int, q_quant: int,
                        out, stream: int = 0, error=None) -> None:
    """``csa2_indexer_logits_pool`` into ``out`` (T, N) float32: row t of request ``req[t]``
    scores entries ``0..N`` of that request, read in place from ``keys`` — vLLM's index-K cache
    view ``(blocks, states_per_page, 68)`` uint8 (strided: ``stride(0)`` = the per-block slab;
    block-planar MXFP4) — through ``block_table`` ``(R, B)`` int32. ``q`` ``(T, H, 128)``, ``w``
    ``(T, H)`` float, ``positions`` ``(T,)`` int, ``req`` ``(T,)`` int32; ``q_quant`` 0 none,
    1 MXFP4, 2 FP8. Every tensor on one device. On CUDA the kernel runs on ``stream`` (a raw
    ``cudaStream_t``) with no host access (capturable once :func:`cuda_preload` ran) and a bad
    request, block or position is recorded in ``error`` (``(4,)`` int32 on the device, zeroed by
    the caller: code, row, column, value) instead of raising; its entry scores −∞."""
    idx = record_format_named("mxfp4")
    keep = []

    def t(x):
        b, p = _ptr(x)
        keep.append(b)
        return p

    args = Csa2IndexerLogitsPoolArgs(
        ctypes.sizeof(Csa2IndexerLogitsPoolArgs), t(q), t(w), t(positions), t(req),
        Csa2Pool(t(keys), idx.format_id, idx.vllm_pool_layout), t(block_table), int(ratio),
        int(q_quant), t(out), int(stream), t(error))
    call("csa2_indexer_logits_pool", ctypes.byref(args))


# ---- top-k of indexer logits (src/ffi/topk.rs; the SM90 MXFP4 indexer) --------------------------

__all__ += ["topk"]


def topk(logits, positions, ratio: int, out, counts=None) -> None:
    """``csa2_topk``: per row t the ``K = out.shape[1]`` largest of ``logits[t, :(positions[t] +
    1) div ratio]`` into ``out`` (T, K) int32 (score desc, index asc; all visible entries in
    index order when they are ≤ K; −1 padded), ``counts`` (T,) int32 optional. ``logits`` (T, N)
    float; every tensor on one device (CUDA: float32 logits)."""
    _call_tensors("csa2_topk", lambda t: (t(logits), t(positions), int(ratio), t(out),
                                          t(counts)))


# ---- top-k on the caller's CUDA stream (src/ffi/topk.rs `csa2_topk_on_stream`) ------------------


class Csa2TopkOnStreamArgs(ctypes.Structure):
    """``Csa2TopkOnStreamArgs`` (include/csa2.h); ``struct_size`` is filled in by
    :func:`topk_on_stream`."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("logits", _T), ("positions", _T),
        ("ratio", ctypes.c_uint32), ("out", _T), ("counts_out", _T), ("error", _T),
        ("stream", ctypes.c_uint64),
    ]


SIGNATURES.update({
    "csa2_topk_on_stream": ([ctypes.POINTER(Csa2TopkOnStreamArgs)], _C_STATUS),
})
__all__ += ["topk_on_stream"]


def topk_on_stream(logits, positions, ratio: int, out, counts=None, error=None,
                   stream: int = 0) -> None:
    """``csa2_topk_on_stream``: the top-K entry ids of each row of ``logits`` ``(T, N)`` float
    over its first ``(positions[t] + 1) // ratio`` entries into ``out`` ``(T, K)`` int32, in the
    order (logit desc, index asc), −1 padded; ``counts`` ``(T,)`` int32 gets the number selected.
    On CUDA tensors the kernel runs on ``stream`` (a raw ``cudaStream_t``, e.g.
    ``torch.cuda.current_stream().cuda_stream``) with no host access — capturable in a CUDA graph
    once :func:`cuda_preload` ran — and a negative position is recorded in ``error`` (``(4,)``
    int32 on the device, zeroed by the caller) instead of raising. On host tensors it is
    ``csa2_topk``."""
    keep = []

    def t(x):
        b, p = _ptr(x)
        keep.append(b)
        return p

    args = Csa2TopkOnStreamArgs(
        ctypes.sizeof(Csa2TopkOnStreamArgs), t(logits), t(positions), int(ratio), t(out),
        t(counts), t(error), int(stream))
    call("csa2_topk_on_stream", ctypes.byref(args))


# ---- candidate blocks on the caller's CUDA stream (src/ffi/candidates.rs) --------------


class Csa2CandidatesOnStreamArgs(ctypes.Structure):
    """``Csa2CandidatesOnStreamArgs`` (include/csa2.h); ``struct_size`` is filled in by
    :func:`candidates_on_stream`."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("logits", _T), ("positions", _T),
        ("ratio", ctypes.c_uint32), ("block_size", ctypes.c_uint32), ("blocks_out", _T),
        ("counts_out", _T), ("error", _T), ("stream", ctypes.c_uint64),
    ]


SIGNATURES.update({
    "csa2_candidates_on_stream": ([ctypes.POINTER(Csa2CandidatesOnStreamArgs)], _C_STATUS),
})
__all__ += ["candidates_on_stream"]


def candidates_on_stream(logits, positions, ratio: int, block_size: int, blocks_out,
                         counts=None, error=None, stream: int = 0) -> None:
    """``csa2_candidates_on_stream``: the candidate pool of each row of ``logits`` ``(T, N)``
    float over its first ``(positions[t] + 1) // ratio`` entries — blocks of ``block_size``
    scored by their max, the newest pinned — into ``blocks_out`` ``(T, B)`` int32, sorted by
    (score desc, id asc), −1 padded; ``counts`` ``(T,)`` int32 gets the number kept. On CUDA
    tensors the kernel runs on ``stream`` with no host access (capturable once
    :func:`cuda_preload` ran) and a negative position is recorded in ``error`` (``(4,)`` int32 on
    the device, zeroed by the caller) instead of raising. On host tensors it is
    ``csa2_candidates``."""
    keep = []

    def t(x):
        b, p = _ptr(x)
        keep.append(b)
        return p

    args = Csa2CandidatesOnStreamArgs(
        ctypes.sizeof(Csa2CandidatesOnStreamArgs), t(logits), t(positions), int(ratio),
        int(block_size), t(blocks_out), t(counts), t(error), int(stream))
    call("csa2_candidates_on_stream", ctypes.byref(args))
