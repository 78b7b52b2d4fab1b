"""The group scheduler's touchpoint and decisions (integration/vllm/scheduler.py) without an engine:
when it is installed, the budget it sets from the peers' steps, and the peers' chunks it reads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from vllm_kunserve.config import KunServeConfigError, parse_config
from vllm_kunserve.integration.vllm.pipeline import _step_chunks
from vllm_kunserve.integration.vllm.scheduler import (PACE_MAX_AGE_S, QUALNAME, SchedulerPatch, budget_for,
                                                      fresh_peer_chunks, queue_work, wanted_step)
from vllm_kunserve.policy import CostModel

pytestmark = pytest.mark.unit


def _holder(scheduler_cls=None):
    return SimpleNamespace(scheduler_cls=scheduler_cls, async_scheduling=False)


def test_installed_only_for_group_members_with_lookahead_or_peak_admission_and_never_over_a_users_class():
    member = parse_config({"drop": {"group_member": True}})
    h = _holder()
    SchedulerPatch().configure(member, h)
    assert h.scheduler_cls == QUALNAME
    vc = SimpleNamespace(scheduler_config=_holder())        # a VllmConfig: the scheduler config inside
    SchedulerPatch().configure(member, vc)
    assert vc.scheduler_config.scheduler_cls == QUALNAME
    not_member = _holder()
    SchedulerPatch().configure(parse_config({"remap": {"enable": True}}), not_member)
    no_lookahead = _holder()
    SchedulerPatch().configure(parse_config({"drop": {"group_member": True},
                                             "lookahead": {"enable": False, "admission": "vllm"}}), no_lookahead)
    admission_only = _holder()                              # peak-aware admission alone still needs it
    SchedulerPatch().configure(parse_config({"drop": {"group_member": True},
                                             "lookahead": {"enable": False, "admission": "peak"}}), admission_only)
    assert admission_only.scheduler_cls == QUALNAME
    asynchronous = SimpleNamespace(scheduler_cls=None, async_scheduling=True)
    SchedulerPatch().configure(member, asynchronous)
    assert not_member.scheduler_cls is no_lookahead.scheduler_cls is asynchronous.scheduler_cls is None
    mine = _holder(scheduler_cls="my.Scheduler")
    SchedulerPatch().configure(member, mine)
    assert mine.scheduler_cls == "my.Scheduler"


def _req(rid, computed, prompt, total=None):
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed, num_prompt_tokens=prompt,
                           num_tokens=total or prompt)


def test_budget_balances_against_the_costliest_recent_peer_step():
    m = CostModel(alpha=0.0, beta=1.0, gamma=5.0)
    sched = SimpleNamespace(running=[_req("d0", 100, 50, 101), _req("d1", 80, 40, 81), _req("p0", 32, 512)],
                            waiting=[_req("w0", 0, 300)], max_num_scheduled_tokens=2048)
    # the peers' steps: 40 decodes (cost 40) and a 200-token prefill (cost 200): balance against 200
    peers = [[(500, 1)] * 40, [(0, 200)]]
    assert budget_for(sched, peers, m, 16) == 2 + 198
    assert budget_for(sched, [[(500, 1)] * 40], m, 16) == 2 + 38
    assert budget_for(sched, [], m, 16) == 2048                   # no peer step: vLLM's own budget
    sched.max_num_scheduled_tokens = 100
    assert budget_for(sched, peers, m, 16) == 100


def test_fresh_peer_chunks_drop_idle_peers():
    steps = {"e0": (100.0, [(0, 5)]), "e1": (100.0 - PACE_MAX_AGE_S - 0.1, [(3, 1)]), "e2": (100.0, [])}
    assert fresh_peer_chunks(steps, now=100.0) == [[(0, 5)]]


def test_fresh_peer_chunks_pace_only_current_peers():
    """A member that left (or a late span of it) no longer paces this one, however recent its step."""
    steps = {"e0": (100.0, [(0, 5)]), "gone": (100.0, [(0, 900)])}
    assert fresh_peer_chunks(steps, now=100.0, peers=["e0"]) == [[(0, 5)]]
    assert fresh_peer_chunks(steps, now=100.0, peers=[]) == []
    assert len(fresh_peer_chunks(steps, now=100.0)) == 2


def test_a_peers_wanted_step_paces_where_it_sent_one():
    """A peer's entry is (when, its step, the step it wanted): both pace (the costlier wins)."""
    steps = {"e0": (100.0, [(9, 1)], [(9, 1), (0, 64), (0, 64)]), "e1": (100.0, [(3, 1)], [])}
    assert fresh_peer_chunks(steps, now=100.0) == [[(9, 1)], [(9, 1), (0, 64), (0, 64)], [(3, 1)]]


