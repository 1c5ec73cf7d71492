"""Registration through vLLM's own machinery: entry point discovery, idempotence, registries."""

import importlib.metadata as md
import sys
import types

import pytest


def test_entry_point_is_declared_and_discovered_by_vllm():
    eps = md.entry_points(group="vllm.general_plugins")
    ours = [e for e in eps if e.name == "csa2"]
    assert len(ours) == 1 and ours[0].value == "csa2_vllm.plugin:register"

    import vllm.plugins as plugins
    from vllm.plugins import load_plugins_by_group

    found = load_plugins_by_group("vllm.general_plugins")
    from csa2_vllm.plugin import register

    assert found["csa2"] is register
    plugins.plugins_loaded = False  # let load_general_plugins run in this process
    plugins.load_general_plugins()
    from csa2_vllm import plugin

    assert plugin._registered


def test_importing_the_package_and_plugin_is_light():
    import subprocess

    code = (
        "import sys, csa2_vllm, csa2_vllm.plugin; "
        "print(sorted(m for m in ('vllm', 'torch', 'csa2_vllm.model', 'csa2_vllm.attention', "
        "'csa2_vllm._lib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_register_twice_is_harmless():
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from csa2_vllm import plugin

    plugin.register()
    n_members = len(AttentionBackendEnum.__members__)
    plugin._registered = False  # as in a fresh process that already has the member
    plugin.register()
    plugin.register()
    assert len(AttentionBackendEnum.__members__) == n_members
    assert AttentionBackendEnum["CSA2_RS"].get_path() == plugin.BACKEND_PATH
    assert "DeepseekV41ForCausalLM" in ModelRegistry.get_supported_archs()


def test_model_registry_resolves_our_class():
    from vllm import ModelRegistry

    from csa2_vllm import plugin

    plugin.register()
    cls = ModelRegistry._try_load_model_cls("DeepseekV41ForCausalLM")
    from csa2_vllm.model import Csa2DeepseekV41ForCausalLM
    from vllm.models.deepseek_v41 import DeepseekV41ForCausalLM

    assert cls is Csa2DeepseekV41ForCausalLM
    assert issubclass(cls, DeepseekV41ForCausalLM)


def test_backend_name_resolves_through_attention_config():
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from csa2_vllm import plugin
    from csa2_vllm.backend import Csa2SparseMLABackend

    plugin.register()
    cfg = AttentionConfig(backend="CSA2_RS")
    assert cfg.backend is AttentionBackendEnum["CSA2_RS"]
    assert cfg.backend.get_class() is Csa2SparseMLABackend
    assert Csa2SparseMLABackend.get_name() == "CSA2_RS"
    assert plugin.backend_member() is cfg.backend
    with pytest.raises(ValueError):
        AttentionConfig(backend="CSA2_NOPE")


def _cfg(backend):
    from vllm.config.attention import AttentionConfig

    return types.SimpleNamespace(
        attention_config=AttentionConfig(backend=backend),
        parallel_config=types.SimpleNamespace(prefill_context_parallel_size=1),
    )


def test_layer_selection_is_ours_only_when_selected(monkeypatch):
    import vllm.models.deepseek_v41.nvidia.model as nv

    from csa2_vllm import model, plugin
    from csa2_vllm.attention import Csa2DeepseekV4Attention

    plugin.register()
    original = nv._select_dsv4_attn_cls
    with model.csa2_layer_selection():
        assert nv._select_dsv4_attn_cls(_cfg("CSA2_RS")) is Csa2DeepseekV4Attention
        # vLLM's own choice is untouched for its own backends (no GPU: FlashMLA is the fallback).
        assert nv._select_dsv4_attn_cls(_cfg("FLASHMLA_SPARSE_DSV41")) is original(
            _cfg("FLASHMLA_SPARSE_DSV41")
        )
        with model.csa2_layer_selection():  # nested construction
            assert nv._select_dsv4_attn_cls(_cfg(None)) is original(_cfg(None))
        monkeypatch.setenv("CSA2_VLLM_BACKEND", "csa2_rs")
        assert nv._select_dsv4_attn_cls(_cfg(None)) is Csa2DeepseekV4Attention
    assert nv._select_dsv4_attn_cls is original
    assert issubclass(Csa2DeepseekV4Attention, nv.DeepseekV4FlashMLAAttention)
    # Prefill context parallelism is refused by name when csa2 is selected, untouched otherwise.
    pcp = _cfg("CSA2_RS")
    pcp.parallel_config.prefill_context_parallel_size = 2
    with model.csa2_layer_selection(), pytest.raises(ValueError, match="prefill context"):
        nv._select_dsv4_attn_cls(pcp)
    assert Csa2DeepseekV4Attention.backend_cls.get_name() == "CSA2_RS"


def test_backend_classes_declare_the_csa2_cache_and_uniform_batch_graphs(monkeypatch):
    import vllm.models.deepseek_v41.attention as v41_attention
    from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention
    from vllm.v1.attention.backend import AttentionCGSupport

    from csa2_vllm.attention import Csa2DeepseekV4Attention
    from csa2_vllm.backend import Csa2SparseMLABackend, Csa2SparseSWABackend

    # csa2 reads the 288-B NVFP4 compressed record that stock FlashMLA cannot.
    assert "nvfp4_ds_mla" in Csa2SparseMLABackend.supported_kv_cache_dtypes
    assert "fp8_ds_mla" in Csa2SparseMLABackend.supported_kv_cache_dtypes
    # UNIFORM_BATCH only where csa2's kernels launch on the device in use: NEVER without a GPU.
    for backend in (Csa2SparseMLABackend, Csa2SparseSWABackend):
        assert backend.get_builder_cls().get_cudagraph_support(None, None) is AttentionCGSupport.NEVER
        assert backend.supports_pcp() is False
    assert Csa2DeepseekV4Attention.swa_backend_cls is Csa2SparseSWABackend
    assert Csa2DeepseekV4Attention.forward_mqa is not DeepseekV4FlashMLAAttention.forward_mqa

    # The preferred packed record: NVFP4 where vLLM's V4.1-record switch is on (SM100) and on
    # SM90 (csa2's choice, python_shim/tests_interpreted/test_sm90_layer.py); the V4 584-B record
    # elsewhere (nvfp4_ds_mla needs the V4.1 MXFP8 SWA record).
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    layer = Csa2DeepseekV4Attention.__new__(Csa2DeepseekV4Attention)
    assert v41_attention._use_v41_mxfp8_kv_record() is False  # this CPU machine
    assert layer.packed_kv_cache_dtype == "fp8_ds_mla"
    monkeypatch.setattr(v41_attention, "_use_v41_mxfp8_kv_record", lambda: True)
    assert layer.packed_kv_cache_dtype == "nvfp4_ds_mla"
    monkeypatch.setattr(v41_attention, "_use_v41_mxfp8_kv_record", lambda: False)
    for major, want in ((9, "nvfp4_ds_mla"), (8, "fp8_ds_mla"), (12, "fp8_ds_mla")):
        cap = DeviceCapability(major, 0)
        monkeypatch.setattr(type(current_platform), "get_device_capability",
                            classmethod(lambda cls, device_id=0, cap=cap: cap))
        assert layer.packed_kv_cache_dtype == want, major
