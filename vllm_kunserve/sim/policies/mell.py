"""MELL in the simulator, in one of two modes.

``fixed`` (the default, ``build_policy("mell")``): MELL on a fixed cluster, exactly what
``kunserve serve --dispatch mell`` runs (see ``policy.dispatch.mell`` for why). Arrivals are placed by
``policy.dispatch.choose_instance(..., "mell")``; every ``tick_s`` (the front end's monitor
period) ``policy.migration.plan_migrations`` gets every live server's ``InstanceLoad`` and one
``RequestLoad`` per decoding request (what the front end can move: it has produced a token) and
returns bounded migrations, carried out when the source ends its current step (a request in a
running step cannot leave it): ``kv`` moves the request with its KV (``move_request``: copied over
the instance link while it keeps decoding, 10% of the copy stalls the destination), ``reprefill``
drops its KV and queues it on the destination, which recomputes prompt + generated tokens.
Re-prefills are priced by the step-time model's cost model (``adapters.lookahead_costmodel``).

``pack``: MELL's elastic bin packing (``policy.placement.MellPlacer``) forced onto the fixed
instances: the placer's bins map to distinct instances, bins beyond the instance count share the
least-loaded ones; departures and KV growth are batched every ``tick_s`` (``apply_batch``) and its
migrations move requests like ``kv`` above. This is what the simulator ran as ``mell`` before: it
packs arrivals onto few instances (P99 TTFT 30x least-load's on 8 instances in
an earlier paper-scale simulation, 8x on average in docs/benchmarks/placement.md) and is kept as
the reference the fixed mode is measured against (``benchmarks/placement.py``).
"""

from __future__ import annotations

from dataclasses import replace

from vllm_kunserve.config import PlacementConfig
from vllm_kunserve.policy.migration import plan_migrations
from vllm_kunserve.policy.placement import MellPlacer

from .. import adapters
from .base import Policy, move_request

MODES = ("fixed", "pack")


class MellPolicy(Policy):
    name = "mell"

    def __init__(self, config=None, tick_s: float = 0.5, max_migrations: int | None = None, mode: str = "fixed"):
        if mode not in MODES:
            raise ValueError(f"mell mode {mode!r}: one of {', '.join(MODES)}")
        super().__init__("mell" if mode == "fixed" else "least-load")
        pcfg = config.placement if config is not None else PlacementConfig()
        if max_migrations is not None:
            pcfg = replace(pcfg, max_migrations=max_migrations)
        self.pcfg = pcfg
        self.mode = mode
        self.tick_s = tick_s
        self.max_migrations = pcfg.max_migrations
        self.by_id: dict[str, object] = {}
        # fixed mode
        self.cost_model = None
        self.pending: dict[int, list] = {}  # source server id -> orders waiting for its step to end
        self.orders = {"kv": 0, "reprefill": 0}
        # pack mode
        self.placer: MellPlacer | None = None
        self.bin_server: dict[int, object] = {}
        self.sizes: dict[str, float] = {}
        self.departed: list[str] = []

    def setup(self, sim) -> None:
        if self.mode == "pack":
            self.placer = MellPlacer(capacity=float(sim.base_blocks), max_migrations=self.max_migrations)
        else:
            self.cost_model = adapters.lookahead_costmodel(sim.cfg.step_time)

    # ---- arrivals and departures --------------------------------------------------------------
    def dispatch(self, sim, r):
        rid = str(r.id)
        self.by_id[rid] = r
        if self.mode == "fixed":
            return super().dispatch(sim, r)
        size = self._size(sim, r)
        self.sizes[rid] = size
        res = self.placer.allocate(rid, size)
        s = self._server_of_bin(sim, res.instance)
        self._apply(sim, [res])
        return s

    def on_finish(self, sim, r) -> None:
        if self.mode == "fixed":
            self.by_id.pop(str(r.id), None)
        else:
            self.departed.append(str(r.id))

    def on_tick(self, sim) -> None:
        if self.mode == "fixed":
            self._plan(sim)
        else:
            self._pack_tick(sim)

    def on_step_done(self, sim, server) -> None:
        if self.pending:
            self._execute(sim, server)

    # ---- fixed: plan_migrations each period -----------------------------------------------------
    def _plan(self, sim) -> None:
        units = adapters.instance_loads(sim)
        reqs = adapters.movable_requests(s for s in sim.servers if s.alive and not s.frozen)
        orders = plan_migrations(units, reqs, self.pcfg, kv_bytes_per_block=sim.cfg.block_bytes,
                                 link_bytes_per_s=sim.cfg.link.bandwidth_bytes_per_s, cost_model=self.cost_model)
        self.pending = {}
        for o in orders:
            self.pending.setdefault(o.src, []).append(o)
        for s in list(sim.servers):
            if not s.inflight:
                self._execute(sim, s)

    def _execute(self, sim, src) -> None:
        orders = self.pending.pop(src.sid, None)
        if not orders:
            return
        by_sid = {s.sid: s for s in sim.servers}
        was_busy, src.busy = src.busy, True  # no step may start on src until every order has left
        for o in orders:
            r = self.by_id.get(o.request_id)
            dst = by_sid.get(o.dst)
            if r is None or dst is None or r.server is not src or r not in src.running or not dst.alive or dst.frozen:
                continue
            if o.method == "kv":
                if move_request(sim, r, src, dst, kind="mell_migrate"):
                    self.orders["kv"] += 1
            else:
                self._reprefill(sim, r, src, dst)
        src.busy = was_busy
        sim.kick(src)

    def _reprefill(self, sim, r, src, dst) -> None:
        """Drop ``r``'s KV on ``src`` and queue it on ``dst``, which recomputes its prompt and the
        tokens generated so far (the front end resubmits them as the prompt)."""
        src.running.remove(r)
        src.used -= r.blocks
        r.blocks = 0
        r.computed = 0
        r.migrations += 1
        r.server = dst
        dst.waiting.append(r)
        self.orders["reprefill"] += 1
        sim.log("mell_reprefill", req=r.id, src=src.sid, dst=dst.sid, tokens=r.prompt + r.generated)
        sim.kick(src)
        sim.kick(dst)

    # ---- pack: the elastic placer forced onto fixed instances ----------------------------------
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

    def _pack_tick(self, sim) -> None:
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
        if self.mode == "pack":
            return {**super().describe(), "mode": "pack", "dispatch": "policy.placement.MellPlacer",
                    "max_migrations": self.max_migrations}
        return {**super().describe(), "mode": "fixed", "migration": "policy.migration.plan_migrations",
                "max_migrations": self.pcfg.max_migrations, "max_migration_bytes": self.pcfg.max_migration_bytes,
                "high_watermark": self.pcfg.high_watermark, "orders": dict(self.orders)}
