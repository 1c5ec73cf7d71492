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
# The plugin wheel as `pip install ./python_shim` builds it where a CUDA compiler is found (the
# test command builds the CPU-only wheel): the same build script outputs as the line above (same
# profile, features and environment), then the installed package must load its bundled library,
# and the doctor must see the `cuda` feature.
if [ -x "${CSA2_VLLM_VENV:-$root/.venv-vllm}/bin/python" ]; then
    venv="${CSA2_VLLM_VENV:-$root/.venv-vllm}"
    CSA2_CUDA=1 CSA2_SKIP_EMU=1 bash python_shim/run_tests.sh --build
    CSA2_SKIP_EMU=1 bash python_shim/run_tests.sh --run tests/test_install.py
    (cd /tmp && env -u CSA2_LIB "$venv/bin/python" -P -m csa2_vllm.doctor --json) >"$root/target/doctor.json"
    "$venv/bin/python" - "$root/target/doctor.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["cuda_feature"] is True, d
print("ci-cuda: the CUDA wheel's doctor:", {k: d[k] for k in ("cuda_feature", "route")})
PY
fi
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
