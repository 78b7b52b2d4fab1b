"""Pooled tail statistics with bootstrap intervals (benchmarks/common/pooled.py) and the burst-value benchmark's
analysis (benchmarks/burst_value.py): percentiles over repetitions, ratios, gap closed, goodput."""

import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import pooled as P

from .benchmod import load_benchmark

pytestmark = pytest.mark.unit


def reqs(values, rep=1, tpot=0.05, ok=True, e2e=None):
    return [P.Request(rep, float(i), ok, v if ok else math.inf, tpot if ok else None, 10, e2e if ok else None)
            for i, v in enumerate(values)]


def test_tail_pools_repetitions_and_brackets_the_point():
    rng = np.random.default_rng(3)
    a, b = rng.exponential(1.0, 150), rng.exponential(2.0, 150)
    r = reqs(a, rep=1) + reqs(b, rep=2)
    t = P.tail(r)
    for q in (50, 90, 99):
        cell = t[f"p{q}"]
        assert cell["value"] == pytest.approx(np.percentile(np.concatenate([a, b]), q))
        assert cell["lo"] <= cell["value"] <= cell["hi"]
    assert t["p99"]["hi"] - t["p99"]["lo"] > t["p50"]["hi"] - t["p50"]["lo"]   # the tail is the uncertain end


def test_share_above_counts_slow_and_lost_requests_with_an_interval():
    # rep 1: 10 of 100 over 2 s; rep 2: 30 of 100 over, one of them lost
    r = reqs([0.5] * 90 + [30.0] * 10, rep=1) + reqs([0.5] * 70 + [9.0] * 29, rep=2) + reqs([0.0], rep=2, ok=False)
    s = P.share_above(r, 2.0)
    assert s["value"] == pytest.approx(40 / 200)
    assert s["lo"] < s["value"] < s["hi"] and s["hi"] - s["lo"] < 0.2
    assert P.share_above(r, 100.0)["value"] == pytest.approx(1 / 200)   # only the lost one
    assert P.share_above([], 2.0)["value"] is None


def test_a_lost_request_is_an_infinite_ttft():
    r = reqs([1.0] * 95) + reqs([0.0] * 5, ok=False)
    t = P.tail(r)
    assert t["p50"]["value"] == 1.0 and math.isinf(t["p99"]["value"]) and math.isinf(t["p99"]["hi"])


def test_ratio_and_gap_closed():
    rng = np.random.default_rng(0)
    base = rng.exponential(1.0, 300)
    best, bound = reqs(base * 4), reqs(base)
    r = P.percentile_ratio(best, bound, 99)
    assert r["value"] == pytest.approx(4.0) and r["lo"] < 4.0 < r["hi"]
    closed = P.gap_closed(best, reqs(base), bound, 90)
    assert closed["value"] == pytest.approx(1.0) and closed["lo"] < 1.0 < closed["hi"]
    assert P.gap_closed(best, best, bound, 90)["value"] == pytest.approx(0.0)
    half = P.gap_closed(best, reqs(base * 2.5), bound, 90)
    assert half["value"] == pytest.approx(0.5)
    assert P.gap_closed(bound, best, bound, 90) == {"value": None, "lo": None, "hi": None, "no_gap": True}


def test_goodput_counts_failures_as_misses():
    r = reqs([0.5, 1.5, 2.5]) + reqs([0.5], tpot=0.2) + reqs([0.0], ok=False)
    assert P.goodput(r, ttft_slo_s=2.0, tpot_slo_s=0.1) == pytest.approx(2 / 5)
    assert P.goodput([], 2.0, 0.1) is None


def test_read_window_keeps_the_window(tmp_path):
    f = tmp_path / "requests.csv"
    f.write_text("idx,arrival_s,send_s,ok,ttft_s,tpot_s,e2e_s,output_tokens\n"
                 "0,10,10,1,0.5,0.05,2,30\n1,20,20,1,0.7,0.06,3,30\n2,25,25,0,,,,0\n3,40,40,1,0.1,0.05,1,30\n")
    w = P.read_window(f, 3, 15, 40)
    assert [(x.arrival_s, x.ok, x.rep) for x in w] == [(20.0, True, 3), (25.0, False, 3)]
    assert math.isinf(w[1].ttft_s) and w[0].tpot_s == 0.06


@pytest.fixture
def bv():
    return load_benchmark("burst_value")


