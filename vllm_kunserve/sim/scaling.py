"""Scale a trace's rate so its memory demand is a chosen share of the cluster's KV capacity.

The factor is found by simulating the infinite-memory oracle (the demand the trace *would* put on
memory if nothing queued) and iterating on the mean KV demand over the measured period until it is
within ``tol`` of the target (:func:`fit_rate`, over any ``factor -> trace`` builder). Two ways to
apply a factor (``method``):

* ``upscale`` (``workload.traces.upscale``, TraceUpscaler's approach): factor x the arrivals over the
  same span, so bursts keep their height, length and timing against request lifetimes;
* ``compress`` (``workload.traces.compress_time``): timestamps divided by the factor. A burst of B s
  becomes B/factor s, shorter than the requests it holds, so KV demand averages it away; kept as
  the default of :func:`scale_to_mem_share` only so earlier runs (``kunserve simulate
  --target-mem-share``) reproduce.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .engine import SimConfig, Simulator
from .policies.base import DEFAULT_DISPATCH
from .policies.baselines import OraclePolicy
from .trace import TraceRequest, compress_time, upscale

METHODS = ("compress", "upscale")


def oracle_demand_share(cfg: SimConfig, trace: list[TraceRequest], dispatch: str = DEFAULT_DISPATCH,
                        span: tuple[float, float] | None = None) -> tuple[float, float]:
    """(mean, peak) oracle KV use as a share of cluster capacity over ``span`` (default: the arrival
    period, ``[0, last arrival]``), with the oracle routing by ``dispatch``."""
    sim = Simulator(cfg, OraclePolicy(dispatch), trace).run()
    cap = cfg.base_kv_blocks() * cfg.instances
    lo, hi = span if span is not None else (0.0, trace[-1].arrival_s)
    used = np.array([p["kv_used_blocks"] for p in sim.timeline if lo <= p["t"] <= hi] or [0.0], float)
    return float(used.mean() / cap), float(used.max() / cap)


def guess_factor(points: list[tuple[float, float]], target: float, default: float) -> float:
    """Next rate factor to try for mean demand ``target`` from ``(factor, mean)`` points of the same
    trace: log-log interpolation between the closest points below and above the target, else
    extrapolation along the local slope (demand grows about as factor^k, k clipped to 1-4: faster
    than linear near the prefill capacity, where lifetimes grow), at most 2x per step; ``default``
    without points."""
    pts = [(f, m) for f, m in points if m > 0 and f > 0]
    if not pts:
        return default
    lt = math.log(target)
    below = [p for p in pts if p[1] < target]
    above = [p for p in pts if p[1] >= target]
    if below and above:
        f1, m1 = max(below, key=lambda p: p[1])
        f2, m2 = min(above, key=lambda p: p[1])
        if f1 < f2 and m1 < m2:
            return math.exp(math.log(f1) + (lt - math.log(m1)) * (math.log(f2) - math.log(f1))
                            / (math.log(m2) - math.log(m1)))
        return math.sqrt(f1 * f2)
    near = sorted(pts, key=lambda p: abs(math.log(p[1]) - lt))
    f0, m0 = near[0]
    k = 2.0
    if len(near) > 1 and near[1][0] != f0 and near[1][1] != m0:
        k = (math.log(near[1][1]) - math.log(m0)) / (math.log(near[1][0]) - math.log(f0))
        k = min(max(k, 1.0), 4.0)
    step = math.exp((lt - math.log(m0)) / k)
    return f0 * min(max(step, 0.5), 2.0)


def fit_rate(cfg: SimConfig, make: Callable[[float], list[TraceRequest]], target: float, tol: float = 0.05,
             max_iter: int = 8, dispatch: str = DEFAULT_DISPATCH,
             span: tuple[float, float] | Callable[[float], tuple[float, float]] | None = None,
             start: float = 1.0, linear: bool = False,
             points: list[tuple[float, float]] | None = None) -> tuple[list[TraceRequest], dict]:
    """The trace ``make(factor)`` whose oracle mean KV demand over ``span`` is ``target`` x capacity
    (within ``tol``, else the closest of ``max_iter`` tries), and the fit's numbers. Until the
    target is bracketed the factor moves by ``(target / measured) ** 0.8`` (at most 4x a step), or
    with ``linear`` (demand about proportional to the factor, as when upscaling over a fixed span)
    by ``target / measured`` (at most 16x); once bracketed, by geometric bisection (``linear``: the proportional step while it
    stays inside the bracket). ``span``: the measured period, or a function of the factor giving it
    (a compressed trace's period moves with the factor).

    With ``points`` (``(factor, mean)`` of earlier fits of the same trace, e.g. for other targets,
    extended with this fit's tries) every factor is :func:`guess_factor` over them instead (``start``
    without points), kept inside this fit's bracket (its geometric middle, or 1.5x beyond its one
    bound)."""
    if not target > 0:
        raise ValueError(f"target memory share {target}: must be positive")
    factor, lo, hi, best, tries = start, None, None, None, []
    for _ in range(max_iter):
        if points is not None:
            factor = _inside(guess_factor(points, target, start), lo, hi)
        scaled = make(factor)
        mean, peak = oracle_demand_share(cfg, scaled, dispatch, span(factor) if callable(span) else span)
        if points is not None:
            points.append((factor, mean))
        tries.append((round(factor, 6), round(mean, 6)))
        if best is None or abs(mean - target) < abs(best[2] - target):
            best = (factor, scaled, mean, peak)
        if mean > 0 and abs(mean / target - 1) <= tol:
            break
        if mean < target:
            lo = factor if lo is None else max(lo, factor)
        else:
            hi = factor if hi is None else min(hi, factor)
        if points is not None:
            continue
        prop = factor * target / mean if mean > 0 else None
        if lo is not None and hi is not None:
            # bracketed: geometric bisection, or the proportional step when linear and inside
            factor = prop if linear and prop is not None and lo < prop < hi else (lo * hi) ** 0.5
        else:
            cap = 16.0 if linear else 4.0
            step = float(np.clip(target / mean if mean > 0 else cap, 1 / cap, cap))
            factor *= step if linear else step ** 0.8
    factor, scaled, mean, peak = best
    return scaled, {"scale": factor, "target_share": target, "mean_share": mean, "peak_share": peak,
                    "oracle_dispatch": dispatch, "tries": tries}


def _inside(f: float, lo: float | None, hi: float | None) -> float:
    """``f`` if it lies strictly inside the bracket (``lo``, ``hi``; None: unbounded), else the
    bracket's geometric middle, or 1.5x beyond the bound it has."""
    lo_, hi_ = lo or 0.0, math.inf if hi is None else hi
    if lo_ < f < hi_:
        return f
    return math.sqrt(lo_ * hi_) if lo_ > 0 and hi_ < math.inf else (lo_ * 1.5 if lo_ > 0 else hi_ / 1.5)


