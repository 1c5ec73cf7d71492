#!/usr/bin/env bash
# Runs every test of the repository: the Rust suites (unit, integration, property, header drift,
# the C smoke test), then the Python cross-checks of the codecs against an independent docs/SPEC.md
# implementation and ml_dtypes. Self-sufficient on a clean clone: creates .venv-test if missing.
# Exits non-zero on the first failing stage.
set -euo pipefail
cd "$(dirname "$0")/.."

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
timeout "${CSA2_SIMT_TIMEOUT:-1800}" cargo test --features cuda-emu --lib --test suite cuda
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
