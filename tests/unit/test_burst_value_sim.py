"""benchmarks/burst_value_sim.py's verdict helpers: which missed percentiles sit on the knee of the
TTFT curve (the measured share of slow requests straddles the percentile's tail share)."""

import pytest

from .benchmod import load_benchmark

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def bvs():
    return load_benchmark("burst_value_sim")


def row(system, r90, r99, share, lo, hi, sim_share=None, within=None):
    return {"system": system, "ratio_p90": r90, "ratio_p99": r99,
            "within": within if within is not None else all(abs(x - 1) <= 0.25 for x in (r90, r99)),
            "over_slo": {"measured": {"value": share, "lo": lo, "hi": hi},
                         "predicted": {"value": sim_share, "lo": None, "hi": None}}}


def test_knee_note_names_missed_percentiles_whose_tail_share_is_inside_the_measured_interval(bvs):
    rows = [row("router", 9.95, 0.90, 0.097, 0.065, 0.13),     # P90 missed, 10% inside 6.5..13%: on the knee
            row("stock", 0.07, 0.77, 0.19, 0.15, 0.23),        # P90 missed, 10% outside: a real miss
            row("oracle", 1.1, 1.0, 0.0, 0.0, 0.0)]            # within: never listed
    note = bvs.knee_note(rows)
    assert "router's P90" in note and "stock" not in note and "oracle" not in note
    assert bvs.knee_note(rows[1:]) == ""


def test_share_cell_reads_measured_interval_and_prediction(bvs):
    assert bvs.share_cell(row("a", 1, 1, 0.192, 0.149, 0.234, sim_share=0.104)) == "19.2% (14.9%..23.4%) / 10.4%"
    r = row("a", 1, 1, 0.192, 0.149, 0.234, sim_share=0.104)
    r["over_slo"]["measured_reps"] = [0.05, 0.21, 0.29]
    assert bvs.share_cell(r) == "19.2% (14.9%..23.4%; reps 5%..29%) / 10.4%"
    assert bvs.share_cell({"system": "b"}) == "-"


def _run(tmp_path, name, tpots):
    """A burst_value run directory: per system one repetition, warm requests (arrival < 30 s) with
    the given TPOT and window requests (arrival >= 30 s) ten times slower, which must not count."""
    for system, tpot in tpots.items():
        d = tmp_path / name / system / "rep1"
        d.mkdir(parents=True)
        rows = ["idx,arrival_s,ok,ttft_s,tpot_s,output_tokens,e2e_s"]
        rows += [f"{i},{i},1,0.5,{tpot},100,10" for i in range(10)]
        rows += [f"{10 + i},{40 + i},1,0.5,{tpot * 10},100,10" for i in range(10)]
        (d / "requests.csv").write_text("\n".join(rows) + "\n")
    return tmp_path / name


def test_machine_speed_is_the_median_warm_tpot_ratio_over_systems(bvs, tmp_path):
    fit = _run(tmp_path, "fit", {"vllm": 0.20, "kunserve": 0.25, "oracle-equal": 0.22})
    pred = _run(tmp_path, "pred", {"vllm": 0.23, "kunserve": 0.30, "oracle-equal": 0.242})
    w = {"window": [30.0, 94.0]}
    sp = bvs.machine_speed(fit, pred, w, w, ["vllm", "kunserve", "oracle-equal", "static"])
    assert sp["by_system"] == pytest.approx({"vllm": 1.15, "kunserve": 1.2, "oracle-equal": 1.1})
    assert sp["factor"] == pytest.approx(1.15)
    assert "every line x1.150" in bvs.machine_line(sp)
    assert bvs.machine_speed(fit, pred, w, w, ["static"]) is None
    assert "not applied" in bvs.machine_line(None)


