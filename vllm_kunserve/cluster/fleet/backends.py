"""Where an engine runs: the :class:`Backend` protocol and its two implementations, named in
:data:`BACKENDS` (the one list ``kunserve serve --backend`` offers) and built by :func:`make_backend`.

* :class:`LocalBackend` (default): a process group on this machine (``cluster.fleet.launcher``).
* :class:`RayBackend`: one Ray actor per engine, which starts the same ``vllm serve`` on its own
  node (vLLM's Ray executor refuses the CPU platform, so Ray hosts whole engines, not workers).

Every engine is whole on its node. Cluster drop's pipeline groups need more: the members of a
group talk over stage links (shared memory between processes), so **the members of a pipeline
group must be on one host**; Ray engines on different nodes can be dispatched to and migrated
between, but not grouped.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from typing import Protocol, runtime_checkable

from vllm_kunserve.cluster.fleet.launcher import ServerProcess, StartupExited
from vllm_kunserve.cluster.fleet.spec import Engine, EngineSpec, start_engine
from vllm_kunserve.engine.state import HOST_ENV

logger = logging.getLogger("kunserve.fleet")

__all__ = ["BACKENDS", "Backend", "LocalBackend", "RayBackend", "make_backend"]

#: the backends, by the name ``kunserve serve --backend`` takes (the first is the default)
BACKENDS = ("local", "ray")
#: how Ray places the engines' actors (``--ray-placement``; the first is the default)
RAY_PLACEMENTS = ("spread", "pack")
#: engines started elsewhere, attached by URL (``kunserve serve --engine-url``; not a --backend choice)
ATTACH = "attach"


@runtime_checkable
class Backend(Protocol):
    """What :class:`~vllm_kunserve.cluster.fleet.fleet.Fleet` asks of a backend, per engine: start it
    (setting ``engine.url``, ``engine.control_url`` and ``engine.handle``), wait until it serves,
    tell whether its process lives, kill it (a fault drill), stop it; and release the backend."""

    name: str
    #: whether the front end asks ``alive`` the moment a request to the engine fails (else it is
    #: left to the supervisor's periodic check)
    probe_on_failure: bool
    #: ``alive`` may block (a remote call): the front end asks it from a worker thread, never in
    #: its event loop, and marks the engine dead when the answer comes
    probe_in_thread: bool

    def launch(self, spec: EngineSpec, index: int, engine: Engine) -> None: ...

    def wait_ready(self, engine: Engine, timeout_s: float) -> None: ...

    def alive(self, engine: Engine) -> bool: ...

    def kill(self, engine: Engine) -> None: ...

    def stop(self, engine: Engine) -> None: ...

    def close(self) -> None: ...


class LocalBackend:
    """Engines as local process groups (``vllm serve`` on 127.0.0.1 or ``host``)."""

    name = "local"
    probe_on_failure = True   # a process check, instant
    probe_in_thread = False

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
        self.node = ray.get_runtime_context().get_node_id()
        # the engine reports its Ray node as its host: groups form within a node, also where several
        # nodes share one machine (a test cluster) and its name
        spec = replace(spec, env={**spec.env, HOST_ENV: f"ray-node-{self.node[:16]}"})
        self.index, self.spec, self.bind = index, spec, bind_host or "0.0.0.0"
        self.proc: ServerProcess | None = None

    def start(self) -> tuple[str, str, str]:
        self.proc, control = start_engine(self.spec, self.index, self.bind, self.host, "ray-engine")
        return self.proc.endpoint, control, self.node

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
    probe_on_failure = True
    probe_in_thread = True    # a remote call (up to 10 s): off the front end's event loop

    def __init__(self, address: str | None = None, num_cpus: float = 1.0, bind_host: str | None = None,
                 resources: dict[str, float] | None = None, placement: str = RAY_PLACEMENTS[0],
                 place_timeout_s: float = 120.0):
        if placement not in RAY_PLACEMENTS:
            raise ValueError(f"--ray-placement {placement!r}: one of {', '.join(RAY_PLACEMENTS)}")
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
        self.num_cpus, self.resources, self.place_timeout_s = num_cpus, dict(resources or {}), place_timeout_s
        self.bind_host = bind_host if bind_host is not None else ("127.0.0.1" if not address else "0.0.0.0")
        # each engine reserves its CPUs and any custom resources (the nodes that offer them: e.g. one
        # "engine_slot" per node for one engine a node); "spread" puts replicas on distinct nodes where
        # Ray can (one node's loss takes the fewest engines), "pack" fills a node first (more groups)
        self._cls = ray.remote(num_cpus=num_cpus, resources=self.resources or None, max_restarts=0,
                               scheduling_strategy="SPREAD" if placement == "spread" else "DEFAULT")(_RayEngineActor)

    def launch(self, spec: EngineSpec, index: int, engine: Engine) -> None:
        actor = self._cls.remote(spec, index, self.bind_host)
        engine.handle = actor
        try:
            engine.url, engine.control_url, engine.node = self.ray.get(actor.start.remote(),
                                                                       timeout=self.place_timeout_s)
        except Exception as e:   # no node offers what it reserves (yet), or its start failed: no actor lingers
            self.ray.kill(actor)
            engine.handle = None
            if isinstance(e, self.ray.exceptions.GetTimeoutError):
                raise RuntimeError(f"instance {index}: no Ray node took the engine in {self.place_timeout_s:g} s "
                                   f"(it reserves {self.num_cpus:g} CPUs"
                                   + (f" and {json.dumps(self.resources)}" if self.resources else "")
                                   + "; `ray status` shows what the nodes offer)") from None
            raise
        logger.info("instance %d: starting as a Ray actor on node %s at %s", index, engine.node[:16], engine.url)

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


class AttachBackend:
    """Engines started elsewhere (Kubernetes pods, another launcher, by hand), attached by URL:
    kunserve fronts them and watches their ``/health``; it neither starts, stops nor kills them. One
    that stops answering is marked dead (its requests fail over) and rejoins once ``/health``
    answers again (the fleet's restart waits for it). ``control_urls``: their control ports, for
    kunserve engines; where one is not given, the engine is asked (``GET /kunserve/engine``, the
    kunserve endpoint plugin's route on ``vllm serve``, ``integration/vllm/endpoint.py``) once its
    ``/health`` answers; an engine without the route is stock, read through ``/metrics``.
    ``found``: per index, where its control URL came from ("flag", "engine") and, for an engine
    whose announced port cannot serve this front end, why it is read as stock."""

    name = ATTACH
    probe_on_failure = False  # alive() is an HTTP round trip: never in the front end's event loop
    probe_in_thread = True

    def __init__(self, urls: list[str], control_urls: list[str | None] | None = None, health_timeout_s: float = 2.0,
                 misses_to_dead: int = 3, heard_fresh_s: float = 1.0):
        control = list(control_urls or [])
        #: an engine that answered a request this recently is alive without a probe: under load the
        #: supervisor's probes (an HTTP round trip per engine every half second, from a thread that
        #: takes the interpreter lock from the relay) were ~5% of the front end's CPU at 32 streams
        self.heard_fresh_s = heard_fresh_s
        self.misses_to_dead = misses_to_dead   # consecutive failed checks before an engine counts as dead
        self._misses: dict[int, int] = {}
        if len(control) > len(urls):
            raise ValueError(f"{len(control)} control URLs for {len(urls)} engine URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.control = [c.rstrip("/") if c else None for c in control] + [None] * (len(urls) - len(control))
        self.health_timeout_s = health_timeout_s
        self.found: dict[int, str] = {i: "flag" for i, c in enumerate(self.control) if c}

    def launch(self, spec: EngineSpec, index: int, engine: Engine) -> None:
        engine.url, engine.control_url, engine.handle = self.urls[index], self.control[index], None

    def discover(self, engine: Engine, deadline: float) -> None:
        """Ask a serving engine for its control port (kunserve's endpoint plugin); leave it stock
        where the engine has no such route (404: a stock engine, or one run without
        ``VLLM_PLUGINS=kunserve``), and where its port listens on a loopback address of another
        machine (unreachable from here)."""
        import json
        import urllib.error
        import urllib.parse
        import urllib.request

        from vllm_kunserve.engine.control import is_loopback

        if self.control[engine.index]:
            return
        while True:
            try:
                with urllib.request.urlopen(f"{engine.url}/kunserve/engine", timeout=self.health_timeout_s) as r:
                    url = json.loads(r.read()).get("control_url")
                break
            except urllib.error.HTTPError as e:
                if e.code == 503 and time.monotonic() < deadline:   # the engine core has not announced yet
                    time.sleep(0.5)
                    continue
                self.found[engine.index] = f"stock (GET /kunserve/engine answered {e.code})"
                return
            except (urllib.error.URLError, OSError, ValueError) as e:
                self.found[engine.index] = f"stock (GET /kunserve/engine: {type(e).__name__})"
                return
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            self.found[engine.index] = "stock (/kunserve/engine named no control URL)"
            return
        parts = urllib.parse.urlsplit(url)
        host, reach = parts.hostname or "", urllib.parse.urlsplit(engine.url).hostname or ""
        if host in ("0.0.0.0", "::") and reach:   # bound to every interface (control.host 0.0.0.0, e.g. a
            # pod): its port is on the host this front end reaches the engine at
            url = parts._replace(netloc=f"[{reach}]:{parts.port}" if ":" in reach else f"{reach}:{parts.port}").geturl()
            host = reach
        if is_loopback(host) and not is_loopback(reach):
            self.found[engine.index] = (f"stock (its control port {url} listens on the engine's loopback, "
                                        "unreachable from here: set the engine's kunserve control.host)")
            return
        engine.control_url = url.rstrip("/")   # asked again after a restart: the port may be another
        self.found[engine.index] = "engine"

    def healthy(self, url: str, timeout_s: float | None = None) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"{url}/health", timeout=timeout_s or self.health_timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, engine: Engine, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy(engine.url):
            if time.monotonic() > deadline:
                raise StartupExited(f"{engine.url}/health did not answer 200 within {timeout_s:.0f} s "
                                    f"(--engine-url: the engine must be serving)", None, engine.index)
            time.sleep(0.5)
        self.discover(engine, deadline)

    def alive(self, engine: Engine) -> bool:
        """False after ``misses_to_dead`` failed checks in a row (one lost probe on a network is not
        a death). An engine heard from within ``heard_fresh_s`` is alive without a probe (passive
        health checking, as proxies do: the requests it answers are the probe)."""
        if time.monotonic() - engine.heard_s < self.heard_fresh_s or self.healthy(engine.url):
            self._misses[engine.index] = 0
            return True
        self._misses[engine.index] = self._misses.get(engine.index, 0) + 1
        return self._misses[engine.index] < self.misses_to_dead

    def kill(self, engine: Engine) -> None:
        raise NotImplementedError(f"instance {engine.index} ({engine.url}) was started elsewhere: kunserve does not "
                                  "kill attached engines")

    def stop(self, engine: Engine) -> None:
        pass   # not ours to stop

    def close(self) -> None:
        pass


def make_backend(name: str, host: str = "127.0.0.1", ray_address: str | None = None,
                 ray_num_cpus: float = 1.0, ray_resources: dict[str, float] | None = None,
                 ray_placement: str = RAY_PLACEMENTS[0]) -> Backend:
    """The backend named ``name`` (one of :data:`BACKENDS`)."""
    if name == "local":
        return LocalBackend(host)
    if name == "ray":
        return RayBackend(ray_address, ray_num_cpus, resources=ray_resources, placement=ray_placement)
    raise ValueError(f"--backend {name!r}: one of {', '.join(BACKENDS)}")
