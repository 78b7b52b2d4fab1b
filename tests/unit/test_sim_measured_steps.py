"""Measured step times in the simulator: a decode table interpolated by batch size plus a prefill rate."""

import pytest

from vllm_kunserve.sim import runfit
from vllm_kunserve.sim.engine import SimConfig, Simulator
from vllm_kunserve.sim.hardware import get_gpu
from vllm_kunserve.sim.policies import build_policy
from vllm_kunserve.sim.steptime import MeasuredStepTime
from vllm_kunserve.sim.trace import TraceRequest
from vllm_kunserve.workload.models import BUILTIN

pytestmark = pytest.mark.unit

# docs/benchmarks/batch_scaling.json's shape (batch 1 costs more than batch 4 there: kept as measured)
ROWS = [{"batch": 1, "step_ms": 45.54}, {"batch": 4, "step_ms": 39.62},
        {"batch": 16, "step_ms": 73.06}, {"batch": 64, "step_ms": 237.32}]


def test_matches_table_at_measured_batches():
    st = MeasuredStepTime.from_table(ROWS, prefill_tps=480.0)
    for r in ROWS:
        assert st.decode_time(r["batch"]) == pytest.approx(r["step_ms"] / 1e3)
        assert st.batch_time([(100, 1)] * r["batch"]) == pytest.approx(r["step_ms"] / 1e3)


def test_linear_between_rows_and_clamped_below():
    st = MeasuredStepTime.from_table(ROWS, prefill_tps=480.0)
    assert st.decode_time(10) == pytest.approx((39.62 + 73.06) / 2 / 1e3)
    assert st.decode_time(0.5) == pytest.approx(45.54e-3)
    assert st.decode_time(0) == 0.0
    assert st.batch_time([]) == 0.0


def test_extrapolates_with_last_slope():
    st = MeasuredStepTime.from_table(ROWS, prefill_tps=480.0)
    slope = (237.32 - 73.06) / 48 / 1e3
    assert st.decode_time(96) == pytest.approx(237.32e-3 + 32 * slope)


def test_monotone_where_the_table_is():
    st = MeasuredStepTime([(1, 0.04), (4, 0.045), (16, 0.07), (64, 0.24)], prefill_tps=480.0)
    times = [st.decode_time(n) for n in range(1, 200)]
    assert all(b >= a for a, b in zip(times, times[1:]))
    # and above the first row the real table is monotone too
    real = MeasuredStepTime.from_table(ROWS, prefill_tps=480.0)
    times = [real.decode_time(n) for n in range(4, 200)]
    assert all(b >= a for a, b in zip(times, times[1:]))


def test_prefill_tokens_add_at_the_rate():
    st = MeasuredStepTime.from_table(ROWS, prefill_tps=480.0)
    assert st.batch_time([(0, 64)]) == pytest.approx(64 / 480)
    mixed = st.batch_time([(0, 64)] + [(200, 1)] * 4)
    assert mixed == pytest.approx(64 / 480 + 39.62e-3)
    assert st.describe()["kind"] == "measured"


def test_rejects_bad_tables():
    with pytest.raises(ValueError):
        MeasuredStepTime([], 480.0)
    with pytest.raises(ValueError):
        MeasuredStepTime([(1, 0.04), (1, 0.05)], 480.0)
    with pytest.raises(ValueError):
        MeasuredStepTime([(1, 0.04)], 0.0)


def test_drives_a_simulation():
    """One instance, a lone request: TTFT is its prefill step, every later token one batch-1 step."""
    st = MeasuredStepTime.from_table(ROWS, prefill_tps=480.0)
    cfg = SimConfig(model=BUILTIN["small"], gpu=get_gpu("cpu"), step_time=st, instances=1, block_size=32,
                    kv_blocks=40, runtime_reserve_bytes=0)
    sim = Simulator(cfg, build_policy("vllm"), [TraceRequest(0, 0.0, 64, 5)]).run()
    rec = sim.reqs[0].record()
    assert rec["ttft_s"] == pytest.approx(64 / 480)
    assert rec["tpot_s"] == pytest.approx(45.54e-3)


