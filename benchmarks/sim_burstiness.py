"""Burstiness x memory demand at paper scale (simulated): where, if anywhere, KunServe's P99 TTFT is
12.7x lower than tuned vLLM's, and how often real 10-minute windows are there (issue 34, item 5).

Setup: Qwen-2.5-14B on 8 x H100 80 GB, step times from the
Vidur H100 profiles, the default ``least-work`` router, KunServe's default config. Arrival
processes (rows):

* ``gamma-cvC``: gamma inter-arrival gaps with coefficient of variation C (``--cvs``, seed
  ``--seed``) at the Azure row's mean rate, carrying its requests (lengths, in order);
* ``azure``: a ``--window-s`` window of the Azure LLM inference trace 2023 (conversation), its own
  timestamps and lengths;
* ``mooncake``: the Mooncake FAST'25 conversation trace's timestamps from the start of a window on,
  as many as the Azure row has requests, carrying those requests (the simulator models no prefix
  sharing between requests, which Mooncake's 12k-token prompts rely on, and one request set keeps
  the rows comparable; in the window analysis Mooncake's request i carries Azure's request i).

Columns: the infinite-memory oracle's mean KV demand over the arrival period (``--demands``), set
by compressing each row's window in time (``sim.scaling.fit_rate``;
cold start, every request measured). Per cell: stock vLLM, ``vllm-tuned`` (the cap of
``--caps`` plus stock's 1024 with the lowest P99 TTFT, picked per cell: ``sim.tuning.pick_vllm_cap``),
``kunserve``, and ``oracle-equal`` for each group size of ``--equal-groups`` (stock vLLM with the KV a
KunServe group of that size reaches).

Real windows: every ``--window-s`` window of each trace, every ``--window-step`` s, gets its
inter-arrival CV and its oracle mean KV demand at one rate factor per trace (the factor that puts
the window with the median request count at ``--window-target``, the paper-scale page's 60%); each
maps to the nearest cell (gamma row by log CV, demand column), and the doc reports the share that
lands where KunServe / tuned vLLM >= 12.7x.

    python -m benchmarks.sim_burstiness                    # the full sweep
    python -m benchmarks.sim_burstiness --quick            # 2 CVs x 2 demands (+ the trace rows), short windows

Writes ``--out`` (markdown), and beside it ``.json`` (raw) and ``.png`` (heat map); everything from a
``## Reading`` heading on in an existing markdown file is kept. Data: "Azure LLM inference trace
2023, Microsoft Azure, used in Splitwise (Patel et al., ISCA 2024)", CC BY 4.0; "Mooncake FAST'25
trace release, Moonshot AI and Tsinghua University (Qin et al., FAST 2025)", Apache-2.0; GPU
linear-op timings: Microsoft Vidur profiles, MIT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.common.stats import fmt_num
from vllm_kunserve.bench.report import command, md_row, md_table, pyplot, rel, save_figure, write_doc, write_json
from vllm_kunserve.bench.report import json_safe as clean  # noqa: F401  (JSON-safe: non-finite floats as None)
from vllm_kunserve.sim.scaling import guess_factor  # noqa: F401  (the rate fit's next factor, fit_cell's step)
from vllm_kunserve.workload.stats import ratio

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
DATA = ROOT.parent / "shared" / "data" / "traces"
AZURE = DATA / "azure_llm_2023_conv.csv"
MOONCAKE = DATA / "mooncake_fast25_conversation.jsonl"
STEP_MEASURED = ROOT / "docs" / "benchmarks" / "step_tokens_gpu_7b.json"
PAPER_X = 12.7
OFF_TARGET = 0.1  # a cell whose fitted mean demand misses its column by more than this (relative) is flagged
MAX_MODEL_LEN = 32768  # Qwen-2.5-14B's context
FULL = {"cvs": "1,2,4,8", "demands": "0.4,0.5,0.6,0.7,0.8,0.9", "caps": "128,256,384,512",
        "window_s": 600.0, "window_step": 60.0, "warmup_s": 300.0, "real": "azure,mooncake"}
QUICK = {"cvs": "1,8", "demands": "0.5,0.8", "caps": "128,256", "window_s": 300.0, "window_step": 900.0, "warmup_s": 300.0,
         "real": "azure,mooncake"}
REAL = ("azure", "mooncake")
STEP_TIMES = ("vidur", "measured")


# ------------------------------------------------------------------------------------ arguments
def _floats(text: str, what: str, lo: float, hi: float) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what} {text!r}: expected comma-separated numbers") from None
    if not vals:
        raise SystemExit(f"{what} {text!r}: at least one value")
    bad = [v for v in vals if not (lo < v <= hi) or not math.isfinite(v)]
    if bad:
        raise SystemExit(f"{what} {text!r}: every value must be in ({lo:g}, {hi:g}]; got {bad[0]:g}")
    if len(set(vals)) != len(vals):
        raise SystemExit(f"{what} {text!r}: repeated value")
    return sorted(vals)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: CVs 1,8, demands 0.5,0.8, 300-s windows, caps 128,256, windows every 900 s")
    ap.add_argument("--cvs", help=f"gamma inter-arrival CVs (default {FULL['cvs']})")
    ap.add_argument("--demands", help=f"oracle mean KV demand / capacity per column (default {FULL['demands']})")
    ap.add_argument("--caps", help=f"vllm-tuned batch caps tried per cell besides stock's (default {FULL['caps']})")
    ap.add_argument("--equal-groups", default="2,8",
                    help="oracle-equal group sizes (comma-separated; 2: a pair, 8: all 8 instances pooled)")
    ap.add_argument("--real", help="trace rows and window analysis: azure, mooncake, both (default) or none")
    ap.add_argument("--window-s", type=float, help="seconds of source trace per row and per analysed window "
                    "(default 600; quick 300)")
    ap.add_argument("--window-step", type=float, help="analysed windows start every this many s (default 60; "
                    "quick 900)")
    ap.add_argument("--warmup-s", type=float, help="source seconds replayed before every row and window, not "
                    "measured (default 300): the cluster's KV is in steady state when measurement starts")
    ap.add_argument("--window-target", type=float, default=0.6,
                    help="mean demand of the median window at each trace's common rate factor (default 0.6)")
    ap.add_argument("--azure-offset", type=float, default=None,
                    help="source second of the azure row's window (default: the analysed window with the "
                         "highest oracle KV peak-to-mean)")
    ap.add_argument("--mooncake-offset", type=float, default=None, help="likewise for the mooncake row")
    ap.add_argument("--step-time", default="vidur", choices=STEP_TIMES,
                    help="vidur (default): the simulator's H100 step time (Vidur linear ops + attention); measured: "
                         "its fixed and per-token parts rescaled to the H100 forward pass measured in "
                         "docs/benchmarks/step_tokens_gpu_7b.json (a sensitivity run)")
    ap.add_argument("--seed", type=int, default=0, help="gamma arrivals' seed")
    ap.add_argument("--azure", default=str(AZURE), help="Azure conversation CSV")
    ap.add_argument("--mooncake", default=str(MOONCAKE), help="Mooncake conversation JSON lines")
    ap.add_argument("--out", default=None,
                    help="markdown path (default docs/benchmarks/sim_burstiness.md; quick: "
                         "runs/sim_burstiness_quick/sim_burstiness.md)")
    a = ap.parse_args(argv)
    base = QUICK if a.quick else FULL
    pick = lambda v, k: base[k] if v is None else v  # noqa: E731
    a.cvs = _floats(pick(a.cvs, "cvs"), "--cvs", 0.0, 100.0)
    a.demands = _floats(pick(a.demands, "demands"), "--demands", 0.0, 4.0)
    caps = _floats(pick(a.caps, "caps"), "--caps", 0.0, 1e6)
    if any(c != int(c) for c in caps):
        raise SystemExit(f"--caps {a.caps!r}: whole numbers of sequences")
    a.caps = [int(c) for c in caps]
    groups = _floats(a.equal_groups, "--equal-groups", 0.0, 4096)
    if any(g != int(g) or g < 2 for g in groups):
        raise SystemExit(f"--equal-groups {a.equal_groups!r}: whole group sizes >= 2")
    a.equal_groups = [int(g) for g in groups]
    real = a.real if a.real is not None else base["real"]
    a.real = [] if real.strip().lower() == "none" else [r.strip().lower() for r in real.split(",") if r.strip()]
    if not a.real and real.strip().lower() != "none" or any(r not in REAL for r in a.real):
        raise SystemExit(f"--real {real!r}: comma-separated from {', '.join(REAL)}, or none")
    if len(set(a.real)) != len(a.real):
        raise SystemExit(f"--real {real!r}: repeated trace")
    a.window_s = base["window_s"] if a.window_s is None else a.window_s
    a.window_step = base["window_step"] if a.window_step is None else a.window_step
    a.warmup_s = base["warmup_s"] if a.warmup_s is None else a.warmup_s
    if not (a.warmup_s >= 0 and math.isfinite(a.warmup_s)):
        raise SystemExit(f"--warmup-s {a.warmup_s}: must be >= 0 seconds")
    for name in ("window_s", "window_step"):
        v = getattr(a, name)
        if not (v > 0 and math.isfinite(v)):
            raise SystemExit(f"--{name.replace('_', '-')} {v}: must be a positive number of seconds")
    if not 0 < a.window_target <= 4:
        raise SystemExit(f"--window-target {a.window_target}: must be in (0, 4]")
    for name in ("azure_offset", "mooncake_offset"):
        v = getattr(a, name)
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise SystemExit(f"--{name.replace('_', '-')} {v}: must be >= 0")
    if "azure" not in a.real and a.azure_offset is not None or "mooncake" not in a.real and a.mooncake_offset is not None:
        raise SystemExit("--azure-offset / --mooncake-offset: that trace is not among --real")
    for path, what in ((a.azure, "--azure"), (a.mooncake, "--mooncake")):
        if (what == "--azure" or "mooncake" in a.real) and not os.path.isfile(path):
            raise SystemExit(f"{what} {path}: no such file (the traces live in ../shared/data/traces)")
    if a.out is None:
        a.out = str(ROOT / ("runs/sim_burstiness_quick/sim_burstiness.md" if a.quick
                            else "docs/benchmarks/sim_burstiness.md"))
    return a


# ------------------------------------------------------------------------------------ traces
def load_sources(a):
    """(azure, mooncake or None) as simulator request lists; Mooncake's lengths are Azure's, in order."""
    from vllm_kunserve.workload import traces as T
    from vllm_kunserve.sim.trace import clip_lengths, from_trace

    az = T.load_csv(a.azure)
    azure = clip_lengths(from_trace(az), MAX_MODEL_LEN)
    mooncake, tick = None, None
    if "mooncake" in a.real:
        mc = T.load_mooncake(a.mooncake)
        idx = np.arange(len(mc)) % len(az)
        mc = mc.replace(prompt_len=az.prompt_len[idx], output_len=az.output_len[idx])
        mooncake, tick = clip_lengths(from_trace(mc), MAX_MODEL_LEN), mc.meta.get("timestamp_tick_s")
    return azure, mooncake, tick


def interarrival_cv(reqs) -> float:
    a = np.array([r.arrival_s for r in reqs])
    g = np.diff(a)
    return float(g.std() / g.mean()) if len(g) > 1 and g.mean() > 0 else 0.0


def spread_ticks(reqs, tick: float):
    """The requests stamped on one tick spread evenly over it (what a finer clock might have seen)."""
    from vllm_kunserve.sim.trace import TraceRequest

    out, i = [], 0
    while i < len(reqs):
        j = i
        while j < len(reqs) and reqs[j].arrival_s == reqs[i].arrival_s:
            j += 1
        k = j - i
        out += [TraceRequest(r.id, r.arrival_s + tick * n / k, r.prompt, r.output) for n, r in enumerate(reqs[i:j])]
        i = j
    return out


def windows_of(reqs, window_s: float, step_s: float, warmup_s: float, min_requests: int = 50):
    """``(offset, requests, boundary)`` of every window ``[offset, offset + window_s)`` starting every
    ``step_s`` from ``warmup_s`` on: the requests of ``[offset - warmup_s, offset + window_s)``
    rebased, the measured ones from ``boundary`` (= ``warmup_s``) on."""
    from vllm_kunserve.sim.trace import window

    out, off, end = [], warmup_s, reqs[-1].arrival_s
    while off + window_s <= end + 1e-9:
        n = sum(1 for r in reqs if off <= r.arrival_s < off + window_s)
        if n >= min_requests:
            out.append((off, window(reqs, off - warmup_s, warmup_s + window_s), warmup_s))
        off += step_s
    return out


def measured(reqs, boundary: float):
    return [r for r in reqs if r.arrival_s >= boundary]


def span_of(reqs, boundary: float):
    """The measured period of ``reqs`` compressed by ``f``: first measured arrival to the last."""
    last = reqs[-1].arrival_s
    return lambda f: (boundary / f, last / f)


def analyse_windows(cfg, name: str, reqs, a, tick: float | None) -> dict:
    """Each window's CV and oracle KV demand at the trace's common rate factor."""
    from vllm_kunserve.sim.scaling import oracle_demand_share
    from vllm_kunserve.sim.trace import compress_time

    wins = windows_of(reqs, a.window_s, a.window_step, a.warmup_s)
    if not wins:
        raise SystemExit(f"{name}: no {a.window_s:g}-s window with >= 50 requests after a {a.warmup_s:g}-s warm-up")
    order = sorted(range(len(wins)), key=lambda i: len(measured(wins[i][1], wins[i][2])))
    ref_off, ref, ref_b = wins[order[len(order) // 2]]
    t0 = time.perf_counter()
    _, info = fit_cell(cfg, {"reqs": ref, "boundary": ref_b}, a.window_target, [], 12.0)
    factor = info["scale"]
    rows = []
    for off, w, b in wins:
        mean, peak = oracle_demand_share(cfg, compress_time(w, factor), span=span_of(w, b)(factor))
        m = measured(w, b)
        row = {"offset_s": off, "requests": len(m), "cv": interarrival_cv(m), "mean_share": mean,
               "peak_share": peak, "peak_to_mean": peak / mean if mean > 0 else 0.0,
               "non_overlapping": abs(off / a.window_s - round(off / a.window_s)) < 1e-9}
        if tick:
            row["cv_spread"] = interarrival_cv(spread_ticks(m, tick))
        rows.append(row)
    print(f"{name}: {len(rows)} windows of {a.window_s:g} s at rate x{factor:.2f} (reference {ref_off:g}:{a.window_s:g}, "
          f"mean {info['mean_share']:.0%}) in {time.perf_counter() - t0:.0f} s", flush=True)
    return {"trace": name, "factor": factor, "reference_offset_s": ref_off, "reference_mean_share": info["mean_share"],
            "fit_tries": info["tries"], "timestamp_tick_s": tick, "windows": rows}


def row_traces(a, azure, mooncake, analysis: dict) -> list[dict]:
    """Every row's requests on the source time scale: a warm-up of the Azure row's ``warmup_s``
    preceding seconds' requests, then its ``window_s`` window's, under each row's arrival times;
    ``boundary``: the source time measurement starts."""
    from vllm_kunserve.workload.traces import gamma_arrivals
    from vllm_kunserve.sim.trace import TraceRequest, window

    def pick(name: str, override: float | None) -> float:
        if override is not None:
            return override
        ws = analysis[name]["windows"]
        return max(ws, key=lambda w: w["peak_to_mean"])["offset_s"]

    W = a.warmup_s
    az_off = pick("azure", a.azure_offset) if "azure" in a.real else None
    if az_off is None:  # no trace rows: the requests of the Azure trace's burstiest 600-s window
        az_off = 1140.0
    if az_off < W or az_off + a.window_s > azure[-1].arrival_s:
        raise SystemExit(f"azure window {az_off:g}:{a.window_s:g} with a {W:g}-s warm-up lies outside the trace "
                         f"(0-{azure[-1].arrival_s:.0f} s)")
    src = window(azure, az_off - W, W + a.window_s)
    n_warm = sum(1 for r in src if r.arrival_s < W)
    n = len(src) - n_warm
    rows = []
    for cv in a.cvs:
        t = gamma_arrivals(len(src), len(src) / (W + a.window_s), cv, seed=a.seed)
        rows.append({"row": f"gamma-cv{cv:g}", "kind": "gamma", "cv_target": cv, "boundary": float(t[n_warm]),
                     "reqs": [TraceRequest(i, float(x), r.prompt, r.output) for i, (x, r) in enumerate(zip(t, src))],
                     "source": f"gamma CV {cv:g} (seed {a.seed}) at the Azure row's mean rate"})
    if "azure" in a.real:
        rows.append({"row": "azure", "kind": "trace", "offset_s": az_off, "reqs": src, "boundary": W,
                     "source": f"Azure conversation {az_off:g}:{a.window_s:g}"})
    if "mooncake" in a.real:
        # Mooncake's own warm-up seconds, then as many arrivals as the Azure row measures (its rate is
        # about half Azure's), carrying the Azure row's requests in order
        off = pick("mooncake", a.mooncake_offset)
        warm = [r.arrival_s for r in mooncake if off - W <= r.arrival_s < off]
        meas = [r.arrival_s for r in mooncake if r.arrival_s >= off][:n]
        if off < W or len(meas) < n:
            raise SystemExit(f"mooncake: {len(meas)} requests from {off:g} s on (the rows need {n}) or no "
                             f"{W:g}-s warm-up before it")
        lengths = ([src[i % n_warm] for i in range(n_warm - len(warm), n_warm)] if n_warm else src[:len(warm)]) + src[n_warm:]
        ts = warm + meas
        rows.append({"row": "mooncake", "kind": "trace", "offset_s": off, "boundary": W,
                     "reqs": [TraceRequest(i, t - (off - W), r.prompt, r.output) for i, (t, r) in enumerate(zip(ts, lengths))],
                     "source": f"Mooncake conversation timestamps from {off:g} s on ({meas[-1] - off:.0f} s to {n} arrivals)"})
    for r in rows:
        m = measured(r["reqs"], r["boundary"])
        r.update(requests=len(m), warmup_requests=len(r["reqs"]) - len(m), cv=interarrival_cv(m),
                 measured_source_s=r["reqs"][-1].arrival_s - r["boundary"])
    return rows


# ------------------------------------------------------------------------------------ cells
def brief(summary: dict, res: dict | None = None) -> dict:
    out = {"p50_ttft_s": summary["ttft_s"].get("p50"), "p99_ttft_s": summary["ttft_s"].get("p99"),
           "p50_tpot_s": summary["tpot_s"].get("p50"), "p99_tpot_s": summary["tpot_s"].get("p99"),
           "completed": summary["completed"], "requests": summary["requests"], "failed": summary["failed"],
           "preemptions": summary["preemptions"], "kv_blocks_per_instance": summary["kv_blocks_per_instance"]}
    if res is not None:
        out["wall_s"] = round(res["wall_s"], 2)
    return out


def run_cell(cfg, trace, a, warm: float) -> dict:
    """Every system on one scaled trace; metrics over the requests arriving from ``warm`` on."""
    from vllm_kunserve.sim.policies import build_policy
    from vllm_kunserve.sim.runner import simulate
    from vllm_kunserve.sim.tuning import p99_ttft, pick_vllm_cap

    out: dict = {"systems": {}}
    t0 = time.perf_counter()
    tuned = pick_vllm_cap(cfg, trace, [*a.caps, cfg.max_seqs], warmup_s=warm)
    out["cap_sweep_p99_s"] = {str(c): v for c, v in tuned["p99_ttft_s"].items()}
    out["tuned_cap"] = tuned["cap"]
    out["systems"]["vllm"] = brief(tuned["summaries"][cfg.max_seqs])   # cap = the config's = stock vLLM
    out["systems"]["vllm-tuned"] = {**brief(tuned["summaries"][tuned["cap"]]), "max_seqs": tuned["cap"]}
    out["cap_sweep_wall_s"] = round(time.perf_counter() - t0, 2)
    res = simulate(cfg, build_policy("kunserve"), trace, keep_requests=False, warmup_s=warm)
    sim = res.pop("_sim")
    k = brief(res["summary"], res)
    k.update(drops=res["summary"]["drops"], restores=res["summary"]["restores"],
             max_group=max((p["max_group"] for p in sim.timeline), default=1),
             pipeline_bubble_time=res["summary"]["pipeline_bubble_time"])
    out["systems"]["kunserve"] = k
    for g in a.equal_groups:
        pol = build_policy(f"oracle-equal-g{g}")
        res = simulate(cfg, pol, trace, keep_requests=False, warmup_s=warm)
        res.pop("_sim")
        out["systems"][f"oracle-equal-g{g}"] = {**brief(res["summary"], res), "kv_factor": pol.kv_factor(cfg)}
    p99 = {n: p99_ttft(_as_summary(s)) for n, s in out["systems"].items()}
    out["p99_ttft_s"] = p99
    ks = p99["kunserve"]
    out["ratio_tuned_over_kunserve"] = ratio(p99["vllm-tuned"], ks)
    out["ratio_stock_over_kunserve"] = ratio(p99["vllm"], ks)
    for g in a.equal_groups:
        out[f"ratio_tuned_over_oracle_equal_g{g}"] = ratio(p99["vllm-tuned"], p99[f"oracle-equal-g{g}"])
    return out


def _as_summary(b: dict) -> dict:
    return {"completed": b["completed"], "requests": b["requests"], "ttft_s": {"p99": b["p99_ttft_s"]}}


def fit_cell(cfg, row: dict, target: float, points: list, default: float, tol: float = 0.05, max_iter: int = 8):
    """The row's trace compressed until the oracle's mean KV demand over its measured period is
    ``target`` (``sim.scaling.fit_rate``, stepping with ``guess_factor`` over every point of the row so
    far: ``points``, extended)."""
    from vllm_kunserve.sim.scaling import fit_rate
    from vllm_kunserve.sim.trace import compress_time

    return fit_rate(cfg, lambda f: compress_time(row["reqs"], f), target, tol, max_iter,
                    span=span_of(row["reqs"], row["boundary"]), start=default, points=points)


def sweep(cfg, rows: list[dict], a, ref_factor: float) -> list[dict]:
    cells = []
    for row in rows:
        points: list[tuple[float, float]] = []
        for d in a.demands:
            t0, c0 = time.perf_counter(), time.process_time()
            trace, info = fit_cell(cfg, row, d, points, ref_factor * math.sqrt(d / a.window_target))
            warm = row["boundary"] / info["scale"]
            fit_wall = time.perf_counter() - t0
            cell = {"row": row["row"], "demand": d, "factor": info["scale"], "mean_share": info["mean_share"],
                    "on_target": abs(info["mean_share"] / d - 1) <= OFF_TARGET,
                    "peak_share": info["peak_share"], "fit_tries": info["tries"], "fit_wall_s": round(fit_wall, 2),
                    "requests": row["requests"], "warmup_s": warm, "measured_s": trace[-1].arrival_s - warm,
                    **run_cell(cfg, trace, a, warm)}
            cell["wall_s"] = round(time.perf_counter() - t0, 2)
            cell["cpu_s"] = round(time.process_time() - c0, 2)
            cells.append(cell)
            r = cell["ratio_tuned_over_kunserve"]
            print(f"{row['row']:>12} demand {d:.0%}: mean {info['mean_share']:.0%} peak {info['peak_share']:.0%} "
                  f"x{info['scale']:.2f} | P99 TTFT s: vllm {fmt_num(cell['p99_ttft_s']['vllm'])}, tuned "
                  f"(cap {cell['tuned_cap']}) {fmt_num(cell['p99_ttft_s']['vllm-tuned'])}, kunserve "
                  f"{fmt_num(cell['p99_ttft_s']['kunserve'])}, "
                  + ", ".join(f"eq-g{g} {fmt_num(cell['p99_ttft_s'][f'oracle-equal-g{g}'])}" for g in a.equal_groups)
                  + f" | tuned/kunserve {fmt_num(r, suffix='x')} | {cell['wall_s']:.0f} s wall, {cell['cpu_s']:.0f} s CPU", flush=True)
    return cells


# ------------------------------------------------------------------------------------ windows -> cells
def nearest_cell(cells: list[dict], cvs: list[float], demands: list[float], cv: float, demand: float) -> dict:
    row_cv = min(cvs, key=lambda c: (abs(math.log(max(cv, 1e-9)) - math.log(c)), c))
    col = min(demands, key=lambda d: (abs(d - demand), d))
    return next(c for c in cells if c["row"] == f"gamma-cv{row_cv:g}" and c["demand"] == col)


def window_shares(cells, a, analysis: dict) -> dict:
    out = {}
    lo, hi = min(a.demands), max(a.demands)
    for name, an in analysis.items():
        for cv_key in ("cv", "cv_spread"):
            ws = [w for w in an["windows"] if cv_key in w]
            if not ws:
                continue
            for subset in ("all", "non_overlapping"):
                sel = ws if subset == "all" else [w for w in ws if w["non_overlapping"]]
                if not sel:
                    continue
                hits, mapped = 0, []
                for w in sel:
                    c = nearest_cell(cells, a.cvs, a.demands, w[cv_key], w["mean_share"])
                    r = c["ratio_tuned_over_kunserve"]
                    hits += r is not None and r >= PAPER_X
                    mapped.append((c["row"], c["demand"]))
                rows = sorted({m[0] for m in mapped})
                out[f"{name}/{cv_key}/{subset}"] = {
                    "trace": name, "cv": cv_key, "subset": subset, "windows": len(sel), "at_or_above": hits,
                    "share": hits / len(sel),
                    "outside_demand_range": sum(1 for w in sel if not lo - 0.05 <= w["mean_share"] <= hi + 0.05),
                    "rows": {r: sum(1 for m in mapped if m[0] == r) for r in rows},
                    "cv_range": [min(w[cv_key] for w in sel), max(w[cv_key] for w in sel)],
                    "demand_range": [min(w["mean_share"] for w in sel), max(w["mean_share"] for w in sel)]}
    return out


# ------------------------------------------------------------------------------------ step time
def step_check(gpu) -> dict | None:
    """The simulator's H100 step time for Llama-2-7B (one sequence, no prefix) beside the forward pass
    of a random-weight 7b Llama measured on an H100 (docs/benchmarks/step_tokens_gpu_7b.json), and
    the two factors that fit it: measured - per_seq ~ fixed_x * (layers * gamma + fixed) +
    token_x * (the rest), least squares over the measured token counts."""
    if not STEP_MEASURED.is_file():
        return None
    from vllm_kunserve.workload.models import load_model_spec
    from vllm_kunserve.sim.steptime import GpuStepTime

    meas = json.loads(STEP_MEASURED.read_text())
    st = GpuStepTime(load_model_spec("llama2-7b"), gpu)
    fixed = st.model.layers * st.gamma_layer + st.fixed
    rows, A, y = [], [], []
    for r in meas["rows"]:
        sim = st.batch_time([(0, r["tokens"])])
        rows.append({"tokens": r["tokens"], "measured_ms": r["ms"], "simulated_ms": round(sim * 1e3, 3)})
        A.append([fixed, sim - fixed - st.per_seq])
        y.append(r["ms"] * 1e-3 - st.per_seq)
    (fx, tx), *_ = np.linalg.lstsq(np.array(A), np.array(y), rcond=None)
    return {"device": meas.get("device"), "source": st.describe()["source"], "rows": rows,
            "fixed_x": float(fx), "token_x": float(tx),
            "weight_read_floor_ms": st.model.param_bytes / gpu.hbm_bw * 1e3, "hbm_tb_s": gpu.hbm_bw / 1e12}


def measured_step_time(cfg, check: dict):
    """``cfg`` with its GPU step time's fixed part x ``fixed_x`` and per-token linear part x ``token_x``."""
    import copy
    import dataclasses

    st = copy.copy(cfg.step_time)
    st.gamma_layer *= check["fixed_x"]
    st.fixed *= check["fixed_x"]
    st.beta_layer *= check["token_x"]
    st.source = f"{st.source}, fixed x{check['fixed_x']:.2f}, per token x{check['token_x']:.2f} (measured 7b H100)"
    return dataclasses.replace(cfg, step_time=st)


