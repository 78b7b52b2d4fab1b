"""Touchpoint: ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``.

On CPU, vLLM moves each unquantized linear weight into a closure (a oneDNN handle or a packed
copy) and empties ``layer.weight`` (``remove_weight=True``). kunserve needs the weight itself: it
packs it into the memory pool, releases it to the KV cache and streams it through slots. So with
memory features on we call vLLM's dispatch with ``remove_weight=False``: the module keeps its weight
*and* vLLM's fast packed kernel, remembered as ``_kunserve_fast_linear``. Resident layers run that
kernel; while a layer is streamed, ``use_streamed_weights`` switches its linears to
``torch.nn.functional.linear`` (vLLM's own fallback), which reads ``layer.weight`` (the slot) at call
time. The packed copies are a CPU-kernel detail outside the pool (on GPU nothing is packed and this
function is never called).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_kunserve.integration.vllm.base import VllmPatch


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def use_streamed_weights(module: torch.nn.Module, streamed: bool) -> None:
    """Point every CPU linear under ``module`` at ``layer.weight`` (streamed) or at vLLM's packed kernel."""
    for m in module.modules():
        fast = m.__dict__.get("_kunserve_fast_linear")
        if fast is not None:
            m.cpu_linear = _linear if streamed else fast


class CpuLinearPatch(VllmPatch):
    name = "cpu_linear"
    versions = ">=0.32,<0.34"
    summary = "keep CPU linear weights as plain tensors so kunserve can move them"
    requires = ("remap",)


    def patch(self, cfg: Any) -> None:
        utils = self.resolve("vllm.model_executor.layers.utils")

        def make(orig):
            def dispatch_cpu_unquantized_gemm(layer, remove_weight):
                w = getattr(layer, "weight", None)
                if remove_weight and w is not None and not w.is_meta and w.ndim == 2:
                    orig(layer, False)  # keep the weight; vLLM still builds its fast kernel
                    layer._kunserve_fast_linear = layer.cpu_linear
                    return None
                return orig(layer, remove_weight)
            return dispatch_cpu_unquantized_gemm

        self.replace(utils, "dispatch_cpu_unquantized_gemm", make)
