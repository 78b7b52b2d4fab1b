"""``kunserve demo`` (``make demo``): one burst where KV binds and compute does not, on three
2-engine clusters started with ``kunserve serve``, side by side.

The regime, chosen so that what cluster drop is for shows on any of these CPUs:

- **Model**: a random-weight Llama of 48 thin layers (hidden 256, full multi-head attention), fp32,
  168 MB. A decode step of so many small layers costs its per-layer overhead more than its batch
  (an EPYC Zen 3 core, measured once beside other work: about 61, 69 and 71 ms a step at batch
  8, 12 and 16), so a bigger batch is nearly free,
  as on a GPU, where a decode step reads the weights once whatever the batch. A wide model on a CPU
  is compute-bound instead, and there extra KV buys nothing (docs/benchmarks/burst_value_headline.md).
- **Memory**: weights are 0.55 of each engine's memory (weight share w, mid-range of what replicated
  serving sees), so a group of the two holds 1 + w / (2 (1 - w)) = 1.61x their KV.
- **Burst**: users in a closed loop (each sends its next request when its previous one ends;
  32-token prompts, 96-192 output tokens): ``BASE`` of what stock's KV holds, ``PEAK`` from
  ``PHASES[0]`` to ``PHASES[1]`` (joining over ``RAMP_S`` seconds), then ``BASE`` again. A closed
  loop's KV demand is set by the requests' lengths, not by the machine's speed, so the same burst
  binds stock's KV and fits a group's on a fast machine and a slow one.
- **Systems**: ``vllm`` (stock engines behind the same front end), ``kunserve`` (cluster drop: the
  monitor merges the two engines into a pipeline group when demand nears their KV, and splits them
  when it falls) and ``oracle-equal`` (stock engines each given the KV a group reaches: the same
  memory from the start, no pipeline). Each engine runs one compute thread pinned to a core of its own.

``run_demo`` prints the regime, the table and a footer that reads it, draws the timeline, and returns
what it printed; ``benchmarks/demo_spread.py`` runs it several times in a row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SHAPE = {"layers": 48, "hidden": 256, "heads": 4, "kv_heads": 4, "intermediate": 768, "vocab": 2048}
WEIGHT_SHARE = 0.55
PROMPT, OUT_MIN, OUT_MAX = 32, 96, 192
BLOCK = 32
BASE, PEAK = 0.7, 1.45   # users before / during the burst, as a share of what stock's KV holds (the group: 1.61)
PHASES = (8.0, 26.0, 30.0)   # the burst from 8 s to 26 s (its users join over RAMP_S); requests for ~4 s after it
RAMP_S = 4
LIFE_S = 10.0   # a request's rough life (144 tokens at ~70 ms), only to size how many requests the users send
SYSTEMS = ("vllm", "kunserve", "oracle-equal")
KUNSERVE = {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 2.0, "min_decode_share": 0.5},
            "restore": {"threshold": 0.85, "hold_s": 2.0},   # of the base KV: the users after the burst (0.7) fit
            # the demo's prompts are 32 tokens: a grouped step starts at least two (the default 256, eight),
            # so fewer prompt tokens ride each grouped cycle's decodes
            "lookahead": {"step_min_tokens": 64}}
ENGINE_ENV = ("KUNSERVE_ENGINE_CPUS=0|1", "OMP_NUM_THREADS=1", "KUNSERVE_ENGINE_NICE=5")
TARGETS = {"ttft_p99": 0.3, "tpot_p50": 1.2}   # kunserve / stock at most (issue 71's bar for the demo)


def machine() -> dict[str, Any]:
    """The CPU by name and kind (what decides a CPU result), and how many cores this process may use."""
    from vllm_kunserve.bench.report import cpu_model
    from vllm_kunserve.runtime.cpuinfo import cpu_flags

    flags = cpu_flags()
    kind = ("AMX" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags
            else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2")
    return {"cpu": cpu_model(), "kind": kind, "cores": len(os.sched_getaffinity(0)), "threads_per_engine": 1}


def spec():
    from vllm_kunserve.tools.make_model import CheckpointSpec

    return CheckpointSpec(**SHAPE)


def kv_tokens_per_engine() -> int:
    """KV tokens that make each engine's weight share ``WEIGHT_SHARE``, in whole blocks."""
    s = spec()
    kv_bytes = s.weight_bytes() * (1 - WEIGHT_SHARE) / WEIGHT_SHARE
    return int(kv_bytes // (s.kv_bytes_per_token() * BLOCK)) * BLOCK


def footprint_tokens() -> tuple[float, float]:
    """(mean output length, time-weighted mean KV footprint of a request in tokens) over the length
    mix: a request of ``o`` outputs decodes ``o`` steps holding its prompt, half its output on
    average and half a block of rounding."""
    o = np.arange(OUT_MIN, OUT_MAX + 1, dtype=float)
    return float(o.mean()), float((o * (PROMPT + o / 2 + BLOCK / 2)).sum() / o.sum())


def group_factor() -> float:
    return 1 + WEIGHT_SHARE / (2 * (1 - WEIGHT_SHARE))


def users() -> dict[str, Any]:
    """The burst as users over time, a closed loop (each user sends its next request when its previous
    one ends): how much KV it holds then depends on the requests' lengths, not on the machine's speed.
    Stock's cluster holds ``capacity`` users' requests (KV tokens / the time-weighted footprint);
    ``BASE`` of that before and after the burst, ``PEAK`` during it."""
    _, foot = footprint_tokens()
    capacity = 2 * kv_tokens_per_engine() / foot
    base, peak = max(1, round(BASE * capacity)), round(PEAK * capacity)
    n = round(base * PHASES[0] / LIFE_S + peak * (PHASES[1] - PHASES[0]) / LIFE_S + base * (PHASES[2] - PHASES[1]) / LIFE_S)
    return {"capacity_users": round(capacity, 1), "base": base, "peak": peak, "requests": n,
            "schedule": ",".join([str(base)] + [f"{base + (peak - base) * (k + 1) // RAMP_S}@{PHASES[0] + k:g}"
                                                 for k in range(RAMP_S)] + [f"{base}@{PHASES[1]:g}"]),
            "prompt": PROMPT,
            "outputs": [OUT_MIN, OUT_MAX]}


def series(run_dir: Path, column: str, how=sum) -> tuple[np.ndarray, np.ndarray]:
    """(second, value) of one column of a run's timeline, combined over instances (``how``: sum, max)
    where it is per instance."""
    import csv

    rows = list(csv.DictReader((run_dir / "timeline.csv").open()))
    t = np.array([float(r["second"]) for r in rows])
    cols = [c for c in (rows[0].keys() if rows else ()) if c == column or c.startswith(column + "{")]

    def num(x):
        try:
            return float(x)
        except (TypeError, ValueError):
            return 0.0
    return t, np.array([how(num(r[c]) for c in cols) if cols else 0.0 for r in rows])


def plot(out: Path, facts: dict[str, Any]) -> Path | None:
    """The timeline picture: for each system, requests waiting and KV use per second; kunserve's grouped span."""
    from vllm_kunserve.bench.report import pyplot, save_figure

    plt = pyplot(optional=True)
    if plt is None:
        return None
    fig, ax = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    for name in SYSTEMS:
        d = out / name / "rep1"
        if not (d / "timeline.csv").exists():
            continue
        t, waiting = series(d, "waiting")
        ax[0].step(t, waiting, where="post", label=name)
        t, kv = series(d, "kv_usage", max)
        ax[1].plot(t, 100 * kv, label=name)
        t, running = series(d, "running")
        ax[2].plot(t, running, label=name)
    g = facts.get("kunserve", {}).get("grouped_s")
    for a in ax:
        if g:
            a.axvspan(g[0], g[1], color="tab:orange", alpha=0.12, lw=0)
    ax[0].set_ylabel("requests waiting")
    ax[1].set_ylabel("KV used, fuller engine\n(% of its own KV)")
    ax[2].set_ylabel("requests running")
    ax[2].set_xlabel("time since the first arrival (s); shaded: kunserve's engines grouped")
    ax[0].legend(fontsize=8)
    fig.suptitle("make demo: the same burst on three 2-engine clusters")
    path = out / "timeline.png"
    save_figure(fig, path)
    return path


def run_facts(run_dir: Path) -> dict[str, Any]:
    t, waiting = series(run_dir, "waiting")
    _, grouped = series(run_dir, "kunserve:grouped_instances")
    on = t[grouped > 0]
    return {"waiting_peak": float(waiting.max(initial=0)),
            "grouped_s": [float(on.min()), float(on.max())] if on.size else None}


def header(m: dict[str, Any], kv: int, u: dict[str, Any]) -> list[str]:
    s = spec()
    return [
        f"machine: {m['cpu']} ({m['kind']}), {m['cores']} cores; each engine one compute thread on a core of its own",
        f"model: random-weight Llama, {s.layers} layers x hidden {s.hidden}, fp32, {s.weight_bytes() / 1e6:.0f} MB; "
        f"KV per engine {kv} tokens ({kv * s.kv_bytes_per_token() / 1e6:.0f} MB): weight share "
        f"{WEIGHT_SHARE:.2f}, so a 2-engine group holds {group_factor():.2f}x the KV",
        f"the burst: users in a closed loop (each sends its next request when its previous one ends; prompt "
        f"{PROMPT}, output {OUT_MIN}-{OUT_MAX} tokens): {u['base']} users, {u['peak']} from {PHASES[0]:.0f} s to "
        f"{PHASES[1]:.0f} s, then {u['base']} again, {u['requests']} requests in all. Stock's KV holds about "
        f"{u['capacity_users']:.0f} users' requests, the group's {group_factor() * u['capacity_users']:.0f}: the burst "
        "needs more KV than stock has and less than a group has, whatever the machine's speed",
    ]


def footer(res: dict[str, Any], facts: dict[str, dict]) -> list[str]:
    agg = res["aggregate"]

    def v(system: str, key: str) -> float | None:
        return agg.get(system, {}).get(key, {}).get("mean")

    def r(system: str, key: str) -> float | None:
        return agg.get(system, {}).get(key, {}).get("ratio")

    lines = ["", "How to read it: each column is a 2-engine cluster behind one `kunserve serve` front end under "
             "the same burst; (0.10x) is that system's value / stock's."]
    sv, kv_ = facts.get("vllm", {}), facts.get("kunserve", {})
    if v("vllm", "ttft_p99") is not None and v("kunserve", "ttft_p99") is not None:
        lines.append(f"- TTFT P99: stock {v('vllm', 'ttft_p99'):.2f} s, kunserve {v('kunserve', 'ttft_p99'):.2f} s "
                     f"({r('kunserve', 'ttft_p99'):.2f}x). Stock's KV filled and up to {sv.get('waiting_peak', 0):.0f} "
                     "requests waited for a running one to finish; kunserve's monitor grouped the two engines "
                     + (f"at {kv_['grouped_s'][0]:.0f} s (until {kv_['grouped_s'][1]:.0f} s)" if kv_.get("grouped_s")
                        else "(it did not group this time)")
                     + f" and at most {kv_.get('waiting_peak', 0):.0f} waited.")
    if v("kunserve", "tpot_p50") is not None:
        lines.append(f"- TPOT P50: stock {1e3 * v('vllm', 'tpot_p50'):.0f} ms, kunserve "
                     f"{1e3 * v('kunserve', 'tpot_p50'):.0f} ms ({r('kunserve', 'tpot_p50'):.2f}x): a grouped engine "
                     "runs half the layers for twice the requests, in a pipeline, at a bigger batch.")
    if v("oracle-equal", "ttft_p99") is not None:
        lines.append(f"- oracle-equal (stock engines given the group's memory from the start, no pipeline): TTFT P99 "
                     f"{v('oracle-equal', 'ttft_p99'):.2f} s ({r('oracle-equal', 'ttft_p99'):.2f}x), TPOT P50 "
                     f"{r('oracle-equal', 'tpot_p50'):.2f}x: what the same memory buys without moving anything; its "
                     "TPOT says what a bigger batch costs on this machine.")
    if v("kunserve", "e2e_p99") is not None:
        lines.append(f"- E2E P99: stock {v('vllm', 'e2e_p99'):.1f} s, kunserve {v('kunserve', 'e2e_p99'):.1f} s "
                     f"({r('kunserve', 'e2e_p99'):.2f}x); output tokens/s {r('kunserve', 'output_tokens_per_s'):.2f}x "
                     "stock's: the same requests finish, what changes is who waits before the first token.")
    lines.append("One repetition on this machine; benchmarks/demo_spread.py runs it three times "
                 "(docs/benchmarks/demo_spread.md).")
    return lines


def run_demo(model: Path, out: Path, seed: int = 1, log=print) -> dict[str, Any]:
    """Probe, print the regime, run the comparison, print the table, footer and timeline; return the facts."""
    from vllm_kunserve.bench.report import write_json
    from vllm_kunserve.cli.main import main as kunserve
    from vllm_kunserve.tools.make_model import build_model

    t0 = time.monotonic()
    m = machine()
    if m["cores"] < 2:
        raise RuntimeError(f"the demo pins its two engines to two cores; this process may use {m['cores']}")
    if not (model / "config.json").exists():
        log(f"making the demo model in {model} ...")
        build_model(model, spec())
    kv = kv_tokens_per_engine()
    u = users()
    for line in header(m, kv, u):
        log(line)
    argv = ["compare", "--model", str(model), "--instances", "2", "--dispatch", "least-work",
            "--systems", ",".join(SYSTEMS), "--oracle-equal-kv-multiplier", f"{group_factor():g}",
            "--repeat", "1", "--order", "fixed", "--kunserve-config", json.dumps(KUNSERVE),
            "--kv-capacity-tokens", str(kv), "--block-size", str(BLOCK), "--max-model-len", str(PROMPT + OUT_MAX + BLOCK),
            "--engine-arg=--enforce-eager", "--engine-arg=--stream-interval=8",
            *[x for e in ENGINE_ENV for x in ("--env", e)],
            "--format", "poisson", "--num-requests", str(u["requests"]), "--rate", "1000",
            "--max-concurrency", u["schedule"],
            "--synthetic-lengths", "--prompt-len", str(PROMPT), "--output-len", str(OUT_MIN),
            "--output-len-max", str(OUT_MAX), "--seed", str(seed), "--no-progress", "--out", str(out)]
    log("running: kunserve " + " ".join(argv))
    if kunserve(argv) != 0:
        raise RuntimeError("kunserve compare failed (its output is above)")
    res = json.loads((out / "compare.json").read_text())
    facts = {name: run_facts(out / name / "rep1") for name in SYSTEMS}
    picture = plot(out, facts)
    for line in footer(res, facts):
        log(line)
    ratios = {name: {k: res["aggregate"][name][k]["ratio"] for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
                                                                    "e2e_p99")} for name in SYSTEMS}
    absolute = {name: {k: res["aggregate"][name][k]["mean"] for k in ("ttft_p99", "tpot_p50", "e2e_p99")}
                for name in SYSTEMS}
    met = {k: ratios["kunserve"][k] is not None and ratios["kunserve"][k] <= bar for k, bar in TARGETS.items()}
    summary = {"machine": m, "model": SHAPE, "weight_share": WEIGHT_SHARE, "kv_tokens_per_engine": kv,
               "burst": u, "kunserve_config": KUNSERVE, "facts": facts, "ratios": ratios, "absolute": absolute,
               "targets": TARGETS, "met": met, "wall_s": round(time.monotonic() - t0, 1)}
    write_json(out / "demo.json", summary)
    log(f"timeline picture: {picture}" if picture else "no timeline picture (matplotlib missing)")
    log(f"wrote {out / 'demo.json'}; demo took {summary['wall_s']:.0f} s")
    return summary


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="one burst on three 2-engine clusters (stock, kunserve, oracle-equal), side by side",
                       description=__doc__.split("\n\n")[0].replace("``", "`"))
    p.add_argument("--model", default="models/demo-48x256", help="the demo model's directory (built there if missing)")
    p.add_argument("--out", default="runs/demo", help="output directory (compare.json, demo.json, timeline.png, runs)")
    p.add_argument("--seed", type=int, default=1, help="the requests' lengths and prompts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        run_demo(Path(args.model), Path(args.out), seed=args.seed)
    except RuntimeError as e:
        print(f"kunserve demo: {e}", file=sys.stderr)
        return 1
    return 0