def test_wanted_step_is_the_queue_under_vllms_budget_decodes_first():
    sched = SimpleNamespace(running=[_req("p0", 32, 512), _req("d0", 100, 50, 101)], waiting=[_req("w0", 0, 300)])
    work = queue_work(sched)
    assert wanted_step(work, 2048) == [(100, 1), (32, 480), (0, 300)]
    assert wanted_step(work, 200) == [(100, 1), (32, 199)]          # the last prefill chunked at the budget
    assert wanted_step(queue_work(SimpleNamespace(running=[], waiting=[])), 2048) == []


def _member_steps(queues, rule, steps=4, decodes=30, min_tokens=64, max_tokens=2048):
    """Two members with ``decodes`` running decodes each pace each other's steps (``rule``:
    "wanted" sends each member's wanted step with its spans, "latest" only the step it ran);
    returns, per step, each member's prefill tokens scheduled."""
    m = CostModel(alpha=5.5e-08, beta=0.000587, gamma=0.146)     # the built-in stand-in's shape
    queues = [list(q) for q in queues]
    seen = [(0.0, [(200, 1)] * decodes, [])] * 2     # what each member's stage last saw of the other
    took = []
    for _ in range(steps):
        row = []
        for me in (0, 1):
            sched = SimpleNamespace(running=[_req(f"d{i}", 201, 200, 201) for i in range(decodes)],
                                    waiting=[_req(f"w{i}", 0, n) for i, n in enumerate(queues[me])],
                                    max_num_scheduled_tokens=max_tokens)
            work = queue_work(sched)
            wanted = wanted_step(work, max_tokens)
            peers = fresh_peer_chunks({"peer": seen[1 - me]}, now=0.0)
            pre = budget_for(sched, peers, m, min_tokens, work) - decodes
            row.append(min(pre, sum(queues[me])))
            chunks, left = [(200, 1)] * decodes, []
            for n in queues[me]:
                k = min(n, pre)
                pre -= k
                if k:
                    chunks.append((0, k))
                if n - k:
                    left.append(n - k)
            queues[me] = left
            seen[me] = (0.0, chunks, wanted if rule == "wanted" else [])
        took.append(row)
    return took


def test_members_with_prompts_queued_on_both_take_min_tokens_each_by_latest_steps_all_by_wanted_ones():
    """What ``lookahead.pace`` chooses between: paced by each other's latest steps (the default),
    two members with three 64-token prompts queued each take one prompt per step (each cut at the
    other's cut, ``min_tokens``), so the third starts three group steps later; paced by the steps
    they want, the second member takes all three at once (the first member's wanted step has reached
    it), the first the other two in its next step (the peer's wanted step it saw was from before
    the prompts). A member whose peer only decodes still chunks a long prompt to the peer's step."""
    assert _member_steps([[64] * 3, [64] * 3], "latest")[:3] == [[64, 64]] * 3
    assert _member_steps([[64] * 3, [64] * 3], "wanted")[:2] == [[64, 192], [128, 0]]
    long_alone = _member_steps([[1000], []], "wanted")
    assert long_alone[0][0] == 64 and long_alone[1][0] == 64     # the decoding peer's step paces it


def test_the_step_floor_starts_a_cluster_of_prompts_together_while_both_members_decode_alike():
    """``lookahead.step_min_tokens``: two members decoding alike leave each other no room but the
    floor. Four 64-token prompts queued on one member start one per step under a 64-token floor (the
    fourth three group steps late: the R1 tail of docs/benchmarks/pipeline_idle_r1_xeon.md), all in
    one step under the default 256, and a long prompt still moves by the floor, not all at once."""
    assert parse_config({}).lookahead.step_min_tokens == 256
    assert parse_config({}).lookahead.min_tokens == 64          # the microbatch split's floor, unchanged
    with pytest.raises(KunServeConfigError, match="lookahead.step_min_tokens"):
        parse_config({"lookahead": {"step_min_tokens": 0}})
    assert [r[0] for r in _member_steps([[64] * 4, []], "latest", min_tokens=64)] == [64] * 4
    assert [r[0] for r in _member_steps([[64] * 4, []], "latest", min_tokens=256)] == [256, 0, 0, 0]
    assert [r[0] for r in _member_steps([[1000], []], "latest", min_tokens=256)] == [256] * 3 + [232]


def test_step_chunks_read_prefix_and_new_tokens_from_attention_metadata():
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 1, 2, 66]), seq_lens=torch.tensor([10, 200, 64, 0]))
    assert _step_chunks({"layers.0.attn": md}) == [(9, 1), (199, 1), (0, 64)]
    assert _step_chunks({}) == [] and _step_chunks(SimpleNamespace()) == []


