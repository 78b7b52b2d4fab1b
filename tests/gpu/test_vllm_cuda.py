"""kunserve inside vLLM on CUDA (issue 72): one engine's remap and a two-engine pipeline group on one
device, token-identical to stock vLLM, with a small model of 7B layer dimensions. The figures of the
same steps at the documented size come from ``python -m benchmarks.gpu_vllm``."""

from __future__ import annotations

import argparse

import pytest
import torch

pytestmark = pytest.mark.gpu


def _vllm_on_cuda() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from vllm.platforms import current_platform
    except Exception:
        return False
    return current_platform.device_type == "cuda"


needs_vllm_cuda = pytest.mark.skipif(not _vllm_on_cuda(), reason="needs vLLM's CUDA platform and a GPU")
ARGS = argparse.Namespace(alpha=1, slots=1, group_tokens=64, timeout=900.0)


@pytest.fixture(scope="module")
def model():
    from benchmarks import gpu_vllm

    path, spec = gpu_vllm.make_model("cuda", 4)
    return path, gpu_vllm.engine_kwargs("cuda", spec, 0.6)


@needs_vllm_cuda
def test_remap_on_cuda_is_token_identical_to_stock_and_grows_the_kv(model):
    from benchmarks import gpu_vllm

    r = gpu_vllm.remap_step("cuda", *model, ARGS)
    assert "same" in r, r
    assert r["same"] == {"resident": True, "remapped": True, "reverted": True}
    assert r["kunserve"]["runner_v2"] is False and r["blocks_grown"] > 0
    assert r["blocks_after_revert"] == r["blocks_base"] and not r["kunserve"]["problems"]


@needs_vllm_cuda
def test_a_group_of_two_cuda_engines_keeps_outputs_and_restores(model):
    from benchmarks import gpu_vllm

    g = gpu_vllm.group_step("cuda", *model, ARGS)
    assert "error" not in g, g.get("error")
    assert g["drop_code"] == 200 and all(g["same_during"]) and all(g["same_after"])
    assert all(g["blocks_grouped"][k] > g["blocks_before"][k] for k in g["blocks_before"])
    assert g["blocks_after"] == g["blocks_before"]
