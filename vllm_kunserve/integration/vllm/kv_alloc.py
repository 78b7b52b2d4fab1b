"""Touchpoint: ``allocate_kv_cache`` as the model runners call it.

``GPUModelRunner.initialize_kv_cache_tensors`` (V1 runner; the CPU runner inherits it) calls
``allocate_kv_cache`` by module-level name. We wrap ``initialize_kv_cache_tensors`` to note which
runner is allocating (a context variable: explicit, per call) and ``allocate_kv_cache`` to build
kunserve's memory for that runner when the engine core planned a growable KV cache for it
(``kv_plan.py`` tags the config with ``kunserve_base_blocks``): weights move into the pool layer by
layer and every layer's KV cache gets its own growable region (``worker_memory.py``). Otherwise the
original runs unchanged.

vLLM 0.26-0.28 have no ``allocate_kv_cache``: the runner allocates one raw buffer per layer
(``GPUModelRunner._allocate_kv_cache_tensors``) and views them itself (``_reshape_kv_cache_tensors``),
so there we wrap ``_allocate_kv_cache_tensors`` to hand it the layers' KV regions as those buffers.

Model Runner V2 (``vllm.v1.worker.gpu``, vLLM's CUDA default since 0.25) is not wrapped: an engine
that moves memory runs the V1 runner (``runner.py`` answers vLLM's switch for it), and a growable
plan that still reaches another runner refuses with a clear message.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from vllm_kunserve.config import engine_config
from vllm_kunserve.integration.vllm.base import VllmPatch
from vllm_kunserve.integration.vllm.versions import params, release
from vllm_kunserve.integration.vllm.kv_plan import base_blocks

logger = logging.getLogger("vllm.kunserve")

#: (the allocating runner, its kernel block sizes) while ``initialize_kv_cache_tensors`` runs
_RUNNER: contextvars.ContextVar[Any] = contextvars.ContextVar("kunserve_kv_runner", default=(None, None))


class KVAllocationPatch(VllmPatch):
    name = "kv_allocation"
    summary = "allocate a growable KV cache (per-layer pool regions) when the engine planned one"
    requires = ("moves_memory",)

    def patch(self) -> None:
        mod = self.resolve("vllm.v1.worker.gpu_model_runner")
        runner_cls = self.resolve("vllm.v1.worker.gpu_model_runner:GPUModelRunner")

        def make_init(orig):
            def initialize_kv_cache_tensors(runner, kv_cache_config, *args, **kwargs):
                token = _RUNNER.set((runner, args[0] if args else kwargs.get("kernel_block_sizes")))
                try:
                    return orig(runner, kv_cache_config, *args, **kwargs)
                finally:
                    _RUNNER.reset(token)
            return initialize_kv_cache_tensors

        def make_alloc(orig):
            def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
                if base_blocks(kv_cache_config) is None:
                    return orig(kv_cache_config, device, layout, kernel_block_sizes)
                runner = _allocating_runner()
                from vllm_kunserve.integration.vllm.worker_memory import build_worker_memory

                res, views, make_view = build_worker_memory(runner.model, kv_cache_config, device, layout, kernel_block_sizes,
                                                 engine_config(runner.vllm_config))
                runner._kunserve_memory = res
                runner._kunserve_kv_view = make_view  # views over a group peer's KV (pipeline.py)
                return views
            return allocate_kv_cache

        def make_raw(orig):
            def _allocate_kv_cache_tensors(runner, kv_cache_config):
                if base_blocks(kv_cache_config) is None:
                    return orig(runner, kv_cache_config)
                _allocating_runner()
                kbs = _RUNNER.get()[1]
                from vllm_kunserve.integration.vllm.worker_memory import build_worker_memory

                res, raws, make_view = build_worker_memory(
                    runner.model, kv_cache_config, runner.device, None, kbs, engine_config(runner.vllm_config),
                    reshape=lambda raw: runner._reshape_kv_cache_tensors(raw, kbs))
                runner._kunserve_memory = res
                runner._kunserve_kv_view = make_view
                return raws   # vLLM views them (_reshape_kv_cache_tensors)
            return _allocate_kv_cache_tensors

        self.replace(runner_cls, "initialize_kv_cache_tensors", make_init,
                     params=params("vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache_tensors"))
        if release() < (0, 29):  # vLLM 0.26-0.28: per-layer raw buffers viewed by the runner (no allocate_kv_cache)
            self.replace(runner_cls, "_allocate_kv_cache_tensors", make_raw,
                         params=params("vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors"))
            return
        self.replace(mod, "allocate_kv_cache", make_alloc,
                     params=params("vllm.v1.worker.gpu_model_runner:allocate_kv_cache"))


def _allocating_runner() -> Any:
    runner = _RUNNER.get()[0]
    if runner is None:
        raise RuntimeError("kunserve: a growable KV cache was planned but the allocating model "
                           "runner is not one kunserve supports (V1 GPUModelRunner / CPUModelRunner)")
    return runner
