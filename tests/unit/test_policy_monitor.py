"""The overload monitor (``policy.monitor``): demand history, drop, restore after the hold."""

from dataclasses import replace

import pytest

from vllm_kunserve.config import DropConfig, RestoreConfig
from vllm_kunserve.policy import ClusterSnapshot, InstanceSnapshot, ModelSpec, RestoreState
from vllm_kunserve.policy.monitor import MonitorState, monitor_tick, record_demand

pytestmark = pytest.mark.unit

MODEL = ModelSpec(num_layers=4, layer_bytes=100, block_bytes=1)  # one layer = 100 blocks
DROP = DropConfig(forecast_horizon_s=0.0)
RESTORE = RestoreConfig(threshold=0.5, hold_s=5.0)


def alone(used, queued, now):
    return ClusterSnapshot(MODEL, (InstanceSnapshot(0, 1000, used, queued), InstanceSnapshot(1, 1000, used, queued)),
                           now_s=now)


def grouped(used, now):
    # two instances in one group, each dropped 2 layers: +200 blocks over its base of 1000
    insts = (InstanceSnapshot(0, 1200, used // 2, 0, 0, 2), InstanceSnapshot(1, 1200, used // 2, 0, 2, 4))
    return ClusterSnapshot(MODEL, insts, ((0, 1),), now_s=now)


def test_history_keeps_the_window():
    h = ()
    for t, d in ((0.0, 1.0), (5.0, 2.0), (12.0, 3.0)):
        h = record_demand(h, t, d, 10.0)
    assert h == ((5.0, 2.0), (12.0, 3.0))


def test_overload_drops_with_a_plan_and_restarts_the_restore_hold():
    state = MonitorState(restore=RestoreState(below_since=1.0))
    dec, state = monitor_tick(alone(900, 300, 2.0), state, DROP, RESTORE)
    assert dec.action == "drop" and dec.overload.overloaded and dec.drop.groups
    assert dec.cluster.demand_history == ((2.0, 2400.0),) == state.history
    assert state.restore.below_since is None


def test_drop_disabled_or_light_load_does_nothing():
    dec, _ = monitor_tick(alone(900, 300, 0.0), MonitorState(), DropConfig(enable=False, forecast_horizon_s=0.0),
                          RESTORE)
    assert dec.action == "none" and dec.overload.overloaded and dec.drop is None
    dec, _ = monitor_tick(alone(100, 0, 0.0), MonitorState(), DROP, RESTORE)
    assert dec.action == "none" and not dec.overload.overloaded


def test_restores_a_group_after_the_hold():
    state = MonitorState()
    actions = []
    for t in (0.0, 2.5, 5.0):
        dec, state = monitor_tick(grouped(600, t), state, DROP, RESTORE)
        actions.append(dec.action)
    assert actions == ["none", "none", "restore"]
    assert [g.instances for g in dec.restore.restore] == [(0, 1)]
    assert len(state.history) == 3


def test_restore_can_be_switched_off():
    state = MonitorState()
    for t in (0.0, 5.0, 10.0):
        dec, state = monitor_tick(grouped(600, t), state, DROP, RESTORE, allow_restore=False)
        assert dec.action == "none"
    dec, _ = monitor_tick(grouped(600, 20.0), state, DROP, RestoreConfig(enable=False, threshold=0.5))
    assert dec.action == "none"


def test_the_decode_share_spans_the_monitors_recent_readings():
    def snap(used, prompt, output, now, queued=0):
        insts = tuple(InstanceSnapshot(i, 1000, used, queued, prompt_tokens=prompt, output_tokens=output)
                      for i in range(2))
        return ClusterSnapshot(MODEL, insts, now_s=now)
    for window, action in ((5.0, "none"), (0.0, "drop")):
        drop = DropConfig(forecast_horizon_s=0.0, min_decode_share=0.5, decode_share_window_s=window)
        state = MonitorState()
        for t in (0.0, 0.5, 1.0):  # a prompt-heavy mix, below the trigger
            dec, state = monitor_tick(snap(600, 2560, 240, t), state, drop, RESTORE)
            assert dec.action == "none"
        # one reading over the trigger with a decode-heavy mix
        dec, state = monitor_tick(snap(950, 0, 200, 1.5, queued=100), state, drop, RESTORE)
        assert dec.action == action, (window, dec.overload)
        assert [w[0] for w in state.work] == [0.0, 0.5, 1.0, 1.5]
        assert dec.cluster.work_history == tuple(state.work[:-1]) and state.work[-1] == (1.5, 400, 0)


def test_a_drop_merges_lone_instances_only_unless_regroup():
    """By default the plan leaves a live group as it is and merges lone instances; ``drop.regroup``
    (or ``regroup=True``) merges it further."""
    insts = (InstanceSnapshot(0, 1200, 1200, 300, 0, 2), InstanceSnapshot(1, 1200, 1200, 300, 2, 4),
             InstanceSnapshot(2, 1000, 1000, 300), InstanceSnapshot(3, 1000, 1000, 300))
    snap = ClusterSnapshot(MODEL, insts, ((0, 1), (2,), (3,)), now_s=1.0)
    dec, _ = monitor_tick(snap, MonitorState(), DROP, RESTORE)
    assert dec.action == "drop" and [g.instances for g in dec.drop.groups] == [(2, 3)]
    assert dec.drop.unchanged == ((0, 1),) and not dec.drop.satisfied
    dec, _ = monitor_tick(snap, MonitorState(), DROP, RESTORE, regroup=True)
    assert [sorted(g.instances) for g in dec.drop.groups] == [[0, 1, 2, 3]]
    dec2, _ = monitor_tick(snap, MonitorState(), replace(DROP, regroup=True), RESTORE)
    assert dec2.drop == dec.drop
