"""Tests that run vLLM's own Triton kernels on the CPU, in Triton's interpreter.

``python_shim/run_tests.sh`` runs this folder in a second pytest process with
``TRITON_INTERPRET=1`` (kernels decorated with ``triton.jit`` are interpreted on CPU tensors) and
``CUDA_VISIBLE_DEVICES=`` (with no GPU, vLLM 0.33 keeps Triton enabled only when the variable is set
and empty; otherwise ``vllm.triton_utils`` swaps in placeholders). Both must be set before vLLM is
imported, hence the separate process.
"""

import os

import pytest

os.environ.setdefault("VLLM_PLUGINS", "csa2")

if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    pytest.exit(
        "tests_interpreted needs TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES= (empty) in the "
        "environment before vLLM is imported; run it through python_shim/run_tests.sh",
        returncode=4,
    )
