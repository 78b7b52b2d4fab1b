"""benchmarks/front_end.py's 1-stream level: requests alternate between the arms one at a time, the
order flipping every pair, and each pair's TTFT difference is what the summary reports."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from aiohttp import web

from tests.unit.benchmod import load_benchmark

pytestmark = pytest.mark.unit

fe = load_benchmark("front_end")


def _server(log: list, name: str, first_delay_s: float) -> web.Application:
    async def generate(request):
        log.append(name)
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(first_delay_s)
        for _ in range(body["max_tokens"]):
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    return app


def test_interleaved_pairs_measure_the_slower_arm_request_by_request():
    async def go():
        log, runners, urls = [], [], {}
        for name, delay in (("direct", 0.0), ("proxy", 0.02)):
            runner = web.AppRunner(_server(log, name, delay))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            out = await fe.interleaved(urls, n=3, requests=6)
        finally:
            for r in runners:
                await r.cleanup()
        return log, out

    log, out = asyncio.run(go())
    timed = log[2:]   # after one warm-up request per arm
    assert timed == ["direct", "proxy", "proxy", "direct"] * 3
    assert out["direct"]["requests"] == out["proxy"]["requests"] == 6
    assert len(out["paired_ttft_added_ms"]) == 6
    assert all(15 < d < 60 for d in out["paired_ttft_added_ms"]), out["paired_ttft_added_ms"]

    rows = [{"rep": k, "concurrency": 1, "paired_ttft_added_ms": [k + 1.0, k + 2.0, k + 3.0],
             "direct": {**out["direct"]}, "proxy": {**out["proxy"], "frontend_cpu_us_per_token": 1.0}}
            for k in range(3)]
    s = fe.summarize(rows)[0]["paired_ttft_added_p50_ms"]
    assert s["per_rep"] == [2.0, 3.0, 4.0] and s["median"] == 3.0 and (s["min"], s["max"]) == (2.0, 4.0)


def test_streams_keep_every_stream_busy_and_measure_the_steady_part():
    """Closed-loop streams: never more than ``concurrency`` requests in flight, each stream sends its
    next as its last ends, at least 8 requests per stream, and the throughput is that of c busy
    streams (each request takes the server's 20 ms to its first of 3 tokens)."""
    inflight, peak = [0], [0]

    async def generate(request):
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        try:
            body = await request.json()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(0.02)
            for _ in range(body["max_tokens"]):
                await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            inflight[0] -= 1

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            peak[0] = 0
            return await fe.streams(url, concurrency=4, n=3, min_requests=10)
        finally:
            await runner.cleanup()

    out = asyncio.run(go())
    assert peak[0] == 4
    assert out["sent"] == 32                  # max(10, 8 x 4)
    assert 0 < out["requests"] <= out["sent"] and out["steady_s"] > 0
    ideal = 4 * 3 / 0.02                       # 4 streams, 3 tokens per 20 ms request
    assert 0.3 * ideal < out["tokens_per_s"] < 1.2 * ideal, out
    assert 15 < out["ttft_p50_ms"] < 100


def test_the_stand_in_load_arm_is_summarised_beside_the_other_two():
    """Rows with the third arm (straight to the engine beside a stand-in load on the front end's core):
    its throughput over direct's, proxy's over it, the duties, and CPU per token by process and arm."""
    def arm(tps, cpu, **extra):
        return {"ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "itl_p50_ms": 1.0, "itl_p99_ms": 2.0,
                "tokens_per_s": tps, "send_lag_p99_ms": 0.0, "requests": 10, "sent": 12,
                "cpu_us_per_token": cpu, **extra}
    rows = []
    for k, (d, p, ld) in enumerate([(100.0, 90.0, 95.0), (100.0, 80.0, 100.0), (200.0, 190.0, 190.0)]):
        rows.append({"rep": k, "concurrency": 200,
                     "direct": arm(d, {"client": 1.0, "engine worker": 10.0}),
                     "proxy": arm(p, {"client": 1.0, "front end": 5.0, "engine worker": 12.0},
                                  frontend_cpu_us_per_token=5.0, frontend_duty=0.2),
                     fe.LOADED: arm(ld, {"client": 1.0, "engine worker": 11.0 + k},
                                    load_duty=0.19, load_duty_asked=0.2)})
    s = fe.summarize(rows)[0]
    ld = s["loaded"]
    assert ld["reps"] == 3
    assert ld["load_over_direct"] == {"median": 0.95, "min": 0.95, "max": 1.0, "n": 3}
    assert ld["proxy_over_load"]["median"] == pytest.approx(90 / 95)
    assert ld["proxy_over_load"]["min"] == pytest.approx(0.8) and ld["proxy_over_load"]["max"] == pytest.approx(1.0)
    assert (ld["duty_asked"], ld["duty_taken"], ld["frontend_duty"]) == (0.2, 0.19, 0.2)
    assert s["cpu_us_per_token"]["proxy"] == {"client": 1.0, "engine worker": 12.0, "front end": 5.0}
    assert s["cpu_us_per_token"][fe.LOADED]["engine worker"] == 12.0
    assert s["tokens_per_s_by_arm"] == {"direct": 100.0, "proxy": 90.0, fe.LOADED: 100.0}


def test_cpu_by_process_finds_the_engine_processes_below_the_front_end():
    """The engine's processes are the front end's descendants, named by what they run."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in fe.descendants(os.getpid())
        got = fe.cpu_by_process(os.getpid())
        assert {"client", "front end", "engine other"} <= set(got)
        assert all(v >= 0 for v in got.values())
    finally:
        child.kill()
        child.wait()


def test_where_time_goes_engine_view_cores_and_the_throughput_verdict():
    """The engine's own means come from its histogram deltas; the cores' shares from /proc/stat
    deltas; the no-loss verdict reads the median's 95% interval, not the median alone."""
    before = {"ttft_sum": 10.0, "ttft_count": 100.0, "e2e_sum": 50.0, "e2e_count": 100.0}
    after = {"ttft_sum": 13.0, "ttft_count": 110.0, "e2e_sum": 62.0, "e2e_count": 110.0}
    assert fe.engine_view(before, after) == {"engine_ttft_mean_ms": 300.0, "engine_e2e_mean_ms": 1200.0}
    assert fe.engine_view(after, after) == {}   # no request in between: no mean
    t0 = {"total": 1000, "idle": 400, "irq": 10, "steal": 0}
    t1 = {"total": 2000, "idle": 500, "irq": 60, "steal": 100}
    assert fe.core_shares(t0, t1) == {"engine_cores_busy": 0.9, "engine_cores_irq": 0.05, "engine_cores_steal": 0.1}
    now = fe.core_times(os.sched_getaffinity(0))
    assert now["total"] >= now["idle"] + now["irq"] + now["steal"] > 0

    assert "met" in fe.throughput_verdict({"ratio_ci95": (0.96, 1.04)})
    assert "missed" in fe.throughput_verdict({"ratio_ci95": (0.80, 0.97)})
    assert "not settled" in fe.throughput_verdict({"ratio_ci95": (0.85, 1.05)})
    assert "not settled" in fe.throughput_verdict({"ratio_ci95": None})
    rows = [{"rep": k, "concurrency": 200,
             "direct": {"ttft_p50_ms": 1, "ttft_p99_ms": 1, "itl_p50_ms": 1, "itl_p99_ms": 1, "tokens_per_s": 100.0,
                        "send_lag_p99_ms": 0, "ttft_mean_all_ms": 700.0, "engine_ttft_mean_ms": 500.0},
             "proxy": {"ttft_p50_ms": 1, "ttft_p99_ms": 1, "itl_p50_ms": 1, "itl_p99_ms": 1,
                       "tokens_per_s": 100.0 * (0.9 + 0.02 * k), "send_lag_p99_ms": 0, "frontend_cpu_us_per_token": 60,
                       "ttft_mean_all_ms": 760.0, "engine_ttft_mean_ms": 510.0}} for k in range(9)]
    s = fe.summarize(rows)[0]
    assert s["tokens_per_s"]["ratio_ci95"] == pytest.approx((0.92, 1.04))   # x_(2), x_(8) of 0.90..1.06
    assert s["where_time_goes"]["proxy"] == {"ttft_mean_all_ms": 760.0, "engine_ttft_mean_ms": 510.0}
    table = "\n".join(fe.where_time_goes_table([s]))
    assert "| 200 | proxy | 760.0 | 510.0 | - | 250.0 | - | - | - | - | - | - | - |" in table
    assert "not settled" in "\n".join(fe.throughput_verdicts([s]))


def test_analyse_only_quotes_the_measuring_run_not_the_re_render(tmp_path):
    """A doc re-written from raw data (``--analyse-only``) names the command and the machine load of
    the run that measured it, not its own."""
    import json
    import shutil
    from pathlib import Path

    raw = tmp_path / "fe.json"
    shutil.copy(Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "front_end.json", raw)
    data = json.loads(raw.read_text())
    data["command"] = ["benchmarks/front_end.py", "--reps", "7", "--levels", "1", "32", "--no-load-arm",
                       "--frontend-core", "1"]
    data["load_avg"] = 0.5
    raw.write_text(json.dumps(data))
    md = tmp_path / "fe.md"
    assert fe.main(["--analyse-only", "--out", str(raw), "--md", str(md)]) == 0
    text = md.read_text()
    assert text.splitlines()[2].startswith(
        "Produced by `python -m benchmarks.front_end --reps 7 --levels 1 32 --no-load-arm --frontend-core 1`")
    assert "--analyse-only" not in text and "(1-min load average at the end, " in text
    assert "cores): 0.5;" in text
