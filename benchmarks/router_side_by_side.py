"""The front end side by side with vllm-router over the same two engines (issue 37).

Two stock ``vllm serve`` engines (the tiny model, one core each: ``VLLM_CPU_OMP_THREADS_BIND`` 0
and 1, one thread) are started once; in front of them, at the same time and each idle while
another is measured:

- ``vllm-router-rr`` and ``vllm-router-ca``: vllm-router (PyPI, the vLLM project's Rust router)
  with ``--policy round_robin`` and ``cache_aware`` (its default), ``--worker-urls`` the engines;
- ``kunserve``: ``kunserve serve --engine-url`` over the same engines (attach mode, its default
  least-work dispatch);
- ``direct``: no front end, the client's streams and prompts split evenly between the engines (one
  ``vllm bench serve`` per engine, started together, their per-request results pooled as one
  client's): the floor every front end adds to.

The client is vLLM's own, ``vllm bench serve`` (random dataset, ``--random-input-len`` prompt and
``--random-output-len`` output tokens, ``--ignore-eos``), at each ``--concurrency``, every front in
a shuffled order per repetition; everything shares the machine's cores (front ends, client and
engines), as a user's front end does. Per front and concurrency: output tokens/s, median and P99
TTFT, the client's median inter-token latency (tokens bunched by a late relay show as a median
ITL near 0), each the mean over repetitions with a 95% bootstrap interval of that mean; the ratio
to vllm-router round_robin. Writes ``docs/benchmarks/router_side_by_side.{md,json,png}``.

    python -m benchmarks.router_side_by_side [--repeat 5] [--concurrency 1,32,128]

``--workload prefix`` asks the shared-prefix question instead (issue 37's cache-aware dispatch):
``vllm bench serve --dataset-name prefix_repetition`` (``--num-prefixes`` prompts of
``--prefix-len`` tokens, each followed by a ``--suffix-len``-token suffix, shuffled), a fresh set of
prefixes every run (the seed), against vllm-router ``cache_aware`` and kunserve's own least-work
and ``cache-aware`` dispatch (``kunserve``, ``kunserve-ca``: two front ends over the same engines),
with each run's prefix-cache hit rate from the engines' own counters (``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``). Writes ``router_side_by_side_prefix.{md,json,png}``.

    python -m benchmarks.router_side_by_side --workload prefix --model decode-bf16 --kv-mib 48 \
        --num-prefixes 16 --prompts 96 --output-len 32

``--workload mooncake`` asks it on real conversations: the first ``--prompts`` requests of the
Mooncake FAST'25 conversation trace's multi-turn conversations, each 512-token block of the trace a
text of ``--block-tokens`` random tokens (new texts every run), in the trace's order (``vllm bench
serve --dataset-name custom --disable-shuffle``). Writes ``router_side_by_side_mooncake.{md,json,png}``.

    python -m benchmarks.router_side_by_side --workload mooncake --model decode-bf16 --kv-mib 48 \
        --prompts 96 --output-len 32

``--layout own-core`` gives the front end a core of its own: the engines (every process of theirs)
on core 1, the front ends and the client on core 0; ``--fronts`` adds ``kunserve-rr`` (kunserve
with ``--dispatch round-robin``, the router's policy: the data plane compared with the policy held
equal). Writes ``router_side_by_side_own_core.{md,json,png}``.

``--fronts vllm-router-rr,kunserve,kunserve-x2`` adds ``kunserve-x2``: two ``kunserve serve
--engine-url --reuse-port`` front ends over the same engines on one port, the kernel spreading the
client's connections over them (as replicas of a router are run): does a second event loop catch up
with the engines' streams on cores they keep busy? Writes ``router_side_by_side_replicas.{md,json,png}``.

``--workload kill`` asks what a front end loses when an engine dies: per run a fresh front, 16
streams of 256-token answers, engine 1 SIGKILLed ``--kill-after`` seconds after it first runs a
request of the run and restarted on its port after it; lost = failed + cut short
(``vllm bench serve --save-detailed``'s per-request results). Writes ``router_side_by_side_kill.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common.stats import fmt_interval
from vllm_kunserve.bench.compare import cpu_times
from vllm_kunserve.bench.report import command, cpu_model, md_table, pyplot, save_figure, write_json
from vllm_kunserve.bench.scrape import engine_metrics
from vllm_kunserve.bench.router_fleet import engine_environ, router_argv, router_binary, wait_healthy
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster, VllmServer, free_port, start_all

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
NAME = "router_side_by_side"
FRONTS = ("vllm-router-rr", "vllm-router-ca", "kunserve")
DIRECT = "direct"   # no front end: the client's streams split between the engines (the floor a front end adds to)
RANDOM_FRONTS = (*FRONTS, DIRECT)
PREFIX_FRONTS = ("vllm-router-ca", "kunserve", "kunserve-ca")
ALL_FRONTS = ("vllm-router-rr", "vllm-router-ca", "kunserve", "kunserve-x2", "kunserve-rr", "kunserve-ca", DIRECT)   # the pages' order
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms")
LOOP_KEYS = ("ticks", "late", "late_s", "late_cpu_s", "late_runq_s")   # /kunserve/status loop totals
EXTRA = ("front_cpu_us_per_token", "prefix_hit_rate", "engine_queue_ms", "engine_prefill_ms",
         "mean_ttft_ms", "admit_ms", "engine_ms", "relay_ms", "unseen_ms")   # measured since the runs that record them


def engine_args(kv_bytes: int, dtype: str = "float32", max_len: int = 512) -> list[str]:
    return ["--dtype", dtype, "--block-size", "32", "--kv-cache-memory-bytes", str(kv_bytes),
            "--max-model-len", str(max_len), "--enforce-eager", "--served-model-name", "model",
            "--max-num-seqs", "256"]


def dataset_args(a: argparse.Namespace, dataset: Path | None = None) -> list[str]:
    if a.workload == "mooncake":
        return ["--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template", "--disable-shuffle",
                "--custom-output-len", str(a.output_len)]
    if a.workload == "prefix":
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(a.prefix_len),
                "--prefix-repetition-suffix-len", str(a.suffix_len), "--prefix-repetition-num-prefixes",
                str(a.num_prefixes), "--prefix-repetition-output-len", str(a.output_len)]
    return ["--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)]


MOONCAKE = "mooncake_fast25_conversation.jsonl"


def mooncake_sessions(path: Path, n: int, max_blocks: int) -> list[list[int]]:
    """The ``hash_ids`` of the Mooncake FAST'25 conversation trace's first multi-turn conversations
    (a conversation: the requests sharing their second block, block 0 being every request's system
    prompt), every turn of at most ``max_blocks`` blocks, in the trace's order, until ``n`` requests."""
    from collections import defaultdict

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    turns: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        h = r.get("hash_ids")
        if not isinstance(h, list) or len(h) < 2:
            continue
        turns[h[1]].append(i)
    keep: list[int] = []
    for idx in sorted((v for v in turns.values() if len(v) >= 2
                       and all(len(rows[i]["hash_ids"]) <= max_blocks for i in v)), key=lambda v: v[0]):
        if len(keep) >= n:
            break
        keep += idx
    if len(keep) < n:
        raise ValueError(f"{path}: only {len(keep)} requests in multi-turn conversations of <= {max_blocks} blocks")
    return [rows[i]["hash_ids"] for i in sorted(keep)[:n]]


def mooncake_dataset(sessions: list[list[int]], tokenizer, block_tokens: int, seed: int, out: Path) -> None:
    """A ``vllm bench serve`` custom dataset: each block id becomes its own text of ``block_tokens``
    random tokens (a new text per ``seed``: no run finds another's blocks cached), a prompt its blocks'
    texts in order, so prompts share a prefix exactly where the trace's share blocks."""
    rng = np.random.default_rng(seed)
    vocab = [t for t in range(tokenizer.vocab_size) if t not in tokenizer.all_special_ids]
    text: dict[int, str] = {}
    with open(out, "w") as f:
        for blocks in sessions:
            for b in blocks:
                if b not in text:
                    text[b] = tokenizer.decode(rng.choice(vocab, block_tokens).tolist()) + " "
            f.write(json.dumps({"prompt": "".join(text[b] for b in blocks)}) + "\n")


