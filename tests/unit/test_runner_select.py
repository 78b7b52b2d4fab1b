"""Which model runner an engine that moves memory runs (integration/vllm/runner.py): the V1 runner
for that engine only, vLLM's choice for every other, and one line where the user forced V2."""

from __future__ import annotations

import logging
import types

import pytest

from vllm_kunserve.config import KunServeConfigError, parse_config
from vllm_kunserve.integration.vllm import runner
from vllm_kunserve.integration.vllm.base import PatchShapeError, is_patched

pytestmark = pytest.mark.unit


class FakeVllmConfig:
    """The switch as vLLM reads it: a property, here answering what vLLM would choose (``v2``)."""

    def __init__(self, v2: bool, additional_config: dict | None = None):
        self.v2, self.additional_config = v2, additional_config

    @property
    def use_v2_model_runner(self) -> bool:
        return self.v2


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.delenv(runner.ENV, raising=False)
    p = runner.RunnerSelectionPatch()
    monkeypatch.setattr(p, "resolve", lambda dotted: FakeVllmConfig)
    p.patch()
    yield p
    p.revert()


def test_an_engine_that_moves_memory_runs_v1_and_says_so_others_keep_vllms_choice(patched, caplog):
    remap = {"kunserve": {"remap": {"enable": True}}}
    member = {"kunserve": {"drop": {"group_member": True}}}
    with caplog.at_level(logging.INFO, logger="vllm.kunserve"):
        assert FakeVllmConfig(True, remap).use_v2_model_runner is False
        assert FakeVllmConfig(True, member).use_v2_model_runner is False
    assert "model runner V1" in caplog.text and "kunserve selects V1 for this engine" in caplog.text
    assert FakeVllmConfig(True, None).use_v2_model_runner is True               # a stock engine
    assert FakeVllmConfig(True, {"kunserve": {}}).use_v2_model_runner is True   # kunserve, moving no memory
    assert FakeVllmConfig(False, remap).use_v2_model_runner is False            # CPU: V1 already
    assert is_patched(FakeVllmConfig.__dict__["use_v2_model_runner"]) == "runner_select"
    patched.patch()   # idempotent: applied once per process however often plugins load
    assert FakeVllmConfig.__dict__["use_v2_model_runner"].fget.__wrapped__ is not None
    assert FakeVllmConfig(True, None).use_v2_model_runner is True


def test_a_user_who_forced_model_runner_v2_is_refused_in_one_line(patched, monkeypatch):
    cfg = parse_config({"remap": {"enable": True}})
    monkeypatch.setenv(runner.ENV, "1")
    with pytest.raises(KunServeConfigError) as e:
        patched.configure(cfg, types.SimpleNamespace())
    assert "\n" not in str(e.value) and "VLLM_USE_V2_MODEL_RUNNER=1" in str(e.value)
    with pytest.raises(KunServeConfigError):
        FakeVllmConfig(True, {"kunserve": {"remap": {"enable": True}}}).use_v2_model_runner
    patched.configure(parse_config({}), types.SimpleNamespace())   # moves no memory: V2 is the user's
    assert FakeVllmConfig(True, None).use_v2_model_runner is True
    monkeypatch.setenv(runner.ENV, "0")
    patched.configure(cfg, types.SimpleNamespace())


def test_a_switch_whose_shape_changed_refuses_to_start(monkeypatch):
    class Changed:
        @property
        def use_v2_model_runner(other):   # not (self, ...): as if vLLM rewrote it
            return True

    p = runner.RunnerSelectionPatch()
    monkeypatch.setattr(p, "resolve", lambda dotted: Changed)
    with pytest.raises(PatchShapeError, match="use_v2_model_runner"):
        p.patch()


@pytest.mark.parametrize("value,forced", [("1", True), ("true", True), ("0", False), ("", False), ("no", False)])
def test_forced_v2_reads_the_switch_as_vllm_does(value, forced):
    assert runner.forced_v2({runner.ENV: value}) is forced
