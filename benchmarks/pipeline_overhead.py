"""Pipeline group in closed loop: two engines grouped vs the same two engines independent.

    python -m benchmarks.pipeline_overhead [--repeat 3]

The burst benchmarks' regime (the preset, dtype and thread count of docs/benchmarks/batch_scaling.json,
KV for 1280 tokens per engine, each engine pinned to its own core with one compute thread at
niceness 5, ``KUNSERVE_SHM_WAIT_MS=1``), one ``kunserve serve`` of 2 engines, no arrivals process:
K streamed greedy requests sent at once (P prompt + N output tokens each, token-id prompts).
Each repetition runs, interleaved: independent at K = the most requests the base KV holds without
queueing, then, at that K and at each larger load the freed KV holds, a forced group of both
engines (``ops/drop``), the load, and restore (``ops/restore``): one group per load, so each load's
hop times (round trip, the peer's wait, its span, the link) are its own. Throughput: output tokens over the middle
60% of all token arrivals; TPOT: each request's mean gap between tokens, P50 over requests. The
workers trace their steps (``KUNSERVE_PIPELINE_TRACE``) and each group's trace is analysed
(``benchmarks/common/pipeline_trace.py``): the shares of each stage's core and its idle time by
cause. ``--stage-turn-ms 0,8`` runs each repetition once per stage turn (how long a peer's span
waits for a member's own due work: its sampling, its next step; ``integration/vllm/pipeline.py``
``Turn``), each on a cluster of its own, and pairs them.
Paired per repetition: grouped / independent at the same K (what the pipeline costs per token at
equal batch: the time a stage waits for its peer) and grouped at each larger K / independent
(what the freed KV buys). A closed loop isolates the engines: no prefill of arrivals, no queue.

Writes docs/benchmarks/pipeline_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.common.stats import fmt_median_range, median_range
from vllm_kunserve.bench.report import command as cmd
from vllm_kunserve.bench.report import cpu_device, doc_header, md_row, md_table, write_json

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
DOCS = ROOT / "docs" / "benchmarks"


def throughput(results) -> float:
    """Output tokens per second over the middle 60% of the run's token arrivals."""
    marks = sorted(r.send_s + t for r in results for t in r.token_times)
    lo, hi = len(marks) // 5, 4 * len(marks) // 5
    return (hi - lo) / (marks[hi] - marks[lo]) if hi > lo and marks[hi] > marks[lo] else float("nan")


def tpot_p50(results) -> float:
    v = [statistics.fmean(r.gaps) for r in results if len(r.token_times) > 1]
    return statistics.median(v) if v else float("nan")


async def _op(url: str, name: str, body: dict) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async with s.post(f"{url}/kunserve/ops/{name}", json=body) as resp:
            out = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"ops/{name}: {resp.status} {out}")
            return out


async def _split(url: str, timeout_s: float = 300.0) -> dict:
    """Wait until the group has split and both engines are back at their base; returns where each
    engine's hops spent their time in that group (``bench.compare.pipeline_times``)."""
    from vllm_kunserve.bench.compare import pipeline_times

    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - t0 < timeout_s:
            async with s.get(f"{url}/kunserve/status") as resp:
                st = await resp.json()
            if not st["groups"] and all(i["kv"].get("engine", {}).get("phase") == "base" for i in st["instances"]):
                return pipeline_times(st)
            await asyncio.sleep(0.5)
    raise RuntimeError("the group did not split")


def load(url: str, k: int, prompts: list[list[int]], n: int) -> dict:
    from vllm_kunserve.bench.client import RequestSpec, replay

    specs = [RequestSpec(i, 0.0, prompts[i % len(prompts)], len(prompts[0]), n) for i in range(k)]
    res = asyncio.run(replay(url, "m", specs, request_timeout_s=900, progress=False))
    failed = [r.error for r in res if not r.ok or r.output_tokens != n]
    return {"k": k, "tok_s": round(throughput(res), 2), "tpot_p50_ms": round(tpot_p50(res) * 1e3, 2),
            "failed": len(failed), "errors": failed[:3],
            "send_lag_max_ms": round(max(r.send_s for r in res) * 1e3, 1)}


