"""Run several systems on the same trace, in turn, and tabulate them with ratios to stock vLLM.

Repeats are interleaved (rep 1 of every system, then rep 2, ...) so slow drift of a shared machine
spreads over all systems, and with a shuffle seed each repetition runs its systems in an order of its
own, a row of a balanced design (``run_order``), so no system keeps one position. Each run: start the server, wait for /health, replay, stop; the server log
goes next to the run's files in ``OUT/<system>/rep<k>/``.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from vllm_kunserve.bench import metrics as M
from vllm_kunserve.bench import report
from vllm_kunserve.bench.hostwatch import HostSampler, faults_in
from vllm_kunserve.bench.runner import BenchRun
from vllm_kunserve.bench.systems import LAUNCHERS, CommonArgs, SystemSpec
from vllm_kunserve.cluster.fleet.launcher import ServerProcess, StartupExited, free_port
from vllm_kunserve.runtime.looplag import lag_cause
from vllm_kunserve.workload.stats import ratio

# (key in the table, label, getter from a summary, scale for display)
METRICS: list[tuple[str, str, Callable[[dict], Any], float]] = [
    ("ttft_p50", "TTFT P50 (s)", lambda s: s["ttft_s"]["p50"], 1.0),
    ("ttft_p99", "TTFT P99 (s)", lambda s: s["ttft_s"]["p99"], 1.0),
    ("tpot_p50", "TPOT P50 (ms)", lambda s: s["tpot_s"]["p50"], 1e3),
    ("tpot_p99", "TPOT P99 (ms)", lambda s: s["tpot_s"]["p99"], 1e3),
    ("e2e_p99", "E2E P99 (s)", lambda s: s["e2e_s"]["p99"], 1.0),
    ("preemptions", "preemptions", lambda s: s.get("preemptions"), 1.0),
    ("kv_usage_peak", "peak KV usage (%)", lambda s: s.get("kv_usage_peak"), 100.0),
    ("throughput_rps", "throughput (req/s)", lambda s: s.get("throughput_rps"), 1.0),
    ("output_tokens_per_s", "output tokens/s", lambda s: s.get("output_tokens_per_s"), 1.0),
    ("completed", "completed", lambda s: s["completed"], 1.0),
    ("failed", "failed", lambda s: s["failed"], 1.0),
    ("slo_5x", "SLO attainment @5x (%)", lambda s: s["slo_attainment"].get("ttft_and_tpot", {}).get("5x"), 100.0),
]


@dataclass
class CompareResult:
    systems: list[dict[str, Any]]
    common: dict[str, Any]
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # system -> per-repeat summaries
    aggregate: dict[str, dict[str, dict[str, float | None]]] = field(default_factory=dict)
    baseline: str = ""
    workload: dict[str, Any] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)  # the CLI arguments, for reproducibility
    orders: list[list[str]] = field(default_factory=list)  # per repetition, the order its systems ran in


def _stats(values: Sequence[float | None]) -> dict[str, float | None]:
    v = [float(x) for x in values if x is not None and x == x]
    if not v:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": float(np.mean(v)), "min": min(v), "max": max(v), "n": len(v)}


def aggregate(runs: dict[str, list[dict[str, Any]]], baseline: str) -> dict[str, dict[str, dict[str, Any]]]:
    """system -> metric -> {mean, min, max, n, ratio} (ratio = mean / baseline's mean)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, summaries in runs.items():
        out[name] = {}
        for key, _, get, _scale in METRICS:
            vals = []
            for s in summaries:
                try:
                    vals.append(get(s))
                except (KeyError, TypeError):
                    vals.append(None)
            out[name][key] = _stats(vals)
    base = out.get(baseline, {})
    for name in out:
        for key in out[name]:
            b = base.get(key, {}).get("mean")
            m = out[name][key]["mean"]
            out[name][key]["ratio"] = ratio(m, b)
    return out


def _number_cell(v: float | None, scale: float) -> str:
    """``v`` x ``scale`` in a table cell: no decimals from 100 on (or when whole), one from 10, else three
    significant digits."""
    if v is None:
        return "-"
    x = v * scale
    if abs(x) >= 100 or float(x).is_integer():
        return f"{x:.0f}"
    return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


def table(agg: dict[str, dict[str, dict[str, Any]]], systems: Sequence[str], baseline: str, markdown: bool = False) -> str:
    """One row per metric, per system 'mean [min-max] (ratio x)'."""
    header = ["metric"] + [f"{s}" + (" (baseline)" if s == baseline else "") for s in systems]
    rows = []
    for key, label, _, scale in METRICS:
        row = [label]
        for s in systems:
            st = agg[s][key]
            if st["mean"] is None:
                row.append("-")
                continue
            cell = _number_cell(st["mean"], scale)
            if st["n"] > 1 and st["min"] != st["max"]:
                cell += f" [{_number_cell(st['min'], scale)}-{_number_cell(st['max'], scale)}]"
            if s != baseline and st.get("ratio") is not None:
                cell += f" ({st['ratio']:.2f}x)"
            row.append(cell)
        rows.append(row)
    if markdown:
        return "\n".join(report.md_table(header, "l" * len(header), rows))
    return "\n".join(report.text_table(header, rows))


#: how many ports a system's server is started on before a run gives up (:func:`port_taken`)
PORT_TRIES = 3
_PORT_TAKEN = re.compile(r"address already in use|Errno 98|EADDRINUSE", re.IGNORECASE)


def port_taken(startup_error: str) -> bool:
    """Whether a server's startup failure (its log's excerpt) is its port being in use."""
    return bool(_PORT_TAKEN.search(startup_error))


def run_system(spec: SystemSpec, common: CommonArgs, run_dir: Path, startup_timeout_s: float,
               body: Callable[[str], BenchRun]) -> tuple[BenchRun, dict[str, Any]]:
    """Start ``spec``, run ``body(endpoint)``, stop it. Returns the run and server facts."""
    host = "127.0.0.1"
    run_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, PORT_TRIES + 1):
        # the port is free when picked, but another process may bind it before the server does:
        # then (only then) the server starts again on another one
        port = free_port(host)
        plan = LAUNCHERS[spec.launcher](spec, common, host, port)
        server = ServerProcess(plan, host, port, run_dir / "server.log").start()
        try:
            startup = server.wait_ready(startup_timeout_s)
            break
        except BaseException as exc:  # the server never outlives a failed start
            server.stop()
            if attempt == PORT_TRIES or not (isinstance(exc, StartupExited) and port_taken(str(exc))):
                raise
            print(f"[{spec.name}] port {port} was taken before the server bound it; again on another "
                  f"(attempt {attempt + 1} of {PORT_TRIES})", file=sys.stderr, flush=True)
    with server:
        pid = server.proc.pid if server.proc else None
        with HostSampler(pid, run_dir / "host.csv") as host:
            before, t0, c0 = cpu_times(pid), time.perf_counter(), time.process_time()
            run = body(server.endpoint)
            wall, client = time.perf_counter() - t0, time.process_time() - c0
            after = cpu_times(pid)
            front = _frontend_status(server.endpoint)
            front_gc = front.get("gc")
    cpu = {k: round((after.get(k, 0.0) - before.get(k, 0.0)) / wall, 3) for k in after} if wall > 0 else {}
    cpu["client"] = round(client / wall, 3) if wall > 0 else None
    facts = {"startup_s": startup, "exit_code": server.proc.returncode if server.proc else None,
             "argv": plan.argv, "env": plan.env, "cpu_share": cpu,
             "host": host_facts(host.rows, run.summary, front_gc), "frontend_gc": front_gc,
             "frontend_loop": front.get("loop"), "pipeline": pipeline_times(front),
             "late_sends": late_sends(run.results, run.summary)}
    return run, facts


