"""The front end side by side with vllm-router over the same two engines (issue 37).

Two stock ``vllm serve`` engines (the tiny model, one core each: ``VLLM_CPU_OMP_THREADS_BIND`` 0
and 1, one thread) are started once; in front of them, at the same time and each idle while
another is measured:

- ``vllm-router-rr`` and ``vllm-router-ca``: vllm-router (PyPI, the vLLM project's Rust router)
  with ``--policy round_robin`` and ``cache_aware`` (its default), ``--worker-urls`` the engines;
- ``kunserve``: ``kunserve serve --engine-url`` over the same engines (attach mode, its default
  least-work dispatch).

The client is vLLM's own, ``vllm bench serve`` (random dataset, ``--random-input-len`` prompt and
``--random-output-len`` output tokens, ``--ignore-eos``), at each ``--concurrency``, every front in
a shuffled order per repetition; everything shares the machine's cores (front ends, client and
engines), as a user's front end does. Per front and concurrency: output tokens/s, median and P99
TTFT, the client's median inter-token latency (tokens bunched by a late relay show as a median
ITL near 0), each the mean over repetitions with a 95% bootstrap interval of that mean; the ratio
to vllm-router round_robin. Writes ``docs/benchmarks/router_side_by_side.{md,json,png}``.

    python benchmarks/router_side_by_side.py [--repeat 5] [--concurrency 1,32,128]

``--workload prefix`` asks the shared-prefix question instead (issue 37's cache-aware dispatch):
``vllm bench serve --dataset-name prefix_repetition`` (``--num-prefixes`` prompts of
``--prefix-len`` tokens, each followed by a ``--suffix-len``-token suffix, shuffled), a fresh set of
prefixes every run (the seed), against vllm-router ``cache_aware`` and kunserve's own least-work
and ``cache-aware`` dispatch (``kunserve``, ``kunserve-ca``: two front ends over the same engines),
with each run's prefix-cache hit rate from the engines' own counters (``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``). Writes ``router_side_by_side_prefix.{md,json,png}``.

    python benchmarks/router_side_by_side.py --workload prefix [--concurrency 16] [--prompts 160]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from vllm_kunserve.bench.compare import cpu_times
from vllm_kunserve.bench.report import command, cpu_model, md_table, pyplot, save_figure, write_json
from vllm_kunserve.bench.router_fleet import engine_environ, router_argv, router_binary, wait_healthy
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster, VllmServer, free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
NAME = "router_side_by_side"
FRONTS = ("vllm-router-rr", "vllm-router-ca", "kunserve")
PREFIX_FRONTS = ("vllm-router-ca", "kunserve", "kunserve-ca")
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms")
LOOP_KEYS = ("ticks", "late", "late_s", "late_cpu_s", "late_runq_s")   # /kunserve/status loop totals
EXTRA = ("front_cpu_us_per_token", "prefix_hit_rate")   # measured since the runs that record them


def engine_args(kv_bytes: int) -> list[str]:
    return ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(kv_bytes),
            "--max-model-len", "512", "--enforce-eager", "--served-model-name", "model",
            "--max-num-seqs", "256"]


def dataset_args(a: argparse.Namespace) -> list[str]:
    if a.workload == "prefix":
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(a.prefix_len),
                "--prefix-repetition-suffix-len", str(a.suffix_len), "--prefix-repetition-num-prefixes",
                str(a.num_prefixes), "--prefix-repetition-output-len", str(a.output_len)]
    return ["--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)]


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """The engines' prefix-cache hits and queries (tokens) so far, summed over engines."""
    import urllib.request

    hits = queries = 0.0
    for u in urls:
        with urllib.request.urlopen(u + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def bench(url: str, model: Path, conc: int, n: int, a: argparse.Namespace, out: Path, seed: int) -> dict:
    argv = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--model", "model", "--tokenizer", str(model), *dataset_args(a), "--ignore-eos",
            "--num-prompts", str(n), "--max-concurrency", str(conc), "--request-rate", "inf", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "VLLM_HOST_IP": "127.0.0.1"})
    res = json.loads(out.read_text())
    return {"completed": res.get("completed"), "failed": res.get("failed", 0),
            **{k: res.get(k) for k in METRICS}}


def loop_view(url: str) -> dict:
    """kunserve's front end: its event loop's late wake-ups so far (``/kunserve/status``)."""
    import urllib.request

    with urllib.request.urlopen(url + "/kunserve/status", timeout=10) as r:
        return json.loads(r.read())["loop"]


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


def fmt(c: dict, digits: int = 1) -> str:
    return f"{c['mean']:.{digits}f} ({c['lo']:.{digits}f}..{c['hi']:.{digits}f})"


