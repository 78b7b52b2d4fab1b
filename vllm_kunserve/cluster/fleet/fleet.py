"""The fleet: N vLLM engines started, watched and restarted for one front end.

Each engine is a whole ``vllm serve`` (its own OpenAI server, engine core and, for kunserve engines,
its control port; ``cluster.fleet.spec``). A backend (``cluster.fleet.backends``: local process
groups or Ray actors) decides where the process runs.

:class:`Fleet` starts every engine (a progress line per instance as each becomes ready), tells the
front end which engines accept work, and runs a supervisor thread: an engine whose process died is
marked dead (dispatch skips it, its requests fail over), restarted, and rejoins when healthy. Every
start, death and restart is an event (``events``) and a counter the front end exports.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from vllm_kunserve.cluster.fleet.backends import Backend
from vllm_kunserve.cluster.fleet.launcher import StartupExited
from vllm_kunserve.cluster.fleet.spec import Engine, EngineSpec

logger = logging.getLogger("kunserve.fleet")

__all__ = ["Fleet"]


class Fleet:
    """N engines of one spec on one backend, with a supervisor that restarts dead ones."""

    def __init__(self, spec: EngineSpec, instances: int, backend: Backend, *, restart: bool = True,
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
