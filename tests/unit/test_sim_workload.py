"""Paper-scale workload construction: rate upscaling that keeps the trace's temporal pattern (and
the time compression that does not), length mixes, warm-up exclusion, workload building."""

import os
from pathlib import Path

import numpy as np
import pytest

from vllm_kunserve.sim import workload as W
from vllm_kunserve.sim.engine import SimConfig, Simulator
from vllm_kunserve.sim.hardware import get_gpu
from vllm_kunserve.sim.metrics import summarize
from vllm_kunserve.sim.policies import build_policy
from vllm_kunserve.sim.steptime import EqStepTime
from vllm_kunserve.sim.trace import TraceRequest
from vllm_kunserve.workload import traces as T
from vllm_kunserve.workload.models import BUILTIN

pytestmark = pytest.mark.unit
AZURE = Path(__file__).parents[1] / "data" / "azure_conv_slice.csv"


def on_off(span_s: float, seed: int = 0, base: float = 2.0, burst: float = 6.0, period: float = 80.0,
           on: float = 20.0) -> T.Trace:
    """Poisson arrivals at ``base`` req/s, ``burst`` req/s for the first ``on`` s of every ``period``."""
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    while t < span_s:
        rate = burst if (t % period) < on else base
        t += rng.exponential(1.0 / rate)
        out.append(t)
    a = np.array(out[:-1])
    n = len(a)
    return T.Trace(a, np.full(n, 100), np.full(n, 10), np.arange(n), name="on-off")


def test_upscale_keeps_burstiness_and_compression_does_not():
    f, win, span = 8, 5.0, 800.0
    src = on_off(span, seed=1)
    ref = T.burstiness(src.arrival_s, win, span=(0, span))
    up = T.upscale(src, f, seed=3)
    assert len(up) == pytest.approx(f * len(src), rel=0.01)
    assert up.arrival_s[0] >= src.arrival_s[0] and up.arrival_s[-1] <= src.arrival_s[-1]  # same span
    got = T.burstiness(up.arrival_s, win, span=(0, span))
    assert got["interarrival_cv"] == pytest.approx(ref["interarrival_cv"], rel=0.10)
    assert got["rate_peak_to_mean"] == pytest.approx(ref["rate_peak_to_mean"], rel=0.10)
    assert got["rate_autocorr_lag1"] == pytest.approx(ref["rate_autocorr_lag1"], abs=0.05)
    # the rate profile itself is the source's x f, window by window
    edges = np.arange(0, span + win, win)
    hs, hu = np.histogram(src.arrival_s, edges)[0], np.histogram(up.arrival_s, edges)[0]
    assert np.corrcoef(hs, hu)[0, 1] > 0.97

    # time compression to the same span and rate: the same number of requests needs a source f times
    # longer; every 5-s window then averages 40 s of it, so the 20-s bursts are flattened and the
    # window-to-window correlation (5 s apart here, 40 s = half a period in the source) flips sign
    long = on_off(span * f, seed=1)
    comp = T.compress_time(long, f)
    assert comp.duration_s == pytest.approx(long.duration_s / f)
    c = T.burstiness(comp.arrival_s, win, span=(0, span))
    assert c["rate_peak_to_mean"] < 0.8 * ref["rate_peak_to_mean"]
    assert c["rate_autocorr_lag1"] < ref["rate_autocorr_lag1"] - 0.5
    # ... while its interarrival CV is the source's exactly: compression hides in that statistic
    assert c["interarrival_cv"] == pytest.approx(T.burstiness(long.arrival_s, win)["interarrival_cv"], rel=1e-9)


