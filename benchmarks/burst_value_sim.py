"""Predict a burst_value run's pooled burst-window TTFT with the simulator, held out (issue 34).

    python -m benchmarks.burst_value_sim --fit docs/benchmarks/runs/burst_value_r1_2x_join.tar.xz \\
        --predict docs/benchmarks/runs/burst_value_r1_epyc_head2.tar.xz --out-name burst_value_sim_epyc_head2

Both arguments are ``benchmarks/burst_value.py`` runs: a run folder (its ``compare.json``, and per
system and repetition ``requests.csv`` and ``timeline.csv[.gz]``) or a run's archive
(``benchmarks/common/raw.py``), which holds both.

**Fit** (``--fit``): per system, the decode step lines (one engine alone, and a pipeline group's
cycle) from the clean seconds of every repetition's timeline pooled, and the prefill rate from the
warm-phase requests: the estimators of ``vllm_kunserve/sim/runfit.py``.
Then each system's lines are scaled by one factor until the simulator reproduces the median TPOT of
the fit run's repetitions (``sim.runfit.calibrate``): the clean seconds are a biased sample of a run's
steps (warm phase and drain), and the uncalibrated lines give TPOTs 1.1-1.7x the measured.

**Noise** (off with ``--no-noise``): the simulator is deterministic, the runs are not. The same
request waits 0.9 s for its first token in one repetition and 1.7 s in another, where the simulator
says 0.7 s every time (the OS and the front end sharing the engines' cores, a step's jitter). Per
system, the fit run's residuals (measured minus simulated TTFT of its window requests, where
neither is over 2 s, ``sim.runfit.ttft_residuals``) are added to each predicted request, 50 draws
each from a fixed seed, and the percentiles are taken over the draws. A system that did not run in
the fit run (or has fewer than 30 residuals) takes the residuals of the system its lines come from.

**Predict** (``--predict``, another run: another burst rate): nothing measured in it is used but
the requests it offered (arrival, prompt, output length asked for). Every repetition is simulated
with its own requests; the burst window's TTFTs are pooled over the repetitions, and the pooled
P50 / P90 / P99 compared with the measured ones (``benchmarks.common.pooled``: lost requests count as infinite,
95% bootstrap interval of the measured). Target: within 25% at P90 and P99 for every system.

Systems, simulated as the harness runs them:

* ``vllm``: stock engines behind the front end's dispatch (the run's), vLLM-CPU's 128 sequences;
* ``vllm-tuned``: the same with the run's ``--tuned-max-num-seqs``;
* ``oracle-equal``: stock with the run's ``--oracle-equal-kv-multiplier`` times the KV;
* ``vllm-router``: stock engines, dispatched round-robin. vllm-router's default (``cache_aware``),
  on prompts that share no prefix, sends each request to the worker whose prefix tree holds the
  fewest characters (equal prompts: alternately) unless the workers' loads drift apart; its
  step lines are ``vllm``'s (the harness reads ``/metrics`` through the router, one engine's, so
  the router's timeline cannot be fitted); ``vllm-router-rr`` (its ``round_robin``) the same;
* ``static``: the simulator's static policy (one pipeline group of all engines from the start), its
  lines from the fit run's ``static`` where it ran, else ``kunserve``'s (whose grouped line is the
  same pipeline's);
* ``kunserve``: the simulator's KunServe policy with the run's kunserve config (the real monitor
  and drop planner; a group member's KV capped at ``memory.max_kv_ratio`` x its base);
* a ``--variant`` of the predicted run: ``kunserve`` with that variant's config.

A system that did not run in the fit run takes the lines of one of its kind (``lines_source``):
a variant and ``static`` kunserve's, a stock one the first stock system that did (the harsher R0
run, every KV capped at 2x, predicted from the ablation run at 10x: held out in memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import statistics
import sys
from functools import partial
from pathlib import Path

from benchmarks.common import pooled, raw
from benchmarks.common.stats import fmt_num
from vllm_kunserve.bench.report import command, md_row, md_table, write_json
from vllm_kunserve.bench.systems import variant_configs
from vllm_kunserve.sim import runfit   # the step estimators, calibration and the run simulator
from vllm_kunserve.workload.records import read_csv
from vllm_kunserve.workload.stats import percentiles, ratio
from vllm_kunserve.workload.traces import parse_phases

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
DOCS = ROOT / "docs" / "benchmarks"
TOL = 0.25
SLOW_S = 2.0   # burst_value.py's TTFT SLO (--ttft-slo): a request waiting longer missed it
NOISE_DRAWS, NOISE_SEED, MIN_NOISE = 50, 0, 30   # --no-noise: draws per request, their seed, residuals needed
SYSTEMS = ("vllm", "vllm-tuned", "vllm-router", "vllm-router-rr", "static", "kunserve", "oracle-equal")
#: how each harness system is simulated: the simulator's policy, and where its step lines come from
SIM_AS = {"vllm": "vllm", "vllm-tuned": "vllm", "vllm-router": "vllm", "vllm-router-rr": "vllm", "oracle-equal": "vllm",
          "static": "static", "kunserve": "kunserve"}
LINES_FROM = {"vllm-router": "vllm", "vllm-router-rr": "vllm"}
#: stock systems whose timelines carry their engines' steps (a router's is one engine's), in the order a
#: stock system absent from the fit run takes its lines from
STOCK_LINES = ("vllm", "vllm-tuned", "oracle-equal")
#: two runs' phase rates this close are one arrival sequence (each run's rates follow its measured capacity)
RATE_TOL = 0.05
#: a run fixes a percentile to TOL where a second run of the system (two-level bootstrap) lands within TOL
#: of it in at least this share of draws; below it, no prediction can be held to TOL against the run
FIXED = 0.5


def lines_source(system: str, fit_run: Path, variants: dict) -> str:
    """The fit run's system whose step lines ``system`` is simulated with: its own where it ran there
    (a router's are ``vllm``'s: ``LINES_FROM``), else one of its kind: kunserve's for static and for
    kunserve's variants, the first stock system that ran for a stock one (the lines are a decode
    step by batch, the same engines' whatever their KV or batch cap)."""
    own = LINES_FROM.get(system, system)
    if reps_of(fit_run, own):
        return own
    if system == "static" or system in variants:
        return "kunserve"
    if SIM_AS.get(system) == "vllm":
        return next((s for s in STOCK_LINES if reps_of(fit_run, s)), own)
    return own


