"""Overload detection and the KunServe drop planner."""

import pytest
from hypothesis import given, settings, strategies as st

from vllm_kunserve.config import DropConfig
from vllm_kunserve.policy import (ClusterSnapshot, InstanceSnapshot, ModelSpec, assess_overload,
                                  balanced_stages, forecast_blocks, plan_drop)

pytestmark = pytest.mark.unit

MODEL = ModelSpec(num_layers=32, layer_bytes=100, block_bytes=10)


def cluster(n, used=900, total=1000, queued=0, groups=(), model=MODEL, **kw):
    insts = tuple(InstanceSnapshot(i, total, used, queued) for i in range(n))
    return ClusterSnapshot(model, insts, groups, **kw)


def check_groups(plan, model, ids):
    seen = [i for g in plan.unchanged for i in g]
    for g in plan.groups:
        seen += list(g.instances)
        covered = []
        for s in g.stages:
            assert 0 <= s.layer_start < s.layer_end <= model.num_layers  # one contiguous range
            covered += range(s.layer_start, s.layer_end)
        assert sorted(covered) == list(range(model.num_layers))  # every layer exactly once
        sizes = [s.layer_end - s.layer_start for s in g.stages]
        assert max(sizes) - min(sizes) <= 1  # balanced stages
    assert sorted(seen) == sorted(ids)  # every instance in exactly one group


def test_demand_counts_used_queued_and_forecast():
    c = cluster(2, used=800, queued=300, demand_history=((0.0, 1000.0), (1.0, 1100.0), (2.0, 1200.0)))
    rep = assess_overload(c, DropConfig(forecast_horizon_s=2.0, headroom_ratio=0.0))
    assert rep.demand_blocks == 2 * 1100
    assert rep.forecast_blocks == pytest.approx(200.0)
    assert rep.overloaded and rep.need_blocks == pytest.approx(2200 + 200 - 2000)
    assert rep.need_bytes == pytest.approx(rep.need_blocks * MODEL.block_bytes)
    assert [d.ratio for d in rep.instances] == [1.1, 1.1]


def test_forecast_ignores_falling_trend_and_short_history():
    assert forecast_blocks([(0, 100.0), (1, 50.0)], 5.0) == 0.0
    assert forecast_blocks([(0, 100.0)], 5.0) == 0.0
    assert forecast_blocks([(0, 0.0), (1, 10.0)], 0.0) == 0.0


def test_not_overloaded_below_trigger():
    rep = assess_overload(cluster(4, used=500), DropConfig(forecast_horizon_s=0.0))
    assert not rep.overloaded and rep.need_bytes == 0


def test_a_prefill_heavy_mix_is_compute_bound_not_a_reason_to_drop():
    def work(prompt, output):
        insts = tuple(InstanceSnapshot(i, 1000, 900, 300, prompt_tokens=prompt, output_tokens=output)
                      for i in range(2))
        return ClusterSnapshot(MODEL, insts, ())
    # off by default (a token count, not a cost): the paper's trigger alone
    assert assess_overload(work(prompt=10 * 256, output=10 * 24), DropConfig(forecast_horizon_s=0.0)).overloaded
    cfg = DropConfig(forecast_horizon_s=0.0, min_decode_share=0.5)
    # 256-token prompts with 24-token outputs, whole requests: prefill work, even where no prompt is
    # queued (the running requests' prompts done, only outputs left: the mix is the requests')
    rep = assess_overload(work(prompt=5 * 256, output=5 * 24), cfg)
    assert rep.ratio > cfg.trigger_ratio and rep.compute_bound and not rep.overloaded and rep.need_bytes == 0
    assert rep.decode_share == pytest.approx(120 / (120 + 1280))
    # 64-token prompts with 320-token outputs: decode, so more KV is worth throughput
    rep = assess_overload(work(prompt=9 * 64, output=9 * 320), cfg)
    assert rep.overloaded and not rep.compute_bound and rep.need_bytes > 0
    # the boundary is the config's, 0 turns the check off; no tokens reported: no veto
    assert not assess_overload(work(prompt=600, output=400), cfg).overloaded
    assert assess_overload(work(prompt=600, output=400), DropConfig(forecast_horizon_s=0.0,
                                                                    min_decode_share=0.4)).overloaded
    assert assess_overload(work(prompt=600, output=0), DropConfig(forecast_horizon_s=0.0)).overloaded
    assert assess_overload(work(prompt=0, output=0), cfg).overloaded
    # an unhealthy instance's requests do not count
    insts = (InstanceSnapshot(0, 1000, 900, 300, prompt_tokens=0, output_tokens=500),
             InstanceSnapshot(1, 1000, 900, 300, prompt_tokens=5000, output_tokens=0, healthy=False))
    assert assess_overload(ClusterSnapshot(MODEL, insts, ()), cfg).decode_share == 1.0


