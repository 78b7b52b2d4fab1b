"""The order of the levers (``policy.levers``): remap first while the engines' remap room covers the
shortfall, then drop; groups restore first (a grouped engine never reverts); with no remap room it
decides what the monitor decides."""

from dataclasses import replace

import pytest

from vllm_kunserve.config import DropConfig, RemapConfig
from vllm_kunserve.policy import ClusterSnapshot, InstanceSnapshot, ModelLayers, remap_room
from vllm_kunserve.policy.levers import LeverState, decide_levers
from vllm_kunserve.policy.monitor import MonitorState, monitor_tick

from .test_policy_monitor import MODEL, RESTORE, alone, grouped   # the monitor's snapshots: 2 x 1000 blocks

pytestmark = pytest.mark.unit

DROP = DropConfig(forecast_horizon_s=0.0, remap_first_s=5.0)


def test_a_due_drop_waits_while_the_engines_remap_room_covers_it_then_goes_ahead():
    # demand 2100 of 2000: the drop must free (100 over the trigger) * 1.1 = 110 blocks
    state, levers = LeverState(), []
    for t in (0.0, 2.0, 4.0, 5.0):
        dec, state = decide_levers(alone(1000, 50, t), state, DROP, RESTORE, remap_room={0: 100, 1: 100})
        levers.append(dec.lever)
        assert dec.monitor.action == "drop" and dec.need_blocks == pytest.approx(110.0)
    assert levers == ["remap", "remap", "remap", "drop"]   # past remap_first_s the drop goes ahead
    assert "did not cover it" in dec.reason and state.remap_since is None


def test_remap_room_short_of_the_need_drops_at_once():
    dec, state = decide_levers(alone(1000, 50, 0.0), LeverState(), DROP, RESTORE, remap_room={0: 50, 1: 50})
    assert dec.lever == "drop" and dec.room_blocks == 100 and "short" in dec.reason


def test_only_lone_healthy_engines_room_counts():
    snap = ClusterSnapshot(MODEL, (InstanceSnapshot(0, 1000, 1000, 50), InstanceSnapshot(1, 1000, 1000, 50),
                                   InstanceSnapshot(2, 1000, 1000, 50, healthy=False)), now_s=0.0)
    dec, _ = decide_levers(snap, LeverState(), DROP, RESTORE, remap_room={1: 1000, 2: 1000, 7: 1000})
    assert dec.room_blocks == 1000
    dec, _ = decide_levers(grouped(2400, 0.0), LeverState(), DROP, RESTORE, remap_room={0: 1000, 1: 1000})
    assert dec.room_blocks == 0


def test_with_no_room_or_remap_first_off_it_decides_what_the_monitor_decides():
    for room, drop in (({}, DROP), ({0: 1000, 1: 1000}, replace(DROP, remap_first_s=0.0))):
        lstate, mstate = LeverState(), MonitorState()
        for t, snap in ((0.0, alone(1000, 50, 0.0)), (1.0, alone(100, 0, 1.0)), (2.0, grouped(600, 2.0)),
                        (8.0, grouped(600, 8.0))):
            dec, lstate = decide_levers(snap, lstate, drop, RESTORE, remap_room=room)
            mdec, mstate = monitor_tick(snap, mstate, drop, RESTORE)
            assert dec.lever == mdec.action and lstate.monitor == mstate


def test_groups_restore_first_whatever_the_remap_room():
    state = LeverState()
    for t in (0.0, 2.5, 5.0):
        dec, state = decide_levers(grouped(600, t), state, DROP, RESTORE, remap_room={0: 1000, 1: 1000})
    assert dec.lever == "restore" and [g.instances for g in dec.monitor.restore.restore] == [(0, 1)]


def test_a_wait_that_ends_without_a_drop_starts_over_next_time():
    state = LeverState()
    dec, state = decide_levers(alone(1000, 50, 0.0), state, DROP, RESTORE, remap_room={0: 100, 1: 100})
    assert dec.lever == "remap" and state.remap_since == 0.0
    dec, state = decide_levers(alone(500, 0, 1.0), state, DROP, RESTORE, remap_room={0: 100, 1: 100})
    assert dec.lever == "none" and state.remap_since is None   # the remap covered it
    dec, state = decide_levers(alone(1000, 50, 9.0), state, DROP, RESTORE, remap_room={0: 100, 1: 100})
    assert dec.lever == "remap" and state.remap_since == 9.0


def test_remap_room_is_the_bound_less_what_is_given_and_nothing_with_remap_off():
    m = ModelLayers("m", 8, 100, decode_ms=1.0, prefill_ms=4.0)
    cfg = RemapConfig(enable=True, max_fraction=0.5)
    full = remap_room(m, 1e5, cfg)          # t_x = 1 ms = one layer-time: the caps bind (4 layers, 1 slot)
    assert full == 3 * 100
    assert remap_room(replace(m, remapped_alpha=2, slots=1), 1e5, cfg) == 100
    assert remap_room(m, 1e3, cfg) == 0      # a link too slow to hide any layer
    assert remap_room(m, 1e5, RemapConfig(enable=False)) == 0


def test_a_first_token_deferral_does_not_restart_the_remap_wait():
    drop = replace(DROP, defer_for_first_token_s=2.0, trigger_ratio=0.9)

    def snap(now, awaiting):   # 1900 + 50 of 2000 blocks: over the trigger, under capacity
        return ClusterSnapshot(MODEL, tuple(InstanceSnapshot(i, 1000, 950, 25, awaiting_first_token=awaiting)
                                            for i in range(2)), now_s=now)
    dec, state = decide_levers(snap(0.0, 0), LeverState(), drop, RESTORE, remap_room={0: 1000, 1: 1000})
    assert dec.lever == "remap" and state.remap_since == 0.0
    dec, state = decide_levers(snap(1.0, 3), state, drop, RESTORE, remap_room={0: 1000, 1: 1000})
    assert dec.lever == "none" and "first token" in dec.reason and state.remap_since == 0.0
    dec, state = decide_levers(snap(6.0, 0), state, drop, RESTORE, remap_room={0: 1000, 1: 1000})
    assert dec.lever == "drop" and "within 5 s" in dec.reason   # waited from 0.0, not from 6.0
