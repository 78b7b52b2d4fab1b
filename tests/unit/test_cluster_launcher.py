"""Process launching (``cluster.fleet.launcher``): one ``vllm serve`` command builder for the harness and
:class:`VllmServer`."""

import json
import sys

import pytest

from vllm_kunserve.bench import systems as S
from vllm_kunserve.cluster.fleet.launcher import VllmServer, free_port, serve_argv

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
    from vllm_kunserve.cluster.fleet.spec import EngineSpec, engine_env

    monkeypatch.delenv("KUNSERVE_ENGINE_CPUS", raising=False)
    spec = EngineSpec("m", env={"KUNSERVE_ENGINE_CPUS": "0|1"})
    assert [engine_env(spec, i)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(3)] == ["0", "1", "0"]
    assert "KUNSERVE_ENGINE_CPUS" not in engine_env(spec, 0)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(EngineSpec("m"), 1)
    monkeypatch.setenv("KUNSERVE_ENGINE_CPUS", "0-1|2-3")
    assert engine_env(EngineSpec("m"), 1)["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"


def test_engine_nice_prefixes_the_engine_command_and_rejects_bad_values(monkeypatch):
    from vllm_kunserve.cluster.fleet.spec import engine_nice

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


def test_a_vllm_server_runs_at_the_engine_niceness_but_kunserve_serve_passes_it_on(monkeypatch):
    """A ``vllm serve`` started by the launcher (benchmarks, attach tests) is niced as ``kunserve
    serve`` nices its own engines; ``kunserve serve`` itself (the front end) is not, and hands the
    setting on to the fleet in its environment."""
    from vllm_kunserve.cluster.fleet.launcher import KunserveCluster, VllmServer

    monkeypatch.delenv("KUNSERVE_ENGINE_NICE", raising=False)
    plain = VllmServer("m", port=8000).plan()
    assert plain.argv[:3] != ["nice", "-n", "7"] and "KUNSERVE_ENGINE_NICE" not in plain.env
    plan = VllmServer("m", port=8000, env={"KUNSERVE_ENGINE_NICE": "7"}).plan()
    assert plan.argv[:3] == ["nice", "-n", "7"] and "vllm" in " ".join(plan.argv[3:])
    assert "KUNSERVE_ENGINE_NICE" not in plan.env
    front = KunserveCluster("m", port=8000, env={"KUNSERVE_ENGINE_NICE": "7"}).plan()
    assert front.argv[0] != "nice" and front.env["KUNSERVE_ENGINE_NICE"] == "7"


def test_free_port_never_hands_out_the_same_port_twice():
    from vllm_kunserve.cluster.fleet.launcher import free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


_SERVER = r"""
import http.server, sys
port, fail = int(sys.argv[1]), sys.argv[2] == "fail"
print("INFO starting", flush=True)
if fail:
    print("(EngineCore pid=1) ERROR EngineCore failed to start.", flush=True)
    print("OSError: [Errno 98] control port: address already in use", flush=True)
    for i in range(60):  # the front process's own traceback, long after the root cause
        print(f"  frame {i}", flush=True)
    sys.exit(1)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


class _ScriptBackend:
    """Engines that are small HTTP servers: the first ``fails`` launches exit at startup."""

    name = "script"

    def __init__(self, tmp_path, fails: int):
        self.tmp, self.fails, self.launches = tmp_path, fails, 0

    def launch(self, spec, index, engine):
        from vllm_kunserve.cluster.fleet.launcher import LaunchPlan, ServerProcess

        self.launches += 1
        port = free_port()
        mode = "fail" if self.launches <= self.fails else "serve"
        plan = LaunchPlan([sys.executable, "-c", _SERVER, str(port), mode], {})
        engine.handle = ServerProcess(plan, "127.0.0.1", port, self.tmp / f"e{index}-{self.launches}.log").start()
        engine.url = engine.handle.endpoint

    def wait_ready(self, engine, timeout_s):
        engine.handle.wait_ready(timeout_s)

    def alive(self, engine):
        return engine.handle.alive()

    def stop(self, engine):
        engine.handle.stop(grace_s=5)

    def close(self):
        pass


def test_an_engine_that_exits_at_startup_is_relaunched_once_and_its_first_error_is_shown(tmp_path):
    from vllm_kunserve.cluster.fleet.fleet import Fleet
    from vllm_kunserve.cluster.fleet.spec import EngineSpec

    backend = _ScriptBackend(tmp_path, fails=1)
    with Fleet(EngineSpec("m", startup_timeout_s=30), 1, backend, progress=lambda _: None) as fleet:
        assert backend.launches == 2 and fleet.engines[0].state == "ready"
        (ev,) = [e for e in fleet.events if e["event"] == "start_failed"]
        assert ev["attempt"] == 1
        # the root cause (the log's first error) is in the message, not only the log's last lines
        assert "address already in use" in ev["error"] and "frame 59" in ev["error"]


def test_an_engine_that_keeps_exiting_at_startup_fails_the_fleet(tmp_path):
    from vllm_kunserve.cluster.fleet.fleet import Fleet
    from vllm_kunserve.cluster.fleet.spec import EngineSpec
    from vllm_kunserve.cluster.fleet.launcher import StartupExited

    backend = _ScriptBackend(tmp_path, fails=2)
    with pytest.raises(StartupExited, match="address already in use"):
        Fleet(EngineSpec("m", startup_timeout_s=30), 1, backend, progress=lambda _: None).start()
    assert backend.launches == 2
    backend = _ScriptBackend(tmp_path, fails=1)
    with pytest.raises(StartupExited):
        Fleet(EngineSpec("m", startup_timeout_s=30, startup_retries=0), 1, backend, progress=lambda _: None).start()
    assert backend.launches == 1


def test_a_restart_that_exits_at_startup_is_relaunched(tmp_path):
    """A dead engine's relaunch gets the same startup retry as the first start."""
    import time

    from vllm_kunserve.cluster.fleet.fleet import Fleet
    from vllm_kunserve.cluster.fleet.spec import EngineSpec

    backend = _ScriptBackend(tmp_path, fails=0)
    with Fleet(EngineSpec("m", startup_timeout_s=30), 1, backend, progress=lambda _: None) as fleet:
        backend.fails = 2          # the next launch (the restart's first) exits at startup
        fleet.mark_dead(fleet.engines[0], "test")
        deadline = time.monotonic() + 60
        while fleet.engines[0].state != "ready" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fleet.engines[0].state == "ready" and fleet.engines[0].restarts == 1
        assert backend.launches == 3
        kinds = [e["event"] for e in fleet.events]
        assert kinds.count("start_failed") == 1 and "restarted" in kinds and "restart_failed" not in kinds


def test_log_excerpt_shows_the_first_error_and_the_last_lines(tmp_path):
    from vllm_kunserve.cluster.fleet.launcher import log_excerpt

    log = tmp_path / "x.log"
    log.write_text("\n".join(["INFO a"] * 100 + ["ERROR root cause"] + [f"line {i}" for i in range(200)]))
    text = log_excerpt(log)
    assert text.startswith("first error:\nERROR root cause\nline 0")
    assert text.endswith("line 199") and "line 100" not in text
    warn = ("(APIServer pid=1) WARNING 11-26 [system_utils.py:255] Found ulimit of 20000 ... This can cause "
            "fd limit errors like `OSError: [Errno 24] Too many open files`.")
    log.write_text("\n".join([warn] + ["INFO a"] * 100 + ["(EngineCore pid=2) ValueError: kunserve.bogus: unknown key"]
                             + [f"line {i}" for i in range(200)]))
    assert log_excerpt(log).startswith("first error:\n(EngineCore pid=2) ValueError: kunserve.bogus")
    log.write_text("\n".join(f"line {i}" for i in range(100)))  # no error: the tail
    assert log_excerpt(log).splitlines() == [f"line {i}" for i in range(50, 100)]
    assert log_excerpt(tmp_path / "missing.log") == "(no log)"


def test_cpu_env_sleeps_engine_cores_on_a_cpu_host(monkeypatch):
    """Without an NVIDIA device, engines get KUNSERVE_SHM_WAIT_MS=1 (no engine core spinning on a
    shared core); a value the user set, 0 included, wins; with a GPU vLLM's spin is left alone."""
    from pathlib import Path

    from vllm_kunserve.cluster.fleet import launcher as L

    monkeypatch.delenv("KUNSERVE_SHM_WAIT_MS", raising=False)
    real_exists = Path.exists
    gpu = {"present": False}
    monkeypatch.setattr(Path, "exists", lambda self: gpu["present"] if str(self) == "/dev/nvidiactl"
                        else real_exists(self))
    assert L.cpu_env()["KUNSERVE_SHM_WAIT_MS"] == "1"
    monkeypatch.setenv("KUNSERVE_SHM_WAIT_MS", "0")
    assert "KUNSERVE_SHM_WAIT_MS" not in L.cpu_env()   # the process's own 0 reaches the engine as it is
    monkeypatch.delenv("KUNSERVE_SHM_WAIT_MS")
    gpu["present"] = True
    assert "KUNSERVE_SHM_WAIT_MS" not in L.cpu_env()


def test_local_and_ray_backends_satisfy_the_backend_protocol():
    import inspect

    from vllm_kunserve.cluster.fleet.backends import BACKENDS, Backend, LocalBackend, RayBackend, make_backend

    assert isinstance(make_backend("local"), Backend) and isinstance(LocalBackend("127.0.0.1"), Backend)
    for method in ("launch", "wait_ready", "alive", "kill", "stop", "close"):
        want = list(inspect.signature(getattr(Backend, method)).parameters)
        for cls in (LocalBackend, RayBackend):   # Ray itself is optional: the class, not an instance
            assert list(inspect.signature(getattr(cls, method)).parameters) == want, (cls, method)
    assert (LocalBackend.name, RayBackend.name) == BACKENDS
    with pytest.raises(ValueError, match="one of local, ray"):
        make_backend("k8s")


class _FakeRay:
    """What RayBackend asks of Ray: the actor options it declares, and a start that answers or times out."""

    class exceptions:
        class GetTimeoutError(Exception):
            pass

    def __init__(self, answer=None):
        self.options, self.killed, self.answer = {}, [], answer

    def is_initialized(self):
        return True

    def remote(self, **options):
        self.options = options
        ray = self

        class Actor:
            class start:
                @staticmethod
                def remote():
                    return "start-ref"

        class Cls:
            @staticmethod
            def remote(*args):
                return Actor()
        return lambda body: Cls

    def get(self, ref, timeout=None):
        if self.answer is None:
            raise self.exceptions.GetTimeoutError(ref)
        return self.answer

    def kill(self, actor):
        self.killed.append(actor)


def test_ray_engines_reserve_their_resources_spread_over_nodes_and_no_unplaced_actor_lingers(monkeypatch):
    from vllm_kunserve.cluster.fleet.backends import RayBackend
    from vllm_kunserve.cluster.fleet.spec import Engine, EngineSpec

    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    b = RayBackend("ray://head:10001", 2.0, resources={"engine_slot": 1.0})
    assert fake.options == {"num_cpus": 2.0, "resources": {"engine_slot": 1.0}, "max_restarts": 0,
                            "scheduling_strategy": "SPREAD"}
    assert b.bind_host == "0.0.0.0"
    RayBackend(None, 1.0, placement="pack")
    assert fake.options["scheduling_strategy"] == "DEFAULT" and fake.options["resources"] is None
    with pytest.raises(ValueError, match="--ray-placement 'scatter': one of spread, pack"):
        RayBackend(None, placement="scatter")
    e = Engine(0)
    b.place_timeout_s = 0.5
    with pytest.raises(RuntimeError, match=r'no Ray node took the engine in 0.5 s \(it reserves 2 CPUs and '
                                           r'\{"engine_slot": 1.0\}'):
        b.launch(EngineSpec("m"), 0, e)
    assert len(fake.killed) == 1 and e.handle is None   # the pending actor does not wait on for a node
    fake.answer = ("http://10.0.0.2:8001", "http://10.0.0.2:8002", "a1b2c3")
    b.launch(EngineSpec("m"), 0, e)
    assert (e.url, e.control_url, e.node) == fake.answer and e.view()["node"] == "a1b2c3"
    assert "node" not in Engine(1).view()   # off Ray, no node


def test_start_all_starts_servers_together_and_stops_them_all_on_a_failure():
    """The servers' start-ups overlap (each waits at a barrier only the others' starts can open), and
    one that fails stops every one and raises its error."""
    import threading

    from vllm_kunserve.cluster.fleet.launcher import StartupExited, start_all

    class Fake:
        def __init__(self, barrier, fail=False):
            self.barrier, self.fail, self.started, self.stopped = barrier, fail, False, False

        def start(self):
            self.barrier.wait()          # serial starts would break the barrier after its timeout
            if self.fail:
                raise StartupExited("engine 1 exited", None)
            self.started = True
            return self

        def stop(self):
            self.stopped = True

    b = threading.Barrier(3, timeout=10)
    fleet = [Fake(b) for _ in range(3)]
    assert start_all(fleet) == fleet and all(f.started and not f.stopped for f in fleet)
    b = threading.Barrier(2, timeout=10)
    fleet = [Fake(b), Fake(b, fail=True)]
    with pytest.raises(StartupExited, match="engine 1 exited"):
        start_all(fleet)
    assert all(f.stopped for f in fleet)


def test_a_server_sharing_its_port_is_ready_by_its_own_log_not_anothers_health(tmp_path):
    """``kunserve serve --reuse-port``: another front end on the port answers /health at once, so a
    starting one counts as ready only when its own log says it serves (``KunserveCluster.ready_line``)."""
    import http.server
    import threading

    from vllm_kunserve.cluster.fleet.launcher import SERVING_LINE, KunserveCluster, LaunchPlan, ServerProcess

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)   # the front end already on the port
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    # the line comes from the environment: the log's first line is the command, which must not hold it
    script = "import os, time; time.sleep(1.5); print(os.environ['LINE'], '2 instance(s)', flush=True); time.sleep(60)"
    try:
        for says in (None, SERVING_LINE):
            log = tmp_path / f"{says is None}.log"
            p = ServerProcess(LaunchPlan([sys.executable, "-c", script], {"LINE": SERVING_LINE}), "127.0.0.1", port,
                              log).start()
            try:
                p.wait_ready(30, says)
                assert (SERVING_LINE in log.read_text()) == (says is not None)
            finally:
                p.stop(grace_s=2)
        quiet = ServerProcess(LaunchPlan([sys.executable, "-c", "import sys; sys.exit(3)"], {}), "127.0.0.1", port,
                              tmp_path / "quiet.log").start()
        with pytest.raises(RuntimeError, match="exited with code 3"):   # it never said it serves
            quiet.wait_ready(30, SERVING_LINE)
    finally:
        other.shutdown()
    assert KunserveCluster("m").ready_line == SERVING_LINE and VllmServer("m").ready_line is None
