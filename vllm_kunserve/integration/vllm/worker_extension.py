"""Touchpoint: ``parallel_config.worker_extension_cls``.

vLLM mixes the named class into its worker class (``WorkerWrapperBase.init_worker``), which makes
our methods reachable with ``LLM.collective_rpc("kunserve_...")`` / ``engine.collective_rpc``
in every worker process. No vLLM function is replaced. If the user already set their own
extension class we leave it and log that kunserve's worker methods are unavailable.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_kunserve.integration.vllm.base import VllmPatch

logger = logging.getLogger("vllm.kunserve")

EXTENSION_QUALNAME = "vllm_kunserve.integration.vllm.worker_extension.KunServeWorkerExtension"


class WorkerExtensionPatch(VllmPatch):
    name = "worker_extension"
    versions = ">=0.32,<0.34"
    summary = "mix KunServeWorkerExtension into the vLLM worker for collective_rpc control"

    def configure(self, cfg: Any, holder: Any) -> None:
        target = getattr(holder, "parallel_config", holder)  # VllmConfig or EngineArgs
        current = getattr(target, "worker_extension_cls", None)
        if current in (None, ""):
            target.worker_extension_cls = EXTENSION_QUALNAME
        elif current != EXTENSION_QUALNAME:
            logger.warning("kunserve: worker_extension_cls=%s already set by the user; "
                           "kunserve worker methods are not available", current)


class KunServeWorkerExtension:
    """Methods added to vLLM's worker; call them with ``collective_rpc("<name>")``.

    Every name starts with ``kunserve_`` so it cannot collide with the worker's own attributes.
    """

    def kunserve_info(self) -> dict:
        """State of this worker as seen by kunserve: process, model layers, KV cache."""
        from vllm_kunserve import plugin

        runner = getattr(self, "model_runner", None)
        layers = _decoder_layers(getattr(runner, "model", None))
        kv = getattr(runner, "kv_caches", None) or []
        kv_bytes = sum(int(t.numel() * t.element_size()) for t in kv if hasattr(t, "numel"))
        return {
            "pid": os.getpid(),
            "active": plugin.active_config() is not None,
            "patches": plugin.applied_patches(),
            "num_layers": len(layers),
            "kv_cache_tensors": len(kv),
            "kv_cache_bytes": kv_bytes,
        }


    # -- memory (remap) control: called by the engine core's RemapCoordinator ------------------
    def _kunserve_memory(self):
        wm = getattr(getattr(self, "model_runner", None), "_kunserve_memory", None)
        if wm is None:
            raise RuntimeError("kunserve memory is not set up on this worker (remap not enabled?)")
        return wm

    def kunserve_memory_state(self) -> dict:
        return {"pid": os.getpid(), **self._kunserve_memory().state()}

    def kunserve_remap(self, layers: list, slots: int) -> int:
        """Release ``layers`` to the KV cache and stream them; returns the mapped block count."""
        return self._kunserve_memory().remap(list(layers), int(slots))

    def kunserve_revert(self) -> int:
        return self._kunserve_memory().revert()

    def kunserve_inject_fault(self, kind: str) -> dict:
        return self._kunserve_memory().inject_fault(kind)


def _decoder_layers(model: Any) -> list:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []
