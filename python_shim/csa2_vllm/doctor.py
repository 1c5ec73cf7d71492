"""``python -m csa2_vllm.doctor``: what the installed plugin will do on this machine.

Prints the library it loads, whether that library has csa2's CUDA feature and can launch on the
device in use (the answer of ``csa2_cuda_preload``, the same probe the layer and the metadata
builders use), the driver, device and compute capability torch sees, the records and bytes per
token csa2's layer will ask vLLM for there, and the CUDA-graph mode its metadata builders
declare. Imports no vLLM (the record choice mirrors ``csa2_vllm.attention``'s rule for SM90 and
SM100). ``--json`` prints the same as one JSON object. Exit status 0, or 1 when the library
cannot be loaded or a GPU is present that csa2's CUDA build cannot launch on.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import _lib


def _records(cap: tuple[int, int] | None, mxfp4_index: bool) -> dict:
    """Record widths (bytes per token per layer) csa2's layer asks vLLM for on ``cap``."""
    width = {f.name: f.record_bytes for f in _lib.record_formats()}
    if cap is not None and cap[0] in (9, 10):  # V4.1 records: vLLM's choice on SM100, csa2's on SM90
        main, swa = width["nvfp4"], width["mxfp8"]
        names = ("nvfp4 (288 B, interleaved)", "mxfp8 (528 B, interleaved)")
    else:
        main = swa = width["v4"]
        names = ("v4 (584 B, block-planar)", "v4 (584 B, block-planar)")
    index = width["mxfp4"] if mxfp4_index else 132  # vLLM's FP8 index K: 128 B + one f32 scale
    return {"compressed": names[0], "swa": names[1],
            "index_k": "mxfp4 (68 B)" if mxfp4_index else "fp8 (132 B, vLLM's)",
            "bytes_per_token": main + swa + index}


class _Support:
    """``csa2_cuda_preload``'s answer (as :class:`csa2_vllm.route.CudaSupport`, without torch)."""

    def __init__(self, status: int, message: str):
        self.status, self.message = status, message
        self.launches = status == 0
        self.no_cuda_build = status == _lib.CSA2_ERR_NO_CUDA_BUILD


def _probe(ordinal: int) -> _Support:
    try:
        _lib.cuda_preload(ordinal)
        return _Support(0, "")
    except _lib.Csa2Error as e:
        return _Support(e.status, e.message)


def report() -> dict:
    out: dict = {}
    try:
        out["library"] = _lib.library_path()
        out["version"] = _lib.version()
    except Exception as e:  # noqa: BLE001
        out["library_error"] = str(e)
        return out
    try:
        import torch
    except ImportError:
        torch = None
    out["torch"] = None if torch is None else torch.__version__
    gpu = torch is not None and torch.cuda.is_available()
    ordinal = torch.cuda.current_device() if gpu else 0
    if gpu:
        cap = torch.cuda.get_device_capability(ordinal)
        out["device"] = torch.cuda.get_device_name(ordinal)
        out["compute_capability"] = f"{cap[0]}.{cap[1]}"
        out["torch_cuda"] = torch.version.cuda
        try:
            out["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") \
                else None
        except Exception:  # noqa: BLE001
            out["driver"] = None
    else:
        cap = None
        out["device"] = None
    sup = _probe(ordinal)
    out["preload_status"] = sup.status
    out["preload_message"] = sup.message
    out["cuda_feature"] = {0: True, _lib.CSA2_ERR_NO_CUDA_BUILD: False}.get(
        sup.status, sup.status in (_lib.CSA2_ERR_CUDA_MODULE, _lib.CSA2_ERR_UNSUPPORTED))
    out["cuda_module"] = ("loaded" if sup.launches else
                          "built, does not load on this GPU" if sup.status == _lib.CSA2_ERR_CUDA_MODULE
                          else "not built" if sup.no_cuda_build else
                          "not loaded (no CUDA driver or device)")
    out["route"] = ("device (csa2's CUDA kernels on torch's stream)" if gpu and sup.launches else
                    "host route (a GPU with a library without the `cuda` feature: gathers on the "
                    "GPU, attention on the host, no CUDA graphs)" if gpu and sup.no_cuda_build else
                    "refused: this GPU cannot run this CUDA build" if gpu else
                    "host (no GPU: csa2's ops on host tensors; vLLM's V4.1 model needs a GPU)")
    out["graph_mode"] = "UNIFORM_BATCH" if gpu and sup.launches else "NEVER"
    out["records"] = {"indexer_kv_dtype fp8": _records(cap, False),
                      "indexer_kv_dtype mxfp4": _records(cap, True)}
    if cap is not None and cap[0] == 9 and not sup.launches:
        out["records"]["indexer_kv_dtype mxfp4"]["note"] = (
            "refused at start-up: csa2's SM90 MXFP4 indexer needs its CUDA kernels")
    out["ok"] = not (gpu and not sup.launches and not sup.no_cuda_build)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m csa2_vllm.doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = ap.parse_args(argv)
    rep = report()
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        for key, value in rep.items():
            if isinstance(value, dict):
                print(f"{key}:")
                for k, v in value.items():
                    if isinstance(v, dict):
                        print(f"  {k}: " + ", ".join(f"{a} {b}" for a, b in v.items()))
                    else:
                        print(f"  {k}: {v}")
            else:
                print(f"{key}: {value}")
    return 0 if rep.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
