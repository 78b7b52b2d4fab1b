"""Dispatch over immutable instance loads (``policy.dispatch``)."""

import pytest

from vllm_kunserve.policy.dispatch import InstanceLoad, choose_instance

pytestmark = pytest.mark.unit


def units():
    return [
        # a pipeline group: more memory, but a deep prefill queue (2000 tokens over 2 GPUs)
        InstanceLoad(0, used_blocks=0, queued_blocks=130, capacity_blocks=300, queued_prefill_tokens=2000,
                     requests=5, k=2),
        InstanceLoad(1, used_blocks=60, queued_blocks=0, capacity_blocks=100, requests=3),  # idle compute
        InstanceLoad(2, used_blocks=95, queued_blocks=0, capacity_blocks=100, requests=1),  # prompt does not fit
    ]


def test_least_load_is_the_lowest_demand_share():
    assert choose_instance(units(), "least-load", prompt_blocks=13) == 0  # 130/300 < 60/100


def test_least_work_prefers_idle_compute_where_the_prompt_fits():
    assert choose_instance(units(), "least-work", prompt_blocks=13) == 1
    # nothing fits: the least demand share
    assert choose_instance(units(), "least-work", prompt_blocks=500) == 0


def test_least_work_divides_the_queue_by_the_pipeline_width():
    a = InstanceLoad(0, 0, 0, 100, queued_prefill_tokens=300, k=4)
    b = InstanceLoad(1, 0, 0, 100, queued_prefill_tokens=100)
    assert choose_instance([a, b], "least-work") == 0  # 75 tokens per GPU < 100


def test_ties_break_on_requests_then_id():
    a, b = InstanceLoad(7, 10, 0, 100, requests=4), InstanceLoad(3, 10, 0, 100, requests=2)
    assert choose_instance([a, b], "least-load") == 3
    assert choose_instance([a, InstanceLoad(3, 10, 0, 100, requests=4)], "least-load") == 3


def test_round_robin_cycles_over_accepting_instances():
    us = [InstanceLoad(i, 0, 0, 10, alive=i != 1) for i in range(3)]
    assert [choose_instance(us, "round-robin", turn=t) for t in range(4)] == [0, 2, 0, 2]


def test_dead_instances_are_skipped_unless_all_are_dead():
    us = units()
    dead = [InstanceLoad(u.instance_id, u.used_blocks, u.queued_blocks, u.capacity_blocks, alive=u.instance_id != 1)
            for u in us]
    assert choose_instance(dead, "least-work", prompt_blocks=13) != 1
    none = [InstanceLoad(i, i, 0, 10, alive=False) for i in range(2)]
    assert choose_instance(none, "least-load") == 0


def test_bad_mode_and_empty_cluster():
    with pytest.raises(ValueError, match="dispatch 'fastest'"):
        choose_instance(units(), "fastest")
    with pytest.raises(ValueError, match="no instance"):
        choose_instance([], "least-load")
