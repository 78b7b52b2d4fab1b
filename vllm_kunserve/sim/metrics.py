"""Per-request records, percentile summaries and ratios between policies."""

from __future__ import annotations

from vllm_kunserve.workload.stats import percentiles, ratio

PCTS = (50, 90, 99, 99.9)  # percentiles() also gives the mean and the max


def summarize(sim, warmup_s: float = 0.0, end_s: float | None = None) -> dict:
    """Summary of one finished simulation over the requests that arrive in ``[warmup_s, end_s)``
    (default: all). Requests arriving during the warm-up are served like any other, so the cluster
    is in steady state when measurement starts, but count in no latency, preemption or event
    figure (``requests`` counts the measured ones; ``warmup_requests`` the others)."""
    hi = float("inf") if end_s is None else end_s
    measured = [r for r in sim.reqs if warmup_s <= r.arrival < hi]
    recs = [r.record() for r in measured if r.finish_t is not None]
    makespan = max((r.finish_t for r in sim.reqs if r.finish_t is not None), default=0.0)
    tpots = [x["tpot_s"] for x in recs if x["output"] > 1]
    groups = sim.group_steps + [(s.bubble_sum, s.steps, s.stage_idle_s, s.stage_busy_s)
                                for s in sim.servers if s.k > 1 and s.steps]
    gsteps = sum(g[1] for g in groups)
    gtime = sum(g[3] for g in groups)
    mids = {id(r) for r in measured}
    failed = sum(1 for r in sim.failed if id(r) in mids)
    events = [e for e in sim.events if warmup_s <= e["t"] < hi]
    return {
        "requests": len(measured), "completed": len(recs), "failed": failed,
        "unfinished": len(measured) - len(recs) - failed,
        "warmup_requests": len(sim.reqs) - len(measured), "measure_s": [warmup_s, end_s],
        "ttft_s": percentiles((x["ttft_s"] for x in recs), PCTS),
        "tpot_s": percentiles(tpots, PCTS),
        "latency_s": percentiles((x["latency_s"] for x in recs), PCTS),
        "preemptions": int(sum(x["preemptions"] for x in recs)),
        "migrations": int(sum(x["migrations"] for x in recs)),
        "drops": sum(1 for e in events if e["kind"] == "drop"),
        "restores": sum(1 for e in events if e["kind"] == "restore"),
        "remaps": sum(1 for e in events if e["kind"] == "remap"),
        "makespan_s": makespan,
        "throughput_tok_s": sim._tok / makespan if makespan > 0 else 0.0,
        "kv_blocks_per_instance": sim.base_blocks,
        "pipeline_steps": gsteps,
        "pipeline_bubble": sum(g[0] for g in groups) / gsteps if gsteps else None,  # mean over group steps
        # idle share of the groups' stage time (long steps weigh more; what the pipeline costs)
        "pipeline_bubble_time": sum(g[2] for g in groups) / gtime if gtime > 0 else None,
    }


def ratios_to(results: dict, ref: str = "vllm") -> dict:
    """Per policy: reference's metric divided by the policy's (``> 1``: the policy is faster)."""
    if ref not in results:
        return {}
    base = results[ref]["summary"]
    out = {}
    for name, res in results.items():
        s = res["summary"]
        out[name] = {f"{m}_{p}": ratio(base[m][p], s[m][p])
                     for m in ("ttft_s", "tpot_s", "latency_s") for p in ("p50", "p99")}
    return out