def test_cost_model_key_must_name_a_readable_model(tmp_path):
    with pytest.raises(KunServeConfigError, match="lookahead.cost_model"):
        parse_config({"lookahead": {"cost_model": str(tmp_path / "missing.json")}})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(KunServeConfigError, match="lookahead.cost_model"):
        parse_config({"lookahead": {"cost_model": str(bad)}})
    good = tmp_path / "m.json"
    CostModel(alpha=0.0, beta=1.0, gamma=2.0).save(good)
    assert parse_config({"lookahead": {"cost_model": str(good)}}).lookahead.cost_model == str(good)
    assert json.loads(good.read_text())["beta"] == 1.0


def test_schedule_applies_the_admission_limit_only_while_grouped_and_never_fails_for_it(monkeypatch):
    """The limit is set for one ``schedule()`` call and put back; alone vLLM's own; a failing
    admission check turns peak-aware admission off instead of failing the step."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_kunserve.integration.vllm import scheduler as mod

    seen = []
    admit = mod.admission_attr()   # max_num_active_reqs (vLLM >= 0.31) or max_num_running_reqs
    monkeypatch.setattr(Scheduler, "schedule", lambda self, *a, **k: seen.append(getattr(self, admit)) or "out")
    cls = mod.KunServeScheduler
    s = cls.__new__(cls)
    grouped = [False]
    s.kunserve_grouped = lambda: grouped[0]
    s.kunserve_pace, s.kunserve_lookahead, s.kunserve_peak_admission = None, False, True
    s.kunserve_limits, s.kunserve_budgets = [], []
    s.max_num_scheduled_tokens = 2048
    setattr(s, admit, 128)
    s.waiting = [_r2("w", 64, 0, 300)]
    s.running, s.kv_holding_waiting, s.num_waiting_for_streaming_input, s.block_size = [], [], 0, 32
    s.kv_cache_manager = SimpleNamespace(block_pool=SimpleNamespace(num_gpu_blocks=25))   # 24 usable
    assert s.schedule() == "out" and seen == [128]               # alone: vLLM's admission
    grouped[0] = True
    s.running = [_r2("a", 300, 100, 400)]     # 300 + 300 left: 19 blocks at its end; with w 32 > 24
    assert s.schedule() == "out" and seen[-1] == 1 and getattr(s, admit) == 128   # w waits
    s.kv_cache_manager = None                                     # the check breaks: vLLM's own admits
    assert s.schedule() == "out" and seen[-1] == 128 and s.kunserve_peak_admission is False


def test_schedule_sends_the_wanted_step_with_pace_wanted_and_nothing_with_latest(monkeypatch):
    """``lookahead.pace``: `wanted` hands the member's wanted step to the pace call (its worker
    sends it with its spans) and cuts against the peers'; `latest` (the ablation) hands none."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_kunserve.integration.vllm import scheduler as mod

    seen = []
    monkeypatch.setattr(Scheduler, "schedule", lambda self, *a, **k: seen.append(self.max_num_scheduled_tokens))
    assert parse_config({}).lookahead.pace == "latest"
    with pytest.raises(KunServeConfigError, match="lookahead.pace"):
        parse_config({"lookahead": {"pace": "fastest"}})
    cls = mod.KunServeScheduler
    s = cls.__new__(cls)
    s.kunserve_grouped = lambda: True
    sent = []
    peer = [(200, 1)] * 30 + [(0, 64)]
    s.kunserve_pace = lambda wanted: sent.append(wanted) or [peer, [(200, 1)] * 30 + [(0, 64)] * 3]
    s.kunserve_lookahead, s.kunserve_peak_admission = True, False
    s.kunserve_model, s.kunserve_step_min_tokens, s.kunserve_budgets = CostModel(alpha=0.0, beta=1.0, gamma=5.0), 64, []
    s.max_num_scheduled_tokens = 2048
    setattr(s, mod.admission_attr(), 128)
    s.running = [_req(f"d{i}", 201, 200, 201) for i in range(30)]
    s.waiting = [_req(f"w{i}", 0, 64) for i in range(3)]
    s.kunserve_send_wanted = True
    s.schedule()
    assert sent[-1] == [(201, 1)] * 30 + [(0, 64)] * 3 and seen[-1] == 30 + 192
    s.kunserve_send_wanted = False
    s.kunserve_pace = lambda wanted: sent.append(wanted) or [peer]
    s.schedule()
    assert sent[-1] is None and seen[-1] == 30 + 64
    assert s.max_num_scheduled_tokens == 2048                      # put back after the call


def _r2(rid, tokens, out, max_tokens):
    return SimpleNamespace(request_id=rid, num_tokens=tokens, num_output_tokens=out, max_tokens=max_tokens)
