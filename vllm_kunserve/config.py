"""kunserve configuration: one frozen dataclass per feature, parsed from
``additional_config["kunserve"]``.

Every field carries its documentation and its allowed values in ``field(metadata=...)``; the parser
uses them to reject unknown keys, wrong types and out-of-range values with a message naming the key,
the value and what is allowed, and ``docs/config.md`` is generated from the same metadata
(``kunserve config-docs``), so the docs cannot drift from the code.

This module is pure Python: no torch, no vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

CONFIG_KEY = "kunserve"


class KunServeConfigError(ValueError):
    """Raised for any invalid kunserve option. The message names the key, value and what is allowed."""


def _opt(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None,
         choices: tuple | None = None, lo_open: bool = False) -> Any:
    meta = {"doc": doc, "lo": lo, "hi": hi, "choices": choices, "lo_open": lo_open}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DropConfig:
    """Cluster drop (KunServe): merge instances into pipeline groups and drop replicated layers."""

    enable: bool = _opt(True, "Allow the monitor to drop replicated layers when KV demand exceeds capacity.")
    trigger_ratio: float = _opt(
        1.0, "Drop when demand / KV capacity exceeds this (demand = used blocks + head-of-line queued blocks + forecast).",
        lo=0.1, hi=4.0)
    forecast_horizon_s: float = _opt(
        2.0, "Seconds of arrival-trend forecast added to demand (0 disables the forecast).", lo=0.0, hi=600.0)
    headroom_ratio: float = _opt(
        0.1, "Extra KV asked for beyond the measured shortfall, as a share of the shortfall.", lo=0.0, hi=4.0)
    min_decode_share: float = _opt(
        0.0, "Drop only while the requests in the engines are decode-heavy: their output budgets (max_tokens) at "
        "least this share of their prompt lengths plus output budgets. More KV buys throughput only through bigger "
        "decode batches, and where prefill is slow per token (a CPU) long prompts with short outputs are "
        "compute-bound, which a pipeline would slow down. A token count, not a cost: on a GPU a prompt token costs "
        "a small fraction of a decode step and a prompt-heavy mix can still be KV-bound, so the default (0) leaves "
        "the check off.",
        lo=0.0, hi=1.0)
    decode_share_window_s: float = _opt(
        5.0, "Seconds of the monitor's recent readings the decode share is summed over, with the current one "
        "(0: the current reading alone).", lo=0.0, hi=600.0)
    defer_for_first_token_s: float = _opt(
        0.0, "While the instances a drop would group have requests waiting for their first token and their KV is "
        "not yet short (demand below capacity), wait up to this many seconds for a moment with none before "
        "joining: a join stalls its members for its length (0.5 s on a CPU), which those requests would pay "
        "in TTFT, where the requests already decoding pay it once in a stream of tokens. 0 (the default) joins at "
        "once: measured at 2 s (docs/benchmarks/burst_value_r1_2x_join.md) it waited in 1 of 5 runs, for its whole "
        "2 s, and that run had kunserve's only preemption and its slowest first token.",
        lo=0.0, hi=60.0)
    remap_first_s: float = _opt(
        10.0, "The order of the levers (policy.levers): while the lone engines' own remap (remap.enable, each "
        "engine's agent streaming layers its link hides) can still cover the shortfall, a due drop waits up to "
        "this many seconds for it: a local remap costs no pipeline hop. Past it, or where the remap room is "
        "short, the drop goes ahead (a remapped engine joins keeping the layers it streams). 0: drop at once, "
        "whatever the engines could remap.",
        lo=0.0, hi=600.0)
    max_group_size: int = _opt(
        8, "Largest pipeline group the planner may form (instances per group).", lo=1, hi=4096)
    regroup: bool = _opt(
        False, "Let a drop merge live groups into a larger one (two groups of 2 into a group of 4) when merging lone "
        "instances cannot free enough. Every member moves to its new stage at once, keeping every request's KV: "
        "each request's KV of each layer moves to the member that runs the layer in the larger group, nothing is "
        "recomputed; lone instances in the merge join the same way. Where that fails (or with drop.transition "
        "reprefill) the merged groups' members take their layers back from the host copies and recompute their "
        "requests, then the larger group forms as from lone instances; no request is lost either way. The same "
        "switch lets a restore step down: a group of four or more whose requests would not fit back in its "
        "members alone, but would in two halves, splits into the halves first (each member drains to its count "
        "in its half, then all restage at once keeping the KV). Measured at "
        "paper scale in the simulator (docs/benchmarks/sim_regroup.md): keeping the KV lowered P99 TTFT by 5% or "
        "more in 20 of the 25 cells with room for a larger group (median 0.82x) and raised it in one (1.21x). Off "
        "by default (a live group stays as it is until restored) until it is measured under a burst in real "
        "engines: so far one test forms a group of 4 from two live pairs, and one steps a group of 4 down into "
        "pairs, each token-identical.")
    check_interval_s: float = _opt(0.5, "Monitor period in seconds.", lo=0.01, hi=60.0, lo_open=False)
    transition: str = _opt(
        "kv", "How ongoing requests cross into a group: kv (their KV of the layers changing hands moves to the "
        "member that runs them) or reprefill (they are recomputed); a failed KV exchange falls back to reprefill.",
        choices=("kv", "reprefill"))
    static_group: bool = _opt(
        False, "Form one pipeline group of all instances as soon as they are up and keep it (no monitor-driven "
        "drop or restore): the static pipeline-parallel bound a dynamic drop approaches without transition cost.")
    group_member: bool = _opt(
        False, "This engine can join pipeline groups: it keeps a growable KV cache, an engine agent and a "
        "control port (`kunserve serve` sets it on its engines).")
    allow_unvalidated_cuda: bool = _opt(
        False, "Let a group member start on a CUDA platform. Pipeline groups have run inside vLLM on CPU only; on "
        "CUDA the stage link (CUDA IPC, tensors kept on the device) and KV exchange ran at mechanism level on an "
        "H100 without vLLM, and the FlashAttention metadata glue is tested against vLLM's dataclass, not inside "
        "vLLM. Off, drop.group_member refuses to start there; on, it starts (for validating the CUDA glue).")


@dataclass(frozen=True)
class RestoreConfig:
    """Restore dropped layers when demand falls."""

    enable: bool = _opt(True, "Restore weights and split groups when demand stays low.")
    threshold: float = _opt(
        0.5, "Restore when demand stays below this share of the undropped (base) KV capacity.", lo=0.0, hi=1.0)
    hold_s: float = _opt(5.0, "Seconds demand must stay below the threshold before restoring.", lo=0.0, hi=3600.0)
    source: str = _opt("auto", "Where a group member's dropped layers come back from: `peer` (the member that ran "
                       "them; a layer whose copy fails comes from its host copy), `host` (the host copies), `auto` "
                       "(peer in a group).", choices=("auto", "peer", "host"))


@dataclass(frozen=True)
class RemapConfig:
    """Instance remap (Oneiros): turn some layers' weight memory into KV and stream those layers."""

    enable: bool = _opt(False, "Remap layers to KV instead of preempting when KV blocks run out.")
    max_layers: int = _opt(
        0, "Cap on remapped layers per model (0: the controller's bound from bandwidth and compute time).",
        lo=0, hi=4096)
    max_fraction: float = _opt(
        0.5, "Never remap more than this share of a model's decoder layers.", lo=0.0, hi=1.0, lo_open=True)
    slots: str = _opt(
        "auto", "Shared weight slots for streamed layers: 1, 2, or auto (the paper's Eq. 4/5).",
        choices=("auto", "1", "2"))
    high_watermark: float = _opt(
        0.95, "Remap when KV usage (with queued demand) exceeds this share of capacity.", lo=0.0, hi=4.0, lo_open=True)
    low_watermark: float = _opt(
        0.5, "Revert when KV demand stays below this share of the base capacity.", lo=0.0, hi=1.0)
    revert_hold_s: float = _opt(2.0, "Seconds demand must stay low before reverting.", lo=0.0, hi=3600.0)
    growth_tokens: int = _opt(
        256, "Output tokens per running or queued request counted ahead as KV demand (capped by its max_tokens).",
        lo=0, hi=1 << 20)
    h2d_bandwidth_gbps: float = _opt(
        0.0, "Host-to-device bandwidth in GB/s (0: measure at startup).", lo=0.0, hi=10000.0)


