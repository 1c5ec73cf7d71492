"""``DeepseekV41ForCausalLM`` as registered by the csa2 plugin.

It *is* vLLM's own model class (a subclass, no behaviour added) unless the user selected csa2 —
``--attention-config '{"backend": "CSA2_RS"}'`` or ``CSA2_VLLM_BACKEND=CSA2_RS`` — in which case the
attention layer class chosen by ``vllm.models.deepseek_v41.nvidia.model._select_dsv4_attn_cls`` is
replaced by :class:`csa2_vllm.attention.Csa2DeepseekV4Attention` while the model is constructed.
"""

from __future__ import annotations

import contextlib
import os
import threading

from vllm.models.deepseek_v41 import DeepseekV41ForCausalLM as _VllmDeepseekV41

from . import BACKEND_NAME

_SELECTOR_MODULE = "vllm.models.deepseek_v41.nvidia.model"
_patch_lock = threading.RLock()


def csa2_selected(vllm_config) -> bool:
    """Whether this engine asked for the csa2 attention layers."""
    if os.environ.get("CSA2_VLLM_BACKEND", "").upper() == BACKEND_NAME:
        return True
    from .plugin import backend_member

    backend = vllm_config.attention_config.backend
    return backend is not None and backend is backend_member()


def select_attn_cls(vllm_config):
    """Our replacement for ``_select_dsv4_attn_cls``: csa2's layer when selected, else vLLM's."""
    import importlib

    mod = importlib.import_module(_SELECTOR_MODULE)
    if csa2_selected(vllm_config):
        pcp = getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1)
        if pcp > 1:
            # vLLM's PCP layers gather their own slot mappings and zero trailing rows; csa2's
            # forward_mqa was checked against the single-rank path only.
            raise ValueError(
                f"the CSA2_RS attention backend does not support prefill context parallelism "
                f"(prefill_context_parallel_size={pcp}); run without PCP or drop CSA2_RS")
        from .attention import Csa2DeepseekV4Attention

        return Csa2DeepseekV4Attention
    return mod._csa2_original_select(vllm_config)


@contextlib.contextmanager
def csa2_layer_selection():
    """Routes vLLM's V4.1 layer selector through :func:`select_attn_cls` for the duration of a
    model construction (restored afterwards; nested and concurrent constructions are safe)."""
    import importlib

    mod = importlib.import_module(_SELECTOR_MODULE)
    with _patch_lock:
        original = mod._select_dsv4_attn_cls
        if original is not select_attn_cls:  # a nested construction keeps the outer original
            mod._csa2_original_select = original
        mod._select_dsv4_attn_cls = select_attn_cls
        try:
            yield
        finally:
            mod._select_dsv4_attn_cls = original


class Csa2DeepseekV41ForCausalLM(_VllmDeepseekV41):
    """vLLM's DeepSeek-V4.1 model; attention layers from csa2 when ``CSA2_RS`` is selected."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        if csa2_selected(vllm_config):
            with csa2_layer_selection():
                super().__init__(vllm_config=vllm_config, prefix=prefix)
        else:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