def cell(fr: dict, f: str, m: str, digits: int, base: str) -> str:
    """A table cell: front ``f``'s mean of ``m`` with its interval and, for any front but ``base``,
    its ratio to ``base``'s mean ("-" where ``f`` has no ``m``)."""
    x, b = fr[f].get(m), fr.get(base, {}).get(m)
    if x is None:
        return "-"
    return fmt(x, digits) + (f" [{x['mean'] / b['mean']:.2f}x]" if b and b["mean"] and f != base else "")


def target_line(c: str, what: str, mine: dict, ref: dict, bound: float | None, above: bool) -> str:
    """One target's verdict: ``mine`` / ``ref`` (means) against ``bound`` (``above``: at least it,
    else at most; None: within 10% of 1), and whether the two 95% intervals overlap."""
    v = mine["mean"] / ref["mean"] if ref["mean"] else float("nan")
    ok = abs(v - 1) <= 0.1 if bound is None else (v >= bound if above else v <= bound)
    overlap = mine["lo"] <= ref["hi"] and ref["lo"] <= mine["hi"]
    return (f"- {c} streams, {what}: {v:.2f}x -> **{'met' if ok else 'missed'}**"
            + (" (the 95% intervals overlap)" if overlap else " (the 95% intervals apart)"))


def render(meta: dict, an: dict) -> str:
    L = ["# kunserve serve side by side with vllm-router (written by benchmarks/router_side_by_side.py)", "",
         f"Command: `{meta['command']}`.", "", f"![side by side]({NAME}.png)", "",
         f"{meta['cpu']}, {os.cpu_count()} cores shared by everything. Two stock `vllm serve` engines (`models/tiny`, "
         f"{meta['kv_bytes'] >> 20} MiB of KV each, one compute thread each, bound to cores 0 and 1), started once; "
         "in front of them vllm-router 0.1.17 (`--policy round_robin`: `vllm-router-rr`; `cache_aware`, its default: "
         "`vllm-router-ca`) and `kunserve serve --engine-url` over the same two engines (`kunserve`, least-work). "
         f"Client: `vllm bench serve`, random dataset, {meta['input_len']}-token prompts, {meta['output_len']} output "
         f"tokens (`--ignore-eos`), {meta['repeat']} repetitions, the fronts in a shuffled order in each; the prompt "
         "counts per concurrency are in the JSON. Each cell: the mean over repetitions (95% bootstrap interval of the "
         "mean) and, in brackets, the ratio to vllm-router round_robin's mean.", ""]
    for c, fr in an.items():
        L += [f"## {c} concurrent stream{'s' if c != '1' else ''}", ""]
        L += md_table(["front", "output tok/s", "median TTFT (ms)", "P99 TTFT (ms)", "median ITL (ms)", "failed"],
                      "lrrrrr", ([f, *(cell(fr, f, m, d, "vllm-router-rr") for m, d in (
                          ("output_throughput", 0), ("median_ttft_ms", 1), ("p99_ttft_ms", 1), ("median_itl_ms", 2))),
                          fr[f]["failed"]] for f in FRONTS if f in fr))
        L += [""]
    if any("front_cpu_us_per_token" in fr[f] for fr in an.values() for f in fr):
        L += ["## What each front end costs, and where kunserve's waits", "",
              "CPU time of the front end's process (and its children) over each run, per output token (psutil), and "
              "kunserve's event loop over its runs (`/kunserve/status` `loop`: wake-ups of a 10 ms tick at least "
              "20 ms late; of their lateness, the time its thread ran and the time it was runnable but waiting for "
              "a core, from `/proc/thread-self/schedstat`, the latter counted over the whole tick and so capped at "
              "100%):", "",
              "Reading: the engines keep both cores busy; the Rust router needs about half the CPU per token that "
              "kunserve's Python front end needs at 32 and 128 streams, and kunserve's late wake-ups are time spent "
              "runnable without a core, not its own work: it runs late, reads several of a stream's tokens at once "
              "and passes them on together (the median ITL near 0), while the engines' throughput is the same. "
              "Less CPU per token (or a core of its own, which `docs/benchmarks/front_end.md` measures) is what "
              "the remaining targets need.", ""]
        rows = []
        for c, fr in an.items():
            lp = fr.get("kunserve", {}).get("loop") or {}
            cpu = [fmt(fr[f]["front_cpu_us_per_token"], 0) if "front_cpu_us_per_token" in fr.get(f, {}) else "-"
                   for f in FRONTS]
            share = (f"{lp['late']} late ({lp['late_s']:.1f} s): running {lp['late_cpu_s'] / lp['late_s']:.0%}, "
                     f"waiting for a core {min(1.0, lp['late_runq_s'] / lp['late_s']):.0%}") if lp.get("late_s") else "-"
            rows.append([c, *cpu, share])
        L += md_table(["streams", *(f"{f} CPU us/token" for f in FRONTS), "kunserve's late wake-ups"], "rrrrl", rows)
        L += [""]
    L += ["## Targets (issue 37, shared cores, against vllm-router)", ""]
    for c, fr in an.items():
        k, rr = fr.get("kunserve"), fr.get("vllm-router-rr")
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
        L += [target_line(c, what, mine, ref, bound, above) for what, mine, ref, bound, above in checks]
    L += ["", f"Raw data: `{NAME}.json` (every run's `vllm bench serve` result, the order).", ""]
    return "\n".join(L)


