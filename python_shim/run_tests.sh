#!/usr/bin/env bash
# Runs the csa2_vllm tests against the real vLLM 0.33.0 (CPU) in a cached venv.
#   python_shim/run_tests.sh [pytest args]
# By default builds a wheel of ./python_shim (cdylib bundled by setuptools-rust), installs it
# non-editable and tests the installed package with its bundled library.
# Env: CSA2_VLLM_VENV (default: <repo>/.venv-vllm), CSA2_WHEEL_PROFILE (cargo profile of the
# bundled library, default dev), CSA2_SHIM_EDITABLE=1 (editable install + CSA2_LIB instead),
# CSA2_LIB (test that library instead of the bundled one), PYTHON (default python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# libfabric1 and libibverbs1 (the Mooncake tests): stop now, with the install command, if missing.
bash "$root/scripts/prereqs.sh"
venv="${CSA2_VLLM_VENV:-$root/.venv-vllm}"
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.33.0")' 2>/dev/null; then
    "$venv/bin/pip" install "vllm==0.33.0"          # ~4.6 GB download, ~9.4 GB venv
fi
"$venv/bin/python" -c 'import pytest' 2>/dev/null || "$venv/bin/pip" install "pytest==9.2.0"
"$venv/bin/python" -c 'import setuptools_rust' 2>/dev/null || "$venv/bin/pip" install "setuptools-rust==1.13.0"
# Mooncake's store client and master (tests_interpreted/test_mooncake.py: vLLM's MultiConnector with
# MooncakeStoreConnector). The non-CUDA EFA build runs over TCP on a CPU machine (the plain package
# needs libcuda); it loads the system's libfabric1 and libibverbs1 (checked above by
# scripts/prereqs.sh; .ci/run installs them).
mooncake_pkg="mooncake-transfer-engine-efa-non-cuda==0.3.13.post1"
"$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version(sys.argv[1].split("==")[0]) != sys.argv[1].split("==")[1])' "$mooncake_pkg" 2>/dev/null \
    || "$venv/bin/pip" install "$mooncake_pkg"
# -P (wheel mode): keep the working directory off sys.path, so `import csa2_vllm` finds the installed
# package, not the source tree next to the tests. Editable mode imports the source tree on purpose.
safe_path=-P
if [ "${CSA2_SHIM_EDITABLE:-0}" = 1 ]; then
    # Quick path for development: editable install, library from `cargo build --lib`.
    safe_path=
    if [ -z "${CSA2_LIB:-}" ]; then
        (cd "$root" && cargo build --lib)
        export CSA2_LIB="$root/target/debug/libcsa2.so"
    fi
    if ! "$venv/bin/python" -c 'import csa2_vllm' 2>/dev/null; then
        "$venv/bin/pip" install --no-build-isolation --no-deps -e "$here"
    fi
else
    # What a user does (`pip install ./python_shim`), non-editable: build a wheel from this tree —
    # setuptools-rust compiles the cdylib and bundles it as csa2_vllm/_csa2*.so — and install it.
    # CSA2_WHEEL_PROFILE is the cargo profile: `dev` by default (a debug build that reuses
    # target/debug, ~1.5 min on the 2-core CI machine); `release` is what a plain
    # `pip install ./python_shim` builds (several minutes here). --no-build-isolation reuses the
    # venv's setuptools-rust (no network needed).
    wheels="$root/target/wheels"
    rm -f "$wheels"/csa2_vllm-*.whl
    # -v: pip passes cargo's own progress through (otherwise minutes of silence).
    echo "== building the csa2-vllm wheel (cargo profile ${CSA2_WHEEL_PROFILE:-dev}; cargo's progress follows)"
    SETUPTOOLS_RUST_CARGO_PROFILE="${CSA2_WHEEL_PROFILE:-dev}" \
        "$venv/bin/pip" wheel --no-build-isolation --no-deps -v -w "$wheels" "$here" 2>&1 \
        | { grep --line-buffered -E '^ *(Compiling|Finished) |^ *(warning|error)(\[|:)|Building wheel|Created wheel' || true; }
    "$venv/bin/pip" install --no-deps --force-reinstall -q "$wheels"/csa2_vllm-*.whl
    # The tests import the installed package and its bundled library (unless CSA2_LIB was set by
    # the caller); test_install.py proves both.
    export CSA2_EXPECT_WHEEL=1
fi
cd "$here"
"$venv/bin/python" $safe_path -m pytest -q -p no:cacheprovider "$@"
# With no arguments, also the device route on the host SIMT harness: a library built with
# `--features cuda-emu` runs every CUDA branch of csa2_vllm.route on host tensors presented as
# CUDA, and tests/gpu/check_shim_route.py --emu with it. It shares target/debug's dependencies
# (only the core crate is compiled again) and is copied aside, since the next default build puts
# its own libcsa2.so back in that place. CSA2_SKIP_EMU=1 skips it.
if [ $# -eq 0 ] && [ "${CSA2_SKIP_EMU:-0}" != 1 ]; then
    (cd "$root" && cargo build -p csa2 --features cuda-emu --lib)
    mkdir -p "$root/target/emu-lib"
    cp "$root/target/debug/libcsa2.so" "$root/target/emu-lib/libcsa2.so"
    CSA2_LIB="$root/target/emu-lib/libcsa2.so" "$venv/bin/python" $safe_path -m pytest -q \
        -p no:cacheprovider tests/test_device_route.py
fi
# With no arguments, also the tests that run vLLM's own Triton kernels (its V4.1 metadata, gathers
# and FlashMLA layer code) in Triton's CPU interpreter; both variables must be set before vLLM is
# imported, hence a second process (see tests_interpreted/conftest.py).
if [ $# -eq 0 ]; then
    CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 "$venv/bin/python" $safe_path -m pytest -q \
        -p no:cacheprovider -W ignore::DeprecationWarning tests_interpreted
fi
