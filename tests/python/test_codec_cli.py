"""The Rust codecs (through `csa2 codec`) against the independent spec implementation."""

import numpy as np
import pytest

import spec_formats as spec

FORMATS = ["nvfp4", "mxfp4", "mxfp8", "v4", "fp8index"]


def edge_values():
    e2m1_ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    v = [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-30, 1e-40, -1e-45, 3e38, -3e38,
         448.0, 464.0, 480.0, 1e-4, 6.0, 7.0, 6 * 2.0 ** -126, 2.0 ** -9, 2.0 ** -10]
    for k in range(-14, 12):
        for m in e2m1_ties + [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]:
            v += [m * 2.0 ** k, -m * 2.0 ** k]
    return np.array(v, dtype=np.float32)


def make_rows(fmt, n, seed):
    rng = np.random.default_rng(seed)
    dim = spec.DIM[fmt]
    edges = edge_values()
    rows = []
    for r in range(n):
        kind = r % 5
        if kind == 0:  # Gaussian at a row-specific magnitude (sweeps every block scale)
            row = rng.standard_normal(dim) * 2.0 ** rng.integers(-24, 14)
        elif kind == 1:  # edges only
            row = rng.choice(edges, dim)
        elif kind == 2:  # Gaussian sprinkled with edges
            row = rng.standard_normal(dim)
            m = rng.random(dim) < 0.1
            row[m] = rng.choice(edges, m.sum())
        elif kind == 3:  # arbitrary bit patterns (NaN payloads, subnormals, huge)
            row = rng.integers(0, 2 ** 32, dim, dtype=np.uint64).astype(np.uint32).view(np.float32)
        else:  # exact ties at scale 1: a block amax of 6 (mxfp4) / 448 (mxfp8) keeps the scale at 2^0
            row = rng.choice(edges[np.isfinite(edges) & (np.abs(edges) <= 6)], dim)
            row[::32] = 6.0 if fmt in ("mxfp4", "nvfp4") else 448.0
        rows.append(np.asarray(row, dtype=np.float32))
    special = [np.zeros(dim, np.float32), np.full(dim, -0.0, np.float32),
               np.full(dim, np.nan, np.float32), np.full(dim, np.inf, np.float32),
               np.full(dim, -np.inf, np.float32), np.full(dim, 1e-42, np.float32)]
    return np.stack(rows + special).astype(np.float32)


def same_floats(a, b):
    a, b = np.asarray(a), np.asarray(b)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    assert np.array_equal(nan_a, nan_b), f"NaN positions differ at {np.argwhere(nan_a != nan_b)[:5]}"
    fa, fb = a[~nan_a], b[~nan_b]
    diff = fa.view(np.uint32) != fb.view(np.uint32)
    assert not diff.any(), f"{diff.sum()} values differ, first {fa[diff][:5]} vs {fb[diff][:5]}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_is_byte_identical(codec, fmt):
    x = make_rows(fmt, 600, seed=FORMATS.index(fmt))
    ours = np.frombuffer(codec("encode", fmt, x.tobytes()), dtype=np.uint8)
    want = spec.encode(fmt, x)
    ours = ours.reshape(want.shape)
    bad = np.argwhere((ours != want).any(axis=1))[:, 0]
    assert bad.size == 0, f"{bad.size} records differ; first row {bad[0]}: " \
        f"cols {np.argwhere(ours[bad[0]] != want[bad[0]])[:8, 0]}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_is_identical_for_every_byte_pattern(codec, fmt):
    rng = np.random.default_rng(100 + FORMATS.index(fmt))
    recs = rng.integers(0, 256, (500, spec.RECORD[fmt]), dtype=np.uint8)
    # and the records of real rows
    recs = np.concatenate([recs, spec.encode(fmt, make_rows(fmt, 100, seed=5))])
    ours = np.frombuffer(codec("decode", fmt, recs.tobytes()), dtype=np.float32)
    same_floats(ours, spec.decode(fmt, recs).reshape(-1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_sizes_fail_cleanly(csa2_bin, tmp_path, fmt):
    import subprocess

    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(b"\0" * 7)
    for op in ("encode", "decode"):
        r = subprocess.run([str(csa2_bin), "codec", op, "--format", fmt, "--in", str(src),
                            "--out", str(dst)], capture_output=True, text=True)
        assert r.returncode != 0
        assert "panicked" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