def test_upscale_real_trace_slice_and_request_data():
    # Azure LLM inference trace 2023 (Microsoft Azure, used in Splitwise), CC BY 4.0: tests/data slice
    src = T.load_csv(AZURE)
    span = (0.0, src.duration_s)
    for f, seed in ((4.0, 1), (4.5, 2), (0.5, 0)):
        up = T.upscale(src, f, seed=seed)
        assert len(up) == pytest.approx(f * len(src), rel=0.01)
        a, b = T.burstiness(src.arrival_s, 10.0, span=span), T.burstiness(up.arrival_s, 10.0, span=span)
        assert b["rate_peak_to_mean"] == pytest.approx(a["rate_peak_to_mean"], rel=0.10)
        if f > 1:
            assert b["interarrival_cv"] == pytest.approx(a["interarrival_cv"], rel=0.10)
            assert b["rate_autocorr_lag1"] == pytest.approx(a["rate_autocorr_lag1"], abs=0.05)
        # request data comes from the source request whose gap the arrival falls in
        idx = np.searchsorted(src.arrival_s, up.arrival_s, side="right") - 1
        assert np.array_equal(up.prompt_len, src.prompt_len[idx]) and np.array_equal(up.output_len, src.output_len[idx])
        assert up.meta["rate_method"] == "upscale"
    # integer factor: each source gap holds exactly f arrivals
    up = T.upscale(src, 3, seed=5)
    per_gap = np.bincount(np.searchsorted(src.arrival_s, up.arrival_s, side="right") - 1, minlength=len(src))
    assert set(per_gap[:-1]) == {3}
    with pytest.raises(ValueError, match="factor"):
        T.upscale(src, 0.0)
    with pytest.raises(ValueError, match="at least 2"):
        T.upscale(T.window(src, 0.0, 1e-3), 2.0)


@pytest.mark.parametrize("mix", ["burstgpt", "longbench"])
def test_length_mixes_match_the_paper_means(mix):
    m = T.LENGTH_MIXES[mix]
    p, o = T.sample_lengths(mix, 40000, seed=7, max_total=32768)
    assert p.mean() == pytest.approx(m.prompt_mean, rel=0.03) and o.mean() == pytest.approx(m.output_mean, rel=0.03)
    assert p.min() >= 1 and o.min() >= 1 and (p + o).max() <= 32768
    p2, _ = T.sample_lengths(mix, 40000, seed=7, max_total=32768)
    assert np.array_equal(p, p2)  # seeded
    p3, o3 = T.sample_lengths(mix, 1000, seed=1, max_total=600)
    assert (p3 + o3).max() <= 600


