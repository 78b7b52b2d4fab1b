"""Cluster drop under a burst: stock vs kunserve vs oracle (and a static PP=2 group) on 2 engines.

1. The batch-scaling table of this machine (``benchmarks/batch_scaling.py``): decode step at batch
   1 / 4 / 16 / 64 with one compute thread and the model preset the CPU suits; the run is refused
   (``--force`` overrides, and the doc says so) where a batch of 16 costs more than 3x a batch of 1.
2. From that table, stock's capacity: the decode batch its KV holds per engine (KV tokens over a
   request's mid-life length), times the tokens per second that batch decodes, over a request's
   output length, for both engines. The arrival phases are set from it: a warm start of
   ``--warm-s`` at ``--warm-share`` of that capacity, then a burst of ``--burst-s`` at
   ``--burst-x`` times it.
3. ``kunserve compare --instances 2``: 2-engine clusters behind ``kunserve serve`` (least-work
   dispatch), each engine pinned to its own core (``KUNSERVE_ENGINE_CPUS=0|1``, one compute thread)
   at niceness 5 (``KUNSERVE_ENGINE_NICE``), with vLLM's shared-memory queue readers sleeping on
   the writer's signal instead of spinning (``KUNSERVE_SHM_WAIT_MS=1``, ``--shm-wait-ms``: each
   engine core otherwise spins ~0.35 of a core away) and the replay client at real-time priority
   (``--client-realtime``, on by default: at normal priority its loop waited up to seconds for a
   core, and it sent late): stock vLLM, kunserve (cluster drop), static (one pipeline group from the start:
   an alternative configuration without transition cost, not a bound: kunserve can beat it) and the oracle (stock with 10x KV), ``--repeat`` interleaved
   repetitions on one workload: the Azure LLM conversation trace's (2023) arrival times, re-timed
   into the phases, with a synthetic decode-heavy length mix (``--prompt-len`` prompts,
   ``--output-len``..``--output-len-max`` outputs); ``--mix prefill`` is the negative control
   (long prompts, short outputs: prefill-bound, KV is not the limit).
4. docs/benchmarks/cluster_burst[_prefill].{md,json} and cluster_burst[_prefill]/: per-repetition
   paired ratios of P99 TTFT over the burst window (arrivals in the burst and up to one output's
   decode after it) and P50 TPOT, their spread, the client's send lag (a repetition where any
   request was sent > 50 ms late is reported and kept out of the ratios), the client's and the
   servers' CPU share, and the timeline picture (every system stacked on one time axis: KV
   demand and capacity, layers held per engine, each request's TTFT at its arrival time).

    python benchmarks/cluster_burst.py [--repeat 5] [--mix decode|prefill] [--reuse-scaling] [--force]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from vllm_kunserve.bench.burst import (add_phase_args, dispatch_split, group_times, kunserve_config, read_requests,
                                       run_files, scaling_table, window_stats)
from vllm_kunserve.bench.report import command as cmd
from vllm_kunserve.bench.report import md_row, md_table, pyplot, save_figure, write_json
from vllm_kunserve.workload.records import read_csv

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
DOCS = ROOT / "docs" / "benchmarks"
TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"
SYSTEMS = ("vllm", "kunserve", "static", "oracle")
LABEL = {"vllm": "stock vLLM", "kunserve": "kunserve (cluster drop)", "static": "static PP=2 group",
         "oracle": "oracle (10x KV)"}
#: decode: KV is the limit; prefill: the negative control (long prompts, short outputs)
MIXES = {"decode": {"prompt_len": 64, "output_len": 256, "output_len_max": 384},
         "prefill": {"prompt_len": 256, "output_len": 16, "output_len_max": 32}}


def interp_step_ms(rows: list[dict], batch: float) -> float:
    """Decode step at ``batch`` by linear interpolation in the measured table (clamped)."""
    pts = sorted((r["batch"], r["step_ms"]) for r in rows)
    if batch <= pts[0][0]:
        return pts[0][1]
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if batch <= b1:
            return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
    return pts[-1][1] * batch / pts[-1][0]


def stock_capacity(scaling: dict, kv_tokens: int, mix: dict, prefill_tps: float = 480.0) -> dict:
    """Requests/s two stock engines sustain: each decodes a batch of (KV tokens / a request's
    mid-life length) at the measured step time; prefill time per request is added (one thread
    does both)."""
    out = (mix["output_len"] + mix["output_len_max"]) / 2
    batch = max(1.0, kv_tokens / (mix["prompt_len"] + out / 2))
    step = interp_step_ms(scaling["rows"], batch) / 1e3
    per_req_s = out * step / batch + mix["prompt_len"] / prefill_tps  # engine seconds per request
    return {"batch": round(batch, 2), "step_ms": round(step * 1e3, 2), "mean_output": out,
            "req_per_s": round(2 / per_req_s, 4)}


def compare_argv(model: Path, dtype: str, out: Path, a: argparse.Namespace, mix: dict, phases: str,
                 systems: list[str]) -> list[str]:
    return ["compare", "--model", str(model), "--instances", "2", "--dispatch", "least-work",
            "--systems", ",".join(systems), "--repeat", str(a.repeat),
            "--kunserve-config", json.dumps(kunserve_config(a.kv_cap_x)), "--oracle-kv-multiplier", str(a.oracle_x),
            "--kv-capacity-tokens", str(a.kv_tokens), "--block-size", "32", "--dtype", dtype,
            "--max-model-len", "1024", "--engine-arg=--enforce-eager",
            "--env", "KUNSERVE_ENGINE_CPUS=0|1", "--env", "OMP_NUM_THREADS=1", "--env", "KUNSERVE_ENGINE_NICE=5",
            "--trace", str(a.trace), "--format", "azure", "--window-offset", str(a.window_offset),
            "--synthetic-lengths", "--prompt-len", str(mix["prompt_len"]), "--output-len", str(mix["output_len"]),
            "--output-len-max", str(mix["output_len_max"]), "--phases", phases, "--seed", "1",
            "--no-progress", "--out", str(out)] + (["--client-realtime"] if a.client_realtime else []) + \
        [f"--variant={v}" for v in a.variant] + \
        (["--env", "KUNSERVE_MLOCK=1"] if a.mlock else []) + \
        ["--env", f"KUNSERVE_SHM_WAIT_MS={a.shm_wait_ms:g}"]   # 0 too: engines default to 1 on a CPU host


# ------------------------------------------------------------------------------------------ analysis
# (the window's statistics, dispatch split and grouping times: vllm_kunserve/bench/burst.py)
def paired(out: Path, systems: list[str], reps: int, window: tuple[float, float]) -> list[dict]:
    rows = []
    for k in range(1, reps + 1):
        st = {}
        for s in systems:
            f = out / s / f"rep{k}" / "requests.csv"
            if f.exists():
                st[s] = window_stats(read_requests(f), *window)
        if not st:
            continue
        s, o = st.get("vllm", {}), st.get("oracle", {})
        row = {"rep": k, "window": st, "valid": all(v["late_sends"] == 0 for v in st.values()),
               "failed": {n: v["failed_all"] for n, v in st.items()}}

        def r(a, b):
            return a / b if a is not None and b else None
        row["stock_over_oracle"] = r(s.get("ttft_p99"), o.get("ttft_p99"))
        uses = {"stock_over_oracle": ["vllm", "oracle"]}
        for n in st:
            if n in ("vllm", "oracle"):
                continue
            kp = st[n]["ttft_p99"]
            row[f"{n}_over_stock"] = r(kp, s.get("ttft_p99"))
            row[f"{n}_over_oracle"] = r(kp, o.get("ttft_p99"))
            gap = (s["ttft_p99"] - o["ttft_p99"] if s.get("ttft_p99") is not None and o.get("ttft_p99") is not None
                   else None)
            row[f"{n}_gap_closed"] = (s["ttft_p99"] - kp) / gap if gap and gap > 0 and kp is not None else None
            row[f"{n}_tpot_p50_over_stock"] = r(st[n]["tpot_p50"], s.get("tpot_p50"))
            uses.update({f"{n}_over_stock": ["vllm", n], f"{n}_over_oracle": [n, "oracle"],
                         f"{n}_gap_closed": ["vllm", n, "oracle"], f"{n}_tpot_p50_over_stock": ["vllm", n]})
        if "static" in st:  # the group without transition cost: how each dynamic system compares with it
            for n in st:
                if n not in ("vllm", "oracle", "static"):
                    row[f"{n}_over_static"] = r(st[n]["ttft_p99"], st["static"]["ttft_p99"])
                    row[f"{n}_tpot_p50_over_static"] = r(st[n]["tpot_p50"], st["static"]["tpot_p50"])
                    uses.update({f"{n}_over_static": [n, "static"], f"{n}_tpot_p50_over_static": [n, "static"]})
        # a ratio is kept out where a run it compares had a late client (a late run, not the repetition)
        row["ok"] = {k: all(st.get(x, {}).get("late_sends", 0) == 0 for x in xs) for k, xs in uses.items()}
        rows.append(row)
    return rows


def tail_requests(out: Path, systems: list[str], reps: int, window: tuple[float, float], top: int = 3) -> dict:
    """Per system and repetition, the window's largest TTFTs with their arrival times, and how many
    requests arrived within 1 s either side of the largest one's arrival: with some 50 requests in the
    window, P99 lies between the two largest TTFTs, so it is set by a handful of requests."""
    lo, hi = window
    res: dict = {}
    for s, k, f in run_files(out, systems, reps, "requests.csv"):
        rows = [r for r in read_requests(f) if lo <= float(r["arrival_s"]) < hi]
        done = sorted(((float(r["ttft_s"]), float(r["arrival_s"])) for r in rows if r["ok"] == "1" and r["ttft_s"]),
                      reverse=True)
        if not done:
            continue
        t_top = done[0][1]
        res.setdefault(s, {})[k] = {
            "n": len(done), "top": [[round(t, 2), round(at, 2)] for t, at in done[:top]],
            "around_top": sum(1 for r in rows if abs(float(r["arrival_s"]) - t_top) <= 1.0)}
    return res


#: the per-repetition sections: (title, what the table shows)
GROUPED_TEXT = ("When the engines were grouped",
                "The first second each system's engines were in a pipeline group and the share of the burst "
                "window's seconds they were (the front end's `kunserve:grouped_instances`). `static` is grouped "
                "from the start.")
SPLIT_TEXT = ("Dispatch split",
              "The window's arrivals the front end gave each engine (engine 0 / engine 1 ...; its "
              "`kunserve:dispatched_total` counters). In a pipeline group each member's requests are its own "
              "microbatch through both stages, so an uneven split makes one microbatch the longer and sets the "
              "group's cycle (policy/dispatch/least_work.py: inside a group least-work balances requests).")
TAILS_TEXT = ("Which requests set the P99",
              "The window's largest TTFTs (s) with their arrival times (s, trace time), per system and repetition, "
              "and the requests arriving within 1 s either side of the largest one's: with about 50 requests in the "
              "window, P99 lies between the largest TTFT and the second, so a few requests arriving together set it.")


def rep_section(title_text: tuple[str, str], per_system: dict, cell) -> list[str]:
    """A doc section: a title, its text and a table of one row per repetition, one column per system
    (``per_system``: system -> repetition -> value; ``cell`` formats a value, "-" where none); none
    without values."""
    if not per_system:
        return []
    title, text = title_text
    reps = sorted({k for v in per_system.values() for k in v})
    return [f"## {title}", "", text, ""] + md_table(
        ["rep", *per_system], "r" + "l" * len(per_system),
        ([k, *("-" if per.get(k) is None else cell(per[k]) for per in per_system.values())] for k in reps)) + [""]


def group_section(groups: dict, rows: list[dict]) -> list[str]:
    L = rep_section(GROUPED_TEXT, groups, lambda g: f"{g['first_s']:g} s ({f2(g['window_share'])} of the window)")
    ks, st = groups.get("kunserve", {}), groups.get("static", {})
    same = {(tuple(v.get("layers") or ()), tuple(v.get("kv_blocks") or ())) for v in [*ks.values(), *st.values()]}
    if ks and st and len(same) == 1 and all((v.get("window_share") or 0) >= 1 for v in [*ks.values(), *st.values()]):
        p99 = spread(rows, "kunserve_over_static")
        tpot = spread(rows, "kunserve_tpot_p50_over_static")
        layers, blocks = next(iter(same))
        L += ["kunserve grouped before the burst and stayed grouped through the window in every repetition, "
              f"holding what static holds (layers per engine {list(layers)}, KV blocks {list(blocks)}): inside the "
              "window it ran the static group's configuration. kunserve / static there, paired per repetition: "
              f"P99 TTFT {f2(p99.get('median'))} ({f2(p99.get('min'))}..{f2(p99.get('max'))}), P50 TPOT "
              f"{f2(tpot.get('median'))} ({f2(tpot.get('min'))}..{f2(tpot.get('max'))}).", ""]
    return L


def dispatch_section(split: dict) -> list[str]:
    return rep_section(SPLIT_TEXT, split, lambda v: " / ".join(map(str, v)))


def tail_section(tails: dict) -> list[str]:
    return rep_section(TAILS_TEXT, tails, lambda t: ", ".join(f"{x:.2f} @{at:.1f}" for x, at in t["top"])
                       + f" ({t['around_top']} within 1 s)")


def kept(r: dict, key: str) -> bool:
    """Whether ``r[key]`` counts: every run the ratio compares sent all its requests on time."""
    return r.get(key) is not None and r.get("ok", {}).get(key, r["valid"])


def spread(rows: list[dict], key: str) -> dict:
    v = [r[key] for r in rows if kept(r, key)]
    if not v:
        return {"n": 0}
    return {"n": len(v), "median": statistics.median(v), "min": min(v), "max": max(v)}


def verdict(rows: list[dict], systems: list[str], harsh: bool = False) -> list[dict]:
    """Each issue-13 target: the median over valid repetitions, met or not, and whether every
    valid repetition meets it. ``harsh``: kunserve's KV growth is capped below the burst's peak, and
    the target is that drop + vLLM's own fallback still beats stock."""
    def summary(v):
        return f"{statistics.median(v):.2f} ({min(v):.2f}..{max(v):.2f}, n={len(v)})" if v else "-"

    def one(target, key, ok):
        v = [r[key] for r in rows if kept(r, key)]
        every = [r[key] for r in rows if r.get(key) is not None]
        out = {"target": target, "all_reps": summary(every)}   # late-client repetitions included
        if not v:
            return {**out, "measured": "no repetition whose runs were all on time", "met": False, "every_rep": None}
        med = statistics.median(v)
        return {**out, "measured": summary(v), "met": ok(med), "every_rep": all(ok(x) for x in v),
                "reps_met": [sum(1 for x in v if ok(x)), len(v)]}
    out = [one("stock P99 TTFT >= 3x the oracle's (the gap is real)", "stock_over_oracle", lambda x: x >= 3)]
    if "kunserve" in systems:
        out += [one("the peak exceeds what dropping frees: drop + fallback still beats stock (kunserve / stock "
                    "P99 TTFT < 1)", "kunserve_over_stock", lambda x: x < 1)] if harsh else [
            one("kunserve closes >= 80% of that gap", "kunserve_gap_closed", lambda x: x >= 0.8),
            one("kunserve P99 TTFT <= 1.3x the oracle's", "kunserve_over_oracle", lambda x: x <= 1.3)]
        out.append(one("kunserve P50 TPOT <= 1.3x stock's", "kunserve_tpot_p50_over_stock", lambda x: x <= 1.3))
    failed = sum(sum(r["failed"].values()) for r in rows)
    out.append({"target": "zero requests lost (every request of every repetition and system)",
                "measured": f"{failed} failed", "met": failed == 0, "every_rep": None})
    return out


