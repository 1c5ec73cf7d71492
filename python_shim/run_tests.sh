#!/usr/bin/env bash
# Runs the csa2_vllm tests against the real vLLM 0.33.0 (CPU) in a cached venv.
#   python_shim/run_tests.sh [pytest args]
# Env: CSA2_VLLM_VENV (default: <repo>/.venv-vllm), CSA2_LIB (skip building: test that library;
# otherwise `cargo build --lib` and use target/debug/libcsa2.so), PYTHON (default python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
venv="${CSA2_VLLM_VENV:-$root/.venv-vllm}"
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.33.0")' 2>/dev/null; then
    "$venv/bin/pip" install "vllm==0.33.0"          # ~4.6 GB download, ~9.4 GB venv
fi
"$venv/bin/python" -c 'import pytest' 2>/dev/null || "$venv/bin/pip" install "pytest==9.2.0"
"$venv/bin/python" -c 'import setuptools_rust' 2>/dev/null || "$venv/bin/pip" install "setuptools-rust==1.13.0"
if [ -z "${CSA2_LIB:-}" ]; then
    (cd "$root" && cargo build --lib)
    export CSA2_LIB="$root/target/debug/libcsa2.so"
fi
# Editable install registers the entry point; --no-build-isolation reuses the venv's setuptools.
# CSA2_LIB takes precedence over the bundled copy at run time.
if ! "$venv/bin/python" -c 'import csa2_vllm' 2>/dev/null; then
    "$venv/bin/pip" install --no-build-isolation --no-deps -e "$here"
fi
cd "$here"
exec "$venv/bin/python" -m pytest -q "$@"
