"""The shim's device route (csa2_vllm.route) and the choices made around it: which route a CUDA
tensor takes for each ``csa2_cuda_preload`` answer, the graph mode the metadata builders declare,
the SM90 MXFP4 indexer's start-up refusal, one request-id rule, and the kernels' error records.

The tests marked ``emu`` need a library built with ``--features cuda-emu`` (``CSA2_LIB``;
python_shim/run_tests.sh builds one and runs this file against it): host tensors presented as
CUDA DLPack views then run every CUDA branch of the library on the CPU."""

import logging
import os
import subprocess
import sys
import types

import pytest
import torch

from csa2_vllm import _lib, indices, route

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _emu_library() -> bool:
    if torch.cuda.is_available():
        return False
    try:
        _lib.cuda_preload(0)
        return True
    except _lib.Csa2Error:
        return False


# run_tests.sh sets this in its pass over the emulated-device library: there, a library without
# the emulated device is an error, not a reason to skip.
if os.environ.get("CSA2_REQUIRE_EMU") == "1" and not _emu_library():
    raise RuntimeError(f"CSA2_LIB={os.environ.get('CSA2_LIB')} is not a --features cuda-emu build")


def emu(test):
    """Marks a test that needs the emulated-device library (skipped, with the reason, without it)."""
    skip = pytest.mark.skipif(not _emu_library(),
                              reason="needs CSA2_LIB built with --features cuda-emu")
    return pytest.mark.emu(skip(test))


@pytest.fixture
def preload_answers(monkeypatch):
    """Makes ``csa2_cuda_preload`` answer a given status (fresh probe cache)."""
    def set_status(status):
        def fake(ordinal):
            if status:
                raise _lib.Csa2Error(status, f"preload answer {status}")
        monkeypatch.setattr(_lib, "cuda_preload", fake)
        monkeypatch.setattr(route, "_SUPPORT", {})
    return set_status


@pytest.mark.parametrize("status,route_taken", [
    (0, True), (_lib.CSA2_ERR_NO_CUDA_BUILD, False),
    (_lib.CSA2_ERR_CUDA_MODULE, None), (_lib.CSA2_ERR_UNSUPPORTED, None), (403, None),
])
def test_a_cuda_build_that_cannot_launch_is_an_error_never_a_host_route(preload_answers, status,
                                                                        route_taken):
    """Finding 4: only a library without the `cuda` feature takes the host route on a GPU; a
    module that does not load (406), no driver (402) or any other failure raises."""
    preload_answers(status)
    x = torch.zeros(2)
    with _lib.present_host_as_cuda():
        if route_taken is None:
            with pytest.raises(_lib.Csa2Error) as e:
                route.device_route(x)
            assert e.value.status == status and "does not fall back" in str(e.value)
        else:
            assert route.device_route(x) is route_taken
    assert route.device_route(x) is False  # a host tensor: the host route, no probe needed


def test_the_layer_decides_its_route_through_the_probe():
    """Finding 4 (read of the source): attention.py no longer reads a non-OK preload as "no
    CUDA build" itself."""
    src = open(os.path.join(ROOT, "python_shim", "csa2_vllm", "attention.py")).read()
    assert "e.status != 402" not in src and "_csa2_host_only" not in src
    assert "route.device_route(q)" in src


@pytest.mark.parametrize("status,mode", [
    (0, "UNIFORM_BATCH"), (_lib.CSA2_ERR_NO_CUDA_BUILD, "NEVER"),
    (_lib.CSA2_ERR_CUDA_MODULE, "NEVER"), (_lib.CSA2_ERR_UNSUPPORTED, "NEVER"),
])
def test_graph_mode_follows_what_the_library_can_launch(preload_answers, monkeypatch, status,
                                                         mode):
    """Finding 2: UNIFORM_BATCH only where csa2's kernels launch on the device in use."""
    preload_answers(status)
    monkeypatch.setattr(route, "current_ordinal", lambda: 0)
    assert route.graph_support() == mode


