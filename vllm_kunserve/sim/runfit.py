"""The simulator fitted to a measured harness run (``kunserve compare`` output, as
``benchmarks/burst_value.py`` writes it), for ``benchmarks/burst_value_sim.py``:

* step times from the run itself: decode lines (``step = a + c * batch``) fitted to a timeline's
  "clean" seconds (:func:`clean_seconds`, :func:`fit_steps`; a pipeline group's seconds get their own
  line, the group's cycle), and the prefill rate from the warm-phase requests that had an engine to
  themselves (:func:`prefill_samples`);
* :func:`calibrate`: one factor on the decode lines, found where the simulated median TPOT of the
  runs they come from equals the measured one (the clean seconds are a biased sample of the steps);
* :func:`make_sim`: the simulator set up as the run's cluster (:class:`RunSimulator`: a group
  member's KV capped at ``memory.max_kv_ratio`` x its base, the group's measured cycle for its
  steps) running each harness system as a simulator policy, and :func:`predict` over a burst window.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from vllm_kunserve.config import parse_config
from vllm_kunserve.policy.transfer import Link
from vllm_kunserve.workload.models import load_model_spec
from vllm_kunserve.workload.records import read_csv
from vllm_kunserve.workload.stats import percentile

from .engine import SimConfig, Simulator
from .harness import prompt_of
from .hardware import get_gpu
from .policies import build_policy
from .steptime import MeasuredStepTime, fit_decode_line
from .trace import TraceRequest

#: the harness systems :func:`make_sim` simulates (besides a run's ``--variant`` kunserve systems)
SYSTEMS = ("vllm", "kunserve", "static", "oracle")

FULL_LAYERS = 12  # layers_held of an engine holding the whole model (decode-bf16: 12 layers)
#: vLLM 0.32's defaults for `vllm serve` on the CPU platform (engine/arg_utils.py get_batch_defaults:
#: OPENAI_API_SERVER 2048 x world size tokens and 128 x world size sequences; world size 1 here),
#: used where the run's logs do not print them (its engine logs do not)
VLLM_CPU_DEFAULTS = {"max_num_batched_tokens": 2048, "max_num_seqs": 128}
MIN_SECONDS = 5      # clean seconds a step line needs (else: the other line / the table)
MIN_PREFILL = 5      # warm requests a system's prefill rate needs (else: the run's pooled estimate)


def fnum(x, default=None):
    try:
        return float(x) if x not in (None, "") else default
    except ValueError:
        return default


def argv_opt(argv: list[str], flag: str):
    for i, x in enumerate(argv):
        if x == flag and i + 1 < len(argv):
            return argv[i + 1]
        if x.startswith(flag + "="):
            return x.split("=", 1)[1]
    return None


def rep_data(rep_dir: Path, lo: float, instances: int) -> dict:
    """One repetition's requests and timeline (either gzipped), clean seconds, step lines and the
    prefill samples of its warm-phase requests (arrivals before ``lo``)."""
    tl = read_csv(rep_dir / "timeline.csv")
    rows = read_csv(rep_dir / "requests.csv")
    secs = clean_seconds(tl, instances)
    fits = {g: fit_steps(v) for g, v in secs.items()}
    return {"dir": rep_dir, "tl": tl, "rows": rows, "secs": secs, "fits": fits,
            "pf": prefill_samples(rows, lo, tl, instances, fits)}


def grouped_flags(tl: list[dict]) -> list[bool | None]:
    """Per timeline second: every engine holds fewer than all layers (a pipeline group), None if unknown."""
    cols = [c for c in (tl[0] if tl else {}) if c.startswith("kunserve:layers_held{")]
    out = []
    for r in tl:
        v = [fnum(r[c]) for c in cols]
        v = [x for x in v if x is not None]
        out.append((all(x < FULL_LAYERS for x in v)) if v else (None if cols else False))
    return out


def clean_seconds(tl: list[dict], instances: int) -> dict[str, list[dict]]:
    """The timeline's decode-only seconds by grouping state ("single" / "grouped"): in the second and
    the one before, no arrival, no new preemption (a recompute), the same grouping, and nothing
    waiting or no completion (a finish admits a waiting request: a prefill); at least one request
    running. Each: running, output tokens, batch = max(1, running / engines)."""
    g = grouped_flags(tl)
    out: dict[str, list[dict]] = {"single": [], "grouped": []}
    for i in range(1, len(tl)):
        r, p = tl[i], tl[i - 1]
        run, tok = fnum(r.get("running")), fnum(r.get("output_tokens"))
        if run is None or tok is None or run < 1 or g[i] is None or g[i] != g[i - 1]:
            continue
        if fnum(r.get("arrivals"), 0) or fnum(p.get("arrivals"), 0):
            continue
        waiting = fnum(r.get("waiting"), 0) or fnum(p.get("waiting"), 0)
        if waiting and (fnum(r.get("completions"), 0) or fnum(p.get("completions"), 0)):
            continue  # a finish frees KV and a waiting request is prefilled
        if fnum(r.get("preemptions"), 0) != fnum(p.get("preemptions"), 0):
            continue
        out["grouped" if g[i] else "single"].append(
            {"second": float(r["second"]), "running": run, "tokens": tok, "batch": max(1.0, run / instances)})
    return out


def fit_steps(secs: list[dict], chunk: int = 5) -> dict | None:
    """Fit a line to the clean seconds pooled in runs of up to ``chunk`` consecutive seconds (step =
    sum of running / sum of output tokens over the run, at its mean batch): the client counts a token
    in the second it arrives, and a front end that pauses delivers a second's tokens in the next, so
    one second alone can read 0 tokens or twice its share; a run of seconds keeps the sum."""
    if len(secs) < MIN_SECONDS:
        return None
    runs, cur = [], []
    for s in secs:
        if cur and (s["second"] != cur[-1]["second"] + 1 or len(cur) >= chunk):
            runs.append(cur)
            cur = []
        cur.append(s)
    if cur:
        runs.append(cur)
    pts = [(sum(s["batch"] for s in r) / len(r), sum(s["running"] for s in r) / sum(s["tokens"] for s in r), len(r))
           for r in runs if sum(s["tokens"] for s in r) > 0]
    if len(pts) < 2:
        return None
    a, c = fit_decode_line(pts)
    return {"a_s": a, "c_s": c, "seconds": len(secs), "runs": len(pts),
            "batch_range": [round(min(p[0] for p in pts), 1), round(max(p[0] for p in pts), 1)],
            "points": sorted([round(b, 2), round(s * 1e3, 1), n] for b, s, n in pts)}


def pooled_fits(data: dict, system: str, leave_out: int | None = None) -> tuple[dict, list[float]]:
    """Step lines and warm prefill samples of ``system``'s repetitions in ``data`` (``(system, k) ->``
    :func:`rep_data`), pooled, but for repetition ``leave_out`` (held out: a prediction for it then uses
    nothing measured in it). Each repetition's seconds are kept apart, so runs of consecutive seconds
    never join two repetitions."""
    ks = sorted(k for s, k in data if s == system and k != leave_out)
    fits = {g: fit_steps([{**x, "second": x["second"] + 1e6 * i} for i, k in enumerate(ks)
                          for x in data[(system, k)]["secs"][g]]) for g in ("single", "grouped")}
    return fits, [x for k in ks for x in data[(system, k)]["pf"]]


def prefill_samples(rows: list[dict], lo: float, tl: list[dict], instances: int, fits: dict) -> list[float]:
    """Seconds per prompt token of the warm-phase requests whose send-to-first-token overlapped no
    other request's: ``(TTFT - 1.5 x step(b)) / prompt``, ``(TTFT - a) / prompt`` on an idle engine."""
    g = grouped_flags(tl)

    def state(t):
        i = int(t)
        return g[i] if 0 <= i < len(g) else None
    iv = []
    for r in rows:
        if r["ok"] != "1" or not r["ttft_s"]:
            continue
        s = float(r["send_s"])
        iv.append((s, s + float(r["ttft_s"]), s + float(r["e2e_s"]), float(r["arrival_s"]),
                   prompt_of(r)))
    out = []
    for i, (s, f, e, arr, p) in enumerate(iv):
        if arr >= lo:
            continue
        if any(j != i and s_j < f and f_j > s for j, (s_j, f_j, *_rest) in enumerate(iv)):
            continue  # another prefill in flight: its step may carry two prompts
        gs, gf = state(s), state(f)
        if gs is None or gs != gf:
            continue
        n = sum(1 for j, (s_j, _, e_j, *_r) in enumerate(iv) if j != i and s_j <= s < e_j)
        fit = fits.get("grouped" if gs else "single")
        if fit is None:
            continue
        b = n / instances if gs else n // instances
        # the step in flight (half of it on average), then the step carrying the prompt; an idle
        # engine: one step of the prompt alone, which pays the line's fixed part
        busy = gs or b >= 1
        wait = 1.5 * (fit["a_s"] + fit["c_s"] * max(1.0, b)) if busy else fit["a_s"]
        out.append((f - s - wait) / p)
    return out


