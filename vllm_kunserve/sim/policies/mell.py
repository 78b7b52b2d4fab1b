"""MELL placement: requests are bin-packed onto instances by ``policy.placement.MellPlacer``
(classes L/M/S/T, multi-items, bounded migrations per operation) and the simulator carries out
the placements and migrations it returns.

Bins are the placer's; the simulator maps each open bin to a distinct instance. When the placer
opens more bins than there are instances (the cluster is over capacity), the extra bins share the
least-loaded instances, whose own scheduler then queues or preempts. Departures and KV growth are
batched every ``tick_s`` (``MellPlacer.apply_batch``); arrivals are placed at once.
"""

from __future__ import annotations

from vllm_kunserve.policy.placement import MellPlacer

from .base import Policy, move_request


class MellPolicy(Policy):
    name = "mell"

    def __init__(self, config=None, tick_s: float = 0.25, max_migrations: int | None = None):
        super().__init__("least-load")
        mm = max_migrations if max_migrations is not None else (
            config.placement.max_migrations if config is not None else 10)
        self.tick_s = tick_s
        self.max_migrations = mm
        self.placer: MellPlacer | None = None
        self.bin_server: dict[int, object] = {}
        self.sizes: dict[str, float] = {}
        self.departed: list[str] = []
        self.by_id: dict[str, object] = {}

    def setup(self, sim) -> None:
        self.placer = MellPlacer(capacity=float(sim.base_blocks), max_migrations=self.max_migrations)

    def _server_of_bin(self, sim, b: int):
        s = self.bin_server.get(b)
        if s is not None and s.alive:
            return s
        used = {id(x) for x in self.bin_server.values()}
        free = [x for x in sim.servers if id(x) not in used]
        s = free[0] if free else min(sim.servers, key=lambda x: (x.load(), x.sid))
        self.bin_server[b] = s
        return s

    def _size(self, sim, r) -> float:
        cap = float(sim.base_blocks)
        return min(cap, max(1.0, float(-(-(r.computed or r.prompt) // sim.cfg.block_size))))

    def _apply(self, sim, results) -> None:
        for res in results:
            for b in res.released_instances:
                self.bin_server.pop(b, None)
            for m in res.migrations:
                dst = self._server_of_bin(sim, m.dst)
                for rid in m.requests:
                    r = self.by_id.get(rid)
                    if r is not None and r.server is not None and r.finish_t is None:
                        move_request(sim, r, r.server, dst, kind="mell_migrate")

    def dispatch(self, sim, r):
        rid = str(r.id)
        self.by_id[rid] = r
        size = self._size(sim, r)
        self.sizes[rid] = size
        res = self.placer.allocate(rid, size)
        s = self._server_of_bin(sim, res.instance)
        self._apply(sim, [res])
        return s

    def on_finish(self, sim, r) -> None:
        self.departed.append(str(r.id))

    def on_tick(self, sim) -> None:
        ops = [("depart", rid) for rid in self.departed if rid in self.placer.req]
        for rid in self.departed:
            self.sizes.pop(rid, None)
            self.by_id.pop(rid, None)
        self.departed = []
        for s in sim.servers:
            for r in s.running:
                rid = str(r.id)
                if rid not in self.placer.req:
                    continue
                size = self._size(sim, r)
                if size != self.sizes.get(rid):
                    self.sizes[rid] = size
                    ops.append(("update", rid, size))
        if ops:
            self._apply(sim, self.placer.apply_batch(ops))

    def describe(self) -> dict:
        return {**super().describe(), "dispatch": "policy.placement.MellPlacer",
                "max_migrations": self.max_migrations}
