"""Traces for the simulator: a list of :class:`TraceRequest` sorted by arrival.

Files are read by the loader the benchmark harness uses too (``vllm_kunserve.workload.traces.load_csv``:
the Azure LLM inference CSV ``TIMESTAMP, ContextTokens, GeneratedTokens``, "Azure LLM inference
trace 2023, Microsoft Azure, used in Splitwise (Patel et al., ISCA 2024)", CC BY 4.0, or the
BurstGPT CSV; errors name the line and column), so the simulator and the harness replay the same
requests. Rate scaling is shared too (``workload.traces.upscale``, ``workload.traces.compress_time``):
the functions here only convert between its :class:`~vllm_kunserve.workload.traces.Trace` and
:class:`TraceRequest` lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_kunserve.workload import traces as T


@dataclass(frozen=True)
class TraceRequest:
    id: int
    arrival_s: float
    prompt: int
    output: int


def from_trace(tr: T.Trace) -> list[TraceRequest]:
    """A :class:`~vllm_kunserve.workload.traces.Trace` as simulator requests (ids in arrival order)."""
    return [TraceRequest(i, a, p, o) for i, (a, p, o) in
            enumerate(zip(tr.arrival_s.tolist(), tr.prompt_len.tolist(), tr.output_len.tolist()))]


def to_trace(reqs: list[TraceRequest], name: str = "sim") -> T.Trace:
    """Simulator requests as a :class:`~vllm_kunserve.workload.traces.Trace` (timestamps kept as they are)."""
    n = len(reqs)
    return T.Trace(np.array([r.arrival_s for r in reqs], np.float64), np.array([r.prompt for r in reqs], np.int64),
                   np.array([r.output for r in reqs], np.int64), np.zeros(n, np.int64), name=name)


def read_trace_csv(path: str) -> list[TraceRequest]:
    """Azure or BurstGPT CSV (BurstGPT's failed requests, with no response, are skipped); arrivals
    start at 0."""
    tr = T.load_csv(path)
    if len(tr) == 0:
        raise ValueError(f"{path}: no requests")
    return from_trace(tr)


def window(reqs: list[TraceRequest], offset_s: float = 0.0, duration_s: float | None = None) -> list[TraceRequest]:
    """Requests arriving in ``[offset, offset + duration)``, re-based to start at 0."""
    if offset_s < 0 or (duration_s is not None and duration_s <= 0):
        raise ValueError(f"bad window offset={offset_s} duration={duration_s}")
    end = float("inf") if duration_s is None else offset_s + duration_s
    out = [r for r in reqs if offset_s <= r.arrival_s < end]
    if not out:
        raise ValueError(f"window offset={offset_s}s duration={duration_s}s holds no request")
    return [TraceRequest(i, r.arrival_s - offset_s, r.prompt, r.output) for i, r in enumerate(out)]


def compress_time(reqs: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """``workload.traces.compress_time``: every timestamp divided by ``factor`` (the same requests in
    1/factor of the time; distorts bursts against request lifetimes, see there)."""
    a = T.compress_time(to_trace(reqs), factor).arrival_s.tolist()
    return [TraceRequest(r.id, t, r.prompt, r.output) for r, t in zip(reqs, a)]


def upscale(reqs: list[TraceRequest], factor: float, seed: int = 0) -> list[TraceRequest]:
    """``workload.traces.upscale``: ``factor`` x the requests over the same span, pattern kept."""
    return from_trace(T.upscale(to_trace(reqs), factor, seed=seed))


def clip_lengths(reqs: list[TraceRequest], max_model_len: int) -> list[TraceRequest]:
    """Cap prompt + output at the model's context length (as a server would reject/truncate)."""
    out = []
    for r in reqs:
        p = min(r.prompt, max_model_len - 1)
        out.append(TraceRequest(r.id, r.arrival_s, p, max(1, min(r.output, max_model_len - p))))
    return out


def load_trace(path: str, offset_s: float = 0.0, duration_s: float | None = None,
               rate_scale: float = 1.0) -> list[TraceRequest]:
    """Read, window and (``rate_scale`` != 1) compress time, as ``kunserve simulate --rate-scale``
    documents; paper-scale workloads are built by ``sim.workload`` with :func:`upscale`."""
    reqs = read_trace_csv(path)
    if offset_s or duration_s is not None:
        reqs = window(reqs, offset_s, duration_s)
    if rate_scale != 1.0:
        reqs = compress_time(reqs, rate_scale)
    return reqs
