"""Transfer chunk sizing."""

import pytest

from vllm_kunserve.policy import Link, chunk_bytes, fit_link

pytestmark = pytest.mark.unit


def test_chunk_takes_about_one_stage():
    link = Link(10e9, 20e-6)
    n = chunk_bytes(link, 5e-3, align=4096)
    assert n % 4096 == 0
    assert link.time_s(n) == pytest.approx(5e-3, rel=0.01)
    assert chunk_bytes(link, 1e-9) == 64 << 10  # clamped to the minimum
    with pytest.raises(ValueError):
        chunk_bytes(link, 0)


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [2 ** k for k in range(10, 28)]
    times = [15e-6 + s / 40e9 for s in sizes]
    link = fit_link(sizes, times)
    assert link.bandwidth_bytes_per_s == pytest.approx(40e9, rel=1e-6)
    assert link.latency_s == pytest.approx(15e-6, rel=1e-6)