def test_request_mix_round_trips_and_is_checked():
    d = {"instance_id": 0, "kv_blocks_total": 10, "kv_blocks_used": 1, "prompt_tokens": 64, "output_tokens": 320}
    i = InstanceSnapshot.from_dict(d)
    assert (i.prompt_tokens, i.output_tokens) == (64, 320)
    with pytest.raises(ValueError):
        InstanceSnapshot.from_dict({**d, "output_tokens": -1})
    with pytest.raises(ValueError):
        InstanceSnapshot(0, 10, 1, prompt_tokens=-5)


def test_plan_frees_one_copy_per_merge_and_stops_when_enough():
    c = cluster(8)
    need = 2.5 * MODEL.weight_bytes
    plan = plan_drop(c, need)
    assert len(plan.merges) == 3 and plan.satisfied
    assert plan.freed_bytes == 3 * MODEL.weight_bytes
    assert sorted(len(g.instances) for g in plan.groups) == [2, 2, 2]
    assert sorted(plan.unchanged) == [(6,), (7,)]
    check_groups(plan, MODEL, range(8))


def test_partial_plan_reports_shortfall():
    plan = plan_drop(cluster(4), 10 * MODEL.weight_bytes, max_group_size=4)
    assert not plan.satisfied
    assert len(plan.groups) == 1 and plan.freed_bytes == 3 * MODEL.weight_bytes
    assert plan.shortfall_bytes == 7 * MODEL.weight_bytes


def test_max_group_size_caps_merging():
    plan = plan_drop(cluster(8), 100 * MODEL.weight_bytes, max_group_size=2)
    assert len(plan.groups) == 4 and not plan.unchanged and not plan.satisfied
    assert all(len(g.instances) == 2 for g in plan.groups)


def test_unhealthy_instance_is_never_merged():
    insts = (InstanceSnapshot(0, 1000, 900, healthy=False),) + tuple(InstanceSnapshot(i, 1000, 900) for i in (1, 2))
    plan = plan_drop(ClusterSnapshot(MODEL, insts), 5 * MODEL.weight_bytes)
    assert (0,) in plan.unchanged and all(0 not in g.instances for g in plan.groups)


def test_merging_existing_groups_reports_layers_to_load():
    # two 2-stage groups merge into one 4-stage group: nothing is loaded, half of each is dropped
    insts = (InstanceSnapshot(0, 1000, 0, 0, 0, 16), InstanceSnapshot(1, 1000, 0, 0, 16, 32),
             InstanceSnapshot(2, 1000, 0, 0, 0, 16), InstanceSnapshot(3, 1000, 0, 0, 16, 32))
    c = ClusterSnapshot(MODEL, insts, ((0, 1), (2, 3)))
    plan = plan_drop(c, 1)
    check_groups(plan, MODEL, range(4))
    assert plan.freed_bytes == MODEL.weight_bytes
    loads = [s.load_layers for g in plan.groups for s in g.stages]
    assert sum(hi - lo for ls in loads for lo, hi in ls) == 0


def test_balanced_stages():
    assert balanced_stages(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError):
        balanced_stages(3, 4)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), layers=st.integers(1, 80), need=st.floats(0, 50), cap=st.integers(1, 16))
def test_drop_plan_group_invariants(n, layers, need, cap):
    model = ModelSpec(layers, 7, 3)
    plan = plan_drop(cluster(n, model=model), need * model.weight_bytes, max_group_size=cap)
    check_groups(plan, model, range(n))
    assert plan.freed_bytes == len(plan.merges) * model.weight_bytes
    assert plan.satisfied == (plan.freed_bytes >= need * model.weight_bytes)
    sizes = [len(g.instances) for g in plan.groups] + [len(g) for g in plan.unchanged]
    assert max(sizes) <= max(1, min(cap, layers))
    # smallest-first merging keeps groups within a factor two of each other
    assert max(sizes) <= 2 * min(sizes)
    if not plan.satisfied:  # best partial plan: no further merge was possible
        assert len(sizes) == 1 or sorted(sizes)[0] + sorted(sizes)[1] > min(cap, layers)


