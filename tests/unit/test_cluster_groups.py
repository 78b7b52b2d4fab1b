"""The cluster's group controller (cluster/control/groups.py) against fake engines: what each member is
asked to do, the re-prefill fallback, partial joins, and the monitor's own decisions."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from vllm_kunserve.cluster.control.groups import GroupController, GroupOpError
from vllm_kunserve.cluster.control.monitor import FlightBook
from vllm_kunserve.config import parse_config
from vllm_kunserve.engine.state import EngineState

pytestmark = pytest.mark.unit

L = 8


def _state(i, used=0, queued=0, total=88):
    return {"engine": {"stage": [f"unix:///tmp/s{i}"]}, "phase": "base",
            "capacity": {"blocks_total": total, "blocks_base": total, "block_bytes": 1 << 16, "block_size": 32},
            "blocks": {"used": used, "queued": queued, "draining": 0},
            "layers": [{"index": k, "state": "resident", "bytes": 3 << 20} for k in range(L)]}


class FakeFront:
    def __init__(self, n, cfg=None):
        self.registry = CollectorRegistry()
        self.token = ""
        self.events = []
        self.fleet = SimpleNamespace(engines=[SimpleNamespace(index=i, accepting=True, control_url=f"http://c{i}")
                                              for i in range(n)])
        self.states = {i: _state(i) for i in range(n)}
        self.monitor = SimpleNamespace(reports={i: SimpleNamespace(ok=True, state=self.states[i]) for i in range(n)})
        self.book = FlightBook()   # what the front end relays (empty: no request awaits a first token)

    def record(self, kind, **info):
        self.events.append({"event": kind, **info})


def _controller(n, cfg=None, fail=None):
    front = FakeFront(n)
    gc = GroupController(front, parse_config(cfg or {}))
    calls = []

    async def op(i, name, body, timeout_s):
        calls.append((i, name, body))
        if fail and fail(i, name, body):
            raise GroupOpError(f"instance {i} {name} failed")
        if name == "group_join":
            return {"bytes": 10, "blocks_before": 88, "blocks_after": 130, "recomputed": 3 if body["transition"] == "reprefill" else 0}
        if name == "group_restage":
            return {"bytes": 20, "blocks_before": 130, "blocks_after": 170, "moved_regions": 2}
        return {"draining": 0}

    async def fresh(members):
        return {i: EngineState.from_dict(front.states[i]) for i in members}
    gc._op, gc._fresh_states = op, fresh
    return front, gc, calls


def test_form_asks_each_member_to_keep_its_stage_and_host_the_others():
    front, gc, calls = _controller(3)
    ev = asyncio.run(gc.form([2, 0, 1]))
    joins = {i: b for i, name, b in calls if name == "group_join"}
    assert ev["stages"] == {"0": [0, 3], "1": [3, 6], "2": [6, 8]}
    assert joins[0]["drop"] == [3, 4, 5, 6, 7] and joins[0]["spans"] == [[3, 6, "e1"], [6, 8, "e2"]]
    assert joins[2]["drop"] == [0, 1, 2, 3, 4, 5] and joins[2]["spans"] == [[0, 3, "e0"], [3, 6, "e1"]]
    assert joins[1]["peers"] == {"e0": {"stage": "unix:///tmp/s0", "blocks": 88},
                                 "e2": {"stage": "unix:///tmp/s2", "blocks": 88}}
    assert all(b["transition"] == "kv" for b in joins.values())
    assert gc.view()[0]["state"] == "grouped" and gc.group_of(1).members == [0, 1, 2]
    with pytest.raises(GroupOpError, match="already in group"):
        asyncio.run(gc.form([1, 2]))


def test_a_failed_kv_exchange_is_retried_by_reprefill():
    front, gc, calls = _controller(2, fail=lambda i, name, b: name == "group_join" and b["transition"] == "kv")
    ev = asyncio.run(gc.form([0, 1]))
    assert ev["transition"] == "reprefill" and ev["reason"] == "forced+fallback"
    assert ev["recomputed"] == {"0": 3, "1": 3}
    outcomes = [(e["event"], e["outcome"]) for e in front.events if e["event"] == "group_join"]
    assert outcomes == [("group_join", "failed"), ("group_join", "ok")]


def test_members_that_joined_while_another_failed_abandon_the_group_at_once():
    """A member that joined while another failed has no peer to drain with: it is told to abandon
    (layers from the host copies, requests recomputed), and the group is gone; the ids of the
    attempt's members are one, so a retry's barriers never meet this attempt's."""
    front, gc, calls = _controller(2, fail=lambda i, name, b: name == "group_join" and i == 1)
    with pytest.raises(GroupOpError):
        asyncio.run(gc.form([0, 1], transition="reprefill"))
    leaves = [(i, b["step"]) for i, name, b in calls if name == "group_leave"]
    assert leaves == [(0, "abandon")]
    assert gc.view() == [] and gc.group_of(0) is None
    joins = [b["join_id"] for i, name, b in calls if name == "group_join"]
    assert len(set(joins)) == 1
    calls.clear()
    with pytest.raises(GroupOpError):
        asyncio.run(gc.form([0, 1], transition="reprefill"))
    assert {b["join_id"] for i, name, b in calls if name == "group_join"}.isdisjoint(joins)


