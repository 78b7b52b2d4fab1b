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
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms")
EXTRA = ("front_cpu_us_per_token",)   # measured since the runs that record it


def engine_args(kv_bytes: int) -> list[str]:
    return ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(kv_bytes),
            "--max-model-len", "512", "--enforce-eager", "--served-model-name", "model",
            "--max-num-seqs", "256"]


def bench(url: str, model: Path, conc: int, n: int, a: argparse.Namespace, out: Path, seed: int) -> dict:
    argv = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--model", "model", "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len), "--ignore-eos",
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


def analyse(runs: list[dict], concs: list[int]) -> dict:
    rng = np.random.default_rng(0)
    out: dict = {}
    for c in concs:
        for f in FRONTS:
            rows = [r for r in runs if r["front"] == f and r["concurrency"] == c]
            if rows:
                out.setdefault(str(c), {})[f] = {m: mean_ci([r[m] for r in rows], rng) for m in METRICS} | {
                    m: mean_ci([r[m] for r in rows], rng) for m in EXTRA if all(m in r for r in rows)} | {
                    "failed": sum(r["failed"] or 0 for r in rows), "completed": sum(r["completed"] or 0 for r in rows)}
        k = [r["loop"] for r in runs if r["front"] == "kunserve" and r["concurrency"] == c and "loop" in r]
        if k:
            tot = {key: sum(x.get(key, 0) for x in k) for key in ("ticks", "late", "late_s", "late_cpu_s", "late_runq_s")}
            out[str(c)]["kunserve"]["loop"] = tot
    return out


def fmt(c: dict, digits: int = 1) -> str:
    return f"{c['mean']:.{digits}f} ({c['lo']:.{digits}f}..{c['hi']:.{digits}f})"


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
        base = fr.get("vllm-router-rr")
        L += [f"## {c} concurrent stream{'s' if c != '1' else ''}", ""]

        def cell(f, m, d):
            x = fr[f][m]
            r = f" [{x['mean'] / base[m]['mean']:.2f}x]" if base and base[m]["mean"] and f != "vllm-router-rr" else ""
            return fmt(x, d) + r
        L += md_table(["front", "output tok/s", "median TTFT (ms)", "P99 TTFT (ms)", "median ITL (ms)", "failed"],
                      "lrrrrr", ([f, cell(f, "output_throughput", 0), cell(f, "median_ttft_ms", 1),
                                  cell(f, "p99_ttft_ms", 1), cell(f, "median_itl_ms", 2), fr[f]["failed"]]
                                 for f in FRONTS if f in fr))
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
        for what, mine, ref, bound, above in checks:
            v = mine["mean"] / ref["mean"] if ref["mean"] else float("nan")
            ok = abs(v - 1) <= 0.1 if bound is None else (v >= bound if above else v <= bound)
            overlap = mine["lo"] <= ref["hi"] and ref["lo"] <= mine["hi"]
            L.append(f"- {c} streams, {what}: {v:.2f}x -> **{'met' if ok else 'missed'}**"
                     + (" (the 95% intervals overlap)" if overlap else " (the 95% intervals apart)"))
    L += ["", f"Raw data: `{NAME}.json` (every run's `vllm bench serve` result, the order).", ""]
    return "\n".join(L)