def reps_of(run: Path, system: str) -> list[tuple[int, Path]]:
    out = []
    for d in (run / system).glob("rep*"):
        m = re.fullmatch(r"rep(\d+)", d.name)
        if m and (d / "requests.csv").exists():
            out.append((int(m.group(1)), d))
    return sorted(out)


def settings_of(run: Path) -> dict:
    """The simulator's settings of a burst_value run, from its compare.json."""
    args = json.loads((run / "compare.json").read_text())["args"]
    ph = parse_phases(args["phases"])
    lo = ph[0][0]
    eng = args.get("engine_arg") or []
    seqs = runfit.argv_opt(eng, "--max-num-seqs")
    kcfg = json.loads(args["kunserve_config"] or "{}")
    base = {"model": args["model"], "instances": int(args["instances"]), "kv_tokens": int(args["kv_capacity_tokens"]),
            "block_size": int(args["block_size"]), "dispatch": args["dispatch"], "oracle_x": 1.0,
            "kunserve_config": kcfg, "phases": args["phases"], "window": [lo, lo + ph[1][0]], "engine_args": eng,
            "variants": variant_configs(args.get("variant") or [], kcfg),
            "trace": {"window_offset": args.get("window_offset"), "seed": args.get("seed")},
            "max_num_batched_tokens": int(runfit.argv_opt(eng, "--max-num-batched-tokens")
                                          or runfit.VLLM_CPU_DEFAULTS["max_num_batched_tokens"]),
            "max_num_seqs": int(seqs or runfit.VLLM_CPU_DEFAULTS["max_num_seqs"])}
    model = Path(base["model"])
    if not (model / "config.json").exists():   # a run made in another checkout: the same preset here
        base["model"] = str(ROOT / "models" / model.name)
    specs = {"vllm-router": {"dispatch": "round-robin"}, "vllm-router-rr": {"dispatch": "round-robin"},
             "oracle-equal": {"kv_x": float(args.get("oracle_equal_kv_multiplier") or 1.0)}}
    if args.get("tuned_max_num_seqs"):
        specs["vllm-tuned"] = {"max_seqs": int(args["tuned_max_num_seqs"])}
    base["specs"] = specs
    return base


def load(run: Path, systems: list[str], lo: float, inst: int) -> dict:
    """Per (system, rep): rows, timeline, clean seconds, per-rep lines and warm prefill samples."""
    return {(s, k): runfit.rep_data(d, lo, inst) for s in systems for k, d in reps_of(run, s)}


def run_requests(run: Path, system: str, lo: float, hi: float) -> list[pooled.Request]:
    """A system's requests that arrived in [lo, hi), over every repetition of ``run``."""
    return [r for k, d in reps_of(run, system) for r in pooled.read_window(d / "requests.csv", k, lo, hi)]


def within(ratio: float | None) -> bool:
    """A predicted / measured ratio (or a second run's over this one) within TOL of 1."""
    return ratio is not None and abs(ratio - 1) <= TOL


