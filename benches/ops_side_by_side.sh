#!/usr/bin/env bash
# The csa2-versus-torch ops table, side by side: `csa2 bench ops` and the torch CPU baseline
# (benches/torch_ops.py) interleaved ROUNDS times with the same thread count for rayon and torch,
# the load average printed before each run, then one table per round: each row's csa2 median,
# torch's same-run median and the ratio. Extra arguments (--keys, --reps, ...) go to both.
#
#   cargo build --release --bin csa2
#   python3 -m venv .venv-ops && .venv-ops/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
#   THREADS=2 ROUNDS=3 benches/ops_side_by_side.sh
#
# Without torch (PY unusable) the csa2 column is printed alone. After the rounds, the mHC row
# (fused boundary vs the unfused passes, no torch counterpart: the ratio is unfused / fused) comes
# from `cargo bench --bench mhc` at T = 16, 256, 4096 (MHC=0 skips it; MHC_SECONDS per figure).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(nproc)}
PY=${PY:-.venv-ops/bin/python}
BIN=${BIN:-target/release/csa2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r csa2: $(date -u '+%F %T UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)"
  RAYON_NUM_THREADS=$THREADS "$BIN" bench ops "$@" | tee "$tmp/csa2.$r"
  if "$PY" -c 'import torch' 2>/dev/null; then
    echo "== round $r torch: $(date -u '+%F %T UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)"
    "$PY" benches/torch_ops.py --threads "$THREADS" "$@" | tee "$tmp/torch.$r"
  else
    echo "== round $r torch: skipped ($PY cannot import torch)"
    : > "$tmp/torch.$r"
  fi
  python3 - "$tmp/csa2.$r" "$tmp/torch.$r" "$r" <<'PYEOF'
import re, sys
def rows(path):
    out = {}
    for l in open(path, encoding="utf-8"):
        m = re.match(r"^(.*?)\s+([0-9.]+) µs \[", l)
        if m:
            out[m.group(1).strip()] = float(m.group(2)) / 1000.0
    return out
c, t, rnd = rows(sys.argv[1]), rows(sys.argv[2]), sys.argv[3]
def find(d, *words):
    for k, v in d.items():
        if all(w in k for w in words):
            return v
    return None
table = [
    ("decode indexer, 1M MXFP4 keys, q f32 (f32 kernel)", find(c, "decode indexer,", "MXFP4 keys"), ("f32 keys", find(t, "decode indexer,", "f32 keys (dense only)")), "<= 20 ms"),
    ("decode indexer, q MXFP4 (int8 vpdpbusd)", find(c, "q Mxfp4, int8"), ("f32 keys", find(t, "decode indexer,", "f32 keys (dense only)")), "<= 20 ms"),
    ("decode indexer, q bf16 (bf16 vdpbf16ps)", find(c, "q Bf16, bf16"), ("bf16 keys", find(t, "decode indexer,", "bf16 keys (dense only)")), "<= 20 ms"),
    ("decode attention 64x(512+128)x512, f32 dots", find(c, "decode attention 64"), ("pre-decoded", find(t, "pre-decoded f32 rows")), "<= 1/3 torch"),
    ("decode attention, bf16 dots", find(c, "decode attention, bf16 dots"), ("pre-decoded", find(t, "pre-decoded f32 rows")), "<= 1/3 torch"),
    ("decode attention, int16 dots (default)", find(c, "decode attention, int16 dots"), ("pre-decoded", find(t, "pre-decoded f32 rows")), "<= 1/3 torch"),
]
# The dot-unit floors `csa2 bench ops` printed from this run's probes ("floor NAME: X µs (...)").
floors = {}
for l in open(sys.argv[1], encoding="utf-8"):
    m = re.match(r"^floor (.*?): ([0-9.]+) µs", l)
    if m:
        floors[m.group(1).strip()] = float(m.group(2)) / 1000.0
def floor_of(*words):
    return find(floors, *words)
# Per table row, the words of its floor line (the f32-query indexer row has none).
floor_keys = [None, ("decode indexer, q Mxfp4, int8",),
              ("decode indexer, q Bf16, bf16",), ("decode attention 64",),
              ("decode attention, bf16 dots",), ("decode attention, int16 dots",)]
# torch's own floor on the attention rows: the f32 path's FMA count at the f32 probe.
torch_floor = floor_of("decode attention 64")
print(f"\n== round {rnd} table (medians, ms; ratio = csa2 / torch; floor = dot-unit time at this run's probes)")
print(f"| {'op':<46} | {'csa2':>9} | {'torch (same run)':>24} | {'ratio':>6} | goal | floor | csa2 at | goal needs |")
print(f"|{'-'*48}|{'-'*11}|{'-'*26}|{'-'*8}|------|-------|---------|------------|")
for (name, cv, (tn, tv), goal), fk in zip(table, floor_keys):
    cs = f"{cv:9.3f}" if cv is not None else f"{'—':>9}"
    ts = f"{tv:.3f} ({tn})" if tv is not None else "—"
    ratio = f"{cv / tv:6.2f}" if cv is not None and tv else f"{'—':>6}"
    fl = floor_of(*fk) if fk else None
    fs = f"{fl:.3f}" if fl else "—"
    at = f"{100 * fl / cv:.0f}%" if fl and cv else "—"
    # The goal as a time, then the share of the floor a kernel must reach to meet it.
    gt = 20.0 if goal == "<= 20 ms" else (tv / 3 if tv else None)
    need = (f"{100 * fl / gt:.0f}%" + (" (under the floor)" if fl > gt else "")) if fl and gt else "—"
    print(f"| {name:<46} | {cs} | {ts:>24} | {ratio} | {goal} | {fs} | {at} | {need} |")
if torch_floor:
    for name, cv, (tn, tv), goal in table[3:4]:
        if tv:
            print(f"torch's attention rows: f32 FMA floor {torch_floor:.3f} ms, torch at {100 * torch_floor / tv:.0f}% of it")
for l in open(sys.argv[1], encoding="utf-8"):
    if l.startswith("reindex") and "ratio" in l:
        print(f"| {l.strip():<95} | goal: median ratio <= 1.1 |")
# The load-robust figures (thread CPU time) and the probed peaks the rows are bounded by.
print("\nprobed peaks and the int8 breakdown (thread CPU time):")
for l in open(sys.argv[1], encoding="utf-8"):
    if l.startswith(("threads ", "dot units", "int8 vpdpbusd on all", "memory read", "floor ")) or "breakdown" in l:
        print("  " + l.strip())
PYEOF
done
if [ "${MHC:-1}" != 0 ]; then
  echo "== mHC: $(date -u '+%F %T UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)"
  RAYON_NUM_THREADS=$THREADS CSA2_BENCH_SECONDS=${MHC_SECONDS:-2} CSA2_BENCH_TOKENS=16,256,4096 \
    cargo bench --bench mhc 2>/dev/null | tee "$tmp/mhc"
  python3 - "$tmp/mhc" <<'PYEOF'
import re, sys
print("\n== mHC table (medians, µs; ratio = unfused / fused; goal >= 1.6x at T >= 256)")
print("| T | fused | unfused | ratio | GEMV alone (% of FMA peak) | goal |")
print("|---:|---:|---:|---:|---:|---|")
for l in open(sys.argv[1], encoding="utf-8"):
    f = [x.strip() for x in l.split("|")]
    if len(f) >= 4 and f[0].isdigit():
        a, g = f[1].split(), f[3].split()
        goal = ">= 1.6x" if int(f[0]) >= 256 else "—"
        print(f"| {f[0]} | {a[0]} | {a[2]} | {a[4]} | {g[0]} ({g[2]}) | {goal} |")
# The peak the % column is taken of (thread CPU time, all threads at once) and the wall-clock rate
# of the same loop, which says how much of the cores the machine gave the run; then each T's
# floors (FMAs at that peak, modeled bytes at the all-thread memcpy rate) and the ratio they allow.
for l in open(sys.argv[1], encoding="utf-8"):
    if l.startswith(("FMA peak", "memcpy", "floor T=")):
        print("  " + l.strip())
PYEOF
fi