# ------------------------------------------------------------------------------------ outputs
def plot(path: Path, cells: list[dict], rows: list[dict], demands: list[float], groups: list[int]) -> None:
    plt = pyplot()
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    names = [r["row"] for r in rows]
    g = max(groups) if groups else None
    panels = [("ratio_tuned_over_kunserve", "tuned vLLM P99 TTFT / KunServe's")]
    if g:
        panels.append((f"ratio_tuned_over_oracle_equal_g{g}", f"tuned vLLM P99 TTFT / oracle-equal (group of {g})'s"))
    off = {(c["row"], c["demand"]) for c in cells if not c.get("on_target", True)}
    grids = []
    for key, _ in panels:
        m = np.full((len(names), len(demands)), np.nan)
        for c in cells:
            v = c.get(key)
            if v is not None:
                m[names.index(c["row"]), demands.index(c["demand"])] = v
        grids.append(m)
    vals = np.concatenate([m[np.isfinite(m)] for m in grids]) if grids else np.array([1.0])
    vals = vals[vals > 0] if len(vals) else np.array([1.0])
    norm = LogNorm(vmin=min(0.5, float(vals.min()) if len(vals) else 0.5),
                   vmax=max(PAPER_X * 2, float(vals.max()) if len(vals) else 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 1.2, 0.55 * len(names) + 2.2),
                             squeeze=False, constrained_layout=True)
    for ax, (key, title), m in zip(axes[0], panels, grids):
        im = ax.imshow(np.where(np.isfinite(m), m, np.nan), cmap="viridis", norm=norm, aspect="auto")
        ax.set_xticks(range(len(demands)), [f"{d:.0%}" for d in demands])
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("oracle mean KV demand / capacity")
        ax.set_title(title, fontsize=10)
        for i in range(len(names)):
            for j in range(len(demands)):
                v = m[i, j]
                txt = "-" if not np.isfinite(v) else f"{v:.1f}x" if v < 10 else f"{v:.0f}x"
                txt += "*" if (names[i], demands[j]) in off else ""
                ax.text(j, i, txt, ha="center", va="center", fontsize=8,
                        color="black" if np.isfinite(v) and norm(v) > 0.6 else "white")
                if np.isfinite(v) and v >= PAPER_X:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
    cb = fig.colorbar(im, ax=axes[0].tolist(), shrink=0.9)
    cb.ax.axhline(PAPER_X, color="red", linewidth=2)
    cb.set_label(f"P99 TTFT ratio (log); red: the paper's {PAPER_X}x")
    fig.suptitle("Qwen-2.5-14B, 8 x H100 (simulated): how many times lower P99 TTFT"
                 + (f"  (*: demand off its column by > {OFF_TARGET:.0%})" if off else ""), fontsize=11)
    save_figure(fig, path, dpi=120, tight=False)   # laid out by constrained_layout


