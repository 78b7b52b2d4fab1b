"""What dropping parameters buys under a burst, against what users deploy instead (issue 34).

Two engines, each pinned to its own core (one compute thread), on the Azure LLM conversation trace's
(2023, CC BY 4.0) arrival times re-timed into a warm phase and a burst, decode-heavy lengths
(``--lengths decode``, 64 prompt and 256-384 output tokens, ``--outputs``) or the trace's own lengths scaled to fit
(``--lengths azure``: each request's prompt and output times ``--length-scale``, its total clipped to
``--max-total-len``). The
systems, every one on the same engines, trace, client and cores, run interleaved with the order
shuffled per repetition (``kunserve compare --order shuffled``):

- ``vllm``: stock defaults; ``vllm-tuned``: stock with the batch cap (``--max-num-seqs``) that gave
  the lowest P99 TTFT in the sweep (step 2); ``vllm-router`` / ``vllm-router-rr``: two ``vllm serve``
  engines behind vllm-router (PyPI, the vLLM project's Rust router; cache_aware, its default, and
  round_robin);
- ``static`` (one PP=2 group from the start: an alternative configuration, not a bound) and
  ``kunserve``;
- ``oracle-equal``: stock engines with the KV a kunserve group reaches (the same memory, no
  pipeline; 1 + w / (2 (1 - w)) for weight share w): the bound for what dropping can buy; and
  ``oracle`` (10x KV) where asked for, the extreme.

Regimes (``--regime``):

- ``r1``, paper-like: preset ``decode-bf16-mha`` (full multi-head attention, 72 KiB of KV per token)
  with KV for ``--kv-tokens`` (6080) tokens per engine: weights are 60% of an engine's weights + KV,
  so a group holds 1.75x the KV of its members apart.
- ``r1-fp32``: R1 on CPUs without avx512_bf16 or AMX (there a bf16 matmul is compute-bound, a bigger
  batch is not nearly free): preset ``decode-fp32-mha``, the same shape in fp32 (1.41 GB of weights,
  144 KiB of KV per token), the same 6080 tokens per engine and so the same weight share.
- ``r0``, extreme: the ``decode-bf16`` preset at 1280 tokens (weights 97%, a group would hold 20x);
  kunserve's KV growth is capped at ``--kv-cap`` (default ``KV_CAP``, 10x, ``memory.max_kv_ratio``),
  so ``oracle-equal`` gets the same 10x. Same steps as R1. ``--kv-cap 2`` asks the harsher question:
  a group that may grow its KV only to 2x, below what the burst needs.

Steps (``--steps``, each kept in ``--out`` and skipped when its file is there):

1. ``capacity``: a closed-loop saturation run of two stock engines behind ``kunserve serve``, driven
   by vLLM's own client (``vllm bench serve``, random dataset with the workload's lengths, or a
   custom dataset of the scaled trace's own prompt and output lengths for ``--lengths azure``,
   ``--ignore-eos``, ``--max-concurrency`` each of ``--concurrency``): the sustainable req/s is the
   best completed rate. The warm phase runs at ``--warm-share`` of it, the burst at ``--burst-x``.
2. ``sweep``: ``vllm-tuned`` at each batch cap of ``--caps`` on the calibrated trace; the cap with
   the lowest window P99 TTFT is the tuned baseline.
3. ``compare``: every system, ``--repeat`` shuffled repetitions; an interrupted compare step keeps the
   runs it finished (``kunserve compare --resume``), so the same command, or one with a smaller
   ``--repeat`` that its finished repetitions cover, goes on from them.
4. the doc: pooled window statistics (``benchmarks/common/pooled.py``: P50 / P90 / P99 TTFT with
   bootstrap 95% intervals, TPOT, goodput, output tokens/s, preemptions, lost), the gap to
   ``oracle-equal`` closed, when kunserve grouped, where each system's P99 sits (its slowest requests,
   paired with the same arrivals at ``oracle-equal``, by where kunserve's engines were when they
   arrived), kunserve against its stock twin ``vllm`` where both ran (what the plugin costs where it
   never drops), the client's send lag, and a PNG. The run's raw data and the page's analysis go into
   one file, ``docs/benchmarks/runs/NAME.tar.xz`` (``benchmarks/common/raw.py``), with the commit and
   the serving code it ran (``provenance``); ``--steps '' --out docs/benchmarks/runs/NAME.tar.xz``
   re-writes a page from it. ``--readme`` writes the question's page over every archived run and the
   README's block (``benchmarks/common/headline.py``, its rule).

    python -m benchmarks.burst_value --regime r1 [--repeat 5] [--out runs/burst_r1]
    python -m benchmarks.burst_value --regime r0 --concurrency 8 --capacity-requests 48 --caps 2,3 \
        --burst-s 100 --burst-x 2.0 --systems vllm-tuned,vllm-router,kunserve,oracle-equal
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import pooled, raw
from benchmarks.common.pooled import load_runs, request_files
from benchmarks.common.burst import (LATE_S, SLOW_SHARE, add_phase_args, dispatch_split, group_times, grouped_output,
                                      in_spans, kunserve_config, lever_section, lever_times, machine_speed,
                                      scaling_table)
from vllm_kunserve.bench.report import command as cmd
from vllm_kunserve.bench.report import md_row, md_table, pyplot, save_figure, write_json
from vllm_kunserve.sim.policies.baselines import group_kv_factor   # one home: the simulator's oracle-equal uses it
from vllm_kunserve.workload.records import read_csv

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
DOCS = ROOT / "docs" / "benchmarks"
TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"
MACHINE_FROM_S = 5.0   # the machine-speed probe's warm seconds start here (the first arrivals are in)
REGIMES = {
    "r1": {"preset": "decode-bf16-mha", "kv_tokens": 6080, "scaling": "batch_scaling_mha"},
    # R1 where bf16 is compute-bound (no avx512_bf16: Zen 3, Cascade Lake): the same shape in fp32
    "r1-fp32": {"preset": "decode-fp32-mha", "kv_tokens": 6080, "scaling": "batch_scaling_zen3_fp32_mha"},
    "r0": {"preset": "decode-bf16", "kv_tokens": 1280, "scaling": "batch_scaling"},
}
MIX = {"prompt_len": 64, "output_len": 256, "output_len_max": 384}
ALTERNATIVES = ("vllm", "vllm-tuned", "vllm-router", "vllm-router-rr")
LABEL = {"vllm": "stock vLLM (defaults)", "vllm-tuned": "stock, tuned batch cap", "vllm-router": "vllm-router "
         "(cache_aware)", "vllm-router-rr": "vllm-router (round_robin)", "static": "static PP=2 group",
         "kunserve": "kunserve (cluster drop)", "oracle-equal": "oracle-equal (same memory, no pipeline)",
         "oracle": "oracle (10x KV)"}
KV_CAP = 10.0   # kunserve's memory.max_kv_ratio unless --kv-cap says otherwise: the most KV a group member may reach
ENGINE_ENV = ["KUNSERVE_ENGINE_CPUS=0|1", "OMP_NUM_THREADS=1", "KUNSERVE_ENGINE_NICE=5", "KUNSERVE_SHM_WAIT_MS=1"]


def weight_share(weight_bytes: int, kv_bytes: int) -> float:
    return weight_bytes / (weight_bytes + kv_bytes)


def kunserve(argv: list[str]) -> int:
    from vllm_kunserve.cli.main import main

    print("running: kunserve " + shlex.join(argv), flush=True)
    return main(argv)


def common_argv(a: argparse.Namespace, model: Path, dtype: str) -> list[str]:
    return ["--model", str(model), "--instances", "2", "--dispatch", a.dispatch,
            "--kv-capacity-tokens", str(a.kv_tokens), "--block-size", "32", "--dtype", dtype,
            "--max-model-len", "1024", "--engine-arg=--enforce-eager",
            *[x for e in ENGINE_ENV for x in ("--env", e)], "--client-realtime", "--no-progress"]


def length_argv(a: argparse.Namespace) -> list[str]:
    if a.lengths == "azure":
        return ["--length-scale", f"{a.length_scale:g}", "--max-total-len", str(a.max_total_len)]
    return ["--synthetic-lengths", "--prompt-len", str(MIX["prompt_len"]), "--output-len", str(MIX["output_len"]),
            "--output-len-max", str(MIX["output_len_max"])]


def trace_argv(a: argparse.Namespace, phases: str) -> list[str]:
    return ["--trace", str(a.trace), "--format", "azure", "--window-offset", str(a.window_offset), *length_argv(a),
            "--phases", phases, "--seed", str(a.seed)]


def azure_dataset(a: argparse.Namespace, model: Path, n: int, path: Path) -> dict:
    """``n`` requests of the scaled trace's own lengths (in trace order from ``--window-offset``) as a
    ``vllm bench serve`` custom dataset: text prompts of exactly the prompt length for the model's
    tokenizer, and each request's output length."""
    from vllm_kunserve.bench.prompts import PromptFactory, load_tokenizer
    from vllm_kunserve.bench.workload import WorkloadOptions, build_trace

    tr, _ = build_trace(WorkloadOptions(format="azure", trace=str(a.trace), window_offset=a.window_offset,
                                        length_scale=a.length_scale, max_total_len=a.max_total_len))
    if len(tr) < n:
        raise SystemExit(f"the trace holds {len(tr)} requests after --window-offset; the capacity run needs {n}")
    pf = PromptFactory(load_tokenizer(str(model)), mode="text", seed=a.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": pf.make(int(tr.prompt_len[i]), i), "output_tokens": int(tr.output_len[i])}) + "\n")
    return {"mean_prompt": float(np.mean(tr.prompt_len[:n])), "mean_output": float(np.mean(tr.output_len[:n]))}


# ------------------------------------------------------------------------------------------ capacity
def saturation(a: argparse.Namespace, model: Path, dtype: str, out: Path) -> dict:
    """Closed-loop runs of two stock engines behind ``kunserve serve`` at each concurrency of
    ``a.concurrency``, driven by ``vllm bench serve``; the best completed req/s is the capacity."""
    from vllm_kunserve.bench.systems import LAUNCHERS, CommonArgs, builtin_systems
    from vllm_kunserve.cli.compare import model_kv_bytes_per_token
    from vllm_kunserve.cluster.fleet.launcher import ServerProcess, free_port

    per_token = model_kv_bytes_per_token(model, dtype)
    common = CommonArgs(model=str(model), dtype=dtype, block_size=32, kv_cache_bytes=a.kv_tokens * per_token,
                        max_model_len=1024, extra_args=("--enforce-eager",),
                        env=tuple(tuple(e.split("=", 1)) for e in ENGINE_ENV))
    spec = builtin_systems(None, 10.0, 2, "least-work")["vllm"]
    mean_out = (MIX["output_len"] + MIX["output_len_max"]) / 2
    rows = []
    for conc in a.concurrency:
        host, port = "127.0.0.1", free_port()
        d = out / "capacity" / f"c{conc}"
        server = ServerProcess(LAUNCHERS[spec.launcher](spec, common, host, port), host, port,
                               d / "server.log").start()
        try:
            server.wait_ready(600)
            n = max(3 * conc, a.capacity_requests)
            if a.lengths == "azure":
                lengths = azure_dataset(a, model, n, d / "dataset.jsonl")
                data = ["--dataset-name", "custom", "--dataset-path", str(d / "dataset.jsonl"),
                        "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle"]
            else:
                lengths = {"mean_prompt": MIX["prompt_len"], "mean_output": mean_out}
                data = ["--dataset-name", "random", "--random-input-len", str(MIX["prompt_len"]),
                        "--random-output-len", str(int(mean_out)),
                        "--random-range-ratio", f"{(MIX['output_len_max'] - mean_out) / mean_out:.3f}"]
            argv = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm",
                    "--base-url", server.endpoint, "--model", "model", "--tokenizer", str(model), *data,
                    "--ignore-eos", "--num-prompts", str(n), "--max-concurrency", str(conc), "--request-rate", "inf",
                    "--seed", str(a.seed), "--save-result", "--result-dir", str(d), "--result-filename", "bench.json",
                    "--disable-tqdm"]
            t0 = time.perf_counter()
            with open(d / "client.log", "w") as log:
                subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "VLLM_HOST_IP": "127.0.0.1"})
            res = json.loads((d / "bench.json").read_text())
            rows.append({"concurrency": conc, "requests": n, "completed": res.get("completed"),
                         "req_per_s": res.get("request_throughput"), "output_tokens_per_s": res.get("output_throughput"),
                         "median_tpot_ms": res.get("median_tpot_ms"), "median_ttft_ms": res.get("median_ttft_ms"),
                         "wall_s": round(time.perf_counter() - t0, 1), "lengths": lengths, "argv": argv})
            print(f"capacity at concurrency {conc}: {rows[-1]['req_per_s']:.3f} req/s", flush=True)
        finally:
            server.stop()
    best = max(rows, key=lambda r: r["req_per_s"] or 0)
    return {"rows": rows, "req_per_s": best["req_per_s"], "concurrency": best["concurrency"]}


