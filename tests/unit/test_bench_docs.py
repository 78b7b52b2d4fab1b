"""What the benchmarks' docs share (bench/report.py, benchmarks/common/burst.py, workload/records.py), the one
percentile helper (workload/stats.py) with the rank rules the benchmarks keep, the rate fit that
steps over a trace's earlier points (sim/scaling.py) and the static group as a simulator policy."""

import gzip
import math
import random
import sys

import numpy as np
import pytest

from vllm_kunserve.bench import report
from benchmarks.common.burst import dispatch_split, window_stats
from vllm_kunserve.workload.records import read_csv
from vllm_kunserve.workload.stats import percentile, percentiles

pytestmark = pytest.mark.unit


def test_markdown_and_text_tables():
    assert report.md_table(["a", "b", "c"], "lrl", [[1, "x", 2.5]]) == ["| a | b | c |", "|---|---:|---|",
                                                                         "| 1 | x | 2.5 |"]
    assert report.md_row(["", "y"]) == "|  | y |"
    with pytest.raises(ValueError, match="one letter per column"):
        report.md_table(["a", "b"], "l")
    assert report.text_table(["name", "n"], [["ab", "1"], ["c", "123"]]) == ["name    n", "----  ---", "ab      1",
                                                                            "c     123"]


def test_write_doc_keeps_a_hand_written_reading(tmp_path):
    doc = tmp_path / "sub" / "page.md"
    report.write_doc(doc, ["# Page", "", "v1", ""], keep="## Reading")
    assert doc.read_text() == "# Page\n\nv1\n"
    doc.write_text(doc.read_text() + "\n## Reading\n\nmine\n")
    report.write_doc(doc, ["# Page", "", "v2", ""], keep="## Reading")
    assert doc.read_text() == "# Page\n\nv2\n\n## Reading\n\nmine\n"
    report.write_doc(doc, ["# Page", "v3"])
    assert doc.read_text() == "# Page\nv3"


def test_write_json_cleans_or_keeps_non_finite_values(tmp_path):
    f = tmp_path / "x.json"
    report.write_json(f, {"a": math.inf, 1: (np.float64(1.5), np.int64(2))}, indent=1)
    assert f.read_text() == '{\n "a": null,\n "1": [\n  1.5,\n  2\n ]\n}\n'
    report.write_json(f, {"a": math.nan}, indent=None, clean=False, newline=False)
    assert f.read_text() == '{"a": NaN}'
    deep = tmp_path / "not" / "made" / "x.json"   # a benchmark's --out in a folder not made yet
    report.write_json(deep, [1])
    assert deep.read_text() == "[\n  1\n]\n"


def test_a_saved_figure_is_a_palette_png_that_keeps_its_colours(tmp_path):
    """save_figure writes a 256-colour palette PNG: smaller than matplotlib's RGBA one, the plot's own
    colours still in it, and compacting it again changes nothing."""
    plt = report.pyplot()
    from PIL import Image

    def fig():
        f, ax = plt.subplots(figsize=(4, 3))
        ax.plot(range(10), [x * x for x in range(10)], color="#1f77b4")
        ax.bar(range(5), [3, 1, 4, 1, 5], color="#d62728")
        return f
    raw = tmp_path / "raw.png"
    fig().savefig(raw, dpi=110)
    out = tmp_path / "fig.png"
    report.save_figure(fig(), out)
    with Image.open(out) as im:
        assert im.mode == "P" and im.size == Image.open(raw).size
        colours = {c for _, c in im.convert("RGB").getcolors(1 << 16)}
    assert (0x1f, 0x77, 0xb4) in colours and (0xd6, 0x27, 0x28) in colours
    assert out.stat().st_size < raw.stat().st_size
    before = out.read_bytes()
    report.compact_png(out)
    assert out.read_bytes() == before


def test_command_and_rel(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["/x/benchmarks/tool.py", "--name", "a b", "--j", '{"k": 1}'])
    assert report.command("tool.py") == """python -m benchmarks.tool --name 'a b' --j '{"k": 1}'"""
    assert report.command("tool.py", quote=False) == 'python -m benchmarks.tool --name a b --j {"k": 1}'
    assert report.command("other.py") == "python -m benchmarks.other"       # not the program that runs
    assert report.command("other.py", ["--x"]) == "python -m benchmarks.other --x"
    assert report.rel(report.REPO / "docs" / "benchmarks" / "x.json") == "docs/benchmarks/x.json"
    assert report.rel(tmp_path / "y") == (tmp_path / "y").resolve().as_posix()


