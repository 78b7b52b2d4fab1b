"""The fleet: N vLLM engines started, watched and restarted for one front end.

Each engine is a whole ``vllm serve`` (its own OpenAI server, engine core and, for kunserve engines,
its control port; ``cluster.fleet.spec``). A backend (``cluster.fleet.backends``: local process
groups or Ray actors) decides where the process runs.

:class:`Fleet` starts every engine (a progress line per instance as each becomes ready), tells the
front end which engines accept work, and runs a supervisor thread: an engine whose process died is
marked dead (dispatch skips it, its requests fail over), restarted, and rejoins when healthy. Every
start, death and restart is an event (``events``) and a counter the front end exports.

An elastic fleet (``max_instances`` above ``instances``) holds the engines it has not started as
``parked``: :meth:`Fleet.add` starts one (``ready`` when healthy), :meth:`Fleet.drain` stops sending it
work (``draining``: its requests finish or move) and :meth:`Fleet.retire` stops it (``parked`` again).
Which and when is ``cluster.control.elastic``'s call.
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
                 check_interval_s: float = 0.5, progress: Callable[[str], None] | None = None,
                 max_instances: int | None = None):
        if instances < 1:
            raise ValueError(f"--instances must be >= 1, got {instances}")
        if max_instances is not None and max_instances < instances:
            raise ValueError(f"--max-instances {max_instances} is below --instances {instances}")
        self.spec, self.backend, self.restart = spec, backend, restart
        self.engines = [Engine(i, state="starting" if i < instances else "parked")
                        for i in range(max(instances, max_instances or 0))]
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
        """Start every engine not parked, then wait for each (a progress line per instance); raises if one fails."""
        first = [e for e in self.engines if e.state != "parked"]
        n = len(first)
        for e in first:
            self._start_one(e)
            self.progress(f"[kunserve] instance {e.index + 1}/{n}: starting at {e.url}")
        try:
            for e in first:
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
                if e.serving and not self.backend.alive(e):
                    self.mark_dead(e, "process exited")

    def mark_dead(self, e: Engine, why: str) -> None:
        """Called by the supervisor, or by the front end when an engine stops answering. A draining
        engine that dies is not restarted: it was leaving (its requests fail over)."""
        with self._lock:
            if not e.serving:
                return
            leaving, e.state = e.state == "draining", "dead"
        self.event(e, "dead", reason=why)
        if leaving:
            self.backend.stop(e)
            e.state = "parked"
            self.event(e, "removed", reason="died while draining")
            return
        if self.restart and not self._stop.is_set():
            threading.Thread(target=self._restart, args=(e,), name=f"kunserve-restart-{e.index}", daemon=True).start()

    def _come_up(self, e: Engine, failed: Callable[[Exception], None]) -> bool:
        """Start ``e``'s engine and wait until it is healthy (a launch that exits at startup, e.g. a
        port taken meanwhile, is retried); ``ready_s`` set, True. A failure calls ``failed`` (False);
        an engine that came up while the fleet stopped is stopped too (False)."""
        try:
            self._start_one(e)
            self._wait_started(e)
        except Exception as exc:
            failed(exc)
            return False
        if self._stop.is_set():
            self.backend.stop(e)
            e.state = "stopped"
            return False
        e.ready_s = time.monotonic()
        return True

    def _restart(self, e: Engine) -> None:
        def failed(exc: Exception) -> None:
            logger.error("instance %d: restart failed: %s", e.index, exc)
            e.state = "dead"
            self.event(e, "restart_failed", error=str(exc)[-500:])
        e.state = "restarting"
        try:
            self.backend.stop(e)
        except Exception as exc:
            failed(exc)
            return
        if self._stop.is_set() or not self._come_up(e, failed):
            return
        e.restarts += 1
        e.state = "ready"
        self.event(e, "restarted", startup_s=round(e.ready_s - e.started_s, 2), url=e.url)

    # -- elastic: add, drain, retire --------------------------------------------------------------
    def add(self, reason: str = "") -> Engine | None:
        """Start the lowest-numbered parked engine (in a thread; ``ready`` when healthy, ``parked``
        again with an ``add_failed`` event if it never starts). None when none is parked."""
        with self._lock:
            e = next((x for x in self.engines if x.state == "parked"), None)
            if e is None or self._stop.is_set():
                return None
            e.state = "starting"
        self.event(e, "adding", reason=reason)
        threading.Thread(target=self._add, args=(e,), name=f"kunserve-add-{e.index}", daemon=True).start()
        return e

    def _add(self, e: Engine) -> None:
        def failed(exc: Exception) -> None:
            logger.error("instance %d: start failed: %s", e.index, exc)
            self.backend.stop(e)
            e.state = "parked"
            self.event(e, "add_failed", error=str(exc)[-500:])
        if self._come_up(e, failed):
            e.state = "ready"
            self.event(e, "added", startup_s=round(e.ready_s - e.started_s, 2), url=e.url)

    def drain(self, index: int, reason: str = "") -> bool:
        """Stop sending engine ``index`` new requests (those it holds finish or move); False unless it was ready."""
        e = self.engines[index]
        with self._lock:
            if e.state != "ready":
                return False
            e.state = "draining"
        self.event(e, "draining", reason=reason)
        return True

    def retire(self, index: int) -> bool:
        """Stop a draining engine (it holds nothing now) and park it; False unless it was draining."""
        e = self.engines[index]
        with self._lock:
            if e.state != "draining":
                return False
            e.state = "stopping"
        self.backend.stop(e)
        e.state = "parked"
        self.event(e, "removed", up_s=round(time.monotonic() - e.started_s, 1))
        return True

    def counts(self) -> dict[str, int]:
        """Engines per state."""
        out: dict[str, int] = {}
        for e in self.engines:
            out[e.state] = out.get(e.state, 0) + 1
        return out

    def kill(self, index: int) -> None:
        """Hard-kill one engine (tests and fault drills); the supervisor notices and restarts it."""
        self.backend.kill(self.engines[index])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for e in self.engines:
            if e.state != "parked":
                self.backend.stop(e)
                e.state = "stopped"
        self.backend.close()

    def ready(self) -> Sequence[Engine]:
        return [e for e in self.engines if e.accepting]

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