def _turns(text: str) -> list[float]:
    from vllm_kunserve.integration.vllm.pipeline import turn_s  # the engines' own KUNSERVE_STAGE_TURN_MS check

    parts = [x.strip() for x in text.split(",") if x.strip()]
    try:
        for x in parts:
            turn_s(x)
    except ValueError:
        parts = []
    if not parts:
        raise SystemExit(f"--stage-turn-ms {text!r}: comma-separated milliseconds in 0..1000")
    return [float(x) for x in parts]


def _trace(directory: Path, before: set[str]) -> dict | None:
    """The step-trace analysis of the group whose dumps appeared in ``directory`` since ``before``."""
    from benchmarks.common.pipeline_trace import analyse, load

    groups = load(f for f in directory.glob("*.json") if f.name not in before)
    return analyse(groups[-1]) if groups else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=320)
    ap.add_argument("--kv-tokens", type=int, default=1280, help="base KV capacity per engine (tokens)")
    ap.add_argument("--grouped", default="2,3.3", help="grouped loads, as multiples of the independent K")
    ap.add_argument("--stage-turn-ms", default="8",
                    help="the engines' KUNSERVE_STAGE_TURN_MS (how long a peer's span waits for a member's own "
                         "due work: its sampling, its next step); several, comma-separated, run interleaved in "
                         "each repetition, each on a cluster of its own, e.g. 0,8")
    ap.add_argument("--log-dir", default=str(ROOT / "runs" / "pipeline_overhead"))
    a = ap.parse_args()
    turns = _turns(a.stage_turn_ms)
    from vllm_kunserve.cluster.fleet.launcher import KunserveCluster
    from vllm_kunserve.tools.make_model import PRESETS, build_model

    scaling = json.loads((DOCS / "batch_scaling.json").read_text())
    spec = PRESETS[scaling["preset"]]
    model = ROOT / "models" / scaling["preset"]
    if not (model / "config.json").exists():
        build_model(model, spec)
    per_req = a.prompt_len + a.output_len
    k_ind = max(1, a.kv_tokens // per_req) * 2  # both engines, none queued
    k_grp = sorted({k_ind, *(int(round(float(x) * k_ind)) for x in a.grouped.split(","))})
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, spec.vocab - 10, a.prompt_len).tolist() for _ in range(8)]
    kv_bytes = a.kv_tokens * spec.kv_bytes_per_token()
    args = ["--dtype", spec.dtype, "--block-size", "32", "--kv-cache-memory-bytes", str(kv_bytes),
            "--max-model-len", "1024", "--enforce-eager", "--served-model-name", "m"]
    config = {"drop": {"enable": False}, "memory": {"max_kv_ratio": 10.0}}
    log_dir = Path(a.log_dir)
    trace_dir = log_dir / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for rep in range(1, a.repeat + 1):
        for turn in turns:
            env = {"KUNSERVE_ENGINE_CPUS": "0|1", "OMP_NUM_THREADS": "1", "KUNSERVE_ENGINE_NICE": "5",
                   "KUNSERVE_SHM_WAIT_MS": "1", "KUNSERVE_PIPELINE_TRACE": str(trace_dir),
                   "KUNSERVE_STAGE_TURN_MS": f"{turn:g}"}
            tag = {"rep": rep, "turn_ms": turn}
            with KunserveCluster(str(model), args, config, env=env, log_path=log_dir / "serve.log", instances=2,
                                 startup_timeout_s=900,
                                 extra=["--monitor-interval", "0.5", "--log-dir", str(log_dir)]) as srv:
                load(srv.url, 2, prompts, 8)  # warm both engines
                runs.append({**tag, "mode": "independent", **load(srv.url, k_ind, prompts, a.output_len)})
                print(runs[-1], flush=True)
                for k in k_grp:
                    before = {f.name for f in trace_dir.glob("*.json")}
                    ev = asyncio.run(_op(srv.url, "drop", {"instances": [0, 1]}))
                    runs.append({**tag, "mode": "grouped", "blocks": ev.get("blocks"),
                                 **load(srv.url, k, prompts, a.output_len)})
                    asyncio.run(_op(srv.url, "restore", {}))
                    runs[-1]["pipeline"] = asyncio.run(_split(srv.url))
                    runs[-1]["trace"] = _trace(trace_dir, before)
                    print({x: y for x, y in runs[-1].items() if x != "trace"}, flush=True)
    pairs = []
    for rep in range(1, a.repeat + 1):
        for turn in turns:
            mine = [r for r in runs if r["rep"] == rep and r["turn_ms"] == turn]
            ind = next(r for r in mine if r["mode"] == "independent")
            for g in (r for r in mine if r["mode"] == "grouped"):
                pairs.append({"rep": rep, "turn_ms": turn, "k": g["k"],
                              "tok_s_over_independent": round(g["tok_s"] / ind["tok_s"], 3),
                              "tpot_over_independent": round(g["tpot_p50_ms"] / ind["tpot_p50_ms"], 3)})

    summary = {f"{g:g}": {k: {"tok_s": median_range([p["tok_s_over_independent"] for p in pairs
                                                     if p["k"] == k and p["turn_ms"] == g], 3),
                               "tpot": median_range([p["tpot_over_independent"] for p in pairs
                                                    if p["k"] == k and p["turn_ms"] == g], 3)}
                           for k in k_grp} for g in turns}
    versus = {}
    if len(turns) > 1:  # each turn's grouped tokens/s over the first one's, same repetition and K
        for g in turns[1:]:
            versus[f"{g:g}"] = {}
            for k in k_grp:
                tok = {(r["rep"], r["turn_ms"]): r["tok_s"] for r in runs if r["mode"] == "grouped" and r["k"] == k}
                versus[f"{g:g}"][k] = median_range([round(tok[(rep, g)] / tok[(rep, turns[0])], 3)
                                                    for rep in range(1, a.repeat + 1)], 3)
    command = cmd("pipeline_overhead.py")
    device = cpu_device(f"the benchmark's process; each engine: 1 compute thread, {scaling['preset']}")
    raw = DOCS / "pipeline_overhead.json"
    write_json(raw, {"command": command, "device": device, "preset": scaling["preset"],
                     "prompt_len": a.prompt_len, "output_len": a.output_len, "kv_tokens": a.kv_tokens,
                     "k_independent": k_ind, "k_grouped": k_grp, "sample_turn_ms": turns,
                     "runs": runs, "pairs": pairs, "summary": summary, "turn_vs_first": versus}, indent=1, clean=False)
    lines = doc_header(
        "Pipeline group in closed loop: grouped vs independent engines", "pipeline_overhead.py", device, raw,
        f"Command: `{command}`. Two engines of `{scaling['preset']}` ({spec.dtype}), KV for {a.kv_tokens} tokens "
        f"each (the burst benchmarks' regime); K streamed greedy requests of {a.prompt_len} prompt + "
        f"{a.output_len} output tokens sent at once. Independent at K = {k_ind} (the most the base KV holds), "
        f"grouped (forced drop, both engines) at K = {', '.join(map(str, k_grp))}; repetitions interleaved"
        + (f"; in each, one cluster per stage turn ({', '.join(f'{g:g}' for g in turns)} ms: how long a "
           "peer's span waits for a member's own due work, its sampling or its next step, "
           "`KUNSERVE_STAGE_TURN_MS`)." if len(turns) > 1 else
           f"; stage turn {turns[0]:g} ms (`KUNSERVE_STAGE_TURN_MS`)."),
        "Throughput: output tokens over the middle 60% of the token arrivals. TPOT: each request's mean gap "
        "between tokens, P50 over requests. A closed loop: no arrivals to prefill, no queue; the client sent "
        "every request at once (its largest send lag is in the raw data).")
    lines += md_table(["rep", "turn (ms)", "mode", "K", "tokens/s", "TPOT P50 (ms)", "failed"], "rrlrrrr",
                      ([r["rep"], f"{r['turn_ms']:g}", r["mode"], r["k"], f"{r['tok_s']:.1f}", f"{r['tpot_p50_ms']:.1f}",
                        r["failed"]] for r in runs))
    lines += ["", "Paired with the same repetition's (and cluster's) independent run, median (min..max, n):", ""]
    lines += md_table(["turn (ms)", "grouped K", "tokens/s vs independent", "TPOT vs independent"], "rrll",
                      ([g, k, fmt_median_range(s["tok_s"]), fmt_median_range(s["tpot"])] for g, by_k in summary.items() for k, s in by_k.items()))
    for g, by_k in versus.items():
        lines += ["", f"Grouped tokens/s with a {g} ms turn over the same repetition's with {turns[0]:g} ms, "
                  "median (min..max, n): " + "; ".join(f"K={k}: {fmt_median_range(s)}" for k, s in by_k.items()) + "."]
    hop_rows = [(r, inst, t) for r in runs for inst, t in sorted((r.get("pipeline") or {}).items())]
    if hop_rows:
        from vllm_kunserve.bench.compare import HOP_COLUMNS, HOP_NOTE, hop_cells

        lines += ["", "## Pipeline hops", "", HOP_NOTE + " One group per grouped run.", ""]
        lines += md_table(["rep", "turn (ms)", "K", "engine", *HOP_COLUMNS], "rrrr" + "r" * len(HOP_COLUMNS),
                          ([r["rep"], f"{r['turn_ms']:g}", r["k"], inst, *hop_cells(t)] for r, inst, t in hop_rows))
    trace_rows = [(r, m, t) for r in runs for m, t in sorted((r.get("trace") or {}).items())]
    if trace_rows:
        lines += ["", "## Where each stage's core goes", "",
                  "From the workers' step traces (`KUNSERVE_PIPELINE_TRACE`, analysed by "
                  "`benchmarks/common/pipeline_trace.py`), the middle 60% of each group's life: the cycle (median "
                  "time between a member's steps) and the shares of its core: its own step's compute, the peer's "
                  "spans, its sampling, and idle as far as the workers go (the member's engine core and API server "
                  "run in part of it). Idle by cause: *collision* (this member's microbatch and the peer's own are "
                  "both at the peer's stage, one waiting there, while this stage has nothing), *between steps* "
                  "(this member's engine core between its steps, the peer's microbatch elsewhere), *in transit* "
                  "(both between stages). Then one step's chain, mean ms: before the hop / the hop / after it / to "
                  "the sampling call / the sampling with its wait / to the next step / the next step's wait for "
                  "the core.", ""]
        lines += md_table(["rep", "turn (ms)", "K", "member", "cycle (ms)", "own", "peer spans", "sampling", "idle",
                           "collision", "between steps", "in transit", "chain (ms)"], "rrrlrrrrrrrrl")
        for r, m, t in trace_rows:
            c, i = t["core"], t.get("idle_by_cause") or {}
            chain = " / ".join(f"{v:.1f}" for v in (t.get("chain_ms") or {}).values())
            lines.append(md_row([r["rep"], f"{r['turn_ms']:g}", r["k"], m, t["cycle_ms"], f"{c['own_step']:.2f}",
                                 f"{c['peer_spans']:.2f}", f"{c['sampling']:.3f}", f"{c['idle']:.2f}",
                                 f"{i.get('collision', 0):.3f}", f"{i.get('between steps', 0):.3f}",
                                 f"{i.get('in transit', 0):.3f}", chain]))
    (DOCS / "pipeline_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
