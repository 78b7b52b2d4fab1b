"""The engine control port (``engine.control``) against a fake handler, and ``kunserve status``."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest

from vllm_kunserve.cli.main import main
from vllm_kunserve.engine.control import ControlConflict, ControlRequestError, ControlServer

pytestmark = pytest.mark.unit


class FakeEngine:
    """A ControlHandler holding an engine-like state under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, dict]] = []
        self.release = threading.Event()
        self.state = {
            "engine": {"label": "0", "pid": 4242, "model": "/models/tiny", "vllm": "0.32.0"},
            "phase": "base", "operation": None, "auto": True, "errors": 0,
            "capacity": {"blocks_total": 120, "blocks_base": 88, "blocks_max": 176, "block_size": 32,
                         "block_bytes": 8192},
            "blocks": {"used": 40, "free": 79, "queued": 10, "demand": 60, "draining": 0},
            "requests": {"waiting": 2, "running": 14},
            "layers": [{"index": i, "state": s, "bytes": 3 << 20}
                       for i, s in enumerate(["resident", "resident", "streamed", "resident", "dropped"])],
            "events": [{"event": "remap", "outcome": "ok", "ms": 12.3, "bytes": 6 << 20, "time": 1.7e9,
                        "inputs": {"demand": 60}, "decision": {"layers": [2]}},
                       {"event": "revert", "outcome": "failed", "ms": 1.0, "bytes": 0, "time": 1.7e9 + 5,
                        "error": "RuntimeError('boom')"}],
        }

    def control_state(self) -> dict:
        with self.lock:
            return json.loads(json.dumps(self.state))

    def control_operations(self) -> dict[str, str]:
        return {"grow": "n (int > 0)", "busy": "-", "slow": "-", "boom": "-", "wait": "-"}

    def control_submit(self, op: str, params: dict, timeout_s: float) -> dict:
        self.calls.append((op, params))
        if op == "grow":
            n = params.get("n")
            if not isinstance(n, int) or n <= 0:
                raise ControlRequestError(f"grow: n must be a positive integer, got {n!r}")
            with self.lock:
                self.state["capacity"]["blocks_total"] += n
                return {"blocks_total": self.state["capacity"]["blocks_total"]}
        if op == "busy":
            raise ControlConflict("remap is in progress")
        if op == "slow":
            raise TimeoutError("slow: no step boundary within 1 s")
        if op == "wait":
            assert self.release.wait(10)
            return {"waited": True}
        raise RuntimeError("kaboom")


def call(url: str, path: str, method: str = "GET", body: bytes | None = None, token: str | None = None):
    """(status, JSON body) of one request."""
    req = urllib.request.Request(url + path, data=body, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def server(engine):
    with ControlServer(engine) as srv:
        yield srv


def assert_error(status_body, code: int, needle: str) -> None:
    status, body = status_body
    assert status == code, body
    assert body["error"]["code"] == code and needle in body["error"]["message"], body
    assert isinstance(body["error"]["type"], str)


def test_state_ops_and_health(server, engine):
    assert server.url.startswith("http://127.0.0.1:") and server.port > 0
    assert call(server.url, "/health") == (200, {"ok": True})
    assert call(server.url, "/state") == (200, engine.state)
    status, body = call(server.url, "/ops")
    assert status == 200 and body["operations"] == engine.control_operations()


def test_operation_changes_state(server, engine):
    status, body = call(server.url, "/ops/grow", "POST", b'{"n": 8}')
    assert (status, body) == (200, {"blocks_total": 128})
    assert call(server.url, "/state")[1]["capacity"]["blocks_total"] == 128
    assert engine.calls == [("grow", {"n": 8})]


def test_empty_body_is_an_empty_object(server, engine):
    assert_error(call(server.url, "/ops/grow", "POST", b""), 400, "positive integer")
    assert engine.calls == [("grow", {})]


def test_unknown_op_is_400_and_changes_nothing(server, engine):
    before = call(server.url, "/state")[1]
    assert_error(call(server.url, "/ops/explode", "POST", b"{}"), 400, "grow")
    assert engine.calls == [] and call(server.url, "/state")[1] == before


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'"grow"', "JSON object"),
    (b'{"n": "' + b"x" * (65 << 10) + b'"}', "limit"),
])
def test_bad_body_is_400_and_handler_not_called(server, engine, body, needle):
    before = call(server.url, "/state")[1]
    assert_error(call(server.url, "/ops/grow", "POST", body), 400, needle)
    assert engine.calls == [] and call(server.url, "/state")[1] == before


