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

echo "== pytest tests/python"
CSA2_BIN="${CSA2_BIN:-target/debug/csa2}" "$venv/bin/python" -m pytest -q tests/python

if [ "${CSA2_SKIP_VLLM:-0}" = 1 ]; then
    echo "== vLLM plugin tests SKIPPED (CSA2_SKIP_VLLM=1)"
else
    echo "== vLLM 0.33 plugin tests (python_shim/run_tests.sh; first run installs vllm==0.33.0 into .venv-vllm)"
    bash python_shim/run_tests.sh
fi

echo "== all tests passed"
