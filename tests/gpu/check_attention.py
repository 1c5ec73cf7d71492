#!/usr/bin/env python3
"""GPU check of ``csa2_attention_pools``: csa2's CUDA kernel on vLLM-shaped page slabs.

Run on a machine with one NVIDIA GPU (sized for an H200: < 8 min from a cold start, no network;
needs torch with CUDA and numpy; no vLLM):

    CSA2_LIB=target/gpu-check/libcsa2.so python3 tests/gpu/check_attention.py

with the library built beforehand on any machine by ``bash tests/gpu/build_attention_check.sh``
(``--features cuda``, SASS + PTX for sm_90a and sm_100a embedded). ``--dry-run`` runs only the
CPU side (slab building, CPU encoders, the CPU entry against the torch reference) and needs no GPU.

What it does:

1. Builds per-block slabs exactly as vLLM 0.33 lays them out (docs/VLLM.md "The GPU serving
   route"): one slab row per block id holding the SWA page (32 states) then the compressed page
   (block 256 tokens, ratio 4: 64 states), each page at an aligned offset; a layer's cache is an
   ``as_strided`` ``[blocks, states, record bytes]`` view whose ``stride(0)`` is the slab size.
   Record kinds: the SM90 default (V4 584 B, block-planar, both pools) and the V4.1 SM100 pair
   (NVFP4 288 B compressed + MXFP8 528 B SWA, interleaved; what csa2's layer asks for on SM90 too).
   Records come from csa2's CPU encoders (``csa2_encode_rows``), placed as vLLM's writers place them.
2. Correctness: the GPU entry against the CPU entry on the same slabs (copied to the host), both
   against a float64 torch reference (dequantise + gather + softmax with sink); NaN/Inf positions
   must agree, elements within the tolerance table's ``GPU_BF16_VS_F64`` (src/tolerance.rs),
   cosine; padded heads zero; a bad slot sets the kernel's error flag.
3. ``torch.cuda.graph`` capture of the entry on a side stream and replay: bitwise equal to eager.
4. Timing at decode batches 1 / 32 / 128 × 64 heads, contexts 64K and 1M tokens (top-k 512
   compressed entries + 128 SWA rows per token): µs (CUDA events, median), GB/s moved, TFLOP/s,
   the roofline from two figures measured in the same run (device-to-device copy bandwidth, a
   large bf16 matmul's rate), % of that roofline, and the ratio to a torch reference on the same
   slab (gather + dequantise + bf16 attention).

Exit status: 0 when every check passes, 1 on a failed check, 2 on a setup error (no GPU, library
without CUDA support, ...). The table and verdicts are printed; ``--json PATH`` writes them too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "python_shim"))
from csa2_vllm import _lib  # noqa: E402  (ctypes only: imports no vLLM)

# src/tolerance.rs::GPU_BF16_VS_F64 (bf16 outputs against an f64 reference): keep in step.
TOL = {"abs": 1e-6, "rel": 8e-3, "cos_diff": 1e-6}
# src/tolerance.rs::BF16_DOTS_VS_F64: the tensor-core kernel rounds the softmax weights to bf16.
TOL_MMA = {"abs": 5e-2, "rel": 5e-2, "cos_diff": 2e-5}
#: The CUDA kernels, selected per call with CSA2_ATTENTION_KERNEL (src/ops/attention/cuda.rs):
#: the reference kernel, the unsplit tensor-core kernel, the split one (the default) and the
#: split one on 32-head blocks (two blocks per SM).
KERNELS = {"simt": TOL, "mma": TOL_MMA, "split": TOL_MMA, "split-h32": TOL_MMA}


def use_kernel(name):
    os.environ["CSA2_ATTENTION_KERNEL"] = name
# Two bf16 results of f32 sums in different orders: one bf16 ulp (2^-8) apart where they
# straddle a rounding boundary, i.e. the same element bound.
TOPK, WINDOW, HEADS, SWA_STATES, BLOCK_TOKENS, RATIO = 512, 128, 64, 32, 256, 4
CMP_STATES = BLOCK_TOKENS // RATIO

KINDS = {
    # name: (compressed width, SWA width)
    "sm90_v4_584": (584, 584),
    "v41_nvfp4_288_mxfp8_528": (288, 528),
}
FORMAT = {288: 0, 528: 2, 584: 3}
DATA = {288: 256, 528: 512, 584: 576}


def log(*a):
    print(*a, flush=True)


# ---- slabs ---------------------------------------------------------------------------------------

class Slabs:
    """SWA and compressed pools of ``blocks_swa`` / ``blocks_cmp`` blocks in one per-block slab
    allocation each group (SWA groups and the compressed group alias from byte 0 in vLLM; here
    they are two slabs with the same row layout, which addresses identically)."""

    def __init__(self, kind, swa_blocks, cmp_blocks, device, rng):
        self.main_w, self.swa_w = KINDS[kind]
        align = 576 if self.swa_w == 584 else 512
        pages = [SWA_STATES * self.swa_w, CMP_STATES * self.main_w]
        offs = [0, -(-pages[0] // align) * align]
        self.stride = -(-(offs[1] + pages[1]) // align) * align + align  # padded, as vLLM's lcm
        self.swa_slab = torch.empty((swa_blocks, self.stride), dtype=torch.uint8, device=device)
        self.cmp_slab = torch.empty((cmp_blocks, self.stride), dtype=torch.uint8, device=device)
        self.swa_slab.fill_(0xFF)
        self.cmp_slab.fill_(0xFF)
        self.swa = self.swa_slab.as_strided((swa_blocks, SWA_STATES, self.swa_w),
                                            (self.stride, self.swa_w, 1), offs[0])
        self.main = self.cmp_slab.as_strided((cmp_blocks, CMP_STATES, self.main_w),
                                             (self.stride, self.main_w, 1), offs[1])
        self._fill(self.swa, self.swa_w, rng)
        self._fill(self.main, self.main_w, rng)

    @staticmethod
    def _pages(width, states, n_pages, rng):
        """``n_pages`` pages of CPU-encoded records (uint8 [n_pages, states · width]) in vLLM's
        in-page layout: interleaved rows, or block-planar (all data, then all scales) for 584."""
        x = rng.standard_normal((n_pages * states, 512), dtype=np.float32) * 1.5
        rec = _lib.encode_rows(FORMAT[width], x).reshape(n_pages, states, width)
        if width == 584:
            d = DATA[width]
            rec = np.concatenate([rec[:, :, :d].reshape(n_pages, -1),
                                  rec[:, :, d:].reshape(n_pages, -1)], 1)
        return torch.from_numpy(np.ascontiguousarray(rec.reshape(n_pages, states * width)))

    def _fill(self, view, width, rng):
        """Every page gets valid records: up to 256 distinct encoded pages, tiled over the pool
        (the bytes between pages stay 0xFF)."""
        blocks, states = view.shape[0], view.shape[1]
        tmpl = self._pages(width, states, min(256, blocks), rng).to(view.device)
        page = view.as_strided((blocks, states * width), (view.stride(0), 1))
        for b0 in range(0, blocks, tmpl.shape[0]):
            n = min(tmpl.shape[0], blocks - b0)
            page[b0:b0 + n].copy_(tmpl[:n])


def decode_lists(batch, context, slabs, rng, device):
    """Per-token lists for ``batch`` decode tokens, each a request with ``context`` tokens:
    top-k ``TOPK`` distinct compressed entries of the request (global slots of its blocks, in a
    shuffled block table) and its last ``WINDOW`` SWA rows (global slots)."""
    entries = context // RATIO
    cmp_blocks_per_req = -(-entries // CMP_STATES)
    swa_blocks_per_req = -(-WINDOW // SWA_STATES) + 1
    cmp_perm = torch.randperm(slabs.main.shape[0], generator=rng)
    swa_perm = torch.randperm(slabs.swa.shape[0], generator=rng)
    m_idx = torch.empty((batch, TOPK), dtype=torch.int32)
    s_idx = torch.empty((batch, WINDOW), dtype=torch.int32)
    for r in range(batch):
        table = cmp_perm[r * cmp_blocks_per_req:(r + 1) * cmp_blocks_per_req]
        j = torch.randperm(entries, generator=rng)[:TOPK]
        m_idx[r] = (table[j // CMP_STATES] * CMP_STATES + j % CMP_STATES).to(torch.int32)
        stable = swa_perm[r * swa_blocks_per_req:(r + 1) * swa_blocks_per_req]
        p = torch.arange(context - WINDOW, context) % (swa_blocks_per_req * SWA_STATES)
        s_idx[r] = (stable[p // SWA_STATES] * SWA_STATES + p % SWA_STATES).to(torch.int32)
    m_len = torch.full((batch,), TOPK, dtype=torch.int32)
    s_len = torch.full((batch,), WINDOW, dtype=torch.int32)
    return [t.to(device) for t in (m_idx, m_len, s_idx, s_len)]


def blocks_for(batch, context):
    cmp = batch * -(-(context // RATIO) // CMP_STATES)
    swa = batch * (-(-WINDOW // SWA_STATES) + 1)
    return swa, cmp


# ---- torch reference (dequantise + gather + attention) ------------------------------------------

def _e8m0(b):
    return torch.exp2(b.float() - 127.0)


def dequant(recs, width):
    """Records ``[n, width]`` uint8 (data then scales, csa2's record order) → [n, 512] float32."""
    if width == 528:
        v = recs[:, :512].view(torch.float8_e4m3fn).float()
        return (v.view(-1, 16, 32) * _e8m0(recs[:, 512:528])[:, :, None]).view(-1, 512)
    if width == 584:
        nope = recs[:, :448].view(torch.float8_e4m3fn).float()
        nope = (nope.view(-1, 7, 64) * _e8m0(recs[:, 576:583])[:, :, None]).view(-1, 448)
        rope = recs[:, 448:576].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, rope], 1)
    # 288: E2M1 pairs (even element low nibble), E4M3 scale per 16
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                       device=recs.device)
    d = recs[:, :256].long()
    v = torch.stack([lut[d & 15], lut[d >> 4]], 2).view(-1, 512)
    s = recs[:, 256:288].view(torch.float8_e4m3fn).float()
    return (v.view(-1, 32, 16) * s[:, :, None]).view(-1, 512)


