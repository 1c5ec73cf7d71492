"""Fails unless every `extern "C" __global__` kernel of kernels/*.cu is named in the host SIMT
harness's launch log (CSA2_EMU_LAUNCH_LOG: one line per launch that ran to completion).
    python3 scripts/kernels_ran.py LOG [WHAT]"""
import pathlib
import re
import sys

log = pathlib.Path(sys.argv[1])
what = sys.argv[2] if len(sys.argv) > 2 else "the host SIMT harness"
ran = set(log.read_text().split())
root = pathlib.Path(__file__).resolve().parent.parent
src = "".join(p.read_text() for p in sorted((root / "kernels").glob("*.cu")))
names = re.findall(r'extern "C" __global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)', src)
missing = [n for n in names if n not in ran]
if not names:
    sys.exit("kernels_ran: no kernel found in kernels/*.cu")
if missing:
    sys.exit(f"kernels that never ran on {what}: {' '.join(missing)}")
print(f"all {len(names)} kernels ran on {what}")