def test_monitor_forms_a_group_when_demand_exceeds_capacity_and_not_before():
    cfg = {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 0.0}}
    front, gc, calls = _controller(2, cfg)
    asyncio.run(gc.on_poll({}))
    assert not calls and gc.last["overload"]["overloaded"] is False
    front.states[0]["blocks"].update(used=80, queued=40)
    front.states[1]["blocks"].update(used=70)
    asyncio.run(gc.on_poll({}))
    joins = [c for c in calls if c[1] == "group_join"]
    assert len(joins) == 2 and gc.view()[0]["reason"] == "overload"
    ev = next(e for e in front.events if e["event"] == "group_join")
    assert ev["inputs"]["overloaded"] and ev["decision"]["groups"][0]["instances"] == [0, 1]


def test_the_lever_order_waits_for_the_engines_remap_then_drops_and_says_so():
    """``policy.levers`` in the fleet: while the engines' published remap room covers what the drop
    would free, no member is asked to join (a ``lever`` event and metric say why); once the room is
    short the group forms, with the event naming the drop lever."""
    cfg = {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 0.0, "remap_first_s": 60.0}}
    front, gc, calls = _controller(2, cfg)
    front.states[0]["blocks"].update(used=80, queued=40)
    front.states[1]["blocks"].update(used=70)
    for i in range(2):   # each could still give 40 blocks to its KV by remapping
        front.states[i]["remap_room_bytes"] = 40 << 16
    for _ in range(2):
        asyncio.run(gc.on_poll({}))
    assert not [c for c in calls if c[1] == "group_join"] and gc.last["lever"]["lever"] == "remap"
    levers = [e for e in front.events if e["event"] == "lever"]
    assert len(levers) == 1 and levers[0]["lever"] == "remap" and levers[0]["room_blocks"] == 80
    assert gc.m_lever.labels("remap")._value.get() == 1
    for i in range(2):   # the engines remapped what they could: no room left, the demand still over
        front.states[i]["remap_room_bytes"] = 0
    asyncio.run(gc.on_poll({}))
    assert len([c for c in calls if c[1] == "group_join"]) == 2
    assert [e["lever"] for e in front.events if e["event"] == "lever"] == ["remap", "drop"]
    drop = next(e for e in front.events if e["event"] == "lever" and e["lever"] == "drop")
    assert "remap room of 0 blocks is short" in drop["reason"]
    assert gc.m_lever.labels("drop")._value.get() == 1


def test_monitor_off_when_drop_is_disabled_and_shortfall_reported():
    front, gc, calls = _controller(2, {"drop": {"enable": False}})
    front.states[0]["blocks"].update(used=500)
    asyncio.run(gc.on_poll({}))
    assert not calls and gc.auto is False
    front, gc, calls = _controller(2, {"drop": {"trigger_ratio": 0.5, "forecast_horizon_s": 0.0}})
    front.states[0]["blocks"].update(used=10_000)  # no plan frees that much
    asyncio.run(gc.on_poll({}))
    assert gc.last["plan"]["satisfied"] is False
    assert gc.m_shortfall._value.get() > 0


