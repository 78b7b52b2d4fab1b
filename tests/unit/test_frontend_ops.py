"""The operator's operations (``cluster.frontend.ops``), one handler each, against a stand-in front
end: every parameter a handler cannot take is a 400 naming it, a request not in flight a 404, an
operation the fleet cannot do now a 409, and a refused operation changes nothing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from vllm_kunserve.cluster.control.groups import GroupOpError
from vllm_kunserve.cluster.frontend import ops
from vllm_kunserve.cluster.frontend.validate import BadRequest

pytestmark = pytest.mark.unit


def _flight(rid, instance, movable=True):
    return SimpleNamespace(rid=rid, visible_id=f"cmpl-{rid}", instance=instance, generated=[1, 2],
                           checked=SimpleNamespace(movable=movable), move=None)


class FakeGroups:
    def __init__(self, busy=False, fail=False, static=False):
        self.busy, self.fail, self.calls = busy, fail, []
        self.cfg = SimpleNamespace(drop=SimpleNamespace(static_group=static))

    async def form(self, members, transition=None):
        self.calls.append(("form", members, transition))
        if self.fail:
            raise GroupOpError("instance 1 group_join: 500")
        return {"group": 1, "members": members}

    def set_auto(self, enable):
        self.calls.append(("auto", enable))
        was, self.auto = getattr(self, "auto", False), enable
        return was

    async def restore(self, gid=None, step=False):
        self.calls.append(("restore", gid) + (("step",) if step else ()))
        if self.fail:
            raise GroupOpError(f"no grouped group {gid}")
        return [{"group": 1, "state": "leaving"}]


def _front(groups=None, planner=None):
    flights = {"a": _flight("a", 0), "b": _flight("b", 1, movable=False)}
    killed, events = [], []

    async def pick(f, exclude):
        return next(i for i in range(3) if i not in exclude)

    front = SimpleNamespace(
        fleet=SimpleNamespace(engines=[object()] * 3, kill=killed.append), flights=flights,
        by_visible={f.visible_id: f for f in flights.values()}, arrivals={}, pick=pick, dispatch="least-work",
        migrating=False, plan_migrations=planner, groups=groups, killed=killed, events=events,
        record=lambda kind, **info: events.append((kind, info)))
    front.find = lambda key: (front.by_visible.get(key) or front.flights.get(key)) if isinstance(key, str) else None
    return front


def _run(front, op, body):
    try:
        return 200, asyncio.run(ops.run_op(front, op, body))
    except BadRequest as e:
        return e.status, e


REFUSED = [
    # (op, body, status, param or needle)
    ("kill", {}, 400, "instance"),
    ("kill", {"instance": 3}, 400, "instance"),
    ("kill", {"instance": True}, 400, "instance"),
    ("kill", {"instance": "0"}, 400, "instance"),
    ("kill", {"request_id": ""}, 400, "request_id"),
    ("kill", {"request_id": None}, 400, "request_id"),
    ("kill", {"request_id": "no-such"}, 404, "request_id"),
    ("migrate", {"request_id": "a", "wait_s": -1}, 400, "wait_s"),
    ("migrate", {"request_id": "a", "wait_s": 601}, 400, "wait_s"),
    ("migrate", {"request_id": "a", "wait_s": True}, 400, "wait_s"),
    ("migrate", {"request_id": "no-such"}, 404, "request_id"),
    ("migrate", {"request_id": 7}, 404, "request_id"),
    ("migrate", {"request_id": "a", "to": 0}, 400, "to"),   # where it runs
    ("migrate", {"request_id": "a", "to": 3}, 400, "to"),
    ("migrate", {"request_id": "a", "to": False}, 400, "to"),
    ("migrate", {"request_id": "a", "to": 1, "method": "teleport"}, 400, "method"),
    ("migrate", {"request_id": "a", "to": 1, "at_token": -1}, 400, "at_token"),
    ("migrate", {"request_id": "a", "to": 1, "at_token": 1.5}, 400, "at_token"),
    ("migrate", {"request_id": "b", "to": 0}, 409, "cannot move"),
    ("dispatch", {}, 400, "mode"),
    ("dispatch", {"mode": "fastest"}, 400, "mode"),
    ("dispatch", {"mode": ["mell"]}, 400, "mode"),
    ("dispatch", {"mode": "mell"}, 400, "mode"),   # no migration planner
    ("drop", {"instances": [0, 1]}, 409, "--kunserve-config"),
    ("restore", {}, 409, "--kunserve-config"),
    ("auto", {"enable": True}, 409, "--kunserve-config"),
    ("explode", {}, 404, "known: auto, dispatch, drop, kill, migrate, restore"),
]


@pytest.mark.parametrize("op,body,status,what", REFUSED, ids=[f"{o}-{i}" for i, (o, *_) in enumerate(REFUSED)])
def test_each_handler_refuses_what_it_cannot_take(op, body, status, what):
    front = _front()
    code, e = _run(front, op, body)
    assert code == status and isinstance(e, BadRequest), e
    assert e.param == what or what in e.message, (e.param, e.message)
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}[status]
    assert e.kind == kind
    # nothing changed
    assert front.killed == [] and front.dispatch == "least-work" and not front.migrating
    assert all(f.move is None for f in front.flights.values()) and front.arrivals == {}


def test_kill_by_instance_or_request_reports_what_it_interrupts():
    front = _front()
    code, out = _run(front, "kill", {"request_id": "cmpl-b"})
    assert code == 200 and out == {"killed": 1, "in_flight": [{"id": "cmpl-b", "generated": 2, "movable": False}]}
    code, out = _run(front, "kill", {"instance": 2})
    assert code == 200 and out == {"killed": 2, "in_flight": []}
    assert front.killed == [1, 2] and [k for k, _ in front.events] == ["kill", "kill"]


def test_migrate_marks_the_move_and_defaults_to_dispatch_choice():
    front = _front()
    code, out = _run(front, "migrate", {"request_id": "cmpl-a", "method": "kv", "at_token": 3})
    assert code == 200 and out == {"request_id": "cmpl-a", "from": 0, "to": 1, "method": "kv", "generated": 2,
                                   "at_token": 3}
    move = front.flights["a"].move
    assert (move.dst, move.method, move.reason, move.at_token) == (1, "kv", "operator", 3)


def test_migrate_waits_for_a_request_not_yet_arrived():
    front = _front()
    code, e = _run(front, "migrate", {"request_id": "later", "wait_s": 0.01})
    assert code == 404 and front.arrivals == {}   # the waiter is gone after the timeout


def test_dispatch_switches_the_policy_and_arms_the_planner_for_a_periodic_one():
    front = _front(planner=lambda *a: ())
    assert _run(front, "dispatch", {"mode": "mell"}) == (200, {"dispatch": "mell", "was": "least-work"})
    assert front.dispatch == "mell" and front.migrating
    assert _run(front, "dispatch", {"mode": "round-robin"}) == (200, {"dispatch": "round-robin", "was": "mell"})
    assert not front.migrating and [k for k, _ in front.events] == ["dispatch", "dispatch"]


@pytest.mark.parametrize("body,param", [({}, "instances"), ({"instances": [0]}, "instances"),
                                        ({"instances": [0, 3]}, "instances"), ({"instances": [0, True]}, "instances"),
                                        ({"instances": "0,1"}, "instances"),
                                        ({"instances": [0, 1], "transition": "teleport"}, "transition")])
def test_drop_checks_its_members_and_transition(body, param):
    groups = FakeGroups()
    code, e = _run(_front(groups), "drop", body)
    assert code == 400 and e.param == param and groups.calls == []


def test_drop_and_restore_conflicts_are_409():
    for groups in (FakeGroups(busy=True), FakeGroups(fail=True)):
        for op, body in (("drop", {"instances": [0, 1]}), ("restore", {"group": 1})):
            code, e = _run(_front(groups), op, body)
            assert code == 409 and e.kind == "ConflictError", (op, e)


def test_drop_and_restore_call_the_group_controller():
    groups = FakeGroups()
    front = _front(groups)
    assert _run(front, "drop", {"instances": [2, 0], "transition": "reprefill"}) == (
        200, {"group": 1, "members": [2, 0]})
    assert _run(front, "restore", {}) == (200, {"restoring": [{"group": 1, "state": "leaving"}]})
    for bad in ("1", True, 1.0):
        code, e = _run(front, "restore", {"group": bad})
        assert code == 400 and e.param == "group"
    for bad, param in (({"group": 1, "step": "yes"}, "step"), ({"step": True}, "group")):
        code, e = _run(front, "restore", bad)
        assert code == 400 and e.param == param
    assert _run(front, "restore", {"group": 1, "step": True})[0] == 200
    assert groups.calls == [("form", [2, 0], "reprefill"), ("restore", None), ("restore", 1, "step")]


@pytest.mark.parametrize("body", [{}, {"enable": 1}, {"enable": "true"}, {"enable": None}])
def test_auto_takes_only_true_or_false_and_changes_nothing_otherwise(body):
    front = _front(groups=FakeGroups())
    code, e = _run(front, "auto", body)
    assert code == 400 and e.param == "enable" and front.groups.calls == [] and front.events == []


def test_auto_refuses_a_static_group_and_changes_nothing():
    front = _front(groups=FakeGroups(static=True))
    code, e = _run(front, "auto", {"enable": False})
    assert code == 409 and "static" in e.message and front.groups.calls == [] and front.events == []


def test_auto_switches_the_monitor_and_records_it_even_while_a_group_operation_runs():
    front = _front(groups=FakeGroups(busy=True))
    assert _run(front, "auto", {"enable": True}) == (200, {"auto": True, "was": False})
    assert _run(front, "auto", {"enable": False}) == (200, {"auto": False, "was": True})
    assert front.groups.calls == [("auto", True), ("auto", False)]
    assert front.events == [("auto", {"old": False, "new": True}), ("auto", {"old": True, "new": False})]
