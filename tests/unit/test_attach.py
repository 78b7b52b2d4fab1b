"""`kunserve serve --engine-url`: the front end over engines started elsewhere (issue 37). The fleet
watches their /health, never starts, kills or restarts them; a dead one rejoins when it answers."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import httpx
import pytest
from aiohttp import web

from tests.unit.test_frontend import FakeEngine
from vllm_kunserve.cli import serve
from vllm_kunserve.cluster.fleet.backends import AttachBackend
from vllm_kunserve.cluster.fleet.fleet import Fleet
from vllm_kunserve.cluster.fleet.spec import EngineSpec
from vllm_kunserve.cluster.frontend.app import FrontEnd, build_app

pytestmark = pytest.mark.unit


async def _until(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.02)


def _engines_elsewhere(n):
    """Fake engines served by their own event loop in another thread (as engines started elsewhere
    are: the front end's loop pausing must not stop them answering)."""
    fakes, urls, ready = [FakeEngine(i) for i in range(n)], [], threading.Event()
    loop = asyncio.new_event_loop()

    async def serve():
        for f in fakes:
            runner = web.AppRunner(f.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}/")
        ready.set()
    threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True).start()
    assert ready.wait(10)
    return fakes, urls, loop


async def _teardown(client, front, fleet, loop) -> None:
    await client.aclose()
    await front.close()
    await asyncio.to_thread(fleet.stop)
    loop.call_soon_threadsafe(loop.stop)


def test_attached_engines_are_served_watched_and_never_killed():
    async def go():
        fakes, urls, loop = _engines_elsewhere(2)
        fleet = Fleet(EngineSpec("m", startup_timeout_s=5), 2, AttachBackend(urls), restart=True,
                      check_interval_s=0.05, progress=lambda s: None)
        await asyncio.to_thread(fleet.start)
        front = FrontEnd(fleet, dispatch="round-robin", monitor_interval_s=0.05)
        await front.start()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(front)), base_url="http://front")
        try:
            assert [e.url for e in fleet.engines] == [u.rstrip("/") for u in urls]
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200
            kill = await client.post("/kunserve/ops/kill", json={"instance": 0})
            assert kill.status_code == 409 and "started elsewhere" in kill.text
            fakes[1].alive = False   # its /health fails (3 checks in a row): marked dead, its traffic goes to the other
            await _until(lambda: fleet.engines[1].state != "ready")
            before = len(fakes[0].requests)
            for _ in range(3):
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200
            assert len(fakes[0].requests) == before + 3
            fakes[1].alive = True    # answers again: it rejoins (nothing was started)
            await _until(lambda: fleet.engines[1].state == "ready" and fleet.engines[1].restarts == 1)
            kinds = [e["event"] for e in fleet.events if e["instance"] == 1]
            assert "dead" in kinds and "restarted" in kinds
        finally:
            await _teardown(client, front, fleet, loop)
    asyncio.run(go())


def test_an_engine_that_never_answers_fails_startup_in_one_line():
    fleet = Fleet(EngineSpec("m", startup_timeout_s=0.5, startup_retries=0), 1,
                  AttachBackend(["http://127.0.0.1:9"]), progress=lambda s: None)
    with pytest.raises(Exception) as ei:
        fleet.start()
    assert "instance 0" in ei.value.one_line() and "/health did not answer" in ei.value.one_line()


def _parse(*rest):
    return serve.parse(argparse.Namespace(model="m", rest=list(rest)))


