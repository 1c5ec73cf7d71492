#!/usr/bin/env bash
# The test command of README.md: every Rust test (unit, integration, doc).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --all-targets
