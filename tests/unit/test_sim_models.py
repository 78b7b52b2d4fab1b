"""Memory model numbers from HF configs and trace reading for the simulator."""

import json
import os

import pytest

from vllm_kunserve.sim.engine import SimConfig
from vllm_kunserve.sim.hardware import get_gpu
from vllm_kunserve.sim.steptime import EqStepTime
from vllm_kunserve.sim.trace import compress_time, read_trace_csv, window
from vllm_kunserve.workload.models import BUILTIN, load_model_spec, spec_from_hf_config

pytestmark = pytest.mark.unit
DATA = os.path.join(os.path.dirname(__file__), "..", "data", "sim")


def test_param_counts_match_published_sizes():
    # published parameter counts: Llama-2-7B 6.74B, Llama-2-70B 68.98B, Qwen2.5-14B 14.77B
    assert BUILTIN["llama2-7b"].params == pytest.approx(6.738e9, rel=2e-3)
    assert BUILTIN["llama2-70b"].params == pytest.approx(68.98e9, rel=2e-3)
    assert BUILTIN["qwen2.5-14b"].params == pytest.approx(14.77e9, rel=2e-3)


def test_kv_bytes_per_token():
    # 2 (K,V) x layers x kv_heads x head_dim x dtype bytes
    assert BUILTIN["llama2-7b"].kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
    assert BUILTIN["qwen2.5-14b"].kv_bytes_per_token == 2 * 48 * 8 * 128 * 2
    assert BUILTIN["small"].kv_bytes_per_token == 2 * 8 * 2 * 64 * 4


def test_hf_config_roundtrip_and_errors(tmp_path):
    cfg = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
           "intermediate_size": 1024, "vocab_size": 4096, "torch_dtype": "float32"}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    spec = load_model_spec(str(tmp_path))
    assert spec.param_bytes == BUILTIN["small"].param_bytes
    assert spec.kv_bytes_per_token == BUILTIN["small"].kv_bytes_per_token
    with pytest.raises(ValueError, match="vocab_size"):
        spec_from_hf_config({k: v for k, v in cfg.items() if k != "vocab_size"})
    with pytest.raises(FileNotFoundError):
        load_model_spec(str(tmp_path / "nope"))


def test_kv_capacity_from_memory():
    cfg = SimConfig(model=BUILTIN["qwen2.5-14b"], gpu=get_gpu("h100"), step_time=EqStepTime(0, 1e-6, 1e-3))
    free = 80e9 * 0.9 - BUILTIN["qwen2.5-14b"].param_bytes - cfg.activation_reserve_bytes() - 1.5e9
    assert cfg.base_kv_blocks() == int(free // (16 * 196608))
    with pytest.raises(ValueError, match="no KV space"):
        SimConfig(model=BUILTIN["llama2-70b"], gpu=get_gpu("h100"), step_time=EqStepTime(0, 0, 0)).base_kv_blocks()


def test_trace_reader_window_scale(tmp_path):
    reqs = read_trace_csv(os.path.join(DATA, "azure_conv_slice.csv"))
    assert len(reqs) == 40 and reqs[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    w = window(reqs, 10.0, 20.0)
    assert all(0 <= r.arrival_s < 20.0 for r in w)
    s = compress_time(reqs, 4.0)
    assert s[-1].arrival_s == pytest.approx(reqs[-1].arrival_s / 4)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1000,12,3\n2000,x,4\n")
    with pytest.raises(ValueError, match=r"bad.csv:3:2: column 'ContextTokens'"):
        read_trace_csv(str(bad))


def test_scan_windows_ranks_the_burst_first():
    from vllm_kunserve.sim.engine import SimConfig
    from vllm_kunserve.sim.scaling import arrival_peak_to_mean, scan_windows
    from vllm_kunserve.sim.steptime import EqStepTime
    from vllm_kunserve.sim.trace import TraceRequest

    # steady 1 req/s for 300 s, plus a 20-request burst at t=200
    reqs = [TraceRequest(i, float(i), 300, 20) for i in range(300)]
    reqs += [TraceRequest(300 + i, 200.0 + 0.05 * i, 300, 20) for i in range(20)]
    reqs.sort(key=lambda r: r.arrival_s)
    assert arrival_peak_to_mean(reqs[:100], 10.0, "requests") == pytest.approx(1.0)
    assert arrival_peak_to_mean(reqs, 10.0, "requests") > 2.5
    cfg = SimConfig(model=BUILTIN["small"], gpu=get_gpu("h100"), step_time=EqStepTime(1e-8, 2e-5, 5e-3),
                    instances=2, max_tokens=512, max_seqs=64, kv_blocks=400)
    ranked = scan_windows(cfg, reqs, 100.0, 50.0, rate_scale=1.0)
    by = {d["window"]: d["oracle_peak_to_mean"] for d in ranked}
    assert ranked[0]["window"] == "150:100"  # the burst on top of steady load
    assert by["150:100"] > 1.3 * max(by["0:100"], by["50:100"])  # steady windows: only the warm-up ramp
    with pytest.raises(ValueError):
        scan_windows(cfg, reqs, 0.0)
