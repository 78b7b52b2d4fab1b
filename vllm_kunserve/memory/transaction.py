"""Transactions for memory transitions: every step records its undo; a failure rolls back.

A transition (remap, revert, drop, restore) is a sequence of named steps. :meth:`Transaction.step`
runs one and remembers how to undo it; if a later step raises, :meth:`Transaction.rollback` runs the
undos newest first, so the memory is back in the state before the transition. A transaction can
also be kept *prepared* (done, undo log kept) until the caller commits or aborts it: the engine
agent uses that to move several workers together (two-phase: every worker prepares, then all
commit, or all abort).

:class:`StepFaults` is the test hook: arm a step name and the next time that step runs it raises
:class:`~vllm_kunserve.memory.errors.InjectedFault` before doing anything.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .errors import InjectedFault, MemoryPoolError

logger = logging.getLogger("vllm.kunserve")


class RollbackError(MemoryPoolError):
    """An undo step failed: the memory is in neither the old nor the new state."""


class StepFaults:
    """Named fault points. ``arm("reload")`` makes the next ``check("reload")`` raise once;
    ``arm("reload", delay_s=3)`` makes it sleep 3 s instead (a slow step, for killing a process
    in the middle of a transition)."""

    def __init__(self) -> None:
        self._armed: dict[str, int] = {}
        self._delays: dict[str, float] = {}
        self._lock = threading.Lock()

    def arm(self, step: str, after: int = 0, delay_s: float = 0.0) -> None:
        """Fail (or, with ``delay_s``, stall) the ``after + 1``-th time ``step`` runs from now (once)."""
        with self._lock:
            self._armed[step] = int(after)
            if delay_s > 0:
                self._delays[step] = float(delay_s)
            else:
                self._delays.pop(step, None)

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()
            self._delays.clear()

    @property
    def armed(self) -> dict[str, int]:
        return dict(self._armed)

    def check(self, step: str) -> None:
        with self._lock:
            left = self._armed.get(step)
            if left is None:
                return
            if left > 0:
                self._armed[step] = left - 1
                return
            del self._armed[step]
            delay = self._delays.pop(step, 0.0)
        if delay:
            time.sleep(delay)
            return
        raise InjectedFault(f"injected failure at step {step!r}")


class Transaction:
    """One transition's steps and their undos."""

    def __init__(self, name: str, faults: StepFaults | None = None) -> None:
        self.name = name
        self.faults = faults
        self.steps: list[str] = []
        #: milliseconds per step name, summed over the steps of that name (where a transition's time went)
        self.step_ms: dict[str, float] = {}
        self._undo: list[tuple[str, Callable[[], Any]]] = []

    def step(self, name: str, do: Callable[[], Any], undo: Callable[[], Any] | None = None) -> Any:
        """Run ``do`` (after the fault check); remember ``undo`` once it succeeded."""
        if self.faults is not None:
            self.faults.check(name)
        t0 = time.perf_counter()
        out = do()
        self.step_ms[name] = self.step_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
        self.steps.append(name)
        if undo is not None:
            self._undo.append((name, undo))
        return out

    def rollback(self) -> list[str]:
        """Undo every completed step, newest first. Returns the undone step names.

        Every undo is attempted even if one fails; the first failure is raised afterwards as
        :class:`RollbackError` (the state is then unknown and the caller must say so)."""
        undone, first = [], None
        while self._undo:
            name, fn = self._undo.pop()
            try:
                fn()
                undone.append(name)
            except Exception as exc:  # keep undoing the rest
                logger.exception("kunserve: undo of %s step %r failed", self.name, name)
                first = first or RollbackError(f"{self.name}: undo of step {name!r} failed: {exc!r}")
        if first is not None:
            raise first
        return undone

    def commit(self) -> None:
        self._undo.clear()
