"""The engine agent over two real layer-residency workers and a stand-in scheduler: a transition
that fails on one worker rolls both back; controller errors never escape."""

from __future__ import annotations

import types

import pytest
import torch

from tests.unit.test_residency import BASE, H, _residency, _run, _stack
from vllm_kunserve.config import parse_config
from vllm_kunserve.engine.agent import EngineAgent
from vllm_kunserve.engine.control import ControlRequestError

pytestmark = pytest.mark.unit


class FakeSched:
    block_size = 16

    def __init__(self, base: int, max_blocks: int) -> None:
        self.visible, self.base, self.max_blocks, self.used = base, base, max_blocks, 0
        self.draining = 0

    def state(self):
        return types.SimpleNamespace(visible=self.visible, base=self.base, max_blocks=self.max_blocks,
                                     free=self.visible - 1 - self.used, draining=self.draining, used=self.used)

    def demand(self):
        return self.used, 0, 0

    def requests(self):
        return 0, 0

    def pending_tokens(self):
        return 0, 0

    def request_mix(self):
        return 0, 0

    def unfinished(self):
        return 0

    def grow(self, n):
        self.visible += n

    def begin_shrink(self, n):
        self.visible -= n
        return True

    def cancel_shrink(self):
        return 0


class Worker:
    """The worker half: the same calls the vLLM worker extension answers."""

    def __init__(self, res):
        self.res = res

    def kunserve_memory_state(self):
        self.res.h2d_bytes_per_s = 1e10
        return self.res.state()

    def kunserve_prepare(self, op, params):
        self.res.faults.check("rpc")
        if op in ("remap", "lend"):
            return self.res.remap(params["layers"], params["slots"], commit=False, lend=op == "lend")
        if op == "borrow":
            return self.res.borrow(params["blocks"], commit=False)
        if op == "repay":
            return self.res.repay(params["blocks"], commit=False)
        return self.res.revert(kv_blocks=params["kv_blocks"], keep=params["keep"], commit=False)

    def kunserve_commit(self):
        self.res.commit()

    def kunserve_abort(self):
        return self.res.abort()

    def kunserve_check(self):
        return {"mapped_blocks": self.res.mapped_blocks, "remapped_layers": list(self.res.streamed),
                "problems": self.res.check_invariants()}

    def kunserve_inject_fault(self, step, after=0, rank=None):
        self.res.faults.arm(step, after)


def _agent():
    stacks = [_stack(), _stack()]
    workers = [Worker(_residency(s)) for s in stacks]

    def call(method, *args):
        return [getattr(w, method)(*args) for w in workers]  # like collective_rpc: raises on the first error

    cfg = parse_config({"remap": {"enable": True, "h2d_bandwidth_gbps": 10.0}})
    agent = EngineAgent(cfg, FakeSched(BASE, 64), call)
    return agent, workers, stacks


def test_failure_on_one_of_two_workers_rolls_both_back():
    agent, workers, stacks = _agent()
    x = torch.randn(2, H)
    ref = _run(stacks[0], x)
    for step in ("rpc", "release", "streamer_install", "kv_grow"):
        workers[1].res.faults.arm(step)
        ev = agent.remap([1, 4], 1)
        assert ev["outcome"] == "failed", step
        assert [w.res.streamed for w in workers] == [(), ()], step
        assert agent.sched.visible == BASE and agent.phase == "base"
        assert agent.invariant_problems() == []
    ev = agent.remap([1, 4], 1)
    assert ev["outcome"] == "ok" and agent.sched.visible > BASE
    assert [w.res.streamed for w in workers] == [(1, 4), (1, 4)] and agent.invariant_problems() == []
    assert torch.equal(_run(stacks[0], x), ref) and torch.equal(_run(stacks[1], x), ref)
    workers[0].res.faults.arm("reload")  # revert fails on worker 0 after worker 1 would succeed
    agent.call("revert", {})
    assert agent.phase == "remapped" and agent.sched.visible == workers[0].res.mapped_blocks
    assert [w.res.streamed for w in workers] == [(1, 4), (1, 4)] and agent.invariant_problems() == []
    agent.call("revert", {})
    assert agent.phase == "base" and [w.res.streamed for w in workers] == [(), ()]
    assert agent.events[-1]["event"] == "revert" and agent.events[-1]["outcome"] == "ok"


