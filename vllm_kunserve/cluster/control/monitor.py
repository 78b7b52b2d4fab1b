"""The global monitor: polls every engine and keeps what dispatch, migration and status read.

Each period it reads, per ready engine, its control port ``GET /state`` (kunserve engines: block
capacity, which changes when an engine remaps or drops; used/queued blocks; layer states; events)
or, for stock engines, the engine's Prometheus ``/metrics`` (``vllm:cache_config_info`` for the
block count, ``vllm:kv_cache_usage_perc``, running and waiting counts) every ``metrics_interval_s``. What it reads is the
engine's view; the front end adds its own exact, instantaneous account of the requests it has in
flight on each engine (:class:`FlightBook`) when it builds the policy's snapshots in
:func:`instance_loads`, so dispatch never acts on a stale poll between two periods.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import aiohttp

from vllm_kunserve.cluster.control.client import ControlClient
from vllm_kunserve.engine.state import EngineState
from vllm_kunserve.policy.dispatch import InstanceLoad

logger = logging.getLogger("kunserve.monitor")

__all__ = ["EngineReport", "FlightBook", "Monitor", "instance_loads", "parse_vllm_metrics"]

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_vllm_metrics(text: str) -> dict[str, Any]:
    """Blocks and requests from an engine's ``/metrics`` text (sums over its label sets)."""
    out: dict[str, Any] = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name == "vllm:num_requests_running":
            out["running"] += float(value)
        elif name == "vllm:num_requests_waiting":
            out["waiting"] += float(value)
        elif name == "vllm:kv_cache_usage_perc":
            out["kv_usage"] = max(out["kv_usage"], float(value))
        elif name == "vllm:cache_config_info":
            lab = dict(_LABEL.findall(labels))
            for key in ("num_gpu_blocks", "block_size"):
                if lab.get(key, "None") not in ("None", ""):
                    out[key] = int(float(lab[key]))
    return out


@dataclass
class EngineReport:
    """The latest poll of one engine."""

    instance: int
    t: float = 0.0
    ok: bool = False
    source: str = ""                      # "control" | "metrics"
    capacity_blocks: int = 0
    block_size: int = 16
    used_blocks: int = 0
    queued_blocks: int = 0
    running: int = 0
    waiting: int = 0
    state: dict | None = None             # the control port's whole state, as sent (kunserve engines)
    engine_state: EngineState | None = None   # the same, parsed
    error: str = ""

    def view(self) -> dict:
        d = {"instance": self.instance, "polled_s_ago": round(time.time() - self.t, 2) if self.t else None,
             "ok": self.ok, "source": self.source, "capacity_blocks": self.capacity_blocks,
             "block_size": self.block_size, "used_blocks": self.used_blocks, "queued_blocks": self.queued_blocks,
             "running": self.running, "waiting": self.waiting}
        if self.error:
            d["error"] = self.error
        if self.state:
            d["engine"] = {k: self.state.get(k) for k in ("phase", "operation", "auto", "errors", "remapped_layers",
                                                          "dropped_layers", "group", "layers", "events",
                                                          "requests", "pipeline")}
            # the host the engine groups by is in its info (``engine.host``): the machine, or its Ray node
            d["engine"]["host"] = (self.state.get("engine") or {}).get("host")
        return d


@dataclass
class _Tally:
    requests: int = 0
    used_tokens: int = 0         # tokens whose KV exists (started requests: prompt + generated)
    queued_prompt_tokens: int = 0  # prompts not yet answered with a first token
    awaiting: int = 0              # requests not yet answered with a first token
    used_blocks: int = 0
    queued_blocks: int = 0


class FlightBook:
    """The front end's exact account of what it has in flight on each engine, in tokens."""

    def __init__(self) -> None:
        self._by_instance: dict[int, dict[str, tuple[int, int, bool]]] = {}
        self._where: dict[str, int] = {}

    def put(self, instance: int, rid: str, prompt_tokens: int, generated: int, started: bool) -> None:
        self.drop(rid)
        self._where[rid] = instance
        self._by_instance.setdefault(instance, {})[rid] = (prompt_tokens, generated, started)

    def drop(self, rid: str) -> None:
        if rid in self._where:
            self._by_instance[self._where.pop(rid)].pop(rid, None)

    def tally(self, instance: int, block_size: int) -> _Tally:
        t = _Tally()
        bs = max(block_size, 1)
        for prompt, gen, started in self._by_instance.get(instance, {}).values():
            t.requests += 1
            if started:
                t.used_tokens += prompt + gen
                t.used_blocks += math.ceil((prompt + gen) / bs)
            else:
                t.awaiting += 1
                t.queued_prompt_tokens += prompt
                t.queued_blocks += math.ceil(prompt / bs)
        return t

    def count(self, instance: int) -> int:
        return len(self._by_instance.get(instance, {}))