def test_group_kv_factor_is_the_issues_formula(bv):
    assert bv.group_kv_factor(0.5) == pytest.approx(1.5)
    assert bv.group_kv_factor(0.6) == pytest.approx(1.75)
    assert bv.group_kv_factor(0.97) == pytest.approx(1 + 0.97 / 0.06)
    assert bv.weight_share(600, 400) == pytest.approx(0.6)
    # the inverse, for a KV cap: 2x is what a group reaches at w = 2/3, 10x at w = 18/19
    for w in (0.5, 0.6, 2 / 3, 0.97):
        assert bv.share_for_kv_factor(bv.group_kv_factor(w)) == pytest.approx(w)
    assert bv.share_for_kv_factor(2.0) == pytest.approx(2 / 3)


def test_analysis_picks_the_best_alternative_and_judges_the_targets(bv):
    rng = np.random.default_rng(1)
    x = rng.exponential(1.0, 320)
    runs = {"vllm": reqs(x * 10), "vllm-tuned": reqs(x * 6), "kunserve": reqs(x * 1.1), "oracle-equal": reqs(x)}
    an = bv.analyse(runs, ttft_slo=2.0, tpot_slo=0.1)
    assert an["best"]["p99"] == "vllm-tuned" and an["best"]["goodput"] == "vllm-tuned"
    k = an["compare"]["kunserve"]
    assert k["p99_over_equal"]["value"] == pytest.approx(1.1)
    assert k["p99_gap_closed"]["value"] == pytest.approx((6 - 1.1) / 5)
    assert an["best_p99_over_equal"]["value"] == pytest.approx(6.0)
    totals = {s: {"failed": 0} for s in runs}
    groups = {"kunserve": {1: {"first_s": 55.0}}}
    lines = bv.verdict(an, totals, groups, (40.0, 80.0))
    text = "\n".join(lines)
    assert "P99 TTFT <= 1.2x oracle-equal's: 1.10" in text and "**met**" in text
    assert "zero requests lost (every run): 0 failed -> **met**" in text
    assert "no group forms in the warm phase" in text and text.count("**missed**") == 0
    early = bv.verdict(an, totals, {"kunserve": {1: {"first_s": 12.0}}}, (40.0, 80.0))
    assert "first grouped at 12 s; warm phase ends at 40 s -> **missed**" in "\n".join(early)

    # an ablation: no alternative ran, so the targets against one are left out rather than listed unmeasured
    abl = bv.analyse({"kunserve": runs["kunserve"], "oracle-equal": runs["oracle-equal"]}, ttft_slo=2.0, tpot_slo=0.1)
    assert "**not measured**" in "\n".join(bv.verdict(abl, totals, groups, (40.0, 80.0)))
    only = "\n".join(bv.verdict(abl, totals, groups, (40.0, 80.0), measured_only=True))
    assert "**not measured**" not in only and "P99 TTFT <= 1.2x oracle-equal's: 1.10" in only


def test_a_pooled_ratio_one_repetition_carries_is_not_called_met(bv):
    rng = np.random.default_rng(5)
    xs = [rng.exponential(0.3, 100) for _ in range(3)]
    kun = [r for k, x in enumerate(xs, 1) for r in reqs(x * 1.5, rep=k)]
    # the oracle's third repetition thrashed: its pooled P99 is that run's, so the pooled ratio looks met
    thrash = [r for k, x in enumerate(xs, 1) for r in reqs(x * (10 if k == 3 else 1), rep=k)]
    each = P.without_each_rep(kun, thrash, 99)
    assert [e["rep"] for e in each] == [1, 2, 3]
    assert each[2]["value"] == pytest.approx(P.percentile_ratio([r for r in kun if r.rep < 3], [r for r in thrash if r.rep < 3],
                                                     99)["value"])
    assert each[2]["value"] > 1.2 > max(e["value"] for e in each[:2])
    totals = {"kunserve": {"failed": 0}, "oracle-equal": {"failed": 0}}
    an = bv.analyse({"kunserve": kun, "oracle-equal": thrash}, ttft_slo=2.0, tpot_slo=0.1)
    assert an["compare"]["kunserve"]["p99_over_equal"]["value"] <= 1.2
    line = next(x for x in bv.verdict(an, totals, {}, (40.0, 80.0), measured_only=True) if "1.2x" in x)
    assert "pooled and with each repetition left out" in line and "not met without repetition 3" in line
    assert line.endswith("**missed**")
    # every repetition alike: met, and the note gives the range without naming one
    calm = [r for k, x in enumerate(xs, 1) for r in reqs(x * 1.4, rep=k)]
    an = bv.analyse({"kunserve": [r for k, x in enumerate(xs, 1) for r in reqs(x * 1.5, rep=k)],
                     "oracle-equal": calm}, ttft_slo=2.0, tpot_slo=0.1)
    line = next(x for x in bv.verdict(an, totals, {}, (40.0, 80.0), measured_only=True) if "1.2x" in x)
    assert "each left out: 1.07..1.07" in line and "not met without" not in line
    assert line.endswith("**met**")
    assert P.without_each_rep(reqs(xs[0]), reqs(xs[0]), 99) == []   # one repetition: nothing to leave out


