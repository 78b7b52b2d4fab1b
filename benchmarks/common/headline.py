"""The README's claim for a burst question, computed over every comparable run (``burst_value.py --readme``).

The rule (fixed on 2026-12-06, before any run it will be applied to; it takes every run already
archived too, none left out by hand):

1. The runs are every archived ``burst_value`` run (``docs/benchmarks/runs/burst_value_*.tar.xz``).
2. Runs are comparable when they share the CPU model, the model preset, the weight share, the request
   lengths, the burst factor, the KV a group may reach and the serving code (the last commit that changed ``vllm_kunserve``
   outside ``bench/`` and ``sim/``, recorded at the run; for runs made before that was recorded, the
   archive's ``provenance`` says where it comes from).
3. Each system is compared with ``oracle-equal`` (stock vLLM with the KV a kunserve group reaches, no
   pipeline) of the same run: kunserve (its default configuration; an ablation's variants are other
   systems) and every alternative that ran. Per metric (TTFT P50 / P90 / P99, TPOT P50, end-to-end
   latency P50 / P99, over the burst window's requests; a lost request has an infinite TTFT and
   end-to-end latency), three figures: the **median of the per-run ratios** with their **range**, and the
   **pooled ratio** (every run's window requests of the system against every run's of the oracle) with a
   95% bootstrap interval (requests resampled within each repetition of each run).
4. Goodput: the share of window requests with TTFT <= 2 s and TPOT <= 1.5x a decode step at the burst's
   batch (the median running requests per engine of ``oracle-equal`` over the window, interpolated in the
   batch table measured on that CPU): a bound the unloaded system meets, printed beside.

The headline is the group with the most runs for the regime (on a tie, the one with the newest run); the
others are listed on the page.
"""

from __future__ import annotations

import csv
import math
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmarks.common import pooled, raw
from vllm_kunserve.bench.report import md_row, md_table

REF = "oracle-equal"
TTFT_SLO_S = 2.0
METRICS = (("ttft", 50), ("ttft", 90), ("ttft", 99), ("tpot", 50), ("e2e", 50), ("e2e", 99))
ORDER = ("vllm", "vllm-router", "vllm-router-rr", "vllm-tuned", "static", "kunserve", REF)
LABEL = {"vllm": "stock vLLM", "vllm-router": "vllm-router (cache_aware)", "vllm-router-rr": "vllm-router (round_robin)",
         "vllm-tuned": "stock, tuned batch cap", "static": "static PP=2 group", "kunserve": "kunserve (cluster drop)",
         REF: "oracle-equal (same memory, no pipeline)"}


@dataclass
class Run:
    name: str
    meta: dict
    reqs: dict[str, list[pooled.Request]]      # per system, the window's requests
    warm: dict[str, list[pooled.Request]]      # per system, the warm phase's
    batch: float | None                        # oracle-equal's median running requests per engine in the window
    folder: Path

    @property
    def commit(self) -> str:
        return (self.meta.get("provenance") or {}).get("commit") or "?"

    @property
    def when(self) -> int:
        """The run's commit time (unix seconds; 0 where unknown)."""
        import subprocess

        try:
            return int(subprocess.check_output(["git", "log", "-1", "--format=%ct", self.commit], text=True,
                                               stderr=subprocess.DEVNULL, cwd=raw.DOCS).strip() or 0)
        except (subprocess.CalledProcessError, ValueError, OSError):
            return 0


def burst_x(meta: dict) -> float | None:
    m = re.search(r"burst ([\d.]+)x", meta.get("load_note", ""))
    return float(m.group(1)) if m else None


def key(meta: dict) -> tuple:
    """What makes two runs comparable (rule 2)."""
    mix = meta.get("mix") or {}
    return (meta.get("cpu"), meta.get("preset"), round(meta.get("weight_share", 0), 3), meta.get("lengths", "decode"),
            mix.get("prompt_len"), mix.get("output_len"), mix.get("output_len_max"), burst_x(meta),
            meta.get("oracle_equal_x"), (meta.get("provenance") or {}).get("serving_code"))


