"""Every operation of the control plane needs the token (issue 36): the front end's
``/kunserve/ops/<op>`` and every route of an engine's control port, tried without a token, with a
wrong one and with the right one and malformed bodies. Refused requests change nothing."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.test_control_port import FakeEngine, call
from tests.unit.test_frontend import _stack, _teardown
from vllm_kunserve.engine.control import ControlServer

pytestmark = pytest.mark.unit

TOKEN = "s3cret"
MALFORMED = (b"{", b"[1, 2]", b'"x"', b"[" * 5000 + b"]" * 5000, b"\xff\xfe")
FRONT_OPS = ("kill", "migrate", "dispatch", "drop", "restore")


def test_engine_control_port_every_route_needs_the_token_and_refuses_malformed_bodies():
    engine = FakeEngine()
    before = engine.control_state()
    with ControlServer(engine, token=TOKEN) as srv:
        assert call(srv.url, "/health")[0] == 200                       # liveness stays open
        routes = [("GET", "/state"), ("GET", "/ops")] + [("POST", f"/ops/{op}") for op in engine.control_operations()]
        for method, path in routes + [("POST", "/ops/nope")]:
            body = b"{}" if method == "POST" else None
            assert call(srv.url, path, method, body)[0] == 401, path
            assert call(srv.url, path, method, body, token="wrong")[0] in (401, 403), path
        for op in engine.control_operations():
            for raw in MALFORMED:
                status, out = call(srv.url, f"/ops/{op}", "POST", raw, token=TOKEN)
                assert status == 400 and out["error"]["code"] == 400, (op, raw[:20], out)
        assert call(srv.url, "/ops/grow", "POST", b'{"n": 1}', token=TOKEN)[0] == 200   # the right token works
    assert engine.calls == [("grow", {"n": 1})]                         # nothing else reached the engine
    assert engine.control_state()["capacity"]["blocks_total"] == before["capacity"]["blocks_total"] + 1


def test_front_end_every_operation_needs_the_token_and_refuses_malformed_bodies():
    async def go():
        fakes, front, client, runners = await _stack()
        front.token = TOKEN
        try:
            out = []
            for op in FRONT_OPS + ("explode",):
                for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
                    r = await client.post(f"/kunserve/ops/{op}", json={"instance": 0}, headers=headers)
                    out.append((op, "auth", r.status_code))
                for raw in MALFORMED:
                    r = await client.post(f"/kunserve/ops/{op}", content=raw,
                                          headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
                    out.append((op, raw[:10], r.status_code, r.json()["error"]["code"]))
            state = ([e.accepting for e in front.fleet.engines], front.dispatch, list(front.events) + list(front.fleet.events))
            return out, state
        finally:
            await _teardown(front, client, runners)
    out, (accepting, dispatch, events) = asyncio.run(go())
    assert all(x[2] in (401, 403) for x in out if x[1] == "auth"), out
    assert all(x[2] in (400, 404) and x[3] == x[2] for x in out if x[1] != "auth"), out
    assert accepting == [True, True] and dispatch == "round-robin"
    assert not [e for e in events if (e.get("event") or e.get("kind")) in ("kill", "drop", "restore", "dispatch", "migrate")], events