def _frontend_status(endpoint: str) -> dict:
    """The ``kunserve serve`` front end's collector pauses and late loop wake-ups
    (``/kunserve/status`` keys ``gc`` and ``loop``); empty elsewhere."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(endpoint.rstrip("/") + "/kunserve/status", timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}


def pipeline_times(front: dict) -> dict[str, dict]:
    """Per engine (instance index), where its pipeline hops spent their time in its latest group
    (the agent's ``pipeline`` state: round trip, the peer's wait for its compute, the span's compute,
    the link), as the front end's ``/kunserve/status`` had it at the run's end; empty where no
    engine was grouped."""
    out = {}
    for inst in front.get("instances") or []:
        t = ((inst.get("kv") or {}).get("engine") or {}).get("pipeline")
        if t:
            out[str(inst.get("instance"))] = t
    return out


#: what a hop table says of each hop's time (``HopTimes``), after the columns that name the engine
HOP_COLUMNS = ("hops", "round trip", "peer wait", "peer span", "link")
HOP_NOTE = ("Each grouped engine's calls to its peer's stage (`integration/vllm/pipeline.py` `HopTimes`): the "
            "round trip, the peer's wait for its compute lock (its own step was running: pipeline queueing), the "
            "span's compute there, and the rest, the link (shared memory both ways, the pickled headers, the "
            "wake-ups). P50 / P90 in ms.")


def hop_cells(t: dict) -> list[str]:
    """The :data:`HOP_COLUMNS` cells of one engine's ``HopTimes`` summary."""
    def ms(key: str) -> str:
        v = t.get(key)
        return "-" if not v else f"{v['p50']:.2f} / {v['p90']:.2f}"
    return [str(t.get("hops", 0))] + [ms(k) for k in ("round_trip_ms", "peer_wait_ms", "peer_span_ms", "link_ms")]