# ---------------------------------------------------------------------------- a run's own step line
def test_fit_decode_line_recovers_a_line_and_stays_physical():
    from vllm_kunserve.sim.steptime import fit_decode_line

    a, c = fit_decode_line([(b, 0.05 + 0.004 * b, 1.0) for b in (1, 2, 5, 10, 30)])
    assert (a, c) == (pytest.approx(0.05), pytest.approx(0.004))
    # weights: the heavy point pulls the constant
    a, c = fit_decode_line([(1, 0.10, 3.0), (2, 0.05, 1.0)])  # falling: a constant step, the weighted mean
    assert c == 0.0 and a == pytest.approx((0.3 + 0.05) / 4)
    a, c = fit_decode_line([(1, 0.01, 1.0), (2, 0.05, 1.0)])  # negative intercept: through the origin
    assert a == 0.0 and c == pytest.approx((0.01 + 0.1) / 5)
    with pytest.raises(ValueError):
        fit_decode_line([])


def test_linear_step_time_pays_the_fixed_part_once():
    st = MeasuredStepTime.linear(0.05, 0.004, prefill_tps=400.0)
    assert st.decode_time(1) == pytest.approx(0.054)
    assert st.decode_time(10) == pytest.approx(0.09)
    assert st.decode_time(0.5) == pytest.approx(0.054)
    # a prompt alone pays the intercept; riding a decode step it does not pay it again
    assert st.batch_time([(0, 64)]) == pytest.approx(0.05 + 64 / 400)
    assert st.batch_time([(0, 64)] + [(100, 1)] * 10) == pytest.approx(0.09 + 64 / 400)
    assert st.describe()["prefill_fixed_s"] == 0.05
    flat = MeasuredStepTime.linear(0.06, 0.0, prefill_tps=400.0)
    assert flat.decode_time(1) == flat.decode_time(50) == pytest.approx(0.06)
    with pytest.raises(ValueError):
        MeasuredStepTime.linear(0.05, -0.001, 400.0)
    with pytest.raises(ValueError):
        MeasuredStepTime([(1, 0.04)], 400.0, prefill_fixed_s=-1.0)


def _tl_row(sec, running, tokens, arrivals=0, waiting=0, completions=0, preemptions=0, layers=(12, 12)):
    r = {"second": str(sec), "arrivals": str(arrivals), "completions": str(completions), "running": str(running),
         "output_tokens": str(tokens), "waiting": str(waiting), "preemptions": str(preemptions)}
    for i, v in enumerate(layers):
        r[f"kunserve:layers_held{{instance={i}}}"] = str(v)
    return r


def test_clean_seconds_and_the_run_line():
    """2 engines whose step is 40 ms + 5 ms per request: running R gives R / step(R/2) tokens/s."""

    def tok(run):
        return run / (0.04 + 0.005 * max(1.0, run / 2))

    tl = [_tl_row(0, 2, tok(2), arrivals=1)]           # an arrival: its second and the next are out
    tl += [_tl_row(s, 2, tok(2)) for s in range(1, 7)]
    tl += [_tl_row(7, 8, tok(8), waiting=2, completions=1)]  # a finish admits a waiting request: out
    tl += [_tl_row(s, 8, tok(8), waiting=2) for s in range(8, 14)]  # waiting, nothing frees: decode only
    tl += [_tl_row(s, 20, tok(20), layers=(6, 6)) for s in range(14, 24)]  # grouped
    secs = runfit.clean_seconds(tl, 2)
    assert [s["second"] for s in secs["single"]] == [2, 3, 4, 5, 6, 9, 10, 11, 12, 13]
    assert [s["second"] for s in secs["grouped"]] == list(range(15, 24))
    fit = runfit.fit_steps(secs["single"])
    assert fit["a_s"] == pytest.approx(0.04) and fit["c_s"] == pytest.approx(0.005)
    g = runfit.fit_steps(secs["grouped"])  # one batch size only: a constant step at it
    assert g["c_s"] == 0.0 and g["a_s"] == pytest.approx(0.04 + 0.005 * 10)


