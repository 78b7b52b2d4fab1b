import sys

import pytest

from vllm_kunserve import plugin

pytestmark = pytest.mark.unit


class EngineArgs:  # same class name vLLM uses; register() recognises its caller by it
    def __init__(self, additional_config):
        self.model = "m"
        self.additional_config = additional_config
        self.worker_extension_cls = ""
        self.seen = _load_general_plugins()


def _load_general_plugins():
    return plugin.find_additional_config(start_depth=2)


def _engine_core(vllm_config):
    return _load_general_plugins()


class _VllmConfig:
    model = "m"

    def __init__(self, additional_config):
        self.additional_config = additional_config


def test_finds_engine_args_config():
    args = EngineArgs({"kunserve": {"remap": {"enable": True}}})
    found, additional, holder = args.seen
    assert found and holder is args and additional == {"kunserve": {"remap": {"enable": True}}}


def test_finds_vllm_config_local():
    cfg = _VllmConfig({"kunserve": {}})
    found, additional, holder = _engine_core(cfg)
    assert found and holder is cfg and additional == {"kunserve": {}}


def test_no_engine_in_stack_means_not_found():
    assert plugin.find_additional_config(start_depth=1)[0] is False


def test_register_is_inert_without_kunserve_key(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm_kunserve.integration.vllm", raising=False)

    class EngineArgs:  # noqa: D401 - shadows on purpose
        def __init__(self):
            self.model = "m"
            self.additional_config = {"someone_else": 1}
            plugin.register()

    EngineArgs()
    assert plugin.active_config() is None
    assert plugin.applied_patches() == []
    assert "vllm_kunserve.integration.vllm" not in sys.modules


def test_register_rejects_bad_config():
    from vllm_kunserve.config import KunServeConfigError

    class EngineArgs:
        def __init__(self):
            self.model = "m"
            self.additional_config = {"kunserve": {"bogus": 1}}
            plugin.register()

    with pytest.raises(KunServeConfigError, match="bogus"):
        EngineArgs()