def test_engine_url_flags_are_checked():
    opts, engine_args = _parse("--engine-url", "http://a:8000", "--engine-url", "http://b:8000",
                               "--engine-control-url", "http://a:9000")
    assert opts.instances == 2 and opts.backend == "attach" and engine_args == []
    assert _parse("--engine-url", "http://a:8000", "--backend", "local")[0].backend == "attach"  # the default
    assert _parse("--engine-url", "http://a:8000", "--reuse-port")[0].reuse_port
    assert not _parse("--engine-url", "http://a:8000")[0].reuse_port
    for bad, why in [(("--engine-url", "a:8000"), "http:// or https://"),
                     (("--engine-url", "http://"), "no host"),
                     (("--engine-url", "http://a:abc"), "port must be a number"),
                     (("--engine-url", "http://a:99999"), "port must be a number"),
                     (("--engine-url", "http://a:1?x=1"), "no query"),
                     (("--engine-url", "http://a:1", "--engine-url", "http://a:1/"), "given twice"),
                     (("--engine-url", "http://a:1", "--backend", "ray"), "--backend ray with --engine-url"),
                     (("--engine-url", "http://a:1", "--ray-address=x:1"), "--ray-address with --engine-url"),
                     (("--engine-control-url", "http://a:9000"), "needs --engine-url"),
                     (("--engine-url", "http://a", "--instances", "3"), "counted by their URLs"),
                     (("--engine-url", "http://a", "--engine-control-url", "http://a:1", "--engine-control-url",
                       "http://a:2"), "2 --engine-control-url for 1"),
                     (("--reuse-port",), "--reuse-port needs --engine-url"),
                     (("--engine-url", "http://a:1", "--reuse-port", "--kunserve-config", "{}"),
                      "--reuse-port with --kunserve-config")]:
        with pytest.raises(ValueError, match=why):
            _parse(*bad)


def test_a_flaky_engine_is_skipped_by_its_breaker_and_no_request_fails():
    """Engine 1 answers /health but breaks every stream before its first token: each of its
    requests fails over to engine 0, and after three in a row its breaker opens, so round-robin
    dispatch stops sending it requests for the cool-down."""
    async def go():
        fakes, urls, loop = _engines_elsewhere(2)
        fakes[1].die_after = 0
        fleet = Fleet(EngineSpec("m", startup_timeout_s=5), 2, AttachBackend(urls), restart=True,
                      check_interval_s=0.05, progress=lambda s: None)
        await asyncio.to_thread(fleet.start)
        front = FrontEnd(fleet, dispatch="round-robin", monitor_interval_s=0.05)
        await front.start()
        front.breakers.cooldown_s = front.breakers.max_cooldown_s = 30.0
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(front)), base_url="http://front")
        try:
            bodies = []
            for _ in range(12):
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3,
                                                               "stream": True})
                assert r.status_code == 200
                bodies.append(r.text)
            assert all("error" not in b and b.rstrip().endswith("data: [DONE]") for b in bodies), bodies
            assert front.breakers.is_open(1) and fleet.engines[1].state == "ready", (front.breakers.view(), len(fakes[1].requests), [e["event"] for e in front.events])
            assert len(fakes[1].requests) == 3   # the three that tripped it, then nothing
            kinds = [e["event"] for e in front.events]
            assert kinds.count("circuit_open") == 1 and kinds.count("failover") == 3
            st = (await client.get("/kunserve/status")).json()
            assert st["breakers"]["1"]["open_s"] > 0 and st["breakers"]["1"]["state"] == "open"
            assert 'kunserve:circuit_state{instance="1"} 1.0' in (await client.get("/metrics")).text
            # the cool-down ends and engine 1 is well again: half open, probed, closed
            fakes[1].die_after = None
            front.breakers._s[1].open_until = 0.0
            for _ in range(2):
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3,
                                                               "stream": True})
                assert r.status_code == 200 and "error" not in r.text
            kinds = [e["event"] for e in front.events if e["event"].startswith("circuit_")]
            assert kinds == ["circuit_open", "circuit_half_open", "circuit_closed"], kinds
            assert len(fakes[1].requests) == 4
            assert 'kunserve:circuit_state{instance="1"} 0.0' in (await client.get("/metrics")).text
        finally:
            await _teardown(client, front, fleet, loop)
    asyncio.run(go())


