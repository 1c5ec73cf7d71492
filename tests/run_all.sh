#!/usr/bin/env bash
# Runs every test of the repository: the Rust suites (unit, integration, property, header drift,
# the C smoke test), then the Python cross-checks of the codecs against an independent docs/SPEC.md
# implementation and ml_dtypes. Self-sufficient on a clean clone: creates .venv-test if missing.
# Exits non-zero on the first failing stage.
set -euo pipefail
cd "$(dirname "$0")/.."

# A missing system prerequisite stops the command here, naming what to install (no stage is
# skipped for want of one).
if [ "${CSA2_SKIP_VLLM:-0}" = 1 ]; then
    bash scripts/prereqs.sh --no-vllm
else
    bash scripts/prereqs.sh
fi

venv=.venv-test
if [ ! -x "$venv/bin/python" ]; then
    echo "== creating $venv (pinned: tests/python/requirements.txt)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet -r tests/python/requirements.txt
fi

# Unit tests of the workspace's three crates (core library, harness, CLI), then the integration
# suite (one binary, tests/suite.rs, a test of the CLI crate: it includes the C smoke test, the
# header drift check and the seeded C ABI fuzzer) and tests/cache_oom.rs. Benches and examples are
# not built here; CI's `cargo clippy --workspace --all-targets` compiles them.
echo "== cargo test --workspace --lib --bins --tests"
cargo test --workspace --lib --bins --tests

# Every CUDA kernel on the host SIMT harness (kernels/simt/, docs/ARCHITECTURE.md): the CUDA tests
# and the CUDA unit tests through the same launch code on an emulated device, then once more under
# ThreadSanitizer and AddressSanitizer + UBSan. A kernel that hangs ends the stage by timeout.
echo "== cargo test --features cuda-emu --lib --test suite cuda (CUDA kernels on the host SIMT harness)"
launch_log="$(mktemp)"
export CSA2_EMU_LAUNCH_LOG="$launch_log"
timeout "${CSA2_SIMT_TIMEOUT:-1800}" cargo test --features cuda-emu --lib --test suite cuda
echo "== the same, each block's threads in reverse order; the codecs on the sm_100a build"
CSA2_EMU_SCHEDULE=reverse timeout "${CSA2_SIMT_TIMEOUT:-1800}" cargo test --features cuda-emu --lib --test suite cuda
CSA2_EMU_CC=10.0 timeout "${CSA2_SIMT_TIMEOUT:-1800}" cargo test --features cuda-emu --test suite cuda::codec
unset CSA2_EMU_LAUNCH_LOG
# Every `extern "C" __global__` of kernels/ must have run to completion above.
missing=$(python3 - "$launch_log" <<'PY'
import re, sys, pathlib
ran = set(pathlib.Path(sys.argv[1]).read_text().split())
src = "".join(p.read_text() for p in sorted(pathlib.Path("kernels").glob("*.cu")))
names = re.findall(r'extern "C" __global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)', src)
print(" ".join(n for n in names if n not in ran))
PY
)
rm -f "$launch_log"
if [ -n "$missing" ]; then
    echo "kernels that never ran on the host SIMT harness: $missing" >&2
    exit 1
fi
bash scripts/simt-sanitizers.sh

echo "== pytest tests/python"
CSA2_BIN="${CSA2_BIN:-target/debug/csa2}" "$venv/bin/python" -m pytest -q tests/python

if [ "${CSA2_SKIP_VLLM:-0}" = 1 ]; then
    echo "== vLLM plugin tests SKIPPED (CSA2_SKIP_VLLM=1)"
else
    echo "== vLLM 0.33 plugin tests (python_shim/run_tests.sh; first run installs vllm==0.33.0 into .venv-vllm)"
    bash python_shim/run_tests.sh
fi

echo "== all tests passed"
