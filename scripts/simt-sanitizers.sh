#!/usr/bin/env bash
# The CUDA kernels on the host SIMT harness under ThreadSanitizer, then AddressSanitizer + UBSan:
# the same tests as `cargo test --features cuda-emu --lib --test suite cuda`, with the modules'
# sanitizer builds (CSA2_EMU_SANITIZER) and the sanitizer runtime preloaded into the test binaries
# (cargo's runner setting, so cargo and rustc themselves run without it; ThreadSanitizer watches
# the instrumented kernels only, not the test harness around them). A race, an out-of-bounds
# access or undefined behaviour in a kernel ends the run with the sanitizer's report.
set -euo pipefail
cd "$(dirname "$0")/.."
cxx="${CXX:-c++}"
limit="${CSA2_SIMT_TIMEOUT:-1800}"
# Under ThreadSanitizer every kernel runs, but two tests of the 1,024-thread sorting kernels
# (top-k and candidates in the order contract: thousands of barriers over 1,024 fibers, each a
# vector-clock merge) are left to the AddressSanitizer pass and the plain runs: under TSan they
# alone took longer than the whole test command may. Their kernels run under TSan in
# `topk_matches_cpu_exactly` and `candidate_pool_matches_cpu_exactly`.
for san in thread address; do
    skip=()
    case "$san" in
        thread)
            lib="$("$cxx" -print-file-name=libtsan.so)"
            skip=(--skip topk_on_stream_orders_like_cpu --skip candidates_on_stream_match_cpu_and_reference)
            ;;
        address) lib="$("$cxx" -print-file-name=libasan.so)" ;;
    esac
    if [ ! -e "$lib" ]; then
        echo "simt-sanitizers: $lib not found: install the compiler's sanitizer runtimes (Debian: libtsan2, libasan8)" >&2
        exit 1
    fi
    echo "== CUDA kernels on the host SIMT harness under the $san sanitizer"
    launches="$(mktemp)"
    CSA2_EMU_LAUNCH_LOG="$launches" CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="env LD_PRELOAD=$lib CSA2_EMU_SANITIZER=$san \
TSAN_OPTIONS=halt_on_error=1:exitcode=66:ignore_noninstrumented_modules=1 ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1" \
        timeout "$limit" cargo test --features cuda-emu --lib --test suite cuda -- "${skip[@]}"
    # Every kernel must still have run under this sanitizer (the skips and the smaller sanitizer
    # shapes of tests/cuda_support/checks.rs leave none out).
    python3 scripts/kernels_ran.py "$launches" "the host SIMT harness under the $san sanitizer"
    rm -f "$launches"
done