def phases_of(cap: float, a: argparse.Namespace) -> str:
    tail = f",{a.tail_s:g}@{round(a.tail_share * cap, 4):g}" if getattr(a, "tail_s", 0) > 0 else ""
    return f"{a.warm_s:g}@{round(a.warm_share * cap, 4):g},{a.burst_s:g}@{round(a.burst_x * cap, 4):g}{tail}"


def window_of(a: argparse.Namespace) -> tuple[float, float]:
    return (a.warm_s, a.warm_s + a.burst_s)


# ------------------------------------------------------------------------------------------ analysis
def send_lag(run: Path, systems: list[str], window: tuple[float, float], reps: int | None = None) -> dict[str, dict]:
    """Per system: the largest client send lag (ms) over every run, how many requests went > 50 ms
    late and, where any did, the window's pooled TTFT percentiles counted from each request's arrival
    instead of its send (so a late client cannot hide a queue)."""
    out = {}
    for s in systems:
        lags, from_arrival = [], []
        for _, f in request_files(run, s, reps):
            for r in read_csv(f):
                if not r["send_s"]:
                    continue
                lag = float(r["send_s"]) - float(r["arrival_s"])
                lags.append(lag)
                if window[0] <= float(r["arrival_s"]) < window[1]:
                    from_arrival.append(float(r["ttft_s"]) + lag if r["ok"] == "1" and r["ttft_s"] else math.inf)
        if lags:
            late = sum(x > LATE_S for x in lags)
            out[s] = {"max_ms": round(max(lags) * 1e3, 1), "late": late, "n": len(lags)}
            if late and from_arrival:
                out[s]["ttft_from_arrival_s"] = {f"p{q}": round(float(pooled.point([np.asarray(from_arrival)], q)), 3)
                                                 for q in (50, 90, 99)}
    return out


def run_totals(compare: dict, systems: list[str]) -> dict[str, dict]:
    """Per system, summed over repetitions: preemptions, failed, output tokens/s (mean)."""
    out = {}
    routed = {x["name"] for x in compare.get("systems", []) if x.get("launcher") == "vllm-router"}
    for s in systems:
        rs = compare["runs"].get(s) or []
        if not rs:
            continue
        # behind vllm-router the client's /metrics scrape reaches one engine's counters only
        pre = [None if s in routed else r.get("preemptions") for r in rs]
        tps = [r.get("output_tokens_per_s") for r in rs if r.get("output_tokens_per_s") is not None]
        out[s] = {"preemptions": None if None in pre else sum(pre), "failed": sum(r["failed"] for r in rs),
                  "requests": sum(r["requests"] for r in rs), "output_tokens_per_s": sum(tps) / len(tps) if tps else None,
                  "positions": [r.get("position") for r in rs], "cpu": cpu_roles(rs)}
    return out


#: the serving processes' roles as ``kunserve compare`` names them in a run's ``cpu_share``
CPU_ROLES = (("python", "front end + API servers (Python)"), ("vllm::router", "vllm-router"),
             ("VLLM::EngineCore", "engine cores"), ("VLLM::Worker", "model workers"), ("client", "client"))


def cpu_roles(rs: list[dict]) -> dict[str, float]:
    """Mean over runs of each role's share of a core while the run's requests were served (CPU
    seconds over the run's wall time, the server tree by process name and the client process)."""
    shares = [(r.get("server") or {}).get("cpu_share") or {} for r in rs]
    shares = [x for x in shares if x]
    return {k: sum(x.get(k) or 0.0 for x in shares) / len(shares) for k, _ in CPU_ROLES} if shares else {}


def cpu_section(totals: dict) -> list[str]:
    """Where the two cores went, per system: every system shares them with its front end, the
    engines' API servers and the client; the front ends differ (kunserve serve in Python, or
    vllm-router in Rust), and what one takes, the engines' model workers do not get."""
    rows = {s: t["cpu"] for s, t in totals.items() if t.get("cpu")}
    if not rows:
        return []
    L = ["", "## Where the cores went", "",
         "Mean share of a core per role while a run's requests were served (CPU seconds over the run's wall "
         "time; `kunserve compare`'s `cpu_share`). The front end and the engines' API servers are Python "
         "processes behind `kunserve serve`; behind vllm-router only the API servers are. The front end's "
         "monitor polls the engines, and the client's metrics scrape (once a second) reaches both engines' "
         "`/metrics` through `kunserve serve` and one engine's through vllm-router.", ""]
    L += md_table(["system", *(label for _, label in CPU_ROLES)], "l" + "r" * len(CPU_ROLES),
                  ([s, *(f"{c.get(k, 0.0):.3f}" for k, _ in CPU_ROLES)] for s, c in rows.items()))
    return L


#: kunserve and its stock twin: the same engines, KV and (no) batch cap, the plugin installed but inert
TWIN = ("kunserve", "vllm")


def pair_ratios(a: list[pooled.Request], b: list[pooled.Request]) -> dict:
    """``a`` over ``b``, pooled with intervals: TTFT P50 / P90 / P99 and P50 TPOT, and each side's count."""
    return {"n": [len(a), len(b)], **{f"ttft_p{q}": pooled.percentile_ratio(a, b, q) for q in (50, 90, 99)},
            "tpot_p50": pooled.percentile_ratio(a, b, 50, metric="tpot")}


def apart(x: dict) -> list[str]:
    """The statistics of :func:`pair_ratios`'s ``x`` whose 95% interval excludes 1."""
    return [label for label, key in (("P50 TTFT", "ttft_p50"), ("P90 TTFT", "ttft_p90"), ("P99 TTFT", "ttft_p99"),
                                     ("P50 TPOT", "tpot_p50"))
            if x[key].get("lo") is not None and (x[key]["lo"] > 1 or x[key]["hi"] < 1)]


def ablation(reqs: dict[str, list[pooled.Request]], variants: list[str]) -> dict:
    """Each ablation variant over ``kunserve`` in the burst window (:func:`pair_ratios`): what the
    mechanisms the variant turns off buy. Empty unless kunserve and a variant ran."""
    return {v: pair_ratios(reqs[v], reqs["kunserve"]) for v in variants if v in reqs and "kunserve" in reqs}


def ablation_section(abl: dict, variants: dict[str, str]) -> list[str]:
    if not abl:
        return []
    L = ["", "## Each ablation against kunserve", "",
         "Pooled over the burst window, variant / kunserve with 95% bootstrap intervals (above 1: kunserve's own "
         "settings, which the variant changes, were worth that much). The variants, as merged over the benchmark's "
         "config:",
         ""] + [f"- `{v}`: `{variants.get(v, '')}`" for v in abl] + [""]
    L += md_table(["variant / kunserve", "requests", "P50 TTFT", "P90 TTFT", "P99 TTFT", "P50 TPOT",
                   "intervals excluding 1"], "lrlllll",
                  ([v, f"{x['n'][0]} / {x['n'][1]}", *(fmt_ci(x[f"ttft_p{q}"]) for q in (50, 90, 99)),
                    fmt_ci(x["tpot_p50"]), ", ".join(apart(x)) or "none"] for v, x in abl.items()))
    return L


def twin(run: Path, window: tuple[float, float], reqs: dict[str, list[pooled.Request]], groups: dict,
         totals: dict, reps: int | None = None) -> dict | None:
    """kunserve over its stock twin ``vllm``, pooled with intervals: TTFT P50 / P90 / P99 and P50
    TPOT of the burst window's arrivals (``reqs``, as :func:`load_runs` read them) and of the warm
    phase's, the runs' output tokens/s and each role's share of the cores. Where kunserve never
    grouped, this is what the plugin costs an engine that never drops. None unless both ran."""
    k, v = TWIN
    if not (k in totals and v in totals):
        return None
    out: dict = {"grouped_reps": sorted(groups.get(k) or {})}
    for phase, r in (("window", reqs), ("warm", load_runs(run, list(TWIN), (0.0, window[0]), reps))):
        if k not in r or v not in r:
            continue
        out[phase] = pair_ratios(r[k], r[v])
    tk, tv = totals[k].get("output_tokens_per_s"), totals[v].get("output_tokens_per_s")
    out["output_tokens_per_s"] = [tk, tv]
    out["cpu"] = {role: [totals[k].get("cpu", {}).get(role), totals[v].get("cpu", {}).get(role)]
                  for role, _ in CPU_ROLES}
    return out


