"""Regrouping at paper scale (simulated): what merging live groups further (``drop.regroup``) buys
KunServe, with the KV kept (the fleet's restage, the paper's Fig. 6) and recomputed (the fleet's
fallback), on the cells of ``sim_burstiness``.

At paper scale (Qwen-2.5-14B on 8 x H100) KunServe's default plan merges lone instances only, so
its groups stop at pairs, while the equal-memory oracle with all 8 pooled (``oracle-equal-g8``) is
the bound on what dropping can buy. Each cell of ``docs/benchmarks/sim_burstiness.json`` (its row's
trace compressed by the cell's fitted factor, the same warm-up) is run again with three KunServe
variants:

* ``kunserve``: the default (no regroup); its P99 TTFT is checked against the stored cell's (the
  same trace and code path: they must agree, or the stored cells are stale);
* ``regroup``: ``drop.regroup`` on, by recomputation: live groups merge further, their members'
  running requests recomputed and their layers loaded back over PCIe (``KunServePolicy(
  regroup_keeps_kv=False)``: the fleet's fallback when a restage fails, and ``drop.transition:
  reprefill``);
* ``regroup-kv``: the same plans with the KV kept (each (request owner, layer) range moved to the
  member that holds the layer in the larger group): what the fleet carries out (``group_restage``).

The stored cell's ``vllm-tuned`` and ``oracle-equal-g2`` / ``-g8`` P99s are quoted beside them.

    python -m benchmarks.sim_regroup                       # every cell of sim_burstiness.json
    python -m benchmarks.sim_regroup --rows azure --demands 0.6,0.9

Writes ``--out`` (markdown), and beside it ``.json`` (raw) and ``.png``; everything from a
``## Reading`` heading on in an existing markdown file is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import sim_burstiness as SB
from benchmarks.common.stats import fmt_num
from vllm_kunserve.bench.report import command, md_row, md_table, pyplot, rel, save_figure, write_doc, write_json
from vllm_kunserve.workload.stats import ratio

ROOT = Path(__file__).resolve().parents[1]
CELLS = ROOT / "docs" / "benchmarks" / "sim_burstiness.json"
VARIANTS = ("kunserve", "regroup", "regroup-kv")
#: the stored cell's P99 and this run's default kunserve may differ by float noise only
AGREE = 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=str(CELLS), help="sim_burstiness's raw JSON (its cells and rows)")
    ap.add_argument("--rows", default=None, help="rows to run (comma-separated; default every row of --cells)")
    ap.add_argument("--demands", default=None, help="demand columns to run (default every column of --cells)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "sim_regroup.md"), help="markdown path")
    a = ap.parse_args(argv)
    try:
        with open(a.cells, encoding="utf-8") as f:
            a.source = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"--cells {a.cells}: no such file (run benchmarks/sim_burstiness.py first)") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"--cells {a.cells}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(a.source, dict) or not isinstance(a.source.get("cells"), list) or "args" not in a.source:
        raise SystemExit(f"--cells {a.cells}: not a sim_burstiness.json (no cells / args)")
    rows = sorted({c["row"] for c in a.source["cells"]})
    a.rows = rows if a.rows is None else [r.strip() for r in a.rows.split(",") if r.strip()]
    bad = [r for r in a.rows if r not in rows]
    if bad or not a.rows:
        raise SystemExit(f"--rows: {', '.join(bad) or 'none given'}; the cells have {', '.join(rows)}")
    demands = sorted({c["demand"] for c in a.source["cells"]})
    a.demands = demands if a.demands is None else SB._floats(a.demands, "--demands", 0.0, 4.0)
    bad = [d for d in a.demands if d not in demands]
    if bad:
        raise SystemExit(f"--demands: {bad} not among the cells' columns {demands}")
    return a


def source_args(src: dict) -> argparse.Namespace:
    """sim_burstiness's arguments as that run had them, with its rows' trace offsets pinned (no window
    analysis needed to rebuild the same rows)."""
    s = src["args"]
    argv = ["--cvs", ",".join(f"{c:g}" for c in s["cvs"]), "--demands", ",".join(f"{d:g}" for d in s["demands"]),
            "--window-s", f"{s['window_s']:g}", "--warmup-s", f"{s['warmup_s']:g}", "--seed", str(s["seed"]),
            "--real", ",".join(s["real"]) or "none"]
    for r in src["rows"]:
        if r["row"] in SB.REAL:
            argv += [f"--{r['row']}-offset", f"{r['offset_s']:g}"]
    return SB.parse_args(argv)


def run_variants(cfg, trace, warm: float) -> dict:
    from vllm_kunserve.config import KunServeConfig, parse_config
    from vllm_kunserve.sim.policies.kunserve import KunServePolicy
    from vllm_kunserve.sim.runner import simulate

    pols = {"kunserve": KunServePolicy(KunServeConfig()),
            "regroup": KunServePolicy(parse_config({"drop": {"regroup": True}}), regroup_keeps_kv=False),
            "regroup-kv": KunServePolicy(parse_config({"drop": {"regroup": True}}))}
    out = {}
    for name, pol in pols.items():
        res = simulate(cfg, pol, trace, keep_requests=False, warmup_s=warm)
        sim = res.pop("_sim")
        s = res["summary"]
        plans = [e for e in sim.events if e["kind"] == "drop_plan"]
        drops = [e for e in sim.events if e["kind"] == "drop"]
        out[name] = {**SB.brief(s, res), "max_group": max((p["max_group"] for p in sim.timeline), default=1),
                     "regroups": sum(1 for e in plans if e.get("live_merged")),
                     "recomputed": sum(e.get("recomputed", 0) for e in drops),
                     "drops": len(drops)}
    return out


def sweep(a) -> list[dict]:
    from vllm_kunserve.sim.runner import build_config
    from vllm_kunserve.sim.trace import compress_time

    sa = source_args(a.source)
    cfg = build_config("qwen2.5-14b", "h100", instances=8, gpu_mem_gb=80)
    azure, mooncake, _ = SB.load_sources(sa)
    rows = {r["row"]: r for r in SB.row_traces(sa, azure, mooncake, {})}
    out = []
    for c in a.source["cells"]:
        if c["row"] not in a.rows or c["demand"] not in a.demands:
            continue
        t0 = time.perf_counter()
        trace = compress_time(rows[c["row"]]["reqs"], c["factor"])
        v = run_variants(cfg, trace, c["warmup_s"])
        stored = c["p99_ttft_s"]
        cell = {"row": c["row"], "demand": c["demand"], "factor": c["factor"], "warmup_s": c["warmup_s"],
                "variants": v, "stored_p99_ttft_s": {k: stored.get(k) for k in
                                                     ("kunserve", "vllm-tuned", "oracle-equal-g2", "oracle-equal-g8")},
                "wall_s": round(time.perf_counter() - t0, 2)}
        k_now, k_then = v["kunserve"]["p99_ttft_s"], stored.get("kunserve")
        cell["agrees_with_stored"] = (k_now is not None and k_then is not None
                                      and abs(k_now - k_then) <= AGREE * max(1.0, abs(k_then)))
        out.append(cell)
        print(f"{c['row']:>12} {c['demand']:.0%}: P99 TTFT kunserve {fmt_num(k_now)} (stored {fmt_num(k_then)}), "
              f"regroup {fmt_num(v['regroup']['p99_ttft_s'])} (max group {v['regroup']['max_group']}, "
              f"{v['regroup']['recomputed']} recomputed), regroup-kv {fmt_num(v['regroup-kv']['p99_ttft_s'])}, "
              f"eq-g8 {fmt_num(stored.get('oracle-equal-g8'))} | {cell['wall_s']:.0f} s", flush=True)
    return out


def summary(cells: list[dict]) -> dict:
    """Over the cells where the default kunserve's P99 is above eq-g8's by more than 10% (room for a
    larger group): how often each regroup variant lowers it by 5% or more, raises it by 5% or more,
    and the median ratio to the default."""
    room = [c for c in cells if (ratio(c["variants"]["kunserve"]["p99_ttft_s"], c["stored_p99_ttft_s"]["oracle-equal-g8"])
                                 or 0) > 1.1]
    out = {"cells": len(cells), "cells_with_room": len(room), "all_agree_with_stored": all(c["agrees_with_stored"]
                                                                                           for c in cells)}
    for name in ("regroup", "regroup-kv"):
        rs = sorted(r for c in room if (r := ratio(c["variants"][name]["p99_ttft_s"],
                                                   c["variants"]["kunserve"]["p99_ttft_s"])) is not None)
        out[name] = {"better": sum(1 for r in rs if r <= 0.95), "worse": sum(1 for r in rs if r >= 1.05),
                     "median_ratio": rs[len(rs) // 2] if rs else None,
                     "regrouped_cells": sum(1 for c in cells if c["variants"][name]["regroups"])}
    return out


def plot(path: Path, cells: list[dict]) -> None:
    plt = pyplot()
    rows = list(dict.fromkeys(c["row"] for c in cells))
    fig, axes = plt.subplots(1, len(rows), figsize=(3.0 * len(rows), 3.2), sharey=True, squeeze=False)
    for ax, row in zip(axes[0], rows):
        cs = sorted((c for c in cells if c["row"] == row), key=lambda c: c["demand"])
        x = [c["demand"] for c in cs]
        for name, style in (("kunserve", "o-"), ("regroup", "s--"), ("regroup-kv", "^:")):
            ax.plot(x, [c["variants"][name]["p99_ttft_s"] for c in cs], style, label=name)
        ax.plot(x, [c["stored_p99_ttft_s"]["oracle-equal-g8"] for c in cs], "k-", lw=0.8, label="oracle-equal-g8")
        ax.plot(x, [c["stored_p99_ttft_s"]["vllm-tuned"] for c in cs], color="gray", lw=0.8, label="vllm-tuned")
        ax.set_title(row, fontsize=9)
        ax.set_xlabel("mean KV demand")
    axes[0][0].set_ylabel("P99 TTFT (s)")
    axes[0][-1].legend(fontsize=7)
    save_figure(fig, path)


def render(a, cells: list[dict], summ: dict, png: Path, raw: Path, wall: float) -> list[str]:
    f = fmt_num
    link = os.path.relpath(Path(a.cells).resolve(), png.parent.resolve())
    lines = ["# Regrouping at paper scale (simulated)", "",
             f"`{command('sim_regroup.py')}` ({wall:.0f} s); raw data [{raw.name}]({raw.name}); cells from "
             f"[{rel(a.cells)}]({link}) (`{a.source['command']}`): Qwen-2.5-14B on 8 x H100, Vidur "
             "step times, each cell's trace compressed by its fitted factor, the same warm-up.", "",
             "Variants: `kunserve` (default, no regroup: groups stop at pairs once no lone instance is left), "
             "`regroup` (`drop.regroup` by recomputation: live groups merge further, their running requests "
             "recomputed: the fleet's fallback), `regroup-kv` (the same plans with the KV kept: what the fleet's "
             "restage does). `vllm-tuned` and `oracle-equal-g8` (all 8 instances' memory pooled, the bound on what "
             "dropping buys) are the stored cell's.", "",
             f"![P99 TTFT by demand]({png.name})", "",
             "| row | demand | vllm-tuned | kunserve | regroup | regroup-kv | oracle-equal-g8 | regroup max group "
             "| recomputed | regroup / kunserve | regroup-kv / kunserve |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        v, st = c["variants"], c["stored_p99_ttft_s"]
        k = v["kunserve"]["p99_ttft_s"]
        lines.append(md_row([c["row"], f"{c['demand']:.0%}", f(st["vllm-tuned"]), f(k), f(v["regroup"]["p99_ttft_s"]),
                             f(v["regroup-kv"]["p99_ttft_s"]), f(st["oracle-equal-g8"]), v["regroup"]["max_group"],
                             v["regroup"]["recomputed"], fmt_num(ratio(v["regroup"]["p99_ttft_s"], k), suffix="x"),
                             fmt_num(ratio(v["regroup-kv"]["p99_ttft_s"], k), suffix="x")]))
    lines += ["", "P99 TTFT in seconds over the measured requests.", "",
              "## Summary", ""]
    lines += md_table(["variant", "cells regrouped", "better by >= 5%", "worse by >= 5%", "median / kunserve"], "lrrrr",
                      [[n, f"{summ[n]['regrouped_cells']} of {summ['cells']}", summ[n]["better"], summ[n]["worse"],
                        fmt_num(summ[n]["median_ratio"], suffix="x")] for n in ("regroup", "regroup-kv")])
    lines += ["", f"Better / worse / median over the {summ['cells_with_room']} cells where the default's P99 is more "
              "than 1.1x oracle-equal-g8's (room for a larger group). The default kunserve's P99 "
              + ("agrees with the stored cell's in every cell (the cells are current)." if summ["all_agree_with_stored"]
                 else "differs from the stored cell's in some cells (`agrees_with_stored` in the JSON): the stored "
                 "cells are stale; re-run sim_burstiness.py."), ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    cells = sweep(a)
    summ = summary(cells)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png, raw = out.with_suffix(".png"), out.with_suffix(".json")
    plot(png, cells)
    wall = time.perf_counter() - t0
    write_doc(out, render(a, cells, summ, png, raw, wall), keep="## Reading")
    write_json(raw, {"command": command("sim_regroup.py", argv or None), "source": a.source["command"],
                     "cells": cells, "summary": summ, "wall_s": wall}, indent=1, newline=False)
    print(f"wrote {out}, {png.name}, {raw.name} in {wall:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
