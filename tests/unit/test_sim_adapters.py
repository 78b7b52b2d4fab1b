"""Simulator <-> policy bridge: the microbatcher's cost model (with the decode KV-read term) and
cost-balanced microbatches of decode-heavy pipeline steps."""

import pytest

from vllm_kunserve.policy.costmodel import CostModel
from vllm_kunserve.sim import adapters
from vllm_kunserve.sim.hardware import get_gpu
from vllm_kunserve.sim.steptime import EqStepTime, GpuStepTime
from vllm_kunserve.workload.models import BUILTIN

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def gpu_st(tmp_path_factory):
    # an empty data dir: the roofline step time (decode attention KV-read-bound), no shared data needed
    import os

    old = os.environ.get("KUNSERVE_DATA")
    os.environ["KUNSERVE_DATA"] = str(tmp_path_factory.mktemp("nodata"))
    try:
        yield GpuStepTime(BUILTIN["qwen2.5-14b"], get_gpu("h100"))
    finally:
        if old is None:
            os.environ.pop("KUNSERVE_DATA", None)
        else:
            os.environ["KUNSERVE_DATA"] = old


def mixed_step():
    # one pipeline step: a long prefill chunk, then 300 decodes at long contexts
    return [(0, 2048)] + [(2000 + 37 * i % 6000, 1) for i in range(300)]


def test_costmodel_fits_decode_attention_of_the_step_time(gpu_st):
    cm = adapters.lookahead_costmodel(gpu_st)
    assert cm.form == "extended" and cm.delta > 10 * cm.alpha  # decode reads KV: far dearer per context token
    for pairs in (mixed_step(), [(4096, 1)] * 64, [(0, 4096)], [(1024, 512)] + [(512, 1)] * 8):
        assert cm.batch_cost(pairs) == pytest.approx(gpu_st.batch_time(pairs) * 1e3, rel=0.05)


def test_eq_steptime_round_trips_delta():
    cm = CostModel(alpha=1e-6, beta=0.02, gamma=1.0, delta=5e-5)
    st = adapters.eq_from_costmodel(cm)
    pairs = [(0, 100), (3000, 1), (10, 1)]
    assert st.batch_time(pairs) == pytest.approx(cm.batch_cost(pairs) * 1e-3)
    back = adapters.lookahead_costmodel(st)
    assert back.batch_cost(pairs) == pytest.approx(cm.batch_cost(pairs))
    assert EqStepTime(1e-9, 1e-5, 1e-3).batch_time([(3000, 1)]) < st.batch_time([(3000, 1)])


def test_decode_heavy_microbatches_are_cost_balanced(gpu_st):
    pairs = mixed_step()
    cm = adapters.lookahead_costmodel(gpu_st)

    def spread(model):
        mbs = adapters.policy_microbatches(pairs, 2, model, 64)
        assert sorted(p for m in mbs for p in m if p[1] == 1) == sorted(p for p in pairs if p[1] == 1)
        assert sum(c for m in mbs for _, c in m) == sum(c for _, c in pairs)  # every token once
        costs = [gpu_st.batch_time(m) for m in mbs]
        return max(costs) / min(costs)

    assert spread(cm) < 1.1
    # the paper form (no decode term) sees the decodes as nearly free and unbalances the stages
    paper = CostModel(cm.alpha, cm.beta, cm.gamma)
    assert spread(paper) > 1.3
