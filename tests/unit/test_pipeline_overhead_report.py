"""benchmarks/pipeline_overhead.py's measures: throughput over the middle of the token arrivals and
the P50 of each request's mean token gap."""

import math

import pytest

from tests.unit.benchmod import load_benchmark
from vllm_kunserve.bench.client import RequestResult

pytestmark = pytest.mark.unit


def _res(send_s: float, times: list[float]) -> RequestResult:
    r = RequestResult(0, 0.0, 8, len(times), send_s=send_s, ok=True, output_tokens=len(times))
    r.token_times = times
    return r


def test_throughput_counts_the_middle_of_the_arrivals_and_tpot_each_requests_gaps():
    po = load_benchmark("pipeline_overhead")
    # two requests at 10 tokens/s each, the second sent 0.05 s later: 20 tokens/s together
    a = _res(0.0, [0.1 * i for i in range(1, 101)])
    b = _res(0.05, [0.1 * i for i in range(1, 101)])
    assert po.throughput([a, b]) == pytest.approx(20.0, rel=0.02)
    # a slow start and a slow tail are outside the middle 60%
    c = _res(0.0, [5.0] + [5.0 + 0.1 * i for i in range(1, 99)] + [60.0])
    assert po.throughput([c]) == pytest.approx(10.0, rel=0.05)
    assert po.tpot_p50([a, _res(0.0, [0.2 * i for i in range(1, 11)]), _res(0.0, [0.3, 0.6, 0.9])]) == \
        pytest.approx(0.2)
    assert math.isnan(po.throughput([])) and math.isnan(po.tpot_p50([_res(0.0, [1.0])]))
