"""Memory-aware admission at the front end (``kunserve serve --admission memory``).

A stock engine takes every request it is sent: when the KV its running requests will grow into is
not there, it preempts and recomputes. vLLM's own bound (``--max-num-queued-reqs``, 503 past it)
counts requests, not memory. The front end knows more: each request's KV need (prompt tokens and
``max_tokens``: :func:`vllm_kunserve.policy.admission.peak_blocks`), and what the fleet can hold once
every drop its planner may still make is made (:func:`~vllm_kunserve.policy.admission.reachable_blocks`
over the group controller's snapshot; a fleet that cannot drop, its engines' KV now).

A new request whose sequences would take the admitted requests' peak past that waits in a bounded
queue, ordered by priority (the ``x-kunserve-priority`` header, an integer, lower first as vLLM's
``priority``; then arrival); past ``queue_max`` waiting, or after ``max_wait_s`` in the queue, it is
answered 429 with ``Retry-After``. The queue's head is admitted whenever a request finishes or the
monitor reports (a group that formed holds more); a client that disconnects while queued leaves the
queue (499). The decision is the policy's
(:func:`~vllm_kunserve.policy.admission.gate`); this module keeps the queue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_kunserve.cluster.frontend.validate import BadRequest, Checked
from vllm_kunserve.policy.admission import KvNeed, gate

PRIORITY_HEADER = "x-kunserve-priority"
MODES = ("off", "memory")


def parse_priority(value: str | None) -> int:
    """The request's priority from its header: an integer (lower is served first, vLLM's sense), 0
    without one; anything else is a 400."""
    if value is None or value == "":
        return 0
    try:
        return int(value.strip())
    except ValueError:
        raise BadRequest(f"{PRIORITY_HEADER}: {value[:40]!r} is not an integer (lower is served first)",
                         param=PRIORITY_HEADER) from None


def needs_of(checked: Checked, generated: int = 0) -> list[KvNeed]:
    """One request's sequences as KV needs: each prompt's tokens (and what was generated) with the
    rest of its output budget, ``n`` sequences per prompt."""
    n = int(checked.body.get("n") or 1)
    return [KvNeed(p + generated, max(0, checked.max_tokens - generated))
            for p in checked.prompt_tokens for _ in range(max(1, n))]


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    rid: str = field(compare=False)
    needs: list[KvNeed] = field(compare=False)
    future: asyncio.Future = field(compare=False)
    t0: float = field(compare=False, default_factory=time.monotonic)


class AdmissionGate:
    """The queue in front of the fleet, deciding by the fleet's reachable KV."""

    def __init__(self, front: Any, queue_max: int = 256, max_wait_s: float = 60.0) -> None:
        if queue_max < 0 or not max_wait_s > 0:
            raise ValueError(f"admission queue {queue_max} / wait {max_wait_s}: a queue of >= 0 and a wait > 0")
        self.front, self.queue_max, self.max_wait_s = front, queue_max, max_wait_s
        self.admitted: dict[str, list[KvNeed]] = {}
        self.waiting: list[_Waiter] = []
        self._seq = itertools.count()
        self.finished_at: list[float] = []   # recent finishes, for Retry-After
        self.shed = self.timed_out = 0
        self._reach: float | None = None
        from prometheus_client import Counter, Gauge, Histogram

        r = front.registry
        self.m_queued = Gauge("kunserve:admission_queued", "Requests waiting in the front end's admission queue",
                              registry=r)
        self.m_outcome = Counter("kunserve:admission", "Admission decisions", ["outcome"], registry=r)
        self.m_wait = Histogram("kunserve:admission_wait_seconds", "Time admitted requests waited in the queue",
                                buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.m_reachable = Gauge("kunserve:admission_reachable_blocks",
                                 "KV blocks the fleet can hold after every drop it may still make", registry=r)

    # -- what the fleet holds and can hold ----------------------------------------------------------
    def block_size(self) -> int:
        sizes = [r.block_size for r in self.front.monitor.reports.values() if r.ok]
        return min(sizes) if sizes else 16

    def reachable(self) -> float:
        """Blocks the fleet can hold after every drop it may still make (inf before any engine reported),
        as of the monitor's last period (:meth:`refresh`)."""
        return self._reach if self._reach is not None else self.refresh()

    def refresh(self) -> float:
        """Recompute :meth:`reachable` from the monitor's latest reports (each period, not each request)."""
        self._reach = self._reachable_now()
        self.m_reachable.set(self._reach if math.isfinite(self._reach) else -1)
        return self._reach

    def _reachable_now(self) -> float:
        return self.front.reachable_blocks()

    def current(self) -> list[KvNeed]:
        """The admitted requests' sequences, each as far as it has generated (streams the front end relays)."""
        out: list[KvNeed] = []
        for rid, needs in self.admitted.items():
            f = self.front.flights.get(rid)
            g = len(f.generated) if f is not None else 0
            out += [KvNeed(n.tokens + g, max(0, n.left - g)) for n in needs] if g else needs
        return out

    # -- the queue ---------------------------------------------------------------------------------------
    def retry_after_s(self) -> int:
        """Seconds until the queue's length of requests has likely finished, from the recent finish rate."""
        now = time.monotonic()
        self.finished_at = [t for t in self.finished_at if now - t <= 60.0]
        rate = len(self.finished_at) / 60.0 if self.finished_at else 0.0
        return max(1, min(600, math.ceil((len(self.waiting) + 1) / rate))) if rate else 10

    def _refuse(self, why: str) -> BadRequest:
        return BadRequest(why, status=429, kind="TooManyRequestsError",
                          headers={"Retry-After": str(self.retry_after_s())})

    async def enter(self, rid: str, checked: Checked, priority: int = 0) -> float:
        """Admit ``rid`` now or once the fleet can hold it; the seconds it waited. BadRequest (429) past
        the queue's bound or its longest wait."""
        w = self.try_enter(rid, checked, priority)
        return 0.0 if w is None else await self.wait(w)

    def try_enter(self, rid: str, checked: Checked, priority: int = 0) -> _Waiter | None:
        """Admit ``rid`` now (None) or queue it (its place, for :meth:`wait`); BadRequest (429) when the
        queue is full. No await: a request the fleet can hold costs no task."""
        needs = needs_of(checked)
        reach = self.reachable()
        d = gate(self.current(), needs, reach, self.block_size(), len(self.waiting), self.queue_max)
        if d.action == "admit" and not self._ahead(priority):
            self.admitted[rid] = needs
            self.m_outcome.labels("admitted").inc()
            return None
        if d.action == "shed" or len(self.waiting) >= self.queue_max:
            self.shed += 1
            self.m_outcome.labels("shed").inc()
            raise self._refuse(f"the fleet cannot hold this request's KV (peak {d.peak_blocks} blocks of "
                               f"{reach:.0f} it can reach) and {len(self.waiting)} requests are queued already")
        w = _Waiter(priority, next(self._seq), rid, needs, asyncio.get_running_loop().create_future())
        heapq.heappush(self.waiting, w)
        self.m_queued.set(len(self.waiting))
        return w

    async def wait(self, w: _Waiter) -> float:
        """Wait in the queue until admitted (the seconds waited); 429 after ``max_wait_s``. Cancelled
        (the client went away), the request leaves the queue, or the fleet if it was just admitted."""
        try:
            await asyncio.wait_for(asyncio.shield(w.future), self.max_wait_s)
        except asyncio.TimeoutError:
            if not w.future.done():
                self._remove(w)
                self.timed_out += 1
                self.m_outcome.labels("timed_out").inc()
                raise self._refuse(f"queued {self.max_wait_s:g} s and the fleet still cannot hold this request's "
                                   "KV") from None
        except asyncio.CancelledError:
            if not w.future.done():
                self._remove(w)
                self.m_outcome.labels("abandoned").inc()
            else:
                self.leave(w.rid)
            raise
        waited = time.monotonic() - w.t0
        self.m_wait.observe(waited)
        self.m_outcome.labels("admitted_after_queue").inc()
        return waited

    def _ahead(self, priority: int) -> bool:
        """Someone already waits who goes first (same or more important): no overtaking the queue."""
        return bool(self.waiting) and self.waiting[0].priority <= priority

    def _remove(self, w: _Waiter) -> None:
        self.waiting.remove(w)
        heapq.heapify(self.waiting)
        self.m_queued.set(len(self.waiting))

    def leave(self, rid: str) -> None:
        """``rid`` finished (or failed): its KV is free; admit whom the fleet can now hold."""
        if self.admitted.pop(rid, None) is not None:
            self.finished_at.append(time.monotonic())
        self.wake()

    def wake(self) -> None:
        """Admit the queue's head while the fleet can hold it (in priority order, no overtaking)."""
        if not self.waiting:
            return
        reach = self.reachable()
        bs = self.block_size()
        while self.waiting:
            w = self.waiting[0]
            if w.future.done():
                heapq.heappop(self.waiting)
                continue
            if gate(self.current(), w.needs, reach, bs, 0, 0).action != "admit":
                break
            heapq.heappop(self.waiting)
            self.admitted[w.rid] = w.needs
            w.future.set_result(True)
        self.m_queued.set(len(self.waiting))

    def view(self) -> dict:
        reach = self.reachable()
        return {"queued": len(self.waiting), "queue_max": self.queue_max, "max_wait_s": self.max_wait_s,
                "admitted": len(self.admitted), "shed": self.shed, "timed_out": self.timed_out,
                "reachable_blocks": reach if math.isfinite(reach) else None,
                "peak_blocks": gate(self.current(), [], reach, self.block_size(), 0, 0).peak_blocks}
