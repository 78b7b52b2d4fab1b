"""Paper-scale workloads for the simulator: a real trace's arrivals upscaled with their temporal
pattern kept, a length mix, a warm-up excluded from the metrics, and a measured period as long as
the paper's.

One workload is ``[offset - warmup, offset + duration)`` seconds of the source trace (by default the
Azure LLM conversation trace 2023; "Azure LLM inference trace 2023, Microsoft Azure, used in
Splitwise (Patel et al., ISCA 2024)", CC BY 4.0), rebased to 0, then

1. upscaled by ``factor`` with ``workload.traces.upscale`` (factor x the arrivals over the same
   span: bursts keep their height, length and timing; no time compression);
2. given the lengths of a mix (``workload.traces.LENGTH_MIXES``: ``burstgpt``, ``sharegpt``,
   ``longbench`` or the trace's own ``azure``), drawn with ``seed``, clipped to the context length;
3. replayed whole; metrics cover the requests arriving in ``[warmup, warmup + duration)``, so the
   cluster is in steady state (its KV filled by the source's own preceding traffic) when
   measurement starts and arrivals go on for the paper's full 640 s.

:func:`calibrate` finds the factor whose infinite-memory oracle puts the mean KV demand of the
measured period at a target share of capacity. :func:`compressed` builds the earlier construction
(a window compressed in time, cold start, arrivals ending early) for comparison.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from vllm_kunserve.workload import traces as T

from .engine import SimConfig
from .hardware import data_dir
from .policies.base import DEFAULT_DISPATCH
from .scaling import fit_rate
from .trace import TraceRequest, compress_time, from_trace

PAPER_DURATION_S = 640.0  # the KunServe paper's trace length
DEFAULT_WARMUP_S = 120.0
#: start of the measured period in the Azure conversation trace: the 640-s window (every 20 s from
#: 120 s on) with the highest 30-s request-rate peak-to-mean (1.50; 10-s: 1.81)
DEFAULT_OFFSET_S = 2740.0


def default_trace() -> str:
    return os.path.join(data_dir(), "traces", "azure_llm_2023_conv.csv")


@dataclass(frozen=True)
class WorkloadSpec:
    lengths: str = "burstgpt"
    trace: str = field(default_factory=default_trace)
    offset_s: float = DEFAULT_OFFSET_S      # source second where the measured period starts
    duration_s: float = PAPER_DURATION_S    # measured period (source seconds = simulated seconds)
    warmup_s: float = DEFAULT_WARMUP_S      # source seconds replayed before it, not measured
    seed: int = 0                           # upscaling phase and length draws
    max_model_len: int = 32768              # Qwen-2.5-14B's context: prompt + output clipped to it
    waves: int = 1                          # > 1: the measured period is the source's first
                                            # duration/waves seconds from offset, repeated

    def __post_init__(self):
        if self.lengths not in T.LENGTH_MIXES:
            raise ValueError(f"length mix {self.lengths!r}: one of {', '.join(T.LENGTH_MIXES)}")
        if self.waves < 1:
            raise ValueError(f"waves={self.waves}: must be >= 1")
        if self.duration_s <= 0 or self.warmup_s < 0 or self.offset_s - self.warmup_s < 0:
            raise ValueError(f"workload window: need duration > 0, warm-up >= 0 and offset >= warm-up "
                             f"(got offset {self.offset_s}, duration {self.duration_s}, warm-up {self.warmup_s})")

    def with_(self, **kw) -> "WorkloadSpec":
        return replace(self, **kw)


@dataclass
class Workload:
    spec: WorkloadSpec
    factor: float
    reqs: list[TraceRequest]
    warmup_s: float
    end_s: float | None  # None: every request from warmup_s on is measured
    info: dict = field(default_factory=dict)

    def describe(self) -> dict:
        hi = float("inf") if self.end_s is None else self.end_s
        tr = [r for r in self.reqs if self.warmup_s <= r.arrival_s < hi]
        n = max(len(tr), 1)
        span = (min(hi, self.reqs[-1].arrival_s) - self.warmup_s) if self.reqs else 0.0
        return {"spec": asdict(self.spec), "factor": round(self.factor, 4), "requests": len(self.reqs),
                "measured_requests": len(tr), "warmup_s": self.warmup_s, "end_s": self.end_s,
                "mean_rate_rps": round(len(tr) / span, 3) if span > 0 else None,
                "prompt_mean": round(sum(r.prompt for r in tr) / n, 1),
                "output_mean": round(sum(r.output for r in tr) / n, 1), **self.info}


_SOURCES: dict[str, T.Trace] = {}


def source(path: str) -> T.Trace:
    if path not in _SOURCES:
        _SOURCES[path] = T.load_csv(path)
    return _SOURCES[path]


def source_window(spec: WorkloadSpec) -> T.Trace:
    """The source seconds the workload replays, ``[offset - warmup, offset + duration)``, rebased.
    With ``waves = n > 1`` the measured part is the segment ``[offset, offset + duration / n)``
    played ``n`` times back to back (the source's wave repeated, as the KunServe paper's 640-s
    traces repeat theirs), after the same warm-up."""
    src = source(spec.trace)
    if spec.waves == 1:
        return T.window(src, spec.offset_s - spec.warmup_s, spec.warmup_s + spec.duration_s)
    seg_s = spec.duration_s / spec.waves
    warm = T.window(src, spec.offset_s - spec.warmup_s, spec.warmup_s) if spec.warmup_s > 0 else None
    seg = T.window(src, spec.offset_s, seg_s)
    parts = ([warm] if warm is not None else []) + [seg] * spec.waves
    starts = ([0.0] if warm is not None else []) + [spec.warmup_s + j * seg_s for j in range(spec.waves)]
    cat = lambda f: np.concatenate([f(t) for t in parts])  # noqa: E731
    a = np.concatenate([t.arrival_s + s0 for t, s0 in zip(parts, starts)])
    return T.Trace(a, cat(lambda t: t.prompt_len), cat(lambda t: t.output_len), cat(lambda t: t.source_line),
                   name=f"{src.name} x{spec.waves} waves", meta={"waves": spec.waves, "wave_s": seg_s})


def build(spec: WorkloadSpec, factor: float) -> Workload:
    """The workload at rate ``factor`` x the source's (upscaled, lengths from the mix)."""
    up = T.upscale(source_window(spec), factor, seed=spec.seed)
    up = T.with_lengths(up, spec.lengths, seed=spec.seed, max_total=spec.max_model_len)
    return Workload(spec, factor, from_trace(up), spec.warmup_s, spec.warmup_s + spec.duration_s,
                    {"rate_method": "upscale"})


