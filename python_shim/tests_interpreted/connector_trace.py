"""The Mooncake conversation trace through vLLM 0.33's real ``Scheduler`` with ``Csa2Connector``.

No model runs: every step's outputs are synthetic (one sampled token per running request), and the
worker side is not attached — the connector's scheduler side plans every load and save, and its
size-only DRAM mirror makes the pool's capacity/TTL/LRU decisions. The KV cache groups are
DeepSeek-V4.1-Flash's own (40 backbone layers, SM100 records) through vLLM's KV planner, with the
HBM budget given. Time is virtual: a step lasts (prefill tokens / 20,000 s) + 30 ms when it
decodes, the same model as ``csa2 trace``; requests arrive at their trace timestamps.

Tokens: trace block ``h`` (512 tokens) is the token ids ``h·512 … h·512 + 511``, so equal hash ids
give equal tokens and vLLM's chained block hashes (256-token blocks) agree exactly where the
trace's prefixes do. Output tokens are unique per request and never prompt tokens (a later turn
never reuses them; :class:`OutputTokens`), as in ``csa2 trace``.

    CUDA_VISIBLE_DEVICES= python connector_trace.py --trace <trace.jsonl[.gz]> --requests N --json out.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def read_trace(path: str, n: int | None):
    with open(path, "rb") as f:
        magic = f.read(2)
    op = gzip.open if magic == b"\x1f\x8b" else open
    out = []
    with op(path, "rt") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if n is not None and len(out) >= n:
                    break
    return out


def tokens_of(rec) -> list[int]:
    n = rec["input_length"]
    toks = []
    for h in rec["hash_ids"]:
        toks.extend(range(h * 512, h * 512 + 512))
    return toks[:n]


class OutputTokens:
    """The synthetic sampled tokens: output token ``n`` of request ``r<i>`` is
    ``base + (outputs of the requests before i) + n``, with ``base`` past every prompt token (trace
    block ``h`` is tokens ``h·512 … h·512 + 511``). So no two requests ever share an output token
    and none equals a prompt token, as in ``csa2 trace`` — a later turn never reuses an output.
    (The engine's own sampler, a function of the request id's character sum and the step, gave
    ``r12`` and ``r21`` the same outputs: two such requests with the same prompt saved the same
    output blocks once, and the run counted fewer records than the traffic has.)"""

    def __init__(self, trace):
        self.base = (max((max(r["hash_ids"], default=0) for r in trace), default=0) + 1) * 512
        self.start = []
        at = 0
        for r in trace:
            self.start.append(at)
            at += max(1, r["output_length"])

    def __call__(self, rid: str, n: int) -> int:
        return self.base + self.start[int(rid[1:])] + n


def account_records(eng, sc, trace) -> dict:
    """Which full blocks the connector saved, against two rules computed from the requests
    themselves: vLLM's (a finished request has computed ``prompt + output − 1`` tokens: the last
    sampled token is never fed back, so its KV is never written) and ``csa2 trace``'s (the output
    end counts ``prompt + output`` tokens). Lists the requests whose blocks differ from vLLM's
    rule, so every record apart is accounted for."""
    per = sc.layout.prefix_block_tokens
    want_vllm, want_sim, owner = set(), set(), {}
    for i, r in enumerate(trace):
        req = eng.requests[f"r{i}"]
        n_out = max(1, r["output_length"])
        vk = sc._block_keys(req, r["input_length"] + n_out - 1)
        want_vllm.update(vk)
        for k in vk:
            owner.setdefault(k, i)
        # csa2 trace hashes exactly the prompt + output_length tokens (0 outputs: the prompt).
        want_sim.update(sc._block_keys(req, r["input_length"] + r["output_length"]))
    got = sc._ssd_added
    missing = want_vllm - got
    extra = got - want_vllm
    who = sorted({owner[k] for k in missing})
    return {"saved": len(got), "vllm_rule": len(want_vllm), "sim_rule": len(want_sim),
            "sim_rule_minus_vllm_rule": len(want_sim - want_vllm),
            "requests_ending_on_a_block_boundary": sum(
                (r["input_length"] + r["output_length"]) % per == 0 and r["output_length"] > 0
                for r in trace),
            "missing_vs_vllm_rule": len(missing), "extra_vs_vllm_rule": len(extra),
            "requests_with_missing": [
                {"request": i, "input": trace[i]["input_length"],
                 "output": trace[i]["output_length"],
                 "missing": sum(owner[k] == i for k in missing)} for i in who[:50]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--requests", type=int, default=None, help="a prefix of the trace")
    ap.add_argument("--hbm-gib", type=float, default=16.0)
    ap.add_argument("--dram-gib", type=float, default=None, help="default: 10%% of host memory")
    ap.add_argument("--ttl-s", type=float, default=300.0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import _connector_engine as E
    from csa2_vllm import _store
    from csa2_vllm import connector as conn

    t0 = time.time()
    work = tempfile.mkdtemp(prefix="csa2-trace-")
    tiny = E.Tiny(os.path.join(work, "model"), full=True, hbm_bytes=int(a.hbm_gib * (1 << 30)),
                  max_num_seqs=a.max_num_seqs, max_num_batched_tokens=8192,
                  max_model_len=1 << 18)
    clock = _store.ManualClock(0)
    conn.use_clock(clock)
    extra = {"ssd_dir": os.path.join(work, "ssd"), "ssd_capacity_bytes": 1 << 50,
             "dram_ttl_s": a.ttl_s, "fsync": "never"}
    if a.dram_gib is not None:
        extra["dram_pool_bytes"] = int(a.dram_gib * (1 << 30))
    eng = E.Engine(tiny, extra, worker=False)
    sc = eng.sched_conn
    trace = read_trace(a.trace, a.requests)
    eng.sampled = OutputTokens(trace)
    prompt_tokens = sum(r["input_length"] for r in trace)
    nxt = 0
    dram_peak = dram_sum = samples = 0
    computed_at_admission = 0
    replays = hits_at_admission = 0  # requests admitted with a hit; those vLLM rewound 128 tokens
    seen = set()
    steps = idle = 0
    while nxt < len(trace) or eng.scheduler.has_requests() or sc.has_pending_push_work():
        now = clock.now_ms()
        if not eng.scheduler.has_requests() and nxt < len(trace):
            now = max(now, trace[nxt]["timestamp"])
            clock.advance(now - clock.now_ms())
        while nxt < len(trace) and trace[nxt]["timestamp"] <= now:
            r = trace[nxt]
            eng.add(f"r{nxt}", tokens_of(r), max(1, r["output_length"]))
            nxt += 1
        so = eng.step()
        steps += 1
        if so.total_num_scheduled_tokens == 0 and not so.kv_connector_metadata.saves \
                and not so.kv_connector_metadata.loads and nxt >= len(trace):
            idle += 1
            if idle > 1000:
                stuck = {r.request_id: (str(r.status), r.num_computed_tokens, r.num_tokens)
                         for r in eng.scheduler.requests.values()}
                raise RuntimeError(f"the scheduler stalled with {stuck}; plans "
                                   f"{ {k: (v.hit_tokens, v.allocated) for k, v in sc._plans.items()} } "
                                   f"unsettled {sc._unsettled} delayed {sc._delayed}")
        else:
            idle = 0
        if steps % 500 == 0:
            print(f"step {steps}: {nxt}/{len(trace)} admitted, {len(eng.finished)} finished, "
                  f"virtual {clock.now_ms() / 1000:.0f} s, wall {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        for nr in so.scheduled_new_reqs:
            if nr.req_id not in seen:
                seen.add(nr.req_id)
                computed_at_admission += nr.num_computed_tokens
                hits_at_admission += nr.num_computed_tokens > 0
                replays += nr.replay_start > 0
        prefill = sum(n for n in so.num_scheduled_tokens.values() if n > 1)
        decode = any(n == 1 for n in so.num_scheduled_tokens.values())
        clock.advance(int(prefill / 20.0) + (30 if decode else 0) or 1)
        d = sc._dram_mirror.stats().bytes
        dram_peak = max(dram_peak, d)
        dram_sum += d
        samples += 1
    c = sc.counters
    rec_bytes = sc.layout.block_bytes + 64
    res = {
        "requests": len(trace), "steps": steps, "virtual_s": clock.now_ms() / 1000,
        "wall_s": round(time.time() - t0, 1), "prompt_tokens": prompt_tokens,
        "block_bytes": sc.layout.block_bytes, "num_gpu_blocks": tiny.kv_cache_config.num_blocks,
        "hbm_prefix_cache_hits_tokens": None,
        "computed_at_admission_tokens": computed_at_admission,
        "requests_admitted_with_a_hit": hits_at_admission,
        "bounded_replays": replays,
        "connector": dict(c),
        "ssd_records": len(sc._ssd_added), "ssd_gib": len(sc._ssd_added) * rec_bytes / 2**30,
        "dram": vars(sc._dram_mirror.stats()) if hasattr(sc._dram_mirror.stats(), "__dict__")
        else sc._dram_mirror.stats().__dict__,
        "dram_peak_gib": dram_peak / 2**30, "dram_mean_gib": dram_sum / max(samples, 1) / 2**30,
        "dram_pool_gib": sc.config.dram_pool_bytes / 2**30,
    }
    res["records"] = account_records(eng, sc, trace)
    pcs = eng.scheduler.kv_cache_manager.make_prefix_cache_stats()
    if pcs is not None:
        res["hbm_prefix_cache"] = {"queries": pcs.queries, "hits": pcs.hits}
    eng.close()
    conn.use_clock(None)
    print(json.dumps(res, indent=1, default=str))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return res


if __name__ == "__main__":
    main()
