"""Record-level cache access, the stateful compressor and the candidate-restricted indexer through
the ctypes layer (``csa2_vllm._lib``), on numpy arrays and CPU torch tensors."""

import numpy as np
import pytest
import torch

from csa2_vllm import _lib

rng = np.random.default_rng(5)


@pytest.fixture(scope="module")
def geometry():
    with _lib.Geometry() as g:
        yield g


def test_entries_round_trip_and_errors(geometry):
    with _lib.Cache(geometry, num_blocks=4) as c:
        info = c.layer_info(2)
        assert (info.kv_source, info.ratio, info.main_record_bytes, info.entries_per_block) == (1, 2, 288, 128)
        c.add_request(7)
        c.allocate(7, 512)
        entries = np.array([126, 127, 128, 200], np.int64)
        rows = torch.from_numpy(rng.uniform(-2, 2, (4, 512)).astype(np.float32))
        c.write_entries(7, 2, _lib.RECORD_MAIN, entries, rows)
        raw = np.zeros((4, 288), np.uint8)
        c.read_entries(7, 2, _lib.RECORD_MAIN, entries, raw)
        back = torch.zeros(4, 512)
        c.read_entries(7, 2, _lib.RECORD_MAIN, entries, back)
        # The records decode to a close copy (E2M1 with E4M3 scales per 16) ...
        assert torch.allclose(back, rows, atol=0.7)
        # ... and raw records written back decode to exactly the same rows (bf16 out too).
        c.write_entries(7, 2, _lib.RECORD_MAIN, np.array([0, 1, 2, 3], np.int32), raw)
        again = torch.zeros(4, 512, dtype=torch.bfloat16)
        c.read_entries(7, 2, _lib.RECORD_MAIN, np.array([0, 1, 2, 3], np.int64), again)
        assert torch.equal(again, back.to(torch.bfloat16))
        # −1 pads a gather with zero rows.
        pad = torch.ones(2, 512)
        c.read_entries(7, 2, _lib.RECORD_MAIN, np.array([-1, 127], np.int64), pad)
        assert torch.equal(pad[0], torch.zeros(512)) and torch.equal(pad[1], back[1])

        with pytest.raises(_lib.Csa2Error) as e:
            c.write_entries(8, 2, _lib.RECORD_MAIN, entries, rows)
        assert e.value.status == 302 and "request 8" in e.value.message
        with pytest.raises(_lib.Csa2Error, match="past the 256 entries"):
            c.write_entries(7, 2, _lib.RECORD_MAIN, np.array([256], np.int64), rows[:1])
        with pytest.raises(_lib.Csa2Error, match="src"):
            c.write_entries(7, 2, _lib.RECORD_INDEX, entries, rows)  # index K rows are 128 wide
        bad = rows.clone()
        bad[1, 3] = float("nan")
        with pytest.raises(_lib.Csa2Error, match="non-finite"):
            c.write_entries(7, 2, _lib.RECORD_MAIN, entries, bad)
        # Published prefix blocks are read-only: the whole batch is refused.
        keys = c.prefix_keys(list(range(256)))
        assert c.publish(7, keys) == 1
        with pytest.raises(_lib.Csa2Error, match="read-only"):
            c.write_entries(7, 2, _lib.RECORD_MAIN, np.array([200, 5], np.int64), rows[:2])
        check = torch.zeros(4, 512)
        c.read_entries(7, 2, _lib.RECORD_MAIN, entries, check)
        assert torch.equal(check, back)


def test_swa_rows(geometry):
    with _lib.Cache(geometry, num_blocks=1) as c:
        c.add_request(1)
        assert c.swa_newest(1, 3) == -1
        rows = rng.uniform(-1, 1, (5, 512)).astype(np.float32)
        c.swa_write(1, 3, 1000, rows)
        assert c.swa_newest(1, 3) == 1005
        out = np.zeros((5, 512), np.float32)
        c.swa_read(1, 3, 1000, out)
        assert np.allclose(out, rows, atol=0.07)
        with pytest.raises(_lib.Csa2Error) as e:
            c.swa_read(1, 3, 1001, out)  # 1005 was never written
        assert e.value.status == 302
        with pytest.raises(_lib.Csa2Error, match="older"):
            c.swa_write(1, 3, 800, rows[:1])


