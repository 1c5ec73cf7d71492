#!/usr/bin/env bash
# Builds the GPU validation binary on a CPU machine (kernels embedded; libcuda is dlopen'ed at run
# time) into target/gpu-validate/gpu_validate, ready to carry to a GPU machine that has no network
# (and so no nvcc) and run with tests/gpu/validate.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
NVCC="${NVCC:-$("$root/scripts/cuda-env.sh")}"
export NVCC
cargo build --release --features cuda --example gpu_validate
mkdir -p target/gpu-validate
cp target/release/examples/gpu_validate target/gpu-validate/gpu_validate
strip target/gpu-validate/gpu_validate 2>/dev/null || true
ls -l target/gpu-validate/gpu_validate