def instance_loads(engines: Sequence[Any], reports: dict[int, EngineReport], book: FlightBook,
                   group_of: Callable[[int], int | None] = lambda i: None) -> list[InstanceLoad]:
    """The dispatch policy's snapshot: capacity from the engine's last poll, load from the book
    (exact and current for requests through this front end) or the poll, whichever is larger;
    ``group_of(index)``: the pipeline group an engine is a member of, if any."""
    out = []
    for e in engines:
        r = reports.get(e.index)
        bs = r.block_size if r and r.ok else 16
        t = book.tally(e.index, bs)
        cap = r.capacity_blocks if r and r.ok and r.capacity_blocks else 0
        used = max(t.used_blocks, r.used_blocks if r and r.ok else 0)
        queued = max(t.queued_blocks, r.queued_blocks if r and r.ok else 0)
        out.append(InstanceLoad(instance_id=e.index, used_blocks=used, queued_blocks=queued,
                                capacity_blocks=cap or max(used + queued, 1),
                                queued_prefill_tokens=t.queued_prompt_tokens, requests=t.requests,
                                alive=bool(e.accepting), group=group_of(e.index)))
    return out


@dataclass
class Monitor:
    """Polls the fleet's engines every ``interval_s`` on the front end's event loop."""

    engines: Sequence[Any]
    interval_s: float = 0.5
    timeout_s: float = 2.0
    metrics_interval_s: float = 10.0
    token: str = ""
    reports: dict[int, EngineReport] = field(default_factory=dict)
    polls: int = 0
    listeners: list = field(default_factory=list)   # called after each period with the reports

    @property
    def client(self) -> ControlClient:
        """The client of the engines' control ports, with the monitor's token as it is now."""
        return ControlClient(self.token)

    async def poll_one(self, session: aiohttp.ClientSession, e: Any) -> EngineReport:
        r = EngineReport(e.index, t=time.time())
        try:
            if e.control_url:
                st = await self.client.state_json(session, e.control_url)
                es = EngineState.from_dict(st)
                r.source, r.state, r.engine_state = "control", st, es
                r.capacity_blocks = es.capacity.blocks_total or 0
                r.block_size = es.capacity.block_size or 16
                r.used_blocks, r.queued_blocks = es.blocks.used or 0, es.blocks.queued or 0
                r.running, r.waiting = es.requests.running or 0, es.requests.waiting or 0
            else:
                async with session.get(f"{e.url}/metrics") as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"/metrics answered {resp.status}")
                    m = parse_vllm_metrics(await resp.text())
                r.source = "metrics"
                r.capacity_blocks = int(m.get("num_gpu_blocks", 0))
                r.block_size = int(m.get("block_size", 16))
                r.used_blocks = int(round(m["kv_usage"] * max(r.capacity_blocks - 1, 0)))
                r.running, r.waiting = int(m["running"]), int(m["waiting"])
            r.ok = True
        except Exception as exc:  # an unreachable engine is the supervisor's business, not ours
            r.error = f"{type(exc).__name__}: {exc}"[:300]
        return r

    def due(self, e: Any, now: float) -> bool:
        """Control ports are read every period; a stock engine's ``/metrics`` (vLLM renders it in its
        API server's event loop, tens of ms for a multiprocess registry) only every
        ``metrics_interval_s``: its capacity does not change and the front end's own book is the
        current load."""
        prev = self.reports.get(e.index)
        return bool(e.control_url) or prev is None or not prev.ok or now - prev.t >= self.metrics_interval_s

    async def poll(self, session: aiohttp.ClientSession) -> None:
        now = time.time()
        live = [e for e in self.engines if e.serving and self.due(e, now)]
        for r in await asyncio.gather(*(self.poll_one(session, e) for e in live)):
            prev = self.reports.get(r.instance)
            if not r.ok and prev is not None and prev.ok:
                prev.error = r.error   # keep the last good numbers, note the miss
                continue
            self.reports[r.instance] = r
        self.polls += 1
        for cb in list(self.listeners):
            try:
                res = cb(self.reports)
                if asyncio.iscoroutine(res):
                    await res
            except Exception:
                logger.exception("monitor listener failed")

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                t0 = time.monotonic()
                await self.poll(session)
                try:
                    await asyncio.wait_for(stop.wait(), max(self.interval_s - (time.monotonic() - t0), 0.01))
                except asyncio.TimeoutError:
                    pass

    def views(self, instances: Iterable[int]) -> list[dict]:
        return [self.reports[i].view() if i in self.reports else {"instance": i, "ok": False} for i in instances]