def calibrate(cfg: SimConfig, spec: WorkloadSpec, target: float, dispatch: str = DEFAULT_DISPATCH,
              start: float | None = None, tol: float = 0.05, max_iter: int = 6) -> Workload:
    """:func:`build` at the factor whose oracle mean KV demand over the measured period is
    ``target`` x cluster capacity (``scaling.fit_rate``, demand about linear in the factor)."""
    made: dict[float, Workload] = {}

    def make(f: float) -> list[TraceRequest]:
        made[f] = build(spec, f)
        return made[f].reqs

    _, info = fit_rate(cfg, make, target, tol, max_iter, dispatch, span=(spec.warmup_s, spec.warmup_s + spec.duration_s),
                       start=start or 8.0, linear=True)
    w = made[info["scale"]]
    w.info.update({"target_share": target, "oracle_mean_share": round(info["mean_share"], 4),
                   "oracle_peak_share": round(info["peak_share"], 4), "oracle_dispatch": dispatch,
                   "fit_tries": info["tries"]})
    return w


def compressed(cfg: SimConfig, spec: WorkloadSpec, target: float, dispatch: str = DEFAULT_DISPATCH,
               window_s: float = 600.0, tol: float = 0.05, max_iter: int = 8) -> Workload:
    """The earlier construction for comparison: ``window_s`` source seconds from ``offset`` with the
    mix's lengths, compressed in time until the oracle's mean KV demand over the arrival period is
    ``target`` x capacity; cold start (no warm-up), arrivals end after window / factor seconds, and
    every request is measured."""
    w = T.window(source(spec.trace), spec.offset_s, window_s)
    base = from_trace(T.with_lengths(w, spec.lengths, seed=spec.seed, max_total=spec.max_model_len))
    reqs, info = fit_rate(cfg, lambda f: compress_time(base, f), target, tol, max_iter, dispatch)
    return Workload(spec, info["scale"], reqs, 0.0, None,
                    {"rate_method": "compress", "target_share": target,
                     "oracle_mean_share": round(info["mean_share"], 4), "oracle_peak_share": round(info["peak_share"], 4),
                     "oracle_dispatch": dispatch, "fit_tries": info["tries"],
                     "arrival_span_s": round(reqs[-1].arrival_s, 2)})