def plot(an: dict, path: Path) -> None:
    plt = pyplot(optional=True)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    concs = list(an)
    x = np.arange(len(concs))
    for ax, (m, label) in zip(axes, [("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT (ms)"),
                                     ("median_itl_ms", "median ITL (ms)")]):
        for k, f in enumerate(FRONTS):
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
    ap.add_argument("--concurrency", default="1,32,128")
    ap.add_argument("--prompts", default="24,192,384", help="requests per run at each concurrency")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "runs" / NAME))
    ap.add_argument("--render-only", action="store_true", help="re-write the doc from the JSON")
    a = ap.parse_args()
    concs = [int(x) for x in a.concurrency.split(",")]
    prompts = [int(x) for x in a.prompts.split(",")]
    if len(prompts) != len(concs) or a.repeat < 1:
        ap.error("--prompts needs one count per --concurrency, and --repeat >= 1")
    if a.render_only:
        data = json.loads((DOCS / f"{NAME}.json").read_text())
        (DOCS / f"{NAME}.md").write_text(render(data["meta"], data["analysis"]))
        return 0
    from vllm_kunserve.tools.make_model import PRESETS, build_model

    model = ROOT / "models" / "tiny"
    if not (model / "config.json").exists():
        build_model(model, PRESETS["tiny"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kv = a.kv_mib << 20
    engines = [VllmServer(str(model), engine_args(kv), env=engine_environ(i, {"KUNSERVE_ENGINE_CPUS": "0|1",
                                                                             "OMP_NUM_THREADS": "1"}),
                          log_path=out / f"engine{i}.log", startup_timeout_s=600) for i in range(2)]
    routers: list[subprocess.Popen] = []
    front = None
    runs: list[dict] = []
    try:
        for e in engines:
            e.start()
        urls = [e.url for e in engines]
        fronts, pids = {}, {}
        for name, policy in (("vllm-router-rr", "round_robin"), ("vllm-router-ca", "cache_aware")):
            port = free_port()
            with open(out / f"{name}.log", "w") as log:
                routers.append(subprocess.Popen(router_argv(router_binary(), "127.0.0.1", port, urls, policy,
                                                            free_port()), stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True))
            fronts[name] = f"http://127.0.0.1:{port}"
            pids[name] = routers[-1].pid
            wait_healthy(fronts[name], routers[-1], 60)
        front = KunserveCluster(str(model), [], None, log_path=out / "kunserve.log", instances=2, startup_timeout_s=120,
                                extra=[x for u in urls for x in ("--engine-url", u)])
        front.start()
        fronts["kunserve"], pids["kunserve"] = front.url, front._proc.proc.pid
        order_rng = random.Random(1)
        for rep in range(1, a.repeat + 1):
            for conc, n in zip(concs, prompts):
                order = list(FRONTS)
                order_rng.shuffle(order)
                for f in order:
                    cpu0 = sum(cpu_times(pids[f]).values())   # the front end's process tree
                    loop0 = loop_view(fronts[f]) if f == "kunserve" else None
                    res = bench(fronts[f], model, conc, n, a, out / f"{f}-c{conc}-rep{rep}.json", seed=rep)
                    res["front_cpu_s"] = sum(cpu_times(pids[f]).values()) - cpu0
                    res["front_cpu_us_per_token"] = 1e6 * res["front_cpu_s"] / max(1, (res["completed"] or 0)
                                                                                     * a.output_len)
                    if loop0 is not None:
                        loop1 = loop_view(fronts[f])
                        res["loop"] = {k: round(loop1[k] - loop0[k], 3) for k in
                                       ("ticks", "late", "late_s", "late_cpu_s", "late_runq_s") if k in loop1}
                    runs.append({"front": f, "concurrency": conc, "rep": rep, "prompts": n, **res})
                    print(f"rep {rep} c{conc} {f}: {res['output_throughput']:.0f} tok/s, median TTFT "
                          f"{res['median_ttft_ms']:.1f} ms, P99 {res['p99_ttft_ms']:.1f} ms, median ITL "
                          f"{res['median_itl_ms']:.2f} ms, failed {res['failed']}", flush=True)
    finally:
        if front is not None:
            front.stop()
        for p in routers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        for e in engines:
            e.stop()
    an = analyse(runs, concs)
    meta = {"command": command("router_side_by_side.py"), "cpu": cpu_model(), "kv_bytes": kv, "repeat": a.repeat,
            "input_len": a.input_len, "output_len": a.output_len, "prompts": dict(zip(map(str, concs), prompts)),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_json(DOCS / f"{NAME}.json", {"meta": meta, "analysis": an, "runs": runs}, indent=1, clean=False)
    plot(an, DOCS / f"{NAME}.png")
    (DOCS / f"{NAME}.md").write_text(render(meta, an))
    print((DOCS / f"{NAME}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