@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead microbatch formation for pipeline groups (cost-balanced divide and conquer)."""

    enable: bool = _opt(True, "Split queued work into cost-balanced microbatches (else token-count chunks).")
    min_tokens: int = _opt(
        64, "Least work per microbatch where lookahead splits a group's work into stage microbatches (`kunserve "
        "plan microbatch`, the simulator): the cost of this many prefill tokens (lookahead splits no further).",
        lo=1, hi=1 << 20)
    step_min_tokens: int = _opt(
        256, "While grouped, the least prefill (tokens) a member's step starts whatever its peers' steps cost. "
        "The budget balances a member's step against its peer's, so two members decoding alike leave each other "
        "no room but this floor: a cluster of queued prompts starts this many tokens per step. 64 started one "
        "64-token prompt per step (k arrivals: k steps); 256 at R1 on a CPU: P99 TTFT 0.74x and P50 TPOT 0.95x "
        "64's, with fewer preemptions (docs/benchmarks/burst_value_r1_xeon_prefill_ablation.md).", lo=1, hi=1 << 20)
    cost_model: str = _opt(
        "", "Fitted cost model JSON (`kunserve costmodel fit --out`) the group scheduler balances steps with "
        "(empty: the built-in stand-in; only relative costs matter). One fitted at R1 on a CPU (4.95% held-out "
        "error) left TTFT unchanged and cost 2% of TPOT: the floor or the queue set the budgets there "
        "(docs/benchmarks/burst_value_r1_epyc_costmodel_ablation.md).")
    pace: str = _opt(
        "latest", "While grouped, what a member's step budget is balanced against: `latest`: each peer's latest "
        "step (members with prompts queued on both then start `step_min_tokens` of prefill per step each: short steps "
        "that pick up new arrivals soon); `wanted`: the costlier of that and the step the peer wants (its queue "
        "under vLLM's budget, sent with its spans): queued prompts start together in one longer step. Measured at "
        "R1 on a CPU: the same TTFT, `latest` 6% lower TPOT and fewer preemptions "
        "(docs/benchmarks/burst_value_r1_xeon_pace_ablation.md).",
        choices=("latest", "wanted"))
    admission: str = _opt(
        "vllm", "While grouped, when a queued request may start: `vllm`: vLLM's own (as soon as its prompt "
        "fits; a shortfall of KV is met by preempting and recomputing); `peak`: only if every started request "
        "can still reach its max_tokens in the group's KV (no preemption churn, but a queue that waits for "
        "whole requests to finish wherever the group's KV is short of the admitted set's peak, even briefly: with a "
        "group's KV capped at 2x under a burst, no preemption but P99 TTFT 33x `vllm`'s, "
        "docs/benchmarks/burst_value_r0_harsh.md).",
        choices=("peak", "vllm"))


@dataclass(frozen=True)
class PlacementConfig:
    """Request placement and migration (MELL)."""

    policy: str = _opt("mell", "Placement policy of `kunserve plan placement` (elastic bin packing).",
                       choices=("mell", "best_fit", "worst_fit", "llumnix"))
    max_migrations: int = _opt(
        10, "Migrations allowed per placement operation (`kunserve serve --dispatch mell`: per monitor period).",
        lo=0, hi=1000)
    max_migration_bytes: int = _opt(
        4 << 30, "KV bytes migrations may send per operation (per monitor period), all instance pairs together; "
        "a move over budget re-prefills instead or waits (0: never send KV).", lo=0, hi=1 << 50)
    max_reprefill_ms: float = _opt(
        1000.0, "Prefill time (cost model, ms) each destination may spend per operation re-prefilling migrated "
        "requests (0: never re-prefill).", lo=0.0, hi=3.6e6)
    high_watermark: float = _opt(
        0.9, "Fixed-cluster MELL: migrate requests off an instance whose KV demand (used + queued blocks) "
        "exceeds this share of its capacity; a destination must stay at or below it.", lo=0.0, hi=1.0, lo_open=True)


@dataclass(frozen=True)
class ControlConfig:
    """The engine's control port (state and operations over HTTP, for the cluster and for people)."""

    enable: bool = _opt(True, "Serve the control port from the engine-core process (engines with remap on).")
    host: str = _opt("127.0.0.1", "Address to bind; anything but loopback is reachable from other machines.")
    port: int = _opt(0, "TCP port (0: a free port, logged at startup and shown in the engine state).", lo=0, hi=65535)
    token: str = _opt("", "Bearer token callers must send (empty: env KUNSERVE_CONTROL_TOKEN, else none).")


