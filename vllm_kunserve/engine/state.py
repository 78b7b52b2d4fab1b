"""An engine's state as its control port's ``GET /state`` carries it: :class:`EngineState`, defined once.

The engine agent builds one each time it publishes (``EngineAgent._publish``) and serves its
:meth:`EngineState.to_dict`; the readers (the cluster's monitor and control-port client,
``kunserve status``, an engine checking a KV-export target) parse what they receive with
:meth:`EngineState.from_dict` and read typed fields instead of string keys. The wire format is the
dict below, unchanged; ``from_dict(agent_dict).to_dict() == agent_dict``.

    {"engine": {"label", "pid", "model", ..., "stage": [addr, ...], "control_url"},
     "phase", "operation", "auto", "errors",
     "capacity": {"blocks_total", "blocks_base", "blocks_max", "block_size", "block_bytes"},
     "blocks": {"used", "free", "queued", "demand", "draining"},
     "requests": {"waiting", "running", "prefill_tokens", "decode_tokens", "mix_prompt_tokens",
                  "mix_output_tokens"},
     "layers": [{"index", "state", "bytes"}, ...], "remapped_layers", "slots", "dropped_layers",
     "group", "pipeline", "h2d_bytes_per_s", "copy_overlap", "remap_room_bytes", "tenancy",
     "events": [...]}

A key a reader does not find is None (an engine of another version, a stand-in in a test); a value
of the wrong type is an :class:`EngineStateError` that names it. Standard library only: the CLI and
the front end import it without torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

__all__ = ["Blocks", "Capacity", "EngineInfo", "EngineState", "EngineStateError", "Layer", "Requests"]


class EngineStateError(ValueError):
    """A ``/state`` that is not an engine's state; the message names the first field that is wrong."""


