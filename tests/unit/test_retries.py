"""Retries with backoff and circuit breakers in the front end (issue 37): a request that fails
before its first token goes to another engine after a jittered backoff; an engine that refuses
connections, answers 5xx or hangs is tripped out of dispatch; the client never sees those failures."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from tests.unit.test_frontend import _expected, _stack, _stream, _teardown
from vllm_kunserve.cluster.frontend.breaker import backoff_s

pytestmark = pytest.mark.unit


def test_backoff_is_exponential_with_full_jitter_and_capped():
    rng = random.Random(0)
    assert backoff_s(0, rng=rng) == 0.0
    for attempt, bound in [(1, 0.05), (2, 0.1), (3, 0.2), (6, 1.0), (20, 1.0)]:
        draws = [backoff_s(attempt, 0.05, 1.0, rng) for _ in range(2000)]
        assert all(0.0 <= d <= bound for d in draws)
        # full jitter: the draws spread over the whole interval, not bunched at its end
        assert min(draws) < 0.05 * bound and max(draws) > 0.95 * bound


def test_refusing_failing_and_hung_engines_are_retried_around_and_tripped():
    """Engine 0 serves; 1 answers 500; 2 accepts and never answers; 3 refuses connections. Round-robin
    sends requests to each in turn: every request still completes with the expected tokens, the
    three bad engines' breakers open (and stay out of dispatch), and retries are events and metrics."""
    async def go():
        fakes, front, client, runners = await _stack(4)
        fakes[1].status = 500
        fakes[2].hang_s = 3.0
        await runners[3].cleanup()   # nothing listens on engine 3's port any more
        front.first_byte_timeout_s, front.retry_backoff_s = 0.3, 0.01
        front.breakers.cooldown_s = front.breakers.max_cooldown_s = 60.0
        try:
            for k in range(10):
                prompt = [3, 1, 4, k]
                ids, _, _ = await _stream(client, {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True,
                                                   "return_token_ids": True})
                assert ids == _expected(prompt, 4)
            assert [front.breakers.is_open(i) for i in range(4)] == [False, True, True, True], front.breakers.view()
            retries = [e for e in front.events if e["event"] == "retry"]
            assert {e["src"] for e in retries} == {1, 2, 3}
            assert any("answered 500" in e["reason"] for e in retries)
            assert any("no response in 0.3 s" in e["reason"] for e in retries)
            assert any("connect" in e["reason"] for e in retries)
            # once tripped, a bad engine gets nothing more than the 3 that tripped it
            assert len(fakes[1].requests) == len(fakes[2].requests) == 3
            metrics = (await client.get("/metrics")).text
            for i in (1, 2, 3):
                assert f'kunserve:circuit_open{{instance="{i}"}} 1.0' in metrics
            assert 'kunserve:retries_total{instance="1",reason="status"}' in metrics
            assert 'kunserve:retries_total{instance="3",reason="connect"}' in metrics
        finally:
            fakes[2].hang_s = 0.0
            await _teardown(front, client, runners[:3])
    asyncio.run(go())


def test_non_streamed_requests_are_retried_past_refusing_and_failing_engines():
    """Non-streamed answers come whole (no head before the last token), so a hung engine is bounded
    by --request-timeout only; a refused connection or a 5xx is retried at once."""
    async def go():
        fakes, front, client, runners = await _stack(3)
        fakes[1].status = 500
        await runners[2].cleanup()
        front.retry_backoff_s = 0.01
        front.breakers.cooldown_s = front.breakers.max_cooldown_s = 60.0
        try:
            for k in range(9):
                prompt = [2, 7, k]
                r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 3,
                                                               "return_token_ids": True})
                assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == _expected(prompt, 3)
            assert front.breakers.is_open(1) and front.breakers.is_open(2) and not front.breakers.is_open(0)
        finally:
            await _teardown(front, client, runners[:2])
    asyncio.run(go())


@pytest.mark.parametrize("stream", [True, False])
def test_an_error_every_engine_gives_is_relayed_after_one_try_each(stream):
    async def go():
        fakes, front, client, runners = await _stack(2)
        for f in fakes:
            f.status = 503
        front.retry_backoff_s = 0.0
        try:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2,
                                                           "stream": stream})
            assert r.status_code == 503 and "fake engine error" in json.loads(r.text)["error"]["message"]
            assert [len(f.requests) for f in fakes] == [1, 1]
        finally:
            await _teardown(front, client, runners)
    asyncio.run(go())


@pytest.mark.parametrize("where,stream", [("status", True), ("status", False), ("stream_status", True)])
def test_a_full_engine_503_is_retried_elsewhere_without_tripping_its_breaker(where, stream):
    """An engine at vLLM's --max-num-queued-reqs bound answers 503, as its HTTP status or, once a stream's
    head went out, as the stream's error event: the request goes to another engine (a "busy" retry) with
    the same tokens, and however many such answers, the full engine is not failed: its breaker stays
    shut, so it gets requests again once it has room."""
    async def go():
        fakes, front, client, runners = await _stack(2)
        setattr(fakes[1], where, 503)
        front.retry_backoff_s = 0.0
        front.breakers.cooldown_s = front.breakers.max_cooldown_s = 60.0
        try:
            same = []
            for k in range(8):
                prompt = [9, k]
                body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream, "return_token_ids": True}
                if stream:
                    ids, _, _ = await _stream(client, body)
                else:
                    r = await client.post("/v1/completions", json=body)
                    ids = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None
                same.append(ids == _expected(prompt, 4))
            tried_busy = len(fakes[1].requests)
            metrics = (await client.get("/metrics")).text
            setattr(fakes[1], where, None)   # room again: the engine serves at once
            for k in range(4):
                await client.post("/v1/completions", json={"model": "m", "prompt": [8, k], "max_tokens": 2,
                                                           "stream": stream})
            return same, tried_busy, front.breakers.is_open(1), metrics, len(fakes[1].requests) - tried_busy
        finally:
            await _teardown(front, client, runners)
    same, tried_busy, open_, metrics, served_after = asyncio.run(go())
    assert all(same) and tried_busy >= 3 and not open_
    if where == "status":
        assert 'kunserve:retries_total{instance="1",reason="busy"}' in metrics
    assert 'reason="status"' not in metrics
    assert served_after >= 1


def test_a_blocking_liveness_probe_runs_off_the_event_loop():
    """A backend whose ``alive`` blocks (Ray's remote call) is asked from a worker thread: the failed
    request's retry goes on at once, and the engine is marked dead when the probe answers."""
    import threading
    import time

    async def go():
        fakes, front, client, runners = await _stack(2)
        backend = front.fleet.backend
        asked = threading.Event()

        def slow_alive(engine):
            asked.set()
            time.sleep(1.0)
            return False
        backend.alive, backend.probe_in_thread = slow_alive, True
        try:
            t0 = time.monotonic()
            front.engine_failed(1, "test")
            front.engine_failed(1, "test again")     # one probe at a time per engine
            assert time.monotonic() - t0 < 0.2      # the loop was not held
            await asyncio.sleep(0.1)
            assert asked.is_set() and front.fleet.engines[1].accepting
            for _ in range(40):
                if not front.fleet.engines[1].accepting:
                    break
                await asyncio.sleep(0.05)
            assert not front.fleet.engines[1].accepting and front.fleet.engines[0].accepting
        finally:
            await _teardown(front, client, runners)
    asyncio.run(go())
