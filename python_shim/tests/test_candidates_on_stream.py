"""``csa2_candidates_on_stream`` on host tensors, against the candidate-pool rule written out here
(docs/SPEC.md §2.6): blocks of ``block_size`` over each row's first ``(position + 1) // ratio``
entries, scored by their max (NaN ignored), the newest block pinned (+∞), blocks scoring −∞
dropped, kept ``B`` sorted by (score desc, block id asc), −1 padded; ``counts`` is the number kept.
The error record is left alone on the host; a negative position is refused and writes nothing."""

import math

import pytest
import torch

from csa2_vllm import _lib


def _pool(row: list[float], visible: int, block_size: int, b: int) -> list[int]:
    visible = min(visible, len(row))
    n = -(-visible // block_size)
    scores = []
    for blk in range(n):
        vals = [v for v in row[blk * block_size:min((blk + 1) * block_size, visible)]
                if not math.isnan(v)]
        scores.append(max(vals, default=-math.inf))
    if n:
        scores[-1] = math.inf
    kept = sorted((j for j in range(n) if scores[j] > -math.inf), key=lambda j: (-scores[j], j))
    kept = kept[:b]
    return kept + [-1] * (b - len(kept))


@pytest.mark.parametrize("block_size,b", [(1, 7), (4, 8), (8, 64), (16, 3)])
def test_on_stream_host_rows_follow_the_pool_rule(block_size, b):
    g = torch.Generator().manual_seed(block_size * 100 + b)
    t, n, ratio = 6, 300, 2
    # Few distinct values: ties between blocks, so the id order inside a score is exercised.
    logits = torch.randint(-3, 4, (t, n), generator=g).to(torch.float32)
    logits[1, 5] = float("nan")
    logits[2, :] = float("-inf")  # only the pinned newest block survives
    logits[3, 0:40] = float("nan")
    # Visible counts 0, around the block size and ratio, and past the row's end.
    positions = torch.tensor([0, 2 * block_size + 1, 599, 2 * block_size * 3 - 1, 9, 10_000],
                             dtype=torch.int64)
    out = torch.zeros(t, b, dtype=torch.int32)
    counts = torch.zeros(t, dtype=torch.int32)
    error = torch.full((4,), 5, dtype=torch.int32)
    _lib.candidates_on_stream(logits, positions, ratio, block_size, out, counts, error)
    for r in range(t):
        want = _pool(logits[r].tolist(), (int(positions[r]) + 1) // ratio, block_size, b)
        assert out[r].tolist() == want, r
        assert int(counts[r]) == sum(1 for x in want if x >= 0), r
    assert error.tolist() == [5, 5, 5, 5]


def test_on_stream_host_refuses_a_negative_position_and_writes_nothing():
    logits = torch.zeros(2, 40)
    out = torch.full((2, 4), 42, dtype=torch.int32)
    with pytest.raises(Exception, match="position"):
        _lib.candidates_on_stream(logits, torch.tensor([30, -1]), 1, 8, out)
    assert (out == 42).all()
