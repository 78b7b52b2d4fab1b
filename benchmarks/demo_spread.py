"""How much `make demo`'s ratios move from run to run (issue 71 item 3): the demo's comparison, N times.

    python -m benchmarks.demo_spread [--runs 3] [--seed 1] [--out runs/demo_spread]

Each run is ``benchmarks/common/demo.py``'s ``run_demo``, exactly what ``make demo`` runs (the same
seed, so the same arrivals and lengths; the rate follows each run's own probe of the machine's decode
speed): stock vLLM, kunserve and oracle-equal, each a 2-engine ``kunserve serve`` cluster started
for its replay. Per run: kunserve's and oracle-equal's P99 TTFT and P50 TPOT over stock's, what the
timelines say (queue, KV, when the engines grouped) and the run's wall time; then the spread
(min / median / max) of each against the demo's targets (kunserve's P99 TTFT at most 0.3x stock's,
its P50 TPOT at most 1.2x). A benchmark, not a test: about 6 minutes a run on a 2-core Zen 3.

Writes docs/benchmarks/demo_spread.{json,md} (``--name``); the runs' files stay under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.common.demo import REQUESTS, SYSTEMS, run_demo
from benchmarks.common.stats import fmt_num, median_range
from vllm_kunserve.bench.report import REPO, doc_header, md_table, rel, write_doc, write_json

DOCS = REPO / "docs" / "benchmarks"
#: the demo's targets (issue 71 item 3): kunserve / stock
TARGETS = {"ttft_p99": 0.3, "tpot_p50": 1.2}
#: `make demo`'s own time, the venv aside (a fresh clone builds it first, ~2.5 min)
WALL_TARGET_S = 210.0


def summary_of(res) -> dict:
    """What the page keeps of one run: the rate it ran at, each system's latencies and timeline facts,
    the ratios to stock, the servers' start-up times and the wall time (no per-request data)."""
    per = {}
    for n in res.systems:
        s = res.summaries[n]
        per[n] = {"ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"], "tpot_p50_s": s["tpot_s"]["p50"],
                  "tpot_p99_s": s["tpot_s"]["p99"], "preemptions": s.get("preemptions"), "failed": s["failed"],
                  "late_sends": s.get("late_sends"), "output_tokens_per_s": s.get("output_tokens_per_s"),
                  **res.facts.get(n, {})}
    return {"wall_s": res.wall_s, "probe": res.probe, "burst": res.burst, "startup_s": res.startup_s,
            "systems": per, "ratios": {n: res.ratios[n] for n in res.systems if n != "vllm"}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1, help="the demo's seed (make demo: 1)")
    ap.add_argument("--out", default=str(REPO / "runs" / "demo_spread"))
    ap.add_argument("--name", default="demo_spread", help="the page: docs/benchmarks/NAME.{md,json}")
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    runs, meta = [], {}
    for k in range(1, a.runs + 1):
        print(f"run {k}/{a.runs}", flush=True)
        res = run_demo(Path(a.out) / f"run{k}", seed=a.seed, log=lambda s: print(s, file=sys.stderr, flush=True))
        runs.append(summary_of(res))
        meta = {"machine": res.machine, "regime": res.regime, "systems": res.systems}
        r = runs[-1]["ratios"]["kunserve"]
        print(f"run {k}: kunserve / stock P99 TTFT {fmt_num(r['ttft_p99'], suffix='x')}, P50 TPOT "
              f"{fmt_num(r['tpot_p50'], suffix='x')}, wall {res.wall_s:.0f} s", flush=True)
    spread = {}
    for n in meta["systems"]:
        if n == "vllm":
            continue
        for key in ("ttft_p99", "tpot_p50"):
            vals = [x["ratios"][n][key] for x in runs if x["ratios"][n][key] is not None]
            if vals:
                spread[f"{n}/{key}"] = median_range(vals, 3)
    spread["wall_s"] = median_range([x["wall_s"] for x in runs], 1)
    met = {key: sum(1 for x in runs if (x["ratios"]["kunserve"][key] or float("inf")) <= t) for key, t in TARGETS.items()}
    met["wall_s"] = sum(1 for x in runs if x["wall_s"] <= WALL_TARGET_S)
    raw = DOCS / f"{a.name}.json"
    write_json(raw, {"command": f"python benchmarks/demo_spread.py {' '.join(sys.argv[1:] if argv is None else argv)}".strip(),
                     **meta, "runs": runs, "spread": spread, "targets": {**TARGETS, "wall_s": WALL_TARGET_S},
                     "met": met, "load_avg": os.getloadavg()}, indent=1)
    write_doc(DOCS / f"{a.name}.md", render(a, meta, runs, spread, met, raw), keep="## Reading")
    print((DOCS / f"{a.name}.md").read_text())
    return 0


