#!/usr/bin/env python3
"""GPU check of the shim's own device route, without vLLM: the functions csa2's layer runs in
``forward_mqa`` and its SM90 MXFP4 indexer, called with plain tensors in place of vLLM's metadata.

    CSA2_LIB=target/gpu-lent/libcsa2.so python3 tests/gpu/check_shim_route.py [--json PATH]

On a GPU (torch with CUDA, Triton, numpy; no vLLM, no network), in one process:

1. csa2's Triton writers (``csa2_vllm.writers``), compiled for the GPU, write the 288-B NVFP4
   compressed records and the 68-B MXFP4 index K into strided page pools; the records are read
   back (``gather_records`` + ``csa2_decode_rows``) and checked against their inputs within the
   formats' quantisation bound. The 528-B MXFP8 SWA records come from csa2's encoder.
2. The indexer: ``mxfp4_index_q`` (the Q quantiser) into the shim's Q workspace dtype, then
   ``route.score`` (``csa2_indexer_logits_pool`` + ``csa2_topk_on_stream``) into the top-k buffer;
   its selection against an f64 evaluation (near-ties allowed). ``csa2_candidates_on_stream`` on
   the same logits against the torch rule (``select_candidate_blocks``).
3. The lists (``route.pool_lists``, device, no host check) equal the host lists (``check=True``);
   a padded batch (a padding token whose request id lies past the table) included.
4. Attention (``route.csa2_attend_pools``, and ``csa2_attention_pools`` with ``lse`` on both
   kernels, simt and mma) against an f64 reference: partial tiles, −1 holes, zero and one-entry
   lists, padded heads zero; the element bound is ``abs + rel · Σ p|v|``; lse within 1e-3.
5. A bad slot in each pool and a bad block in the index-K table reach ``route.errors``
   (code, row, column, value) through ``ErrorRecords.poll``, not an exception.
6. A compressed pool whose slab spans more than 4 GiB, read at its far end (``--no-big`` skips).
7. In a fresh process (``--graph-child``): ``csa2_cuda_preload`` and buffer allocation only, no
   eager csa2 launch; indexer + top-k + attention captured in one CUDA graph, replayed twice,
   bitwise equal to an eager run afterwards.

``--emu`` runs steps 1–5 on the CPU: host tensors presented as CUDA DLPack views
(``_lib.present_host_as_cuda``) against a library built with ``--features cuda-emu`` (every CUDA
branch of the library on the host SIMT harness) and the Triton writers in Triton's interpreter.
The test command runs it (python_shim/run_tests.sh), so this script is exercised on every run.

Exit status: 0 all passed, 1 a check failed, 2 a setup error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types

if "--emu" in sys.argv:  # before Triton (or vLLM's view of it, where installed) is imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "python_shim"))
from csa2_vllm import _lib, indices, route, writers  # noqa: E402  (none imports vLLM)

RATIO, BS, SWA_STATES, HEADS, PADDED, IDX_HEADS, TOPK = 4, 16, 32, 16, 64, 8, 24
SCALE = 512 ** -0.5
#: Per kernel (rel, abs) of the bound |out − ref| ≤ abs + rel · Σ_j p_j |v_j| (bf16 output
#: rounding is 2^-8 of that sum; the mma kernel also rounds the weights p to bf16).
TOL = {"simt": (8e-3, 1e-6), "mma": (1.6e-2, 1e-6)}
results: list[dict] = []


def check(name: str, ok: bool, **detail) -> None:
    results.append({"check": name, "ok": bool(ok), **detail})
    print(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(detail) if detail else ''}", flush=True)


def fmt(name):
    return _lib.record_format_named(name)


def decode(pool, slots, name):
    """f32 values of the records at ``slots`` of a pool (any layout, any device)."""
    recs = indices.gather_records(pool, slots.to(pool.device).long()).cpu().contiguous()
    return torch.from_numpy(_lib.decode_rows(fmt(name).format_id, recs.numpy()))


def strided_pool(blocks, states, width, device, pad=192, far=0):
    """A ``[blocks, states, width]`` view with a padded block stride (vLLM's slab), optionally
    placed ``far`` bytes into its allocation."""
    stride = states * width + pad
    base = torch.zeros(far + blocks * stride, dtype=torch.uint8, device=device)
    return torch.as_strided(base, (blocks, states, width), (stride, width, 1), far), base


def build_case(device, far=0):
    """Three requests (one long, one short, one of 5 tokens), decode tokens then prefill tokens,
    and a padding token whose request id is past the table; pools written as vLLM's writers do."""
    g = torch.Generator().manual_seed(27)
    seq = [300, 90, 5]
    nblk = [(s + BS * RATIO - 1) // (BS * RATIO) for s in seq]
    width = max(nblk)
    blocks = sum(nblk) + 2
    perm = torch.randperm(blocks, generator=g)
    table = torch.full((len(seq), width), -1, dtype=torch.int32)
    k = 0
    for r, n in enumerate(nblk):
        table[r, :n] = perm[k:k + n].int()
        k += n
    cmp_pool, cmp_base = strided_pool(blocks, BS, 288, device, far=far)
    idx_pool, _ = strided_pool(blocks, BS, 68, device)
    swa_pool, _ = strided_pool(blocks, SWA_STATES, 528, device)
    # Compressed entries and index keys of every request, through csa2's Triton writers
    # (identity RoPE: cos 1, sin 0, so the expected record values are the inputs).
    slots = torch.cat([(table[r, j // BS].long() * BS + j % BS)[None]
                       for r, s in enumerate(seq) for j in range(s // RATIO)])
    n = slots.numel()
    cos_sin = torch.cat([torch.ones(4096, 32), torch.zeros(4096, 32)], 1).to(device)
    latent = (torch.randn(n, 512, generator=g) * 2).bfloat16().to(device)
    pos = torch.arange(n, dtype=torch.int64, device=device) * RATIO
    writers.nvfp4_insert(latent, pos, cos_sin, cmp_pool, slots.to(device), 1)
    k_pre = torch.randn(n, 128, generator=g).bfloat16().to(device)
    norm_w = (torch.rand(128, generator=g) + 0.5).to(device)
    writers.mxfp4_index_k_store(k_pre, pos, cos_sin, norm_w, 1e-6, idx_pool, slots.to(device), 1)
    got = decode(cmp_pool, slots, "nvfp4")
    x = latent.float().cpu()
    amax = x.view(n, -1, 16).abs().amax(-1, keepdim=True)
    err = ((got - x).view(n, -1, 16).abs() - 1.07 * amax / 6).amax()
    check("triton nvfp4 writer records read back", float(err) <= 1e-6, worst=float(err))
    kf = k_pre.float().cpu()
    kn = (kf * torch.rsqrt((kf * kf).mean(1, keepdim=True) + 1e-6) * norm_w.cpu()).bfloat16()
    got = decode(idx_pool, slots, "mxfp4")
    amax = kn.float().view(n, -1, 32).abs().amax(-1, keepdim=True)
    err = ((got - kn.float()).view(n, -1, 32).abs() - 2 * amax / 6).amax()
    check("triton mxfp4 index-K writer records read back", float(err) <= 1e-6, worst=float(err))
    # SWA records from csa2's encoder, every state of every block.
    swa_vals = (torch.randn(blocks * SWA_STATES, 512, generator=g) * 2)
    recs = _lib.encode_rows(fmt("mxfp8").format_id, swa_vals.numpy())
    recs = torch.as_tensor(recs).view(blocks, SWA_STATES, 528)
    swa_pool.copy_(recs.to(device))
    # Tokens: 3 decode (one per request), 3 prefill of request 0, one padding token.
    req = torch.tensor([0, 1, 2, 0, 0, 0, len(seq)], dtype=torch.int32)
    positions = torch.tensor([299, 89, 4, 40, 41, 7, 0], dtype=torch.int64)
    valid = torch.tensor([True] * 6 + [False])
    nd, npf = 3, 4
    t = req.numel()
    swa_w = 37  # not a multiple of any tile: partial tiles
    swa_idx = torch.randint(0, blocks * SWA_STATES, (t, swa_w), generator=g, dtype=torch.int32)
    swa_idx[:, 5] = -1  # a hole
    swa_len = torch.tensor([37, 1, 0, 20, 37, 3, 0], dtype=torch.int32)  # short and zero lengths
    md = types.SimpleNamespace(
        num_decode_tokens=nd, num_prefill_tokens=npf, token_to_req_indices=req.to(device),
        is_valid_token=valid.to(device), decode_swa_indices=swa_idx[:nd].to(device),
        decode_swa_lens=swa_len[:nd].to(device), prefill_swa_indices=swa_idx[nd:].to(device),
        prefill_swa_lens=swa_len[nd:].to(device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device))
    cmp_md = types.SimpleNamespace(block_size=BS * RATIO, block_table=table.to(device))
    topk_buf = torch.full((t, TOPK), -1, dtype=torch.int32, device=device)
    layer = types.SimpleNamespace(
        compress_ratio=RATIO, topk_indices_buffer=topk_buf, n_local_heads=HEADS,
        swa_cache_layer=types.SimpleNamespace(kv_cache=swa_pool), scale=SCALE,
        attn_sink=(torch.randn(HEADS, generator=g)).to(device),
        compressed_cache_prefix="cmp", _compressed_kv_cache=lambda: cmp_pool)
    op = types.SimpleNamespace(k_cache=types.SimpleNamespace(kv_cache=idx_pool),
                               compress_ratio=RATIO, topk_tokens=TOPK,
                               topk_indices_buffer=topk_buf, candidate_blocks=None)
    qi = torch.randn(t, IDX_HEADS, 128, generator=g).bfloat16().to(device)
    wi = torch.randn(t, IDX_HEADS, generator=g).to(device)
    q = (torch.randn(t, PADDED, 512, generator=g)).bfloat16().to(device)
    return types.SimpleNamespace(
        layer=layer, op=op, md=md, cmp_md=cmp_md, q=q, qi=qi, wi=wi, positions=positions.to(device),
        cos_sin=cos_sin, table=table, cmp_pool=cmp_pool, idx_pool=idx_pool, swa_pool=swa_pool,
        blocks=blocks, t=t, device=device)


def index_q(c):
    rows = c.t
    q_out = route._Workspace.get("q", (rows, IDX_HEADS, 128), route.INDEX_Q_DTYPE, c.device)
    w_out = route._Workspace.get("w", (rows, IDX_HEADS), torch.float32, c.device)
    route.mxfp4_index_q(c.qi, c.positions, c.cos_sin, c.wi, 128 ** -0.5, IDX_HEADS ** -0.5,
                        q_out, w_out)
    return q_out, w_out


def run_indexer(c):
    q_out, w_out = index_q(c)
    route.score(c.op, q_out[:c.t], w_out[:c.t], c.positions, c.md.token_to_req_indices,
                c.cmp_md.block_table)
    return q_out, w_out


def check_indexer(c):
    q_out, w_out = run_indexer(c)
    sel = c.op.topk_indices_buffer.cpu()
    # f64 reference: Σ_h w·ReLU(q·k) over each request's visible entries.
    n = c.table.shape[1] * BS
    cols = torch.arange(n)
    req = indices.request_rows(c.md.token_to_req_indices.cpu(), c.table.shape[0])
    worst_rows = []
    for t in range(c.t - 1):  # the padding token's row is never read
        r = int(req[t])
        vis = min((int(c.positions[t]) + 1) // RATIO, n)
        slots = c.table[r, cols[:vis] // BS].long() * BS + cols[:vis] % BS
        keys = decode(c.idx_pool, slots, "mxfp4").double()
        logit = (torch.relu(q_out[t].double().cpu() @ keys.T) * w_out[t].double().cpu()[:, None]) \
            .sum(0)
        want = set(torch.topk(logit, min(TOPK, vis)).indices.tolist()) if vis else set()
        got = set(x for x in sel[t].tolist() if x >= 0)
        if got != want:
            kth = torch.topk(logit, min(TOPK, vis)).values[-1]
            gap = max(abs(float(logit[i] - kth)) for i in got ^ want)
            if gap > 1e-3 * float(logit.abs().max()):
                worst_rows.append(t)
    check("indexer score + top-k (device route, workspace Q dtype "
          f"{str(route.INDEX_Q_DTYPE).removeprefix('torch.')}) vs f64", not worst_rows,
          rows=worst_rows)


def check_candidates(c):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(c.t - 1, 64, generator=g).to(c.device)
    pos = c.positions[: c.t - 1]
    out = torch.full((c.t - 1, 4), -1, dtype=torch.int32, device=c.device)
    err = route.errors.tensor("topk", c.device)
    stream = route.stream_of(logits)
    _lib.candidates_on_stream(logits, pos, RATIO, 8, out, error=err, stream=stream)
    want = torch.full_like(out, -1)
    route.select_candidate_blocks(logits.cpu(), ((pos.cpu() + 1) // RATIO).clamp(max=64), 8,
                                  want.cpu() if not want.is_cuda else want)
    same = all(set(a) == set(b) for a, b in zip(out.cpu().tolist(), want.cpu().tolist()))
    check("candidates_on_stream vs select_candidate_blocks", same)


def lists_of(c, check_host):
    if check_host:
        host = types.SimpleNamespace(**{k: (v.cpu() if torch.is_tensor(v) else v)
                                        for k, v in vars(c.md).items()})
        cmd = types.SimpleNamespace(block_size=c.cmp_md.block_size, block_table=c.table)
        lay = types.SimpleNamespace(compress_ratio=RATIO,
                                    topk_indices_buffer=c.layer.topk_indices_buffer.cpu())
        return route.pool_lists(lay, c.positions.cpu(), host, cmd, check=True)
    return route.pool_lists(c.layer, c.positions, c.md, c.cmp_md, check=False)


def reference(c, q, m_idx, m_len, s_idx, s_len, sink):
    """f64 attention with the sink, lse (no sink) and Σ p|v| per output element."""
    t, h = q.shape[0], HEADS
    out = torch.zeros(t, PADDED, 512, dtype=torch.float64)
    pv = torch.zeros_like(out)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    for i in range(t):
        ms = [s for s in m_idx[i, : int(m_len[i])].tolist() if s >= 0]
        ss = [s for s in s_idx[i, : int(s_len[i])].tolist() if s >= 0]
        parts = []
        if ms:
            parts.append(decode(c.cmp_pool, torch.tensor(ms), "nvfp4"))
        if ss:
            parts.append(decode(c.swa_pool, torch.tensor(ss), "mxfp8"))
        if not parts:
            continue
        kv = torch.cat(parts).double()
        z = q[i, :h].double().cpu() @ kv.T * SCALE
        a = sink.double().cpu()[:, None]
        m = torch.maximum(z.amax(1, keepdim=True), a)
        e = torch.exp(z - m)
        den = e.sum(1, keepdim=True) + torch.exp(a - m)
        p = e / den
        out[i, :h] = p @ kv
        pv[i, :h] = p @ kv.abs()
        lse[i] = (torch.log(e.sum(1)) + m[:, 0])
    return out, pv, lse


def within(got, want, pv, rel, abs_):
    """(violations, worst |out − ref| / bound over the live heads)."""
    d = (got.double().cpu() - want).abs()
    bound = abs_ + rel * pv
    return int((d > bound).sum()), float((d / bound)[:, :HEADS].max())


def check_attention(c):
    dev = lists_of(c, False)
    host = lists_of(c, True)
    same = all(torch.equal(a.cpu(), b.cpu()) for pd, ph in zip(dev, host)
               for a, b in zip(pd[2:], ph[2:]))
    check("pool_lists on the device = host lists (padded batch, request id past the table)", same)
    out = torch.zeros_like(c.q)
    route.csa2_attend_pools(c.layer, c.q, c.positions, c.md, c.cmp_md, out)
    sink = c.layer.attn_sink[:HEADS].float().contiguous()
    for lo, hi, mi, ml, si, sl in dev:
        want, pv, lse_ref = reference(c, c.q[lo:hi], mi.cpu(), ml.cpu(), si.cpu(), sl.cpu(), sink)
        bad, worst = within(out[lo:hi].float(), want, pv, *TOL[os.environ.get(
            "CSA2_ATTENTION_KERNEL", "simt") if os.environ.get("CSA2_ATTENTION_KERNEL") in TOL
            else "simt"])
        check(f"csa2_attend_pools rows {lo}..{hi} vs f64 (Σp|v| bound)", bad == 0, worst=worst)
        for kern, (rel, abs_) in TOL.items():
            os.environ["CSA2_ATTENTION_KERNEL"] = kern
            o = torch.zeros_like(c.q[lo:hi])
            lse = torch.zeros(hi - lo, HEADS, dtype=torch.float32, device=c.device)
            _lib.attention_pools(c.q[lo:hi].contiguous(), c.cmp_pool, mi, ml, c.swa_pool, si, sl,
                                 sink, HEADS, SCALE, o, lse=lse,
                                 error=route.errors.tensor("attention", c.device),
                                 stream=route.stream_of(o))
            os.environ.pop("CSA2_ATTENTION_KERNEL")
            bad, worst = within(o.float(), want, pv, rel, abs_)
            lc = lse.double().cpu()
            fin = torch.isfinite(lse_ref)
            diff = (lc[fin] - lse_ref[fin]).abs()
            lse_ok = bool((torch.isfinite(lc) == fin).all()) and \
                (diff.numel() == 0 or float(diff.max()) <= 1e-3)
            check(f"attention {kern} rows {lo}..{hi}: out (Σp|v| bound), lse, padded heads zero",
                  bad == 0 and lse_ok and not o[:, HEADS:].any(), worst=worst, lse_ok=lse_ok)


def sync(x):
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def check_errors(c):
    route.errors.poll()
    sync(c.q)
    route.errors.poll()  # nothing pending from the good calls above
    before = dict(route.errors.counts)
    sink = c.layer.attn_sink[:HEADS].float().contiguous()
    q = c.q[:1].contiguous()
    cap_m, cap_s = c.blocks * BS, c.blocks * SWA_STATES
    for which, code in (("compressed", 1), ("swa", 2)):
        m = torch.tensor([[0, cap_m if which == "compressed" else 1]], dtype=torch.int32)
        s = torch.tensor([[0, cap_s if which == "swa" else 1]], dtype=torch.int32)
        two = torch.tensor([2], dtype=torch.int32)
        _lib.attention_pools(q, c.cmp_pool, m.to(c.device), two.to(c.device), c.swa_pool,
                             s.to(c.device), two.to(c.device), sink, HEADS, SCALE,
                             torch.zeros_like(q), error=route.errors.tensor("attention", c.device),
                             stream=route.stream_of(q))
        seen = route.errors.poll()
        sync(q)
        seen += route.errors.poll()
        rec = dict(seen).get("attention")
        check(f"bad {which} slot reported through route.errors", rec is not None
              and rec[0] == code and rec[2] == 1, record=rec)
    table = c.cmp_md.block_table.clone()
    c.cmp_md.block_table[0, 0] = c.blocks + 7  # a block past the index-K pool
    try:
        run_indexer(c)
    finally:
        c.cmp_md.block_table.copy_(table)
    seen = route.errors.poll()
    sync(q)
    seen += route.errors.poll()
    check("bad index-K block reported through route.errors", "indexer" in dict(seen),
          record=dict(seen).get("indexer"))
    check("error counters advanced", route.errors.counts["attention"] >= before["attention"] + 2
          and route.errors.counts["indexer"] >= before["indexer"] + 1, counts=route.errors.counts)


def check_big_slab(device):
    far = (4 << 30) + 4096
    c = build_case(device, far=far)
    check_attention_quick(c, "slab over 4 GiB")


def check_attention_quick(c, what):
    run_indexer(c)
    out = torch.zeros_like(c.q)
    route.csa2_attend_pools(c.layer, c.q, c.positions, c.md, c.cmp_md, out)
    sink = c.layer.attn_sink[:HEADS].float().contiguous()
    ok = True
    for lo, hi, mi, ml, si, sl in lists_of(c, False):
        want, pv, _ = reference(c, c.q[lo:hi], mi.cpu(), ml.cpu(), si.cpu(), sl.cpu(), sink)
        ok &= within(out[lo:hi].float(), want, pv, *TOL["simt"])[0] == 0
    check(f"attention on a {what}", ok)


def graph_child():
    """Fresh process: preload and allocations only, then capture indexer + top-k + attention."""
    dev = torch.device("cuda", torch.cuda.current_device())
    c = build_case(dev)  # Triton writers and torch ops only: no csa2 library launch
    route.require_device_route(dev.index, "the graph check")
    for p in route.errors.PRODUCERS:
        route.errors.tensor(p, dev)
    n = c.table.shape[1] * BS
    rows = max(1, route.LOGITS_BUDGET_BYTES // (4 * n))
    route._Workspace.get("logits", (rows, n), torch.float32, dev)
    index_q(c)  # torch ops only (the Q quantiser), allocates its workspace
    route.pool_lists(c.layer, c.positions, c.md, c.cmp_md, check=False)  # torch ops only
    out = torch.zeros_like(c.q)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        run_indexer(c)
        route.csa2_attend_pools(c.layer, c.q, c.positions, c.md, c.cmp_md, out)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    g_top, g_out = c.op.topk_indices_buffer.clone(), out.clone()
    c.op.topk_indices_buffer.fill_(-1)
    out.zero_()
    run_indexer(c)
    route.csa2_attend_pools(c.layer, c.q, c.positions, c.md, c.cmp_md, out)
    torch.cuda.synchronize()
    check("graph replay (captured after preload only) = eager, bitwise",
          torch.equal(g_top, c.op.topk_indices_buffer) and torch.equal(g_out.view(torch.int16),
                                                                    out.view(torch.int16)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--emu", action="store_true", help="CPU run against a cuda-emu library")
    ap.add_argument("--graph-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-big", action="store_true", help="skip the slab over 4 GiB")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    try:
        if args.graph_child:
            graph_child()
        elif args.emu:
            if not route.cuda_support(0).launches:
                print("SETUP ERROR: --emu needs a library built with --features cuda-emu "
                      f"({route.cuda_support(0).describe()})")
                return 2
            with _lib.present_host_as_cuda():
                c = build_case(torch.device("cpu"))
                check_indexer(c)
                check_candidates(c)
                check_attention(c)
                check_errors(c)
        else:
            if not torch.cuda.is_available():
                print("SETUP ERROR: no CUDA device (use --emu on a CPU machine)")
                return 2
            dev = torch.device("cuda", torch.cuda.current_device())
            # The graph check first, in its own process: nothing of csa2 has launched there.
            child = subprocess.run([sys.executable, os.path.abspath(__file__), "--graph-child"],
                                   capture_output=True, text=True, timeout=300)
            print(child.stdout + child.stderr, end="")
            check("graph child process", child.returncode == 0 and "FAIL" not in child.stdout,
                  rc=child.returncode)
            route.require_device_route(dev.index, "the shim route check")
            c = build_case(dev)
            check_indexer(c)
            check_candidates(c)
            check_attention(c)
            check_errors(c)
            if not args.no_big:
                check_big_slab(dev)
    except _lib.Csa2Error as e:
        print(f"SETUP ERROR: {e}")
        return 2
    failed = [r for r in results if not r["ok"]]
    print(f"== {len(results) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
