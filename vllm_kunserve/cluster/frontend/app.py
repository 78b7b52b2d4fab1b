"""The fleet's OpenAI-compatible front end: one endpoint for N engines.

An asynchronous proxy on vLLM's HTTP stack (FastAPI on uvicorn, aiohttp to the engines, pooled
keep-alive connections). Routes:

    POST /v1/completions, /v1/chat/completions   validated (400 on bad input), dispatched, relayed
    GET  /v1/models                               the engines' model card
    GET  /health                                  200 while an engine is ready, else 503
    GET  /metrics                                 the engines' ``vllm:`` series labelled ``instance``
                                                  + the fleet's ``kunserve:`` series
    GET  /kunserve/status                         instances, their control-port state, groups,
                                                  memory, recent events (``kunserve status --url``)
    POST /kunserve/ops/{op}                       the operator's operations, one handler each
                                                  (:mod:`cluster.frontend.ops`): kill, migrate, dispatch,
                                                  drop, restore

Streamed requests are relayed chunk by chunk (:mod:`cluster.frontend.relay`), can migrate and survive an
engine's death; non-streamed requests are relayed whole and, if their engine dies before
answering, sent again elsewhere. A client that disconnects aborts its request on the engine (the
upstream connection is closed). At most ``max_concurrency`` requests are upstream at once; more
wait up to ``queue_timeout_s`` and then get 503. ``/kunserve/ops/*`` need the token when one is set.
"""

# no ``from __future__ import annotations``: FastAPI must see the real ``Request`` annotations
import asyncio
import contextlib
import hmac
import itertools
import logging
import math
import re
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Sequence

import aiohttp

from vllm_kunserve.cluster.control.client import ControlClient
from vllm_kunserve.cluster.control.monitor import FlightBook, Monitor, instance_loads
from vllm_kunserve.cluster.fleet.spec import ENGINE_STATES, HELD_STATES
from vllm_kunserve.cluster.frontend.admission import MODES as ADMISSION_MODES
from vllm_kunserve.cluster.frontend.admission import PRIORITY_HEADER, AdmissionGate, parse_priority
from vllm_kunserve.cluster.frontend.ops import run_op
from vllm_kunserve.cluster.frontend.prefix import PrefixIndex, Sessions, prompt_key
from vllm_kunserve.cluster.frontend.relay import READS, Flight, Move, Relay, UpstreamLost, busy_or_status
from vllm_kunserve.cluster.frontend.validate import (BadRequest, check_token_ids, encodes, error_body, max_token_id,
                                                   parse_json, prompt_counter, validate)
from vllm_kunserve.config import PlacementConfig
from vllm_kunserve.policy.dispatch import check_mode, choose_instance, get_policy
from vllm_kunserve.runtime.gcpause import GcPauses, freeze_heap
from vllm_kunserve.runtime.looplag import LoopLag

logger = logging.getLogger("kunserve.frontend")

__all__ = ["FrontEnd", "build_app", "relabel_metrics"]

#: the breaker's events (cluster/frontend/breaker.py) and the kunserve:circuit_state value each sets
CIRCUIT_STATES = {"circuit_closed": 0, "circuit_open": 1, "circuit_half_open": 2}
#: kunserve:frontend_ttft_stage_seconds: a millisecond to a minute
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def relabel_metrics(texts: dict[int, str]) -> str:
    """Merge engines' Prometheus texts into one exposition, each sample labelled ``instance``
    (samples of one family kept together under one HELP/TYPE, as the format requires)."""
    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    order: list[str] = []
    sample = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")
    for inst, text in sorted(texts.items()):
        fam = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                if name not in headers:
                    headers[name], families[name] = [], []
                    order.append(name)
                if line not in headers[name]:
                    headers[name].append(line)
                fam = name
                continue
            if not line or line.startswith("#"):
                continue
            m = sample.match(line)
            if not m:
                continue
            name, labels, rest = m.groups()
            lab = f'instance="{inst}"' + ("," + labels[1:-1] if labels and len(labels) > 2 else "")
            key = fam if fam is not None and name.startswith(fam) else name
            if key not in families:
                headers[key], families[key] = [], []
                order.append(key)
            families[key].append(f"{name}{{{lab}}}{rest}")
    out = []
    for name in order:
        out.extend(headers[name])
        out.extend(families[name])
    return "\n".join(out) + "\n"


