"""vLLM 0.33's own torch references, run on CPU, against csa2's C ABI on the same inputs.

Conventions that differ, and how each test bridges them (nothing is loosened silently):

mHC (``vllm/model_executor/kernels/mhc/torch.py``):
- ``mhc_pre_delayed_torch`` returns the shifted collapse ``Σ_i pre_mix_i · residual_i`` *before* the
  layer's input RMSNorm (vLLM applies ``attn_norm``/``ffn_norm`` as a separate op); ``csa2_mhc``
  fuses that RMSNorm into ``layer_in``. The test applies the same RMSNorm in torch to vLLM's output.
- ``pre_mix=None`` means "stream 0" in vLLM; csa2 takes an explicit one-hot ``pre_prev``.
- vLLM rounds the collapse to the residual dtype; the test uses float32 residuals so both sides are
  f32 throughout.
- The post update is ``mhc_post_torch(y, residual, post, comb)``; ``comb[t][i][j]`` weighs input
  stream i in output stream j on both sides (same convention, no transpose).

Indexer logits (``vllm/v1/attention/ops/rocm_aiter_mla_sparse.py::fp8_mqa_logits_torch``):
- vLLM's path takes FP8 E4M3 Q and K plus one f32 scale per key row, and casts Q and K to bf16 and
  rounds every per-head score ``q_h · k_j`` to bf16 (the einsum runs in bf16). csa2 takes f32 keys
  (or MXFP4 records; V4.1 quantises Q to MXFP4, vLLM's reference has no MXFP4 path). The test feeds
  E4M3-valued Q and K (exact in bf16 and f32) to both, gives csa2 the keys already multiplied by
  their power-of-two scales (exact), and allows the bf16 rounding of the per-head scores: relative
  error ≤ 2^-8 per term, so ≤ 2^-8 · Σ_h |w_h| · |q_h · k_j| per logit.
- Masking: vLLM masks keys outside ``[ks, ke)``; csa2's rule is ``j < (p + 1) div ratio``. The
  test passes ``ks = 0, ke = (p + 1) div ratio`` and requires the −∞ pattern to match exactly.
"""

import numpy as np
import pytest
import torch

from csa2_vllm import _lib

mhc_ref = pytest.importorskip("vllm.model_executor.kernels.mhc.torch")
mla_sparse = pytest.importorskip("vllm.v1.attention.ops.rocm_aiter_mla_sparse")

HC = 4
POST_MULT, ITERS, HC_EPS, RMS_EPS = 2.0, 20, 1e-6, 1e-6


