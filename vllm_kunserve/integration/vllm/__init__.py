"""vLLM touchpoints. Each is one small, version-gated :class:`VllmPatch` (see ``patches/``).

``apply_all`` runs once per process when the plugin activates; ``on_engine_config`` runs for each
engine configuration the plugin sees (EngineArgs in the main process, VllmConfig in the engine core
and worker processes).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kunserve.integration.vllm.base import VllmPatch, vllm_version
from vllm_kunserve.integration.vllm.cpu_linear import CpuLinearPatch
from vllm_kunserve.integration.vllm.engine_hooks import EngineCorePatch
from vllm_kunserve.integration.vllm.kv_alloc import KVAllocationPatch
from vllm_kunserve.integration.vllm.kv_plan import KVPlanPatch
from vllm_kunserve.integration.vllm.worker_extension import WorkerExtensionPatch

logger = logging.getLogger("vllm.kunserve")

#: every touchpoint, in application order
PATCH_CLASSES: list[type[VllmPatch]] = [
    WorkerExtensionPatch, KVPlanPatch, EngineCorePatch, KVAllocationPatch, CpuLinearPatch]

_instances: dict[str, VllmPatch] = {}


def apply_all(cfg: Any) -> list[str]:
    """Apply every supported touchpoint once; unsupported vLLM versions are skipped with a warning."""
    applied = []
    version = vllm_version()
    for cls in PATCH_CLASSES:
        inst = _instances.get(cls.name)
        if inst is None:
            inst = cls()
            if not inst.wanted(cfg):
                continue
            if not inst.supported(version):
                logger.warning("kunserve: patch %s supports vllm%s, not %s: skipped",
                               cls.name, cls.versions, version)
                continue
            inst.patch(cfg)
            _instances[cls.name] = inst
        applied.append(cls.name)
    return applied


def on_engine_config(cfg: Any, holder: Any) -> None:
    """Let each applied touchpoint adjust the engine configuration (EngineArgs or VllmConfig)."""
    for inst in _instances.values():
        inst.configure(cfg, holder)


def revert_all() -> None:
    """Undo every patch in this process (tests)."""
    for inst in reversed(list(_instances.values())):
        inst.revert()
    _instances.clear()


__all__ = ["PATCH_CLASSES", "apply_all", "on_engine_config", "revert_all", "VllmPatch"]