class RunSimulator(Simulator):
    """The simulator as a measured run's cluster: a group member's KV grows to at most ``kv_ratio`` x
    its base (the engine plans its KV at that size); a group's steps take the group's measured step
    line ``group_step_time`` (None: the config's step time)."""

    def __init__(self, cfg, policy, trace, kv_ratio: float, group_step_time=None):
        self.kv_ratio, self.group_step_time = kv_ratio, group_step_time
        super().__init__(cfg, policy, trace)

    def capacity_blocks(self, instances, layers=None):
        return min(super().capacity_blocks(instances, layers), int(len(instances) * self.kv_ratio * self.base_blocks))

    def new_server(self, instances):
        s = super().new_server(instances)
        if len(instances) > 1 and self.group_step_time is not None:
            s.step_time = self.group_step_time
        return s


def make_sim(st, st_group, settings: dict, system: str, trace) -> RunSimulator:
    """The simulator of ``system`` as the run's cluster (``settings``: the run's instances, KV tokens,
    block size, dispatch, kunserve config and its variants, engine limits, oracle KV multiplier) on
    ``trace``: decode steps ``st`` for single engines, ``st_group`` for a group (None: ``st``)."""
    bs = settings["block_size"]
    base = settings["kv_tokens"] // bs
    variant = settings.get("variants", {}).get(system)
    kcfg = parse_config(settings["kunserve_config"] if variant is None else variant)
    # a system of another harness (benchmarks/burst_value_sim.py): which simulator policy it runs as,
    # and its KV multiplier, batch cap and dispatch where they differ from the run's
    spec = settings.get("specs", {}).get(system, {})
    kind = settings.get("system_as", {}).get(system, system)
    dispatch = spec.get("dispatch", settings["dispatch"])
    kv_blocks = int(round(base * spec.get("kv_x", settings["oracle_x"] if system == "oracle" else 1)))
    cfg = SimConfig(model=load_model_spec(settings["model"]), gpu=get_gpu("cpu"), step_time=st,
                    instances=settings["instances"], block_size=bs,
                    max_tokens=settings["max_num_batched_tokens"], max_seqs=spec.get("max_seqs", settings["max_num_seqs"]),
                    kv_blocks=kv_blocks, runtime_reserve_bytes=0,
                    # vLLM's default, on in the runs' engines (summary.json: server_cache_config)
                    prefix_cache=True,
                    # kunserve as built here: a group's members are engines with their own scheduler,
                    # queue and 1/k of the group's KV (integration/vllm/pipeline.py), the front end
                    # dispatching to members
                    member_queues=True,
                    # the members share one host: stage hand-offs and KV exchange in shared memory (the
                    # grouped step line carries what the hand-offs cost in the run)
                    link=Link(1e15, 0.0, "local"))
    if kind in ("vllm", "oracle"):
        pol = build_policy("vllm", dispatch)
    elif (kind == "kunserve" or variant is not None) and kcfg.remap.enable:
        # remap on the engines too: the three levers in the order policy.levers gives; the CPU engines
        # run on one core each, so a streamed layer's copy runs inline
        pol = build_policy("levers", dispatch, kcfg, copy_overlap=False)
    elif kind == "kunserve" or variant is not None:
        pol = build_policy("kunserve", dispatch, kcfg)
    elif kind == "static":
        pol = build_policy("static", dispatch, kcfg)
    else:
        raise ValueError(f"system {system!r}: one of {', '.join(SYSTEMS)} or a --variant of the run")
    return RunSimulator(cfg, pol, trace, kcfg.kv_ratio, st_group)


