"""Parity of `csa2 op mhc` with an independent numpy (float64) implementation of docs/SPEC.md §4.

Run: .venv-mhc/bin/pytest tests/python/test_mhc_parity.py
The csa2 binary is taken from $CSA2_BIN, else target/{release,debug}/csa2, else built with cargo.
"""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
N = 4


def csa2_bin() -> pathlib.Path:
    env = os.environ.get("CSA2_BIN")
    if env:
        return pathlib.Path(env)
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "csa2"
        if p.exists():
            return p
    subprocess.run(["cargo", "build", "--bin", "csa2"], cwd=ROOT, check=True)
    return ROOT / "target" / "debug" / "csa2"


# ---- docs/SPEC.md §4 in numpy, written from the spec text -------------------------------------------

def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def coefficients(x, fn, base, scale, post_mult, iters, eps, rms_eps=1e-20):
    """x [T, 4, d] -> pre [T,4], post [T,4], comb [T,4,4]."""
    t = x.shape[0]
    flat = x.reshape(t, -1)
    r = 1.0 / np.sqrt((flat ** 2).mean(axis=1) + rms_eps)
    mix = (flat @ fn.T) * r[:, None]  # [T, 24]
    pre = sigmoid(mix[:, :N] * scale[0] + base[:N]) + eps
    post = post_mult * sigmoid(mix[:, N:2 * N] * scale[1] + base[N:2 * N])
    logits = mix[:, 2 * N:].reshape(t, N, N) * scale[2] + base[2 * N:].reshape(N, N)
    e = np.exp(logits - logits.max(axis=2, keepdims=True))
    c = e / e.sum(axis=2, keepdims=True) + eps
    c = c / (c.sum(axis=1, keepdims=True) + eps)  # columns
    for _ in range(iters - 1):
        c = c / (c.sum(axis=2, keepdims=True) + eps)  # rows
        c = c / (c.sum(axis=1, keepdims=True) + eps)  # columns
    return pre, post, c


def boundary(x, y, post_prev, comb_prev, pre_prev, fn, base, scale, norm, post_mult, iters, eps):
    # X'_j = post_j * y + sum_i C[i, j] X_i
    x_new = post_prev[:, :, None] * y[:, None, :] + np.einsum("tij,tid->tjd", comb_prev, x)
    u = np.einsum("tj,tjd->td", pre_prev, x_new)
    layer_in = u / np.sqrt((u ** 2).mean(axis=1, keepdims=True) + 1e-20) * norm
    pre, post, comb = coefficients(x_new, fn, base, scale, post_mult, iters, eps)
    return dict(x_new=x_new, layer_in=layer_in, pre=pre, post=post, comb=comb)


# ---- the test ----------------------------------------------------------------------------------

def make_inputs(rng, t, d):
    f32 = np.float32
    return dict(
        x=rng.standard_normal((t, N, d)).astype(f32),
        y=rng.standard_normal((t, d)).astype(f32),
        post_prev=rng.uniform(0, 2, (t, N)).astype(f32),
        comb_prev=rng.uniform(0, 1, (t, N, N)).astype(f32),  # not symmetric
        pre_prev=rng.uniform(0, 1, (t, N)).astype(f32),
        fn=(rng.standard_normal((2 * N + N * N, N * d)) / np.sqrt(N * d)).astype(f32),
        base=rng.normal(0, 0.5, 2 * N + N * N).astype(f32),
        scale=rng.uniform(0.5, 1.5, 3).astype(f32),
        norm=(1 + rng.normal(0, 0.1, d)).astype(f32),
    )


@pytest.mark.parametrize("t,d,path,reference", [
    (1, 256, "fused", False),
    (9, 200, "fused", False),
    (17, 264, "unfused", False),
    (5, 96, "fused", True),
])
def test_op_mhc_matches_numpy(tmp_path, t, d, path, reference):
    rng = np.random.default_rng(1000 * t + d)
    inp = make_inputs(rng, t, d)
    params = dict(post_mult=2.0, sinkhorn_iters=20, eps=1e-6, path=path)
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    in_dir.mkdir()
    for k, v in inp.items():
        np.save(in_dir / f"{k}.npy", v)
    (in_dir / "params.json").write_text(json.dumps(params))
    cmd = [str(csa2_bin()), "op", "mhc", "--in", str(in_dir), "--out", str(out_dir)]
    if reference:
        cmd.append("--reference")
    subprocess.run(cmd, check=True)

    want = boundary(*(inp[k].astype(np.float64) for k in (
        "x", "y", "post_prev", "comb_prev", "pre_prev", "fn", "base", "scale", "norm")),
        post_mult=2.0, iters=20, eps=1e-6)
    for name, ref in want.items():
        got = np.load(out_dir / f"{name}.npy")
        assert got.dtype == np.float32 and got.shape == ref.shape, name
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=name)


def test_op_mhc_names_the_bad_input(tmp_path):
    rng = np.random.default_rng(3)
    inp = make_inputs(rng, 2, 64)
    inp["norm"] = inp["norm"][:63]
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    for k, v in inp.items():
        np.save(in_dir / f"{k}.npy", v)
    r = subprocess.run([str(csa2_bin()), "op", "mhc", "--in", str(in_dir), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "norm" in r.stderr and "64" in r.stderr and "63" in r.stderr, r.stderr