def test_an_operator_switches_the_monitor_on_and_off_at_run_time():
    """``drop.enable: false`` starts the monitor off; ``set_auto`` (the front end's ``auto``
    operation) switches it on, from a fresh demand history, and off again."""
    cfg = {"drop": {"enable": False, "trigger_ratio": 0.9, "forecast_horizon_s": 0.0}}
    front, gc, calls = _controller(2, cfg)
    front.states[0]["blocks"].update(used=80, queued=40)
    front.states[1]["blocks"].update(used=70)
    asyncio.run(gc.on_poll({}))
    assert not calls and gc.auto is False
    gc.lstate = gc.lstate.__class__(gc.lstate.monitor.__class__(deferred_since=1.0))   # a history left over
    assert gc.set_auto(True) is False and gc.auto is True
    assert gc.lstate.monitor.deferred_since is None       # started over
    asyncio.run(gc.on_poll({}))
    assert len([c for c in calls if c[1] == "group_join"]) == 2 and gc.view()[0]["reason"] == "overload"
    assert gc.set_auto(False) is True and gc.auto is False
    n = len(calls)
    front.states[0]["blocks"].update(used=0, queued=0)
    front.states[1]["blocks"].update(used=0)
    for _ in range(3):   # low demand: no restore either while off
        asyncio.run(gc.on_poll({}))
    assert len(calls) == n and gc.view()[0]["state"] == "grouped"


def test_forget_marks_the_group_of_a_dead_member():
    front, gc, calls = _controller(2)
    asyncio.run(gc.form([0, 1]))
    gc.forget(1)
    assert gc.view() == [] and front.events[-1]["event"] == "group_lost"


def test_static_group_forms_once_all_are_up_and_is_never_restored():
    front, gc, calls = _controller(2, {"drop": {"static_group": True}, "restore": {"hold_s": 0}})
    front.fleet.engines[1].accepting = False
    asyncio.run(gc.on_poll({}))
    assert not calls                                   # waits for every instance
    front.fleet.engines[1].accepting = True
    asyncio.run(gc.on_poll({}))
    assert [c[0] for c in calls if c[1] == "group_join"] == [0, 1] and gc.view()[0]["reason"] == "static"
    for _ in range(3):                                 # idle: demand far below the restore threshold
        asyncio.run(gc.on_poll({}))
    assert [c for c in calls if c[1] != "group_join"] == [] and gc.view()[0]["state"] == "grouped"
    front, gc, calls = _controller(2, {"restore": {"hold_s": 0}})   # a monitor-formed group is restored
    asyncio.run(gc.form([0, 1]))
    for _ in range(3):
        asyncio.run(gc.on_poll({}))
    assert any(c[1] == "group_leave" for c in calls)


def test_monitor_plans_with_each_engines_kv_cap_and_reports_the_rest_as_shortfall():
    """The engines' ``capacity.blocks_max`` reaches the planner: capped at their base (the KV cache
    cannot grow) no group is formed, the whole need is the shortfall; with room to grow it forms."""
    cfg = {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 0.0, "headroom_ratio": 0.0}}
    front, gc, calls = _controller(2, cfg)
    for s in front.states.values():
        s["capacity"]["blocks_max"] = 88
        s["blocks"].update(used=88, queued=20)
    asyncio.run(gc.on_poll({}))
    assert not [c for c in calls if c[1] == "group_join"]
    assert gc.last["plan"]["freed_bytes"] == 0 and not gc.last["plan"]["groups"]
    need = gc.last["overload"]["need_blocks"]
    assert need > 0 and gc.m_shortfall._value.get() == pytest.approx(need)
    for s in front.states.values():
        s["capacity"]["blocks_max"] = 176
    asyncio.run(gc.on_poll({}))
    assert len([c for c in calls if c[1] == "group_join"]) == 2