def test_oversize_chunked_body_is_400(server, engine):
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request("POST", "/ops/grow", body=iter([b"{" + b" " * 40000] * 2 + [b"}"]), encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 400 and "limit" in json.loads(resp.read())["error"]["message"]
    finally:
        conn.close()
    assert engine.calls == []


@pytest.mark.parametrize("op, code, needle", [
    ("grow", 400, "positive integer"), ("busy", 409, "in progress"), ("slow", 504, "step boundary"),
    ("boom", 500, "kaboom"),
])
def test_handler_errors_map_to_status(server, op, code, needle):
    assert_error(call(server.url, f"/ops/{op}", "POST", b'{"n": -1}'), code, needle)


def test_not_found_method_not_allowed_and_validation_are_json(server):
    assert_error(call(server.url, "/nope"), 404, "/nope")
    assert_error(call(server.url, "/state", "POST", b"{}"), 405, "/state")
    assert_error(call(server.url, "/ops/grow"), 405, "/ops/grow")


def test_state_read_is_not_blocked_by_a_slow_operation(server, engine):
    got: list = []
    t = threading.Thread(target=lambda: got.append(call(server.url, "/ops/wait", "POST", b"{}")))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not engine.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.calls == [("wait", {})]
        assert call(server.url, "/state")[0] == 200  # answered while the operation still runs
        assert not got
    finally:
        engine.release.set()
        t.join(10)
    assert got == [(200, {"waited": True})]


def test_token(engine):
    with ControlServer(engine, token="s3cret") as srv:
        assert call(srv.url, "/health") == (200, {"ok": True})
        assert_error(call(srv.url, "/state"), 401, "missing bearer token")
        assert_error(call(srv.url, "/state", token="nope"), 403, "wrong token")
        assert_error(call(srv.url, "/ops/grow", "POST", b'{"n": 1}', token="nope"), 403, "wrong token")
        assert_error(call(srv.url, "/ops/grow", "POST", b'{"n": 1}'), 401, "missing")
        assert engine.calls == []
        assert call(srv.url, "/state", token="s3cret")[0] == 200
        assert call(srv.url, "/ops/grow", "POST", b'{"n": 1}', token="s3cret")[0] == 200
        assert engine.calls == [("grow", {"n": 1})]


def test_token_from_env(engine, monkeypatch):
    monkeypatch.setenv("KUNSERVE_CONTROL_TOKEN", "from-env")
    with ControlServer(engine) as srv:
        assert call(srv.url, "/state")[0] == 401
        assert call(srv.url, "/state", token="from-env")[0] == 200
    with ControlServer(engine, token="") as srv:  # an explicit empty token: none
        assert call(srv.url, "/state")[0] == 200


def test_two_servers_get_different_ports_and_stop_frees_the_port(engine):
    a, b = ControlServer(engine), ControlServer(engine)
    try:
        a.start(), b.start()
        assert a.port != b.port
        assert call(a.url, "/health")[0] == call(b.url, "/health")[0] == 200
        port, url = a.port, a.url
        a.stop()
        a.stop()  # idempotent
        assert not a.running
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url + "/health", timeout=5)
        with ControlServer(engine, port=port) as again:  # the port is free again
            assert again.port == port and call(again.url, "/health")[0] == 200
    finally:
        a.stop(), b.stop()


def test_busy_port_is_a_clear_error(engine):
    with ControlServer(engine) as srv:
        blocker = socket.socket()
        try:
            blocker.bind(("127.0.0.1", 0))
            blocker.listen(1)
            with pytest.raises(OSError, match="cannot listen"):
                ControlServer(engine, port=blocker.getsockname()[1]).start()
        finally:
            blocker.close()
        assert call(srv.url, "/health")[0] == 200


def test_started_and_stopped_from_a_non_main_thread(engine):
    out: dict = {}

    def run() -> None:
        srv = ControlServer(engine)
        out["url"] = srv.start()
        out["state"] = call(srv.url, "/state")[0]
        srv.stop()
        out["stopped"] = not srv.running

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert out == {"url": out["url"], "state": 200, "stopped": True}


def test_runs_beside_another_event_loop(engine):
    async def main_loop() -> int:
        with ControlServer(engine) as srv:
            status, _ = await asyncio.to_thread(call, srv.url, "/ops/grow", "POST", b'{"n": 2}')
            await asyncio.sleep(0)
            return status

    assert asyncio.run(main_loop()) == 200
    assert engine.state["capacity"]["blocks_total"] == 122


def test_non_loopback_host_needs_a_token_and_warns(engine, caplog, monkeypatch):
    monkeypatch.delenv("KUNSERVE_CONTROL_TOKEN", raising=False)
    with pytest.raises(ValueError, match="reachable from other machines; set control.token"):
        ControlServer(engine, host="0.0.0.0").start()
    with caplog.at_level("WARNING", logger="vllm.kunserve"):
        with ControlServer(engine, host="0.0.0.0", token="s3cret") as srv:
            assert call(f"http://127.0.0.1:{srv.port}", "/health")[0] == 200
    assert "reachable from other machines (token required)" in caplog.text


def test_nan_in_state_is_null(engine, server):
    engine.state["blocks"]["used"] = float("nan")
    assert call(server.url, "/state")[1]["blocks"]["used"] is None


