"""KV-centric baselines: vLLM (recompute), tuned vLLM (a batch cap), InferCept-like swap,
Llumnix-like migration, the oracle and the equal-KV oracle."""

from __future__ import annotations

import dataclasses

from .base import DEFAULT_DISPATCH, Policy


def droppable_weight_bytes(cfg) -> int:
    """Weight bytes a drop frees on an instance: its decoder layers (``ModelArch.layer_bytes`` x
    layers; the embedding and LM head stay on every member, as ``Simulator.capacity_blocks``
    counts a group's capacity)."""
    return cfg.model.layers * cfg.model.layer_bytes


def weight_share(cfg) -> float:
    """w = droppable weights / (droppable weights + KV) of one instance of ``cfg`` (a ``SimConfig``)."""
    weights = droppable_weight_bytes(cfg)
    kv = cfg.base_kv_blocks() * cfg.block_bytes
    return weights / (weights + kv)


def group_kv_factor(w: float, members: int = 2) -> float:
    """KV of a group of ``members`` instances keeping one copy of the weights, over theirs apart
    (per member): each member's KV grows by (members - 1) / members of a copy of the weights,
    ``1 + (members - 1) w / (members (1 - w))``; for ``members = 2``, ``1 + w / (2 (1 - w))``."""
    if not 0 <= w < 1:
        raise ValueError(f"weight share {w}: must be in [0, 1)")
    if members < 1:
        raise ValueError(f"group of {members}: must be >= 1")
    return 1 + (members - 1) * w / (members * (1 - w))


class VllmPolicy(Policy):
    """Stock vLLM: preempt the newest running request and recompute it later."""

    name = "vllm"


class VllmTunedPolicy(VllmPolicy):
    """Stock vLLM with a batch cap: ``max_num_seqs`` = ``max_seqs`` per instance (what a user tunes;
    ``sim.tuning.pick_vllm_cap`` picks it on a trace). Its KV follows vLLM's profile-and-fill rule
    with that cap (``SimConfig.activation_reserve_bytes`` reserves the sampler's logits for
    ``max_num_seqs`` requests, so a smaller cap leaves slightly more KV)."""

    name = "vllm-tuned"

    def __init__(self, max_seqs: int, dispatch: str = DEFAULT_DISPATCH):
        super().__init__(dispatch)
        if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"vllm-tuned max_seqs={max_seqs!r}: must be an integer >= 1")
        self.max_seqs = max_seqs

    def kv_blocks(self, cfg) -> int:
        return dataclasses.replace(cfg, max_seqs=self.max_seqs).base_kv_blocks()

    def describe(self) -> dict:
        return {**super().describe(), "max_seqs": self.max_seqs}


class OracleEqualPolicy(VllmPolicy):
    """Stock vLLM (recompute preemption, no pipeline) with the KV a KunServe group of ``group``
    instances reaches: ``group_kv_factor(w, group)`` x the base KV blocks per instance, w the
    droppable weight share of ``SimConfig`` (:func:`weight_share`); ``factor`` sets the multiplier
    directly instead. The bound for what the memory dropping frees can buy without its costs."""

    name = "oracle-equal"

    def __init__(self, dispatch: str = DEFAULT_DISPATCH, group: int = 2, factor: float | None = None):
        super().__init__(dispatch)
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"oracle-equal group={group!r}: must be an integer >= 1")
        if factor is not None and not factor >= 1:
            raise ValueError(f"oracle-equal factor={factor!r}: must be >= 1")
        self.group = group
        self.factor = factor

    def kv_factor(self, cfg) -> float:
        return self.factor if self.factor is not None else group_kv_factor(weight_share(cfg), self.group)

    def kv_blocks(self, cfg) -> int:
        return int(self.kv_factor(cfg) * cfg.base_kv_blocks())

    def describe(self) -> dict:
        return {**super().describe(), "group": self.group, "factor": self.factor}


class OraclePolicy(Policy):
    """Infinite KV memory: never preempts, never queues for memory (the TTFT bound)."""

    name = "oracle"
    infinite_memory = True


class InferceptPolicy(Policy):
    """InferCept-like: preempted requests' KV is swapped to host memory over PCIe and swapped back
    in instead of being recomputed (the copy time stalls the step that does it)."""

    name = "infercept"
    preempt_mode = "swap"


class LlumnixPolicy(Policy):
    """Llumnix-like load balancing: load-aware dispatch plus periodic live migration of the newest
    running requests from the instance with the highest KV demand to the one with the most free
    blocks (KV copied over the instance link, overlapped with decoding; the request pauses for the
    final copy only)."""

    name = "llumnix"

    def __init__(self, dispatch: str = DEFAULT_DISPATCH, tick_s: float = 0.1, gap: float = 0.1,
                 max_per_tick: int = 4, downtime_share: float = 0.1):
        super().__init__(dispatch)
        self.tick_s = tick_s
        self.gap = gap
        self.max_per_tick = max_per_tick
        self.downtime_share = downtime_share

    def on_tick(self, sim) -> None:
        live = [s for s in sim.servers if s.alive and not s.frozen]
        if len(live) < 2:
            return
        for _ in range(self.max_per_tick):
            src = max(live, key=lambda s: s.load())
            dst = min(live, key=lambda s: s.load())
            if src.load() - dst.load() < self.gap:
                return
            cand = [r for r in reversed(src.running) if not any(r is x for x, _ in src.inflight)]
            movable = [r for r in cand if r.blocks + 1 <= dst.free]
            if src.waiting and (not movable or src.load() > 1.0):
                # queued requests hold no KV: re-dispatch the newest one for free
                r = src.waiting.pop()
                r.server = dst
                dst.waiting.append(r)
                sim.kick(dst)
                continue
            if not movable:
                return
            r = movable[0]
            src.running.remove(r)
            src.used -= r.blocks
            dst.used += r.blocks
            dst.running.append(r)
            r.server = dst
            r.migrations += 1
            copy = sim.server_bulk_time(src, r.blocks * sim.cfg.block_bytes)
            dst.pending_io += copy * self.downtime_share
            sim.log("migrate", req=r.id, src=src.sid, dst=dst.sid, blocks=r.blocks, copy_s=round(copy, 6))
            sim.kick(src)
            sim.kick(dst)