def warm_tpot(run: Path, system: str, lo: float) -> float | None:
    """Median TPOT of a system's warm-phase requests (arrivals before the burst window), pooled over
    its repetitions."""
    return pooled.tpot(run_requests(run, system, 0.0, lo), (50.0,))["p50"]


def machine_speed(fit_run: Path, pred_run: Path, fset: dict, pset: dict, systems: list[str]) -> dict | None:
    """How much slower (> 1) or faster the machine decoded on the predicted run's day than on the fit
    run's: per system in both, its warm-phase median TPOT in the predicted run over the fit run's
    (the warm phase runs at half the capacity, below any drop, and comes before the burst window the
    prediction is judged on), the median over systems. Runs made in different sessions of this
    shared machine decode at speeds 10-25% apart, which alone moves a tail on the knee by more than
    the target's 25%."""
    ratios = {}
    for s in systems:
        f, p = warm_tpot(fit_run, s, fset["window"][0]), warm_tpot(pred_run, s, pset["window"][0])
        if f and p:
            ratios[s] = p / f
    if not ratios:
        return None
    return {"factor": statistics.median(ratios.values()), "by_system": ratios}


def sim_window(st, st_g, settings: dict, system: str, rows: list[dict], rep: int) -> list[pooled.Request]:
    """One repetition simulated with its own offered requests: its window's requests as pooled sees them."""
    sim = runfit.make_sim(st, st_g, settings, system, runfit.trace_of(rows)).run()
    lo, hi = settings["window"]
    out = []
    for r in sim.reqs:
        if not lo <= r.arrival < hi:
            continue
        if r.finish_t is None:
            out.append(pooled.Request(rep, r.arrival, False, math.inf, None, 0, None))
            continue
        x = r.record()
        out.append(pooled.Request(rep, r.arrival, True, x["ttft_s"], x["tpot_s"] if x["output"] > 1 else None,
                                  x["output"], None))
    return out


def with_noise(pred: list[pooled.Request], residuals: list[float], draws: int = NOISE_DRAWS,
               seed: int = NOISE_SEED) -> list[pooled.Request]:
    """Each predicted request ``draws`` times, its TTFT plus a residual drawn from ``residuals`` (never
    below zero); a lost request stays lost. Its repetition is kept, so the bootstrap still resamples
    within repetitions."""
    rng = random.Random(seed)
    out = []
    for r in pred:
        if not r.ok:
            out += [r] * draws
            continue
        out += [dataclasses.replace(r, ttft_s=max(0.0, r.ttft_s + rng.choice(residuals))) for _ in range(draws)]
    return out


def noise_summary(res: list[float], source: str) -> dict:
    q = percentiles(res, (50, 90, 99))
    return {"from": source, "n": len(res), "p50": q["p50"], "p90": q["p90"], "p99": q["p99"]}