# -- kunserve status ----------------------------------------------------------------------------------
def test_status_table(server, capsys):
    assert main(["status", "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert "engine 0" in out and "pid 4242" in out and "phase base" in out and "auto on" in out
    assert "total 120  base 88  max 176" in out and "used 40  free 79  queued 10" in out
    assert "waiting 2  running 14" in out
    assert "layers     R R S R D" in out and "3 resident, 1 streamed, 1 dropped" in out
    assert "R=resident" in out and "S=streamed" in out and "D=dropped" in out
    assert "events (last 2 of 2)" in out and "6.0 MiB" in out and "12.3" in out
    assert '{"layers":[2]}' in out and "boom" in out and "failed" in out


def test_status_last_n_events_and_missing_keys(server, engine, capsys):
    assert main(["status", "--url", server.url.removeprefix("http://") + "/", "--events", "1"]) == 0
    out = capsys.readouterr().out
    assert "events (last 1 of 2)" in out and "revert" in out and "remap " not in out
    engine.state = {"phase": "draining"}
    assert main(["status", "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert "phase draining" in out and "total -" in out and "layers     -" in out and "events     none" in out


def test_status_json(server, engine, capsys):
    assert main(["status", "--url", server.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == engine.state


def test_status_token(engine, capsys, monkeypatch):
    monkeypatch.delenv("KUNSERVE_CONTROL_TOKEN", raising=False)
    with ControlServer(engine, token="t0k") as srv:
        assert main(["status", "--url", srv.url]) == 1
        err = capsys.readouterr().err
        assert "token" in err and "none was given" in err and err.count("\n") == 1
        assert main(["status", "--url", srv.url, "--token", "bad"]) == 1
        assert "wrong token" in capsys.readouterr().err
        assert main(["status", "--url", srv.url, "--token", "t0k"]) == 0
        assert "engine 0" in capsys.readouterr().out
        monkeypatch.setenv("KUNSERVE_CONTROL_TOKEN", "t0k")
        assert main(["status", "--url", srv.url, "--json"]) == 0


def test_status_refused_port(engine, capsys):
    srv = ControlServer(engine)
    url = srv.start()
    srv.stop()
    assert main(["status", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "cannot reach" in err and err.count("\n") == 1


def test_status_http_error_names_the_reason(engine, server, capsys):
    engine.control_state = lambda: 1 / 0
    assert main(["status", "--url", server.url]) == 1
    assert "HTTP 500" in capsys.readouterr().err


def test_serve_and_status_are_listed(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("    ")]
    assert "status" in listed and "serve" in listed


def test_render_fleet_status():
    from vllm_kunserve.cli.status import render

    st = {"dispatch": "least-work", "served_models": ["m"], "max_model_len": 256, "inflight": 3,
          "instances": [{"instance": 0, "state": "ready", "restarts": 1, "inflight": 2, "url": "http://a",
                         "kv": {"capacity_blocks": 88, "used_blocks": 10, "source": "control",
                                "engine": {"phase": "base", "layers": [{"state": "resident"}, {"state": "dropped"}]}}},
                        {"instance": 1, "state": "restarting", "restarts": 0, "inflight": 1, "kv": {}}],
          "events": [{"t": 2.0, "event": "restarted", "instance": 0}, {"t": 1.0, "event": "dead", "instance": 0}]}
    out = render(st)
    lines = out.splitlines()
    assert lines[0].startswith("front end  dispatch least-work")
    assert lines[2].split()[:6] == ["0", "ready", "1", "2", "88", "10"]
    assert lines[3].split()[:2] == ["1", "restarting"]
    assert "layers     R D" in out
    assert out.index(" dead ") < out.index(" restarted ")   # events in time order
    assert "elastic" not in out
    st["elastic"] = {"min_instances": 1, "max_instances": 3, "engines": {"ready": 1, "parked": 2},
                     "last": {"action": "add", "ratio_up": 1.2, "reason": "demand 1.20x of what 1 engine(s) reach"}}
    line = next(x for x in render(st).splitlines() if x.startswith("elastic"))
    assert line.startswith("elastic  1 to 3 engines  parked 2 ready 1  last add  demand/reach 1.2")
    assert "(demand 1.20x" in line
    assert "levers" not in render(st)
    st["drop"] = {"auto": True, "lever": {"lever": "remap", "room_blocks": 80.0, "need_blocks": 33.0,
                                          "reason": "remap first: the engines' remap room covers it"}}
    line = next(x for x in render(st).splitlines() if x.startswith("levers"))
    assert line.startswith("levers   last remap  remap room 80.0 blocks  drop need 33.0 blocks  (remap first")


def test_render_long_models_and_front_end_states():
    from vllm_kunserve.cli.status import render

    layers = [{"index": i, "state": "streamed" if i % 10 == 0 else "resident"} for i in range(40)]
    lines = render({"layers": layers}).splitlines()
    assert lines[5].startswith("layers   0 S R") and lines[6].startswith("        32 R R")
    assert "40 layers: 36 resident, 4 streamed" in lines[7]
    out = render({"instances": 2, "engines": [{"engine": {"label": "a"}}, {"engine": {"label": "b"}}]})
    assert out.startswith("instances 2") and "engine a" in out and "engine b" in out
