"""Python's garbage collector in a latency-critical process: freeze the startup heap, time every pause.

A process that relays tokens (the front end) or stamps them (the benchmark client) stops every
stream it handles while the cyclic collector runs. A full collection scans every tracked object,
and after importing transformers, FastAPI and their kin a process holds hundreds of thousands of
them that will never be garbage: ``freeze_heap()`` collects once and moves them to the permanent
generation (``gc.freeze()``), as vLLM does for its own API server and engine core after startup, so
later collections scan only what serving allocates. :class:`GcPauses` times every collection
through ``gc.callbacks`` (start on the shared ``time.perf_counter`` clock, seconds, generation), so
a pause can be laid beside the stalls a client saw.

``KUNSERVE_GC_FREEZE=0`` turns the freeze off (to measure what it buys).
"""

from __future__ import annotations

import gc
import time
from collections import deque

from vllm_kunserve.runtime.switch import env_switch

ENV_FREEZE = "KUNSERVE_GC_FREEZE"


def freeze_heap() -> int:
    """Collect every generation, then freeze what survives; returns how many objects were frozen
    (0 where ``KUNSERVE_GC_FREEZE=0``). The count is taken here, once: ``gc.get_freeze_count()``
    walks the whole frozen list (about 50 ms for half a million objects), so it must never sit on
    a path that runs per request."""
    if not env_switch(ENV_FREEZE, True):
        return 0
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Times every collection of this process while installed (``with`` or install()/remove())."""

    def __init__(self, keep: int = 2000, min_s: float = 0.001):
        self.keep, self.min_s = keep, min_s
        self.pauses: deque[tuple[float, float, int]] = deque(maxlen=keep)  # (start, seconds, generation)
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        g = int(info.get("generation", 0))
        self.count[g] += 1
        self.seconds[g] += dt
        if dt >= self.min_s:
            self.pauses.append((self._t0, dt, g))

    def install(self) -> "GcPauses":
        if self._cb not in gc.callbacks:
            gc.callbacks.append(self._cb)
        return self

    def remove(self) -> None:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)

    def __enter__(self) -> "GcPauses":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def longest(self, n: int = 20) -> list[dict]:
        return [{"start_perf_s": round(t, 4), "seconds": round(d, 4), "generation": g}
                for t, d, g in sorted(self.pauses, key=lambda p: -p[1])[:n]]

    def view(self, n: int = 20) -> dict:
        return {"collections": list(self.count), "seconds": [round(s, 4) for s in self.seconds],
                "longest": self.longest(n)}


__all__ = ["ENV_FREEZE", "GcPauses", "freeze_heap"]
