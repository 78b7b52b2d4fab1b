"""Traces for the simulator: a list of :class:`TraceRequest` sorted by arrival.

Files are read by the benchmark harness's loader (``vllm_kunserve.bench.traces.load_csv``: the
Azure LLM inference CSV ``TIMESTAMP, ContextTokens, GeneratedTokens``, "Azure LLM inference trace
2023, Microsoft Azure, used in Splitwise (Patel et al., ISCA 2024)", CC BY 4.0, or the BurstGPT
CSV; errors name the line and column), so the simulator and the harness replay the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kunserve.bench.traces import load_csv


@dataclass(frozen=True)
class TraceRequest:
    id: int
    arrival_s: float
    prompt: int
    output: int


def read_trace_csv(path: str) -> list[TraceRequest]:
    """Azure or BurstGPT CSV (BurstGPT's failed requests, with no response, are skipped); arrivals
    start at 0."""
    tr = load_csv(path)
    if len(tr) == 0:
        raise ValueError(f"{path}: no requests")
    return [TraceRequest(i, a, p, o) for i, (a, p, o) in
            enumerate(zip(tr.arrival_s.tolist(), tr.prompt_len.tolist(), tr.output_len.tolist()))]


def window(reqs: list[TraceRequest], offset_s: float = 0.0, duration_s: float | None = None) -> list[TraceRequest]:
    """Requests arriving in ``[offset, offset + duration)``, re-based to start at 0."""
    if offset_s < 0 or (duration_s is not None and duration_s <= 0):
        raise ValueError(f"bad window offset={offset_s} duration={duration_s}")
    end = float("inf") if duration_s is None else offset_s + duration_s
    out = [r for r in reqs if offset_s <= r.arrival_s < end]
    if not out:
        raise ValueError(f"window offset={offset_s}s duration={duration_s}s holds no request")
    return [TraceRequest(i, r.arrival_s - offset_s, r.prompt, r.output) for i, r in enumerate(out)]


def scale_rate(reqs: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Multiply the arrival rate by ``factor`` keeping the temporal pattern (inter-arrival times / factor)."""
    if not factor > 0:
        raise ValueError(f"rate scale {factor} must be positive")
    return [TraceRequest(r.id, r.arrival_s / factor, r.prompt, r.output) for r in reqs]


def clip_lengths(reqs: list[TraceRequest], max_model_len: int) -> list[TraceRequest]:
    """Cap prompt + output at the model's context length (as a server would reject/truncate)."""
    out = []
    for r in reqs:
        p = min(r.prompt, max_model_len - 1)
        out.append(TraceRequest(r.id, r.arrival_s, p, max(1, min(r.output, max_model_len - p))))
    return out


def load_trace(path: str, offset_s: float = 0.0, duration_s: float | None = None,
               rate_scale: float = 1.0) -> list[TraceRequest]:
    reqs = read_trace_csv(path)
    if offset_s or duration_s is not None:
        reqs = window(reqs, offset_s, duration_s)
    if rate_scale != 1.0:
        reqs = scale_rate(reqs, rate_scale)
    return reqs