@dataclass(frozen=True)
class MemoryConfig:
    """Physical memory pool backing weights and KV."""

    backend: str = _opt("auto", "Memory backend (auto: cuda when a driver is usable, else host).",
                        choices=("auto", "cuda", "host"))
    max_kv_ratio: float = _opt(
        0.0, "KV regions reserve virtual space for this multiple of the base KV capacity: the most KV an engine "
        "can reach by remap or drop (its block count never exceeds it). 0 (auto): 2 for remap alone, 4 for a "
        "pipeline-group member: a member of an n-engine group that uses every freed byte holds "
        "1 + (n - 1) / n x weights / base KV times its base blocks (its own requests' KV and its peers', over "
        "the layers it keeps), under 4 for any n where weights are up to 3/4 of weights + KV, under 2 only "
        "up to 1/2.",
        lo=0.0, hi=64.0)
    chunk_kib: int = _opt(
        0, "Physical chunk size in KiB (0: ~1/16 of the smallest layer, a power of two from the "
        "granularity up to 32 MiB on CUDA, 2 MiB on host).",
        lo=0, hi=1 << 20)


@dataclass(frozen=True)
class ElasticConfig:
    """An elastic fleet (`kunserve serve --min-instances N --max-instances M --elastic JSON`): the front end
    starts an engine when the forecast KV demand stays above what the running engines can hold even after
    every drop they may still make, and drains and stops one when the demand would fit in one fewer
    (`policy.elastic`; the simulator runs the same decision). Not an engine option."""

    up_ratio: float = _opt(
        0.9, "Start an engine when (demand + forecast) / what the running and starting engines can reach "
        "stays above this.", lo=0.0, hi=4.0, lo_open=True)
    up_hold_s: float = _opt(5.0, "Seconds the demand must stay above `up_ratio` before an engine starts.",
                            lo=0.0, hi=3600.0)
    down_ratio: float = _opt(
        0.6, "Drain an engine when (demand + forecast) / what the others can reach stays at or below this.",
        lo=0.0, hi=1.0, lo_open=True)
    down_hold_s: float = _opt(30.0, "Seconds the demand must stay at or below `down_ratio` before a drain.",
                              lo=0.0, hi=3600.0)
    cooldown_s: float = _opt(30.0, "Seconds after an engine joined or left before another may leave.",
                             lo=0.0, hi=3600.0)
    forecast_horizon_s: float = _opt(
        10.0, "The demand's rising trend is projected this far ahead (an engine takes time to start); "
        "a falling trend counts 0.", lo=0.0, hi=3600.0)
    drain_migrations: int = _opt(
        8, "Requests a drain may move to other engines in all (MELL's bound; the rest finish where they are, "
        "with no new ones sent there).", lo=0, hi=10000)