def twin_section(tw: dict | None) -> list[str]:
    if not tw or "window" not in tw:
        return []
    k, v = TWIN
    grouped = tw["grouped_reps"]
    L = ["", f"## {k} against its stock twin", "",
         f"`{v}` is the same two engines with the same KV and no batch cap, the plugin installed but inert (no "
         f"`kunserve` key), behind the same front end. "
         + (f"{k} never grouped in any repetition, so this is what the plugin costs an engine that never drops "
            "(its agent, control port and the front end's monitor polling it)." if not grouped else
            f"{k} grouped in repetition(s) {', '.join(map(str, grouped))}: the ratios include its drops.")
         + f" Pooled {k} / {v}, 95% bootstrap intervals; the warm phase is the requests that arrived before the burst "
         "(they run into it):", ""]
    rows = []
    for phase, label in (("window", "burst window"), ("warm", "warm phase")):
        x = tw.get(phase)
        if x:
            rows.append([label, f"{x['n'][0]} / {x['n'][1]}", *(fmt_ci(x[f"ttft_p{q}"]) for q in (50, 90, 99)),
                         fmt_ci(x["tpot_p50"])])
    L += md_table(["requests", f"{k} / {v}", "P50 TTFT", "P90 TTFT", "P99 TTFT", "P50 TPOT"], "lrllll", rows)
    tk, tv = tw["output_tokens_per_s"]
    cpu = tw["cpu"]
    L += ["", (f"Output tokens/s (mean of the runs' rates): {tk:.1f} against {tv:.1f} ({tk / tv:.3f}x). " if tk and tv
               else "") + "Share of a core: " + "; ".join(
        f"{label} {cpu[role][0]:.3f} against {cpu[role][1]:.3f}" for role, label in CPU_ROLES
        if cpu.get(role) and None not in cpu[role] and any(cpu[role])) + "."]
    L += ["", "In the burst window, intervals that exclude 1 (a difference this many requests can tell from noise): "
          + (", ".join(apart(tw["window"])) or "none") + "."]
    return L


def share_for_kv_factor(x: float) -> float:
    """The weight share w at which a 2-engine group holds ``x`` times its members' KV: the inverse of
    ``group_kv_factor`` (x = 1 + w / (2 (1 - w)))."""
    return 2 * (x - 1) / (1 + 2 * (x - 1))


def reused_note(command: str, swept: bool = True, capacity_from: str = "") -> str:
    """Where the measuring command ran only some steps, the others' results came from the run
    directory: say so (the capacity and the sweep then predate the comparison). ``swept``: the doc
    has a sweep at all (an ablation without tuned stock has none to have reused). ``capacity_from``:
    which run measured a capacity copied into the run directory (its ``measured_by``)."""
    argv = shlex.split(command)
    steps = argv[argv.index("--steps") + 1] if "--steps" in argv[:-1] else "capacity,sweep,compare"
    missing = [x for x in ("capacity", "sweep") if x not in steps.split(",") and (swept or x != "sweep")]
    if not missing:
        return ""
    return (f"The {' and the '.join(missing)} {'were' if len(missing) > 1 else 'was'} not re-measured by this "
            f"command (`--steps {steps}`): {'they are' if len(missing) > 1 else 'it is'} an earlier run's, "
            "read from the run directory" + (f" (the capacity: {capacity_from})" if capacity_from and
                                              "capacity" in missing else "") + ".")


def sweep_section(sw: dict) -> list[str]:
    """The batch-cap sweep's table: per cap, window TTFT pooled over its repetitions (P99 with its 95%
    interval), TPOT and end-to-end latency; the lowest pooled P99 TTFT is the tuned cap."""
    reps = sw.get("repeat", 1)
    L = [f"Batch-cap sweep for `vllm-tuned` ({reps} repetition{'s' if reps > 1 else ''} of each cap on this trace"
         + (", the caps in an order shuffled per repetition: " + "; ".join(", ".join(map(str, o)) for o in sw["orders"])
            if sw.get("orders") else "") + "; window TTFT pooled over the repetitions; the lowest P99 is the tuned cap):", ""]
    L += md_table(["--max-num-seqs", "window requests", "P50 TTFT (s)", "P99 TTFT (s) (95%)", "P50 TPOT (ms)",
                   "P99 E2E (s)", "preemptions"], "rrrlrrr",
                  ([r["cap"], r.get("requests", "-"), f"{r['p50']:.2f}",
                    f"{r['p99']:.2f}" + (f" ({r['p99_lo']:.2f}..{r['p99_hi']:.2f})" if r.get("p99_lo") is not None else ""),
                    f"{r['tpot_p50'] * 1e3:.0f}", "-" if r.get("e2e_p99") is None else f"{r['e2e_p99']:.1f}",
                    r["preemptions"]] for r in sw["rows"]))
    return L


def analyse(reqs: dict[str, list[pooled.Request]], ttft_slo: float, tpot_slo: float,
            equal: str = "oracle-equal") -> dict:
    """Pooled statistics per system, the best alternative per statistic, and the comparisons with
    ``equal``, the stock system holding the memory a kunserve group reaches."""
    stats = {s: {"n": len(r), "lost": sum(not x.ok for x in r), "reps": len({x.rep for x in r}),
                 "ttft": pooled.tail(r), "tpot": pooled.tpot(r), "goodput": pooled.goodput(r, ttft_slo, tpot_slo)}
             for s, r in reqs.items()}
    alts = [s for s in ALTERNATIVES if s in stats]
    best = {}
    for q in ("p50", "p90", "p99"):
        if alts:
            best[q] = min(alts, key=lambda s: stats[s]["ttft"][q]["value"])
    if alts:
        best["goodput"] = max(alts, key=lambda s: stats[s]["goodput"] or 0)
    cmp: dict = {}
    for s in reqs:
        if s in alts:
            continue
        c = {}
        for q in ("p50", "p90", "p99"):
            qq = float(q[1:])
            if equal in reqs:
                c[f"{q}_over_equal"] = pooled.percentile_ratio(reqs[s], reqs[equal], qq)
                if s != equal:
                    c[f"{q}_over_equal_each_out"] = pooled.without_each_rep(reqs[s], reqs[equal], qq)
            if q in best:
                c[f"{q}_over_best"] = pooled.percentile_ratio(reqs[s], reqs[best[q]], qq)
                if equal in reqs and s != equal:
                    c[f"{q}_gap_closed"] = pooled.gap_closed(reqs[best[q]], reqs[s], reqs[equal], qq)
        cmp[s] = c
    extra = {}
    if equal in reqs:
        for q in ("p90", "p99"):
            if q in best:   # against an equal whose tail is a lost request there is no gap to read
                extra[f"best_{q}_over_equal"] = (pooled.percentile_ratio(reqs[best[q]], reqs[equal], float(q[1:]))
                                                 if math.isfinite(stats[equal]["ttft"][q]["value"]) else
                                                 {"value": None, "lo": None, "hi": None, "equal_lost": True})
    return {"stats": stats, "best": best, "compare": cmp, "equal": equal, **extra}


def fmt_ci(c: dict | None, digits: int = 2) -> str:
    if not c or c.get("value") is None:
        return "-"
    f = lambda x: "inf" if x is None or math.isinf(x) else f"{x:.{digits}f}"  # noqa: E731
    return f"{f(c['value'])} ({f(c['lo'])}..{f(c['hi'])})"


def each_out_note(each: list[dict], carried: list[int]) -> str:
    """The ratio with each repetition left out (``pooled.without_each_rep``) and, where the pooled
    point meets a target that one of those misses, which repetitions carry it."""
    if not each:
        return ""
    v = [x["value"] for x in each]
    note = f"; each left out: {min(v):.2f}..{max(v):.2f}"
    if carried:
        reps = ", ".join(str(k) for k in carried)
        note += (f" (not met without repetition{'s' if len(carried) > 1 else ''} {reps}: the pooled point rests on "
                 f"{'them' if len(carried) > 1 else 'it'})")
    return note


