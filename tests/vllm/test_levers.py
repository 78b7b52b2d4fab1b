"""Both memory levers on the same real engines, in the order ``policy.levers`` gives (levers_probe.py):
remap first, then a pipeline group joined from remapped, the group let go first, the remap after;
greedy outputs token-identical at every stage, a fault in the join from remapped rolled back."""

import pytest

from .conftest import BURST_KV_BYTES, run_script

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def levers_run(burst_model):
    return run_script("levers_probe.py", [burst_model, BURST_KV_BYTES], timeout=600)[0]


def test_outputs_stay_token_identical_through_remap_group_leave_and_revert(levers_run):
    r = levers_run
    assert all(x["outcome"] == "ok" for x in r["remaps"] + r["joins"] + r["leaves"]), r
    assert r["same"] == {k: [True, True] for k in ("remapped", "abandoned", "grouped", "left", "reverted")}, r["same"]
    assert all(s["problems"] == [] for stage in r["stages"].values() for s in stage), r["stages"]


def test_a_remapped_engine_joins_keeping_the_layers_it_still_runs_streamed(levers_run):
    r = levers_run
    rem, grp, left = r["stages"]["remapped"], r["stages"]["grouped"], r["stages"]["left"]
    for i in range(2):
        streamed, drop = set(rem[i]["streamed"]), set(r["plans"][i])
        assert rem[i]["phase"] == "remapped" and len(streamed) == 3 and rem[i]["blocks"] > r["stages"]["base"][i]["blocks"]
        assert streamed & drop and streamed - drop, (streamed, drop)   # some go to the peer, some stay
        assert grp[i]["phase"] == "grouped" and set(grp[i]["streamed"]) == streamed - drop
        assert set(grp[i]["dropped"]) == drop and grp[i]["blocks"] > rem[i]["blocks"]
        assert r["joins"][i]["unstreamed"] == sorted(streamed & drop)
        # out of the group: remapped by the layers it kept streaming, its KV grown back into them
        assert left[i]["phase"] == "remapped" and set(left[i]["streamed"]) == streamed - drop
        assert left[i]["dropped"] == [] and left[i]["blocks"] > r["stages"]["base"][i]["blocks"]
        assert r["stages"]["reverted"][i]["phase"] == "base"
        assert r["stages"]["reverted"][i]["blocks"] == r["stages"]["base"][i]["blocks"]
    # the remap room each engine publishes (what the fleet's lever order waits for) shrinks as it remaps
    # and is 0 while grouped (a grouped engine does not remap)
    assert all(g["room"] == 0 for g in grp)
    assert all(rm["room"] < b["room"] for rm, b in zip(rem, r["stages"]["base"]))


def test_a_fault_joining_from_remapped_leaves_both_engines_remapped_as_they_were(levers_run):
    r = levers_run
    rem = r["stages"]["remapped"]
    for f in r["faults"]:
        assert any(f["errors"]), f
        assert [a["phase"] for a in f["after"]] == ["remapped", "remapped"], f
        assert [a["streamed"] for a in f["after"]] == [x["streamed"] for x in rem], f
        assert [a["blocks"] for a in f["after"]] == [x["blocks"] for x in rem], f
        assert all(a["problems"] == [] for a in f["after"]) and f["same"] == [True, True], f


def test_a_remapped_member_that_abandons_its_group_is_remapped_again_within_what_it_maps(levers_run):
    """A lost peer: each member abandons the group joined from remapped. It comes back remapped by the
    layers it kept streaming, its scheduler using no block its workers do not map (the three-lever
    run's second segfault: the scheduler kept the group's count after an abandon, above what was mapped)."""
    r = levers_run
    rem, ab = r["stages"]["remapped2"], r["stages"]["abandoned"]
    assert all(x["outcome"] == "ok" for x in r["abandon_joins"] + r["abandons"]), r
    for i in range(2):
        kept = set(rem[i]["streamed"]) - set(r["plans"][i])
        assert ab[i]["phase"] == "remapped" and set(ab[i]["streamed"]) == kept and ab[i]["dropped"] == []
        assert ab[i]["problems"] == [] and r["stages"]["base"][i]["blocks"] < ab[i]["blocks"]
