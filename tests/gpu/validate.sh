#!/usr/bin/env bash
# GPU validation on a machine with an NVIDIA GPU (sized for an H200 to finish in < 8 min).
#
#   tests/gpu/validate.sh [gpu_validate args: --iters N --seed S --small]
#
# 1. Finds the validation binary: $CSA2_GPU_VALIDATE_BIN, else target/gpu-validate/gpu_validate
#    (prebuilt on a CPU machine by scripts/build-gpu-validate.sh — GPU boxes without a network
#    cannot install nvcc), else builds it here with `cargo build --release --features cuda`
#    (needs NVCC / CUDA_HOME / nvcc on PATH, or scripts/cuda-env.sh with a network).
# 2. Runs every kernel against the CPU path at model shapes on fresh random inputs (NaN/Inf
#    positions, element bounds, cosine, bitwise rerun) and times each (CUDA events, 3 warm-ups,
#    median), printing µs | GB/s | % of the measured device copy bandwidth.
# 3. Reloads the modules through each fallback path (PTX JIT, compat PTX, NVRTC) on small sizes.
# 4. Runs `cargo test --features cuda --test suite cuda::` when cargo and nvcc are available.
# Everything is logged to $OUT/gpu_validate.log (or out/gpu/ without $OUT). Exit status: that of
# step 2.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
out="${OUT:-$root/out/gpu}"
mkdir -p "$out"
log="$out/gpu_validate.log"
exec > >(tee "$log") 2>&1

echo "== csa2 GPU validation, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "(nvidia-smi unavailable)"

bin="${CSA2_GPU_VALIDATE_BIN:-$root/target/gpu-validate/gpu_validate}"
if [ ! -x "$bin" ]; then
    echo "== building the validation binary (no prebuilt one at $bin)"
    if [ -z "${NVCC:-}" ] && ! command -v nvcc >/dev/null && [ -z "${CUDA_HOME:-}" ]; then
        NVCC="$("$root/scripts/cuda-env.sh")" || { echo "FAIL: no nvcc and cannot install one"; exit 3; }
        export NVCC
    fi
    cargo build --release --features cuda --example gpu_validate || { echo "FAIL: build"; exit 3; }
    bin="$root/target/release/examples/gpu_validate"
fi

echo "== 1/3 all kernels vs CPU, timed"
timeout 420 "$bin" "$@"
rc=$?
echo "== validation exit status: $rc"

echo "== 2/3 fallback load paths (small sizes, no timing)"
for p in ptx compat nvrtc; do
    echo "-- CSA2_CUDA_LOAD=$p"
    CSA2_CUDA_LOAD=$p CSA2_CUDA_SYNC=1 timeout 90 "$bin" --small --iters 0 | grep -E "loaded via|PASS|FAIL|SKIPPED|failed" || true
done

echo "== 3/3 cargo test --features cuda (if a toolchain is here)"
if command -v cargo >/dev/null && { [ -n "${NVCC:-}" ] || command -v nvcc >/dev/null || [ -n "${CUDA_HOME:-}" ]; }; then
    timeout 300 cargo test --release --features cuda --test suite cuda:: -- --nocapture --test-threads=1 2>&1 | tail -40
else
    echo "SKIPPED: no cargo / nvcc on this machine"
fi
exit $rc
