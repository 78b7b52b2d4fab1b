"""Request placement with bounded migrations (MELL): online bin packing of KV onto instances.

Items are requests sized in KV blocks; bins are instances of capacity ``C`` blocks. Operations are
``allocate`` (a new request), ``depart`` (a finished one) and ``update`` (a request's KV grew or
shrank), alone or batched (:meth:`MellPlacer.apply_batch`: departures first, then updates, then
arrivals largest first, and one repair pass for the whole batch).

Classes by size ``s``: L (s > C/2), M (C/3 < s <= C/2), S (C/4 < s <= C/3), T (s <= C/4). Tiny
requests (s <= C/8) are grouped inside a bin into *multi-items* of total at most C/4; a multi-item
moves as one unit (one migration, one batched transfer), which is what keeps migrations per
operation bounded however small requests get. Grouping is logical: it never moves data.

Invariants maintained after every operation (our reading of MELL's Theorem 1; checked by
:meth:`MellPlacer.check_invariants` and the property tests):

* I1 capacity: every instance holds at most ``C`` blocks.
* I2 bounded migrations: every operation moves at most ``max_migrations`` units.
* I3 multi-items: every multi-item's members are tiny and its total is at most C/4.
* I4 fill: at most ``open_bins`` (3: one per class M, S, T) instances without an L item are at
  most 3/4 full. When emptying one would exceed the operation's migration budget (or its units
  fit nowhere else) the deficit is carried to later operations as ``pending_repair``; the property
  tests check it never exceeds 2.

Bound: instances holding an L item are at least OPT's L count; every other instance but
``open_bins`` is more than 3/4 full, so ``used <= max(#L, 4/3 * total / C) + L-bin slack + 3``;
tests check ``used <= 4/3 * LB + 4`` against the Martello-Toth L2 lower bound ``LB``.

The instance priority function scores feasible instances by fill after placement (best fit), a
bonus for lifting an under-full instance past 3/4, locality (the request's preferred instance,
e.g. where its prefix is cached) and a penalty for compute load (running requests).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Sequence

from vllm_kunserve.policy.costmodel import CostModel


def size_class(size: float, cap: float) -> str:
    if size > cap / 2:
        return "L"
    if size > cap / 3:
        return "M"
    if size > cap / 4:
        return "S"
    return "T"


@dataclass(frozen=True)
class Migration:
    requests: tuple[str, ...]  # more than one for a multi-item
    src: int
    dst: int
    blocks: float


@dataclass(frozen=True)
class OpResult:
    op: str
    request_id: str
    instance: int | None  # where the request now lives (None after depart)
    migrations: tuple[Migration, ...]
    new_instances: tuple[int, ...] = ()
    released_instances: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {"op": self.op, "request_id": self.request_id, "instance": self.instance,
                "migrations": [{"requests": list(m.requests), "src": m.src, "dst": m.dst, "blocks": m.blocks}
                               for m in self.migrations],
                "new_instances": list(self.new_instances), "released_instances": list(self.released_instances)}


@dataclass(frozen=True)
class PriorityWeights:
    fill: float = 1.0  # fuller after placement is better (packing)
    complete: float = 0.5  # lifts an under-full instance past 3/4
    locality: float = 0.3  # the request's preferred instance
    load: float = 0.2  # penalty per share of the busiest instance's running requests


@dataclass(frozen=True)
class PlacementSnapshot:
    capacity: float
    instances: dict  # instance id -> {request id: blocks}

    def used(self) -> int:
        return sum(1 for v in self.instances.values() if v)


class _Unit:
    __slots__ = ("uid", "members", "bin", "multi")

    def __init__(self, uid: int, members: dict[str, float], b: int, multi: bool):
        self.uid, self.members, self.bin, self.multi = uid, members, b, multi

    @property
    def size(self) -> float:
        return sum(self.members.values())


class _Op:
    """Migration bookkeeping for one operation (coalesces repeated moves of a unit)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.moves: dict[int, list] = {}  # uid -> [requests, first src, last dst, blocks]
        self.new: list[int] = []
        self.released: list[int] = []

    def record(self, u: _Unit, src: int, dst: int) -> None:
        if u.uid in self.moves:
            self.moves[u.uid][2] = dst
        else:
            self.moves[u.uid] = [tuple(u.members), src, dst, u.size]
            self.budget -= 1

    def migrations(self) -> tuple[Migration, ...]:
        return tuple(Migration(r, s, d, b) for r, s, d, b in self.moves.values() if s != d)