def test_each_runs_machine_speed_is_read_from_its_warm_decode_rate_and_a_slow_run_is_named(bv, tmp_path):
    from benchmarks.common.burst import machine_speed

    def run(system, rep, tpot):
        d = tmp_path / system / f"rep{rep}"
        d.mkdir(parents=True)
        # two warm requests decoding at 1 / tpot tokens/s from their first token on; one failed; one after the warm
        # phase at another rate, which must not count
        (d / "requests.csv").write_text(
            "idx,arrival_s,send_s,ok,ttft_s,tpot_s,e2e_s,output_tokens\n"
            f"0,2,2,1,0.5,{tpot},40,100\n1,10,10,1,0.5,{tpot},60,100\n2,12,12,0,,,,0\n3,35,35,1,0.5,9.0,50,5\n")
    for s, tpots in {"kunserve": (0.2, 0.2, 0.6), "oracle-equal": (0.2, 0.25, 0.2)}.items():
        for k, t in enumerate(tpots, 1):
            run(s, k, t)
    runs = {"kunserve": [{"server": {"host": {"steal_s": 0.0, "seconds": 200.0}}}] * 2
            + [{"server": {"host": {"steal_s": 100.0, "seconds": 200.0}}}], "oracle-equal": []}
    sp = machine_speed(tmp_path, ["kunserve", "oracle-equal"], 3, (5.0, 30.0), runs)
    assert sp["kunserve"][1]["rate"] == pytest.approx(5.0) and sp["oracle-equal"][2]["rate"] == pytest.approx(4.0)
    assert sp["kunserve"][3]["of_median"] == pytest.approx((1 / 0.6) / 5.0, abs=1e-3) and sp["kunserve"][3]["slow"]
    assert sp["kunserve"][3]["steal_cores"] == 0.5 and sp["oracle-equal"][1]["steal_cores"] is None
    assert [(s, k) for s, v in sp.items() for k, x in v.items() if x["slow"]] == [("kunserve", 3)]
    text = "\n".join(bv.machine_section(sp, 3, (5.0, 30.0)))
    assert "Slow: kunserve rep 3 (0.33x)" in text and "**slow**" in text
    sp["kunserve"][3]["slow"] = False
    assert "No run was slow." in "\n".join(bv.machine_section(sp, 3, (5.0, 30.0)))
    assert bv.machine_section({}, 3, (5.0, 30.0)) == []

    # the statistics again without the slow run's repetition, for every system
    rng = np.random.default_rng(7)
    xs = [rng.exponential(0.3, 100) for _ in range(3)]
    kept = {"kunserve": [r for k, x in enumerate(xs[:2], 1) for r in reqs(x * 1.1, rep=k)],
            "oracle-equal": [r for k, x in enumerate(xs[:2], 1) for r in reqs(x, rep=k)]}
    ws = {"reps": [3], **bv.analyse(kept, ttft_slo=2.0, tpot_slo=0.1)}
    text = "\n".join(bv.without_slow_section(ws, ["kunserve", "oracle-equal"], {"kunserve": {3: {"first_s": 1.0}}},
                                              (40.0, 80.0)))
    assert "Repetition 3 left out for every system" in text and "| kunserve | 200 |" in text
    assert "P99 TTFT <= 1.2x oracle-equal's, pooled and with each repetition left out: 1.10" in text
    assert "zero requests lost (every run): 0 failed -> **met**" in text and "first grouped" not in text
    assert bv.without_slow_section(None, ["kunserve"], {}, (40.0, 80.0)) == []


