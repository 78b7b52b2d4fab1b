"""benchmarks/sim_burstiness.py: argument checks and the helpers that place windows on the grid."""

import math

import pytest

from tests.unit.benchmod import load_benchmark
from vllm_kunserve.sim.trace import TraceRequest

pytestmark = pytest.mark.unit

sb = load_benchmark("sim_burstiness")


def args(*argv):
    """parse_args with stand-in trace files (only their existence is checked)."""
    return sb.parse_args([*argv, "--azure", __file__, "--mooncake", __file__])


def test_quick_and_full_defaults(tmp_path):
    a = args("--quick", "--out", str(tmp_path / "q.md"))
    assert a.cvs == [1.0, 8.0] and a.demands == [0.5, 0.8] and a.window_s == 300 and a.real == ["azure", "mooncake"]
    assert a.caps == [128, 256] and a.equal_groups == [2, 8]
    full = args()
    assert full.cvs == [1, 2, 4, 8] and full.demands == [0.4, 0.5, 0.6, 0.7, 0.8, 0.9] and full.window_s == 600
    assert full.out.endswith("docs/benchmarks/sim_burstiness.md")
    assert args("--real", "none", "--cvs", "3,1").real == [] and args("--cvs", "3,1").cvs == [1, 3]


@pytest.mark.parametrize("argv, needle", [
    (["--cvs", "1,x"], "--cvs '1,x': expected comma-separated numbers"),
    (["--cvs", "0,2"], "--cvs '0,2': every value must be in (0, 100]"),
    (["--demands", "0.5,5"], "--demands '0.5,5': every value must be in (0, 4]"),
    (["--demands", ""], "at least one value"),
    (["--demands", "0.5,0.5"], "repeated value"),
    (["--caps", "64.5"], "whole numbers"),
    (["--equal-groups", "1"], "group sizes >= 2"),
    (["--real", "azure,code"], "--real 'azure,code': comma-separated from azure, mooncake, or none"),
    (["--window-s", "-5"], "--window-s -5.0: must be a positive"),
    (["--warmup-s", "nan"], "--warmup-s nan: must be >= 0"),
    (["--window-target", "0"], "--window-target 0.0"),
    (["--real", "azure", "--mooncake-offset", "60"], "that trace is not among --real"),
    (["--mooncake", "/nonexistent.jsonl", "--azure", __file__], "--mooncake /nonexistent.jsonl: no such file"),
    (["--azure", "/nonexistent.csv"], "--azure /nonexistent.csv: no such file"),
])
def test_bad_arguments_say_what_is_wrong(argv, needle):
    with pytest.raises(SystemExit) as e:
        sb.parse_args(argv if "/nonexistent" in " ".join(argv) else [*argv, "--azure", __file__, "--mooncake", __file__])
    assert needle in str(e.value)


def test_bad_step_time_choice(capsys):
    with pytest.raises(SystemExit):
        sb.parse_args(["--step-time", "cpu"])
    assert "invalid choice" in capsys.readouterr().err


def test_guess_factor_interpolates_in_log_log_and_bounds_extrapolation():
    # demand = (f / 10)^3: interpolation between bracketing points lands on the power law's root
    pts = [(8.0, 0.512), (12.0, 1.728)]
    assert sb.guess_factor(pts, 1.0, 1.0) == pytest.approx(10.0)
    assert sb.guess_factor([], 0.6, 7.0) == 7.0
    # one point: k = 2, at most 2x per step
    assert sb.guess_factor([(10.0, 0.25)], 1.0, 1.0) == pytest.approx(20.0)
    assert sb.guess_factor([(10.0, 0.01)], 1.0, 1.0) == pytest.approx(20.0)
    # two points on one side: the local slope (clipped to <= 4)
    assert sb.guess_factor([(10.0, 0.1), (20.0, 0.8)], 0.9, 1.0) == pytest.approx(20.0 * (0.9 / 0.8) ** (1 / 3))


def test_spread_ticks_and_cv():
    reqs = [TraceRequest(i, t, 10, 2) for i, t in enumerate([0, 0, 0, 3, 3, 6])]
    spread = sb.spread_ticks(reqs, 3.0)
    assert [r.arrival_s for r in spread] == [0, 1, 2, 3, 4.5, 6]
    assert sb.interarrival_cv(spread) < sb.interarrival_cv(reqs)
    even = [TraceRequest(i, float(i), 10, 2) for i in range(5)]
    assert sb.interarrival_cv(even) == 0.0


def _cells(ratios):
    return [{"row": f"gamma-cv{cv:g}", "demand": d, "ratio_tuned_over_kunserve": r} for (cv, d), r in ratios.items()]


def test_windows_go_to_the_nearest_cell_by_log_cv_and_demand():
    cells = _cells({(1, 0.4): 1.0, (1, 0.9): 2.0, (8, 0.4): 3.0, (8, 0.9): 20.0})
    near = lambda cv, d: sb.nearest_cell(cells, [1.0, 8.0], [0.4, 0.9], cv, d)  # noqa: E731
    assert near(2.5, 0.8)["row"] == "gamma-cv1" and near(3.0, 0.8)["row"] == "gamma-cv8"  # sqrt(8) = 2.83
    assert near(1.0, 0.2)["demand"] == 0.4 and near(1.0, 1.5)["demand"] == 0.9


def test_window_shares_count_cells_at_or_above_the_paper():
    cells = _cells({(1, 0.4): 1.0, (1, 0.9): 2.0, (8, 0.4): 3.0, (8, 0.9): 20.0})
    a = sb.argparse.Namespace(cvs=[1.0, 8.0], demands=[0.4, 0.9])
    wins = [{"cv": 6.0, "mean_share": 0.85, "non_overlapping": True},
            {"cv": 1.1, "mean_share": 0.85, "non_overlapping": False},
            {"cv": 7.0, "mean_share": 1.3, "non_overlapping": False}]
    out = sb.window_shares(cells, a, {"t": {"windows": wins}})
    allw = out["t/cv/all"]
    assert allw["windows"] == 3 and allw["at_or_above"] == 2 and allw["share"] == pytest.approx(2 / 3)
    assert allw["outside_demand_range"] == 1 and allw["rows"] == {"gamma-cv1": 1, "gamma-cv8": 2}
    assert out["t/cv/non_overlapping"]["share"] == 1.0 and "t/cv_spread/all" not in out
    cells[-1]["ratio_tuned_over_kunserve"] = None  # kunserve left requests unfinished: not a hit
    assert sb.window_shares(cells, a, {"t": {"windows": wins}})["t/cv/all"]["at_or_above"] == 0


def test_clean_makes_json_safe():
    import numpy as np

    assert sb.clean({"a": math.inf, 2: [np.float64(1.5), np.int64(3), (np.nan,)]}) == {"a": None, "2": [1.5, 3, [None]]}