def test_one_percentile_helper_keeps_each_benchmarks_rank_rule():
    rng = random.Random(0)
    for n in (1, 2, 7, 20, 101, 200):
        v = [rng.lognormvariate(0, 1) for _ in range(n)]
        s = sorted(v)
        for q in (50, 90, 99):
            k = (n - 1) * q / 100   # linear interpolation (the burst window's P99)
            lo, hi = int(k), min(int(k) + 1, n - 1)
            assert percentile(v, q) == pytest.approx(s[lo] + (s[hi] - s[lo]) * (k - lo), rel=1e-12)
            # the nearest rank (front_end.py) and the order statistic at or above (stage_link.py)
            assert percentile(v, q, method="nearest") == s[min(n - 1, max(0, round(q / 100 * (n - 1))))]
        assert percentile(v, 50, method="higher") == s[n // 2]
        assert percentile(v, 90, method="higher") == s[int(n * 0.9)]
    assert percentile([], 99) is None and percentile([math.nan], 50) is None
    assert percentiles([1.0, 2.0, 3.0], (50,), method="higher") == {"p50": 2.0, "mean": 2.0, "max": 3.0}


def test_a_runs_records_are_read_from_their_gzipped_copy(tmp_path):
    rep = tmp_path / "kunserve" / "rep1"
    rep.mkdir(parents=True)
    rows = ["second,kunserve:dispatched_total{instance=0},kunserve:dispatched_total{instance=1}",
            "0,0,0", "10,4,3", "20,9,9", "30,12,10"]
    with gzip.open(rep / "timeline.csv.gz", "wt") as f:
        f.write("\n".join(rows) + "\n")
    assert read_csv(rep / "timeline.csv")[1]["second"] == "10"
    assert dispatch_split(tmp_path, ["kunserve", "vllm"], 2, (10.0, 30.0)) == {"kunserve": {1: [8, 7]}}
    (rep / "requests.csv").write_text("arrival_s,send_s,ok,ttft_s,tpot_s\n" + "".join(
        f"{t},{t + 0.001},1,{t / 10},0.05\n" for t in range(10, 30)) + "5,5.2,1,9,0.1\n40,40,0,,\n")
    w = window_stats(read_csv(rep / "requests.csv"), 10, 30)
    assert (w["n"], w["failed"], w["failed_all"], w["late_sends"]) == (20, 0, 1, 1)
    assert w["ttft_p50"] == pytest.approx(1.95) and w["ttft_p99"] == pytest.approx(np.percentile(
        [t / 10 for t in range(10, 30)], 99))


def _cfg():
    from vllm_kunserve.sim.engine import SimConfig
    from vllm_kunserve.sim.hardware import get_gpu
    from vllm_kunserve.sim.steptime import EqStepTime
    from vllm_kunserve.workload.models import BUILTIN

    return SimConfig(model=BUILTIN["small"], gpu=get_gpu("h100"), step_time=EqStepTime(1e-8, 2e-5, 5e-3),
                     instances=4, block_size=16, max_tokens=512, max_seqs=64, kv_blocks=64)


def _trace(n=200, seed=3):
    from vllm_kunserve.sim.trace import TraceRequest

    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(1.0)
        out.append(TraceRequest(i, t, rng.randint(50, 400), rng.randint(10, 80)))
    return out


def test_fit_rate_steps_over_a_traces_earlier_points():
    """With ``points`` every factor is guess_factor over this fit's and the earlier fits' points, kept
    inside the bracket; a later target of the same trace starts from what the earlier fits learnt."""
    from vllm_kunserve.sim.scaling import fit_rate, guess_factor
    from vllm_kunserve.sim.trace import compress_time

    cfg, reqs, points = _cfg(), _trace(), []
    _, first = fit_rate(cfg, lambda f: compress_time(reqs, f), 0.5, span=lambda f: (0.0, reqs[-1].arrival_s / f),
                        start=1.0, points=points)
    assert [(round(f, 6), round(m, 6)) for f, m in points] == first["tries"]
    assert abs(first["mean_share"] - 0.5) == min(abs(m - 0.5) for _, m in points)   # the closest try
    lo = [f for f, m in points if m < 0.5]
    hi = [f for f, m in points if m >= 0.5]
    assert lo and hi and max(lo) < min(hi)   # bracketed, and every try kept inside the bracket
    seen = list(points)
    _, second = fit_rate(cfg, lambda f: compress_time(reqs, f), 0.8, span=lambda f: (0.0, reqs[-1].arrival_s / f),
                         start=1.0, points=points)
    assert second["tries"][0][0] == round(guess_factor(seen, 0.8, 1.0), 6)
    assert len(points) == len(seen) + len(second["tries"])


def test_static_is_a_simulator_policy_grouping_every_instance_from_the_start():
    from vllm_kunserve.sim.engine import Simulator
    from vllm_kunserve.sim.policies import POLICIES, build_policy

    assert "static" in POLICIES
    pol = build_policy("static")
    assert pol.name == "static" and pol.tick_s is None
    sim = Simulator(_cfg(), pol, _trace(60)).run()
    drops = [e for e in sim.events if e["kind"] == "drop"]
    assert drops and drops[0]["t"] == 0.0 and len(drops) == 1
    assert not any(e["kind"] == "restore" for e in sim.events)