def harsh(a: argparse.Namespace) -> bool:
    """The harsher window: kunserve may grow its KV less than the oracle holds."""
    return a.kv_cap_x < a.oracle_x


def shortfall(out: Path, systems: list[str], repeat: int) -> dict:
    """Per repetition, the largest KV shortfall (blocks no drop plan could free) kunserve's front end
    reported (``kunserve:kv_shortfall_blocks``, scraped into the run's timeline), and the seconds it was > 0."""
    res = {}
    if "kunserve" not in systems:
        return res
    for k in range(1, repeat + 1):
        path = out / "kunserve" / f"rep{k}" / "timeline.csv"
        if not path.exists():
            continue
        vals = [float(v) for r in read_csv(path) for c, v in r.items()
                if c.startswith("kunserve:kv_shortfall_blocks") and v not in ("", None)]
        res[f"rep{k}"] = {"peak_blocks": max(vals, default=None), "seconds": sum(1 for v in vals if v > 0)}
    return res


# ------------------------------------------------------------------------------------------ picture
def kv_demand(rows: list[dict], times: list[float]) -> list[float]:
    """KV tokens the requests needed at each time, from the client's own timings: a request
    arrived but without its first token needs its prompt (queued); afterwards its prompt plus the
    tokens generated so far (spread evenly between its first and last token); none once done."""
    out = []
    for t in times:
        need = 0.0
        for r in rows:
            a = float(r["arrival_s"])
            if t < a or not r["ttft_s"] or not r["e2e_s"]:
                continue
            t1, e, n = a + float(r["ttft_s"]), a + float(r["e2e_s"]), int(r["output_tokens"] or 0)
            if t < t1:
                need += int(r["prompt_len"])
            elif t < e:
                need += int(r["prompt_len"]) + n * (t - t1) / max(e - t1, 1e-9)
        out.append(need)
    return out