@dataclass(frozen=True)
class TenancyConfig:
    """A multi-model fleet (`kunserve serve --fleet FILE`, its `tenancy` object): the engines of one host share
    the memory they started with; a model idle this long lends its engines' weight memory down to the
    threshold at which its next prefill streams the rest in time (`policy.remap`, Oneiros's order), busy
    models' engines borrow it as KV, and a request for a lender takes it back (`policy.tenancy`). Not an
    engine option."""

    idle_s: float = _opt(30.0, "Seconds without a request (and none in flight) before a model is inactive and "
                               "lends its weight memory.", lo=0.0, hi=86400.0, lo_open=True)
    borrow_ratio: float = _opt(0.9, "An active engine borrows when its KV demand exceeds this share of its "
                                    "blocks.", lo=0.0, hi=4.0, lo_open=True)
    repay_ratio: float = _opt(0.5, "A borrowing engine repays when its KV demand stays under this share of its "
                                   "base blocks.", lo=0.0, hi=1.0, lo_open=True)
    repay_hold_s: float = _opt(10.0, "Seconds the demand must stay under `repay_ratio` before a repay.",
                               lo=0.0, hi=3600.0)
    headroom: float = _opt(0.25, "A borrow asks this much more than the shortage (a share of it), so that "
                                 "a rising demand borrows less often.", lo=0.0, hi=10.0)


