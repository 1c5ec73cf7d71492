"""The csa2 layer's ``forward_mqa`` route on CPU, side by side with torch on the same batch.

    CSA2_LIB=target/release/libcsa2.so PYTHONPATH=python_shim \\
        <vllm venv>/bin/python benches/vllm_forward_mqa.py [--tokens 32] [--context 65536] [--threads 2]

A decode batch of V4.1 shape (64 heads, top-k 512 over a ratio-2 compressed cache of NVFP4
records, a 128-token MXFP8 SWA window, the sink), laid out in vLLM's paged pools with shuffled
block tables. Figures (median of --reps, one warm-up):

- ``csa2 forward``: :func:`csa2_vllm.attention.csa2_attend`, everything ``forward_mqa`` does — the
  per-token lists from the metadata, the compact record gathers, the C ABI call, the copy out;
- ``csa2 call``: the ``csa2_attention_indexed`` call alone on the already-compacted inputs;
- ``csa2 pools``: :func:`csa2_vllm.attention.csa2_attend_pools`, the route ``forward_mqa`` takes —
  capture-safe lists, then ``csa2_attention_pools`` in place on the pools (no
  ``unique``, no gather); its output is checked equal to ``csa2 forward``'s;
- ``torch (pre-decoded)``: the same attention in torch on keys already dequantised to f32 and
  gathered per token (a lower bound for torch: no dequantisation, no gather), with the sink in
  the denominator; compare with ``csa2 call``;
- ``torch (dequantise + gather + attend)``: the launch-day way, from the same compact records
  (dequantised with torch ops, checked bit-equal to csa2's decoder); compare with ``csa2 forward``.
The glue share is (forward − call) / forward.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import time
import types

import torch

from csa2_vllm import _lib
from csa2_vllm import attention as layer_mod
from csa2_vllm import indices

H, WINDOW, TOPK, RATIO, BLOCK = 64, 128, 512, 2, 64


def best(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2], ts[0], ts[-1]


def records(g, n, width):
    r = torch.randint(0, 256, (n, width), generator=g, dtype=torch.int32).to(torch.uint8)
    if width == 288:
        r[:, 256:] = torch.randint(0x18, 0x30, (n, 32), generator=g, dtype=torch.int32).to(torch.uint8)
    else:  # MXFP8: O(1) E4M3 codes, scales 2^-3 .. 2^1
        c = torch.randint(0x28, 0x40, (n, 512), generator=g, dtype=torch.int32)
        c |= torch.randint(0, 2, (n, 512), generator=g, dtype=torch.int32) << 7
        r[:, :512] = c.to(torch.uint8)
        r[:, 512:] = torch.randint(124, 129, (n, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    return r


def paged(g, nreq, per_req_blocks, tokens_per_block, width):
    nb = nreq * per_req_blocks
    table = torch.randperm(nb, generator=g).to(torch.int32).reshape(nreq, per_req_blocks)
    return records(g, nb * tokens_per_block, width).reshape(nb, tokens_per_block, width), table


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def torch_dequant_nvfp4(rec):
    """(M, 288) NVFP4 records → (M, 512) f32 in torch ops (element 2i in the low nibble)."""
    packed = rec[:, :256]
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(1).long()
    scales = rec[:, 256:].view(torch.float8_e4m3fn).float()
    return (E2M1[codes].reshape(-1, 32, 16) * scales[:, :, None]).reshape(-1, 512)


def torch_dequant_mxfp8(rec):
    """(M, 528) MXFP8 records → (M, 512) f32 in torch ops (UE8M0 scale per 32 values)."""
    vals = rec[:, :512].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, 16, 32)
    scales = torch.exp2(rec[:, 512:].float() - 127.0)
    return (vals * scales[:, :, None]).reshape(-1, 512)


def decode(rec, fmt):
    """Records → f32 rows through ``csa2_decode_rows`` (exact)."""
    out = torch.empty(rec.shape[0], 512)
    status = _lib.lib().csa2_decode_rows(
        ctypes.c_int32(fmt), ctypes.c_void_p(rec.data_ptr()), ctypes.c_size_t(rec.numel()),
        ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(out.numel()))
    _lib.check(status, "csa2_decode_rows")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32, help="decode requests (one token each)")
    ap.add_argument("--context", type=int, default=65536, help="tokens per request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    # Same thread count for both sides; rayon reads this when csa2's pool first starts.
    os.environ.setdefault("RAYON_NUM_THREADS", str(a.threads))
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    t, ctx = a.tokens, a.context
    entries = ctx // RATIO
    swa_pool, swa_table = paged(g, t, math.ceil(ctx / BLOCK), BLOCK, 528)
    bs_c = BLOCK // RATIO
    cmp_pool, cmp_table = paged(g, t, math.ceil(entries / bs_c), bs_c, 288)
    pos = torch.full((t,), ctx - 1)
    req = torch.arange(t, dtype=torch.int32)
    win = pos[:, None] - torch.arange(WINDOW - 1, -1, -1)
    swa_idx = (swa_table.long()[req[:, None].long(), win // BLOCK] * BLOCK + win % BLOCK).to(torch.int32)
    topk = torch.stack([torch.randperm(entries, generator=g)[:TOPK] for _ in range(t)]).to(torch.int32)
    swa_md = types.SimpleNamespace(
        num_decode_tokens=t, num_prefill_tokens=0, num_decodes=t, decode_swa_indices=swa_idx,
        decode_swa_lens=torch.full((t,), WINDOW, dtype=torch.int32), token_to_req_indices=req,
        is_valid_token=torch.ones(t, dtype=torch.bool), seq_lens=torch.full((t,), ctx))
    cmp_md = types.SimpleNamespace(block_size=BLOCK, block_table=cmp_table)
    layer = types.SimpleNamespace(
        compress_ratio=RATIO, n_local_heads=H, scale=512 ** -0.5,
        attn_sink=torch.randn(H, generator=g), topk_indices_buffer=topk,
        swa_cache_layer=types.SimpleNamespace(kv_cache=swa_pool),
        compressed_cache_prefix="c", _compressed_kv_cache=lambda: cmp_pool)
    q = (torch.randn(t, H, 512, generator=g) * 2).to(torch.bfloat16)
    out = torch.empty_like(q)

    fwd = best(lambda: layer_mod.csa2_attend(layer, q, pos, swa_md, cmp_md, out), a.reps)
    out_pools = torch.empty_like(q)
    pools = best(lambda: layer_mod.csa2_attend_pools(layer, q, pos, swa_md, cmp_md, out_pools),
                 a.reps)
    assert torch.equal(out_pools, out), "the in-place route must equal the compacting route"

    # The call alone, on the compacted inputs forward_mqa builds.
    slots, lens = layer_mod._topk_lists(layer, pos, swa_md, cmp_md)
    main_rec, main_rows = indices.compact(cmp_pool, slots, lens, "c")
    swa_rec, swa_rows = indices.compact(swa_pool, swa_idx, swa_md.decode_swa_lens, "s")
    qh, sink = q.contiguous(), layer.attn_sink.float()
    o2, lse = torch.empty_like(qh), torch.empty(t, H)
    call = best(lambda: _lib.attention_indexed(
        qh, main_rec, main_rows, swa_rec, swa_rows, sink, o2, lse, main_len=lens,
        swa_len=swa_md.decode_swa_lens, main_format=0, swa_format=2, scale=layer.scale), a.reps)

    # torch on pre-decoded f32 keys, gathered per token: (T, 640, 512).
    main_f, swa_f = decode(main_rec, 0), decode(swa_rec, 2)
    keys = torch.cat([main_f[main_rows.long()], swa_f[swa_rows.long()]], 1)
    qf = q.float()

    def torch_attn():
        z = torch.einsum("thd,tnd->thn", qf, keys) * layer.scale
        s = sink[None, :, None].expand(t, H, 1)
        p = torch.softmax(torch.cat([z, s], -1), -1)[..., :-1]
        return torch.einsum("thn,tnd->thd", p, keys)

    ref = best(torch_attn, a.reps)

    # torch the launch-day way: dequantise the gathered records, gather per token, attend.
    def torch_full():
        mk, sk = torch_dequant_nvfp4(main_rec), torch_dequant_mxfp8(swa_rec)
        k = torch.cat([mk[main_rows.long()], sk[swa_rows.long()]], 1)
        z = torch.einsum("thd,tnd->thn", qf, k) * layer.scale
        s = sink[None, :, None].expand(t, H, 1)
        p = torch.softmax(torch.cat([z, s], -1), -1)[..., :-1]
        return torch.einsum("thn,tnd->thd", p, k)

    full = best(torch_full, a.reps)
    assert torch.equal(torch_dequant_nvfp4(main_rec), main_f)
    assert torch.equal(torch_dequant_mxfp8(swa_rec), swa_f)
    err = (out.float() - torch_attn()).abs().max().item()
    print(f"decode batch: {t} tokens × {H} heads, top-{TOPK} NVFP4 entries + {WINDOW} MXFP8 SWA rows "
          f"each, context {ctx}, {a.threads} threads")
    for name, (m, lo, hi) in [("csa2 forward (lists + gathers + call)", fwd),
                              ("csa2 pools (lists + in-place call)", pools),
                              ("csa2 call (csa2_attention_indexed)", call),
                              ("torch (pre-decoded f32 keys)", ref),
                              ("torch (dequantise + gather + attend)", full)]:
        print(f"  {name:<40} {m * 1e3:8.3f} ms  [{lo * 1e3:.3f}–{hi * 1e3:.3f}]")
    print(f"  max |csa2 forward − torch| = {err:.2e} (csa2's output is bf16, as q)")
    print(f"  glue share of forward: {(fwd[0] - call[0]) / fwd[0]:.1%}")
    print(f"  csa2 forward / csa2 pools: {fwd[0] / pools[0]:.2f}×")
    print(f"  torch pre-decoded / csa2 call: {ref[0] / call[0]:.2f}×; "
          f"torch dequantise+attend / csa2 forward: {full[0] / fwd[0]:.2f}×")


if __name__ == "__main__":
    main()
