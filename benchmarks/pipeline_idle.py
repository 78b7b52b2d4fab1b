"""Where a pipeline group's stages idle during a burst run, from its workers' step traces.

    python -m benchmarks.pipeline_idle --trace DIR --run RUN_DIR --run-command "kunserve compare ..."
                                       [--name pipeline_idle]

``DIR``: the ``KUNSERVE_PIPELINE_TRACE`` directory of a ``kunserve compare`` run (the workers write
it in parts as their group runs and when it splits);
``RUN_DIR``: that run's output (its requests, for the burst window's TTFT and TPOT). Writes
``docs/benchmarks/NAME.md`` and one archive, ``docs/benchmarks/runs/NAME.tar.xz`` (``benchmarks/common/raw.py``:
the traces themselves, and as ``page.json`` the analysis of ``benchmarks/common/pipeline_trace.py`` and
the distribution of each stage's time).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import raw
from benchmarks.common.burst import read_requests, window_stats
from benchmarks.common.pipeline_trace import CYCLE_KINDS, analyse, load
from benchmarks.common.pooled import QUANTILES, percentile_ratio, read_window, tail
from vllm_kunserve.bench.report import command, cpu_model, md_row, md_table, rel
from vllm_kunserve.workload.records import read_csv
from vllm_kunserve.workload.stats import percentiles

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs


def pcts(xs: list[float]) -> dict:
    """P10 / P50 / P90 / P99 of ``xs`` seconds, in ms ({} when empty)."""
    if not xs:
        return {}
    return {k: round(v * 1e3, 2) for k, v in percentiles(xs, (10, 50, 90, 99)).items() if k.startswith("p")}


def stage_times(events: list) -> dict:
    """A member's own stage per step (the step less its hop) and the peer spans it ran, in ms."""
    steps = [e for e in events if e[0] == "execute_model"]
    hops = sorted((e for e in events if e[0] == "hop"), key=lambda e: e[1])
    own = []
    for e in steps:
        h = next((x for x in hops if e[2] <= x[1] <= e[3]), None)
        if h is not None:
            own.append((e[3] - e[2]) - (h[4] - h[1]))
    spans = [e[3] - e[2] for e in events if e[0] == "span"]
    waits = [e[2] - e[1] for e in events if e[0] == "span"]
    return {"own_stage_ms": pcts(own), "peer_span_ms": pcts(spans), "span_wait_ms": pcts(waits),
            "steps": len(steps), "spans": len(spans)}


def prompt_cost_section(analysis: dict) -> list[str]:
    """What a prompt costs the group: each member's cycles by where prefill tokens ran
    (``pipeline_trace.prefill_cycles``), as a table and a reading; [] for traces without step loads."""
    cyc = {m: r["prefill_cycles"] for m, r in sorted(analysis.items()) if r.get("prefill_cycles")}
    if not cyc:
        return []
    L = ["", "### What a prompt costs the group", "",
         "Each member's cycles (one step's start to the next's, the middle of the group's life) by where "
         "prefill tokens ran meanwhile: in neither member's step, in its own step only, only in a step of "
         "the peer's that overlapped the cycle, or in both. Requests and prefill tokens: the member's "
         "own step's, mean.", ""] + md_table(
        ["member", "cycle", "cycles", "share of time", "P50 (ms)", "P90 (ms)", "core idle", "requests",
         "prefill tokens"], "llrrrrrrr")
    for m, kinds in cyc.items():
        total = sum(c["seconds"] for c in kinds.values()) or 1.0
        for kind in CYCLE_KINDS:
            if kind in kinds:
                c = kinds[kind]
                idle = f"{c['idle']:.0%}" if "idle" in c else "-"
                L.append(md_row([m, kind, c["cycles"], f"{c['seconds'] / total:.0%}", f"{c['cycle_p50_ms']:g}",
                                 f"{c['cycle_p90_ms']:g}", idle, f"{c['requests']:g}", f"{c['prefill_tokens']:g}"]))

    def vals(kind: str, key: str) -> list[float]:
        return [k[kind][key] for k in cyc.values() if kind in k and key in k[kind]]

    def rng(xs: list[float], fmt: str) -> str:
        lo, hi = format(min(xs), fmt), format(max(xs), fmt)
        return lo if lo == hi else f"{lo}-{hi}"

    base, peer = vals("decode only", "cycle_p50_ms"), vals("peer prefill", "cycle_p50_ms")
    if base and peer:
        L += ["", f"Reading: a prompt in one member's step lengthens the *other* member's cycle too, from "
              f"{rng(base, 'g')} ms (no prefill anywhere) to {rng(peer, 'g')} ms at P50: its microbatch "
              "waits behind the prefill at the shared stage. Alone, an engine's step pays only for its "
              "own prompts."]
        lone = vals("own prefill", "idle") + vals("peer prefill", "idle")
        if vals("decode only", "idle") and lone:
            both = vals("both", "idle")
            L[-1] += (f" Each core idled {rng(vals('decode only', 'idle'), '.0%')} of the decode-only cycles' "
                      f"time and {rng(lone, '.0%')} of the cycles where one member alone prefilled"
                      + (f" ({rng(both, '.0%')} where both did: two balanced microbatches)" if both else "")
                      + ".")
    return L


