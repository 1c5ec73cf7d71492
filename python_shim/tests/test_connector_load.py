"""``Csa2Connector`` loads by name through vLLM 0.33's own factory, passes its HMA check, and
refuses bad ``kv_connector_extra_config`` with a message naming the key. The connector's work
with a real Scheduler and vLLM's writer kernels is in ``tests_interpreted/test_connector.py``."""

import pytest


def test_loads_by_name_after_register_and_supports_hma():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from csa2_vllm import plugin
    from csa2_vllm.connector import Csa2Connector

    plugin.register()
    plugin._register_connector()  # idempotent: our own name is left alone
    cfg = KVTransferConfig(kv_connector="Csa2Connector", kv_role="kv_both",
                           kv_connector_extra_config={"ssd_dir": "/nonexistent"})
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls is Csa2Connector
    assert supports_hma(cls)
    assert KVConnectorFactory.supports_hma_config(cfg)
    # By module path, as --kv-transfer-config '{"kv_connector_module_path": ...}' names it.
    cfg2 = KVTransferConfig(kv_connector="Csa2Connector", kv_role="kv_both",
                            kv_connector_module_path="csa2_vllm.connector")
    assert KVConnectorFactory.get_connector_class(cfg2) is Csa2Connector
    assert not Csa2Connector.requires_piecewise_for_cudagraph({})


def test_a_foreign_class_under_our_name_is_an_error(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from csa2_vllm import plugin

    class Other:
        pass

    monkeypatch.setitem(KVConnectorFactory._registry, "Csa2Connector", lambda: Other)
    with pytest.raises(ValueError, match="already registered"):
        plugin._register_connector()


def test_config_defaults_and_errors(tmp_path):
    from csa2_vllm._store import host_memory_bytes
    from csa2_vllm.connector import Csa2ConnectorConfig

    c = Csa2ConnectorConfig.parse({"ssd_dir": str(tmp_path)})
    assert c.min_lifetime_ms == 72 * 3_600_000
    assert c.dram_ttl_ms == 300_000
    assert c.dram_pool_bytes == host_memory_bytes() // 10
    assert c.on_locked == "read_only"
    for bad, word in [({}, "ssd_dir"), ({"ssd_dir": "x", "ssd_size": 1}, "ssd_size"),
                      ({"ssd_dir": "x", "fsync": "sometimes"}, "fsync"),
                      ({"ssd_dir": "x", "dram_ttl_s": 0}, "dram_ttl_s"),
                      ({"ssd_dir": "x", "ssd_capacity_bytes": "lots"}, "ssd_capacity_bytes"),
                      ({"ssd_dir": "x", "on_locked": "wait"}, "on_locked")]:
        with pytest.raises(ValueError, match=word):
            Csa2ConnectorConfig.parse(bad)


def test_store_bindings_round_trip_and_refuse(tmp_path):
    from csa2_vllm import _store
    from csa2_vllm._lib import Csa2Error

    clock = _store.ManualClock(5)
    s = _store.SsdStore(str(tmp_path), 1 << 20, fsync=_store.FSYNC_NEVER, clock=clock)
    k = bytes(range(32))
    assert s.put(k, b"abc" * 100) and not s.put(k, b"abc" * 100)
    assert s.get(k, 300) == b"abc" * 100 and s.contains(k)
    with pytest.raises(Csa2Error) as e:
        s.get(k, 10)
    assert e.value.status == 200  # CSA2_ERR_SHAPE
    with pytest.raises(Csa2Error) as e:
        _store.SsdStore(str(tmp_path), 1 << 20)
    assert e.value.status == _store.STATUS_BUSY
    ro = _store.SsdStore(str(tmp_path), 1 << 20, read_only=True)
    assert ro.get(k, 300) == b"abc" * 100 and ro.stats().read_only == 1
    ro.close()
    s.close()
    with pytest.raises(ValueError):
        s.contains(b"short")
    p = _store.DramPool(1000, 50, clock)
    p.put(k, b"x" * 10)
    assert p.contains(k) and p.get(k, 10) == b"x" * 10
    clock.advance(50)
    assert not p.contains(k) and p.get(k, 10) is None
    with pytest.raises(Csa2Error) as e:
        p.put(k, b"x" * 1001)
    assert e.value.status == _store.STATUS_REFUSED
    p.close()