def scale_to_mem_share(cfg: SimConfig, trace: list[TraceRequest], target: float, tol: float = 0.05,
                       max_iter: int = 8, dispatch: str = DEFAULT_DISPATCH, method: str = "compress",
                       seed: int = 0) -> tuple[list[TraceRequest], dict]:
    """Scale ``trace``'s rate until the oracle's mean KV demand over the arrival period is ``target``
    x capacity (one trace for every policy and router that is compared on it; the oracle routes
    with ``dispatch``). ``method``: ``compress`` (default, for the earlier runs) or ``upscale``."""
    if method not in METHODS:
        raise ValueError(f"rate scaling method {method!r}: one of {', '.join(METHODS)}")
    make = (lambda f: compress_time(trace, f)) if method == "compress" else (lambda f: upscale(trace, f, seed))
    scaled, info = fit_rate(cfg, make, target, tol, max_iter, dispatch, linear=method == "upscale")
    return scaled, {**info, "method": method}


def arrival_peak_to_mean(reqs: list[TraceRequest], bucket_s: float = 30.0, weight: str = "tokens") -> float:
    """Peak-to-mean of arrivals per ``bucket_s`` bucket, counting requests or their tokens
    (prompt + output, a proxy for the KV they will hold)."""
    if not reqs:
        return 0.0
    if weight not in ("tokens", "requests"):
        raise ValueError(f"weight={weight!r}: tokens or requests")
    t = np.array([r.arrival_s for r in reqs])
    w = np.array([r.prompt + r.output if weight == "tokens" else 1 for r in reqs], float)
    edges = np.arange(t.min(), t.max() + bucket_s, bucket_s)
    h = np.histogram(t, bins=edges, weights=w)[0] if len(edges) > 1 else w.sum(keepdims=True)
    return float(h.max() / h.mean()) if h.mean() > 0 else 0.0


def scan_windows(cfg: SimConfig, reqs: list[TraceRequest], duration_s: float, step_s: float = 60.0,
                 rate_scale: float = 14.0, min_requests: int = 50) -> list[dict]:
    """Rank ``duration_s`` windows (every ``step_s``) of a trace by burstiness, best first.

    Per window: the arrival peak-to-mean (30-s buckets, tokens and requests) and the oracle's KV
    demand peak-to-mean at one common ``rate_scale`` (``oracle_demand_share``; KV integrates
    arrivals over request lifetimes, which at paper-scale upscaling span minutes of the original
    trace, so it is the ratio that decides how far a window overloads memory at a given mean)."""
    if not duration_s > 0 or not step_s > 0:
        raise ValueError("duration_s and step_s must be positive")
    out = []
    end = reqs[-1].arrival_s if reqs else 0.0
    off = 0.0
    while off + duration_s <= end + 1e-9:
        win = [r for r in reqs if off <= r.arrival_s < off + duration_s]
        if len(win) >= min_requests:
            t0 = win[0].arrival_s
            win = [TraceRequest(i, r.arrival_s - t0, r.prompt, r.output) for i, r in enumerate(win)]
            mean, peak = oracle_demand_share(cfg, compress_time(win, rate_scale))
            out.append({"window": f"{off:g}:{duration_s:g}", "requests": len(win),
                        "arrival_peak_to_mean_tokens": arrival_peak_to_mean(win, 30.0, "tokens"),
                        "arrival_peak_to_mean_requests": arrival_peak_to_mean(win, 30.0, "requests"),
                        "oracle_peak_to_mean": peak / mean if mean > 0 else 0.0,
                        "oracle_mean_share": mean, "oracle_peak_share": peak, "rate_scale": rate_scale})
        off += step_s
    out.sort(key=lambda d: -d["oracle_peak_to_mean"])
    return out