def test_fit_steps_keeps_tokens_a_paused_front_end_delivers_late():
    """A second read as 0 tokens and the next as twice its share: pooled in a run, the step is right."""
    secs = [{"second": float(s), "running": 4.0, "tokens": t, "batch": 2.0}
            for s, t in zip(range(10), [80, 80, 0, 160, 80, 80, 80, 0, 160, 80])]
    secs += [{"second": float(s), "running": 20.0, "tokens": 200.0, "batch": 10.0} for s in range(20, 30)]
    fit = runfit.fit_steps(secs)
    assert fit["a_s"] + 2 * fit["c_s"] == pytest.approx(4 / 80)
    assert fit["a_s"] + 10 * fit["c_s"] == pytest.approx(20 / 200)


def test_prefill_rate_from_warm_requests():
    """An idle engine: TTFT = fixed + prompt / rate; a busy one: 1.5 steps + prompt / rate."""
    fits = {"single": {"a_s": 0.05, "c_s": 0.01}, "grouped": None}
    tl = [_tl_row(s, 1, 20) for s in range(200)]
    rate = 400.0
    rows = [  # idx, arrival, send, ttft, e2e
        (0, 0.0, 0.0, 0.05 + 64 / rate, 30.0),                     # alone
        (1, 10.0, 10.0, 1.5 * 0.06 + 64 / rate, 5.0),              # request 0 decoding: batch 1
        (2, 50.0, 50.0, 0.2, 1.0),                                  # overlaps 3's prefill: skipped
        (3, 50.1, 50.1, 0.2, 1.0),
        (4, 70.0, 70.0, 0.05 + 64 / rate, 1.0),                     # arrival in the window: skipped
    ]
    csv_rows = [{"idx": str(i), "arrival_s": str(a), "send_s": str(s), "ttft_s": str(t), "e2e_s": str(e),
                 "ok": "1", "prompt_len": "64", "server_prompt_tokens": "64"} for i, a, s, t, e in rows]
    got = runfit.prefill_samples(csv_rows, 60.0, tl, 1, fits)  # one engine: request 1 finds request 0 running
    assert got == [pytest.approx(1 / rate), pytest.approx(1 / rate)]


def test_a_runs_variant_is_simulated_with_its_own_kunserve_config():
    """``--variant NAME=JSON`` systems of a run are simulated as kunserve with the merged config:
    here vLLM's admission in place of the group's peak-aware one."""
    base = {"memory": {"max_kv_ratio": 2.0}, "lookahead": {"admission": "peak"}}
    from vllm_kunserve.bench.systems import variant_configs

    variants = variant_configs(['vllm-admit={"lookahead": {"admission": "vllm"}}'], base)
    assert variants == {"vllm-admit": {"memory": {"max_kv_ratio": 2.0}, "lookahead": {"admission": "vllm"}}}
    settings = {"block_size": 16, "kv_tokens": 1024, "kunserve_config": base, "variants": variants,
                "model": "small", "instances": 2, "max_num_batched_tokens": 2048, "max_num_seqs": 128,
                "oracle_x": 10.0, "dispatch": "least-work"}
    st = MeasuredStepTime.linear(0.04, 0.005, 400.0)
    assert runfit.make_sim(st, None, settings, "kunserve", []).policy.peak_admission is True
    assert runfit.make_sim(st, None, settings, "vllm-admit", []).policy.peak_admission is False
    with pytest.raises(ValueError, match="variant"):
        runfit.make_sim(st, None, settings, "nope", [])