def test_a_comparison_rendered_from_its_finished_repetitions_reads_no_later_one(bv, tmp_path):
    for k in (1, 2, 3):   # the third had begun (one system's run done) when the comparison was stopped
        d = tmp_path / "kunserve" / f"rep{k}"
        d.mkdir(parents=True)
        (d / "requests.csv").write_text("idx,arrival_s,send_s,ok,ttft_s,tpot_s,e2e_s,output_tokens\n"
                                        f"0,40,40,1,{k},0.05,2,30\n")
    assert [x.rep for x in bv.load_runs(tmp_path, ["kunserve"], (30.0, 94.0), 2)["kunserve"]] == [1, 2]
    assert len(bv.load_runs(tmp_path, ["kunserve"], (30.0, 94.0))["kunserve"]) == 3
    assert bv.send_lag(tmp_path, ["kunserve"], (30.0, 94.0), 2)["kunserve"]["n"] == 2
    bv.copy_raw(tmp_path, tmp_path / "doc", ["kunserve"], 2)
    assert sorted(p.parent.name for p in (tmp_path / "doc").rglob("requests.csv")) == ["rep1", "rep2"]


def test_verdict_says_which_missed_targets_the_equal_memory_oracle_misses_too(bv):
    rng = np.random.default_rng(2)
    x = rng.exponential(1.0, 320)
    runs = {"vllm": reqs(x * 10, tpot=0.05), "vllm-tuned": reqs(x * 6, tpot=0.05),
            "kunserve": reqs(x * 1.1, tpot=0.10), "oracle-equal": reqs(x, tpot=0.08)}
    an = bv.analyse(runs, ttft_slo=2.0, tpot_slo=0.2)
    lines = bv.verdict(an, {s: {"failed": 0} for s in runs}, {}, (40.0, 80.0))
    tpot = next(x for x in lines if "P50 TPOT" in x)
    assert "2.00; oracle-equal (the same memory, no pipeline): 1.60, missed -> **missed**" in tpot
    too = [x for x in lines if "misses the" in x]
    assert len(too) == 1 and too[0].startswith("oracle-equal misses the TPOT target too")
    p99 = next(x for x in lines if "P99 <= 0.6x the best" in x)   # met by both: not listed
    assert p99.endswith("**met**") and "met ->" in p99 and "P99 TTFT" not in too[0]


def test_where_the_cores_went_averages_each_roles_share_over_runs(bv):
    compare = {"systems": [{"name": "vllm-router", "launcher": "vllm-router"}], "runs": {
        "vllm": [{"failed": 0, "requests": 5, "server": {"cpu_share": {"python": 0.08, "VLLM::Worker": 1.6, "client": 0.04}}},
                 {"failed": 0, "requests": 5, "server": {"cpu_share": {"python": 0.06, "VLLM::Worker": 1.4, "client": 0.04}}}],
        "vllm-router": [{"failed": 0, "requests": 5, "server": {"cpu_share": {"python": 0.035, "vllm::router": 0.008,
                                                                               "VLLM::Worker": 1.7}}}]}}
    totals = bv.run_totals(compare, ["vllm", "vllm-router"])
    assert totals["vllm"]["cpu"]["python"] == pytest.approx(0.07)
    assert totals["vllm"]["cpu"]["VLLM::Worker"] == pytest.approx(1.5)
    assert totals["vllm-router"]["cpu"]["vllm::router"] == pytest.approx(0.008)
    text = "\n".join(bv.cpu_section(totals))
    assert "| vllm | 0.070 | 0.000 | 0.000 | 1.500 | 0.040 |" in text
    assert "| vllm-router | 0.035 | 0.008 | 0.000 | 1.700 | 0.000 |" in text
    assert bv.cpu_section({"x": {"cpu": {}}}) == []


def test_a_doc_says_which_steps_its_command_did_not_measure(bv):
    assert bv.reused_note("python benchmarks/burst_value.py --regime r1 --repeat 5") == ""
    assert bv.reused_note("python benchmarks/burst_value.py --steps capacity,sweep,compare") == ""
    n = bv.reused_note("python benchmarks/burst_value.py --steps compare --repeat 5")
    assert n.startswith("The capacity and the sweep were not re-measured") and "`--steps compare`" in n
    assert bv.reused_note("python benchmarks/burst_value.py --steps sweep,compare").startswith(
        "The capacity was not re-measured")
    src = "burst_value_r0_harsh.md, the run before"
    assert f"(the capacity: {src})" in bv.reused_note("python benchmarks/burst_value.py --steps compare",
                                                       swept=False, capacity_from=src)
    assert src not in bv.reused_note("python benchmarks/burst_value.py --steps capacity,compare", capacity_from=src)