def test_metadata_builders_declare_never_without_a_gpu():
    """Finding 2: on this machine (no GPU) every csa2 builder says NEVER; they said
    UNIFORM_BATCH whatever the library was."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import AttentionCGSupport

    from csa2_vllm import backend

    for cls in (backend.Csa2MetadataBuilder, backend.Csa2SWAMetadataBuilder,
                backend.Csa2IndexerMetadataBuilder):
        assert cls.get_cudagraph_support(None, None) is AttentionCGSupport.NEVER, cls


def test_sm90_mxfp4_indexer_refuses_to_start_without_cuda_kernels(preload_answers):
    """Finding 2: no host route for csa2's SM90 MXFP4 indexer, so a library without the
    `cuda` feature is refused when the layer is built, naming the fix."""
    preload_answers(_lib.CSA2_ERR_NO_CUDA_BUILD)
    with pytest.raises(_lib.Csa2Error) as e:
        route.require_device_route(0, "csa2's MXFP4 index K on SM90")
    assert e.value.status == _lib.CSA2_ERR_NO_CUDA_BUILD and "pip install ./python_shim" in str(e.value)
    src = open(os.path.join(ROOT, "python_shim", "csa2_vllm", "indexer.py")).read()
    init = src[src.index("class Csa2Indexer("):src.index("def _produce_k")]
    assert "require_device_route(" in init


def test_request_ids_follow_one_rule_in_a_padded_batch():
    """Finding 5: a padding token whose request id is −1 or past the table (a padded batch) gets
    an empty list in decode and prefill, on the checked and the capture-safe path alike, and
    the indexer clamps with the same function."""
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    local = torch.tensor([[0, 5, -1], [1, 2, 3], [0, 1, 2], [4, 0, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1, 2, -1], dtype=torch.int32)  # tokens 2, 3: padding
    valid = torch.tensor([True, True, False, False])
    for check in (True, False):
        slots, lens = indices.decode_topk_slots(local, req, table, 4, valid, check)
        assert lens.tolist() == [2, 3, 0, 0]
        assert slots[0, :2].tolist() == [12, 5] and slots[1].tolist() == [1, 2, 3]
        pos = torch.tensor([11, 11, 3, 3])
        n_entries = torch.tensor([8, 8])
        slots, lens = indices.prefill_topk_slots(local, req, pos, n_entries, table, 4, 4,
                                                 valid, check)
        assert lens.tolist() == [3, 3, 0, 0]
    assert indices.request_rows(req, 2).tolist() == [0, 1, 1, 0]
    src = open(os.path.join(ROOT, "python_shim", "csa2_vllm", "route.py")).read()
    assert "lists.request_rows(req, block_table.shape[0])" in src


@emu
def test_error_records_are_read_at_the_poll_and_counted(caplog):
    """Finding 6: a bad slot on the device route is not raised; the next poll logs it and
    counts it, and the record is zeroed for the next step."""
    from csa2_vllm import route as r

    errs = r.ErrorRecords()
    with _lib.present_host_as_cuda():
        q = torch.randn(1, 64, 512).bfloat16()
        swa = torch.zeros(2, 4, 528, dtype=torch.uint8)
        idx = torch.tensor([[0, 8]], dtype=torch.int32)  # 8 = past the 2 × 4 slots
        n = torch.tensor([2], dtype=torch.int32)
        _lib.attention_pools(q, None, idx[:, :0], torch.zeros(1, dtype=torch.int32), swa, idx, n,
                             torch.zeros(64), 64, 0.04, torch.zeros_like(q),
                             error=errs.tensor("attention", q.device))
    with caplog.at_level(logging.WARNING, logger="csa2_vllm"):
        seen = errs.poll()
    assert seen == [("attention", (2, 0, 1, 8))]
    assert errs.counts["attention"] == 1 and "SWA slot outside its pool" in caplog.text
    assert errs.poll() == [] and errs.counts["attention"] == 1


@emu
def test_the_shim_route_check_runs_on_the_emulated_device():
    """Findings 1 and 6 and the GPU check itself: tests/gpu/check_shim_route.py --emu drives
    the writers, the Q quantiser (in the shim's Q workspace dtype), the indexer score, top-k,
    candidates, the lists and both attention kernels through the CUDA branches."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "check_shim_route.py"),
                          "--emu"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "CSA2_LIB": _lib.library_path()})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "0 failed" in out.stdout


def test_wheel_build_chooses_cuda_when_a_compiler_can_be_had():
    """Packaging: CSA2_CUDA=auto adds the pinned NVIDIA compiler wheels where there is no nvcc,
    none when one is found or CSA2_CUDA=0; a typo is refused."""
    sys.path.insert(0, os.path.join(ROOT, "python_shim", "build_backend"))
    import csa2_build as b

    env = {"PATH": "/nonexistent"}
    assert b.extra_requires(env, "Linux", "x86_64") == list(b.NVCC_WHEELS)
    assert b.extra_requires({**env, "CSA2_CUDA": "0"}, "Linux", "x86_64") == []
    assert b.extra_requires({**env, "NVCC": "/opt/nvcc"}, "Linux", "x86_64") == []
    assert b.extra_requires(env, "Darwin", "arm64") == []
    with pytest.raises(RuntimeError):
        b.extra_requires({**env, "CSA2_CUDA": "1"}, "Darwin", "arm64")
    with pytest.raises(ValueError):
        b.cuda_choice({"CSA2_CUDA": "maybe"})
    pins = open(os.path.join(ROOT, "scripts", "cuda-env.sh")).read()
    for pin in b.NVCC_WHEELS:
        name, version = pin.split("==")
        assert f"{name.removeprefix('nvidia-cuda-').upper()}_VERSION={version}" in pins, pin
