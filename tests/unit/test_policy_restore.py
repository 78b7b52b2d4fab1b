"""Restore policy: hysteresis, hold time, no re-trigger, failed peers."""

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
