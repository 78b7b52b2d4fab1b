"""Summary statistics and the per-second timeline of a replay.

Percentiles (``workload.stats.percentiles``: numpy's linear interpolation) are over completed
requests. SLO attainment at scale s is the share of *all* requests (failures count as misses) whose
TTFT <= s x the reference P50 TTFT and whose TPOT <= s x the reference P50 TPOT (requests of one
output token have no TPOT and pass that half); the reference is given (e.g. the oracle's P50s in
``kunserve compare``) or the run's own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from vllm_kunserve.workload.stats import percentiles

if TYPE_CHECKING:  # annotations only
    from vllm_kunserve.bench.client import RequestResult

SLO_SCALES = tuple(range(1, 11))


def median_ci(values: Iterable[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median (the sign test's order statistics):
    [x_(k), x_(n-k+1)] with the largest k whose binomial tail P(Binom(n, 1/2) < k) <= (1 - level) / 2,
    so it covers the median with probability >= ``level``. None when too few values for one
    (fewer than 6 at 95%)."""
    v = sorted(x for x in values if x == x)
    n, alpha = len(v), (1.0 - level) / 2
    k, tail = 0, 0.0
    for j in range(n + 1):
        tail += math.comb(n, j) / 2.0 ** n
        if tail > alpha:
            break
        k = j + 1
    return (v[k - 1], v[n - k]) if k >= 1 else None


def slo_attainment(results: Sequence[RequestResult], ref_ttft_s: float, ref_tpot_s: float | None,
                   scales: Sequence[float] = SLO_SCALES) -> dict[str, dict[str, float]]:
    if not results:
        return {"ttft_and_tpot": {}, "ttft": {}}
    if not ref_ttft_s or not ref_ttft_s > 0:
        raise ValueError(f"SLO reference TTFT must be > 0, got {ref_ttft_s}")
    n = len(results)
    ttft = np.array([r.ttft_s if r.ok else math.inf for r in results])
    tpot = np.array([r.tpot_s if r.ok else math.inf for r in results])
    tpot = np.where(np.isnan(tpot), 0.0, tpot)  # one-token outputs have no TPOT
    both, only = {}, {}
    for s in scales:
        ok_t = ttft <= s * ref_ttft_s
        ok_p = tpot <= s * ref_tpot_s if ref_tpot_s else np.ones(n, bool)
        both[f"{s:g}x"] = float((ok_t & ok_p).sum() / n)
        only[f"{s:g}x"] = float(ok_t.sum() / n)
    return {"ttft_and_tpot": both, "ttft": only}


def _end(r: RequestResult) -> float:
    return r.send_s + r.e2e_s


#: a request sent this much after its scheduled arrival makes a run's latency figures suspect
LATE_SEND_S = 0.05


def summarize(results: Sequence[RequestResult], *, scrape_series: Sequence[dict[str, Any]] = (),
              ref_ttft_s: float | None = None, ref_tpot_s: float | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = percentiles(r.ttft_s for r in ok)
    tpot = percentiles(r.tpot_s for r in ok)
    itl = percentiles(g for r in ok for g in r.gaps)
    e2e = percentiles(r.e2e_s for r in ok)
    sent = [r.send_s for r in results if r.send_s == r.send_s]
    span = (max(_end(r) for r in ok) - min(sent)) if ok and sent else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error.split(":")[0][:80] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    ref_t = ref_ttft_s if ref_ttft_s else ttft["p50"]
    ref_p = ref_tpot_s if ref_tpot_s else tpot["p50"]
    summary: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": span,
        "throughput_rps": len(ok) / span if span > 0 else None,
        "output_tokens_per_s": out_tokens / span if span > 0 else None,
        "output_tokens": out_tokens,
        "short_outputs": sum(1 for r in ok if r.output_tokens < r.output_len),
        "ttft_s": ttft,
        "tpot_s": tpot,
        "itl_s": itl,
        "e2e_s": e2e,
        "slo_reference": {"ttft_p50_s": ref_t, "tpot_p50_s": ref_p},
        "slo_attainment": slo_attainment(results, ref_t, ref_p) if ref_t else {},
    }
    # a late client is not a slow server: how late each request left the client after its arrival
    lag = [r.send_s - r.arrival_s for r in results if r.send_s == r.send_s]
    if lag:
        summary["send_lag_s"] = percentiles(lag)
        summary["late_sends"] = sum(1 for x in lag if x > LATE_SEND_S)
    queue = [r.queue_s for r in ok if r.queue_s == r.queue_s]
    if queue:
        summary["queue_s"] = percentiles(queue)
    summary.update(server_summary(scrape_series))
    return summary


