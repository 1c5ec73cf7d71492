"""csa2_vllm.indices: vLLM's paged coordinates → compact record arrays and per-token rows."""

import pytest
import torch

from csa2_vllm import indices


def _pool(nb, bs, width, pad=0, seed=0):
    """A pool (nb, bs, width) uint8 whose block stride is padded by ``pad`` bytes, and its bytes."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nb, bs * width + pad), generator=g, dtype=torch.int32)
    raw = raw.to(torch.uint8)
    return raw[:, : bs * width].as_strided((nb, bs, width), (bs * width + pad, width, 1)), raw


@pytest.mark.parametrize("width", [288, 528])
def test_v41_records_are_rows_of_the_page(width):
    pool, raw = _pool(3, 16, width, pad=64)
    slots = torch.tensor([0, 17, 47, 5])
    got = indices.gather_records(pool, slots)
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, 16)
        assert torch.equal(got[i], raw[b, o * width:(o + 1) * width])


def test_v4_pages_are_block_planar():
    # 584-B V4 page: the 576 data bytes of every slot, then the 8 scale bytes of every slot.
    bs = 64
    pool, raw = _pool(2, bs, 584, pad=448)
    slots = torch.tensor([0, 63, 64, 100])
    got = indices.gather_records(pool, slots)
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, bs)
        data = raw[b, o * 576:(o + 1) * 576]
        scale = raw[b, bs * 576 + o * 8: bs * 576 + (o + 1) * 8]
        assert torch.equal(got[i], torch.cat([data, scale]))


def test_compact_gathers_each_record_once_and_honours_lengths():
    pool, raw = _pool(2, 4, 288)
    slots = torch.tensor([[5, 1, 5, 7], [1, -1, 3, 6], [2, 2, 2, 2]], dtype=torch.int32)
    lens = torch.tensor([3, 4, 0], dtype=torch.int32)
    rec, rows = indices.compact(pool, slots, lens, "test")
    assert rec.shape == (4, 288)  # slots 1, 3, 5, 6 (7 is past its row's length, row 2 is empty)
    assert rows.tolist() == [[2, 0, 2, -1], [0, -1, 1, 3], [-1, -1, -1, -1]]
    assert torch.equal(rec[2], raw[1, 288:576])  # slot 5 = block 1, offset 1
    with pytest.raises(ValueError, match="outside the pool"):
        indices.compact(pool, torch.tensor([[8]], dtype=torch.int32),
                        torch.tensor([1], dtype=torch.int32), "test")


def test_record_format_names_the_problem():
    assert indices.record_format(torch.zeros(1, 2, 288, dtype=torch.uint8), "x") == 0
    assert indices.record_format(torch.zeros(1, 2, 528, dtype=torch.uint8), "x") == 2
    assert indices.record_format(torch.zeros(1, 2, 584, dtype=torch.uint8), "x") == 3
    with pytest.raises(ValueError, match="record width 656"):
        indices.record_format(torch.zeros(1, 2, 656, dtype=torch.uint8), "x")
    with pytest.raises(ValueError, match="packed page pool"):
        indices.record_format(torch.zeros(2, 288, dtype=torch.uint8), "x")


def test_prefill_topk_rules():
    # ratio 2, K = 4: a token at position p sees (p + 1) // 2 entries, capped at K; entries outside
    # the request's compressed prefix (seq_len // 2) are dropped, holes stay holes.
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)  # 2 requests, blocks of 4 entries
    local = torch.tensor([[0, 1, 2, 3], [2, -1, 0, 9], [4, 5, 6, 7]], dtype=torch.int32)
    req = torch.tensor([0, 1, 1], dtype=torch.int32)
    pos = torch.tensor([4, 8, 15])
    n_entries = torch.tensor([3, 8])
    valid = torch.ones(3, dtype=torch.bool)
    slots, lens = indices.prefill_topk_slots(local, req, pos, n_entries, table, 4, 2, valid)
    assert lens.tolist() == [2, 4, 4]
    assert slots.tolist() == [[12, 13, -1, -1], [6, -1, 4, -1], [8, 9, 10, 11]]
    slots, lens = indices.prefill_topk_slots(local, req, pos, n_entries, table, 4, 2,
                                             torch.tensor([True, False, True]))
    assert lens.tolist() == [2, 0, 4] and slots[1].tolist() == [-1] * 4


def test_decode_topk_counts_valid_entries():
    table = torch.tensor([[2, 5]], dtype=torch.int32)
    local = torch.tensor([[0, 7, -1, -1], [1, 2, 3, 4]], dtype=torch.int32)
    slots, lens = indices.decode_topk_slots(local, torch.zeros(2, dtype=torch.int32), table, 4,
                                            torch.tensor([True, False]))
    assert slots.tolist() == [[8, 23, -1, -1], [-1, -1, -1, -1]]  # a padding token: no slots
    assert lens.tolist() == [2, 0]
    with pytest.raises(ValueError, match="past the block table"):
        indices.decode_topk_slots(torch.tensor([[8]], dtype=torch.int32),
                                  torch.zeros(1, dtype=torch.int32), table, 4,
                                  torch.ones(1, dtype=torch.bool))


def test_padding_tokens_ignore_stale_topk_rows():
    # A padding token (is_valid_token False, slot_mapping < 0) keeps whatever its top-k row held
    # from an earlier step; vLLM's compute_global_topk_indices_and_lens only zeroes its length.
    # Stale entries past the block table must not fail the batch, decode or prefill.
    table = torch.tensor([[2, 5]], dtype=torch.int32)
    local = torch.tensor([[0, 7, -1], [900, 3, 1 << 20]], dtype=torch.int32)
    req = torch.zeros(2, dtype=torch.int32)
    valid = torch.tensor([True, False])
    slots, lens = indices.decode_topk_slots(local, req, table, 4, valid)
    assert lens.tolist() == [2, 0]
    assert slots[0].tolist() == [8, 23, -1] and slots[1].tolist() == [-1, -1, -1]
    slots, lens = indices.prefill_topk_slots(local, req, torch.tensor([20, 20]),
                                             torch.tensor([8]), table, 4, 2, valid)
    assert lens.tolist() == [3, 0] and slots[1].tolist() == [-1, -1, -1]


def test_compact_refuses_negative_slots_other_than_minus_one():
    # −1 is "none"; any other negative slot inside a row's length is a broken block-table entry
    # (e.g. block −1 → slot −bs + offset) and must not be dropped silently (csa2's own contract
    # refuses ids < −1 too).
    pool, _ = _pool(2, 4, 288)
    slots = torch.tensor([[1, -3, -1], [-9, 2, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="slot -3"):
        indices.compact(pool, slots, torch.tensor([3, 0], dtype=torch.int32), "test")
    # Past the length anything goes.
    rec, rows = indices.compact(pool, slots, torch.tensor([1, 0], dtype=torch.int32), "test")
    assert rows.tolist() == [[0, -1, -1], [-1, -1, -1]] and rec.shape == (1, 288)
