#!/usr/bin/env bash
# Builds what tests/gpu/check_attention.py needs on a GPU machine that has no network (and so no
# nvcc): libcsa2.so with the `cuda` feature (SASS for sm_90a and sm_100a, PTX and the NVRTC source
# embedded; libcuda is dlopen'ed at run time), stripped, into target/gpu-check/libcsa2.so. Carry
# that file (5.6 MB stripped) plus the working tree (python_shim/, tests/gpu/) to the GPU machine and run
#   CSA2_LIB=target/gpu-check/libcsa2.so python3 tests/gpu/check_attention.py
# Needs nvcc here: $NVCC, else scripts/cuda-env.sh (installs the compile-only toolchain).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
NVCC="${NVCC:-$("$root/scripts/cuda-env.sh")}"
export NVCC
cargo build -p csa2 --release --features cuda --lib
mkdir -p target/gpu-check
cp target/release/libcsa2.so target/gpu-check/libcsa2.so
strip target/gpu-check/libcsa2.so 2>/dev/null || true
ls -l target/gpu-check/libcsa2.so
# The check imports nothing of vLLM; a CPU-side smoke run proves the script and library load.
if command -v python3 >/dev/null && python3 -c 'import torch, numpy' 2>/dev/null; then
    CSA2_LIB="$root/target/gpu-check/libcsa2.so" python3 tests/gpu/check_attention.py --dry-run
fi