class FrontEnd:
    """State of the front end: the fleet, its monitor, what is in flight, dispatch, metrics."""

    def __init__(self, fleet, *, dispatch: str = "least-work", monitor_interval_s: float = 0.5,
                 max_concurrency: int = 1024, queue_timeout_s: float = 60.0, request_timeout_s: float = 3600.0,
                 first_byte_timeout_s: float = 60.0, retry_backoff_s: float = 0.05, token: str = "",
                 tokenizer: Any = None,
                 plan_migrations: Callable[..., Sequence[Any]] | None = None, kunserve_cfg: Any = None,
                 api_keys: Sequence[str] = (), engine_api_key: str = "", admission: str = "off",
                 admission_queue: int = 256, admission_wait_s: float = 60.0, elastic: Any = None,
                 min_instances: int | None = None):
        self.fleet = fleet
        # vLLM's --api-key: what every /v1 route of this front end asks of its clients (any of them),
        # and the key it sends the engines (whose /v1 routes ask the same)
        self.api_keys, self.engine_api_key = tuple(api_keys), engine_api_key
        self.dispatch = check_mode(dispatch)
        self.monitor = Monitor(fleet.engines, interval_s=monitor_interval_s, token=token)
        self.book = FlightBook()
        from vllm_kunserve.cluster.frontend.breaker import Breakers

        # an engine that keeps failing is skipped for a cool-down (its supervisor decides if it is dead)
        self.breakers = Breakers(on_change=lambda i, kind, info: self.record(kind, instance=i, **info))
        self.prefixes, self.sessions = PrefixIndex(), Sessions()   # where prompts and sessions went
        self.flights: dict[str, Flight] = {}
        self.by_visible: dict[str, Flight] = {}
        self.arrivals: dict[str, asyncio.Event] = {}   # migrate ops waiting for a request id to arrive
        self.max_concurrency = max_concurrency
        self.queue_timeout_s = queue_timeout_s
        self.request_timeout_s = request_timeout_s
        # a streamed request's engine sends its response head once the prompt is queued: one that
        # sends none in this long is hung, and the request goes elsewhere (non-streamed answers come
        # whole, so they are bounded by request_timeout_s only)
        self.first_byte_timeout_s = first_byte_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.token = token
        self.tokenizer = tokenizer
        self._count = prompt_counter(tokenizer)
        self.max_token_id = max_token_id(tokenizer)
        self.plan_migrations = plan_migrations
        self.migrating = plan_migrations is not None and get_policy(self.dispatch).periodic
        self.events: list[dict] = []
        self.gc, self.gc_frozen = GcPauses(), 0  # the collector's pauses of this event loop; objects frozen
        self.loop_lag = LoopLag()  # this event loop's late wake-ups: a late relay, not a slow engine
        self.freeze_gc = False  # `kunserve serve` sets it: the serving process's heap is frozen after startup
        self.served: list[str] = []
        self.max_model_len = 0
        self.models_body: bytes = b""
        self._turn = itertools.count()
        self._ids = itertools.count()
        self._sem: asyncio.Semaphore | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._probes: dict[int, asyncio.Task] = {}   # engines whose liveness is being asked off the loop
        self.session: aiohttp.ClientSession | None = None
        self._init_metrics()
        from vllm_kunserve.cluster.control.groups import GroupController

        # cluster drop: only a fleet of kunserve engines (group members) can form pipeline groups
        self.groups = GroupController(self, kunserve_cfg) if kunserve_cfg is not None else None
        if admission not in ADMISSION_MODES:
            raise ValueError(f"admission {admission!r}: one of {', '.join(ADMISSION_MODES)}")
        # memory-aware admission: a request the fleet cannot hold even after its drops waits or gets 429
        self.gate = AdmissionGate(self, admission_queue, admission_wait_s) if admission == "memory" else None
        # an elastic fleet (engines parked beyond those started): engines start and stop with the demand
        self.elastic = None
        if elastic is not None:
            from vllm_kunserve.cluster.control.elastic import ElasticController

            self.elastic = ElasticController(
                self, elastic, min_instances or sum(1 for e in fleet.engines if e.state != "parked"),
                len(fleet.engines), kunserve_cfg.placement if kunserve_cfg is not None else PlacementConfig())
        fleet.on_change.append(self._on_fleet)

    # -- metrics ------------------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.m_requests = Counter("kunserve:frontend_requests", "Requests answered by the front end",
                                  ["kind", "outcome"], registry=r)
        self.m_inflight = Gauge("kunserve:frontend_inflight", "Requests upstream now", registry=r)
        self.m_dispatch = Counter("kunserve:dispatched", "Requests dispatched per instance", ["instance"], registry=r)
        self.m_migrations = Counter("kunserve:migrations", "Request migrations", ["method", "outcome"], registry=r)
        self.m_failovers = Counter("kunserve:failovers", "Requests moved off a failed engine", registry=r)
        self.m_retries = Counter("kunserve:retries", "Requests sent to another engine after one failed them",
                                 ["instance", "reason"], registry=r)
        self.m_circuit = Gauge("kunserve:circuit_open", "1 while the instance's circuit breaker is open",
                               ["instance"], registry=r)
        self.m_circuit_state = Gauge("kunserve:circuit_state", "The instance's circuit breaker: 0 closed, 1 open, "
                                     "2 half open (cooled down, the next request probes it)", ["instance"], registry=r)
        self.m_restarts = Counter("kunserve:engine_restarts", "Engine restarts", ["instance"], registry=r)
        self.m_up = Gauge("kunserve:engine_up", "1 while the instance accepts work", ["instance"], registry=r)
        self.m_blocks = Gauge("kunserve:engine_kv_blocks", "KV block capacity per instance (last poll)",
                              ["instance"], registry=r)
        self.m_stage = Histogram(
            "kunserve:frontend_ttft_stage_seconds",
            "A streamed request's time to first token inside the front end, by stage: admit (its body read, "
            "validated, counted and dispatched), engine (sent until the engine's first token was read back), "
            "relay (that token written to the client). What a client measures beyond their sum was spent before "
            "the front end's handler ran (the network, the server's accept and parse, a late event loop)",
            ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.m_engines = Gauge("kunserve:fleet_engines", "Engines per state (held: those holding a machine: "
                               "starting, ready, draining, restarting, stopping; over time, instance-seconds)",
                               ["state"], registry=r)
        for e in self.fleet.engines:
            self.m_up.labels(str(e.index)).set(1 if e.accepting else 0)
        self.count_engines()

    def count_engines(self) -> None:
        """``kunserve:fleet_engines{state}`` as the fleet is now."""
        counts = self.fleet.counts()
        for s in ENGINE_STATES:
            self.m_engines.labels(s).set(counts.get(s, 0))
        self.m_engines.labels("held").set(sum(counts.get(s, 0) for s in HELD_STATES))

    def _on_fleet(self, engine, kind: str) -> None:
        self.count_engines()
        self.m_up.labels(str(engine.index)).set(1 if engine.accepting else 0)
        if kind in ("dead", "restarted"):
            self.prefixes.forget(engine.index)   # a restarted engine's prefix cache is empty
        if kind == "restarted":
            self.m_restarts.labels(str(engine.index)).inc()
        if kind == "dead" and self.groups is not None:
            self.groups.forget(engine.index)

    def record(self, kind: str, **info: Any) -> None:
        ev = {"t": time.time(), "event": kind, **info}
        self.events.append(ev)
        del self.events[:-200]
        if kind == "migration":
            self.m_migrations.labels(info.get("method", "?"), "ok").inc()
        elif kind == "migration_fallback":
            self.m_migrations.labels("kv", "fallback").inc()
        elif kind == "failover":
            self.m_failovers.inc()
        elif kind in CIRCUIT_STATES:
            self.m_circuit.labels(str(info.get("instance"))).set(1 if kind == "circuit_open" else 0)
            self.m_circuit_state.labels(str(info.get("instance"))).set(CIRCUIT_STATES[kind])
        logger.info("%s %s", kind, {k: v for k, v in info.items()})

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        from vllm_kunserve.cluster.frontend.validate import load_request_models

        load_request_models()   # vLLM's request models import in seconds: not on the first request
        self._sem = asyncio.Semaphore(self.max_concurrency)
        self._stop = asyncio.Event()
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=self.request_timeout_s),
            headers={"Authorization": f"Bearer {self.engine_api_key}"} if self.engine_api_key else None)
        await self._load_models()
        self.monitor.listeners.append(self._after_poll)
        if self.groups is not None:
            self.monitor.listeners.append(self.groups.on_poll)
        if self.elastic is not None:
            self.monitor.listeners.append(self.elastic.on_poll)
        await self.monitor.poll(self.session)
        self._tasks.append(asyncio.create_task(self.monitor.run(self._stop)))
        # every stream passes through this one event loop: keep the startup heap (vLLM's request
        # models, the tokenizer, FastAPI) out of the collector's scans, and time every pause
        self.gc_frozen = freeze_heap() if self.freeze_gc else 0
        self.gc.install()
        self.loop_lag.start()

    async def close(self) -> None:
        self.gc.remove()
        await self.loop_lag.stop()
        if self._stop is not None:
            self._stop.set()
        for t in self._tasks:
            try:
                await asyncio.wait_for(t, 5)
            except Exception:
                t.cancel()
        for t in list(self._probes.values()):
            t.cancel()
        if self.session is not None:
            await self.session.close()

    async def _load_models(self) -> None:
        for e in self.fleet.ready():
            try:
                async with self.session.get(f"{e.url}/v1/models") as resp:
                    self.models_body = await resp.read()
                    data = (await resp.json())["data"]
                self.served = [d["id"] for d in data]
                self.max_model_len = int(data[0].get("max_model_len") or 0)
                return
            except Exception as exc:
                logger.warning("instance %d: /v1/models failed: %s", e.index, exc)
        raise RuntimeError("no engine answered /v1/models")

    async def _after_poll(self, reports: dict) -> None:
        self.count_engines()
        for i, r in reports.items():
            if r.ok:
                self.m_blocks.labels(str(i)).set(r.capacity_blocks)
        if self.gate is not None:   # a group that formed holds more: the queue's head may fit now
            self.gate.refresh()
            self.gate.wake()
        if self.plan_migrations is None or not self.migrating:
            return
        for o in self.plan_migrations(self.loads(), self.request_loads(), reports, get_policy(self.dispatch)):
            self.order_move(o, "placement")

    def order_move(self, o, reason: str) -> bool:
        """Have the relay move request ``o.request_id`` (a ``policy.migration.MigrationOrder``) at its
        next chunk; False if it has left ``o.src``, is not movable or has a move pending."""
        f = self.flights.get(o.request_id)
        if f is None or f.move is not None or not f.checked.movable or f.instance != o.src:
            return False
        f.move = Move(o.dst, o.method, reason)
        return True

    @property
    def control(self) -> ControlClient:
        """The client of the engines' control ports, with the front end's token as it is now."""
        return ControlClient(self.token)

    # -- the RelayHost protocol (cluster.frontend.relay) ----------------------------------------------
    def engine_url(self, instance: int) -> str | None:
        e = self.fleet.engines[instance]
        return e.url if e.serving else None   # a draining engine still runs what it holds

    def loads(self):
        return instance_loads(self.fleet.engines, self.monitor.reports, self.book, self._group_id)

    def _group_id(self, instance: int) -> int | None:
        g = self.groups.group_of(instance) if self.groups is not None else None
        return g.gid if g is not None else None

    def request_loads(self):
        from vllm_kunserve.policy.migration import RequestLoad

        out = []
        for f in self.flights.values():
            if f.started and f.checked.movable and f.move is None:
                bs = self._block_size(f.instance)
                toks = f.prompt_len + len(f.generated)
                out.append(RequestLoad(f.rid, f.instance, math.ceil(toks / bs), toks, f.remaining))
        return out

    def reachable_blocks(self) -> float:
        """KV blocks the engines accepting work can hold after every drop the fleet may still make
        (``policy.admission.reachable_blocks`` over the group controller's snapshot; stock engines: their
        KV now); inf before any engine reported. The admission gate and the elastic fleet read it."""
        from vllm_kunserve.policy.admission import reachable_blocks

        ctl = self.groups
        if ctl is not None and ctl.cfg.drop.enable:
            snap = ctl.snapshot(ctl._states())
            if snap is not None:
                return reachable_blocks(snap, ctl.cfg.drop.max_group_size)
        caps = [r.capacity_blocks for i, r in self.monitor.reports.items()
                if r.ok and r.capacity_blocks and i < len(self.fleet.engines) and self.fleet.engines[i].accepting]
        return float(sum(caps)) if caps else math.inf

    def _block_size(self, instance: int) -> int:
        r = self.monitor.reports.get(instance)
        return r.block_size if r and r.ok else 16

    async def pick(self, flight: Flight, exclude: set[int]) -> int:
        deadline = time.monotonic() + self.fleet.spec.startup_timeout_s
        while True:
            live = [u for u in self.loads() if u.alive]
            # engines not excluded and not cooling down after failures; else not excluded; else any
            # ready one; else wait for a restart
            ok = [u for u in live if u.instance_id not in exclude]
            loads = [u for u in ok if not self.breakers.is_open(u.instance_id)] or ok or live
            if loads:
                bs = self._block_size(loads[0].instance_id)
                toks = flight.prompt_len + len(flight.generated)
                prefixed = get_policy(self.dispatch).uses_prefix   # the index is kept only for a policy that reads it
                if prefixed:   # what each engine likely caches, the session's
                    key = prompt_key(flight.checked.body) if not flight.generated else None
                    share, last = self.prefixes.share(key), self.sessions.get(flight.session)
                    loads = [replace(u, prefix_share=share.get(u.instance_id, 0.0), affinity=u.instance_id == last)
                             for u in loads]
                i = choose_instance(loads, self.dispatch, prompt_blocks=math.ceil(toks / bs), turn=next(self._turn))
                if prefixed:
                    self.prefixes.add(i, key)
                    self.sessions.put(flight.session, i)
                return i
            if time.monotonic() > deadline:
                raise UpstreamLost("no engine is ready")
            await asyncio.sleep(0.25)

    async def reroute(self, flight: Flight, tried: set[int], why: str, max_hops: int = 8,
                      kind: str = "connect") -> int:
        """``flight.instance`` did not take the request (``kind``: connect, status, timeout or busy, the
        ``kunserve:retries_total`` label): report it (a busy engine, one answering 503, is not a failed
        one: no breaker count, no liveness probe), wait a backoff with jitter (:func:`breaker.backoff_s`)
        and pick another engine (UpstreamLost after ``max_hops`` retries)."""
        from vllm_kunserve.cluster.frontend.breaker import backoff_s

        if kind != "busy":
            self.engine_failed(flight.instance, why)
        tried.add(flight.instance)
        flight.retries += 1
        self.m_retries.labels(str(flight.instance), kind).inc()
        if flight.retries > max_hops:
            raise UpstreamLost(f"no engine took the request after {flight.retries} tries: {why}")
        self.record("retry", request=flight.visible_id or flight.rid, src=flight.instance, attempt=flight.retries,
                    reason=why[:200])
        await asyncio.sleep(backoff_s(flight.retries, self.retry_backoff_s))
        return await self.pick(flight, tried)

    def untried(self, tried: set[int]) -> bool:
        """A ready engine outside ``tried`` exists (a 5xx is retried only on an engine that has not
        answered this request yet: an input every engine fails on is not sent round forever)."""
        return any(e.accepting and e.index not in tried for e in self.fleet.engines)

    def engine_failed(self, instance: int, why: str) -> None:
        self.breakers.failure(instance, why)
        e, backend = self.fleet.engines[instance], self.fleet.backend
        if not (e.serving and backend.probe_on_failure):
            return
        if not backend.probe_in_thread:
            if not backend.alive(e):
                self.fleet.mark_dead(e, why)
        elif instance not in self._probes:   # one probe per engine at a time, off the event loop
            task = asyncio.get_running_loop().create_task(self._probe(e, why))
            self._probes[instance] = task
            task.add_done_callback(lambda _: self._probes.pop(instance, None))

    async def _probe(self, e, why: str) -> None:
        if e.serving and not await asyncio.to_thread(self.fleet.backend.alive, e):
            self.fleet.mark_dead(e, why)

    def engine_ok(self, instance: int) -> None:
        """An engine answered a request (its first chunk): its breaker closes, and it was heard
        from (an attached engine's supervisor then spares it a health probe)."""
        self.breakers.success(instance)
        self.fleet.engines[instance].heard_s = time.monotonic()

    def find(self, key: Any) -> Flight | None:
        """The flight a client's id names: the id it sees in answers, its own ``request_id``, or
        the front end's internal one."""
        if not isinstance(key, str):
            return None
        return self.by_visible.get(key) or self.flights.get(key)

    def account(self, f: Flight) -> None:
        if f.visible_id and f.visible_id not in self.by_visible:
            self.by_visible[f.visible_id] = f
        key = (f.instance, f.started, (f.prompt_len + len(f.generated)) // 8)
        if f.booked == key:   # the book counts blocks: skip updates that change nothing
            return
        f.booked = key
        self.book.put(f.instance, f.rid, f.prompt_len, len(f.generated), f.started)

    async def migrate_kv(self, flight: Flight, src: int, dst: int) -> dict:
        """Move the KV of the flight's tokens from ``src``'s prefix cache to ``dst``'s (the control
        port's ``kv_export``, :meth:`ControlClient.kv_export`). Raises when nothing could be moved."""
        s, d = self.fleet.engines[src], self.fleet.engines[dst]
        if not (s.control_url and d.control_url):
            raise RuntimeError("KV transfer needs kunserve engines (a control port on both)")
        return await self.control.kv_export(self.session, s.control_url, d.control_url,
                                            flight.prompt_ids + flight.generated)

    # -- requests -----------------------------------------------------------------------------------
    def count_tokens(self, kind: str, body: dict) -> list[int]:
        tok = self.tokenizer
        if kind == "chat":
            if tok is None or not getattr(tok, "chat_template", None):
                return [0]   # the engine renders and checks the template itself
            try:
                ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            except Exception as e:
                raise BadRequest(f"messages: {e}", param="messages") from None
            return [len(ids["input_ids"] if hasattr(ids, "keys") else ids)]
        p = body.get("prompt")
        special = body.get("add_special_tokens", True)
        if isinstance(p, str):
            p = [p]
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            check_token_ids(p, self.max_token_id)
            return [len(p)]
        out = []
        for x in p or []:
            if isinstance(x, str):
                if not encodes(x):   # valid JSON ("\udc80"), but no text a tokenizer takes
                    raise BadRequest("prompt: not valid Unicode text (a lone UTF-16 surrogate)", param="prompt")
                out.append(self._count(x, bool(special)) if self._count is not None else 0)
            elif isinstance(x, list):
                check_token_ids(x, self.max_token_id)
                out.append(len(x))
            else:   # e.g. [0.0]: pydantic's lax mode lets a whole float pass as a token id
                raise BadRequest(f"prompt: {x!r} is neither text nor a token id (an integer)", param="prompt")
        return out or [0]

    async def acquire(self) -> None:
        try:
            await asyncio.wait_for(self._sem.acquire(), self.queue_timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(f"the front end has {self.max_concurrency} requests upstream and this one waited "
                             f"{self.queue_timeout_s:g} s", status=503, kind="ServiceUnavailableError") from None

    def status(self) -> dict:
        reps = {v["instance"]: v for v in self.monitor.views(e.index for e in self.fleet.engines)}
        instances = []
        for e in self.fleet.engines:
            rep = reps.get(e.index, {})
            instances.append({**e.view(), "inflight": self.book.count(e.index), "kv": rep})
        return {"dispatch": self.dispatch, "served_models": self.served, "max_model_len": self.max_model_len,
                "inflight": len(self.flights), "instances": instances,
                "groups": self.groups.view() if self.groups else [],
                "breakers": self.breakers.view(),
                "drop": ({"auto": self.groups.auto, **self.groups.last} if self.groups else None),
                "admission": self.gate.view() if self.gate is not None else None,
                "elastic": self.elastic.status() if self.elastic is not None else None,
                "requests": [{"id": f.visible_id or f.rid, "instance": f.instance, "generated": len(f.generated),
                              "movable": f.checked.movable, "hops": len(f.hops)}
                             for f in itertools.islice(self.flights.values(), 200)],
                "memory": {str(e.index): reps.get(e.index, {}).get("capacity_blocks") for e in self.fleet.engines},
                "monitor": {"interval_s": self.monitor.interval_s, "polls": self.monitor.polls},
                "gc": {"frozen_objects": self.gc_frozen, **self.gc.view()},
                "loop": self.loop_lag.view(),
                "relay_reads": READS.view(),
                "events": (self.fleet.events[-30:] + self.events[-30:])}


def build_app(front: FrontEnd):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await front.start()
        try:
            yield
        finally:
            await front.close()

    app = FastAPI(title="kunserve", docs_url=None, redoc_url=None, lifespan=lifespan)

    def err(e: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.status, e.kind, e.param), status_code=e.status,
                            headers=e.headers or None)

    def authorized(request: Request) -> bool:
        if not front.token:
            return True
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {front.token}".encode())

    async def generate(kind: str, request: Request):
        t_in = time.monotonic()
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        try:
            body = parse_json(await request.body())
            checked = validate(kind, body, served=front.served, max_model_len=front.max_model_len,
                               count_tokens=front.count_tokens)
            priority = parse_priority(request.headers.get(PRIORITY_HEADER))
        except BadRequest as e:
            front.m_requests.labels(kind, "client_error").inc()
            return err(e)
        rid = f"ks-{next(front._ids)}"
        try:
            if front.gate is not None:
                place = front.gate.try_enter(rid, checked, priority)
                if place is not None and await until_disconnect(request.receive, front.gate.wait(place)) is None:
                    front.m_requests.labels(kind, "aborted").inc()   # the client left while queued
                    return Response(status_code=499)
            try:
                await front.acquire()
            except BadRequest:
                if front.gate is not None:
                    front.gate.leave(rid)
                raise
        except BadRequest as e:
            front.m_requests.labels(kind, "shed" if e.status == 429 else "rejected").inc()
            return err(e)
        model = body.get("model") or front.served[0]
        flight = Flight(rid, checked, -1, model)
        user = body.get("user")
        flight.session = request.headers.get("x-session-id") or (user if isinstance(user, str) else None)
        released = False

        def release(outcome: str) -> None:
            nonlocal released
            if released:
                return
            released = True
            front._sem.release()
            if front.gate is not None:
                front.gate.leave(rid)
            front.book.drop(rid)
            front.flights.pop(rid, None)
            for key in (flight.visible_id, body.get("request_id")):
                if isinstance(key, str) and front.by_visible.get(key) is flight:
                    front.by_visible.pop(key, None)
            front.m_inflight.set(len(front.flights))
            front.m_requests.labels(kind, outcome).inc()

        try:
            flight.instance = await front.pick(flight, set())
        except UpstreamLost as e:
            release("failed")
            return err(BadRequest(str(e), status=503, kind="ServiceUnavailableError"))
        front.flights[rid] = flight
        if isinstance(body.get("request_id"), str):  # the client's own id also names the flight
            front.by_visible[body["request_id"]] = flight
            waiter = front.arrivals.pop(body["request_id"], None)
            if waiter is not None:
                waiter.set()
        front.m_inflight.set(len(front.flights))
        front.m_dispatch.labels(str(flight.instance)).inc()
        front.account(flight)
        if checked.stream:
            relay = Relay(front, flight)
            t_sent = time.monotonic()
            try:
                resp = await relay.open_first()
            except Exception as e:
                release("failed")
                return err(BadRequest(f"no engine reachable: {e}", status=503, kind="ServiceUnavailableError"))
            if resp.status != 200:  # the engine's own error, with its status code
                data = await resp.read()
                resp.release()
                release("engine_error")
                return Response(data, status_code=resp.status, media_type=resp.content_type)

            def finish(outcome: str) -> None:
                relay.close(resp)
                # a stream that ended in an error event reached its end, but the request was lost
                release("failed" if relay.failed else "engine_error" if relay.refused else outcome)

            def first_sent() -> None:   # the first token is with the client: where its wait went
                if relay.first_read is not None:
                    front.m_stage.labels("admit").observe(t_sent - t_in)
                    front.m_stage.labels("engine").observe(relay.first_read - t_sent)
                    front.m_stage.labels("relay").observe(time.monotonic() - relay.first_read)
            return EventStream(relay.stream(resp), rid, finish, first_sent)

        async def whole():
            tried: set[int] = set()
            while True:
                url = front.engine_url(flight.instance)
                try:
                    if url is None:
                        raise aiohttp.ClientConnectionError(f"instance {flight.instance} not ready")
                    async with front.session.post(url + path, json=body) as resp:
                        data = await resp.read()
                        if resp.status < 500:
                            front.engine_ok(flight.instance)
                            return resp.status, data, resp.content_type
                        if not front.untried(tried | {flight.instance}):   # every engine answered 5xx
                            return resp.status, data, resp.content_type
                    why = f"answered {resp.status}: {data[:200].decode(errors='replace')}"
                    kind = busy_or_status(resp.status)
                except aiohttp.ClientConnectionError as e:
                    why, kind = f"non-streamed: {e}", "connect"
                src = flight.instance
                flight.instance = await front.reroute(flight, tried, why, kind=kind)
                front.record("failover", request=rid, src=src, dst=flight.instance, tokens=0)
                front.account(flight)

        try:
            out = await until_disconnect(request.receive, whole())
        except Exception as e:
            release("failed")
            return err(BadRequest(f"request failed: {e}", status=503, kind="ServiceUnavailableError"))
        if out is None:
            release("aborted")
            return Response(status_code=499)
        status, data, ctype = out
        release("ok" if status == 200 else "engine_error")
        return Response(data, status_code=status, media_type=ctype, headers={"X-Request-Id": rid})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate("chat", request)

    @app.get("/v1/models")
    async def models():
        return Response(front.models_body, media_type="application/json")

    @app.get("/health")
    async def health():
        n = len(front.fleet.ready())
        return Response(status_code=200 if n else 503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import generate_latest

        async def one(e):
            try:
                async with front.session.get(f"{e.url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return e.index, await r.text()
            except Exception:
                return e.index, ""
        texts = dict(await asyncio.gather(*(one(e) for e in front.fleet.engines if e.serving)))
        body = generate_latest(front.registry).decode() + relabel_metrics({i: t for i, t in texts.items() if t})
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/kunserve/status")
    async def status():
        return JSONResponse(front.status())

    @app.post("/kunserve/ops/{op}")
    async def ops(op: str, request: Request):
        if not authorized(request):
            return err(BadRequest("missing or wrong bearer token", status=401, kind="AuthenticationError"))
        try:
            return JSONResponse(await run_op(front, op, parse_json(await request.body())))
        except BadRequest as e:
            return err(e)

    hot = HotPaths(app, {"/v1/completions": "completion", "/v1/chat/completions": "chat"}, generate, Request)
    if not front.api_keys:
        return hot
    # vLLM's own check, as `vllm serve --api-key` runs it: every /v1 route (hot paths included) needs
    # `Authorization: Bearer <one of the keys>`, compared in constant time; /health, /metrics and
    # /kunserve/* do not (the operations have their own token)
    from vllm_kunserve.integration.vllm.base import VllmPatch
    from vllm_kunserve.integration.vllm.versions import located

    guard = VllmPatch.resolve(located("AuthenticationMiddleware"))(hot, tokens=list(front.api_keys))

    async def guarded(scope, receive, send) -> None:   # a coroutine function: servers take it as ASGI 3
        await guard(scope, receive, send)               # (vLLM's __call__ returns an awaitable)
    return guarded


class EventStream:
    """A streamed answer written straight to the ASGI server: every chunk the relay yields is one
    ``send``, with no middleware wrapping each one (Starlette's ``StreamingResponse`` passes each
    through its error and exception middleware's senders), and no generator between the relay and
    the ``send`` (each layer costs every token a step). A client that disconnects cancels the
    relay, which closes the engine's request (vLLM aborts it). ``finish`` is called once at the
    end with ``"ok"`` (every chunk sent) or ``"aborted"``."""

    def __init__(self, chunks: AsyncIterator[bytes], rid: str, finish: Callable[[str], None] | None = None,
                 first_sent: Callable[[], None] | None = None):
        self.chunks, self.rid, self.finish, self.first_sent = chunks, rid, finish, first_sent
        self._closed = False

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"x-request-id", self.rid.encode())]})
            await until_disconnect(receive, self._pump(send))
        except OSError:   # the client's connection went
            pass
        finally:   # a no-op after the pump's; where the pump never ran (the client went first), the cleanup
            await self._close("aborted")

    async def _close(self, outcome: str) -> None:
        """Once: the relay's own cleanup (engine stream closed), then ``finish`` (the flight released)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.chunks.aclose()
        finally:
            if self.finish is not None:
                self.finish(outcome)

    async def _pump(self, send) -> None:
        outcome = "aborted"
        try:
            first = self.first_sent
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if first is not None:
                    first()
                    first = None
            outcome = "ok"
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._close(outcome)


async def until_disconnect(receive, coro):
    """Run ``coro`` until it ends (its result; its exception raised) or the client disconnects first
    (``coro`` cancelled, which closes its upstream request; None)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class HotPaths:
    """The ASGI app ``kunserve serve`` runs: POSTs to the generation paths go straight to their
    handler, everything else (and the lifespan) to the FastAPI app. A relayed request is the front
    end's hot path: FastAPI's routing and middleware stack cost about as much per request as the
    relay itself, on the way to every first token."""

    def __init__(self, app, paths: dict[str, str], handler, request_cls):
        self.app, self.paths, self.handler, self.request_cls = app, paths, handler, request_cls

    async def __call__(self, scope, receive, send) -> None:
        kind = self.paths.get(scope.get("path")) if scope["type"] == "http" else None
        if kind is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        response = await self.handler(kind, self.request_cls(scope, receive))
        await response(scope, receive, send)
