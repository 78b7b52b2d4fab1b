"""One builder of the remap policy's input (``policy.inputs``), shared by the engine agent and the
simulator: shortage above the high watermark, the KV a revert needs free, demand over the base."""

import pytest

from vllm_kunserve.config import RemapConfig
from vllm_kunserve.policy import ModelLayers, RemapState, decide_remap
from vllm_kunserve.policy.inputs import EngineLoad, remap_input

pytestmark = pytest.mark.unit

BB = 1000  # bytes per block
MODEL = ModelLayers("m", 8, 10 * BB, 1.0, 1.0)


def load(used=0, queued=0, growth=0, capacity=100, base=100, free=None):
    return EngineLoad(used, queued, growth, capacity, base, capacity - used if free is None else free, BB)


def inp(ld, watermark=0.9, **kw):
    return remap_input(ld, MODEL, h2d_bytes_per_s=1e9, high_watermark=watermark, now_s=7.0, **kw)


def test_demand_counts_used_queued_and_growth():
    assert load(40, 30, 20).demand_blocks == 90


def test_shortage_is_demand_above_the_high_watermark_of_capacity():
    assert inp(load(40, 30, 20)).kv_shortage_bytes == 0  # 90 <= 0.9 * 100
    assert inp(load(40, 30, 25)).kv_shortage_bytes == pytest.approx(5 * BB)
    assert inp(load(80, 60, 0), watermark=1.0).kv_shortage_bytes == pytest.approx(40 * BB)
    # after a remap the capacity, not the base, is what the demand is measured against
    assert inp(load(80, 50, 0, capacity=150, base=100)).kv_shortage_bytes == 0  # 130 <= 0.9 * 150


def test_free_kv_is_what_a_revert_could_take_back():
    # remapped: capacity 150 over a base of 100; a revert gives back 50 blocks, so only the part of
    # the base the demand leaves free counts, whatever the free blocks above it
    assert inp(load(30, 10, 0, capacity=150, base=100, free=120)).kv_free_bytes == 60 * BB
    assert inp(load(90, 30, 0, capacity=150, base=100)).kv_free_bytes == 0
    # not remapped: the free blocks themselves
    assert inp(load(30, 10, 0, free=70)).kv_free_bytes == 70 * BB


def test_demand_ratio_is_over_the_base_and_never_divides_by_zero():
    assert inp(load(30, 10, 10, capacity=150, base=100)).demand_ratio == pytest.approx(0.5)
    assert inp(load(3, 0, 0, capacity=0, base=0, free=0)).demand_ratio == 3.0


def test_the_rest_of_the_input_is_passed_through():
    x = inp(load(10), copy_overlap=False)
    assert x.models == (MODEL,) and x.h2d_bytes_per_s == 1e9 and x.now_s == 7.0 and x.copy_overlap is False
    assert inp(load(10)).copy_overlap is True


def test_decisions_follow_the_input():
    cfg = RemapConfig(enable=True, high_watermark=0.9, max_fraction=1.0)
    plan, _ = decide_remap(inp(load(95, 20, 0)), cfg, RemapState())
    assert plan.action == "remap" and plan.models[0].alpha >= 1
    plan, _ = decide_remap(inp(load(50, 0, 0)), cfg, RemapState())
    assert plan.action != "remap"
