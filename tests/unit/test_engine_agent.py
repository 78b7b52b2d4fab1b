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
        if op == "remap":
            return self.res.remap(params["layers"], params["slots"], commit=False)
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
