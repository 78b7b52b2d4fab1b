"""The GPU-in-vLLM benchmark's own arithmetic and page (benchmarks/gpu_vllm.py); its steps run on
vLLM (CUDA on the lent GPU, or ``--device cpu`` as a rehearsal), not here."""

from __future__ import annotations

import pytest

from benchmarks import gpu_vllm

pytestmark = pytest.mark.unit


def test_kv_bytes_give_the_asked_weight_share_and_the_cuda_model_has_7b_layers():
    spec = gpu_vllm.model_spec("cuda", 8)
    assert (spec.hidden, spec.heads, spec.kv_heads, spec.intermediate, spec.dtype) == (4096, 32, 8, 14336, "bfloat16")
    for w in (0.35, 0.6, 0.65):
        kv = gpu_vllm.kv_bytes_for(spec, w)
        assert spec.weight_bytes() / (spec.weight_bytes() + kv) == pytest.approx(w, rel=1e-6)
    kw = gpu_vllm.engine_kwargs("cuda", spec, 0.6)
    assert kw["enforce_eager"] and kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] < 0.5


def test_engine_keywords_become_vllm_serve_flags():
    flags = gpu_vllm.serve_args({"dtype": "bfloat16", "enforce_eager": True, "trust": False, "max_model_len": 1024})
    assert flags == ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "1024", "--served-model-name", "m"]


def _page(remap_ok=True, group=None):
    b = {str(x): 10.0 for x in gpu_vllm.BATCHES}
    state = {"blocks": 100}
    return {"command": "c", "environment": {"device": "NVIDIA H100", "vllm": "0.26.0", "torch": "2.11.0",
                                            "python": "3.12"},
            "args": {"weight_share": 0.6, "alpha": 2, "slots": 2, "group_tokens": 64}, "kv_bytes": 2 << 30,
            "model": "8 layers",
            "remap": {"ok": remap_ok, "same": {"resident": True, "remapped": remap_ok, "reverted": True},
                      "blocks_base": 100, "blocks_remapped": 160, "blocks_grown": 60, "blocks_after_revert": 100,
                      "stock": {"runner_v2": True, "step_ms": b},
                      "kunserve": {"runner_v2": False, "resident": {"step_ms": b, "state": state},
                                   "remapped": {"ms": 20.0, "streamed_linear": "plain", "step_ms": b},
                                   "reverted": {"ms": 30.0}}},
            **({"group": group} if group else {})}


def test_the_page_names_the_device_and_says_pass_or_fail_and_why():
    text = gpu_vllm.render(_page())
    assert "NVIDIA H100" in text and "vLLM 0.26.0" in text and "**Pass.**" in text and "100 -> 160 (+60)" in text
    assert "**FAIL.**" in gpu_vllm.render(_page(remap_ok=False))
    failed = gpu_vllm.render(_page(group={"ok": False, "error": "RuntimeError: engine died", "log_tail": "boom"}))
    assert "Failed: RuntimeError: engine died" in failed and "boom" in failed