def test_an_engine_grouped_without_a_live_group_is_told_to_abandon():
    """An engine whose state says grouped while the controller holds no live group for it (its
    peer died and the group was forgotten, or a join formed only on it) takes its layers back at
    the next period, instead of waiting for a step to find its peer gone."""
    front, gc, calls = _controller(2, {"drop": {"enable": False}})
    front.states[1]["phase"] = "grouped"
    asyncio.run(gc.on_poll({}))
    assert [(i, name, b["step"]) for i, name, b in calls] == [(1, "group_leave", "abandon")]
    calls.clear()
    front.states[1]["phase"] = "base"
    asyncio.run(gc.on_poll({}))
    assert calls == []


def test_monitor_groups_engines_of_one_host_only():
    """Engines report their host (the agent's ``engine.host``): under the same overload as above,
    engines 0 and 2 share a host and group, 1 and 3 another; no group spans the two."""
    cfg = {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 0.0}}
    front, gc, calls = _controller(4, cfg)
    for i in range(4):
        front.states[i]["engine"]["host"] = f"node{i % 2}"
        front.states[i]["blocks"].update(used=86, queued=40)
    asyncio.run(gc.on_poll({}))
    groups = sorted(g["members"] for g in gc.view())
    assert groups and all(set(m) in ({0, 2}, {1, 3}) for m in groups), groups
    joined = {i for i, name, b in calls if name == "group_join"}
    assert joined and all(len({j % 2 for j in g}) == 1 for g in groups)


def test_an_operators_group_across_hosts_is_refused_before_any_member_is_asked():
    """/kunserve/ops drop names instances of two hosts (two Ray nodes): refused in one line naming each
    one's host, no member asked anything; the same instances on one host group."""
    front, gc, calls = _controller(2)
    front.states[0]["engine"]["host"], front.states[1]["engine"]["host"] = "ray-node-a", "ray-node-b"
    with pytest.raises(GroupOpError, match="different hosts .*0: ray-node-a, 1: ray-node-b"):
        asyncio.run(gc.form([0, 1]))
    assert calls == [] and gc.view() == []
    front.states[1]["engine"]["host"] = "ray-node-a"
    asyncio.run(gc.form([0, 1]))
    assert gc.group_of(0).members == [0, 1]


@pytest.mark.parametrize("failing", [{1}, {0, 1}])
def test_a_failed_leave_keeps_the_group_or_abandons_the_members_left_behind(failing):
    """The leave's finish fails on some members (each rolled back, still grouped): where every
    member failed the group is grouped again (a later restore retries); where some left, the
    others have no peer any more and are told to abandon. Never stuck leaving."""
    front, gc, calls = _controller(2, fail=lambda i, name, b: name == "group_leave" and b["step"] == "finish"
                                   and i in failing)
    asyncio.run(gc.form([0, 1]))
    g = gc.groups[0]
    asyncio.run(gc.begin_leave(g))
    asyncio.run(gc._finish_leave(g))
    finishes = [b["leave_id"] for i, name, b in calls if name == "group_leave" and b["step"] == "finish"]
    assert len(set(finishes)) == 1
    abandons = [i for i, name, b in calls if name == "group_leave" and b["step"] == "abandon"]
    if failing == {0, 1}:
        assert g.state == "grouped" and abandons == []
        asyncio.run(gc.begin_leave(g))
        asyncio.run(gc._finish_leave(g))   # a retry is another attempt: another id
        ids = [b["leave_id"] for i, name, b in calls if name == "group_leave" and b["step"] == "finish"]
        assert len(set(ids)) == 2
    else:
        assert g.state == "split" and abandons == [1] and gc.view() == []


def test_a_group_forgotten_while_its_leave_fails_stays_forgotten():
    """A member dies during the leave's finish: the group was forgotten (split) meanwhile, and the
    finish's failures must not bring it back as grouped (the survivors abandon by the orphan rule)."""
    front, gc, calls = _controller(2, fail=lambda i, name, b: name == "group_leave" and b["step"] == "finish")
    asyncio.run(gc.form([0, 1]))
    g = gc.groups[0]
    asyncio.run(gc.begin_leave(g))
    gc.forget(1)
    asyncio.run(gc._finish_leave(g))
    assert g.state == "split" and gc.group_of(0) is None