def _median_running(folder: Path, system: str, window: tuple[float, float], instances: int) -> float | None:
    vals = []
    for _, f in pooled.request_files(folder, system):
        tl = f.parent / "timeline.csv"
        if not tl.exists():
            continue
        with open(tl) as fh:
            for row in csv.DictReader(fh):
                if window[0] <= float(row["second"]) < window[1] and row.get("running"):
                    vals.append(float(row["running"]) / instances)
    return float(np.median(vals)) if vals else None


def load(name: str) -> Run:
    folder = raw.unpack(name)
    meta = raw.page(name)["meta"]
    window = tuple(meta["window"])
    systems = [p.name for p in folder.iterdir() if p.is_dir()]
    reqs = pooled.load_runs(folder, systems, window)
    warm = pooled.load_runs(folder, list(reqs), (0.0, window[0]))
    inst = int((meta.get("capacity") or {}).get("instances") or 2)
    return Run(name, meta, reqs, warm, _median_running(folder, REF, window, inst), folder)


def step_ms_at(rows: Sequence[dict], batch: float) -> float | None:
    """A decode step's time at ``batch`` from a measured batch table, linear between its rows."""
    pts = sorted((r["batch"], r["step_ms"]) for r in rows)
    if not pts:
        return None
    if batch <= pts[0][0]:
        return pts[0][1]
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if batch <= b1:
            return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
    (b0, s0), (b1, s1) = pts[-2], pts[-1]
    return s1 + (s1 - s0) * (batch - b1) / (b1 - b0)   # beyond the table: its last slope


def across(runs: Sequence[Run], system: str) -> list[pooled.Request]:
    """The system's window requests of every run, each run's repetitions numbered apart (the pooled
    bootstrap's strata are a run's repetitions)."""
    return [replace(r, rep=i * 1000 + r.rep) for i, run in enumerate(runs) for r in run.reqs.get(system, [])]


def run_ratio(run: Run, system: str, metric: str, q: float) -> float | None:
    """The point ratio of one run (``pooled.percentile_ratio``'s value, without its draws)."""
    ga = pooled.by_rep(run.reqs.get(system, []), pooled.METRIC[metric])
    gb = pooled.by_rep(run.reqs.get(REF, []), pooled.METRIC[metric])
    if not ga or not gb:
        return None
    return pooled.point(ga, q) / pooled.point(gb, q)


def goodput_bound(runs: Sequence[Run]) -> dict:
    """Rule 4's TPOT bound for a group: 1.5x the decode step at the burst's batch on the runs' CPU."""
    batches = [r.batch for r in runs if r.batch]
    rows = runs[0].meta.get("scaling_rows") or []
    batch = float(np.median(batches)) if batches else None
    step = step_ms_at(rows, batch) if batch and rows else None
    return {"batch": batch, "step_ms": step, "tpot_s": 1.5 * step / 1e3 if step else None, "ttft_s": TTFT_SLO_S,
            "scaling_doc": runs[0].meta.get("scaling_doc")}


