"""Chaos under a burst (issue 36): a fleet behind ``kunserve serve`` serves a burst of streamed
requests while a driver hard-kills a random engine every few seconds and forces drops and
restores; every request must complete with the same greedy tokens as in a run without faults.

:func:`run_chaos` drives a running fleet (its front end's URL): first the reference (every request
once, no faults), then the same requests at their arrival times with the driver running. It
returns the requests' results, the driver's actions and the front end's events, and
:func:`summarise` counts what happened (kills, transitions, failovers, re-prefills) and the tail
TTFT of the requests that were in flight when an engine died. ``benchmarks/chaos.py`` writes the
doc; ``tests/vllm/test_cluster_drop.py`` runs a short one on its 4-engine fleet.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_kunserve.bench.client import RequestResult, RequestSpec, replay
from vllm_kunserve.workload.stats import percentile

__all__ = ["ChaosSpec", "run_chaos", "summarise"]


@dataclass(frozen=True)
class ChaosSpec:
    requests: int = 120
    duration_s: float = 40.0       # arrivals spread over this (Poisson)
    prompt_len: tuple[int, int] = (16, 96)
    output_len: int = 64
    kill_every_s: float = 8.0      # one kill per period, while more than ``min_ready`` engines are ready
    min_ready: int = 1             # never kill below this many ready engines (restarts take a while)
    # in turn, one per period: a forced drop of two random ready engines, a drop of every ready engine
    # (a regroup where live groups lie whole inside it: their KV moves, nothing recomputed), a restore
    ops_every_s: float = 5.0
    seed: int = 0
    model: str = "m"


@dataclass
class ChaosRun:
    spec: ChaosSpec
    reference: list[RequestResult]
    results: list[RequestResult]
    actions: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    t0: float = 0.0
    before: dict = field(default_factory=dict)   # the counters and restarts when the chaos pass began


def _specs(spec: ChaosSpec) -> list[RequestSpec]:
    rnd = random.Random(spec.seed)
    t, out = 0.0, []
    rate = spec.requests / spec.duration_s
    for i in range(spec.requests):
        n = rnd.randint(*spec.prompt_len)
        out.append(RequestSpec(i, t, [rnd.randrange(10, 250) for _ in range(n)], n, spec.output_len))
        t += rnd.expovariate(rate)
    return out


async def _get(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url) as r:
        return await r.json()


async def _op(s: aiohttp.ClientSession, url: str, name: str, body: dict, token: str) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with s.post(f"{url}/kunserve/ops/{name}", json=body, headers=headers) as r:
        try:
            return r.status, await r.json()
        except (aiohttp.ContentTypeError, ValueError):
            return r.status, await r.text()


async def _driver(url: str, spec: ChaosSpec, t0: float, stop: asyncio.Event, actions: list[dict], token: str) -> None:
    rnd = random.Random(spec.seed + 1)
    next_kill, next_op, op_n = spec.kill_every_s, spec.ops_every_s / 2, 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        while not stop.is_set():
            now = time.perf_counter() - t0
            try:
                st = await _get(s, f"{url}/kunserve/status")
            except (aiohttp.ClientError, asyncio.TimeoutError):
                await asyncio.sleep(0.2)
                continue
            ready = [i["instance"] for i in st["instances"] if i["state"] == "ready"]
            if now >= next_kill:
                next_kill += spec.kill_every_s
                if len(ready) > max(1, spec.min_ready):
                    victim = rnd.choice(ready)
                    code, res = await _op(s, url, "kill", {"instance": victim}, token)
                    actions.append({"t": round(now, 3), "action": "kill", "instance": victim, "status": code,
                                    "in_flight": len(res.get("in_flight", [])) if isinstance(res, dict) else None})
                    ready.remove(victim)
            if now >= next_op:
                next_op += spec.ops_every_s
                kind = ("pair", "all", "restore")[op_n % 3]
                op_n += 1
                if kind != "restore" and len(ready) >= 2:
                    members = sorted(rnd.sample(ready, 2)) if kind == "pair" else sorted(ready)
                    code, res = await _op(s, url, "drop", {"instances": members}, token)
                    actions.append({"t": round(now, 3), "action": "drop", "kind": kind, "instances": members,
                                    "status": code, "error": None if code == 200 else str(res)[:200],
                                    "regrouped": res.get("regrouped") if isinstance(res, dict) else None,
                                    "kept_kv": bool(res.get("kept_kv")) if isinstance(res, dict) else False})
                elif kind == "restore":
                    code, res = await _op(s, url, "restore", {}, token)
                    actions.append({"t": round(now, 3), "action": "restore", "status": code,
                                    "error": None if code == 200 else str(res)[:200]})
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass


async def run_chaos(url: str, spec: ChaosSpec, token: str = "") -> ChaosRun:
    """The reference pass, then the chaos pass with the driver, on the fleet at ``url``."""
    specs = _specs(spec)
    extra = {"return_token_ids": True}
    reference = await replay(url, spec.model, [RequestSpec(s.idx, 0.0, s.prompt, s.prompt_len, s.output_len)
                                               for s in specs], progress=False, extra_body=extra)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        before = await _fleet_counts(s, url)   # a fleet that served before (tests share one) counted then too
    stop, actions = asyncio.Event(), []
    started: list[float] = []
    driver: asyncio.Task | None = None

    def on_start(t0: float) -> None:
        nonlocal driver
        started.append(t0)
        driver = asyncio.get_running_loop().create_task(_driver(url, spec, t0, stop, actions, token))
    try:
        results = await replay(url, spec.model, specs, progress=False, extra_body=extra, on_start=on_start,
                               request_timeout_s=600.0)
    finally:
        stop.set()
        if driver is not None:
            await driver
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        st = await _fleet_counts(s, url)
    return ChaosRun(spec, reference, results, actions, st.get("events", []), st, started[0] if started else 0.0,
                    before)


async def _fleet_counts(s: aiohttp.ClientSession, url: str) -> dict:
    """The front end's status with its ``kunserve:`` counters under ``metrics``."""
    st = await _get(s, f"{url}/kunserve/status")
    async with s.get(f"{url}/metrics") as r:
        st["metrics"] = _counters(await r.text())
    return st