def server_summary(series: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Preemptions during the replay, peak KV usage, server-side mean queue time."""
    if not series:
        return {}
    first, last = series[0], series[-1]
    out: dict[str, Any] = {"scrapes": len(series)}
    if "preemptions" in last:
        out["preemptions"] = last["preemptions"] - first.get("preemptions", 0.0)
    usage = [s["kv_usage"] for s in series if "kv_usage" in s]
    if usage:
        out["kv_usage_peak"] = max(usage)
        out["kv_usage_mean"] = float(np.mean(usage))
    waiting = [s["waiting"] for s in series if "waiting" in s]
    if waiting:
        out["waiting_peak"] = max(waiting)
    dc = last.get("queue_time_count", 0.0) - first.get("queue_time_count", 0.0)
    if dc > 0:
        out["server_queue_time_mean_s"] = (last.get("queue_time_sum", 0.0) - first.get("queue_time_sum", 0.0)) / dc
    return out


def timeline(results: Sequence[RequestResult], scrape_series: Sequence[dict[str, Any]] = (),
             demand: tuple[np.ndarray, np.ndarray] | None = None) -> list[dict[str, Any]]:
    """One row per second of the replay: arrivals, completions, failures, output tokens, mean TTFT
    of the requests arriving that second, estimated KV demand (tokens), and the last scrape of that
    second (KV usage, preemptions since the start, running, waiting, kunserve:* gauges), carried
    forward when a second had no scrape."""
    ends = [_end(r) for r in results if r.ok]
    horizon = max([r.arrival_s for r in results] + ends + [s["t"] for s in scrape_series] + [0.0])
    n = int(math.floor(horizon)) + 1
    arrivals, done, failed, tokens = np.zeros(n, int), np.zeros(n, int), np.zeros(n, int), np.zeros(n, int)
    ttft_sum, ttft_n = np.zeros(n), np.zeros(n, int)
    for r in results:
        k = min(int(r.arrival_s), n - 1)
        arrivals[k] += 1
        if r.ok:
            ttft_sum[k] += r.ttft_s
            ttft_n[k] += 1
            done[min(int(_end(r)), n - 1)] += 1
            for t in r.token_times:
                tokens[min(int(r.send_s + t), n - 1)] += 1
        else:
            t_fail = r.send_s if r.send_s == r.send_s else r.arrival_s
            failed[min(int(t_fail + (r.e2e_s if r.e2e_s == r.e2e_s else 0.0)), n - 1)] += 1
    base_preempt = scrape_series[0].get("preemptions", 0.0) if scrape_series else 0.0
    last: dict[str, Any] = {}
    by_sec: dict[int, dict[str, Any]] = {}
    for s in scrape_series:
        by_sec[int(s["t"])] = s
    extra_keys = sorted({k for s in scrape_series for k in s if k not in ("t", "queue_time_sum", "queue_time_count")})
    rows = []
    for k in range(n):
        last = by_sec.get(k, last)
        row: dict[str, Any] = {
            "second": k, "arrivals": int(arrivals[k]), "completions": int(done[k]), "failures": int(failed[k]),
            "output_tokens": int(tokens[k]),
            "mean_ttft_s": float(ttft_sum[k] / ttft_n[k]) if ttft_n[k] else None,
        }
        if demand is not None:
            t, d = demand
            sel = (t >= k) & (t < k + 1)
            row["est_kv_demand_tokens"] = float(d[sel].mean()) if sel.any() else 0.0
        for key in extra_keys:
            v = last.get(key)
            row[key] = (v - base_preempt) if (key == "preemptions" and v is not None) else v
        rows.append(row)
    return rows
