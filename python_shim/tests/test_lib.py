"""The ctypes layer: library loading, signatures, DLPack descriptors, errors with csa2's text."""

import ctypes

import numpy as np
import pytest
import torch

from csa2_vllm import _lib


def test_library_loads_once_with_every_signature():
    a = _lib.lib()
    assert _lib.lib() is a
    for name in _lib.SIGNATURES:
        assert hasattr(a, name), name
    assert _lib.version().count(".") == 2


@pytest.mark.parametrize(
    "x, text",
    [
        (np.zeros((2, 3), np.float32), "float32[2, 3] host"),
        (torch.zeros(4, 64, 512, dtype=torch.bfloat16), "bfloat16[4, 64, 512] host"),
        (torch.zeros(0, 512), "float32[0, 512] host"),
        (torch.arange(6, dtype=torch.int32).reshape(1, 6), "int32[1, 6] host"),
        (torch.zeros(8, 3)[2:5], "float32[3, 3] host"),  # storage offset handled by data_ptr
        (torch.zeros(5, 1, 7)[:, :, :].expand(5, 1, 7), "float32[5, 1, 7] host"),
    ],
)
def test_valid_tensors_are_described(x, text):
    assert _lib.describe(x) == text


def test_non_contiguous_tensor_is_refused_with_csa2s_reason():
    with pytest.raises(_lib.Csa2Error) as e:
        _lib.describe(torch.zeros(4, 6).t())
    assert e.value.status == 200
    assert "csa2_dlpack_describe: tensor.strides" in e.value.message
    assert "[1, 6]" in e.value.message and ".contiguous()" in e.value.message
    assert _lib.describe(torch.zeros(4, 6).t().contiguous()) == "float32[6, 4] host"


def test_cuda_descriptor_is_described_but_not_dereferenced():
    # A device pointer is validated as a descriptor; host access would be refused by ops.
    b = _lib.Borrowed(0x7F0000000000, [4], None, _lib.K_DL_FLOAT, 32, _lib.K_DL_CUDA, 1, None)
    import ctypes

    buf = ctypes.create_string_buffer(64)
    _lib.call("csa2_dlpack_describe", b.ptr, buf, 64)
    assert buf.value == b"float32[4] cuda:1"


def test_malformed_descriptors_raise_typed_errors():
    import ctypes

    buf = ctypes.create_string_buffer(64)
    with pytest.raises(_lib.Csa2Error) as e:
        _lib.call("csa2_dlpack_describe", None, buf, 64)
    assert e.value.status == 202 and "tensor" in e.value.message
    b = _lib.Borrowed(0, [3], None, _lib.K_DL_FLOAT, 32, _lib.K_DL_CPU, 0, None)
    with pytest.raises(_lib.Csa2Error) as e:
        _lib.call("csa2_dlpack_describe", b.ptr, buf, 64)
    assert e.value.status == 202
    b = _lib.Borrowed(0, [1 << 40, 1 << 40], None, _lib.K_DL_FLOAT, 32, _lib.K_DL_CPU, 0, None)
    with pytest.raises(_lib.Csa2Error, match="overflows"):
        _lib.call("csa2_dlpack_describe", b.ptr, buf, 64)
    b = _lib.Borrowed(0, [2], None, 5, 64, _lib.K_DL_CPU, 0, None)  # complex64
    with pytest.raises(_lib.Csa2Error, match="tensor.dtype"):
        _lib.call("csa2_dlpack_describe", b.ptr, buf, 64)
    # The error is per call: a later success clears it.
    assert _lib.describe(np.zeros(1, np.uint8)) == "uint8[1] host"
    assert _lib.last_error() == ""


def test_unsupported_python_types_are_type_errors():
    with pytest.raises(TypeError):
        _lib.borrow([1.0, 2.0])
    with pytest.raises(TypeError):
        _lib.borrow(torch.zeros(2, dtype=torch.complex64))


def test_record_format_table_comes_from_the_library():
    table = _lib.record_formats()
    assert [f.format_id for f in table] == list(range(len(table)))
    assert {f.record_bytes: f.name for f in table} == {
        288: "nvfp4", 68: "mxfp4", 528: "mxfp8", 584: "v4", 132: "fp8index"}
    for f in table:
        info = _lib.format_info(f.format_id)
        assert (f.dim, f.data_bytes, f.scale_bytes, f.record_bytes) == (
            info.dim, info.data_bytes, info.scale_bytes, info.record_bytes)
    by_name = {f.name: f for f in table}
    assert by_name["nvfp4"].vllm_dtype == "nvfp4_ds_mla" and not by_name["nvfp4"].vllm_block_planar
    assert by_name["v4"].vllm_dtype == "fp8_ds_mla" and by_name["v4"].vllm_block_planar
    assert by_name["mxfp4"].vllm_block_planar and by_name["fp8index"].vllm_dtype == "fp8"
    # The header enum values the bindings mirror are the table's ids.
    assert (_lib.FORMAT_NVFP4, _lib.FORMAT_MXFP8, _lib.FORMAT_V4) == tuple(
        by_name[n].format_id for n in ("nvfp4", "mxfp8", "v4"))
    # The pool layout ids come from the same table: block-planar records carry one id, the
    # interleaved ones the other.
    assert _lib.POOL_INTERLEAVED != _lib.POOL_BLOCK_PLANAR
    for f in table:
        want = _lib.POOL_BLOCK_PLANAR if f.vllm_block_planar else _lib.POOL_INTERLEAVED
        assert f.vllm_pool_layout == want, f
        assert _lib.record_format_named(f.name) == f
    with pytest.raises(KeyError, match="nvfp4"):
        _lib.record_format_named("nvfp5")
    with pytest.raises(AttributeError):
        _lib.FORMAT_NVFP5  # noqa: B018 - the module __getattr__ refuses unknown names


def test_args_struct_smaller_than_its_first_version_is_refused_by_name():
    args = _lib.IndexerLogitsArgs(ratio=1)
    assert args.struct_size == ctypes.sizeof(_lib.IndexerLogitsArgs)
    args.struct_size = 8
    with pytest.raises(_lib.Csa2Error) as e:
        _lib.call("csa2_indexer_logits", ctypes.byref(args))
    assert e.value.status == 201
    assert "Csa2IndexerLogitsArgs" in e.value.message and "struct_size is 8" in e.value.message
