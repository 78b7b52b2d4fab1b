"""Lookahead microbatching vs token-count chunking."""

import csv
import random
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from vllm_kunserve.policy import (CostModel, RequestSnapshot, default_model, lookahead_microbatches,
                                  pipeline_bubble, token_count_microbatches, work_from_requests)
from vllm_kunserve.policy.microbatch import min_microbatch_cost

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data"
MODEL = default_model()


def azure_lengths():
    with open(DATA / "azure_conv_slice.csv", newline="") as f:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]


def check_schedule(work, mbs):
    """Every token scheduled once; each request's chunks contiguous and in prefix order."""
    want = {}
    for w in work:
        want[w.request_id] = (w.prefix, w.prefix + w.tokens)
    got = defaultdict(list)
    for mb in mbs:
        for c in mb.chunks:
            got[c.request_id].append((c.prefix, c.prefix + c.tokens))
    assert set(got) == set(want)
    for rid, spans in got.items():
        assert spans[0][0] == want[rid][0] and spans[-1][1] == want[rid][1]
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 == b0  # no gap, no overlap, prefix order across microbatches


requests_st = st.lists(st.tuples(st.integers(1, 5000), st.booleans(), st.integers(0, 300)), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(reqs=requests_st, parts=st.integers(1, 9), min_tokens=st.integers(1, 256))
def test_every_token_once_in_prefix_order(reqs, parts, min_tokens):
    rs = [RequestSnapshot(str(i), p, 0 if pre else p, 0 if pre else g) for i, (p, pre, g) in enumerate(reqs)]
    work = work_from_requests(rs)
    for fn in (lookahead_microbatches, token_count_microbatches):
        mbs = fn(work, MODEL, parts, min_tokens)
        check_schedule(work, mbs)
        assert 1 <= len(mbs) <= parts
    la = lookahead_microbatches(work, MODEL, parts, min_tokens)
    assert all(mb.tokens >= 1 for mb in la)
    # the stop rule: never more microbatches than whole units of the min_tokens prefill cost
    total = sum(MODEL.var_cost(w.prefix, w.tokens) for w in work)
    assert len(la) <= max(1, int(total / min_microbatch_cost(MODEL, min_tokens) + 1e-9))


def test_stops_below_min_tokens():
    work = work_from_requests([RequestSnapshot("a", 100)])
    assert len(lookahead_microbatches(work, MODEL, 8, min_tokens=64)) == 1
    assert len(lookahead_microbatches(work, MODEL, 8, min_tokens=8)) > 1


# extended form (decode KV-read term) as fitted to the simulator's H100 Qwen-2.5-14B step times, ms
GPU_MODEL = CostModel(alpha=1.97e-6, beta=0.0406, gamma=8.22, delta=8.25e-5)


def test_decode_only_batches_split_by_cost():
    rng = random.Random(3)
    unit = min_microbatch_cost(GPU_MODEL, 64)
    for n, stages in ((40, 2), (48, 4), (100, 8)):
        # fewer than 2 x min_tokens decodes: a token floor would keep them in one microbatch
        work = work_from_requests([RequestSnapshot(str(j), c, c, 1) for j, c in
                                   enumerate(rng.choice((700, 1500, 3000, 6000)) for _ in range(n))])
        assert all(w.decode and w.tokens == 1 for w in work)
        mbs = lookahead_microbatches(work, GPU_MODEL, stages, min_tokens=64)
        check_schedule(work, mbs)
        total = sum(GPU_MODEL.var_cost(w.prefix, 1) for w in work)
        assert len(mbs) == min(stages, int(total / unit)) > 1
        var = [m.cost - GPU_MODEL.gamma for m in mbs]
        biggest = max(GPU_MODEL.var_cost(w.prefix, 1) for w in work)
        assert max(var) - min(var) <= 2 * biggest  # balanced up to indivisible decode chunks
        assert min(var) >= unit - biggest
        assert pipeline_bubble([m.cost for m in mbs], stages) < pipeline_bubble([sum(var) + GPU_MODEL.gamma], stages)
    # a few short decodes cost less than two units: one microbatch
    few = work_from_requests([RequestSnapshot(str(j), 1000, 1000, 1) for j in range(8)])
    assert len(lookahead_microbatches(few, GPU_MODEL, 4, min_tokens=64)) == 1


def test_balanced_costs_and_chunking():
    # one long prompt: the split must chunk it, and the later chunk (longer prefix) has fewer tokens
    model = CostModel(alpha=1e-4, beta=0.01, gamma=0.5)
    mbs = lookahead_microbatches(work_from_requests([RequestSnapshot("a", 8192)]), model, 4, 64)
    costs = [m.cost for m in mbs]
    assert len(mbs) == 4 and max(costs) / min(costs) < 1.01
    toks = [m.tokens for m in mbs]
    assert toks == sorted(toks, reverse=True) and toks[0] > toks[-1]


def test_bubble_simulator():
    assert pipeline_bubble([1, 1, 1, 1], 4) == pytest.approx(0.0, abs=1e-9)
    assert pipeline_bubble([2, 1, 1, 1], 4) == pytest.approx(1 - 1.25 / 2.0)
    assert pipeline_bubble([1], 4) == pytest.approx(0.75)


def test_lookahead_halves_token_count_bubble_on_azure_mixes():
    lengths = azure_lengths()
    rng = random.Random(0)
    for stages in (2, 4, 8):
        la, tc = [], []
        for _ in range(10):
            rs = []
            for j in range(32):
                p, g = rng.choice(lengths)
                rs.append(RequestSnapshot(str(j), p) if j % 4 == 0 or stages == 8 else
                          RequestSnapshot(str(j), p, p, rng.randint(1, g)))
            work = work_from_requests(rs)
            la.append(pipeline_bubble([m.cost for m in lookahead_microbatches(work, MODEL, stages)], stages))
            tc.append(pipeline_bubble([m.cost for m in token_count_microbatches(work, MODEL, stages)], stages))
        assert sum(la) / len(la) <= 0.5 * sum(tc) / len(tc)
        assert sum(tc) > 0  # the baseline really is imbalanced


def test_step_budget_balances_a_members_step_against_its_peers():
    from vllm_kunserve.policy import WorkChunk, step_budget

    m = CostModel(alpha=0.0, beta=1.0, gamma=5.0)                # one cost unit per token
    dec = [WorkChunk(f"d{i}", 100, 1, True) for i in range(10)]
    pre = [WorkChunk("p0", 0, 300), WorkChunk("p1", 0, 300)]
    # the peer's steps cost 110: ten decodes leave 100 for prefill tokens (p0 chunked)
    assert step_budget(dec + pre, m, 110.0, 16, 8192) == 10 + 100
    # no peer to balance against, or nothing to chunk: the engine's own budget
    assert step_budget(dec + pre, m, 0.0, 16, 8192) == 8192
    assert step_budget(dec, m, 5.0, 16, 8192) == 8192
    # decodes are never split, and queued prefills always move by at least min_tokens
    assert step_budget(dec + pre, m, 3.0, 16, 8192) == 10 + 16
    assert step_budget(dec + [WorkChunk("p", 0, 5)], m, 3.0, 16, 8192) == 10 + 5
    # a costly peer step takes the whole queue, capped by the engine's budget
    assert step_budget(dec + pre, m, 10_000.0, 16, 8192) == 610
    assert step_budget(dec + pre, m, 10_000.0, 16, 256) == 256
    # attention makes later tokens of a long prefix costlier: fewer tokens for the same target
    ma = CostModel(alpha=0.01, beta=1.0, gamma=5.0)
    assert step_budget([WorkChunk("p", 2000, 500)], ma, 200.0, 16, 8192) < step_budget(
        [WorkChunk("p", 0, 500)], ma, 200.0, 16, 8192)
    with pytest.raises(ValueError):
        step_budget(pre, m, 1.0, 0, 10)
