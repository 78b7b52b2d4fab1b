"""A circuit breaker per engine, and the backoff between retries: the front end stops dispatching
to an engine that keeps failing, and spaces its retries of one request.

An engine that refused connections or broke ``threshold`` requests in a row is *open* for a
cool-down (doubling on each new trip, up to ``max_cooldown_s``): dispatch skips it while another
engine can take the request. After the cool-down it is *half open*: the next request may go
there; a success closes it, a failure opens it again for the doubled cool-down. Every change of
state is reported through ``on_change`` (``circuit_open``, ``circuit_half_open`` the first time
dispatch looks at it after its cool-down, ``circuit_closed``), which the front end makes an event
and the ``kunserve:circuit_state`` gauge. The fleet's
supervisor still decides whether an engine is dead (and restarts it); the breaker is what keeps a
flaky but living engine (or an attached one across a network) from taking every retry.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["Breakers", "backoff_s"]


def backoff_s(attempt: int, base_s: float = 0.05, cap_s: float = 1.0, rng: random.Random | None = None) -> float:
    """The wait before retry ``attempt`` (1, 2, ...) of one request: exponential backoff with full
    jitter (a uniform draw below ``min(cap_s, base_s * 2 ** (attempt - 1))``), so the retries of
    requests that failed together do not arrive together at the next engine."""
    if attempt < 1:
        return 0.0
    return (rng or random).uniform(0.0, min(cap_s, base_s * 2 ** (attempt - 1)))


@dataclass
class _State:
    failures: int = 0       # in a row
    open_until: float = 0.0
    cooldown_s: float = 0.0  # the last trip's (0: never tripped or closed since)
    half_open: bool = False  # its cool-down ended and that was reported (until it closes or trips again)


class Breakers:
    """One breaker per engine index."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 2.0, max_cooldown_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[int, str, dict], None] | None = None):
        if threshold < 1 or cooldown_s <= 0 or max_cooldown_s < cooldown_s:
            raise ValueError("breaker: threshold >= 1, 0 < cooldown_s <= max_cooldown_s")
        self.threshold, self.cooldown_s, self.max_cooldown_s = threshold, cooldown_s, max_cooldown_s
        self.clock, self.on_change = clock, on_change
        self._s: dict[int, _State] = {}

    def _st(self, i: int) -> _State:
        return self._s.setdefault(i, _State())

    def failure(self, i: int, why: str = "") -> None:
        s = self._st(i)
        s.failures += 1
        half_open = s.cooldown_s and self.clock() >= s.open_until
        if s.failures >= self.threshold or half_open:
            s.cooldown_s = min(self.max_cooldown_s, 2 * s.cooldown_s) if s.cooldown_s else self.cooldown_s
            s.open_until = self.clock() + s.cooldown_s
            s.half_open = False
            if self.on_change:
                self.on_change(i, "circuit_open", {"failures": s.failures, "cooldown_s": s.cooldown_s,
                                                   "reason": why[:200]})

    def success(self, i: int) -> None:
        s = self._s.get(i)
        if s is None or (not s.failures and not s.cooldown_s):
            return
        was_open = bool(s.cooldown_s)
        self._s[i] = _State()
        if was_open and self.on_change:
            self.on_change(i, "circuit_closed", {})

    def is_open(self, i: int) -> bool:
        """Dispatch should skip ``i`` now (open and cooling down; half open lets the next one through)."""
        s = self._s.get(i)
        if s is None:
            return False
        if self.clock() < s.open_until:
            return True
        if s.cooldown_s and not s.half_open:
            s.half_open = True
            if self.on_change:
                self.on_change(i, "circuit_half_open", {"cooldown_s": s.cooldown_s})
        return False

    def state(self, i: int) -> str:
        """"closed", "open" or "half_open" (cooled down, not yet probed by a request)."""
        s = self._s.get(i)
        if s is None or not s.cooldown_s:
            return "closed"
        return "open" if self.clock() < s.open_until else "half_open"

    def view(self) -> dict[str, dict]:
        now = self.clock()
        return {str(i): {"failures": s.failures, "open_s": round(max(0.0, s.open_until - now), 2),
                         "state": self.state(i)}
                for i, s in self._s.items() if s.failures or s.open_until > now or s.cooldown_s}
