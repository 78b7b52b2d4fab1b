"""Oneiros remap controller."""

import pytest

from vllm_kunserve.config import RemapConfig
from vllm_kunserve.policy import ModelLayers, RemapInput, RemapState, decide_remap, spaced_layers
from vllm_kunserve.policy.remap import max_remapped, with_models

pytestmark = pytest.mark.unit

GB = 1 << 30


def model(name="m", layers=32, active=True, prio=None, last=0.0, decode_ms=1.0, **kw):
    # one layer = 0.5 GB; at 100 GB/s it streams in 5 ms = 5 decode layer-times
    return ModelLayers(name, layers, GB // 2, decode_ms, 4.0, active, prio, last, **kw)


def gaps(layers, n):
    s = sorted(layers)
    return [(s[(i + 1) % len(s)] - s[i]) % n or n for i in range(len(s))]


def test_eq4_eq5_bounds():
    # t_x / t_c = 5: one slot needs gaps of 6 layers, two slots gaps of 5
    assert max_remapped(32, 5.0, 1) == 32 // 6
    assert max_remapped(32, 5.0, 2) == 32 // 5
    assert max_remapped(32, 0.2, 1) == 16 and max_remapped(32, 0.2, 2) == 32


def test_transfer_hides_behind_compute():
    cfg = RemapConfig(max_fraction=1.0)
    inp = RemapInput((model(),), 100e9, kv_shortage_bytes=100 * GB)
    plan, _ = decide_remap(inp, cfg)
    (r,) = plan.models
    t_x = (GB // 2) / 100e9 * 1e3
    d = min(gaps(r.layers, 32))
    assert len(r.layers) == r.alpha + r.slots
    assert (t_x <= (d - 1) * 1.0) if r.slots == 1 else (t_x <= d * 1.0)  # Eq. 4 / Eq. 5
    assert r.hidden and plan.shortfall_bytes > 0  # bounded by bandwidth, not the shortage
    assert max(gaps(r.layers, 32)) - min(gaps(r.layers, 32)) <= 1  # evenly spaced on the ring


def test_auto_slots_prefers_one_slot_when_enough():
    inp = RemapInput((model(),), 100e9, kv_shortage_bytes=GB)  # 2 layers needed
    plan, _ = decide_remap(inp, RemapConfig())
    assert plan.models[0].alpha == 2 and plan.models[0].slots == 1 and plan.shortfall_bytes == 0
    plan2, _ = decide_remap(inp, RemapConfig(slots="2"))
    assert plan2.models[0].slots == 2 and len(plan2.models[0].layers) == 4


def test_inactive_low_priority_first_and_never_whole_model():
    ms = (model("hot", prio=5), model("cold", active=False, prio=9), model("low", prio=0))
    plan, _ = decide_remap(RemapInput(ms, 100e9, kv_shortage_bytes=GB), RemapConfig())
    assert [r.model for r in plan.models] == ["cold"]
    plan, _ = decide_remap(RemapInput(ms, 100e9, kv_shortage_bytes=1000 * GB), RemapConfig(max_fraction=1.0))
    assert plan.models[0].model == "cold" and plan.models[1].model == "low"
    for r in plan.models:
        assert len(r.layers) <= 31  # never the whole model


def test_mru_when_no_priority():
    ms = (model("old", last=1.0), model("recent", last=9.0))
    plan, _ = decide_remap(RemapInput(ms, 100e9, kv_shortage_bytes=GB), RemapConfig())
    assert plan.models[0].model == "recent"


def test_caps():
    inp = RemapInput((model(active=False),), 100e9, kv_shortage_bytes=1000 * GB)
    plan, _ = decide_remap(inp, RemapConfig(max_fraction=0.25))
    assert len(plan.models[0].layers) <= 8
    plan, _ = decide_remap(inp, RemapConfig(max_layers=3))
    assert plan.models[0].alpha == 3


def test_revert_after_hold_when_kv_frees_up():
    cfg = RemapConfig(low_watermark=0.5, revert_hold_s=2.0)
    inp = RemapInput((model(),), 100e9, kv_shortage_bytes=2 * GB)
    plan, st = decide_remap(inp, cfg)
    after = with_models(inp, plan)
    low = RemapInput(after.models, 100e9, 0.0, kv_free_bytes=100 * GB, demand_ratio=0.3, now_s=10.0)
    p1, st = decide_remap(low, cfg, st)
    assert p1.action == "hold" and st.low_since == 10.0
    p2, st = decide_remap(RemapInput(low.models, 100e9, 0.0, 100 * GB, 0.3, 12.0), cfg, st)
    assert p2.action == "revert" and p2.models[0].alpha == 0 and p2.freed_bytes == -plan.freed_bytes
    # not enough free KV to give back: partial revert only
    p3, _ = decide_remap(RemapInput(low.models, 100e9, 0.0, GB // 2, 0.3, 12.0), cfg, RemapState(10.0))
    assert p3.models[0].alpha == plan.models[0].alpha - 1


def test_spaced_layers_even_on_ring():
    for n, m in [(32, 5), (7, 3), (80, 9)]:
        g = gaps(spaced_layers(n, m), n)
        assert len(set(spaced_layers(n, m))) == m and max(g) - min(g) <= 1


def test_further_remap_keeps_the_slot_count_in_use():
    # remapped with 1 slot already: the 2-slot bound (larger here) must not be used with 1 slot
    cfg = RemapConfig(max_fraction=1.0)
    bw = 2.5e12  # t_x / t_c ~ 0.21: one slot needs gaps of 2 layers, two slots of 1
    m = model(remapped_alpha=2, slots=1)
    plan, _ = decide_remap(RemapInput((m,), bw, kv_shortage_bytes=100 * GB), cfg)
    (r,) = plan.models
    assert r.slots == 1
    assert r.alpha + 1 == max_remapped(32, (GB // 2) / bw * 1e3, 1) == 16  # Eq. 4 bound, 1 slot
    fresh, _ = decide_remap(RemapInput((model(),), bw, kv_shortage_bytes=100 * GB), cfg)
    assert fresh.models[0].slots == 2 and fresh.models[0].alpha > r.alpha  # from scratch 2 slots reach further


def test_inline_copies_use_one_slot_and_a_step_budget():
    # 0.5 GiB layers at 100 GB/s: t_x = 5.4 ms; 4 ms/layer on 32 layers: 128 ms a step
    cfg = RemapConfig(max_fraction=1.0)
    inp = RemapInput((model(decode_ms=4.0),), 100e9, kv_shortage_bytes=2 * GB, copy_overlap=False)
    (r,) = decide_remap(inp, cfg)[0].models
    assert r.slots == 1 and not r.hidden and r.alpha == r.alpha_bound == 4
    t_x = (GB // 2) / 100e9 * 1e3
    m = r.alpha + r.slots
    assert m * t_x <= 0.25 * 32 * 4.0 < (m + 1) * t_x  # copies stay within a quarter of the step
    # a fast link: the cap binds, not the budget, and still one slot
    fast = RemapInput((model(decode_ms=4.0),), 10e12, kv_shortage_bytes=15 * GB, copy_overlap=False)
    (r2,) = decide_remap(fast, cfg)[0].models
    assert r2.slots == 1 and r2.alpha + 1 == 31


def test_inline_copies_remap_only_when_the_shortage_is_covered():
    cfg = RemapConfig(max_fraction=1.0)
    m = model(decode_ms=4.0)
    within = RemapInput((m,), 100e9, kv_shortage_bytes=GB, copy_overlap=False)  # 2 layers cover it
    plan, _ = decide_remap(within, cfg)
    assert plan.action == "remap" and plan.shortfall_bytes == 0
    beyond = RemapInput((m,), 100e9, kv_shortage_bytes=100 * GB, copy_overlap=False)
    plan, _ = decide_remap(beyond, cfg)
    assert plan.action == "hold" and not plan.models and plan.shortfall_bytes > 0
    # with overlapping copies a partial remap still helps (streaming is hidden): it is made
    plan, _ = decide_remap(RemapInput((m,), 100e9, kv_shortage_bytes=100 * GB), cfg)
    assert plan.action == "remap" and plan.shortfall_bytes > 0