def test_joins_are_read_per_system_from_each_front_ends_log(bv, tmp_path):
    """An ablation's variants group too: each system's joins come from its own front end's log (the
    first successful join of a repetition, its deferral measured back from the join's start)."""
    def log(system: str, rep: int, lines: list[str]) -> None:
        p = tmp_path / system / f"rep{rep}" / "server.log"
        p.parent.mkdir(parents=True)
        p.write_text("\n".join(lines) + "\n")
    join = ("2026-11-27 10:00:{s},{ms} kunserve.front INFO group_join {{'outcome': '{o}', 'ms': {d}, "
            "'bytes': {b}, 'engine_ms': {{'0': 300.0, '1': 280.0}}, 'worker_ms': {{'0': [{{'kv_send': 150.0, "
            "'ready_barrier': 40.0}}]}}}}")
    log("kunserve", 1, ["2026-11-27 10:00:01,000 kunserve.front INFO drop_deferred {'waiting': 3}",
                        join.format(s="04", ms="500", o="ok", d=500.0, b=445000000)])
    log("abl-reprefill", 1, [join.format(s="02", ms="000", o="failed", d=90.0, b=0),
                             join.format(s="03", ms="000", o="ok", d=120.0, b=None)])
    (k,) = bv.join_events(tmp_path, 1)
    assert (k["ms"], k["deferred_s"], k["kv_send_ms"], k["barrier_wait_ms"]) == (500.0, 3.0, 150.0, 40.0)
    (v,) = bv.join_events(tmp_path, 1, "abl-reprefill")
    assert (v["ms"], v["deferred_s"], v["bytes"]) == (120.0, 0.0, None)
    assert "| 1 | 0.00 | 120 | 280 / 300 |" in "\n".join(bv.join_section([v]))
    assert bv.join_events(tmp_path, 1, "abl-kv") == []


def test_ratio_of_tpot_skips_requests_without_one():
    a = reqs([1.0] * 50, tpot=0.12) + [P.Request(1, 99.0, True, 1.0, None, 1, None)]
    r = P.percentile_ratio(a, reqs([1.0] * 50, tpot=0.10), 50, metric="tpot")
    assert r["value"] == pytest.approx(1.2) and r["lo"] == pytest.approx(1.2) and r["hi"] == pytest.approx(1.2)
    assert P.percentile_ratio(a, a, 50)["value"] == pytest.approx(1.0)
    lost = [P.Request(1, 98.0, False, math.inf, None, 0, None)]   # a lost request's end-to-end latency is infinite
    e2e = P.percentile_ratio(reqs([1.0] * 50, e2e=3.0) + lost, reqs([1.0] * 50, e2e=2.0), 50, metric="e2e")
    assert e2e["value"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="one of ttft, tpot, e2e"):
        P.percentile_ratio(a, a, 50, metric="itl")


def test_kunserve_against_its_stock_twin(bv, tmp_path):
    """The twin section pools kunserve over stock ``vllm`` per phase (warm: arrivals before the window),
    says whether kunserve grouped, and names only the intervals that exclude 1."""
    rng = np.random.default_rng(3)
    for system, slow in (("kunserve", 1.3), ("vllm", 1.0)):
        for rep in (1, 2):
            p = tmp_path / system / f"rep{rep}" / "requests.csv"
            p.parent.mkdir(parents=True)
            rows = ["idx,arrival_s,send_s,ok,ttft_s,tpot_s,e2e_s,output_tokens"]
            for i, t in enumerate(np.linspace(0, 99, 200)):
                ttft = rng.uniform(1.0, 2.0) * (slow if t >= 30 else 1.0)
                rows.append(f"{i},{t:.2f},{t:.2f},1,{ttft:.4f},{0.5 * slow:.4f},10,20")
            p.write_text("\n".join(rows) + "\n")
    totals = {s: {"output_tokens_per_s": tps, "cpu": {"VLLM::EngineCore": ec, "VLLM::Worker": 1.6}}
              for s, tps, ec in (("kunserve", 58.0, 0.11), ("vllm", 60.0, 0.09))}
    win = bv.load_runs(tmp_path, ["kunserve", "vllm"], (30.0, 100.0))
    tw = bv.twin(tmp_path, (30.0, 100.0), win, {}, totals)
    late = int((np.linspace(0, 99, 200) >= 30).sum())
    assert tw["window"]["n"] == [2 * late] * 2 and tw["warm"]["n"] == [2 * (200 - late)] * 2
    assert tw["window"]["ttft_p50"]["lo"] > 1.1 and tw["window"]["tpot_p50"]["value"] == pytest.approx(1.3)
    assert 0.8 < tw["warm"]["ttft_p50"]["lo"] < 1.0 < tw["warm"]["ttft_p50"]["hi"]
    text = "\n".join(bv.twin_section(tw))
    assert "never grouped in any repetition" in text and "(0.967x)" in text
    assert "engine cores 0.110 against 0.090" in text
    assert "exclude 1 (a difference this many requests can tell from noise): P50 TTFT, P90 TTFT, P99 TTFT, P50 TPOT" in text
    grouped = "\n".join(bv.twin_section(bv.twin(tmp_path, (30.0, 100.0), win, {"kunserve": {2: {}}}, totals)))
    assert "grouped in repetition(s) 2: the ratios include its drops" in grouped
    assert bv.twin(tmp_path, (30.0, 100.0), win, {}, {"kunserve": totals["kunserve"]}) is None
    assert bv.twin_section(None) == []


