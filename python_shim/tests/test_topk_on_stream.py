"""``csa2_topk_on_stream`` on host tensors: the capture-safe top-k's CPU face gives the order
contract (logit desc, index asc; all visible entries in index order at K or fewer), leaves the
error record alone and refuses a negative position."""

import pytest
import torch

from csa2_vllm import _lib


def _contract(row: torch.Tensor, visible: int, k: int) -> list[int]:
    if visible <= k:
        return list(range(visible)) + [-1] * (k - visible)
    vals = row[:visible].tolist()
    order = sorted(range(visible), key=lambda j: (-vals[j], j))[:k]
    return order + [-1] * (k - len(order))


def test_on_stream_host_rows_follow_the_order_contract():
    g = torch.Generator().manual_seed(3)
    t, n, k, ratio = 4, 300, 16, 2
    # Few distinct values: many ties, so the index order inside a value is exercised.
    logits = torch.randint(0, 5, (t, n), generator=g).to(torch.float32)
    positions = torch.tensor([599, 9, 31, 400], dtype=torch.int64)
    out = torch.zeros(t, k, dtype=torch.int32)
    counts = torch.zeros(t, dtype=torch.int32)
    error = torch.full((4,), 5, dtype=torch.int32)
    _lib.topk_on_stream(logits, positions, ratio, out, counts, error)
    for r in range(t):
        vis = min((int(positions[r]) + 1) // ratio, n)
        assert out[r].tolist() == _contract(logits[r], vis, k), r
        assert int(counts[r]) == min(vis, k)
    assert error.tolist() == [5, 5, 5, 5]


def test_on_stream_host_refuses_a_negative_position_and_writes_nothing():
    logits = torch.zeros(2, 10)
    out = torch.full((2, 4), 42, dtype=torch.int32)
    with pytest.raises(Exception, match="position"):
        _lib.topk_on_stream(logits, torch.tensor([3, -1]), 1, out)
    assert (out == 42).all()
