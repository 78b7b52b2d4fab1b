"""Chunk sizing for the coordinated KV exchange (KunServe section 4.3).

Bulk KV moves in chunks while pipeline activations keep priority on the same link. A chunk should
take about one pipeline stage on the wire: large enough to amortise the per-message latency, small
enough that an activation never waits behind more than one stage's worth of bulk data.

Links are modelled as ``time = latency + bytes / bandwidth``; :func:`fit_link` recovers both from
measured (bytes, seconds) points, :func:`load_vidur_send_recv` from Vidur's ``network/*/send_recv.csv``.
:class:`Link` is the project's one link model: the simulator times its instance link and PCIe with it.
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
