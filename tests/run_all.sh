#!/usr/bin/env bash
# Runs every test of the repository: the Rust suites (unit, integration, property, header drift,
# the C smoke test), every CUDA kernel on the host SIMT harness (plain, reversed, sm_100a, under
# ThreadSanitizer and AddressSanitizer + UBSan), the Python cross-checks of the codecs against an
# independent docs/SPEC.md implementation and ml_dtypes, and the vLLM 0.33 plugin tests.
# Self-sufficient on a clean clone: creates .venv-test and .venv-vllm if missing. Exits non-zero
# when any stage fails, and ends with the time each stage took.
#
# Two lanes share the machine. The Python lane starts at once: it installs the venvs (a first run
# downloads ≈ 4.6 GB while the Rust code compiles), waits for the builds, then runs the Python
# tests. The Rust lane builds everything cargo builds (cargo holds target/'s lock for a whole
# command, so nothing else may build while a cargo test runs), then runs the Rust and host SIMT
# harness tests while the Python tests run beside them. The Python lane's output is kept in
# target/test-logs/ and printed when it ends.
#
# Env: CSA2_SKIP_VLLM=1 (no vLLM plugin stage), CSA2_CUDA (the plugin wheel's `cuda` feature:
# 0 here by default, see python_shim/README.md; the CUDA build is tested by scripts/ci-cuda.sh),
# CSA2_SIMT_TIMEOUT (seconds each host SIMT harness command may take, default 1800).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
skip_vllm="${CSA2_SKIP_VLLM:-0}"
logs="$PWD/target/test-logs"
mkdir -p "$logs"
rm -f "$logs"/*

# A missing system prerequisite stops the command here, naming what to install (no stage is
# skipped for want of one).
if [ "$skip_vllm" = 1 ]; then
    bash scripts/prereqs.sh --no-vllm
else
    bash scripts/prereqs.sh
fi

# Each stage's wall time, appended to $1 as "seconds<TAB>lane<TAB>name".
timed() {
    local file="$1" lane="$2" name="$3" t0
    shift 3
    [ "$lane" = rust ] && python_check
    echo "== $name"
    t0=$(date +%s)
    "$@"
    printf '%s\t%s\t%s\n' "$(($(date +%s) - t0))" "$lane" "$name" >>"$file"
}

# ---- the Python lane ----------------------------------------------------------------------------
venv_vllm="${CSA2_VLLM_VENV:-$PWD/.venv-vllm}"
export CSA2_VLLM_VENV="$venv_vllm"
rm -f "$venv_vllm/.csa2-build-ready"
python_lane() {
    local t="$logs/times-python"
    setup_test_venv() {
        local venv=.venv-test
        if [ ! -x "$venv/bin/python" ]; then
            python3 -m venv "$venv"
            "$venv/bin/pip" install --quiet -r tests/python/requirements.txt
        fi
    }
    timed "$t" python "venv .venv-test (pinned: tests/python/requirements.txt)" setup_test_venv
    if [ "$skip_vllm" != 1 ]; then
        timed "$t" python "venv .venv-vllm (vllm==0.33.0, Mooncake; first run ≈ 4.6 GB download)" \
            bash python_shim/run_tests.sh --setup
    fi
    # The Rust lane writes builds-ok (or builds-failed) when everything is compiled. (Python tests
    # started beside the builds slowed them more than they gained: docs/PERF.md, "Test command:
    # where the time went".)
    while [ ! -e "$logs/builds-ok" ]; do
        [ -e "$logs/builds-failed" ] && return 1
        sleep 2
    done
    timed "$t" python "pytest tests/python (codecs against docs/SPEC.md and ml_dtypes)" \
        env CSA2_BIN="${CSA2_BIN:-target/debug/csa2}" .venv-test/bin/python -m pytest -q tests/python
    if [ "$skip_vllm" != 1 ]; then
        timed "$t" python "vLLM 0.33 plugin tests (python_shim/run_tests.sh --run)" \
            bash python_shim/run_tests.sh --run
    fi
}
echo "== Python lane started in the background (log: $logs/python.log)"
# (Not `python_lane || …`: on the left of `||` bash ignores `set -e` inside the function.)
(
    set +e
    (
        set -e
        python_lane
    )
    rc=$?
    [ "$rc" = 0 ] || touch "$logs/python-failed"
    exit "$rc"
) >"$logs/python.log" 2>&1 &
python_pid=$!
# A failed Python lane ends the command at the Rust lane's next stage, with the lane's log.
python_check() {
    if [ -e "$logs/python-failed" ]; then
        echo "the Python lane failed; its log ($logs/python.log):" >&2
        cat "$logs/python.log" >&2
        exit 1
    fi
}
# If the Rust lane fails, the Python lane stops too (with whatever it started).
kill_tree() {
    local c
    for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done
    kill "$1" 2>/dev/null || true
}
trap 'touch "$logs/builds-failed"; kill_tree "$python_pid"' EXIT

# ---- the Rust lane: builds ----------------------------------------------------------------------
t="$logs/times-rust"
# Unit tests of the workspace's three crates (core library, harness, CLI), then the integration
# suite (one binary, tests/suite.rs, a test of the CLI crate: it includes the C smoke test, the
# header drift check and the seeded C ABI fuzzer) and tests/cache_oom.rs. Benches and examples are
# not built here; CI's `cargo clippy --workspace --all-targets` compiles them.
timed "$t" rust "build: cargo test --workspace --lib --bins --tests" \
    cargo test --workspace --lib --bins --tests --no-run
timed "$t" rust "build: cargo test --features cuda-emu --lib --test suite (the host SIMT harness)" \
    cargo test --features cuda-emu --lib --test suite --no-run
if [ "$skip_vllm" != 1 ]; then
    # The wheel needs the venv's setuptools-rust (installed first, in seconds).
    while [ ! -e "$venv_vllm/.csa2-build-ready" ]; do
        kill -0 "$python_pid" 2>/dev/null || { cat "$logs/python.log"; exit 1; }
        sleep 2
    done
    timed "$t" rust "build: the csa2-vllm wheel and the emulated-device library" \
        env CSA2_CUDA="${CSA2_CUDA:-0}" bash python_shim/run_tests.sh --build
fi
touch "$logs/builds-ok"

# ---- the Rust lane: tests -----------------------------------------------------------------------
timed "$t" rust "cargo test --workspace --lib --bins --tests" cargo test --workspace --lib --bins --tests

# Every CUDA kernel on the host SIMT harness (kernels/simt/, docs/ARCHITECTURE.md): the CUDA tests
# and the CUDA unit tests through the same launch code on an emulated device, then with each
# block's threads in reverse order, the codecs on the sm_100a build, and once more under
# ThreadSanitizer and AddressSanitizer + UBSan. A kernel that hangs ends the stage by timeout.
limit="${CSA2_SIMT_TIMEOUT:-1800}"
simt() {
    export CSA2_EMU_LAUNCH_LOG="$logs/launches"
    : >"$CSA2_EMU_LAUNCH_LOG"
    timeout "$limit" cargo test --features cuda-emu --lib --test suite cuda
    echo "== the same, each block's threads in reverse order; the codecs on the sm_100a build"
    CSA2_EMU_SCHEDULE=reverse timeout "$limit" cargo test --features cuda-emu --lib --test suite cuda
    CSA2_EMU_CC=10.0 timeout "$limit" cargo test --features cuda-emu --test suite cuda::codec
    unset CSA2_EMU_LAUNCH_LOG
    # Every `extern "C" __global__` of kernels/ must have run to completion above.
    python3 scripts/kernels_ran.py "$logs/launches"
}
timed "$t" rust "cargo test --features cuda-emu --lib --test suite cuda (CUDA kernels on the host SIMT harness)" simt
timed "$t" rust "the CUDA kernels under ThreadSanitizer, then AddressSanitizer + UBSan" \
    bash scripts/simt-sanitizers.sh

# ---- the end ------------------------------------------------------------------------------------
echo "== waiting for the Python lane"
python_ok=0
wait "$python_pid" || python_ok=$?
trap - EXIT
echo "== the Python lane's output ($logs/python.log)"
# pip's download and install lines stay in the log file; the rest is shown.
grep -v -E '^(Collecting|Downloading|  Downloading|Requirement already satisfied|Using cached|  Using cached|Installing collected|Successfully installed|  Attempting uninstall|    Found existing|    Uninstalling|      Successfully uninstalled) ' "$logs/python.log" || true
echo "== stage times (wall; the lanes overlap)"
cat "$logs/times-rust" "$logs/times-python" 2>/dev/null \
    | awk -F'\t' '{ printf "%7d s  %-6s  %s\n", $1, $2, $3 }'
echo "   total $(($(date +%s) - start)) s"
if [ "$python_ok" != 0 ]; then
    echo "the Python lane failed (exit $python_ok): see above or $logs/python.log" >&2
    exit 1
fi
echo "== all tests passed"
