"""Percentiles, SLO attainment, summary and per-second timeline on hand-made results."""

import math

import numpy as np
import pytest

from vllm_kunserve.bench.client import RequestResult
from vllm_kunserve.bench.metrics import slo_attainment, summarize, timeline
from vllm_kunserve.bench.scrape import parse_metrics
from vllm_kunserve.workload.stats import percentiles

pytestmark = pytest.mark.unit


def _r(idx, arrival, ttft, tpot, n_out=3, ok=True, error=""):
    r = RequestResult(idx, arrival, 10, n_out, send_s=arrival, ok=ok, error=error)
    if ok:
        r.ttft_s, r.tpot_s = ttft, tpot
        r.token_times = [ttft + k * tpot for k in range(n_out)]
        r.e2e_s = r.token_times[-1] + 0.001
        r.output_tokens = n_out
    return r


def test_percentiles_linear_interpolation():
    v = list(range(1, 101))  # 1..100
    p = percentiles(v)
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01) and p["p99.9"] == pytest.approx(99.901)
    assert p["mean"] == pytest.approx(50.5) and p["max"] == 100
    assert percentiles([2.0, float("nan"), 4.0])["p50"] == 3.0  # NaN ignored
    assert percentiles([])["p99"] is None


def test_slo_attainment_counts_failures_as_misses():
    res = [_r(0, 0, 1.0, 0.1), _r(1, 0, 2.0, 0.1), _r(2, 0, 5.0, 0.3), _r(3, 0, 0, 0, ok=False, error="x")]
    s = slo_attainment(res, ref_ttft_s=1.0, ref_tpot_s=0.1, scales=(1, 2, 3, 5))
    assert s["ttft"] == {"1x": 0.25, "2x": 0.5, "3x": 0.5, "5x": 0.75}
    assert s["ttft_and_tpot"] == {"1x": 0.25, "2x": 0.5, "3x": 0.5, "5x": 0.75}
    s2 = slo_attainment(res, 1.0, 0.05, scales=(2,))  # TPOT 0.1 <= 2 x 0.05 passes, 0.3 does not
    assert s2["ttft_and_tpot"]["2x"] == 0.5
    with pytest.raises(ValueError):
        slo_attainment(res, 0.0, 0.1)


def test_summary_counts_throughput_and_server_deltas():
    res = [_r(0, 0.0, 0.5, 0.1, n_out=5), _r(1, 1.0, 1.5, 0.2, n_out=3), _r(2, 2.0, 0, 0, ok=False, error="HTTP 503: x")]
    series = [{"t": 0.1, "preemptions": 7.0, "kv_usage": 0.2, "queue_time_sum": 1.0, "queue_time_count": 2.0},
              {"t": 1.1, "preemptions": 9.0, "kv_usage": 0.9, "waiting": 4.0},
              {"t": 2.1, "preemptions": 12.0, "kv_usage": 0.5, "queue_time_sum": 4.0, "queue_time_count": 4.0}]
    s = summarize(res, scrape_series=series)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"HTTP 503": 1})
    end = max(0.5 + 4 * 0.1, 1.0 + 1.5 + 2 * 0.2) + 0.001
    assert s["duration_s"] == pytest.approx(end)
    assert s["throughput_rps"] == pytest.approx(2 / end) and s["output_tokens_per_s"] == pytest.approx(8 / end)
    assert s["ttft_s"]["p50"] == pytest.approx(1.0) and s["tpot_s"]["p50"] == pytest.approx(0.15)
    assert s["itl_s"]["max"] == pytest.approx(0.2)
    assert s["preemptions"] == 5.0 and s["kv_usage_peak"] == 0.9 and s["waiting_peak"] == 4.0
    assert s["server_queue_time_mean_s"] == pytest.approx((4.0 - 1.0) / (4.0 - 2.0))
    # own P50 is the SLO reference unless given
    assert s["slo_reference"]["ttft_p50_s"] == pytest.approx(1.0)
    assert summarize(res, ref_ttft_s=3.0)["slo_attainment"]["ttft"]["1x"] == pytest.approx(2 / 3)


def test_timeline_bins_per_second():
    res = [_r(0, 0.2, 0.5, 0.3, n_out=4), _r(1, 0.7, 0.1, 0.1, n_out=2), _r(2, 2.5, 0, 0, ok=False)]
    series = [{"t": 0.05, "preemptions": 3.0, "kv_usage": 0.1}, {"t": 2.2, "preemptions": 5.0, "kv_usage": 0.6}]
    t = np.arange(0, 4, 0.5)
    demand = (t, np.where(t < 1, 100.0, 50.0))
    rows = timeline(res, series, demand)
    assert [r["arrivals"] for r in rows] == [2, 0, 1]
    # request 0 tokens at 0.7, 1.0, 1.3, 1.6 -> seconds 0,1,1,1 ; request 1 at 0.8, 0.9 -> second 0
    assert [r["output_tokens"] for r in rows] == [3, 3, 0]
    assert [r["completions"] for r in rows] == [1, 1, 0] and rows[2]["failures"] == 1
    assert rows[0]["mean_ttft_s"] == pytest.approx(0.3) and rows[1]["mean_ttft_s"] is None
    assert [r["preemptions"] for r in rows] == [0.0, 0.0, 2.0]  # since the start, carried forward
    assert [r["kv_usage"] for r in rows] == [0.1, 0.1, 0.6]
    assert [r["est_kv_demand_tokens"] for r in rows] == [100.0, 50.0, 50.0]


def test_parse_metrics_sums_and_kunserve_labels():
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 2\n'
        'vllm:num_preemptions_total{engine="1",model_name="m"} 3\n'
        "# TYPE kunserve:group_size gauge\n"
        'kunserve:group_size{group="a",engine="0"} 2\n'
        'kunserve:group_size{group="b",engine="0"} 1\n'
    )
    values, info = parse_metrics(text)
    assert values["kv_usage"] == pytest.approx(0.4) and values["preemptions"] == 5
    assert values["kunserve:group_size{group=a}"] == 2 and values["kunserve:group_size{group=b}"] == 1
    assert info == {} and not math.isnan(values["kv_usage"])


def test_median_ci_is_the_sign_tests_order_statistics():
    import random

    from vllm_kunserve.bench.metrics import median_ci

    xs = [0.8, 1.2, 0.9, 1.1, 1.0, 0.95, 1.05, 0.85, 1.15]
    assert median_ci(xs) == (0.85, 1.15)            # n = 9: x_(2) and x_(8)
    assert median_ci(list(range(20))) == (5, 14)     # n = 20: x_(6) and x_(15)
    assert median_ci([1, 2, 3, 4, 5]) is None        # too few for 95%
    assert median_ci([1, 2, 3, 4, 5], level=0.9) == (1, 5)
    # coverage: intervals from samples of a known distribution hold its median >= 95% of the time
    rng = random.Random(1)
    hits = sum(lo <= 0.0 <= hi for lo, hi in (median_ci([rng.gauss(0, 1) for _ in range(15)])
                                               for _ in range(2000)))
    assert hits / 2000 >= 0.95
