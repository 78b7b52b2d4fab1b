"""Where memory buys something on this platform: one load curve instead of more points (issue 71, item 2).

The burst question of ``benchmarks/burst_value.py`` (regime R1, 2 engines each pinned to a core, the
Azure trace's arrivals re-timed into a warm phase at 0.5x the measured capacity and a 64 s burst) at
several burst factors (``--loads``, multiples of the capacity measured once), the four systems at each
(``vllm-tuned``, ``vllm-router``, ``kunserve``, ``oracle-equal``), shuffled per repetition.

    python -m benchmarks.load_curve [--loads 2.0,1.0,1.5,3.0] [--repeat 1] [--caps 8,12,16,24] [--sweep-repeat 2]
    python -m benchmarks.load_curve --render          # the page again from the archived runs

Steps: the first load runs ``burst_value``'s capacity step and its batch-cap sweep (``--caps`` x
``--sweep-repeat``, caps shuffled per repetition; the lowest pooled P99 TTFT is ``vllm-tuned``'s cap at
every load, as a user tunes once); every load then runs the comparison with that capacity and cap.
Each load point is one ``burst_value`` run archived as ``docs/benchmarks/runs/burst_value_load_<machine>_x<X>.tar.xz``
(so the headline's rule sees it too, as its own group), without a page of its own; this script writes
the one page, ``docs/benchmarks/load_curve.{md,json,png}``: per load and system, pooled window TTFT /
TPOT / end-to-end latency and their ratios to ``oracle-equal`` with 95% intervals
(``benchmarks/common/headline.py``'s ``summarize``, the same rule), the batch table that explains them,
and what the simulator predicts for an H100 at the same weight share (``--sim``: Vidur's H100 step
costs, the ``stage-h100`` link).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.common import headline, raw
from vllm_kunserve.bench.report import REPO, command, md_table, pyplot, save_figure, write_json

PAGE = REPO / "docs" / "benchmarks" / "load_curve"
SYSTEMS = ("vllm-tuned", "vllm-router", "kunserve", "oracle-equal")
ALTERNATIVES = ("vllm-tuned", "vllm-router")
PREFIX = "burst_value_load_"
METRICS = (("ttft_p99", "P99 TTFT"), ("tpot_p50", "P50 TPOT"), ("e2e_p99", "P99 E2E"))


def machine_slug() -> str:
    from vllm_kunserve.cli.demo import machine

    m = machine()
    vendor = "xeon" if "xeon" in m["cpu"].lower() else "epyc" if "epyc" in m["cpu"].lower() else "cpu"
    return re.sub(r"[^a-z0-9]+", "_", f"{vendor} {m['kind']}".lower()).strip("_")


def run_name(slug: str, x: float) -> str:
    return f"{PREFIX}{slug}_x{x:g}".replace(".", "p")


def parse_loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--loads {text!r}: comma-separated burst factors, e.g. 2.0,1.0,1.5,3.0") from None
    if not loads or any(not x > 0.5 for x in loads) or len(set(loads)) != len(loads):
        raise SystemExit(f"--loads {text!r}: distinct burst factors above the warm phase's 0.5x")
    return loads


def measure(a: argparse.Namespace, slug: str) -> int:
    """Every load point, the first with the capacity step and the sweep, the rest reusing both."""
    loads = parse_loads(a.loads)
    first = Path(a.out) / f"x{loads[0]:g}"
    for x in loads:
        d = Path(a.out) / f"x{x:g}"
        d.mkdir(parents=True, exist_ok=True)
        if d != first:
            for f in ("capacity.json", "sweep.json"):
                if (first / f).exists() and not (d / f).exists():
                    shutil.copy(first / f, d / f)
        argv = [sys.executable, "-m", "benchmarks.burst_value", "--regime", a.regime, "--concurrency", a.concurrency,
                "--burst-x", f"{x:g}", "--systems", ",".join(SYSTEMS), "--repeat", str(a.repeat), "--caps", a.caps,
                "--sweep-repeat", str(a.sweep_repeat), "--steps", "capacity,sweep,compare", "--out", str(d),
                "--name", run_name(slug, x), "--no-page", *(["--scaling", a.scaling] if a.scaling else [])]
        print("running: " + " ".join(argv), flush=True)
        if subprocess.call(argv, cwd=REPO) != 0:
            return 1
    return 0


# ------------------------------------------------------------------------------ the simulated GPU
GPU_MODEL = "llama2-7b"
GPU_BLOCK = 16
WARM_S, WARM_SHARE, BURST_S = 30.0, 0.5, 64.0   # burst_value's phases, as every load point ran them
SAT_S, SAT_RATE = 60.0, 100.0   # the simulated capacity run: arrivals well past what 2 H100s serve; the last 2/3 counted


def simulate_gpu(weight_share: float, loads: list[float], caps: list[int], seed: int = 1) -> dict:
    """The same question on the simulator with an H100's step costs: 2 instances of ``GPU_MODEL``
    whose weights are ``weight_share`` of weights + KV, the same trace, phases, lengths, kunserve config
    and systems (vllm-router as stock dispatched round-robin, its default's behaviour on prompts that
    share no prefix). Capacity is the simulated stock cluster's completed rate under a saturating
    arrival rate; the tuned cap the sweep's rule (lowest window P99 TTFT) over ``caps`` at the first load."""
    from benchmarks.burst_value import KV_CAP, MIX, TRACE
    from benchmarks.common.burst import kunserve_config
    from vllm_kunserve.bench.workload import WorkloadOptions, build_trace
    from vllm_kunserve.config import parse_config
    from vllm_kunserve.sim.policies import build_policy
    from vllm_kunserve.sim.runner import build_config, simulate
    from vllm_kunserve.sim.trace import from_trace
    from vllm_kunserve.sim.tuning import pick_vllm_cap
    from vllm_kunserve.workload.models import load_model_spec

    spec = load_model_spec(GPU_MODEL, None)
    kv_tokens = spec.param_bytes * (1 - weight_share) / weight_share / spec.kv_bytes_per_token
    cfg = build_config(GPU_MODEL, "h100", instances=2, link="stage-h100", block_size=GPU_BLOCK,
                       kv_blocks=int(kv_tokens // GPU_BLOCK))
    kcfg = parse_config(json.dumps(kunserve_config(KV_CAP)))

    def trace(phases: str):
        tr, _ = build_trace(WorkloadOptions(format="azure", trace=str(TRACE), phases=phases, synthetic_lengths=True,
                                            prompt_len=MIX["prompt_len"], output_len=MIX["output_len"],
                                            output_len_max=MIX["output_len_max"], seed=seed))
        return from_trace(tr)

    # capacity: stock under arrivals well past what it serves, completions per second once it is full
    sat = simulate(cfg, build_policy("vllm"), trace(f"{SAT_S:g}@{SAT_RATE:g}"), keep_requests=True)
    capacity = sum(SAT_S / 3 <= r["arrival_s"] + r["latency_s"] < SAT_S for r in sat["requests"]) / (SAT_S * 2 / 3)
    window = (WARM_S, WARM_S + BURST_S)
    tuned = pick_vllm_cap(cfg, trace(f"{WARM_S:g}@{WARM_SHARE * capacity:.4f},{BURST_S:g}@{loads[0] * capacity:.4f}"),
                          caps, warmup_s=window[0], end_s=window[1])
    out_loads = []
    for x in sorted(loads):
        tr = trace(f"{WARM_S:g}@{WARM_SHARE * capacity:.4f},{BURST_S:g}@{x * capacity:.4f}")
        pols = {"vllm-tuned": build_policy("vllm-tuned", max_seqs=tuned["cap"]),
                "vllm-router": build_policy("vllm", "round-robin"),
                "kunserve": build_policy("kunserve", config=kcfg), "oracle-equal": build_policy("oracle-equal")}
        summ = {n: simulate(cfg, pol, tr, keep_requests=False, warmup_s=window[0], end_s=window[1])["summary"]
                for n, pol in pols.items()}
        val = {n: {"ttft_p99": s_["ttft_s"].get("p99"), "tpot_p50": s_["tpot_s"].get("p50"),
                   "e2e_p99": s_["latency_s"].get("p99"), "requests": s_["requests"], "completed": s_["completed"]}
               for n, s_ in summ.items()}
        ref = val["oracle-equal"]
        ratio = {n: {k: (v[k] / ref[k] if v[k] is not None and ref[k] else None) for k, _ in METRICS}
                 for n, v in val.items()}
        alt = min((val[a]["ttft_p99"] or math.inf, a) for a in ALTERNATIVES)
        out_loads.append({"x": x, "abs": val, "ratio": ratio,
                          "vs_alt": (val["kunserve"]["ttft_p99"] / alt[0]) if val["kunserve"]["ttft_p99"] and
                          math.isfinite(alt[0]) else None, "better_alternative": alt[1]})
    return {"model": GPU_MODEL, "weight_share": weight_share, "kv_tokens_per_instance": int(kv_tokens),
            "capacity": capacity, "cap": tuned["cap"], "caps": list(caps), "loads": out_loads,
            "note": (f"{GPU_MODEL} (fp16) on 2 simulated H100s with {int(kv_tokens)} KV tokens each (weights "
                     f"{weight_share:.0%} of weights + KV, as the CPU runs), step costs from Vidur's H100 profiles "
                     f"(MIT), the `stage-h100` link; capacity is the stock cluster's completed rate under {SAT_RATE:g} req/s "
                     f"of arrivals, {capacity:.2f} req/s; the same phases, lengths, kunserve config and systems as "
                     f"the CPU runs (vllm-router as stock dispatched round-robin); tuned cap {tuned['cap']} from "
                     f"caps {', '.join(map(str, caps))} at {loads[0]:g}x. One deterministic run per load: no "
                     "intervals.")}


# ------------------------------------------------------------------------------------------ the page
def load_points(slug: str) -> list[dict]:
    """Per archived load point of this machine, in load order: the run and the headline rule's summary."""
    names = [n for n in raw.names() if n.startswith(f"{PREFIX}{slug}_x")]
    if not names:
        raise SystemExit(f"no archived load point {PREFIX}{slug}_x*: run python -m benchmarks.load_curve first")
    pts = []
    for name in names:
        run = headline.load(name)
        page = raw.page(name)
        pts.append({"name": name, "x": headline.burst_x(run.meta), "run": run, "summary": headline.summarize([run]),
                    "grouped": (page.get("grouped") or {}).get("kunserve"), "totals": page.get("totals") or {}})
    return sorted(pts, key=lambda p: p["x"])


def versus(run: headline.Run, system: str, other: str, metric: str, q: float) -> dict:
    """``system``'s pooled P{q} of ``metric`` over ``other``'s in the same run, with its 95% interval."""
    from benchmarks.common import pooled

    return pooled.percentile_ratio(run.reqs.get(system, []), run.reqs.get(other, []), q, metric=metric)


def grouped_spans(pt: dict) -> str:
    """kunserve's grouped seconds per repetition (``burst_value``'s ``group_times``), or "never"."""
    g = pt["grouped"] or {}
    if not g:
        return "never"
    return "; ".join(", ".join(f"{a:.0f}-{b:.0f}" for a, b in v.get("spans") or []) for _, v in sorted(g.items()))


def _ci(p: dict) -> str:
    if not p or p.get("value") is None:
        return "-"
    hi = "inf" if p["hi"] is None or math.isinf(p["hi"]) else f"{p['hi']:.2f}"
    v = "lost" if math.isinf(p["value"]) else f"{p['value']:.2f}x"
    return f"{v} ({p['lo']:.2f}..{hi})" if p.get("lo") is not None else v


def _s(v, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else ("lost" if math.isinf(v) else f"{v * scale:.{digits}f}")


def best_alternative(pt: dict) -> str | None:
    """The alternative (tuned stock or vllm-router) with the lower pooled P99 TTFT at this load."""
    alts = [(pt["summary"]["systems"][s]["abs"]["ttft_p99"], s) for s in ALTERNATIVES if s in pt["summary"]["systems"]]
    return min(alts)[1] if alts else None


def plot(path: Path, pts: list[dict], gpu: dict | None) -> bool:
    plt = pyplot(optional=True)
    if plt is None:
        return False
    ncol = len(METRICS) + 1
    fig, ax = plt.subplots(1, ncol, figsize=(4.0 * ncol, 3.8))
    xs = [p["x"] for p in pts]
    for i, s in enumerate(SYSTEMS):
        ys = [p["summary"]["systems"].get(s, {}).get("abs", {}).get("ttft_p99") for p in pts]
        ax[0].plot(xs, [math.nan if y is None or math.isinf(y) else y for y in ys], "o-", color=f"C{i}", label=s)
        if s == headline.REF:
            continue
        for j, (k, title) in enumerate(METRICS, start=1):
            vals, lo, hi = [], [], []
            for p in pts:
                r = (p["summary"]["systems"].get(s, {}).get("ratio", {}).get(k) or {}).get("pooled") or {}
                v = r.get("value")
                ok = v is not None and math.isfinite(v)
                vals.append(v if ok else math.nan)
                lo.append(v - r["lo"] if ok and r.get("lo") is not None else 0)
                hi.append(r["hi"] - v if ok and r.get("hi") is not None and math.isfinite(r["hi"]) else 0)
            ax[j].errorbar([x + (i - 1.5) * 0.03 for x in xs], vals, yerr=[lo, hi], fmt="o-", color=f"C{i}",
                           capsize=3, label=s)
    if gpu:
        gx = [r["x"] for r in gpu["loads"]]
        for j, (k, _) in enumerate(METRICS, start=1):
            ax[j].plot(gx, [r["ratio"]["kunserve"].get(k) or math.nan for r in gpu["loads"]], "x--",
                       color=f"C{SYSTEMS.index('kunserve')}", alpha=0.6, label="kunserve, simulated H100")
    ax[0].set_title("P99 TTFT (s)", fontsize=10)
    ax[0].set_yscale("log")
    for j, (_, title) in enumerate(METRICS, start=1):
        ax[j].set_title(f"{title} / oracle-equal", fontsize=10)
        ax[j].axhline(1.0, color="grey", lw=0.8, ls="--")
        ax[j].set_yscale("log")
    for a_ in ax:
        a_.set_xlabel("burst / measured capacity")
    ax[1].legend(fontsize=7)
    ax[0].legend(fontsize=7)
    save_figure(fig, path)
    return True


def batch_sentence(rows: list[dict]) -> str:
    """The batch table in a sentence: a decode step at batch 4, 16 and 64 against batch 1."""
    by = {r["batch"]: r["step_ms"] for r in rows}
    if 1 not in by:
        return ""
    parts = [f"{by[b] / by[1]:.2f}x at batch {b}" for b in (4, 16, 64) if b in by]
    return (f"A decode step of one engine costs {by[1]:.0f} ms at batch 1 and " + ", ".join(parts)
            + " of that (one thread)")


def reading(pts: list[dict], gpu: dict | None) -> str:
    """Where dropping pays here and why, from the numbers on the page."""
    L: list[str] = []
    pays: list[str] = []
    rest: list[str] = []
    for p in pts:
        alt = best_alternative(p)
        k = p["summary"]["systems"].get("kunserve")
        if not k or not alt:
            continue
        v = versus(p["run"], "kunserve", alt, "ttft", 99)
        # below 1 as printed (two decimals): an upper bound of 0.998 reads "1.00" and does not count
        (pays if v.get("hi") is not None and round(v["hi"], 2) < 1 else rest).append(f"{p['x']:g}x")
        t = (k["ratio"].get("tpot_p50") or {}).get("pooled") or {}
        e = versus(p["run"], "kunserve", alt, "e2e", 99)
        g = p["grouped"]
        L.append(f"at {p['x']:g}x kunserve's P99 TTFT is {_ci(v)} {alt}'s, its P50 TPOT {_ci(t)} oracle-equal's and "
                 f"its P99 end-to-end latency {_ci(e)} {alt}'s"
                 + ("" if g else " (it never grouped)"))
    rows = pts[0]["run"].meta.get("scaling_rows") or []
    text = ""
    if L:
        text = ("**Dropping paid here at " + (", ".join(pays) or "no load") + "**: there kunserve's P99 TTFT against "
                "the better alternative has its 95% interval below 1" + (f"; at {', '.join(rest)} it holds 1 or lies "
                                                                        "above" if rest else "") + ". ")
        text += ("Measured here, against the better alternative at each load (tuned stock or vllm-router, whichever "
                 "had the lower P99 TTFT): " + "; ".join(L) + ". ")
    bs = batch_sentence(rows)
    if bs:
        text += (bs + f" ([{Path(pts[0]['run'].meta.get('scaling_doc', '')).name}]"
                 f"({Path(pts[0]['run'].meta.get('scaling_doc', '')).name})). The KV a group frees lets each engine "
                 "run a bigger batch: that pays where a bigger batch costs little per step and the queue, not the "
                 "step, is what a request waits for; it stops paying where the load passes what the engines can "
                 "compute, since then the extra KV only moves waiting from the queue into slower steps. ")
    if gpu:
        ks = [(r["x"], r["ratio"]["kunserve"].get("ttft_p99"), r["vs_alt"]) for r in gpu["loads"]]
        text += ("The simulator, with an H100's step costs (Vidur's profiles) and the link measured on one "
                 f"(`stage-h100`), {gpu['model']} on 2 instances at the same weight share ({gpu['weight_share']:.0%}), "
                 "predicts kunserve's P99 TTFT at " + ", ".join(
                     f"{_s(v)}x oracle-equal's and {_s(a)}x the better alternative's at {x:g}x" for x, v, a in ks) + ".")
    return text


def render(slug: str, cmd: str, gpu: dict | None = None, again: str = "") -> int:
    pts = load_points(slug)
    gpu_file = PAGE.with_suffix(".json")
    if gpu is None and gpu_file.exists():   # the simulated GPU curve is kept from the last page unless re-run
        gpu = (json.loads(gpu_file.read_text()).get("gpu") or None)
    meta = pts[0]["run"].meta
    cap = meta.get("capacity") or {}
    sw = meta.get("sweep") or {}
    L = ["# Where memory buys something on this CPU: one load curve (written by benchmarks/load_curve.py)", "",
         f"Command: `{cmd}`" + (f" (this page re-rendered by `{again}`)" if again else "")
         + ". Raw data, one archive per load point: "
         + ", ".join(f"`docs/benchmarks/runs/{p['name']}{raw.SUFFIX}`" for p in pts) + ".", "",
         f"![ratios against the load]({PAGE.name}.png)", "",
         "## Reading", "", reading(pts, gpu), "",
         "## Regime", "",
         f"{meta.get('cpu')}; preset `{meta.get('preset')}` ({meta['weight_bytes'] / 1e6:.0f} MB of weights); 2 engines, "
         f"each on its own core with one compute thread; weights are **{meta['weight_share']:.0%}** of an engine's "
         f"weights + KV, so a 2-engine group holds **{meta['group_kv_factor']:.2f}x** the KV (oracle-equal gets "
         f"{meta['oracle_equal_x']:g}x). Capacity, measured once by a closed-loop saturation run driven by "
         f"`vllm bench serve`: **{cap.get('req_per_s', float('nan')):.3f} req/s**. Each load: the Azure 2023 "
         "conversation trace's arrivals (CC BY 4.0) re-timed into a 30 s warm phase at 0.5x the capacity and a 64 s "
         f"burst at the load's factor; {meta['mix']['prompt_len']}-token prompts, outputs uniform in "
         f"{meta['mix']['output_len']}..{meta['mix']['output_len_max']} tokens; the window is the burst's arrivals.", ""]
    rows = meta.get("scaling_rows") or []
    if rows:
        L += md_table(["batch", "decode step (ms)", "tokens/s"], "rrr",
                      ([r["batch"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:.1f}"] for r in rows)) + [""]
    if sw:
        from benchmarks.burst_value import sweep_section

        edge = sw["cap"] == max(r["cap"] for r in sw["rows"]) if sw.get("rows") else False
        L += [*sweep_section(sw), "", f"Tuned cap: **{sw['cap']}** per engine, used at every load"
              + (" (the largest cap swept; a larger one was not tried)" if edge else "") + ".", ""]
    L += ["## Per load", "",
          "Pooled over the load's repetitions (" + ", ".join(
              f"{p['x']:g}x: {len(p['summary']['runs'])} run, "
              f"{p['run'].meta.get('repeat', 1)} repetition(s)" for p in pts)
          + "); ratios are to oracle-equal of the same load, with bootstrap 95% intervals (requests resampled within "
          "each repetition). A lost request counts as infinite TTFT and end-to-end latency.", ""]
    L += md_table(["load", "system", "window requests", "P50 / P99 TTFT (s)", "P50 TPOT (ms)", "P50 / P99 E2E (s)",
                   "preemptions", "P99 TTFT / oracle", "P50 TPOT / oracle", "P99 E2E / oracle", "grouped (s)"],
                  "rlrllllllll", (
        [f"{p['x']:g}x", s, row["n"], f"{_s(row['abs']['ttft_p50'])} / {_s(row['abs']['ttft_p99'])}",
         _s(row["abs"]["tpot_p50"], 1e3, 0), f"{_s(row['abs']['e2e_p50'], 1, 1)} / {_s(row['abs']['e2e_p99'], 1, 1)}",
         f"{(p['totals'].get(s) or {}).get('preemptions', '-'):g}" if isinstance(
             (p['totals'].get(s) or {}).get('preemptions'), (int, float)) else "-",
         *(("1 (reference)" if s == headline.REF else _ci((row["ratio"].get(k) or {}).get("pooled")))
           for k, _ in METRICS),
         grouped_spans(p) if s == "kunserve" else "-"]
        for p in pts for s in SYSTEMS if (row := p["summary"]["systems"].get(s))))
    L += [""]
    if gpu:
        L += ["## The simulator's H100 at the same weight share", "", gpu["note"], ""]
        L += md_table(["load", "capacity (req/s)", "kunserve P99 TTFT / oracle", "P50 TPOT / oracle",
                       "P99 E2E / oracle", "kunserve P99 TTFT / better alternative", "tuned cap"], "rrrrrrr",
                      ([f"{r['x']:g}x", f"{gpu['capacity']:.2f}", _s(r["ratio"]["kunserve"].get("ttft_p99")),
                        _s(r["ratio"]["kunserve"].get("tpot_p50")), _s(r["ratio"]["kunserve"].get("e2e_p99")),
                        _s(r["vs_alt"]), gpu["cap"]] for r in gpu["loads"]))
        L += [""]
    plot(PAGE.with_suffix(".png"), pts, gpu)
    out = {"command": cmd, "machine": slug, "points": [
        {"name": p["name"], "x": p["x"], "summary": p["summary"], "grouped": p["grouped"]} for p in pts], "gpu": gpu}
    write_json(gpu_file, out, indent=1, clean=False, default=str)
    PAGE.with_suffix(".md").write_text("\n".join(L) + "\n")
    print(PAGE.with_suffix(".md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="2.0,1.0,1.5,3.0",
                    help="burst factors (multiples of the measured capacity); the first runs the capacity step and "
                         "the sweep")
    ap.add_argument("--repeat", type=int, default=1, help="shuffled repetitions of the four systems per load")
    ap.add_argument("--caps", default="8,12,16,24", help="vllm-tuned's sweep: --max-num-seqs per engine")
    ap.add_argument("--sweep-repeat", type=int, default=2)
    ap.add_argument("--concurrency", default="48", help="the capacity step's closed-loop concurrencies")
    ap.add_argument("--regime", default="r1", choices=("r1", "r1-fp32"))
    ap.add_argument("--scaling", default="", help="burst_value.py --scaling: the batch table of this CPU")
    ap.add_argument("--out", default=str(REPO / "runs" / "load_curve"))
    ap.add_argument("--machine", default="", help="the runs' machine slug (default: this CPU's)")
    ap.add_argument("--render", action="store_true", help="only the page, from the archived runs")
    ap.add_argument("--sim", action="store_true",
                    help="(re)compute the simulated H100 curve (otherwise the page keeps the last one)")
    a = ap.parse_args(argv)
    if a.repeat < 1 or a.sweep_repeat < 1:
        ap.error("--repeat and --sweep-repeat must be >= 1")
    slug = a.machine or machine_slug()
    if not a.render and measure(a, slug) != 0:
        return 1
    gpu = None
    if a.sim:
        pts = load_points(slug)
        gpu = simulate_gpu(pts[0]["run"].meta["weight_share"], [p["x"] for p in pts],
                           [int(c) for c in a.caps.split(",")] + [1024])
    cmd, again = command("load_curve.py", argv if argv is not None else sys.argv[1:]), ""
    page = PAGE.with_suffix(".json")
    if a.render and page.exists():   # the page names the command that measured, and the one that re-rendered
        was = json.loads(page.read_text()).get("command", "")
        cmd, again = (was, cmd) if was else (cmd, "")
    return render(slug, cmd, gpu, again)


if __name__ == "__main__":
    sys.exit(main())
