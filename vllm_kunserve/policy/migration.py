"""MELL's bounded migrations on a fixed cluster: which running requests move where, and how.

The front end (``kunserve serve --dispatch mell``) and the simulator call :func:`plan_migrations`
once per monitor period with every unit's :class:`~vllm_kunserve.policy.dispatch.InstanceLoad` and
one :class:`RequestLoad` per request it is able to move (running, with its KV on ``instance_id``).
It returns a tuple of :class:`MigrationOrder`; empty when nothing needs moving. Pure and
deterministic: the same inputs give the same orders.

What it does (see ``policy.dispatch.mell`` for why this is MELL on a fixed cluster):

1. Sources: live units whose KV demand (used + queued blocks) exceeds ``high_watermark`` x
   capacity, the fullest share first. A balanced cluster, or one with every unit under the
   watermark, moves nothing.
2. Per source, the excess ``demand - high_watermark x capacity`` is relieved with the fewest
   moves (MELL's make-room rule): the smallest request at least as large as the excess if there is
   one, else the largest first (ties: more tokens left to generate, as it would keep growing, then
   ``request_id``). Requests with nothing left to generate free their blocks at their next step
   and never move.
3. Destination of each move: the live unit, other than the source, with the lowest demand share
   after taking the request among those that stay at or under the watermark with it; none, and
   the request stays. Planned moves update both units' demand, so later moves see them.
4. Method: :func:`~vllm_kunserve.policy.placement.choose_migration` per move, with what is left of
   the operation's budgets: the link budget is ``max_migration_bytes`` minus the KV already
   planned (one budget for all pairs), the destination's compute budget is ``max_reprefill_ms``
   minus the re-prefills already planned there. So a move sends its KV when the link moves it
   faster than the destination re-prefills its tokens (or re-prefill is unaffordable), re-prefills
   otherwise, and is dropped (``defer``) when neither budget allows it. Without a cost model there
   is no price for a re-prefill: every move sends its KV.
5. Budgets: at most ``max_migrations`` orders and ``max_migration_bytes`` KV bytes per call.

Units that are not alive (dead, or frozen while their group changes) are neither sources nor
destinations, and requests on them are ignored (failover re-dispatches those). Neither are members
of a pipeline group (``InstanceLoad.group``): a request's KV there is spread over the members, each
holding its layers' share, so no one engine can send it or take it in; while it lasts the group is
the lever (``policy.levers``) and placement moves requests between the lone engines only. (Before,
with ``--dispatch mell`` and cluster drop on the same engines, a move between two members of one
group read the KV of a layer its source had dropped: a worker segfault, found in the three-lever run.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from vllm_kunserve.config import PlacementConfig
from vllm_kunserve.policy.costmodel import CostModel, default_model
from vllm_kunserve.policy.dispatch.base import InstanceLoad
from vllm_kunserve.policy.placement import MoveCandidate, choose_migration

METHODS = ("kv", "reprefill")


@dataclass(frozen=True)
class RequestLoad:
    """One movable request as the planner sees it."""

    request_id: str
    instance_id: int            # the unit holding its KV
    blocks: int                 # KV blocks it holds there
    tokens: int                 # prompt + generated so far (what a re-prefill computes)
    remaining_tokens: int       # tokens it may still generate (a bound, e.g. max_tokens - generated)


@dataclass(frozen=True)
class MigrationOrder:
    """Move ``request_id`` from unit ``src`` to ``dst`` by KV transfer or token re-prefill."""

    request_id: str
    src: int
    dst: int
    method: str                 # "kv" | "reprefill"
    bytes: int                  # KV bytes sent over the transfer channel (0 for a re-prefill)

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "src": self.src, "dst": self.dst, "method": self.method,
                "bytes": self.bytes}


def _relief_order(reqs: Sequence[RequestLoad], excess: float) -> list[RequestLoad]:
    """MELL's make-room order: the smallest request covering ``excess`` alone first, then the
    largest first (the fewest moves); ties prefer more tokens left, then the id."""
    movable = [r for r in reqs if r.blocks > 0 and r.remaining_tokens > 0]
    largest = sorted(movable, key=lambda r: (-r.blocks, -r.remaining_tokens, r.request_id))
    one = min((r for r in movable if r.blocks >= excess),
              key=lambda r: (r.blocks, -r.remaining_tokens, r.request_id), default=None)
    if one is None:
        return largest
    return [one] + [r for r in largest if r is not one]


def plan_migrations(units: Sequence[InstanceLoad], requests: Sequence[RequestLoad],
                    config: PlacementConfig = PlacementConfig(), *, kv_bytes_per_block: int,
                    link_bytes_per_s: float, cost_model: CostModel | None = None) -> tuple[MigrationOrder, ...]:
    """MELL's migrations for one operation (monitor period) on a fixed cluster.

    ``config`` gives the budgets (``max_migrations``, ``max_migration_bytes``,
    ``max_reprefill_ms``) and the trigger (``high_watermark``); ``kv_bytes_per_block`` prices a
    KV transfer (``blocks x kv_bytes_per_block`` bytes over ``link_bytes_per_s``); ``cost_model``
    (a whole-model ``CostModel`` in ms) prices a re-prefill of ``tokens``.
    """
    if kv_bytes_per_block < 0:
        raise ValueError(f"kv_bytes_per_block={kv_bytes_per_block}: must be >= 0")
    if not link_bytes_per_s > 0:
        raise ValueError(f"link_bytes_per_s={link_bytes_per_s}: must be > 0")
    live = {u.instance_id: u for u in units if u.alive and u.group is None}
    if config.max_migrations <= 0 or len(live) < 2:
        return ()
    cap = {i: max(u.capacity_blocks, 1) for i, u in live.items()}
    demand = {i: float(u.demand_blocks) for i, u in live.items()}
    limit = {i: config.high_watermark * u.capacity_blocks for i, u in live.items()}
    sources = sorted((i for i in live if demand[i] > limit[i]), key=lambda i: (-demand[i] / cap[i], i))
    if not sources:
        return ()
    on: dict[int, list[RequestLoad]] = {}
    for r in requests:
        if r.instance_id in live:
            on.setdefault(r.instance_id, []).append(r)
    model = cost_model if cost_model is not None else default_model()
    compute = {i: (config.max_reprefill_ms if cost_model is not None else 0.0) for i in live}
    bytes_left = float(config.max_migration_bytes)
    orders: list[MigrationOrder] = []
    moved: set[str] = set()
    for src in sources:
        for r in _relief_order(on.get(src, ()), demand[src] - limit[src]):
            if len(orders) >= config.max_migrations or demand[src] <= limit[src]:
                break
            if r.request_id in moved:
                continue
            fits = [i for i in live if i != src and demand[i] + r.blocks <= limit[i]]
            if not fits:
                continue
            dst = min(fits, key=lambda i: ((demand[i] + r.blocks) / cap[i], i))
            kv_bytes = r.blocks * kv_bytes_per_block
            choice = choose_migration([MoveCandidate(r.request_id, src, dst, float(kv_bytes), r.tokens)],
                                      {(src, dst): bytes_left}, {dst: compute[dst]}, link_bytes_per_s, model)[0]
            if choice.method == "defer":
                continue
            if choice.method == "kv":
                bytes_left -= kv_bytes
            else:
                compute[dst] -= choice.time_s * 1e3
            orders.append(MigrationOrder(r.request_id, src, dst, choice.method,
                                         int(kv_bytes) if choice.method == "kv" else 0))
            moved.add(r.request_id)
            demand[src] -= r.blocks
            demand[dst] += r.blocks
        if len(orders) >= config.max_migrations:
            break
    return tuple(orders)


__all__ = ["METHODS", "MigrationOrder", "RequestLoad", "plan_migrations"]
