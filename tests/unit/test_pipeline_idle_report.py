"""benchmarks/pipeline_idle.py: a member's own stage per step (its step less its hop), the spans it
ran and their waits, and the doc it writes from a trace directory; bad input is refused."""

import json
import tarfile

import pytest

from tests.unit.benchmod import load_benchmark

pytestmark = pytest.mark.unit


def _member(t0: float, own_s: float, span_s: float, n: int, prompt_every: int = 0) -> list:
    """``n`` steps of one member: own stage ``own_s``, then a hop of ``span_s`` (the peer's span), and
    one span of the peer's run here per step, each waiting 1 ms for the core. With ``prompt_every``,
    steps carry their load (20 decodes), and every such step also a 64-token prompt, 3x as long."""
    ev, t = [], t0
    for k in range(n):
        if prompt_every:
            pre = 64 if k % prompt_every == 0 else 0
            own_s_k = own_s * (3 if pre else 1)
            ev.append(["execute_model", t, t, t + own_s_k + span_s, 20, 20 + pre, pre])
            t += own_s_k - own_s
            ev[-1][3] = t + own_s + span_s
        else:
            ev.append(["execute_model", t, t, t + own_s + span_s])
        ev.append(["hop", t + own_s, t + own_s, t + own_s + span_s, t + own_s + span_s])
        ev.append(["span", t + own_s, t + own_s + 0.001, t + own_s + 0.001 + span_s])
        ev.append(["sample_tokens", t + own_s + span_s, t + own_s + span_s, t + own_s + span_s + 0.0005])
        t += own_s + span_s + 0.001
    return ev


def test_stage_times_take_the_step_less_its_hop():
    pi = load_benchmark("pipeline_idle")
    s = pi.stage_times(_member(0.0, 0.030, 0.020, 50))
    assert s["own_stage_ms"]["p50"] == pytest.approx(30.0, abs=0.01)
    assert s["peer_span_ms"]["p50"] == pytest.approx(20.0, abs=0.01)
    assert s["span_wait_ms"]["p50"] == pytest.approx(1.0, abs=0.01)
    assert s["steps"] == s["spans"] == 50
    assert pi.stage_times([]) == {"own_stage_ms": {}, "peer_span_ms": {}, "span_wait_ms": {}, "steps": 0, "spans": 0}


def test_the_doc_is_written_from_a_trace_directory_and_bad_input_is_refused(tmp_path, capsys):
    pi = load_benchmark("pipeline_idle")
    trace, run, docs = tmp_path / "trace", tmp_path / "run", tmp_path / "docs"
    trace.mkdir()
    for name, t0 in (("e0", 0.0), ("e1", 0.025)):
        (trace / f"{name}-1-1.json").write_text(json.dumps({"member": name, "events": _member(t0, 0.030, 0.020, 40)}))
    rep = run / "kunserve" / "rep1"
    rep.mkdir(parents=True)
    (rep / "requests.csv").write_text("idx,arrival_s,send_s,prompt_len,output_len,ok,error,ttft_s,tpot_s\n"
                                      "0,61.0,61.001,64,300,1,,0.4,0.12\n1,5.0,5.0,64,300,1,,0.3,0.1\n")
    args = ["--trace", str(trace), "--run", str(run), "--run-command", "kunserve compare --out run", "--docs", str(docs)]
    assert pi.main(args) == 0
    md = (docs / "pipeline_idle.md").read_text()
    assert "kunserve compare --out run" in md and "| e0 |" in md and "| e1 |" in md
    assert "| rep1 | 1 | 0 | 0.400 | 0.400 | 0.120 |" in md      # only the window's arrival
    with tarfile.open(docs / "runs" / "pipeline_idle.tar.xz") as tar:   # one archive: the traces and the analysis
        names = sorted(m.name for m in tar.getmembers())
        saved = json.loads(tar.extractfile("pipeline_idle/page.json").read())
    assert set(saved["groups"][0]["analysis"]) == {"e0", "e1"}
    assert names == ["pipeline_idle/e0-1-1.json", "pipeline_idle/e1-1-1.json", "pipeline_idle/page.json"]
    for bad, needle in ((["--window", "9,3"], "--window"), (["--trace", str(tmp_path / "none")], "no worker traces")):
        with pytest.raises(SystemExit):
            pi.main(args + bad)
        assert needle in capsys.readouterr().err


