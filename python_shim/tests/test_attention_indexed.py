"""``csa2_attention_indexed`` through ``_lib.attention_indexed``: FlashMLA's sparse contract
(explicit main / SWA slot lists with lengths, one softmax plus the sink) against a float64 torch
evaluation of the same rule on the same rows, for f32 rows and NVFP4 / MXFP8 records."""

import numpy as np
import pytest
import torch

from csa2_vllm import _lib


def _reference(q, main, main_idx, main_len, swa, swa_idx, swa_len, sink, scale):
    """(out, lse) in float64: per token, rows = main[main_idx[t, :main_len[t]]] then
    swa[swa_idx[t, :swa_len[t]]] without −1; softmax over them with the sink in the denominator."""
    t, h, _ = q.shape

    def valid(idx, lens, i):
        k = idx.shape[1]
        n = k if lens is None else min(max(int(lens[i]), 0), k)
        return [j for j in idx[i, :n].tolist() if j >= 0]

    out = torch.zeros(t, h, 512, dtype=torch.float64)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    for i in range(t):
        rows = [main[j].double() for j in valid(main_idx, main_len, i)]
        rows += [swa[j].double() for j in valid(swa_idx, swa_len, i)]
        if not rows:
            continue
        kv = torch.stack(rows)
        z = (kv @ q[i].double().t()) * scale  # (rows, h)
        a = sink.double()
        m = torch.maximum(z.max(0).values, a)
        e = torch.exp(z - m)
        out[i] = (e.t() @ kv) / (e.sum(0) + torch.exp(a - m))[:, None]
        lse[i] = torch.logsumexp(z, 0)
    return out, lse


def _lists(g, t, k, n):
    ids = torch.randint(0, max(n, 1), (t, k), generator=g, dtype=torch.int32)
    ids[torch.rand(t, k, generator=g) < 0.3] = -1
    if n == 0:
        ids.fill_(-1)
    return ids


@pytest.mark.parametrize("heads", [1, 8])
def test_f32_rows_match_float64_with_holes_lengths_and_an_empty_token(heads):
    g = torch.Generator().manual_seed(7)
    t, n, s, km, ks = 5, 7, 9, 6, 4
    q = torch.randn(t, heads, 512, generator=g)
    main = torch.randn(n, 512, generator=g)
    swa = torch.randn(s, 512, generator=g)
    sink = torch.randn(heads, generator=g)
    main_idx, swa_idx = _lists(g, t, km, n), _lists(g, t, ks, s)
    # Full, nothing (also no SWA: the empty token), past K (clamped), negative, one.
    main_len = torch.tensor([km, 0, km + 3, -2, 1], dtype=torch.int32)
    swa_len = torch.tensor([ks, 0, 2, ks, ks + 9], dtype=torch.int32)
    # Token 3 (main length −2) must still attend something from SWA: make its first slot valid.
    swa_idx[3, 0] = 4
    # Stale, out-of-range ids behind a length are never read.
    main_idx[1, :] = 1 << 30
    for ml, sl, scale in [(main_len, swa_len, 0.0), (main_len, swa_len, 0.03)]:
        out, lse = torch.empty(t, heads, 512), torch.empty(t, heads)
        _lib.attention_indexed(q, main, main_idx, swa, swa_idx, sink, out, lse,
                               main_len=ml, swa_len=sl, scale=scale)
        want, want_lse = _reference(q, main, main_idx, ml, swa, swa_idx, sl, sink,
                                    scale if scale > 0 else 512 ** -0.5)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        fin = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        torch.testing.assert_close(lse.double()[fin], want_lse[fin], rtol=1e-5, atol=1e-5)
        assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())


