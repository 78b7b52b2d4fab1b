"""Placement baselines with :class:`~vllm_kunserve.policy.placement.MellPlacer`'s interface.

* ``best_fit``: the fullest instance the request fits in; a grown request that no longer fits
  moves to the best fit elsewhere (one migration); never consolidates.
* ``worst_fit``: the emptiest instance (spreads load, maximises per-request headroom): least-load
  dispatch in an elastic cluster.
* ``round_robin``: the next open instance in turn that the request fits in (round-robin dispatch
  in an elastic cluster).
* ``llumnix``: least-loaded placement plus Llumnix-style load balancing: after every operation, if
  the most and least loaded instances differ by more than ``imbalance`` x C, migrate the smallest
  request that narrows the gap (one migration per operation).

Every policy opens an instance only when nothing fits and releases it when it becomes empty.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from vllm_kunserve.policy.placement import Migration, OpResult

POLICIES = ("best_fit", "worst_fit", "llumnix", "round_robin")


class GreedyPlacer:
    def __init__(self, capacity: float, policy: str = "best_fit", imbalance: float = 0.25):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: choose one of {', '.join(POLICIES)}")
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.cap = float(capacity)
        self.policy = policy
        self.imbalance = imbalance
        self.bins: dict[int, dict[str, float]] = {}
        self.load: dict[int, float] = {}
        self.req: dict[str, int] = {}
        self._bid = itertools.count()
        self._turn = 0

    def instances_used(self) -> int:
        return len(self.bins)

    def sizes(self) -> list[float]:
        return [s for b in self.bins.values() for s in b.values()]

    def _pick(self, size: float, exclude: int | None = None) -> int | None:
        fits = [b for b, ld in self.load.items() if b != exclude and ld + size <= self.cap + 1e-9]
        if not fits:
            return None
        if self.policy == "best_fit":
            return max(fits, key=lambda b: (self.load[b], -b))
        if self.policy == "round_robin":
            order = sorted(self.load)
            start = self._turn % len(order)
            self._turn += 1
            ok = set(fits)
            return next(b for b in order[start:] + order[:start] if b in ok)
        return min(fits, key=lambda b: (self.load[b], b))

    def _open(self, new: list) -> int:
        b = next(self._bid)
        self.bins[b], self.load[b] = {}, 0.0
        new.append(b)
        return b

    def _place(self, rid: str, size: float, b: int) -> None:
        self.bins[b][rid] = size
        self.load[b] += size
        self.req[rid] = b

    def _remove(self, rid: str) -> tuple[int, float]:
        b = self.req.pop(rid)
        size = self.bins[b].pop(rid)
        self.load[b] -= size
        return b, size

    def _release(self, b: int, released: list) -> None:
        if b in self.bins and not self.bins[b]:
            del self.bins[b], self.load[b]
            released.append(b)

    def _balance(self, migs: list) -> None:
        if self.policy != "llumnix" or len(self.bins) < 2:
            return
        hi = max(self.load, key=lambda b: self.load[b])
        lo = min(self.load, key=lambda b: self.load[b])
        gap = self.load[hi] - self.load[lo]
        if gap <= self.imbalance * self.cap:
            return
        for rid, s in sorted(self.bins[hi].items(), key=lambda kv: kv[1]):
            if s < gap and self.load[lo] + s <= self.cap:
                self._remove(rid)
                self._place(rid, s, lo)
                migs.append(Migration((rid,), hi, lo, s))
                return

    def allocate(self, request_id: str, size: float, affinity: int | None = None) -> OpResult:
        if request_id in self.req:
            raise ValueError(f"request {request_id!r} is already placed")
        if not 0 < size <= self.cap:
            raise ValueError(f"request {request_id!r}: size {size} must be in (0, capacity={self.cap}]")
        new: list = []
        migs: list = []
        b = self._pick(size)
        if b is None:
            b = self._open(new)
        self._place(request_id, size, b)
        self._balance(migs)
        return OpResult("allocate", request_id, self.req[request_id], tuple(migs), tuple(new))

    def depart(self, request_id: str) -> OpResult:
        if request_id not in self.req:
            raise ValueError(f"request {request_id!r} is not placed")
        released: list = []
        migs: list = []
        b, _ = self._remove(request_id)
        self._release(b, released)
        self._balance(migs)
        return OpResult("depart", request_id, None, tuple(migs), (), tuple(released))

    def update(self, request_id: str, size: float) -> OpResult:
        if request_id not in self.req:
            raise ValueError(f"request {request_id!r} is not placed")
        if not 0 < size <= self.cap:
            raise ValueError(f"request {request_id!r}: size {size} must be in (0, capacity={self.cap}]")
        new: list = []
        released: list = []
        migs: list = []
        b, _ = self._remove(request_id)
        if self.load[b] + size <= self.cap + 1e-9:
            self._place(request_id, size, b)
        else:
            dst = self._pick(size, exclude=b)
            if dst is None:
                dst = self._open(new)
            self._place(request_id, size, dst)
            migs.append(Migration((request_id,), b, dst, size))
            self._release(b, released)
        self._balance(migs)
        return OpResult("update", request_id, self.req[request_id], tuple(migs), tuple(new), tuple(released))

    def apply_batch(self, ops: Sequence[tuple]) -> list[OpResult]:
        out = []
        for o in ops:
            if o[0] == "allocate":
                out.append(self.allocate(o[1], float(o[2]), o[3] if len(o) > 3 else None))
            elif o[0] == "update":
                out.append(self.update(o[1], float(o[2])))
            elif o[0] == "depart":
                out.append(self.depart(o[1]))
            else:
                raise ValueError(f"bad placement op {o!r}: expected allocate, update or depart")
        return out


def make_placer(policy: str, capacity: float, max_migrations: int = 10):
    """``mell`` or one of the baselines (:data:`POLICIES`), all with allocate/update/depart/apply_batch."""
    if policy == "mell":
        from vllm_kunserve.policy.placement import MellPlacer

        return MellPlacer(capacity, max_migrations)
    return GreedyPlacer(capacity, policy)
