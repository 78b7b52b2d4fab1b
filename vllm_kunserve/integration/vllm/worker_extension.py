"""Touchpoint: ``parallel_config.worker_extension_cls``.

vLLM mixes the named class into its worker class (``WorkerWrapperBase.init_worker``), which makes
our methods reachable with ``collective_rpc("kunserve_...")`` in every worker process. No vLLM
function is replaced. If the user already set their own extension class we leave it and log that
kunserve's worker methods are unavailable.

The memory methods are the worker half of the engine agent's two-phase transitions:
``kunserve_prepare`` runs a residency transition and keeps its undo log, ``kunserve_commit`` drops
it, ``kunserve_abort`` undoes it (a no-op where nothing is prepared, e.g. on the worker that
failed, which rolled itself back).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_kunserve.integration.vllm import kv_migration  # noqa: F401  (registers the KV migration view)
from vllm_kunserve.integration.vllm.base import VllmPatch

logger = logging.getLogger("vllm.kunserve")

EXTENSION_QUALNAME = "vllm_kunserve.integration.vllm.worker_extension.KunServeWorkerExtension"


class WorkerExtensionPatch(VllmPatch):
    name = "worker_extension"
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
        from vllm_kunserve.config import engine_config
        from vllm_kunserve.integration.vllm.registry import applied
        from vllm_kunserve.integration.vllm.worker_memory import decoder_layers

        runner = getattr(self, "model_runner", None)
        kv = getattr(runner, "kv_caches", None) or []
        kv_bytes = sum(int(t.numel() * t.element_size()) for t in kv if hasattr(t, "numel"))
        return {"pid": os.getpid(), "active": engine_config(self.vllm_config) is not None,
                "patches": applied(), "num_layers": len(decoder_layers(getattr(runner, "model", None))),
                "kv_cache_tensors": len(kv), "kv_cache_bytes": kv_bytes}

    # -- memory: the worker half of the engine agent's transitions ------------------------------
    def _kunserve_memory(self):
        res = getattr(getattr(self, "model_runner", None), "_kunserve_memory", None)
        if res is None:
            raise RuntimeError("kunserve memory is not set up on this worker (remap not enabled?)")
        return res

    def _kunserve_rank(self) -> int:
        return int(getattr(self, "rank", 0) or 0)

    def kunserve_memory_state(self) -> dict:
        return {"pid": os.getpid(), "rank": self._kunserve_rank(), **self._kunserve_memory().state()}

    def kunserve_prepare(self, op: str, params: dict) -> int:
        """Run a transition and keep it prepared; returns the mapped block count."""
        res = self._kunserve_memory()
        res.faults.check("rpc")
        if op == "remap":
            return res.remap(list(params["layers"]), int(params["slots"]), commit=False)
        if op == "revert":
            return res.revert(kv_blocks=int(params["kv_blocks"]), keep=list(params.get("keep", ())), commit=False)
        if op == "lend":
            return res.remap(list(params["layers"]), int(params["slots"]), commit=False, lend=True)
        if op == "borrow":
            return res.borrow(int(params["blocks"]), commit=False)
        if op == "repay":
            return res.repay(int(params["blocks"]), commit=False)
        raise ValueError(f"unknown kunserve transition {op!r}")

    def kunserve_commit(self) -> None:
        self._kunserve_memory().commit()

    def kunserve_abort(self) -> list:
        return self._kunserve_memory().abort()

    def kunserve_check(self) -> dict:
        res = self._kunserve_memory()
        return {"mapped_blocks": res.mapped_blocks, "remapped_layers": list(res.streamed),
                "dropped_layers": list(res.dropped), "problems": res.check_invariants()}

    def kunserve_inject_fault(self, step: str, after: int = 0, rank: int | None = None, delay_s: float = 0.0) -> dict:
        """Test hook: the next time ``step`` runs on this worker (or only on ``rank``) it fails.
        Steps: ``rpc`` (the next prepare fails before doing anything), ``map`` (a chunk map while
        growing KV), ``exhausted`` (growing KV), a residency step name (``memory.residency.STEPS``) or
        a pipeline group's (``integration.vllm.pipeline.GROUP_STEPS``). ``delay_s`` > 0: the step
        stalls that long instead of failing (a process can then be killed in the middle of it)."""
        from vllm_kunserve.integration.vllm.pipeline import GROUP_STEPS
        from vllm_kunserve.memory.residency import STEPS

        res = self._kunserve_memory()
        if rank is not None and rank != self._kunserve_rank():
            return {"rank": self._kunserve_rank(), "armed": None}
        if step == "clear":
            res.faults.disarm()
            res.pool.faults.clear()
            return {"rank": self._kunserve_rank(), "armed": None}
        if step == "map":
            res.pool.faults.fail_map(after=1 + after)
        elif step == "exhausted":
            res.faults.arm("kv_grow", after)
        elif step in STEPS or step in GROUP_STEPS or step == "rpc":
            res.faults.arm(step, after, delay_s)
        else:
            raise ValueError(f"fault step must be one of map, exhausted, rpc, {', '.join(STEPS + GROUP_STEPS)}; "
                             f"got {step!r}")
        return {"rank": self._kunserve_rank(), "armed": step}

    # -- KV migration (issue 12): the worker half of engine/migration.py -------------------------
    def kunserve_kv_layout(self) -> dict:
        """Per layer: block shape, dtype and bytes per block of this worker's KV cache."""
        return kv_migration.worker_kv(self).layout()

    def kunserve_kv_read(self, xfer: dict) -> dict:
        """Source: read ``xfer["block_ids"]`` of every layer and send them over a transfer channel
        to this rank's receiver on the target (blocks until sent)."""
        return kv_migration.worker_kv(self).send(xfer)

    def kunserve_kv_open(self, xfer: dict) -> dict:
        """Target: start receiving ``xfer["num_blocks"]`` blocks in the background; returns this
        rank's rendezvous (host, port)."""
        return kv_migration.worker_kv(self).open(xfer)

    def kunserve_kv_write(self, xfer: dict) -> dict:
        """Target: wait for the receive, write the blocks into ``xfer["block_ids"]``."""
        return kv_migration.worker_kv(self).write(xfer)

    def kunserve_kv_close(self, xfer_id: str) -> bool:
        """Target: abort a staged receive (idempotent)."""
        return kv_migration.worker_kv(self).close(xfer_id)

    # -- pipeline groups (issue 13): the worker half of the agent's group operations -------------
    def kunserve_group_open(self) -> dict:
        """This worker's stage server address (a group peer connects to it)."""
        from vllm_kunserve.integration.vllm.pipeline import member

        return {"rank": self._kunserve_rank(), "stage": member(self).server.address}

    def kunserve_group_join(self, params: dict) -> dict:
        from vllm_kunserve.integration.vllm.pipeline import member

        self._kunserve_memory().faults.check("rpc")
        return member(self).join(params)

    def kunserve_group_leave(self, params: dict) -> dict:
        from vllm_kunserve.integration.vllm.pipeline import member

        return member(self).leave(params)

    def kunserve_group_restage(self, params: dict) -> dict:
        from vllm_kunserve.integration.vllm.pipeline import member

        return member(self).restage(params)

    def kunserve_group_state(self) -> dict:
        from vllm_kunserve.integration.vllm.pipeline import member

        return member(self).state()

    def kunserve_group_pace(self, wanted: list | None = None) -> list:
        """The peers' latest and wanted step chunks this worker's stage served (the group
        scheduler's input); ``wanted``: this member's own, sent to the peers with its spans."""
        m = self.__dict__.get("_kunserve_group")
        return m.pace(wanted) if m is not None else []

    def kunserve_group_ping(self, stage: str, nbytes: int = 16384) -> dict:
        from vllm_kunserve.integration.vllm.pipeline import member

        return member(self).ping(stage, int(nbytes))