def timeline_png(out: Path, systems: list[str], rep: int, phases: list[tuple[float, float]], path: Path) -> bool:
    plt = pyplot(optional=True)
    if plt is None:
        return False
    import matplotlib.ticker
    fig, axes = plt.subplots(2 * len(systems), 1, figsize=(10, 3.1 * len(systems)), sharex=True,
                             gridspec_kw={"height_ratios": [1.3, 1] * len(systems)})
    burst_lo = phases[0][0]
    burst_hi = burst_lo + sum(d for d, _ in phases[1:])
    tmax = 0.0
    for k, s in enumerate(systems):
        d = out / s / f"rep{rep}"
        if not (d / "timeline.csv").exists():
            continue
        tl = read_csv(d / "timeline.csv")
        req = read_requests(d / "requests.csv")
        t = [float(r["second"]) for r in tl]
        tmax = max(tmax, max(t, default=0))

        def col(prefix):
            vals = []
            for r in tl:
                xs = [float(v) for c, v in r.items() if c.startswith(prefix) and v not in ("", None)]
                vals.append(sum(xs) if xs else float("nan"))
            return vals
        cap = col("kunserve:kv_blocks_total{")
        if all(v != v for v in cap):
            cap = col("kunserve:engine_kv_blocks{")
        ax = axes[2 * k]
        ax.plot(t, [c * 32 for c in cap], color="tab:blue", label="KV capacity (tokens, both engines)")
        ax.plot(t, kv_demand(req, t), color="tab:orange", label="KV demand (tokens: held + queued prompts)")
        ax.axvspan(burst_lo, burst_hi, color="0.9", zorder=0)
        ax.set_ylabel("tokens")
        ax.set_title(LABEL.get(s, s), loc="left", fontsize=10)
        layers = [c for c in tl[0] if c.startswith("kunserve:layers_held{")] if tl else []
        if layers:
            ax2 = ax.twinx()
            for c in sorted(layers):
                ax2.step(t, [float(r[c] or "nan") for r in tl], where="post", lw=1, ls="--",
                         label="layers held, " + c.split("{")[1].rstrip("}"))
            ax2.set_ylabel("layers held")
            ax2.set_ylim(0, 13)
            ax2.legend(loc="upper right", fontsize=7)
        ax.legend(loc="upper left", fontsize=7)
        ax = axes[2 * k + 1]
        ok = [r for r in req if r["ok"] == "1" and r["ttft_s"]]
        bad = [r for r in req if r["ok"] != "1"]
        ax.scatter([float(r["arrival_s"]) for r in ok], [float(r["ttft_s"]) for r in ok], s=6, color="tab:green",
                   label="TTFT at arrival")
        if bad:
            ax.scatter([float(r["arrival_s"]) for r in bad], [0.01] * len(bad), s=12, marker="x", color="red",
                       label="failed")
        ax.axvspan(burst_lo, burst_hi, color="0.9", zorder=0)
        ax.set_yscale("log")
        # 1-2-5 ticks: a run whose TTFTs stay within one decade (0.3-1 s) still gets labelled ticks
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel("TTFT (s)")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("seconds since the replay started (grey: the burst)")
    axes[-1].set_xlim(0, tmax)
    save_figure(fig, path, dpi=90)
    return True


