"""Tuning a baseline the way a user would: sweep stock vLLM's batch cap on a trace and keep the best.

``pick_vllm_cap`` runs ``vllm-tuned`` (``max_num_seqs`` = each candidate per instance) on one trace
and returns the cap with the lowest P99 TTFT over the measured requests. A candidate that leaves a
measured request unfinished or rejected counts as infinitely slow. Ties go to the larger cap (the
one closer to stock, with more throughput headroom).
"""

from __future__ import annotations

import math
from typing import Iterable

from .engine import SimConfig
from .policies import DEFAULT_DISPATCH
from .policies.baselines import VllmTunedPolicy
from .runner import simulate
from .trace import TraceRequest


def p99_ttft(summary: dict) -> float:
    """P99 TTFT of a ``metrics.summarize`` summary; inf when a measured request did not finish."""
    if summary["completed"] < summary["requests"] or summary["ttft_s"].get("p99") is None:
        return math.inf
    return float(summary["ttft_s"]["p99"])


def pick_vllm_cap(cfg: SimConfig, trace: list[TraceRequest], caps: Iterable[int],
                  dispatch: str = DEFAULT_DISPATCH, warmup_s: float = 0.0, end_s: float | None = None) -> dict:
    """Run stock vLLM with each batch cap of ``caps`` on ``trace``; ``{"cap": best, "p99_ttft_s":
    {cap: P99}, "summaries": {cap: summary}}``, best = lowest P99 TTFT (ties: the larger cap)."""
    caps = sorted({int(c) for c in caps})
    if not caps:
        raise ValueError("pick_vllm_cap: no candidate cap")
    if caps[0] < 1:
        raise ValueError(f"pick_vllm_cap: caps must be >= 1, got {caps[0]}")
    p99, summaries = {}, {}
    for cap in caps:
        res = simulate(cfg, VllmTunedPolicy(cap, dispatch), trace, keep_requests=False,
                       warmup_s=warmup_s, end_s=end_s)
        summaries[cap] = res["summary"]
        p99[cap] = p99_ttft(res["summary"])
    best = min(caps, key=lambda c: (p99[c], -c))
    return {"cap": best, "p99_ttft_s": p99, "summaries": summaries}