def _counters(text: str) -> dict[str, float]:
    """The front end's ``kunserve:`` counters (summed over their labels but ``op`` / ``outcome``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("kunserve:") or fam.type != "counter":
            continue
        for smp in fam.samples:
            if not smp.name.endswith("_total"):
                continue
            key = fam.name + "".join(f"{{{k}={smp.labels[k]}}}" for k in ("op", "outcome") if k in smp.labels)
            out[key] = out.get(key, 0.0) + smp.value
    return out


def summarise(run: ChaosRun, fault_window_s: float = 10.0) -> dict:
    """Completion and token identity per request, counts of what the driver and the fleet did, and
    the TTFT of requests in flight at a kill (sent before it, first token after it or within
    ``fault_window_s`` after)."""
    ref = {r.idx: r for r in run.reference}
    ok = [r for r in run.results if r.ok]
    same = [r for r in ok if r.token_ids and r.token_ids == ref[r.idx].token_ids]
    kills = [a["t"] for a in run.actions if a["action"] == "kill" and a["status"] == 200]

    def near_kill(r: RequestResult) -> bool:
        end = r.send_s + (r.e2e_s if r.e2e_s == r.e2e_s else 0.0)
        return any(r.send_s <= k + fault_window_s and end >= k for k in kills)
    during = [r.ttft_s for r in ok if near_kill(r)]
    calm = [r.ttft_s for r in ok if not near_kill(r)]
    m0 = run.before.get("metrics", {})
    m = {k: v - m0.get(k, 0.0) for k, v in run.status.get("metrics", {}).items()}   # the chaos pass's own
    r0 = {i["instance"]: i.get("restarts", 0) for i in run.before.get("instances", [])}
    ttft = lambda xs: ({"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99),  # noqa: E731
                        "max": max(xs)} if xs else {"n": 0})
    return {
        "requests": len(run.results), "completed": len(ok), "token_identical": len(same),
        "reference_ok": sum(1 for r in run.reference if r.ok),
        "failed": [{"idx": r.idx, "error": r.error[:200]} for r in run.results if not r.ok][:20],
        "differ": [r.idx for r in ok if r not in same][:20],
        "kills": len(kills), "drops_ok": sum(1 for a in run.actions if a["action"] == "drop" and a["status"] == 200),
        "drops_refused": sum(1 for a in run.actions if a["action"] == "drop" and a["status"] != 200),
        "restores": sum(1 for a in run.actions if a["action"] == "restore"),
        "regroups_kept_kv": sum(1 for a in run.actions if a["action"] == "drop" and a["status"] == 200
                                and a.get("kept_kv")),
        "fleet": {"group_ops": {k.split("kunserve:group_ops", 1)[1]: int(v) for k, v in m.items()
                                if k.startswith("kunserve:group_ops")},
                  "failovers": int(sum(v for k, v in m.items() if k.startswith("kunserve:failovers"))),
                  "migrations": int(sum(v for k, v in m.items() if k.startswith("kunserve:migrations"))),
                  "engine_restarts": int(sum(v for k, v in m.items() if k.startswith("kunserve:engine_restarts")))},
        "restarts": {str(i["instance"]): i.get("restarts", 0) - r0.get(i["instance"], 0)
                     for i in run.status.get("instances", [])},
        "ttft_near_kill": ttft(during), "ttft_calm": ttft(calm),
    }