def test_held_out_lines_come_from_the_other_repetitions_only():
    """A held-out repetition (``pooled_fits(leave_out=1)``): repetition 1 is predicted from repetitions
    2 and 3 (their seconds pooled but never joined into one run across repetitions, their warm-request
    prefill samples), nothing of its own."""

    def secs(a, c, start):   # 5 seconds at a batch of 2, then 2 at a batch of 8
        return [{"second": float(s), "running": 2 * b, "tokens": 2 * b / (a + c * b), "batch": float(b)}
                for s, b in zip(range(start, start + 7), [2] * 5 + [8] * 2)]

    data = {("vllm", 1): {"secs": {"single": secs(0.04, 0.005, 0), "grouped": []}, "pf": [0.001] * 6},
            ("vllm", 2): {"secs": {"single": secs(0.06, 0.002, 0), "grouped": []}, "pf": [0.003] * 6},
            ("vllm", 3): {"secs": {"single": secs(0.06, 0.002, 7), "grouped": []}, "pf": [0.003] * 6},
            ("oracle", 1): {"secs": {"single": secs(0.01, 0.001, 0), "grouped": []}, "pf": [0.009] * 6}}
    fits, pf = runfit.pooled_fits(data, "vllm", leave_out=1)
    # rep 3's seconds 7.. follow rep 2's 0..6 in number; a run joining them would pool rep 2's batch-8
    # seconds with rep 3's batch-2 ones and bend the line: runs never span two repetitions
    assert fits["single"]["a_s"] == pytest.approx(0.06) and fits["single"]["c_s"] == pytest.approx(0.002)
    assert fits["single"]["runs"] == 4
    assert fits["grouped"] is None
    assert pf == [0.003] * 12
    own, _ = runfit.pooled_fits(data, "vllm", leave_out=2)
    assert own["single"]["a_s"] != pytest.approx(0.06)   # rep 1's line is in it


def test_crossing_interpolates_where_the_curve_meets_one():
    assert runfit.crossing([(0.8, 0.9), (0.9, 0.95), (1.0, 1.05)]) == (pytest.approx(0.95), True)
    assert runfit.crossing([(0.8, 1.2), (0.9, 1.3)]) == (0.8, False)      # never crosses: the nearest, flagged
    assert runfit.crossing([(0.8, 0.7), (0.9, 0.8)]) == (0.9, False)


def _rows_from(sim_reqs, records):
    """requests.csv rows of a simulated run: what the calibration reads (trace and client TPOT)."""
    rows = []
    for r in sim_reqs:
        x = records[r.id]
        rows.append({"idx": str(r.id), "arrival_s": str(r.arrival), "send_s": str(r.arrival), "ok": "1",
                     "prompt_len": str(r.prompt), "server_prompt_tokens": str(r.prompt), "output_len": str(r.output),
                     "ttft_s": str(x["ttft_s"]), "e2e_s": str(x["latency_s"]), "tpot_s": str(x["tpot_s"])})
    return rows


def test_calibrate_finds_the_scale_the_runs_decoded_at():
    """Two repetitions whose engines really decoded at 0.8x the fitted line: the calibration, fed the
    unscaled line, finds a scale near 0.8 (the grid is 0.05 apart, interpolated), and the uncalibrated
    simulator's TPOT would have been at least 1.25x theirs (more: slower steps hold more requests at once)."""
    from vllm_kunserve.sim.steptime import MeasuredStepTime
    from vllm_kunserve.sim.trace import TraceRequest

    settings = {"block_size": 16, "kv_tokens": 4096, "kunserve_config": {}, "model": "small", "instances": 2,
                "max_num_batched_tokens": 2048, "max_num_seqs": 128, "oracle_x": 10.0, "dispatch": "least-work",
                "window": (20.0, 40.0)}
    line = {"a_s": 0.05, "c_s": 0.004}
    true = MeasuredStepTime.linear(0.05 * 0.8, 0.004 * 0.8, 400.0)
    data = {}
    for k, gap in ((1, 0.5), (2, 0.4)):
        trace = [TraceRequest(i, gap * i, 64, 96 + 8 * (i % 5)) for i in range(60)]
        sim = runfit.make_sim(true, true, settings, "oracle", trace).run()
        data[("oracle", k)] = {"rows": _rows_from(sim.reqs, {r.id: r.record() for r in sim.reqs}), "tl": []}
    cal = runfit.calibrate(data, "oracle", [1, 2], line, line, settings, fixed_tps=400.0)
    assert cal["crossed"] and cal["scale"] == pytest.approx(0.8, abs=0.03)
    at_one = dict(cal["curve"])[1.0]
    assert at_one >= 1.2 and dict(cal["curve"])[0.8] == pytest.approx(1.0, abs=0.05)
    assert cal["tps"] == 400.0 and cal["source_reps"] == [1, 2]


