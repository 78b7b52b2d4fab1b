"""Trace parsing (good and bad files), windows and scaling maths, synthetic arrivals, KV demand."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from vllm_kunserve.bench.workload import WorkloadOptions, build_trace, busiest_offset
from vllm_kunserve.workload import traces as T
from vllm_kunserve.workload.kvdemand import DemandModel, demand_stat, kv_demand, rate_for_kv_share

pytestmark = pytest.mark.unit

DATA = Path(__file__).parents[1] / "data"
AZURE = DATA / "azure_conv_slice.csv"


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_azure_slice_loads_datetime_timestamps():
    tr = T.load_azure(AZURE)
    assert len(tr) == 2000
    assert tr.arrival_s[0] == 0.0 and np.all(np.diff(tr.arrival_s) >= 0)
    # rows 1 and 2: 18:15:46.6805900 -> 18:15:50.9951690, lengths (374, 44) and (396, 109)
    assert tr.arrival_s[1] == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    assert list(tr.prompt_len[:2]) == [374, 396] and list(tr.output_len[:2]) == [44, 109]
    assert list(tr.source_line[:2]) == [2, 3]


def test_azure_microsecond_timestamps_and_sorting(tmp_path):
    p = _write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n3500000,10,5\n1000000,20,7\n")
    tr = T.load_azure(p)
    assert list(tr.arrival_s) == [0.0, 2.5]
    assert list(tr.prompt_len) == [20, 10] and list(tr.source_line) == [3, 2]


@pytest.mark.parametrize("body, line, col, needle", [
    ("2023-11-16 18:15:46.1,12,3\n2023-11-16 18:15:47.0,abc,4\n", 3, 2, "ContextTokens"),
    ("2023-11-16 18:15:46.1,12,3\nyesterday,5,4\n", 3, 1, "TIMESTAMP"),
    ("2023-11-16 18:15:46.1,12,-3\n", 2, 3, ">= 1"),
    ("2023-11-16 18:15:46.1,12.5,3\n", 2, 2, "integer"),
])
def test_azure_bad_cells_name_line_and_column(tmp_path, body, line, col, needle):
    p = _write(tmp_path, "bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n" + body)
    with pytest.raises(T.TraceError) as e:
        T.load_azure(p)
    assert (e.value.line, e.value.col) == (line, col)
    assert f"bad.csv:{line}:{col}:" in str(e.value) and needle in str(e.value)


def test_bad_structure_errors(tmp_path):
    p = _write(tmp_path, "h.csv", "TIME,ContextTokens\n1,2\n")
    with pytest.raises(T.TraceError, match=r"h.csv:1: missing column\(s\) TIMESTAMP, GeneratedTokens"):
        T.load_azure(p)
    p = _write(tmp_path, "f.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n4,5\n")
    with pytest.raises(T.TraceError, match=r"f.csv:3: expected 3 fields, found 2"):
        T.load_azure(p)
    with pytest.raises(FileNotFoundError):
        T.load_azure(tmp_path / "missing.csv")
    with pytest.raises(T.TraceError, match="empty file"):
        T.load_azure(_write(tmp_path, "e.csv", ""))


BURST_HEADER = "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def test_burstgpt_filters_and_skips_failed(tmp_path):
    p = _write(tmp_path, "b.csv", BURST_HEADER +
               "5,s1,1.0,ChatGPT,100,20,120,Conversation log\n"
               "7,s2,1.0,GPT-4,50,0,50,Conversation log\n"
               "8,s3,1.0,GPT-4,60,30,90,API log\n"
               "9.5,s4,1.0,ChatGPT,70,10,80,API log\n")
    tr = T.load_burstgpt(p)
    assert list(tr.arrival_s) == [0.0, 3.0, 4.5] and tr.meta["skipped_zero_output"] == 1
    chat = T.load_burstgpt(p, model="ChatGPT")
    assert list(chat.prompt_len) == [100, 70]
    api = T.load_burstgpt(p, log_type="API log")
    assert list(api.output_len) == [30, 10]
    assert T.detect_csv_format(p) == "burstgpt" and T.detect_csv_format(AZURE) == "azure"


def test_burstgpt_bad_timestamp(tmp_path):
    p = _write(tmp_path, "b.csv", BURST_HEADER + "5,s1,1.0,ChatGPT,100,20,120,x\nnan,s1,1,ChatGPT,1,2,3,x\n")
    with pytest.raises(T.TraceError, match=r"b.csv:3:1: column 'Timestamp'"):
        T.load_burstgpt(p)


def _conv(h, g):
    return {"id": "x", "conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}


def test_mooncake_jsonl_loads_ms_timestamps_and_names_bad_lines(tmp_path):
    p = tmp_path / "mc.jsonl"
    rows = [{"timestamp": 3000, "input_length": 900, "output_length": 4, "hash_ids": [0, 1]},
            {"timestamp": 0, "input_length": 700, "output_length": 2, "hash_ids": [0]},
            {"timestamp": 0, "input_length": 800, "output_length": 3, "hash_ids": [2]},
            {"timestamp": 6000, "input_length": 1000, "output_length": 1, "hash_ids": []}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tr = T.load_mooncake(p)
    assert tr.arrival_s.tolist() == [0.0, 0.0, 3.0, 6.0]
    assert tr.prompt_len.tolist() == [700, 800, 900, 1000] and tr.output_len.tolist() == [2, 3, 4, 1]
    assert tr.source_line.tolist() == [2, 3, 1, 4] and tr.meta["timestamp_tick_s"] == 3.0
    for body, needle in (('{"timestamp": 0, "input_length": 5}', "output_length"),
                         ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp"),
                         ('{"timestamp": 0, "input_length": 5, "output_length": 1', "JSON syntax"),
                         ('[1, 2]', "JSON object")):
        p.write_text(json.dumps(rows[0]) + "\n" + body + "\n")
        with pytest.raises(T.TraceError, match=f"mc.jsonl:2.*{needle}"):
            T.load_mooncake(p)
    p.write_text("")
    with pytest.raises(T.TraceError, match="no requests"):
        T.load_mooncake(p)


def test_sharegpt_lengths_and_errors(tmp_path):
    recs = [_conv("a" * 40, "b" * 80), _conv("c" * 20, "d" * 400), {"id": "y", "conversations": []},
            _conv("e" * 8, "f" * 8)]
    p = _write(tmp_path, "s.json", json.dumps(recs, indent=1))
    pl, ol = T.load_sharegpt_lengths(p, 3, seed=1, count_tokens=len)
    assert sorted(zip(pl.tolist(), ol.tolist())) == [(8, 8), (20, 400), (40, 80)]
    with pytest.raises(ValueError, match="only 3 usable"):
        T.load_sharegpt_lengths(p, 4, count_tokens=len)
    bad = _write(tmp_path, "bad.json", '[\n {"id": 1},\n {"id": 2,,}\n]')
    with pytest.raises(T.TraceError, match=r"bad.json:3:11: JSON syntax"):
        T.load_sharegpt_lengths(bad, 1)
    # truncated files: an error normally, the complete records with a warning when allowed
    trunc = _write(tmp_path, "t.json", json.dumps(recs)[:-30])
    with pytest.raises(T.TraceError):
        list(T.iter_json_array(trunc))
    with pytest.warns(UserWarning, match="complete records"):
        assert len(list(T.iter_json_array(trunc, allow_truncated=True))) == 3


def test_gamma_and_poisson_arrivals_statistics():
    a = T.gamma_arrivals(20001, rate_rps=4.0, cv=3.0, seed=7)
    gaps = np.diff(a)
    assert a[0] == 0 and gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.08)
    p = np.diff(T.poisson_arrivals(20001, 2.0, seed=3))
    assert p.std() / p.mean() == pytest.approx(1.0, rel=0.05)
    assert np.array_equal(T.gamma_arrivals(10, 1, 2, seed=5), T.gamma_arrivals(10, 1, 2, seed=5))
    with pytest.raises(ValueError, match="rate"):
        T.gamma_arrivals(10, 0.0, 1.0)


def _tr(arr, p, o):
    return T.synthetic(np.array(p), np.array(o), np.array(arr, float), "t")


def test_window_rate_and_length_scaling():
    tr = _tr([0, 1, 2, 5, 9], [10, 20, 30, 40, 50], [5, 5, 5, 5, 5])
    w = T.window(tr, 1.0, 4.5)
    assert list(w.arrival_s) == [0.0, 1.0, 4.0] and list(w.prompt_len) == [20, 30, 40]
    s = T.scale_rate(w, 2.0)
    assert list(s.arrival_s) == [0.0, 0.5, 2.0] and s.meta["rate_scale"] == 2.0
    assert np.allclose(np.diff(s.arrival_s) / np.diff(w.arrival_s), 0.5)  # pattern kept
    ls = T.scale_lengths(w, 0.25, max_output=1)
    assert list(ls.prompt_len) == [5, 8, 10] and list(ls.output_len) == [1, 1, 1]
    clip = T.scale_lengths(tr, 1.0, max_total=32)
    assert np.all(clip.prompt_len + clip.output_len <= 32) and list(clip.output_len) == [5] * 5
    with pytest.raises(ValueError, match="no request"):
        T.window(tr, 100, 5)
    with pytest.raises(ValueError, match="rate scale"):
        T.scale_rate(tr, 0)


def test_kv_demand_matches_hand_computation():
    # one request: prompt 10, output 20, decode 10 tok/s, block 8: holds 16 tokens at t=0,
    # 24 once 14 decoded... ceil((10+g)/8)*8 for g = floor(t*10)
    tr = _tr([0.0], [10], [20])
    m = DemandModel(decode_tps=10.0, block_size=8)
    t, d = kv_demand(tr, m, dt=0.5)
    expect = [math.ceil((10 + min(20, math.floor(x * 10))) / 8) * 8 for x in t if x < 2.0 - 1e-9]
    assert list(d[: len(expect)]) == expect and d[len(expect):].sum() == 0
    # two overlapping requests sum up; peak counts both
    tr2 = _tr([0.0, 0.5], [16, 16], [10, 10])
    m2 = DemandModel(decode_tps=100.0, block_size=16)
    assert demand_stat(tr2, m2, "peak") == 32  # residency 0.1 s each: never overlap
    m3 = DemandModel(decode_tps=10.0, block_size=16)
    assert demand_stat(tr2, m3, "peak") == 64  # both hold 2 blocks at t in [0.6, 1)
    # mean = token-seconds / busy span [0, 1.5): grid sum * dt / 1.5
    t3, d3 = kv_demand(tr2, m3)
    assert demand_stat(tr2, m3, "mean") == pytest.approx(d3.mean()) and t3[-1] >= 1.5
    # prefill time delays decoding: 16 prompt tokens at 32 tok/s = 0.5 s more residency
    t4, d4 = kv_demand(_tr([0.0], [16], [10]), DemandModel(decode_tps=10.0, prefill_tps=32.0, block_size=16))
    assert d4[t4 < 1.5 - 1e-9].min() > 0 and d4[t4 >= 1.5 + 1e-9].sum() == 0


def test_rate_for_kv_share_hits_target():
    tr = T.window(T.load_azure(AZURE), 0, 120)
    tr = T.scale_lengths(tr, 0.25)
    m = DemandModel(decode_tps=20.0, block_size=32)
    for stat, share in (("mean", 0.6), ("peak", 1.4)):
        f = rate_for_kv_share(tr, m, 4096, share, stat)
        got = demand_stat(T.scale_rate(tr, f), m, stat)
        below = demand_stat(T.scale_rate(tr, f * 0.999), m, stat)
        assert below < share * 4096 <= got  # smallest rate reaching the target
        if stat == "mean":  # the mean moves smoothly: hit within 1%
            assert got == pytest.approx(share * 4096, rel=0.01)
    with pytest.raises(ValueError, match="cannot reach"):
        rate_for_kv_share(_tr([0, 1], [1, 1], [1, 1]), m, 4096, 2.0, "peak")


def test_build_trace_pipeline_and_auto_window():
    base = T.load_azure(AZURE)
    off = busiest_offset(base, 30.0)
    w = T.window(base, off, 30.0)
    # no other 30 s window starting at a request holds more tokens
    for start in base.arrival_s[::50]:
        sel = (base.arrival_s >= start) & (base.arrival_s < start + 30)
        assert (base.prompt_len[sel] + base.output_len[sel]).sum() <= (w.prompt_len + w.output_len).sum()
    o = WorkloadOptions(format="azure", trace=str(AZURE), window_offset="auto", window_duration=30.0,
                        length_scale=0.5, max_total_len=512, target_kv_share=1.3, kv_share_stat="peak",
                        kv_capacity_tokens=4096, block_size=32, decode_tps=30.0)
    tr, info = build_trace(o)
    assert info["window_offset_auto_s"] == off and len(tr) == len(w)
    assert np.all(tr.prompt_len + tr.output_len <= 512)
    assert 1.3 <= info["est_kv_demand_peak_share"] < 1.45
    with pytest.raises(ValueError, match="needs the KV capacity"):
        build_trace(WorkloadOptions(trace=str(AZURE), target_kv_share=0.5))
    with pytest.raises(ValueError, match="needs --trace"):
        build_trace(WorkloadOptions(format="burstgpt"))


def test_synthetic_formats():
    tr, _ = build_trace(WorkloadOptions(format="gamma", num_requests=50, rate=5.0, cv=2.0, prompt_len=7, output_len=3))
    assert len(tr) == 50 and set(tr.prompt_len) == {7} and tr.arrival_s[0] == 0
    tr2, _ = build_trace(WorkloadOptions(format="poisson", trace=str(AZURE), num_requests=40, seed=2))
    assert len(tr2) == 40 and set(tr2.prompt_len) <= set(T.load_azure(AZURE).prompt_len)


def test_phases_retime_consecutive_arrivals_to_each_phase_rate():
    base = T.load_azure(AZURE)
    tr = T.phases(base, [(60.0, 0.5), (40.0, 1.6)])
    n1, n2 = 30, 64
    assert len(tr) == n1 + n2
    a = tr.arrival_s
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert a[n1 - 1] < 60.0 <= a[n1] < 100.0 and a[-1] < 100.0
    # within a phase, the source's relative gaps are kept (one scale factor per phase)
    src = base.arrival_s - base.arrival_s[0]
    g_src, g_new = np.diff(src[n1: n1 + n2]), np.diff(a[n1:])
    nz = g_src > 0
    assert np.allclose(g_new[nz] / g_src[nz], (g_new[nz] / g_src[nz])[0])
    assert list(tr.prompt_len) == list(base.prompt_len[: n1 + n2])      # lengths travel along
    with pytest.raises(ValueError, match="needs .* more arrivals"):
        T.phases(T.window(base, 0, 5), [(600.0, 5.0)])
    for bad in ("60", "60@0", "x@1", "-1@2", ""):
        with pytest.raises(ValueError, match="SECONDS@REQUESTS_PER_S"):
            T.parse_phases(bad)


def test_synthetic_lengths_on_trace_arrivals():
    o = WorkloadOptions(format="azure", trace=str(AZURE), synthetic_lengths=True, prompt_len=64, output_len=256,
                        output_len_max=512, phases="20@1,10@3", seed=3)
    tr, info = build_trace(o)
    assert len(tr) == 50 and set(tr.prompt_len) == {64}
    assert tr.output_len.min() >= 256 and tr.output_len.max() <= 512 and len(set(tr.output_len)) > 10
    tr2, _ = build_trace(o)
    assert list(tr2.output_len) == list(tr.output_len)                 # seeded
    with pytest.raises(ValueError, match="output-len-max"):
        build_trace(WorkloadOptions(format="gamma", output_len=256, output_len_max=100))
