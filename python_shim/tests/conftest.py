"""Tests run against the real vLLM 0.33.0 install (CPU only) and the csa2 library named by
``$CSA2_LIB`` or bundled by ``pip install ./python_shim``. See python_shim/run_tests.sh."""

import os

import pytest

# vLLM's plugin loader honours this allowlist; keep it to our plugin so unrelated plugins that
# happen to be installed do not run in the tests.
os.environ.setdefault("VLLM_PLUGINS", "csa2")


def pytest_configure(config):
    # run_tests.sh deselects these (-m "not emu") in the pass over the bundled library and runs
    # them in the pass over the emulated-device library.
    config.addinivalue_line("markers", "emu: needs a library built with --features cuda-emu")


@pytest.fixture(autouse=True)
def _no_env_selection(monkeypatch):
    monkeypatch.delenv("CSA2_VLLM_BACKEND", raising=False)