def test_ttft_residuals_are_what_the_simulator_misses_where_neither_side_queued():
    """A run simulated on its own true line, then 'measured' with known delays added: the residuals
    are exactly those delays, for window requests only, and a request measured (or simulated) over
    the threshold is left out (its difference is a queue's, not noise)."""
    from vllm_kunserve.sim.steptime import MeasuredStepTime
    from vllm_kunserve.sim.trace import TraceRequest

    settings = {"block_size": 16, "kv_tokens": 4096, "kunserve_config": {}, "model": "small", "instances": 2,
                "max_num_batched_tokens": 2048, "max_num_seqs": 128, "oracle_x": 10.0, "dispatch": "least-work",
                "window": (10.0, 20.0)}
    st = MeasuredStepTime.linear(0.04, 0.004, 400.0)
    trace = [TraceRequest(i, 0.5 * i, 64, 40) for i in range(50)]
    sim = runfit.make_sim(st, st, settings, "oracle", trace).run()
    records = {r.id: r.record() for r in sim.reqs}
    rows = _rows_from(sim.reqs, records)
    window = [r for r in rows if 10.0 <= float(r["arrival_s"]) < 20.0]
    assert len(window) == 20
    expect = []
    for i, r in enumerate(window):
        delay = 0.05 * (i % 4)
        if i == 3:
            delay = 30.0   # measured far over the threshold: queued, not noise
        else:
            expect.append(delay)
        r["ttft_s"] = str(float(r["ttft_s"]) + delay)
    rows[0]["ttft_s"] = str(float(rows[0]["ttft_s"]) + 0.7)   # before the window: not counted
    got = runfit.ttft_residuals(st, st, {("oracle", 1): {"rows": rows}}, "oracle", [1], settings, 2.0)
    assert sorted(got) == pytest.approx(sorted(expect), abs=1e-9)
    assert runfit.ttft_residuals(st, st, {("oracle", 1): {"rows": rows}}, "oracle", [1], settings, 0.0) == []


def test_a_measured_runs_group_drops_and_restores_under_its_kv_cap():
    """The measured run's cluster (runfit.RunSimulator) through a whole burst: kunserve groups, the
    demand falls and the group restores (its members' KV sized for the layers they take back, under
    the run's ``memory.max_kv_ratio``), and every request finishes. The restore once called the
    cluster's KV with the layers the members take back, which this subclass did not accept."""

    settings = {"block_size": 16, "kv_tokens": 1024, "kunserve_config": {"memory": {"max_kv_ratio": 2.0}},
                "model": "small", "instances": 2, "max_num_batched_tokens": 2048, "max_num_seqs": 128,
                "oracle_x": 10.0, "dispatch": "least-work"}
    st = MeasuredStepTime.linear(0.04, 0.005, 400.0)
    burst = [TraceRequest(i, 0.05 * i, 64, 400) for i in range(24)]   # ~28 blocks each: 2x one engine's 64
    calm = [TraceRequest(24 + i, 200.0 + 2.0 * i, 64, 8) for i in range(20)]
    sim = runfit.make_sim(st, st, settings, "kunserve", burst + calm).run()
    kinds = [e["kind"] for e in sim.events]
    assert "drop_plan" in kinds and "restore_start" in kinds
    assert kinds.index("drop_plan") < kinds.index("restore_start")
    assert all(r.finish_t is not None for r in sim.reqs)
    cap = 2.0 * 1024 // 16
    assert all(s.capacity <= cap * len(s.instances) for s in sim.servers)


def test_a_run_replayed_counts_the_asked_prompt_where_the_server_gave_no_usage():
    """The client writes server_prompt_tokens -1 where a stream's usage never came (the three-lever run's
    resumed streams); the replay then takes the prompt asked for, never a negative prompt."""
    from vllm_kunserve.sim.runfit import prompt_of, trace_of

    rows = [{"idx": "0", "arrival_s": "0.5", "prompt_len": "64", "server_prompt_tokens": "-1", "output_len": "300"},
            {"idx": "1", "arrival_s": "0.1", "prompt_len": "64", "server_prompt_tokens": "70", "output_len": "256"},
            {"idx": "2", "arrival_s": "0.2", "prompt_len": "32", "output_len": "8"}]
    assert [prompt_of(r) for r in rows] == [64, 70, 32]
    assert [(t.id, t.prompt) for t in trace_of(rows)] == [(1, 70), (2, 32), (0, 64)]