class MellPlacer:
    """MELL online placement. Pure in-memory state; :meth:`snapshot` gives an immutable view."""

    def __init__(self, capacity: float, max_migrations: int = 10, open_bins: int = 3,
                 weights: PriorityWeights = PriorityWeights()):
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        if max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        self.cap = float(capacity)
        self.max_migrations = max_migrations
        self.open_bins = open_bins
        self.w = weights
        self.bins: dict[int, dict[int, _Unit]] = {}
        self.load: dict[int, float] = {}
        self.nreq: dict[int, int] = {}
        self.req: dict[str, _Unit] = {}
        self._uid = itertools.count()
        self._bid = itertools.count()
        self.pending_repair = 0

    # ---------------------------------------------------------------- views
    def instances_used(self) -> int:
        return len(self.bins)

    def total_load(self) -> float:
        return sum(self.load.values())

    def sizes(self) -> list[float]:
        return [s for u in self._units() for s in u.members.values()]

    def _units(self) -> Iterable[_Unit]:
        for units in self.bins.values():
            yield from units.values()

    def snapshot(self) -> PlacementSnapshot:
        return PlacementSnapshot(self.cap, {b: {r: s for u in us.values() for r, s in u.members.items()}
                                            for b, us in sorted(self.bins.items())})

    def where(self, request_id: str) -> int:
        return self.req[request_id].bin

    def _has_l(self, b: int) -> bool:
        return any(not u.multi and u.size > self.cap / 2 for u in self.bins[b].values())

    def underfull(self) -> list[int]:
        return [b for b in self.bins if self.load[b] <= 0.75 * self.cap and not self._has_l(b)]

    def check_invariants(self) -> None:
        """Raise AssertionError when I1 or I3 fails (I2 and I4 are per-operation, see tests)."""
        for b, units in self.bins.items():
            assert self.load[b] <= self.cap + 1e-9, f"instance {b} over capacity"
            assert abs(sum(u.size for u in units.values()) - self.load[b]) < 1e-6
            for u in units.values():
                if u.multi:
                    assert u.size <= self.cap / 4 + 1e-9 and all(s <= self.cap / 8 for s in u.members.values())

    # ---------------------------------------------------------------- primitives
    def _new_bin(self, op: _Op) -> int:
        b = next(self._bid)
        self.bins[b], self.load[b], self.nreq[b] = {}, 0.0, 0
        op.new.append(b)
        return b

    def _drop_if_empty(self, b: int, op: _Op) -> None:
        if b in self.bins and not self.bins[b]:
            del self.bins[b], self.load[b], self.nreq[b]
            if b in op.new:
                op.new.remove(b)
            else:
                op.released.append(b)

    def _put(self, u: _Unit, b: int) -> None:
        u.bin = b
        self.bins[b][u.uid] = u
        self.load[b] += u.size
        self.nreq[b] += len(u.members)

    def _take(self, u: _Unit) -> None:
        del self.bins[u.bin][u.uid]
        self.load[u.bin] -= u.size
        self.nreq[u.bin] -= len(u.members)

    def _move(self, u: _Unit, dst: int, op: _Op) -> None:
        src = u.bin
        self._take(u)
        self._put(u, dst)
        op.record(u, src, dst)

    def _score(self, b: int, size: float, affinity: int | None, busiest: int) -> float:
        after = self.load[b] + size
        s = self.w.fill * after / self.cap
        if self.load[b] <= 0.75 * self.cap < after:
            s += self.w.complete
        if affinity is not None and b == affinity:
            s += self.w.locality
        if busiest:
            s -= self.w.load * self.nreq[b] / busiest
        return s

    def _best(self, size: float, exclude: Sequence[int] = (), affinity: int | None = None) -> int | None:
        busiest = max(self.nreq.values(), default=0)
        best, best_s = None, -1e18
        for b, ld in self.load.items():
            if ld + size <= self.cap + 1e-9 and b not in exclude:
                s = self._score(b, size, affinity, busiest)
                if s > best_s:
                    best, best_s = b, s
        return best

    def _tiny_unit(self, b: int, size: float) -> _Unit | None:
        for u in self.bins[b].values():
            if u.multi and u.size + size <= self.cap / 4:
                return u
        return None

    # ---------------------------------------------------------------- operations
    def allocate(self, request_id: str, size: float, affinity: int | None = None) -> OpResult:
        op = _Op(self.max_migrations)
        self._allocate(request_id, size, affinity, op)
        self._repair(op)
        return OpResult("allocate", request_id, self.req[request_id].bin, op.migrations(), tuple(op.new),
                        tuple(op.released))

    def _allocate(self, rid: str, size: float, affinity: int | None, op: _Op) -> int:
        if rid in self.req:
            raise ValueError(f"request {rid!r} is already placed")
        if not 0 < size <= self.cap:
            raise ValueError(f"request {rid!r}: size {size} must be in (0, capacity={self.cap}]")
        b = self._best(size, affinity=affinity)
        if b is None:
            b = self._new_bin(op)
        self._insert(rid, size, b)
        return b

    def _insert(self, rid: str, size: float, b: int) -> None:
        u = self._tiny_unit(b, size) if size <= self.cap / 8 else None
        if u is not None:
            self._take(u)
            u.members[rid] = size
            self._put(u, b)
        else:
            u = _Unit(next(self._uid), {rid: size}, b, size <= self.cap / 8)
            self._put(u, b)
        self.req[rid] = u

    def depart(self, request_id: str) -> OpResult:
        op = _Op(self.max_migrations)
        self._depart(request_id, op)
        self._repair(op)
        return OpResult("depart", request_id, None, op.migrations(), tuple(op.new), tuple(op.released))

    def _detach(self, rid: str, u) -> int:
        """Take request ``rid`` out of its unit ``u`` (logical, no data moves); returns its bin."""
        b = u.bin
        self._take(u)
        del u.members[rid]
        if u.members:
            self._put(u, b)
        return b

    def _depart(self, rid: str, op: _Op) -> None:
        u = self.req.pop(rid, None)
        if u is None:
            raise ValueError(f"request {rid!r} is not placed")
        self._drop_if_empty(self._detach(rid, u), op)

    def update(self, request_id: str, size: float) -> OpResult:
        op = _Op(self.max_migrations)
        self._update(request_id, size, op)
        self._repair(op)
        return OpResult("update", request_id, self.req[request_id].bin, op.migrations(), tuple(op.new),
                        tuple(op.released))

    def _update(self, rid: str, size: float, op: _Op) -> None:
        u = self.req.get(rid)
        if u is None:
            raise ValueError(f"request {rid!r} is not placed")
        if not 0 < size <= self.cap:
            raise ValueError(f"request {rid!r}: size {size} must be in (0, capacity={self.cap}]")
        # take the request out of its unit and re-insert it resized
        b = self._detach(rid, u)
        if self.load[b] + size <= self.cap + 1e-9:
            self._insert(rid, size, b)
            return
        # it no longer fits: move the request itself, or make room by moving smaller units out
        dst = self._best(size, exclude=(b,))
        if dst is None:
            room = self._make_room(b, self.load[b] + size - self.cap, op)
            if room:
                self._insert(rid, size, b)
                return
            dst = self._new_bin(op)
        nu = _Unit(next(self._uid), {rid: size}, dst, False)  # moves alone, out of any group
        self._put(nu, dst)
        self.req[rid] = nu
        op.record(nu, b, dst)
        self._drop_if_empty(b, op)

    def _make_room(self, b: int, overflow: float, op: _Op) -> bool:
        """Move other units out of ``b`` (fewest moves) so ``overflow`` more blocks fit."""
        units = sorted(self.bins[b].values(), key=lambda u: u.size)
        plan, freed, placed = [], 0.0, {}
        one = next((u for u in units if u.size >= overflow), None)
        cand = [one] if one is not None else list(reversed(units))
        for u in cand:
            if freed >= overflow or len(plan) >= op.budget:
                break
            dst = self._best_dry(u.size, b, placed)
            if dst is None:
                continue
            placed[dst] = placed.get(dst, 0.0) + u.size
            plan.append((u, dst))
            freed += u.size
        if freed < overflow:
            return False
        for u, dst in plan:
            self._move(u, dst, op)
        return True

    def _best_dry(self, size: float, exclude: int, extra: dict[int, float]) -> int | None:
        best, best_load = None, -1.0
        for b2, ld in self.load.items():
            ld2 = ld + extra.get(b2, 0.0)
            if b2 != exclude and ld2 + size <= self.cap + 1e-9 and ld2 > best_load:
                best, best_load = b2, ld2
        return best

    def _repair(self, op: _Op) -> None:
        """Empty the emptiest under-full instances into others while I4 is violated (I2 budget)."""
        tried: set[int] = set()
        while True:
            under = [b for b in self.underfull() if b not in tried]
            if len(self.underfull()) <= self.open_bins or not under:
                break
            a = min(under, key=lambda b: (self.load[b], b))
            tried.add(a)
            units = sorted(self.bins[a].values(), key=lambda u: -u.size)
            if len(units) > op.budget:
                continue
            placed: dict[int, float] = {}
            plan = []
            for u in units:
                dst = self._best_dry(u.size, a, placed)
                if dst is None:
                    break
                placed[dst] = placed.get(dst, 0.0) + u.size
                plan.append((u, dst))
            if len(plan) != len(units):
                continue
            for u, dst in plan:
                self._move(u, dst, op)
            self._drop_if_empty(a, op)
        self.pending_repair = max(0, len(self.underfull()) - self.open_bins)

    def apply_batch(self, ops: Sequence[tuple]) -> list[OpResult]:
        """Apply ``("allocate", id, size[, affinity])``, ``("update", id, size)``, ``("depart", id)``.

        Departures run first (they free room), then updates, then arrivals largest first; one repair
        pass follows with the budget of every operation in the batch pooled.
        """
        order = {"depart": 0, "update": 1, "allocate": 2}
        for o in ops:
            if not o or o[0] not in order:
                raise ValueError(f"bad placement op {o!r}: expected allocate, update or depart")
        ops = sorted(ops, key=lambda o: (order[o[0]], -(o[2] if o[0] == "allocate" else 0)))
        op = _Op(self.max_migrations * len(ops))
        results = []
        for o in ops:
            if o[0] == "depart":
                self._depart(o[1], op)
            elif o[0] == "update":
                self._update(o[1], float(o[2]), op)
            else:
                self._allocate(o[1], float(o[2]), o[3] if len(o) > 3 else None, op)
        self._repair(op)
        migs = op.migrations()
        for o in ops:
            results.append(OpResult(o[0], o[1], self.req[o[1]].bin if o[1] in self.req else None, ()))
        if results:
            results[-1] = OpResult(results[-1].op, results[-1].request_id, results[-1].instance, migs,
                                   tuple(op.new), tuple(op.released))
        return results