def summarize(runs: Sequence[Run]) -> dict:
    """Rule 3 and 4 over one group of comparable runs."""
    bound = goodput_bound(runs)
    systems = [s for s in ORDER if any(s in r.reqs for r in runs)]
    out: dict = {"runs": [{"name": r.name, "commit": r.commit, "capacity": (r.meta.get("capacity") or {}).get("req_per_s"),
                           "batch": r.batch, "systems": sorted(r.reqs, key=lambda s: ORDER.index(s) if s in ORDER else 99),
                           "window_requests": {s: len(v) for s, v in r.reqs.items()}} for r in runs],
                 "bound": bound, "systems": {}}
    for s in systems:
        have = [r for r in runs if s in r.reqs and REF in r.reqs]
        reqs = [x for r in runs for x in r.reqs.get(s, [])]
        warm = [x for r in runs for x in r.warm.get(s, [])]
        row: dict = {"runs": len(have), "n": len(reqs), "lost": sum(not x.ok for x in reqs), "abs": {}, "ratio": {}}
        for metric, q in METRICS:
            g = pooled.by_rep(across(runs, s), pooled.METRIC[metric])
            v = pooled.point(g, q) if g else None
            row["abs"][f"{metric}_p{q}"] = v
            if s == REF:
                continue
            per = [x for x in (run_ratio(r, s, metric, q) for r in have) if x is not None]
            row["ratio"][f"{metric}_p{q}"] = {
                "median": float(np.median(per)) if per else None, "min": min(per) if per else None,
                "max": max(per) if per else None, "per_run": {r.name: run_ratio(r, s, metric, q) for r in have},
                "pooled": pooled.percentile_ratio(across(have, s), across(have, REF), q, metric=metric)}
        if bound["tpot_s"]:
            row["goodput"] = pooled.goodput(reqs, bound["ttft_s"], bound["tpot_s"])
            row["goodput_warm"] = pooled.goodput(warm, bound["ttft_s"], bound["tpot_s"]) if warm else None
        out["systems"][s] = row
    return out


def collect(prefix: str = "burst_value_") -> dict[tuple, list[Run]]:
    """Every archived run of the burst question, grouped by rule 2."""
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for name in raw.names():
        if name.startswith(prefix):
            run = load(name)
            if REF in run.reqs and "kunserve" in run.reqs:
                groups[key(run.meta)].append(run)
    return groups


def regime_of(meta: dict) -> str:
    w = meta["weight_share"]
    return "R1" if 0.35 <= w <= 0.65 else "R0"


def _x(v: float | None, lo: float | None = None, hi: float | None = None) -> str:
    if v is None:
        return "-"
    s = "lost" if math.isinf(v) else f"{v:.2f}x"
    if lo is not None and hi is not None:
        s += f" ({lo:.2f}..{'inf' if math.isinf(hi) else f'{hi:.2f}'})"
    return s


