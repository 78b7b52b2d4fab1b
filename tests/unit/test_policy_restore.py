"""Restore policy: hysteresis, hold time, no re-trigger, failed peers."""

from dataclasses import replace

import pytest

from vllm_kunserve.config import DropConfig, RestoreConfig
from vllm_kunserve.policy import ClusterSnapshot, InstanceSnapshot, ModelSpec, RestoreState, decide_restore

pytestmark = pytest.mark.unit

MODEL = ModelSpec(num_layers=4, layer_bytes=100, block_bytes=1)  # one layer = 100 blocks


def grouped(used, now, healthy=True):
    # two instances in one group; each dropped 2 layers: +200 blocks over its base of 1000
    insts = (InstanceSnapshot(0, 1200, used // 2, 0, 0, 2, healthy), InstanceSnapshot(1, 1200, used // 2, 0, 2, 4))
    return ClusterSnapshot(MODEL, insts, ((0, 1),), now_s=now)


CFG = RestoreConfig(threshold=0.5, hold_s=5.0)
DROP = DropConfig(forecast_horizon_s=0.0)


def test_waits_for_hold_time_then_restores():
    d, s = decide_restore(grouped(600, 0.0), RestoreState(), CFG, DROP)
    assert d.reason == "holding" and not d.restore and s.below_since == 0.0
    d, s = decide_restore(grouped(600, 4.0), s, CFG, DROP)
    assert not d.restore
    d, s = decide_restore(grouped(600, 5.0), s, CFG, DROP)
    assert [g.instances for g in d.restore] == [(0, 1)]
    assert d.restore[0].restored_bytes == 4 * 100
    assert d.predicted_ratio == pytest.approx(600 / 2000)


def test_hysteresis_resets_when_demand_rises():
    _, s = decide_restore(grouped(600, 0.0), RestoreState(), CFG, DROP)
    d, s = decide_restore(grouped(1100, 3.0), s, CFG, DROP)  # 55% of base: above threshold
    assert d.reason == "demand_above_threshold" and s.below_since is None
    d, s = decide_restore(grouped(600, 6.0), s, CFG, DROP)
    assert not d.restore and s.below_since == 6.0


def test_no_restore_that_would_retrigger_a_drop():
    # demand fits the cluster under the threshold, but this group's requests would not fit back
    insts = (InstanceSnapshot(0, 1200, 1100, 0, 0, 2), InstanceSnapshot(1, 1200, 1000, 0, 2, 4),
             InstanceSnapshot(2, 4000, 0), InstanceSnapshot(3, 4000, 0))
    c = ClusterSnapshot(MODEL, insts, ((0, 1), (2,), (3,)), now_s=10.0)
    d, _ = decide_restore(c, RestoreState(below_since=0.0), CFG, DROP)
    assert d.restore == () and d.reason == "would_retrigger"


def test_failed_instance_restores_immediately_from_host():
    d, _ = decide_restore(grouped(2000, 0.0, healthy=False), RestoreState(), CFG, DROP)
    assert d.restore[0].reason == "failed_instance" and d.restore[0].source == "host"


def test_threshold_must_sit_below_trigger():
    with pytest.raises(ValueError, match="hysteresis"):
        decide_restore(grouped(0, 0.0), RestoreState(), RestoreConfig(threshold=0.9), DropConfig(trigger_ratio=0.8))


def test_restore_uses_the_base_the_engine_reports_when_growth_was_capped():
    # each member dropped 2 layers (200 blocks' worth) but its KV grew only 1000 -> 1100 (capped by
    # max_kv_ratio): deriving the base from the dropped bytes gives 900 per member and misjudges
    # the split; with the engine's own base of 1000 the group splits back to exactly that
    def snap(used, now, base):
        insts = (InstanceSnapshot(0, 1100, used // 2, 0, 0, 2, kv_blocks_base=base),
                 InstanceSnapshot(1, 1100, used // 2, 0, 2, 4, kv_blocks_base=base))
        return ClusterSnapshot(MODEL, insts, ((0, 1),), now_s=now)

    _, s = decide_restore(snap(900, 0.0, 1000), RestoreState(), CFG, DROP)
    d, _ = decide_restore(snap(900, 5.0, 1000), s, CFG, DROP)
    assert [g.instances for g in d.restore] == [(0, 1)]
    assert d.demand_ratio == pytest.approx(900 / 2000) and d.predicted_ratio == pytest.approx(900 / 2000)
    d, _ = decide_restore(snap(900, 0.0, 0), RestoreState(), CFG, DROP)   # derived: 900 / 1800
    assert d.demand_ratio == pytest.approx(900 / 1800) and d.reason == "demand_above_threshold"
    assert InstanceSnapshot.from_dict({"instance_id": 0, "kv_blocks_total": 5, "kv_blocks_used": 0,
                                       "kv_blocks_base": 3}).kv_blocks_base == 3


# step by step (drop.regroup): eight layers, a group of four holding two each; each member's base is
# 1000 blocks, so in the four it has 1000 + 3/4 of a weight copy (800 blocks) = 1600, in a pair 1400
MODEL8 = ModelSpec(num_layers=8, layer_bytes=100, block_bytes=1)
STEP = DropConfig(forecast_horizon_s=0.0, trigger_ratio=0.9, regroup=True)


def four(used, now=10.0):
    """The group of four (instance i on layers [2i, 2i + 2), ``used[i]`` blocks) and three idle lone
    instances, so the cluster is far below the restore threshold."""
    insts = tuple(InstanceSnapshot(i, 1600, used[i], 0, 2 * i, 2 * i + 2, kv_blocks_base=1000) for i in range(4))
    insts += tuple(InstanceSnapshot(i, 4000, 0, kv_blocks_base=4000) for i in (4, 5, 6))
    return ClusterSnapshot(MODEL8, insts, ((0, 1, 2, 3), (4,), (5,), (6,)), now_s=now)


def test_a_group_of_four_whose_requests_do_not_fit_back_alone_splits_into_pairs_first():
    used = (950, 950, 950, 950)   # 3800 of the four's 4000 base blocks: over the trigger alone
    d, _ = decide_restore(four(used), RestoreState(below_since=0.0), CFG, replace(STEP, regroup=False))
    assert d.restore == () and d.reason == "would_retrigger"   # without drop.regroup: all or nothing
    d, s = decide_restore(four(used), RestoreState(below_since=0.0), CFG, STEP)
    (g,) = d.restore
    assert g.reason == "low_demand_step" and g.instances == (0, 1, 2, 3)
    # members alternate by stage, so each half's stages contain what its members hold now
    assert g.into == ((0, 2), (1, 3))
    assert dict((i, (lo, hi)) for i, lo, hi in g.stages) == {0: (0, 4), 2: (4, 8), 1: (0, 4), 3: (4, 8)}
    assert dict(g.blocks) == {i: 1400 for i in range(4)}          # 1600 less the two layers each takes back
    assert g.restored_bytes == 4 * 2 * 100
    assert d.predicted_ratio == pytest.approx(3800 / (4 * 1400 + 3 * 4000))
    assert s.below_since is None                                  # the next step waits the hold time again
    assert d.to_dict()["restore"][0]["into"] == [[0, 2], [1, 3]]
    # the pairs then split once their requests fit their members alone
    pairs = (InstanceSnapshot(0, 1400, 400, 0, 0, 4, kv_blocks_base=1000),
             InstanceSnapshot(2, 1400, 400, 0, 4, 8, kv_blocks_base=1000),
             InstanceSnapshot(1, 1400, 1300, 0, 0, 4, kv_blocks_base=1000),
             InstanceSnapshot(3, 1400, 1300, 0, 4, 8, kv_blocks_base=1000))
    c = ClusterSnapshot(MODEL8, pairs + four(used).instances[4:], ((0, 2), (1, 3), (4,), (5,), (6,)), now_s=20.0)
    d, _ = decide_restore(c, RestoreState(below_since=10.0), CFG, STEP)
    assert [(g.instances, g.reason, g.into) for g in d.restore] == [((0, 2), "low_demand", ())]


def test_no_step_where_a_half_would_not_hold_its_requests():
    # the same 3800 blocks, but 0 and 2 (one half) hold 2600 of them: 2600 / 2800 is over the trigger
    d, _ = decide_restore(four((1300, 600, 1300, 600)), RestoreState(below_since=0.0), CFG, STEP)
    assert d.restore == () and d.reason == "would_retrigger"
    # and a group of two or three never steps: there is no smaller group to step to
    trio = tuple(InstanceSnapshot(i, 1600, 1000, 0, lo, hi, kv_blocks_base=1000)
                 for i, (lo, hi) in enumerate(((0, 3), (3, 6), (6, 8))))
    c = ClusterSnapshot(MODEL8, trio + (InstanceSnapshot(3, 9000, 0, kv_blocks_base=9000),), ((0, 1, 2), (3,)),
                        now_s=10.0)
    d, _ = decide_restore(c, RestoreState(below_since=0.0), CFG, STEP)
    assert d.restore == ()
