"""What the burst benchmarks share (``benchmarks/burst_value.py``, ``pipeline_idle.py``): the
kunserve config their clusters run, and the reading of a ``kunserve compare`` run's repetitions
(``<out>/<system>/rep<k>/``): the burst window's TTFT and TPOT, the front end's dispatch split, when
the engines were grouped.

Percentiles over a window are ``workload.stats.percentile``'s (linear interpolation, completed
requests only).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Iterator

from vllm_kunserve.bench.report import md_table
from vllm_kunserve.workload.records import read_csv
from vllm_kunserve.workload.stats import percentile

#: a request sent this much after its arrival time makes its run's latencies suspect
LATE_S = 0.05


def kunserve_config(max_kv_ratio: float) -> dict:
    """The kunserve config of the burst benchmarks' clusters, its KV growth capped at ``max_kv_ratio``."""
    # min_decode_share: on this CPU a prompt token costs ~2 ms (prefill ~480 tok/s) against a decode
    # step of 40-70 ms for the whole batch, so a queue of prompts is compute-bound (the prefill mix)
    # defer_for_first_token_s: measured on (burst_value_r1_2x_join.md) and kept, so that page is this config's
    return {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 2.0, "min_decode_share": 0.5,
                     "defer_for_first_token_s": 2.0},
            "restore": {"threshold": 0.4, "hold_s": 5.0},
            "memory": {"max_kv_ratio": max_kv_ratio}}


def add_phase_args(ap, warm_s: float, warm_share: float, burst_s: float, burst_x: float) -> None:
    """The burst run's phases as options of ``ap`` (a parser or an argument group), with these defaults:
    ``--warm-s`` seconds at ``--warm-share`` of the capacity, then ``--burst-s`` seconds at ``--burst-x``
    times it."""
    for flag, default in (("--warm-s", warm_s), ("--warm-share", warm_share), ("--burst-s", burst_s),
                          ("--burst-x", burst_x)):
        ap.add_argument(flag, type=float, default=default)


def read_requests(path: Path | str) -> list[dict]:
    """A run's ``requests.csv`` rows (every field a string, as written)."""
    return read_csv(path)


def window_stats(rows: list[dict], lo: float, hi: float) -> dict:
    """TTFT and TPOT of the requests arriving in [lo, hi) (P99 over the burst window)."""
    sel = [r for r in rows if lo <= float(r["arrival_s"]) < hi]
    ok = [r for r in sel if r["ok"] == "1"]
    ttft = [float(r["ttft_s"]) for r in ok if r["ttft_s"]]
    tpot = [float(r["tpot_s"]) for r in ok if r["tpot_s"]]
    lag = [float(r["send_s"]) - float(r["arrival_s"]) for r in rows if r["send_s"]]
    return {"n": len(sel), "failed": len(sel) - len(ok), "failed_all": sum(r["ok"] != "1" for r in rows),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "late_sends": sum(x > LATE_S for x in lag),
            "send_lag_max": max(lag) if lag else None}


def run_files(out: Path, systems: list[str], reps: int, name: str) -> Iterator[tuple[str, int, Path]]:
    """(system, repetition, path) of every run's ``name`` file under ``out`` (or its gzipped copy,
    as a doc's raw data keeps it: ``report.read_csv`` reads either)."""
    for s in systems:
        for k in range(1, reps + 1):
            f = out / s / f"rep{k}" / name
            if f.exists() or f.with_name(name + ".gz").exists():
                yield s, k, f


def dispatch_split(out: Path, systems: list[str], reps: int, window: tuple[float, float]) -> dict:
    """Per system and repetition, how many requests the front end gave each engine over the window
    (its ``kunserve:dispatched_total{instance=i}`` counters in timeline.csv, at the window's ends)."""
    lo, hi = window
    res: dict = {}
    for s, k, f in run_files(out, systems, reps, "timeline.csv"):
        rows = read_csv(f)
        cols = sorted((c for c in (rows[0] if rows else {}) if c.startswith("kunserve:dispatched_total{instance=")),
                      key=lambda c: int(c.split("=")[1].rstrip("}")))

        def at(t: float, col: str) -> float:
            seen = [float(r[col]) for r in rows if r.get(col) and float(r["second"]) <= t]
            return seen[-1] if seen else 0.0
        if cols:
            res.setdefault(s, {})[k] = [round(at(hi, c) - at(lo, c)) for c in cols]
    return res


#: the engines' transitions of the three levers, in the order they engage and let go (docs/levers.md)
LEVER_KINDS = ("remap", "group_join", "group_leave", "revert")