def trace_of(rows: list[dict]):
    """Every request offered (failed ones too): trace arrival, server-counted prompt, asked output."""
    reqs = []
    for r in rows:
        prompt = prompt_of(r)
        reqs.append((float(r["arrival_s"]), int(r["idx"]), prompt, max(1, int(float(r["output_len"])))))
    reqs.sort()
    return [TraceRequest(i, t, p, o) for t, i, p, o in reqs]


def predict(st, st_group, settings: dict, system: str, trace) -> dict:
    """:func:`make_sim` run: the burst window's (``settings["window"]``) P50 / P99 TTFT and P50 TPOT,
    preemptions and the first drop."""
    sim = make_sim(st, st_group, settings, system, trace).run()
    lo, hi = settings["window"]
    sel = [r for r in sim.reqs if lo <= r.arrival < hi]
    recs = [r.record() for r in sel if r.finish_t is not None]
    drops = [e["t"] for e in sim.events if e["kind"] == "drop"]
    return {"n": len(sel), "failed": sum(1 for r in sim.failed if lo <= r.arrival < hi),
            "ttft_p99": percentile([x["ttft_s"] for x in recs], 99),
            "ttft_p50": percentile([x["ttft_s"] for x in recs], 50),
            "tpot_p50": percentile([x["tpot_s"] for x in recs if x["output"] > 1], 50),
            "tpot_p50_all": percentile([x["tpot_s"] for x in (r.record() for r in sim.reqs if r.finish_t is not None)
                                        if x["output"] > 1], 50),
            "preemptions": sum(r.preempts for r in sim.reqs), "first_drop_s": drops[0] if drops else None}


