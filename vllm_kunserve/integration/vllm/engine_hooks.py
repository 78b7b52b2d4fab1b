"""Touchpoint: ``vllm.v1.engine.core.EngineCore`` (engine-core process).

- ``_initialize_effective_attention_block_size``: called by ``EngineCore.__init__`` right after the
  scheduler is built (and before the ready handshake reports ``num_gpu_blocks``); we attach the
  :class:`RemapCoordinator`, which hides the KV blocks above the base. (``__init__`` itself cannot
  be wrapped: vLLM loads plugins from inside it.)
- ``step`` / ``step_with_batch_queue``: run the coordinator's control tick before scheduling and
  time the step (the controller's compute estimate).
- ``collective_rpc``: method names in ``ENGINE_METHODS`` (``kunserve_state``, ``kunserve_remap``,
  ``kunserve_revert``, ...) are answered by the coordinator, since remap/revert must move the
  scheduler and the workers together. Everything else goes to the workers as before.

Engines without a kunserve remap configuration pass straight through.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_kunserve.integration.vllm.base import VllmPatch

logger = logging.getLogger("vllm.kunserve")


def _coordinator(core: Any):
    return core.__dict__.get("_kunserve")


class EngineCorePatch(VllmPatch):
    name = "engine_core"
    versions = ">=0.32,<0.34"
    summary = "attach the remap coordinator to the engine core, tick it every step, route kunserve RPCs"
    requires = ("remap",)


    def configure(self, cfg: Any, holder: Any) -> None:
        """Streaming uses forward hooks and side copies, which need eager execution."""
        if not cfg.remap.enable:
            return
        if type(holder).__name__ in ("EngineArgs", "AsyncEngineArgs"):
            if not holder.enforce_eager:
                logger.info("kunserve: remap streams layers with forward hooks; enabling enforce_eager")
                holder.enforce_eager = True
            return
        model_config = getattr(holder, "model_config", None)
        if model_config is not None and not model_config.enforce_eager:
            from vllm_kunserve.config import KunServeConfigError

            raise KunServeConfigError(
                "kunserve.remap.enable=true: weight streaming needs eager execution; "
                "start vLLM with --enforce-eager (or LLM(..., enforce_eager=True))")

    def patch(self, cfg: Any) -> None:
        EngineCore = self.resolve("vllm.v1.engine.core:EngineCore")

        def make_init_hook(orig):
            def _initialize_effective_attention_block_size(core, *a, **kw):
                out = orig(core, *a, **kw)
                _attach(core)
                return out
            return _initialize_effective_attention_block_size

        def make_step(orig):
            def step(core, *a, **kw):
                coord = _coordinator(core)
                if coord is None:
                    return orig(core, *a, **kw)
                coord.tick()
                t0 = time.perf_counter()
                out = orig(core, *a, **kw)
                if out[1]:  # the model ran
                    coord.note_step((time.perf_counter() - t0) * 1e3)
                if core.scheduler.get_num_unfinished_requests() == 0:
                    coord.on_idle()
                return out
            return step

        def make_rpc(orig):
            def collective_rpc(core, method, timeout=None, args=(), kwargs=None):
                from vllm_kunserve.integration.vllm.remap_coordinator import ENGINE_METHODS

                coord = _coordinator(core)
                if isinstance(method, str) and method in ENGINE_METHODS:
                    if coord is None:
                        raise RuntimeError(f"{method}: kunserve remap is not enabled on this engine")
                    return [coord.call(method, *(args or ()), **(kwargs or {}))]
                return orig(core, method, timeout, args, kwargs)
            return collective_rpc

        self.replace(EngineCore, "_initialize_effective_attention_block_size", make_init_hook)
        self.replace(EngineCore, "step", make_step)
        self.replace(EngineCore, "step_with_batch_queue", make_step)
        self.replace(EngineCore, "collective_rpc", make_rpc)


def _attach(core: Any) -> None:
    from vllm_kunserve.integration.vllm.kv_plan import BASE_BLOCKS, engine_cfg
    from vllm_kunserve.integration.vllm.remap_coordinator import RemapCoordinator

    cfg = engine_cfg(core.vllm_config)
    base = BASE_BLOCKS.get(id(core.vllm_config))
    if cfg is None or not cfg.remap.enable or base is None:
        return
    core._kunserve = RemapCoordinator(core, cfg, base)
