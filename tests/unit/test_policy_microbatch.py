"""Lookahead microbatching vs token-count chunking."""

import csv
import random
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from vllm_kunserve.policy import (CostModel, RequestSnapshot, default_model, lookahead_microbatches,
                                  pipeline_bubble, token_count_microbatches, work_from_requests)

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


def test_stops_below_min_tokens():
    work = work_from_requests([RequestSnapshot("a", 100)])
    assert len(lookahead_microbatches(work, MODEL, 8, min_tokens=64)) == 1
    assert len(lookahead_microbatches(work, MODEL, 8, min_tokens=8)) > 1


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
