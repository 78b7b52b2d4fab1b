"""benchmarks/plugin_cost.py: the ratio to stock with its interval, the doc and JSON it writes from a
run's raw numbers (outputs compared across variants), and its refusal of bad options."""

import json

import pytest

from tests.unit.benchmod import load_benchmark

pytestmark = pytest.mark.unit


def _run(variant, rep, decode_s, outputs="abc"):
    return {"variant": variant, "rep": rep, "prefill_s": 11.0, "decode_s": decode_s, "step_ms": decode_s / 129 * 1e3,
            "steal_s": 0.5, "cpu_s": {"engine_core": 1.0, "worker": decode_s - 1, "parent": 0.1}, "outputs": outputs}


def test_ratio_to_stock_and_its_interval():
    pc = load_benchmark("plugin_cost")
    r, lo, hi = pc.ratio_ci([52.0, 54.0, 56.0], [50.0, 50.0, 50.0])
    assert r == pytest.approx(1.08)
    assert 1.0 < lo <= r <= hi <= 56 / 50   # stock never varies: the interval is the plugin's spread
    assert pc.ratio_ci([50.0, 50.0], [50.0, 50.0]) == (1.0, 1.0, 1.0)


def test_report_writes_the_table_and_flags_differing_outputs(tmp_path):
    pc = load_benchmark("plugin_cost")
    raw = {"model": "models/decode-fp32-mha", "core": 1, "reps": 2, "variants": ["stock", "kunserve"],
           "orders": [["stock", "kunserve"], ["kunserve", "stock"]],
           "runs": [_run("stock", 1, 50.0), _run("kunserve", 1, 53.0), _run("kunserve", 2, 55.0), _run("stock", 2, 52.0)]}
    md, js = tmp_path / "p.md", tmp_path / "p.json"
    pc.report(dict(raw), md, js)
    doc, data = md.read_text(), json.loads(js.read_text())
    assert data["outputs_identical"] is True
    assert data["summary"]["kunserve"]["decode_vs_stock"][0] == pytest.approx(54 / 51)
    assert "decode_vs_stock" not in data["summary"]["stock"]
    assert "| kunserve | 2 |" in doc and "53.0, 55.0" in doc and "1.059" in doc
    assert "identical across every run of every variant: **yes**" in doc
    assert "cores): not recorded in the raw data" in doc
    raw["argv"], raw["load_avg"] = ["--reps", "2"], 0.5   # a doc re-written later quotes the measuring run
    pc.report(dict(raw), md, js)
    assert "Produced by `python -m benchmarks.plugin_cost --reps 2`" in md.read_text()
    assert "cores): 0.5;" in md.read_text()
    raw["runs"][1] = _run("kunserve", 1, 53.0, outputs="other")
    pc.report(dict(raw), md, js)
    assert "**NO**" in md.read_text() and json.loads(js.read_text())["outputs_identical"] is False


@pytest.mark.parametrize("argv, message", [
    (["--variants", "stock,bogus"], "unknown"),
    (["--reps", "1"], "at least 2"),
    (["--core", "999"], "has cores"),
    (["--model", "/nonexistent/model"], "no model there"),
])
def test_bad_options_are_refused(argv, message, capsys, monkeypatch):
    pc = load_benchmark("plugin_cost")
    monkeypatch.setattr("sys.argv", ["plugin_cost.py", *argv])
    with pytest.raises(SystemExit):
        pc.main()
    assert message in capsys.readouterr().err


def test_in_process_runs_are_compared_with_stock_in_process_where_stock_did_not_run(tmp_path):
    pc = load_benchmark("plugin_cost")
    raw = {"model": "m", "core": 1, "reps": 2, "variants": ["stock-in-process", "kunserve-in-process"],
           "orders": [["stock-in-process", "kunserve-in-process"]] * 2,
           "runs": [_run("stock-in-process", 1, 48.0), _run("kunserve-in-process", 1, 49.0),
                    _run("stock-in-process", 2, 50.0), _run("kunserve-in-process", 2, 51.0)]}
    md, js = tmp_path / "p.md", tmp_path / "p.json"
    pc.report(raw, md, js)
    summary = json.loads(js.read_text())["summary"]
    assert summary["kunserve-in-process"]["decode_vs_stock"][0] == pytest.approx(50 / 49)
    assert "decode_vs_stock" not in summary["stock-in-process"]
    assert "decode / stock-in-process (95%)" in md.read_text()
    # in one process the engine core's CPU is the worker's: counted once, with the parent's
    assert summary["kunserve-in-process"]["worker_cpu_s"] == pytest.approx(49.1)