def _s(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else ("lost" if math.isinf(v) else f"{v * scale:.{digits}f}")


def table(summary: dict) -> list[str]:
    """One row per system: absolute pooled figures, then each ratio to the oracle as median of runs
    (range) and pooled (95% interval)."""
    b = summary["bound"]
    gp = (f"goodput (TTFT <= {b['ttft_s']:g} s, TPOT <= {b['tpot_s'] * 1e3:.0f} ms)" if b["tpot_s"] else "goodput")
    L = md_table(["system", "runs", "window requests", "P50 / P99 TTFT (s)", "P50 TPOT (ms)", "P50 / P99 E2E (s)", gp,
                  "P99 TTFT / oracle: median of runs (range); pooled (95%)", "P50 TPOT / oracle", "P99 E2E / oracle"],
                 "lrrllllll" + "l")
    for s, row in summary["systems"].items():
        a, r = row["abs"], row["ratio"]

        def rx(k: str, full: bool = False) -> str:
            x = r.get(k)
            if not x or x["median"] is None:
                return "1 (reference)" if s == REF else "-"
            p = x["pooled"]
            rng = f" ({x['min']:.2f}..{x['max']:.2f})" if row["runs"] > 1 else ""
            if full or row["runs"] > 1:
                return f"{x['median']:.2f}x{rng}; {_x(p['value'], p['lo'], p['hi'])}"
            return f"{x['median']:.2f}x"
        L.append(md_row([LABEL.get(s, s), row["runs"], row["n"], f"{_s(a['ttft_p50'])} / {_s(a['ttft_p99'])}",
                         _s(a["tpot_p50"], 1e3, 0), f"{_s(a['e2e_p50'], 1, 1)} / {_s(a['e2e_p99'], 1, 1)}",
                         "-" if row.get("goodput") is None else f"{row['goodput']:.2f}",
                         rx("ttft_p99", True), rx("tpot_p50"), rx("e2e_p99")]))
    return L


def _sentence(summary: dict, what: str) -> str:
    """The claim in one sentence, from the summary's numbers."""
    k = summary["systems"].get("kunserve", {}).get("ratio", {}).get("ttft_p99")
    if not k or k["median"] is None:
        return ""
    n = summary["systems"]["kunserve"]["runs"]
    p = k["pooled"]
    alts = {s: row["ratio"]["ttft_p99"] for s, row in summary["systems"].items()
            if s not in ("kunserve", REF) and row["ratio"].get("ttft_p99", {}).get("median") is not None}
    best = min(alts.items(), key=lambda x: x[1]["median"]) if alts else None
    tp = summary["systems"]["kunserve"]["ratio"]["tpot_p50"]
    e2e = summary["systems"]["kunserve"]["ratio"]["e2e_p99"]
    runs = "run" if n == 1 else f"{n} runs"
    s = (f"{what}: kunserve's P99 TTFT is **{k['median']:.2f}x** the equal-memory oracle's "
         + (f"(median of {runs}, range {k['min']:.2f}..{k['max']:.2f}; pooled {_x(p['value'], p['lo'], p['hi'])})"
            if n > 1 else f"({_x(p['value'], p['lo'], p['hi'])}, one run)")
         + f", its P50 TPOT {tp['median']:.2f}x and P99 end-to-end latency {e2e['median']:.2f}x")
    if best:
        s += (f"; the best alternative that ran beside it, {LABEL.get(best[0], best[0])}, {best[1]['median']:.1f}x at "
              f"P99 TTFT ({alts[best[0]] and summary['systems'][best[0]]['runs']} of the runs)")
    return s + "."


def render_page(groups: list[tuple[str, list[Run], dict]], command: str, png: str) -> list[str]:
    head_name, head_runs, head = groups[0]
    L = ["# What dropping buys under a burst, over every comparable run (written by benchmarks/burst_value.py --readme)",
         "", f"Command: `{command}` (reads every archived run, `docs/benchmarks/runs/burst_value_*.tar.xz`; "
         "raw data and each run's analysis are in those files).", "", f"![per-run and pooled ratios]({png})", "",
         "## The rule", "", *("The rule" + __doc__.split("The rule", 1)[1]).strip().split("\n"), ""]
    for title, runs, summ in groups:
        L += [f"## {title}", "", _sentence(summ, "Over these runs"), "",
              md_row(["run", "commit", "capacity (req/s)", "systems", "burst batch per engine"]),
              "|---|---|---:|---|---:|"]
        for r in summ["runs"]:
            L.append(md_row([r["name"], r["commit"], "-" if r["capacity"] is None else f"{r['capacity']:.3f}",
                             ", ".join(r["systems"]), "-" if r["batch"] is None else f"{r['batch']:.1f}"]))
        b = summ["bound"]
        L += ["", *table(summ), ""]
        if b["tpot_s"]:
            warm = {s: row.get("goodput_warm") for s, row in summ["systems"].items() if row.get("goodput_warm") is not None}
            L += [f"Goodput's TPOT bound: 1.5x a decode step of {b['step_ms']:.0f} ms at batch {b['batch']:.1f} "
                  f"([{Path(b['scaling_doc']).name}]({Path(b['scaling_doc']).name})); in the warm phase (0.5x capacity) "
                  "the systems met both bounds for " + ", ".join(f"{v:.0%} ({s})" for s, v in warm.items()) + ".", ""]
        per = summ["systems"].get("kunserve", {}).get("ratio", {}).get("ttft_p99", {}).get("per_run") or {}
        if len(per) > 1:
            L += ["kunserve's P99 TTFT over the oracle's, run by run: " + ", ".join(
                f"{n} {v:.2f}x" for n, v in sorted(per.items(), key=lambda x: x[1]) if v is not None) + ".", ""]
    return L


def plot(path: Path, summary: dict, title: str) -> bool:
    from vllm_kunserve.bench.report import pyplot, save_figure

    plt = pyplot(optional=True)
    if plt is None:
        return False
    keys = [f"{m}_p{q}" for m, q in METRICS]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    systems = [s for s in summary["systems"] if s != REF]
    for i, s in enumerate(systems):
        r = summary["systems"][s]["ratio"]
        dx = (i - (len(systems) - 1) / 2) * 0.18
        for j, k in enumerate(keys):
            x = r.get(k) or {}
            per = [v for v in (x.get("per_run") or {}).values() if v is not None and math.isfinite(v)]
            ax.scatter([j + dx] * len(per), per, s=12, alpha=0.5, color=f"C{i}")
            p = x.get("pooled") or {}
            if p.get("value") is not None and math.isfinite(p["value"]):
                lo = p["lo"] if p["lo"] is not None else p["value"]
                hi = p["hi"] if p["hi"] is not None and math.isfinite(p["hi"]) else p["value"]
                ax.errorbar([j + dx], [p["value"]], yerr=[[p["value"] - lo], [hi - p["value"]]], fmt="D", ms=5,
                            color=f"C{i}", capsize=3, label=LABEL.get(s, s) if j == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xticks(range(len(keys)), [k.replace("_p", " P").upper().replace("TTFT", "TTFT").replace("E2E", "E2E") for k in keys])
    ax.set_ylabel("system / equal-memory oracle")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, path)
    return True


README_BEGIN, README_END = "<!-- headline: written by benchmarks/burst_value.py --readme -->", "<!-- /headline -->"


def readme_block(groups: Sequence[tuple[str, object, dict]], page: str, png: str) -> list[str]:
    """The README's block: per headline group (title, runs, summary), its sentence and table."""
    L = [README_BEGIN, "", f"![per-run and pooled ratios to the equal-memory oracle]({png})", ""]
    for title, _, summ in groups:
        L += [f"**{title}** ([all runs and the rule]({page})). " + _sentence(summ, "Over every comparable run"), "",
              *table(summ), ""]
    return L + [README_END]


def splice(text: str, block: list[str]) -> str:
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"README has no {README_BEGIN} ... {README_END} block")
    head, rest = text.split(README_BEGIN, 1)
    return head + "\n".join(block) + rest.split(README_END, 1)[1]


