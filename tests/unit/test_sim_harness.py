"""Reading measured harness runs for simulator validation (vllm_kunserve.sim.harness)."""

import os

import pytest

from vllm_kunserve.sim.harness import (Interval, discover_runs, load_run_requests, run_trace, solo_profile_rows,
                                       stalled_seconds)

pytestmark = pytest.mark.unit

HEAD = "idx,arrival_s,send_s,prompt_len,output_len,ok,error,ttft_s,tpot_s,e2e_s,queue_s,output_tokens,server_prompt_tokens\n"


def test_solo_rows_only_from_requests_alone():
    reqs = [
        Interval(0.0, 0.2, 1.0, 400, 10, 0.09),     # alone throughout: prefill + decode rows
        Interval(2.0, 2.1, 3.0, 100, 10, 0.1),      # b arrives during its decode: prefill row only
        Interval(2.5, 2.9, 3.5, 300, 10, 0.07),     # a is still running when it is sent: none
        Interval(5.0, 5.3, 5.4, 600, 2, 0.1),       # alone but too short a decode: prefill row only
    ]
    rows = solo_profile_rows(reqs)
    assert [(r["kind"], r["chunks"]) for r in rows] == [
        ("prefill", [[0, 400]]), ("decode", [[405, 1]]), ("prefill", [[0, 100]]), ("prefill", [[0, 600]])]
    assert rows[0]["ms"] == pytest.approx(200.0)
    assert rows[1]["ms"] == pytest.approx(90.0)


def test_run_trace_replays_completed_requests_from_the_first_send(tmp_path):
    p = tmp_path / "requests.csv"
    p.write_text(HEAD + "0,0,2.5,10,4,1,,0.2,0.05,0.4,,0,30\n1,1,1.5,10,4,0,boom,,,,,0,\n"
                 "2,2,1.0,20,8,1,,0.1,0.05,0.9,,8,21\n")
    assert [(r.id, r.arrival_s, r.prompt, r.output) for r in run_trace(str(p))] == [(0, 0.0, 21, 8), (1, 1.5, 30, 1)]
    p.write_text(HEAD)
    with pytest.raises(ValueError, match="no completed request"):
        run_trace(str(p))


def test_solo_rows_ignore_input_order():
    a = Interval(0.0, 0.1, 3.0, 50, 5, 0.5)
    b = Interval(1.0, 1.2, 1.5, 60, 5, 0.05)  # sent while a decodes: neither is alone in decode
    assert [r["kind"] for r in solo_profile_rows([b, a])] == ["prefill"]  # only a's prefill


def test_load_requests_skips_failed_and_reports_bad_rows(tmp_path):
    p = tmp_path / "requests.csv"
    p.write_text(HEAD + "0,0,0.5,10,4,1,,0.2,0.05,0.4,,4,12\n1,1,1.5,10,4,0,boom,,,,,0,\n")
    (r,) = load_run_requests(str(p))
    assert (r.send, r.first, r.end, r.prompt, r.output) == (0.5, pytest.approx(0.7), pytest.approx(0.9), 12, 4)
    p.write_text(HEAD + "0,0,x,10,4,1,,0.2,0.05,0.4,,4,12\n")
    with pytest.raises(ValueError, match="requests.csv:2"):
        load_run_requests(str(p))


def test_stalled_seconds(tmp_path):
    p = tmp_path / "timeline.csv"
    rows = ["0,1,0,0,5,0.1,0,0,0,1,0", "1,0,0,0,0,,0,0,0,2,0", "2,0,0,0,0,,0,0,0,2,3",
            "3,0,1,0,0,,0,0,0,1,0", "4,0,0,0,0,,0,0,0,0,0", "5,0,0,0,0,,0,0,0,1,0"]
    p.write_text("second,arrivals,completions,failures,output_tokens,mean_ttft_s,est_kv_demand_tokens,"
                 "kv_usage,preemptions,running,waiting\n" + "\n".join(rows) + "\n")
    assert stalled_seconds(str(p)) == (3, 2)  # seconds 1, 2 and 5; idle second 4 is not a stall


def test_discover_runs(tmp_path):
    for sysname, rep in (("vllm", 2), ("vllm", 1), ("oracle", 1), ("kunserve", 1)):
        d = tmp_path / sysname / f"rep{rep}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text("{}")
        (d / "requests.csv").write_text(HEAD)
    (tmp_path / "vllm" / "rep3").mkdir()  # incomplete: skipped
    got = [(s, k, os.path.basename(d)) for s, k, d in discover_runs(str(tmp_path))]
    assert got == [("oracle", 1, "rep1"), ("vllm", 1, "rep1"), ("vllm", 2, "rep2")]
    with pytest.raises(FileNotFoundError, match="no <system>/rep<k>"):
        discover_runs(str(tmp_path), systems=("nope",))
