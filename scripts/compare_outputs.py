#!/usr/bin/env python3
"""Compare two `csa2 <run|ab|trace> --json` outputs, ignoring wall-clock timing values.

Usage: python3 scripts/compare_outputs.py BEFORE.json AFTER.json  (exit 1 when a value differs)

Timing = any value under a `timings` object, or a key naming seconds / rates / time ratios.
Everything else (bytes, accuracy, digests, counts, trace-time fields) must be identical."""
import json, re, sys
TIMING = re.compile(r"(seconds|^prefill_s$|^decode_s$|^session_s$|tok_s$|per_second|^ratio_step|"
                    r"^ratio_to_launch_day$|^ratio_ops$|^ratio_roles$|^spread_exceeds_difference$|^date_unix_s$|^workload_median$)")
def flat(d, pre=""):
    if isinstance(d, dict):
        for k, v in d.items():
            if k == "timings" or TIMING.search(k):
                continue
            yield from flat(v, f"{pre}.{k}")
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from flat(v, f"{pre}[{i}]")
    else:
        yield pre, d
a, b = (dict(flat(json.load(open(p)))) for p in sys.argv[1:3])
diff = [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
print(f"{sys.argv[1]} vs {sys.argv[2]}: {len(a)} compared values, {len(diff)} differ")
for k, x, y in diff[:40]:
    print(f"  {k}: {x!r} -> {y!r}")
sys.exit(1 if diff else 0)
