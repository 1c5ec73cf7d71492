"""The engine exports through ctypes: a prefill then decode steps, the same outputs from two
engines fed the same calls, and a refused step (wrong token count) that changes nothing."""

import numpy as np
import pytest

from csa2_vllm import _engine, _lib


def _tokens(n, first=0):
    return (np.arange(first, first + n, dtype=np.uint64) * 2654435761 % 50000).astype(np.uint32)


def test_prefill_and_decode_are_deterministic_and_bad_shapes_change_nothing():
    a = _engine.Engine(num_blocks=8)
    b = _engine.Engine(num_blocks=8)
    info = a.info()
    assert (info.num_layers, info.decoder_replay) == (40, 1)
    n = 150
    ha, pa, ra = a.step([_engine.Seq.prefill(3, 0, n)], _tokens(n))
    hb, _, _ = b.step([_engine.Seq.prefill(3, 0, n)], _tokens(n))
    # Decoder bounded replay: the prompt outputs its last `window` rows.
    w = info.window
    assert ha.shape == (w, info.hidden_size)
    assert list(pa) == list(range(n - w, n)) and set(ra) == {3}
    assert np.array_equal(ha, hb) and np.isfinite(ha).all()
    before = a.stats()
    with pytest.raises(_lib.Csa2Error) as e:
        a.step([_engine.Seq.decode(3, n)], _tokens(2, n))
    assert e.value.status == 200 and "tokens" in e.value.message
    assert bytes(a.stats()) == bytes(before)
    da, pos, _ = a.step([_engine.Seq.decode(3, n)], _tokens(1, n))
    db, _, _ = b.step([_engine.Seq.decode(3, n)], _tokens(1, n))
    assert list(pos) == [n] and np.array_equal(da, db)
    a.free_request(3)
    with pytest.raises(_lib.Csa2Error) as e:
        a.free_request(3)
    assert e.value.status == 302
    a.close()
    b.close()
