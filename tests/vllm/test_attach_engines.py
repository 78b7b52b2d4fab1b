"""`kunserve serve --engine-url` over two real `vllm serve` engines started elsewhere (issue 37):
answers token-identical to the engines' own, a hung engine (SIGSTOP) is retried around after
--first-byte-timeout and tripped, a killed one is failed over and never restarted by the front end."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from tests.vllm.cluster_client import complete, status
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster, VllmServer

pytestmark = pytest.mark.vllm

ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(32 << 20),
        "--max-model-len", "256", "--enforce-eager", "--served-model-name", "m"]
PROMPTS = [f"attached {i}: the router fronts {i * 3} engines and" for i in range(4)]


def test_attached_real_engines_hung_and_killed(tiny_model, tmp_path):
    engines = [VllmServer(str(tiny_model), ARGS, log_path=tmp_path / f"engine{i}.log", startup_timeout_s=400)
               for i in range(2)]
    for e in engines:
        e.start()
    front = KunserveCluster(str(tiny_model), [], None, log_path=tmp_path / "front.log", instances=2,
                            startup_timeout_s=120,
                            extra=["--engine-url", engines[0].url, "--engine-url", engines[1].url,
                                   "--dispatch", "round-robin", "--first-byte-timeout", "3",
                                   "--monitor-interval", "0.25"])
    stopped = None
    try:
        front.start()

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
                direct = [await complete(s, engines[0].url, p, max_tokens=24) for p in PROMPTS]
                via = [await complete(s, front.url, p, max_tokens=24, stream=k % 2 == 0)
                       for k, p in enumerate(PROMPTS)]
                nonlocal stopped
                stopped = engines[1]._proc.proc.pid
                os.kill(stopped, signal.SIGSTOP)    # engine 1's server hangs: accepts, never answers
                t0 = time.monotonic()
                hung = [await complete(s, front.url, p, max_tokens=24, stream=True) for p in PROMPTS]
                hung_s = time.monotonic() - t0
                st_hung = await status(s, front.url)
                os.kill(stopped, signal.SIGCONT)
                stopped = None
                engines[0].stop()                   # engine 0 dies: its requests go to engine 1
                killed = [await complete(s, front.url, p, max_tokens=24, stream=k % 2 == 0)
                          for k, p in enumerate(PROMPTS)]
                return direct, via, hung, hung_s, st_hung, killed, await status(s, front.url)
        direct, via, hung, hung_s, st_hung, killed, st = asyncio.run(go())
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        front.stop()
        for e in engines:
            e.stop()
    ref = [a.token_ids for a in direct]
    assert all(len(r) == 24 for r in ref)
    assert [a.token_ids for a in via] == ref
    # every streamed request while engine 1 hung was answered by engine 0; the ones sent to engine 1
    # first waited one --first-byte-timeout, and engine 1's breaker opened after three
    assert [a.token_ids for a in hung] == ref and all(a.error is None for a in hung)
    retries = [e for e in st_hung["events"] if e["event"] == "retry"]
    assert retries and all(e["src"] == 1 and "no response in 3 s" in e["reason"] for e in retries)
    assert hung_s < 3 * (len(retries) + 1) + 30
    assert [a.token_ids for a in killed] == ref and all(a.status == 200 and a.error is None for a in killed)
    # attached: the front end never restarts what it did not start
    assert st["instances"][0]["restarts"] == 0
