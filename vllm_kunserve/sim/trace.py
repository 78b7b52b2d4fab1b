"""Traces for the simulator: a list of :class:`TraceRequest` sorted by arrival.

Uses the benchmark harness's loader (``vllm_kunserve.bench.traces``) when it is installed, else a
minimal reader of its own for the Azure LLM inference CSV (``TIMESTAMP, ContextTokens,
GeneratedTokens``; "Azure LLM inference trace 2023, Microsoft Azure, used in Splitwise (Patel et
al., ISCA 2024)", CC BY 4.0) and the BurstGPT CSV.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    id: int
    arrival_s: float
    prompt: int
    output: int


def _parse_ts(raw: str, where: str) -> float:
    raw = raw.strip()
    try:
        return float(raw) * 1e-6  # microseconds
    except ValueError:
        pass
    try:
        # "2023-11-16 18:15:46.6805900": fromisoformat takes at most 6 fraction digits
        head, _, frac = raw.partition(".")
        t = _dt.datetime.fromisoformat(head)
        return t.timestamp() + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise ValueError(f"{where}: TIMESTAMP {raw!r} is neither microseconds nor a date-time") from None


def _int(raw: str, where: str, col: str, lo: int) -> int:
    try:
        v = int(float(raw))
    except (TypeError, ValueError):
        raise ValueError(f"{where}, column {col}: {raw!r} is not an integer") from None
    if v < lo:
        raise ValueError(f"{where}, column {col}: {v} < {lo}")
    return v


def read_trace_csv(path: str) -> list[TraceRequest]:
    """Azure (TIMESTAMP, ContextTokens, GeneratedTokens) or BurstGPT (Timestamp, Request tokens,
    Response tokens) CSV; arrivals are shifted to start at 0. Errors name the line and column."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"trace {path} not found")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(cols):
            ts, pc, oc, secs = "TIMESTAMP", "ContextTokens", "GeneratedTokens", False
        elif {"Timestamp", "Request tokens", "Response tokens"} <= set(cols):
            ts, pc, oc, secs = "Timestamp", "Request tokens", "Response tokens", True
        else:
            raise ValueError(f"{path}:1: unknown trace columns {cols}; expected Azure "
                             "(TIMESTAMP, ContextTokens, GeneratedTokens) or BurstGPT "
                             "(Timestamp, Request tokens, Response tokens)")
        rows = []
        for line, row in enumerate(reader, start=2):
            where = f"{path}:{line}"
            if row.get(ts) in (None, ""):
                raise ValueError(f"{where}, column {ts}: missing")
            t = float(row[ts]) if secs else _parse_ts(row[ts], f"{where}, column {ts}")
            p = _int(row.get(pc), where, pc, 1)
            o = _int(row.get(oc), where, oc, 0)
            if o == 0:
                continue  # failed requests in BurstGPT have no response
            rows.append((t, p, o))
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceRequest(i, t - t0, p, o) for i, (t, p, o) in enumerate(rows)]


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
    reqs = _load_with_harness(path)
    if reqs is None:
        reqs = read_trace_csv(path)
    if offset_s or duration_s is not None:
        reqs = window(reqs, offset_s, duration_s)
    if rate_scale != 1.0:
        reqs = scale_rate(reqs, rate_scale)
    return reqs


def _load_with_harness(path: str) -> list[TraceRequest] | None:
    """Hook for ``vllm_kunserve.bench.traces`` (the harness's loader); None when unavailable."""
    try:
        from vllm_kunserve.bench import traces as bt  # noqa: F401
    except ImportError:
        return None
    from .adapters import harness_trace
    return harness_trace(path)
