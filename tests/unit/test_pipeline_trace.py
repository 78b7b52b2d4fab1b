"""The pipeline trace analysis (benchmarks/common/pipeline_trace.py): a member's core shares, its step's chain
and the idle time of its core by cause, on a hand-made two-member trace whose numbers are known."""

from __future__ import annotations

import json

import pytest

from benchmarks.common.pipeline_trace import _merge, _minus, analyse, load, prefill_cycles

pytestmark = pytest.mark.unit

MS = 1e-3


def cycle(t: float) -> tuple[list, list]:
    """One 100 ms cycle from ``t``. e0: its step 0-50 ms runs its own layers 0-10 and 40-50 and hops
    to e1 10-40; it samples at 51-52, then its engine core is between steps until 100. e1: its own
    step 0-20 (no hop), e0's span waits for e1's core until 20 and runs 20-40, e1's sampling is
    called at 21 and waits for the span until 40."""
    at = lambda *xs: [t + x * MS for x in xs]  # noqa: E731
    e0 = [["execute_model", *at(0, 0, 50)], ["hop", *at(10, 10, 40, 40)], ["sample_tokens", *at(51, 51, 52)]]
    e1 = [["execute_model", *at(0, 0, 20)], ["span", *at(10, 20, 40)], ["sample_tokens", *at(21, 40, 41)]]
    return e0, e1


def trace(n: int = 11) -> dict[str, list]:
    e0, e1 = [], []
    for k in range(n):
        a, b = cycle(k * 0.1)
        e0 += a
        e1 += b
    return {"e0": e0, "e1": e1}


