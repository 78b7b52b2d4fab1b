"""`vllm serve` with the plugin: the OpenAI server works, and a bad option refuses to start. The burst
and control port tests share one server (``remap_server``)."""

import json
import urllib.request

import pytest

from vllm_kunserve.cluster.fleet.launcher import VllmServer

pytestmark = pytest.mark.vllm

ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(32 << 20),
        "--max-model-len", "256", "--enforce-eager"]


def _complete(url: str, prompt: str) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_serve_refuses_unknown_key_and_names_it(tiny_model, tmp_path):
    srv = VllmServer(str(tiny_model), ARGS, {"kunserve": {"bogus": 1}}, log_path=tmp_path / "bad.log",
                     startup_timeout_s=180)
    with pytest.raises(RuntimeError, match="exited with code"):
        srv.start()
    log = (tmp_path / "bad.log").read_text()
    assert "kunserve.bogus: unknown key" in log


@pytest.fixture(scope="module")
def remap_server(burst_model, tmp_path_factory):
    """One mp `vllm serve` (engine core + worker processes) with remap on and its control port behind
    a token, for the burst test and the control port test (one engine start-up for both): the burst
    test runs on it first, with the engine's own policy (auto), and leaves it at its base; the
    control port test switches auto off for its forced remap and back on after."""
    import socket

    from tests.vllm.conftest import BURST_KV_BYTES

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tmp_path_factory.mktemp("serve-remap")
    kc = {"kunserve": {"remap": {"enable": True, "max_fraction": 0.75, "revert_hold_s": 1.0,
                                 "h2d_bandwidth_gbps": 50.0},
                       "control": {"port": port, "token": "s3cret"}}}
    prom = tmp / "prom"
    prom.mkdir()
    srv = VllmServer(str(burst_model), ["--served-model-name", "m", "--dtype", "float32", "--block-size", "32",
                                        "--kv-cache-memory-bytes", str(BURST_KV_BYTES), "--max-model-len", "512",
                                        "--enforce-eager"], kc,
                     env={"PROMETHEUS_MULTIPROC_DIR": str(prom)}, log_path=tmp / "serve.log")
    srv.control = f"http://127.0.0.1:{port}"
    with srv:
        yield srv


def _call(ctl: str, path: str, body=None, token="s3cret"):
    import urllib.error

    req = urllib.request.Request(ctl + path, body, {"Content-Type": "application/json"} |
                                 ({"Authorization": f"Bearer {token}"} if token else {}),
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_remap_burst_metrics_and_idle_revert(remap_server):
    """mp engine core + worker processes: a burst remaps, /metrics shows it, idle reverts it."""
    import random
    import threading
    import time

    srv = remap_server
    assert _call(srv.control, "/ops/auto", b'{"enable": true}')[0] == 200   # the engine's own policy
    rng = random.Random(1)
    bodies = [json.dumps({"model": "m", "prompt": [rng.randrange(3, 2048) for _ in range(160)],
                          "max_tokens": 80, "ignore_eos": True, "temperature": 0}).encode() for _ in range(16)]
    done: list[int] = []

    def send(body: bytes) -> None:
        req = urllib.request.Request(f"{srv.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            done.append(json.loads(r.read())["usage"]["completion_tokens"])

    def metric(text: str, name: str) -> float:
        return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name)))

    threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    time.sleep(4.0)  # > revert_hold_s: the idle engine core must wake up and revert
    after = urllib.request.urlopen(f"{srv.url}/metrics", timeout=30).read().decode()
    assert done == [80] * 16
    assert metric(after, "vllm:num_preemptions_total") == 0
    assert metric(after, "kunserve:remapped_layers") == 0
    assert metric(after, 'kunserve:kv_blocks_total') == metric(after, "kunserve:kv_blocks_base")
    assert metric(after, 'kunserve:memory_events_total{engine="0",kind="remap",outcome="ok"}') >= 1
    assert metric(after, 'kunserve:memory_events_total{engine="0",kind="revert",outcome="ok"}') >= 1
    log = srv.log_path.read_text()
    assert "kunserve remap ok" in log and "kunserve revert ok" in log and "'reason': 'idle'" in log


def test_control_port_under_vllm_serve(remap_server):
    """State read and operations requested from outside the engine process; wrong token and bad
    requests are refused with a clear error and change nothing; the server completes requests and
    its log carries the plugin's banner."""
    srv = remap_server

    def call(path, body=None, token="s3cret"):
        return _call(srv.control, path, body, token)

    code, st = call("/state")
    assert code == 200 and st["phase"] == "base" and st["capacity"]["blocks_total"] == st["capacity"]["blocks_base"]
    assert len(st["layers"]) == 8 and {x["state"] for x in st["layers"]} == {"resident"}
    base = st["capacity"]["blocks_total"]
    refused = [call("/state", token=None), call("/state", token="nope"), call("/ops/remap", b"{not json"),
               call("/ops/remap", b"[1]"), call("/ops/explode", b"{}"), call("/ops/remap", b'{"alpha": 99}')]
    assert [c for c, _ in refused] == [401, 403, 400, 400, 400, 400]
    assert all(b["error"]["message"] for _, b in refused)
    assert "token" in refused[0][1]["error"]["message"] and "explode" in refused[4][1]["error"]["message"]
    code, st = call("/state")
    assert st["phase"] == "base" and st["capacity"]["blocks_total"] == base  # unchanged
    assert call("/ops/auto", b'{"enable": false}') == (200, {"auto": False})  # no idle revert in between
    try:
        code, ev = call("/ops/remap", json.dumps({"alpha": 2, "slots": 1}).encode())
        assert code == 200 and ev["outcome"] == "ok"
        code, st = call("/state")
        assert st["phase"] == "remapped" and st["capacity"]["blocks_total"] > base
        assert sum(x["state"] == "streamed" for x in st["layers"]) == 3
        out = _complete(srv.url, "the memory cache")
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 5
        code, ev = call("/ops/revert", b"")
        assert code == 200 and ev["outcome"] == "ok"
        code, st = call("/state")
        assert st["phase"] == "base" and st["capacity"]["blocks_total"] == base
        assert [e["event"] for e in st["events"]][-3:] == ["remap", "revert", "revert"]
    finally:
        call("/ops/auto", b'{"enable": true}')
    log = srv.log_path.read_text()   # the plugin announced itself, once per process
    assert "kunserve active:" in log and "patches: worker_extension" in log