def test_from_dict_names_missing_field():
    with pytest.raises(ValueError, match="cluster.instances\\[0\\].kv_blocks_used: missing"):
        ClusterSnapshot.from_dict({"model": {"num_layers": 2, "layer_bytes": 1, "block_bytes": 1},
                                   "instances": [{"instance_id": 0, "kv_blocks_total": 3}]})


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 24), first=st.integers(1, 6), second=st.integers(1, 12))
def test_replanning_from_existing_groups(n, first, second):
    """Apply a plan, then drop more: invariants hold and each merge still frees one copy."""
    model = ModelSpec(48, 5, 1)
    p1 = plan_drop(cluster(n, model=model), first * model.weight_bytes)
    stages = {s.instance_id: (s.layer_start, s.layer_end) for g in p1.groups for s in g.stages}
    stages.update({g[0]: (0, 48) for g in p1.unchanged})
    insts = tuple(InstanceSnapshot(i, 1000, 900, 0, *stages[i]) for i in range(n))
    c2 = ClusterSnapshot(model, insts, tuple(g.instances for g in p1.groups) + p1.unchanged)
    p2 = plan_drop(c2, second * model.weight_bytes, max_group_size=64)
    check_groups(p2, model, range(n))
    assert p2.freed_bytes == len(p2.merges) * model.weight_bytes
    for g in p2.groups:
        for s in g.stages:
            h0, h1 = stages[s.instance_id]
            need = sum(hi - lo for lo, hi in s.load_layers)
            kept = max(0, min(s.layer_end, h1) - max(s.layer_start, h0))
            assert need == (s.layer_end - s.layer_start) - kept


def test_the_decode_share_is_summed_over_the_window():
    # one decode-heavy reading in a prefill-heavy window: the share is summed over the window's readings
    insts = tuple(InstanceSnapshot(i, 1000, 950, 100, prompt_tokens=0, output_tokens=150) for i in range(2))
    past = ((2.0, 5000, 0),            # older than the window: ignored
            (6.0, 300, 2560), (8.0, 250, 2300))
    snap = ClusterSnapshot(MODEL, insts, (), now_s=10.0, work_history=past)
    cfg = DropConfig(forecast_horizon_s=0.0, min_decode_share=0.5, decode_share_window_s=5.0)
    rep = assess_overload(snap, cfg)
    assert rep.decode_share == pytest.approx((300 + 300 + 250) / (300 + 300 + 250 + 2560 + 2300))
    assert rep.ratio > cfg.trigger_ratio and rep.compute_bound and not rep.overloaded
    # the current reading alone (window 0) drops, as before
    alone_now = DropConfig(forecast_horizon_s=0.0, min_decode_share=0.5, decode_share_window_s=0.0)
    assert assess_overload(snap, alone_now).overloaded
    # a decode-heavy window stays a reason to drop
    decode_past = ((6.0, 1600, 320), (8.0, 1800, 192))
    rep = assess_overload(ClusterSnapshot(MODEL, insts, (), now_s=10.0, work_history=decode_past), cfg)
    assert rep.overloaded and rep.decode_share == pytest.approx(3700 / 4212)


def test_work_history_round_trips_and_is_checked():
    d = {"model": {"num_layers": 2, "layer_bytes": 10, "block_bytes": 1},
         "instances": [{"instance_id": 0, "kv_blocks_total": 10, "kv_blocks_used": 1}],
         "now_s": 3.0, "work_history": [[1.0, 320, 64], [2.0, 0, 256]]}
    assert ClusterSnapshot.from_dict(d).work_history == ((1.0, 320, 64), (2.0, 0, 256))
    with pytest.raises(ValueError, match=r"work_history\[0\]"):
        ClusterSnapshot.from_dict({**d, "work_history": [[1.0, 320]]})
    with pytest.raises(ValueError, match=r"work_history\[1\]"):
        ClusterSnapshot.from_dict({**d, "work_history": [[1.0, 320, 64], [2.0, -1, 0]]})


def capped(n, total, cap, model=MODEL):
    insts = tuple(InstanceSnapshot(i, total, total, 0, kv_blocks_max=cap) for i in range(n))
    return ClusterSnapshot(model, insts, tuple((i,) for i in range(n)))


