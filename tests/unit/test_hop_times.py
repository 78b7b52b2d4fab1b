"""Where a pipeline group's hops spend their time (``HopTimes``), and how the benchmark harness reads
it from the front end's status (``bench.compare.pipeline_times``)."""

import pytest

pytestmark = pytest.mark.unit


def test_hop_times_split_a_round_trip_into_queueing_compute_and_link():
    from vllm_kunserve.integration.vllm.pipeline import HopTimes

    h = HopTimes(keep=10)
    assert h.summary() == {"hops": 0, "round_trip_ms": None, "peer_wait_ms": None, "peer_span_ms": None,
                           "link_ms": None}
    for i in range(25):                       # round trip = wait + span + link (0.5 ms)
        h.add(round_trip_ms=10.0 + i + 0.5, peer_wait_ms=float(i), peer_span_ms=10.0)
    h.add(round_trip_ms=1.0, peer_wait_ms=0.0, peer_span_ms=2.0)   # clocks disagree: no negative link
    s = h.summary()
    assert s["hops"] == 26                    # counted over the group's life ...
    assert s["link_ms"]["p50"] == 0.5 and s["link_ms"]["max"] == 0.5
    assert min(r[3] for r in h.rows) == 0.0
    assert s["peer_wait_ms"]["max"] == 24.0   # ... percentiles over the last `keep`
    assert s["peer_wait_ms"]["p50"] >= 15.0
    assert len(h.rows) <= 20


def test_pipeline_times_reads_each_grouped_engine_from_the_status():
    from vllm_kunserve.bench.compare import pipeline_times

    t = {"hops": 3, "link_ms": {"p50": 0.2, "p90": 0.3, "max": 0.4}}
    status = {"instances": [{"instance": 0, "kv": {"engine": {"pipeline": t}}},
                            {"instance": 1, "kv": {"engine": {"pipeline": None}}},
                            {"instance": 2, "kv": {}}]}
    assert pipeline_times(status) == {"0": t}
    assert pipeline_times({}) == {}


def test_a_members_turn_is_due_between_its_steps_and_away_while_it_hops_or_fails(monkeypatch):
    """vLLM asks for the sampling in a second call after ``execute_model``, then schedules the next
    step: the member's turn is due from a step's end to its next hop; a failure ends it."""
    import threading
    import time

    from vllm_kunserve.integration.vllm import pipeline as p

    turn = p.Turn(0.2)
    monkeypatch.setattr(p, "TURN", turn)
    step = p._locked(lambda: None, "execute_model")
    sample = p._locked(lambda: "tokens", "sample_tokens")

    def failing(name):
        def fn():
            raise RuntimeError(f"{name} failed")
        return p._locked(fn, name)

    assert not turn.is_due()
    assert step() is None and turn.is_due()     # its sampling follows
    assert not p.COMPUTE.locked()               # the lock itself is free between the two calls
    assert sample() == "tokens" and turn.is_due()  # its next step follows
    with pytest.raises(RuntimeError):
        failing("execute_model")()
    assert not turn.is_due()                    # nothing follows a failed step
    step()
    with pytest.raises(RuntimeError):
        failing("sample_tokens")()
    assert not turn.is_due() and not p.COMPUTE.locked()
    # a span waits while the turn is due, and goes as soon as the member's microbatch hops away
    turn.due()
    t0 = time.monotonic()
    threading.Timer(0.05, turn.away).start()
    turn.wait()
    assert 0.04 <= time.monotonic() - t0 < 0.19
    # never longer than the turn, even if the member never comes
    turn.due()
    t0 = time.monotonic()
    turn.wait()
    assert 0.15 <= time.monotonic() - t0 < 1.0
    off = p.Turn(0.0)                           # 0: off, nothing is ever due
    off.due()
    assert not off.is_due()