def render_prefix(meta: dict, an: dict) -> str:
    """The shared-prefix page: per concurrency the fronts' throughput, TTFT and the engines' prefix-cache
    hit rate, and issue 37's cache-aware targets (kunserve-ca against least-work and vllm-router cache_aware)."""
    name = meta["name"]
    L = ["# Shared prefixes: cache-aware dispatch side by side with vllm-router (written by "
         "benchmarks/router_side_by_side.py)", "", f"Command: `{meta['command']}`.", "", f"![shared prefixes]({name}.png)",
         "", f"{meta['cpu']}, {os.cpu_count()} cores shared by everything. Two stock `vllm serve` engines (`models/tiny`, "
         f"{meta['kv_bytes'] >> 20} MiB of KV each, prefix caching on as vLLM's default, one compute thread each, bound "
         "to cores 0 and 1), started once; in front of them vllm-router 0.1.17 `--policy cache_aware` "
         "(`vllm-router-ca`) and two `kunserve serve --engine-url` over the same engines: least-work (`kunserve`, its "
         "default) and `--dispatch cache-aware` (`kunserve-ca`). Client: `vllm bench serve --dataset-name "
         f"prefix_repetition`: {meta['num_prefixes']} prefixes of {meta['prefix_len']} tokens, every prompt one of them "
         f"and a {meta['suffix_len']}-token suffix of its own, {meta['output_len']} output tokens (`--ignore-eos`), "
         "shuffled, a new set of prefixes every run (the seed), so no run finds another's prefixes cached; "
         f"{meta['repeat']} repetitions, the fronts in a shuffled order in each. Each cell: the mean over repetitions "
         "(95% bootstrap interval of the mean) and, in brackets, the ratio to `kunserve` (least-work). Prefix hit rate: "
         "the engines' own counters over the run, hit tokens over queried tokens.", ""]
    for c, fr in an.items():
        L += [f"## {c} concurrent stream{'s' if c != '1' else ''}", ""]
        L += md_table(["front", "output tok/s", "median TTFT (ms)", "P99 TTFT (ms)", "prefix hit rate", "failed"],
                      "lrrrrr", ([f, *(cell(fr, f, m, d, "kunserve") for m, d in (
                          ("output_throughput", 0), ("median_ttft_ms", 1), ("p99_ttft_ms", 1), ("prefix_hit_rate", 3))),
                          fr[f]["failed"]] for f in PREFIX_FRONTS if f in fr))
        L += [""]
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
            ax.bar(x + (k - 1) * 0.27, [v["mean"] for v in vals], 0.27, label=f,
                   yerr=[[v["mean"] - v["lo"] for v in vals], [v["hi"] - v["mean"] for v in vals]], capsize=2)
        ax.set_xticks(x, [f"{c} streams" for c in concs])
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workload", choices=("random", "prefix"), default="random")
    ap.add_argument("--concurrency", default=None, help="default 1,32,128 (random) or 16 (prefix)")
    ap.add_argument("--prompts", default=None, help="requests per run at each concurrency (default 24,192,384 / 160)")
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--out", default="", help="run directory (default runs/<the page's name>)")
    ap.add_argument("--render-only", action="store_true", help="re-write the doc from the JSON")
    a = ap.parse_args()
    prefix = a.workload == "prefix"
    name, fronts, draw = (f"{NAME}_prefix", PREFIX_FRONTS, render_prefix) if prefix else (NAME, FRONTS, render)
    concs = [int(x) for x in (a.concurrency or ("16" if prefix else "1,32,128")).split(",")]
    prompts = [int(x) for x in (a.prompts or ("160" if prefix else "24,192,384")).split(",")]
    if len(prompts) != len(concs) or a.repeat < 1:
        ap.error("--prompts needs one count per --concurrency, and --repeat >= 1")
    if prefix and min(prompts) < a.num_prefixes:
        ap.error("--prompts must be at least --num-prefixes")
    if a.render_only:
        data = json.loads((DOCS / f"{name}.json").read_text())
        (DOCS / f"{name}.md").write_text(draw(data["meta"], data["analysis"]))
        return 0
    from vllm_kunserve.tools.make_model import PRESETS, build_model

    model = ROOT / "models" / "tiny"
    if not (model / "config.json").exists():
        build_model(model, PRESETS["tiny"])
    out = Path(a.out or ROOT / "runs" / name)
    out.mkdir(parents=True, exist_ok=True)
    kv = a.kv_mib << 20
    engines = [VllmServer(str(model), engine_args(kv), env=engine_environ(i, {"KUNSERVE_ENGINE_CPUS": "0|1",
                                                                             "OMP_NUM_THREADS": "1"}),
                          log_path=out / f"engine{i}.log", startup_timeout_s=600) for i in range(2)]
    routers: list[subprocess.Popen] = []
    kfronts: list[KunserveCluster] = []
    runs: list[dict] = []
    try:
        for e in engines:
            e.start()
        urls = [e.url for e in engines]
        urls_of, pids = {}, {}
        for fname, policy in (("vllm-router-rr", "round_robin"), ("vllm-router-ca", "cache_aware")):
            if fname not in fronts:
                continue
            port = free_port()
            with open(out / f"{fname}.log", "w") as log:
                routers.append(subprocess.Popen(router_argv(router_binary(), "127.0.0.1", port, urls, policy,
                                                            free_port()), stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True))
            urls_of[fname] = f"http://127.0.0.1:{port}"
            pids[fname] = routers[-1].pid
            wait_healthy(urls_of[fname], routers[-1], 60)
        for fname, dispatch in (("kunserve", []), ("kunserve-ca", ["--dispatch", "cache-aware"])):
            if fname not in fronts:
                continue
            kfronts.append(KunserveCluster(str(model), [], None, log_path=out / f"{fname}.log", instances=2,
                                           startup_timeout_s=120,
                                           extra=[*dispatch, *[x for u in urls for x in ("--engine-url", u)]]))
            kfronts[-1].start()
            urls_of[fname], pids[fname] = kfronts[-1].url, kfronts[-1]._proc.proc.pid
        order_rng = random.Random(1)
        for rep in range(1, a.repeat + 1):
            for conc, n in zip(concs, prompts):
                order = list(fronts)
                order_rng.shuffle(order)
                for f in order:
                    cpu0 = sum(cpu_times(pids[f]).values())   # the front end's process tree
                    loop0 = loop_view(urls_of[f]) if f == "kunserve" else None
                    pc0 = prefix_counters(urls) if prefix else None
                    # prefix: every run its own prefixes (a run must not find another's in the caches)
                    seed = 1000 * rep + 10 * concs.index(conc) + fronts.index(f) if prefix else rep
                    res = bench(urls_of[f], model, conc, n, a, out / f"{f}-c{conc}-rep{rep}.json", seed=seed)
                    if pc0 is not None:
                        pc1 = prefix_counters(urls)
                        res["prefix_hit_rate"] = (pc1[0] - pc0[0]) / max(1.0, pc1[1] - pc0[1])
                    res["front_cpu_s"] = sum(cpu_times(pids[f]).values()) - cpu0
                    res["front_cpu_us_per_token"] = 1e6 * res["front_cpu_s"] / max(1, (res["completed"] or 0)
                                                                                     * a.output_len)
                    if loop0 is not None:
                        loop1 = loop_view(urls_of[f])
                        res["loop"] = {k: round(loop1[k] - loop0[k], 3) for k in LOOP_KEYS if k in loop1}
                    runs.append({"front": f, "concurrency": conc, "rep": rep, "prompts": n, **res})
                    print(f"rep {rep} c{conc} {f}: {res['output_throughput']:.0f} tok/s, median TTFT "
                          f"{res['median_ttft_ms']:.1f} ms, P99 {res['p99_ttft_ms']:.1f} ms, median ITL "
                          f"{res['median_itl_ms']:.2f} ms, failed {res['failed']}", flush=True)
    finally:
        for k in kfronts:
            k.stop()
        for p in routers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        for e in engines:
            e.stop()
    an = analyse(runs, concs, fronts)
    meta = {"command": command("router_side_by_side.py"), "cpu": cpu_model(), "kv_bytes": kv, "repeat": a.repeat,
            "input_len": a.input_len, "output_len": a.output_len, "prompts": dict(zip(map(str, concs), prompts)),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "name": name, "workload": a.workload}
    if prefix:
        meta.update(prefix_len=a.prefix_len, suffix_len=a.suffix_len, num_prefixes=a.num_prefixes)
    write_json(DOCS / f"{name}.json", {"meta": meta, "analysis": an, "runs": runs}, indent=1, clean=False)
    plot(an, DOCS / f"{name}.png", fronts)
    (DOCS / f"{name}.md").write_text(draw(meta, an))
    print((DOCS / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