def test_an_engine_that_dies_mid_operation_is_a_group_error_not_a_crash():
    """A member killed while the controller talks to it (connection reset, refused) fails the
    operation as a GroupOpError (the operator's drop answers 409), and a partial join still
    abandons the members that joined."""
    import aiohttp

    front, gc, calls = _controller(2)
    real = gc._op

    async def op(i, name, body, timeout_s):
        if name == "group_join" and i == 1:
            raise GroupOpError("instance 1 group_join: no answer (ServerDisconnectedError)")
        return await real(i, name, body, timeout_s)
    gc._op = op
    with pytest.raises(GroupOpError, match="did not form"):
        asyncio.run(gc.form([0, 1], transition="reprefill"))
    assert [(i, b["step"]) for i, name, b in calls if name == "group_leave"] == [(0, "abandon")]

    class Dead:
        async def op(self, *a, **k):
            raise aiohttp.ClientConnectionError("Connection refused")
    gc2 = GroupController(FakeFront(2), parse_config({}))
    gc2._client = lambda: Dead()
    gc2.front.session = None
    with pytest.raises(GroupOpError, match="instance 0 group_join: no answer .*Connection refused"):
        asyncio.run(gc2._op(0, "group_join", {}, 1.0))


def test_a_regroup_keeps_the_kv_each_member_restaging_to_a_sub_range_of_what_it_holds():
    """Two live pairs merged into one group of four (the KV exchange, the default transition): every
    member is asked at once to restage, each to a quarter inside the half it holds (pipeline order
    e0, e2, e1, e3: nothing reloads), with the same holder of every (member, layer) on all; nothing is
    recomputed. A group taken in only in part is refused before anything is asked of an engine."""
    front, gc, calls = _controller(4)
    asyncio.run(gc.form([0, 1]))
    asyncio.run(gc.form([2, 3]))
    calls.clear()
    with pytest.raises(GroupOpError, match="only whole"):
        asyncio.run(gc.form([1, 2]))
    with pytest.raises(GroupOpError, match="already form group 2"):   # a drop that would change nothing
        asyncio.run(gc.form([3, 2]))
    assert calls == []
    ev = asyncio.run(gc.form([0, 1, 2, 3]))
    assert [name for i, name, b in calls] == ["group_restage"] * 4
    assert ev["stages"] == {"0": [0, 2], "1": [4, 6], "2": [2, 4], "3": [6, 8]}
    assert ev["regrouped"] == [[0, 1], [2, 3]] and ev["kept_kv"] and sum(ev["recomputed"].values()) == 0
    bodies = {i: b for i, name, b in calls}
    order = [[0, 2, "e0"], [2, 4, "e2"], [4, 6, "e1"], [6, 8, "e3"]]
    assert all(b["holders"] == {f"e{o}": order for o in range(4)} for b in bodies.values())
    assert bodies[1]["spans"] == [s for s in order if s[2] != "e1"] and sorted(bodies[1]["peers"]) == ["e0", "e2", "e3"]
    assert bodies[1]["members"] == {f"e{j}": f"unix:///tmp/s{j}" for j in range(4)}
    assert len({b["restage_id"] for b in bodies.values()}) == 1
    (regroup,) = [e for e in front.events if e["event"] == "group_regroup"]
    assert regroup["outcome"] == "ok" and regroup["kept_kv"] and regroup["members"] == [[0, 1], [2, 3]]
    assert [(g["members"], g["state"]) for g in gc.view()] == [([0, 1, 2, 3], "grouped")]
    assert gc.m_ops.labels("regroup", "ok")._value.get() == 1