def test_each_ablation_against_kunserve(bv):
    """The ablation section pools each variant over kunserve in the burst window and names the
    intervals that exclude 1: a variant 1.5x slower to a first token is told apart, a twin is not."""
    rng = np.random.default_rng(5)
    base = rng.uniform(1.0, 2.0, 300)
    win = {"kunserve": reqs(base[:150], rep=1) + reqs(base[150:], rep=2),
           "abl-drop": reqs(base[:150] * 1.5, rep=1) + reqs(base[150:] * 1.5, rep=2),
           "abl-same": reqs(base[:150], rep=1) + reqs(base[150:], rep=2)}
    abl = bv.ablation(win, ["abl-drop", "abl-same", "abl-absent"])
    assert set(abl) == {"abl-drop", "abl-same"}   # a variant that did not run is left out
    assert abl["abl-drop"]["ttft_p50"]["value"] == pytest.approx(1.5) and abl["abl-drop"]["ttft_p50"]["lo"] > 1.2
    assert abl["abl-drop"]["n"] == [300, 300]
    text = "\n".join(bv.ablation_section(abl, {"abl-drop": '{"drop": {"transition": "reprefill"}}'}))
    assert '`abl-drop`: `{"drop": {"transition": "reprefill"}}`' in text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| abl-")}
    assert rows["abl-drop"].rstrip(" |").endswith("P50 TTFT, P90 TTFT, P99 TTFT")   # TPOT is the same
    assert rows["abl-same"].rstrip(" |").endswith("none")
    assert bv.ablation(win, []) == {} and bv.ablation_section({}, {}) == []
    assert bv.ablation({"abl-drop": win["abl-drop"]}, ["abl-drop"]) == {}   # no kunserve: nothing to compare


def test_kv_cap_at_or_below_one_is_refused_before_anything_runs(tmp_path):
    """--kv-cap is a member's KV growth (memory.max_kv_ratio, > 1): a cap of 1 would ask for a group
    that gains nothing, refused in one line before the capacity step starts an engine."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "benchmarks.burst_value", "--regime", "r0", "--kv-cap", "1",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=root)
    assert p.returncode == 2
    assert "--kv-cap 1: a group member's KV may grow to this multiple of its base; must be > 1" in p.stderr
    assert not (tmp_path / "run").exists()


def test_rerun_agreement_tells_a_run_that_fixes_its_tail_from_one_that_does_not():
    """Five repetitions alike: a second run lands within 25% nearly always. Four repetitions whose slow
    requests (2-60 s) bunch in two of them: resampling the repetitions moves P90 from under a second
    to tens of seconds. With 8 slow of 60 in each of the two, the stratified interval (every
    repetition kept) stays under a second while the runs' spread reaches past 5 s; with 12 (P90 on
    the knee), a second run agrees less than half the time. The runs' spread brackets the point."""
    rng = np.random.default_rng(5)
    alike = [r for k in range(5) for r in reqs(rng.exponential(0.5, 60) + 0.2, rep=k)]
    a = P.rerun_agreement(alike, 90, 0.25)
    assert a["agree"] > 0.9 and a["lo"] <= P.tail(alike)["p90"]["value"] <= a["hi"]

    def bunched(slow):
        return [r for k in range(4) for r in reqs(np.r_[rng.uniform(0.3, 0.6, 60 - (slow if k < 2 else 0)),
                                                        rng.uniform(2, 60, slow if k < 2 else 0)], rep=k)]
    b8 = bunched(8)
    spread, strat = P.rerun_agreement(b8, 90, 0.25), P.tail(b8)["p90"]
    assert strat["hi"] < 1.0 and spread["hi"] > 5.0 and spread["lo"] <= strat["value"] <= spread["hi"]
    b12 = bunched(12)
    knee = P.rerun_agreement(b12, 90, 0.25)
    assert knee["agree"] < 0.45 and knee["lo"] < 1.0 and knee["hi"] > 20.0
    assert P.rerun_agreement(b12, 90, 0.25) == knee   # seeded
    assert P.rerun_agreement([], 90, 0.25)["agree"] is None
    lost = [r for k in range(3) for r in reqs([1.0] * 90, rep=k) + reqs([0.0] * 10, rep=k, ok=False)]
    assert P.rerun_agreement(lost, 99, 0.25)["agree"] == 1.0   # every draw's P99 is a lost request


