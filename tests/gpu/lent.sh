#!/usr/bin/env bash
# Every GPU check in one bounded run, for a GPU machine with no network, no cargo and no vLLM
# (torch, numpy and the NVIDIA driver are assumed). Everything it runs is built beforehand on a CPU
# machine by scripts/build-gpu-lent.sh into target/gpu-lent/ (carry that folder with the tree):
#
#   suite        tests/suite.rs built with --features cuda   (the `cuda::` tests; skip without a GPU)
#   csa2_lib     the core's unit tests built with --features cuda (ops/*/cuda.rs tests)
#   gpu_validate examples/gpu_validate.rs                     (every kernel vs the CPU, timed)
#   libcsa2.so   the cdylib with --features cuda              (tests/gpu/check_attention.py)
#
#   OUT=dir tests/gpu/lent.sh [quick|full]
#
# Steps and their time caps (a step that runs over is killed; the next one still runs); quick, the
# default, stays under 8 minutes in all (caps 90 + 90 + 45 + 120 + 120 s):
#   1. unit + suite CUDA tests (correctness, small sizes)                      90 s + 90 s
#   2. gpu_validate --small: every kernel vs the CPU at small sizes            45 s
#   3. check_attention.py: pools route vs CPU and f64, graph replay, timing   120 s (quick: 64K only)
#   4. check_shim_route.py: the shim's own device route without vLLM (Triton
#      writers, Q quantiser, indexer, top-k, candidates, lists, both attention
#      kernels with lse, error records, a slab over 4 GiB, graph capture in a
#      fresh process after preload only)                                      120 s
#   5. gpu_validate at model shapes, timed beside the copy bandwidth          150 s (full only)
#   6. module fallback load paths (PTX, compat PTX, NVRTC)                    3 × 20 s (full only)
# Logs: $OUT/<step>.log (7 files at most); the JSON of the two Python checks: $OUT/attention.json,
# $OUT/shim_route.json. Exit status: the number of steps that failed (0 = all passed).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
mode="${1:-quick}"
out="${OUT:-$root/out/gpu}"
bin="$root/target/gpu-lent"
mkdir -p "$out"
failed=0
started=$(date +%s)

step() { # name timeout command...
    local name="$1" secs="$2"
    shift 2
    local t0
    t0=$(date +%s)
    echo "== $name (cap ${secs} s) at +$((t0 - started)) s"
    timeout "$secs" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "   rc $rc in $(($(date +%s) - t0)) s"
    grep -E "^(test .*(ok|FAILED|ignored)$|SKIPPED|FAIL|PASS|==|test result)" "$out/$name.log" | tail -60
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

{
    echo "== csa2 GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), mode $mode"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1
    ls -l "$bin"
}

export CSA2_LIB="$bin/libcsa2.so"
step unit 90 "$bin/csa2_lib" cuda:: --test-threads=1
step suite 90 "$bin/suite" cuda:: --nocapture --test-threads=1
step validate_small 45 "$bin/gpu_validate" --small --iters 3 --seed 17 \
    --model-json "$out/decode_model.json"
# The split kernels' decode model (this build's ptxas figures, this GPU's SM count) beside the
# attention timings, when gpu_validate got as far as writing it.
model=()
[ -s "$out/decode_model.json" ] && model=(--model "$out/decode_model.json")
if [ "$mode" = quick ]; then
    step attention 120 python3 tests/gpu/check_attention.py --contexts 65536 --iters 10 \
        "${model[@]}" --json "$out/attention.json"
    step shim_route 120 python3 tests/gpu/check_shim_route.py --json "$out/shim_route.json"
else
    step attention 150 python3 tests/gpu/check_attention.py --iters 20 "${model[@]}" \
        --json "$out/attention.json"
    step shim_route 120 python3 tests/gpu/check_shim_route.py --json "$out/shim_route.json"
    step validate_large 150 "$bin/gpu_validate" --iters 20 --seed 18
    step loads 60 bash -c 'for p in ptx compat nvrtc; do echo "== CSA2_CUDA_LOAD=$p";
        CSA2_CUDA_LOAD=$p CSA2_CUDA_SYNC=1 timeout 20 "$0" --small --iters 0 || exit; done' \
        "$bin/gpu_validate"
fi
echo "== done in $(($(date +%s) - started)) s; $failed step(s) failed"
exit "$failed"
