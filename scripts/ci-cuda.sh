#!/usr/bin/env bash
# CI for the `cuda` feature on a machine without a GPU: installs the compile-only toolchain, builds,
# lints and tests. GPU tests report "SKIPPED: no CUDA driver" (counted below, never silently passed).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
start=$(date +%s)

NVCC="$("$root/scripts/cuda-env.sh")"
export NVCC
# NVRTC from the same venv, so the no-GPU NVRTC test really compiles a kernel.
export LD_LIBRARY_PATH="$(dirname "$(dirname "$NVCC")")/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ptxas' registers / stack / spills of every kernel entry point, printed as build warnings
# (build.rs); compare them before and after a kernel change.
export CSA2_PTXAS_REPORT=1
cargo build --features cuda
cargo clippy --workspace --features cuda --all-targets -- -D warnings
log="$(mktemp)"
# The feature only adds src/cuda, ops/*/cuda.rs, formats/cuda.rs (and the CUDA branch of the
# device dispatch): their unit tests and tests/cuda.rs are what change; the rest of the suite
# already ran without the feature.
cargo test --features cuda --lib --test suite cuda:: -- --nocapture 2>&1 | tee "$log"
skipped=$(grep -c "^SKIPPED" "$log" || true)
echo "ci-cuda: $skipped test(s) SKIPPED (no CUDA driver / device on this machine)"
rm -f "$log"
echo "ci-cuda: done in $(( $(date +%s) - start )) s"
