"""vLLM general plugin entry point (``vllm.general_plugins``: ``csa2 = csa2_vllm.plugin:register``).

vLLM calls :func:`register` in every process it starts (API server, engine core, each worker),
possibly more than once per process; it must stay cheap and idempotent. Importing this module
imports nothing heavy: vLLM is imported inside ``register``, and our model and layer modules are
handed to vLLM as class-path strings, so they load only if a DeepSeek-V4.1 model is built.

What it registers (vLLM 0.33 interfaces, see docs/VLLM.md):

* attention backend ``CSA2_RS`` — a new ``AttentionBackendEnum`` member via
  ``register_backend("CSA2_RS", "csa2_vllm.backend.Csa2SparseMLABackend")``, so that
  ``--attention-config '{"backend": "CSA2_RS"}'`` parses. If the enum cannot grow (a member of that
  name exists already from another package), it falls back to overriding ``CUSTOM``.
* architecture ``DeepseekV41ForCausalLM`` → ``csa2_vllm.model:Csa2DeepseekV41ForCausalLM``, which
  builds vLLM's own model and swaps the attention layer class only when ``CSA2_RS`` is selected.
  Registering the backend alone is not enough for V4.1: the model picks its attention *layer class*
  in ``nvidia/model.py::_select_dsv4_attn_cls`` and never asks the backend registry for an impl.
* KV connector ``Csa2Connector`` → ``csa2_vllm.connector:Csa2Connector`` (csa2's SSD tier and DRAM
  SWA-snapshot pool) with ``KVConnectorFactory.register_connector``, so
  ``--kv-transfer-config '{"kv_connector": "Csa2Connector", ...}'`` finds it by name.
* secondary tier ``Csa2SsdTier`` → ``csa2_vllm.offload:Csa2SsdTier`` (csa2's SSD store under vLLM's
  ``OffloadingConnector``) with ``SecondaryTierFactory.register_tier``, so a ``secondary_tiers``
  entry ``{"type": "Csa2SsdTier", ...}`` needs no ``module_path``.
"""

from __future__ import annotations

import threading

from . import BACKEND_NAME

MODEL_ARCH = "DeepseekV41ForCausalLM"
MODEL_PATH = "csa2_vllm.model:Csa2DeepseekV41ForCausalLM"
BACKEND_PATH = "csa2_vllm.backend.Csa2SparseMLABackend"
CONNECTOR_NAME = "Csa2Connector"
CONNECTOR_MODULE = "csa2_vllm.connector"
TIER_TYPE = "Csa2SsdTier"
TIER_MODULE = "csa2_vllm.offload"

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Registers the ``CSA2_RS`` backend and the V4.1 model wrapper with vLLM (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        from vllm import ModelRegistry
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        member = AttentionBackendEnum.__members__.get(BACKEND_NAME)
        if member is None:
            try:
                register_backend(BACKEND_NAME, BACKEND_PATH)
            except ValueError:
                # The enum refused a new member: take the CUSTOM placeholder instead.
                register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
        elif member.get_path() != BACKEND_PATH:
            register_backend(member, BACKEND_PATH)
        ModelRegistry.register_model(MODEL_ARCH, MODEL_PATH)
        _register_connector()
        _register_offload_tier()
        _registered = True


def _register_connector() -> None:
    """Registers ``Csa2Connector`` by name (lazily imported; a name already taken by our own class
    path is left alone, one taken by another package is an error naming it)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        cls = KVConnectorFactory._registry[CONNECTOR_NAME]()
        if cls.__module__ != CONNECTOR_MODULE:
            raise ValueError(f"KV connector name {CONNECTOR_NAME!r} is already registered by "
                             f"{cls.__module__}.{cls.__qualname__}")
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)


def _register_offload_tier() -> None:
    """Registers ``Csa2SsdTier`` with vLLM's secondary-tier factory (a name already taken by our
    own class is left alone, one taken by another package is an error naming it)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if TIER_TYPE in SecondaryTierFactory._registry:
        cls = SecondaryTierFactory._registry[TIER_TYPE]()
        if cls.__module__ != TIER_MODULE:
            raise ValueError(f"secondary tier type {TIER_TYPE!r} is already registered by "
                             f"{cls.__module__}.{cls.__qualname__}")
        return
    SecondaryTierFactory.register_tier(TIER_TYPE, TIER_MODULE, TIER_TYPE)


def backend_member():
    """The ``AttentionBackendEnum`` member that means "csa2" (``CSA2_RS``, else ``CUSTOM`` when that
    carries our class path), or ``None`` before :func:`register`."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum.__members__.get(BACKEND_NAME)
    if member is not None:
        return member
    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() == BACKEND_PATH:
        return custom
    return None
