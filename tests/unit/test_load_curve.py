"""The load curve's page (benchmarks/load_curve.py): its points are every archived load run of the
machine, each summarised by the headline's rule, and its reading is computed from them."""

import json
import math
from pathlib import Path

import pytest

from benchmarks import burst_value, load_curve
from benchmarks.common import raw

pytestmark = pytest.mark.unit


@pytest.fixture
def archives(tmp_path, monkeypatch):
    monkeypatch.setattr(raw, "ARCHIVES", tmp_path / "runs")
    monkeypatch.setattr(raw, "UNPACKED", tmp_path / "unpacked")
    monkeypatch.setattr(load_curve, "PAGE", tmp_path / "page" / "load_curve")
    (tmp_path / "page").mkdir()
    return tmp_path


def _point(tmp: Path, x: float, ttft: dict[str, float], grouped: bool, n: int = 40) -> str:
    """One archived load point: window requests of a fixed TTFT per system (TPOT 0.1 s, E2E TTFT + 10 s)."""
    name = load_curve.run_name("box", x)
    folder = tmp / "src" / name
    for system, t in ttft.items():
        d = folder / system / "rep1"
        d.mkdir(parents=True)
        rows = ["idx,arrival_s,send_s,prompt_len,output_len,ok,error,ttft_s,tpot_s,e2e_s,output_tokens"]
        rows += [f"{i},{31 + i},{31 + i},64,100,1,,{t + i / 1000},0.1,{t + 10},100" for i in range(n)]
        (d / "requests.csv").write_text("\n".join(rows) + "\n")
    meta = {"cpu": "CPU", "preset": "p", "weight_share": 0.61, "weight_bytes": 7e8, "group_kv_factor": 1.79,
            "mix": {"prompt_len": 64, "output_len": 256, "output_len_max": 384},
            "load_note": f"warm 0.5x and burst {x:g}x the measured capacity", "window": [30.0, 94.0],
            "oracle_equal_x": 1.79, "repeat": 1, "capacity": {"req_per_s": 0.9},
            "sweep": {"rows": [{"cap": c, "repeat": 2, "requests": 80, "p50": 1.0, "p99": c / 4, "p99_lo": 1.0,
                                "p99_hi": math.inf, "tpot_p50": 0.15, "e2e_p99": 60.0, "preemptions": 3}
                               for c in (8, 12, 16, 24)], "cap": 8, "repeat": 2, "orders": [[8, 24, 12, 16]]},
            "scaling_rows": [{"batch": 1, "step_ms": 140.0, "tokens_per_s": 7.1},
                             {"batch": 16, "step_ms": 180.0, "tokens_per_s": 88.9}],
            "scaling_doc": "docs/benchmarks/batch_scaling_xeon_amx_mha.md",
            "provenance": {"commit": "abc1234", "serving_code": "s1"}}
    raw.pack(folder, name, {"meta": meta, "grouped": {"kunserve": {"1": {"spans": [[35.0, 80.0]]}}} if grouped else {},
                            "totals": {s: {"preemptions": 4} for s in ttft}})
    return name


def test_the_page_reads_every_load_point_of_its_machine_and_computes_its_reading(archives):
    _point(archives, 2.0, {"vllm-tuned": 20.0, "vllm-router": 30.0, "kunserve": 2.0, "oracle-equal": 1.0}, True)
    _point(archives, 1.0, {"vllm-tuned": 1.0, "vllm-router": 1.2, "kunserve": 1.0, "oracle-equal": 1.0}, False)
    _point(archives, 3.0, {"vllm-tuned": 40.0, "vllm-router": 50.0, "kunserve": 40.0, "oracle-equal": 30.0}, True)
    (archives / "runs" / "burst_value_load_other_x2.tar.xz").write_bytes(
        (archives / "runs" / f"{load_curve.run_name('box', 2.0)}.tar.xz").read_bytes())   # another machine's: not read
    assert load_curve.render("box", "python -m benchmarks.load_curve --render") == 0
    page = load_curve.PAGE.with_suffix(".md").read_text()
    data = json.loads(load_curve.PAGE.with_suffix(".json").read_text())
    assert [p["x"] for p in data["points"]] == [1.0, 2.0, 3.0]
    # at 2x kunserve's P99 TTFT over tuned stock's (the better alternative): 2.039 / 20.039
    assert "at 2x kunserve's P99 TTFT is 0.10x" in page and "vllm-tuned's" in page
    assert "(it never grouped)" in page.split("at 1x", 1)[1].split(";", 1)[0]
    k2 = data["points"][1]["summary"]["systems"]["kunserve"]["ratio"]["ttft_p99"]["pooled"]["value"]
    assert k2 == pytest.approx(2.039 / 1.039, rel=1e-3)
    assert "35-80" in page and "never" in page
    assert "Tuned cap: **8**" in page and "1.29x at batch 16" in page
    assert load_curve.PAGE.with_suffix(".png").exists()


def test_no_archived_point_is_a_clear_error(archives):
    with pytest.raises(SystemExit, match="no archived load point"):
        load_curve.render("box", "cmd")


@pytest.mark.parametrize("text", ["", "2,x", "0.4,2", "2,2"])
def test_bad_loads_are_refused(text):
    with pytest.raises(SystemExit, match="--loads"):
        load_curve.parse_loads(text)


def test_run_names_are_the_headline_rules_and_distinct_per_load():
    names = {load_curve.run_name("xeon_amx", x) for x in (1.0, 1.5, 2.0, 3.0)}
    assert len(names) == 4 and all(n.startswith("burst_value_") and "." not in n for n in names)


def test_the_sweep_table_pools_repetitions_and_names_the_order():
    sw = {"rows": [{"cap": 8, "repeat": 2, "requests": 80, "p50": 1.0, "p99": 3.0, "p99_lo": 2.0, "p99_hi": 4.0,
                    "tpot_p50": 0.15, "e2e_p99": 60.0, "preemptions": 3}], "cap": 8, "repeat": 2,
          "orders": [[8, 12], [12, 8]]}
    text = "\n".join(burst_value.sweep_section(sw))
    assert "2 repetitions" in text and "8, 12; 12, 8" in text and "3.00 (2.00..4.00)" in text