# ---------------------------------------------------------------------------------------------
# lower bound

def lower_bound_l2(sizes: Sequence[float], cap: float) -> int:
    """Martello-Toth L2 lower bound on the instances any packing needs (>= ceil(total / C))."""
    import math

    xs = sorted((s for s in sizes if s > 0), reverse=True)
    if not xs:
        return 0
    best = math.ceil(sum(xs) / cap - 1e-9)
    ks = sorted({0.0} | {s for s in xs if s <= cap / 2})
    for k in ks:
        j1 = [s for s in xs if s > cap - k]
        j2 = [s for s in xs if cap / 2 < s <= cap - k]
        j3 = [s for s in xs if k <= s <= cap / 2]
        room = len(j2) * cap - sum(j2)
        lb = len(j1) + len(j2) + max(0, math.ceil((sum(j3) - room) / cap - 1e-9))
        best = max(best, lb)
    return best


# ---------------------------------------------------------------------------------------------
# adaptive migration: KV transfer or token re-prefill per request (two-bin packing)

@dataclass(frozen=True)
class MoveCandidate:
    request_id: str
    src: int
    dst: int
    kv_bytes: float
    tokens: int  # tokens to re-prefill if the KV is not sent


@dataclass(frozen=True)
class MoveChoice:
    request_id: str
    method: str  # "kv", "reprefill" or "defer"
    time_s: float


