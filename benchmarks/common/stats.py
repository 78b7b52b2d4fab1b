"""The benchmark pages' spreads over repetitions and their cells: one function per concept.

Spreads: :func:`median_range` (median, min, max, n: paired ratios over a few repetitions) and
:func:`mean_sd` (mean, sample standard deviation, min, max, n). Cells: :func:`fmt_num` (a number, or
"-" where there is none), :func:`fmt_interval` (a point with its interval, ``value (lo..hi)``),
:func:`fmt_median_range` and :func:`fmt_mean_sd` (the spreads above). The plain ratio of two values
is the product's (``vllm_kunserve.workload.stats.ratio``); a ratio of pooled percentiles with its
bootstrap interval is ``benchmarks.common.pooled.percentile_ratio``.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

import numpy as np


def median_range(xs: Sequence[float], digits: int | None = None) -> dict:
    """``{"median", "min", "max", "n"}`` of ``xs`` (not empty), each rounded to ``digits`` where given."""
    r = (lambda x: x) if digits is None else (lambda x: round(x, digits))
    return {"median": r(statistics.median(xs)), "min": r(min(xs)), "max": r(max(xs)), "n": len(xs)}


def mean_sd(xs: Sequence[float | None]) -> dict:
    """``{"mean", "std", "min", "max", "n"}`` over the values of ``xs`` that are not None (``std``: the
    sample standard deviation, 0 for one value; all None for none)."""
    a = np.asarray([x for x in xs if x is not None], float)
    if a.size == 0:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
            "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


def fmt_num(x: float | None, digits: int = 2, suffix: str = "", finite_only: bool = True) -> str:
    """``x`` with ``digits`` decimals and ``suffix`` ("x", "%"); "-" for None, and for NaN and the
    infinities unless not ``finite_only`` (then they print as Python writes them: ``inf``)."""
    if x is None or (finite_only and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}{suffix}"


def fmt_interval(c: dict | None, digits: int = 2, point: str = "value") -> str:
    """``point (lo..hi)`` of ``c`` (``{point, "lo", "hi"}``); an unbounded end (None or infinite) is
    ``inf``; "-" where there is no point."""
    if not c or c.get(point) is None:
        return "-"
    f = lambda x: "inf" if x is None or math.isinf(x) else f"{x:.{digits}f}"  # noqa: E731
    return f"{f(c[point])} ({f(c['lo'])}..{f(c['hi'])})"


def fmt_median_range(s: dict, digits: int = 2) -> str:
    """:func:`median_range`'s ``median (min..max, n=N)``."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}..{s['max']:.{digits}f}, n={s['n']})"


def fmt_mean_sd(s: dict, digits: int = 2, unit: str = "") -> str:
    """:func:`mean_sd`'s ``mean ± std unit (min-max)``; the mean alone for one value, "-" for none."""
    if s.get("mean") is None:
        return "-"
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f}{unit}"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