def render(a, cfg, meta: dict, rows: list[dict], cells: list[dict], analysis: dict, shares: dict,
           check: dict | None, png: Path, raw: Path, timing: dict) -> list[str]:
    from vllm_kunserve.sim.policies.baselines import group_kv_factor, weight_share

    w = weight_share(cfg)
    names = [r["row"] for r in rows]
    by = {(c["row"], c["demand"]): c for c in cells}
    L = ["# Burstiness x memory demand at paper scale (simulated)", "",
         f"Command: `{meta['command']}`", "",
         f"Raw data: `{rel(raw)}`. Heat map: [{png.name}]({png.name}).", "",
         "## Setup", "",
         f"Qwen-2.5-14B (bf16, {cfg.model.param_bytes / 1e9:.1f} GB weights, {meta['droppable_gb']:.1f} GB of "
         f"them in decoder layers) on 8 x H100 80 GB (gpu_memory_utilization 0.9, "
         f"{cfg.base_kv_blocks() * cfg.block_size:,} KV tokens = {meta['kv_gb']:.1f} GB per instance), step times "
         f"from Microsoft Vidur's H100 profiles (`{cfg.step_time.describe()['source']}`), the simulator's NVLink "
         "link (Vidur's fit), the default `least-work` router, KunServe's default config "
         f"(groups of up to {meta['max_group_size']} instances). Every cell is one row's trace compressed in time "
         "(`compress_time`) until the infinite-memory oracle's mean KV demand over "
         "the measured period is the column's share of capacity (within 5%; the factor is searched with oracle "
         "runs as `sim.scaling.fit_rate` does, stepping by log-log interpolation over the row's earlier tries). "
         f"Unlike a cold start (every request measured) each trace starts with a "
         f"{a.warmup_s:g}-s warm-up (source seconds; the requests before the window, under the row's arrival "
         "process) that is served but not measured, so the KV is in steady state when measurement starts and "
         "the mean demand is not diluted by the cluster filling up. Compression keeps the inter-arrival CV but "
         "shortens a real trace's minute-scale bursts against request lifetimes (the gamma rows have no time "
         "scale of their own, so for them compressing is only setting the rate); upscaling the arrivals over "
         "the source time instead (`workload.traces.upscale`, `sim.workload`) keeps bursts but costs about the "
         "rate factor (12-50x) more requests per run, beyond this sweep's time budget.", "",
         "Systems per cell:", "",
         "* `vllm`: stock vLLM (max_num_seqs 1024, recompute preemption);",
         f"* `vllm-tuned`: stock vLLM with the batch cap (max_num_seqs per instance) of {{{', '.join(map(str, a.caps))}, "
         "1024} that gives the lowest P99 TTFT **in that cell** (`sim.tuning.pick_vllm_cap`: the sweep a user "
         "would run on their own load; ties go to the larger cap; a smaller cap also frees the sampler's "
         "logits reserve, about 0.6 GB of KV more per instance at cap 32);",
         "* `kunserve`: the KunServe policy (drop, pipeline groups, lookahead microbatches, KV exchange, restore);",
         "* `oracle-equal-gN`: stock vLLM whose KV per instance is that of a KunServe group of N holding one copy "
         f"of the decoder layers: 1 + (N - 1) w / (N (1 - w)) with w = {w:.3f} (decoder-layer weights / (those "
         "+ KV) of one instance, the memory a drop frees in the simulator; the embedding and LM head stay on "
         "every member): " + ", ".join(f"N = {g}: {group_kv_factor(w, g):.3f}x" for g in a.equal_groups)
         + ". `build_policy(\"oracle-equal\")` uses N = 2 (a pair, the group KunServe forms first and the "
         "`oracle-equal` of `benchmarks/burst_value.py` on real engines); N = 8 is every instance pooled, the "
         "most KV KunServe can reach here (`drop.max_group_size` 8 = the cluster). The table gives the largest "
         "group KunServe formed per cell.", "",
         f"Rows (arrival processes; measured requests after {a.warmup_s:g} s of warm-up, and their inter-arrival "
         "CV):", ""]
    for r in rows:
        L.append(f"* `{r['row']}`: {r['source']}; {r['requests']} measured requests over "
                 f"{r['measured_source_s']:.0f} source seconds (+{r['warmup_requests']} in the warm-up), "
                 f"inter-arrival CV {r['cv']:.2f}.")
    L += ["", "Requests: every row carries exactly the Azure row's window of requests (lengths, in order), so "
          "rows differ only by their arrival times; the Mooncake row takes as many consecutive Mooncake arrivals "
          "(about twice the window: Mooncake's rate is about half Azure's). In the window analysis Mooncake's "
          "request i carries the Azure trace's request i. The Mooncake trace's own prompts (12k tokens on average, sharing 512-token "
          "prefix blocks across turns) would need prefix caching across requests, which the simulator does "
          "not model. **The Azure code trace is not available** in ../shared/data (only the conversation "
          "trace is shipped), so it has no row.", ""]
    if any(an.get("timestamp_tick_s") for an in analysis.values()):
        tick = next(an["timestamp_tick_s"] for an in analysis.values() if an.get("timestamp_tick_s"))
        L += [f"Mooncake's timestamps are quantized to a {tick:g}-s tick (about 10 requests share each stamp), so "
              "its raw inter-arrival CV (about 3) measures that clock, not user burstiness: spread evenly over "
              "each tick its CV is shown as `cv_spread` below.", ""]
    # ratio grid
    L += [f"## KunServe's P99 TTFT ratio to tuned vLLM (x lower; >= {PAPER_X}x in bold)", "",
          f"![heat map]({png.name})", ""] + md_table(["row", *(f"{d:.0%}" for d in a.demands)], "l" * (1 + len(a.demands)))
    for n in names:
        cellv = []
        for d in a.demands:
            r = by[(n, d)]["ratio_tuned_over_kunserve"]
            mark = "" if by[(n, d)]["on_target"] else "*"
            cellv.append("-" if r is None else (f"**{r:.2f}x**{mark}" if r >= PAPER_X else f"{r:.2f}x{mark}"))
        L.append(md_row([n, *cellv]))
    offs = [c for c in cells if not c["on_target"]]
    if offs:
        L += ["", f"\\* the rate fit missed the column by more than {OFF_TARGET:.0%} (the trace's requests cannot "
              "be packed to that mean demand over its arrival period): "
              + ", ".join(f"{c['row']} at {c['demand']:.0%} reached {c['mean_share']:.0%}" for c in offs) + "."]
    hits = [c for c in cells if (c["ratio_tuned_over_kunserve"] or 0) >= PAPER_X]
    best = max((c for c in cells if c["ratio_tuned_over_kunserve"] is not None),
               key=lambda c: c["ratio_tuned_over_kunserve"], default=None)
    L.append("")
    if hits:
        L.append(f"**KunServe reaches the paper's {PAPER_X}x in {len(hits)} of {len(cells)} cells:** "
                 + ", ".join(f"{c['row']} at {c['demand']:.0%} ({c['ratio_tuned_over_kunserve']:.1f}x)" for c in hits) + ".")
    else:
        L.append(f"**KunServe reaches the paper's {PAPER_X}x in none of the {len(cells)} cells**"
                 + (f"; the largest ratio is {best['ratio_tuned_over_kunserve']:.2f}x ({best['row']} at "
                    f"{best['demand']:.0%})." if best else "."))
    g = max(a.equal_groups) if a.equal_groups else None
    if g:
        eq = [c.get(f"ratio_tuned_over_oracle_equal_g{g}") for c in cells]
        eq = [x for x in eq if x is not None]
        if eq:
            L.append(f"The memory bound (tuned vLLM / oracle-equal with a group of {g}'s KV, no pipeline cost) spans "
                     f"{min(eq):.2f}-{max(eq):.2f}x over the grid.")
    ks = []
    for n in names:
        top = [by[(n, d)] for d in a.demands[-2:]]
        if len(top) == 2 and top[0]["factor"] != top[1]["factor"] and min(t["mean_share"] for t in top) > 0:
            ks.append((n, math.log(top[1]["mean_share"] / top[0]["mean_share"])
                       / math.log(top[1]["factor"] / top[0]["factor"])))
    L += ["", "## Per cell", "",
          "P99 TTFT in seconds; rate x: the compression factor; cap: the tuned batch cap; mean / peak: the oracle's "
          "KV demand; group: KunServe's largest group; preempt: vLLM's / tuned's / KunServe's preemptions."
          + (" Between the two highest columns the oracle's mean demand grows as rate^k, k = "
             + ", ".join(f"{k:.1f} ({n})" for n, k in ks) + ": k > 1 where the oracle's own steps slow as the "
             "rate nears the cluster's compute capacity and request lifetimes grow, so the top columns load "
             "compute as well as memory." if ks else ""), ""]
    cols = ["row", "demand", "mean / peak", "rate x", "requests", "vllm", "tuned (cap)", "kunserve",
            *(f"eq-g{gg}" for gg in a.equal_groups), "tuned / kunserve", "stock / kunserve", "group", "preempt", "wall s"]
    L += md_table(cols, "l" * len(cols))
    for c in cells:
        p = c["p99_ttft_s"]
        s = c["systems"]
        L.append(f"| {c['row']} | {c['demand']:.0%} | {c['mean_share']:.0%} / {c['peak_share']:.0%} | "
                 f"{c['factor']:.2f} | {c['requests']} | {fmt_num(p['vllm'])} | {fmt_num(p['vllm-tuned'])} ({c['tuned_cap']}) | "
                 f"{fmt_num(p['kunserve'])} | " + " | ".join(fmt_num(p[f'oracle-equal-g{gg}']) for gg in a.equal_groups)
                 + f" | {fmt_num(c['ratio_tuned_over_kunserve'], suffix='x')} | {fmt_num(c['ratio_stock_over_kunserve'], suffix='x')} | "
                 f"{s['kunserve']['max_group']} | {s['vllm']['preemptions']} / {s['vllm-tuned']['preemptions']} / "
                 f"{s['kunserve']['preemptions']} | {c['wall_s']:.0f} |")
    # windows
    if analysis:
        L += ["", f"## Real {a.window_s:g}-s windows", "",
              f"Every {a.window_s:g}-s window of each trace starting every {a.window_step:g} s (overlapping unless "
              f"the step is the window; `non_overlapping`: those starting at multiples of {a.window_s:g} s), with "
              "its inter-arrival CV and the oracle's mean KV demand at one rate factor per trace: the factor that "
              f"puts the window with the median request count at {a.window_target:.0%} mean demand (the "
              "paper-scale page's <= 60% condition). Each window maps to the nearest cell: the gamma row with the "
              "nearest log CV and the nearest demand column (demands outside the swept range go to the edge "
              "column and are counted). The inter-arrival CV is only one summary of burstiness: a gamma process "
              "with CV c has c^2 x Poisson's count variance at every time scale, a real trace's CV mixes "
              "clock ticks, diurnal drift and bursts.", ""]
        for name, an in analysis.items():
            ws = an["windows"]
            L.append(f"* {name}: {len(ws)} windows at rate x{an['factor']:.2f} (reference "
                     f"{an['reference_offset_s']:g}:{a.window_s:g}); CV {min(w['cv'] for w in ws):.2f}-"
                     f"{max(w['cv'] for w in ws):.2f}"
                     + (f" (spread over ticks {min(w['cv_spread'] for w in ws):.2f}-{max(w['cv_spread'] for w in ws):.2f})"
                        if "cv_spread" in ws[0] else "")
                     + f"; mean demand {min(w['mean_share'] for w in ws):.0%}-{max(w['mean_share'] for w in ws):.0%}, "
                     f"peak {min(w['peak_share'] for w in ws):.0%}-{max(w['peak_share'] for w in ws):.0%}.")
        L += [""] + md_table(["trace", "CV", "windows", "nearest rows", "outside demand range",
                              f"share in cells >= {PAPER_X}x"], "llllll")
        for v in shares.values():
            L.append(f"| {v['trace']} ({v['subset'].replace('_', '-')}) | {v['cv'].replace('_', ' ')} "
                     f"{v['cv_range'][0]:.2f}-{v['cv_range'][1]:.2f} | {v['windows']} | "
                     + ", ".join(f"{r} {n}" for r, n in v["rows"].items()) + f" | {v['outside_demand_range']} | "
                     f"**{v['share']:.0%}** ({v['at_or_above']}/{v['windows']}) |")
    if check:
        L += ["", "## Step time check (H100)", "",
              f"The simulator's GPU step time for Llama-2-7B (`{check['source']}`) against the forward pass of a "
              f"random-weight 7b Llama measured on an {check['device']} (`docs/benchmarks/step_tokens_gpu_7b.md`: "
              "one sequence, no KV prefix, CUDA graphs). Where it applies: the fixed weight-read cost of small "
              "steps and the token-linear cost of prefill chunks; it has no KV prefix, so decode attention is "
              "not checked.", ""]
        L += md_table(["tokens per step", "measured ms", "simulated ms", "simulated / measured"], "rrrr",
                      ([r["tokens"], f"{r['measured_ms']:.2f}", f"{r['simulated_ms']:.2f}",
                        f"{r['simulated_ms'] / r['measured_ms']:.2f}"] for r in check["rows"]))
        one, floor = min(check["rows"], key=lambda r: r["tokens"]), check["weight_read_floor_ms"]
        L += ["", f"Least squares over these rows: measured = {check['fixed_x']:.2f} x the simulator's fixed "
              f"(weight-read) part + {check['token_x']:.2f} x its per-token part. Reading the 7B weights once at the "
              f"H100's datasheet HBM bandwidth ({check['hbm_tb_s']:.2f} TB/s) takes {check['weight_read_floor_ms']:.2f} "
              f"ms; the simulated one-token step ({one['simulated_ms']:.2f} ms) is {one['simulated_ms'] / floor:.2f}x "
              f"that, the measured pass ({one['measured_ms']:.2f} ms; plain torch + transformers, no vLLM kernels, "
              f"norms and rotary as separate kernels) {one['measured_ms'] / floor:.2f}x. vLLM's own step is likely "
              "between the two. "
              + ("This run uses those factors on Qwen-2.5-14B's step time (`--step-time measured`)."
                 if a.step_time == "measured" else
                 "This run uses the Vidur step time; `--step-time measured` reruns the sweep with the fixed and "
                 "per-token parts scaled by those factors (a sensitivity run; every system slows down, and "
                 "a slower step makes compute, not memory, the bottleneck at a lower demand).")]
    L += ["", "## Run time", "",
          f"{len(cells)} cells in {timing['sweep_wall_s']:.0f} s wall ({timing['sweep_cpu_s']:.0f} s CPU), "
          f"{timing['sweep_wall_s'] / max(len(cells), 1):.1f} s wall per cell on average (max "
          f"{max((c['wall_s'] for c in cells), default=0):.0f} s); window analysis {timing['windows_wall_s']:.0f} s; "
          f"total {timing['total_wall_s']:.0f} s. Each cell: {len(a.caps) + 1} vLLM runs for the cap sweep, KunServe, "
          f"{len(a.equal_groups)} oracle-equal runs and the oracle runs of the rate fit.", "",
          "The KunServe paper reports 12.7-72.2x lower P99 TTFT than vLLM, Llumnix and InferCept.", "",
          "## Attribution", "",
          "Azure LLM inference trace 2023, Microsoft Azure, used in Splitwise (Patel et al., ISCA 2024), CC BY 4.0. "
          "Mooncake FAST'25 trace release, Moonshot AI and Tsinghua University (Qin et al., FAST 2025), Apache-2.0 "
          "(timestamps only). GPU linear-op timings and the NVLink fit: Microsoft Vidur profiles, MIT.", ""]
    return L


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    from vllm_kunserve.config import KunServeConfig
    from vllm_kunserve.sim.policies.baselines import droppable_weight_bytes
    from vllm_kunserve.sim.runner import build_config, config_summary

    cfg = build_config("qwen2.5-14b", "h100", instances=8, gpu_mem_gb=80)
    check = step_check(cfg.gpu)
    if a.step_time == "measured":
        if check is None:
            raise SystemExit(f"--step-time measured: {STEP_MEASURED} is missing")
        cfg = measured_step_time(cfg, check)
    print(f"step time: {cfg.step_time.describe()['source']}; Qwen-2.5-14B decode of 1 at 1k context "
          f"{cfg.step_time.batch_time([(1024, 1)]) * 1e3:.1f} ms, 2048-token prefill "
          f"{cfg.step_time.batch_time([(0, 2048)]) * 1e3:.0f} ms", flush=True)
    azure, mooncake, tick = load_sources(a)
    analysis = {}
    t0 = time.perf_counter()
    if "azure" in a.real:
        analysis["azure"] = analyse_windows(cfg, "azure", azure, a, None)
    if "mooncake" in a.real:
        analysis["mooncake"] = analyse_windows(cfg, "mooncake", mooncake, a, tick)
    windows_wall = time.perf_counter() - t0
    rows = row_traces(a, azure, mooncake, analysis)
    ref_factor = analysis["azure"]["factor"] if "azure" in analysis else 12.0
    t1, c1 = time.perf_counter(), time.process_time()
    cells = sweep(cfg, rows, a, ref_factor)
    timing = {"sweep_wall_s": time.perf_counter() - t1, "sweep_cpu_s": time.process_time() - c1,
              "windows_wall_s": windows_wall}
    shares = window_shares(cells, a, analysis) if analysis else {}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png, raw = out.with_suffix(".png"), out.with_suffix(".json")
    plot(png, cells, rows, a.demands, a.equal_groups)
    timing["total_wall_s"] = time.perf_counter() - t_start
    cmd = command("sim_burstiness.py", argv or None)
    meta = {"command": cmd, "droppable_gb": droppable_weight_bytes(cfg) / 1e9,
            "kv_gb": cfg.base_kv_blocks() * cfg.block_bytes / 1e9,
            "max_group_size": KunServeConfig().drop.max_group_size}
    lines = render(a, cfg, meta, rows, cells, analysis, shares, check, png, raw, timing)
    write_doc(out, lines, keep="## Reading")
    slim = {"command": cmd, "config": config_summary(cfg), "paper_x": PAPER_X,
            "args": {k: v for k, v in vars(a).items() if k not in ("azure", "mooncake", "out")},
            "rows": [{k: v for k, v in r.items() if k != "reqs"} for r in rows], "cells": cells,
            "windows": analysis, "window_shares": shares, "step_check": check, "timing": timing}
    write_json(raw, slim, indent=1, newline=False)
    print(f"wrote {out}, {png.name}, {raw.name} in {timing['total_wall_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