def late_sends(results: Sequence[Any], summary: dict[str, Any], min_s: float = 0.05) -> list[dict]:
    """Every request the client sent at least ``min_s`` after its arrival time, with what the client's
    event loop was doing meanwhile: the late wake-ups (``runtime.looplag.LoopLag``) that overlap the interval
    from arrival to send, their CPU and run-queue seconds summed, and the main cause (``lag_cause``:
    busy, no core, blocked) -- ``unseen`` where no late wake-up overlaps (the loop ran on time)."""
    t0 = summary.get("replay_t0_perf")
    events = (summary.get("client_loop") or {}).get("longest", [])
    out = []
    for r in results:
        lag = r.send_s - r.arrival_s
        if not lag >= min_s:
            continue
        row = {"idx": r.idx, "arrival_s": round(r.arrival_s, 3), "lag_s": round(lag, 3), "cause": "unseen"}
        if t0 is not None:
            a, b = t0 + r.arrival_s, t0 + r.send_s
            hit = [e for e in events if e["start_perf_s"] < b and e["start_perf_s"] + e["late_s"] > a]
            if hit:
                runq = [e["runq_s"] for e in hit]
                agg = {"late_s": sum(e["late_s"] for e in hit), "cpu_s": sum(e["cpu_s"] for e in hit),
                       "runq_s": None if None in runq else sum(runq)}
                row.update({k: round(v, 4) if v is not None else None for k, v in agg.items()},
                           cause=lag_cause(agg))
        out.append(row)
    return out


def _overlapping(windows: Sequence[tuple[float, float]], pauses: Sequence[dict], min_s: float = 0.05) -> int:
    """How many windows a pause of at least ``min_s`` overlaps."""
    spans = [(p["start_perf_s"], p["start_perf_s"] + p["seconds"]) for p in pauses if p["seconds"] >= min_s]
    return sum(1 for a, b in windows if any(s < b and e > a for s, e in spans))


def host_facts(rows: Sequence[dict], summary: dict[str, Any], front_gc: dict | None = None) -> dict[str, Any] | None:
    """The host's share in a run: major faults (all, and inside the client's stalls), steal, iowait;
    how many stalls a collector pause of the client or the front end (>= 50 ms) overlaps."""
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    t0 = summary.get("replay_t0_perf")
    stalls = [(t0 + s["start_s"], t0 + s["end_s"]) for s in summary.get("stalls") or []] if t0 else []
    return {"seconds": round(last["t"] - first["t"], 2),
            "majfaults": last["pgmajfault"] - first["pgmajfault"],
            "majfaults_in_stalls": faults_in(rows, stalls),
            "stall_s": round(sum(b - a for a, b in stalls), 3),
            "stalls_with_client_gc": _overlapping(stalls, (summary.get("client_gc") or {}).get("longest", [])),
            "stalls_with_frontend_gc": _overlapping(stalls, (front_gc or {}).get("longest", [])),
            "steal_s": round(last["steal_s"] - first["steal_s"], 2),
            "iowait_s": round(last["iowait_s"] - first["iowait_s"], 2),
            "majflt_by_process": {k.split(":", 1)[1]: last.get(k, 0) - first.get(k, 0)
                                  for k in last if k.startswith("majflt:")}}