def _s(v: float | None) -> str:
    """Seconds for a table cell ("-" where there are none)."""
    return "-" if v is None else f"{v:.3f}"


def _timeline(path: Path) -> dict[int, dict]:
    """A run's timeline.csv by second."""
    return {int(float(r["second"])): r for r in read_csv(path)}


def _num(r: dict | None, key: str) -> float | None:
    v = (r or {}).get(key)
    return float(v) if v not in (None, "") else None


def against(run: Path, system: str, other: str, window: tuple[float, float]) -> dict:
    """``system`` (a kunserve system) against ``other`` on the same arrivals, repetition by
    repetition (same seed, same trace): the burst window's seconds split at the second ``system``'s
    engines were first grouped in that repetition (``kunserve:grouped_instances`` >= 2). In each part:
    both systems' mean running requests and output tokens/s over the same seconds, and the pooled
    TTFT percentiles (with the ratio's bootstrap interval) of the requests arriving in it. The part
    before the group is the control: two independent engines on each side."""
    lo, hi = window
    parts: dict[str, dict] = {"before the group": {}, "grouped": {}}
    reqs: dict[str, dict[str, list]] = {p: {system: [], other: []} for p in parts}
    joins = {}
    for f in sorted(run.glob(f"{system}/rep*/timeline.csv")):
        rep = f.parent.name
        g = f.parent.parent.parent / other / rep
        if not (g / "timeline.csv").exists():
            continue
        mine, theirs = _timeline(f), _timeline(g / "timeline.csv")
        grouped = [s for s, r in sorted(mine.items()) if (_num(r, "kunserve:grouped_instances") or 0) >= 2]
        join = next((s for s in grouped if s >= lo), None)
        joins[rep] = join
        k = int(rep.removeprefix("rep")) if rep.removeprefix("rep").isdigit() else 0
        arrived = {system: read_window(f.parent / "requests.csv", k, lo, hi),
                   other: read_window(g / "requests.csv", k, lo, hi)}
        for part, (a, b) in (("before the group", (lo, join if join is not None else hi)),
                             ("grouped", (join, hi) if join is not None else (hi, hi))):
            secs = [s for s in range(int(a), int(b)) if s in mine and s in theirs]
            for name, tl in ((system, mine), (other, theirs)):
                acc = parts[part].setdefault(name, {"seconds": 0, "running": 0.0, "tokens": 0.0})
                acc["seconds"] += len(secs)
                acc["running"] += sum(_num(tl[s], "running") or 0 for s in secs)
                acc["tokens"] += sum(_num(tl[s], "output_tokens") or 0 for s in secs)
                reqs[part][name] += [r for r in arrived[name] if a <= r.arrival_s < b]
    out: dict = {"joins_s": joins, "parts": {}}
    for part, by in parts.items():
        if not by or not by[system]["seconds"]:
            continue
        row = {}
        for name, acc in by.items():
            n = acc["seconds"]
            row[name] = {"seconds": n, "running": round(acc["running"] / n, 2), "tokens_per_s": round(acc["tokens"] / n, 1),
                         "requests": len(reqs[part][name]),
                         "ttft": {k: v["value"] for k, v in tail(reqs[part][name]).items()}}
        a_, b_ = row[system], row[other]
        row["tokens_ratio"] = round(a_["tokens_per_s"] / b_["tokens_per_s"], 3) if b_["tokens_per_s"] else None
        row["running_ratio"] = round(a_["running"] / b_["running"], 3) if b_["running"] else None
        row["ttft_ratio"] = {f"p{q:g}": percentile_ratio(reqs[part][system], reqs[part][other], q)
                            for q in QUANTILES}
        out["parts"][part] = row
    return out


