"""Group transitions are transactional in real engines: a fault at every step of a join and of a
leave leaves both members serving, each with its pre-transition layers or the completed layout,
invariants intact and greedy outputs token-identical (two in-process vLLM-CPU engines)."""

import pytest

from .conftest import BURST_KV_BYTES, run_script

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def faults(burst_model):
    return run_script("group_fault_probe.py", [burst_model, BURST_KV_BYTES], timeout=900)[0]


def _serving_as_before(case, base):
    for i, (snap, b) in enumerate(zip(case["end"], base)):
        assert snap["phase"] == "base" and snap["dropped"] == [], (case["step"], i, snap)
        assert snap["blocks"] == b["blocks"] and snap["problems"] == [], (case["step"], i, snap)
    assert case["same_mid"] == [True, True] and case["same_end"] == [True, True], case


def test_a_fault_at_any_join_step_rolls_back_or_completes(faults):
    base = faults["base"]
    by_step = {c["step"]: c for c in faults["join"]}
    for c in faults["join"]:
        failed = [o for o in c["outcomes"] if o != "ok"]
        # before the exchange is over, both members roll back: the faulty one and, told by it, the peer
        if c["step"] in ("release", "connect", "barrier", "foreign_create", "exchange", "kv_chunk"):
            assert len(failed) == 2 and not c["partial"], c
            assert all(m["phase"] == "base" and m["dropped"] == [] for m in c["mid"]), c
            assert c["seconds"] < 12, c   # the peer heard of the failure, it did not wait out its timeout
        _serving_as_before(c, base)
    # after the exchange: the member that failed rolled back alone; its peer abandoned the group
    assert by_step["kv_free"]["partial"] and by_step["kv_free"]["outcomes"][1] == "ok"
    # the committed join's last word lost: the join completes (with the peers' base), then leaves cleanly
    assert by_step["grown"]["completed"] and by_step["grown"]["clean_leave"] == ["ok", "ok"]


def test_a_fault_at_any_leave_step_keeps_the_group_or_completes(faults):
    base = faults["base"]
    for c in faults["leave"]:
        assert any(o != "ok" for o in c["outcomes"]), c   # the fault fired
        # a member whose leave failed is still grouped (rolled back), or alone again
        for m in c["mid"]:
            assert m["problems"] == [], c
            assert m["phase"] in ("grouped", "base"), c
        if c["again"] is not None:
            assert c["again"] == ["ok", "ok"], c
        _serving_as_before(c, base)