def test_a_regroup_with_a_member_gone_asks_nothing_and_keeps_the_groups():
    """A member is not live when the regroup starts: nothing is asked of any engine, the live pairs
    stay as they are, and there is no re-prefill retry (it would dissolve them first, for nothing)."""
    front, gc, calls = _controller(4)
    asyncio.run(gc.form([0, 1]))
    asyncio.run(gc.form([2, 3]))
    calls.clear()
    async def fresh(members):   # the real read's refusal (the stand-in reads every state)
        raise GroupOpError("instance 3 is not a live group member")
    gc._fresh_states = fresh
    with pytest.raises(GroupOpError, match="regroup into .*instance 3 is not a live group member"):
        asyncio.run(gc.form([0, 1, 2, 3]))
    assert calls == [] and not gc.busy
    assert [(g["members"], g["state"]) for g in gc.view()] == [([0, 1], "grouped"), ([2, 3], "grouped")]


def test_a_live_pair_and_two_lone_instances_restage_into_four_together():
    front, gc, calls = _controller(4)
    asyncio.run(gc.form([0, 1]))
    calls.clear()
    ev = asyncio.run(gc.form([0, 1, 2, 3]))
    assert [name for i, name, b in calls] == ["group_restage"] * 4
    assert ev["stages"] == {"0": [0, 2], "2": [2, 4], "3": [4, 6], "1": [6, 8]}   # 0 and 1 keep sub-ranges
    assert {i: b["name"] for i, name, b in calls} == {i: f"e{i}" for i in range(4)}
    assert {i: b["grouped"] for i, name, b in calls} == {0: True, 1: True, 2: False, 3: False}
    (regroup,) = [e for e in front.events if e["event"] == "group_regroup"]
    assert regroup["lone"] == [2, 3] and regroup["members"] == [[0, 1]] and regroup["outcome"] == "ok"


def test_a_regroup_keeping_the_kv_that_fails_on_one_member_forms_the_group_from_lone_engines():
    """One member's restage fails (it abandoned its group itself): the others are told to abandon
    theirs (their requests recomputed), then the four form by the usual join from lone engines."""
    front, gc, calls = _controller(4, fail=lambda i, name, b: name == "group_restage" and i == 2)
    asyncio.run(gc.form([0, 1]))
    asyncio.run(gc.form([2, 3]))
    calls.clear()
    ev = asyncio.run(gc.form([0, 1, 2, 3]))
    steps = [(i, name, b.get("step")) for i, name, b in calls]
    assert steps[:4] == [(i, "group_restage", None) for i in range(4)]
    assert steps[4:7] == [(i, "group_leave", "abandon") for i in (0, 1, 3)]
    assert steps[7:] == [(i, "group_join", None) for i in range(4)]
    (regroup,) = [e for e in front.events if e["event"] == "group_regroup"]
    assert regroup["outcome"] == "failed" and list(regroup["errors"]) == [2] and regroup["kept_kv"]
    assert ev["regrouped"] == [[0, 1], [2, 3]] and ev["transition"] == "kv" and "kept_kv" not in ev
    assert [(g["members"], g["state"]) for g in gc.view()] == [([0, 1, 2, 3], "grouped")]
    assert gc.m_ops.labels("regroup", "failed")._value.get() == 1


def test_a_regroup_by_reprefill_dissolves_whole_live_groups_then_forms_the_larger_one():
    """Two live groups merged into one of four by re-prefill: every member of both abandons its
    group first (its layers back from the host copies, its requests recomputed), then all four join
    with quarter stages."""
    front, gc, calls = _controller(4)
    asyncio.run(gc.form([0, 1]))
    asyncio.run(gc.form([2, 3]))
    calls.clear()
    ev = asyncio.run(gc.form([0, 1, 2, 3], transition="reprefill"))
    steps = [(name, b.get("step")) for i, name, b in calls]
    assert steps[:4] == [("group_leave", "abandon")] * 4 and steps[4:] == [("group_join", None)] * 4
    assert all(b["reason"] == "regroup into [0, 1, 2, 3]" for i, name, b in calls[:4])
    assert ev["stages"] == {"0": [0, 2], "1": [2, 4], "2": [4, 6], "3": [6, 8]}
    assert ev["regrouped"] == [[0, 1], [2, 3]] and sum(ev["recomputed"].values()) > 0
    (regroup,) = [e for e in front.events if e["event"] == "group_regroup"]
    assert regroup["outcome"] == "ok" and regroup["members"] == [[0, 1], [2, 3]] and regroup["groups"] == [1, 2]
    assert [(g["members"], g["state"]) for g in gc.view()] == [([0, 1, 2, 3], "grouped")]
    assert gc.m_ops.labels("regroup", "ok")._value.get() == 1