def cpu_times(pid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) of a server's process tree, summed by process name (vLLM titles
    its processes, e.g. ``VLLM::EngineCore`` and ``VLLM::Worker``; the API servers and a front end
    run as ``python``/``vllm``): how much of the machine each role of the serving processes took."""
    import psutil

    out: dict[str, float] = {}
    if pid is None:
        return out
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            name = p.name() or "?"
            out[name] = out.get(name, 0.0) + t.user + t.system
        except psutil.Error:
            continue
    return out


def balanced_rows(n: int) -> list[list[int]]:
    """A Williams design for ``n`` systems: rows (repetitions) of positions in which every system runs
    at every position equally often and, for even ``n``, right after every other system exactly once
    (odd ``n``: twice, over 2n rows). First row 0, 1, n-1, 2, n-2, ...; each next row adds 1 mod n;
    for odd ``n`` the rows reversed follow."""
    first, lo, hi = [0], 1, n - 1
    for i in range(1, n):
        if i % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def run_order(systems: Sequence[SystemSpec], rep: int, shuffle_seed: int | None) -> list[SystemSpec]:
    """The systems in the order repetition ``rep`` (from 0) runs them: as given, or (``shuffle_seed``
    set) a row of a balanced design (``balanced_rows``) over the systems in a seeded random order, a
    new random order for each cycle of the design's rows. So no system keeps a position or always runs
    right after another, and over a whole cycle each holds every position equally often: drift inside a
    repetition spreads over all systems instead of favouring one. (A fresh shuffle per repetition
    does not balance few repetitions: seed 1 put the fourth of 4 systems last in 5 of 6.)"""
    order = list(systems)
    if shuffle_seed is None or len(order) < 2:
        return order
    import random

    rows = balanced_rows(len(order))
    cycle, row = divmod(rep, len(rows))
    random.Random(shuffle_seed * 1000 + cycle).shuffle(order)
    return [order[i] for i in rows[row]]


def compare(systems: Sequence[SystemSpec], common: CommonArgs, out: Path, repeat: int,
            bench: Callable[[SystemSpec, int, str, Path], BenchRun], *, startup_timeout_s: float = 600.0,
            log: Callable[[str], None] = print, shuffle_seed: int | None = None,
            resume: bool = False) -> CompareResult:
    """Every system ``repeat`` times in the repetitions' orders (``run_order``). ``resume``: a run whose
    ``summary.json`` and ``requests.csv`` an earlier, interrupted comparison in ``out`` left is kept,
    not run again (the orders are the seed's, so the same runs fall in the same places); a run it
    left unfinished runs again."""
    names = [s.name for s in systems]
    baseline = "vllm" if "vllm" in names else names[0]
    res = CompareResult(systems=[s.to_dict() for s in systems], common=asdict(common), baseline=baseline)
    runs: dict[str, list[BenchRun]] = {n: [] for n in names}
    for rep in range(repeat):
        order = run_order(systems, rep, shuffle_seed)
        res.orders.append([s.name for s in order])
        for position, spec in enumerate(order):
            run_dir = out / spec.name / f"rep{rep + 1}"
            if resume and (run_dir / "summary.json").exists() and (run_dir / "requests.csv").exists():
                kept = json.loads((run_dir / "summary.json").read_text())
                runs[spec.name].append(BenchRun(kept, report.read_requests_csv(run_dir / "requests.csv")))
                log(f"[{spec.name} rep {rep + 1}/{repeat}] kept from the earlier run in {run_dir}")
                continue
            log(f"[{spec.name} rep {rep + 1}/{repeat}] starting server ...")
            run, facts = run_system(spec, common, run_dir, startup_timeout_s,
                                    lambda ep, _s=spec, _r=rep, _d=run_dir: bench(_s, _r, ep, _d))
            run.summary["server"] = facts
            run.summary["position"] = position  # where in its repetition this run came (0: first)
            report.write_json(run_dir / "summary.json", run.summary)
            s = run.summary
            log(f"[{spec.name} rep {rep + 1}/{repeat}] done: {s['completed']}/{s['requests']} ok, "
                f"TTFT P50 {s['ttft_s']['p50'] or math.nan:.3f} s P99 {s['ttft_s']['p99'] or math.nan:.3f} s, "
                f"preemptions {s.get('preemptions')}, server up in {facts['startup_s']:.0f} s")
            runs[spec.name].append(run)
    # SLO attainment against one reference for all: the oracle's mean P50s if it ran, else the baseline's
    ref_name = "oracle" if "oracle" in runs else baseline
    ref_t = _stats([r.summary["ttft_s"]["p50"] for r in runs[ref_name]])["mean"]
    ref_p = _stats([r.summary["tpot_s"]["p50"] for r in runs[ref_name]])["mean"]
    for name, rs in runs.items():
        for r in rs:
            if ref_t:
                r.summary["slo_reference"] = {"system": ref_name, "ttft_p50_s": ref_t, "tpot_p50_s": ref_p}
                r.summary["slo_attainment"] = M.slo_attainment(r.results, ref_t, ref_p)
    res.runs = {n: [r.summary for r in rs] for n, rs in runs.items()}
    res.aggregate = aggregate(res.runs, baseline)
    report.plot_ttft_cdf(out / "ttft_cdf.png",
                         {n: [x.ttft_s for r in rs for x in r.results if x.ok] for n, rs in runs.items()},
                         title="TTFT CDF (all repeats)")
    return res


def write_compare(out: Path, res: CompareResult, names: Sequence[str]) -> str:
    text = table(res.aggregate, names, res.baseline)
    md = table(res.aggregate, names, res.baseline, markdown=True)
    report.write_json(out / "compare.json", asdict(res))
    (out / "compare.md").write_text(md + "\n")
    return text


def mean_ratio(res: CompareResult, a: str, b: str, key: str) -> float | None:
    """mean(metric of a) / mean(metric of b) over the repetitions (``workload.stats.ratio``)."""
    return ratio(res.aggregate.get(a, {}).get(key, {}).get("mean"), res.aggregate.get(b, {}).get(key, {}).get("mean"))