def choose_migration(cands: Sequence[MoveCandidate], link_budget_bytes: dict, compute_budget_ms: dict,
                     link_bytes_per_s: float, model: CostModel) -> list[MoveChoice]:
    """Per request: send the KV (spends the (src, dst) link budget) or re-prefill the tokens on the
    destination (spends its compute budget). Two bins per request; the requests that save the most
    time per link byte take the link first, the rest re-prefill if the destination can afford it,
    and what fits neither is deferred. Budgets default to 0 for pairs/instances not listed.
    """
    if link_bytes_per_s <= 0:
        raise ValueError("link_bytes_per_s must be > 0")
    link = {k: float(v) for k, v in link_budget_bytes.items()}
    comp = {k: float(v) for k, v in compute_budget_ms.items()}
    info = []
    for c in cands:
        t_kv = c.kv_bytes / link_bytes_per_s
        t_pf = model.chunk_cost(0, c.tokens) / 1e3 if c.tokens else 0.0
        # prefill ms saved per link byte spent: high = the KV is worth sending
        info.append((-(t_pf / max(c.kv_bytes, 1.0)), c, t_kv, t_pf))
    out: dict[str, MoveChoice] = {}
    for _, c, t_kv, t_pf in sorted(info, key=lambda x: x[0]):
        key = (c.src, c.dst)
        if link.get(key, 0.0) >= c.kv_bytes and (t_kv <= t_pf or comp.get(c.dst, 0.0) < t_pf * 1e3):
            link[key] -= c.kv_bytes
            out[c.request_id] = MoveChoice(c.request_id, "kv", t_kv)
        elif comp.get(c.dst, 0.0) >= t_pf * 1e3:
            comp[c.dst] -= t_pf * 1e3
            out[c.request_id] = MoveChoice(c.request_id, "reprefill", t_pf)
        elif link.get(key, 0.0) >= c.kv_bytes:
            link[key] -= c.kv_bytes
            out[c.request_id] = MoveChoice(c.request_id, "kv", t_kv)
        else:
            out[c.request_id] = MoveChoice(c.request_id, "defer", 0.0)
    return [out[c.request_id] for c in cands]
