"""Chunk sizing for the coordinated KV exchange (KunServe section 4.3).

Bulk KV moves in chunks while pipeline activations keep priority on the same link. A chunk should
take about one pipeline stage on the wire: large enough to amortise the per-message latency, small
enough that an activation never waits behind more than one stage's worth of bulk data.

Links are modelled as ``time = latency + bytes / bandwidth``; :func:`fit_link` recovers both from
measured (bytes, seconds) points, :func:`load_vidur_send_recv` from Vidur's ``network/*/send_recv.csv``.
:class:`Link` is the project's one link model: the simulator times its instance link and PCIe with it;
:class:`SharedLink` is one such link carrying several bulk transfers at once, each with an equal share.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_kunserve.policy.costmodel import nnls


@dataclass(frozen=True)
class Link:
    """Point-to-point link: ``time_s(nbytes) = latency_s + nbytes / bandwidth`` (0 for nothing)."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    name: str = ""

    def time_s(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bandwidth_bytes_per_s


def chunk_bytes(link: Link, stage_time_s: float, align: int = 1, min_bytes: int = 64 << 10,
                max_bytes: int = 1 << 30) -> int:
    """Bytes per chunk so one chunk takes about ``stage_time_s`` on ``link``, aligned down to ``align``.

    Clamped to [``min_bytes``, ``max_bytes``] (and never below one ``align`` unit).
    """
    if link.bandwidth_bytes_per_s <= 0:
        raise ValueError("link bandwidth must be > 0")
    if stage_time_s <= 0:
        raise ValueError("stage_time_s must be > 0")
    if align < 1:
        raise ValueError("align must be >= 1")
    raw = max(0.0, stage_time_s - link.latency_s) * link.bandwidth_bytes_per_s
    n = int(min(max(raw, min_bytes), max_bytes))
    return max(align, n - n % align)


def fit_link(sizes_bytes, times_s, name: str = "") -> Link:
    """Non-negative least squares of ``time = latency + bytes / bandwidth``."""
    x = np.asarray(sizes_bytes, float)
    y = np.asarray(times_s, float)
    if len(x) < 2 or len(x) != len(y):
        raise ValueError("fit_link needs at least two (bytes, seconds) points of equal length")
    # relative weighting so small messages (latency) and large ones (bandwidth) both count
    w = 1.0 / y
    coef = nnls(np.column_stack([np.ones_like(x), x]) * w[:, None], y * w)
    if coef[1] <= 0:
        raise ValueError("fit_link: times do not grow with size; cannot infer a bandwidth")
    return Link(bandwidth_bytes_per_s=float(1.0 / coef[1]), latency_s=float(coef[0]), name=name)


def load_vidur_send_recv(path: str | Path, devices_per_node: int | None = None, name: str = "") -> Link:
    """Fit a :class:`Link` from a Vidur ``send_recv.csv`` (median ms by ``size`` in bytes).

    ``devices_per_node`` keeps only those rows: 2 is two GPUs in one node (NVLink), 1 is one GPU per
    node (the inter-node network); None keeps every row. Bad rows raise naming the line."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such file")
    sizes, times = [], []
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if not {"size", "time_stats.send_recv.median"} <= set(reader.fieldnames or ()):
            raise ValueError(f"{p}: not a Vidur send_recv.csv (needs size and time_stats.send_recv.median)")
        for line, r in enumerate(reader, start=2):
            try:
                if devices_per_node is not None and int(r["devices_per_node"]) != devices_per_node:
                    continue
                sizes.append(float(r["size"]))
                times.append(float(r["time_stats.send_recv.median"]) / 1e3)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{p}:{line}: bad send_recv row ({e})") from None
    if len(sizes) < 2:
        raise ValueError(f"{p}: fewer than 2 rows with devices_per_node={devices_per_node}")
    return fit_link(sizes, times, name=name or f"vidur:{p.parent.name}")


class SharedLink:
    """A :class:`Link` shared by concurrent bulk transfers (one GPU's port: its NIC or NVLink).

    Processor sharing: while ``n`` transfers are active each gets ``bandwidth / n``, so two
    exchanges that share the link each get half and both take twice as long as one alone; a transfer
    that starts later slows the earlier ones from then on. Each transfer pays the link's latency
    once, before its bytes flow. Times are the caller's clock (seconds); the state only moves
    forward. Projections (:meth:`finish_time`) assume no further transfer starts."""

    def __init__(self, link: Link):
        if link.bandwidth_bytes_per_s <= 0:
            raise ValueError("link bandwidth must be > 0")
        self.link = link
        self._now = 0.0
        self._left: dict[object, float] = {}   # key -> bytes still to send
        self._ready: dict[object, float] = {}  # key -> time its bytes start flowing (after latency)
        self._seq = 0

    def _step(self, left: dict, ready: dict, t: float, until: float) -> tuple[float, list]:
        """Advance ``left`` from ``t`` to the first of ``until``, a transfer's end or a transfer's
        start of flow; returns the new time and the keys that finished."""
        flowing = [k for k, r in ready.items() if r <= t]
        pending = [r for r in ready.values() if r > t]
        nxt = min([until] + pending)
        if not flowing:
            return nxt, []
        share = self.link.bandwidth_bytes_per_s / len(flowing)
        first = min(left[k] for k in flowing)
        end = min(nxt, t + first / share)
        if end <= t:  # below the clock's resolution: the smallest ones are done
            done = [k for k in flowing if left[k] <= first]
        else:
            sent = (end - t) * share
            for k in flowing:
                left[k] -= sent
            done = [k for k in flowing if left[k] <= first * 1e-9 + 1e-6]
        for k in done:
            del left[k], ready[k]
        return max(end, t), done

    def _advance(self, now: float) -> None:
        if now < self._now - 1e-9:
            raise ValueError(f"SharedLink: time went back ({now} < {self._now})")
        t = self._now
        while t < now and self._left:
            t, _ = self._step(self._left, self._ready, t, now)
        self._now = max(self._now, now)

    def active(self, now: float) -> int:
        """Transfers not yet finished at ``now``."""
        self._advance(now)
        return len(self._left)

    def start(self, now: float, nbytes: float, key: object = None) -> object:
        """Begin a transfer of ``nbytes`` at ``now``; returns its key (a new one when None)."""
        self._advance(now)
        if key is None:
            self._seq += 1
            key = ("xfer", self._seq)
        if key in self._left:
            raise ValueError(f"SharedLink: transfer {key!r} already active")
        if nbytes > 0:
            self._left[key] = float(nbytes)
            self._ready[key] = now + self.link.latency_s
        return key

    def finish_time(self, key: object, now: float) -> float:
        """When ``key`` will finish if no other transfer starts (``now`` if it already has)."""
        self._advance(now)
        left, ready, t = dict(self._left), dict(self._ready), now
        while key in left:
            t, _ = self._step(left, ready, t, float("inf"))
        return t

    def time_s(self, now: float, nbytes: float) -> float:
        """How long a transfer of ``nbytes`` started now takes, sharing the link with the active
        ones (it is started: the link carries it from now on)."""
        if nbytes <= 0:
            return 0.0
        key = self.start(now, nbytes)
        return self.finish_time(key, now) - now

    def chunk_time_s(self, now: float, nbytes: float) -> float:
        """How long ``nbytes`` take at the share one more transfer would get now (nothing started):
        the latency plus the bytes at ``bandwidth / (active + 1)``."""
        if nbytes <= 0:
            return 0.0
        n = self.active(now) + 1
        return self.link.latency_s + nbytes * n / self.link.bandwidth_bytes_per_s
