"""The fleet: N vLLM engines started, watched and restarted for one front end.

Each engine is a whole ``vllm serve`` (its own OpenAI server, engine core and, for kunserve engines,
its control port). Backends decide where the process runs:

* :class:`LocalBackend` (default): a process group on this machine (``cluster.fleet.launcher``).
* :class:`RayBackend`: one Ray actor per engine, which starts the same ``vllm serve`` on its own
  node (vLLM's Ray executor refuses the CPU platform, so Ray hosts whole engines, not workers).

:class:`Fleet` starts every engine (a progress line per instance as each becomes ready), tells the
front end which engines accept work, and runs a supervisor thread: an engine whose process died is
marked dead (dispatch skips it, its requests fail over), restarted, and rejoins when healthy. Every
start, death and restart is an event (``events``) and a counter the front end exports.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from vllm_kunserve.cluster.fleet.launcher import LaunchPlan, ServerProcess, StartupExited, cpu_env, free_port, serve_argv

logger = logging.getLogger("kunserve.fleet")

__all__ = ["EngineSpec", "Engine", "Fleet", "LocalBackend", "RayBackend", "make_backend"]


@dataclass(frozen=True)
class EngineSpec:
    """What every engine of the fleet runs (all engines are replicas of one model)."""

    model: str
    engine_args: tuple[str, ...] = ()          # vLLM engine arguments, passed through
    kunserve: dict[str, Any] | None = None     # the "kunserve" section (None: stock vLLM engines)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    log_dir: str = ""
    #: relaunches (fresh ports) of an engine whose process exits while it starts: a port another
    #: process took between being handed out and bound, or any other transient start failure. A
    #: timeout is not retried.
    startup_retries: int = 1

    def additional_config(self, control_port: int) -> dict[str, Any] | None:
        if self.kunserve is None:
            return None
        ks = dict(self.kunserve)
        ks["control"] = {**ks.get("control", {}), "port": control_port}
        ks["drop"] = {"group_member": True, **ks.get("drop", {})}  # can join pipeline groups (cluster.control.groups)
        return {"kunserve": ks}


#: ``KUNSERVE_ENGINE_CPUS="0|1"``: engine i runs its model on the i-th entry (vLLM-CPU's
#: ``VLLM_CPU_OMP_THREADS_BIND`` syntax, e.g. ``0|1`` or ``0-1|2-3``), cycling; without it vLLM binds
#: every engine the same way and engines on one host share a core
ENGINE_CPUS = "KUNSERVE_ENGINE_CPUS"
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


def engine_env(spec: EngineSpec, index: int = 0) -> dict[str, str]:
    """One engine's environment: vLLM's CPU settings, the spec's (with ``KUNSERVE_ENGINE_CPUS``
    turned into this engine's own ``VLLM_CPU_OMP_THREADS_BIND``), and a Prometheus directory of its
    own (the engine core's ``kunserve:`` series reach its ``/metrics`` through it; engines sharing
    one would mix their series)."""
    env = {**cpu_env(), **spec.env, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="kunserve-prom-")}
    cpus = env.pop(ENGINE_CPUS, "") or os.environ.get(ENGINE_CPUS, "")
    if cpus:
        parts = [p for p in cpus.split("|") if p.strip()]
        env["VLLM_CPU_OMP_THREADS_BIND"] = parts[index % len(parts)].strip()
    return env


@dataclass
class Engine:
    """One instance as the front end sees it."""

    index: int
    url: str = ""                       # the engine's OpenAI server
    control_url: str = ""               # its control port ("" for stock engines)
    state: str = "starting"             # starting | ready | dead | restarting | stopped
    restarts: int = 0
    started_s: float = 0.0
    ready_s: float = 0.0
    handle: Any = None                  # backend-specific

    @property
    def accepting(self) -> bool:
        return self.state == "ready"

    def view(self) -> dict:
        return {"instance": self.index, "url": self.url, "control_url": self.control_url or None,
                "state": self.state, "restarts": self.restarts,
                "startup_s": round(self.ready_s - self.started_s, 2) if self.ready_s else None}


def start_engine(spec: EngineSpec, index: int, bind_host: str, url_host: str, tag: str) -> tuple[ServerProcess, str]:
    """Start one engine's ``vllm serve`` (and, for kunserve engines, its control port) bound to
    ``bind_host`` on free ports; returns the process (its URL on ``url_host``) and the control URL."""
    port, cport = free_port(bind_host), free_port(bind_host)
    ctl = spec.additional_config(cport)
    if ctl is not None:
        ctl["kunserve"]["control"]["host"] = bind_host
    env = engine_env(spec, index)
    plan = LaunchPlan(engine_nice(env) + serve_argv(spec.model, bind_host, port, spec.engine_args, ctl), env)
    log = Path(spec.log_dir or tempfile.gettempdir()) / f"kunserve-{tag}{index}-{port}.log"
    proc = ServerProcess(plan, url_host, port, log).start()
    logger.info("instance %d: starting on %s (log %s)", index, proc.endpoint, log)
    return proc, (f"http://{url_host}:{cport}" if ctl is not None else "")


class LocalBackend:
    """Engines as local process groups (``vllm serve`` on 127.0.0.1 or ``host``)."""

    name = "local"

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host

    def launch(self, spec: EngineSpec, index: int, engine: Engine) -> None:
        engine.handle, engine.control_url = start_engine(spec, index, self.host, self.host, "engine")
        engine.url = engine.handle.endpoint

    def wait_ready(self, engine: Engine, timeout_s: float) -> None:
        engine.handle.wait_ready(timeout_s)

    def alive(self, engine: Engine) -> bool:
        return engine.handle is not None and engine.handle.alive()

    def kill(self, engine: Engine) -> None:
        if engine.handle is not None:
            engine.handle.kill()

    def stop(self, engine: Engine) -> None:
        if engine.handle is not None:
            engine.handle.stop()

    def close(self) -> None:
        pass


class _RayEngineActor:
    """Body of the Ray actor: a ``vllm serve`` on the actor's node (wrapped by ``ray.remote`` lazily)."""

    def __init__(self, spec: EngineSpec, index: int, bind_host: str):
        import ray

        self.host = ray.util.get_node_ip_address() if bind_host in ("", "0.0.0.0") else bind_host
        self.index, self.spec, self.bind = index, spec, bind_host or "0.0.0.0"
        self.proc: ServerProcess | None = None

    def start(self) -> tuple[str, str]:
        self.proc, control = start_engine(self.spec, self.index, self.bind, self.host, "ray-engine")
        return self.proc.endpoint, control

    def wait_ready(self, timeout_s: float) -> float:
        assert self.proc is not None
        return self.proc.wait_ready(timeout_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> int | None:
        return self.proc.stop() if self.proc else None


class RayBackend:
    """Engines as Ray actors, one whole engine each (across machines when given a Ray address).

    ``address`` None starts a local Ray; otherwise it is passed to ``ray.init`` (``auto`` or
    ``ray://host:10001``). Each actor reserves ``num_cpus`` of its node. The engine binds 0.0.0.0
    on a multi-node cluster so the front end can reach it (set a control token then)."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: float = 1.0, bind_host: str | None = None):
        try:
            import ray
        except ImportError as e:  # pragma: no cover - depends on the optional extra
            raise ValueError("--backend ray needs Ray: pip install 'vllm-kunserve[ray]'") from e
        self.ray = ray
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=max(int(os.cpu_count() or 1), 1), include_dashboard=False, log_to_driver=False)
        self.num_cpus = num_cpus
        self.bind_host = bind_host if bind_host is not None else ("127.0.0.1" if not address else "0.0.0.0")
        self._cls = ray.remote(num_cpus=num_cpus, max_restarts=0)(_RayEngineActor)

    def launch(self, spec: EngineSpec, index: int, engine: Engine) -> None:
        actor = self._cls.remote(spec, index, self.bind_host)
        engine.handle = actor
        engine.url, engine.control_url = self.ray.get(actor.start.remote(), timeout=120)
        logger.info("instance %d: starting as a Ray actor on %s", index, engine.url)

    def wait_ready(self, engine: Engine, timeout_s: float) -> None:
        self.ray.get(engine.handle.wait_ready.remote(timeout_s), timeout=timeout_s + 30)

    def alive(self, engine: Engine) -> bool:
        if engine.handle is None:
            return False
        try:
            return bool(self.ray.get(engine.handle.alive.remote(), timeout=10))
        except Exception:  # the actor itself died (its node went away)
            return False

    def kill(self, engine: Engine) -> None:
        try:
            self.ray.get(engine.handle.kill.remote(), timeout=10)
        except Exception:
            pass

    def stop(self, engine: Engine) -> None:
        if engine.handle is None:
            return
        try:
            self.ray.get(engine.handle.stop.remote(), timeout=60)
        except Exception:
            pass
        try:
            self.ray.kill(engine.handle)
        except Exception:
            pass

    def close(self) -> None:
        self.ray.shutdown()


def make_backend(name: str, host: str = "127.0.0.1", ray_address: str | None = None,
                 ray_num_cpus: float = 1.0):
    if name == "local":
        return LocalBackend(host)
    if name == "ray":
        return RayBackend(ray_address, ray_num_cpus)
    raise ValueError(f"--backend {name!r}: one of local, ray")


class Fleet:
    """N engines of one spec on one backend, with a supervisor that restarts dead ones."""

    def __init__(self, spec: EngineSpec, instances: int, backend, *, restart: bool = True,
                 check_interval_s: float = 0.5, progress: Callable[[str], None] | None = None):
        if instances < 1:
            raise ValueError(f"--instances must be >= 1, got {instances}")
        self.spec, self.backend, self.restart = spec, backend, restart
        self.engines = [Engine(i) for i in range(instances)]
        self.events: list[dict] = []
        self.check_interval_s = check_interval_s
        self.progress = progress or (lambda line: print(line, flush=True))
        self.on_change: list[Callable[[Engine, str], None]] = []   # (engine, event kind)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- events -----------------------------------------------------------------------------------
    def event(self, engine: Engine, kind: str, **info: Any) -> None:
        ev = {"t": time.time(), "instance": engine.index, "event": kind, **info}
        with self._lock:
            self.events.append(ev)
            del self.events[:-200]
        logger.info("instance %d: %s %s", engine.index, kind, info or "")
        for cb in list(self.on_change):
            try:
                cb(engine, kind)
            except Exception:  # a listener must not break the supervisor
                logger.exception("fleet listener failed")

    # -- lifecycle --------------------------------------------------------------------------------
    def _start_one(self, e: Engine) -> None:
        e.started_s, e.ready_s = time.monotonic(), 0.0
        self.backend.launch(self.spec, e.index, e)

    def start(self) -> "Fleet":
        """Start every engine, then wait for each (a progress line per instance); raises if one fails."""
        n = len(self.engines)
        for e in self.engines:
            self._start_one(e)
            self.progress(f"[kunserve] instance {e.index + 1}/{n}: starting at {e.url}")
        try:
            for e in self.engines:
                self._wait_started(e)
                e.ready_s = time.monotonic()
                e.state = "ready"
                self.progress(f"[kunserve] instance {e.index + 1}/{n}: ready in {e.ready_s - e.started_s:.1f} s "
                              f"({e.url}{', control ' + e.control_url if e.control_url else ''})")
                self.event(e, "ready", startup_s=round(e.ready_s - e.started_s, 2))
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._supervise, name="kunserve-fleet", daemon=True)
        self._thread.start()
        return self

    def _wait_started(self, e: Engine) -> None:
        for attempt in range(self.spec.startup_retries + 1):
            try:
                self.backend.wait_ready(e, self.spec.startup_timeout_s)
                return
            except StartupExited as exc:
                exc.instance = e.index
                logger.error("attempt %d of %d: %s", attempt + 1, self.spec.startup_retries + 1, exc.one_line())
                self.event(e, "start_failed", attempt=attempt + 1, error=str(exc)[:2000])
                if attempt == self.spec.startup_retries or self._stop.is_set():
                    raise   # out of tries, or the fleet is stopping (the exit was the stop's kill)
                self.backend.stop(e)
                self._start_one(e)

    def _supervise(self) -> None:
        while not self._stop.wait(self.check_interval_s):
            for e in self.engines:
                if e.state == "ready" and not self.backend.alive(e):
                    self.mark_dead(e, "process exited")

    def mark_dead(self, e: Engine, why: str) -> None:
        """Called by the supervisor, or by the front end when an engine stops answering."""
        with self._lock:
            if e.state != "ready":
                return
            e.state = "dead"
        self.event(e, "dead", reason=why)
        if self.restart and not self._stop.is_set():
            threading.Thread(target=self._restart, args=(e,), name=f"kunserve-restart-{e.index}", daemon=True).start()

    def _restart(self, e: Engine) -> None:
        e.state = "restarting"
        try:
            self.backend.stop(e)
            if self._stop.is_set():
                return
            self._start_one(e)
            self._wait_started(e)   # a relaunch that exits at startup (a port taken meanwhile) is retried
        except Exception as exc:
            logger.error("instance %d: restart failed: %s", e.index, exc)
            e.state = "dead"
            self.event(e, "restart_failed", error=str(exc)[-500:])
            return
        if self._stop.is_set():   # the fleet stopped while this engine came up: stop it too
            self.backend.stop(e)
            e.state = "stopped"
            return
        e.ready_s = time.monotonic()
        e.restarts += 1
        e.state = "ready"
        self.event(e, "restarted", startup_s=round(e.ready_s - e.started_s, 2), url=e.url)

    def kill(self, index: int) -> None:
        """Hard-kill one engine (tests and fault drills); the supervisor notices and restarts it."""
        self.backend.kill(self.engines[index])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for e in self.engines:
            self.backend.stop(e)
            e.state = "stopped"
        self.backend.close()

    def ready(self) -> Sequence[Engine]:
        return [e for e in self.engines if e.accepting]

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