_SECTIONS: dict[str, type] = {
    "drop": DropConfig,
    "restore": RestoreConfig,
    "remap": RemapConfig,
    "lookahead": LookaheadConfig,
    "placement": PlacementConfig,
    "memory": MemoryConfig,
    "control": ControlConfig,
}


@dataclass(frozen=True)
class KunServeConfig:
    """All kunserve options. Construct with :func:`parse_config`."""

    drop: DropConfig = field(default_factory=DropConfig)
    restore: RestoreConfig = field(default_factory=RestoreConfig)
    remap: RemapConfig = field(default_factory=RemapConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    control: ControlConfig = field(default_factory=ControlConfig)

    def features(self) -> list[str]:
        """What runs on this engine, for the startup log line. The drop, restore, lookahead and
        placement sections configure the cluster controller (``kunserve serve``) and are not named
        here: a single engine does not run them."""
        if not self.moves_memory:
            return ["plugin only (no memory feature enabled)"]
        return [*(["remap"] if self.remap.enable else []), *(["group member"] if self.drop.group_member else []),
                "control port" if self.control.enable else "no control port"]

    @property
    def moves_memory(self) -> bool:
        """Whether this engine moves weights and KV (remap, or pipeline-group membership): it then
        gets the growable KV cache, the engine agent and the control port."""
        return self.remap.enable or self.drop.group_member

    @property
    def kv_ratio(self) -> float:
        """``memory.max_kv_ratio`` resolved (0 is auto: see its description)."""
        if self.memory.max_kv_ratio:
            return self.memory.max_kv_ratio
        return 4.0 if self.drop.group_member else 2.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _type_name(tp: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _check_value(path: str, f: dataclasses.Field, tp: Any, value: Any) -> Any:
    meta = f.metadata
    # JSON has no separate int/bool; be strict so `"enable": 1` or `"slots": 2.0` are caught.
    if tp is bool:
        if not isinstance(value, bool):
            raise KunServeConfigError(f"kunserve.{path}={value!r}: expected a boolean (true or false)")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise KunServeConfigError(f"kunserve.{path}={value!r}: expected an integer")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KunServeConfigError(f"kunserve.{path}={value!r}: expected a number")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise KunServeConfigError(f"kunserve.{path}={value!r}: expected a finite number")
    elif tp is str:
        if isinstance(value, int) and not isinstance(value, bool) and meta.get("choices"):
            value = str(value)  # allow "slots": 2 as well as "slots": "2"
        if not isinstance(value, str):
            raise KunServeConfigError(f"kunserve.{path}={value!r}: expected a string")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise KunServeConfigError(
            f"kunserve.{path}={value!r}: not allowed; choose one of {', '.join(map(str, choices))}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value < lo or (meta.get("lo_open") and value == lo)):
        op = ">" if meta.get("lo_open") else ">="
        raise KunServeConfigError(f"kunserve.{path}={value!r}: out of range; allowed {op} {lo} and <= {hi}")
    if hi is not None and value > hi:
        raise KunServeConfigError(f"kunserve.{path}={value!r}: out of range; allowed <= {hi}")
    return value


def _parse_section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise KunServeConfigError(
            f"kunserve.{name}={raw!r}: expected an object with keys {', '.join(_field_names(cls))}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise KunServeConfigError(
                f"kunserve.{name}.{key}: unknown key (value {value!r}); allowed keys: {', '.join(fields)}")
        kwargs[key] = _check_value(f"{name}.{key}", fields[key], hints[key], value)
    obj = cls(**kwargs)
    _cross_check(name, obj)
    return obj


def _cross_check(name: str, obj: Any) -> None:
    if isinstance(obj, LookaheadConfig) and obj.cost_model:
        # the file must be there and hold a JSON object; its fields are read (and checked, naming the
        # one at fault) by ``policy.costmodel.CostModel.load`` where the model is used: config sits
        # below policy and imports none of it
        try:
            model = json.loads(Path(obj.cost_model).read_text(encoding="utf-8"))
            if not isinstance(model, Mapping):
                raise ValueError(f"expected a JSON object, got {type(model).__name__}")
        except (OSError, ValueError) as e:
            raise KunServeConfigError(
                f"kunserve.lookahead.cost_model={obj.cost_model!r}: not a readable cost model JSON ({e})") from None
    if isinstance(obj, MemoryConfig) and 0.0 < obj.max_kv_ratio < 1.0:
        raise KunServeConfigError(
            f"kunserve.memory.max_kv_ratio={obj.max_kv_ratio!r}: must be 0 (auto) or >= 1 (KV never shrinks "
            "below its base)")
    if isinstance(obj, RemapConfig) and obj.low_watermark >= obj.high_watermark:
        raise KunServeConfigError(
            f"kunserve.remap.low_watermark={obj.low_watermark!r}: must be below "
            f"remap.high_watermark={obj.high_watermark!r} (hysteresis)")


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def parse_config(raw: Any) -> KunServeConfig:
    """Parse and validate the value of ``additional_config["kunserve"]``.

    Accepts a mapping or a JSON string (``None`` means all defaults). Raises
    :class:`KunServeConfigError` naming the offending key, its value and what is allowed.
    """
    if raw is None:
        raw = {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise KunServeConfigError(f"kunserve: not valid JSON ({e})") from None
    if not isinstance(raw, Mapping):
        raise KunServeConfigError(
            f"kunserve={raw!r}: expected an object with sections {', '.join(_SECTIONS)}")
    for key in raw:
        if key not in _SECTIONS:
            raise KunServeConfigError(
                f"kunserve.{key}: unknown key (value {raw[key]!r}); allowed sections: {', '.join(_SECTIONS)}")
    return KunServeConfig(**{name: _parse_section(name, cls, raw.get(name)) for name, cls in _SECTIONS.items()})


def parse_elastic(raw: Any) -> ElasticConfig:
    """Parse and validate ``kunserve serve --elastic`` (a mapping or a JSON string; ``None``: defaults),
    refusing what :func:`parse_config` refuses, each key named as ``kunserve.elastic.KEY``."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError as e:
            raise KunServeConfigError(f"kunserve.elastic: not valid JSON ({e})") from None
    return _parse_section("elastic", ElasticConfig, raw)


def parse_tenancy(raw: Any) -> TenancyConfig:
    """Parse a fleet file's ``tenancy`` object (a mapping; ``None``: defaults), each key named as
    ``kunserve.tenancy.KEY``."""
    return _parse_section("tenancy", TenancyConfig, raw)


def parse_kunserve_config(text: str | None) -> dict[str, Any]:
    """A ``--kunserve-config`` value (``kunserve compare``, ``kunserve serve``): inline JSON or a path
    to a JSON file, with or without the outer ``{"kunserve": ...}``; validated, returned as a dict."""
    if not text:
        return {}
    src = "--kunserve-config"
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"--kunserve-config: not JSON and no such file: {text}")
        text, src = path.read_text(), str(path)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{src}: not valid JSON ({e})") from None
    if isinstance(raw, dict) and CONFIG_KEY in raw and len(raw) == 1:
        raw = raw[CONFIG_KEY]  # accept {"kunserve": {...}} as well as the inner object
    parse_config(raw)
    return raw


def config_from_additional(additional_config: Any) -> KunServeConfig | None:
    """Return the parsed config if ``additional_config`` enables kunserve, else ``None`` (plugin inert)."""
    if not additional_config:
        return None
    if isinstance(additional_config, str):
        try:
            additional_config = json.loads(additional_config)
        except json.JSONDecodeError:
            return None
    if not isinstance(additional_config, Mapping) or CONFIG_KEY not in additional_config:
        return None
    return parse_config(additional_config[CONFIG_KEY])


def engine_config(vllm_config: Any) -> KunServeConfig | None:
    """The kunserve configuration of the engine ``vllm_config`` belongs to (None: not enabled)."""
    return config_from_additional(getattr(vllm_config, "additional_config", None))


def render_docs() -> str:
    """Markdown reference of every key, generated from the dataclass metadata."""
    lines = [
        "# kunserve configuration reference",
        "",
        "Generated by `kunserve config-docs` from `vllm_kunserve/config.py`; do not edit by hand.",
        "",
        "All options live under the `kunserve` key of vLLM's `additional_config`:",
        "",
        "```bash",
        "vllm serve MODEL --additional-config '{\"kunserve\": {\"remap\": {\"enable\": true, \"slots\": 2}}}'",
        "```",
        "",
        "```python",
        "LLM(model, additional_config={\"kunserve\": {\"drop\": {\"trigger_ratio\": 0.9}}})",
        "```",
        "",
        "An empty object (`{\"kunserve\": {}}`) enables the plugin with every default. Without the `kunserve`",
        "key the plugin is inert: no patch is applied and vLLM behaves as stock. Unknown keys, wrong types",
        "and out-of-range values stop the engine at startup with a message naming the key, the value and",
        "what is allowed.",
        "",
    ]
    hints_cache: dict[type, dict] = {}
    for name, cls in {**_SECTIONS, "elastic": ElasticConfig, "tenancy": TenancyConfig}.items():
        hints = hints_cache.setdefault(cls, typing.get_type_hints(cls))
        lines += [f"## `{name}`", "", (cls.__doc__ or "").strip(), "",
                  "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            m = f.metadata
            if m.get("choices"):
                allowed = ", ".join(f"`{c}`" for c in m["choices"])
            elif m.get("lo") is not None:
                allowed = f"{'>' if m.get('lo_open') else '>='} {m['lo']}, <= {m['hi']}"
            elif hints[f.name] is bool:
                allowed = "`true`, `false`"
            else:
                allowed = "any string"
            tp = hints[f.name].__name__
            lines.append(f"| `{name}.{f.name}` | {tp} | `{json.dumps(f.default)}` | {allowed} | {m['doc']} |")
        lines.append("")
    return "\n".join(lines)