def _weights(g, d):
    fn = torch.randn(24, HC * d, generator=g) * 0.05
    base = torch.randn(24, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return fn, base, scale


def _rmsnorm(u, w, eps):
    return u * torch.rsqrt(u.square().mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("t, d", [(1, 8), (5, 64), (3, 257)])
@pytest.mark.parametrize("first_site", [True, False])
def test_mhc_matches_vllm_delayed_pre(t, d, first_site):
    g = torch.Generator().manual_seed(t * 1000 + d)
    x = torch.randn(t, HC, d, generator=g)
    fn, base, scale = _weights(g, d)
    norm = torch.rand(d, generator=g) + 0.5
    if first_site:
        pre_prev = torch.zeros(t, HC)
        pre_prev[:, 0] = 1.0
        vllm_pre_mix = None
    else:
        pre_prev = torch.rand(t, HC, generator=g) + 0.1
        vllm_pre_mix = pre_prev
    post_v, comb_v, layer_in_v, pre_v = mhc_ref.mhc_pre_delayed_torch(
        x, fn, scale, base, RMS_EPS, HC_EPS, HC_EPS, POST_MULT, ITERS, pre_mix=vllm_pre_mix)

    x_new, layer_in = torch.empty_like(x), torch.empty(t, d)
    pre, post, comb = torch.empty(t, HC), torch.empty(t, HC), torch.empty(t, HC, HC)
    params = _lib.MhcParams(POST_MULT, ITERS, HC_EPS, RMS_EPS)
    _lib.mhc(x, pre_prev, norm, x_new, layer_in, hc_fn=fn, hc_base=base, hc_scale=scale,
             pre_out=pre, post_out=post, comb_out=comb, params=params)

    assert torch.equal(x_new, x)  # no post update at this boundary
    torch.testing.assert_close(pre, pre_v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(post, post_v.squeeze(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_v, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(layer_in, _rmsnorm(layer_in_v.float(), norm, RMS_EPS),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t, d", [(2, 16), (4, 128)])
def test_mhc_post_update_matches_vllm_post(t, d):
    g = torch.Generator().manual_seed(7 + t + d)
    x = torch.randn(t, HC, d, generator=g)
    y = torch.randn(t, d, generator=g)
    post_prev = torch.rand(t, HC, generator=g) * 2
    comb_prev = torch.rand(t, HC, HC, generator=g)
    pre_prev = torch.rand(t, HC, generator=g)
    norm = torch.ones(d)
    want = mhc_ref.mhc_post_torch(y, x, post_prev.unsqueeze(-1), comb_prev)
    x_new, layer_in = torch.empty_like(x), torch.empty(t, d)
    _lib.mhc(x, pre_prev, norm, x_new, layer_in, y=y, post=post_prev, comb=comb_prev,
             params=_lib.MhcParams(POST_MULT, ITERS, HC_EPS, RMS_EPS))
    torch.testing.assert_close(x_new, want, rtol=1e-5, atol=1e-5)
    collapse = (pre_prev.unsqueeze(-1) * want).sum(1)
    torch.testing.assert_close(layer_in, _rmsnorm(collapse, norm, RMS_EPS), rtol=1e-4, atol=1e-5)


def _e4m3(x):
    return x.to(torch.float8_e4m3fn).to(torch.float32)


@pytest.mark.parametrize("q_quant", [0, 2])
@pytest.mark.parametrize("t, h, n, ratio", [(1, 32, 7, 1), (6, 32, 40, 2), (5, 4, 129, 1)])
def test_indexer_logits_match_vllm_fp8_mqa_logits(t, h, n, ratio, q_quant):
    # q_quant 2 (csa2's FP8 E4M3 fake quantisation of Q, one power-of-two scale per (token, head))
    # must be lossless on E4M3-valued Q within the scaled range, so it agrees too. q_quant 1 (MXFP4,
    # the V4.1 choice) is a different quantiser with no vLLM reference; it differs by design.
    g = torch.Generator().manual_seed(t * 31 + n)
    q = _e4m3(torch.randn(t, h, 128, generator=g) * 2)
    k = _e4m3(torch.randn(n, 128, generator=g) * 2)
    kscale = 2.0 ** torch.randint(-6, 2, (n,), generator=g).float()
    w = torch.randn(t, h, generator=g) * (128 ** -0.5) * (h ** -0.5)
    positions = torch.randint(0, n * ratio, (t,), generator=g)
    positions[-1] = n * ratio - 1  # one query sees every key
    ke = ((positions + 1) // ratio).to(torch.int32)
    ks = torch.zeros(t, dtype=torch.int32)
    want = mla_sparse.fp8_mqa_logits_torch(q, (k, kscale), w, ks, ke)

    got = torch.empty(t, n)
    _lib.indexer_logits(q, w, positions, k * kscale[:, None], ratio, q_quant, got)

    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(torch.isinf(want), torch.arange(n)[None, :] >= ke[:, None])
    fin = ~torch.isinf(want)
    # Bound of vLLM's bf16 per-head score rounding (see the module docstring).
    terms = (q.abs().double() @ (k * kscale[:, None]).abs().double().t())  # [t, h, n] upper bound
    bound = (w.abs().double().unsqueeze(-1) * terms).sum(1) * 2.0 ** -8 + 1e-6
    err = (got.double() - want.double()).abs()
    assert bool((err[fin] <= bound[fin]).all()), float((err - bound)[fin].max())
    # And the agreement is far tighter than "same order of magnitude": mostly within a few ulps of
    # bf16 relative to the logit's own scale.
    scale_ = want[fin].abs().double().max()
    assert float(err[fin].max() / scale_) < 2e-2


def test_indexer_rejects_what_vllm_would_silently_mask():
    # A query whose visible range exceeds the keys is an error in csa2, not a shorter mask.
    q = torch.zeros(1, 4, 128)
    w = torch.zeros(1, 4)
    with pytest.raises(_lib.Csa2Error) as e:
        _lib.indexer_logits(q, w, torch.tensor([9]), torch.zeros(3, 128), 1, 0, torch.empty(1, 3))
    assert e.value.status == 200 and "index keys" in e.value.message


def test_attention_matches_numpy_reference_on_cpu_tensors():
    # Not a vLLM oracle (vLLM 0.33 ships no CPU reference for the sparse+SWA+sink kernel): a direct
    # float64 evaluation of docs/SPEC.md §2 "Attention" on the same tensors.
    g = torch.Generator().manual_seed(3)
    t, h, n, s, k, window = 3, 2, 6, 9, 4, 4
    q = torch.randn(t, h, 512, generator=g)
    main = torch.randn(n, 512, generator=g)
    swa = torch.randn(s, 512, generator=g)
    topk = torch.tensor([[0, 5, -1, 2], [1, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    positions = torch.tensor([2, 6, 8])
    sink = torch.randn(h, generator=g)
    out, lse = torch.empty(t, h, 512), torch.empty(t, h)
    _lib.attention(q, main, swa, topk, positions, sink, out, lse, window=window)
    sc = 512 ** -0.5
    for i in range(t):
        p = int(positions[i])
        rows = [main[j].double() for j in topk[i].tolist() if j >= 0]
        rows += [swa[r].double() for r in range(max(p - window + 1, 0), p + 1)]
        kv = torch.stack(rows)
        for hh in range(h):
            z = kv @ q[i, hh].double() * sc
            m = max(float(z.max()), float(sink[hh]))
            e = torch.exp(z - m)
            o = (e[:, None] * kv).sum(0) / (e.sum() + np.exp(float(sink[hh]) - m))
            torch.testing.assert_close(out[i, hh].double(), o, rtol=1e-4, atol=1e-5)
            assert abs(float(lse[i, hh]) - float(torch.logsumexp(z, 0))) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_sparse_fwd_matches_float64_reference(dtype):
    # csa2's counterpart of flash_mla_sparse_fwd, on CPU tensors in vLLM's layouts.
    from csa2_vllm.attention import csa2_sparse_fwd

    g = torch.Generator().manual_seed(11)
    t, h, m, k = 4, 8, 20, 6
    q = torch.randn(t, h, 512, generator=g).to(dtype)
    kv = torch.randn(m, 1, 512, generator=g).to(dtype)
    idx = torch.randint(-1, m, (t, 1, k), generator=g, dtype=torch.int32)
    lens = torch.tensor([6, 3, 0, 5], dtype=torch.int32)
    sink = torch.randn(h, generator=g)
    scale = 512 ** -0.5
    out = torch.empty(t, h, 512, dtype=dtype)
    csa2_sparse_fwd(q, kv, idx, lens, scale, sink, out)
    for i in range(t):
        rows = [j for j in idx[i, 0, : lens[i]].tolist() if j >= 0]
        for hh in range(h):
            if not rows:
                assert bool((out[i, hh] == 0).all())
                continue
            kvr = kv[rows, 0].double()
            z = kvr @ q[i, hh].double() * scale
            mx = max(float(z.max()), float(sink[hh]))
            e = torch.exp(z - mx)
            o = (e[:, None] * kvr).sum(0) / (e.sum() + np.exp(float(sink[hh]) - mx))
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out[i, hh].double(), o, rtol=tol, atol=tol)


def test_layer_sparse_fwd_writes_a_head_slice_of_the_output():
    # vLLM's _forward_prefill passes out=output[a:b, :_prefill_num_heads] — a non-contiguous view
    # whenever the prefill heads are fewer than the padded heads (SM90 with 8/16/32 local heads).
    from csa2_vllm.attention import csa2_sparse_fwd

    g = torch.Generator().manual_seed(12)
    t, padded, h, m, k = 3, 16, 4, 10, 5
    q = torch.randn(t, padded, 512, generator=g)
    kv = torch.randn(m, 1, 512, generator=g)
    idx = torch.randint(0, m, (t, 1, k), generator=g, dtype=torch.int32)
    lens = torch.tensor([5, 2, 0], dtype=torch.int32)
    sink = torch.randn(padded, generator=g)
    want = torch.empty(t, h, 512)
    csa2_sparse_fwd(q[:, :h], kv, idx, lens, 512 ** -0.5, sink[:h], want)
    output = torch.full((t, padded, 512), 7.0)
    csa2_sparse_fwd(q[:, :h], kv, idx, lens, 512 ** -0.5, sink[:h], output[:, :h])
    assert torch.equal(output[:, :h], want)
    assert bool((output[:, h:] == 7.0).all())