def ttft_residuals(st, st_group, data: dict, system: str, src: list[int], settings: dict, below_s: float) -> list[float]:
    """The run's per-request noise the simulator does not model (the OS and the front end on shared
    cores, a step's jitter): measured minus simulated TTFT of the burst-window requests of
    repetitions ``src`` of ``system`` in ``data``, each simulated with its own offered requests, kept
    where both are under ``below_s`` (neither side queued: on the knee of the TTFT curve the
    difference is the queue's, not noise)."""
    lo, hi = settings["window"]
    out = []
    for k in src:
        rows = data[(system, k)]["rows"]
        sim = make_sim(st, st_group, settings, system, trace_of(rows)).run()
        simulated = {r.id: r.record()["ttft_s"] for r in sim.reqs if r.finish_t is not None}
        for r in rows:
            p = simulated.get(int(r["idx"]))
            if r["ok"] == "1" and p is not None and lo <= float(r["arrival_s"]) < hi:
                m = float(r["ttft_s"])
                if m < below_s and p < below_s:
                    out.append(m - p)
    return out


#: --calibrate: the decode lines' scales tried (their TPOT curve is interpolated where it crosses 1)
CAL_SCALES = tuple(round(0.6 + 0.05 * i, 2) for i in range(11))


def scaled(fit: dict | None, sc: float) -> dict | None:
    """A decode line (``fit_steps``) with intercept and slope times ``sc``."""
    return None if fit is None else {**fit, "a_s": fit["a_s"] * sc, "c_s": fit["c_s"] * sc}