def test_records_nvfp4_main_and_mxfp8_swa_match_their_decoded_rows():
    g = torch.Generator().manual_seed(8)
    t, h, n, s, km, ks = 4, 4, 12, 10, 8, 5
    q = torch.randn(t, h, 512, generator=g)
    main = torch.randn(n, 512, generator=g)
    swa = torch.randn(s, 512, generator=g)
    sink = torch.randn(h, generator=g)
    main_idx, swa_idx = _lists(g, t, km, n), _lists(g, t, ks, s)
    main_rec = _lib.encode_rows(_lib.FORMAT_NVFP4, main)
    swa_rec = _lib.encode_rows(_lib.FORMAT_MXFP8, swa)
    assert main_rec.shape == (n, _lib.format_info(_lib.FORMAT_NVFP4).record_bytes) == (n, 288)
    assert swa_rec.shape == (s, 528)
    out, lse = torch.empty(t, h, 512), torch.empty(t, h)
    _lib.attention_indexed(q, torch.from_numpy(main_rec), main_idx, torch.from_numpy(swa_rec),
                           swa_idx, sink, out, lse, main_format=_lib.FORMAT_NVFP4,
                           swa_format=_lib.FORMAT_MXFP8)
    # Tight: the same rule on the exactly decoded records.
    main_q = torch.from_numpy(_lib.decode_rows(_lib.FORMAT_NVFP4, main_rec))
    swa_q = torch.from_numpy(_lib.decode_rows(_lib.FORMAT_MXFP8, swa_rec))
    want, _ = _reference(q, main_q, main_idx, None, swa_q, swa_idx, None, sink, 512 ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    # Loose: against the unquantised rows (FP4 / FP8 rounding noise only).
    exact, _ = _reference(q, main, main_idx, None, swa, swa_idx, None, sink, 512 ** -0.5)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), exact.flatten(), dim=0)
    assert 1 - float(cos) < 2e-2


def test_window_lists_reproduce_positional_attention_exactly():
    # One sequence: listing each token's window rows gives csa2_attention's result bit for bit.
    g = torch.Generator().manual_seed(9)
    t, h, n, s, window = 4, 2, 6, 300, 128
    q = torch.randn(t, h, 512, generator=g)
    main = torch.randn(n, 512, generator=g)
    swa = torch.randn(s, 512, generator=g)
    sink = torch.randn(h, generator=g)
    topk = _lists(g, t, 3, n)
    positions = torch.tensor([0, 127, 128, 299])
    swa_idx = torch.full((t, window), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        rows = torch.arange(max(p - window + 1, 0), p + 1, dtype=torch.int32)
        swa_idx[i, : len(rows)] = rows
    a_out, a_lse = torch.empty(t, h, 512), torch.empty(t, h)
    _lib.attention(q, main, swa, topk, positions, sink, a_out, a_lse, window=window)
    b_out, b_lse = torch.empty(t, h, 512), torch.empty(t, h)
    _lib.attention_indexed(q, main, topk, swa, swa_idx, sink, b_out, b_lse)
    assert torch.equal(a_out, b_out) and torch.equal(a_lse, b_lse)


def test_bad_ids_and_shapes_raise_csa2s_reason():
    q, sink = torch.zeros(2, 1, 512), torch.zeros(1)
    main, swa = torch.zeros(3, 512), torch.zeros(0, 512)
    out, lse = torch.full((2, 1, 512), 7.0), torch.empty(2, 1)
    main_idx = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    swa_idx = torch.full((2, 1), -1, dtype=torch.int32)
    with pytest.raises(_lib.Csa2Error) as e:
        _lib.attention_indexed(q, main, main_idx, swa, swa_idx, sink, out, lse)
    assert e.value.status == 201
    assert "main_idx" in e.value.message and "token 1, slot 1: row 3" in e.value.message
    assert bool((out == 7.0).all())  # nothing written
    with pytest.raises(_lib.Csa2Error) as e:
        _lib.attention_indexed(q, main, main_idx, swa, swa_idx, sink, out, lse,
                               main_len=torch.tensor([2], dtype=torch.int32))
    assert e.value.status == 200 and "main_len" in e.value.message
    # The same ids behind a length of 1 are fine; the empty SWA pool with −1 lists is fine.
    _lib.attention_indexed(q, main, main_idx, swa, swa_idx, sink, out, lse,
                           main_len=torch.tensor([2, 1], dtype=torch.int32))
    assert np.isfinite(lse.numpy()).all()
