"""Process launching (``cluster.launcher``): one ``vllm serve`` command builder for the harness and
:class:`VllmServer`."""

import json
import sys

import pytest

from vllm_kunserve.bench import systems as S
from vllm_kunserve.cluster.launcher import VllmServer, free_port, serve_argv

pytestmark = pytest.mark.unit


def test_serve_argv():
    a = serve_argv("/m", "127.0.0.1", 8000, ["--enforce-eager"], {"kunserve": {}})
    assert a[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert a[a.index("--host") + 1] == "127.0.0.1" and a[a.index("--port") + 1] == "8000"
    assert json.loads(a[a.index("--additional-config") + 1]) == {"kunserve": {}}
    assert a[-1] == "--enforce-eager"  # caller's arguments last: they win
    assert "--additional-config" not in serve_argv("/m", "h", 1)


def test_vllm_server_plan_and_the_harness_share_the_builder():
    srv = VllmServer("/m", ["--max-model-len", "512"], {"kunserve": {"remap": {"enable": True}}},
                     env={"X": "1"}, port=1234)
    plan = srv.plan()
    assert plan.argv == serve_argv("/m", "127.0.0.1", 1234, ["--max-model-len", "512"], srv.additional_config)
    assert plan.env["X"] == "1" and plan.env["VLLM_HOST_IP"] == "127.0.0.1"
    assert srv.url == "http://127.0.0.1:1234"
    harness = S.vllm_serve_plan(S.builtin_systems()["vllm"], S.CommonArgs(model="/m"), "127.0.0.1", 1234)
    assert harness.argv[:9] == plan.argv[:9]


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_engine_cpus_pin_each_engine_to_its_own_core(monkeypatch):
    from vllm_kunserve.cluster.fleet import EngineSpec, engine_env

    monkeypatch.delenv("KUNSERVE_ENGINE_CPUS", raising=False)
    spec = EngineSpec("m", env={"KUNSERVE_ENGINE_CPUS": "0|1"})
    assert [engine_env(spec, i)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(3)] == ["0", "1", "0"]
    assert "KUNSERVE_ENGINE_CPUS" not in engine_env(spec, 0)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(EngineSpec("m"), 1)
    monkeypatch.setenv("KUNSERVE_ENGINE_CPUS", "0-1|2-3")
    assert engine_env(EngineSpec("m"), 1)["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"


def test_engine_nice_prefixes_the_engine_command_and_rejects_bad_values(monkeypatch):
    from vllm_kunserve.cluster.fleet import engine_nice

    monkeypatch.delenv("KUNSERVE_ENGINE_NICE", raising=False)
    env = {"KUNSERVE_ENGINE_NICE": "5", "X": "1"}
    assert engine_nice(env) == ["nice", "-n", "5"]
    assert env == {"X": "1"}                      # not passed on to the engine
    assert engine_nice({}) == [] and engine_nice({"KUNSERVE_ENGINE_NICE": "0"}) == []
    monkeypatch.setenv("KUNSERVE_ENGINE_NICE", "3")
    assert engine_nice({}) == ["nice", "-n", "3"]
    for bad in ("-1", "20", "low"):
        with pytest.raises(ValueError, match="KUNSERVE_ENGINE_NICE"):
            engine_nice({"KUNSERVE_ENGINE_NICE": bad})


def test_free_port_never_hands_out_the_same_port_twice():
    from vllm_kunserve.cluster.launcher import free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
