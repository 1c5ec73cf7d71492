#!/usr/bin/env bash
# Checks the system prerequisites of the test command and stops with what to install when one is
# missing (a test that cannot run is a failure, never a silent skip).
#   scripts/prereqs.sh          everything tests/run_all.sh needs
#   scripts/prereqs.sh --no-vllm without the vLLM stage's system libraries (CSA2_SKIP_VLLM=1)
set -uo pipefail
vllm=1
[ "${1:-}" = --no-vllm ] && vllm=0
missing=()    # Debian / Ubuntu package names
vllm_libs_missing=0
notes=()
command -v cargo >/dev/null || notes+=("cargo (Rust ≥ 1.89): install with rustup, https://rustup.rs")
command -v cc >/dev/null || missing+=(gcc)
# The host SIMT harness compiles the CUDA kernels as C++20 (build.rs, feature cuda-emu) and runs
# them under ThreadSanitizer and AddressSanitizer + UBSan (scripts/simt-sanitizers.sh).
cxx="${CXX:-c++}"
if ! command -v "$cxx" >/dev/null; then
    missing+=(g++)
elif ! echo 'int main() { return 0; }' | "$cxx" -std=c++20 -x c++ - -o /dev/null 2>/dev/null; then
    notes+=("a C++20 compiler as \$CXX or c++ (\`$cxx\` refuses -std=c++20): g++ ≥ 10 or clang++ ≥ 10")
else
    for rt in libtsan.so:libtsan2 libasan.so:libasan8 libubsan.so:libubsan1; do
        f="$("$cxx" -print-file-name="${rt%%:*}")"
        [ -e "$f" ] || missing+=("${rt##*:}")
    done
fi
if ! command -v python3 >/dev/null; then
    missing+=(python3 python3-venv)
elif ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    missing+=(python3-venv)
fi
if [ "$vllm" = 1 ]; then
    # The Mooncake store client and master (python_shim/tests_interpreted/test_mooncake.py) load
    # these two system libraries.
    has_lib() { ldconfig -p 2>/dev/null | grep -q "$1" || ls /usr/lib/*/"$1"* >/dev/null 2>&1; }
    has_lib libfabric.so.1 || { missing+=(libfabric1); vllm_libs_missing=1; }
    has_lib libibverbs.so.1 || { missing+=(libibverbs1); vllm_libs_missing=1; }
fi
if [ ${#missing[@]} -eq 0 ] && [ ${#notes[@]} -eq 0 ]; then
    exit 0
fi
echo "error: the test command needs what this machine lacks:" >&2
for n in "${notes[@]}"; do echo "  - $n" >&2; done
if [ ${#missing[@]} -gt 0 ]; then
    echo "  - system packages: ${missing[*]}" >&2
    echo "    install them with: sudo apt-get install ${missing[*]}" >&2
fi
if [ "$vllm_libs_missing" = 1 ]; then
    echo "  (CSA2_SKIP_VLLM=1 runs the test command without the vLLM plugin stage, which needs libfabric1 and libibverbs1)" >&2
fi
exit 1
