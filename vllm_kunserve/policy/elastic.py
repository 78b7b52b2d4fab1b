"""An elastic fleet (MELL's other half): when to start an engine, when to drain one, which, and the
bounded migrations a drain makes. Pure: the front end (``cluster.control.elastic``) and the
simulator (``sim.policies.elastic``) call the same functions.

Each monitor period the caller gives :func:`decide_scale` an :class:`ElasticView`: every engine's
:class:`~vllm_kunserve.policy.dispatch.InstanceLoad` (``alive``: accepts new work), the engines
starting and draining, and ``reachable_blocks``, what the engines accepting work can hold after every
drop they may still make (``policy.admission.reachable_blocks``; a stock fleet: its KV now). Demand is
the KV the engines hold and their queues need (used + queued blocks, draining engines included: their
requests still need somewhere to finish) plus :func:`~vllm_kunserve.policy.overload.forecast_blocks`
over the demand history (only a rising trend counts, projected ``forecast_horizon_s`` ahead: an engine
takes that long to start).

* **Up**: ``(demand + forecast) / (per-engine reach x (running + starting))`` above ``up_ratio`` for
  ``up_hold_s``, below ``max_instances``: start as many engines as bring it to ``up_ratio``
  (at least one). An engine starting counts as capacity on its way, so a rise is not answered twice.
* **Down**: nothing starting or draining, above ``min_instances``, ``cooldown_s`` since the last
  change, and ``(demand + forecast) / (per-engine reach x (running - 1))`` at or below ``down_ratio``
  with no request queued anywhere, throughout ``down_hold_s`` (a queue means compute binds where KV
  does not: draining then, the simulator's fleet went 3 to 2 to 4 engines within 10 s at its peak): drain :func:`drain_target`, the engine with the least KV demand (the fewest
  blocks to move or wait for), never a member of a pipeline group; ties: fewer requests, the
  higher index (the last started leaves first).
* A draining engine takes no new requests; :func:`drain_moves` moves up to the drain's migration
  budget off it per period (MELL's make-room order and budgets, ``policy.migration.plan_migrations``),
  the rest finish in place; the caller stops it once it holds nothing.

Per-engine reach is ``reachable_blocks / running``: the engines are replicas of one model, so each
brings an equal share of what the fleet can reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from vllm_kunserve.config import ElasticConfig, PlacementConfig
from vllm_kunserve.policy.costmodel import CostModel
from vllm_kunserve.policy.dispatch.base import InstanceLoad
from vllm_kunserve.policy.migration import MigrationOrder, RequestLoad, plan_migrations
from vllm_kunserve.policy.monitor import record_demand
from vllm_kunserve.policy.overload import forecast_blocks

HISTORY_S = 30.0   # demand samples kept for the forecast's trend


@dataclass(frozen=True)
class ElasticView:
    t: float
    units: tuple[InstanceLoad, ...]   # every engine started (ready or draining); alive: accepts new work
    starting: int                     # engines being started
    draining: tuple[int, ...]         # engines draining (in ``units`` with alive False)
    reachable_blocks: float           # what the alive engines hold after every drop still possible
    min_instances: int
    max_instances: int


@dataclass(frozen=True)
class ElasticState:
    history: tuple[tuple[float, float], ...] = ()
    above_since: float | None = None
    below_since: float | None = None
    last_change_s: float = -math.inf


@dataclass(frozen=True)
class ScaleDecision:
    action: str                 # "none" | "add" | "drain"
    count: int = 0              # engines to start ("add")
    instance: int | None = None  # the engine to drain ("drain")
    demand_blocks: float = 0.0  # used + queued + forecast
    ratio_up: float = 0.0       # demand / what running + starting engines reach
    ratio_down: float = math.inf  # demand / what one engine fewer reaches
    reason: str = ""

    def to_dict(self) -> dict:
        return {"action": self.action, "count": self.count, "instance": self.instance,
                "demand_blocks": round(self.demand_blocks, 1), "ratio_up": round(self.ratio_up, 3),
                "ratio_down": round(self.ratio_down, 3) if math.isfinite(self.ratio_down) else None,
                "reason": self.reason}


def drain_target(units: Sequence[InstanceLoad]) -> int | None:
    """The engine to drain: alive, in no pipeline group, holding the least KV demand; ties fewer
    requests, then the higher index. None when every alive engine is grouped."""
    cands = [u for u in units if u.alive and u.group is None]
    if not cands:
        return None
    return min(cands, key=lambda u: (u.demand_blocks, u.requests, -u.instance_id)).instance_id


def decide_scale(view: ElasticView, cfg: ElasticConfig, state: ElasticState = ElasticState()
                 ) -> tuple[ScaleDecision, ElasticState]:
    """One period's scaling decision (see the module's text) and the state to pass next time."""
    if not 1 <= view.min_instances <= view.max_instances:
        raise ValueError(f"min_instances={view.min_instances}, max_instances={view.max_instances}: "
                         "need 1 <= min <= max")
    if not math.isfinite(view.reachable_blocks):   # no engine has reported its KV yet: nothing to scale by
        return ScaleDecision("none", reason="no KV reported yet"), state
    serving = [u for u in view.units if u.alive or u.instance_id in view.draining]   # their requests need room
    demand_now = float(sum(u.demand_blocks for u in serving))
    history = record_demand(state.history, view.t, demand_now, HISTORY_S)
    demand = demand_now + forecast_blocks(history, cfg.forecast_horizon_s)
    running = sum(1 for u in view.units if u.alive)
    per = view.reachable_blocks / running if running else 0.0
    total = running + view.starting
    ratio_up = demand / (per * total) if per > 0 and total else (math.inf if demand > 0 else 0.0)
    ratio_down = demand / (per * (running - 1)) if per > 0 and running > 1 else math.inf
    above = ratio_up > cfg.up_ratio
    # a queue says compute, not KV, binds (or a drain's requests just moved): no engine leaves while one waits
    below = ratio_down <= cfg.down_ratio and not any(u.queued_blocks for u in serving)
    st = replace(state, history=history,
                 above_since=(state.above_since if state.above_since is not None else view.t) if above else None,
                 below_since=(state.below_since if state.below_since is not None else view.t) if below else None)

    def out(action: str = "none", reason: str = "", **kw) -> ScaleDecision:
        return ScaleDecision(action, demand_blocks=demand, ratio_up=ratio_up, ratio_down=ratio_down,
                             reason=reason, **kw)

    if above and total < view.max_instances and view.t - st.above_since >= cfg.up_hold_s and per > 0:
        want = math.ceil(demand / (cfg.up_ratio * per) - 1e-9) - total
        n = max(1, min(want, view.max_instances - total))
        return out("add", f"demand {ratio_up:.2f}x of what {total} engine(s) reach for "
                   f"{view.t - st.above_since:.0f} s", count=n), replace(st, above_since=None, last_change_s=view.t)
    if total < view.min_instances:   # an engine lost (dead, parked) below the floor
        return out("add", f"{total} engine(s), fewer than the minimum {view.min_instances}",
                   count=view.min_instances - total), replace(st, last_change_s=view.t)
    if (below and not view.starting and not view.draining and running > view.min_instances
            and view.t - st.below_since >= cfg.down_hold_s and view.t - state.last_change_s >= cfg.cooldown_s):
        target = drain_target(view.units)
        if target is not None:
            return out("drain", f"demand {ratio_down:.2f}x of what {running - 1} engine(s) reach for "
                       f"{view.t - st.below_since:.0f} s", instance=target), \
                replace(st, below_since=None, last_change_s=view.t)
    return out(), st


def drain_moves(units: Sequence[InstanceLoad], requests: Sequence[RequestLoad], draining: int, budget: int,
                placement: PlacementConfig = PlacementConfig(), *, kv_bytes_per_block: int,
                link_bytes_per_s: float, cost_model: CostModel | None = None) -> tuple[MigrationOrder, ...]:
    """Up to ``budget`` (and ``placement``'s per-period budgets) moves off the ``draining`` engine onto
    engines that accept work and stay under the placement watermark with them: MELL's
    :func:`~vllm_kunserve.policy.migration.plan_migrations` with the draining engine's capacity taken
    to nothing, so all its demand is excess. Requests about to finish never move (nothing left)."""
    if budget <= 0:
        return ()
    units2 = [replace(u, alive=True, capacity_blocks=1) if u.instance_id == draining
              else u for u in units if u.alive or u.instance_id == draining]
    cfg = replace(placement, max_migrations=min(budget, placement.max_migrations))
    orders = plan_migrations(units2, [r for r in requests if r.instance_id == draining], cfg,
                             kv_bytes_per_block=kv_bytes_per_block, link_bytes_per_s=link_bytes_per_s,
                             cost_model=cost_model)
    return tuple(o for o in orders if o.src == draining)


__all__ = ["ElasticState", "ElasticView", "ScaleDecision", "decide_scale", "drain_moves", "drain_target"]
