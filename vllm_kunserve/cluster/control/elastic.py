"""An elastic fleet in the front end (``kunserve serve --min-instances N --max-instances M``).

Each monitor period :class:`ElasticController` gives ``policy.elastic.decide_scale`` the engines'
loads (dispatch's snapshot), the engines starting and draining, and what the engines accepting work
can reach after every drop still possible (:meth:`FrontEnd.reachable_blocks`, the admission gate's
figure), and carries the decision out on the fleet: ``add`` starts parked engines
(``Fleet.add``, in a thread; an engine joins dispatch when healthy), ``drain`` stops sending an
engine new requests (``Fleet.drain``). Each period a draining engine gives up to its drain's
remaining migration budget of requests to the others (``policy.elastic.drain_moves``; a KV transfer
between kunserve engines, a re-prefill otherwise, carried out by the relay as any migration), and
once the front end holds nothing on it the engine is stopped and parked (``Fleet.retire``, off the
event loop). Every decision and step is an event (the front end's ``kunserve:fleet_engines{state}``
follows each; its ``held`` series, over time, is the fleet's instance-seconds) and
``kunserve:fleet_scale_events{action}`` counts what was done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from vllm_kunserve.config import ElasticConfig, PlacementConfig
from vllm_kunserve.policy.elastic import ElasticState, ElasticView, decide_scale, drain_moves

logger = logging.getLogger("kunserve.elastic")

class ElasticController:
    """The front end's scaler (see the module's text)."""

    def __init__(self, front: Any, cfg: ElasticConfig, min_instances: int, max_instances: int,
                 placement: PlacementConfig = PlacementConfig(), clock: Callable[[], float] = time.monotonic):
        if not 1 <= min_instances <= max_instances <= len(front.fleet.engines):
            raise ValueError(f"--min-instances {min_instances}, --max-instances {max_instances}: need "
                             f"1 <= min <= max <= the fleet's {len(front.fleet.engines)} engines")
        self.front, self.cfg, self.placement, self.clock = front, cfg, placement, clock
        self.min_instances, self.max_instances = min_instances, max_instances
        self.state = ElasticState()
        self.last: dict = {}
        self.budget: dict[int, int] = {}   # draining engine -> migrations its drain may still make
        self._retiring: set[int] = set()
        from prometheus_client import Counter

        self.m_events = Counter("kunserve:fleet_scale_events", "Elastic fleet actions", ["action"],
                                registry=front.registry)

    def view(self) -> ElasticView:
        fleet = self.front.fleet
        draining = tuple(e.index for e in fleet.engines if e.state == "draining")
        units = tuple(u for u in self.front.loads() if fleet.engines[u.instance_id].serving)
        starting = sum(1 for e in fleet.engines if e.state in ("starting", "restarting"))
        return ElasticView(self.clock(), units, starting, draining, self.front.reachable_blocks(),
                           self.min_instances, self.max_instances)

    async def on_poll(self, reports: dict) -> None:
        self._drain_step(reports)
        view = self.view()
        if not any(u.alive for u in view.units) and not view.starting:
            return   # nothing serves (every engine dead or restarting): the supervisor's turn
        dec, self.state = decide_scale(view, self.cfg, self.state)
        self.last = {"t": time.time(), **dec.to_dict()}
        if dec.action == "add":
            for _ in range(dec.count):
                e = self.front.fleet.add(dec.reason)
                if e is None:
                    break
                self.m_events.labels("add").inc()
                self.front.record("scale_up", instance=e.index, reason=dec.reason)
        elif dec.action == "drain" and self.front.fleet.drain(dec.instance, dec.reason):
            self.budget[dec.instance] = self.cfg.drain_migrations
            self.m_events.labels("drain").inc()
            self.front.record("scale_down", instance=dec.instance, reason=dec.reason)

    def _drain_step(self, reports: dict) -> None:
        from vllm_kunserve.cluster.control.migration import LOOPBACK_BYTES_PER_S, kv_block_bytes, kv_or_reprefill

        front = self.front
        moving = None   # (loads, movable requests), read once a period where a drain has moves left
        for e in front.fleet.engines:
            i = e.index
            if e.state != "draining" or i in self._retiring:
                continue
            if front.book.count(i) == 0:
                self._retiring.add(i)
                asyncio.get_running_loop().create_task(self._retire(i))
                continue
            left = self.budget.get(i, 0)
            if left <= 0:
                continue
            moving = moving or (front.loads(), front.request_loads())
            orders = kv_or_reprefill(drain_moves(*moving, i, left, self.placement,
                                                 kv_bytes_per_block=kv_block_bytes(reports),
                                                 link_bytes_per_s=LOOPBACK_BYTES_PER_S), reports)
            for o in orders:
                if front.order_move(o, "drain"):
                    self.budget[i] -= 1
                    self.m_events.labels("drain_move").inc()

    async def _retire(self, i: int) -> None:
        try:
            if await asyncio.to_thread(self.front.fleet.retire, i):
                self.front.monitor.reports.pop(i, None)
                self.front.prefixes.forget(i)
                self.m_events.labels("retire").inc()
                self.front.record("scale_down_done", instance=i)
        finally:
            self._retiring.discard(i)
            self.budget.pop(i, None)

    def status(self) -> dict:
        return {"min_instances": self.min_instances, "max_instances": self.max_instances,
                "engines": self.front.fleet.counts(), "last": self.last,
                "draining": {str(i): {"migrations_left": n, "inflight": self.front.book.count(i)}
                             for i, n in self.budget.items()}}


__all__ = ["ElasticController"]
