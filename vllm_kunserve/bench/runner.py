"""One benchmark run against a live endpoint: warm up, replay with metrics scraping, write outputs."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from vllm_kunserve.bench import metrics as M
from vllm_kunserve.bench import report
from vllm_kunserve.bench.client import RequestResult, RequestSpec, completions_url, replay
from vllm_kunserve.bench.hostwatch import stall_windows
from vllm_kunserve.bench.prompts import PromptFactory
from vllm_kunserve.bench.scrape import Scraper, scrape_once
from vllm_kunserve.runtime.gcpause import GcPauses, freeze_heap
from vllm_kunserve.runtime.looplag import LoopLag
from vllm_kunserve.workload.kvdemand import DemandModel, kv_demand
from vllm_kunserve.workload.traces import Trace


@dataclass
class BenchOptions:
    endpoint: str
    model: str  # served model name
    request_timeout_s: float = 300.0
    deadline_s: float | None = None  # whole replay; default: trace duration + request timeout
    warmup: int = 2
    progress: bool = True
    scrape: bool = True
    scrape_interval_s: float = 1.0
    plots: bool = True
    ref_ttft_s: float | None = None
    ref_tpot_s: float | None = None
    title: str = ""
    realtime: bool = False  # replay from a SCHED_FIFO thread (see client_sched)
    max_concurrency: list[tuple[float, int]] | None = None  # in-flight limit from each time on (client.replay)


@contextmanager
def client_sched(realtime: bool, out: dict[str, Any]):
    """Run the block with this thread at real-time priority (``SCHED_FIFO`` 1, with
    ``SCHED_RESET_ON_FORK`` so no thread or process it starts inherits it) when ``realtime``; the
    previous policy comes back after. The client needs a few percent of a core, but at its send
    times: on a host whose cores the engines, their API servers and the front end keep busy, its
    loop waited up to seconds for a core at normal priority (``runtime/looplag.py``: runnable, not
    running). ``out`` records what was asked and what was granted (refused: no root or
    CAP_SYS_NICE, or not Linux; the replay then runs at normal priority and says so)."""
    out.update(realtime_asked=realtime, realtime=False)
    if not realtime:
        yield
        return
    try:
        prev = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    except (AttributeError, OSError) as e:
        out["realtime_error"] = f"{type(e).__name__}: {e}"
        print(f"client: real-time priority refused ({out['realtime_error']}); replaying at normal priority",
              file=sys.stderr)
        yield
        return
    out["realtime"] = True
    try:
        yield
    finally:
        os.sched_setscheduler(0, prev[0], prev[1])


def build_specs(trace: Trace, factory: PromptFactory) -> list[RequestSpec]:
    specs = []
    for i in range(len(trace)):
        n = int(trace.prompt_len[i])
        prompt = factory.make(n, key=i)
        specs.append(RequestSpec(i, float(trace.arrival_s[i]), prompt, n, int(trace.output_len[i])))
    return specs


async def _warmup(endpoint: str, model: str, factory: PromptFactory, n: int, timeout_s: float) -> None:
    """A few short requests, not recorded, so lazy initialisation does not land on the first arrivals."""
    if n <= 0:
        return
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        for k in range(n):
            body = {"model": model, "prompt": factory.make(16, key=10_000_000 + k), "max_tokens": 4,
                    "ignore_eos": True, "temperature": 0.0}
            async with s.post(completions_url(endpoint), json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"warm-up request failed: HTTP {r.status}: {(await r.text())[:300]}")
                await r.read()


async def _run(opts: BenchOptions, factory: PromptFactory, specs: list[RequestSpec],
               deadline_s: float, t0s: list[float], gc_pauses: GcPauses,
               loop_lag: LoopLag, sched: dict[str, Any]) -> tuple[list, Scraper | None]:
    await _warmup(opts.endpoint, opts.model, factory, opts.warmup, opts.request_timeout_s)
    # this process stamps every token: the tokenizer's and the harness's heap out of the collector's
    # scans from here on (KUNSERVE_GC_FREEZE=0 to measure without), and every pause timed
    freeze_heap()
    gc_pauses.install()
    loop_lag.start()  # every late wake-up of this loop, with what its thread did meanwhile
    scraper = Scraper(opts.endpoint, opts.scrape_interval_s) if opts.scrape else None
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []

    def on_start(t0: float) -> None:
        t0s.append(t0)
        if scraper is not None:
            scraper.t0 = t0
            tasks.append(asyncio.create_task(scraper.run(stop)))

    try:
        with client_sched(opts.realtime, sched):
            results = await replay(opts.endpoint, opts.model, specs, request_timeout_s=opts.request_timeout_s,
                                   deadline_s=deadline_s, progress=opts.progress, on_start=on_start,
                                   max_concurrency=opts.max_concurrency)
    finally:
        gc_pauses.remove()
        await loop_lag.stop()
        stop.set()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    if scraper is not None:  # one last sample after the replay so counters include the tail
        try:
            values, info = await scrape_once(opts.endpoint)
            scraper.samples.append((time.perf_counter() - scraper.t0, values))
            scraper.cache_info = scraper.cache_info or info
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
    return results, scraper


@dataclass
class BenchRun:
    summary: dict[str, Any]
    results: list[RequestResult]


def run_bench(trace: Trace, factory: PromptFactory, opts: BenchOptions, out: Path, *,
              demand_model: DemandModel | None = None, kv_capacity_tokens: int | None = None,
              workload_info: dict[str, Any] | None = None) -> BenchRun:
    """Replay ``trace`` against ``opts.endpoint``; write the run's files under ``out``."""
    if len(trace) == 0:
        raise ValueError("the trace holds no request")
    specs = build_specs(trace, factory)
    # a closed loop's requests wait their turn: each slot runs its share of them one after another
    turns = -(-len(trace) // min(c for _, c in opts.max_concurrency)) if opts.max_concurrency else 1
    deadline = opts.deadline_s if opts.deadline_s else trace.duration_s + turns * opts.request_timeout_s + 5.0
    t0s: list[float] = []
    gc_pauses, loop_lag, sched = GcPauses(), LoopLag(), {}
    results, scraper = asyncio.run(_run(opts, factory, specs, deadline, t0s, gc_pauses, loop_lag, sched))
    series = scraper.series() if scraper else []
    demand = kv_demand(trace, demand_model) if demand_model else None
    rows = M.timeline(results, series, demand)
    summary = M.summarize(results, scrape_series=series, ref_ttft_s=opts.ref_ttft_s, ref_tpot_s=opts.ref_tpot_s)
    mismatched = sum(1 for r in results if r.ok and r.server_prompt_tokens >= 0 and r.server_prompt_tokens != r.prompt_len)
    summary["prompt_token_mismatches"] = mismatched
    summary["trace"] = trace.describe()
    summary["workload"] = workload_info or {}
    summary["bench"] = {k: v for k, v in asdict(opts).items()}
    # the replay's zero on time.perf_counter (host samples are on that clock) and the intervals in
    # which no streamed token arrived while requests were in flight, from that zero
    summary["replay_t0_perf"] = t0s[0] if t0s else None
    summary["client_gc"] = gc_pauses.view()
    summary["client_loop"] = loop_lag.view(n=500)
    summary["client_sched"] = sched
    summary["stalls"] = [{"start_s": round(a, 3), "end_s": round(b, 3), "gap_s": round(b - a, 3), "active": n}
                         for a, b, n in stall_windows((r.send_s, r.token_times) for r in results if r.ok)]
    if scraper is not None:
        summary["server_cache_config"] = scraper.cache_info
        summary["scrape_errors"] = scraper.errors
        if scraper.errors:
            summary["scrape_last_error"] = scraper.last_error
    if kv_capacity_tokens:
        summary["kv_capacity_tokens"] = kv_capacity_tokens
    summary["files"] = report.write_run(out, results, rows, summary, title=opts.title,
                                        kv_capacity_tokens=kv_capacity_tokens, plots=opts.plots)
    report.write_json(out / "summary.json", summary)
    return BenchRun(summary, results)
