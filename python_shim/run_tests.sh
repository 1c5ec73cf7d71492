#!/usr/bin/env bash
# Runs the csa2_vllm tests against the real vLLM 0.33.0 (CPU) in a cached venv.
#   python_shim/run_tests.sh [pytest args]   all three steps below, in order
#   python_shim/run_tests.sh --setup         1. the venv: vLLM 0.33.0, pytest, setuptools-rust, Mooncake
#   python_shim/run_tests.sh --build         2. the wheel of ./python_shim and the emulated-device library
#   python_shim/run_tests.sh --run [args]    3. install the wheel and run the tests (no cargo, no network)
# The steps are separate so tests/run_all.sh can install the venv while the Rust suites compile,
# and run the Python tests beside the Rust ones.
# Step 2 builds a wheel of ./python_shim (setuptools-rust compiles the cdylib with cargo and bundles
# it as csa2_vllm/_csa2*.so), as `pip install ./python_shim` does, and the `--features cuda-emu`
# library the device-route tests load.
# Env: CSA2_VLLM_VENV (default: <repo>/.venv-vllm), CSA2_WHEEL_PROFILE (cargo profile of the
# bundled library, default dev), CSA2_CUDA (the wheel's `cuda` feature: auto, 1 or 0; see
# python_shim/README.md), CSA2_SHIM_EDITABLE=1 (editable install + CSA2_LIB instead of a wheel),
# CSA2_LIB (test that library instead of the bundled one), CSA2_SKIP_EMU=1 (no device-route
# tests on the emulated-device library), PYTHON (default python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
venv="${CSA2_VLLM_VENV:-$root/.venv-vllm}"
wheels="$root/target/wheels"
emu_lib="$root/target/emu-lib/libcsa2.so"