def test_merge_and_minus():
    assert _merge([(3, 4), (0, 1), (0.5, 2)]) == [[0, 2], [3, 4]]
    assert _minus([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert _minus([(0, 1)], []) == [(0, 1)]


def test_core_shares_chain_and_idle_causes_of_a_known_trace():
    out = analyse(trace(), trim=0.0)
    e0 = out["e0"]
    win = 1.05  # the first step's start to the last step's end (11 cycles, the last one's step ends at 50 ms)
    assert e0["cycle_ms"] == pytest.approx(100.0)
    assert e0["core"]["own_step"] == pytest.approx(11 * 20 * MS / win, abs=1e-3)
    assert e0["core"]["peer_spans"] == 0.0
    assert e0["core"]["sampling"] == pytest.approx(10 * MS / win, abs=1e-3)
    assert e0["core"]["idle"] == pytest.approx(820 * MS / win, abs=1e-3)
    # while e0's microbatch is at e1, e1's own step (10 ms) and then its sampling's wait for e0's
    # span (19 ms) mean both microbatches are at e1's stage: a collision; e1 between its step and
    # its sampling call (1 ms): in transit; after e0's own sampling: e0's engine core
    causes = e0["idle_by_cause"]
    assert causes["collision"] == pytest.approx(11 * 29 * MS / win, abs=0.004)
    assert causes["in transit"] == pytest.approx(11 * 1 * MS / win, abs=0.004)
    assert causes["between steps"] == pytest.approx(10 * 49 * MS / win, abs=0.004)
    assert causes["other"] == 0.0
    assert sum(causes.values()) == pytest.approx(e0["core"]["idle"], abs=0.005)
    assert e0["chain_ms"] == pytest.approx({"before_hop": 10.0, "hop": 30.0, "after_hop": 10.0, "to_sampling": 1.0,
                                            "sampling": 1.0, "to_next_step": 48.0, "step_wait": 0.0}, abs=1e-6)
    e1 = out["e1"]
    assert e1["core"]["own_step"] == pytest.approx(11 * 20 * MS / 1.02, abs=1e-3)
    assert e1["core"]["peer_spans"] == pytest.approx(10 * 20 * MS / 1.02, abs=1e-3)
    assert "chain_ms" not in e1  # its steps never hop: no chain to break down


def test_load_groups_the_members_dumps_by_time(tmp_path):
    first = trace(3)
    later = {m: [[e[0], *(x + 10.0 for x in e[1:])] for e in ev] for m, ev in trace(3).items()}
    for k, (m, ev) in enumerate([*first.items(), *later.items()]):
        (tmp_path / f"{m}-{k}.json").write_text(json.dumps({"member": m, "events": ev}))
    (tmp_path / "empty.json").write_text(json.dumps({"member": "e9", "events": []}))
    groups = load(tmp_path.glob("*.json"))
    assert [sorted(g) for g in groups] == [["e0", "e1"], ["e0", "e1"]]
    assert groups[1]["e0"][0][1] == pytest.approx(10.0)


def loaded(t: float, dur: float, reqs: int, prefill: int) -> list:
    """A step traced with what it carried: (start, core, end, requests, tokens, prefill tokens)."""
    return ["execute_model", t, t, t + dur, reqs, reqs + prefill - (1 if prefill else 0), prefill]


def test_prefill_cycles_split_a_members_cycles_by_where_prefill_ran():
    # e0 steps every 100 ms, except that its step at 0.3 carries a prompt and the next one starts
    # at 0.65; e1 prefills in its step at 0.5-0.6 (inside e0's cycle 0.3-0.65 and nowhere else)
    e0 = [loaded(0.0, 0.05, 20, 0), loaded(0.1, 0.05, 20, 0), loaded(0.2, 0.05, 20, 0), loaded(0.3, 0.3, 21, 64),
          loaded(0.65, 0.05, 21, 0), loaded(0.75, 0.05, 21, 0), loaded(0.85, 0.05, 21, 0)]
    e1 = [loaded(0.05, 0.05, 20, 0), loaded(0.5, 0.1, 21, 64), loaded(0.7, 0.05, 21, 0), loaded(0.8, 0.11, 21, 32)]
    out = prefill_cycles(e0, e1)
    assert set(out) == {"decode only", "both", "peer prefill"}
    assert out["decode only"]["cycles"] == 4 and out["decode only"]["cycle_p50_ms"] == pytest.approx(100.0)
    assert out["both"] == {"cycles": 1, "seconds": pytest.approx(0.35), "cycle_p50_ms": pytest.approx(350.0), "cycle_p90_ms": pytest.approx(350.0),
                           "requests": 21.0, "prefill_tokens": 64.0}
    # with the core's busy time: its own steps here (0.3-0.6 of the 0.35 s "both" cycle, 0.05 of each 0.1)
    busy = prefill_cycles(e0, e1, busy=[(e[1], e[3]) for e in e0])
    assert busy["both"]["idle"] == pytest.approx(0.05 / 0.35, abs=1e-3)
    assert busy["decode only"]["idle"] == pytest.approx(0.5, abs=1e-3)
    # e0's cycle 0.75-0.85 overlaps e1's step 0.8-0.91 with 32 prefill tokens
    assert out["peer prefill"]["cycles"] == 1 and out["peer prefill"]["cycle_p50_ms"] == pytest.approx(100.0)
    # the peer's side: its cycle 0.05-0.5 saw e0's prompt (0.3-0.6), 0.5-0.7 its own and e0's, 0.7-0.8
    # neither (its last step has no next one: no cycle)
    theirs = prefill_cycles(e1, e0)
    assert {k: v["cycles"] for k, v in theirs.items()} == {"peer prefill": 1, "both": 1, "decode only": 1}
    assert theirs["peer prefill"]["cycle_p50_ms"] == pytest.approx(450.0)
    assert theirs["both"]["cycle_p50_ms"] == pytest.approx(200.0)


def test_prefill_cycles_of_a_trace_without_step_loads_is_empty():
    assert prefill_cycles(trace()["e0"], trace()["e1"]) == {}
    assert "prefill_cycles" not in analyse(trace(), trim=0.0)["e0"]


def test_load_reads_steps_with_their_loads(tmp_path):
    ev = [loaded(1.0, 0.05, 20, 0), loaded(1.1, 0.3, 21, 64)]  # the last mark (prefill tokens) is not a time
    (tmp_path / "e0-1.json").write_text(json.dumps({"member": "e0", "events": ev}))
    (tmp_path / "e1-1.json").write_text(json.dumps({"member": "e1", "events": [loaded(1.2, 0.05, 20, 0)]}))
    groups = load(tmp_path.glob("*.json"))
    assert len(groups) == 1 and sorted(groups[0]) == ["e0", "e1"]
