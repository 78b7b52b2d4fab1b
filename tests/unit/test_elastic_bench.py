"""benchmarks/elastic.py: the phases it asks for, the fleet's size changes read from a timeline, and the
page's rule applied to an analysis."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import elastic as E

pytestmark = pytest.mark.unit


def test_phases_follow_the_levels_and_the_elastic_system_is_derived_from_stock():
    ph = E.phases(2.0, 30.0).split(",")
    assert len(ph) == len(E.LEVELS) and ph[0] == f"30@{E.LEVELS[0] * 2:.3f}"
    rates = [float(p.split("@")[1]) for p in ph]
    assert rates.index(max(rates)) in (3, 4) and rates[0] == rates[-1]   # a rise and a fall
    d = E.derive()
    assert set(d) == set(E.SYSTEMS) and all(x["from"] == "vllm" for x in d.values())
    assert d["fixed-max"]["serve_args"] == ["--instances", "2"] and "--max-instances" in d["elastic"]["serve_args"]


def test_changes_keep_the_first_row_and_every_change():
    t, held = np.arange(6.0), np.array([1, 1, 2, 2, 1, 1.0])
    assert E.changes(t, held) == [[0.0, 1.0], [2.0, 2.0], [4.0, 1.0]]


def _an(e_inst, mx_inst, e99, mx99, mn99):
    def p(v, lo, hi):
        return {"value": v, "lo": lo, "hi": hi}
    return {"elastic": {"instance_s": float(np.mean(e_inst)), "instance_s_reps": e_inst, "ttft_p99": p(*e99)},
            "fixed-max": {"instance_s": float(np.mean(mx_inst)), "instance_s_reps": mx_inst, "ttft_p99": p(*mx99)},
            "fixed-min": {"instance_s": 1.0, "instance_s_reps": [1.0], "ttft_p99": p(*mn99)}}


def test_the_rule_saves_keeps_and_beats_only_where_the_numbers_say_so():
    v = E.verdict(_an([80, 90], [100, 100], (0.35, 0.31, 0.47), (0.31, 0.27, 0.37), (3.2, 1.6, 5.0)))
    assert (v["saves"], v["keeps_tail"], v["beats_min"]) == (True, True, True)
    assert v["instance_s_ratio"] == pytest.approx(0.85)
    v = E.verdict(_an([80, 101], [100, 100], (0.9, 0.6, 1.9), (0.31, 0.27, 0.37), (1.5, 1.2, 2.0)))
    assert (v["saves"], v["keeps_tail"], v["beats_min"]) == (False, False, False)
