"""Replay client and one full bench run against a fake OpenAI streaming server on 127.0.0.1.

The fake server streams ``max_tokens`` chunks: the first after FIRST_S, the others GAP_S apart, so
the client's TTFT and TPOT can be checked against programmed delays. Prompt lengths select
behaviours: 13 -> HTTP 500, 17 -> an error object mid-stream, 19 -> never answers.
"""

import asyncio
import csv
import json
import threading
import time

import numpy as np
import pytest
from aiohttp import web

from vllm_kunserve.bench.client import RequestSpec, replay
from vllm_kunserve.bench.prompts import PromptFactory
from vllm_kunserve.bench.runner import BenchOptions, run_bench
from vllm_kunserve.workload.kvdemand import DemandModel
from vllm_kunserve.workload.traces import synthetic

pytestmark = pytest.mark.unit

FIRST_S, GAP_S = 0.12, 0.03


class FakeOpenAI:
    def __init__(self):
        self.served = 0
        self.bodies = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        n_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
        if n_prompt == 13:
            return web.Response(status=500, text="boom: engine dead")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if n_prompt == 19:
            await asyncio.sleep(30)
        await asyncio.sleep(FIRST_S)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(GAP_S)
            if n_prompt == 17 and i == 2:
                await resp.write(b'data: {"error": {"message": "preempted and aborted"}}\n\n')
                return resp
            last = i == body["max_tokens"] - 1
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if last else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"]}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.served += 1
        return resp

    async def metrics(self, request):
        text = (
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {min(1.0, 0.1 * self.served)}\n'
            "# TYPE vllm:num_preemptions counter\n"
            f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {5 + 2 * self.served}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1\n'
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="32",num_gpu_blocks="128",engine="0"} 1\n'
            "# TYPE kunserve:groups gauge\n"
            'kunserve:groups{engine="0"} 3\n'
        )
        return web.Response(text=text)

    def _main(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def fake():
    with FakeOpenAI() as f:
        yield f


def _spec(i, t, n_prompt, n_out):
    return RequestSpec(i, t, list(range(1, n_prompt + 1)), n_prompt, n_out)


def test_ttft_tpot_and_arrival_timing(fake):
    specs = [_spec(0, 0.0, 5, 6), _spec(1, 0.3, 7, 4), _spec(2, 0.35, 3, 1)]
    res = asyncio.run(replay(fake.endpoint, "m", specs, progress=False))
    assert [r.idx for r in res] == [0, 1, 2] and all(r.ok for r in res)
    for r, s in zip(res, specs):
        assert r.send_s == pytest.approx(s.arrival_s, abs=0.05)  # sent on time, open loop
        assert FIRST_S <= r.ttft_s < FIRST_S + 0.15
        assert r.output_tokens == s.output_len and r.server_prompt_tokens == s.prompt_len
        assert len(r.token_times) == s.output_len and r.finish_reason == "length"
        assert r.e2e_s >= r.token_times[-1]
    assert res[0].tpot_s == pytest.approx(GAP_S, abs=0.015) and res[1].tpot_s == pytest.approx(GAP_S, abs=0.02)
    assert np.isnan(res[2].tpot_s)  # one token: no TPOT
    assert all(g == pytest.approx(GAP_S, abs=0.03) for g in res[0].gaps)
    body = fake.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["max_tokens"] == 6 and body["prompt"] == [1, 2, 3, 4, 5]


def test_failures_are_recorded_not_fatal(fake):
    specs = [_spec(0, 0.0, 13, 3), _spec(1, 0.0, 17, 5), _spec(2, 0.0, 19, 3), _spec(3, 0.0, 4, 2)]
    res = asyncio.run(replay(fake.endpoint, "m", specs, request_timeout_s=0.5, progress=False))
    assert [r.ok for r in res] == [False, False, False, True]
    assert res[0].error.startswith("HTTP 500") and "engine dead" in res[0].error
    assert "preempted and aborted" in res[1].error
    assert res[2].error == "timeout after 0.5 s"
    # overall deadline: the hanging request and one not yet sent are cancelled and recorded
    t0 = time.perf_counter()
    res = asyncio.run(replay(fake.endpoint, "m", [_spec(0, 0.0, 19, 3), _spec(1, 5.0, 4, 2)],
                             request_timeout_s=60, deadline_s=0.4, progress=False))
    assert time.perf_counter() - t0 < 3
    assert [r.error for r in res] == ["overall deadline reached", "overall deadline reached before sending"]


def test_connection_refused_is_a_failure():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = asyncio.run(replay(f"http://127.0.0.1:{port}", "m", [_spec(0, 0.0, 3, 2)], progress=False))
    assert not res[0].ok and "Connect" in res[0].error


def test_run_bench_writes_outputs(fake, tmp_path):
    n = 6
    tr = synthetic(np.array([5, 6, 13, 7, 8, 9]), np.array([3] * n), np.linspace(0, 1.5, n), "t")
    factory = PromptFactory(vocab_size=100, seed=1)
    opts = BenchOptions(endpoint=fake.endpoint, model="m", warmup=1, progress=False, scrape_interval_s=0.2,
                        title="fake")
    run = run_bench(tr, factory, opts, tmp_path / "out", demand_model=DemandModel(10.0, block_size=32),
                    kv_capacity_tokens=4096)
    s = run.summary
    assert (s["requests"], s["completed"], s["failed"]) == (6, 5, 1)
    assert s["errors"] == {"HTTP 500": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(FIRST_S, abs=0.08)
    assert s["tpot_s"]["p50"] == pytest.approx(GAP_S, abs=0.015)
    # 1 warm-up + 5 replayed requests served; counter baseline taken at the replay start
    assert s["preemptions"] == 2 * 5
    assert s["server_cache_config"]["num_gpu_blocks"] == "128"
    assert s["prompt_token_mismatches"] == 0
    out = tmp_path / "out"
    for f in ("requests.csv", "timeline.csv", "summary.json", "timeline.png", "ttft_cdf.png"):
        assert (out / f).stat().st_size > 0
    rows = list(csv.DictReader(open(out / "requests.csv")))
    assert len(rows) == 6 and rows[2]["ok"] == "0" and rows[2]["error"].startswith("HTTP 500")
    tl = list(csv.DictReader(open(out / "timeline.csv")))
    assert sum(int(r["arrivals"]) for r in tl) == 6 and sum(int(r["completions"]) for r in tl) == 5
    assert sum(int(r["output_tokens"]) for r in tl) == 15
    assert "kunserve:groups" in tl[0] and tl[-1]["kunserve:groups"] == "3.0"
    assert float(tl[-1]["preemptions"]) == 10.0
    assert json.loads((out / "summary.json").read_text())["completed"] == 5


def _in_flight_peak(res) -> list[tuple[float, int]]:
    """(time, requests in flight) after every send and end, from the results' own times."""
    events = sorted([(r.send_s, 1) for r in res] + [(r.send_s + r.e2e_s, -1) for r in res])
    n, out = 0, []
    for t, d in events:
        n += d
        out.append((t, n))
    return out


def test_max_concurrency_is_a_closed_loop(fake):
    """Six requests all due at 0 with two slots: never more than two in flight, sent in order as slots
    free, each recorded as arriving when it got its slot (so no send counts as late)."""
    specs = [_spec(i, 0.0, 5, 4) for i in range(6)]
    res = asyncio.run(replay(fake.endpoint, "m", specs, progress=False, max_concurrency=2))
    assert all(r.ok for r in res)
    assert max(n for _, n in _in_flight_peak(res)) == 2
    sends = [r.send_s for r in res]
    assert sends == sorted(sends) and sends[2] >= res[0].e2e_s - 0.02   # the third waited for a slot
    assert all(r.arrival_s == pytest.approx(r.send_s, abs=0.01) for r in res)


def test_concurrency_schedule_raises_the_limit_on_time(fake):
    """One slot, then three from 0.4 s: the waiting requests go out at 0.4 s, not after the first ends."""
    specs = [_spec(i, 0.0, 5, 20) for i in range(3)]   # each lasts ~0.12 + 19 x 0.03 = 0.69 s
    res = asyncio.run(replay(fake.endpoint, "m", specs, progress=False, max_concurrency=[(0.0, 1), (0.4, 3)]))
    assert all(r.ok for r in res)
    assert res[0].send_s < 0.05
    assert res[1].send_s == pytest.approx(0.4, abs=0.08) and res[2].send_s == pytest.approx(0.4, abs=0.08)
    assert res[1].send_s < res[0].e2e_s


@pytest.mark.parametrize("text, ok", [("4", [(0.0, 4)]), ("4,8@10,4@25.5", [(0.0, 4), (10.0, 8), (25.5, 4)]),
                                      ("0", None), ("4,8", None), ("4,8@10,2@5", None), ("4@3", None), ("x", None)])
def test_parse_concurrency(text, ok):
    from vllm_kunserve.bench.client import parse_concurrency

    if ok is None:
        with pytest.raises(ValueError, match="--max-concurrency"):
            parse_concurrency(text)
    else:
        assert parse_concurrency(text) == ok