def test_grouped_seconds_become_spans_an_arrival_falls_in():
    from benchmarks.common.burst import in_spans, spans

    assert spans([82.0, 80.0, 81.0, 85.0]) == [[80.0, 83.0], [85.0, 86.0]]
    assert spans([]) == []
    assert in_spans(82.9, [[80.0, 83.0]]) and not in_spans(83.0, [[80.0, 83.0]]) and not in_spans(79.9, [[80.0, 83.0]])


def test_the_groups_output_is_read_against_the_reference_over_the_same_seconds(tmp_path):
    import gzip

    from benchmarks.common.burst import grouped_output

    def timeline(path, rows, gz=False):
        path.mkdir(parents=True)
        text = "second,output_tokens,running\n" + "".join(f"{t},{tok},{run}\n" for t, tok, run in rows)
        if gz:
            with gzip.open(path / "timeline.csv.gz", "wt") as f:
                f.write(text)
        else:
            (path / "timeline.csv").write_text(text)
    # window [30, 40): kunserve groups at 35 s; before it both put out 100 tokens/s at 10 running,
    # grouped kunserve 60 tokens/s against the oracle's 100 at the same 10 running; a second the
    # oracle has no sample for (36) and the second past the window (40) count for neither
    timeline(tmp_path / "kunserve" / "rep1", [(t, 60 if t >= 35 else 100, 10) for t in range(28, 42)])
    timeline(tmp_path / "oracle-equal" / "rep1", [(t, 100, 10) for t in range(28, 42) if t != 36], gz=True)
    groups = {1: {"first_s": 35.0, "spans": [[35.0, 42.0]]}}
    go = grouped_output(tmp_path, "kunserve", "oracle-equal", groups, (30.0, 40.0))
    assert go[1]["grouped"] == {"seconds": 4, "tokens": 0.6, "running": 1.0}
    assert go[1]["before"] == {"seconds": 5, "tokens": 1.0, "running": 1.0}
    assert go["all"] == go[1]
    # a repetition whose reference run is missing pools nothing, and the ratios stay undefined
    go2 = grouped_output(tmp_path, "kunserve", "vllm", groups, (30.0, 40.0))
    assert go2[1]["grouped"] == {"seconds": 0, "tokens": None, "running": None}
    assert grouped_output(tmp_path, "kunserve", "oracle-equal", {}, (30.0, 40.0)) == {}


def test_requests_pair_with_the_same_arrival_of_the_same_repetition():
    a = [P.Request(1, 10.0, True, 1.0, None, 1, None), P.Request(1, 10.0, True, 2.0, None, 1, None),
         P.Request(2, 10.0, True, 3.0, None, 1, None), P.Request(1, 11.0, True, 4.0, None, 1, None)]
    b = [P.Request(2, 10.0, True, 0.3, None, 1, None), P.Request(1, 10.0, True, 0.1, None, 1, None),
         P.Request(1, 10.0, True, 0.2, None, 1, None)]
    # one instant's arrivals pair in their order; a request with no twin (rep 1 at 11 s) drops out
    assert [(x.ttft_s, y.ttft_s) for x, y in P.paired(a, b)] == [(1.0, 0.1), (2.0, 0.2), (3.0, 0.3)]