def gather(view, slots, width):
    """Records of global ``slots`` (any shape, ≥ 0) from a strided pool, in csa2's record order."""
    states = view.shape[1]
    flat = slots.reshape(-1).long()
    blk, st = flat // states, flat % states
    row = view.as_strided((view.shape[0], states * width), (view.stride(0), 1))
    if width == 584:
        d = DATA[width]
        col = torch.cat([st[:, None] * d + torch.arange(d, device=view.device),
                         states * d + st[:, None] * 8 + torch.arange(8, device=view.device)], 1)
    else:
        col = st[:, None] * width + torch.arange(width, device=view.device)
    return row[blk[:, None], col]


def torch_reference(q, slabs, m_idx, s_idx, sink, heads, dtype=torch.float64):
    """Attention with the sink over the listed rows (all listed, no holes here)."""
    keys = torch.cat([dequant(gather(slabs.main, m_idx, slabs.main_w), slabs.main_w)
                      .view(m_idx.shape[0], -1, 512),
                      dequant(gather(slabs.swa, s_idx, slabs.swa_w), slabs.swa_w)
                      .view(s_idx.shape[0], -1, 512)], 1).to(dtype)
    qh = q[:, :heads].to(dtype)
    z = torch.einsum("thd,tkd->thk", qh, keys) * 512 ** -0.5
    a = sink.to(dtype)[None, :, None]
    m = torch.maximum(z.amax(2, keepdim=True), a)
    e = torch.exp(z - m)
    o = torch.einsum("thk,tkd->thd", e, keys) / (e.sum(2, keepdim=True) + torch.exp(a - m))
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    out[:, :heads] = o.double()
    return out