def against_section(cmp: dict, system: str, other: str) -> list[str]:
    """The doc's section for :func:`against`."""
    if not cmp.get("parts"):
        return []
    joins = [v for v in cmp["joins_s"].values() if v is not None]

    def iv(r: dict) -> str:
        return "-" if r["value"] is None else f"{r['value']:.2f} ({r['lo']:.2f}..{r['hi']:.2f})"
    L = ["", f"## `{system}` against `{other}` on the same arrivals", "",
         f"Each repetition's burst window split at the second `{system}`'s engines were first grouped "
         f"({', '.join(f'{v:g}' for v in joins) or 'never'} s); over the same seconds of the same repetition "
         f"of `{other}`: mean running requests and output tokens/s (the front end's timeline), and the TTFT of "
         "the requests arriving in each part, pooled over repetitions (ratio with its bootstrap 95% interval).",
         ""] + md_table(["part", "system", "seconds", "running", "tokens/s", "requests", "TTFT P50", "TTFT P90",
                         "TTFT P99"], "llrrrrrrr")
    for part, row in cmp["parts"].items():
        for name in (system, other):
            r = row[name]
            L.append(md_row([part, name, r["seconds"], f"{r['running']:g}", f"{r['tokens_per_s']:g}", r["requests"],
                             *(_s(r["ttft"][k]) for k in ("p50", "p90", "p99"))]))
        L.append(md_row([part, "ratio", "", f"{row['running_ratio']:g}" if row["running_ratio"] else "-",
                         f"{row['tokens_ratio']:g}" if row["tokens_ratio"] else "-", "",
                         *(iv(row["ttft_ratio"][k]) for k in ("p50", "p90", "p99"))]))
    g = cmp["parts"].get("grouped")
    b = cmp["parts"].get("before the group")
    if g and b and g["tokens_ratio"] and b["tokens_ratio"]:
        L += ["", f"Reading: before the group both sides are two independent engines, and `{system}` put out "
              f"{b['tokens_ratio']:.2f}x `{other}`'s tokens/s. Grouped, with {g['running_ratio']:.2f}x its "
              f"running requests, it put out {g['tokens_ratio']:.2f}x: the pipeline's cost in output, and "
              f"requests arriving meanwhile waited {g['ttft_ratio']['p99']['value']:.2f}x as long at P99."]
    return L


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="the KUNSERVE_PIPELINE_TRACE directory")
    ap.add_argument("--run", required=True, help="the compare run's output directory")
    ap.add_argument("--run-command", required=True, help="the command that made the run (recorded)")
    ap.add_argument("--system", default="kunserve")
    ap.add_argument("--against", default="", metavar="SYSTEM",
                    help="a system of the same run (e.g. oracle-equal): its throughput and TTFT over the same seconds")
    ap.add_argument("--window", default="60,100", help="the burst window's arrivals, seconds: LO,HI")
    ap.add_argument("--name", default="pipeline_idle")
    ap.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks"))
    a = ap.parse_args(argv)
    try:
        lo, hi = (float(x) for x in a.window.split(","))
        if not 0 <= lo < hi:
            raise ValueError
    except ValueError:
        ap.error(f"--window {a.window!r}: LO,HI seconds with 0 <= LO < HI")
    files = sorted(Path(a.trace).glob("*.json"))
    groups = load(files)
    if not groups:
        ap.error(f"--trace {a.trace}: no worker traces (*.json) there")
    reqs = sorted(Path(a.run).glob(f"{a.system}/rep*/requests.csv"))
    window = {p.parent.name: window_stats(read_requests(p), lo, hi) for p in reqs}
    cmd = command("pipeline_idle.py").replace(shlex.quote(a.run_command), "RUN_COMMAND")
    out = {"command": cmd, "run_command": a.run_command, "window": [lo, hi],
           "groups": [{"analysis": analyse(g), "stages": {m: stage_times(ev) for m, ev in g.items()}} for g in groups],
           "requests": window}
    if a.against:
        if not list(Path(a.run).glob(f"{a.against}/rep*/timeline.csv")):
            ap.error(f"--against {a.against}: no {a.against}/rep*/timeline.csv under --run {a.run}")
        out["against"] = against(Path(a.run), a.system, a.against, (lo, hi))
    docs = Path(a.docs)
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            shutil.copy(f, Path(tmp) / f.name)
        archive = raw.pack(Path(tmp), a.name, out, into=docs / "runs")
    L = ["# Where a pipeline group's stages idle (written by benchmarks/pipeline_idle.py)", "",
         f"Command: `{out['command']}`, where `RUN_COMMAND` is the run it reads (its workers wrote their traces "
         "in parts as their group ran and when it split):", "", "```", a.run_command, "```", "",
         "Each member of a 2-engine group runs its own requests as one microbatch through both stages (its kept "
         "layers here, the rest as a span on the peer), so two microbatches share two stages. A stage idles when "
         "both microbatches are at the other one: a *collision* (this member's microbatch waits at the peer's "
         "stage behind the peer's own), *between steps* (this member's engine core is outputting and scheduling "
         "and the peer's microbatch is not here) or *in transit* (both between stages). From the workers' traces "
         "(`KUNSERVE_PIPELINE_TRACE`, analysed by `benchmarks/common/pipeline_trace.py`, the middle 60% of "
         "each group's life).", "", f"Machine: {cpu_model()}; the engines' threads and cores: those of the run above "
         "(its `--env` settings, or the regime its page states).", ""]
    for k, g in enumerate(out["groups"], 1):
        L += [f"## Group {k}", ""] + md_table(
            ["member", "steps", "cycle P50 (ms)", "own stage", "peer spans", "sampling", "idle", "idle: collision",
             "between steps", "in transit"], "l" + "r" * 9)
        for m, r in sorted(g["analysis"].items()):
            c, i = r["core"], r.get("idle_by_cause", {})
            L.append(md_row([m, r["steps"], r["cycle_ms"], *(f"{x:.1%}" for x in (
                c["own_step"], c["peer_spans"], c["sampling"], c["idle"], i.get("collision", 0),
                i.get("between steps", 0), i.get("in transit", 0)))]))
        L += ["", "Shares of each member's core over the window. Stage times (ms, P10 / P50 / P90 / P99 over the "
              "group's life): a member's own stage per step, the peers' spans it ran, and how long those spans "
              "waited for its core.", ""]
        cell = lambda d: " / ".join(f"{v:g}" for v in d.values()) if d else "-"  # noqa: E731
        L += md_table(["member", "own stage", "peer span", "span wait"], "llll",
                      ([m, cell(s["own_stage_ms"]), cell(s["peer_span_ms"]), cell(s["span_wait_ms"])]
                       for m, s in sorted(g["stages"].items())))
        rows = list(g["analysis"].values())
        st = list(g["stages"].values())
        if rows and st and all(x["own_stage_ms"] for x in st):
            idle = sum(r["core"]["idle"] for r in rows) / len(rows)
            coll = sum(r.get("idle_by_cause", {}).get("collision", 0) for r in rows) / len(rows)
            spread = [x["own_stage_ms"]["p90"] / x["own_stage_ms"]["p50"] for x in st]
            L += ["", f"Reading: each core idled {idle:.0%} of the group's life, {coll:.0%} in collisions. A member's "
                  f"own stage varies from step to step (P90 / P50: {min(spread):.2f}x-{max(spread):.2f}x; its batch "
                  "and its prefill chunk change every step), and with one microbatch per member the "
                  "shorter of two stages that should overlap waits for the longer one."]
        L += prompt_cost_section(g["analysis"])
        L.append("")
    L += against_section(out.get("against", {}), a.system, a.against) + ([""] if a.against else [])
    L += ["## The run's burst window", "",
          f"Arrivals in [{lo:g}, {hi:g}) s of the `{a.system}` runs: P50 / P99 TTFT and P50 TPOT (s).", ""]
    L += md_table(["rep", "requests", "failed", "TTFT P50", "TTFT P99", "TPOT P50"], "lrrrrr",
                  ([rep, w["n"], w["failed"], _s(w["ttft_p50"]), _s(w["ttft_p99"]), _s(w["tpot_p50"])]
                   for rep, w in window.items()))
    L += ["", f"Raw data: `{rel(archive)}` (this analysis as `page.json`, and the workers' traces: "
          "`python -m benchmarks.common.pipeline_trace` reads them once unpacked)."]
    (docs / f"{a.name}.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
