"""torch-CPU baseline for `csa2 bench ops` (same shapes; run in the same session).

    .venv-ops/bin/python benches/torch_ops.py [--keys 1048576] [--prefill-tokens 4096] [--prefill-ratio 2]

Each figure is the median of a few runs (min–max spread printed), with torch's CPU thread count =
`--threads` (default: the machine's cores, which is what rayon uses for `csa2`). The
quantised caches are decoded with torch ops (the launch-day style: dequantise, then dense maths).
"""

import argparse
import math
import os
import time

import torch

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def best(fn, reps):
    """(median, min, max) wall seconds of `reps` runs after one warm-up."""
    fn()
    ts = []
    for _ in range(max(reps, 1)):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2], ts[0], ts[-1]


def line(name, st, flops, nbytes, note=""):
    secs, lo, hi = st
    print(f"{name:<44} {secs * 1e6:>10.1f} µs [{lo * 1e6:.1f}–{hi * 1e6:.1f}] | {flops / secs / 1e9:>8.2f} GFLOP/s | {nbytes / secs / 1e9:>7.2f} GB/s  {note}")


def decode_fp4(packed):  # [N, B] uint8 → [N, 2B] f32 (low nibble first)
    lo = (packed & 0xF).long()
    hi = (packed >> 4).long()
    return E2M1[torch.stack([lo, hi], -1).flatten(-2)]


def decode_mxfp4(rec):  # [N,68]
    v = decode_fp4(rec[:, :64]).view(-1, 4, 32)
    s = torch.exp2(rec[:, 64:68].float() - 127)
    return (v * s[:, :, None]).view(-1, 128)


def decode_nvfp4(rec):  # [N,288]
    v = decode_fp4(rec[:, :256]).view(-1, 32, 16)
    s = rec[:, 256:288].contiguous().view(torch.float8_e4m3fn).float()
    return (v * s[:, :, None]).view(-1, 512)


def decode_mxfp8(rec):  # [N,528]
    v = rec[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(-1, 16, 32)
    s = torch.exp2(rec[:, 512:528].float() - 127)
    return (v * s[:, :, None]).view(-1, 512)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1 << 20)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--prefill-ratio", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill-reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")

    x = torch.randn(1 << 20)
    t = best(lambda: x.sum(), a.reps * 4)
    line("read pass, 1M f32 (torch sum)", t, 1 << 20, 4 << 20, "baseline")
    t = best(lambda: torch.topk(x, 512), a.reps * 4)
    line("top-512 of 1M logits (torch.topk)", t, 0, 4 << 20)

    n = a.keys
    q = torch.randn(32, 128)
    w = torch.randn(32) / 64
    rec = torch.randint(0, 256, (n, 68), dtype=torch.uint8)
    rec[:, 64:] = torch.randint(120, 130, (n, 4), dtype=torch.uint8)
    macs = 32 * 128 * n

    def idx_quant():
        k = decode_mxfp4(rec)
        return torch.relu(k @ q.T) @ w

    t = best(idx_quant, a.reps)
    line(f"decode indexer, {n} MXFP4 keys (decode+dense)", t, 2 * macs, 68 * n)
    kf = decode_mxfp4(rec)
    t = best(lambda: torch.relu(kf @ q.T) @ w, a.reps)
    line(f"decode indexer, {n} f32 keys (dense only)", t, 2 * macs, 512 * n)
    kb16, qb16 = kf.bfloat16(), q.bfloat16()
    t = best(lambda: torch.relu(kb16 @ qb16.T).float() @ w, a.reps)
    line(f"decode indexer, {n} bf16 keys (dense only)", t, 2 * macs, 256 * n)
    del kb16
    t = best(lambda: torch.topk(idx_quant(), 512), a.reps)
    line("decode indexer + top-512 (MXFP4)", t, 2 * macs, 68 * n)

    # Reindex launch-day style: dense logits over every key, then mask outside the pool.
    pool = torch.zeros(n, dtype=torch.bool)
    pool[torch.randperm(n // 8)[:2048, None] * 8 + torch.arange(8)] = True
    for nn in [n, min(65536, n)]:
        r = rec[:nn]
        p = pool[:nn]

        def reindex():
            lg = torch.relu(decode_mxfp4(r) @ q.T) @ w
            lg = lg.masked_fill(~p, float("-inf"))
            return torch.topk(lg, 512)

        t = best(reindex, a.reps)
        line(f"reindex dense+mask at {nn} entries", t, 2 * 4096 * nn, 68 * nn)

    # Decode attention: 512 NVFP4 rows + 128 MXFP8 rows, 64 heads.
    main_rec = torch.randint(0, 256, (4096, 288), dtype=torch.uint8)
    main_rec[:, 256:] = torch.randint(0x20, 0x40, (4096, 32), dtype=torch.uint8)
    swa_rec = torch.randint(0, 256, (4096, 528), dtype=torch.uint8)
    swa_rec[:, :512] &= 0xF7  # avoid NaN codes
    swa_rec[:, 512:] = torch.randint(115, 125, (4096, 16), dtype=torch.uint8)
    sel = (torch.arange(512) * 7) % 4096
    qa = torch.randn(64, 512)
    sink = torch.randn(64)

    def attn():
        kv = torch.cat([decode_nvfp4(main_rec[sel]), decode_mxfp8(swa_rec[4096 - 128 :])])
        z = qa @ kv.T / math.sqrt(512)
        mx = torch.maximum(z.amax(-1), sink)
        e = torch.exp(z - mx[:, None])
        den = e.sum(-1) + torch.exp(sink - mx)
        return (e / den[:, None]) @ kv

    t = best(attn, a.reps * 4)
    line("decode attention 64×(512+128)×512, fp4+fp8", t, 4 * 64 * 640 * 512, 512 * 288 + 128 * 528)
    kv_pre = torch.cat([decode_nvfp4(main_rec[sel]), decode_mxfp8(swa_rec[4096 - 128 :])])

    def attn_pre():  # torch's best case: the rows already decoded to f32
        z = qa @ kv_pre.T / math.sqrt(512)
        mx = torch.maximum(z.amax(-1), sink)
        e = torch.exp(z - mx[:, None])
        den = e.sum(-1) + torch.exp(sink - mx)
        return (e / den[:, None]) @ kv_pre

    t = best(attn_pre, a.reps * 4)
    line("decode attention, pre-decoded f32 rows", t, 4 * 64 * 640 * 512, 4 * 640 * 512)

    tt, m = a.prefill_tokens, a.prefill_ratio
    ne = tt // m
    qp = torch.randn(tt, 32, 128)
    wp = torch.randn(tt, 32) / 64
    kp = decode_mxfp4(rec[:ne])
    vis = (torch.arange(tt) + 1) // m
    mask = torch.arange(ne)[None, :] >= vis[:, None]

    def prefill():
        out = torch.empty(tt, ne)
        for s in range(0, tt, 512):  # chunked like a real kernel, to bound the [T,32,N] temporary
            d = torch.relu(torch.einsum("thd,nd->thn", qp[s : s + 512], kp))
            out[s : s + 512] = torch.einsum("th,thn->tn", wp[s : s + 512], d)
        return out.masked_fill_(mask, float("-inf"))

    t = best(prefill, a.prefill_reps)
    macs = float(vis.sum()) * 4096
    line(f"prefill indexer {tt} tokens × {ne} entries (m={m})", t, 2 * macs, 4 * tt * ne, "dense then mask; GFLOP/s counts visible MACs")


if __name__ == "__main__":
    main()
