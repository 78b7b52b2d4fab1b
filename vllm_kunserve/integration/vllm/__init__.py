"""vLLM touchpoints. Each is one small, version-gated :class:`VllmPatch` (see ``patches/``).

The plugin's activation gate applies the touchpoints an engine's configuration needs
(``apply_named``), once per process; each touchpoint then reads the configuration of the engine it
is serving from the objects vLLM passes it, so engines without kunserve pass through unchanged.
"""

from __future__ import annotations

import logging

from vllm_kunserve.integration.vllm.base import PatchShapeError, VllmPatch
from vllm_kunserve.integration.vllm.versions import (UnsupportedVllmError, check_supported, check_touchpoint,
                                                      vllm_version)
from vllm_kunserve.integration.vllm.cpu_linear import CpuLinearPatch
from vllm_kunserve.integration.vllm.engine_hooks import EngineCorePatch
from vllm_kunserve.integration.vllm.kv_alloc import KVAllocationPatch
from vllm_kunserve.integration.vllm.kv_plan import KVPlanPatch
from vllm_kunserve.integration.vllm.registry import APPLIED as _instances
from vllm_kunserve.integration.vllm.registry import applied
from vllm_kunserve.integration.vllm.runner import RunnerSelectionPatch
from vllm_kunserve.integration.vllm.scheduler import SchedulerPatch
from vllm_kunserve.integration.vllm.worker_extension import WorkerExtensionPatch

logger = logging.getLogger("vllm.kunserve")

#: every touchpoint, in application order
PATCH_CLASSES: list[type[VllmPatch]] = [
    WorkerExtensionPatch, RunnerSelectionPatch, KVPlanPatch, EngineCorePatch, KVAllocationPatch, CpuLinearPatch,
    SchedulerPatch]

def apply_named(names: list[str]) -> list[str]:
    """Apply the named touchpoints once each (in ``PATCH_CLASSES`` order). A vLLM outside the
    supported range (``versions.py``) is refused in one line (:class:`UnsupportedVllmError`); a
    touchpoint whose vLLM symbol changed shape refuses with :class:`PatchShapeError`. Returns every
    applied name."""
    version = vllm_version()
    if names:
        check_supported(version)
    for cls in PATCH_CLASSES:
        if cls.name not in names or cls.name in _instances:
            continue
        check_touchpoint(cls.name, version)  # one line where this release lacks what it touches
        inst = cls()
        inst.patch()
        _instances[cls.name] = inst
    return applied()


def instances() -> list[VllmPatch]:
    return [_instances[c.name] for c in PATCH_CLASSES if c.name in _instances]


def revert_all() -> None:
    """Undo every patch in this process (tests)."""
    for inst in reversed(instances()):
        inst.revert()
    _instances.clear()


__all__ = ["PATCH_CLASSES", "PatchShapeError", "UnsupportedVllmError", "check_supported", "VllmPatch", "applied", "apply_named", "instances", "revert_all"]
