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


def test_torch_tensors_cross_by_dlpack_without_copies_and_match_numpy():
    torch = pytest.importorskip("torch")
    a = _engine.Engine(num_blocks=8)
    b = _engine.Engine(num_blocks=8)
    n = 16
    toks = _tokens(n)
    hn, pn, rn = a.step([_engine.Seq.prefill(5, 0, n)], toks)
    tt = torch.from_numpy(toks.astype(np.int32))
    d = a.info().hidden_size
    out = torch.full((n, d), float("nan"))
    ht, pt, rt = b.step([_engine.Seq.prefill(5, 0, n)], tt, out=out)
    # Written in place into the caller's tensor, bit for bit the numpy path's values.
    assert ht is out and ht.data_ptr() == out.data_ptr()
    assert np.array_equal(ht.numpy().view(np.uint32), hn.view(np.uint32))
    assert pt.tolist() == pn.tolist() and rt.tolist() == [int(x) for x in rn]
    # bfloat16 output: the float32 result rounded to nearest even.
    bf = torch.empty((1, d), dtype=torch.bfloat16)
    h32, _, _ = a.step([_engine.Seq.decode(5, n)], torch.tensor([7], dtype=torch.int64))
    hbf, _, _ = b.step([_engine.Seq.decode(5, n)], torch.tensor([7], dtype=torch.int64), out=bf)
    assert torch.equal(hbf, h32.to(torch.bfloat16))
    a.close()
    b.close()


def test_tensors_the_step_cannot_take_are_refused_naming_them_and_change_nothing():
    torch = pytest.importorskip("torch")
    e = _engine.Engine(num_blocks=8)
    d = e.info().hidden_size
    e.step([_engine.Seq.prefill(1, 0, 8)], _tokens(8))
    before = bytes(e.stats())
    dec = [_engine.Seq.decode(1, 8)]
    cases = [
        (torch.tensor([1.0]), None, 200, "tokens.dtype"),                 # float token ids
        (torch.tensor([[1, 2]])[:, :1], None, 200, "tokens"),            # rank 2
        (torch.tensor([-3]), None, 201, "tokens[0]"),                     # negative id
        (torch.tensor([1 << 33]), None, 201, "tokens[0]"),                # id past uint32
        (torch.tensor([1]), torch.empty((1, d), dtype=torch.int32), 200, "hidden.dtype"),
        (torch.tensor([1]), torch.empty((2, d)), 200, "hidden"),          # wrong row count
        (torch.tensor([1]), torch.empty((1, 2 * d))[:, ::2], 200, "hidden.strides"),  # strided
    ]
    for tokens, out, status, needle in cases:
        with pytest.raises(_lib.Csa2Error) as err:
            e.step(dec, tokens, out=out)
        assert err.value.status == status and needle in err.value.message, err.value.message
        assert bytes(e.stats()) == before
    # The hidden output may not alias the tokens.
    buf = torch.zeros(d + 2, dtype=torch.int64)
    with pytest.raises(_lib.Csa2Error) as err:
        e.step(dec, buf[:1], out=buf[:d // 2].view(torch.float32).view(1, d))
    assert err.value.status == 201 and "overlaps" in err.value.message
    assert bytes(e.stats()) == before
    # After all the refusals the decode runs as on a fresh twin.
    twin = _engine.Engine(num_blocks=8)
    twin.step([_engine.Seq.prefill(1, 0, 8)], _tokens(8))
    x, _, _ = e.step(dec, torch.tensor([1]))
    y, _, _ = twin.step(dec, torch.tensor([1]))
    assert torch.equal(x, y)
    e.close()
    twin.close()


def test_one_engine_from_python_threads_at_once_matches_a_twin_and_close_is_once():
    import threading

    e = _engine.Engine(num_blocks=8)
    twin = _engine.Engine(num_blocks=8)
    reqs = [21, 22, 23]
    for r in reqs:
        e.step([_engine.Seq.prefill(r, 0, 8)], _tokens(8, r))
        twin.step([_engine.Seq.prefill(r, 0, 8)], _tokens(8, r))
    got, errors = {}, []

    def decode(r):
        try:
            # ctypes drops the GIL around each call, so these steps really overlap in the library.
            got[r] = [e.step([_engine.Seq.decode(r, 8 + i)], _tokens(1, r + i))[0]
                      for i in range(2)]
        except Exception as x:  # reported below, with the thread's request
            errors.append((r, x))

    threads = [threading.Thread(target=decode, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r in reqs:
        for i in range(2):
            want, _, _ = twin.step([_engine.Seq.decode(r, 8 + i)], _tokens(1, r + i))
            assert np.array_equal(got[r][i], want), (r, i)
    assert bytes(e.stats()) == bytes(twin.stats())
    h = e.handle
    e.close()
    e.close()  # a second close is a no-op on the Python side
    # The stale handle itself is refused by the library.
    with pytest.raises(_lib.Csa2Error) as err:
        _lib.check(_engine._lib_with_engine().csa2_engine_free(h), "csa2_engine_free")
    assert err.value.status == 203
    twin.close()
