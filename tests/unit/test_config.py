import json

import pytest

from vllm_kunserve.config import (
    KunServeConfig,
    KunServeConfigError,
    config_from_additional,
    parse_config,
    render_docs,
)

pytestmark = pytest.mark.unit


def test_empty_object_gives_defaults():
    cfg = parse_config({})
    assert cfg == KunServeConfig()
    assert cfg.remap.enable is False and cfg.drop.enable is True


def test_sections_parse_and_json_string_accepted():
    cfg = parse_config(json.dumps({"remap": {"enable": True, "slots": 2, "max_layers": 3},
                                   "restore": {"threshold": 0.4}}))
    assert cfg.remap.enable and cfg.remap.slots == "2" and cfg.remap.max_layers == 3
    assert cfg.restore.threshold == 0.4
    assert "remap" in cfg.features()


@pytest.mark.parametrize("raw, names", [
    ({"bogus": 1}, ["bogus", "allowed sections", "remap"]),
    ({"remap": {"bogus": True}}, ["remap.bogus", "allowed keys", "max_layers"]),
    ({"remap": {"enable": 1}}, ["remap.enable", "1", "boolean"]),
    ({"remap": {"max_layers": 2.5}}, ["remap.max_layers", "2.5", "integer"]),
    ({"remap": {"max_layers": -1}}, ["remap.max_layers", "-1", ">= 0"]),
    ({"remap": {"slots": 3}}, ["remap.slots", "'3'", "auto, 1, 2"]),
    ({"restore": {"threshold": 1.5}}, ["restore.threshold", "1.5", "<= 1.0"]),
    ({"restore": {"source": "disk"}}, ["restore.source", "disk", "peer"]),
    ({"drop": {"trigger_ratio": "high"}}, ["drop.trigger_ratio", "high", "number"]),
    ({"drop": {"trigger_ratio": float("nan")}}, ["drop.trigger_ratio", "finite"]),
    ({"remap": {"max_fraction": 0.0}}, ["remap.max_fraction", "> 0.0"]),
    ({"remap": {"low_watermark": 0.9, "high_watermark": 0.8}}, ["low_watermark", "high_watermark"]),
    ({"drop": 3}, ["kunserve.drop", "expected an object"]),
    ({"memory": {"max_kv_ratio": 0.5}}, ["memory.max_kv_ratio", "0.5", "0 (auto) or >= 1"]),
    ([1, 2], ["expected an object"]),
    ("{not json", ["not valid JSON"]),
])
def test_bad_input_names_key_value_and_allowed(raw, names):
    with pytest.raises(KunServeConfigError) as e:
        parse_config(raw)
    for n in names:
        assert n in str(e.value), (n, str(e.value))


@pytest.mark.parametrize("raw, ratio", [
    ({}, 2.0),                                                    # remap alone (or nothing)
    ({"remap": {"enable": True}}, 2.0),
    ({"drop": {"group_member": True}}, 4.0),
    ({"drop": {"group_member": True, "max_group_size": 100}}, 4.0),
    ({"drop": {"group_member": True}, "memory": {"max_kv_ratio": 1.5}}, 1.5),  # explicit wins
    ({"remap": {"enable": True}, "memory": {"max_kv_ratio": 10}}, 10.0),
])
def test_max_kv_ratio_auto_lets_a_group_member_use_what_it_frees(raw, ratio):
    """A member of an n-engine group that uses every freed byte holds 1 + (n-1)/n x w/(1-w) times
    its base blocks (w: the weights' share of weights + KV); the auto ratio covers w up to 3/4."""
    cfg = parse_config(raw)
    assert cfg.kv_ratio == ratio
    if cfg.drop.group_member and not cfg.memory.max_kv_ratio:
        for n in (2, 8, 4096):
            assert 1 + (n - 1) / n * 0.75 / 0.25 <= cfg.kv_ratio
        assert 1 + 7 / 8 * 0.8 / 0.2 > cfg.kv_ratio  # beyond 3/4 it can cap the gain of a large group


def test_config_is_frozen():
    cfg = parse_config({})
    with pytest.raises(Exception):
        cfg.remap.enable = True  # type: ignore[misc]


@pytest.mark.parametrize("additional", [None, {}, {"other_plugin": {}}, "", '{"x": 1}'])
def test_inert_without_kunserve_key(additional):
    assert config_from_additional(additional) is None


def test_kunserve_key_enables():
    assert config_from_additional({"kunserve": None}) == KunServeConfig()
    assert config_from_additional('{"kunserve": {"placement": {"policy": "best_fit"}}}').placement.policy == "best_fit"


def test_docs_cover_every_key_and_are_current():
    import dataclasses
    import pathlib

    text = render_docs()
    for section in dataclasses.fields(KunServeConfig):
        for f in dataclasses.fields(getattr(KunServeConfig(), section.name)):
            assert f"`{section.name}.{f.name}`" in text
    committed = pathlib.Path(__file__).parents[2] / "docs" / "config.md"
    assert committed.read_text() == text + "\n", "docs/config.md is stale: run `make docs`"


def test_every_documented_key_is_read_somewhere():
    """No key documented but unread: for each ``section.key`` some module other than config.py reads
    the key's attribute and names its section (``cfg.drop.trigger_ratio``, ``d = cfg.drop`` then
    ``d.trigger_ratio``, or a ``drop: DropConfig`` parameter), or config.py's own resolver reads
    ``self.section.key`` (``kv_ratio()``). A new key fails this until a feature reads it."""
    import dataclasses
    import pathlib
    import re

    pkg = pathlib.Path(__file__).parents[2] / "vllm_kunserve"
    texts = [p.read_text() for p in pkg.rglob("*.py") if p.name != "config.py"]
    own = (pkg / "config.py").read_text()
    unread = []
    for section in dataclasses.fields(KunServeConfig):
        cls = type(getattr(KunServeConfig(), section.name))
        sec = re.compile(rf"\b{section.name}\b|\b{cls.__name__}\b")
        for f in dataclasses.fields(cls):
            key = re.compile(rf"\.{f.name}\b")
            if not (re.search(rf"self\.{section.name}\.{f.name}\b", own)
                    or any(sec.search(t) and key.search(t) for t in texts)):
                unread.append(f"{section.name}.{f.name}")
    assert not unread, f"documented config keys that no module reads: {unread}"


def test_cost_model_path_must_hold_a_json_object_and_its_fields_are_read_by_policy(tmp_path):
    """config checks the file (there, JSON, an object) without importing policy; the fields are
    checked where the model is loaded (``policy.costmodel.CostModel.load``, naming the field)."""
    from vllm_kunserve.policy.costmodel import CostModel

    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    with pytest.raises(KunServeConfigError, match=r"lookahead\.cost_model=.*expected a JSON object, got list"):
        parse_config({"lookahead": {"cost_model": str(arr)}})
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"beta": 1.0}))
    with pytest.raises(ValueError, match=r"partial\.json\.alpha: missing required field"):
        CostModel.load(partial)