def test_a_kunserve_engine_is_asked_for_its_control_port():
    """An attached engine that serves kunserve's /kunserve/engine route is read through the control
    port it names; one that answers 404 is stock; a typed --engine-control-url is not asked; a
    port on another machine's loopback is refused (unreachable from here)."""
    from vllm_kunserve.cluster.fleet.spec import Engine

    asked = []

    def route(answer):
        async def h(request):
            asked.append(answer)
            if isinstance(answer, int):
                return web.json_response({"error": "x"}, status=answer)
            return web.json_response({"control_url": answer})
        return h
    _, _, loop = _engines_elsewhere(0)   # an event loop of their own, in another thread
    try:
        apps = [web.Application() for _ in range(3)]
        for app, ans in zip(apps, ("http://127.0.0.1:9100", 404, "http://127.0.0.1:9102")):
            app.router.add_get("/health", lambda r: web.Response(status=200))
            app.router.add_get("/kunserve/engine", route(ans))
        new = []

        async def start():
            for app in apps:
                runner = web.AppRunner(app)
                await runner.setup()
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                new.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        b = AttachBackend(new, [None, None, "http://127.0.0.1:7/"])
        engines = [Engine(i) for i in range(3)]
        for e in engines:
            b.launch(EngineSpec("m"), e.index, e)
            b.wait_ready(e, 5)
        assert [e.control_url for e in engines] == ["http://127.0.0.1:9100", None, "http://127.0.0.1:7"]
        assert b.found == {0: "engine", 1: "stock (GET /kunserve/engine answered 404)", 2: "flag"}
        assert asked == ["http://127.0.0.1:9100", 404]   # the typed one was not asked
        # an engine elsewhere that names its own loopback: not reachable from here, read as stock
        far = AttachBackend(["http://10.9.8.7:1"])
        e = Engine(0)
        far.launch(EngineSpec("m"), 0, e)
        import urllib.request
        from unittest import mock

        class Resp:
            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

            def read(self):
                return b'{"control_url": "http://127.0.0.1:5555"}'
        with mock.patch.object(urllib.request, "urlopen", return_value=Resp()):
            far.discover(e, time.monotonic() + 1)
        assert e.control_url is None and "loopback" in far.found[0]
        # one bound to every interface (a pod's control.host 0.0.0.0) names 0.0.0.0: its port is on the
        # host the front end reaches the engine at
        Resp.read = lambda self: b'{"control_url": "http://0.0.0.0:8100"}'
        for engine_url, want in (("http://engine-0.engines:8000", "http://engine-0.engines:8100"),
                                 ("http://[fd00::5]:8000", "http://[fd00::5]:8100")):
            pod, e = AttachBackend([engine_url]), Engine(0)
            pod.launch(EngineSpec("m"), 0, e)
            with mock.patch.object(urllib.request, "urlopen", return_value=Resp()):
                pod.discover(e, time.monotonic() + 1)
            assert e.control_url == want and pod.found[0] == "engine"
        line = serve.attach_line(type("F", (), {"backend": b, "engines": engines})(), drop_on=False)
        assert "0: control http://127.0.0.1:9100 (from the engine)" in line and "1: stock (GET" in line
        assert "2: control http://127.0.0.1:7 (--engine-control-url)" in line and "cluster drop: off" in line
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_an_attached_engine_heard_from_recently_is_alive_without_a_probe(monkeypatch):
    """Passive health checking: an engine that answered a request within ``heard_fresh_s`` is not
    probed (under load the probes were a thread's HTTP round trips taking the front end's lock);
    one silent longer is probed, and missing ``misses_to_dead`` probes in a row makes it dead."""
    import time

    from vllm_kunserve.cluster.fleet.backends import AttachBackend
    from vllm_kunserve.cluster.fleet.spec import Engine, EngineSpec

    b = AttachBackend(["http://127.0.0.1:9"], misses_to_dead=2, heard_fresh_s=1.0)
    probes = []
    monkeypatch.setattr(b, "healthy", lambda url, timeout_s=None: probes.append(url) or False)
    e = Engine(0)
    b.launch(EngineSpec("m"), 0, e)
    e.heard_s = time.monotonic()
    assert b.alive(e) and b.alive(e) and probes == []
    e.heard_s = time.monotonic() - 5.0
    assert b.alive(e) and probes == ["http://127.0.0.1:9"]      # one miss is not a death
    assert not b.alive(e) and len(probes) == 2
    e.heard_s = time.monotonic()                                   # it answered a request again
    assert b.alive(e) and len(probes) == 2
