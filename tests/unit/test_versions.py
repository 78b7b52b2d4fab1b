"""The version policy has one home (``integration/vllm/versions.py``) and everything else agrees with it:
the refusal is one line naming the range, the patch classes take their range and the parameters they
check from it, ``pyproject.toml`` pins the same range, and ``patches/README.md``'s vLLM column is
generated from it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from vllm_kunserve.integration.vllm import versions as policy

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["0.25.1", "0.35.0", "0.21.0+cpu", "garbage"])
def test_an_unsupported_release_is_refused_in_one_line_that_names_the_range(version):
    msg = policy.refusal(version)
    assert msg is not None and "\n" not in msg
    assert policy.SUPPORTED in msg and version in msg
    with pytest.raises(policy.UnsupportedVllmError, match=re.escape(policy.SUPPORTED)):
        policy.check_supported(version)


@pytest.mark.parametrize("version", ["0.26.0", "0.26.0+cpu", "0.32.0+cpu", "0.34.0", "0.33.1.dev4"])
def test_every_release_in_the_range_is_accepted(version):
    assert policy.refusal(version) is None
    policy.check_supported(version)


def test_releases_lie_in_the_range_and_the_lines_are_releases():
    assert list(policy.RELEASES) == sorted(policy.RELEASES, key=policy._release)
    assert all(policy.in_range(r) for r in policy.RELEASES)
    assert not policy.in_range("0.25.1") and not policy.in_range("0.35.0")
    for line in policy.LINES:
        assert line.release in policy.RELEASES and line.platform in ("cpu", "gpu")
    for t in policy.TOUCHPOINTS:
        assert set(t.ran) <= {ln.release for ln in policy.LINES}, t.name


def test_apply_refuses_an_unsupported_vllm_before_patching_anything(monkeypatch):
    import vllm_kunserve.integration.vllm as integration

    monkeypatch.setattr(integration, "vllm_version", lambda: "0.25.1")
    with pytest.raises(policy.UnsupportedVllmError) as e:
        integration.apply_named(["worker_extension"])
    assert "\n" not in str(e.value) and "0.25.1" in str(e.value)
    assert "worker_extension" not in integration.applied()
    assert integration.apply_named([]) == integration.applied()  # a stock engine: nothing to refuse


def test_pyproject_pins_the_same_range():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (vllm,) = [d for d in deps if re.match(r"vllm\b[^-_]", d)]
    assert vllm.replace(" ", "") == "vllm" + policy.SUPPORTED


def test_params_come_from_the_declaration_and_a_version_branch_picks_its_shape(monkeypatch):
    branched = policy.Touchpoint("t", "T", (
        policy.Symbol("m:f", params=("a",), versions=">=0.26,<0.28"),
        policy.Symbol("m:f", params=("a", "b"), versions=">=0.28,<0.35")))
    monkeypatch.setattr(policy, "TOUCHPOINTS", (*policy.TOUCHPOINTS, branched))
    assert policy.params("m:f", "0.27.1") == ("a",)
    assert policy.params("m:f", "0.28.0+cpu") == ("a", "b")
    assert [s.params for _, s in policy.symbols_for("0.26.0", "t")] == [("a",)]
    with pytest.raises(KeyError, match="not declared"):
        policy.params("m:undeclared", "0.32.0")


def test_every_patch_replaces_only_declared_symbols_with_the_declared_parameters(monkeypatch):
    """Each patch class applied on the vLLM installed here asks the declaration for the parameters it
    checks (an undeclared symbol raises KeyError) and vLLM's symbol has them (else PatchShapeError)."""
    from vllm_kunserve.integration.vllm import PATCH_CLASSES
    from vllm_kunserve.integration.vllm.shm_wait import ShmWaitPatch

    asked: list[str] = []
    real = policy.params

    def recording(path, version=None):
        asked.append(path)
        return real(path, version)

    for cls in (*PATCH_CLASSES, ShmWaitPatch):
        module = __import__(cls.__module__, fromlist=["params"])
        if hasattr(module, "params"):
            monkeypatch.setattr(module, "params", recording)
    declared = {s.path for t in policy.TOUCHPOINTS for s in t.symbols if s.params is not None}
    for cls in (*PATCH_CLASSES, ShmWaitPatch):
        inst = cls()
        try:
            inst.patch()
        finally:
            inst.revert()
    assert asked and set(asked) <= declared
    assert "vllm.v1.engine.core:EngineCore.step" in asked


def _readme_rows() -> list[list[str]]:
    text = (ROOT / "patches" / "README.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| touchpoint")]
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in rows]


def test_patches_readme_vllm_column_is_the_declaration():
    """Every touchpoint of the declaration has its row in patches/README.md (found by its class or
    module in the class column) and that row's vLLM cell is ``versions.column`` of it."""
    rows = _readme_rows()
    for t in policy.TOUCHPOINTS:
        mine = [r for r in rows if r[1].startswith(f"`{t.where}`")]
        assert len(mine) == 1, f"patches/README.md: no single row whose class column starts with `{t.where}`"
        assert mine[0][2] == policy.column(t.name), (
            f"patches/README.md row {mine[0][0]!r}: vLLM column {mine[0][2]!r}, the declaration says "
            f"{policy.column(t.name)!r} (vllm_kunserve/integration/vllm/versions.py)")


def test_a_feature_whose_touchpoint_this_release_lacks_refuses_in_one_line(monkeypatch):
    """vLLM 0.34 removed the V1 model runner: remap and groups (KV allocation) and KV migration refuse
    there in one line; the touchpoints that 0.34 keeps run."""
    import vllm_kunserve.integration.vllm as integration

    for name in ("kv_allocation", "cpu_linear", "pipeline", "kv_migration"):
        with pytest.raises(policy.UnsupportedVllmError) as e:
            policy.check_touchpoint(name, "0.34.0")
        assert "\n" not in str(e.value) and "0.34.0" in str(e.value) and "V1 model runner" in str(e.value)
        policy.check_touchpoint(name, "0.33.0")
        assert policy.column(name).startswith("0.26-0.33 (source)")
    for name in ("plugin", "worker_extension", "kv_plan", "engine_core", "scheduler", "endpoint", "frontend"):
        policy.check_touchpoint(name, "0.34.0")
    monkeypatch.setattr(integration, "vllm_version", lambda: "0.34.0")
    with pytest.raises(policy.UnsupportedVllmError, match="kv_allocation"):
        integration.apply_named(["kv_allocation"])
    assert "kv_allocation" not in integration.applied()


def test_kv_migration_refuses_where_its_touchpoint_does_not_run(monkeypatch):
    from vllm_kunserve.integration.vllm import kv_migration

    monkeypatch.setattr(policy, "vllm_version", lambda: "0.34.0")
    with pytest.raises(kv_migration.KVMigrationUnsupported, match="V1 model runner"):
        kv_migration.SchedulerKV(object())


def test_readme_release_table_is_the_declaration():
    assert policy.release_table() in (ROOT / "README.md").read_text(), (
        "README.md's release table differs from versions.release_table(): paste it again")


@pytest.mark.parametrize("version, module", [("0.26.0", "vllm.entrypoints.openai.cli_args"),
                                             ("0.32.0+cpu", "vllm.entrypoints.launchers.cli_args"),
                                             ("0.34.0", "vllm.entrypoints.common.cli_args")])
def test_a_moved_symbol_is_imported_from_where_the_declaration_says(version, module):
    assert policy.located("make_arg_parser", version) == f"{module}:make_arg_parser"
    with pytest.raises(KeyError, match="0 declared locations"):
        policy.located("no_such_symbol", version)
