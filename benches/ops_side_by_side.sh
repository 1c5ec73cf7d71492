#!/usr/bin/env bash
# Interleaves `csa2 bench ops` and the torch CPU baseline (benches/torch_ops.py) ROUNDS times, with
# the same thread count for rayon and torch, printing the load average before each run. Extra
# arguments (--keys, --prefill-tokens, --prefill-ratio, --reps, --prefill-reps) go to both.
#
#   cargo build --release --bin csa2
#   ROUNDS=2 benches/ops_side_by_side.sh --reps 7 --prefill-tokens 16384
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(nproc)}
PY=${PY:-.venv-ops/bin/python}
for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r csa2: $(date -u '+%F %T UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)"
  RAYON_NUM_THREADS=$THREADS target/release/csa2 bench ops "$@"
  echo "== round $r torch: $(date -u '+%F %T UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)"
  "$PY" benches/torch_ops.py --threads "$THREADS" "$@"
done
