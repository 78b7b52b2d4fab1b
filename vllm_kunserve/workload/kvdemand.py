"""KV-cache demand of a trace over time, and rate scaling to hit a chosen share of capacity.

Estimator (documented in docs/bench.md): every request runs alone at an assumed speed, with no
queueing. Request i arriving at a_i with prompt p_i and output o_i holds, for
t in [a_i, a_i + p_i / prefill_tps + o_i / decode_tps),

    kv_i(t) = ceil((p_i + g_i(t)) / block_size) * block_size,
    g_i(t)  = clip((t - a_i - p_i / prefill_tps) * decode_tps, 0, o_i)

tokens (its prompt blocks are allocated on admission, one block more every ``block_size`` decoded
tokens) and demand(t) = sum_i kv_i(t), sampled on a grid of ``dt`` seconds. This is the memory the
trace asks for if the server kept up; a server that falls behind holds KV longer, so under overload
the real demand is higher than this estimate (it is a lower bound of the burst's pressure).
``mean`` averages demand over [0, end of the last request] (total KV token-seconds / busy span,
which grows monotonically with the rate); ``peak`` is its maximum. Peak demand moves in steps as
requests start or stop overlapping, so a rate chosen for a peak target reaches the target or exceeds
it by at most the step it jumped (reported back as the reached share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vllm_kunserve.workload.traces import Trace, scale_rate


@dataclass(frozen=True)
class DemandModel:
    decode_tps: float = 20.0  # output tokens per second of one request
    prefill_tps: float = math.inf  # prompt tokens per second of one request (inf: instantaneous)
    block_size: int = 16

    def __post_init__(self) -> None:
        if not self.decode_tps > 0:
            raise ValueError(f"decode speed must be > 0 tokens/s, got {self.decode_tps}")
        if not self.prefill_tps > 0:
            raise ValueError(f"prefill speed must be > 0 tokens/s, got {self.prefill_tps}")
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")


def request_spans(trace: Trace, model: DemandModel) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) in seconds of every request's KV residency under the estimator."""
    prefill = trace.prompt_len / model.prefill_tps
    return trace.arrival_s, trace.arrival_s + prefill + trace.output_len / model.decode_tps


def kv_demand(trace: Trace, model: DemandModel, dt: float = 0.05, max_points: int = 400_000) -> tuple[np.ndarray, np.ndarray]:
    """(t, demand_tokens) on a grid from 0 to the last request's end."""
    start, end = request_spans(trace, model)
    horizon = float(end.max()) if len(trace) else 0.0
    dt = max(dt, horizon / max_points)
    t = np.arange(0.0, horizon + dt, dt)
    demand = np.zeros_like(t)
    bs = model.block_size
    prefill = trace.prompt_len / model.prefill_tps
    for a, e, p, o, pf in zip(start, end, trace.prompt_len, trace.output_len, prefill):
        i0, i1 = int(math.ceil(a / dt - 1e-9)), int(math.ceil(e / dt - 1e-9))
        if i1 <= i0:
            continue
        g = np.clip((t[i0:i1] - a - pf) * model.decode_tps, 0.0, o)
        demand[i0:i1] += np.ceil((p + np.floor(g)) / bs) * bs
    return t, demand


def demand_stat(trace: Trace, model: DemandModel, stat: str) -> float:
    t, d = kv_demand(trace, model)
    if stat == "peak":
        return float(d.max()) if len(d) else 0.0
    if stat == "mean":
        return float(d.mean()) if len(d) else 0.0
    raise ValueError(f"unknown KV demand statistic {stat!r}; choose mean or peak")


def rate_for_kv_share(trace: Trace, model: DemandModel, capacity_tokens: int, share: float,
                      stat: str = "mean", lo: float = 1e-4, hi: float = 1e4, iters: int = 60) -> float:
    """Smallest rate scale factor f (within 0.01%) at which ``stat`` of the estimated demand of
    ``scale_rate(trace, f)`` reaches ``share`` x ``capacity_tokens`` (bisection in log space)."""
    if not share > 0:
        raise ValueError(f"target KV share must be > 0, got {share}")
    if capacity_tokens < 1:
        raise ValueError(f"KV capacity must be >= 1 token, got {capacity_tokens}")
    if len(trace) < 2:
        raise ValueError("rate scaling to a KV share needs at least 2 requests")
    target = share * capacity_tokens

    def value(f: float) -> float:
        return demand_stat(scale_rate(trace, f), model, stat)

    if value(hi) < target:
        raise ValueError(f"the trace cannot reach {share:.2f}x of {capacity_tokens} KV tokens by its {stat} "
                         f"demand even with all requests at once ({value(hi):.0f} tokens); lengthen or widen the window")
    if value(lo) > target:
        return lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(iters):
        m = (a + b) / 2
        if value(math.exp(m)) < target:
            a = m
        else:
            b = m
    return math.exp(b)
