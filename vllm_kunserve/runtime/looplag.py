"""How late an asyncio event loop runs its timers, and why: busy, waiting for a core, or blocked.

A replay client that sends late, or a front end that relays late, was not running its event loop
when it should have. :class:`LoopLag` is a task that sleeps ``interval_s`` again and again and
records every wake-up at least ``min_s`` late, with what the loop's thread did meanwhile, read from
the kernel (``/proc/thread-self/schedstat``: time on a CPU, time runnable but waiting for one):

- ``cpu_s``: the thread ran (a callback kept the loop: parsing, a collection, a slow handler);
- ``runq_s``: the thread was runnable but no core was free (other processes held them);
- the rest (``late_s`` minus both): the thread was off the run queue, blocked in a system call
  (a page read from disk, a lock, a write to a full pipe) or the whole process was stopped.

Times are on ``time.perf_counter()``, the clock the client stamps requests with. Without
``/proc`` (not Linux) only the lateness and the thread's CPU time are recorded.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque

_SCHEDSTAT = "/proc/thread-self/schedstat"


def _thread_sched(fd: int | None) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of the thread whose ``schedstat`` ``fd``
    holds open (read again from offset 0: no open and close per read); without one (no /proc),
    the calling thread's CPU time and no queue time."""
    try:
        if fd is not None:
            on_cpu, waiting, _ = os.pread(fd, 128, 0).split()
            return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        pass
    return time.thread_time(), float("nan")


def _open_schedstat() -> int | None:
    try:
        return os.open(_SCHEDSTAT, os.O_RDONLY)
    except OSError:
        return None


class LoopLag:
    """Records the running loop's late wake-ups while started (``start()`` inside the loop, ``stop()``)."""

    def __init__(self, interval_s: float = 0.01, min_s: float = 0.02, keep: int = 2000):
        if interval_s <= 0 or min_s <= 0:
            raise ValueError("interval_s and min_s must be > 0")
        self.interval_s, self.min_s = interval_s, min_s
        self.events: deque[tuple[float, float, float, float]] = deque(maxlen=keep)  # start, late, cpu, runq
        self.ticks = 0
        self.late = 0  # wake-ups at least min_s late (all of them, also those the deque dropped)
        self.late_s = 0.0
        self.late_cpu_s = 0.0   # of the late wake-ups' time: the thread running (its own work)
        self.late_runq_s = 0.0  # ... and runnable but waiting for a core (nan-free sum; 0 without schedstat)
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        fd = _open_schedstat()   # this loop's thread's, held open: ticks come 100 times a second
        try:
            await self._ticks(fd)
        finally:
            if fd is not None:
                os.close(fd)

    async def _ticks(self, fd: int | None) -> None:
        while True:
            t, (cpu, runq) = time.perf_counter(), _thread_sched(fd)
            await asyncio.sleep(self.interval_s)
            now, (cpu2, runq2) = time.perf_counter(), _thread_sched(fd)
            self.ticks += 1
            late = now - t - self.interval_s
            if late >= self.min_s:
                self.late += 1
                self.late_s += late
                self.late_cpu_s += cpu2 - cpu
                if runq2 == runq2 and runq == runq:
                    self.late_runq_s += runq2 - runq
                self.events.append((t + self.interval_s, late, cpu2 - cpu, runq2 - runq))

    def start(self) -> "LoopLag":
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kunserve-looplag")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def longest(self, n: int = 20) -> list[dict]:
        return [{"start_perf_s": round(t, 4), "late_s": round(d, 4), "cpu_s": round(c, 4),
                 "runq_s": None if r != r else round(r, 4)}
                for t, d, c, r in sorted(self.events, key=lambda e: -e[1])[:n]]

    def view(self, n: int = 20) -> dict:
        return {"interval_s": self.interval_s, "min_s": self.min_s, "ticks": self.ticks,
                "late": self.late, "late_s": round(self.late_s, 3), "late_cpu_s": round(self.late_cpu_s, 3),
                "late_runq_s": round(self.late_runq_s, 3), "longest": self.longest(n)}


def lag_cause(event: dict, share: float = 0.5) -> str:
    """The main reason of one late wake-up: ``busy`` (the thread ran), ``no core`` (runnable, waiting
    for a CPU) or ``blocked`` (neither: a system call or a stopped process), by what took at least
    ``share`` of it; ``mixed`` otherwise."""
    late = event["late_s"]
    cpu, runq = event["cpu_s"], event["runq_s"]
    if runq is not None and runq >= share * late:
        return "no core"
    if cpu >= share * late:
        return "busy"
    if runq is not None and late - cpu - runq >= share * late:
        return "blocked"
    return "mixed"


__all__ = ["LoopLag", "lag_cause"]