# ------------------------------------------------------------------------------------------ doc
def f2(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def host_facts(res: dict, systems: list[str]) -> dict:
    """Per system, per repetition: the client's stalls (no token of any stream for >= 0.5 s while >= 2
    requests were in flight) and what the host did meanwhile (bench/hostwatch.py)."""
    out = {}
    for s in systems:
        out[s] = []
        for run in res["runs"].get(s, []):
            st = run.get("stalls") or []
            h = (run.get("server") or {}).get("host") or {}
            out[s].append({"stalls": len(st), "stall_s": round(sum(x["gap_s"] for x in st), 2),
                           "longest_s": max((x["gap_s"] for x in st), default=0.0),
                           "majfaults": h.get("majfaults"), "majfaults_in_stalls": h.get("majfaults_in_stalls"),
                           "steal_s": h.get("steal_s"), "iowait_s": h.get("iowait_s"),
                           "mlock": (run.get("server") or {}).get("env", {}).get("KUNSERVE_MLOCK") == "1",
                           "client_gc_max_s": max((p["seconds"] for p in (run.get("client_gc") or {}).get(
                               "longest", [])), default=None),
                           "frontend_gc_max_s": max((p["seconds"] for p in ((run.get("server") or {}).get(
                               "frontend_gc") or {}).get("longest", [])), default=None),
                           "frontend_gc_frozen": _frozen((run.get("server") or {}).get("frontend_gc")),
                           "stalls_with_gc": [h.get("stalls_with_client_gc"), h.get("stalls_with_frontend_gc")],
                           "late_sends": (run.get("server") or {}).get("late_sends"),
                           "loop_late_max_s": [_loop_max(run.get("client_loop")),
                                               _loop_max((run.get("server") or {}).get("frontend_loop"))]})
    return out


def _loop_max(loop: dict | None) -> float | None:
    """The latest wake-up of an event loop (runtime.looplag.LoopLag's view); None where it was not watched."""
    if not loop:
        return None
    return max((e["late_s"] for e in loop.get("longest", [])), default=0.0)


def _late_causes(late: list[dict] | None) -> str:
    """'n (cause k, ...)' for the client's late sends; '-' where they were not attributed."""
    if late is None:
        return "-"
    causes: dict[str, int] = {}
    for r in late:
        causes[r["cause"]] = causes.get(r["cause"], 0) + 1
    return f"{len(late)}" + (" (" + ", ".join(f"{c} {n}" for c, n in sorted(causes.items())) + ")" if late else "")


def _frozen(front_gc: dict | None) -> bool | None:
    """Whether the front end froze its startup heap (runs before the count was reported: a flag)."""
    if not front_gc:
        return None
    return bool(front_gc["frozen_objects"]) if "frozen_objects" in front_gc else front_gc.get("frozen")


def host_section(host: dict, systems: list[str]) -> list[str]:
    if not any(host.get(s) for s in systems):
        return []
    L = ["## Stalls and the host", "",
         "A stall: no token of any stream reached the client for >= 0.5 s while >= 2 requests were in flight "
         "(client timings). Major faults: the machine's `pgmajfault` over the run and inside the stalls; steal and "
         "iowait: CPU seconds over the run (`host.csv` per run, sampled every 0.25 s by `bench/hostwatch.py`). GC: "
         "the longest pause of Python's collector in the replay client and in the front end (`runtime/gcpause.py`; "
         "frozen: the front end froze its startup heap), and how many stalls a pause >= 50 ms of each overlaps. "
         "Loop late: the latest wake-up of the client's and the front end's event loop (a 10 ms timer, "
         "`runtime/looplag.py`); late sends: requests sent >= 50 ms after their arrival time, by what the client's loop "
         "thread did meanwhile (busy: it ran; no core: runnable, waiting for a CPU; blocked: neither; unseen: "
         "the loop woke on time).", ""] + md_table(
        ["system", "rep", "stalls", "stalled s", "longest s", "major faults (in stalls)", "steal s", "iowait s", "mlock",
         "GC max s client / front end", "front end heap frozen", "stalls with a GC pause client / front end",
         "loop late max s client / front end", "late sends (cause)"], "lrrrrrrrlrlrrl")
    for s in systems:
        for k, h in enumerate(host.get(s, []), 1):
            mf = "-" if h["majfaults"] is None else f"{h['majfaults']:.0f} ({h['majfaults_in_stalls']:.0f})"
            L.append(f"| {s} | {k} | {h['stalls']} | {h['stall_s']:.2f} | {h['longest_s']:.2f} | {mf} | "
                     f"{h['steal_s'] if h['steal_s'] is not None else '-'} | "
                     f"{h['iowait_s'] if h['iowait_s'] is not None else '-'} | {'yes' if h['mlock'] else 'no'} | "
                     f"{f2(h.get('client_gc_max_s'))} / {f2(h.get('frontend_gc_max_s'))} | "
                     f"{ {True: 'yes', False: 'no'}.get(h.get('frontend_gc_frozen'), '-')} | "
                     f"{' / '.join('-' if x is None else str(x) for x in h.get('stalls_with_gc', [None, None]))} | "
                     f"{' / '.join(f2(x) for x in h.get('loop_late_max_s', [None, None]))} | "
                     f"{_late_causes(h.get('late_sends'))} |")
    return L + [""]


def pipeline_section(pipe: dict, systems: list[str]) -> list[str]:
    """Where each grouped engine's pipeline hops spent their time (its latest group, as
    ``/kunserve/status`` had it at the run's end)."""
    from vllm_kunserve.bench.compare import HOP_COLUMNS, HOP_NOTE, hop_cells

    rows = [(s, k, inst, t) for s in systems for k, per in enumerate(pipe.get(s) or [], 1)
            for inst, t in sorted((per or {}).items())]
    if not rows:
        return []
    return ["## Pipeline hops", "", HOP_NOTE + " Its latest group in the run.", ""] + md_table(
        ["system", "rep", "engine", *HOP_COLUMNS], "lrr" + "r" * len(HOP_COLUMNS),
        ([s, k, inst, *hop_cells(t)] for s, k, inst, t in rows)) + [""]


def render(scaling: dict, cap: dict, a: argparse.Namespace, argv: list[str], rows: list[dict], systems: list[str],
           window: tuple[float, float], name: str, mix: dict, cpu: dict, host: dict, short: dict,
           preempt: dict | None = None, pipe: dict | None = None, tails: dict | None = None,
           split: dict | None = None, groups: dict | None = None) -> str:
    others = [s for s in systems if s not in ("vllm", "oracle")]
    keys = ["stock_over_oracle"] + [f"{n}_{k}" for n in others
                                    for k in ("over_stock", "over_oracle", "gap_closed", "tpot_p50_over_stock")]
    keys += sorted({k for r in rows for k in r if k.endswith("_over_static")})
    sp = {k: spread(rows, k) for k in keys}
    L = [f"# Cluster drop under a burst, {a.mix} mix (written by benchmarks/cluster_burst.py)", "",
         f"Command: `{a.command}`" + (f" (this doc re-written from its raw data by `{a.rewritten}`)"
                                       if getattr(a, "rewritten", None) else "") + "; the comparison it ran: "
         f"`kunserve {shlex.join(argv)}`.", "",
         f"![timeline]({name}/timeline.png)", "",
         "The picture (repetition 1): every system on one time axis. Per system, top: KV capacity of both engines "
         "and the KV demand (tokens the requests held or, queued, needed for their prompts, from the client's own "
         "per-request timings), and the layers each engine holds; bottom: each "
         "request's TTFT at its arrival time (log scale). Grey: the burst.", "",
         "## Regime", "",
         f"{scaling['cpu']}, preset `{scaling['preset']}` ({scaling['dtype']}, {scaling['weight_bytes'] / 1e6:.0f} MB of "
         f"weights), {scaling['threads']} compute thread(s), decode step vs batch (measured by "
         "`benchmarks/batch_scaling.py` on this machine):", ""] + scaling_table(scaling["rows"])
    kv_bytes = a.kv_tokens * scaling.get("kv_bytes_per_token", 0)
    w = scaling["weight_bytes"] / (scaling["weight_bytes"] + kv_bytes) if kv_bytes else None
    L += ["", f"Batch 16 / batch 1 per step: {scaling['step16_over_step1']:.2f}x "
          + ("(valid: <= 3x)." if scaling["valid_regime"] else
             "(**not** a valid regime: > 3x" + ("; run forced with --force" if a.force else "") + ")."), "",
          f"Each engine: KV for {a.kv_tokens} tokens" + (f" ({kv_bytes / 1e6:.1f} MB; weights are {w:.0%} of the "
                                                        f"engine's weights + KV, so a 2-engine group holds up to "
                                                        f"{(2 - w) / (2 * (1 - w)):.1f}x the tokens of the two alone; "
                                                        f"kunserve's KV may grow to {a.kv_cap_x:g}x its base, "
                                                        f"the oracle has {a.oracle_x:g}x)"
                                                        if w else "") + ".",
          f"Workload ({a.mix} mix): the Azure LLM conversation trace's (2023, CC BY 4.0) arrival times from offset "
          f"{a.window_offset} s, re-timed into phases `{a.phases_str}`; **synthetic lengths**: {mix['prompt_len']}-token "
          f"prompts, outputs uniform in {mix['output_len']}..{mix['output_len_max']} tokens.",
          f"Stock's capacity from the table: a decode batch of {cap['batch']} per engine (KV tokens over a request's "
          f"mid-life length) at {cap['step_ms']} ms per step: {cap['req_per_s']:.3f} req/s for both engines; the "
          f"warm start runs at {a.warm_share:.2f}x and the burst at {a.burst_x:.2f}x that. That capacity is modelled, "
          "not measured (a saturated stock pair completes less: it preempts); `benchmarks/burst_value.py` measures "
          "capacity with a closed-loop saturation run and calibrates the load to it.",
          f"Burst window for the ratios: arrivals in [{window[0]:g}, {window[1]:g}) s.", "",
          "## Paired ratios per repetition (P99 TTFT over the burst window)", ""]
    L += md_table(["rep", "stock / oracle", *(f"{n} {k}" for n in others
                                               for k in ("/ stock", "/ oracle", "gap closed", "/ stock P50 TPOT")),
                   "failed", "late sends"], "r" * (2 + 4 * len(others)) + "ll")
    for r in rows:
        def c(key):
            return f2(r.get(key)) + ("" if kept(r, key) or r.get(key) is None else " (late)")
        cells = [str(r["rep"]), c("stock_over_oracle")]
        for n in others:
            cells += [c(f"{n}_over_stock"), c(f"{n}_over_oracle"), c(f"{n}_gap_closed"), c(f"{n}_tpot_p50_over_stock")]
        cells += [json.dumps(r["failed"]), json.dumps({n: v["late_sends"] for n, v in r["window"].items()})]
        L.append(md_row(cells))
    L += ["", "## Verdict against the targets (median (min..max, n) over the ratios whose runs were all on time)", ""]
    L += [f"- {v['target']}: {v['measured']} -> **{'met' if v['met'] else 'missed'}**"
          + ("" if v.get("reps_met") is None else " (met in {} of {} such repetitions)".format(*v["reps_met"]))
          + (f"; all repetitions, late-client ones included: {v['all_reps']}" if v.get("all_reps") else "")
          for v in verdict(rows, systems, harsh(a))] if "oracle" in systems and a.mix == "decode" else [
        "Not the issue's target run (" + ("no oracle" if "oracle" not in systems else f"the {a.mix} mix") +
        "): read the per-system table below."
        + ("" if "vllm" in systems else " Stock and the oracle on the same trace and seed are in "
           "[cluster_burst.md](cluster_burst.md) (other runs, not interleaved with these).")]
    if harsh(a) and "kunserve" in systems:
        L += ["", f"The harsher window: kunserve's KV may grow to {a.kv_cap_x:g}x its base (memory.max_kv_ratio), "
              "below what the burst needs, so no drop plan frees enough; the front end reports what is missing as "
              "`kunserve:kv_shortfall_blocks`. The group admits a queued request only when every admitted one can "
              "still reach its max_tokens in the group's KV (`lookahead.admission = \"peak\"`, "
              "policy/admission.py); the rest waits in vLLM's queue, and vLLM's preemption remains for what that "
              "bound misses. Largest shortfall per repetition (blocks) and the seconds it was above 0: "
              + json.dumps(short) + "."]
        L += ["", "Preemptions per repetition (vLLM's counter, both engines): " + json.dumps(preempt or {})
              + ". A variant run beside it (kunserve with one setting changed) has its ratios in the list below."]
    late = {f"rep {r['rep']}": {n: w["send_lag_max"] and round(w["send_lag_max"] * 1e3) for n, w in r["window"].items()
                                if w["late_sends"]} for r in rows if not r["valid"]}
    if late:
        L += ["", "Runs where the client sent a request > 50 ms late, kept out of every ratio that compares them "
              "(marked `(late)` above; the largest lag per run, ms): " + json.dumps(late) + "."]
    L += ["", "Median (min..max) over the ratios whose runs were all on time:", ""]
    L += [f"- {k}: {f2(v.get('median'))} ({f2(v.get('min'))}..{f2(v.get('max'))}, n={v['n']})" for k, v in sp.items()]
    L += ["", "P99 / P50 TTFT and P50 TPOT (s) per system and repetition, burst window:", ""]
    L += md_table(["rep", *systems], "r" + "l" * len(systems), ([r["rep"], *(
        f"{f2(r['window'][s]['ttft_p99'])} / {f2(r['window'][s]['ttft_p50'])} / {f2(r['window'][s]['tpot_p50'])}"
        if s in r["window"] else "-" for s in systems)] for r in rows))
    L += ["", "Targets (issue 13, decode mix): stock / oracle >= 3; kunserve gap closed >= 0.8 and kunserve / oracle "
          "<= 1.3; kunserve / stock P50 TPOT <= 1.3; zero failed. The prefill mix is the negative control: its "
          "load is prompts to prefill, compute-bound on this CPU, where a pipeline group costs more than the "
          "freed KV buys, so kunserve should not drop there (the monitor's decode share, "
          "`drop.min_decode_share`).", "",
          ] + tail_section(tails or {}) + group_section(groups or {}, rows) + dispatch_section(split or {}) \
        + pipeline_section(pipe or {}, systems) \
        + host_section(host, systems) + [
          "CPU share of one core per repetition (client = the replay process; servers = the front end, the API "
          "servers and the engines, summed): " + json.dumps(cpu), "",
          f"Raw data: `{name}/compare.json` (every repetition's summary), `{name}.json` (the paired rows), "
          f"`{name}/rep*/<system>/requests.csv` (every request)."]
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--mix", choices=tuple(MIXES), default="decode")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default="")
    ap.add_argument("--kv-tokens", type=int, default=1280, help="base KV capacity per engine (tokens)")
    ap.add_argument("--oracle-x", type=float, default=10.0, help="oracle KV multiplier (and kunserve's growth cap)")
    ap.add_argument("--kv-cap-x", type=float, default=None,
                    help="kunserve's KV growth cap (memory.max_kv_ratio; default --oracle-x): below the burst's "
                         "peak demand this is the harsher window, where dropping cannot free enough and vLLM's own "
                         "queueing and preemption handle the rest")
    add_phase_args(ap, warm_s=60.0, warm_share=0.55, burst_s=40.0, burst_x=1.5)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--window-offset", default="0")
    ap.add_argument("--force", action="store_true", help="run even where the regime check fails")
    ap.add_argument("--reuse-scaling", action="store_true",
                    help="use docs/benchmarks/batch_scaling.json as measured (skip step 1)")
    ap.add_argument("--analyse-only", action="store_true", help="re-write the doc from an earlier --out")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="extra kunserve systems (kunserve compare --variant), e.g. for the ablation; list them in "
                         "--systems")
    ap.add_argument("--name", default="", help="doc name (default cluster_burst[_MIX])")
    ap.add_argument("--client-realtime", action=argparse.BooleanOptionalAction, default=True,
                    help="replay from a SCHED_FIFO thread so the client sends on time (default on; it waited up to "
                         "seconds for a core at normal priority here)")
    ap.add_argument("--shm-wait-ms", type=float, default=1.0,
                    help="every system's engines: vLLM's shared-memory queue readers sleep on the writer's signal "
                         "up to this many ms at a time instead of spinning on sched_yield (KUNSERVE_SHM_WAIT_MS; "
                         "an engine core spinning for its worker's reply took ~0.35 of a core here; 0: vLLM's spin)")
    ap.add_argument("--mlock", action="store_true",
                    help="lock the memory of every serving process and of this client (KUNSERVE_MLOCK=1: host "
                         "reclaim cannot page them out; see runtime/hostlock.py)")
    a = ap.parse_args()
    if a.kv_cap_x is None:
        a.kv_cap_x = a.oracle_x
    if not 1.0 <= a.kv_cap_x <= 64.0:
        ap.error(f"--kv-cap-x must be in [1, 64] (memory.max_kv_ratio), got {a.kv_cap_x:g}")
    if a.mlock and not a.analyse_only:
        from vllm_kunserve.runtime.hostlock import lock_process_memory

        if not lock_process_memory():
            print("--mlock: this process could not lock its memory (see the warning above)", file=sys.stderr)
            return 2
    if not a.reuse_scaling and not a.analyse_only:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "batch_scaling.py")], check=True)
    scaling = json.loads((DOCS / "batch_scaling.json").read_text())
    if not scaling["valid_regime"] and not a.force:
        print(f"refusing: batch 16 costs {scaling['step16_over_step1']:.2f}x batch 1 per step here (> 3x); "
              "KV capacity is not worth throughput on this machine (--force to run anyway)")
        return 2
    from vllm_kunserve.cli.main import main as kunserve
    from vllm_kunserve.tools.make_model import PRESETS

    spec = PRESETS[scaling["preset"]]
    scaling.setdefault("kv_bytes_per_token", spec.kv_bytes_per_token())
    mix = MIXES[a.mix]
    name = a.name or ("cluster_burst" if a.mix == "decode" else f"cluster_burst_{a.mix}")
    command = cmd("cluster_burst.py", quote=False)   # unquoted, as the docs have quoted it
    prev_path = DOCS / f"{name}.json"
    if a.analyse_only and prev_path.exists():
        # what the measuring run used (the machine's table may have been measured again since)
        prev = json.loads(prev_path.read_text())
        scaling, cap, mix = prev["scaling"], prev["stock_capacity"], prev["mix"]
        phases = [tuple(x) for x in prev["phases"]]
        a.rewritten, command = command, prev.get("command", "python benchmarks/cluster_burst.py --repeat 5")
    else:
        cap = stock_capacity(scaling, a.kv_tokens, mix)
        phases = [(a.warm_s, round(a.warm_share * cap["req_per_s"], 4)),
                  (a.burst_s, round(a.burst_x * cap["req_per_s"], 4))]
    a.phases_str = ",".join(f"{d:g}@{r:g}" for d, r in phases)
    a.warm_share, a.burst_x = phases[0][1] / cap["req_per_s"], phases[1][1] / cap["req_per_s"]
    a.command = command
    out = Path(a.out or ROOT / "runs" / name)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    model = ROOT / "models" / scaling["preset"]
    argv = compare_argv(model, spec.dtype, out, a, mix, a.phases_str, systems)
    if not a.analyse_only:
        print(f"stock capacity {cap}; phases {a.phases_str}", flush=True)
        print("running: kunserve " + shlex.join(argv), flush=True)
        rc = kunserve(argv)
        if rc != 0:
            return rc
    # the burst window: requests arriving during the burst
    window = (phases[0][0], phases[0][0] + phases[1][0])
    rows = paired(out, systems, a.repeat, window)
    assets = DOCS / name
    assets.mkdir(parents=True, exist_ok=True)
    res = json.loads((out / "compare.json").read_text())
    write_json(assets / "compare.json", res, indent=1, clean=False)
    for k in range(1, a.repeat + 1):
        for s in systems:
            src = out / s / f"rep{k}" / "requests.csv"
            if src.exists():
                (assets / f"rep{k}" / s).mkdir(parents=True, exist_ok=True)
                (assets / f"rep{k}" / s / "requests.csv").write_bytes(src.read_bytes())
    timeline_png(out, systems, 1, phases, assets / "timeline.png")
    cpu = {s: [r.get("server", {}).get("cpu_share") for r in res["runs"].get(s, [])] for s in systems}
    host = host_facts(res, systems)
    short = shortfall(out, systems, a.repeat)
    preempt = {s: [r.get("preemptions") for r in res["runs"].get(s, [])] for s in systems}
    pipe = {s: [r.get("server", {}).get("pipeline") for r in res["runs"].get(s, [])] for s in systems}
    tails = tail_requests(out, systems, a.repeat, window)
    split = dispatch_split(out, systems, a.repeat, window)
    groups = group_times(out, systems, a.repeat, window)
    write_json(DOCS / f"{name}.json", {
        "scaling": scaling, "stock_capacity": cap, "phases": phases, "window": window, "mix": mix,
        "paired": rows, "argv": argv, "forced": a.force, "cpu_share": cpu, "host": host, "command": command,
        "verdict": verdict(rows, systems, harsh(a)) if "oracle" in systems else None,
        "kv_cap_x": a.kv_cap_x, "shortfall": short, "preemptions": preempt, "pipeline": pipe,
        "tail_requests": tails, "dispatch_split": split, "grouped": groups}, indent=1, clean=False)
    doc = DOCS / f"{name}.md"
    doc.write_text(render(scaling, cap, a, argv, rows, systems, window, name, mix, cpu, host, short, preempt, pipe,
                          tails, split, groups))
    print(doc.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