def render(a, meta: dict, runs: list[dict], spread: dict, met: dict, raw: Path) -> list[str]:
    m, g = meta["machine"], meta["regime"]
    b = runs[0]["burst"]
    tag = "bf16" if g["dtype"] == "bfloat16" else "fp32"
    L = doc_header(
        "The demo's spread: `make demo`'s comparison, repeated", "demo_spread.py",
        f"{m['cpu']} ({m['class']}), {m['cores']} cores; 2 engines, one compute thread each (OMP_NUM_THREADS=1, "
        f"each pinned to its own core)", raw,
        f"Each run is `make demo`'s comparison (`benchmarks/common/demo.py` `run_demo`, seed {a.seed}): "
        f"{', '.join(f'`{s}`' for s in meta['systems'])}, each a 2-engine `kunserve serve` cluster started for its "
        "replay, one after the other, stock first (the probe of the machine's decode speed runs on its engines and "
        "sets the burst's rate).",
        f"Regime: `{g['model']}` ({tag}, {g['weight_bytes'] / 2**20:.0f} MiB of weights, "
        f"{g['kv_bytes_per_token'] / 1024:.0f} KiB of KV per token), KV for {g['kv_tokens']} tokens per engine: weights "
        f"are w = {g['weight_share']:.0%} of an engine's memory, a group holds {g['group_kv_factor']:.2f}x. Burst: "
        f"{REQUESTS} Poisson arrivals, {b['prompt']}-token prompts, outputs {b['outputs'][0]}..{b['outputs'][1]} "
        f"tokens, at the rate whose estimated peak KV demand is {b['peak_share']:g}x stock's KV at the probed speed.")
    L += ["## Runs", ""]
    L += md_table(["run", "wall (s)", "probe TPOT (ms)", "burst", "stock P99 TTFT (s)", "kunserve P99 TTFT (s)",
                   "kunserve / stock P99 TTFT", "kunserve / stock P50 TPOT", "oracle-equal / stock P99 TTFT",
                   "oracle-equal / stock P50 TPOT", "stock: waited (peak), preempted", "kunserve grouped at (s)"],
                  "rrrlrrrrrrlr",
                  ([k, f"{x['wall_s']:.0f}", f"{x['probe']['tpot_s'] * 1e3:.0f}",
                    f"{x['burst']['rate_rps']:.2f} req/s over {x['burst']['duration_s']:.0f} s",
                    fmt_num(x["systems"]["vllm"]["ttft_p99_s"]), fmt_num(x["systems"]["kunserve"]["ttft_p99_s"]),
                    fmt_num(x["ratios"]["kunserve"]["ttft_p99"], suffix="x"),
                    fmt_num(x["ratios"]["kunserve"]["tpot_p50"], suffix="x"),
                    fmt_num((x["ratios"].get("oracle-equal") or {}).get("ttft_p99"), suffix="x"),
                    fmt_num((x["ratios"].get("oracle-equal") or {}).get("tpot_p50"), suffix="x"),
                    f"{x['systems']['vllm'].get('waiting_peak', 0):.0f}, {x['systems']['vllm'].get('preemptions') or 0:.0f}",
                    fmt_num(x["systems"]["kunserve"].get("grouped_first_s"), 0)]
                   for k, x in enumerate(runs, 1)))
    n = len(runs)
    L += ["", "## Spread", "", f"Over the {n} run{'s' if n > 1 else ''}: min / median / max, and in how many runs "
          "kunserve met the demo's target.", ""]
    rows = []
    for key, s in spread.items():
        target, hits = "", ""
        if key.startswith("kunserve/"):
            t = TARGETS[key.split("/")[1]]
            target, hits = f"<= {t:g}x", f"{met[key.split('/')[1]]} of {n}"
        elif key == "wall_s":
            target, hits = f"<= {WALL_TARGET_S:.0f} s", f"{met['wall_s']} of {n}"
        label = {"wall_s": "demo wall time (s)"}.get(key, key.replace("/ttft_p99", " / stock P99 TTFT")
                                                     .replace("/tpot_p50", " / stock P50 TPOT"))
        digits = 0 if key == "wall_s" else 2
        rows.append([label, fmt_num(s["min"], digits), fmt_num(s["median"], digits), fmt_num(s["max"], digits),
                     target, hits])
    L += md_table(["ratio", "min", "median", "max", "target", "met"], "lrrrll", rows)
    st = [x["startup_s"] for x in runs]
    L += ["", "Servers' start-up (s, per run, each system's 2 engines and front end): "
          + "; ".join(", ".join(f"{k} {v:.0f}" for k, v in s.items()) for s in st) + ".", ""]
    L += [f"Raw data: `{rel(raw)}` (a summary per run and system; the runs' per-request CSVs and timelines stay under "
          f"`{rel(Path(a.out))}`).", ""]
    return L


if __name__ == "__main__":
    sys.exit(main())
