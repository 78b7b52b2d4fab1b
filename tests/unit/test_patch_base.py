import types

import pytest

from vllm_kunserve.integration.vllm.base import VllmPatch, is_patched
from vllm_kunserve.integration.vllm.versions import SUPPORTED

pytestmark = pytest.mark.unit


class _Target:
    def step(self, x):
        return x + 1


class _AddTen(VllmPatch):
    name = "add_ten"

    def patch(self, cfg):
        def make(orig):
            def step(self, x):
                return orig(self, x) + 10
            return step
        return self.replace(_Target, "step", make)


def test_patch_is_idempotent_and_revertible():
    p = _AddTen()
    assert p.patch(None) is True
    assert p.patch(None) is False  # second load in the same process: no double wrap
    assert _Target().step(1) == 12
    assert is_patched(_Target.step) == "add_ten"
    p.revert()
    assert _Target().step(1) == 2
    assert is_patched(_Target.step) is None


@pytest.mark.parametrize("version, ok", [("0.26.0", True), ("0.26.0+cpu", True), ("0.32.0+cpu", True),
                                         ("0.34.0", True), ("0.25.1", False), ("0.35.0", False),
                                         ("0.32.1.dev3", True), ("not-a-version", False)])
def test_version_gate_reads_the_one_range(version, ok):
    """A patch class has no range of its own: it reads versions.SUPPORTED."""
    assert _AddTen.versions == SUPPORTED
    assert _AddTen().supported(version) is ok


def test_resolve_dotted_path():
    assert VllmPatch.resolve("json:decoder.JSONDecoder").__name__ == "JSONDecoder"
    assert isinstance(VllmPatch.resolve("os.path"), types.ModuleType)
