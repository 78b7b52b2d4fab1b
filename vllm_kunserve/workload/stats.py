"""The percentile summary the benchmark harness, the benchmarks and the simulator report latencies with,
and the one plain ratio (:func:`ratio`) they set two values side by side with.

Percentiles use numpy's linear interpolation unless a caller names another of numpy's methods
(``nearest``: the nearest rank, ``higher``: the order statistic at or above); NaN values (a request
without the measure) are left out.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def _pkey(p: float) -> str:
    return f"p{p:g}"


def _values(values: Iterable[float]) -> np.ndarray:
    return np.asarray([x for x in values if x == x], dtype=np.float64)


def percentiles(values: Iterable[float], ps: Sequence[float] = PERCENTILES,
                method: str = "linear") -> dict[str, float | None]:
    """{'p50': ..., 'p90': ..., 'p99': ..., 'p99.9': ..., 'mean': ..., 'max': ...}; None when empty."""
    v = _values(values)
    if v.size == 0:
        return {**{_pkey(p): None for p in ps}, "mean": None, "max": None}
    out: dict[str, float | None] = {_pkey(p): float(np.percentile(v, p, method=method)) for p in ps}
    out["mean"] = float(v.mean())
    out["max"] = float(v.max())
    return out


def percentile(values: Iterable[float], p: float, method: str = "linear") -> float | None:
    """The ``p``-th percentile of ``values`` (as :func:`percentiles` takes it); None when empty."""
    v = _values(values)
    return float(np.percentile(v, p, method=method)) if v.size else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``: the one plain ratio of two measured values (``kunserve compare``'s ratios to the
    baseline, the simulator's ratios between policies, the benchmarks' tables). None where either is
    missing or not finite, or ``b`` is not positive: there is no ratio to read."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b
