#!/usr/bin/env bash
# Creates (or reuses) the CUDA compile toolchain venv `.venv-cuda` at the repository root and prints
# the nvcc path on stdout (everything else goes to stderr), so callers can do
#   export NVCC="$(scripts/cuda-env.sh)"
#
# The toolchain is the PyPI CUDA 13.5 compiler (compile-only; no driver, no GPU needed):
#   nvidia-cuda-nvcc   — nvcc, ptxas, fatbinary, cicc (via nvidia-nvvm)
#   nvidia-cuda-cccl   — REQUIRED: without it every compile fails on `nv/target`
#   nvidia-cuda-nvrtc  — runtime compiler; lets the no-GPU tests JIT a kernel (optional, CSA2_NVRTC=0 skips)
# The cu12 wheels ship no nvcc, hence the cu13 line (docs/SPEC.md §6.3).
set -euo pipefail

NVCC_VERSION=13.5.37
CCCL_VERSION=13.3.5.0.6
NVRTC_VERSION=13.5.37

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CSA2_CUDA_VENV:-$root/.venv-cuda}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "cuda-env: creating $venv" >&2
    "$python" -m venv "$venv" >&2
fi

pkgs=("nvidia-cuda-nvcc==$NVCC_VERSION" "nvidia-cuda-cccl==$CCCL_VERSION")
if [ "${CSA2_NVRTC:-1}" != "0" ]; then
    pkgs+=("nvidia-cuda-nvrtc==$NVRTC_VERSION")
fi

# Only touch the package index when a pin is missing (a reused venv costs ~0.3 s).
need=0
for p in "${pkgs[@]}"; do
    name="${p%%==*}"
    want="${p##*==}"
    have="$("$venv/bin/python" -m pip show "$name" 2>/dev/null | sed -n "s/^Version: //p" || true)"
    if [ "$have" != "$want" ]; then need=1; fi
done
if [ "$need" = 1 ]; then
    echo "cuda-env: installing ${pkgs[*]}" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pkgs[@]}" >&2
fi

cu13="$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
nvcc="$cu13/bin/nvcc"
if [ ! -x "$nvcc" ]; then
    echo "cuda-env: nvcc not found at $nvcc after install" >&2
    exit 1
fi
"$nvcc" --version | tail -n 2 >&2
echo "$nvcc"
