"""Whether a front end passes tokens on as the engines make them or in bunches, and where the
bunches form (issue 37: through kunserve the client's median gap between tokens is near 0).

Two stock ``vllm serve`` engines (the tiny model, one core and one compute thread each, as in
``router_side_by_side.py``), in front of them ``kunserve serve --engine-url`` (least-work) and
vllm-router ``--policy round_robin``, and ``direct`` (the client's streams split between the two
engines, no front end). The client is a small aiohttp one written for this question (``vllm bench
serve`` keeps no per-event times): closed loop at each ``--levels`` streams, prompts of 64 random
token ids, ``--output-len`` tokens each (``ignore_eos``), greedy, streamed; it timestamps every network
read and counts the server-sent events in it. Per front: the client's median gap between a
stream's tokens, the share of gaps under 1 ms (tokens that reached the client together), events per
client read, output tokens/s; for kunserve also the events per read of the engines' streams at the
front end (``/kunserve/status`` ``relay_reads``): where a front end reads an engine's stream late,
the tokens the engine made meanwhile wait in its socket and leave together. Fronts in an order
shuffled per repetition, gaps pooled over repetitions. Writes ``docs/benchmarks/relay_reads.{md,json}``.

    python -m benchmarks.relay_reads [--levels 32,128] [--reps 3] [--requests 4] [--output-len 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks.router_side_by_side import ENGINE_BASE, Fronts, engine_args, front_status
from vllm_kunserve.bench.report import command, cpu_model, md_table
from vllm_kunserve.bench.router_fleet import engine_environ
from vllm_kunserve.cluster.fleet.launcher import VllmServer, start_all

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
NAME = "relay_reads"
FRONTS = ("kunserve", "vllm-router-rr", "direct")


async def _one(s: aiohttp.ClientSession, url: str, rng: random.Random, out_len: int) -> dict:
    body = {"model": "model", "prompt": [rng.randrange(3, 500) for _ in range(64)], "max_tokens": out_len,
            "ignore_eos": True, "stream": True, "temperature": 0}
    times: list[float] = []
    reads: list[int] = []
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"{r.status}: {(await r.text())[:200]}"}
        buf = b""
        async for data in r.content.iter_any():
            t = time.monotonic()
            buf += data
            *events, buf = buf.split(b"\n\n")
            n = sum(1 for e in events if e.strip().startswith(b"data: {"))
            if n:
                reads.append(n)
                times += [t] * n
    return {"times": times, "reads": reads}


async def drive(urls: list[str], streams: int, n: int, seed: int, out_len: int) -> dict:
    """``n`` requests over ``streams`` closed-loop streams, stream i to ``urls[i % len(urls)]``."""
    rng, left, rec = random.Random(seed), [n], []

    async def stream(i: int, s: aiohttp.ClientSession) -> None:
        while left[0] > 0:
            left[0] -= 1
            rec.append(await _one(s, urls[i % len(urls)], rng, out_len))
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(stream(i, s) for i in range(streams)))
    wall = time.monotonic() - t0
    errors = [r["error"] for r in rec if "error" in r]
    ok = [r for r in rec if "times" in r]
    return {"gaps_ms": [round((b - a) * 1e3, 3) for r in ok for a, b in zip(r["times"], r["times"][1:])],
            "client_reads": sum(len(r["reads"]) for r in ok), "events": sum(sum(r["reads"]) for r in ok),
            "tokens_per_s": sum(len(r["times"]) for r in ok) / wall, "errors": len(errors),
            "first_errors": errors[:2]}


def analyse(runs: list[dict], levels: list[int]) -> dict:
    out: dict = {}
    for c in levels:
        for f in FRONTS:
            rows = [r for r in runs if r["front"] == f and r["streams"] == c]
            if not rows:
                continue
            gaps = [g for r in rows for g in r["gaps_ms"]]
            a = {"runs": len(rows), "gaps": len(gaps), "median_gap_ms": statistics.median(gaps),
                 "gaps_under_1ms": sum(g < 1.0 for g in gaps) / len(gaps),
                 "events_per_client_read": sum(r["events"] for r in rows) / sum(r["client_reads"] for r in rows),
                 "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in rows),
                 "errors": sum(r["errors"] for r in rows)}
            fr = [r["front_reads"] for r in rows if r.get("front_reads")]
            if fr:
                a["events_per_engine_read"] = sum(x["events"] for x in fr) / max(1, sum(x["reads"] for x in fr))
            out.setdefault(str(c), {})[f] = a
    return out


def render(meta: dict, an: dict) -> str:
    L = ["# Tokens as they come, or in bunches: where a front end's bunches form (written by "
         "benchmarks/relay_reads.py)", "", f"Command: `{meta['command']}`.", "",
         f"{meta['cpu']}, {meta['cores']} cores shared by everything. Two stock `vllm serve` engines (`models/tiny`, "
         f"one compute thread each, bound to cores 0 and 1); `kunserve serve --engine-url` (least-work) and "
         f"vllm-router `--policy round_robin` over them, and `direct` (no front end, the streams split between the "
         f"engines). Client: this script's own (aiohttp; `vllm bench serve` keeps no per-event times), closed loop, "
         f"{meta['requests_per_stream']} requests per stream, 64 random prompt token ids, {meta['output_len']} output "
         f"tokens (`ignore_eos`), {meta['reps']} repetitions with the fronts in a shuffled order, gaps pooled. A gap "
         "under 1 ms is two tokens of one stream that reached the client in one read: the engines make a stream's "
         "tokens one step apart (the `direct` row), so such a pair was held somewhere on the way.", ""]
    rows = []
    for c, fr in an.items():
        for f in FRONTS:
            if f in fr:
                a = fr[f]
                rows.append([c, f, f"{a['median_gap_ms']:.2f}", f"{a['gaps_under_1ms']:.1%}",
                             f"{a['events_per_client_read']:.2f}",
                             f"{a['events_per_engine_read']:.2f}" if "events_per_engine_read" in a else "-",
                             f"{a['tokens_per_s']:.0f}", a["gaps"], a["errors"]])
    L += md_table(["streams", "front", "median gap (ms)", "gaps < 1 ms", "events per client read",
                   "events per engine read at the front end", "tokens/s", "gaps", "errors"], "rlrrrrrrr", rows)
    L += ["", reading(an), "", f"Raw data: `{NAME}.json`.", ""]
    return "\n".join(L)


def reading(an: dict) -> str:
    """Per level: events per client read through each front against direct's (the client's own
    lateness), and kunserve's reads of the engines' streams: how much of its excess is already there."""
    parts, shares = [], []
    for c, fr in an.items():
        k, r, d = fr.get("kunserve"), fr.get("vllm-router-rr"), fr.get("direct")
        if not (k and r and d and "events_per_engine_read" in k):
            continue
        excess, at_read = k["events_per_client_read"] - d["events_per_client_read"], k["events_per_engine_read"] - 1
        shares.append(at_read / excess if excess > 0 else float("nan"))
        parts.append(f"at {c} streams this client read the engines' own streams at {d['events_per_client_read']:.2f} "
                     f"events per read (its own lateness: the floor), vllm-router's at {r['events_per_client_read']:.2f}, "
                     f"kunserve's at {k['events_per_client_read']:.2f}, and kunserve itself read the engines' streams at "
                     f"{k['events_per_engine_read']:.2f} events per read")
    if not parts:
        return "Reading: no run of every front."
    where = (f"{min(shares):.0%}..{max(shares):.0%} of kunserve's excess over direct is already in its reads of the "
             "engines' streams: it reads its engines late (the tokens an engine made meanwhile wait in the socket and "
             "leave together), and its relay passes on what it reads at once" if all(s >= 0.5 for s in shares) else
             "less than half of kunserve's excess over direct is in its reads of the engines' streams: the relay "
             "or its writes to the client add the rest")
    return "Reading: " + "; ".join(parts) + f". So {where}."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="32,128")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="requests per stream in each run")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--render-only", action="store_true")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    if a.reps < 1 or a.requests < 1 or a.output_len < 2 or min(levels) < 2:
        ap.error("--reps and --requests >= 1, --output-len >= 2, every level >= 2 streams")
    if a.render_only:
        data = json.loads((DOCS / f"{NAME}.json").read_text())
        (DOCS / f"{NAME}.md").write_text(render(data["meta"], data["analysis"]))
        return 0
    from vllm_kunserve.tools.make_model import PRESETS, build_model

    model = ROOT / "models" / "tiny"
    if not (model / "config.json").exists():
        build_model(model, PRESETS["tiny"])
    out = ROOT / "runs" / NAME
    out.mkdir(parents=True, exist_ok=True)
    engines = [VllmServer(str(model), engine_args(a.kv_mib << 20), env=engine_environ(i, ENGINE_BASE),
                          log_path=out / f"engine{i}.log", startup_timeout_s=600) for i in range(2)]
    runs: list[dict] = []
    fe = None
    try:
        start_all(engines)
        fe = Fronts([e.url for e in engines], model, out)
        urls = {f: [fe.start(f)[0]] for f in FRONTS if f != "direct"}
        urls["direct"] = [e.url for e in engines]
        order_rng = random.Random(1)
        for rep in range(1, a.reps + 1):
            for c in levels:
                order = list(FRONTS)
                order_rng.shuffle(order)
                for f in order:
                    before = front_status(urls[f][0], "relay_reads") if f == "kunserve" else None
                    res = asyncio.run(drive(urls[f], c, c * a.requests, rep, a.output_len))
                    if before is not None:
                        after = front_status(urls[f][0], "relay_reads")
                        res["front_reads"] = {k: after[k] - before[k] for k in ("reads", "events")}
                    runs.append({"front": f, "streams": c, "rep": rep, **res})
                    g = res["gaps_ms"]
                    print(f"rep {rep} c{c} {f}: {res['tokens_per_s']:.0f} tok/s, median gap "
                          f"{statistics.median(g) if g else float('nan'):.2f} ms, errors {res['errors']}", flush=True)
    finally:
        if fe is not None:
            fe.stop_all()
        for e in engines:
            e.stop()
    an = analyse(runs, levels)
    meta = {"command": command("relay_reads.py"), "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "reps": a.reps, "requests_per_stream": a.requests, "output_len": a.output_len,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    for r in runs:   # each run's gaps summarized: the pooled figures are in the analysis
        g = r.pop("gaps_ms")
        r.update(gaps=len(g), median_gap_ms=statistics.median(g) if g else None,
                 gaps_under_1ms=sum(x < 1.0 for x in g) / len(g) if g else None)
    (DOCS / f"{NAME}.json").write_text(json.dumps({"meta": meta, "analysis": an, "runs": runs}, indent=1) + "\n")
    (DOCS / f"{NAME}.md").write_text(render(meta, an))
    print((DOCS / f"{NAME}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
