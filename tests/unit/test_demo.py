"""make demo's regime: the burst needs more KV than stock has and less than a group has, in whole
blocks at the stated weight share, and its schedule is one the client accepts."""

import pytest

from vllm_kunserve.cli import demo
from vllm_kunserve.bench.client import parse_concurrency

pytestmark = pytest.mark.unit


def test_weight_share_and_group_factor():
    s = demo.spec()
    kv = demo.kv_tokens_per_engine()
    assert kv % demo.BLOCK == 0
    share = s.weight_bytes() / (s.weight_bytes() + kv * s.kv_bytes_per_token())
    assert share == pytest.approx(demo.WEIGHT_SHARE, abs=0.01)
    assert 0.35 <= demo.WEIGHT_SHARE <= 0.65   # paper-like, not extreme
    assert demo.group_factor() == pytest.approx(1 + demo.WEIGHT_SHARE / (2 * (1 - demo.WEIGHT_SHARE)))


def test_burst_binds_stock_and_fits_the_group():
    u = demo.users()
    cap = u["capacity_users"]
    assert u["base"] < cap < u["peak"] < demo.group_factor() * cap
    sched = parse_concurrency(u["schedule"])
    limits = [c for _, c in sched]
    assert limits[0] == u["base"] == limits[-1] and max(limits) == u["peak"]
    assert sched[-1][0] == demo.PHASES[1] and sched[1][0] == demo.PHASES[0]
    assert limits == sorted(limits[:-1]) + [limits[-1]]   # the users join over the ramp, then leave at once


def test_run_facts_from_a_timeline(tmp_path):
    rows = ["second,waiting{instance=0},waiting{instance=1},kunserve:grouped_instances",
            "0,0,0,0", "1,2,1,0", "2,4,3,2", "3,1,0,2", "4,0,0,0"]
    (tmp_path / "timeline.csv").write_text("\n".join(rows) + "\n")
    f = demo.run_facts(tmp_path)
    assert f == {"waiting_peak": 7.0, "grouped_s": [2.0, 3.0]}