# ---- comparisons ---------------------------------------------------------------------------------

def compare(a, b, tol=TOL):
    """Stats of ``a`` against ``b`` (float64 on the host): special-value mismatches first, then
    the element bound |a − b| ≤ abs + rel·|b| and 1 − cos."""
    a, b = a.double().cpu().flatten(), b.double().cpu().flatten()
    special = int(((~torch.isfinite(a)) != (~torch.isfinite(b))).sum())
    fin = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[fin], b[fin]
    bound = tol["abs"] + tol["rel"] * b.abs()
    viol = int(((a - b).abs() > bound).sum())
    na, nb = a.norm(), b.norm()
    cos = 1.0 if na == 0 and nb == 0 else float((a @ b) / (na * nb).clamp_min(1e-300))
    st = {"special_mismatches": special, "violations": viol,
          "max_abs": float((a - b).abs().max()) if a.numel() else 0.0, "cos_diff": 1 - cos}
    st["ok"] = special == 0 and viol == 0 and st["cos_diff"] <= tol["cos_diff"]
    return st


def attend(q, slabs, lists, sink, heads, out, error=None, stream=0):
    m_idx, m_len, s_idx, s_len = lists
    _lib.attention_pools(q, slabs.main, m_idx, m_len, slabs.swa, s_idx, s_len, sink, heads,
                         512 ** -0.5, out, error=error, stream=stream)


