"""Touchpoint: ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``.

On CPU, vLLM moves each unquantized linear weight into a closure (a oneDNN handle or a packed
copy) and empties ``layer.weight`` (``remove_weight=True``). Layers whose weights kunserve moves
(released to KV, streamed through slots, restored) must compute from ``layer.weight`` as it is at
call time, so with memory features on we keep the weight and use ``torch.nn.functional.linear``,
which vLLM itself uses as its fallback. GPU paths never call this function.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_kunserve.integration.vllm.base import VllmPatch


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


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
                    layer.cpu_linear = _linear
                    return None
                return orig(layer, remove_weight)
            return dispatch_cpu_unquantized_gemm

        self.replace(utils, "dispatch_cpu_unquantized_gemm", make)
