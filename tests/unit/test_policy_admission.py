"""Peak-aware admission (policy/admission.py) and its scheduler touchpoint's inputs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from vllm_kunserve.integration.vllm.scheduler import admission_limit
from vllm_kunserve.policy import KvNeed, admit_count, peak_blocks

pytestmark = pytest.mark.unit


def _exact_peak(reqs, bs):
    """Step by step: after t more steps a request holds tokens + t until it has generated its last."""
    horizon = max((r.left for r in reqs), default=0)
    return max((sum(-(-(r.tokens + t) // bs) for r in reqs if t <= r.left) for t in range(horizon + 1)),
               default=0)


def test_peak_is_the_step_by_step_peak_exactly():
    rng = random.Random(7)
    for _ in range(300):
        bs = rng.choice([1, 16, 32])
        reqs = [KvNeed(rng.randint(1, 400), rng.randint(0, 300)) for _ in range(rng.randint(0, 12))]
        exact, bound = _exact_peak(reqs, bs), peak_blocks(reqs, bs)
        assert bound == exact, (reqs, bs, exact, bound)
    assert peak_blocks([KvNeed(64, 0)], 1) == 64 and peak_blocks([], 16) == 0
    with pytest.raises(ValueError, match="block_size"):
        peak_blocks([KvNeed(1, 1)], 0)


def test_the_peak_is_where_the_long_requests_are_still_alive_not_the_sum_of_final_lengths():
    # one request near its end and one at its start: their final lengths sum to 1000 tokens, but
    # the first is gone before the second has grown: the peak is both 10 steps on (500 + 110)
    reqs = [KvNeed(490, 10), KvNeed(100, 400)]
    assert peak_blocks(reqs, 1) == 610 == _exact_peak(reqs, 1)


def test_admit_in_queue_order_until_the_first_that_would_not_finish():
    running = [KvNeed(200, 100), KvNeed(100, 200)]           # peak 300 + 300 = 600 at t=100
    queue = [KvNeed(64, 100), KvNeed(64, 400), KvNeed(8, 1)]
    assert admit_count(running, queue, capacity_blocks=764, block_size=1) == 1
    # the second does not fit (64 + 400 alone, plus the others alive), and the tiny third does
    # not overtake it
    assert admit_count(running, queue, capacity_blocks=10_000, block_size=1) == 3
    assert admit_count(running, queue, capacity_blocks=500, block_size=1) == 0
    # nothing running: the head starts even if it alone is too big (vLLM's handling takes over)
    assert admit_count([], [KvNeed(900, 900), KvNeed(1, 1)], capacity_blocks=100, block_size=1) == 1
    assert admit_count(running, [], capacity_blocks=10, block_size=1) == 0


def _r(rid, tokens, out, max_tokens):
    return SimpleNamespace(request_id=rid, num_tokens=tokens, num_output_tokens=out, max_tokens=max_tokens)


def test_admission_limit_reads_vllms_requests_and_usable_blocks():
    pool = SimpleNamespace(num_gpu_blocks=31)                 # 30 usable: block 0 is the null block
    sched = SimpleNamespace(
        running=[_r("a", 300, 236, 300), _r("b", 100, 36, 300)],   # 64-token prompts
        kv_holding_waiting=[],
        # a preempted request (its outputs so far are recomputed: it needs them all back) first
        waiting=[_r("p", 264, 200, 300), _r("n", 64, 0, 300)],
        kv_cache_manager=SimpleNamespace(block_pool=pool), block_size=32, num_waiting_for_streaming_input=0)
    need = [KvNeed(300, 64), KvNeed(100, 264), KvNeed(264, 100), KvNeed(64, 300)]
    assert peak_blocks(need[:3], 32) <= 30 < peak_blocks(need, 32)
    assert admission_limit(sched) == 3
    pool.num_gpu_blocks = 19
    assert admission_limit(sched) == 2                          # nothing more starts
    sched.running = []
    assert admission_limit(sched) == 2                          # both queued ones fit in 18 blocks
    pool.num_gpu_blocks = 6
    assert admission_limit(sched) == 1                          # nothing runs: the head always may