def test_lend_borrow_repay_reclaim_through_the_agent_roll_back_on_a_fault_at_each_step():
    """A multi-model fleet's memory moves through two agents (the lender, an idle model's engine; the
    borrower, a busy one's): a fault at any step on either worker leaves both agents and their pools
    as they were; done, the host holds the same bytes in all and outputs stay identical."""
    lender, lw, stacks = _agent()
    borrower, bw, _ = _agent()
    x = torch.randn(2, H)
    ref = _run(stacks[0], x)
    held = lender.held_bytes + borrower.held_bytes
    for step in ("rpc", "release", "streamer_install", "give_back", "bookkeeping"):
        (lender.faults if step == "bookkeeping" else lw[1].res.faults).arm(step)
        assert lender.call("lend", {"alpha": 2})["outcome"] == "failed", step
        assert lender.phase == "base" and not lender.lent and lender.held_bytes == held // 2, step
        assert [w.res.streamed for w in lw] == [(), ()] and lender.invariant_problems() == []
    ev = lender.call("lend", {"alpha": 2})
    assert ev["outcome"] == "ok" and lender.lent and lender.state_tenancy()["lent"] == 3
    assert ev["bytes"] > 0 and lender.held_bytes == held // 2 - ev["bytes"]
    with pytest.raises(Exception):
        lender.call("borrow", {"blocks": BASE + 8})   # a lender does not borrow
    with pytest.raises(Exception):
        lender.call("revert", {})                     # nor reverts behind its controller's back
    for step in ("rpc", "kv_borrow", "bookkeeping"):
        (borrower.faults if step == "bookkeeping" else bw[0].res.faults).arm(step)
        assert borrower.call("borrow", {"blocks": BASE + 16})["outcome"] == "failed", step
        assert borrower.sched.visible == BASE and borrower.borrowed == 0, step
        assert [w.res.pool.held_bytes for w in bw] == [held // 4, held // 4] and borrower.invariant_problems() == []
    assert borrower.call("borrow", {"blocks": BASE + 16})["outcome"] == "ok"
    assert borrower.borrowed == 16 and borrower.held_bytes > held // 2 and borrower.invariant_problems() == []
    assert torch.equal(_run(stacks[0], x), ref)
    for step in ("rpc", "kv_repay", "bookkeeping"):
        (borrower.faults if step == "bookkeeping" else bw[1].res.faults).arm(step)
        assert borrower.call("repay", {})["outcome"] == "failed", step
        assert borrower.borrowed == 16 and borrower.phase == "base" and borrower.invariant_problems() == [], step
    assert borrower.call("repay", {})["outcome"] == "ok" and borrower.borrowed == 0
    assert borrower.held_bytes == held // 2
    lw[0].res.faults.arm("reload")
    lender.call("reclaim", {})
    assert lender.lent and lender.phase == "remapped" and lender.invariant_problems() == []
    lender.call("reclaim", {})
    assert not lender.lent and lender.phase == "base" and lender.held_bytes == held // 2
    assert lender.invariant_problems() == [] and torch.equal(_run(stacks[0], x), ref)


def test_controller_errors_are_events_and_never_escape():
    agent, _, _ = _agent()
    agent.faults.arm("policy")
    agent.tick()  # must not raise
    assert agent.errors == 1 and agent.events[-1]["event"] == "controller_error"
    agent.backoff_until = 0
    agent.faults.arm("bookkeeping")
    ev = agent.remap([2, 5], 1)
    assert ev["outcome"] == "failed" and agent.phase == "base" and agent.invariant_problems() == []


def test_bad_operations_are_refused_and_change_nothing():
    agent, workers, _ = _agent()
    for op, params in (("remap", {"alpha": 0}), ("remap", {"layers": [99]}), ("remap", {"layers": "x"}),
                       ("auto", {"enable": 1}), ("nope", {}), ("inject_fault", {"step": 3})):
        with pytest.raises(ControlRequestError):
            agent.call(op, params)
    assert [w.res.streamed for w in workers] == [(), ()] and agent.sched.visible == BASE
    assert agent.control_state()["phase"] == "base"


def test_the_step_that_finishes_the_last_request_publishes_the_state():
    """An idle engine runs no further step: its last step must leave a state that says idle,
    however soon after the previous publication it ran."""
    agent, _, _ = _agent()
    live = {"running": 3}
    agent.sched.requests = lambda: (0, live["running"])
    agent.sched.unfinished = lambda: live["running"]
    agent._published_at = 0.0
    agent.run_step(lambda: ({}, True))
    assert agent.control_state()["requests"]["running"] == 3
    live["running"] = 2  # a step soon after: not published (the rate limit)
    agent.run_step(lambda: ({}, True))
    assert agent.control_state()["requests"]["running"] == 3
    live["running"] = 0  # the step that finishes the last one
    agent.run_step(lambda: ({}, True))
    assert agent.control_state()["requests"]["running"] == 0


def _grouped_agent(restage):
    """An agent whose engine is in a pair (e0 runs layers 0..2, e1 the rest); its workers answer a
    restage with ``restage(params)`` and an abandon by recording it."""
    agent, workers, _ = _agent()
    asked = {"restage": [], "leave": []}
    for w in workers:
        w.kunserve_group_restage = lambda p: (asked["restage"].append(p), restage(p))[1]
        w.kunserve_group_leave = lambda p: (asked["leave"].append(p), {"hops": None})[1]
        w.kunserve_check = lambda: {"mapped_blocks": 10 ** 6, "remapped_layers": [], "problems": []}
    agent.sched.held_blocks = lambda below=None: [1, 2, 3]
    agent.sched.recompute_all = lambda: 5
    agent.cfg = parse_config({"drop": {"group_member": True}})
    agent.sched.grow(4)
    agent.phase = "grouped"
    agent.group = {"name": "e0", "drop": [3, 4, 5], "spans": [[3, 6, "e1"]], "peers": {"e1": "s1"},
                   "since": 0.0, "blocks": agent.sched.visible}
    return agent, asked


def _restage_params():
    order = [[0, 2, "e0"], [2, 3, "e2"], [3, 5, "e1"], [5, 6, "e3"]]
    return {"spans": [s for s in order if s[2] != "e0"],
            "peers": {p: {"stage": f"s{p[1]}", "blocks": 20} for p in ("e1", "e2", "e3")},
            "members": {f"e{j}": f"s{j}" for j in range(4)}, "holders": {f"e{j}": order for j in range(4)},
            "restage_id": "g3"}


def test_a_restage_moves_the_member_into_the_larger_group_and_grows_its_blocks():
    agent, asked = _grouped_agent(lambda p: {"mapped_blocks": 30, "peer_foreign": {"e1": 28, "e2": 26, "e3": 27},
                                             "seconds": 0.1, "bytes_sent": 100, "moved_regions": 3})
    before = agent.sched.visible
    ev = agent.call("group_restage", _restage_params())
    assert ev["outcome"] == "ok" and agent.phase == "grouped" and agent.sched.visible == 26 > before
    assert agent.group["drop"] == [2, 3, 4, 5] and sorted(agent.group["peers"]) == ["e1", "e2", "e3"]
    assert ev["old_peers"] == ["e1"] and ev["moved_regions"] == 3 * 2   # (two workers)

    sent = asked["restage"][0]
    assert sent["held"] == [1, 2, 3] and "e0" not in sent["members"] and sent["restage_id"] == "g3"
    assert asked["leave"] == []


def test_a_lone_engine_merged_with_live_groups_restages_as_it_would_join():
    agent, asked = _grouped_agent(lambda p: {"mapped_blocks": 30, "peer_foreign": {"e1": 28, "e2": 26, "e3": 27},
                                             "seconds": 0.1, "bytes_sent": 100, "moved_regions": 3})
    agent.phase, agent.group = "base", None
    with pytest.raises(ControlRequestError, match="name"):
        agent.call("group_restage", _restage_params())
    ev = agent.call("group_restage", {**_restage_params(), "name": "e0"})
    assert ev["outcome"] == "ok" and ev["joined"] and ev["old_peers"] == []
    assert agent.phase == "grouped" and agent.group["name"] == "e0" and agent.group["drop"] == [2, 3, 4, 5]
    assert asked["restage"][0]["name"] == "e0" and asked["leave"] == []

    def fail(p):
        raise RuntimeError("kv_chunk")
    agent, asked = _grouped_agent(fail)
    agent.phase, agent.group = "base", None
    with pytest.raises(Exception, match="recomputed its requests"):
        agent.call("group_restage", {**_restage_params(), "name": "e0"})
    assert agent.phase == "base" and agent.group is None and asked["leave"] == []   # nothing to abandon
    assert agent.events[-1]["outcome"] == "recomputed" and agent.events[-1]["recomputed"] == 5
    # the controller saw it grouped: it abandoned meanwhile (recomputing then), so its workers refuse
    # (telling the members) and nothing is recomputed again
    n = len(agent.events)
    with pytest.raises(Exception, match="had left its group already"):
        agent.call("group_restage", {**_restage_params(), "name": "e0", "grouped": True})
    assert asked["restage"][-1]["grouped"] is True and [e["outcome"] for e in agent.events[n:]] == ["failed"]


def test_a_failed_restage_abandons_the_group_and_recomputes_every_request():
    """Whether the workers rolled back (before the KV moved) or could not (after), the member then
    runs alone: its peers may already run the new layout, so it must not step with the old one."""
    def fail(p):
        raise RuntimeError("peer e2 failed at the restage barrier")
    agent, asked = _grouped_agent(fail)
    with pytest.raises(Exception, match="abandoned its group"):
        agent.call("group_restage", _restage_params())
    assert agent.phase == "base" and agent.group is None
    assert asked["leave"] and all(p["abandon"] for p in asked["leave"])
    assert [e["event"] for e in agent.events[-2:]] == ["group_restage", "group_abandon"]
    assert agent.events[-1]["recomputed"] == 5


def test_a_bad_restage_is_refused_and_changes_nothing():
    agent, asked = _grouped_agent(lambda p: pytest.fail("a refused restage reached the workers"))
    group = dict(agent.group)
    good = _restage_params()
    bad = [{**good, "spans": []}, {**good, "spans": [[0, 6, "e1"]]}, {**good, "spans": [[2, 4, "e2"], [3, 6, "e1"]]},
           {**good, "peers": {"e1": {"stage": "s1", "blocks": 20}}},
           {**good, "members": {"e2": "s2", "e3": "s3"}},
           {**good, "holders": {f"e{j}": [[0, 6, "e0"], [3, 6, "e1"]] for j in range(4)}},
           {**good, "holders": {"e0": good["holders"]["e0"]}}]
    for params in bad:
        with pytest.raises(ControlRequestError):
            agent.call("group_restage", params)
    assert agent.group == group and agent.phase == "grouped" and asked == {"restage": [], "leave": []}
    agent.phase = "draining"
    with pytest.raises(Exception, match="only a grouped engine"):
        agent.call("group_restage", good)


def test_a_step_down_drains_to_the_smaller_groups_count_then_restages_into_it_with_that_kv():
    """A four splitting into pairs: ``group_leave begin`` with ``blocks`` drains to the pair's count
    (not the base), a restage before the drain ends is refused, the restage then cuts the workers'
    KV to the drained count, and a plain leave finish is refused there (that step is the restage)."""
    agent, asked = _grouped_agent(lambda p: {"mapped_blocks": p["kv_blocks"] + 1, "peer_foreign": {"e1": 40},
                                             "seconds": 0.1, "bytes_sent": 10, "moved_regions": 2})
    agent.sched.grow(6)   # the four's count: base + 10
    st = agent.sched.state()
    for bad in (st.base - 1, st.visible + 1, "3", True):
        with pytest.raises(ControlRequestError, match="blocks"):
            agent.call("group_leave", {"step": "begin", "blocks": bad})
    assert agent.phase == "grouped" and agent.sched.visible == st.visible
    target = st.base + 4
    ev = agent.call("group_leave", {"step": "begin", "blocks": target})
    assert ev["outcome"] == "draining" and ev["blocks_target"] == target and ev["step"]
    assert agent.phase == "group_draining" and agent.sched.visible == target
    with pytest.raises(Exception, match="smaller group"):
        agent.call("group_leave", {"step": "finish"})
    agent.sched.draining = 3
    with pytest.raises(Exception, match="still in use"):
        agent.call("group_restage", _restage_params())
    agent.sched.draining = 0
    pair = {"spans": [[3, 6, "e1"]], "peers": {"e1": {"stage": "s1", "blocks": target}},
            "members": {f"e{j}": f"s{j}" for j in range(4)},
            "holders": {"e0": [[0, 3, "e0"], [3, 6, "e1"]], "e1": [[0, 3, "e0"], [3, 6, "e1"]],
                        "e2": [[0, 3, "e2"], [3, 6, "e3"]], "e3": [[0, 3, "e2"], [3, 6, "e3"]]}}
    ev = agent.call("group_restage", pair)
    assert ev["outcome"] == "ok" and ev["step"] and agent.phase == "grouped"
    assert all(p["kv_blocks"] == target for p in asked["restage"])
    assert agent.sched.visible == target + 1 and agent.group["peers"] == {"e1": "s1"}
    assert asked["leave"] == []


def test_no_kv_moves_in_or_out_of_a_group_member():
    """A member's requests' KV is spread over its group: kv_export and kv_import_* are refused while
    it is grouped or draining out of a group (they would read a dropped layer's unmapped KV), and
    work again once it is alone."""
    from vllm_kunserve.engine.control import ControlConflict

    agent, _, _ = _agent()
    for phase in ("grouped", "group_draining"):
        agent.phase, agent.group = phase, {"name": "e0", "drop": [3, 4, 5]}
        for op in ("kv_export", "kv_import_prepare", "kv_import_commit", "kv_import_abort"):
            with pytest.raises(ControlConflict, match="pipeline-group member"):
                agent.call(op, {"token_ids": [1, 2, 3]})
    agent.phase, agent.group = "base", None
    assert agent.call("kv_import_abort", {}) == {"aborted": False, "import_id": None}   # alone: it answers


class DrainingSched(FakeSched):
    """A shrink whose top blocks are still in use drains them (``held``); cancelling it gives back every
    block it retired, as vLLM's block pool does (``integration.vllm.block_capacity``)."""

    held = 3

    def recompute_all(self):
        return 2   # two requests preempted to be computed again

    def begin_shrink(self, n):
        self.before, self.visible, self.draining = self.visible, self.visible - n, self.held
        return False

    def cancel_shrink(self):
        back, self.visible, self.draining = self.draining, max(self.visible, getattr(self, "before", 0)), 0
        return back

    def grow(self, n):
        if n <= 0:
            return   # as vLLM's block pool: a grow never shrinks
        if self.draining:
            raise RuntimeError("cannot grow while a shrink is draining")
        super().grow(n)


def test_a_remapped_member_abandoning_its_group_never_uses_a_block_its_workers_do_not_map():
    """A lost peer, blocks still in use above the base: the member comes back remapped by the layer it
    kept streaming, its scheduler at or under what the workers map (the abandon's shrink is not cancelled:
    that gave back the group's count, above the mapping, and vLLM's attention wrote there: a segfault)."""
    agent, workers, stacks = _agent()
    agent.sched = DrainingSched(BASE, 64)
    for w in workers:
        w.kunserve_group_leave = lambda p, w=w: {"mapped_blocks": w.res.leave(p["kv_blocks"], lambda: None),
                                                "hops": None}
    assert agent.remap([1, 4], 1)["outcome"] == "ok"
    for w in workers:   # the group as the workers hold it after a join from remapped (layer 4 to the peer)
        w.res.join([3, 4, 5], {"p": BASE}, lambda: None)
    agent.sched.grow(min(w.res.mapped_blocks for w in workers) - agent.sched.visible)
    agent.phase, agent.group, agent.remapped = "grouped", {"name": "e0", "drop": [3, 4, 5]}, (1,)
    grouped = agent.sched.visible
    ev = agent.group_abandon("peer lost")
    assert ev["outcome"] == "ok" and agent.phase == "remapped" and agent.remapped == (1,)
    assert [w.res.streamed for w in workers] == [(1,), (1,)] and [w.res.dropped for w in workers] == [(), ()]
    assert agent.sched.visible <= min(w.res.mapped_blocks for w in workers) < grouped
    assert agent.invariant_problems() == []
    x = torch.randn(2, H)
    assert torch.equal(_run(stacks[0], x), _run(_stack(), x))
