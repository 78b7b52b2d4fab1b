"""Elastic placement replay: the instances a placement policy holds over time on a trace.

An elastic cluster opens an instance when no open one takes a request and releases it when it
holds nothing (what MELL assumes). This replays a trace's request lengths through a placer from
``policy.placement`` / ``policy.placement_baselines`` (``allocate`` / ``update`` / ``depart``,
batched per tick) and records the instances open, the fluid lower bound and the migrations.

Request model: a request's prompt KV is there from its arrival (prefill is not timed), then it
generates one token every ``tpot_s`` and grows by one block every ``block_size`` tokens; it
departs once its last token is out (``arrival + output x tpot_s``). Every ``tick_s`` the placer
gets one batch: the departures, the requests whose block count changed, then the arrivals since
the last tick, largest first. Sizes are KV blocks, capacity is one instance's KV blocks.
"""

from __future__ import annotations

import math
from typing import Sequence

from .trace import TraceRequest


def _blocks(tokens: int, block_size: int, cap: int) -> int:
    return min(cap, max(1, -(-tokens // block_size)))


def replay(trace: Sequence[TraceRequest], placer, capacity_blocks: int, block_size: int = 16,
           tpot_s: float = 0.05, tick_s: float = 1.0, until_s: float | None = None) -> dict:
    """Replay ``trace`` through ``placer``; per tick ``t``, ``instances``, ``lower_bound``
    (``ceil(total blocks / capacity)``), ``migrations`` (units moved: a MELL multi-item counts
    once), ``moved_requests`` and ``moved_blocks``. Runs until ``until_s`` (default: every request
    departed)."""
    if capacity_blocks < 1 or block_size < 1 or not tpot_s > 0 or not tick_s > 0:
        raise ValueError("replay: capacity_blocks, block_size >= 1 and tpot_s, tick_s > 0")
    reqs = sorted(trace, key=lambda r: (r.arrival_s, r.id))
    end = until_s if until_s is not None else max(r.arrival_s + r.output * tpot_s for r in reqs) + tick_s
    out = {k: [] for k in ("t", "instances", "lower_bound", "migrations", "moved_requests", "moved_blocks")}
    live: dict[str, tuple[TraceRequest, int]] = {}  # id -> (request, blocks now)
    nxt = 0
    k = 0
    while True:
        t = k * tick_s
        if t > end:
            break
        ops: list[tuple] = []
        for rid, (r, b) in list(live.items()):
            if r.arrival_s + r.output * tpot_s <= t:
                ops.append(("depart", rid))
                del live[rid]
        for rid, (r, b) in live.items():
            gen = min(r.output, int((t - r.arrival_s) / tpot_s))
            nb = _blocks(r.prompt + gen, block_size, capacity_blocks)
            if nb != b:
                ops.append(("update", rid, float(nb)))
                live[rid] = (r, nb)
        arrivals = []
        while nxt < len(reqs) and reqs[nxt].arrival_s <= t:
            r = reqs[nxt]
            nxt += 1
            if r.arrival_s + r.output * tpot_s <= t:
                continue  # came and went within one tick
            gen = min(r.output, int((t - r.arrival_s) / tpot_s))
            nb = _blocks(r.prompt + gen, block_size, capacity_blocks)
            rid = str(r.id)
            live[rid] = (r, nb)
            arrivals.append(("allocate", rid, float(nb)))
        ops += sorted(arrivals, key=lambda o: (-o[2], o[1]))
        migs = []
        if ops:
            for res in placer.apply_batch(ops):
                migs.extend(res.migrations)
        total = sum(b for _, b in live.values())
        out["t"].append(t)
        out["instances"].append(placer.instances_used())
        out["lower_bound"].append(math.ceil(total / capacity_blocks - 1e-9))
        out["migrations"].append(len(migs))
        out["moved_requests"].append(sum(len(m.requests) for m in migs))
        out["moved_blocks"].append(float(sum(m.blocks for m in migs)))
        if until_s is None and nxt >= len(reqs) and not live:
            break
        k += 1
    return out


__all__ = ["replay"]