def test_noise_adds_a_drawn_residual_to_each_request_and_keeps_lost_ones_lost(bvs):
    import math

    from benchmarks.common import pooled

    pred = [pooled.Request(1, 40.0, True, 0.5, 0.1, 100, 10.0), pooled.Request(2, 41.0, True, 0.05, 0.1, 100, 10.0),
            pooled.Request(2, 42.0, False, math.inf, None, 0, None)]
    res = [-0.2, 0.0, 0.3]
    out = bvs.with_noise(pred, res, draws=40, seed=1)
    assert len(out) == 120 and out == bvs.with_noise(pred, res, draws=40, seed=1)   # seeded: the page re-renders
    first, second, lost = out[:40], out[40:80], out[80:]
    assert {round(r.ttft_s - 0.5, 9) for r in first} == set(res) and all(r.rep == 1 for r in first)
    assert min(r.ttft_s for r in second) == 0.0   # 0.05 - 0.2 is never a negative wait
    assert all(not r.ok and r.ttft_s == math.inf for r in lost)
    n = bvs.noise_summary([0.01 * i for i in range(101)], "vllm")
    assert n["from"] == "vllm" and n["n"] == 101 and n["p50"] == pytest.approx(0.5) and n["p99"] == pytest.approx(0.99)
    assert "vllm +0.50 / +0.90 / +0.99 s (n 101)" in bvs.noise_line([{"system": "vllm", "noise": n}])
    assert "none added" in bvs.noise_line([{"system": "vllm", "noise": None}])


def test_a_system_absent_from_the_fit_run_takes_the_lines_of_its_kind(bvs, tmp_path):
    """Predicting a run whose systems the fit run lacks (the harsher R0 run from the ablation): a
    kunserve variant and static take kunserve's lines, a stock system the first stock one that ran
    (not a router's, whose timeline is one engine's); a system that ran keeps its own."""
    fit = _run(tmp_path, "fit", {"kunserve": 0.1, "oracle-equal": 0.1, "vllm-router": 0.1})
    variants = {"kunserve-peak": {"lookahead": {"admission": "peak"}}}
    src = {s: bvs.lines_source(s, fit, variants)
           for s in ("kunserve", "kunserve-peak", "static", "vllm", "vllm-tuned", "oracle-equal", "vllm-router")}
    assert src == {"kunserve": "kunserve", "kunserve-peak": "kunserve", "static": "kunserve", "vllm": "oracle-equal",
                   "vllm-tuned": "oracle-equal", "oracle-equal": "oracle-equal", "vllm-router": "oracle-equal"}
    both = _run(tmp_path, "both", {"vllm": 0.1, "kunserve": 0.1, "kunserve-peak": 0.1})
    assert bvs.lines_source("vllm-tuned", both, variants) == "vllm"
    assert bvs.lines_source("kunserve-peak", both, variants) == "kunserve-peak"
    assert bvs.lines_source("vllm-router", both, variants) == "vllm"


def test_held_out_names_what_the_fit_never_saw(bvs):
    """The same arrivals on other memory are held out in memory, not in arrivals; rates a few percent
    apart (each run's measured capacity) are the same arrivals; nothing different is no held-out test."""
    def st(phases, cap=10.0, eq=10.0, offset=0.0):
        return {"trace": {"window_offset": offset, "seed": 1}, "phases": phases,
                "kunserve_config": {"memory": {"max_kv_ratio": cap}}, "specs": {"oracle-equal": {"kv_x": eq}}}
    fit = st("30@0.128,100@0.512")
    txt = bvs.held_out(fit, st("30@0.126,100@0.504", cap=2.0, eq=2.0))
    assert txt.startswith("The two runs share the trace window, seed and phases (rates within 5%")
    assert "kunserve's KV cap (`memory.max_kv_ratio`) is 2.0x, the fit's 10.0x" in txt
    assert "oracle-equal's KV 2x the base, the fit's 10x" in txt and txt.endswith("memory the fit never saw.")
    assert bvs.held_out(fit, st("30@0.128,100@0.512")).endswith("not a held-out test.")
    assert "differ in the burst's rate" in bvs.held_out(fit, st("30@0.128,100@0.7"))
    assert "another part of the trace" in bvs.held_out(fit, st("30@0.128,100@0.512", offset=1800.0))
    assert bvs.memory_change(fit, st("30@0.128,100@0.512")) == ""