def verdict(an: dict, totals: dict, groups: dict, window: tuple[float, float],
            measured_only: bool = False) -> list[str]:
    """The issue's R1 targets, each met or missed, with the measured figure (``measured_only``: leave
    out the targets this run cannot measure, as those against an alternative where none ran)."""
    st, cmp, best = an["stats"], an["compare"].get("kunserve", {}), an["best"]
    out = []

    def line(target: str, measured: str, ok: bool | None):
        if ok is None and measured_only:
            return
        out.append(f"- {target}: {measured} -> **{'met' if ok else ('missed' if ok is not None else 'not measured')}**")
    eq = an.get("equal", "oracle-equal")
    b99 = an.get("best_p99_over_equal")
    gap = b99 is not None and b99.get("value") is not None and b99["value"] >= 2
    line(f"a gap to close: the best alternative's P99 >= 2x {eq}'s",
         fmt_ci(b99) + (f" ({eq}'s P99 is a lost request)" if (b99 or {}).get("equal_lost") else ""),
         None if b99 is None or b99.get("value") is None else gap)
    ecmp = an["compare"].get(eq, {})
    beyond: list[str] = []

    def by_equal(figure: str, ok: bool | None, target: str, kunserve_ok: bool | None) -> str:
        """What the same memory without the pipeline scores on a target: where it misses too, the
        target is beyond what the memory a group reaches buys on this machine."""
        if ok is False and kunserve_ok is False:
            beyond.append(target)
        return "" if ok is None else f"; {eq} (the same memory, no pipeline): {figure}, {'met' if ok else 'missed'}"
    for q in ("p90", "p99"):
        g = cmp.get(f"{q}_gap_closed")
        bq = an.get(f"best_{q}_over_equal")
        no_gap = ("" if g and g.get("value") is not None or not bq or bq.get("value") is None else
                  f" (no gap there: the best alternative's {q.upper()} is {fmt_ci(bq)}x {eq}'s)")
        line(f"kunserve closes >= 70% of the gap from the best alternative to {eq} at {q.upper()}", fmt_ci(g) + no_gap,
             None if not g or g.get("value") is None else g["value"] >= 0.7)
    r = cmp.get("p99_over_equal")
    ok = None if not r or r.get("value") is None else r["value"] <= 1.2
    each = cmp.get("p99_over_equal_each_out") or []
    carried = [x["rep"] for x in each if not x["value"] <= 1.2] if ok else []
    line(f"kunserve P99 TTFT <= 1.2x {eq}'s" + (", pooled and with each repetition left out" if each else ""),
         fmt_ci(r) + each_out_note(each, carried), ok and not carried if ok is not None else None)
    for q in ("p90", "p99"):
        r, re_ = cmp.get(f"{q}_over_best"), ecmp.get(f"{q}_over_best")
        ok = None if not r or r.get("value") is None else (r["hi"] is not None and r["hi"] <= 0.6)
        eok = None if not re_ or re_.get("value") is None else (re_["hi"] is not None and re_["hi"] <= 0.6)
        line(f"kunserve {q.upper()} <= 0.6x the best alternative's ({best.get(q)}), the interval's top included",
             fmt_ci(r) + by_equal(fmt_ci(re_), eok, f"{q.upper()} TTFT", ok), ok)
    if "kunserve" in st and best.get("p50"):
        alts = [s for s in ALTERNATIVES if s in st]
        ref = min(alts, key=lambda s: st[s]["tpot"]["p50"] or math.inf)
        tpot = lambda s: st[s]["tpot"]["p50"] / st[ref]["tpot"]["p50"]  # noqa: E731
        t = tpot("kunserve")
        te = tpot(eq) if eq in st and st[eq]["tpot"]["p50"] else None
        line(f"kunserve P50 TPOT <= 1.2x the best alternative's ({ref})",
             f"{t:.2f}" + ("" if te is None else by_equal(f"{te:.2f}", te <= 1.2, "TPOT", t <= 1.2)), t <= 1.2)
        gb = st[best["goodput"]]["goodput"]
        gk = st["kunserve"]["goodput"]
        ge = st[eq]["goodput"] if eq in st else None
        line(f"kunserve goodput >= 1.3x the best alternative's ({best['goodput']})",
             (f"{gk:.3f} vs {gb:.3f} ({gk / gb:.2f}x)" if gb else f"{gk:.3f} vs 0")
             + ("" if ge is None or not gb else by_equal(f"{ge:.3f} ({ge / gb:.2f}x)", ge / gb >= 1.3, "goodput",
                                                                 bool(gb) and gk / gb >= 1.3)),
             bool(gb) and gk / gb >= 1.3)
    lost = sum(v["failed"] for v in totals.values())
    line("zero requests lost (every run)", f"{lost} failed", lost == 0)
    ks = groups.get("kunserve", {})
    if ks:
        early = [k for k, g in ks.items() if g["first_s"] < window[0]]
        line("no group forms in the warm phase (below the trigger)",
             "first grouped at " + ", ".join(f"{g['first_s']:g} s" for g in ks.values()) + "; warm phase ends at "
             f"{window[0]:g} s", not early)
    if beyond:
        why = ("" if not {"TPOT", "goodput"} & set(beyond) else
               " For TPOT and goodput the batch table above says why: on this CPU a decode step grows with its "
               "batch, so the KV that admits more requests at once makes every step, and so every token, slower, "
               "where the best alternative on TPOT keeps its batch small and its queue long.")
        out += ["", f"{eq} misses the {', '.join(beyond)} target{'s' if len(beyond) > 1 else ''} too: stock with the "
                f"memory a group reaches and no pipeline cannot meet {'it' if len(beyond) == 1 else 'them'} either, "
                "so what these targets ask of a drop is more than the same memory buys stock on this machine (oracle-equal "
                "is a reference, not a bound)." + why]
    return out


