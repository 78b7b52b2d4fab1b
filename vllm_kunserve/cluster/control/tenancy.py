"""The tenancy controller of a multi-model fleet: the memory of each host, shared by the engines of
every model on it, moved between them (``policy.tenancy`` decides; this runs the moves).

After each poll of any model's engines it builds a :class:`~vllm_kunserve.policy.tenancy.TenancyView`
from the latest reports of every model's kunserve engines (their ``tenancy`` state: held memory,
lent layers, borrowed blocks) and the front end's own record of each model's requests (in flight,
when the last one came), and runs the moves one after the other on the engines' control ports
(``lend``, ``reclaim``, ``borrow``, ``repay``: each transactional in the engine agent). A move that
fails leaves its engine as it was (the agent rolls back) and is counted; the next decision sees the
engine as it is. A report read before a move ended is not used for that engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Mapping

from vllm_kunserve.config import RemapConfig, TenancyConfig
from vllm_kunserve.policy.remap import ModelLayers
from vllm_kunserve.policy.tenancy import (Move, TenancyState, TenancyView, TenantEngine, TenantModel,
                                          decide_tenancy, host_free_bytes, is_active)

logger = logging.getLogger("kunserve.tenancy")


def engine_key(model: str, index: int) -> str:
    return f"{model}#{index}"


class TenancyController:
    """``fronts``: model name -> its FrontEnd; ``priorities``: model -> priority (lower lends first)."""

    def __init__(self, fronts: Mapping[str, Any], cfg: TenancyConfig, priorities: Mapping[str, int | None],
                 remap: RemapConfig = RemapConfig(), registry: Any = None):
        self.fronts = dict(fronts)
        self.cfg, self.remap = cfg, remap
        self.priorities = dict(priorities)
        self.last_request: dict[str, float] = {m: time.monotonic() for m in self.fronts}
        self.home: dict[str, int] = {}        # engine -> what it holds at its base (first report there)
        self.state = TenancyState()
        self.moves_done: dict[str, float] = {}   # engine -> when its last move ended (older reports ignored)
        self.events: list[dict] = []
        self.last: dict = {}
        self.auto = True
        self._task: asyncio.Task | None = None
        self._init_metrics(registry)

    def _init_metrics(self, registry: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = r = registry or CollectorRegistry()
        self.m_moves = Counter("kunserve:tenancy_moves", "Memory moves between the models of a host",
                               ["model", "op", "outcome"], registry=r)
        self.m_held = Gauge("kunserve:tenancy_held_bytes", "Memory each model's engines hold (weights and KV)",
                            ["model"], registry=r)
        self.m_free = Gauge("kunserve:tenancy_free_bytes", "Memory of a host its engines do not hold now",
                            ["host"], registry=r)
        self.m_active = Gauge("kunserve:tenancy_model_active", "1 while the model is active (not lending)",
                              ["model"], registry=r)

    # -- what the front end tells it -------------------------------------------------------------------
    def arrived(self, model: str) -> None:
        """A request for ``model`` came in (called before it is dispatched)."""
        self.last_request[model] = time.monotonic()
        if self.auto and self._task is None and self._lent(model):
            # a lender's request: its memory starts coming back now, not at the next poll
            self._task = asyncio.ensure_future(self._decide_and_run())

    def _lent(self, model: str) -> bool:
        front = self.fronts[model]
        return any((r.state or {}).get("tenancy", {}).get("lent") for r in front.monitor.reports.values() if r.ok)

    def start(self) -> None:
        for front in self.fronts.values():
            front.monitor.listeners.append(self.on_poll)

    async def on_poll(self, reports: dict) -> None:
        if self.auto and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self._decide_and_run())

    # -- the view ---------------------------------------------------------------------------------------
    def view(self) -> tuple[TenancyView, dict[str, Any]]:
        """The policy's view, and engine key -> (front, engine) for running its moves."""
        now = time.monotonic()
        engines, where, models = [], {}, []
        bw, overlap = float("inf"), True
        for name, front in self.fronts.items():
            ml = None
            for e in front.fleet.engines:
                rep = front.monitor.reports.get(e.index)
                key = engine_key(name, e.index)
                if not e.control_url:
                    continue
                where[key] = (front, e)
                st = rep.state if rep is not None and rep.ok else None
                ten = (st or {}).get("tenancy")
                stale = rep is None or rep.t < self.moves_done.get(key, 0.0)
                if not e.serving or st is None or ten is None:
                    if key in self.home:   # it holds nothing now; it comes back with its home
                        engines.append(TenantEngine(key, name, self._host(st, key), False, "down", 0, 0, 0, 0, 0,
                                                    0, self.home[key]))
                    continue
                cap, blocks = st.get("capacity") or {}, st.get("blocks") or {}
                layers = st.get("layers") or []
                if not ten.get("lent") and not ten.get("borrowed_blocks") and st.get("phase") == "base":
                    self.home.setdefault(key, int(ten.get("held_bytes") or 0))
                if key not in self.home:
                    continue
                engines.append(TenantEngine(
                    key, name, self._host(st, key), True, st.get("phase") or "", int(blocks.get("demand") or 0),
                    int(cap.get("blocks_total") or 0), int(cap.get("blocks_base") or 0),
                    int(cap.get("blocks_max") or 0), int(ten.get("block_bytes") or cap.get("block_bytes") or 0),
                    int(ten.get("held_bytes") or 0), self.home[key], int(ten.get("round_bytes") or 0),
                    int(ten.get("lent") or 0), int(ten.get("borrowed_blocks") or 0), bool(ten.get("repaying")),
                    busy=stale))
                bw = min(bw, float(st.get("h2d_bytes_per_s") or bw))
                overlap = overlap and bool(st.get("copy_overlap", True))
                if ml is None and layers:
                    n = len(layers)
                    ml = ModelLayers(name, n, max(int(x.get("bytes") or 0) for x in layers) or 1,
                                     float(ten.get("step_ms_p50") or 0.0) / n, float(ten.get("step_ms_max") or 0.0) / n,
                                     priority=self.priorities.get(name),
                                     last_active_s=self.last_request.get(name, 0.0))
            if ml is not None:
                models.append(TenantModel(name, ml, len(front.flights), now - self.last_request.get(name, now)))
        return TenancyView(tuple(models), tuple(engines), bw if bw != float("inf") else 1e9, overlap, now), where

    @staticmethod
    def _host(st: dict | None, key: str) -> str:
        return ((st or {}).get("engine") or {}).get("host") or "local"

    # -- deciding and moving ------------------------------------------------------------------------------
    async def _decide_and_run(self) -> None:
        try:
            view, where = self.view()
            moves, self.state = decide_tenancy(view, self.cfg, self.remap, self.state)
            self._publish(view)
            for mv in moves:
                await self._run(mv, where)
        except Exception:
            logger.exception("tenancy decision failed")
        finally:
            self._task = None

    async def _run(self, mv: Move, where: dict) -> dict:
        front, e = where[mv.engine]
        model = mv.engine.split("#", 1)[0]
        t0 = time.monotonic()
        try:
            out = await front.monitor.client.op(front.session, e.control_url, mv.op, dict(mv.params), timeout_s=120.0)
            outcome = out.get("outcome", "ok") if isinstance(out, dict) else "ok"
        except Exception as exc:
            out, outcome = {"error": f"{type(exc).__name__}: {exc}"[:300]}, "failed"
        self.moves_done[mv.engine] = time.time()
        self.m_moves.labels(model, mv.op, outcome).inc()
        ev = {"t": time.time(), "event": f"tenancy_{mv.op}", "engine": mv.engine, "outcome": outcome,
              "params": dict(mv.params), "reason": mv.reason, "s": round(time.monotonic() - t0, 3),
              **({"bytes": out.get("bytes")} if isinstance(out, dict) and "bytes" in out else {}),
              **({"error": out.get("error")} if isinstance(out, dict) and out.get("error") else {})}
        self.events.append(ev)
        del self.events[:-200]
        front.record(ev["event"], **{k: v for k, v in ev.items() if k not in ("t", "event")})
        return out

    def _publish(self, view: TenancyView) -> None:
        hosts: dict[str, list[TenantEngine]] = {}
        held: dict[str, int] = {m: 0 for m in self.fronts}
        for e in view.engines:
            hosts.setdefault(e.host, []).append(e)
            held[e.model] = held.get(e.model, 0) + (e.held_bytes if e.ready else 0)
        for h, es in hosts.items():
            self.m_free.labels(h).set(host_free_bytes(es))
        for m, b in held.items():
            self.m_held.labels(m).set(b)
        for m in view.models:
            self.m_active.labels(m.name).set(1 if is_active(m, self.cfg) else 0)
        self.last = {"hosts": {h: {"free_bytes": host_free_bytes(es), "budget_bytes": sum(e.home_bytes for e in es)}
                               for h, es in hosts.items()},
                     "models": {m.name: {"active": is_active(m, self.cfg), "inflight": m.inflight,
                                         "idle_s": round(m.idle_s, 1), "priority": m.layers.priority,
                                         "held_bytes": held.get(m.name, 0)} for m in view.models},
                     "engines": {e.key: {"held_bytes": e.held_bytes, "home_bytes": e.home_bytes, "lent": e.lent_layers,
                                         "borrowed_blocks": e.borrowed_blocks, "repaying": e.repaying,
                                         "blocks": e.capacity_blocks, "demand": e.demand_blocks}
                                 for e in view.engines}}

    def status(self) -> dict:
        return {"auto": self.auto, "idle_s": self.cfg.idle_s, **self.last, "events": self.events[-30:]}