def ideal_reuse(sessions: list[list[int]]) -> float:
    """The share of the prompts' blocks an infinite cache would hit (each prompt's leading blocks seen
    before, in order): the most any dispatch can reach."""
    seen: set[int] = set()
    hit = total = 0
    for blocks in sessions:
        for b in blocks:
            if b not in seen:
                break
            hit += 1
        total += len(blocks)
        seen.update(blocks)
    return round(hit / max(1, total), 3)


ENGINE_SERIES = {"vllm:prefix_cache_hits_total": "hits", "vllm:prefix_cache_queries_total": "queries",
                 "vllm:request_queue_time_seconds_sum": "queue_s", "vllm:request_queue_time_seconds_count": "queue_n",
                 "vllm:request_prefill_time_seconds_sum": "prefill_s",
                 "vllm:request_prefill_time_seconds_count": "prefill_n", "vllm:num_requests_running": "running"}
COUNTERS = ("hits", "queries", "queue_s", "queue_n", "prefill_s", "prefill_n")


def engine_counters(urls: list[str]) -> dict[str, float]:
    """The engines' counters so far, summed over engines: prefix-cache hits and queries (tokens), and
    the sums and counts of vLLM's per-request queue-time and prefill-time histograms."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for u in urls:
        m = engine_metrics(u, ENGINE_SERIES, timeout_s=10)
        for k in COUNTERS:
            out[k] += m.get(k, 0.0)
    return out


def engine_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A run's prefix hit rate and its requests' mean time queued and mean prefill time in the engines."""
    d = {k: after[k] - before[k] for k in before}
    view = {"prefix_hit_rate": d["hits"] / max(1.0, d["queries"])}
    if d["queue_n"] > 0 and d["prefill_n"] > 0:
        view.update(engine_queue_ms=1e3 * d["queue_s"] / d["queue_n"],
                    engine_prefill_ms=1e3 * d["prefill_s"] / d["prefill_n"])
    return view


def bench_argv(url: str, model: Path, conc: int, n: int, a: argparse.Namespace, out: Path, seed: int,
               dataset: Path | None = None) -> list[str]:
    return [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--model", "model", "--tokenizer", str(model), *dataset_args(a, dataset), "--ignore-eos",
            "--num-prompts", str(n), "--max-concurrency", str(conc), "--request-rate", "inf", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]


