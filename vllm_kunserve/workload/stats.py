"""The percentile summary the benchmark harness and the simulator report latencies with.

Percentiles use numpy's linear interpolation; NaN values (a request without the measure) are left
out.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def _pkey(p: float) -> str:
    return f"p{p:g}"


def percentiles(values: Iterable[float], ps: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """{'p50': ..., 'p90': ..., 'p99': ..., 'p99.9': ..., 'mean': ..., 'max': ...}; None when empty."""
    v = np.asarray([x for x in values if x == x], dtype=np.float64)
    if v.size == 0:
        return {**{_pkey(p): None for p in ps}, "mean": None, "max": None}
    out: dict[str, float | None] = {_pkey(p): float(np.percentile(v, p)) for p in ps}
    out["mean"] = float(v.mean())
    out["max"] = float(v.max())
    return out