def test_settings_of_a_run_carry_its_variants_configs(bvs, tmp_path):
    """A run's --variant systems are simulated with their own merged kunserve config."""
    import json
    args = {"phases": "30@0.128,100@0.512", "model": "models/decode-bf16", "instances": 2, "kv_capacity_tokens": 1280,
            "block_size": 32, "dispatch": "least-work", "engine_arg": [], "oracle_equal_kv_multiplier": 2.0,
            "kunserve_config": json.dumps({"memory": {"max_kv_ratio": 2.0}}),
            "variant": ['kunserve-peak={"lookahead": {"admission": "peak"}}']}
    (tmp_path / "compare.json").write_text(json.dumps({"args": args}))
    s = bvs.settings_of(tmp_path)
    assert s["variants"] == {"kunserve-peak": {"memory": {"max_kv_ratio": 2.0}, "lookahead": {"admission": "peak"}}}
    assert s["specs"]["oracle-equal"] == {"kv_x": 2.0} and s["window"] == [30.0, 130.0]


def test_fixed_verdict_judges_the_percentiles_a_run_fixes_and_the_rest_by_the_runs_spread(bvs):
    def cell(agree, within, in_spread):
        return {"agree": agree, "lo": 0.0, "hi": 1.0, "fixed": agree >= 0.5, "within": within, "in_spread": in_spread}

    tails = {q: {"value": 1.0} for q in ("p90", "p99")}
    rows = [{"system": "stock", "rerun": {"p90": cell(0.28, False, True), "p99": cell(0.93, True, True)},
             "second_run": {"n": 300, "p90": 1.43, "p99": 0.99}, "measured": tails, "predicted": tails},
            {"system": "kunserve", "rerun": {"p90": cell(0.84, True, True), "p99": cell(0.74, False, False)},
             "measured": tails, "predicted": tails}]
    lines = bvs.fixed_verdict({"rows": rows, "fixed": 0.5, "rerun": "docs/x"})
    text = "\n".join(lines)
    assert "stock 28% / 93%, kunserve 84% / 74%" in text
    assert "within 25% at 2 of 3; outside: kunserve's P99" in text
    assert "does not fix (stock's P90)" in text and "spread at 1 of 1" in text
    assert "(`docs/x`, 1 systems): within 25% of this run at 1 of 2 percentiles; outside: stock's P90 (1.43x)" in text
    assert bvs.fixed_verdict({"rows": [{"system": "a"}]}) == []
    table = bvs.fixed_table({"rows": rows, "rerun": "docs/x"})
    assert any(line.startswith("| stock |") and line.endswith("1.43 / 0.99 (300) |") for line in table)
    assert any(line.startswith("| kunserve |") and line.endswith("| - |") for line in table)


def test_same_arrivals_and_a_rerun_on_other_arrivals_is_refused(bvs):
    def st(phases, offset=0.0, seed=1):
        return {"trace": {"window_offset": offset, "seed": seed}, "phases": phases}
    a = st("30@0.30,64@1.20")
    assert bvs.same_arrivals(a, st("30@0.301,64@1.204", offset=0))   # "0" and "0.0" are one window
    assert not bvs.same_arrivals(a, st("30@0.30,64@1.20", seed=2))
    assert not bvs.same_arrivals(a, st("30@0.30,64@1.20", offset=1800.0))
    assert not bvs.same_arrivals(a, st("30@0.30,64@1.50"))
    assert "their seeds differ (2 against 1)" in bvs.held_out(a, st("30@0.30,64@1.20", seed=2))
    assert "differ in the burst's rate" in bvs.held_out(a, st("30@0.30,64@1.50", offset="0"))
