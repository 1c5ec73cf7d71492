#!/usr/bin/env bash
# Builds everything tests/gpu/lent.sh runs on a GPU machine without a network, cargo or nvcc, into
# target/gpu-lent/ (stripped; kernels embedded as sm_90a / sm_100a SASS + PTX + NVRTC source,
# libcuda dlopen'ed at run time). Needs nvcc here: $NVCC, else scripts/cuda-env.sh installs the
# compile-only toolchain.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
NVCC="${NVCC:-$("$root/scripts/cuda-env.sh")}"
export NVCC
dest=target/gpu-lent
mkdir -p "$dest"

cargo build --release --features cuda -p csa2 --lib --example gpu_validate
cp target/release/libcsa2.so target/release/examples/gpu_validate "$dest/"

# The test binaries: cargo prints their paths as JSON (one "executable" per test target).
exe() {
    cargo test --release --no-run --message-format=json "$@" |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])'
}
cp "$(exe --features cuda -p csa2 --lib | tail -1)" "$dest/csa2_lib"
cp "$(exe -p csa2-cli --features cuda --test suite | tail -1)" "$dest/suite"
strip "$dest"/* 2>/dev/null || true
ls -l "$dest"
du -sh "$dest"