def _where(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _bad(where: str, what: str, v: Any) -> EngineStateError:
    return EngineStateError(f"engine state: {where} must be {what}, got {v!r}"[:300])


def _int(d: Mapping, key: str, where: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _bad(_where(where, key), "an integer or null", v)
    return int(v)


def _num(d: Mapping, key: str, where: str) -> float | int | None:
    v = d.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise _bad(_where(where, key), "a number or null", v)
    return v


def _typed(d: Mapping, key: str, where: str, kind: type | tuple[type, ...], what: str) -> Any:
    v = d.get(key)
    if v is not None and not isinstance(v, kind):
        raise _bad(_where(where, key), what, v)
    return v


def _section(d: Mapping, key: str) -> Mapping:
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _bad(key, "an object or null", v)
    return v


def _ints(d: Mapping, key: str) -> tuple[int, ...]:
    v = d.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise _bad(key, "a list of integers", v)
    return tuple(v)


#: the host an engine reports for grouping (``engine.host``) where its launcher knows better than the
#: machine's name: the Ray backend sets its node's id (two Ray nodes on one machine are two hosts)
HOST_ENV = "KUNSERVE_HOST_ID"


@dataclass(frozen=True)
class _Counts:
    """A section of integer counts (every field an ``int`` or None): parsed and written alike."""

    @classmethod
    def from_dict(cls, d: Mapping, where: str):
        return cls(**{f.name: _int(d, f.name, where) for f in fields(cls)})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Capacity(_Counts):
    """KV blocks the engine can hold now (``blocks_total``), at base and at most; one block's size."""

    blocks_total: int | None = None
    blocks_base: int | None = None
    blocks_max: int | None = None
    block_size: int | None = None     # tokens per block
    block_bytes: int | None = None    # bytes of one block over every layer


@dataclass(frozen=True)
class Blocks(_Counts):
    """KV blocks in use, free, needed by the queue, demanded (used + queued + growth), draining."""

    used: int | None = None
    free: int | None = None
    queued: int | None = None
    demand: int | None = None
    draining: int | None = None


@dataclass(frozen=True)
class Requests(_Counts):
    """The engine's requests and their work: counts, pending prefill / decode tokens, the mix."""

    waiting: int | None = None
    running: int | None = None
    prefill_tokens: int | None = None
    decode_tokens: int | None = None
    mix_prompt_tokens: int | None = None
    mix_output_tokens: int | None = None


@dataclass(frozen=True)
class Layer:
    """One decoder layer: ``resident``, ``streamed`` or ``dropped``, and its weight bytes."""

    index: int | None = None
    state: str | None = None
    bytes: int | None = None

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "Layer":
        if not isinstance(d, dict):
            raise _bad(where, "an object", d)
        return cls(_int(d, "index", where), _typed(d, "state", where, str, "a string or null"), _int(d, "bytes", where))

    def to_dict(self) -> dict:
        return {"index": self.index, "state": self.state, "bytes": self.bytes}


#: the typed keys of the ``engine`` section; every other key is kept as sent in ``extra``
_INFO_KEYS = ("label", "pid", "model", "stage", "control_url")


@dataclass(frozen=True)
class EngineInfo:
    """Who the engine is: its label and process, model, stage link addresses (a pipeline-group
    member's) and control URL; ``extra``: every other key the integration adds, as sent. A field
    that is None is not written (the agent adds ``stage`` and ``control_url`` only when it has them)."""

    label: str | None = None
    pid: int | None = None
    model: str | None = None
    stage: tuple[str, ...] | None = None
    control_url: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping) -> "EngineInfo":
        stage = d.get("stage")
        if stage is not None and (not isinstance(stage, list) or not all(isinstance(s, str) for s in stage)):
            raise _bad("engine.stage", "a list of addresses", stage)
        return cls(label=_typed(d, "label", "engine", str, "a string or null"), pid=_int(d, "pid", "engine"),
                   model=_typed(d, "model", "engine", str, "a string or null"),
                   stage=None if stage is None else tuple(stage),
                   control_url=_typed(d, "control_url", "engine", str, "a string or null"),
                   extra={k: v for k, v in d.items() if k not in _INFO_KEYS})

    @classmethod
    def of(cls, info: Mapping[str, Any]) -> "EngineInfo":
        """The section built from the agent's ``label``, ``pid`` and ``info`` (no checks)."""
        typed = {k: info[k] for k in _INFO_KEYS if info.get(k) is not None}
        if "stage" in typed:
            typed["stage"] = tuple(typed["stage"])
        return cls(**typed, extra={k: v for k, v in info.items() if k not in _INFO_KEYS})

    def get(self, key: str, default: Any = None) -> Any:
        """Any key of the section, typed or not (``kunserve status`` shows ``vllm`` this way)."""
        v = getattr(self, key) if key in _INFO_KEYS else self.extra.get(key)
        return default if v is None else v

    def to_dict(self) -> dict:
        out: dict[str, Any] = {k: getattr(self, k) for k in ("label", "pid", "model") if getattr(self, k) is not None}
        out.update(self.extra)
        if self.stage is not None:
            out["stage"] = list(self.stage)
        if self.control_url is not None:
            out["control_url"] = self.control_url
        return out


@dataclass(frozen=True)
class EngineState:
    """One engine's published state (the control port's ``GET /state``)."""

    engine: EngineInfo = field(default_factory=EngineInfo)
    phase: str | None = None           # base | remapped | draining | grouped | group_draining
    operation: Mapping[str, Any] | None = None   # {"op", "started", "params"} while one runs
    auto: bool | None = None           # the agent's own remap decisions are on
    errors: int | None = None          # controller errors so far
    capacity: Capacity = field(default_factory=Capacity)
    blocks: Blocks = field(default_factory=Blocks)
    requests: Requests = field(default_factory=Requests)
    layers: tuple[Layer, ...] = ()
    remapped_layers: tuple[int, ...] = ()
    slots: int | None = None
    dropped_layers: tuple[int, ...] = ()
    group: Mapping[str, Any] | None = None       # {"name", "drop", "spans", "peers", "since", "blocks"}
    pipeline: Mapping[str, Any] | None = None    # while grouped: where the hops' time goes
    h2d_bytes_per_s: float | None = None
    copy_overlap: bool | None = None
    #: bytes this engine's own remap could still give its KV (policy.remap.remap_room; 0: its remap is off,
    #: or it is grouped, draining or lends memory): what the fleet's lever order waits for (policy.levers)
    remap_room_bytes: int | None = None
    #: memory between engines of one host (a multi-model fleet): {"lent": layers given, "lent_bytes",
    #: "borrowed_blocks": blocks above the base on memory made for them, "held_bytes": the pool's}
    tenancy: Mapping[str, Any] | None = None
    events: tuple[Mapping[str, Any], ...] = ()   # the latest events, oldest first

    @classmethod
    def from_dict(cls, d: Any) -> "EngineState":
        """Parse a ``/state`` answer; :class:`EngineStateError` names the first field that is wrong."""
        if not isinstance(d, dict):
            raise _bad("the state", "a JSON object", d if not isinstance(d, (str, bytes)) else type(d).__name__)
        layers, events = d.get("layers"), d.get("events")
        if layers is not None and not isinstance(layers, list):
            raise _bad("layers", "a list", layers)
        if events is not None and (not isinstance(events, list) or not all(isinstance(e, dict) for e in events)):
            raise _bad("events", "a list of objects", events)
        return cls(
            engine=EngineInfo.from_dict(_section(d, "engine")),
            phase=_typed(d, "phase", "", str, "a string or null"),
            operation=_typed(d, "operation", "", dict, "an object or null"),
            auto=_typed(d, "auto", "", bool, "true, false or null"),
            errors=_int(d, "errors", ""),
            capacity=Capacity.from_dict(_section(d, "capacity"), "capacity"),
            blocks=Blocks.from_dict(_section(d, "blocks"), "blocks"),
            requests=Requests.from_dict(_section(d, "requests"), "requests"),
            layers=tuple(Layer.from_dict(x, f"layers[{i}]") for i, x in enumerate(layers or ())),
            remapped_layers=_ints(d, "remapped_layers"), slots=_int(d, "slots", ""),
            dropped_layers=_ints(d, "dropped_layers"),
            group=_typed(d, "group", "", dict, "an object or null"),
            pipeline=_typed(d, "pipeline", "", dict, "an object or null"),
            tenancy=_typed(d, "tenancy", "", dict, "an object or null"),
            h2d_bytes_per_s=_num(d, "h2d_bytes_per_s", ""),
            copy_overlap=_typed(d, "copy_overlap", "", bool, "true, false or null"),
            remap_room_bytes=_int(d, "remap_room_bytes", ""),
            events=tuple(events or ()))

    def to_dict(self) -> dict:
        """The wire form (what ``/state`` answers)."""
        return {
            "engine": self.engine.to_dict(),
            "phase": self.phase, "operation": self.operation, "auto": self.auto, "errors": self.errors,
            "capacity": self.capacity.to_dict(), "blocks": self.blocks.to_dict(), "requests": self.requests.to_dict(),
            "layers": [x.to_dict() for x in self.layers],
            "remapped_layers": list(self.remapped_layers), "slots": self.slots,
            "dropped_layers": list(self.dropped_layers), "group": self.group, "pipeline": self.pipeline,
            "h2d_bytes_per_s": self.h2d_bytes_per_s, "copy_overlap": self.copy_overlap,
            "remap_room_bytes": self.remap_room_bytes, "tenancy": self.tenancy, "events": list(self.events),
        }
