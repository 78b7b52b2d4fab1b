"""The chaos run's summary (benchmarks/common/chaos.py): token identity against the reference,
the requests in flight at a kill, the fleet's counters read from the front end's /metrics."""

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from benchmarks.common.chaos import ChaosRun, ChaosSpec, _counters, _specs, summarise
from vllm_kunserve.bench.client import RequestResult

pytestmark = pytest.mark.unit


def _res(idx, send, ttft, e2e, ids, ok=True):
    r = RequestResult(idx, send, 10, len(ids), send_s=send, ok=ok, ttft_s=ttft, e2e_s=e2e)
    r.token_ids = list(ids)
    return r


def test_summary_counts_identity_and_the_requests_a_kill_hit():
    ref = [_res(i, 0, 0.1, 1, [i, i + 1]) for i in range(4)]
    got = [_res(0, 1.0, 0.2, 5.0, [0, 1]),     # running at the kill (t = 4)
           _res(1, 20.0, 0.1, 1.0, [1, 2]),    # long after it
           _res(2, 12.0, 0.9, 2.0, [9, 9]),    # sent within 10 s of it, tokens differ
           _res(3, 2.0, 0.0, 0.0, [], ok=False)]
    got[3].error = "HTTP 503"
    reg = CollectorRegistry()   # the front end's counters, as its /metrics writes them
    fo = Counter("kunserve:failovers", "x", ["instance"], registry=reg)
    fo.labels("0").inc(2)
    fo.labels("1").inc()
    Counter("kunserve:group_ops", "x", ["op", "outcome"], registry=reg).labels("join", "ok").inc(3)
    metrics = _counters(generate_latest(reg).decode())
    run = ChaosRun(ChaosSpec(requests=4), ref, got,
                   actions=[{"t": 4.0, "action": "kill", "instance": 1, "status": 200},
                            {"t": 5.0, "action": "drop", "instances": [0, 2], "status": 409},
                            {"t": 6.0, "action": "drop", "kind": "all", "instances": [0, 2, 3], "status": 200,
                             "regrouped": [[0, 2]], "kept_kv": True},
                            {"t": 9.0, "action": "restore", "status": 200}],
                   status={"metrics": metrics, "instances": [{"instance": 0, "restarts": 1}]})
    s = summarise(run)
    assert (s["requests"], s["completed"], s["token_identical"]) == (4, 3, 2)
    assert s["differ"] == [2] and s["failed"] == [{"idx": 3, "error": "HTTP 503"}]
    assert s["kills"] == 1 and s["drops_refused"] == 1 and s["restores"] == 1
    assert s["drops_ok"] == 1 and s["regroups_kept_kv"] == 1
    assert s["ttft_near_kill"]["n"] == 2 and s["ttft_calm"]["n"] == 1
    assert s["fleet"]["failovers"] == 3 and s["fleet"]["group_ops"] == {"{op=join}{outcome=ok}": 3}
    assert s["restarts"] == {"0": 1}
    # on a fleet that served before the chaos pass (the tests share one), only the pass's own count
    before = ChaosRun(run.spec, ref, got, actions=run.actions, status=run.status,
                      before={"metrics": {"kunserve:failovers": 1.0}, "instances": [{"instance": 0, "restarts": 1}]})
    s = summarise(before)
    assert s["fleet"]["failovers"] == 2 and s["fleet"]["group_ops"] == {"{op=join}{outcome=ok}": 3}
    assert s["restarts"] == {"0": 0}


def test_the_burst_is_seeded_and_spread_over_its_duration():
    a, b = _specs(ChaosSpec(requests=50, duration_s=10, seed=1)), _specs(ChaosSpec(requests=50, duration_s=10, seed=1))
    assert [x.prompt for x in a] == [x.prompt for x in b] and [x.arrival_s for x in a] == [x.arrival_s for x in b]
    assert 4 < a[-1].arrival_s < 20 and all(16 <= x.prompt_len <= 96 for x in a)
