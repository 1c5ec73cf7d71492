"""torch-CPU column of `csa2 ab`: one decode step of the 40-layer stack, written the way a user
would first write it in torch, on the same shapes as the A/B (real dimensions from
assets/deepseek_v41_flash_config.json), timed per layer role and per op like `csa2 ab`.

    PYTHON benches/torch_ab.py [--contexts 4K,128K] [--steps 1] [--threads 2] [--json OUT]

What it runs per layer (one request, one decode token): the mHC boundary at both sites (unfused
torch ops, 20 Sinkhorn iterations), the projections (wq_a, wq_b, wkv, compressor wkv/wgate, indexer
wq_b/weights_proj, grouped wo_a, wo_b) as f32 matmuls, RoPE on the last 64 dims, the compressor's
entry for ratio-1 layers, dense indexer logits over every visible index key followed by
torch.topk (Reindex layers: dense logits, then masked to the candidate pool, as launch day did), the
candidate pool at layer 20 (block max + topk), and attention with the per-head sink over the
gathered top-k entries plus the 128-token window.

Inputs are this script's own random data of the same shapes as `csa2 ab` (weights shared by the
layers of one role and ratio, as `csa2 ab --scale full` does), not the A/B's values: the figures are
times, not outputs. The KV cache is held in bf16 tensors (what a first torch port keeps; no FP4/FP8
records), entries for the context filled with random values. Each figure is the mean of `--steps`
steps after one warm-up step.
"""

import argparse
import json
import math
import os
import time
from collections import defaultdict

import torch

ROLES = ["full", "reindex", "reuse", "swa_only"]
OPS = ["projections", "rope", "compressor", "codecs", "indexer", "topk", "attention", "mhc"]


def parse_len(s):
    s = s.strip()
    mul = {"K": 1024, "k": 1024, "M": 1 << 20, "m": 1 << 20}.get(s[-1], 1)
    return int(s[:-1] if mul > 1 else s) * mul


def load_cfg():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "assets", "deepseek_v41_flash_config.json")) as f:
        c = json.load(f)
    return c.get("text_config", c)


def roles_from_geometry():
    """The 40-layer role plan printed by `csa2 geometry` (fixed for V4.1-Flash)."""
    plan = []
    for l in range(40):
        if l < 2:
            plan.append(("swa_only", 0, None, None, None))
        elif l < 20:
            src = 2 + (l - 2) // 6 * 6
            plan.append(("full" if l == src else "reuse", 2, src, src, None))
        else:
            idx = 20 if l < 24 else 24 + (l - 24) // 4 * 4
            if l == 20:
                plan.append(("full", 1, 20, 20, "writes"))
            elif l == idx:
                plan.append(("reindex", 1, 20, idx, "reads"))
            else:
                plan.append(("reuse", 1, 20, idx, None))
    return plan


class Timer:
    def __init__(self):
        self.t = defaultdict(float)

    def run(self, role, op, fn):
        t = time.perf_counter()
        r = fn()
        self.t[(role, op)] += time.perf_counter() - t
        return r


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, inv, inverse=False):
    """Rotates interleaved pairs of the last 64 dims of each row of x [..., D]."""
    ang = pos * inv
    c, s = torch.cos(ang), torch.sin(ang)
    if inverse:
        s = -s
    r = x[..., -64:].reshape(*x.shape[:-1], 32, 2)
    a, b = r[..., 0], r[..., 1]
    out = torch.stack([a * c - b * s, a * s + b * c], -1).reshape(*x.shape[:-1], 64)
    return torch.cat([x[..., :-64], out], -1)