def main(argv: Sequence[str] = ()) -> int:
    """``burst_value.py --readme``: the page over every comparable run, and the README's block."""
    from vllm_kunserve.bench.report import REPO, command, write_json

    groups = collect()
    titled: list[tuple[str, list[Run], dict]] = []
    for k, runs in groups.items():
        runs = sorted(runs, key=lambda r: r.name)
        m = runs[0].meta
        title = (f"{regime_of(m)} on {m.get('cpu')} ({m.get('preset')}, weights {m['weight_share']:.0%}, "
                 f"{m.get('lengths', 'decode')} lengths, burst {burst_x(m):g}x capacity, serving code {k[-1]})")
        titled.append((title, runs, summarize(runs)))
    by_regime: dict[str, list] = defaultdict(list)
    for t in titled:
        by_regime[regime_of(t[1][0].meta)].append(t)
    heads = [max(v, key=lambda t: (len(t[1]), max(r.when for r in t[1])))
             for _, v in sorted(by_regime.items(), key=lambda x: x[0], reverse=True)]
    rest = [t for t in titled if t not in heads]
    name = "burst_value_headline"
    png = raw.DOCS / f"{name}.png"
    plot(png, heads[0][2], heads[0][0])
    write_json(raw.DOCS / f"{name}.json", {"rule": __doc__, "groups": [
        {"title": t, "runs": [r.name for r in rs], "headline": any(t == h[0] for h in heads), "summary": s}
        for t, rs, s in heads + rest]}, indent=1, clean=False, default=str)
    page = raw.DOCS / f"{name}.md"
    page.write_text("\n".join(render_page(heads + rest, command("burst_value.py", ["--readme", *argv]), png.name)) + "\n")
    readme = REPO / "README.md"
    if "--no-readme" not in argv:
        readme.write_text(splice(readme.read_text(), readme_block(heads, f"docs/benchmarks/{page.name}",
                                                                   f"docs/benchmarks/{png.name}")))
    print(page.read_text())
    return 0