def test_a_regroup_whose_abandon_fails_stops_there_and_is_not_retried():
    """A member that cannot abandon its group is not at its base: the larger group is not formed
    (nor retried by re-prefill); the old groups are gone from the controller, the members that did
    abandon serve alone and the one that failed is left to the orphan rule."""
    front, gc, calls = _controller(4, fail=lambda i, name, b: name == "group_leave" and i == 2)
    asyncio.run(gc.form([0, 1]))
    asyncio.run(gc.form([2, 3]))
    calls.clear()
    with pytest.raises(GroupOpError, match="regroup into"):
        asyncio.run(gc.form([0, 1, 2, 3], transition="reprefill"))
    assert [name for i, name, b in calls] == ["group_leave"] * 4   # no join, no re-prefill retry
    assert gc.view() == [] and not gc.busy
    (regroup,) = [e for e in front.events if e["event"] == "group_regroup"]
    assert regroup["outcome"] == "failed" and list(regroup["errors"]) == [2]
    front.states[2]["phase"] = "grouped"   # what the engine that failed still says: told to abandon next period
    calls.clear()
    asyncio.run(gc.on_poll({}))
    assert [(i, b["step"]) for i, name, b in calls if name == "group_leave"] == [(2, "abandon")]


def test_the_monitor_regroups_live_groups_only_with_drop_regroup():
    """Demand beyond what two pairs hold: with ``drop.regroup`` the monitor's plan merges them into one
    group of four, which the controller forms by restaging both; without it nothing is asked."""
    for regroup in (False, True):
        cfg = {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 0.0, "regroup": regroup}}
        front, gc, calls = _controller(4, cfg)
        asyncio.run(gc.form([0, 1]))
        asyncio.run(gc.form([2, 3]))
        calls.clear()
        for s in front.states.values():
            s["capacity"]["blocks_total"] = 130
            s["blocks"].update(used=130, queued=60)
        asyncio.run(gc.on_poll({}))
        if not regroup:
            assert calls == [] and not gc.last["plan"]["groups"]
            continue
        assert [name for i, name, b in calls] == ["group_restage"] * 4
        assert [(g["members"], g["state"], g["reason"]) for g in gc.view()] == [([0, 1, 2, 3], "grouped", "overload")]


