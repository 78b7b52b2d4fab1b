"""Touchpoint: ``allocate_kv_cache`` as imported by the model runners.

``GPUModelRunner.initialize_kv_cache_tensors`` (V1 runner; the CPU runner inherits it) and the V2
runner's ``attn_utils.init_kv_cache`` call ``allocate_kv_cache`` by module-level name. When the
engine core planned a growable KV cache (``kv_plan.py`` tags the config with
``kunserve_base_blocks``), we allocate it in kunserve's memory pool instead: one region per layer,
reserved for the planned maximum, mapped for the base (``WorkerMemory``). Otherwise the original
runs unchanged.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

from vllm_kunserve.integration.vllm.base import VllmPatch

logger = logging.getLogger("vllm.kunserve")

TARGET_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils")

#: WorkerMemory objects created in this process (one per worker)
WORKER_MEMORY: list[Any] = []


def _find_runner(max_frames: int = 8) -> Any:
    """The model runner that is allocating (a caller frame's ``self`` with a ``model``)."""
    import torch

    frame = sys._getframe(2)
    for _ in range(max_frames):
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        if obj is not None and isinstance(getattr(obj, "model", None), torch.nn.Module):
            return obj
        frame = frame.f_back
    raise RuntimeError("kunserve: could not find the model runner allocating the KV cache")


class KVAllocationPatch(VllmPatch):
    name = "kv_allocation"
    versions = ">=0.32,<0.34"
    summary = "allocate a growable KV cache (per-layer pool regions) when the engine planned one"
    requires = ("remap",)


    def patch(self, cfg: Any) -> None:
        for modname in TARGET_MODULES:
            try:
                mod = importlib.import_module(modname)
            except Exception as e:  # e.g. the V2 runner needs Triton, absent on CPU
                logger.debug("kunserve: %s not importable (%s); skipping", modname, e)
                continue
            if hasattr(mod, "allocate_kv_cache"):
                self.replace(mod, "allocate_kv_cache", self._make)

    @staticmethod
    def _make(orig):
        def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
            if getattr(kv_cache_config, "kunserve_base_blocks", None) is None:
                return orig(kv_cache_config, device, layout, kernel_block_sizes)
            from vllm_kunserve import plugin
            from vllm_kunserve.integration.vllm.worker_memory import WorkerMemory

            runner = _find_runner()
            wm = WorkerMemory(runner.model, kv_cache_config, device, layout, kernel_block_sizes,
                              plugin.active_config())
            runner._kunserve_memory = wm
            WORKER_MEMORY.append(wm)
            return dict(wm.kv_caches)
        return allocate_kv_cache
