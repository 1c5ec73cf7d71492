"""csa2_vllm — the vLLM plugin face of csa2 for DeepSeek-V4.1-Flash, over the csa2 C ABI: csa2's
sparse attention inside vLLM (``CSA2_RS``) reading vLLM's own paged KV records, plus ctypes access
to every csa2 op, the cache manager and the replay planner (``csa2_vllm._lib``).

Importing this package imports neither vLLM nor torch nor the native library; vLLM's plugin loader
calls :func:`csa2_vllm.plugin.register` in every process it starts.
"""

BACKEND_NAME = "CSA2_RS"
"""Name users pass as ``--attention-config '{"backend": "CSA2_RS"}'`` (or ``CSA2_VLLM_BACKEND``)."""

__all__ = ["BACKEND_NAME"]
