"""How vLLM's shared-memory queue readers wait while busy: spin, or sleep on the writer's signal
(``KUNSERVE_SHM_WAIT_MS``).

vLLM's multiprocess executor passes every step between the engine core and its workers through
shared-memory ring buffers (``vllm.distributed.device_communicators.shm_broadcast``). A reader
that finds nothing new calls ``SpinCondition.wait``: for ``busy_loop_s`` (1 s) after its last
read it spins on ``sched_yield()``; only after that does it sleep on the ZeroMQ notification the
writer sends with every message (re-checking every 5 s). While an engine serves, the engine core
reads its worker's reply every step, so it never leaves the spin and burns a core for the whole
time the worker computes. With a core to spare per engine that buys microseconds per step; where
cores are shared (vLLM-CPU on a small host, a front end and a client beside the engines) the
spinner takes the CPU the model and every other serving process need. Measured on a 2-core host
with two engines under ``kunserve serve``: each engine core took ~0.35 of a core, and the replay
client's event loop waited up to 5.7 s for a CPU (``runtime/looplag.py``: runnable, not running).

``KUNSERVE_SHM_WAIT_MS=N`` keeps vLLM's busy window but spends it asleep: the reader polls the
writer's notification for up to ``N`` ms at a time and re-checks the buffer, so it wakes as soon
as the writer signals and at the latest ``N`` ms later where a signal was lost (ZeroMQ PUB/SUB
drops messages before a subscription has propagated and past its high-water mark, which is why
notifications alone are not enough: readers that relied on them alone stalled engines at startup).
Idle readers (past the busy window) behave as in vLLM. It is a host setting, not an engine
feature: the plugin applies it in every vLLM process it loads in, engines with or without a
``kunserve`` key alike, so a benchmark's stock engines get the same setting. Unset or 0: vLLM's
spin, untouched.
"""

from __future__ import annotations

import logging
import os

from vllm_kunserve.integration.vllm.base import VllmPatch
from vllm_kunserve.integration.vllm.versions import params

logger = logging.getLogger("vllm.kunserve")

ENV = "KUNSERVE_SHM_WAIT_MS"


def wanted_wait_ms(env: dict | None = None) -> float | None:
    """The poll slice ``KUNSERVE_SHM_WAIT_MS`` asks for (ms, > 0), or None when unset or 0."""
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of milliseconds >= 0, got {raw!r}") from None
    if not 0 <= v < 1000:
        raise ValueError(f"{ENV} must be a number of milliseconds in [0, 1000), got {raw!r}")
    return v or None


class ShmWaitPatch(VllmPatch):
    name = "shm_wait"
    summary = "shared-memory queue readers sleep on the writer's signal (KUNSERVE_SHM_WAIT_MS) instead of spinning"

    def __init__(self, wait_ms: float = 1.0) -> None:
        super().__init__()
        self.wait_ms = wait_ms

    def patch(self) -> None:
        import time

        import zmq
        from vllm.distributed.device_communicators import shm_broadcast

        slice_ms = self.wait_ms

        def make(orig):
            def wait(self, timeout_ms=None):
                poller = getattr(self, "poller", None)
                if (not self.is_reader or poller is None
                        or time.monotonic() > self.last_read + self.busy_loop_s):
                    return orig(self, timeout_ms)  # idle: vLLM's own sleep
                ms = slice_ms if timeout_ms is None else max(0, min(slice_ms, timeout_ms))
                events = dict(poller.poll(timeout=ms))
                if self.local_notify_socket in events:  # CONFLATE: at most one queued
                    self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)
            return wait

        self.replace(shm_broadcast.SpinCondition, "wait", make, params=params("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.wait"))


_applied: list[ShmWaitPatch] = []  # this process's (a host setting: not among the engines' touchpoints)


def apply_from_env() -> float | None:
    """Apply the wait ``KUNSERVE_SHM_WAIT_MS`` asks for in this process (once); returns it (ms)."""
    ms = wanted_wait_ms()
    if ms is None:
        return None
    if _applied:
        return _applied[0].wait_ms
    inst = ShmWaitPatch(ms)
    if not inst.supported():
        logger.warning("kunserve: %s supports vllm%s only: not applied", ENV, inst.versions)
        return None
    inst.patch()
    _applied.append(inst)
    logger.info("kunserve: shared-memory queue readers sleep on the writer's signal, %g ms at a time (%s)", ms, ENV)
    return ms


def revert() -> None:
    """Undo it in this process (tests)."""
    while _applied:
        _applied.pop().revert()


__all__ = ["ENV", "ShmWaitPatch", "apply_from_env", "revert", "wanted_wait_ms"]