def plot(path: Path, an: dict, systems: list[str], title: str) -> bool:
    plt = pyplot(optional=True)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(11, 4.2))
    qs = ("p50", "p90", "p99")
    shown = [s for s in systems if s in an["stats"]]
    width = 0.8 / max(1, len(shown))
    for i, s in enumerate(shown):
        t = an["stats"][s]["ttft"]
        vals = [t[q]["value"] for q in qs]
        err = [[v - t[q]["lo"] for q, v in zip(qs, vals)],
               [(t[q]["hi"] if math.isfinite(t[q]["hi"]) else v) - v for q, v in zip(qs, vals)]]
        ax.bar([j + i * width for j in range(len(qs))], vals, width, yerr=err, capsize=3, label=LABEL.get(s, s))
    ax.set_xticks([j + width * (len(shown) - 1) / 2 for j in range(len(qs))])
    ax.set_xticklabels([q.upper() + " TTFT" for q in qs])
    ax.set_yscale("log")
    ax.set_ylabel("seconds (pooled burst window, 95% bootstrap interval)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path, dpi=90)
    return True


def front_events(run: Path, repeat: int, kinds: str, system: str = "kunserve"):
    """(repetition, log time in s, kind, fields) of every event ``kinds`` (a regex alternation)
    that ``system``'s front end logged in each repetition (its ``server.log`` lines ``<date> <time>,<ms>
    <logger> INFO <kind> {...}``), in order."""
    line_re = re.compile(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{{3}}) \S+ INFO ({kinds}) (\{{.*\}})$")
    for k in range(1, repeat + 1):
        log = run / system / f"rep{k}" / "server.log"
        if not log.exists():
            continue
        for line in log.read_text(errors="replace").splitlines():
            m = line_re.match(line)
            if m:
                t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
                yield k, t, m.group(3), ast.literal_eval(m.group(4))


def monitor_decisions(run: Path, repeat: int) -> list[dict]:
    """The front end's drop decisions in kunserve's runs that formed no group: its log lines
    ``compute_bound {...}`` (demand above the trigger, the decode share of the work below
    ``drop.min_decode_share``: more KV would not buy throughput, so nothing is dropped)."""
    return [{"rep": k, "event": kind, **info}
            for k, _, kind, info in front_events(run, repeat, "compute_bound|compute_bound_over")]


def join_events(run: Path, repeat: int, system: str = "kunserve") -> list[dict]:
    """Each repetition's first group join of ``system`` (kunserve or a ``--variant`` of it), from its
    front end's log: when the drop was first due and deferred (``drop_deferred``: requests awaiting
    their first token), when the join was logged, its length at the front end and in each engine,
    and its workers' largest steps."""
    out, deferred_at = {}, {}
    for k, t, kind, info in front_events(run, repeat, "group_join|drop_deferred", system):
        if k in out:
            continue
        if kind == "drop_deferred":  # logged when a deferral starts: the join's is the latest
            deferred_at[k] = t
            continue
        if info.get("outcome") != "ok":
            continue
        wms = [w for ws in (info.get("worker_ms") or {}).values() for w in (ws or []) if w]
        out[k] = {"rep": k, "ms": info.get("ms"), "bytes": info.get("bytes"),
                  "engine_ms": sorted((info.get("engine_ms") or {}).values()),
                  "deferred_s": round(t - info["ms"] / 1e3 - deferred_at[k], 2) if k in deferred_at else 0.0,
                  "kv_send_ms": max((w.get("kv_send", 0) for w in wms), default=None),
                  "barrier_wait_ms": max((w.get("ready_barrier", 0) for w in wms), default=None),
                  "zero_map_ms": max((w.get("residency.foreign_create", 0) + w.get("residency.kv_grow_after", 0)
                                      for w in wms), default=None)}
    return list(out.values())


def join_section(joins: list[dict]) -> list[str]:
    """The doc's lines on how long kunserve's joins took and whether they waited for first tokens."""
    if not joins:
        return []
    L = ["", "Each repetition's join: how long a due drop waited for the members' requests to get their first "
         "token (`drop.defer_for_first_token_s`, at most 2 s, never while the KV is short), the join's length at the "
         "front end (the members' state reads, their waits for a step to end, the transition) and in each engine, "
         "and, of its workers' steps, the longest wait for the peer at the first barrier, the KV exchange's sending "
         "and the KV regions' mapping and zeroing:", ""]
    L += md_table(["rep", "waited (s)", "join (ms)", "engines (ms)", "peer wait (ms)", "KV send (ms)", "map + zero (ms)",
                   "KV moved (MB)"], "rrrlrrrr",
                  ([j["rep"], f"{j['deferred_s']:.2f}", f"{j['ms']:.0f}", " / ".join(f"{x:.0f}" for x in j["engine_ms"]) or "-",
                    "-" if j["barrier_wait_ms"] is None else f"{j['barrier_wait_ms']:.0f}",
                    "-" if j["kv_send_ms"] is None else f"{j['kv_send_ms']:.0f}",
                    "-" if j["zero_map_ms"] is None else f"{j['zero_map_ms']:.0f}", f"{(j['bytes'] or 0) / 1e6:.0f}"]
                   for j in joins))
    return L


def no_gap_note(meta: dict, an: dict) -> list[str]:
    """Where the best alternative's P99 is within 1.5x oracle-equal's, why: what a request costs in
    prefill and in decode on this CPU (the batch table's lines) and what the monitor decided."""
    b99 = an.get("best_p99_over_equal") or {}
    if b99.get("value") is None or b99["value"] >= 1.5:
        return []
    L = ["", "## Why there is no gap here", "",
         f"The best alternative's P99 is {b99['value']:.2f}x oracle-equal's (within 1.5x): the same memory as a "
         "group buys almost nothing on this workload, so there is nothing for a drop to win. "]
    pl, lengths = meta.get("prefill_line"), meta.get("mean_lengths")
    rows = {r["batch"]: r for r in meta.get("scaling_rows", [])}
    if pl and lengths and 16 in rows and 32 in rows:
        pre_s = pl["fixed_ms"] / 1e3 + lengths["mean_prompt"] / pl["tokens_per_s"]
        dec16 = lengths["mean_output"] / rows[16]["tokens_per_s"]
        gain = rows[32]["tokens_per_s"] / rows[16]["tokens_per_s"] - 1
        share = dec16 / (pre_s + dec16)
        L[-1] += (f"A request's prefill ({lengths['mean_prompt']:.0f} tokens at {pl['tokens_per_s']:.0f} tokens/s plus "
                  f"{pl['fixed_ms']:.0f} ms) costs an engine {pre_s:.2f} s of its core and its decode "
                  f"({lengths['mean_output']:.0f} tokens at batch 16's {rows[16]['tokens_per_s']:.0f} tokens/s) "
                  f"{dec16:.2f} s: decode is {share:.0%} of the work. More KV lets the batch grow past 16, and batch 32 "
                  f"decodes {gain:.0%} more tokens/s (batch table), so the most extra KV can add to capacity is about "
                  f"{share * gain:.0%}; the burst's queue is compute, not memory.")
    dec = meta.get("monitor_decisions") or []
    if dec:
        shares = [d["decode_share"] for d in dec if "decode_share" in d]
        L += ["", f"kunserve's monitor saw it: in {len({d['rep'] for d in dec})} of {meta['repeat']} repetitions KV "
              f"demand crossed the drop trigger (ratio up to {max(d.get('ratio', 0) for d in dec):.2f}) with the "
              f"decode share of the queued work at {min(shares):.2f}..{max(shares):.2f}, below "
              f"`drop.min_decode_share` {dec[0].get('min_decode_share')}: it logged `compute_bound` and formed no "
              "group, as designed: this is the prefill-heavy negative control. kunserve "
              "here is the plugin installed and not dropping; what it costs against stock is in the table above."]
    return L


def render(a: argparse.Namespace, meta: dict, an: dict, totals: dict, lag: dict, groups: dict, systems: list[str],
           name: str) -> str:
    st = an["stats"]
    w = meta["weight_share"]
    L = [f"# What dropping buys under a burst, regime {a.regime.upper()} (written by benchmarks/burst_value.py)", "",
         f"Command: `{meta['command']}`" + (f" (this doc re-written by `{meta['rewritten']}`)" if meta.get("rewritten")
                                           else "") + ".", "",
         f"![pooled TTFT]({name}.png)", "", "## Regime", "",
         f"{meta['cpu']}; preset `{meta['preset']}` ({meta['weight_bytes'] / 1e6:.0f} MB of weights, "
         f"{meta['kv_bytes_per_token'] / 1024:.0f} KiB of KV per token); each engine on its own core with one compute "
         f"thread (`OMP_NUM_THREADS=1`, `KUNSERVE_ENGINE_CPUS=0|1`); KV for {a.kv_tokens} tokens per engine "
         f"({a.kv_tokens * meta['kv_bytes_per_token'] / 1e6:.0f} MB): weights are **{w:.0%}** of an engine's weights + "
         f"KV, so a 2-engine group holds **{meta['group_kv_factor']:.2f}x** the KV of its members apart "
         + ("(paper-like: w in 0.35..0.65)." if 0.35 <= w <= 0.65 else "(**extreme**: outside the paper-like 0.35..0.65).")
         + ("" if meta["oracle_equal_x"] >= meta["group_kv_factor"] - 0.01 else
            f" kunserve's KV may grow only to **{meta['oracle_equal_x']:g}x** its base (`memory.max_kv_ratio`), and "
            f"oracle-equal gets the same {meta['oracle_equal_x']:g}x: the KV a 2-engine group reaches where weights "
            f"are {share_for_kv_factor(meta['oracle_equal_x']):.0%} of an engine's memory."),
         "", "Decode step by batch, one thread (`" + meta.get("scaling_doc", "") + "`):", ""]
    L += scaling_table(meta.get("scaling_rows", []))
    cap, mix = meta.get("capacity"), meta.get("mix", MIX)
    L += [""]
    if cap and cap.get("rows"):
        L += ["Capacity, measured: a closed-loop saturation run of two stock engines behind `kunserve serve`, driven by "
              "`vllm bench serve` (" + (meta.get("capacity_data") or f"random dataset, ~{mix['prompt_len']}-token "
                                        f"prompts, outputs {mix['output_len']}..{mix['output_len_max']} tokens")
              + ", `--ignore-eos`):", ""]
        L += md_table(["concurrency", "requests", "req/s", "output tokens/s", "median TPOT (ms)"], "rrrrr",
                      ([r["concurrency"], r["completed"], f"{r['req_per_s']:.3f}", f"{r['output_tokens_per_s']:.1f}",
                        f"{r['median_tpot_ms']:.1f}"] for r in cap["rows"]))
        L += ["", f"Capacity: **{cap['req_per_s']:.3f} req/s** (the best row). "
              + reused_note(meta["command"], swept=bool(meta.get("sweep")), capacity_from=cap.get("measured_by", ""))]
    elif cap:
        L += [f"Capacity: {cap.get('note')}", ""]
    L += [f"Workload: the Azure LLM conversation trace's (2023, CC BY 4.0) arrival times re-timed into phases "
          f"`{meta['phases']}`" + (f" ({meta['load_note']})" if meta.get("load_note") else "")
          + "; " + meta.get("lengths_note", f"{mix['prompt_len']}-token prompts, outputs uniform in "
                            f"{mix['output_len']}..{mix['output_len_max']} tokens") + ". Burst window: arrivals in "
          f"[{meta['window'][0]:g}, {meta['window'][1]:g}) s.", ""]
    sw = meta.get("sweep")
    if sw:
        L += sweep_section(sw)
        L += ["", f"Tuned cap: **{sw['cap']}**.", ""]
    L += ["## Systems", ""] + [f"- `{s}`: {meta['descriptions'].get(s, '')}" for s in systems] + [""]
    L += ["## Pooled over the repetitions (burst window)", "",
          f"{meta['repeat']} repetitions; the order the systems ran in: "
          + (meta["orders"] if isinstance(meta.get("orders"), str) else
             "shuffled per repetition, " + "; ".join(", ".join(o) for o in meta.get("orders") or []))
          + ". TTFT percentiles over every window request of every repetition (a lost "
          "request counts as an infinite TTFT), with bootstrap 95% intervals (requests resampled within each "
          f"repetition, {pooled.DRAWS} draws). Goodput: the share of window requests with TTFT <= {meta['ttft_slo']:g} s "
          f"and TPOT <= {meta['tpot_slo'] * 1e3:.0f} ms ({meta['tpot_slo_note']}).", ""]
    L += md_table(["system", "window requests", "P50 TTFT (s)", "P90 TTFT (s)", "P99 TTFT (s)", "P50 / P99 TPOT (ms)",
                   "goodput", "output tok/s (run)", "preemptions (all runs)", "lost"], "lrllllrrrr")
    for s in systems:
        if s not in st:
            continue
        x, t = st[s], totals.get(s, {})
        tp = x["tpot"]
        L.append(md_row([s, x["n"], fmt_ci(x["ttft"]["p50"]), fmt_ci(x["ttft"]["p90"]), fmt_ci(x["ttft"]["p99"]),
                         f"{tp['p50'] * 1e3:.0f} / {tp['p99'] * 1e3:.0f}" if tp["p50"] else "-", f"{x['goodput']:.3f}",
                         f"{t['output_tokens_per_s']:.1f}" if t.get("output_tokens_per_s") else "-",
                         "-" if t.get("preemptions") is None else t["preemptions"], x["lost"]]))
    L += ["", "Preemptions are vLLM's counter of both engines over all runs (`-` behind vllm-router: its "
          "`/metrics` answers with one engine's). Output tok/s is the mean over runs of the whole run's rate.", "",
          ("Best alternative per statistic (the better of " + ", ".join(s for s in ALTERNATIVES if s in st) + "): "
           + ", ".join(f"{k.upper()} {v}" for k, v in an["best"].items()) + "." if an["best"] else
           "No alternative ran here (an ablation): the ratios below are to oracle-equal only." if an["equal"] in st
           else "Neither an alternative nor oracle-equal ran here (kunserve and its variants only): each variant is "
                "compared with kunserve in the section below."), ""]
    eq = an["equal"]
    for q in ("p90", "p99"):
        if f"best_{q}_over_equal" in an:
            L.append(f"- the best alternative's {q.upper()} TTFT over {eq}'s: {fmt_ci(an[f'best_{q}_over_equal'])}")
    if an["best"] or eq in st:   # kunserve and its variants alone have no ratios to take here
        L += ["", "Ratios (pooled, 95% bootstrap interval of independent resamples):", ""]
        L += md_table(["system", "P50 / best", "P90 / best", "P99 / best", f"P90 / {eq}", f"P99 / {eq}",
                       "gap closed P90", "gap closed P99"], "l" * 8,
                      ([s, *(fmt_ci(c.get(k)) for k in ("p50_over_best", "p90_over_best", "p99_over_best",
                                                        "p90_over_equal", "p99_over_equal", "p90_gap_closed",
                                                        "p99_gap_closed"))]
                       for s, c in an["compare"].items()))
        L += ["", f"Gap closed = (best alternative - system) / (best alternative - {eq}) at that percentile; it is "
              f"reported only against {eq}, stock with the memory a kunserve group reaches. static is an alternative "
              "configuration, not a bound: kunserve can beat it.", ""]
    L += ["## Verdict (issue 34's targets for R1" + (", applied to R0 for reference)" if a.regime == "r0" else ")"),
          ""]
    if not an["best"]:   # no alternative ran (an ablation): the targets against it are not measured here
        L += ["No alternative ran here: only the targets this run measures. Those against the best alternative are "
              "in the page of the run with them.", ""]
    L += verdict(an, totals, groups, meta["window"], measured_only=not an["best"])
    L += no_gap_note(meta, an)
    L += without_slow_section(an.get("without_slow"), systems, groups, meta["window"])
    joins = {"kunserve": meta.get("joins") or [], **(meta.get("variant_joins") or {})}
    for sysname, sys_joins in joins.items():
        ks = groups.get(sysname, {})
        if not ks:
            continue
        L += ["", f"## When {sysname} grouped", "",
              "The first second its engines were in a pipeline group, the share of the burst window's seconds they "
              "were, and what each engine held at the window's end (layers, KV blocks of 32 tokens):", ""]
        L += md_table(["rep", "first grouped (s)", "window share", "layers", "KV blocks"], "rrrll",
                      ([k, f"{g['first_s']:g}", g["window_share"], g["layers"], g["kv_blocks"]]
                       for k, g in sorted(ks.items())))
        L += ["", f"oracle-equal holds {meta['oracle_equal_x']:.2f}x the base KV per engine "
              f"({int(a.kv_tokens * meta['oracle_equal_x'] // 32)} blocks)."]
        L += grouped_output_section(an.get("grouped_output", {}).get(sysname), an["equal"])
        L += join_section(sys_joins)
    L += tail_section(an.get("tail") or {}, an["equal"], shadow=join_shadow(joins, groups, meta["window"]))
    split = meta.get("dispatch_split") or {}
    if split:
        L += ["", "## Dispatch split", "",
              "The burst window's arrivals `kunserve serve`'s front end gave each engine (engine 0 / engine 1; its "
              "`kunserve:dispatched_total` counters) per repetition. vllm-router's split is not recorded (its "
              "engines' counters are not behind it).", ""]
        reps = range(1, meta["repeat"] + 1)
        L += md_table(["system", *(f"rep {k}" for k in reps)], "l" * (1 + len(reps)),
                      ([s, *(" / ".join(map(str, v[k])) if k in v else "-" for k in reps)] for s, v in split.items()))
    L += machine_section(meta.get("machine") or {}, meta["repeat"], meta.get("machine_warm") or (0, 0))
    L += lever_section(meta.get("levers") or {})
    L += ablation_section(an.get("ablation") or {}, meta.get("variants") or {})
    L += twin_section(an.get("twin"))
    L += cpu_section(totals)
    L += ["", "## The client", "", "Largest send lag per system over all its runs, requests sent > 50 ms late and, for "
          "a system with late sends, its window's pooled TTFT P50 / P90 / P99 counted from each request's arrival "
          "(the tables count from the send): " + json.dumps(lag) + ".", "",
          f"Raw data: `{meta['raw']}`: `compare.json` (every run's summary, the order), `page.json` (the pooled "
          f"statistics), `{meta['raw_layout']}/requests.csv` (every request) and `timeline.csv`."]
    return "\n".join(L) + "\n"


def without_slow_section(ws: dict | None, systems: list[str], groups: dict, window: tuple[float, float]) -> list[str]:
    """The pooled statistics and the verdict again over the repetitions in which no run was slow
    (``machine_section``): each repetition is left out whole, for every system, so the systems still
    ran the same arrivals in the same cycles of the order."""
    if not ws:
        return []
    st, reps = ws["stats"], ws["reps"]
    L = ["", "## Without the repetitions a slow run fell in", "",
         f"Repetition{'s' if len(reps) > 1 else ''} {', '.join(map(str, reps))} left out for every system (a run in "
         f"{'them' if len(reps) > 1 else 'it'} was on a slower machine, see \"The machine in each run\"); the same "
         "pooled statistics over the rest. Lost: window requests here.", ""]
    L += md_table(["system", "window requests", "P50 TTFT (s)", "P90 TTFT (s)", "P99 TTFT (s)", "P50 TPOT (ms)",
                   "goodput", "lost"], "lrlllrrr")
    for s in systems:
        if s in st:
            x = st[s]
            L.append(md_row([s, x["n"], fmt_ci(x["ttft"]["p50"]), fmt_ci(x["ttft"]["p90"]), fmt_ci(x["ttft"]["p99"]),
                             f"{x['tpot']['p50'] * 1e3:.0f}" if x["tpot"]["p50"] else "-", f"{x['goodput']:.3f}",
                             x["lost"]]))
    L += ["", "Verdict over these repetitions:", ""]
    totals = {s: {"failed": x["lost"]} for s, x in st.items()}
    kept = {s: {k: g for k, g in v.items() if k not in reps} for s, v in groups.items()}
    return (L + verdict(ws, totals, kept, window, measured_only=not ws["best"])
            + tail_section(ws.get("tail") or {}, ws["equal"], "### Where the tail sits over these repetitions"))


def machine_section(speed: dict, repeat: int, warm: tuple[float, float]) -> list[str]:
    """Each run's machine speed (``burst.machine_speed``) and the runs on a slower machine."""
    if not speed:
        return []
    reps = range(1, repeat + 1)

    def cell(x: dict | None) -> str:
        if not x or x.get("rate") is None:
            return "-"
        steal = "" if x.get("steal_cores") is None else f", steal {x['steal_cores']:.2f}"
        return f"{x['rate']:.2f} ({x['of_median']:.2f}x{steal})" + (" **slow**" if x["slow"] else "")
    slow = [f"{s} rep {k} ({x['of_median']:.2f}x)" for s, v in speed.items() for k, x in sorted(v.items()) if x["slow"]]
    L = ["", "## The machine in each run", "",
         f"This VM's speed drifts by the hour, so each run's is read where every system is alike: "
         f"the client's decode rate over the warm phase ({warm[0]:g}-{warm[1]:g} s: a few requests on stock-like engines; "
         f"each request's tokens per second, 1 / TPOT, weighted by its seconds decoding there), in tokens/s, then "
         f"against the median run's, and the hypervisor's CPU steal over the run (cores' worth). "
         f"A run below {SLOW_SHARE:g}x the median is marked slow: its latencies are the machine's that hour as much as "
         f"the system's.", ""]
    L += md_table(["system", *(f"rep {k}" for k in reps)], "l" * (1 + len(reps)),
                  ([s, *(cell(v.get(k)) for k in reps)] for s, v in speed.items()))
    L += ["", ("Slow: " + ", ".join(slow) + ". The verdict's leave-one-out range says what a pooled ratio owes each "
               "repetition.") if slow else "No run was slow."]
    return L


def grouped_output_section(go: dict | None, ref: str) -> list[str]:
    """The group's output against ``ref``'s over the same seconds (:func:`grouped_output`), a row per
    repetition and one pooled."""
    if not go or "all" not in go:
        return []

    def cells(x: dict) -> list:
        return [x["seconds"], "-" if x["tokens"] is None else f"{x['tokens']:.2f}",
                "-" if x["running"] is None else f"{x['running']:.2f}"]
    L = ["", f"Output against {ref} over the same seconds of the window (every system replays the same arrivals, so "
         "a second is the same offered load): the seconds grouped and those before the first group, with the output "
         f"tokens and the running requests summed over them, each over {ref}'s (timeline.csv, sampled every second). "
         "Output below the running ratio is what the pipeline costs per request at the same batch (its bubbles, "
         "its hops, a step per microbatch):", ""]
    rows = [[k, *cells(v["grouped"]), *cells(v["before"])] for k, v in go.items() if k != "all"]
    rows.append(["all", *cells(go["all"]["grouped"]), *cells(go["all"]["before"])])
    L += md_table(["rep", "grouped (s)", "output", "running", "before (s)", "output", "running"], "lrrrrrr", rows)
    return L


def arrival_state(r: pooled.Request, groups: dict) -> tuple[str, float | None]:
    """Where a grouping system's engines were when ``r`` arrived (``groups``: that system's
    :func:`group_times`, per repetition): ``before`` its repetition's first group, ``grouped``, ``after``
    (split again), or ``alone`` (that repetition never grouped); and ``r``'s arrival less the first
    group's second (None where it never grouped)."""
    g = groups.get(r.rep)
    if not g:
        return "alone", None
    if in_spans(r.arrival_s, g.get("spans") or []):
        state = "grouped"
    else:
        state = "before" if r.arrival_s < g["first_s"] else "after"
    return state, round(r.arrival_s - g["first_s"], 2)


def pair_summary(pairs: list[tuple[pooled.Request, pooled.Request]]) -> dict:
    """Requests paired with their twins (:func:`pooled.paired`): how many, each side's pooled P99 TTFT
    over them and the median per-request TTFT ratio (None where every ratio is undefined)."""
    a, b = np.array([x.ttft_s for x, _ in pairs]), np.array([y.ttft_s for _, y in pairs])
    with np.errstate(divide="ignore", invalid="ignore"):
        rat = a / b
    rat = rat[~np.isnan(rat)]
    return {"n": len(pairs), "p99": pooled.point([a], 99), "ref_p99": pooled.point([b], 99),
            "median_ratio": float(np.median(rat)) if rat.size else None}


def tail_sites(reqs: dict[str, list[pooled.Request]], groups: dict, ref: str) -> dict:
    """Where each system's pooled P99 TTFT sits. Per system: ``top``, its slowest window requests (one
    per 100 and one more: those at and above its P99), each with the arrivals in the second up to it
    in its repetition (the trace's own clusters), the grouping state at its arrival (for a system in
    ``groups``) and the same request's TTFT at ``ref`` (:func:`pooled.paired`); and ``paired``, its
    requests with their twins at ``ref``: how many, the median per-request TTFT ratio and, for a
    grouping system, the same by its state at arrival with each side's P99 over those requests.
    Empty without ``ref``."""
    if ref not in reqs:
        return {}
    out = {}
    for s, rs in reqs.items():
        pairs = pooled.paired(rs, reqs[ref]) if s != ref else []
        twin = {id(x): y.ttft_s for x, y in pairs}   # by the request itself: one instant's arrivals stay apart
        arrivals: dict[int, list[float]] = {}
        for r in rs:
            arrivals.setdefault(r.rep, []).append(r.arrival_s)
        g = groups.get(s)
        top = []
        for r in sorted(rs, key=lambda r: -r.ttft_s)[:len(rs) // 100 + 1]:
            state, since = arrival_state(r, g) if g is not None else (None, None)
            top.append({"rep": r.rep, "arrival_s": round(r.arrival_s, 2), "ttft_s": r.ttft_s,
                        "cluster": sum(r.arrival_s - 1.0 <= t <= r.arrival_s for t in arrivals[r.rep]),
                        "state": state, "since_group_s": since, "ref_ttft_s": twin.get(id(r))})
        entry: dict = {"top": top}
        if pairs:
            entry["paired"] = pair_summary(pairs)
            if g is not None:
                by: dict[str, list] = {}
                for x, y in pairs:
                    by.setdefault(arrival_state(x, g)[0], []).append((x, y))
                entry["by_state"] = {k: pair_summary(v) for k, v in by.items()}
        out[s] = entry
    return out


STATES = ("before", "grouped", "after", "alone")


def join_shadow(joins: dict[str, list[dict]], groups: dict, window: tuple[float, float]) -> list[str]:
    """What the joins' lengths mean for a tail: a join stalls both members for its length J, so a
    request arriving during one waits up to J for its first token, and J / W of a window of W seconds'
    arrivals arrive during one (one join a repetition); above 1%, more of them waited for a join than
    the 1% a P99 leaves above it. A line per system with joins (``join_events``) whose group first
    showed (``groups``: :func:`group_times`) inside the window or the second after it."""
    w = window[1] - window[0]
    L = []
    for s, js in joins.items():
        inside = {k for k, g in (groups.get(s) or {}).items() if window[0] <= g["first_s"] <= window[1] + 1}
        ms = sorted(j["ms"] for j in js if j.get("ms") and j.get("rep") in inside)
        if not ms or w <= 0:
            continue
        lo, hi = ms[0] / 1e3, ms[-1] / 1e3
        L.append(f"- {s}: its joins took {lo:.2f}-{hi:.2f} s, so {lo / w:.1%}-{hi / w:.1%} of the {w:g} s window's "
                 "arrivals came during one (above 1%: more arrivals waited for a join than the 1% a P99 leaves "
                 "above it)")
    if L:
        L = ["", "A join stalls both members for its length, so a request arriving during one waits for it; one join a "
             "repetition:", "", *L]
    return L


def tail_section(ts: dict, ref: str, heading: str = "## Where the tail sits",
                 shadow: list[str] | None = None) -> list[str]:
    """The page's "Where the tail sits" (:func:`tail_sites`), with ``shadow`` (:func:`join_shadow`)."""
    if not ts:
        return []

    def sec(x: float | None) -> str:
        return "-" if x is None else ("lost" if math.isinf(x) else f"{x:.2f}")
    L = ["", heading, "",
         f"Each system's slowest window requests (one per 100 and one more: those at and above its pooled P99): its "
         f"repetition, arrival, the arrivals in the second up to it (every system replays the same arrivals, so a "
         f"cluster is the trace's), where a grouping system's engines were when it arrived (before the repetition's "
         f"first group, grouped, after it split, or alone: that repetition never grouped) and how long after the "
         f"first group it arrived, its TTFT, and the same request's TTFT at {ref}.", ""]
    L += md_table(["system", "rep", "arrival (s)", "arrivals in the second", "state", "since first group (s)",
                   "TTFT (s)", f"{ref} TTFT (s)"], "lrrrlrrr",
                  ([s, t["rep"], f"{t['arrival_s']:.2f}", t["cluster"], t["state"] or "-",
                    "-" if t["since_group_s"] is None else f"{t['since_group_s']:+.2f}", sec(t["ttft_s"]),
                    sec(t["ref_ttft_s"])] for s, e in ts.items() for t in e["top"]))
    rows = [(s, "all", e["paired"]) for s, e in ts.items() if e.get("paired")]
    rows += [(s, k, e["by_state"][k]) for s, e in ts.items() for k in STATES if k in (e.get("by_state") or {})]
    if rows:
        L += ["", f"Every window request paired with its twin at {ref} (the same repetition and arrival), for a "
              f"grouping system also by where its engines were at the arrival: how many, each side's P99 TTFT over "
              f"those requests and their ratio, and the median of the per-request ratio (the typical request's "
              f"slowdown, where the P99s are a few requests each).", ""]
        L += md_table(["system", "arrived", "requests", "P99 TTFT (s)", f"{ref} P99 (s)", "P99 ratio",
                       "median per-request ratio"], "llrrrrr",
                      ([s, k, x["n"], sec(x["p99"]), sec(x["ref_p99"]),
                        f"{x['p99'] / x['ref_p99']:.2f}" if x["ref_p99"] and math.isfinite(x["p99"])
                        and math.isfinite(x["ref_p99"]) else "-",
                        "-" if x["median_ratio"] is None else f"{x['median_ratio']:.2f}"]
                       for s, k, x in rows))
    return L + (shadow or [])


#: what a page reads from its runs' front-end logs, which its raw data does not keep
FROM_LOGS = ("monitor_decisions", "joins", "variant_joins")


def logged_from_doc(run: Path, doc_meta: dict) -> dict:
    """Re-writing a page from its own raw data (``--steps '' --out docs/benchmarks/NAME``, no
    ``server.log`` there): the joins and monitor decisions its page JSON ``doc_meta`` kept from the
    logs when the run was measured; nothing where the run directory has its logs (read them again)."""
    if not doc_meta or any(run.glob("*/rep*/server.log")):
        return {}
    return {k: doc_meta[k] for k in FROM_LOGS if k in doc_meta}


def provenance() -> dict:
    """The commit a run measured and its serving code: the last commit that changed ``vllm_kunserve``
    outside ``bench/`` and ``sim/`` (rule 2 of ``benchmarks/common/headline.py``); ``+dirty`` where the
    serving code had uncommitted changes."""
    def git(*args: str) -> str:
        try:
            return subprocess.check_output(["git", *args], cwd=ROOT, text=True, stderr=subprocess.DEVNULL).strip()
        except (subprocess.CalledProcessError, OSError):
            return ""
    paths = ["--", "vllm_kunserve", ":!vllm_kunserve/bench", ":!vllm_kunserve/sim"]
    dirty = "+dirty" if git("status", "--porcelain", *paths) else ""
    return {"commit": git("rev-parse", "--short=7", "HEAD") or None,
            "serving_code": (git("log", "-1", "--format=%h", "HEAD", *paths) + dirty) or None,
            "note": "recorded at the run"}


def copy_raw(run: Path, assets: Path, systems: list[str], reps: int | None = None) -> None:
    """The run's raw data, for its archive: compare.json and, per run, requests.csv and timeline.csv (the
    per-second engine counters ``benchmarks/burst_value_sim.py`` fits the simulator's step times to)."""
    assets.mkdir(parents=True, exist_ok=True)
    if (run / "compare.json").exists():
        (assets / "compare.json").write_text((run / "compare.json").read_text())
    for s in systems:
        for k, f in request_files(run, s, reps):
            dst = assets / s / f"rep{k}" / "requests.csv"
            dst.parent.mkdir(parents=True, exist_ok=True)
            if f.resolve() != dst.resolve():
                dst.write_bytes(f.read_bytes())
            tl = f.parent / "timeline.csv"
            if tl.exists() and tl.resolve() != (dst.parent / tl.name).resolve():
                (dst.parent / tl.name).write_bytes(tl.read_bytes())


def main() -> int:
    if sys.argv[1:2] == ["--readme"]:   # the question's page and the README's block, over every comparable run
        from benchmarks.common import headline

        return headline.main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regime", choices=tuple(REGIMES), default="r1")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--systems", default="vllm,vllm-tuned,vllm-router,kunserve,oracle-equal",
                    help="systems of kunserve compare (static and vllm-router-rr too, at 4 min a run each)")
    ap.add_argument("--steps", default="capacity,sweep,compare", help="which measuring steps to run (then the doc)")
    ap.add_argument("--out", default="", help="run directory (default runs/burst_<regime>)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV tokens per engine (default: the regime's)")
    ap.add_argument("--kv-cap", type=float, default=KV_CAP, metavar="X",
                    help="kunserve's memory.max_kv_ratio; oracle-equal gets the same (default %(default)g)")
    ap.add_argument("--scaling", default="", metavar="NAME",
                    help="the batch table measured on this machine, docs/benchmarks/NAME.json (written by "
                         "batch_scaling.py --name NAME; default: the regime's, measured on the CPU that page names)")
    ap.add_argument("--concurrency", default="24,48", help="capacity: closed-loop concurrencies")
    ap.add_argument("--capacity-requests", type=int, default=72)
    ap.add_argument("--caps", default="8,12,16,24", help="sweep: --max-num-seqs per engine (at least 4)")
    ap.add_argument("--sweep-repeat", type=int, default=2,
                    help="sweep: repetitions of every cap (at least 2), the caps shuffled per repetition")
    # the phases in multiples of the measured capacity: 64 s at 1.8x brings >= 60 requests a repetition
    # into the window (>= 300 over 5), a 30 s warm phase at 0.5x stays below the drop trigger
    add_phase_args(ap.add_argument_group("phases (seconds, and rates as multiples of the measured capacity)"),
                   warm_s=30.0, warm_share=0.5, burst_s=64.0, burst_x=1.8)
    ap.add_argument("--tail-s", type=float, default=0.0,
                    help="a quiet phase after the burst, this many seconds (0: none): where the levers let go "
                         "(a group restores, a remap reverts); outside the burst window")
    ap.add_argument("--tail-share", type=float, default=0.1, help="the tail's rate, a multiple of the capacity")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--window-offset", type=float, default=0.0,
                    help="where in the trace the arrivals start (s): another offset is another arrival sequence, "
                         "rescaled to the same phases (a held-out run)")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--lengths", choices=("decode", "azure"), default="decode",
                    help="decode: 64 prompt and --outputs output tokens; azure: the trace's own lengths, scaled")
    ap.add_argument("--outputs", default="256,384",
                    help="--lengths decode: the output lengths, LO,HI (uniform); shorter ones bring more requests "
                         "into a burst window of the same length where an engine decodes slowly")
    ap.add_argument("--length-scale", type=float, default=0.25, help="--lengths azure: prompt and output multiplier")
    ap.add_argument("--max-total-len", type=int, default=1000,
                    help="--lengths azure: a request's prompt + output is clipped to this (max model len 1024)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="a kunserve system with these config sections merged over the benchmark's (an ablation; "
                         "name it in --systems too), passed to kunserve compare; repeatable")
    ap.add_argument("--dispatch", default="least-work",
                    help="the front end's dispatch for every system behind kunserve serve (mell: MELL placement, "
                         "the third lever of docs/levers.md)")
    ap.add_argument("--name", default="")
    ap.add_argument("--no-page", action="store_true",
                    help="write the run's archive (docs/benchmarks/runs/NAME.tar.xz) but no page of its own")
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error("--repeat must be >= 1")
    if a.sweep_repeat < 1:
        ap.error("--sweep-repeat must be >= 1")
    if not a.kv_cap > 1:
        ap.error(f"--kv-cap {a.kv_cap:g}: a group member's KV may grow to this multiple of its base; must be > 1")
    if not 0 < a.warm_share < a.burst_x:
        ap.error("--warm-share must be > 0 and below --burst-x")
    try:
        lo, hi = (int(x) for x in a.outputs.split(","))
        assert 1 <= lo <= hi
    except (ValueError, AssertionError):
        ap.error(f"--outputs {a.outputs!r}: LO,HI with 1 <= LO <= HI")
    MIX.update(output_len=lo, output_len_max=hi)
    reg = REGIMES[a.regime]
    a.kv_tokens = a.kv_tokens or reg["kv_tokens"]
    a.concurrency = [int(x) for x in a.concurrency.split(",") if x.strip()]
    caps = [int(x) for x in a.caps.split(",") if x.strip()]
    steps = {x.strip() for x in a.steps.split(",") if x.strip()}
    unknown = steps - {"capacity", "sweep", "compare", ""}
    if unknown:
        ap.error(f"--steps: unknown {sorted(unknown)}; choose from capacity, sweep, compare")
    from vllm_kunserve.tools.make_model import PRESETS, build_model

    spec = PRESETS[reg["preset"]]
    name = a.name or f"burst_value_{a.regime}"
    model = ROOT / "models" / reg["preset"]
    if not (model / "config.json").exists():
        build_model(model, spec)
    scaling_name = a.scaling or reg["scaling"]
    scaling_path = DOCS / f"{scaling_name}.json"
    if a.scaling and not scaling_path.exists():
        ap.error(f"--scaling {a.scaling}: no {scaling_path} (write it with batch_scaling.py --name {a.scaling})")
    scaling = json.loads(scaling_path.read_text()) if scaling_path.exists() else {}
    if scaling.get("preset") not in (None, reg["preset"]):
        ap.error(f"--scaling {scaling_name}: measured {scaling['preset']}, regime {a.regime} runs {reg['preset']}")
    kv_b = spec.kv_bytes_per_token()
    w = weight_share(spec.weight_bytes(), a.kv_tokens * kv_b)
    oracle_x = round(min(group_kv_factor(w), a.kv_cap), 3)   # what a kunserve group reaches here
    command = cmd("burst_value.py")
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    from vllm_kunserve.bench.systems import parse_variant

    try:   # refused before the capacity and sweep steps run, as kunserve compare would refuse it after them
        parsed = dict(parse_variant(v) for v in a.variant)
    except ValueError as e:
        ap.error(str(e))
    variants = list(parsed)
    if set(variants) - set(systems):
        ap.error(f"--variant {sorted(set(variants) - set(systems))}: name it in --systems too")
    meta: dict = {"cpu": scaling.get("cpu") or "this CPU", "preset": reg["preset"], "weight_bytes": spec.weight_bytes(),
                  "kv_bytes_per_token": kv_b, "weight_share": w, "group_kv_factor": group_kv_factor(w),
                  "oracle_equal_x": oracle_x, "kv_cap": a.kv_cap, "scaling_rows": scaling.get("rows", []),
                  "scaling_doc": f"docs/benchmarks/{scaling_name}.md", "repeat": a.repeat, "command": command,
                  "mix": dict(MIX)}
    archived = a.out.endswith(raw.SUFFIX)   # re-written from its archive: the run folder unpacked from it
    out = raw.run_dir(a.out) if archived else Path(a.out or ROOT / "runs" / f"burst_{a.regime}")
    if archived and steps:
        ap.error(f"--out {a.out}: an archived run is re-written from its raw data only (--steps '')")
    out.mkdir(parents=True, exist_ok=True)
    cap_file = out / "capacity.json"
    if "capacity" in steps and not cap_file.exists():
        write_json(cap_file, saturation(a, model, spec.dtype, out), indent=1, clean=False)
    # re-written from a run's archive (--steps '' --out docs/benchmarks/runs/NAME.tar.xz): the capacity and
    # the sweep it measured are in its page.json, not in that folder
    doc_meta = json.loads((out / "page.json").read_text())["meta"] if not steps and (out / "page.json").exists() else {}
    if not cap_file.exists() and not doc_meta.get("capacity"):
        ap.error(f"no {cap_file}: run the capacity step first")
    cap = json.loads(cap_file.read_text()) if cap_file.exists() else doc_meta["capacity"]
    phases = phases_of(cap["req_per_s"], a)
    window = window_of(a)
    base = common_argv(a, model, spec.dtype) + trace_argv(a, phases)
    kcfg = json.dumps(kunserve_config(a.kv_cap))
    sweep_file = out / "sweep.json"
    if "sweep" in steps and not sweep_file.exists():
        # repetition k runs every cap once, the caps in an order shuffled per repetition; a cap's
        # folder gains one repetition each round (kunserve compare --resume), so an interrupted
        # sweep goes on from the runs it finished
        rng = np.random.default_rng(a.seed)
        orders = []
        for k in range(1, a.sweep_repeat + 1):
            order = [int(c) for c in rng.permutation(caps)]
            orders.append(order)
            for c in order:
                if kunserve(["compare", *base, "--systems", "vllm-tuned", "--tuned-max-num-seqs", str(c),
                             "--repeat", str(k), "--resume", "--out", str(out / "sweep" / f"cap{c}"),
                             "--kunserve-config", kcfg]) != 0:
                    return 1
        rows = []
        for c in caps:
            d = out / "sweep" / f"cap{c}"
            r = load_runs(d, ["vllm-tuned"], window, a.sweep_repeat)["vllm-tuned"]
            t = pooled.tail(r)
            runs = json.loads((d / "compare.json").read_text())["runs"]["vllm-tuned"]
            rows.append({"cap": c, "repeat": len(runs), "requests": len(r), "p50": t["p50"]["value"],
                         "p99": t["p99"]["value"], "p99_lo": t["p99"]["lo"], "p99_hi": t["p99"]["hi"],
                         "tpot_p50": pooled.tpot(r)["p50"],
                         "e2e_p99": pooled.point(pooled.by_rep(r, pooled.METRIC["e2e"]), 99),
                         "preemptions": sum(x.get("preemptions") or 0 for x in runs)})
        best = min(rows, key=lambda r: r["p99"])
        write_json(sweep_file, {"rows": rows, "cap": best["cap"], "repeat": a.sweep_repeat, "orders": orders},
                   indent=1, clean=False)
    sweep = json.loads(sweep_file.read_text()) if sweep_file.exists() else doc_meta.get("sweep")
    if "compare" in steps and not (out / "compare.json").exists():
        extra = ["--oracle-equal-kv-multiplier", str(oracle_x)]
        if sweep:
            extra += ["--tuned-max-num-seqs", str(sweep["cap"])]
        if kunserve(["compare", *base, "--systems", ",".join(systems), "--repeat", str(a.repeat), "--out", str(out),
                     "--kunserve-config", kcfg, "--order", "shuffled", "--resume", *extra,
                     *(f"--variant={v}" for v in a.variant)]) != 0:
            return 1
    compare = json.loads((out / "compare.json").read_text())
    if doc_meta:   # re-written from the raw data: keep the measuring command and where it ran
        meta.update(command=doc_meta["command"], rewritten=command, provenance=doc_meta.get("provenance"))
    else:
        meta["provenance"] = provenance()
    if a.lengths == "azure":
        meta.update(lengths="azure", lengths_note=(
            f"the trace's own prompt and output lengths times {a.length_scale:g}, each request's total clipped to "
            f"{a.max_total_len} tokens (mean prompt {cap['rows'][0]['lengths']['mean_prompt']:.0f}, mean output "
            f"{cap['rows'][0]['lengths']['mean_output']:.0f} tokens over the capacity run's requests)"),
            capacity_data="a custom dataset of the scaled trace's own prompt and output lengths, text prompts of "
                          "exact token counts")
    meta.update(prefill_line=scaling.get("prefill_line"), monitor_decisions=monitor_decisions(out, a.repeat),
                joins=join_events(out, a.repeat),
                variant_joins={v: join_events(out, a.repeat, v) for v in variants},
                mean_lengths=(cap["rows"][0].get("lengths") if cap.get("rows") else None) or {
                    "mean_prompt": MIX["prompt_len"], "mean_output": (MIX["output_len"] + MIX["output_len_max"]) / 2})
    meta.update(logged_from_doc(out, doc_meta))
    meta.update(phases=phases, window=window, capacity=cap, sweep=sweep, orders=compare.get("orders"),
                descriptions={s["name"]: s["description"] for s in compare["systems"]},
                load_note=f"warm {a.warm_share:g}x and burst {a.burst_x:g}x the measured capacity")
    reqs = load_runs(out, systems, window, a.repeat)
    # goodput's TPOT bound: vllm bench serve's convention is 1.5x the unloaded TPOT. On a CPU a
    # batch's decode step grows with the batch (batch table), so 1.5x a batch of one fails most
    # requests of every system (the doc says what share it would pass); the reference is stock's P50
    # TPOT in the warm phase instead (stock defaults, else the first stock alternative that ran, else,
    # in an ablation, oracle-equal: stock engines whose KV does not bind in the warm phase, else
    # kunserve: its engines before they group, which decode at their stock twin's TPOT
    # (burst_value_r1_fp32_twin.md: 1.01x); the doc's "When ... grouped" says whether they had)
    ref_sys = next((s for s in ("vllm", "vllm-router", "vllm-router-rr", "vllm-tuned", "oracle-equal", "kunserve")
                    if s in systems), "vllm")
    warm = load_runs(out, [ref_sys], (0.0, window[0]), a.repeat).get(ref_sys, [])
    ref = pooled.tpot(warm)["p50"]
    rows1 = [r for r in meta["scaling_rows"] if r["batch"] == 1]
    meta["tpot_slo"] = 1.5 * ref if ref else 0.1
    unloaded = 1.5 * rows1[0]["step_ms"] / 1e3 if rows1 else None
    tpots = [r.tpot_s for rs in reqs.values() for r in rs if r.tpot_s is not None]
    meta["tpot_slo_note"] = (f"1.5x {ref_sys}'s P50 TPOT in the warm phase, {ref * 1e3:.0f} ms" if ref else
                             "no warm-phase stock requests: 100 ms") + (
        f"; 1.5x the unloaded TPOT, a batch of one's decode step of {rows1[0]['step_ms']:.0f} ms, would pass "
        f"{sum(t <= unloaded for t in tpots) / len(tpots):.0%} of all systems' window requests here"
        if unloaded and tpots else "")
    meta["ttft_slo"] = a.ttft_slo
    meta["equal"] = "oracle-equal"   # the stock system with the memory a kunserve group reaches
    an = analyse(reqs, a.ttft_slo, meta["tpot_slo"], meta["equal"])
    totals = run_totals(compare, systems)
    lag = send_lag(out, systems, meta["window"], a.repeat)
    groups = group_times(out, [s for s in systems if s in ("kunserve", "static", *variants)], a.repeat, meta["window"])
    meta["dispatch_split"] = dispatch_split(out, systems, a.repeat, meta["window"])
    meta["levers"] = lever_times(out, systems, a.repeat)
    meta["machine_warm"] = (MACHINE_FROM_S, window[0])
    meta["machine"] = machine_speed(out, systems, a.repeat, meta["machine_warm"], compare["runs"])
    slow = sorted({k for v in meta["machine"].values() for k, x in v.items() if x["slow"]})
    if slow and len(slow) < a.repeat:   # the same statistics over the repetitions no slow run fell in
        kept = {s: [r for r in rs if r.rep not in slow] for s, rs in reqs.items()}
        an["without_slow"] = {"reps": slow, **analyse(kept, a.ttft_slo, meta["tpot_slo"], meta["equal"]),
                              "tail": tail_sites(kept, groups, meta["equal"])}
    an["tail"] = tail_sites(reqs, groups, meta["equal"])
    an["grouped_output"] = ({s: grouped_output(out, s, meta["equal"], g, meta["window"]) for s, g in groups.items()}
                            if meta["equal"] in reqs else {})
    an["twin"] = twin(out, meta["window"], reqs, groups, totals, a.repeat)
    an["ablation"] = ablation(reqs, variants)
    meta["variants"] = {n: json.dumps(over) for n, over in parsed.items()}
    meta["raw"] = raw.rel_archive(name)
    meta["raw_layout"] = "<system>/rep<k>"
    page = {"meta": meta, "analysis": an, "totals": totals, "send_lag": lag, "grouped": groups}
    with tempfile.TemporaryDirectory() as tmp:
        copy_raw(out, Path(tmp), systems, a.repeat)
        raw.pack(Path(tmp), name, page)
    if a.no_page:   # a point of another question's page (benchmarks/load_curve.py): its archive only
        print(f"archived {raw.rel_archive(name)}")
        return 0
    plot(DOCS / f"{name}.png", an, systems, f"Regime {a.regime.upper()}: pooled burst-window TTFT")
    doc = DOCS / f"{name}.md"
    doc.write_text(render(a, meta, an, totals, lag, groups, systems, name))
    print(doc.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
