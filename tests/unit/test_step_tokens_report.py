"""benchmarks/step_tokens.py: the step cost by tokens per step (its table, the headline ratio of a
64-token prompt added to 23 decodes, the doc) and its refusal of bad --tokens."""

import json

import pytest

from tests.unit.benchmod import load_benchmark

pytestmark = pytest.mark.unit


def test_summary_rows_and_the_prompt_in_a_decode_step_ratio():
    st = load_benchmark("step_tokens")
    times = {1: [0.010, 0.011, 0.012], 23: [0.020, 0.020, 0.030], 87: [0.050, 0.060, 0.070]}
    s = st.summarise(times)
    assert [r["tokens"] for r in s["rows"]] == [1, 23, 87]
    assert s["rows"][1] == {"tokens": 23, "ms": 20.0, "ms_per_token": pytest.approx(20 / 23, abs=1e-4),
                            "over_one": pytest.approx(20 / 11, abs=1e-3), "spread_ms": [20.0, 30.0]}
    assert s["prompt_in_decode_step"] == {"base_tokens": 23, "with_prompt_tokens": 87, "ratio": 3.0, "added_ms": 40.0}
    assert st.summarise({1: [0.01], 4: [0.02]})["prompt_in_decode_step"] is None  # the pair not measured


def test_bad_tokens_are_refused():
    st = load_benchmark("step_tokens")
    assert st.parse_tokens("64, 1,23,64") == [1, 23, 64]
    for bad in ("", "0,4", "a,b", "-3"):
        with pytest.raises(SystemExit, match="--tokens"):
            st.parse_tokens(bad)


def test_a_tiny_model_is_measured_and_its_doc_written(tmp_path, monkeypatch):
    st = load_benchmark("step_tokens")
    monkeypatch.setitem(st.PRESETS, "tiny", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                             "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128})
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    import torch
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the test process keeps its threads
    assert st.main(["--preset", "tiny", "--dtype", "float32", "--tokens", "1,23,87", "--reps", "2",
                    "--warmup", "1", "--out", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    assert [r["tokens"] for r in res["rows"]] == [1, 23, 87] and len(res["raw_ms"]["87"]) == 2
    assert res["cuda_graphs"] is False and res["threads"] >= 1
    assert "A 64-token prompt added to a step of 23 decodes costs" in md.read_text()