def test_plan_counts_only_the_kv_each_member_can_grow_into():
    """A merge frees one weight copy (3200 B = 320 blocks here), spread over the members, but each
    member's KV stops at kv_blocks_max (memory.max_kv_ratio x base): two engines of 100 blocks
    capped at 200 gain 2 x 100 blocks, not 320, and the rest is the shortfall."""
    plan = plan_drop(capped(2, 100, 200), 300 * MODEL.block_bytes)
    assert len(plan.groups) == 1 and plan.freed_bytes == 200 * MODEL.block_bytes
    assert not plan.satisfied and plan.shortfall_bytes == 100 * MODEL.block_bytes
    roomy = plan_drop(capped(2, 100, 10_000), 300 * MODEL.block_bytes)  # the cap does not bind
    assert roomy.satisfied and roomy.freed_bytes == MODEL.weight_bytes
    assert roomy.freed_bytes == plan_drop(cluster(2, total=100), 300 * MODEL.block_bytes).freed_bytes


def test_plan_makes_no_merge_that_adds_no_kv():
    """Members already at their cap gain nothing from a merge (only pipeline hops): no group, the
    whole need is the shortfall. Four engines capped at 2x: pairs gain, merging the pairs would not."""
    none = plan_drop(capped(2, 100, 100), 50 * MODEL.block_bytes)
    assert not none.groups and none.freed_bytes == 0 and none.shortfall_bytes == 50 * MODEL.block_bytes
    four = plan_drop(capped(4, 100, 200), 10_000 * MODEL.block_bytes)
    assert sorted(g.instances for g in four.groups) == [(0, 1), (2, 3)]
    assert four.freed_bytes == 400 * MODEL.block_bytes and not four.satisfied
    check_groups(four, MODEL, range(4))


def test_snapshot_reads_kv_blocks_max_and_refuses_negative():
    inst = InstanceSnapshot.from_dict({"instance_id": 0, "kv_blocks_total": 10, "kv_blocks_used": 1,
                                       "kv_blocks_max": 40})
    assert inst.kv_blocks_max == 40
    with pytest.raises(ValueError):
        InstanceSnapshot(0, 10, 1, kv_blocks_max=-1)


def test_groups_form_only_among_instances_of_one_host():
    """The stage link is one machine's: 0 and 2 share host a, 1 and 3 host b, so the plan pairs
    (0, 2) and (1, 3) however the ids sort; an instance alone on its host is skipped, and the plan
    says so; with every host unknown the planner is the one-host greedy it always was."""
    hosts = ["a", "b", "a", "b", "c"]
    insts = tuple(InstanceSnapshot(i, 1000, 900, host=h) for i, h in enumerate(hosts))
    plan = plan_drop(ClusterSnapshot(MODEL, insts), 100 * MODEL.weight_bytes, max_group_size=2)
    assert sorted(g.instances for g in plan.groups) == [(0, 2), (1, 3)]
    assert plan.unchanged == ((4,),) and not plan.satisfied
    assert any("[4] on host c: alone on their host" in why for why in plan.skipped), plan.skipped
    assert plan.to_dict()["skipped"] == list(plan.skipped)
    check_groups(plan, MODEL, range(5))
    one_host = plan_drop(ClusterSnapshot(MODEL, tuple(InstanceSnapshot(i, 1000, 900) for i in range(5))),
                         100 * MODEL.weight_bytes, max_group_size=2)
    assert sorted(g.instances for g in one_host.groups) == [(0, 1), (2, 3)] and one_host.skipped == ()


@settings(max_examples=100, deadline=None)
@given(hosts=st.lists(st.sampled_from(["a", "b", "c"]), min_size=2, max_size=9),
       need=st.integers(1, 12), cap=st.integers(2, 8))
def test_no_planned_group_spans_two_hosts(hosts, need, cap):
    insts = tuple(InstanceSnapshot(i, 1000, 900, host=h) for i, h in enumerate(hosts))
    plan = plan_drop(ClusterSnapshot(MODEL, insts), need * MODEL.weight_bytes, max_group_size=cap)
    for g in plan.groups:
        assert len({hosts[i] for i in g.instances}) == 1, (g.instances, hosts)
    seen = sorted(i for g in plan.groups for i in g.instances) + sorted(i for g in plan.unchanged for i in g)
    assert sorted(seen) == list(range(len(hosts)))
    # falling short, no host is left with two groups that could still merge (within the size cap)
    if not plan.satisfied:
        for h in set(hosts):
            sizes = sorted([len(g) for g in plan.unchanged if hosts[g[0]] == h]
                           + [len(g.instances) for g in plan.groups if hosts[g.instances[0]] == h])
            assert len(sizes) < 2 or sizes[0] + sizes[1] > cap, (h, sizes, cap)
