"""Touchpoint: ``get_kv_cache_configs`` as imported by ``vllm.v1.engine.core``.

For an engine with a growable KV cache (remap or pipeline-group membership in *its* configuration) the engine is
planned at ``memory.max_kv_ratio`` (resolved: ``KunServeConfig.kv_ratio``) times the normal KV memory (the most the KV regions may reach),
and the normal block count is remembered on each returned ``KVCacheConfig`` as
``kunserve_base_blocks`` (pickled with it to the workers; the scheduler holds the same object): the
workers map only the base, the scheduler hides the rest (``block_capacity.py``). Other engines get
vLLM's plan unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kunserve.config import engine_config
from vllm_kunserve.integration.vllm.base import VllmPatch
from vllm_kunserve.integration.vllm.versions import params

logger = logging.getLogger("vllm.kunserve")


def base_blocks(kv_cache_config: Any) -> int | None:
    """The base block count of a growable KV plan (None: vLLM's own plan)."""
    return getattr(kv_cache_config, "kunserve_base_blocks", None)


class KVPlanPatch(VllmPatch):
    name = "kv_plan"
    summary = "plan the KV cache at its maximum size and remember the base block count"
    requires = ("moves_memory",)

    def patch(self) -> None:
        core = self.resolve("vllm.v1.engine.core")

        def make(orig):
            def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
                configs = orig(vllm_config, kv_cache_specs, available_memory)
                kcfg = engine_config(vllm_config)
                if kcfg is None or not kcfg.moves_memory or not configs:
                    return configs
                base = min(c.num_blocks for c in configs)
                ratio = kcfg.kv_ratio
                cache = vllm_config.cache_config
                override = cache.num_gpu_blocks_override
                try:
                    if override:
                        cache.num_gpu_blocks_override = int(override * ratio)
                    big = orig(vllm_config, kv_cache_specs, [int(m * ratio) for m in available_memory])
                finally:
                    cache.num_gpu_blocks_override = override
                for c in big:
                    c.kunserve_base_blocks = base
                logger.info("kunserve: KV planned for up to %d blocks, base %d (max_kv_ratio %.2f)",
                            min(c.num_blocks for c in big), base, ratio)
                return big
            return get_kv_cache_configs

        self.replace(core, "get_kv_cache_configs", make, params=params("vllm.v1.engine.core:get_kv_cache_configs"))
