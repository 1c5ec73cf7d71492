"""csa2_vllm — the vLLM plugin face of csa2 (CSA2 attention, FP4 KV cache, fused mHC for
DeepSeek-V4.1-Flash), over the csa2 C ABI.

Importing this package imports neither vLLM nor torch nor the native library; vLLM's plugin loader
calls :func:`csa2_vllm.plugin.register` in every process it starts.
"""

BACKEND_NAME = "CSA2_RS"
"""Name users pass as ``--attention-config '{"backend": "CSA2_RS"}'`` (or ``CSA2_VLLM_BACKEND``)."""

__all__ = ["BACKEND_NAME"]
