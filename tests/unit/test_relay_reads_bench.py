"""benchmarks/relay_reads.py's analysis: pooled gaps and read counts per front, and the reading
that says where a front end's bunches form, derived from the figures (tested both ways)."""

from __future__ import annotations

import pytest

from tests.unit.benchmod import load_benchmark

pytestmark = pytest.mark.unit


def _run(front, gaps, reads, events, front_reads=None):
    r = {"front": front, "streams": 32, "rep": 1, "gaps_ms": gaps, "client_reads": reads, "events": events,
         "tokens_per_s": 100.0, "errors": 0}
    if front_reads:
        r["front_reads"] = front_reads
    return r


def test_analysis_pools_gaps_and_reading_follows_the_figures():
    rr = load_benchmark("relay_reads")
    runs = [_run("direct", [10.0, 10.0, 0.1], 10, 11), _run("vllm-router-rr", [12.0, 0.2], 10, 12),
            _run("kunserve", [0.1, 0.2, 9.0], 10, 16, {"reads": 10, "events": 15})]
    an = rr.analyse(runs, [32])
    k = an["32"]["kunserve"]
    assert k["median_gap_ms"] == 0.2 and k["gaps_under_1ms"] == pytest.approx(2 / 3)
    assert k["events_per_client_read"] == 1.6 and k["events_per_engine_read"] == 1.5
    assert "events_per_engine_read" not in an["32"]["direct"]
    # excess over direct 0.5 events per read, 0.5 of it already in the engine reads: it reads late
    assert "it reads its engines late" in rr.reading(an)
    runs[2]["front_reads"] = {"reads": 10, "events": 11}   # read on time: the relay adds the bunches
    assert "the relay or its writes to the client add the rest" in rr.reading(rr.analyse(runs, [32]))
    assert rr.render({"command": "x", "cpu": "c", "cores": 2, "reps": 1, "requests_per_stream": 4,
                      "output_len": 64}, an).count("| 32 |") == 3
