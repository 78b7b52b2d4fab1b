"""The pipeline trace analysis (bench/pipeline_trace.py): a member's core shares, its step's chain
and the idle time of its core by cause, on a hand-made two-member trace whose numbers are known."""

from __future__ import annotations

import json

import pytest

from vllm_kunserve.bench.pipeline_trace import _merge, _minus, analyse, load

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
