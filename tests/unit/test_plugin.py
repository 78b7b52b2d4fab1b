"""The plugin's activation gate (vLLM's EngineArgs class is imported; no engine is built)."""

import sys
import types

import pytest

from vllm_kunserve import plugin

pytestmark = pytest.mark.unit

EngineArgs = pytest.importorskip("vllm.engine.arg_utils").EngineArgs


@pytest.fixture
def gate(monkeypatch):
    """A fresh gate over a stand-in ``create_engine_config`` (restored afterwards)."""
    made = []

    def create_engine_config(self, *a, **kw):
        cfg = types.SimpleNamespace(additional_config=self.additional_config, model_config=None,
                                    parallel_config=types.SimpleNamespace(worker_extension_cls=""))
        made.append(cfg)
        return cfg

    monkeypatch.setattr(EngineArgs, "create_engine_config", create_engine_config)
    monkeypatch.setitem(plugin._state, "gate", None)
    monkeypatch.setitem(plugin._state, "patches", [])
    # setenv (not delenv) so that teardown removes what activate() exports: it must not leak into
    # engines this test process starts later (they would apply the touchpoints)
    monkeypatch.setenv(plugin.ENV_PATCHES, "")
    monkeypatch.setenv(plugin.ENV_FEATURES, "")
    plugin.register()
    yield made
    from vllm_kunserve.integration.vllm import revert_all

    revert_all()


def _args(additional):
    return types.SimpleNamespace(additional_config=additional, worker_extension_cls="", enforce_eager=False)


def test_register_installs_only_the_gate_and_imports_nothing(gate, monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm_kunserve.integration.vllm", raising=False)
    assert getattr(EngineArgs.create_engine_config, "__kunserve_gate__", False)
    out = EngineArgs.create_engine_config(_args({"someone_else": 1}))
    assert out is gate[-1] and out.parallel_config.worker_extension_cls == ""
    assert plugin.applied_patches() == []
    assert "vllm_kunserve.integration.vllm" not in sys.modules


def test_gate_rejects_bad_config_naming_the_key(gate):
    from vllm_kunserve.config import KunServeConfigError

    with pytest.raises(KunServeConfigError, match="kunserve.bogus"):
        EngineArgs.create_engine_config(_args({"kunserve": {"bogus": 1}}))
    assert gate == []  # vLLM's config was never built


def test_gate_activates_per_engine_and_exports_patches(gate, monkeypatch):
    a = _args({"kunserve": {}})
    EngineArgs.create_engine_config(a)
    assert a.worker_extension_cls.endswith("KunServeWorkerExtension")
    assert plugin.applied_patches() == ["worker_extension"]
    import os

    assert os.environ[plugin.ENV_PATCHES] == "worker_extension"
    stock = EngineArgs.create_engine_config(_args(None))  # a later stock engine stays stock
    assert stock.parallel_config.worker_extension_cls == ""
    assert plugin.ENV_PATCHES not in os.environ  # and its processes apply nothing
    b = _args({"kunserve": {"remap": {"enable": True}}})
    EngineArgs.create_engine_config(b)
    assert b.enforce_eager is True
    assert set(os.environ[plugin.ENV_PATCHES].split(",")) >= {"worker_extension", "kv_plan", "engine_core"}