# The venv. setuptools-rust and pytest come first (seconds), then vLLM (≈ 4.6 GB download, ≈ 9.4
# GB venv) and Mooncake's store client and master (tests_interpreted/test_mooncake.py: vLLM's
# MultiConnector with MooncakeStoreConnector; the non-CUDA EFA build runs over TCP on a CPU machine
# and loads the system's libfabric1 and libibverbs1, checked by scripts/prereqs.sh). Writes
# $venv/.csa2-build-ready once the wheel can be built. --no-compile: pip does not byte-compile the
# ≈ 29,000 Python files it installs (a third of the install's CPU time, beside the Rust builds);
# Python compiles and caches only the modules the tests import, on first import.
setup() {
    # libfabric1 and libibverbs1 (the Mooncake tests): stop now, with the install command, if missing.
    bash "$root/scripts/prereqs.sh"
    if [ ! -x "$venv/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    "$venv/bin/python" -c 'import pytest' 2>/dev/null || "$venv/bin/pip" install -q "pytest==9.2.0"
    "$venv/bin/python" -c 'import setuptools_rust' 2>/dev/null || "$venv/bin/pip" install -q "setuptools-rust==1.13.0"
    touch "$venv/.csa2-build-ready"
    if ! "$venv/bin/python" -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.33.0")' 2>/dev/null; then
        echo "== installing vllm==0.33.0 into $venv (≈ 4.6 GB download, first run only)"
        "$venv/bin/pip" install --no-compile --progress-bar off "vllm==0.33.0"
    fi
    local mooncake_pkg="mooncake-transfer-engine-efa-non-cuda==0.3.13.post1"
    "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version(sys.argv[1].split("==")[0]) != sys.argv[1].split("==")[1])' "$mooncake_pkg" 2>/dev/null \
        || "$venv/bin/pip" install --no-compile --progress-bar off "$mooncake_pkg"
}

# What a user does (`pip install ./python_shim`), as a wheel: --no-build-isolation reuses the venv's
# setuptools-rust (no network needed); CSA2_WHEEL_PROFILE is the cargo profile (`dev` by default, a
# debug build that reuses target/debug; `release` is what a plain `pip install ./python_shim`
# builds). Then the device-route library: `--features cuda-emu` runs every CUDA branch of
# csa2_vllm.route on host tensors presented as CUDA. It shares target/debug's dependencies (only
# the core crate is compiled again) and is copied aside, since the next build of another feature
# set puts its own libcsa2.so in that place.
build_wheel() {
    if [ "${CSA2_SHIM_EDITABLE:-0}" != 1 ]; then
        rm -f "$wheels"/csa2_vllm-*.whl
        # -v: pip passes cargo's own progress through (otherwise minutes of silence).
        echo "== building the csa2-vllm wheel (cargo profile ${CSA2_WHEEL_PROFILE:-dev}, CSA2_CUDA=${CSA2_CUDA:-auto}; cargo's progress follows)"
        SETUPTOOLS_RUST_CARGO_PROFILE="${CSA2_WHEEL_PROFILE:-dev}" \
            "$venv/bin/pip" wheel --no-build-isolation --no-deps -v -w "$wheels" "$here" 2>&1 \
            | { grep --line-buffered -E '^ *(Compiling|Finished) |^ *(warning|error)(\[|:)|^csa2: |Building wheel|Created wheel' || true; }
        ls "$wheels"/csa2_vllm-*.whl >/dev/null
    fi
}
build_emu() {
    if [ "${CSA2_SKIP_EMU:-0}" != 1 ]; then
        echo "== building the emulated-device library (cargo build -p csa2 --features cuda-emu --lib)"
        (cd "$root" && cargo build -p csa2 --features cuda-emu --lib)
        mkdir -p "$(dirname "$emu_lib")"
        cp "$root/target/debug/libcsa2.so" "$emu_lib"
    fi
}

# -P (wheel mode): keep the working directory off sys.path, so `import csa2_vllm` finds the installed
# package, not the source tree next to the tests. Editable mode imports the source tree on purpose.
run() {
    local safe_path=-P
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
        "$venv/bin/pip" install --no-deps --force-reinstall -q "$wheels"/csa2_vllm-*.whl
        # The tests import the installed package and its bundled library (unless CSA2_LIB was set
        # by the caller); test_install.py proves both.
        export CSA2_EXPECT_WHEEL=1
    fi
    cd "$here"
    # --durations=5 (here and below): each run ends with its five slowest tests. The tests that
    # need the emulated-device library run in their own pass, over that library.
    local first=() emu_pass=0
    if [ $# -eq 0 ] && [ "${CSA2_SKIP_EMU:-0}" != 1 ]; then
        first=(-m "not emu")
        emu_pass=1
    fi
    echo "== pytest python_shim/tests"
    "$venv/bin/python" $safe_path -m pytest -q --durations=5 -p no:cacheprovider "${first[@]}" "$@"
    [ "$emu_pass" = 0 ] || run_emu
    # With no arguments, also the tests that run vLLM's own Triton kernels (its V4.1 metadata,
    # gathers and FlashMLA layer code) in Triton's CPU interpreter; both variables must be set
    # before vLLM is imported, hence a second process (see tests_interpreted/conftest.py).
    if [ $# -eq 0 ]; then
        echo "== pytest python_shim/tests_interpreted (vLLM's Triton kernels in Triton's CPU interpreter)"
        CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 "$venv/bin/python" $safe_path -m pytest -q --durations=5 \
            -p no:cacheprovider -W ignore::DeprecationWarning tests_interpreted
    fi
}

# The device route on the host SIMT harness (the library of step 2; test_device_route.py runs
# tests/gpu/check_shim_route.py --emu with it), on the installed wheel. A library without the
# emulated device fails this pass instead of skipping its tests.
run_emu() {
    local safe_path=-P
    [ "${CSA2_SHIM_EDITABLE:-0}" != 1 ] || safe_path=
    cd "$here"
    echo "== pytest python_shim/tests/test_device_route.py on the emulated-device library"
    CSA2_REQUIRE_EMU=1 CSA2_LIB="$emu_lib" "$venv/bin/python" $safe_path -m pytest -q --durations=5 \
        -p no:cacheprovider tests/test_device_route.py
}

case "${1:-}" in
    --setup) setup ;;
    --build) build_wheel; build_emu ;;
    --run) shift; run "$@" ;;
    *)
        setup
        build_wheel
        build_emu
        run "$@"
        ;;
esac
