"""Memory between the models of one host (a multi-model fleet: Oneiros's multi-tenant remap).

The engines of one host share the memory they started with (each engine's *home*: its weights and
base KV). A model with no request in flight and none for ``tenancy.idle_s`` is *inactive*: each of its
engines *lends*, streaming layers from the host copy and giving their memory back, down to the
threshold at which its next prefill streams the rest in time (``policy.remap.lend_plan``, with the
prefill time: the longer compute an inactive model meets next). Active engines whose KV demand
passes ``borrow_ratio`` of their blocks *borrow* what is free on the host. A request for a lender
makes its model active again: it is served at once, its streamed layers copied in during its
prefill, and its engines *reclaim* (reload every layer) as soon as the host has the memory; where it
does not, borrowers *repay*, each drained of the blocks above its new size as their requests finish
(none is lost or recomputed). A borrower whose demand stays under ``repay_ratio`` of its base for
``repay_hold_s`` repays too. A host over its budget (a lender that restarted at home while its
memory was borrowed) takes memory back the same way.

An inactive model's engine that still holds borrowed blocks repays them first, then lends.

Order (Oneiros): inactive models lend first, the lowest priority first (``policy.remap``'s order);
memory goes back to a model coming back before any further borrow on its host; borrowers repay
largest first. One move per engine per decision; the caller waits for each before the next call, and
a host with a move in flight (or an engine's report older than its last move) waits for the next.

Pure: the front end's tenancy controller (``cluster.control.tenancy``) and any replay call
:func:`decide_tenancy` over a :class:`TenancyView`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from vllm_kunserve.config import RemapConfig, TenancyConfig
from vllm_kunserve.policy.remap import ModelLayers, give_order, lend_plan

OPS = ("lend", "reclaim", "borrow", "repay")


@dataclass(frozen=True)
class TenantEngine:
    """One engine of a multi-model fleet as its last report showed it."""

    key: str                 # the fleet's name for it ("model#index")
    model: str
    host: str
    ready: bool              # reports and takes operations (else it holds nothing: dead, restarting)
    phase: str               # the engine agent's (base | remapped | draining | ...)
    demand_blocks: int
    capacity_blocks: int
    base_blocks: int
    max_blocks: int
    block_bytes: int         # memory of one KV block on this engine (every worker)
    held_bytes: int          # memory its pools hold now
    home_bytes: int          # what it holds at its base (lent nothing, borrowed nothing)
    round_bytes: int = 0     # a borrow's rounding: whole chunks per KV region
    lent_layers: int = 0
    borrowed_blocks: int = 0
    repaying: bool = False
    busy: bool = False       # a move of the controller's is in flight on it


@dataclass(frozen=True)
class TenantModel:
    name: str
    layers: ModelLayers      # its layer sizes and per-layer compute; priority; last_active_s
    inflight: int = 0
    idle_s: float = 0.0      # seconds since its last request


@dataclass(frozen=True)
class TenancyView:
    models: tuple[TenantModel, ...]
    engines: tuple[TenantEngine, ...]
    h2d_bytes_per_s: float
    copy_overlap: bool = True
    now_s: float = 0.0


@dataclass(frozen=True)
class Move:
    op: str                  # one of OPS
    engine: str              # TenantEngine.key
    params: Mapping[str, object]
    reason: str


@dataclass(frozen=True)
class TenancyState:
    low_since: Mapping[str, float] = field(default_factory=dict)   # borrower -> when its demand went low


def is_active(m: TenantModel, cfg: TenancyConfig) -> bool:
    return m.inflight > 0 or m.idle_s < cfg.idle_s


def host_free_bytes(engines: tuple[TenantEngine, ...] | list[TenantEngine]) -> int:
    """What a host's engines do not hold of what they started with; an engine that is not ready
    keeps its home (it comes back with it)."""
    return sum(e.home_bytes - e.held_bytes for e in engines if e.ready)


def decide_tenancy(view: TenancyView, cfg: TenancyConfig = TenancyConfig(), remap: RemapConfig = RemapConfig(),
                   state: TenancyState = TenancyState()) -> tuple[tuple[Move, ...], TenancyState]:
    """The moves to make now on every host, and the state for the next call."""
    models = {m.name: m for m in view.models}
    active = {n for n, m in models.items() if is_active(m, cfg)}
    order = {m.name: k for k, m in enumerate(give_order(
        [replace(m.layers, name=m.name, active=m.name in active) for m in view.models]))}
    hosts: dict[str, list[TenantEngine]] = {}
    for e in view.engines:
        hosts.setdefault(e.host, []).append(e)
    moves: list[Move] = []
    low = dict(state.low_since)
    for host in sorted(hosts):
        engines = hosts[host]
        if any(e.busy for e in engines):
            continue   # a move in flight, or a report older than the last move: what the host holds is unknown
        free = host_free_bytes(engines)
        ready = [e for e in engines if e.ready and not e.busy and e.model in models]
        # 1. a model coming back takes its memory back first; a host over its budget does too
        back = sorted((e for e in ready if e.lent_layers and e.model in active), key=lambda e: order[e.model])
        owed = max(0, -free)
        for e in back:
            need = e.home_bytes - e.held_bytes
            if need <= free:
                moves.append(Move("reclaim", e.key, {}, f"{e.model} is active again"))
                free -= need
            else:
                owed += need - max(0, free)
                free = min(free, 0)
        if owed > 0:
            repaying = sum(e.borrowed_blocks * e.block_bytes for e in engines if e.repaying)
            owed -= repaying
            for e in sorted((e for e in ready if e.borrowed_blocks and not e.repaying and e.phase == "base"),
                            key=lambda e: -e.borrowed_blocks * e.block_bytes):
                if owed <= 0:
                    break
                give = min(e.borrowed_blocks, math.ceil(owed / e.block_bytes))
                moves.append(Move("repay", e.key, {"blocks": e.capacity_blocks - give},
                                  "memory back to a returning model" if back else "the host is over its budget"))
                owed -= give * e.block_bytes
                low.pop(e.key, None)
        # 2. inactive models lend, the lowest priority first, each down to its threshold
        for e in sorted(ready, key=lambda e: (order[e.model], e.key)):
            if e.model in active or e.lent_layers or e.phase != "base":
                continue
            m = models[e.model]
            if e.borrowed_blocks:   # an idle model holds no borrowed memory: it goes back first, then it lends
                if not e.repaying and all(mv.engine != e.key for mv in moves):
                    moves.append(Move("repay", e.key, {"blocks": e.base_blocks}, f"{e.model} idle {m.idle_s:.0f} s"))
                    low.pop(e.key, None)
                continue
            plan = lend_plan(replace(m.layers, active=False), view.h2d_bytes_per_s, remap, view.copy_overlap)
            if plan is not None:
                moves.append(Move("lend", e.key, {"layers": list(plan.layers), "slots": plan.slots},
                                  f"{e.model} idle {m.idle_s:.0f} s"))
        # 3. active engines short of KV borrow what is free (none while a returning model waits)
        if not back and owed <= 0:
            for e in sorted(ready, key=lambda e: (order[e.model], e.key), reverse=True):
                if e.model not in active or e.lent_layers or e.repaying or e.phase != "base":
                    continue
                if e.demand_blocks <= cfg.borrow_ratio * e.capacity_blocks or e.capacity_blocks >= e.max_blocks:
                    continue
                want = math.ceil(e.demand_blocks * (1 + cfg.headroom) / cfg.borrow_ratio) - e.capacity_blocks
                can = (free - e.round_bytes) // e.block_bytes if e.block_bytes else 0
                blocks = min(want, e.max_blocks - e.capacity_blocks, can)
                if blocks > 0:
                    moves.append(Move("borrow", e.key, {"blocks": e.capacity_blocks + blocks},
                                      f"demand {e.demand_blocks} of {e.capacity_blocks} blocks"))
                    free -= blocks * e.block_bytes + e.round_bytes
                    low.pop(e.key, None)
        # 4. a borrower whose demand stayed low repays
        taken = {mv.engine for mv in moves}
        for e in ready:
            if not e.borrowed_blocks or e.repaying or e.key in taken or e.phase != "base":
                low.pop(e.key, None)
                continue
            if e.demand_blocks < cfg.repay_ratio * e.base_blocks:
                since = low.setdefault(e.key, view.now_s)
                if view.now_s - since >= cfg.repay_hold_s:
                    moves.append(Move("repay", e.key, {"blocks": e.base_blocks},
                                      f"demand {e.demand_blocks} under {cfg.repay_ratio:g} of its base"))
                    low.pop(e.key, None)
            else:
                low.pop(e.key, None)
    keys = {e.key for e in view.engines}
    return tuple(moves), TenancyState({k: v for k, v in low.items() if k in keys})


__all__ = ["Move", "OPS", "TenancyState", "TenancyView", "TenantEngine", "TenantModel", "decide_tenancy",
           "host_free_bytes", "is_active"]
