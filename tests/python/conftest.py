import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def csa2_bin():
    """The csa2 binary: $CSA2_BIN, else target/debug/csa2 (built by `cargo test --all-targets`)."""
    path = pathlib.Path(os.environ.get("CSA2_BIN", ROOT / "target" / "debug" / "csa2"))
    if not path.exists():
        pytest.fail(f"{path} not found: build it with `cargo build --bin csa2` or set CSA2_BIN")
    return path


@pytest.fixture
def codec(csa2_bin, tmp_path):
    """codec(op, fmt, payload_bytes) -> output bytes of `csa2 codec OP --format FMT`."""

    def run(op, fmt, payload):
        src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
        src.write_bytes(payload)
        r = subprocess.run(
            [str(csa2_bin), "codec", op, "--format", fmt, "--in", str(src), "--out", str(dst)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        return dst.read_bytes()

    return run