def test_sharegpt_mix_rescales_the_package_conversations(tmp_path):
    # a synthetic ShareGPT file: the last human->gpt turn is the output, the turns before it the prompt
    conv = [{"conversations": [{"from": "human", "value": "a" * 400}, {"from": "gpt", "value": "b" * 80},
                               {"from": "human", "value": "c" * 400}, {"from": "gpt", "value": "d" * 40}]},
            {"conversations": [{"from": "human", "value": "e" * 40}, {"from": "gpt", "value": "f" * 120}]},
            {"conversations": [{"from": "gpt", "value": "no human turn"}]}]
    path = tmp_path / "sg.json"
    path.write_text(__import__("json").dumps(conv))
    sp, so = T.sharegpt_conversation_lengths(path)
    assert list(sp) == [(400 + 80 + 400) // 4, 10] and list(so) == [10, 30]
    p, o = T.sample_lengths("sharegpt", 20000, seed=1, sharegpt_path=path)
    assert p.mean() == pytest.approx(1660, rel=0.03) and o.mean() == pytest.approx(373, rel=0.03)
    assert set(np.unique(p)) <= {round(220 * 1660 / 115), round(10 * 1660 / 115)}


def test_with_lengths_keeps_arrivals():
    src = T.load_csv(AZURE)
    tr = T.with_lengths(src, "burstgpt", seed=2, max_total=4096)
    assert np.array_equal(tr.arrival_s, src.arrival_s) and not np.array_equal(tr.prompt_len, src.prompt_len)
    assert tr.meta["lengths"] == "burstgpt"
    same = T.with_lengths(src, "azure", max_total=1 << 20)
    assert np.array_equal(same.prompt_len, src.prompt_len)


def small_cfg(**kw):
    return SimConfig(model=BUILTIN["small"], gpu=get_gpu("h100"), step_time=EqStepTime(1e-8, 2e-5, 5e-3),
                     instances=2, block_size=16, max_tokens=512, max_seqs=64, kv_blocks=kw.pop("kv_blocks", 80), **kw)


def test_warmup_requests_are_served_but_not_measured():
    # a cold-start burst during the warm-up (long queueing) then light, steady traffic
    warm = [TraceRequest(i, 0.001 * i, 300, 30) for i in range(60)]
    steady = [TraceRequest(60 + i, 20.0 + 0.5 * i, 100, 10) for i in range(40)]
    sim = Simulator(small_cfg(), build_policy("vllm"), warm + steady).run()
    full, measured = summarize(sim), summarize(sim, warmup_s=20.0)
    assert full["requests"] == 100 and measured["requests"] == 40 and measured["warmup_requests"] == 60
    assert measured["completed"] == 40
    assert full["ttft_s"]["p99"] > 5 * measured["ttft_s"]["p99"]
    assert measured["ttft_s"]["max"] < max(r.first_t - r.arrival for r in sim.reqs[:60])
    assert "p99.9" in measured["ttft_s"]
    tail = summarize(sim, warmup_s=20.0, end_s=30.0)
    assert tail["requests"] == 20


def test_workload_build_warm_start_and_calibration():
    spec = W.WorkloadSpec("burstgpt", trace=str(AZURE), offset_s=120.0, duration_s=200.0, warmup_s=60.0, seed=4,
                          max_model_len=2048)
    src = T.load_csv(AZURE)
    in_measured = int(((src.arrival_s >= 120.0) & (src.arrival_s < 320.0)).sum())
    w = W.build(spec, 3.0)
    d = w.describe()
    assert (w.warmup_s, w.end_s) == (60.0, 260.0)
    assert all(0 <= r.arrival_s < 260.0 for r in w.reqs)
    assert d["measured_requests"] == pytest.approx(3 * in_measured, rel=0.02)
    assert sum(r.arrival_s < 60.0 for r in w.reqs) > 0  # the warm-up replays the source's preceding traffic
    assert all(r.prompt + r.output <= 2048 for r in w.reqs)
    assert [r.id for r in w.reqs] == list(range(len(w.reqs)))
    with pytest.raises(ValueError, match="length mix"):
        W.WorkloadSpec("nope", trace=str(AZURE))
    with pytest.raises(ValueError, match="warm-up"):
        W.WorkloadSpec("burstgpt", trace=str(AZURE), offset_s=10.0, warmup_s=60.0)

    cfg = small_cfg(kv_blocks=400)
    c = W.calibrate(cfg, spec.with_(duration_s=100.0, warmup_s=30.0, offset_s=30.0, max_model_len=512), 0.5,
                    start=1.0, tol=0.08)
    assert c.info["oracle_mean_share"] == pytest.approx(0.5, rel=0.08)
    assert c.info["fit_tries"] and c.factor > 0


@pytest.mark.skipif(not os.path.isfile(W.default_trace()), reason="needs ../shared/data (Azure trace)")
def test_default_window_is_the_burstiest():
    src = W.source(W.default_trace())
    best = max(np.arange(120, src.duration_s - 640, 20),
               key=lambda off: T.burstiness(src.arrival_s[(src.arrival_s >= off) & (src.arrival_s < off + 640)],
                                            30.0, span=(off, off + 640))["rate_peak_to_mean"])
    assert best == W.DEFAULT_OFFSET_S


def test_waves_repeat_the_source_segment_after_the_warm_up():
    spec = W.WorkloadSpec("azure", trace=str(AZURE), offset_s=100.0, duration_s=240.0, warmup_s=50.0, waves=3)
    tr = W.source_window(spec)
    src = T.load_csv(AZURE)
    seg = src.arrival_s[(src.arrival_s >= 100.0) & (src.arrival_s < 180.0)] - 100.0
    warm = src.arrival_s[(src.arrival_s >= 50.0) & (src.arrival_s < 100.0)]
    assert len(tr) == len(warm) + 3 * len(seg)
    assert np.all(np.diff(tr.arrival_s) >= 0) and tr.arrival_s[-1] < 50.0 + 240.0
    for j in range(3):  # each wave is the segment, shifted
        got = tr.arrival_s[(tr.arrival_s >= 50.0 + 80.0 * j) & (tr.arrival_s < 50.0 + 80.0 * (j + 1))]
        assert np.allclose(got - 50.0 - 80.0 * j, seg)
    w = W.build(spec, 2.0)
    assert w.describe()["measured_requests"] == pytest.approx(2 * 3 * len(seg), rel=0.02)
    with pytest.raises(ValueError, match="waves"):
        W.WorkloadSpec("azure", trace=str(AZURE), waves=0)
