"""An elastic fleet against fixed ones, on a slow rise and fall of load (issue 74, item 2).

    python -m benchmarks.elastic [--repeat 2] [--phase-s 60] [--sim-only]

**Real engines** (``kunserve compare --derive``): `make demo`'s model and memory (48 thin layers, fp32,
weights 0.55 of each engine's memory), each engine one compute thread pinned to a core of its own.
Arrivals: the Azure 2023 conversation trace's (CC BY 4.0), re-timed (``--phases``) into equal phases of
``--phase-s`` seconds at ``LEVELS`` times the arrival rate whose requests one engine's KV would hold (its
KV tokens over a request's time-weighted footprint, over the demo's rough request life of 10 s): a slow
rise and fall. A request lives longer than that on these CPUs (a first run at twice these levels asked
for about one engine's KV at 0.3x and preempted on two engines at its peak), so the lowest level fits one
engine and the peak needs two. Prompts of 32 tokens, outputs 96-192. Systems (stock engines behind ``kunserve serve``,
shuffled per repetition): ``fixed-min`` (1 engine), ``fixed-max`` (2 engines) and ``elastic`` (``--instances 1
--max-instances 2`` with ``ELASTIC``). Instance-seconds are the front end's
``kunserve:fleet_engines{state="held"}`` summed over the per-second timeline (the same series for
every system), from the first arrival to the last request's end.

**Simulator at paper scale** (``vllm_kunserve/sim``, H100 step costs fitted to Vidur's profiles):
llama2-7b, up to ``SIM_MAX`` instances, the same trace re-timed into the same shape over ``SIM_PHASE_S``
seconds a phase at rates relative to what one instance's KV holds; ``fixed-min``, ``fixed-max`` and
``elastic`` from ``SIM_MIN`` instances, each engine's start taking ``SIM_STARTUP_S`` (the elastic
policy there runs ``policy.elastic``, the code the front end runs).

Per system: P50 / P99 TTFT (bootstrap 95% interval over requests), P50 TPOT, P99 end-to-end latency,
instance-seconds, and the fleet's size over time. Writes ``docs/benchmarks/elastic.{md,json,png}``;
raw data ``docs/benchmarks/runs/elastic_<machine>.tar.xz``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import pooled, raw
from benchmarks.common.stats import fmt_interval, fmt_num
from vllm_kunserve.bench.report import REPO, command, md_table, pyplot, save_figure, write_json

PAGE = REPO / "docs" / "benchmarks" / "elastic"
SYSTEMS = ("fixed-min", "fixed-max", "elastic")
LEVELS = (0.15, 0.3, 0.45, 0.65, 0.65, 0.45, 0.3, 0.15)   # x the nominal rate one engine KV holds, a phase each
# the defaults (config.ElasticConfig) but the forecast's horizon: an engine's start on these CPUs, ~23 s
ELASTIC = {"forecast_horizon_s": 20.0}
HELD = "kunserve:fleet_engines{state=held}"
SIM_MODEL, SIM_MIN, SIM_MAX, SIM_PHASE_S, SIM_STARTUP_S = "llama2-7b", 1, 4, 60.0, 30.0
TRACE = REPO.parent / "shared" / "data" / "traces" / "azure_llm_2023_conv.csv"


def phases(per_s: float, phase_s: float) -> str:
    return ",".join(f"{phase_s:g}@{x * per_s:.3f}" for x in LEVELS)


def derive() -> dict[str, dict]:
    return {"fixed-min": {"from": "vllm", "description": "1 stock engine behind kunserve serve"},
            "fixed-max": {"from": "vllm", "serve_args": ["--instances", "2"],
                          "description": "2 stock engines behind kunserve serve"},
            "elastic": {"from": "vllm", "serve_args": ["--max-instances", "2", "--elastic", json.dumps(ELASTIC)],
                        "description": f"1 to 2 stock engines behind kunserve serve --elastic '{json.dumps(ELASTIC)}'"}}


def plan(a: argparse.Namespace) -> dict:
    """What a real-engine run measures under (its page's ``meta``): the KV, the nominal rate, the phases."""
    from vllm_kunserve.cli import demo

    kv = demo.kv_tokens_per_engine()
    _, foot = demo.footprint_tokens()
    per_s = kv / foot / demo.LIFE_S   # arrivals per second whose requests one engine's KV holds
    return {"phases": phases(per_s, a.phase_s), "levels": LEVELS, "phase_s": a.phase_s, "repeat": a.repeat,
            "kv_tokens_per_engine": kv, "holdable_rate": per_s, "elastic": ELASTIC, "machine": demo.machine(),
            "weight_share": demo.WEIGHT_SHARE}


def measure(a: argparse.Namespace, out: Path) -> dict:
    from vllm_kunserve.cli import demo
    from vllm_kunserve.cli.main import main as kunserve
    from vllm_kunserve.tools.make_model import build_model

    model = REPO / "models" / "demo-48x256"
    if not (model / "config.json").exists():
        build_model(model, demo.spec())
    meta = plan(a)
    kv, ph = meta["kv_tokens_per_engine"], meta["phases"]
    argv = ["compare", "--model", str(model), "--instances", "1", "--dispatch", "least-work",
            "--systems", ",".join(SYSTEMS), "--repeat", str(a.repeat), "--order", "shuffled", "--resume",
            "--kv-capacity-tokens", str(kv), "--block-size", str(demo.BLOCK),
            "--max-model-len", str(demo.PROMPT + demo.OUT_MAX + demo.BLOCK),
            "--engine-arg=--enforce-eager", "--engine-arg=--stream-interval=8",
            *[x for e in demo.ENGINE_ENV for x in ("--env", e)],
            "--trace", str(TRACE), "--format", "azure", "--phases", ph, "--synthetic-lengths",
            "--prompt-len", str(demo.PROMPT), "--output-len", str(demo.OUT_MIN), "--output-len-max", str(demo.OUT_MAX),
            "--seed", str(a.seed), "--no-progress", "--client-realtime", "--out", str(out),
            *(f"--derive={n}={json.dumps(d)}" for n, d in derive().items())]
    print("running: kunserve " + " ".join(argv), flush=True)
    if kunserve(argv) != 0:
        raise SystemExit("kunserve compare failed (its output is above)")
    return meta


def held_of(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(second, engines held) of one run: the front end's ``kunserve:fleet_engines{state="held"}``."""
    from vllm_kunserve.cli.demo import series

    return series(run_dir, HELD)


def changes(t: np.ndarray, held: np.ndarray) -> list[list[float]]:
    """[second, engines held] wherever the count changed (the first row included)."""
    return [[float(t[i]), float(held[i])] for i in range(len(t)) if i == 0 or held[i] != held[i - 1]]


def analyse(folder: Path) -> dict:
    compare = json.loads((folder / "compare.json").read_text())
    out = {}
    for s in SYSTEMS:
        files = pooled.request_files(folder, s)
        reqs = [r for k, f in files for r in pooled.read_window(f, k, 0.0, 1e9)]
        done = [r for r in reqs if r.ok]
        inst, spans, steps = [], [], []
        for k, f in files:   # per repetition: engines held from the first arrival to the last request's end
            t, held = held_of(f.parent)
            end = max((r.arrival_s + r.e2e_s for r in done if r.rep == k), default=0.0)
            inside = (t >= 0) & (t <= end)
            dt = np.diff(t, append=t[-1] + 1) if t.size else t
            inst.append(float((held[inside] * dt[inside]).sum()))
            spans.append(end)
            steps.append(changes(t[inside], held[inside]))
        out[s] = {"requests": len(reqs), "completed": len(done),
                  "preemptions": sum(x.get("preemptions") or 0 for x in compare["runs"][s]),
                  "ttft_p50": pooled.tail(done)["p50"], "ttft_p99": pooled.tail(done)["p99"],
                  "tpot_p50": pooled.tpot(done)["p50"],
                  "e2e_p99": pooled.point(pooled.by_rep(done, pooled.METRIC["e2e"]), 99) if done else None,
                  "instance_s": float(np.mean(inst)), "instance_s_reps": inst, "span_s": spans, "held": steps,
                  "description": next((x["description"] for x in compare["systems"] if x["name"] == s), "")}
    return out


def simulate() -> dict:
    """The same shape at paper scale in the simulator (see the module's text)."""
    from vllm_kunserve.bench.workload import WorkloadOptions, build_trace
    from vllm_kunserve.config import parse_elastic
    from vllm_kunserve.sim.policies.elastic import ElasticPolicy
    from vllm_kunserve.sim.runner import build_config
    from vllm_kunserve.sim.runner import simulate as sim_run
    from vllm_kunserve.sim.trace import from_trace

    cfg1 = build_config(SIM_MODEL, "h100", instances=1)
    base = build_trace(WorkloadOptions(format="azure", trace=str(TRACE), max_total_len=4096))[0]
    foot = float(np.mean(base.prompt_len + base.output_len / 2))
    life = float(np.mean(base.output_len)) * 0.03   # ~30 ms a decode step at a loaded batch
    per_s = cfg1.base_kv_blocks() * cfg1.block_size / foot / life
    ph = ",".join(f"{SIM_PHASE_S:g}@{x * per_s * SIM_MAX / 2:.3f}" for x in LEVELS)
    trace = from_trace(build_trace(WorkloadOptions(format="azure", trace=str(TRACE), max_total_len=4096, phases=ph))[0])
    ecfg = parse_elastic({**ELASTIC, "forecast_horizon_s": SIM_STARTUP_S})
    out = {"model": SIM_MODEL, "phases": ph, "startup_s": SIM_STARTUP_S, "requests": len(trace), "systems": {}}
    for name, (n, start, lo) in {"fixed-min": (SIM_MIN, SIM_MIN, SIM_MIN), "fixed-max": (SIM_MAX, SIM_MAX, SIM_MAX),
                                 "elastic": (SIM_MAX, SIM_MIN, SIM_MIN)}.items():
        pol = ElasticPolicy(start, lo, ecfg, startup_s=SIM_STARTUP_S)
        res = sim_run(build_config(SIM_MODEL, "h100", instances=n), pol, trace, keep_requests=False)
        s = res["summary"]
        out["systems"][name] = {"instances": [lo, n], "instance_s": pol.instance_seconds,
                                "ttft_p50": s["ttft_s"]["p50"], "ttft_p99": s["ttft_s"]["p99"],
                                "tpot_p50": s["tpot_s"]["p50"], "e2e_p99": s["latency_s"]["p99"],
                                "completed": s["completed"], "held": pol.held[::20]}
    return out


def plot(path: Path, an: dict, sim: dict) -> bool:
    plt = pyplot(optional=True)
    if plt is None:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(12, 3.8))
    for s in SYSTEMS:
        if an and s in an and an[s]["held"]:
            for k, steps in enumerate(an[s]["held"]):
                h = np.array(steps + [[an[s]["span_s"][k], steps[-1][1]]])
                ax[0].step(h[:, 0], h[:, 1] + 0.03 * SYSTEMS.index(s), where="post", color=f"C{SYSTEMS.index(s)}",
                           alpha=0.8, label=None if k else f"{s}: P99 TTFT {an[s]['ttft_p99']['value']:.1f} s, "
                           f"{an[s]['instance_s']:.0f} instance-s")
        h = np.array(sim["systems"][s]["held"])
        ax[1].step(h[:, 0], h[:, 1], where="post", label=f"{s}: P99 TTFT {sim['systems'][s]['ttft_p99']:.1f} s, "
                   f"{sim['systems'][s]['instance_s']:.0f} instance-s")
    ax[0].set_title("real engines (this CPU): engines held", fontsize=10)
    ax[1].set_title(f"simulator, {sim['model']} on H100s: instances held", fontsize=10)
    for a_ in ax:
        a_.set_xlabel("seconds since the first arrival")
        a_.legend(fontsize=7)
    save_figure(fig, path)
    return True


def render(an: dict, meta: dict, sim: dict, cmd: str, name: str) -> str:
    L = ["# An elastic fleet against fixed ones, on a slow rise and fall (written by benchmarks/elastic.py)", "",
         f"Command: `{cmd}`. Raw data: `docs/benchmarks/runs/{name}{raw.SUFFIX}`.", "",
         f"![engines held over time]({PAGE.name}.png)", ""]
    if an:
        m = meta["machine"]
        L += [f"**Real engines.** Machine: {m['cpu']} ({m['kind']}), {m['cores']} cores, each engine one compute "
              f"thread on its own core. Model and memory: `make demo`'s (48 thin layers, fp32, weights "
              f"{meta['weight_share']:.2f} of each engine's memory; {meta['kv_tokens_per_engine']} KV tokens an engine). "
              f"Arrivals: the Azure 2023 conversation trace's, re-timed into `{meta['phases']}` (s@req/s): "
              f"{', '.join(f'{x:g}' for x in meta['levels'])}x the rate whose requests one engine's KV holds "
              f"({meta['holdable_rate']:.2f} req/s); prompts 32 tokens, outputs 96-192. {meta['repeat']} repetition(s), systems "
              "shuffled; intervals are over the pooled requests. Instance-seconds (mean of the repetitions): the front end's "
              "`kunserve:fleet_engines{state=\"held\"}` over the run (the same series for every system)."
              + (f" Measured at {meta['measured_at']}." if meta.get("measured_at") else ""), ""]
        L += md_table(["system", "completed", "preemptions", "P50 TTFT (s)", "P99 TTFT (s, 95%)", "P50 TPOT (ms)",
                       "P99 E2E (s)", "instance-s", "vs fixed-max"], "lrrrlrrrr",
                      ([s, f"{a['completed']}/{a['requests']}", f"{a['preemptions']:g}", f"{a['ttft_p50']['value']:.2f}",
                        fmt_interval(a["ttft_p99"]), "-" if a["tpot_p50"] is None else f"{a['tpot_p50'] * 1e3:.0f}",
                        "-" if a["e2e_p99"] is None else f"{a['e2e_p99']:.1f}", f"{a['instance_s']:.0f}",
                        f"{a['instance_s'] / max(an['fixed-max']['instance_s'], 1e-9):.2f}x"] for s, a in an.items()))
        steps = "; ".join(f"repetition {k + 1}: " + ", ".join(f"{n:g} at {t:.0f} s" for t, n in h)
                          for k, h in enumerate(an["elastic"]["held"]))
        L += ["", "Systems:", "", *(f"- `{s}`: {an[s]['description']}" for s in SYSTEMS), "",
              f"The elastic fleet's engines held (count at second, from the timeline): {steps}.", ""]
    s = sim["systems"]
    L += [f"**Simulator at paper scale.** {sim['model']} on H100s (Vidur-fitted step costs), {SIM_MIN} to "
          f"{SIM_MAX} instances, an engine's start {sim['startup_s']:g} s (assumed; the elastic policy's forecast "
          f"horizon is set to it), {sim['requests']} requests of the Azure trace re-timed into `{sim['phases']}`.", ""]
    L += md_table(["system", "instances", "P50 TTFT (s)", "P99 TTFT (s)", "P50 TPOT (ms)", "P99 E2E (s)", "instance-s",
                   "vs fixed-max"], "llrrrrrr",
                  ([k, f"{v['instances'][0]}-{v['instances'][1]}", f"{v['ttft_p50']:.2f}", f"{v['ttft_p99']:.2f}",
                    f"{v['tpot_p50'] * 1e3:.0f}", f"{v['e2e_p99']:.1f}", f"{v['instance_s']:.0f}",
                    f"{v['instance_s'] / s['fixed-max']['instance_s']:.2f}x"] for k, v in s.items()))
    if an:
        v = verdict(an)
        L += ["", f"Rule (fixed before the runs): {RULE}. Applied: saves **{'yes' if v['saves'] else 'no'}** "
              f"({v['instance_s_ratio']:.2f}x the instance-seconds), keeps the tail **{'yes' if v['keeps_tail'] else 'no'}**, "
              f"beats the fixed minimum **{'yes' if v['beats_min'] else 'no'}**."]
    L += ["", "Reading: " + reading(an, sim), ""]
    return "\n".join(L) + "\n"


RULE = ("the elastic fleet saves where its instance-seconds are below the fixed maximum's in every repetition; "
        "it keeps the tail where its P99 TTFT interval reaches the fixed maximum's point estimate, and it beats "
        "the fixed minimum where its interval lies below that one's")


def verdict(an: dict) -> dict:
    """The page's rule (``RULE``, fixed before the runs) applied to the real engines' analysis."""
    e, mx, mn = an["elastic"], an["fixed-max"], an["fixed-min"]
    saves = all(a < b for a, b in zip(e["instance_s_reps"], mx["instance_s_reps"]))
    keeps = e["ttft_p99"]["lo"] is not None and e["ttft_p99"]["lo"] <= (mx["ttft_p99"]["value"] or 0.0)
    beats = (e["ttft_p99"]["hi"] is not None and mn["ttft_p99"]["lo"] is not None
             and e["ttft_p99"]["hi"] < mn["ttft_p99"]["lo"])
    return {"saves": saves, "keeps_tail": keeps, "beats_min": beats,
            "instance_s_ratio": e["instance_s"] / max(mx["instance_s"], 1e-9)}


def reading(an: dict, sim: dict) -> str:
    s = sim["systems"]
    out = (f"in the simulator the elastic fleet held {s['elastic']['instance_s'] / s['fixed-max']['instance_s']:.2f}x "
           f"the instance-seconds of the fixed maximum with a P99 TTFT of {s['elastic']['ttft_p99']:.2f} s against "
           f"{s['fixed-max']['ttft_p99']:.2f} s (fixed maximum) and {s['fixed-min']['ttft_p99']:.1f} s (fixed minimum): "
           "what it loses at the rise is the engines' start, which the forecast only partly hides.")
    if an:
        e, mx, mn = an["elastic"], an["fixed-max"], an["fixed-min"]
        ups = [next((t for t, n in h if n > h[0][1]), None) for h in e["held"]]
        drained = any(any(b[1] < a[1] for a, b in zip(h, h[1:])) for h in e["held"])
        out = (f"on the real engines the elastic fleet held {e['instance_s'] / mx['instance_s']:.2f}x the fixed "
               f"maximum's instance-seconds, P99 TTFT {fmt_num(e['ttft_p99']['value'])} s against {fmt_num(mx['ttft_p99']['value'])} s "
               f"(fixed maximum) and {fmt_num(mn['ttft_p99']['value'])} s (fixed minimum). It started its second engine at "
               + " and ".join("-" if t is None else f"{t:.0f} s" for t in ups)
               + (" and drained it as the load fell. " if drained else
                  " and kept it to the end: in the falling phases the demand never stayed at or below "
                  f"{ELASTIC.get('down_ratio', 0.6):g} of one engine (the default) for the default 30 s hold before "
                  "the last request ended, so the saving is the rise's alone (draining is shown by the simulator "
                  "below and tested on real engines, tests/vllm/test_serve_defaults.py). ")
               + "In the simulator " + out[len("in the simulator "):])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="repetitions on the real engines, systems shuffled in each")
    ap.add_argument("--phase-s", type=float, default=60.0, help="seconds of each load level on the real engines")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "runs" / "elastic"))
    ap.add_argument("--sim-only", action="store_true", help="only the simulator (the page keeps no real-engine rows)")
    ap.add_argument("--render", action="store_true", help="only the page, from the runs in --out")
    a = ap.parse_args(argv)
    if not a.phase_s > 0 or a.repeat < 1:
        ap.error("--phase-s > 0 and --repeat >= 1")
    out = Path(a.out)
    if a.render:   # the page's own description and command where it has them; else this command's plan
        page = json.loads(PAGE.with_suffix(".json").read_text()) if PAGE.with_suffix(".json").exists() else {}
        if page.get("meta"):
            meta, argv = page["meta"], shlex.split(page["command"].split("benchmarks.elastic", 1)[-1])
        else:
            meta = plan(a)
            argv = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--render"]
    else:
        meta = {} if a.sim_only else measure(a, out)
    an = {} if a.sim_only or not meta else analyse(out)
    sim = simulate()
    from benchmarks.load_curve import machine_slug

    name = f"elastic_{machine_slug()}"
    if an:
        with tempfile.TemporaryDirectory() as tmp:
            from benchmarks.burst_value import copy_raw

            copy_raw(out, Path(tmp), list(SYSTEMS), meta["repeat"])
            raw.pack(Path(tmp), name, {"meta": meta, "analysis": an})
    cmd = command("elastic.py", argv if argv is not None else sys.argv[1:])
    plot(PAGE.with_suffix(".png"), an, sim)
    write_json(PAGE.with_suffix(".json"), {"command": cmd, "meta": meta, "analysis": an, "sim": sim}, clean=False,
               default=str)
    PAGE.with_suffix(".md").write_text(render(an, meta, sim, cmd, name))
    print(PAGE.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