def lever_times(out: Path, systems: list[str], reps: int) -> dict:
    """Per system and repetition where any engine remapped: for each kind of :data:`LEVER_KINDS`, the
    first second an engine's ``kunserve:memory_events_total{kind=...,outcome=ok}`` counter rose
    (timeline.csv, sampled every second; None: never) and how many there were in the run, over both
    engines."""
    res: dict = {}
    for s, k, f in run_files(out, systems, reps, "timeline.csv"):
        rows = read_csv(f)
        row = {}
        for kind in LEVER_KINDS:
            cols = [c for c in (rows[0] if rows else {}) if c.startswith("kunserve:memory_events_total{")
                    and f"kind={kind}," in c and "outcome=ok" in c]
            totals = [(float(r["second"]), sum(float(r[c]) for c in cols if r.get(c))) for r in rows]
            first = next((t for t, n in totals if n > 0), None)
            row[kind] = {"first_s": first, "count": int(max((n for _, n in totals), default=0))}
        if row["remap"]["count"]:
            res.setdefault(s, {})[k] = row
    return res


def lever_section(levers: dict) -> list[str]:
    """The page's "When each lever engaged" (:func:`lever_times`); empty where no engine remapped."""
    if not levers:
        return []
    head = ["system", "rep", *(f"{k} first s (n)" for k in LEVER_KINDS)]
    rows = [[s, str(k), *(f"{v[kind]['first_s']:g} ({v[kind]['count']})" if v[kind]["first_s"] is not None else "-"
                          for kind in LEVER_KINDS)]
            for s, reps in levers.items() for k, v in sorted(reps.items())]
    return ["## When each lever engaged", "",
            "Where the engines remap too (`remap.enable`): the first second of each engine transition, over both "
            "engines, and how many there were in the run (`kunserve:memory_events_total`, timeline.csv): the "
            "engines' own remap first, then the group joined from remapped (the drop), then the group's leave "
            "(the restore) and the remap's revert (docs/levers.md). `-`: not before the run's last sample (the "
            "harness stops sampling once its last request ends; a restore or revert after that is only in the "
            "logs).", "",
            *md_table(head, "lr" + "r" * len(LEVER_KINDS), rows), ""]


def group_times(out: Path, systems: list[str], reps: int, window: tuple[float, float]) -> dict:
    """Per system and repetition that grouped: the first second its engines were in a pipeline group,
    the share of the burst window's seconds they were (``kunserve:grouped_instances`` >= 2 in
    timeline.csv, the front end's gauge sampled every second) and, at the window's last sample, the
    layers and KV blocks each engine held (``kunserve:layers_held`` / ``kunserve:kv_blocks_total``), and
    ``spans``: the grouped seconds as ``[start, end)`` spans of consecutive samples (an arrival in one
    found the engines grouped)."""
    lo, hi = window
    res: dict = {}
    for s, k, f in run_files(out, systems, reps, "timeline.csv"):
        rows = [r for r in read_csv(f) if r.get("kunserve:grouped_instances")]
        grouped = [float(r["second"]) for r in rows if float(r["kunserve:grouped_instances"]) >= 2]
        inside = [r for r in rows if lo <= float(r["second"]) < hi]
        if grouped:
            last = inside[-1] if inside else {}

            def per_engine(prefix: str) -> list[int]:
                cols = sorted((c for c in last if c.startswith(prefix + "{instance=") and last[c]),
                              key=lambda c: int(c.split("=")[1].rstrip("}")))
                return [int(float(last[c])) for c in cols]
            res.setdefault(s, {})[k] = {
                "first_s": grouped[0],
                "window_share": round(sum(float(r["kunserve:grouped_instances"]) >= 2 for r in inside)
                                      / len(inside), 3) if inside else None,
                "layers": per_engine("kunserve:layers_held"), "kv_blocks": per_engine("kunserve:kv_blocks_total"),
                "spans": spans(grouped, sample_step([float(r["second"]) for r in rows]))}
    return res