def mhc_boundary(x, y, post, comb, pre, hc_fn, base, scale, norm, eps, iters=20, hc_eps=1e-6):
    """Unfused mHC boundary: post update, collapse + RMSNorm, next coefficients (Sinkhorn)."""
    if y is not None:
        x = post[:, None] * y[None, :] + comb.t() @ x
    u = rms((pre[:, None] * x).sum(0), norm, eps)
    flat = x.flatten()
    mix = (hc_fn @ flat) * torch.rsqrt(flat.pow(2).mean() + eps)
    pre_n = torch.sigmoid(mix[:4] * scale[0] + base[:4]) + hc_eps
    post_n = 2.0 * torch.sigmoid(mix[4:8] * scale[1] + base[4:8])
    cm = torch.softmax((mix[8:] * scale[2] + base[8:]).view(4, 4), -1) + hc_eps
    cm = cm / (cm.sum(0, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        cm = cm / (cm.sum(1, keepdim=True) + hc_eps)
        cm = cm / (cm.sum(0, keepdim=True) + hc_eps)
    return x, u, pre_n, post_n, cm


def make_weights(c, role, ratio, g):
    d, h, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    ql, ol, og = c["q_lora_rank"], c["o_lora_rank"], c["o_groups"]
    ih = c["index_n_heads"]

    def m(o, i):
        return torch.randn(o, i, generator=g) / math.sqrt(i)

    w = {
        "wq_a": m(ql, d), "wq_b": m(h * hd, ql), "wkv": m(512, d),
        "wo_a": m(og * ol, h // og * hd).view(og, ol, h // og * hd), "wo_b": m(d, og * ol),
        "sink": torch.zeros(h),
        "hc_attn": (m(24, 4 * d), torch.zeros(24), torch.ones(3)),
        "hc_ffn": (m(24, 4 * d), torch.zeros(24), torch.ones(3)),
    }
    if role == "full":
        w["c_wkv"] = m(512, d)
        if ratio == 2:
            w["c_wgate"] = m(512, d)
        w["wk"] = m(128, 512)
    if role in ("full", "reindex"):
        w["i_wq_b"] = m(ih * 128, ql)
        w["i_wp"] = m(ih, d)
    return w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4K,128K")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    c = load_cfg()
    eps = c["rms_norm_eps"]
    d, h, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    og, ih, k, win = c["o_groups"], c["index_n_heads"], c["index_topk"], c["sliding_window"]
    nblk, bsz = c.get("candidate_topk_blocks", 2048), c.get("candidate_block_size", 8)
    plan = roles_from_geometry()
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    shared = {}
    W = []
    for role, ratio, *_ in plan:
        if (role, ratio) not in shared:
            shared[(role, ratio)] = make_weights(c, role, ratio, g)
        W.append(shared[(role, ratio)])
    print(f"torch {torch.__version__}, {a.threads} threads; weights in {time.perf_counter() - t0:.1f} s")
    inv_local = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).double() / 64)).float()
    inv_global = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).double() / 64)).float()
    results = []
    for ctx in [parse_len(s) for s in a.contexts.split(",")]:
        # Caches: bf16 main KV / index K per Full layer (capacity for the steps), f32 windows.
        cap = ctx + a.steps + 2
        main_kv, index_k, count = {}, {}, {}
        for l, (role, ratio, *_r) in enumerate(plan):
            if role == "full":
                n = ctx // ratio
                main_kv[l] = torch.empty(cap // ratio + 1, 512, dtype=torch.bfloat16)
                main_kv[l][:n] = torch.randn(n, 512, generator=g).to(torch.bfloat16)
                index_k[l] = torch.empty(cap // ratio + 1, 128, dtype=torch.bfloat16)
                index_k[l][:n] = torch.randn(n, 128, generator=g).to(torch.bfloat16)
                count[l] = n
        windows = [torch.randn(win, 512, generator=g) for _ in plan]
        tm_total = defaultdict(float)
        step_total = 0.0
        for step in range(a.steps + 1):
            pos = ctx + step
            tm = Timer()
            t_step = time.perf_counter()
            x = torch.randn(d, generator=g).expand(4, d).clone()
            pre = torch.tensor([1.0, 0, 0, 0])
            pending = (None, None, None)
            topk_of, pool = {}, None
            for l, (role, ratio, kv_src, idx_src, cand) in enumerate(plan):
                w = W[l]
                inv = inv_local if role == "swa_only" else inv_global
                hf, hb, hs = w["hc_attn"]
                x, u, pre_a, post_a, comb_a = tm.run(role, "mhc", lambda: mhc_boundary(
                    x, pending[0], pending[1], pending[2], pre, hf, hb, hs, torch.ones(d), eps))

                def proj():
                    qr = rms(w["wq_a"] @ u, 1.0, eps)
                    q = (w["wq_b"] @ qr).view(h, hd)
                    kv = rms(w["wkv"] @ u, 1.0, eps)
                    return qr, q, kv
                qr, q, kv = tm.run(role, "projections", proj)
                q, kv = tm.run(role, "rope", lambda: (rope(q, pos, inv), rope(kv, pos, inv)))
                win_rows = tm.run(role, "codecs", lambda: torch.cat([windows[l][1:], kv[None]], 0))
                windows[l] = win_rows
                if role == "full":
                    def comp_proj():
                        kvc = w["c_wkv"] @ u
                        if ratio == 2:
                            _ = w["c_wgate"] @ u
                        return kvc
                    kvc = tm.run(role, "projections", comp_proj)
                    if ratio == 1:  # a ratio-2 token waits for its pair
                        def comp():
                            lat = rms(kvc, 1.0, eps).to(torch.bfloat16).float()
                            ik = rope(rms(w["wk"] @ lat, 1.0, eps), pos, inv)
                            n = count[l]
                            main_kv[l][n] = rope(lat, pos, inv).to(torch.bfloat16)
                            index_k[l][n] = ik.to(torch.bfloat16)
                            count[l] = n + 1
                        tm.run(role, "compressor", comp)
                sel = None
                if role in ("full", "reindex"):
                    def iproj():
                        qi = (w["i_wq_b"] @ qr).view(ih, 128)
                        wt = (w["i_wp"] @ u) * (128 ** -0.5) * (ih ** -0.5)
                        return qi, wt
                    qi, wt = tm.run(role, "projections", iproj)
                    qi = tm.run(role, "rope", lambda: rope(qi, pos, inv))
                    n = count[kv_src]
                    logits = tm.run(role, "indexer", lambda: (
                        torch.relu(index_k[kv_src][:n].float() @ qi.t()) @ wt))
                    if cand == "reads" and pool is not None and n > nblk * bsz:
                        def mask():
                            keep = torch.zeros(n, dtype=torch.bool)
                            ids = (pool[:, None] * bsz + torch.arange(bsz)).flatten()
                            keep[ids[ids < n]] = True
                            return logits.masked_fill(~keep, float("-inf"))
                        logits = tm.run(role, "topk", mask)
                    if cand == "writes" and n > nblk * bsz:
                        def blocks():
                            nb = (n + bsz - 1) // bsz
                            padded = torch.full((nb * bsz,), float("-inf"))
                            padded[:n] = logits
                            return torch.topk(padded.view(nb, bsz).amax(-1), nblk).indices
                        pool = tm.run(role, "topk", blocks)
                    sel = tm.run(role, "topk", lambda: torch.topk(logits, min(k, n)).indices)
                    topk_of[l] = sel
                elif role == "reuse":
                    sel = topk_of[idx_src]

                def attend():
                    keys = win_rows
                    if sel is not None:
                        keys = torch.cat([main_kv[kv_src][sel].float(), win_rows], 0)
                    s = (q @ keys.t()) * hd ** -0.5
                    s = torch.cat([s, w["sink"][:, None]], 1)
                    p = torch.softmax(s, -1)[:, :-1]
                    return p @ keys
                o = tm.run(role, "attention", attend)
                o = tm.run(role, "rope", lambda: rope(o, pos, inv, inverse=True))

                def oproj():
                    z = torch.bmm(w["wo_a"], o.reshape(og, -1, 1)).flatten()
                    return w["wo_b"] @ z
                y = tm.run(role, "projections", oproj)
                pre = pre_a
                hf, hb, hs = w["hc_ffn"]
                x, u2, pre_f, post_f, comb_f = tm.run(role, "mhc", lambda: mhc_boundary(
                    x, y, post_a, comb_a, pre, hf, hb, hs, torch.ones(d), eps))
                pre = pre_f
                pending = (u2, post_f, comb_f)
            dt = time.perf_counter() - t_step
            if step > 0:
                step_total += dt
                for key, v in tm.t.items():
                    tm_total[key] += v
        n = max(a.steps, 1)
        by_role = {r: sum(v for (rr, _), v in tm_total.items() if rr == r) / n for r in ROLES}
        by_op = {o: sum(v for (_, oo), v in tm_total.items() if oo == o) / n for o in OPS}
        row = {"context": ctx, "step_seconds": step_total / n, "by_role": by_role, "by_op": by_op}
        results.append(row)
        print(f"{ctx:>9} torch | {row['step_seconds']:8.4f} | "
              + " ".join(f"{r}={by_role[r]:.4f}" for r in ROLES) + " | "
              + " ".join(f"{o}={by_op[o]:.4f}" for o in OPS))
        del main_kv, index_k
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": a.threads, "contexts": results}, f, indent=2)


if __name__ == "__main__":
    main()