def _weights():
    norm = rng.uniform(0.5, 1.5, 512).astype(np.float32)
    wk = rng.uniform(-0.05, 0.05, (128, 512)).astype(np.float32)
    k_norm = rng.uniform(0.5, 1.5, 128).astype(np.float32)
    return norm, wk, k_norm


def test_split_pair_pools_as_one_call_and_survives_the_cache(geometry):
    norm, wk, k_norm = _weights()
    kv = rng.uniform(-1, 1, (6, 512)).astype(np.float32)
    sc = rng.uniform(-1, 1, (6, 512)).astype(np.float32)
    main_all, idx_all = np.zeros((3, 288), np.uint8), np.zeros((3, 68), np.uint8)
    _lib.compress(geometry, 8, kv, sc, norm, wk, k_norm, 40, main_all, idx_all)

    st = _lib.CompressorState(geometry, 8, 40)
    m1, i1 = np.zeros((1, 288), np.uint8), np.zeros((1, 68), np.uint8)
    assert st.step(kv[:3], sc[:3], norm, wk, k_norm, m1, i1) == 20
    assert st.query() == (43, 1)
    with _lib.Cache(geometry, num_blocks=1) as c:
        c.add_request(4)
        st.save(c, 4)
        slot = np.zeros(1024, np.float32)
        assert c.get_compressor_state(4, 8, slot)
        assert np.array_equal(slot, np.concatenate([kv[2], sc[2]]))
        st.close()
        st2 = _lib.CompressorState(geometry, 8, 0)
        st2.load(c, 4, 43)
        m2, i2 = np.zeros((2, 288), np.uint8), np.zeros((2, 68), np.uint8)
        with pytest.raises(_lib.Csa2Error, match="main_kv_out"):
            st2.step(kv[3:], sc[3:], norm, wk, k_norm, m1, i1)  # needs E = 2
        assert st2.step(kv[3:], sc[3:], norm, wk, k_norm, m2, i2) == 21
    assert np.array_equal(np.concatenate([m1, m2]), main_all)
    assert np.array_equal(np.concatenate([i1, i2]), idx_all)
    with pytest.raises(_lib.Csa2Error, match="multiple"):
        _lib.CompressorState(geometry, 8, 3)


def test_indexer_in_blocks_is_the_plain_indexer_masked_to_the_pool():
    t, h, n, m, bs = 3, 4, 20, 1, 4
    q = rng.standard_normal((t, h, 128)).astype(np.float32)
    w = rng.standard_normal((t, h)).astype(np.float32)
    keys = rng.standard_normal((n, 128)).astype(np.float32)
    pos = np.array([3, 12, 19], np.int64)
    blocks = np.array([[0, -1], [2, 1], [4, 0]], np.int32)
    plain = np.zeros((t, n), np.float32)
    _lib.indexer_logits(q, w, pos, keys, m, 0, plain)
    got = np.zeros((t, n), np.float32)
    _lib.indexer_logits_in_blocks(q, w, pos, keys, blocks, m, bs, 0, got)
    for r in range(t):
        pool = {b * bs + k for b in blocks[r] if b >= 0 for k in range(bs)}
        for j in range(n):
            if j in pool and j <= pos[r]:
                assert got[r, j] == pytest.approx(plain[r, j], rel=1e-5, abs=1e-5)
            else:
                assert got[r, j] == -np.inf
    with pytest.raises(_lib.Csa2Error, match="blocks"):
        _lib.indexer_logits_in_blocks(q, w, pos, keys, np.full((t, 2), 9, np.int32), m, bs, 0, got)
