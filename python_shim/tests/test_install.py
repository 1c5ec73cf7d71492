"""The non-editable install (``pip install ./python_shim``): the package is imported from the
environment, not the source tree, and loads the library bundled inside it without ``CSA2_LIB``.

Runs when ``run_tests.sh`` installed a wheel (it sets ``CSA2_EXPECT_WHEEL=1``); skipped for an
editable development install, where there is no bundled copy to prove."""

import os
import subprocess
import sys
from importlib import metadata

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("CSA2_EXPECT_WHEEL") != "1",
    reason="needs the wheel install of python_shim/run_tests.sh (CSA2_EXPECT_WHEEL=1)",
)

PROBE = """
import json, os, sys
import csa2_vllm
from csa2_vllm import _lib
print(json.dumps({
    "package": os.path.dirname(csa2_vllm.__file__),
    "library": _lib.library_path(),
    "version": _lib.version(),
    "records": hasattr(_lib.lib(), "csa2_cache_write_entries"),
}))
"""


def test_installed_package_loads_its_bundled_library(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CSA2_LIB"}
    out = subprocess.run([sys.executable, "-P", "-c", PROBE], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert not got["package"].startswith(here), f"imported the source tree: {got['package']}"
    assert "site-packages" in got["package"]
    assert os.path.dirname(got["library"]) == got["package"]
    assert os.path.basename(got["library"]).startswith("_csa2")
    assert got["version"].count(".") == 2 and got["records"]


def test_distribution_is_a_regular_install_with_the_entry_point():
    dist = metadata.distribution("csa2-vllm")
    files = [str(f) for f in dist.files or []]
    assert any(f.startswith("csa2_vllm/_csa2") and f.endswith(".so") for f in files), files
    assert not any("__editable__" in f for f in files), "editable install"
    eps = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
    assert [(e.name, e.value) for e in eps] == [("csa2", "csa2_vllm.plugin:register")]
