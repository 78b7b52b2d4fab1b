"""Upscale a trace so its memory demand is a chosen share of the cluster's KV capacity.

TraceUpscaler-style: inter-arrival times are divided by a factor, keeping the burst pattern.
The factor is found by simulating the infinite-memory oracle (the demand the trace *would* put on
memory if nothing queued) and iterating ``factor *= target / measured`` on the mean KV demand over
the arrival period until it is within ``tol``.
"""

from __future__ import annotations

import numpy as np

from .engine import SimConfig, Simulator
from .policies.base import DEFAULT_DISPATCH
from .policies.baselines import OraclePolicy
from .trace import TraceRequest, scale_rate


def oracle_demand_share(cfg: SimConfig, trace: list[TraceRequest],
                        dispatch: str = DEFAULT_DISPATCH) -> tuple[float, float]:
    """(mean, peak) oracle KV use during the arrival period as a share of cluster capacity, with
    the oracle routing by ``dispatch`` (the simulator's default router unless told otherwise)."""
    sim = Simulator(cfg, OraclePolicy(dispatch), trace).run()
    cap = cfg.base_kv_blocks() * cfg.instances
    end = trace[-1].arrival_s
    used = np.array([p["kv_used_blocks"] for p in sim.timeline if p["t"] <= end] or [0.0], float)
    return float(used.mean() / cap), float(used.max() / cap)


def scale_to_mem_share(cfg: SimConfig, trace: list[TraceRequest], target: float, tol: float = 0.05,
                       max_iter: int = 8, dispatch: str = DEFAULT_DISPATCH) -> tuple[list[TraceRequest], dict]:
    """Scale ``trace``'s rate until the oracle's mean KV demand is ``target`` x capacity (one trace
    for every policy and router that is compared on it; the oracle routes with ``dispatch``)."""
    if not target > 0:
        raise ValueError(f"target memory share {target}: must be positive")
    factor, lo, hi, best = 1.0, None, None, None
    for _ in range(max_iter):
        scaled = scale_rate(trace, factor)
        mean, peak = oracle_demand_share(cfg, scaled, dispatch)
        if best is None or abs(mean - target) < abs(best[2] - target):
            best = (factor, scaled, mean, peak)
        if mean > 0 and abs(mean / target - 1) <= tol:
            break
        if mean < target:
            lo = factor
        else:
            hi = factor
        if lo is not None and hi is not None:
            factor = (lo * hi) ** 0.5  # bracketed: geometric bisection
        else:
            step = target / mean if mean > 0 else 4.0
            factor *= float(np.clip(step, 0.25, 4.0)) ** 0.8
    factor, scaled, mean, peak = best
    return scaled, {"scale": factor, "target_share": target, "mean_share": mean, "peak_share": peak,
                    "oracle_dispatch": dispatch}


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
            mean, peak = oracle_demand_share(cfg, scale_rate(win, rate_scale))
            out.append({"window": f"{off:g}:{duration_s:g}", "requests": len(win),
                        "arrival_peak_to_mean_tokens": arrival_peak_to_mean(win, 30.0, "tokens"),
                        "arrival_peak_to_mean_requests": arrival_peak_to_mean(win, 30.0, "requests"),
                        "oracle_peak_to_mean": peak / mean if mean > 0 else 0.0,
                        "oracle_mean_share": mean, "oracle_peak_share": peak, "rate_scale": rate_scale})
        off += step_s
    out.sort(key=lambda d: -d["oracle_peak_to_mean"])
    return out