#: a cell's number; a lost request's tail (infinite) prints as inf
fmt = partial(fmt_num, finite_only=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", required=True, help="the burst_value run whose timelines give the step times")
    ap.add_argument("--predict", required=True, help="the burst_value run predicted (its offered requests only)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--no-calibrate", action="store_true", help="the lines as fitted (no TPOT calibration)")
    ap.add_argument("--no-noise", action="store_true",
                    help="predict with the deterministic simulator alone (no residuals of the fit run added)")
    ap.add_argument("--no-machine-speed", action="store_true",
                    help="do not scale the lines by the machine's speed on the predicted run's day (its warm phase)")
    ap.add_argument("--rerun", help="another burst_value run on the predicted run's arrivals (the same trace window, "
                    "seed and phases): how close a real second run of each system came to the predicted run")
    ap.add_argument("--out-name", default="burst_value_sim", help="writes docs/benchmarks/<name>.{md,json}")
    a = ap.parse_args()
    try:
        fit_run, pred_run, rerun = raw.run_dir(a.fit), raw.run_dir(a.predict), a.rerun and raw.run_dir(a.rerun)
    except FileNotFoundError as e:
        raise SystemExit(str(e))
    for p in (fit_run, pred_run, rerun):
        if p and not (p / "compare.json").exists():
            raise SystemExit(f"{p}: no compare.json (a benchmarks/burst_value.py run directory)")
    fset, pset = settings_of(fit_run), settings_of(pred_run)
    if rerun and not same_arrivals(settings_of(rerun), pset):
        raise SystemExit(f"--rerun {rerun}: not the predicted run's arrivals (its trace window, seed or phases differ)")
    if a.systems == ",".join(SYSTEMS):   # the default: every system the predicted run has, its variants too
        a.systems += "," + ",".join(pset["variants"])
    systems = [s for s in a.systems.split(",") if s and reps_of(pred_run, s)]
    unknown = [s for s in systems if s not in SIM_AS and s not in pset["variants"]]
    if unknown:
        raise SystemExit(f"--systems: no simulation of {unknown}; known: {', '.join(SIM_AS)} and the predicted "
                         "run's --variants")
    lines_from = {s: lines_source(s, fit_run, pset["variants"]) for s in systems}
    missing = sorted({src for src in lines_from.values() if not reps_of(fit_run, src)})
    if missing:
        raise SystemExit(f"{fit_run}: no runs of {missing} to fit the lines of {sorted(lines_from)} on")
    # a system whose lines come from another is rescaled to its own TPOT in the fit run, where it ran
    # there: the routers' engines decode faster than the same engines behind kunserve serve, whose
    # front end shares their cores (the timeline behind a router is one engine's, so no lines of its own)
    own = [s for s in systems if lines_from[s] != s and reps_of(fit_run, s)]
    sources = sorted(set(lines_from.values()) | set(own))
    fdata = load(fit_run, sources, fset["window"][0], fset["instances"])
    speed = None if a.no_machine_speed else machine_speed(fit_run, pred_run, fset, pset, systems)

    rows, residuals = [], {}
    for s in systems:
        src = lines_from[s]
        fits, pf = runfit.pooled_fits(fdata, src)
        single, grouped = fits["single"] or fits["grouped"], fits["grouped"] or fits["single"]
        if single is None or len(pf) < runfit.MIN_PREFILL:
            raise SystemExit(f"{fit_run}: too few clean seconds or warm requests of {src} to fit its steps")
        tps = 1 / statistics.median(pf)
        cal = None
        if not a.no_calibrate:   # on the fit run's own repetitions of the source system
            ks = sorted(k for s2, k in fdata if s2 == src)
            cal = runfit.calibrate(fdata, src, ks, single, grouped, {**fset, "system_as": SIM_AS}, None)
            single, grouped, tps = runfit.scaled(single, cal["scale"]), runfit.scaled(grouped, cal["scale"]), cal["tps"]
            if s in own:
                ko = sorted(k for s2, k in fdata if s2 == s)
                c2 = runfit.calibrate(fdata, s, ko, single, grouped, {**fset, "system_as": SIM_AS}, tps)
                single, grouped = runfit.scaled(single, c2["scale"]), runfit.scaled(grouped, c2["scale"])
                cal = {**cal, "scale": cal["scale"] * c2["scale"], "own": c2}
        noise = None
        if not a.no_noise:   # the fit run's residuals, on the lines of the fit run's day (before the speed)
            fst, fst_g = runfit.step_times(single, grouped, 1.0, tps)
            for who in (s, src):
                ks = sorted(k for s2, k in fdata if s2 == who)
                if ks and who not in residuals:
                    residuals[who] = runfit.ttft_residuals(fst, fst_g, fdata, who, ks, {**fset, "system_as": SIM_AS},
                                                           SLOW_S)
                if len(residuals.get(who) or []) >= MIN_NOISE:
                    noise = noise_summary(residuals[who], who)
                    break
        if speed:   # the machine's speed on the predicted run's day, from its warm phase (below)
            single, grouped = runfit.scaled(single, speed["factor"]), runfit.scaled(grouped, speed["factor"])
        st, st_g = runfit.step_times(single, grouped, 1.0, tps)
        meas, pred = [], []
        for k, d in reps_of(pred_run, s):
            rws = read_csv(d / "requests.csv")
            meas += pooled.read_window(d / "requests.csv", k, *pset["window"])
            pred += sim_window(st, st_g, {**pset, "system_as": SIM_AS}, s, rws, k)
        plain = pred
        if noise:
            pred = with_noise(pred, residuals[noise["from"]])
        mt, pt = pooled.tail(meas), pooled.tail(pred)
        row = {"system": s, "lines_from": src, "single": single, "grouped": grouped, "prefill_tps": tps,
               "calibration": cal, "n_measured": len(meas), "n_predicted": len(plain),
               "lost_predicted": sum(1 for r in plain if not r.ok), "measured": mt, "predicted": pt,
               "noise": noise, "predicted_plain": pooled.tail(plain) if noise else None,
               "tpot_p50": {"measured": pooled.tpot(meas)["p50"], "predicted": pooled.tpot(pred)["p50"]}}
        for q in ("p50", "p90", "p99"):
            m, p = mt[q]["value"], pt[q]["value"]
            row[f"ratio_{q}"] = ratio(p, m)
        # the share of the window waiting over the TTFT SLO: stable where a percentile sits on the knee
        row["over_slo"] = {"measured": pooled.share_above(meas, SLOW_S), "predicted": pooled.share_above(pred, SLOW_S)}
        o = row["over_slo"]
        # each repetition's own share: the spread between runs of one system (the bootstrap interval
        # resamples requests within repetitions, so it leaves this spread out)
        rep_shares = sorted(pooled.share_above([r for r in meas if r.rep == k], SLOW_S)["value"]
                            for k in sorted({r.rep for r in meas}))
        o["measured_reps"] = rep_shares
        row["over_slo_in_reps"] = (o["predicted"]["value"] is not None and bool(rep_shares)
                                   and rep_shares[0] <= o["predicted"]["value"] <= rep_shares[-1])
        row["over_slo_in_ci"] = (o["predicted"]["value"] is not None and o["measured"]["lo"] is not None
                                 and o["measured"]["lo"] <= o["predicted"]["value"] <= o["measured"]["hi"])
        row["within"] = all(within(row[f"ratio_{q}"]) for q in ("p90", "p99"))
        # where a percentile sits on the knee of the TTFT curve its interval is wide: is the prediction in it?
        row["in_ci"] = all(pt[q]["value"] is not None and mt[q]["lo"] is not None
                           and mt[q]["lo"] <= pt[q]["value"] <= mt[q]["hi"] for q in ("p90", "p99"))
        row["rerun"] = fixes(meas, pt, row)
        if rerun and reps_of(rerun, s):   # a real second run on these arrivals
            second = run_requests(rerun, s, *pset["window"])
            st2 = pooled.tail(second, (90.0, 99.0))
            row["second_run"] = {"n": len(second), **{q: st2[q]["value"] / mt[q]["value"] if mt[q]["value"] else None
                                                      for q in ("p90", "p99")}}
        rows.append(row)
        print(f"{s}: pooled P90 / P99 measured {fmt(mt['p90']['value'])} / {fmt(mt['p99']['value'])} s, predicted "
              f"{fmt(pt['p90']['value'])} / {fmt(pt['p99']['value'])} s; scale {fmt(cal and cal['scale'], 3)}", flush=True)
    cmd = command("burst_value_sim.py")
    res = {"command": cmd, "fit": str(fit_run), "predict": str(pred_run), "tolerance": TOL, "out_name": a.out_name,
           "rerun": rerun and str(rerun), "fixed": FIXED,
           "machine_speed": speed,
           "fit_settings": fset, "predict_settings": pset, "rows": rows}
    write_json(DOCS / f"{a.out_name}.json", res, indent=1, clean=False, default=str)
    (DOCS / f"{a.out_name}.md").write_text(render(res))
    print((DOCS / f"{a.out_name}.md").read_text())
    return 0


def fixes(meas: list[pooled.Request], pt: dict, row: dict) -> dict:
    """Per P90 / P99: how closely the measured run fixes its own percentile (``pooled.rerun_agreement``:
    a second run of the system on these arrivals within TOL of it, share of draws, and the runs' 95%
    spread), whether it does (``fixed``: at least FIXED), and whether the prediction is within TOL of
    the run and inside the runs' spread."""
    out = {}
    for q in ("p90", "p99"):
        x = pooled.rerun_agreement(meas, float(q[1:]), TOL)
        p = pt[q]["value"]
        out[q] = {**x, "fixed": x["agree"] is not None and x["agree"] >= FIXED, "within": within(row[f"ratio_{q}"]),
                  "in_spread": p is not None and x["lo"] is not None and x["lo"] <= p <= x["hi"]}
    return out


def _same(x, y) -> bool:
    """Two runs' trace settings equal (an offset of 0 and one of 0.0 are the same window)."""
    try:
        return float(x) == float(y)
    except (TypeError, ValueError):
        return str(x) == str(y)


def same_arrivals(a: dict, b: dict) -> bool:
    """Two runs offered one arrival sequence: the same trace window and seed, and phases of the same
    lengths at rates within RATE_TOL (each run's rates follow its measured capacity)."""
    ta, tb = a.get("trace") or {}, b.get("trace") or {}
    if not (_same(ta.get("window_offset"), tb.get("window_offset")) and _same(ta.get("seed"), tb.get("seed"))):
        return False
    fa, fb = parse_phases(a["phases"]), parse_phases(b["phases"])
    return len(fa) == len(fb) and all(x[0] == y[0] and abs(y[1] / x[1] - 1) <= RATE_TOL for x, y in zip(fa, fb))


def held_out(fit: dict, pred: dict) -> str:
    """How the predicted run differs from the fit's: its offered requests, and the memory its systems
    had (kunserve's KV cap, oracle-equal's KV)."""
    ft, pt = fit.get("trace") or {}, pred.get("trace") or {}
    mem = memory_change(fit, pred)
    if not _same(ft.get("window_offset"), pt.get("window_offset")):
        return (f"The predicted run's arrivals come from another part of the trace (offset {pt.get('window_offset')} s "
                f"against {ft.get('window_offset')} s; seed {pt.get('seed')} against {ft.get('seed')}), rescaled to "
                "its phases: an arrival sequence the fit never saw." + (f" {mem}." if mem else ""))
    if not _same(ft.get("seed"), pt.get("seed")):
        return (f"The two runs share the trace window; their seeds differ ({pt.get('seed')} against {ft.get('seed')}), "
                "so each run's requests are its own." + (f" {mem}." if mem else ""))
    if not same_arrivals(fit, pred):
        return ("The two runs share the trace window and seed; they differ in the burst's rate, so each arrival "
                "sequence is new to the fit." + (f" {mem}." if mem else ""))
    same = ("The two runs share the trace window, seed and phases" + (
        "" if fit["phases"] == pred["phases"] else
        f" (rates within {RATE_TOL:.0%}: `{fit['phases']}` against `{pred['phases']}`, each run's measured capacity)"))
    if mem:
        return f"{same}: the same arrivals. {mem}: memory the fit never saw."
    return f"{same}: not a held-out test."


def memory_change(fit: dict, pred: dict) -> str:
    """What differs between the runs' memory: a group member's KV cap, oracle-equal's KV; "" if nothing."""
    out = []
    cap = [((x.get("kunserve_config") or {}).get("memory") or {}).get("max_kv_ratio") for x in (fit, pred)]
    if cap[0] != cap[1]:   # None: the config's default
        out.append(f"kunserve's KV cap (`memory.max_kv_ratio`) is {cap[1]}x, the fit's {cap[0]}x")
    eq = [((x.get("specs") or {}).get("oracle-equal") or {}).get("kv_x") for x in (fit, pred)]
    if eq[0] != eq[1] and None not in eq:
        out.append(f"oracle-equal's KV {eq[1]:g}x the base, the fit's {eq[0]:g}x")
    return ("They differ in memory: " + "; ".join(out)) if out else ""


def machine_line(speed: dict | None) -> str:
    if not speed:
        return "- Machine speed: not applied (`--no-machine-speed`, or no warm-phase TPOT in both runs)."
    by = ", ".join(f"{s} {x:.2f}" for s, x in speed["by_system"].items())
    return (f"- Machine speed: every line x{speed['factor']:.3f}, the median over systems of the predicted run's "
            f"warm-phase median TPOT over the fit run's ({by}): the machine's speed that day, read before the "
            "burst window (nothing of the window is used; `--no-machine-speed` leaves it out).")


def noise_line(rows: list[dict]) -> str:
    ns = [(r["system"], r["noise"]) for r in rows if r.get("noise")]
    if not ns:
        return "- Noise: none added (`--no-noise`): the predictions are the deterministic simulator's."
    by = "; ".join(f"{s} {n['p50']:+.2f} / {n['p90']:+.2f} / {n['p99']:+.2f} s (n {n['n']}"
                   + ("" if n["from"] == s else f", {n['from']}'s") + ")" for s, n in ns)
    return ("- Noise: each predicted request's TTFT plus a residual of the fit run, measured minus simulated TTFT "
            f"of its window requests where neither is over {SLOW_S:g} s (`sim.runfit.ttft_residuals`), "
            f"{NOISE_DRAWS} draws per request; the simulator alone in parentheses in the table. Residuals' P50 / "
            f"P90 / P99: {by}.")


def share_cell(row: dict) -> str:
    o = row.get("over_slo")
    if not o or o["measured"]["value"] is None:
        return "-"
    m, p = o["measured"], o["predicted"]
    sim = "-" if p["value"] is None else f"{p['value']:.1%}"
    reps = o.get("measured_reps") or []
    spread = f"; reps {reps[0]:.0%}..{reps[-1]:.0%}" if len(reps) > 1 else ""
    return f"{m['value']:.1%} ({m['lo']:.1%}..{m['hi']:.1%}{spread}) / {sim}"


def knee_note(rows: list[dict]) -> str:
    """Which missed percentiles sit on the knee: the share over the SLO straddles the percentile's
    tail share, so a few requests more or fewer move it across the knee."""
    knee = []
    for r in rows:
        o = (r.get("over_slo") or {}).get("measured") or {}
        if r["within"] or o.get("lo") is None:
            continue
        for q, tail_share in (("p90", 0.10), ("p99", 0.01)):
            x = r.get(f"ratio_{q}")
            if not within(x) and o["lo"] <= tail_share <= o["hi"]:
                knee.append(f"{r['system']}'s {q.upper()}")
    if not knee:
        return ""
    return (f". On the knee ({', '.join(knee)}): the measured share over {SLOW_S:g} s has the percentile's tail share "
            "(10% for P90, 1% for P99) inside its interval, so whether that percentile lands under a second or near "
            "a minute turns on a few requests, across repetitions as in the simulator")


def _cell_name(c: tuple) -> str:
    """A (system, percentile, ...) cell as "system's P99"."""
    return f"{c[0]}'s {c[1].upper()}"


def fixed_verdict(res: dict) -> list[str]:
    """The verdict on what the predicted run can judge: the percentiles it fixes to TOL (a second run of
    the system within TOL of it in at least FIXED of the draws) and those it does not."""
    rows = [r for r in res["rows"] if r.get("rerun")]
    if not rows:
        return []
    cells = [(r["system"], q, r["rerun"][q]) for r in rows for q in ("p90", "p99")]
    fixed = [c for c in cells if c[2]["fixed"]]
    loose = [c for c in cells if not c[2]["fixed"]]
    L = ["- a second run of the same system on these arrivals lands within 25% of this run (two-level bootstrap: "
         "the run's repetitions resampled, then their requests; share of draws), P90 / P99: "
         + ", ".join(f"{r['system']} {r['rerun']['p90']['agree']:.0%} / {r['rerun']['p99']['agree']:.0%}" for r in rows)]
    miss = [_cell_name(c) for c in fixed if not c[2]["within"]]
    L.append(f"- the percentiles this run fixes to 25% (a second run within it in at least {res.get('fixed', FIXED):.0%} of "
             f"the draws): the simulator within 25% at {len(fixed) - len(miss)} of {len(fixed)}"
             + (f"; outside: {', '.join(miss)}" if miss else ""))
    if loose:
        out = [_cell_name(c) for c in loose if not c[2]["in_spread"]]
        L.append(f"- the percentiles it does not fix ({', '.join(_cell_name(c) for c in loose)}): a second run of the system "
                 "itself would miss 25% more often than not, so no prediction can be held to 25% there; the simulator's "
                 f"inside the runs' 95% spread at {len(loose) - len(out)} of {len(loose)}"
                 + (f"; outside: {', '.join(out)}" if out else ""))
    two = [r for r in rows if r.get("second_run")]
    if two:
        far = [f"{r['system']}'s {q.upper()} ({r['second_run'][q]:.2f}x)" for r in two for q in ("p90", "p99")
               if r["second_run"][q] is not None and not within(r["second_run"][q])]
        L.append(f"- a real second run on these arrivals (`{res['rerun']}`, {len(two)} systems): within 25% of this run "
                 f"at {2 * len(two) - len(far)} of {2 * len(two)} percentiles" + (f"; outside: {', '.join(far)}" if far else ""))
    return L


def fixed_table(res: dict) -> list[str]:
    """Per system and percentile: the runs' spread, a second run's agreement, and the prediction in it."""
    rows = [r for r in res["rows"] if r.get("rerun")]
    if not rows:
        return []
    two = any(r.get("second_run") for r in rows)
    L = ["", "## Does the run fix its own tail? (a second run on the same arrivals)", "",
         "The runs' spread: the 95% interval of the pooled percentile over runs drawn like this one (its repetitions "
         "resampled with replacement, then each one's requests: `benchmarks.common.pooled.rerun_agreement`), wider than the "
         "interval above where a run's slow requests bunch in a few repetitions. A second run within 25%: the share of "
         "pairs of such draws within 25% of each other."
         + (f" A real second run: `{res['rerun']}`, its pooled percentile over this run's." if two else ""), ""]
    head = ["system", "P90 (runs' 95% spread)", "second run within 25%", "sim (in spread?)",
            "P99 (runs' 95% spread)", "second run within 25%", "sim (in spread?)"]
    L += md_table(head + (["real second run / this, P90 / P99 (n)"] if two else []), "lllllll" + ("l" if two else ""))
    for r in rows:
        cells = [r["system"]]
        for q in ("p90", "p99"):
            x = r["rerun"][q]
            cells += [f"{fmt(r['measured'][q]['value'])} ({fmt(x['lo'])}..{fmt(x['hi'])})", f"{x['agree']:.0%}",
                      f"{fmt(r['predicted'][q]['value'])} ({'yes' if x['in_spread'] else 'no'})"]
        if two:
            sr = r.get("second_run")
            cells.append(f"{fmt(sr['p90'])} / {fmt(sr['p99'])} ({sr['n']})" if sr else "-")
        L.append(md_row(cells))
    return L


def render(res: dict) -> str:
    rows = res["rows"]
    met = [r["system"] for r in rows if r["within"]]
    miss = [r["system"] for r in rows if not r["within"]]
    base = res["predict_settings"].get("kunserve_config") or {}
    variants = {k: json.dumps({sec: {o: x for o, x in kv.items() if (base.get(sec) or {}).get(o) != x}
                               for sec, kv in v.items() if kv != base.get(sec)})   # the variant's own settings
                for k, v in (res["predict_settings"].get("variants") or {}).items()}
    regime = re.search(r"burst_value_(r\d)", str(res["predict"]))
    L = [f"# The simulator predicting {regime.group(1).upper() if regime else 'a run'}'s pooled tails, held out "
         "(written by benchmarks/burst_value_sim.py)", "",
         f"Command: `{res['command']}`.", "",
         f"Step times fitted on `{res['fit']}` (phases `{res['fit_settings']['phases']}`); predicted: "
         f"`{res['predict']}` (phases `{res['predict_settings']['phases']}`), of which only the requests offered "
         f"are used. {held_out(res['fit_settings'], res['predict_settings'])}", "",
         "## Verdict (target: pooled P90 and P99 TTFT within 25% for every system)", "",
         f"- within 25% at P90 and P99: {', '.join(met) or 'none'}",
         f"- outside: {', '.join(miss) or 'none'}",
         f"- the prediction inside the measured 95% interval at P90 and P99 (where a percentile sits on the knee "
         f"of the TTFT curve, its interval spans the knee): "
         f"{', '.join(r['system'] for r in rows if r.get('in_ci')) or 'none'}",
         f"- the share of window requests waiting over {SLOW_S:g} s for their first token predicted inside its "
         f"measured 95% interval: {', '.join(r['system'] for r in rows if r.get('over_slo_in_ci')) or 'none'}; "
         f"inside the range of the repetitions' own shares: "
         f"{', '.join(r['system'] for r in rows if r.get('over_slo_in_reps')) or 'none'}" + knee_note(rows),
         *fixed_verdict(res), "",
         "## Pooled burst-window TTFT, measured vs simulated (seconds)", ""]
    L += md_table(["system", "requests", "P50 meas / sim (without noise)", "P90 meas (95% CI) / sim", "P99 meas (95% CI) / sim",
                   "sim / meas P50, P90, P99", f"TTFT > {SLOW_S:g} s meas (95% CI; reps' range) / sim", "P50 TPOT meas / sim (ms)",
                   "lines from", "scale", "lost (sim)"], "lrlllllllrr")
    for r in rows:
        m, p, plain = r["measured"], r["predicted"], r.get("predicted_plain")
        def ci(q, m=m):
            return f"{fmt(m[q]['value'])} ({fmt(m[q]['lo'])}..{fmt(m[q]['hi'])})"

        def sim(q, p=p, plain=plain):   # with the noise, and the simulator alone in parentheses
            return fmt(p[q]["value"]) + (f" ({fmt(plain[q]['value'])})" if plain else "")
        tp = r["tpot_p50"]
        L.append(md_row([r["system"], r["n_measured"], f"{fmt(m['p50']['value'])} / {sim('p50')}",
                         f"{ci('p90')} / {sim('p90')}", f"{ci('p99')} / {sim('p99')}",
                         f"{fmt(r['ratio_p50'])}, {fmt(r['ratio_p90'])}, {fmt(r['ratio_p99'])}", share_cell(r),
                         f"{fmt(tp['measured'] and tp['measured'] * 1e3, 0)} / "
                         f"{fmt(tp['predicted'] and tp['predicted'] * 1e3, 0)}",
                         r["lines_from"], fmt(r["calibration"] and r["calibration"]["scale"], 3), r["lost_predicted"]]))
    L += fixed_table(res)
    L += ["", "## How", "",
          "- Decode step lines (`a + c b` ms at a batch of b per engine) from the fit run's timelines' clean seconds "
          "(`vllm_kunserve/sim/runfit.py`), every repetition pooled; a group's cycle has its own line. "
          "Prefill rate: the fit run's warm requests that had an engine to themselves.",
          machine_line(res.get("machine_speed")),
          noise_line(rows),
          "- Calibration: one factor on each system's lines, found where the simulated median TPOT of the fit run's "
          "repetitions equals the measured (`sim.runfit.calibrate`); a system whose lines come from another is "
          "scaled again to its own median TPOT in the fit run, where it ran there (the scale column is the product).",
          "- Systems: " + "; ".join(
              f"`{s}` as the simulator's `{SIM_AS[s]}`" if s in SIM_AS else
              f"`{s}` as `kunserve` with the variant's config ({variants.get(s, '')})" for s in (r["system"] for r in rows))
          + "; the routers' systems dispatched round-robin with `vllm`'s lines (module docstring). Lines from another "
          "system: " + (", ".join(
              f"`{r['system']}` from `{r['lines_from']}`" for r in rows if r["lines_from"] != r["system"]) or "none")
          + ".", "",
          ] + md_table(["system", "single line", "grouped line", "prefill tok/s"], "lllr",
                       ([r["system"], runfit.line_str(r["single"]), runfit.line_str(r["grouped"]), f"{r['prefill_tps']:.0f}"]
                        for r in rows))
    L += ["", f"Raw: `docs/benchmarks/{Path(res.get('out_name', 'burst_value_sim')).name}.json`.", ""]
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