def bench_direct(urls: list[str], model: Path, conc: int, n: int, a: argparse.Namespace, out: Path,
                 seed: int) -> dict:
    """Straight to the engines, no front end: the ``conc`` streams and ``n`` prompts split as evenly
    as they go between the engines, one ``vllm bench serve`` per engine with a share, all started at
    once; their per-request results (``--save-detailed``) pooled into the figures one client over all
    the requests reports (throughput over the longer client's duration, TTFT and ITL percentiles over
    every successful request, as ``vllm bench serve`` computes them)."""
    shares = [(conc // len(urls) + (i < conc % len(urls)), n // len(urls) + (i < n % len(urls)))
              for i in range(len(urls))]
    procs = []
    with contextlib.ExitStack() as logs:
        for i, (u, (c, k)) in enumerate(zip(urls, shares)):
            if c < 1 or k < 1:
                continue
            o = out.with_name(f"{out.stem}-e{i}.json")
            log = logs.enter_context(open(o.with_suffix(".log"), "w"))
            procs.append((o, subprocess.Popen([*bench_argv(u, model, c, k, a, o, seed + 7919 * i), "--save-detailed"],
                                              stdout=log, stderr=subprocess.STDOUT,
                                              env={**os.environ, "VLLM_HOST_IP": "127.0.0.1"})))
        for _, p in procs:
            if p.wait() != 0:
                raise subprocess.CalledProcessError(p.returncode, p.args)
    merged = pool_clients([json.loads(o.read_text()) for o, _ in procs])
    out.write_text(json.dumps(merged, indent=1))
    return merged


def pool_clients(res: list[dict]) -> dict:
    """Several ``vllm bench serve --save-detailed`` results, run at once, as one client's figures:
    output tokens over the longest duration, TTFT and ITL percentiles over every successful request
    (a failed one has no output tokens), as ``vllm bench serve`` computes them for its own requests."""
    ok = [(t, itl) for r in res for t, itl, ln in zip(r["ttfts"], r["itls"], r["output_lens"]) if ln]
    ttfts = [t for t, _ in ok]
    itls = [x for _, itl in ok for x in itl]
    return {"completed": sum(r.get("completed") or 0 for r in res), "failed": sum(r.get("failed") or 0 for r in res),
            "output_throughput": sum(r["total_output_tokens"] for r in res) / max(r["duration"] for r in res),
            "median_ttft_ms": float(np.median(ttfts or [0])) * 1e3,
            "p99_ttft_ms": float(np.percentile(ttfts or [0], 99)) * 1e3,
            "median_itl_ms": float(np.median(itls or [0])) * 1e3, "clients": len(res)}


def bench(url: str, model: Path, conc: int, n: int, a: argparse.Namespace, out: Path, seed: int,
          dataset: Path | None = None) -> dict:
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(bench_argv(url, model, conc, n, a, out, seed, dataset), check=True, stdout=log,
                       stderr=subprocess.STDOUT, env={**os.environ, "VLLM_HOST_IP": "127.0.0.1"})
    res = json.loads(out.read_text())
    return {"completed": res.get("completed"), "failed": res.get("failed", 0), "mean_ttft_ms": res.get("mean_ttft_ms"),
            **{k: res.get(k) for k in METRICS}}


STAGES = ("admit", "engine", "relay")   # kunserve:frontend_ttft_stage_seconds' stages, in order


def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """kunserve's front end: per stage of its streamed requests' time to first token, the histogram's
    (sum in seconds, count) so far."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {st: [0.0, 0.0] for st in STAGES}
    for fam in text_string_to_metric_families(text):
        if fam.name == "kunserve:frontend_ttft_stage_seconds":
            for smp in fam.samples:
                if smp.labels.get("stage") in out and smp.name.endswith(("_sum", "_count")):
                    out[smp.labels["stage"]][smp.name.endswith("_count")] += smp.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def stage_view(before: dict, after: dict, client_mean_ttft_ms: float | None) -> dict[str, float]:
    """A run's mean time per stage (ms) over its streamed requests, and what the client waited beyond
    their sum (``unseen_ms``: before the front end's handler ran, or after its write)."""
    view = {}
    for st in STAGES:
        n = after[st][1] - before[st][1]
        if n <= 0:
            return {}
        view[f"{st}_ms"] = 1e3 * (after[st][0] - before[st][0]) / n
    if client_mean_ttft_ms is not None:
        view["unseen_ms"] = client_mean_ttft_ms - sum(view.values())
    return view


def front_status(url: str, part: str) -> dict:
    """One part of kunserve's front end's ``/kunserve/status`` now (``loop``: its event loop's late
    wake-ups so far; ``relay_reads``: its reads of the engines' streams so far)."""
    import urllib.request

    with urllib.request.urlopen(url + "/kunserve/status", timeout=10) as r:
        return json.loads(r.read())[part]


def mean_ci(xs: list[float], rng: np.random.Generator) -> dict:
    x = np.asarray(xs, float)
    boots = rng.choice(x, size=(2000, len(x))).mean(axis=1)
    return {"mean": float(x.mean()), "lo": float(np.percentile(boots, 2.5)), "hi": float(np.percentile(boots, 97.5)),
            "n": len(x)}


def analyse(runs: list[dict], concs: list[int], fronts: tuple[str, ...] = FRONTS) -> dict:
    rng = np.random.default_rng(0)
    out: dict = {}
    for c in concs:
        for f in fronts:
            rows = [r for r in runs if r["front"] == f and r["concurrency"] == c]
            if rows:
                out.setdefault(str(c), {})[f] = {m: mean_ci([r[m] for r in rows], rng) for m in METRICS} | {
                    m: mean_ci([r[m] for r in rows], rng) for m in EXTRA if all(m in r for r in rows)} | {
                    "failed": sum(r["failed"] or 0 for r in rows), "completed": sum(r["completed"] or 0 for r in rows)}
        k = [r["loop"] for r in runs if r["front"] == "kunserve" and r["concurrency"] == c and "loop" in r]
        if k:
            tot = {key: sum(x.get(key, 0) for x in k) for key in LOOP_KEYS}
            out[str(c)]["kunserve"]["loop"] = tot
    return out


def cell(fr: dict, f: str, m: str, digits: int, base: str) -> str:
    """A table cell: front ``f``'s mean of ``m`` with its interval and, for any front but ``base``,
    its ratio to ``base``'s mean ("-" where ``f`` has no ``m``)."""
    x, b = fr[f].get(m), fr.get(base, {}).get(m)
    if x is None:
        return "-"
    return fmt_interval(x, digits, point="mean") + (f" [{x['mean'] / b['mean']:.2f}x]"
                                                     if b and b["mean"] and f != base else "")


def target_line(c: str, what: str, mine: dict, ref: dict, bound: float | None, above: bool) -> str:
    """One target's verdict: ``mine`` / ``ref`` (means) against ``bound`` (``above``: at least it,
    else at most; None: within 10% of 1), and whether the two 95% intervals overlap."""
    v = mine["mean"] / ref["mean"] if ref["mean"] else float("nan")
    ok = abs(v - 1) <= 0.1 if bound is None else (v >= bound if above else v <= bound)
    overlap = mine["lo"] <= ref["hi"] and ref["lo"] <= mine["hi"]
    return (f"- {c} streams, {what}: {v:.2f}x -> **{'met' if ok else 'missed'}**"
            + (" (the 95% intervals overlap)" if overlap else " (the 95% intervals apart)"))


def reading(an: dict, own: bool) -> str:
    """The CPU table's reading, from the numbers: at the highest concurrency, kunserve's CPU per token
    against the router's cheaper policy, where its loop's lateness went, and what the client saw."""
    c = max(an, key=int)
    fr = an[c]
    k = fr.get("kunserve", {})
    routers = [f for f in ("vllm-router-rr", "vllm-router-ca") if "front_cpu_us_per_token" in fr.get(f, {})]
    if "front_cpu_us_per_token" not in k or not routers:
        return "Reading: no CPU measurement for both front ends at the highest concurrency."
    r = min(routers, key=lambda f: fr[f]["front_cpu_us_per_token"]["mean"])
    kc, rc = k["front_cpu_us_per_token"]["mean"], fr[r]["front_cpu_us_per_token"]["mean"]
    lp = k.get("loop") or {}
    runq = min(1.0, lp["late_runq_s"] / lp["late_s"]) if lp.get("late_s") else None
    itl, itl_r = k["median_itl_ms"]["mean"], fr["vllm-router-rr"]["median_itl_ms"]["mean"]
    tp = k["output_throughput"]["mean"] / fr["vllm-router-rr"]["output_throughput"]["mean"]
    where = ("the front end and the client share core 0, the engines core 1" if own else
             "the engines keep both cores busy and every front end shares them")
    late = (f"; {runq:.0%} of its event loop's late time was spent runnable without a core" if runq is not None
            else "")
    return (f"Reading ({c} streams): {where}. kunserve's Python front end used {kc / rc:.1f}x the CPU per output "
            f"token of {r} ({kc:.0f} vs {rc:.0f} us){late}. The client's median gap between tokens was {itl:.2f} ms "
            f"through kunserve and {itl_r:.2f} ms through round_robin (a gap near 0 is tokens that reached the "
            f"client together, read late and passed on at once), at {tp:.2f}x round_robin's throughput."
            + policy_sentence(an) + replica_sentence(an)
            + ("" if own else f" The same fronts with the front end on a core of its own: `{NAME}_own_core.md`."))


def stage_section(an: dict) -> list[str]:
    """Where kunserve's streamed requests' time to first token went, by the front end's own clock
    (``kunserve:frontend_ttft_stage_seconds``), beside the client's mean TTFT: what the client waited
    beyond the stages' sum was spent before the front end's handler ran (the request's bytes read
    and parsed by the server, a handler started late by a busy or core-less event loop)."""
    cols = ("mean_ttft_ms", "admit_ms", "engine_ms", "relay_ms", "unseen_ms")
    staged = [c for c, fr in an.items() if all(m in fr.get("kunserve", {}) for m in cols)]
    if not staged:
        return []
    rows = [[c, *(fmt_interval(an[c]["kunserve"][m], 1, point="mean") for m in cols)] for c in staged]
    c = max(staged, key=int)
    k = {m: an[c]["kunserve"][m]["mean"] for m in cols}
    before = k["admit_ms"] + k["unseen_ms"]
    where = ("its one event loop taking requests in, not its relay" if before > k["relay_ms"] else
             "its relay of the first token, not taking requests in")
    reading = (f"Reading ({c} streams): {before:.0f} ms of the client's mean {k['mean_ttft_ms']:.0f} ms "
               f"({before / k['mean_ttft_ms']:.0%}) passed before the request left the front end for its engine "
               f"(admit {k['admit_ms']:.0f} ms, not seen {k['unseen_ms']:.0f} ms), against "
               f"{k['relay_ms']:.1f} ms to pass the first token on: where the front end adds to a first token's "
               f"wait is {where}.")
    return ["## Where kunserve's time to first token goes", "",
            "Means over each run's streamed requests (ms, 95% intervals over runs): the client's TTFT, and the front "
            "end's own clock (`kunserve:frontend_ttft_stage_seconds`): admit (the body read, validated, its tokens "
            "counted, an engine picked), engine (sent until the engine's first token was read back: the engine's "
            "queue and prefill, the hop), relay (that token written to the client); not seen: the client's TTFT "
            "less the three (the request waiting to be read and parsed before the front end's handler ran, a late "
            "event loop).", "",
            *md_table(["streams", "client TTFT", "admit", "engine", "relay", "not seen by the front end"], "rrrrrr",
                      rows), "", reading, ""]


def direct_sentence(an: dict) -> list[str]:
    """What standing between the client and the engines costs, at each concurrency above 1 where the
    fronts ran beside ``direct`` (no front end): each front's throughput and median / P99 TTFT as
    multiples of direct's."""
    rows = []
    for c, fr in an.items():
        d = fr.get(DIRECT)
        if int(c) <= 1 or not d:
            continue
        rel = lambda f, m: fr[f][m]["mean"] / d[m]["mean"] if d[m]["mean"] else float("nan")  # noqa: E731
        rows.append([c, *(" / ".join(f"{rel(f, m):.2f}" for m in ("output_throughput", "median_ttft_ms", "p99_ttft_ms"))
                          for f in ALL_FRONTS if f in fr and f != DIRECT)])
    if not rows:
        return []
    shown = [f for f in ALL_FRONTS if f != DIRECT and any(f in fr for fr in an.values())]
    return ["## What a front end costs against none", "",
            f"Each front's output throughput / median TTFT / P99 TTFT as multiples of `{DIRECT}`'s (the client straight "
            "to the engines, the same streams split between them): above 1 for TTFT, below 1 for throughput, is what "
            "standing in between costs on these shared cores, whichever front it is.", "",
            *md_table(["streams", *shown], "r" + "l" * len(shown), rows), ""]


def replica_sentence(an: dict) -> str:
    """Where ``kunserve-x2`` ran: at every concurrency above 1, what a second front end on the port did
    to the bunching (the client's median ITL against round_robin's), the median TTFT and the CPU per
    token, each beside one front end's."""
    rows = [(c, fr) for c, fr in an.items() if int(c) > 1 and {"kunserve-x2", "kunserve", "vllm-router-rr"} <= set(fr)]
    if not rows:
        return ""
    rel = lambda fr, f, m: fr[f][m]["mean"] / fr["vllm-router-rr"][m]["mean"]  # noqa: E731
    cpu = lambda fr, f: fr[f].get("front_cpu_us_per_token", {}).get("mean", float("nan"))  # noqa: E731
    told = "; ".join(f"at {c} streams median ITL {rel(fr, 'kunserve-x2', 'median_itl_ms'):.2f}x round_robin's (one "
                     f"front end {rel(fr, 'kunserve', 'median_itl_ms'):.2f}x), median TTFT "
                     f"{rel(fr, 'kunserve-x2', 'median_ttft_ms'):.2f}x ({rel(fr, 'kunserve', 'median_ttft_ms'):.2f}x), "
                     f"CPU {cpu(fr, 'kunserve-x2'):.0f} us per token ({cpu(fr, 'kunserve'):.0f})" for c, fr in rows)
    unbunched = all(rel(fr, "kunserve-x2", "median_itl_ms") > rel(fr, "kunserve", "median_itl_ms") for _, fr in rows)
    faster = all(rel(fr, "kunserve-x2", "median_ttft_ms") < 0.9 * rel(fr, "kunserve", "median_ttft_ms") for _, fr in rows)
    return (f" Two front ends on the port (`kunserve-x2`): {told}. "
            + ("A second event loop reads the engines' streams sooner (the tokens bunch less)" if unbunched else
               "A second event loop does not un-bunch the tokens at every concurrency")
            + (" and the first tokens come sooner." if faster else
               ", but the first tokens do not come sooner: it costs more CPU per token, on cores the engines keep busy."))


def policy_sentence(an: dict) -> str:
    """Where kunserve-rr ran: its median TTFT beside kunserve's, both against round_robin's, at every
    concurrency above 1, and whether the policy or the data plane holds the difference."""
    rows = [(c, fr["kunserve-rr"]["median_ttft_ms"]["mean"] / fr["vllm-router-rr"]["median_ttft_ms"]["mean"],
             fr["kunserve"]["median_ttft_ms"]["mean"] / fr["vllm-router-rr"]["median_ttft_ms"]["mean"])
            for c, fr in an.items() if int(c) > 1 and {"kunserve-rr", "kunserve", "vllm-router-rr"} <= set(fr)]
    if not rows:
        return ""
    told = ", ".join(f"{rr:.2f}x (least-work {lw:.2f}x) at {c} streams" for c, rr, lw in rows)
    same = all(rr >= 0.9 * lw for _, rr, lw in rows)
    return (f" With the router's own policy, round-robin (`kunserve-rr`), kunserve's median TTFT was {told} "
            "round_robin's" + (": the same policy does not close the gap, so it lies in the front end's data "
                              "plane, not in its dispatch." if same and any(lw > 1.1 for _, _, lw in rows) else "."))


def render(meta: dict, an: dict) -> str:
    name, own = meta.get("name", NAME), meta.get("layout") == "own-core"
    nice = meta.get("engine_nice", 0)
    where = ("bound to core 1 with all their processes, the front end and the client on core 0: the front end has a "
             "core of its own, shared only with the client" if own else "bound to cores 0 and 1"
             + (f", every process of theirs at niceness {nice} (`KUNSERVE_ENGINE_NICE={nice}`) while the front ends "
                "and the client run at 0: a front end that wakes gets a core at once instead of waiting behind an "
                "engine's compute thread" if nice else ""))
    L = ["# kunserve serve side by side with vllm-router" + (", the front end on its own core" if own else "")
         + (f", the engines at niceness {nice}" if nice else "")
         + (", and two kunserve front ends on one port" if name.endswith("_replicas") else "")
         + " (written by benchmarks/router_side_by_side.py)", "",
         f"Command: `{meta['command']}`.", "", f"![side by side]({name}.png)", "",
         f"{meta['cpu']}, {meta.get('cores', os.cpu_count())} cores"
         + ("" if own else " shared by everything") + f". Two stock `vllm serve` engines (`models/{meta.get('model', 'tiny')}`, "
         f"{meta['kv_bytes'] >> 20} MiB of KV each, one compute thread each, {where}), started once; "
         "in front of them vllm-router 0.1.17 (`--policy round_robin`: `vllm-router-rr`; `cache_aware`, its default: "
         "`vllm-router-ca`) and `kunserve serve --engine-url` over the same two engines (`kunserve`, least-work"
         + ("; `kunserve-rr`, `--dispatch round-robin`, the router's policy: the data plane compared with the policy "
            "held equal" if any("kunserve-rr" in fr for fr in an.values()) else "")
         + ("; `kunserve-x2`, two such front ends started with `--reuse-port` on one port, the kernel spreading the "
            "client's connections over them (as replicas of a router are run): two event loops to read the engines' "
            "streams" if any("kunserve-x2" in fr for fr in an.values()) else "") + ")"
         + (f"; `{DIRECT}`: no front end at all, the client's streams and prompts split evenly between the two "
            "engines (one `vllm bench serve` per engine, started together, their per-request results pooled as one "
            "client's would be; at 1 stream engine 0 alone): the floor every front end adds to, with one client "
            "process more on the cores" if any(DIRECT in fr for fr in an.values()) else "") + ". "
         f"Client: `vllm bench serve`, random dataset, {meta['input_len']}-token prompts, {meta['output_len']} output "
         f"tokens (`--ignore-eos`), {meta['repeat']} repetitions, the fronts in a shuffled order in each; the prompt "
         "counts per concurrency are in the JSON. Each cell: the mean over repetitions (95% bootstrap interval of the "
         "mean) and, in brackets, the ratio to vllm-router round_robin's mean. " + CLOSED_LOOP, ""]
    for c, fr in an.items():
        L += [f"## {c} concurrent stream{'s' if c != '1' else ''}", ""]
        L += md_table(["front", "output tok/s", "median TTFT (ms)", "P99 TTFT (ms)", "median ITL (ms)", "failed"],
                      "lrrrrr", ([f, *(cell(fr, f, m, d, "vllm-router-rr") for m, d in (
                          ("output_throughput", 0), ("median_ttft_ms", 1), ("p99_ttft_ms", 1), ("median_itl_ms", 2))),
                          fr[f]["failed"]] for f in ALL_FRONTS if f in fr))
        L += [""]
    L += direct_sentence(an)
    L += stage_section(an)
    shown = [f for f in ALL_FRONTS if any(f in fr for fr in an.values())]
    if any("front_cpu_us_per_token" in fr[f] for fr in an.values() for f in fr):
        L += ["## What each front end costs, and where kunserve's waits", "",
              "CPU time of the front end's process (and its children) over each run, per output token (psutil), and "
              "kunserve's event loop over its runs (`/kunserve/status` `loop`: wake-ups of a 10 ms tick at least "
              "20 ms late; of their lateness, the time its thread ran and the time it was runnable but waiting for "
              "a core, from `/proc/thread-self/schedstat`, both counted over the whole tick and so capped at "
              "100%):", "",
              reading(an, own), ""]
        rows = []
        for c, fr in an.items():
            lp = fr.get("kunserve", {}).get("loop") or {}
            cpu = [fmt_interval(fr[f]["front_cpu_us_per_token"], 0, point="mean")
                   if "front_cpu_us_per_token" in fr.get(f, {}) else "-"
                   for f in shown]
            share = (f"{lp['late']} late ({lp['late_s']:.1f} s): running {min(1.0, lp['late_cpu_s'] / lp['late_s']):.0%}, "
                     f"waiting for a core {min(1.0, lp['late_runq_s'] / lp['late_s']):.0%}") if lp.get("late_s") else "-"
            rows.append([c, *cpu, share])
        L += md_table(["streams", *(f"{f} CPU us/token" for f in shown), "kunserve's late wake-ups"],
                      "r" * (len(shown) + 1) + "l", rows)
        L += [""]
    L += ["## Targets (issue 37, shared cores, against vllm-router)" if not own else
          "## Issue 37's checks, here with a core for the front end (its targets are set for shared cores)", ""]
    for c, fr, front in [(c, fr, f) for f in ("kunserve", "kunserve-x2") for c, fr in an.items()]:
        k, rr = fr.get(front), fr.get("vllm-router-rr")
        if not (k and rr):
            continue
        routers = [fr[f] for f in ("vllm-router-rr", "vllm-router-ca") if f in fr]
        best_tp = max(routers, key=lambda r: r["output_throughput"]["mean"])["output_throughput"]
        best_ttft = min(routers, key=lambda r: r["median_ttft_ms"]["mean"])["median_ttft_ms"]
        best_p99 = min(routers, key=lambda r: r["p99_ttft_ms"]["mean"])["p99_ttft_ms"]
        itl = rr["median_itl_ms"]
        checks = [("throughput >= 0.97x the router's better", k["output_throughput"], best_tp, 0.97, True),
                  ("median TTFT <= 1.1x the router's better", k["median_ttft_ms"], best_ttft, 1.1, False),
                  ("P99 TTFT <= 1.1x the router's better", k["p99_ttft_ms"], best_p99, 1.1, False),
                  ("median ITL within 10% of round_robin's", k["median_itl_ms"], itl, None, None)]
        L += [target_line(c, what if front == "kunserve" else f"{front}, {what}", mine, ref, bound, above)
              for what, mine, ref, bound, above in checks]
    L += ["", f"Raw data: `{name}.json` (every run's `vllm bench serve` result, the order).", ""]
    return "\n".join(L)


def kv_sentence(meta: dict) -> str:
    """How many tokens an engine's KV holds against the prefixes' total (from the model's config)."""
    cfg_path = ROOT / "models" / meta.get("model", "tiny") / "config.json"
    if not cfg_path.exists():
        return ""
    cfg = json.loads(cfg_path.read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim \
        * (2 if cfg.get("dtype") in ("bfloat16", "float16") else 4)
    tokens = meta["kv_bytes"] // per_token
    if meta.get("workload") == "mooncake":
        return f" The model's KV is {per_token / 1024:g} KiB per token, so an engine holds {tokens} tokens."
    return (f" The model's KV is {per_token / 1024:g} KiB per token, so an engine holds {tokens} tokens; the "
            f"{meta['num_prefixes']} prefixes alone are {meta['num_prefixes'] * meta['prefix_len']} tokens.")


#: every workload's client runs closed loop: what the brief's send lag would measure does not arise
CLOSED_LOOP = ("The client runs closed loop (`--request-rate inf --max-concurrency N`): it sends a request when one "
               "of its N streams frees, so there is no send schedule to fall behind and no send lag to record.")


def client_sentence(meta: dict) -> str:
    if meta.get("workload") == "mooncake":
        n = meta["prompts"][next(iter(meta["prompts"]))]
        return ("Client: `vllm bench serve --dataset-name custom --disable-shuffle`, in the trace's order: the first "
                f"{n} requests of the multi-turn conversations of the Mooncake FAST'25 conversation trace "
                f"(Moonshot AI and Tsinghua University, Qin et al., FAST 2025, Apache-2.0: `{meta['trace']}`; "
                f"{meta['conversations']} conversations, every turn of at most "
                f"{meta['max_blocks']} blocks; a conversation = the requests that share their second block, the first "
                f"being every request's system prompt). Each of the trace's 512-token blocks becomes a text of its "
                f"own, decoded from {meta['block_tokens']} random token ids, a new text every run (the seed), so prompts share "
                "a prefix exactly where the trace's do and no run finds another's blocks cached; an infinite cache "
                f"would hit {meta['ideal_block_reuse']:.0%} of the prompts' blocks. {meta['output_len']} output tokens "
                "(`--ignore-eos`); the trace's timing is not kept (closed loop at the concurrency);")
    return ("Client: `vllm bench serve --dataset-name prefix_repetition`: "
            f"{meta['num_prefixes']} prefixes of {meta['prefix_len']} tokens, every prompt one of them "
            f"and a {meta['suffix_len']}-token suffix of its own, {meta['output_len']} output tokens (`--ignore-eos`), "
            "shuffled, a new set of prefixes every run (the seed), so no run finds another's prefixes cached;")


def prefill_reading(fr: dict) -> str:
    """Where the first token's time went in the engines, and what kunserve-ca's hits took off it."""
    k, lw = fr.get("kunserve-ca"), fr.get("kunserve")
    if not (k and lw and "engine_prefill_ms" in k and "engine_prefill_ms" in lw):
        return ""
    q = max(fr[f]["engine_queue_ms"]["mean"] for f in fr if "engine_queue_ms" in fr[f])
    hk, hl = k["prefix_hit_rate"]["mean"], lw["prefix_hit_rate"]["mean"]
    return (f" Reading: no request waited in an engine's queue (at most {q:.2f} ms on average): the time to a first "
            "token is the prefill phase, whose steps the request shares with the others running. kunserve-ca's "
            f"hits ({hk:.3f} of prompt tokens against least-work's {hl:.3f}) leave "
            f"{(1 - hk) / max(1e-9, 1 - hl):.0%} of least-work's prefill tokens to compute, and its prefill phase "
            f"took {k['engine_prefill_ms']['mean'] / lw['engine_prefill_ms']['mean']:.2f}x least-work's.")


def render_prefix(meta: dict, an: dict) -> str:
    """The shared-prefix page: per concurrency the fronts' throughput, TTFT and the engines' prefix-cache
    hit rate, and issue 37's cache-aware targets (kunserve-ca against least-work and vllm-router cache_aware)."""
    name = meta["name"]
    L = ["# " + ("Mooncake conversations" if meta.get("workload") == "mooncake" else "Shared prefixes")
         + ": cache-aware dispatch side by side with vllm-router (written by "
         "benchmarks/router_side_by_side.py)", "", f"Command: `{meta['command']}`.", "", f"![shared prefixes]({name}.png)",
         "", f"{meta['cpu']}, {os.cpu_count()} cores shared by everything. Two stock `vllm serve` engines (`models/{meta.get('model', 'tiny')}`, "
         f"{meta['kv_bytes'] >> 20} MiB of KV each, prefix caching on as vLLM's default, one compute thread each, bound "
         "to cores 0 and 1), started once; in front of them vllm-router 0.1.17 `--policy cache_aware` "
         "(`vllm-router-ca`) and two `kunserve serve --engine-url` over the same engines: least-work (`kunserve`, its "
         "default) and `--dispatch cache-aware` (`kunserve-ca`). " + client_sentence(meta) + " "
         f"{meta['repeat']} repetitions, the fronts in a shuffled order in each. Each cell: the mean over repetitions "
         "(95% bootstrap interval of the mean) and, in brackets, the ratio to `kunserve` (least-work). Prefix hit rate: "
         "the engines' own counters over the run, hit tokens over queried tokens." + kv_sentence(meta) + " "
         + CLOSED_LOOP, ""]
    for c, fr in an.items():
        L += [f"## {c} concurrent stream{'s' if c != '1' else ''}", ""]
        cols = [("output_throughput", 0, "output tok/s"), ("median_ttft_ms", 1, "median TTFT (ms)"),
                ("p99_ttft_ms", 1, "P99 TTFT (ms)"), ("prefix_hit_rate", 3, "prefix hit rate")]
        if all("engine_queue_ms" in fr[f] for f in fr):
            cols += [("engine_queue_ms", 2, "in the engine: queued (ms, mean)"),
                     ("engine_prefill_ms", 0, "in the engine: prefill (ms, mean)")]
        L += md_table(["front", *(h for _, _, h in cols), "failed"], "l" + "r" * (len(cols) + 1),
                      ([f, *(cell(fr, f, m, d, "kunserve") for m, d, _ in cols), fr[f]["failed"]]
                       for f in PREFIX_FRONTS if f in fr))
        L += [""]
        if len(cols) > 4:
            L += ["Queued and prefill: vLLM's own per-request histograms (`vllm:request_queue_time_seconds`, "
                  "`vllm:request_prefill_time_seconds`), their sums over counts across both engines over the run: "
                  "a request's first token waits for both, and a prefix hit shortens only the prefill."
                  + prefill_reading(fr), ""]
    L += ["## Targets (issue 37, shared-prefix workloads)", ""]
    for c, fr in an.items():
        k, lw, ca = fr.get("kunserve-ca"), fr.get("kunserve"), fr.get("vllm-router-ca")
        if not (k and lw and ca):
            continue
        L += [target_line(c, what, k[m], ref[m], bound, above) for what, m, ref, bound, above in [
            ("median TTFT <= 0.8x least-work's", "median_ttft_ms", lw, 0.8, False),
            ("median TTFT <= vllm-router cache_aware's", "median_ttft_ms", ca, 1.0, False),
            ("throughput >= least-work's", "output_throughput", lw, 1.0, True),
            ("throughput >= vllm-router cache_aware's", "output_throughput", ca, 1.0, True)]]
    L += ["", f"Raw data: `{name}.json` (every run's `vllm bench serve` result, the order, the hit rates).", ""]
    return "\n".join(L)


def analyse_kill(runs: list[dict]) -> dict:
    """Per front over the fault runs: requests sent, lost (failed + short), when the kill came."""
    out: dict = {}
    for f in FRONTS:
        rows = [r for r in runs if r["front"] == f]
        if rows:
            out[f] = {"runs": len(rows), "requests": sum(r["prompts"] for r in rows),
                      **{k: sum(r[k] or 0 for r in rows) for k in ("completed", "failed", "short", "lost")},
                      "runs_with_loss": sum(1 for r in rows if r["lost"]),
                      "killed_at_s": [r["killed_at_s"] for r in rows],
                      "victim_running_at_kill": [r["victim_running_at_kill"] for r in rows],
                      "median_ttft_ms": float(np.median([r["median_ttft_ms"] for r in rows])),
                      "output_throughput": float(np.median([r["output_throughput"] for r in rows])),
                      "errors": sorted({e for r in rows for e in r.get("first_errors", [])})[:4]}
    return out


def render_kill(meta: dict, an: dict) -> str:
    name = meta["name"]
    L = ["# An engine killed mid-run: what each front end loses (written by benchmarks/router_side_by_side.py)", "",
         f"Command: `{meta['command']}`.", "",
         f"{meta['cpu']}, {meta.get('cores', os.cpu_count())} cores shared by everything. Two stock `vllm serve` "
         f"engines (`models/{meta.get('model', 'tiny')}`, {meta['kv_bytes'] >> 20} MiB of KV each, one compute thread each, bound to cores 0 "
         "and 1); per run a fresh front end over them: vllm-router 0.1.17 `--policy round_robin` (`vllm-router-rr`) "
         "or `cache_aware` (`vllm-router-ca`), each with its defaults as a user starts it, or `kunserve serve "
         "--engine-url` (`kunserve`, least-work). Client: `vllm bench serve`, random dataset, "
         f"{meta['input_len']}-token prompts, {meta['output_len']} output tokens (`--ignore-eos`), "
         f"{meta['prompts'][str(meta['concurrency'])]} requests at {meta['concurrency']} concurrent streams. "
         f"{meta['kill_after_s']:g} s after engine 1 first runs a request of the run, the harness SIGKILLs its "
         "process group (API server and engine core); after the run it restarts engine 1 on its port for the next "
         f"one (the client's start-up, about 8 s, is inside the kill time below). {meta['repeat']} repetition"
         f"{'s' if meta['repeat'] != 1 else ''}, the fronts in a shuffled order in each. Lost = requests the client "
         "counted failed + requests that completed with fewer tokens than asked (a stream cut short and closed "
         "as if whole). " + CLOSED_LOOP, ""]
    L += md_table(["front", "runs", "requests", "lost", "failed", "short", "runs with a loss", "kill at (s after the client started)",
                   "victim's running requests (its metrics, polled just before the kill)", "median TTFT (ms, median of runs)",
                   "output tok/s (median of runs)"], "lrrrrrrllrr",
                  [[f, r["runs"], r["requests"], r["lost"], r["failed"], r["short"], r["runs_with_loss"],
                    ", ".join(f"{x:.1f}" if x is not None else "none" for x in r["killed_at_s"]),
                    ", ".join("?" if x is None else f"{x:.0f}" for x in r["victim_running_at_kill"]), f"{r['median_ttft_ms']:.0f}",
                    f"{r['output_throughput']:.0f}"] for f, r in an.items()])
    errs = [f"- {f}: " + "; ".join(f"`{e}`" for e in r["errors"]) for f, r in an.items() if r["errors"]]
    if errs:
        L += ["", "What the client was told (distinct errors, the last line of each):", "", *errs]
    k = an.get("kunserve")
    routers = {f: an[f] for f in ("vllm-router-rr", "vllm-router-ca") if f in an}
    if k:
        L += ["", "## Target (issue 37)", "",
              f"- no request lost when an engine is killed: kunserve lost {k['lost']} of {k['requests']} -> "
              f"**{'met' if k['lost'] == 0 else 'missed'}**"
              + "".join(f"; {f} lost {r['lost']} of {r['requests']}" for f, r in routers.items())]
    L += ["", f"Raw data: `{name}.json` (every run: the kill time, the client's counts and its first errors); the "
          "client's per-request results stay in the run directory.", ""]
    return "\n".join(L)


def plot(an: dict, path: Path, fronts: tuple[str, ...] = FRONTS) -> None:
    plt = pyplot(optional=True)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    concs = list(an)
    x = np.arange(len(concs))
    for ax, (m, label) in zip(axes, [("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT (ms)"),
                                     ("median_itl_ms", "median ITL (ms)")]):
        for k, f in enumerate(fronts):
            vals = [an[c][f][m] for c in concs if f in an[c]]
            if len(vals) != len(concs):
                continue
            w = 0.8 / len(fronts)
            ax.bar(x + (k - (len(fronts) - 1) / 2) * w, [v["mean"] for v in vals], w, label=f,
                   yerr=[[v["mean"] - v["lo"] for v in vals], [v["hi"] - v["mean"] for v in vals]], capsize=2)
        ax.set_xticks(x, [f"{c} streams" for c in concs])
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


class Fronts:
    """The front ends over ``urls``: vllm-router (round_robin / cache_aware) and ``kunserve serve
    --engine-url`` (least-work / cache-aware), started on demand and stopped together."""

    ROUTER_POLICY = {"vllm-router-rr": "round_robin", "vllm-router-ca": "cache_aware"}
    KUNSERVE_DISPATCH = {"kunserve": [], "kunserve-ca": ["--dispatch", "cache-aware"],
                         "kunserve-rr": ["--dispatch", "round-robin"], "kunserve-x2": ["--reuse-port"]}
    REPLICAS = {"kunserve-x2": 2}   # front ends on one port (--reuse-port): the kernel spreads the connections

    def __init__(self, urls: list[str], model: Path, out: Path):
        self.urls, self.model, self.out = urls, model, out
        self.routers: dict[str, subprocess.Popen] = {}
        self.kunserve: dict[str, list[KunserveCluster]] = {}

    def start(self, fname: str, tag: str = "") -> tuple[str, list[int]]:
        """Start front ``fname`` (log ``<fname><tag>.log``); return its URL and its processes' pids once
        healthy (a replicated kunserve: every replica)."""
        log_path = self.out / f"{fname}{tag}.log"
        if fname in self.ROUTER_POLICY:
            port = free_port()
            with open(log_path, "w") as log:
                proc = subprocess.Popen(router_argv(router_binary(), "127.0.0.1", port, self.urls,
                                                    self.ROUTER_POLICY[fname], free_port()),
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.routers[fname] = proc
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, 60)
            return url, [proc.pid]
        port, ks = free_port(), []
        self.kunserve[fname] = ks
        for r in range(self.REPLICAS.get(fname, 1)):
            ks.append(KunserveCluster(str(self.model), [], None, log_path=log_path.with_name(
                f"{log_path.stem}{f'-r{r}' if r else ''}.log"), instances=len(self.urls), port=port,
                startup_timeout_s=120, extra=[*self.KUNSERVE_DISPATCH[fname],
                                              *[x for u in self.urls for x in ("--engine-url", u)]]))
            ks[-1].start()   # each ready by its own log, whichever replica answered /health
        return ks[0].url, [k._proc.proc.pid for k in ks]

    def stop(self, fname: str) -> None:
        for k in self.kunserve.pop(fname, []):
            k.stop()
        p = self.routers.pop(fname, None)
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for f in [*self.kunserve, *self.routers]:
            self.stop(f)


def running(url: str) -> float | None:
    """The engine's requests running now (``vllm:num_requests_running``; None if it does not answer)."""
    try:
        return engine_metrics(url, ENGINE_SERIES, timeout_s=2).get("running", 0.0)
    except OSError:
        return None


def kill_run(fe: Fronts, f: str, engines: list, victim: int, conc: int, n: int, a: argparse.Namespace,
             out: Path, rep: int) -> dict:
    """One fault run: a fresh front ``f``, ``vllm bench serve`` through it, engine ``victim``
    SIGKILLed ``--kill-after`` seconds after it first runs a request of the run; the front
    stopped, the engine restarted on its port. Counts what the client lost: failed requests and
    requests that completed short of ``--output-len`` tokens."""
    url, _ = fe.start(f, tag=f"-rep{rep}")
    target = out / f"{f}-kill-rep{rep}.json"
    argv = bench_argv(url, fe.model, conc, n, a, target, seed=rep) + ["--save-detailed"]
    t0 = time.monotonic()
    with open(target.with_suffix(".log"), "w") as log:
        client = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "VLLM_HOST_IP": "127.0.0.1"})
        victim_url, at, busy = engines[victim].url, None, 0.0
        while client.poll() is None and at is None:
            busy = running(victim_url)
            if (busy or 0) >= 1:
                time.sleep(a.kill_after)
                busy = running(victim_url)
                engines[victim]._proc.kill()
                at = time.monotonic() - t0
            else:
                time.sleep(0.2)
        rc = client.wait()
    fe.stop(f)
    engines[victim].log_path = out / f"engine{victim}-after-{f}-rep{rep}.log"
    engines[victim].env = engine_environ(victim, ENGINE_BASE)
    engines[victim].start()
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited {rc}; log {target.with_suffix('.log')}")
    res = json.loads(target.read_text())
    return {**client_losses(res, a.output_len), "killed_at_s": None if at is None else round(at, 2),
            "victim_running_at_kill": busy, **{k: res.get(k) for k in METRICS}}


def client_losses(res: dict, output_len: int) -> dict:
    """What ``vllm bench serve --save-detailed`` saw lost: requests it counted failed, and requests it
    counted complete with fewer than ``output_len`` tokens (with ``--ignore-eos`` every whole
    answer has them: fewer is a stream cut short and closed as if whole); the distinct errors' last lines."""
    lens, errors = res.get("output_lens"), res.get("errors")
    if lens is None or errors is None or len(lens) != len(errors):
        raise ValueError("the client's result has no per-request output_lens and errors (--save-detailed)")
    failed = sum(1 for e in errors if e)
    short = sum(1 for x, e in zip(lens, errors) if not e and x < output_len)
    return {"completed": len(lens) - failed - short, "failed": failed, "short": short, "lost": failed + short,
            "first_errors": sorted({e.strip().splitlines()[-1][:160] for e in errors if e and e.strip()})[:3]}


ENGINE_BASE = {"KUNSERVE_ENGINE_CPUS": "0|1", "OMP_NUM_THREADS": "1"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workload", choices=("random", "prefix", "mooncake", "kill"), default="random")
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "data" / "traces" / MOONCAKE),
                    help="mooncake: the Mooncake FAST'25 conversation trace (JSON lines with hash_ids)")
    ap.add_argument("--block-tokens", type=int, default=16,
                    help="mooncake: tokens per trace block (the trace's blocks are 512 tokens; scaled to this CPU)")
    ap.add_argument("--max-blocks", type=int, default=24, help="mooncake: keep conversations whose turns have at most this many blocks")
    ap.add_argument("--layout", choices=("shared", "own-core"), default="shared",
                    help="random workload: everything on every core (shared), or the engines on core 1 and the "
                         "front end with the client on core 0 (own-core)")
    ap.add_argument("--fronts", default=None, help="random workload: the fronts, comma-separated (default "
                    f"{','.join(RANDOM_FRONTS)}; kunserve-rr: kunserve with --dispatch round-robin; kunserve-x2: "
                    f"two kunserve front ends on one port (--reuse-port); {DIRECT}: no front end, the streams split "
                    "between the engines)")
    ap.add_argument("--concurrency", default=None, help="default 1,32,128 (random), 16 (prefix, kill)")
    ap.add_argument("--prompts", default=None, help="requests per run at each concurrency (default 24,192,384 / 160)")
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=None, help="default 64 (random, prefix), 256 (kill)")
    ap.add_argument("--kill-after", type=float, default=3.0,
                    help="kill: seconds from the victim engine's first running request of the run to its SIGKILL")
    ap.add_argument("--engine-nice", type=int, default=0,
                    help="random workload, shared layout: the engines at this niceness (KUNSERVE_ENGINE_NICE, as "
                         "`kunserve serve` can start its own), the fronts and the client at 0; writes the page "
                         f"{NAME}_nice")
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--model", default="tiny", help="a make-model preset, built under models/ if missing "
                    "(decode-bf16: a 610 MB model whose prefill costs enough for cache hits to show in TTFT)")
    ap.add_argument("--out", default="", help="run directory (default runs/<the page's name>)")
    ap.add_argument("--render-only", action="store_true", help="re-write the doc from the JSON")
    a = ap.parse_args()
    prefix, kill = a.workload in ("prefix", "mooncake"), a.workload == "kill"
    if a.workload != "random" and (a.layout == "own-core" or a.fronts or a.engine_nice):
        ap.error(f"--layout own-core, --fronts and --engine-nice are for the random workload (--workload {a.workload})")
    if a.engine_nice and a.layout == "own-core":
        ap.error("--engine-nice is for the shared layout (own-core gives the front end a core instead)")
    if not 0 <= a.engine_nice <= 19:
        ap.error(f"--engine-nice must be a niceness 0..19, got {a.engine_nice}")
    a.output_len = a.output_len or (256 if kill else 64)
    if prefix:
        name, fronts, draw = f"{NAME}_{a.workload}", PREFIX_FRONTS, render_prefix
    elif kill:
        name, fronts, draw = f"{NAME}_kill", FRONTS, render_kill
    else:
        name = NAME + ("_own_core" if a.layout == "own-core" else "_nice" if a.engine_nice else "")
        fronts, draw = RANDOM_FRONTS, render
        if a.fronts:
            fronts = tuple(a.fronts.split(","))
            if (not set(fronts) <= {*RANDOM_FRONTS, "kunserve-rr", "kunserve-x2"} or "kunserve" not in fronts
                    or "vllm-router-rr" not in fronts):
                ap.error(f"--fronts: kunserve, vllm-router-rr and any of vllm-router-ca, kunserve-rr, kunserve-x2, "
                         f"{DIRECT}; got {a.fronts!r}")
            if "kunserve-x2" in fronts:
                name += "_replicas"
    concs = [int(x) for x in (a.concurrency or ("16" if prefix or kill else "1,32,128")).split(",")]
    prompts = [int(x) for x in (a.prompts or ("160" if prefix or kill else "24,192,384")).split(",")]
    if len(prompts) != len(concs) or a.repeat < 1:
        ap.error("--prompts needs one count per --concurrency, and --repeat >= 1")
    if a.workload == "prefix" and min(prompts) < a.num_prefixes:
        ap.error("--prompts must be at least --num-prefixes")
    if a.workload == "mooncake":
        if a.block_tokens < 1 or a.max_blocks < 2:
            ap.error("--block-tokens must be >= 1 and --max-blocks >= 2")
        if not Path(a.trace).is_file():
            ap.error(f"--trace {a.trace}: no such file (the Mooncake FAST'25 conversation trace, ../shared/data/traces)")
    if a.layout == "own-core" and os.cpu_count() < 2:
        ap.error("--layout own-core needs 2 cores")
    if a.render_only:
        data = json.loads((DOCS / f"{name}.json").read_text())
        (DOCS / f"{name}.md").write_text(draw(data["meta"], data["analysis"]))
        return 0
    from vllm_kunserve.tools.make_model import PRESETS, build_model

    if a.model not in PRESETS:
        ap.error(f"--model {a.model!r}: one of {', '.join(sorted(PRESETS))}")
    model = ROOT / "models" / a.model
    if not (model / "config.json").exists():
        build_model(model, PRESETS[a.model])
    dtype = json.loads((model / "config.json").read_text()).get("dtype") or "float32"
    out = Path(a.out or ROOT / "runs" / name)
    out.mkdir(parents=True, exist_ok=True)
    kv = a.kv_mib << 20
    own = a.layout == "own-core"
    if a.workload == "mooncake":
        from transformers import AutoTokenizer

        try:
            sessions = mooncake_sessions(Path(a.trace), max(prompts), a.max_blocks)
        except (ValueError, KeyError, TypeError) as e:
            ap.error(f"--trace {a.trace}: {e}")
        tokenizer = AutoTokenizer.from_pretrained(str(model))
    base = {**ENGINE_BASE, "KUNSERVE_ENGINE_CPUS": "1"} if own else ENGINE_BASE
    if a.engine_nice:
        base = {**base, "KUNSERVE_ENGINE_NICE": str(a.engine_nice)}
    engines = [VllmServer(str(model), engine_args(kv, dtype, 1024 if a.workload == "mooncake" else 512),
                          env=engine_environ(i, base), log_path=out / f"engine{i}.log",
                          startup_timeout_s=600) for i in range(2)]
    fe = None
    runs: list[dict] = []
    all_cores = os.sched_getaffinity(0)
    try:
        if own:   # the engines' every process on core 1; what starts after them (fronts, client) on core 0
            os.sched_setaffinity(0, {1})
        start_all(engines)   # the start threads and the engines they spawn inherit this thread's cores
        if own:
            os.sched_setaffinity(0, {0})
        urls = [e.url for e in engines]
        fe = Fronts(urls, model, out)
        urls_of, pids = {}, {}
        for f in ([] if kill else fronts):   # kill: a fresh front per run
            if f != DIRECT:
                urls_of[f], pids[f] = fe.start(f)

        def through_front(f: str, conc: int, n: int, rep: int) -> dict:
            """One ``vllm bench serve`` run through front ``f``, with its CPU, loop and engine views."""
            cpu0 = sum(sum(cpu_times(p).values()) for p in pids[f])   # the front end's process trees
            loop0 = front_status(urls_of[f], "loop") if f == "kunserve" else None
            st0 = stage_totals(urls_of[f]) if f == "kunserve" else None
            pc0 = engine_counters(urls) if prefix else None
            # prefix: every run its own prefixes (a run must not find another's in the caches)
            seed = 1000 * rep + 10 * concs.index(conc) + fronts.index(f) if prefix else rep
            dataset = None
            if a.workload == "mooncake":
                dataset = out / f"mooncake-{seed}.jsonl"
                mooncake_dataset(sessions[:n], tokenizer, a.block_tokens, seed, dataset)
            res = bench(urls_of[f], model, conc, n, a, out / f"{f}-c{conc}-rep{rep}.json", seed=seed,
                        dataset=dataset)
            if pc0 is not None:
                res.update(engine_view(pc0, engine_counters(urls)))
            res["front_cpu_s"] = sum(sum(cpu_times(p).values()) for p in pids[f]) - cpu0
            res["front_cpu_us_per_token"] = 1e6 * res["front_cpu_s"] / max(1, (res["completed"] or 0)
                                                                             * a.output_len)
            if loop0 is not None:
                loop1 = front_status(urls_of[f], "loop")
                res["loop"] = {k: round(loop1[k] - loop0[k], 3) for k in LOOP_KEYS if k in loop1}
            if st0 is not None:
                res.update(stage_view(st0, stage_totals(urls_of[f]), res.get("mean_ttft_ms")))
            return res

        order_rng = random.Random(1)
        for rep in range(1, a.repeat + 1):
            for conc, n in zip(concs, prompts):
                order = list(fronts)
                order_rng.shuffle(order)
                for f in order:
                    if kill:
                        res = kill_run(fe, f, engines, 1, conc, n, a, out, rep)
                        runs.append({"front": f, "concurrency": conc, "rep": rep, "prompts": n, **res})
                        print(f"rep {rep} {f}: killed at {res['killed_at_s']} s ({res['victim_running_at_kill']} "
                              f"running), lost {res['lost']} (failed {res['failed']}, short {res['short']})", flush=True)
                        continue
                    if f == DIRECT:
                        res = bench_direct(urls, model, conc, n, a, out / f"{f}-c{conc}-rep{rep}.json", seed=rep)
                    else:
                        res = through_front(f, conc, n, rep)
                    runs.append({"front": f, "concurrency": conc, "rep": rep, "prompts": n, **res})
                    print(f"rep {rep} c{conc} {f}: {res['output_throughput']:.0f} tok/s, median TTFT "
                          f"{res['median_ttft_ms']:.1f} ms, P99 {res['p99_ttft_ms']:.1f} ms, median ITL "
                          f"{res['median_itl_ms']:.2f} ms, failed {res['failed']}", flush=True)
    finally:
        if fe is not None:
            fe.stop_all()
        for e in engines:
            e.stop()
        os.sched_setaffinity(0, all_cores)
    an = analyse_kill(runs) if kill else analyse(runs, concs, fronts)
    meta = {"command": command("router_side_by_side.py"), "cpu": cpu_model(), "kv_bytes": kv, "repeat": a.repeat,
            "input_len": a.input_len, "output_len": a.output_len, "prompts": dict(zip(map(str, concs), prompts)),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "name": name, "workload": a.workload, "model": a.model,
            "layout": a.layout, "cores": os.cpu_count(), "engine_nice": a.engine_nice}
    if a.workload == "prefix":
        meta.update(prefix_len=a.prefix_len, suffix_len=a.suffix_len, num_prefixes=a.num_prefixes)
    if a.workload == "mooncake":
        meta.update(block_tokens=a.block_tokens, max_blocks=a.max_blocks, trace=Path(a.trace).name,
                    conversations=len({b[1] for b in sessions[:max(prompts)]}),
                    ideal_block_reuse=ideal_reuse(sessions[:max(prompts)]))
    if kill:
        meta.update(kill_after_s=a.kill_after, concurrency=concs[0])
    write_json(DOCS / f"{name}.json", {"meta": meta, "analysis": an, "runs": runs}, indent=1, clean=False)
    if not kill:
        plot(an, DOCS / f"{name}.png", fronts)
    (DOCS / f"{name}.md").write_text(draw(meta, an))
    print((DOCS / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
