"""The build backend of ``pip install ./python_shim``: setuptools (with setuptools-rust, which
runs cargo on ``../Cargo.toml``) plus one decision — whether the bundled library gets csa2's
``cuda`` feature.

``CSA2_CUDA`` chooses:

- ``auto`` (default): the ``cuda`` feature whenever a CUDA compiler can be had: ``$NVCC``,
  ``$CUDA_HOME/bin/nvcc`` or ``nvcc`` on ``PATH``; otherwise, on Linux x86_64 / aarch64, the
  pinned NVIDIA compiler wheels are added to the build requirements (the versions of
  ``scripts/cuda-env.sh``; compile-only, no driver needed). A platform with neither builds the
  CPU-only library and says so.
- ``1``: the ``cuda`` feature, or the build fails.
- ``0``: the CPU-only library (no nvcc, no compiler wheels fetched).

One library serves both kinds of machines: the CUDA build loads the driver at run time and
answers "no driver" on a machine without one (``python -m csa2_vllm.doctor``).
"""

from __future__ import annotations

import os
import platform
import shutil
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the hooks this module does not change)

#: scripts/cuda-env.sh's pins: nvcc, ptxas, fatbinary, cicc, and CCCL (the compile needs both).
NVCC_WHEELS = ("nvidia-cuda-nvcc==13.5.37", "nvidia-cuda-cccl==13.3.5.0.6")


def cuda_choice(env=os.environ) -> str:
    """``auto``, ``1`` or ``0`` from ``CSA2_CUDA`` (a few spellings accepted); anything else
    raises, so a typo does not silently give a CPU-only build."""
    raw = env.get("CSA2_CUDA", "auto").strip().lower()
    for value, names in (("auto", ("", "auto")), ("1", ("1", "on", "yes", "true", "cuda")),
                         ("0", ("0", "off", "no", "false", "cpu"))):
        if raw in names:
            return value
    raise ValueError(f"CSA2_CUDA={raw!r}: expected auto, 1 (CUDA build) or 0 (CPU-only build)")


def local_nvcc(env=os.environ) -> str | None:
    """An nvcc on this machine, in build.rs's order: ``$NVCC``, ``$CUDA_HOME/bin/nvcc``, PATH."""
    if env.get("NVCC"):
        return env["NVCC"]
    home = env.get("CUDA_HOME")
    if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc", path=env.get("PATH"))


def wheels_exist_for(system: str | None = None, machine: str | None = None) -> bool:
    """Whether NVIDIA publishes the compiler wheels for this platform."""
    system = system or platform.system()
    machine = (machine or platform.machine()).lower()
    return system == "Linux" and machine in ("x86_64", "amd64", "aarch64", "arm64")


def extra_requires(env=os.environ, system=None, machine=None) -> list[str]:
    """Build requirements added to setuptools' own: the compiler wheels, when the library is to
    be built with CUDA and this machine has no nvcc of its own."""
    choice = cuda_choice(env)
    if choice == "0" or local_nvcc(env):
        return []
    if wheels_exist_for(system, machine):
        return list(NVCC_WHEELS)
    if choice == "1":
        raise RuntimeError("CSA2_CUDA=1 but no nvcc here ($NVCC, $CUDA_HOME, PATH) and no NVIDIA "
                           "compiler wheels for this platform")
    return []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + extra_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + extra_requires()


if __name__ == "__main__":  # what a build would choose here
    print(cuda_choice(), local_nvcc(), extra_requires(), file=sys.stderr)
