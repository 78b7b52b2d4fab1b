"""Admission that knows memory, under an overload no group can hold (issue 74, item 3).

    python -m benchmarks.admission [--repeat 2] [--burst-x 2.5] [--queue 16]

The demo's regime (``vllm_kunserve/cli/demo.py``: a random-weight Llama of 48 thin layers, fp32, weights
0.55 of each engine's memory, 2 engines each pinned to a core), open-loop arrivals: the Azure 2023
conversation trace's (CC BY 4.0) re-timed into 20 s at ``--warm-x`` and 40 s at ``--burst-x`` times the
arrival rate whose requests stock's KV holds (its KV tokens over a request's time-weighted footprint,
over the demo's rough request life): the burst asks for more KV than even a 2-engine group holds
(1.61x). Systems, shuffled per repetition (``kunserve compare --derive``):

- ``vllm``: stock engines behind ``kunserve serve``: every request goes in; the engines preempt;
- ``vllm-queued``: the same with vLLM's own bound, ``--max-num-queued-reqs`` (per engine: the requests
  its KV holds and ``--queue`` / 2 waiting, :func:`vllm_bound`; an engine answers 503 past it, and the
  front end tries the other before the client hears it);
- ``vllm-admit``: stock engines behind ``kunserve serve --admission memory --admission-queue --queue``:
  a request whose KV the fleet cannot hold waits in the front end's queue, 429 past it;
- ``kunserve-admit``: cluster drop with the same admission: what the fleet can hold includes every drop
  it may still make.

Per system, pooled over the repetitions: requests completed and shed (HTTP 429 / 503), preemptions,
P50 / P99 TTFT of the admitted (bootstrap 95% interval), P50 TPOT, P99 end-to-end latency. Writes
``docs/benchmarks/admission.{md,json,png}``; raw data ``docs/benchmarks/runs/admission_<machine>.tar.xz``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path

from benchmarks.common import pooled, raw
from benchmarks.common.stats import fmt_interval
from vllm_kunserve.bench.report import REPO, command, md_table, pyplot, save_figure, write_json

PAGE = REPO / "docs" / "benchmarks" / "admission"
SYSTEMS = ("vllm", "vllm-queued", "vllm-admit", "kunserve-admit")
WARM_S, BURST_S = 20.0, 40.0


def vllm_bound(queue: int, holds: int) -> int:
    """vLLM's ``--max-num-queued-reqs`` for an engine whose KV holds ``holds`` requests, given the front
    end's queue of ``queue``: the bound counts the engine's running requests with its waiting ones
    (vLLM 0.32's API server answers 503 once running + waiting would pass it), so an engine may run what its KV
    holds and queue its half of the front end's queue."""
    return max(1, holds + queue // 2)


def derive(queue: int, wait_s: float, holds: int) -> dict[str, dict]:
    """The three systems made from stock and kunserve (``kunserve compare --derive``); ``holds``: the
    requests one engine's KV holds at their time-weighted footprint."""
    admit = ["--admission", "memory", "--admission-queue", str(queue), "--admission-wait", f"{wait_s:g}"]
    bound = vllm_bound(queue, holds)
    return {"vllm-queued": {"from": "vllm", "engine_args": ["--max-num-queued-reqs", str(bound)],
                            "description": f"stock engines, each with vLLM's --max-num-queued-reqs {bound} (the "
                                           f"{holds} requests its KV holds and {queue // 2} waiting)"},
            "vllm-admit": {"from": "vllm", "serve_args": admit,
                           "description": f"stock engines, the front end's memory-aware admission (queue {queue})"},
            "kunserve-admit": {"from": "kunserve", "serve_args": admit,
                               "description": f"cluster drop and the front end's memory-aware admission (queue {queue})"}}


def measure(a: argparse.Namespace, out: Path) -> dict:
    from vllm_kunserve.cli import demo
    from vllm_kunserve.cli.main import main as kunserve
    from vllm_kunserve.tools.make_model import build_model

    model = REPO / "models" / "demo-48x256"
    if not (model / "config.json").exists():
        build_model(model, demo.spec())
    kv = demo.kv_tokens_per_engine()
    _, foot = demo.footprint_tokens()
    per_s = 2 * kv / foot / demo.LIFE_S   # arrivals per second whose requests stock's KV holds
    holds = math.ceil(kv / foot)
    phases = f"{WARM_S:g}@{a.warm_x * per_s:.3f},{BURST_S:g}@{a.burst_x * per_s:.3f}"
    systems = ",".join(SYSTEMS)
    argv = ["compare", "--model", str(model), "--instances", "2", "--dispatch", "least-work", "--systems", systems,
            "--repeat", str(a.repeat), "--order", "shuffled", "--resume", "--kunserve-config", json.dumps(demo.KUNSERVE),
            "--kv-capacity-tokens", str(kv), "--block-size", str(demo.BLOCK),
            "--max-model-len", str(demo.PROMPT + demo.OUT_MAX + demo.BLOCK),
            "--engine-arg=--enforce-eager", "--engine-arg=--stream-interval=8",
            *[x for e in demo.ENGINE_ENV for x in ("--env", e)],
            "--trace", str(REPO.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"), "--format", "azure",
            "--phases", phases, "--synthetic-lengths", "--prompt-len", str(demo.PROMPT),
            "--output-len", str(demo.OUT_MIN), "--output-len-max", str(demo.OUT_MAX), "--seed", str(a.seed),
            "--no-progress", "--client-realtime", "--out", str(out),
            *(f"--derive={n}={json.dumps(d)}" for n, d in derive(a.queue, a.wait, holds).items())]
    print("running: kunserve " + " ".join(argv), flush=True)
    if kunserve(argv) != 0:
        raise SystemExit("kunserve compare failed (its output is above)")
    return {"phases": phases, "window": [WARM_S, WARM_S + BURST_S], "kv_tokens_per_engine": kv,
            "holdable_rate": per_s, "holds_per_engine": holds, "warm_x": a.warm_x, "burst_x": a.burst_x, "queue": a.queue, "wait_s": a.wait,
            "repeat": a.repeat, "machine": demo.machine(), "weight_share": demo.WEIGHT_SHARE,
            "group_factor": demo.group_factor(), "kunserve_config": demo.KUNSERVE}


def shed_of(folder: Path, system: str) -> dict:
    """Every request of a system's repetitions (not only the window's): completed, shed (429 / 503), failed."""
    from vllm_kunserve.workload.records import read_csv

    n = ok = shed = 0
    for _, f in pooled.request_files(folder, system):
        for r in read_csv(f):
            n += 1
            ok += r["ok"] == "1"
            shed += r["ok"] != "1" and (r.get("error") or "").startswith(("HTTP 429", "HTTP 503"))
    return {"requests": n, "completed": ok, "shed": shed, "failed": n - ok - shed}


def analyse(folder: Path, meta: dict) -> dict:
    compare = json.loads((folder / "compare.json").read_text())
    out = {}
    for s in SYSTEMS:
        reqs = [r for k, f in pooled.request_files(folder, s) for r in pooled.read_window(f, k, 0.0, 1e9)]
        done = [r for r in reqs if r.ok]
        t = pooled.tail(done)
        out[s] = {**shed_of(folder, s), "preemptions": sum(x.get("preemptions") or 0 for x in compare["runs"][s]),
                  "ttft_p50": t["p50"]["value"], "ttft_p99": t["p99"], "tpot_p50": pooled.tpot(done)["p50"],
                  "e2e_p99": pooled.point(pooled.by_rep(done, pooled.METRIC["e2e"]), 99) if done else None,
                  "description": next((x["description"] for x in compare["systems"] if x["name"] == s), "")}
    return out


def plot(path: Path, an: dict) -> bool:
    plt = pyplot(optional=True)
    if plt is None:
        return False
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
    xs = range(len(SYSTEMS))
    ax[0].bar(xs, [an[s]["completed"] / max(1, an[s]["requests"]) for s in SYSTEMS], color="C2", label="completed")
    ax[0].bar(xs, [an[s]["shed"] / max(1, an[s]["requests"]) for s in SYSTEMS],
              bottom=[an[s]["completed"] / max(1, an[s]["requests"]) for s in SYSTEMS], color="C3", label="shed")
    ax[0].set_title("share of requests", fontsize=10)
    ax[0].legend(fontsize=7)
    ax[1].bar(xs, [an[s]["preemptions"] for s in SYSTEMS], color="C1")
    ax[1].set_title("preemptions (all repetitions)", fontsize=10)
    p99 = [an[s]["ttft_p99"]["value"] or 0 for s in SYSTEMS]
    lo = [v - (an[s]["ttft_p99"]["lo"] or v) for v, s in zip(p99, SYSTEMS)]
    hi = [min(1e4, an[s]["ttft_p99"]["hi"] or v) - v for v, s in zip(p99, SYSTEMS)]
    ax[2].bar(xs, p99, yerr=[lo, hi], color="C0", capsize=3)
    ax[2].set_title("P99 TTFT of the admitted (s)", fontsize=10)
    for a_ in ax:
        a_.set_xticks(list(xs), SYSTEMS, rotation=20, fontsize=8)
    save_figure(fig, path)
    return True


def render(an: dict, meta: dict, cmd: str, name: str) -> str:
    m = meta["machine"]
    L = ["# Admission that knows memory, under an overload no group holds (written by benchmarks/admission.py)", "",
         f"Command: `{cmd}`. Raw data: `docs/benchmarks/runs/{name}{raw.SUFFIX}`.", "",
         f"![completed and shed, preemptions, P99 TTFT]({PAGE.name}.png)", "",
         f"Machine: {m['cpu']} ({m['kind']}), {m['cores']} cores, each engine one compute thread on its own core. "
         f"Model and memory: `make demo`'s (48 thin layers, fp32; weights {meta['weight_share']:.2f} of each engine's "
         f"memory, so a 2-engine group holds {meta['group_factor']:.2f}x the KV; {meta['kv_tokens_per_engine']} KV "
         f"tokens per engine). Arrivals: the Azure 2023 conversation trace's, re-timed into `{meta['phases']}` "
         f"(s@req/s): {meta['warm_x']:g}x then {meta['burst_x']:g}x the rate whose requests stock's KV holds "
         f"({meta['holdable_rate']:.2f} req/s); prompts of 32 tokens, outputs 96-192. "
         f"{meta['repeat']} repetition(s), systems shuffled per repetition; statistics pooled over them (every "
         "request of the run, not a window: shedding changes who is in it).", "",
         "Systems:", "", *(f"- `{s}`: {an[s]['description']}" for s in SYSTEMS), ""]

    L += md_table(["system", "requests", "completed", "shed (429 / 503)", "failed otherwise", "preemptions",
                   "P50 TTFT admitted (s)", "P99 TTFT admitted (s, 95%)", "P50 TPOT (ms)", "P99 E2E (s)"],
                  "lrrrrrrlrr",
                  ([s, a["requests"], a["completed"], f"{a['shed']} ({a['shed'] / max(1, a['requests']):.0%})",
                    a["failed"], f"{a['preemptions']:g}", "-" if a["ttft_p50"] is None else f"{a['ttft_p50']:.2f}",
                    fmt_interval(a["ttft_p99"]), "-" if a["tpot_p50"] is None else f"{a['tpot_p50'] * 1e3:.0f}",
                    "-" if a["e2e_p99"] is None else f"{a['e2e_p99']:.1f}"] for s, a in an.items()))
    k, v = an["kunserve-admit"], an["vllm"]
    L += ["", f"Reading: stock took every request and preempted {v['preemptions']:g} times; its admitted requests' "
          f"P99 TTFT was {fmt_interval(v['ttft_p99'])} s. With admission over what the fleet can reach after its drops, "
          f"kunserve preempted {k['preemptions']:g} times, shed {k['shed']} of {k['requests']} requests "
          f"({k['shed'] / max(1, k['requests']):.0%}) and its admitted requests' P99 TTFT was {fmt_interval(k['ttft_p99'])} s. "
          "The queue waits count in TTFT: a request the front end holds back is timed from when the client sent it. "
          "The gate counts the fleet's KV as one pool while dispatch puts each request on one engine, so an engine "
          "can still run short while the other has room: the likely source of the preemptions left with admission "
          "(per-engine admission is not built). vLLM's bound counts requests, so what it lets in depends on their "
          "lengths; the front end's gate counts their KV.",
          ""]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--warm-x", type=float, default=0.6)
    ap.add_argument("--burst-x", type=float, default=2.5)
    ap.add_argument("--queue", type=int, default=16, help="the front end's admission queue; vLLM's bound queues half of it per engine")
    ap.add_argument("--wait", type=float, default=30.0, help="seconds a request may wait in the front end's queue")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "runs" / "admission"))
    ap.add_argument("--render", action="store_true", help="only the page, from the runs in --out")
    a = ap.parse_args(argv)
    if a.repeat < 1 or a.queue < 2 or not 0 < a.warm_x < a.burst_x or not a.wait > 0:
        ap.error("--repeat >= 1, --queue >= 2, 0 < --warm-x < --burst-x and --wait > 0")
    out = Path(a.out)
    if a.render:   # the measured run's own description and command, as its last full run wrote them
        page = json.loads(PAGE.with_suffix(".json").read_text())
        meta, argv = page["meta"], shlex.split(page["command"].split("benchmarks.admission", 1)[-1])
    else:
        meta = measure(a, out)
    an = analyse(out, meta)
    from benchmarks.load_curve import machine_slug

    name = f"admission_{machine_slug()}"
    with tempfile.TemporaryDirectory() as tmp:
        from benchmarks.burst_value import copy_raw

        copy_raw(out, Path(tmp), list(SYSTEMS), a.repeat)
        raw.pack(Path(tmp), name, {"meta": meta, "analysis": an})
    cmd = command("admission.py", argv if argv is not None else sys.argv[1:])
    plot(PAGE.with_suffix(".png"), an)
    write_json(PAGE.with_suffix(".json"), {"command": cmd, "meta": meta, "analysis": an}, clean=False, default=str)
    PAGE.with_suffix(".md").write_text(render(an, meta, cmd, name))
    print(PAGE.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