def host_copy(slabs):
    """The same slabs on the host (same strides and offsets)."""
    h = Slabs.__new__(Slabs)
    h.main_w, h.swa_w, h.stride = slabs.main_w, slabs.swa_w, slabs.stride
    h.swa_slab, h.cmp_slab = slabs.swa_slab.cpu(), slabs.cmp_slab.cpu()
    h.swa = h.swa_slab.as_strided(slabs.swa.shape, slabs.swa.stride(), slabs.swa.storage_offset())
    h.main = h.cmp_slab.as_strided(slabs.main.shape, slabs.main.stride(),
                                   slabs.main.storage_offset())
    return h


# ---- checks --------------------------------------------------------------------------------------

def check_correctness(kind, device, rng_np, rng, results, padded=64, heads=64, batch=8,
                      context=8192):
    swa_b, cmp_b = blocks_for(batch, context)
    slabs = Slabs(kind, swa_b, cmp_b, device, rng_np)
    lists = decode_lists(batch, context, slabs, rng, device)
    q = torch.zeros(batch, padded, 512, dtype=torch.bfloat16)
    q[:, :heads] = (torch.randn(batch, heads, 512, generator=rng) * 2).to(torch.bfloat16)
    sink = torch.randn(heads, generator=rng) * 0.5
    name = f"{kind} T={batch} Hp={padded} H={heads}"
    ok = True
    host = slabs if device == "cpu" else host_copy(slabs)
    hl = [t.cpu() for t in lists]
    out_cpu = torch.full_like(q, float("nan"))
    attend(q, host, hl, sink, heads, out_cpu)
    # The tolerance row is for bf16 outputs against the f64 reference rounded to bf16.
    ref = torch_reference(q, host, hl[0], hl[2], sink, heads).to(torch.bfloat16)
    st = compare(out_cpu, ref)
    results.append({"check": f"cpu entry vs f64 torch reference, {name}", **st})
    ok &= st["ok"]
    if device != "cpu":
        qd, sd = q.to(device), sink.to(device)
        for kern, tol in KERNELS.items():
            use_kernel(kern)
            err = torch.zeros(4, dtype=torch.int32, device=device)
            out_gpu = torch.full_like(qd, float("nan"))
            attend(qd, slabs, lists, sd, heads, out_gpu, err,
                   torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            for what, b in (("cpu entry", out_cpu), ("f64 torch reference", ref)):
                st = compare(out_gpu, b, tol)
                results.append({"check": f"gpu {kern} kernel vs {what}, {name}", **st})
                ok &= st["ok"]
            pad_ok = bool((out_gpu[:, heads:] == 0).all())
            flag_ok = int(err[0]) == 0
            results.append({"check": f"gpu {kern}: padded heads zero, error flag clear, {name}",
                            "ok": pad_ok and flag_ok})
            ok &= pad_ok and flag_ok
            # A bad slot is skipped and recorded in the flag, never read.
            bad = [t.clone() for t in lists]
            bad[2][3, 5] = slabs.swa.shape[0] * SWA_STATES + 7
            attend(qd, slabs, bad, sd, heads, out_gpu, err,
                   torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            want = [2, 3, 5, slabs.swa.shape[0] * SWA_STATES + 7]
            flag_ok = err.cpu().tolist() == want
            results.append({"check": f"gpu {kern}: error flag names the bad slot {want}, {name}",
                            "ok": flag_ok, "flag": err.cpu().tolist()})
            ok &= flag_ok
    return ok


def check_graph(kind, device, rng_np, rng, results):
    batch, context = 32, 8192
    swa_b, cmp_b = blocks_for(batch, context)
    slabs = Slabs(kind, swa_b, cmp_b, device, rng_np)
    lists = decode_lists(batch, context, slabs, rng, device)
    q = (torch.randn(batch, 64, 512, generator=rng) * 2).to(torch.bfloat16).to(device)
    sink = (torch.randn(64, generator=rng) * 0.5).to(device)
    err = torch.zeros(4, dtype=torch.int32, device=device)
    eager = torch.empty_like(q)
    attend(q, slabs, lists, sink, 64, eager, err, torch.cuda.current_stream().cuda_stream)
    out = torch.full_like(q, float("nan"))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attend(q, slabs, lists, sink, 64, out, err, s.cuda_stream)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(float("nan"))
    with torch.cuda.graph(g):
        attend(q, slabs, lists, sink, 64, out, err, torch.cuda.current_stream().cuda_stream)
    g.replay()
    torch.cuda.synchronize()
    ok = torch.equal(out, eager)
    q2 = (torch.randn(batch, 64, 512, generator=rng) * 2).to(torch.bfloat16).to(device)
    q.copy_(q2)  # replay reads the new values at the captured addresses
    attend(q, slabs, lists, sink, 64, eager, err, torch.cuda.current_stream().cuda_stream)
    g.replay()
    torch.cuda.synchronize()
    ok2 = torch.equal(out, eager)
    ok3 = int(err[0]) == 0
    results.append({"check": f"cuda graph capture+replay bitwise == eager, "
                             f"{os.environ.get('CSA2_ATTENTION_KERNEL')} kernel, {kind}",
                    "ok": ok and ok2 and ok3})
    return ok and ok2 and ok3


def events_time(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return float(np.median(ts))


def rooflines(device):
    """Same-run device figures: D2D copy bandwidth (GB/s, read + write counted) and a large
    bf16 matmul's rate (TFLOP/s)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    us = events_time(lambda: b.copy_(a), 20)
    bw = 2 * n / (us * 1e-6) / 1e9
    del a, b
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    us = events_time(lambda: x @ y, 20)
    tf = 2 * m ** 3 / (us * 1e-6) / 1e12
    return bw, tf


def timing(kind, device, rng_np, rng, bw, tf, results, contexts, batches, iters):
    rows = []
    for context in contexts:
        bmax = max(batches)
        swa_b, cmp_b = blocks_for(bmax, context)
        t0 = time.time()
        slabs = Slabs(kind, swa_b, cmp_b, device, rng_np)
        lists_all = decode_lists(bmax, context, slabs, rng, device)
        log(f"   slabs for {kind} ctx {context}: {slabs.cmp_slab.numel() / 2**30:.2f} GiB "
            f"compressed + {slabs.swa_slab.numel() / 2**20:.1f} MiB SWA, {time.time() - t0:.1f} s")
        for batch in batches:
            lists = [t[:batch] for t in lists_all]
            q = (torch.randn(batch, 64, 512, generator=rng) * 2).to(torch.bfloat16).to(device)
            sink = (torch.randn(64, generator=rng) * 0.5).to(device)
            out = torch.empty_like(q)
            st = torch.cuda.current_stream().cuda_stream
            ref_us = events_time(lambda: torch_reference(q, slabs, lists[0], lists[2], sink, 64,
                                                         torch.bfloat16), max(3, iters // 4))
            for kern in KERNELS:
                use_kernel(kern)
                us = events_time(lambda: attend(q, slabs, lists, sink, 64, out, None, st), iters)
                rows.append(row_of(kind, kern, context, batch, us, ref_us, slabs, bw, tf))
        del slabs
        torch.cuda.empty_cache()
    results.extend({"check": "timing", "ok": True, **r} for r in rows)
    return rows


#: The split kernels' decode model written by ``gpu_validate --model-json`` (``--model``): blocks,
#: SMs covered and blocks per SM from the build's ptxas figures, per kernel, batch and context.
MODEL = None


def model_of(kern, context, batch, moved, flops, bw, tf):
    """The model's row for this kernel and shape beside a measurement, or None: its launch shape
    and the plan's floor from this run's figures — the row's bytes plus the split's partials at
    the copy bandwidth, or the FLOPs at the matmul rate on the covered SMs only."""
    k = (MODEL or {}).get("kernels", {}).get(kern)
    row = next((r for r in (k or {}).get("rows", [])
                if r["batch"] == batch and r["context"] == context), None)
    if row is None:
        return None
    sms = MODEL["sm_count"]
    floor = max((moved + row["partial_bytes"]) / (bw * 1e9),
                flops / (tf * 1e12) * sms / max(1, row["sms_covered"])) * 1e6
    return {"blocks": row["blocks"], "sms_covered": row["sms_covered"], "sm_count": sms,
            "blocks_per_sm": k["blocks_per_sm"], "splits": row["splits"], "waves": row["waves"],
            "partial_MB": row["partial_bytes"] / 1e6, "plan_floor_us": floor}


def model_text(m):
    return ("" if m is None else
            f"  | model: {m['splits']} split(s), {m['blocks']} blocks on {m['sms_covered']}/"
            f"{m['sm_count']} SMs, {m['blocks_per_sm']}/SM, {m['waves']} wave(s), partials "
            f"{m['partial_MB']:.2f} MB, plan floor {m['plan_floor_us']:.1f} µs")


def row_of(kind, kern, context, batch, us, ref_us, slabs, bw, tf):
    """One timing row: bytes moved = the listed records + q + out + the two slot lists; FLOPs =
    QKᵀ and PV over the 640 rows of each token for 64 heads; with ``--model``, the split kernels'
    modeled launch shape and plan floor beside it."""
    rows_per_tok = TOPK + WINDOW
    moved = batch * (TOPK * slabs.main_w + WINDOW * slabs.swa_w + 2 * 64 * 512 * 2
                     + rows_per_tok * 4)
    flops = batch * 64 * rows_per_tok * 512 * 2 * 2
    gbs = moved / (us * 1e-6) / 1e9
    tfs = flops / (us * 1e-6) / 1e12
    roof_us = max(moved / (bw * 1e9), flops / (tf * 1e12)) * 1e6
    row = {"kind": kind, "kernel": kern, "context": context, "batch": batch, "us": us,
           "GB/s": gbs, "TFLOP/s": tfs, "roofline_us": roof_us, "pct_roofline": 100 * roof_us / us,
           "torch_ref_us": ref_us, "speedup_vs_torch": ref_us / us,
           "model": model_of(kern, context, batch, moved, flops, bw, tf)}
    log(f"   {kind:24s} {kern:4s} ctx {context:>8d} B {batch:>4d}: {us:9.1f} µs {gbs:8.1f} GB/s "
        f"{tfs:6.2f} TFLOP/s  roofline {roof_us:8.1f} µs ({100 * roof_us / us:5.1f} %)  "
        f"torch ref {ref_us:9.1f} µs (×{ref_us / us:.1f})" + model_text(row["model"]))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU side only (slabs, encoders, CPU entry vs torch reference); no GPU")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per case (median)")
    ap.add_argument("--contexts", default="65536,1048576")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--model", help="the decode model gpu_validate --model-json wrote: printed "
                                    "beside the split kernels' timing rows")
    args = ap.parse_args()
    global MODEL
    if args.model:
        try:
            with open(args.model) as f:
                MODEL = json.load(f)
            names = ", ".join(MODEL["kernels"]) or "none (no ptxas figures in that build)"
            log(f"== decode model from {args.model}: {MODEL['sm_count']} SMs, kernels {names}")
        except (OSError, ValueError, KeyError) as e:
            log(f"SETUP ERROR: the decode model {args.model}: {e}")
            return 2
        if args.dry_run:
            # The join on the CPU: each modeled row beside its own bytes at the model's copy
            # bandwidth and the datasheet matmul rate (a GPU run uses its measured figures).
            for kern, k in MODEL["kernels"].items():
                for r in k["rows"]:
                    m = model_of(kern, r["context"], r["batch"], r["bytes"], r["flops"],
                                 MODEL["copy_GBps"], 989.0)
                    log(f"   {kern:9s} ctx {r['context']:>8d} B {r['batch']:>4d}" + model_text(m))
    t_start = time.time()
    results = []
    rng_np = np.random.default_rng(15)
    rng = torch.Generator().manual_seed(15)
    try:
        log(f"== csa2 attention-over-pools check, library {_lib.library_path()} "
            f"({_lib.version()}), torch {torch.__version__}")
        device = "cpu"
        if not args.dry_run:
            if not torch.cuda.is_available():
                log("SETUP ERROR: no CUDA device visible to torch (use --dry-run for the CPU side)")
                return 2
            device = "cuda"
            log(f"   device: {torch.cuda.get_device_name()} (cc {torch.cuda.get_device_capability()})")
            _lib.cuda_preload(torch.cuda.current_device())
    except _lib.Csa2Error as e:
        log(f"SETUP ERROR: {e.message}")
        return 2
    ok = True
    log("== 1. correctness on vLLM-layout slabs")
    for kind in KINDS:
        for padded, heads in ((64, 64), (128, 16)):
            ok &= check_correctness(kind, device, rng_np, rng, results, padded, heads,
                                    batch=4 if args.dry_run else 8,
                                    context=2048 if args.dry_run else 8192)
    if device == "cuda":
        log("== 2. CUDA graph capture + replay")
        for kern in KERNELS:
            use_kernel(kern)
            for kind in KINDS:
                ok &= check_graph(kind, device, rng_np, rng, results)
        log("== 3. timing (decode, 64 heads, top-k 512 + window 128)")
        bw, tf = rooflines(device)
        log(f"   same-run roofline figures: D2D copy {bw:.0f} GB/s, bf16 matmul {tf:.0f} TFLOP/s")
        results.append({"check": "roofline figures", "ok": True, "copy_GBps": bw,
                        "bf16_TFLOPs": tf})
        for kind in KINDS:
            timing(kind, device, rng_np, rng, bw, tf, results,
                   [int(c) for c in args.contexts.split(",")],
                   [int(b) for b in args.batches.split(",")], args.iters)
        # The goal: a split tensor-core kernel at batch >= 32 reaches >= 50 % of the roofline
        # and at least 5x the reference kernel's speed (same kind, context and batch); reported
        # for both split kernels (the 64-head default and the 32-head one, two blocks per SM).
        ref = {(r["kind"], r["context"], r["batch"]): r["us"] for r in results
               if r["check"] == "timing" and r["kernel"] == "simt"}
        for kern in ("split", "split-h32"):
            goal = [r for r in results if r["check"] == "timing" and r["kernel"] == kern
                    and r["batch"] >= 32]
            met = bool(goal) and all(r["pct_roofline"] >= 50 for r in goal)
            log(f"   goal ({kern}, batch >= 32, >= 50 % of roofline): {'met' if met else 'NOT met'}")
            fast = bool(goal) and all(
                ref.get((r["kind"], r["context"], r["batch"]), 0) >= 5 * r["us"] for r in goal)
            log(f"   goal ({kern} >= 5x the reference kernel at batch >= 32): "
                f"{'met' if fast else 'NOT met'}")
            results.append({"check": f"goal: {kern} kernel >= 50 % of roofline and >= 5x the "
                                     "reference at batch >= 32 (reported, not an exit criterion)",
                            "ok": True, "met": met and fast})
    for r in results:
        if r["check"] != "timing":
            log(f"   {'PASS' if r['ok'] else 'FAIL'}  {r['check']}"
                + ("" if r["ok"] or "violations" not in r else
                   f"  (special {r['special_mismatches']}, violations {r['violations']}, "
                   f"max_abs {r['max_abs']:.3g}, 1-cos {r['cos_diff']:.3g})"))
    log(f"== {'PASS' if ok else 'FAIL'} in {time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": bool(ok), "results": results}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
