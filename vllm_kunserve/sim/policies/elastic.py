"""An elastic fleet in the simulator: the decision ``kunserve serve --max-instances`` runs
(``policy.elastic.decide_scale`` and ``drain_moves``), on simulated instances.

The simulator's ``SimConfig.instances`` is the most instances; those beyond ``start`` begin parked
(``alive`` False: no steps, no dispatch). Every ``tick_s`` (the front end's monitor period) the
policy builds the same :class:`~vllm_kunserve.policy.elastic.ElasticView` the front end builds: the
serving instances' loads (``sim.adapters.instance_loads``, a draining one not alive for dispatch),
the instances starting and draining, and the KV the ready ones hold now (stock instances: no drops).
``add`` makes a parked instance serve ``startup_s`` later (an engine's start: measured on the real
engines); ``drain`` stops dispatch to it, moves up to the drain's budget of its decoding requests
with their KV (``move_request``) and parks it once it holds nothing. ``instance_seconds`` integrates
the instances holding a machine (starting, serving, draining) over the run, tick by tick, the way
the front end's ``kunserve:fleet_engines{state="held"}`` does.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from vllm_kunserve.config import ElasticConfig, PlacementConfig
from vllm_kunserve.policy.elastic import ElasticState, ElasticView, decide_scale, drain_moves

from .. import adapters
from .base import DEFAULT_DISPATCH, Policy, move_request


class ElasticPolicy(Policy):
    name = "elastic"

    def __init__(self, start: int, min_instances: int, cfg: ElasticConfig = ElasticConfig(),
                 dispatch: str = DEFAULT_DISPATCH, startup_s: float = 30.0, tick_s: float = 0.5,
                 placement: PlacementConfig = PlacementConfig()):
        super().__init__(dispatch)
        if not 1 <= min_instances <= start:
            raise ValueError(f"elastic: need 1 <= min_instances ({min_instances}) <= start ({start})")
        if startup_s < 0:
            raise ValueError(f"elastic: startup_s={startup_s} must be >= 0")
        self.start, self.min_instances, self.cfg = start, min_instances, cfg
        self.startup_s, self.tick_s, self.placement = startup_s, tick_s, placement
        self.state = ElasticState()
        self.status: dict[int, str] = {}     # server id -> parked | starting | ready | draining
        self.budget: dict[int, int] = {}
        self.instance_seconds = 0.0
        self.held: list[tuple[float, int]] = []   # (t, instances holding a machine) each tick
        self._last_t = 0.0

    def setup(self, sim) -> None:
        if self.start > len(sim.servers):
            raise ValueError(f"elastic: start={self.start} but the simulator has {len(sim.servers)} instances")
        for k, s in enumerate(sim.servers):
            self.status[s.sid] = "ready" if k < self.start else "parked"
            s.alive = k < self.start

    def dispatch_units(self, sim):
        """A draining instance takes no new request: not alive for dispatch (it still steps)."""
        return [replace(u, alive=False) if self.status.get(u.instance_id) == "draining" else u
                for u in adapters.instance_loads(sim)]

    def _up(self, sim, s) -> None:
        if self.status.get(s.sid) == "starting":
            self.status[s.sid] = "ready"
            s.alive = True
            sim.log("scale_up_ready", server=s.sid)
            sim.kick(s)

    def on_tick(self, sim) -> None:
        held = sum(1 for v in self.status.values() if v in ("starting", "ready", "draining"))
        self.instance_seconds += held * (sim.now - self._last_t)
        self._last_t = sim.now
        self.held.append((sim.now, held))
        by_sid = {s.sid: s for s in sim.servers}
        for sid, st in list(self.status.items()):
            if st == "draining":
                self._drain_step(sim, by_sid[sid])
        units = [u for u in self.dispatch_units(sim) if self.status.get(u.instance_id) in ("ready", "draining")]
        reach = float(sum(u.capacity_blocks for u in units if u.alive))
        view = ElasticView(sim.now, tuple(units), sum(1 for v in self.status.values() if v == "starting"),
                           tuple(sid for sid, v in self.status.items() if v == "draining"), reach,
                           self.min_instances, len(sim.servers))
        dec, self.state = decide_scale(view, self.cfg, self.state)
        if dec.action == "add":
            for s in [x for x in sim.servers if self.status[x.sid] == "parked"][:dec.count]:
                self.status[s.sid] = "starting"
                sim.log("scale_up", server=s.sid, reason=dec.reason)
                sim.at(sim.now + self.startup_s, self._up, sim, s)
        elif dec.action == "drain":
            self.status[dec.instance] = "draining"
            self.budget[dec.instance] = self.cfg.drain_migrations
            sim.log("scale_down", server=dec.instance, reason=dec.reason)

    def _drain_step(self, sim, s) -> None:
        if not s.running and not s.waiting and not s.inflight:
            self.status[s.sid] = "parked"
            s.alive = False
            sim.log("scale_down_done", server=s.sid)
            return
        if self.budget.get(s.sid, 0) <= 0 or s.inflight:
            return
        orders = drain_moves(self.dispatch_units(sim), adapters.movable_requests([s]), s.sid, self.budget[s.sid], self.placement,
                             kv_bytes_per_block=sim.cfg.block_bytes,
                             link_bytes_per_s=sim.cfg.link.bandwidth_bytes_per_s)
        by_id = {str(r.id): r for r in s.running}
        by_sid = {x.sid: x for x in sim.servers}
        for o in orders:
            r = by_id.get(o.request_id)
            if r is not None and move_request(sim, r, s, by_sid[o.dst], kind="drain_migrate"):
                self.budget[s.sid] -= 1

    def describe(self) -> dict:
        return {**super().describe(), "name": "elastic", "start": self.start, "min_instances": self.min_instances,
                "startup_s": self.startup_s, "elastic": asdict(self.cfg),
                "instance_seconds": round(self.instance_seconds, 1)}


__all__ = ["ElasticPolicy"]