def test_the_doc_says_what_a_prompt_costs_the_group_when_steps_carry_their_load(tmp_path):
    pi = load_benchmark("pipeline_idle")
    trace, run, docs = tmp_path / "trace", tmp_path / "run", tmp_path / "docs"
    trace.mkdir()
    for name, t0, every in (("e0", 0.0, 5), ("e1", 0.025, 7)):
        ev = _member(t0, 0.030, 0.020, 60, prompt_every=every)
        (trace / f"{name}-1-1.json").write_text(json.dumps({"member": name, "events": ev}))
    (run / "kunserve").mkdir(parents=True)
    args = ["--trace", str(trace), "--run", str(run), "--run-command", "kunserve compare", "--docs", str(docs)]
    assert pi.main(args) == 0
    md = (docs / "pipeline_idle.md").read_text()
    assert "### What a prompt costs the group" in md
    with tarfile.open(docs / "runs" / "pipeline_idle.tar.xz") as tar:
        saved = json.loads(tar.extractfile("pipeline_idle/page.json").read())
    cycles = saved["groups"][0]["analysis"]["e0"]["prefill_cycles"]
    assert cycles["decode only"]["prefill_tokens"] == 0 and cycles["own prefill"]["prefill_tokens"] == 64
    # a cycle of its own prompt is 60 ms longer (its own stage ran 3x 30 ms)
    assert cycles["own prefill"]["cycle_p50_ms"] == pytest.approx(cycles["decode only"]["cycle_p50_ms"] + 60, abs=0.5)


def _run(root, system: str, rep: int, grouped_from: int | None, tokens: float, ttft: float) -> None:
    """One repetition of ``system``: 20 s of timeline (10 running, ``tokens`` output tokens/s; from
    ``grouped_from`` on, grouped and half the tokens/s) and a request arriving every second."""
    d = root / system / f"rep{rep}"
    d.mkdir(parents=True)
    rows = ["second,running,output_tokens,kunserve:grouped_instances"]
    for s in range(20):
        on = grouped_from is not None and s >= grouped_from
        rows.append(f"{s},10,{tokens / 2 if on else tokens},{2 if on else 0}")
    (d / "timeline.csv").write_text("\n".join(rows) + "\n")
    reqs = ["idx,arrival_s,send_s,prompt_len,output_len,ok,error,ttft_s,tpot_s,e2e_s,queue_s,output_tokens"]
    for s in range(20):
        slow = grouped_from is not None and s >= grouped_from
        reqs.append(f"{s},{s + 0.5},{s + 0.5},64,100,1,,{ttft * (3 if slow else 1)},0.1,10,,100")
    (d / "requests.csv").write_text("\n".join(reqs) + "\n")


def test_against_splits_the_window_at_each_repetitions_join_and_compares_the_same_seconds(tmp_path):
    pi = load_benchmark("pipeline_idle")
    for rep, join in ((1, 10), (2, 12)):
        _run(tmp_path, "kunserve", rep, join, 100.0, 0.2)
        _run(tmp_path, "oracle-equal", rep, None, 100.0, 0.2)
    c = pi.against(tmp_path, "kunserve", "oracle-equal", (5.0, 15.0))
    assert c["joins_s"] == {"rep1": 10, "rep2": 12}
    before, grouped = c["parts"]["before the group"], c["parts"]["grouped"]
    assert before["kunserve"]["seconds"] == before["oracle-equal"]["seconds"] == 5 + 7
    assert grouped["kunserve"]["seconds"] == 5 + 3 and grouped["kunserve"]["requests"] == 8
    assert before["tokens_ratio"] == 1.0 and grouped["tokens_ratio"] == 0.5 and grouped["running_ratio"] == 1.0
    assert before["ttft_ratio"]["p50"]["value"] == pytest.approx(1.0)
    assert grouped["ttft_ratio"]["p99"]["value"] == pytest.approx(3.0)
    md = "\n".join(pi.against_section(c, "kunserve", "oracle-equal"))
    assert "| grouped | ratio |  | 1 | 0.5 |" in md and "put out 0.50x" in md


def test_against_a_system_the_run_lacks_is_refused(tmp_path, capsys):
    pi = load_benchmark("pipeline_idle")
    trace, run = tmp_path / "trace", tmp_path / "run"
    trace.mkdir()
    for name, t0 in (("e0", 0.0), ("e1", 0.025)):
        (trace / f"{name}-1-1.json").write_text(json.dumps({"member": name, "events": _member(t0, 0.030, 0.020, 40)}))
    _run(run, "kunserve", 1, 10, 100.0, 0.2)
    with pytest.raises(SystemExit):
        pi.main(["--trace", str(trace), "--run", str(run), "--run-command", "x", "--docs", str(tmp_path / "d"),
                 "--against", "oracle-equal"])
    assert "--against oracle-equal" in capsys.readouterr().err
