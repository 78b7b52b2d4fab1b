"""A multi-model fleet's description: ``kunserve serve FLEET.json`` or ``kunserve serve MODEL_A MODEL_B ...``.

    {"models": [{"model": "/models/a", "name": "a", "instances": 1, "priority": 0,
                 "engine_args": ["--max-model-len", "1024"]},
                {"model": "/models/b", "instances": 1, "priority": 1}],
     "tenancy": {"idle_s": 30}}

``model``: a path or name as for ``vllm serve`` (required); ``name``: what clients send as ``model``
(vLLM's ``--served-model-name``; default ``model``); ``instances``: its engines (default: the
command's ``--instances``, 1);
``priority``: lower lends its memory first when idle (default none: 0); ``engine_args``: vLLM engine
arguments for this model's engines, after the command's own. ``tenancy``: the memory moves'
thresholds (``docs/config.md``, ``tenancy``). Anything else is refused, in one line naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kunserve.config import KunServeConfigError, TenancyConfig, parse_tenancy

_MODEL_KEYS = ("model", "name", "instances", "priority", "engine_args")


@dataclass(frozen=True)
class ModelEntry:
    model: str
    name: str
    instances: int | None = None   # None: the command's --instances
    priority: int | None = None
    engine_args: tuple[str, ...] = ()


def is_fleet_file(arg: str) -> bool:
    """A positional argument that names a fleet file (a model is a directory or a hub name)."""
    return arg.endswith(".json") and Path(arg).is_file()


def parse_fleet(raw: Any, where: str = "fleet file") -> tuple[list[ModelEntry], TenancyConfig]:
    """A fleet description (its JSON text, or the parsed object): the models and the tenancy options."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object with \"models\" (and optionally \"tenancy\")")
    unknown = sorted(set(raw) - {"models", "tenancy"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: models, tenancy)")
    models = raw.get("models")
    if not isinstance(models, list) or not models:
        raise ValueError(f"{where}: \"models\" must be a non-empty list of {{\"model\": ...}} objects")
    out: list[ModelEntry] = []
    for k, m in enumerate(models):
        w = f"{where}: models[{k}]"
        if isinstance(m, str):
            m = {"model": m}
        if not isinstance(m, dict):
            raise ValueError(f"{w}: expected an object with \"model\" (or a model name)")
        bad = sorted(set(m) - set(_MODEL_KEYS))
        if bad:
            raise ValueError(f"{w}: unknown key {bad[0]!r} (known: {', '.join(_MODEL_KEYS)})")
        model = m.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"{w}.model: a model path or name is required")
        name = m.get("name", model)
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{w}.name: a non-empty string")
        inst = m.get("instances")
        if inst is not None and (isinstance(inst, bool) or not isinstance(inst, int) or not 1 <= inst <= 256):
            raise ValueError(f"{w}.instances: an integer in 1..256, got {inst!r}")
        prio = m.get("priority")
        if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int)):
            raise ValueError(f"{w}.priority: an integer (lower lends first), got {prio!r}")
        args = m.get("engine_args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{w}.engine_args: a list of strings (vLLM engine arguments)")
        out.append(ModelEntry(model, name, inst, prio, tuple(args)))
    names = [e.name for e in out]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise ValueError(f"{where}: model name {dup!r} given twice (set \"name\" to tell them apart)")
    try:
        tenancy = parse_tenancy(raw.get("tenancy"))
    except KunServeConfigError as e:
        raise ValueError(f"{where}: {e}") from None
    return out, tenancy


def load_fleet(path: str) -> tuple[list[ModelEntry], TenancyConfig]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"fleet file {path}: {e.strerror or e}") from None
    return parse_fleet(text, f"fleet file {path}")


def from_models(models: list[str], instances: int) -> list[ModelEntry]:
    """``kunserve serve MODEL_A MODEL_B ...``: each model with ``--instances`` engines."""
    dup = next((m for i, m in enumerate(models) if m in models[:i]), None)
    if dup is not None:
        raise ValueError(f"model {dup!r} given twice: one model, one name (a fleet file can name two copies)")
    return [ModelEntry(m, m, instances) for m in models]