@pytest.mark.parametrize("fail_on", [None, 2])
def test_the_monitor_steps_a_group_of_four_down_into_pairs_keeping_the_kv(fail_on):
    """Demand falls to where the four's requests would not fit back in its members alone but would
    in two pairs: with ``drop.regroup`` the restore steps down. Each member drains to its count in
    its pair (its count now less the two layers it takes back), then all four restage at once into
    the pairs, alternating by stage so each keeps the layers it holds. Where one member fails, every
    member ends alone (the others told to abandon), the group split, no pair formed."""
    cfg = {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 0.0, "regroup": True}, "restore": {"hold_s": 0.0}}
    front, gc, calls = _controller(6, cfg, fail=lambda i, name, b: name == "group_restage" and i == fail_on)
    asyncio.run(gc.form([0, 1, 2, 3]))
    calls.clear()
    for i, s in front.states.items():   # a layer is 48 blocks: in the four each has 88 + 6 x 48 = 376
        if i < 4:
            s.update(phase="grouped")
            s["capacity"]["blocks_total"] = 376
            s["blocks"].update(used=80)   # 320 of the four's 352 base blocks: over the trigger alone
        else:
            s["capacity"].update(blocks_total=1000, blocks_base=1000)   # idle: the cluster is far below
    asyncio.run(gc.on_poll({}))
    begins = {i: b for i, name, b in calls if name == "group_leave"}
    assert [name for i, name, b in calls] == ["group_leave"] * 4
    assert begins == {i: {"step": "begin", "blocks": 376 - 2 * 48} for i in range(4)}
    (four,) = [g for g in gc.groups if g.state == "leaving"]
    assert four.step["into"] == [[0, 2], [1, 3]] and gc.view()[0]["into"] == [[0, 2], [1, 3]]
    assert gc.last["restore"]["restore"][0]["reason"] == "low_demand_step"
    calls.clear()
    for i in range(4):
        front.states[i].update(phase="group_draining")
        front.monitor.reports[i].engine_state = None
    asyncio.run(gc.on_poll({}))
    restages = {i: b for i, name, b in calls if name == "group_restage"}
    assert sorted(restages) == [0, 1, 2, 3] and len({b["restage_id"] for b in restages.values()}) == 1
    assert restages[0]["spans"] == [[4, 8, "e2"]] and restages[3]["spans"] == [[0, 4, "e1"]]
    assert restages[0]["peers"] == {"e2": {"stage": "unix:///tmp/s2", "blocks": 280}}
    assert restages[1]["members"] == {f"e{j}": f"unix:///tmp/s{j}" for j in range(4)}
    pair = {"e0": [[0, 4, "e0"], [4, 8, "e2"]], "e1": [[0, 4, "e1"], [4, 8, "e3"]]}
    assert all(b["holders"] == {**pair, "e2": pair["e0"], "e3": pair["e1"]} for b in restages.values())
    (ev,) = [e for e in front.events if e["event"] == "group_step_down"]
    assert four.state == "split" and ev["kept_kv"] and ev["into"] == [[0, 2], [1, 3]]
    abandons = sorted(i for i, name, b in calls if name == "group_leave" and b["step"] == "abandon")
    if fail_on is None:
        assert ev["outcome"] == "ok" and abandons == []
        assert sorted((g["members"], g["state"], g["stages"]) for g in gc.view()) == [
            ([0, 2], "grouped", {"0": [0, 4], "2": [4, 8]}), ([1, 3], "grouped", {"1": [0, 4], "3": [4, 8]})]
    else:
        assert ev["outcome"] == "failed" and list(ev["errors"]) == [2] and abandons == [0, 1, 3]
        assert gc.view() == [] and gc.m_ops.labels("step_down", "failed")._value.get() == 1


def test_an_operators_step_down_names_a_group_of_four_or_more_and_drains_to_the_halves_counts():
    front, gc, calls = _controller(4)
    asyncio.run(gc.form([0, 1]))
    with pytest.raises(GroupOpError, match="four or more"):
        asyncio.run(gc.restore(1, step=True))
    with pytest.raises(GroupOpError, match="four or more"):
        asyncio.run(gc.restore(None, step=True))
    asyncio.run(gc.form([0, 1, 2, 3]))
    for i, s in front.states.items():
        s["capacity"]["blocks_total"] = 376
    calls.clear()
    asyncio.run(gc.restore(2, step=True))
    assert {i: b for i, name, b in calls} == {i: {"step": "begin", "blocks": 280} for i in range(4)}
    (g,) = [g for g in gc.groups if g.state == "leaving"]
    # stage order 0, 2, 3, 1 (the lone 2 and 3 took quarters beside 0): halves alternate, (0, 3) and (2, 1)
    assert g.reason == "forced step" and g.step["into"] == [[0, 3], [1, 2]]
    calls.clear()
    g.state = "grouped"
    asyncio.run(gc.restore(2))        # a plain restore afterwards: every member alone
    assert {i: b for i, name, b in calls} == {i: {"step": "begin"} for i in range(4)} and g.step is None


def test_the_status_view_shows_the_host_an_engine_groups_by():
    """/kunserve/status's ``kv.engine.host`` is the host in the engine's info, the one the planner and
    form() group by (a Ray node's id under Ray), not a top-level key the state does not have."""
    from vllm_kunserve.cluster.control.monitor import EngineReport

    state = _state(0)
    state["engine"]["host"] = "ray-node-a1b2"
    assert EngineReport(0, ok=True, state=state).view()["engine"]["host"] == "ray-node-a1b2"
    assert EngineState.from_dict(state).engine.get("host") == "ray-node-a1b2"
