"""The cdylib extension of ``pip install ./python_shim``; whether it gets the ``cuda`` feature is
decided here from ``CSA2_CUDA`` (build_backend/csa2_build.py, which also fetched the NVIDIA
compiler wheels when they are needed)."""

import os
import sys

from setuptools import setup
from setuptools_rust import Binding, RustExtension

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "build_backend"))
from csa2_build import cuda_choice, local_nvcc  # noqa: E402


def wheel_nvcc() -> str | None:
    """nvcc of the ``nvidia-cuda-nvcc`` wheel in this build environment, if installed."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        path = os.path.join(root, "cu13", "bin", "nvcc")
        if os.path.isfile(path):
            return path
    return None


def features() -> list[str]:
    choice = cuda_choice()
    if choice == "0":
        return []
    nvcc = local_nvcc() or wheel_nvcc()
    if nvcc is None:
        if choice == "1":
            raise RuntimeError("CSA2_CUDA=1 but no nvcc was found (NVCC, CUDA_HOME, PATH or the "
                               "nvidia-cuda-nvcc wheel)")
        print("csa2: no CUDA compiler here, building the CPU-only library (CSA2_CUDA=auto)",
              file=sys.stderr)
        return []
    os.environ["NVCC"] = nvcc  # build.rs reads it
    print(f"csa2: building the `cuda` feature with {nvcc}", file=sys.stderr)
    return ["cuda"]


setup(rust_extensions=[RustExtension(
    "csa2_vllm._csa2", path="../Cargo.toml", binding=Binding.NoBinding, py_limited_api=False,
    features=features(),
    # NoBinding runs `cargo rustc --lib`: the `csa2` CLI binary is neither built nor shipped.
)])