def grouped_output(out: Path, system: str, ref: str, groups: dict, window: tuple[float, float]) -> dict:
    """A grouping ``system``'s output against ``ref``'s over the same seconds of the burst window (every
    system replays the same arrivals, so a second is the same offered load in both): per repetition in
    ``groups`` (``system``'s :func:`group_times`), the window's seconds it was grouped and those before
    its first group, each with both runs' output tokens (timeline.csv's ``output_tokens`` per second)
    and running requests summed over them: ``{"seconds", "tokens", "running"}``, the last two
    ``system`` over ``ref`` (None where ``ref`` had none); ``all`` pools the repetitions. Output below
    the running ratio is what the pipeline costs per request (its bubbles, hops, a step per
    microbatch), where the batch is the same."""
    lo, hi = window

    def per_second(k: int, s: str) -> dict[int, tuple[float, float]]:
        f = out / s / f"rep{k}" / "timeline.csv"
        if not (f.exists() or f.with_name(f.name + ".gz").exists()):
            return {}
        return {round(float(r["second"])): (float(r.get("output_tokens") or 0), float(r.get("running") or 0))
                for r in read_csv(f) if r.get("second")}

    def summary(n: int, x: tuple[float, ...]) -> dict:   # x: (my tokens, my running, ref tokens, ref running)
        return {"seconds": n, "tokens": round(x[0] / x[2], 3) if x[2] > 0 else None,
                "running": round(x[1] / x[3], 3) if x[3] > 0 else None}

    res: dict = {}
    pooled_: dict[str, list[tuple[int, tuple[float, ...]]]] = {"grouped": [], "before": []}
    for k, g in sorted(groups.items()):
        mine, theirs = per_second(k, system), per_second(k, ref)
        both = [t for t in sorted(mine) if t in theirs and lo <= t < hi]
        parts = {"grouped": [t for t in both if in_spans(t, g.get("spans") or [])],
                 "before": [t for t in both if t < g["first_s"]]}
        res[k] = {}
        for part, ts in parts.items():
            x = tuple(sum(src[t][i] for t in ts) for src in (mine, theirs) for i in (0, 1))
            res[k][part] = summary(len(ts), x)
            pooled_[part].append((len(ts), x))
    if res:
        res["all"] = {part: summary(sum(n for n, _ in v), tuple(map(sum, zip(*(x for _, x in v)))))
                      for part, v in pooled_.items()}
    return res


def spans(seconds: list[float], step: float = 1.0) -> list[list[float]]:
    """Sorted once-a-``step`` sample times as ``[start, end)`` spans: a sample covers ``step`` from its
    time, and samples ``step`` apart (or closer) join one span."""
    out: list[list[float]] = []
    for t in sorted(seconds):
        if out and t <= out[-1][1] + 1e-6:
            out[-1][1] = t + step
        else:
            out.append([t, t + step])
    return out


def sample_step(seconds: list[float]) -> float:
    """The sampling period of a timeline's seconds (their median spacing; 1 s, the front end's, by default)."""
    gaps = [b - a for a, b in zip(seconds, seconds[1:]) if b > a]
    return statistics.median(gaps) if gaps else 1.0


def in_spans(t: float, spans_: list[list[float]]) -> bool:
    """Whether time ``t`` falls in one of ``spans_`` (:func:`spans`)."""
    return any(lo <= t < hi for lo, hi in spans_)


#: a run whose warm-phase decode rate falls below this share of the median run's was on a slower machine
SLOW_SHARE = 0.75


def machine_speed(out: Path, systems: list[str], reps: int, warm: tuple[float, float], runs: dict) -> dict:
    """How fast the machine was in each run, read where every system is alike: the client's decode
    rate over the warm phase's seconds ``warm`` (few requests on stock-like engines, no KV pressure,
    no group), each request's tokens per second (1 / TPOT) weighted by the seconds of ``warm`` it
    spent decoding (from its first token to its end, requests.csv), and the hypervisor's CPU steal
    over the whole run (``runs``: compare.json's per-system run summaries, their ``server.host``).
    A run whose rate is below ``SLOW_SHARE`` of the median run's is ``slow``: its latencies are the
    machine's that hour as much as the system's. Per system and repetition: ``rate``, ``of_median``,
    ``steal_cores`` (stolen CPU seconds per second of the run), ``slow``."""
    lo, hi = warm
    res: dict = {}
    for s, k, f in run_files(out, systems, reps, "requests.csv"):
        seconds = tokens = 0.0
        for r in read_csv(f):
            if r["ok"] != "1" or not r.get("tpot_s") or not float(r["tpot_s"]) > 0:
                continue
            t0 = float(r.get("send_s") or r["arrival_s"])
            overlap = min(hi, t0 + float(r["e2e_s"])) - max(lo, t0 + float(r["ttft_s"]))
            if overlap > 0:
                seconds += overlap
                tokens += overlap / float(r["tpot_s"])
        summaries = runs.get(s) or []
        host = ((summaries[k - 1].get("server") or {}).get("host") or {}) if k <= len(summaries) else {}
        res.setdefault(s, {})[k] = {
            "rate": round(tokens / seconds, 3) if seconds else None,
            "steal_cores": round(host["steal_s"] / host["seconds"], 3) if host.get("seconds") else None}
    rates = [x["rate"] for v in res.values() for x in v.values() if x["rate"]]
    median = statistics.median(rates) if rates else None
    for v in res.values():
        for x in v.values():
            x["of_median"] = round(x["rate"] / median, 3) if median and x["rate"] else None
            x["slow"] = x["of_median"] is not None and x["of_median"] < SLOW_SHARE
    return res


def scaling_table(rows: list[dict]) -> list[str]:
    """The decode step by batch (``benchmarks/batch_scaling.py``'s rows) as a markdown table."""
    return md_table(["batch", "step (ms)", "tokens/s"], "rrr", ([r["batch"], r["step_ms"], r["tokens_per_s"]] for r in rows))
