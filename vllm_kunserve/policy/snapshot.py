"""Immutable snapshots the policies decide over.

Mechanisms (engines, the monitor, the simulator) build these from their live state; policies never
see live objects. Units: KV is counted in *full-model blocks* (``ModelSpec.block_bytes`` = bytes of
one KV block across every decoder layer), so the KV of a pipeline group is simply the sum of its
instances' blocks. Weights are counted in bytes per decoder layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_kunserve.policy._schema import check_unknown, get, need_list, need_mapping


@dataclass(frozen=True)
class ModelSpec:
    """Memory shape of the served model (identical on every instance of a cluster)."""

    num_layers: int
    layer_bytes: int  # weight bytes of one decoder layer
    block_bytes: int  # bytes of one KV block over all layers (block_size tokens)
    block_size: int = 16  # tokens per KV block

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.layer_bytes < 1 or self.block_bytes < 1 or self.block_size < 1:
            raise ValueError(f"ModelSpec: all fields must be >= 1, got {self}")

    @property
    def weight_bytes(self) -> int:
        """Bytes of one full copy of the decoder layers (what one merge frees)."""
        return self.num_layers * self.layer_bytes

    @classmethod
    def from_dict(cls, d: Any, where: str = "model") -> "ModelSpec":
        d = need_mapping(d, where)
        check_unknown(d, {"num_layers", "layer_bytes", "block_bytes", "block_size"}, where)
        return cls(num_layers=get(d, "num_layers", int, where, lo=1),
                   layer_bytes=get(d, "layer_bytes", int, where, lo=1),
                   block_bytes=get(d, "block_bytes", int, where, lo=1),
                   block_size=get(d, "block_size", int, where, 16, lo=1))


@dataclass(frozen=True)
class RequestSnapshot:
    """One request as the scheduler sees it."""

    request_id: str
    prompt_tokens: int
    computed_tokens: int = 0  # prompt tokens whose KV already exists
    generated_tokens: int = 0
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"request {self.request_id}: prompt_tokens must be >= 1")
        if not 0 <= self.computed_tokens <= self.prompt_tokens:
            raise ValueError(f"request {self.request_id}: computed_tokens must be in [0, prompt_tokens]")
        if self.generated_tokens < 0:
            raise ValueError(f"request {self.request_id}: generated_tokens must be >= 0")

    @property
    def is_prefill(self) -> bool:
        return self.computed_tokens < self.prompt_tokens

    @property
    def kv_tokens(self) -> int:
        return self.computed_tokens + self.generated_tokens

    def blocks(self, block_size: int) -> int:
        return -(-self.kv_tokens // block_size)

    @classmethod
    def from_dict(cls, d: Any, where: str = "request") -> "RequestSnapshot":
        d = need_mapping(d, where)
        check_unknown(d, {"request_id", "prompt_tokens", "computed_tokens", "generated_tokens",
                          "arrival_s"}, where)
        return cls(request_id=str(get(d, "request_id", (str, int), where)),
                   prompt_tokens=get(d, "prompt_tokens", int, where, lo=1),
                   computed_tokens=get(d, "computed_tokens", int, where, 0, lo=0),
                   generated_tokens=get(d, "generated_tokens", int, where, 0, lo=0),
                   arrival_s=get(d, "arrival_s", float, where, 0.0))


@dataclass(frozen=True)
class InstanceSnapshot:
    """One serving instance. ``layer_end=0`` means it holds every layer (not dropped)."""

    instance_id: int
    kv_blocks_total: int  # current KV capacity in full-model blocks
    kv_blocks_used: int
    queued_blocks: int = 0  # blocks the head-of-line queued requests need to start
    layer_start: int = 0
    layer_end: int = 0  # exclusive; 0 = num_layers
    healthy: bool = True
    kv_blocks_base: int = 0  # capacity holding every layer, where the engine knows it (0: derive it)
    # the request mix: the requests in the engine (waiting and running), whole lives, not what is left
    prompt_tokens: int = 0   # their prompt lengths
    output_tokens: int = 0   # their output budgets (max_tokens)
    kv_blocks_max: int = 0   # the most blocks its KV cache can reach (memory.max_kv_ratio x base; 0: unknown)
    host: str = ""           # the machine it runs on: a pipeline group's stage link is one host's ("": unknown)
    awaiting_first_token: int = 0  # requests in it that have not had their first token yet

    def __post_init__(self) -> None:
        if (self.kv_blocks_total < 0 or self.kv_blocks_used < 0 or self.queued_blocks < 0 or self.kv_blocks_base < 0
                or self.kv_blocks_max < 0):
            raise ValueError(f"instance {self.instance_id}: block counts must be >= 0")
        if self.prompt_tokens < 0 or self.output_tokens < 0 or self.awaiting_first_token < 0:
            raise ValueError(f"instance {self.instance_id}: request-mix token counts must be >= 0")

    def held_layers(self, num_layers: int) -> int:
        end = self.layer_end or num_layers
        return end - self.layer_start

    def base_kv_blocks(self, model: ModelSpec) -> float:
        """Capacity this instance would have holding every layer (weights restored): the engine's
        own figure where it reports one, else today's capacity less the dropped layers' bytes (which
        undercounts, even below zero, where growth was capped below what the dropped bytes free)."""
        if self.kv_blocks_base:
            return float(self.kv_blocks_base)
        dropped = model.num_layers - self.held_layers(model.num_layers)
        return self.kv_blocks_total - dropped * model.layer_bytes / model.block_bytes

    @classmethod
    def from_dict(cls, d: Any, where: str = "instance") -> "InstanceSnapshot":
        d = need_mapping(d, where)
        check_unknown(d, {"instance_id", "kv_blocks_total", "kv_blocks_used", "queued_blocks",
                          "layer_start", "layer_end", "healthy", "kv_blocks_base", "prompt_tokens",
                          "output_tokens", "kv_blocks_max"}, where)
        return cls(instance_id=get(d, "instance_id", int, where),
                   kv_blocks_total=get(d, "kv_blocks_total", int, where, lo=0),
                   kv_blocks_used=get(d, "kv_blocks_used", int, where, lo=0),
                   queued_blocks=get(d, "queued_blocks", int, where, 0, lo=0),
                   layer_start=get(d, "layer_start", int, where, 0, lo=0),
                   layer_end=get(d, "layer_end", int, where, 0, lo=0),
                   healthy=get(d, "healthy", bool, where, True),
                   kv_blocks_base=get(d, "kv_blocks_base", int, where, 0, lo=0),
                   prompt_tokens=get(d, "prompt_tokens", int, where, 0, lo=0),
                   output_tokens=get(d, "output_tokens", int, where, 0, lo=0),
                   kv_blocks_max=get(d, "kv_blocks_max", int, where, 0, lo=0))


@dataclass(frozen=True)
class ClusterSnapshot:
    """The cluster at one instant: instances, current pipeline groups, recent demand samples."""

    model: ModelSpec
    instances: tuple[InstanceSnapshot, ...]
    groups: tuple[tuple[int, ...], ...] = ()  # empty = every instance alone
    now_s: float = 0.0
    demand_history: tuple[tuple[float, float], ...] = ()  # (time_s, cluster demand blocks)
    #: earlier readings of the request mix, (time_s, output tokens, prompt tokens), healthy instances
    #: summed; the current reading is the instances' own (not repeated here)
    work_history: tuple[tuple[float, int, int], ...] = ()

    def __post_init__(self) -> None:
        ids = [i.instance_id for i in self.instances]
        if len(set(ids)) != len(ids):
            raise ValueError("instances: duplicate instance_id")
        if not self.groups:
            object.__setattr__(self, "groups", tuple((i,) for i in ids))
        seen = [i for g in self.groups for i in g]
        if sorted(seen) != sorted(ids):
            raise ValueError("groups: every instance_id must appear in exactly one group")
        for g in self.groups:
            if not g:
                raise ValueError("groups: empty group")

    def by_id(self) -> dict[int, InstanceSnapshot]:
        return {i.instance_id: i for i in self.instances}

    def base_capacity_blocks(self) -> float:
        """KV capacity with every weight restored (the undropped cluster)."""
        return sum(i.base_kv_blocks(self.model) for i in self.instances)

    @classmethod
    def from_dict(cls, d: Any, where: str = "cluster") -> "ClusterSnapshot":
        d = need_mapping(d, where)
        check_unknown(d, {"model", "instances", "groups", "now_s", "demand_history", "work_history"}, where)
        model = ModelSpec.from_dict(get(d, "model", dict, where), f"{where}.model")
        insts = tuple(InstanceSnapshot.from_dict(x, f"{where}.instances[{k}]")
                      for k, x in enumerate(need_list(get(d, "instances", list, where), f"{where}.instances")))
        groups = tuple(tuple(int(i) for i in need_list(g, f"{where}.groups[{k}]"))
                       for k, g in enumerate(get(d, "groups", list, where, [])))
        hist = []
        for k, s in enumerate(get(d, "demand_history", list, where, [])):
            s = need_list(s, f"{where}.demand_history[{k}]")
            if len(s) != 2:
                raise ValueError(f"{where}.demand_history[{k}]: expected [time_s, demand_blocks]")
            hist.append((float(s[0]), float(s[1])))
        work = []
        for k, s in enumerate(get(d, "work_history", list, where, [])):
            s = need_list(s, f"{where}.work_history[{k}]")
            if len(s) != 3 or int(s[1]) < 0 or int(s[2]) < 0:
                raise ValueError(f"{where}.work_history[{k}]: expected [time_s, output_tokens, prompt_tokens] (>= 0)")
            work.append((float(s[0]), int(s[1]), int(s[2])))
        return cls(model=model, instances=insts, groups=groups, now_s=get(d, "now_s", float, where, 0.0),
                   demand_history=tuple(hist), work_history=tuple(work))

    def work_now(self) -> tuple[float, int, int]:
        """This reading of the request mix: (now_s, output tokens, prompt tokens), healthy instances."""
        live = [i for i in self.instances if i.healthy]
        return (self.now_s, sum(i.output_tokens for i in live), sum(i.prompt_tokens for i in live))


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b - 1e-12))


__all__ = ["ModelSpec", "RequestSnapshot", "InstanceSnapshot", "ClusterSnapshot"]
