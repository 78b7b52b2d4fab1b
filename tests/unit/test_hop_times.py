"""Where a pipeline group's hops spend their time (``HopTimes``), and how the benchmark harness reads
it from the front end's status (``bench.compare.pipeline_times``)."""

import pytest

pytestmark = pytest.mark.unit


def test_hop_times_split_a_round_trip_into_queueing_compute_and_link():
    from vllm_kunserve.integration.vllm.pipeline import HopTimes

    h = HopTimes(keep=10)
    assert h.summary() == {"hops": 0, "round_trip_ms": None, "peer_wait_ms": None, "peer_span_ms": None,
                           "link_ms": None}
    for i in range(25):                       # round trip = wait + span + link (0.5 ms)
        h.add(round_trip_ms=10.0 + i + 0.5, peer_wait_ms=float(i), peer_span_ms=10.0)
    h.add(round_trip_ms=1.0, peer_wait_ms=0.0, peer_span_ms=2.0)   # clocks disagree: no negative link
    s = h.summary()
    assert s["hops"] == 26                    # counted over the group's life ...
    assert s["link_ms"]["p50"] == 0.5 and s["link_ms"]["max"] == 0.5
    assert min(r[3] for r in h.rows) == 0.0
    assert s["peer_wait_ms"]["max"] == 24.0   # ... percentiles over the last `keep`
    assert s["peer_wait_ms"]["p50"] >= 15.0
    assert len(h.rows) <= 20


def test_pipeline_times_reads_each_grouped_engine_from_the_status():
    from vllm_kunserve.bench.compare import pipeline_times

    t = {"hops": 3, "link_ms": {"p50": 0.2, "p90": 0.3, "max": 0.4}}
    status = {"instances": [{"instance": 0, "kv": {"engine": {"pipeline": t}}},
                            {"instance": 1, "kv": {"engine": {"pipeline": None}}},
                            {"instance": 2, "kv": {}}]}
    assert pipeline_times(status) == {"0": t}
    assert pipeline_times({}) == {}