def step_times(single: dict, grouped: dict, sc: float, tps: float):
    """The simulator's step times, single and grouped: the decode lines times ``sc``, prefill at ``tps``."""
    return tuple(MeasuredStepTime.linear(f["a_s"] * sc, f["c_s"] * sc, tps) for f in (single, grouped))


def measured_tpot_p50(rows: list[dict]) -> float | None:
    """Median TPOT over every completed request of a repetition (the client's, preemption waits in)."""
    return percentile([float(r["tpot_s"]) for r in rows if r["ok"] == "1" and r.get("tpot_s")], 50)


def crossing(curve: list[tuple[float, float]]) -> tuple[float, bool]:
    """The scale where a rising (scale, simulated / measured) curve crosses 1, linearly interpolated
    between the grid points around it; (nearest grid point, False) where it never crosses."""
    for (s0, c0), (s1, c1) in zip(curve, curve[1:]):
        if (c0 - 1) * (c1 - 1) <= 0 and c1 != c0:
            return s0 + (1 - c0) * (s1 - s0) / (c1 - c0), True
    return min(curve, key=lambda x: abs(x[1] - 1))[0], False


def calibrate(data: dict, system: str, src: list[int], single: dict, grouped: dict, settings: dict,
              fixed_tps: float | None = None) -> dict:
    """``--calibrate``: the scale of the decode lines at which the simulator reproduces the median TPOT
    of repetitions ``src`` (the same ones the lines come from; held out: never the one predicted).
    At each scale the prefill rate is derived again from their warm requests on the scaled line
    (``TTFT - 1.5 step(b)``: a faster step leaves more of a first token's wait to its prefill), then each
    of them is simulated and its median TPOT over every request compared with its measured one."""
    lo, inst = settings["window"][0], settings["instances"]

    def warm(sc: float) -> list[float]:   # seconds per prompt token of the warm requests, on the scaled line
        fs = {"single": scaled(single, sc), "grouped": scaled(grouped, sc)}
        return [] if fixed_tps else [x for j in src for x in prefill_samples(
            data[(system, j)]["rows"], lo, data[(system, j)]["tl"], inst, fs)]

    curve, rates = [], {}
    for sc in CAL_SCALES:
        samples = warm(sc)
        if fixed_tps is None and (len(samples) < MIN_PREFILL or statistics.median(samples) <= 0):
            continue   # too few warm requests, or a step so slow it leaves the prompts no time
        tps = fixed_tps or 1 / statistics.median(samples)
        st, st_g = step_times(single, grouped, sc, tps)
        got = []
        for j in src:
            sim = predict(st, st_g, settings, system, trace_of(data[(system, j)]["rows"]))["tpot_p50_all"]
            meas = measured_tpot_p50(data[(system, j)]["rows"])
            if sim and meas:
                got.append(sim / meas)
        if got:
            curve.append((sc, statistics.median(got)))
            rates[sc] = (tps, len(samples))
    if not curve:
        raise SystemExit(f"{system}: nothing to calibrate on (no TPOT, or fewer than {MIN_PREFILL} warm requests)")
    scale, crossed = crossing(curve)
    samples = warm(scale)
    ok = len(samples) >= MIN_PREFILL and statistics.median(samples) > 0
    tps = fixed_tps or (1 / statistics.median(samples) if ok else rates[min(rates, key=lambda x: abs(x - scale))][0])
    return {"scale": scale, "crossed": crossed, "tps": tps, "n": len(samples), "source_reps": list(src),
            "curve": [[sc, round(c, 4)] for sc, c in curve]}


def line_str(fit: dict | None) -> str:
    if not fit:
        return "-"
    return (f"{fit['a_s'] * 1e3:.0f} + {fit['c_s'] * 1e3:.1f}b ms ({fit['seconds']} s, b "
            f"{fit['batch_range'][0]:g}-{fit['batch_range'][1]:g})")