def test_where_the_tail_sits_names_the_slowest_requests_their_state_and_their_twin(bv):
    def req(rep, t, ttft):
        return P.Request(rep, t, math.isfinite(ttft), ttft, 0.05 if math.isfinite(ttft) else None, 10, None)
    # 2 repetitions of 100 window arrivals each, one every 0.5 s from 40 s; the oracle's TTFT 0.5 s each,
    # kunserve's 0.55 s before its group (from 60 s in rep 1, never in rep 2) and 0.6 s grouped; the
    # request that arrived just before rep 1's group paid the join (2.0 s) and one in rep 2 was lost
    times = [40.0 + 0.5 * i for i in range(100)]
    ora = [req(k, t, 0.5) for k in (1, 2) for t in times]
    ks = [req(1, t, 2.0 if t == 59.5 else 0.6 if t >= 60 else 0.55) for t in times]
    ks += [req(2, t, math.inf if t == 70.0 else 0.55) for t in times]
    groups = {"kunserve": {1: {"first_s": 60.0, "spans": [[60.0, 200.0]]}}}
    ts = bv.tail_sites({"kunserve": ks, "oracle-equal": ora}, groups, "oracle-equal")
    top = ts["kunserve"]["top"]
    assert len(top) == 3   # one per 100 window requests and one more
    assert top[0]["ttft_s"] == math.inf and top[0]["rep"] == 2 and top[0]["state"] == "alone"
    assert top[1] == {"rep": 1, "arrival_s": 59.5, "ttft_s": 2.0, "cluster": 3, "state": "before",
                      "since_group_s": -0.5, "ref_ttft_s": 0.5}
    assert top[2]["state"] == "grouped" and top[2]["ttft_s"] == 0.6
    assert ts["oracle-equal"]["top"][0]["state"] is None and "paired" not in ts["oracle-equal"]
    by = ts["kunserve"]["by_state"]
    assert by["grouped"]["n"] == 60 and by["grouped"]["median_ratio"] == pytest.approx(1.2)
    assert by["before"]["n"] == 40 and by["before"]["p99"] == pytest.approx(np.percentile([0.55] * 39 + [2.0], 99))
    assert by["alone"]["n"] == 100 and by["alone"]["p99"] == math.inf
    assert ts["kunserve"]["paired"]["n"] == 200
    text = "\n".join(bv.tail_section(ts, "oracle-equal"))
    assert "## Where the tail sits" in text
    assert "| kunserve | 1 | 59.50 | 3 | before | -0.50 | 2.00 | 0.50 |" in text
    assert "| kunserve | 2 | 70.00 | 3 | alone | - | lost | 0.50 |" in text
    assert "| kunserve | grouped | 60 | 0.60 | 0.50 | 1.20 | 1.20 |" in text
    assert "| kunserve | alone | 100 | lost | 0.50 | - |" in text
    assert bv.tail_sites({"kunserve": ks}, groups, "oracle-equal") == {} and bv.tail_section({}, "x") == []


def test_a_page_rewritten_from_its_raw_data_keeps_what_its_logs_said(bv, tmp_path):
    doc = {"command": "measured", "joins": [{"rep": 1, "ms": 600}], "monitor_decisions": [], "capacity": {}}
    (tmp_path / "kunserve" / "rep1").mkdir(parents=True)   # a doc's raw data: no server.log
    assert bv.logged_from_doc(tmp_path, doc) == {"joins": [{"rep": 1, "ms": 600}], "monitor_decisions": []}
    assert bv.logged_from_doc(tmp_path, {}) == {}
    (tmp_path / "kunserve" / "rep1" / "server.log").write_text("")   # a run directory: its logs are read again
    assert bv.logged_from_doc(tmp_path, doc) == {}


def test_a_percentile_between_a_finite_ttft_and_a_lost_request_is_lost():
    g = [np.array([0.5] * 99 + [math.inf])]
    assert P.point(g, 99) == math.inf and P.point(g, 50) == 0.5


def test_the_joins_shadow_is_the_share_of_a_window_arriving_during_one(bv):
    joins = {"kunserve": [{"rep": 1, "ms": 640.0}, {"rep": 2, "ms": 1280.0}, {"rep": 3, "ms": 9000.0}],
             "join-early": []}
    groups = {"kunserve": {1: {"first_s": 70.0}, 2: {"first_s": 94.5}, 3: {"first_s": 120.0}}}
    text = "\n".join(bv.join_shadow(joins, groups, (30.0, 94.0)))
    # rep 3 joined after the window: its join kept no window arrival waiting
    assert "- kunserve: its joins took 0.64-1.28 s, so 1.0%-2.0% of the 64 s window's arrivals came during one (above 1%" in text
    assert "join-early" not in text and bv.join_shadow({"kunserve": []}, groups, (30.0, 94.0)) == []