def test_the_step_trace_records_steps_and_is_written_when_asked(tmp_path, monkeypatch):
    import json

    from vllm_kunserve.integration.vllm import pipeline as p

    monkeypatch.setattr(p, "_TRACE", [])
    monkeypatch.setattr(p, "_TRACE_DIR", "")
    monkeypatch.setattr(p, "_TRACE_PART_S", 3600.0)
    monkeypatch.setattr(p, "_TRACE_AT", {"name": "e0", "group": 1, "part": 0, "written": 0.0})
    p._locked(lambda: "out", "execute_model")()
    assert p._TRACE == []                    # off unless KUNSERVE_PIPELINE_TRACE names a directory
    monkeypatch.setattr(p, "_TRACE_DIR", str(tmp_path / "trace"))
    p._trace_group("e0")                     # joined: parts every _TRACE_PART_S from now
    p._locked(lambda: "out", "execute_model")()
    p._locked(lambda: "tokens", "sample_tokens")()
    (kind, t0, t1, t2), (kind2, *_) = p._TRACE
    assert (kind, kind2) == ("execute_model", "sample_tokens") and t0 <= t1 <= t2
    p._dump_trace()
    (f,) = (tmp_path / "trace").iterdir()
    d = json.loads(f.read_text())
    assert d["member"] == "e0" and [e[0] for e in d["events"]] == ["execute_model", "sample_tokens"]
    assert p._TRACE == []                    # written once: the next group starts empty


def test_the_stage_turn_setting_is_checked():
    from vllm_kunserve.integration.vllm.pipeline import turn_s

    assert turn_s("8") == 0.008 and turn_s("0") == 0.0
    for bad in ("x", "-1", "5000", "nan"):
        with pytest.raises(ValueError, match="KUNSERVE_STAGE_TURN_MS"):
            turn_s(bad)


def test_a_traced_step_records_its_requests_tokens_and_prefill_tokens():
    from types import SimpleNamespace

    from vllm_kunserve.integration.vllm.pipeline import _step_load

    # three decodes, a 64-token prompt and a 30-token chunk of another: vLLM's SchedulerOutput field
    out = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1, "c": 1, "p": 64, "q": 30})
    assert _step_load(out) == (5, 97, 94)
    assert _step_load(SimpleNamespace(num_scheduled_tokens={})) == (0, 0, 0)
    assert _step_load(None) == ()            # sample_tokens' argument: no step to describe


def test_a_groups_trace_is_written_in_parts_that_load_joins_again(tmp_path, monkeypatch):
    from benchmarks.common.pipeline_trace import load
    from vllm_kunserve.integration.vllm import pipeline

    monkeypatch.setattr(pipeline, "_TRACE_DIR", str(tmp_path))
    monkeypatch.setattr(pipeline, "_TRACE_PART_EVENTS", 4)
    monkeypatch.setattr(pipeline, "_TRACE", [])
    monkeypatch.setattr(pipeline, "_TRACE_PART_S", 3600.0)
    monkeypatch.setattr(pipeline, "_TRACE_AT", {"name": "", "group": 0, "part": 0, "written": 0.0})
    for group, (name, t0) in enumerate((("e0", 0.0), ("e0", 50.0)), 1):
        pipeline._trace_group(name)
        for k in range(10):                  # 10 steps: two parts of 4 as it goes, the rest at the split
            pipeline._trace("execute_model", t0 + k, t0 + k, t0 + k + 0.5, 20, 20, 0)
        pipeline._dump_trace()
        pipeline._dump_trace()               # nothing new: no empty part
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 6 and all(f.startswith("e0-") for f in files)
    groups = load(tmp_path.glob("*.json"))   # two groups, each e0's parts joined in order
    assert [[e[1] for e in g["e0"]] for g in groups] == [[float(k) for k in range(10)],
                                                         [50.0 + k for k in range(10)]]


def test_a_trace_that_cannot_be_written_turns_tracing_off_instead_of_failing_the_step(tmp_path, monkeypatch,
                                                                                       caplog):
    from vllm_kunserve.integration.vllm import pipeline as p

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(p, "_TRACE_DIR", str(blocker / "trace"))   # under a file: makedirs fails
    monkeypatch.setattr(p, "_TRACE", [])
    monkeypatch.setattr(p, "_TRACE_PART_EVENTS", 2)
    monkeypatch.setattr(p, "_TRACE_AT", {"name": "e0", "group": 1, "part": 0, "written": 1e18})
    assert p._locked(lambda: "out", "execute_model")() == "out"
    assert p._locked(lambda: "out", "execute_model")() == "out"   # the part is due here, and fails
    assert p._TRACE_DIR == "" and p._TRACE == []
    assert "cannot write" in caplog.text and "tracing is off" in caplog.text
    assert p._locked(lambda: "out", "execute_model")() == "out" and p._TRACE == []
