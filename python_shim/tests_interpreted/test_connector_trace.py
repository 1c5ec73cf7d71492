"""The trace driver (``connector_trace.py``: the Mooncake trace through vLLM's real ``Scheduler`` with
``Csa2Connector``) counts every SSD record the traffic makes, on a small synthetic trace whose
records are known by hand.

22 requests of 300 prompt tokens (one full 256-token block + 44) and 300 outputs: vLLM writes KV
for 599 tokens, two full blocks each. ``r12`` and ``r21`` have the same prompt (one shared block)
and ids with the same character sum; ``r5`` has 212 outputs, so prompt + outputs end exactly on a
block boundary (512) while vLLM computes 511 tokens: one full block. Records:
19 × 2 + 1 (``r5``) + 1 shared + 2 (the two output blocks of ``r12``/``r21``) = 42.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _trace(path):
    reqs = []
    for i in range(22):
        h = 1000 + (12 if i == 21 else i)
        reqs.append({"timestamp": 0, "input_length": 300, "output_length": 212 if i == 5 else 300,
                     "hash_ids": [h]})
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps(r) + "\n")


def test_every_request_has_its_own_outputs_and_every_record_is_counted(tmp_path):
    import connector_trace as T

    p = tmp_path / "t.jsonl"
    _trace(p)
    res = T.main(["--trace", str(p), "--hbm-gib", "1", "--dram-gib", "0.5"])
    rec = res["records"]
    # Failed before the driver's own output tokens: r12 and r21 sampled the same outputs and
    # their second blocks were one record (41).
    assert rec["saved"] == 42, rec
    assert rec["vllm_rule"] == 42 and rec["missing_vs_vllm_rule"] == 0, rec
    # csa2 trace's rule counts r5's last sampled token's KV as written: one record more.
    assert rec["sim_rule"] == 43 and rec["requests_ending_on_a_block_boundary"] == 1, rec
    assert res["ssd_records"] == 42


def test_output_tokens_are_unique_and_never_prompt_tokens():
    import connector_trace as T

    trace = [{"hash_ids": [3, 9], "output_length": 4}, {"hash_ids": [7], "output_length": 0},
             {"hash_ids": [], "output_length": 2}]
    out = T.OutputTokens(trace)
    toks = [out(f"r{i}", n) for i, r in enumerate(trace) for n in range(max(1, r["output_length"]))]
    assert len(set(toks)) == len(toks) == 7
    assert min(toks) >= 10 * 512  # past the last prompt token of hash id 9
