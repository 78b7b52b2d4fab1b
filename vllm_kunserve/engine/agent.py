"""The engine agent: one per engine, in the engine-core process. It owns the engine's block
capacity and the worker RPCs, and runs every memory transition (remap, further remap, revert) as
one state machine:

    base --remap--> remapped --revert(begin)--> draining --revert(finish)--> base
                        ^  \\--further remap--/      |--partial revert--> remapped
                        \\------ cancel (demand came back) ----/

Transitions move the scheduler and every worker together: each worker *prepares* the change
(``LayerResidency`` with ``commit=False``), and only when all did does the scheduler change and the
workers commit; if any worker fails, all workers abort (undo), so tensor-parallel ranks never
disagree on their layer sets. Remap grows the workers first and the scheduler last; revert
retires blocks in the scheduler first (draining live ones) and shrinks the workers last, so a step
never sees a block that is not mapped on every worker.

Every control decision runs behind an exception boundary: an error in the policy or the
bookkeeping is logged as an event, counted in ``kunserve:controller_errors_total`` and backed off;
the engine keeps serving. Invariants (scheduler blocks == every worker's mapped blocks; every
layer's tensors where its state says) are checked at startup and after each transition.

The agent implements the control port's handler (``engine.control``): state reads and operation
requests from outside the engine process. Operations from the port run between engine steps: the
step and every operation hold ``self.lock``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

from vllm_kunserve.engine.control import ControlConflict, ControlRequestError
from vllm_kunserve.engine.migration import MIGRATION_OPERATIONS, KVMigration, _number
from vllm_kunserve.engine.state import HOST_ENV, Blocks, Capacity, EngineInfo, EngineState, Layer, Requests

#: marker in the message of a step that failed because a group peer is gone (raised by the worker's
#: pipeline; vLLM's multiprocess executor passes worker errors on as text)
PEER_LOST = "kunserve-group-peer-lost"
from vllm_kunserve.memory.transaction import StepFaults
from vllm_kunserve.policy.inputs import EngineLoad, remap_input
from vllm_kunserve.policy.remap import ModelLayers, RemapState, decide_remap, remap_room, spaced_layers

logger = logging.getLogger("vllm.kunserve")

#: methods the engine core answers itself when called through ``collective_rpc``
ENGINE_METHODS = ("kunserve_state", "kunserve_remap", "kunserve_revert", "kunserve_inject_fault",
                  "kunserve_auto", "kunserve_check", "kunserve_group_join", "kunserve_group_leave",
                  "kunserve_group_restage", "kunserve_group_ping", "kunserve_lend", "kunserve_reclaim",
                  "kunserve_borrow", "kunserve_repay", *(f"kunserve_{op}" for op in MIGRATION_OPERATIONS))

#: operations of the control port: name -> parameters
OPERATIONS = {
    "remap": "alpha (int >= 1, default 1), slots (1|2, default 1), or layers (list of layer indices)",
    "revert": "no parameters: return every streamed layer (drains blocks above the base first)",
    "auto": "enable (bool): let the agent remap and revert by itself",
    "lend": "alpha (int >= 1) or layers (list of layer indices), slots (1|2, default 1): stream those layers and "
            "give their memory back to the host, for another engine's KV (a multi-model fleet's idle model)",
    "reclaim": "no parameters: take back what lend gave and reload every streamed layer",
    "borrow": "blocks (int): grow the KV to that many blocks on memory made now (what another engine lent)",
    "repay": "blocks (int, default the base): shrink the KV back (blocks in use drain first: no request is lost or "
             "recomputed) and give the memory back to the host; the state's tenancy says when it is done",
    "inject_fault": "step (str; 'clear' disarms all), after (int, default 0), rank (int, optional), delay_s "
                    "(stall that long instead of failing): test hook",
    "check": "no parameters: check the invariants now",
    "group_join": "name (str), drop (layer indices), spans ([[lo, hi, peer]]: who runs each dropped span), "
                  "peers ({name: {stage, blocks}}), timeout_s, transition ('kv' | 'reprefill'), join_id (str, "
                  "the same on every member of one attempt): join a pipeline group (KV exchange included)",
    "group_leave": "step ('begin': retire the blocks above the base, or above blocks (int: a step down into a "
                   "smaller group, then group_restage), draining live ones | 'finish': every "
                   "member drained: take the layers back and return the peers' KV | 'abandon': take the layers "
                   "back from the host copies now and recompute every request, no peer needed), timeout_s, source, "
                   "leave_id (str, the same on every member of one attempt)",
    "group_restage": "spans ([[lo, hi, peer]]: who of the new group runs each layer this member will not), peers "
                     "({name: {stage, blocks}}: the new group), members ({name: stage}: every engine of the "
                     "regroup), holders ({origin: [[lo, hi, holder]]}: who holds each member's KV of each layer "
                     "after), timeout_s, restage_id (str, the same on every member): a grouped member moves into "
                     "a larger group keeping every request's KV (a lone engine merged with live groups too: name, "
                     "its member name; grouped: whether the controller saw it grouped), or, drained by "
                     "group_leave begin with blocks, into a smaller one; on failure it abandons "
                     "(requests recomputed)",
    "group_ping": "stage (a peer's stage address), bytes (payload, default 16384): stage-link round trip",
    **MIGRATION_OPERATIONS,  # KV migration between engines (engine/migration.py)
}

#: faults the agent itself can be armed with (the rest go to the workers' residency)
AGENT_FAULTS = ("policy", "bookkeeping")

_FAILURE_BACKOFF_S = 5.0
#: how stale the published state may get while the engine steps (transitions publish at once)
_PUBLISH_EVERY_S = 0.05
_PIPELINE_READ_S = 2.0


class AgentError(RuntimeError):
    pass


class EngineAgent:
    """Memory transitions and control of one engine.

    ``sched``: the scheduler view (capacity and demand); ``workers(method, *args, **kwargs)`` calls
    a method on every worker and returns their answers; ``wake``: optional callable that makes an
    idle engine loop run one more iteration (``EngineCoreProc``)."""

    def __init__(self, cfg: Any, sched: Any, workers: Callable[..., list], label: str = "0",
                 metrics: dict | None = None, wake: Callable[[], None] | None = None, info: dict | None = None):
        self.cfg = cfg
        self.sched = sched
        self._workers = workers
        self.label = label
        self.m = metrics
        self.wake = wake
        self.info = dict(info or {})
        # groups form within one host (the stage link's): the machine's name, or the node its launcher
        # placed it on (a Ray actor names its Ray node: two nodes on one machine are two hosts)
        self.info.setdefault("host", os.environ.get(HOST_ENV) or socket.gethostname())
        self.lock = threading.RLock()
        self._waiting_ops = 0
        self._ops_done = threading.Condition()
        states = workers("kunserve_memory_state")
        self.num_layers = states[0]["num_layers"]
        self.layer_bytes = max(max(s["layer_bytes"]) for s in states)
        self.layer_bytes_each = states[0]["layer_bytes"]
        self.chunk_bytes = states[0]["chunk_bytes"]
        self.block_bytes = max(s["block_bytes"] for s in states)
        self.num_kv = states[0]["kv_regions"]
        self.num_workers = len(states)
        self.h2d_bytes_per_s = (cfg.remap.h2d_bandwidth_gbps * 1e9 if cfg.remap.h2d_bandwidth_gbps
                                else min(s["h2d_bytes_per_s"] for s in states))
        self.copy_overlap = all(s["copy_overlap"] for s in states)
        self.phase = "base"          # base | remapped | draining | grouped | group_draining
        self.group: dict | None = None
        self.remapped: tuple[int, ...] = ()
        self.slots = 0
        self._revert_target: tuple[int, ...] = ()
        self._revert_reason = "idle"
        # memory between engines of one host (a multi-model fleet's controller decides it): layers lent,
        # and where a repay drains to (None: the draining phase is a revert's)
        self.lent = False
        self._repay_to: int | None = None
        self.held_bytes = sum(s.get("held_bytes", 0) for s in states)
        self.auto = True
        self.policy_state = RemapState()
        self.step_ms: deque[float] = deque(maxlen=64)
        self.backoff_until = 0.0
        self.events: list[dict] = []
        self.errors = 0
        self.operation: dict | None = None
        self.faults = StepFaults()
        self._state: dict = {}
        self._published_at = 0.0
        self._pipeline: dict | None = None
        self._pipeline_read_at = 0.0
        if cfg.drop.group_member:
            self.info["stage"] = [w["stage"] for w in workers("kunserve_group_open")]
        problems = self.invariant_problems()
        if problems:
            raise AgentError(f"kunserve: engine {label} starts inconsistent: {problems}")
        self._publish()
        logger.info("kunserve agent ready (engine %s): %d layers of %.1f MB, KV base %d blocks (max %d), "
                    "host link %.1f GB/s, copies %s", label, self.num_layers, self.layer_bytes / 1e6,
                    self.sched.state().base, self.sched.state().max_blocks, self.h2d_bytes_per_s / 1e9,
                    "overlap compute" if self.copy_overlap else "inline")

    # -- the engine loop's entry points ---------------------------------------------------------------
    def run_step(self, step: Callable[[], Any]) -> Any:
        """Run one engine step under the agent: waiting control operations go first, then the
        control tick, then the step itself (timed)."""
        with self._ops_done:
            while self._waiting_ops:
                self._ops_done.wait(0.5)
        with self.lock:
            self.tick()
            t0 = time.perf_counter()
            try:
                out = step()
            except Exception as exc:
                if self.group is None or PEER_LOST not in str(exc):
                    raise
                self.group_abandon(str(exc)[:500])
                return {}, False  # nothing was computed; every request is recomputed next steps
            if isinstance(out, tuple) and len(out) > 1 and out[1]:  # the model ran
                self.step_ms.append((time.perf_counter() - t0) * 1e3)
            idle = self.sched.unfinished() == 0
            if idle:
                self.tick()
            # O(requests): not every step, but always after the step that finished the last request
            # (an idle engine runs no step that would publish its state again)
            if idle or time.monotonic() - self._published_at >= _PUBLISH_EVERY_S:
                self._publish()
            return out

    def tick(self) -> None:
        """One control decision. Never raises: errors become events, metrics and a back-off."""
        try:
            self._tick()
        except Exception as exc:
            self._error("tick", exc)

    def _error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self.backoff_until = time.monotonic() + _FAILURE_BACKOFF_S
        if self.m:
            self.m["controller_errors"].labels(self.label, where).inc()
        logger.exception("kunserve: controller error in %s (engine keeps serving; backing off %.0f s)",
                         where, _FAILURE_BACKOFF_S)
        self._event("controller_error", "failed", 0.0, 0, where=where, error=repr(exc))

    # -- demand and decisions ---------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        st = self.sched.state()
        used, queued, growth = self.sched.demand()
        return EngineLoad(used_blocks=used, queued_blocks=queued, growth_blocks=growth,
                          capacity_blocks=st.visible - 1, base_blocks=st.base - 1, free_blocks=st.free,
                          block_bytes=self.block_bytes)

    def _tick(self) -> None:
        if self.phase == "draining":
            self._drain_tick()
            return
        if not self.cfg.remap.enable or self.phase not in ("base", "remapped"):
            return  # groups are decided by the cluster monitor, not by this engine
        if self.lent or self.borrowed:
            return  # memory lent or borrowed is the host's controller's (a multi-model fleet)
        if not self.auto or time.monotonic() < self.backoff_until:
            return
        self.faults.check("policy")
        load = self.load()
        model, step_ms = self._model()
        alpha_now = model.remapped_alpha
        inp = remap_input(load, model, h2d_bytes_per_s=self.h2d_bytes_per_s,
                          high_watermark=self.cfg.remap.high_watermark, now_s=time.monotonic(),
                          copy_overlap=self.copy_overlap)
        plan, self.policy_state = decide_remap(inp, self.cfg.remap, self.policy_state)
        decision = {"action": plan.action, **({"alpha": plan.models[0].alpha, "slots": plan.models[0].slots}
                                              if plan.models else {})}
        inputs = {"demand": load.demand_blocks, "capacity": load.capacity_blocks, "base": load.base_blocks,
                  "used": load.used_blocks, "step_ms": round(step_ms, 3)}
        if plan.action == "remap":
            target = plan.models[0]
            if self.phase == "base":
                self.remap(list(target.layers), target.slots, reason="overload", inputs=inputs, decision=decision)
            elif target.alpha > alpha_now:
                self.remap(self._extend(target.alpha + self.slots), self.slots, reason="overload",
                           inputs=inputs, decision=decision)
        elif plan.action == "revert" and self.phase == "remapped":
            target = plan.models[0]
            keep = self._subset(target.alpha + target.slots) if target.alpha else ()
            self.begin_revert(keep, reason="idle", inputs=inputs, decision=decision)

    def _model(self) -> tuple[ModelLayers, float]:
        """This engine's model for the remap policy (its median step time spread over its layers)."""
        sorted_ms = sorted(self.step_ms)
        step_ms = sorted_ms[len(sorted_ms) // 2] if sorted_ms else 10.0
        per_layer_ms = max(1e-3, step_ms / self.num_layers)
        return ModelLayers("self", self.num_layers, self.layer_bytes, per_layer_ms, per_layer_ms, active=True,
                           remapped_alpha=max(0, len(self.remapped) - self.slots), slots=self.slots), step_ms

    def remap_room_bytes(self) -> int:
        """What this engine's own remap could still give its KV (0 where it will not remap by itself)."""
        if not (self.cfg.remap.enable and self.auto) or self.phase not in ("base", "remapped") \
                or self.lent or self.borrowed:
            return 0
        return remap_room(self._model()[0], self.h2d_bytes_per_s, self.cfg.remap, self.copy_overlap)

    def _extend(self, m: int) -> list[int]:
        """``m`` layers including the remapped ones, the rest spread over the largest gaps."""
        chosen = set(self.remapped)
        while len(chosen) < min(m, self.num_layers - 1):
            free = [i for i in range(self.num_layers) if i not in chosen]

            def dist(i: int) -> int:
                return min(min(abs(i - c), self.num_layers - abs(i - c)) for c in chosen)
            chosen.add(max(free, key=lambda i: (dist(i), -i)))
        return sorted(chosen)

    def _subset(self, m: int) -> tuple[int, ...]:
        """``m`` of the remapped layers, evenly spread (what a partial revert keeps)."""
        cur = list(self.remapped)
        if m >= len(cur):
            return tuple(cur)
        return tuple(sorted({cur[(k * len(cur)) // m] for k in range(m)}))

    # -- transitions ------------------------------------------------------------------------------------
    def _two_phase(self, op: str, params: dict) -> list[int]:
        """Prepare ``op`` on every worker; abort all if any fails. Returns their mapped blocks."""
        try:
            return self._workers("kunserve_prepare", op, params)
        except Exception:
            self._abort_workers()
            raise

    def _abort_workers(self) -> None:
        try:
            self._workers("kunserve_abort")
        except Exception as exc:  # a worker could not undo: its memory state is unknown
            self._error("abort", exc)
            raise AgentError(f"workers could not roll back: {exc!r}") from exc

    def _transact(self, op: str, params: dict, middle: Callable[[list[int]], None] | None = None) -> list[int]:
        """Prepare ``op`` on every worker, then the agent's own part (``middle(mapped)``; a fault point),
        then commit; a failure before the commit aborts every worker. Returns their mapped blocks."""
        mapped = self._two_phase(op, params)
        try:
            self.faults.check("bookkeeping")
            if middle is not None:
                middle(mapped)
        except Exception:
            self._abort_workers()
            raise
        self._workers("kunserve_commit")
        return mapped

    def remap(self, layers: list[int], slots: int, reason: str = "forced", inputs: dict | None = None,
              decision: dict | None = None) -> dict:
        if self.phase == "draining":
            raise ControlConflict("a revert is draining; remap after it finishes (or it is cancelled)")
        t0 = time.perf_counter()
        st = self.sched.state()
        before = st.visible
        self.operation = {"op": "remap", "started": time.time(), "params": {"layers": layers, "slots": slots}}
        try:
            self._transact("remap", {"layers": list(layers), "slots": int(slots)},
                           lambda mapped: self.sched.grow(min(min(mapped), st.max_blocks) - st.visible))
        except Exception as exc:
            self.backoff_until = time.monotonic() + _FAILURE_BACKOFF_S
            return self._event("remap", "failed", time.perf_counter() - t0, 0, layers=list(layers), reason=reason,
                               error=repr(exc), blocks=before, inputs=inputs, decision=decision)
        finally:
            self.operation = None
        new = [i for i in layers if i not in self.remapped]
        self.remapped, self.slots, self.phase = tuple(sorted(layers)), int(slots), "remapped"
        self._after_transition()
        return self._event("remap", "ok", time.perf_counter() - t0, len(new) * self.layer_bytes,
                           layers=list(self.remapped), slots=self.slots, reason=reason, blocks_before=before,
                           blocks_after=self.sched.state().visible, inputs=inputs, decision=decision)

    def begin_revert(self, keep: tuple[int, ...] = (), reason: str = "forced", inputs: dict | None = None,
                     decision: dict | None = None) -> dict:
        if self.phase != "remapped":
            return {"event": "revert", "outcome": "noop", "phase": self.phase}
        st = self.sched.state()
        back = [i for i in self.remapped if i not in keep]
        if keep:
            # blocks whose chunks the reloaded layers need, plus one chunk of rounding per KV region
            need = sum(self.layer_bytes_each[i] for i in back) + self.num_kv * self.chunk_bytes
            target = max(st.base, st.visible - -(-need // self.block_bytes))
        else:
            target = st.base
        self.sched.begin_shrink(st.visible - target)
        self.phase = "draining"
        self._revert_target, self._revert_reason = tuple(keep), reason
        self._event("revert", "draining", 0.0, 0, keep=list(keep), blocks_target=target,
                    draining=self.sched.state().draining, reason=reason, inputs=inputs, decision=decision)
        if self.sched.state().draining == 0:
            return self._finish_revert()
        return {"event": "revert", "outcome": "draining", "draining": self.sched.state().draining}

    def _drain_tick(self) -> None:
        if self._repay_to is not None:  # the host wants its memory back: no cancel on demand
            if self.sched.state().draining == 0:
                self._finish_repay()
            return
        if self.sched.state().draining == 0:
            self._finish_revert()
            return
        load = self.load()
        if load.demand_blocks > self.cfg.remap.high_watermark * load.base_blocks:
            n = self._regrow()
            self.phase = "remapped"
            self._event("revert", "cancelled", 0.0, 0, blocks_returned=n, demand=load.demand_blocks)

    def _regrow(self) -> int:
        """Give the scheduler back every block the workers still map (a cancelled or failed
        revert). Returns how many blocks came back."""
        before = self.sched.state().visible
        self.sched.cancel_shrink()
        self._grow_to_mapped()
        return self.sched.state().visible - before

    def _grow_to_mapped(self) -> None:
        """Grow the scheduler from what is visible up to what every worker maps (at most its maximum)."""
        mapped = min(w["mapped_blocks"] for w in self._workers("kunserve_check"))
        st = self.sched.state()
        self.sched.grow(min(mapped, st.max_blocks) - st.visible)

    def _finish_revert(self) -> dict:
        t0 = time.perf_counter()
        st = self.sched.state()
        keep = self._revert_target
        back = [i for i in self.remapped if i not in keep]
        self.operation = {"op": "revert", "started": time.time(), "params": {"keep": list(keep)}}
        try:
            mapped = self._two_phase("revert", {"kv_blocks": st.visible, "keep": list(keep)})
            self._workers("kunserve_commit")
        except Exception as exc:
            # workers keep streaming (aborted); the scheduler gets the retired blocks back
            self.phase = "remapped"
            self._regrow()
            self.backoff_until = time.monotonic() + _FAILURE_BACKOFF_S
            return self._event("revert", "failed", time.perf_counter() - t0, 0, error=repr(exc))
        finally:
            self.operation = None
        self.remapped = tuple(keep)
        self.slots = self.slots if keep else 0
        self.phase = "remapped" if keep else "base"
        if keep:  # KV shrinks in whole chunks: the workers may still map a few blocks above the target
            self.sched.grow(min(min(mapped), st.max_blocks) - self.sched.state().visible)
        self._after_transition()
        return self._event("revert", "ok", time.perf_counter() - t0, len(back) * self.layer_bytes,
                           layers=back, kept=list(keep), reason=self._revert_reason,
                           blocks_after=self.sched.state().visible)

    # -- memory between engines of one host (a multi-model fleet) ---------------------------------------
    @property
    def borrowed(self) -> int:
        """Blocks above the base that a borrow made (0 when none)."""
        st = self.sched.state()
        return 0 if self.lent or self.remapped or self.group else max(0, st.visible - st.base)

    def state_tenancy(self) -> dict:
        ms = sorted(self.step_ms)
        return {"lent": len(self.remapped) if self.lent else 0, "borrowed_blocks": self.borrowed,
                "repaying": self._repay_to is not None, "held_bytes": self.held_bytes,
                # what one block and a borrow's rounding (whole chunks per KV region) cost on every worker
                "block_bytes": self.block_bytes * self.num_workers,
                "round_bytes": self.num_kv * self.chunk_bytes * self.num_workers,
                # the recent steps' times: the median (a decode) and the longest (a prefill's, when one ran)
                "step_ms_p50": round(ms[len(ms) // 2], 3) if ms else 0.0, "step_ms_max": round(ms[-1], 3) if ms else 0.0}

    def _held(self) -> None:
        self.held_bytes = sum(s.get("held_bytes", 0) for s in self._workers("kunserve_memory_state"))

    def lend(self, layers: list[int], slots: int) -> dict:
        """Stream ``layers`` and give their memory (every free chunk) back to the host."""
        if self.phase != "base" or self.borrowed:
            raise ControlConflict(f"lend: only an engine at its base lends (phase {self.phase}, "
                                  f"{self.borrowed} blocks borrowed)")
        t0, before = time.perf_counter(), self.held_bytes
        self.operation = {"op": "lend", "started": time.time(), "params": {"layers": layers, "slots": slots}}
        try:
            self._transact("lend", {"layers": list(layers), "slots": int(slots)})
        except Exception as exc:
            return self._event("lend", "failed", time.perf_counter() - t0, 0, layers=list(layers), error=repr(exc))
        finally:
            self.operation = None
        self.remapped, self.slots, self.phase, self.lent = tuple(sorted(layers)), int(slots), "remapped", True
        self._held()
        self._after_transition()
        return self._event("lend", "ok", time.perf_counter() - t0, before - self.held_bytes, layers=list(self.remapped),
                           slots=self.slots, held_bytes=self.held_bytes)

    def reclaim(self) -> dict:
        """Take back what :meth:`lend` gave: every streamed layer reloads (the pool makes its chunks)."""
        if not self.lent:
            return {"event": "reclaim", "outcome": "noop", "phase": self.phase}
        before = self.held_bytes
        out = self.begin_revert((), reason="reclaim")
        if self.phase == "base":
            self.lent = False
        self._held()
        self._publish()
        return {**out, "event": "reclaim", "bytes": self.held_bytes - before, "held_bytes": self.held_bytes}

    def borrow(self, blocks: int) -> dict:
        """Grow the KV to ``blocks`` on memory the workers make now."""
        if self.phase != "base" or self.lent:
            raise ControlConflict(f"borrow: only an engine at its base (or borrowing) grows (phase {self.phase})")
        t0, st, before = time.perf_counter(), self.sched.state(), self.held_bytes
        blocks = min(int(blocks), st.max_blocks)
        if blocks <= st.visible:
            return {"event": "borrow", "outcome": "noop", "blocks": st.visible}
        self.operation = {"op": "borrow", "started": time.time(), "params": {"blocks": blocks}}
        try:
            self._transact("borrow", {"blocks": blocks},
                           lambda mapped: self.sched.grow(min(min(mapped), st.max_blocks) - st.visible))
        except Exception as exc:
            grown = self.sched.state().visible - st.visible
            if grown > 0:  # fresh blocks no step has used yet: hidden at once
                self.sched.begin_shrink(grown)
            return self._event("borrow", "failed", time.perf_counter() - t0, 0, blocks=blocks, error=repr(exc))
        finally:
            self.operation = None
        self._held()
        self._after_transition()
        return self._event("borrow", "ok", time.perf_counter() - t0, self.held_bytes - before, blocks_before=st.visible,
                           blocks_after=self.sched.state().visible, held_bytes=self.held_bytes)

    def repay(self, blocks: int | None = None) -> dict:
        """Shrink the KV to ``blocks`` (default the base): blocks in use drain as their requests finish,
        then the workers give the memory back to the host."""
        st = self.sched.state()
        target = st.base if blocks is None else int(blocks)
        if self.phase != "base" or self.lent:
            raise ControlConflict(f"repay: only a borrowing engine repays (phase {self.phase})")
        if not st.base <= target <= st.visible:
            raise ControlRequestError(f"repay: blocks must be in [{st.base}, {st.visible}] (base, now), got {target}")
        self.sched.begin_shrink(st.visible - target)
        self.phase, self._repay_to = "draining", target
        self._event("repay", "draining", 0.0, 0, blocks_target=target, draining=self.sched.state().draining)
        if self.sched.state().draining == 0:
            return self._finish_repay()
        return {"event": "repay", "outcome": "draining", "draining": self.sched.state().draining}

    def _finish_repay(self) -> dict:
        t0, target, before = time.perf_counter(), self._repay_to, self.held_bytes
        self.operation = {"op": "repay", "started": time.time(), "params": {"blocks": target}}
        try:
            self._transact("repay", {"blocks": target})
        except Exception as exc:
            self.phase, self._repay_to = "base", None
            self._regrow()
            self.backoff_until = time.monotonic() + _FAILURE_BACKOFF_S
            return self._event("repay", "failed", time.perf_counter() - t0, 0, error=repr(exc))
        finally:
            self.operation = None
        self.phase, self._repay_to = "base", None
        self._held()
        self._after_transition()
        return self._event("repay", "ok", time.perf_counter() - t0, before - self.held_bytes,
                           blocks_after=self.sched.state().visible, held_bytes=self.held_bytes)

    # -- pipeline groups (KunServe cluster drop) --------------------------------------------------------
    def group_join(self, params: dict) -> dict:
        """Join a pipeline group now (the engine is paused: the caller holds the lock). Every member
        is called at the same time; the workers meet at barriers over their stage links."""
        if not self.cfg.drop.group_member:
            raise ControlRequestError("group_join: this engine was not started as a group member "
                                      "(kunserve drop.group_member)")
        if self.phase not in ("base", "remapped"):
            raise ControlConflict(f"group_join: the engine is {self.phase}; only an engine at its base or remapped "
                                  f"can join")
        if self.lent or self.borrowed:
            raise ControlConflict("group_join: this engine has memory lent or borrowed (a multi-model fleet's); "
                                  "it joins once that is back")
        name, drop, spans, peers = (params.get(k) for k in ("name", "drop", "spans", "peers"))
        L = self.num_layers
        if not isinstance(name, str) or not name:
            raise ControlRequestError("group_join: 'name' must be a non-empty string")
        if not (isinstance(drop, list) and drop and all(isinstance(i, int) and 0 <= i < L for i in drop)
                and len(set(drop)) < L):
            raise ControlRequestError(f"group_join: 'drop' must list 1..{L - 1} layer indices in 0..{L - 1}")
        if not (_spans_ok(spans, L) and sorted(i for lo, hi, _ in spans for i in range(lo, hi)) == sorted(set(drop))):
            raise ControlRequestError("group_join: 'spans' must be [[lo, hi, peer], ...] covering exactly the dropped layers")
        if not _peers_ok(peers, spans, name):
            raise ControlRequestError("group_join: 'peers' must map each peer named in spans to {stage, blocks}")
        timeout = _number(params, "timeout_s", 120.0, 1.0, 3600.0, "group_join")
        transition = params.get("transition", "kv")
        if transition not in ("kv", "reprefill"):
            raise ControlRequestError(f"group_join: transition must be 'kv' or 'reprefill', got {transition!r}")
        t0 = time.perf_counter()
        recomputed = self.sched.recompute_all() if transition == "reprefill" else 0
        st = self.sched.state()
        held = self.sched.held_blocks()
        self.operation = {"op": "group_join", "started": time.time(), "params": {"name": name, "drop": drop}}
        try:
            self.faults.check("bookkeeping")
            outs = self._workers("kunserve_group_join", {**params, "timeout_s": timeout, "held": held,
                                                          "visible": st.visible,
                                                          "stage_bytes": self._stage_bytes()})
        except Exception as exc:  # each worker rolled its own transition back
            self.backoff_until = time.monotonic() + _FAILURE_BACKOFF_S
            self.operation = None
            self._event("group_join", "failed", time.perf_counter() - t0, 0, error=repr(exc), name=name)
            raise AgentError(f"group_join failed and was rolled back: {exc}") from exc
        self.operation = None
        own, peer_cap = self._grow_into_group(outs, st)
        dropped = set(drop)
        unstreamed = [i for i in self.remapped if i in dropped]   # a peer runs them now
        self.remapped = tuple(i for i in self.remapped if i not in dropped)
        self.slots = self.slots if self.remapped else 0
        self.group = {"name": name, "drop": sorted(set(drop)), "spans": spans,
                      "peers": {p: v["stage"] for p, v in peers.items()}, "since": time.time(),
                      "blocks": self.sched.state().visible}
        self.phase = "grouped"
        self._pipeline, self._pipeline_read_at = None, 0.0   # this group's hops from the first publish
        self._after_transition()
        return self._event("group_join", "ok", time.perf_counter() - t0, sum(o["bytes_sent"] for o in outs),
                           name=name, drop=sorted(set(drop)), transition=transition, recomputed=recomputed,
                           unstreamed=unstreamed or None, streamed=list(self.remapped) or None,
                           held_blocks=len(held), blocks_before=st.visible,
                           blocks_after=self.sched.state().visible, own_blocks=own, peer_blocks=peer_cap,
                           worker_s=round(max(o["seconds"] for o in outs), 4),
                           worker_ms=[o.get("ms") for o in outs])

    def group_restage(self, params: dict) -> dict:
        """Move into a larger group keeping every request's KV (a regroup; the engine is paused:
        the caller holds the lock). Every member of the regroup is called at the same time; the
        workers meet at barriers over their stage links. A failure before the KV moved rolls back on
        every member, one after it cannot: either way this member then abandons its group (its
        layers back from the host copies, every request recomputed), so no member runs a step with a
        layout its peers no longer have; the controller forms the group from lone engines instead.
        A lone engine merged with live groups (at its base) restages too, as it would join; on a
        failure its workers roll back and it recomputes its requests (what it sent may be freed).
        A member that drained for a step down (``group_leave`` ``begin`` with ``blocks``) restages
        into its smaller group the same way, its KV cut to the drained count first."""
        if not self.cfg.drop.group_member:
            raise ControlRequestError("group_restage: this engine was not started as a group member "
                                      "(kunserve drop.group_member)")
        if self.phase not in ("grouped", "base", "group_draining"):
            raise ControlConflict(f"group_restage: the engine is {self.phase}; only a grouped engine, or one at "
                                  f"its base merged with live groups, can restage")
        step = self.phase == "group_draining"   # a step down into a smaller group, drained to its block count
        if step and self.sched.state().draining:
            raise ControlConflict(f"group_restage: {self.sched.state().draining} blocks above the smaller group's "
                                  f"count are still in use")
        spans, peers, members, holders = (params.get(k) for k in ("spans", "peers", "members", "holders"))
        lone = self.phase == "base"
        L, name = self.num_layers, (params.get("name") if lone else self.group["name"])
        if not isinstance(name, str) or not name:
            raise ControlRequestError("group_restage: 'name' must be a non-empty string (this engine is not grouped)")
        old_peers = sorted(self.group["peers"]) if self.group else []
        if not (spans and _spans_ok(spans, L)):
            raise ControlRequestError("group_restage: 'spans' must be [[lo, hi, peer], ...] within the layers")
        drop = sorted(i for lo, hi, _ in spans for i in range(lo, hi))
        if len(drop) != len(set(drop)) or not 0 < len(drop) < L:
            raise ControlRequestError(f"group_restage: 'spans' must not overlap and must leave 1..{L - 1} layers here")
        if not _peers_ok(peers, spans, name):
            raise ControlRequestError("group_restage: 'peers' must map each peer named in spans to {stage, blocks}")
        if not (isinstance(members, dict) and all(isinstance(v, str) for v in members.values())
                and set(peers) | set(old_peers) <= set(members) | {name}):
            raise ControlRequestError("group_restage: 'members' must map every engine of the regroup (the old "
                                      "peers and the new) to its stage address")
        if not (isinstance(holders, dict) and all(
                isinstance(v, list) and sorted(i for lo, hi, _ in v for i in range(lo, hi)) == list(range(L))
                for v in holders.values()) and set(holders) >= set(members) | {name}):
            raise ControlRequestError("group_restage: 'holders' must give, for every member's requests, the "
                                      "holder of each layer (exactly once)")
        timeout = _number(params, "timeout_s", 120.0, 1.0, 3600.0, "group_restage")
        t0 = time.perf_counter()
        st = self.sched.state()
        held = self.sched.held_blocks()
        self.operation = {"op": "group_restage", "started": time.time(), "params": {"drop": drop}}
        try:
            self.faults.check("bookkeeping")
            outs = self._workers("kunserve_group_restage", {
                "name": name, "grouped": bool(params.get("grouped", not lone)), "spans": spans, "peers": peers,
                "members": {m: a for m, a in members.items() if m != name},
                "holders": holders, "held": held, "timeout_s": timeout, "stage_bytes": self._stage_bytes(),
                "restage_id": str(params.get("restage_id", "")), **({"kv_blocks": st.visible} if step else {})})
        except Exception as exc:
            self.operation = None
            self._event("group_restage", "failed", time.perf_counter() - t0, 0, error=repr(exc))
            if lone and params.get("grouped"):   # it abandoned its group before the call: recomputed then
                what = "had left its group already"
            elif lone:   # the workers rolled back; what they sent may already be freed there: recompute
                self._event("group_restage", "recomputed", 0.0, 0, recomputed=self.sched.recompute_all())
                what = "recomputed its requests"
            else:
                self.group_abandon(f"restage failed: {exc!r}"[:500])
                what = "abandoned its group (requests recomputed)"
            raise AgentError(f"group_restage failed; this member {what}: {exc}") from exc
        self.operation = None
        own, peer_cap = self._grow_into_group(outs, st)
        self.group = {**(self.group or {}), "name": name, "drop": drop, "spans": spans,
                      "peers": {p: v["stage"] for p, v in peers.items()}, "since": time.time(),
                      "blocks": self.sched.state().visible}
        self.phase = "grouped"
        self._pipeline, self._pipeline_read_at = None, 0.0
        self._after_transition()
        return self._event("group_restage", "ok", time.perf_counter() - t0, sum(o["bytes_sent"] for o in outs),
                           drop=drop, old_peers=old_peers, joined=lone or None, step=step or None,
                           peers=sorted(peers),
                           held_blocks=len(held),
                           blocks_before=st.visible, blocks_after=self.sched.state().visible, own_blocks=own,
                           peer_blocks=peer_cap, moved_regions=sum(o.get("moved_regions", 0) for o in outs),
                           worker_s=round(max(o["seconds"] for o in outs), 4),
                           worker_ms=[o.get("ms") for o in outs])

    def _grow_into_group(self, outs: list[dict], st: Any) -> tuple[int, int]:
        """After a join or restage: the scheduler grows to what every worker maps for this engine's
        requests and every peer can hold of them. Returns (own blocks, the peers' least)."""
        own = min(o["mapped_blocks"] for o in outs)
        peer_cap = min(min(o["peer_foreign"].values()) for o in outs)
        target = min(own, peer_cap, st.max_blocks)
        if target > st.visible:
            self.sched.grow(target - st.visible)
        return own, peer_cap

    def _stage_bytes(self) -> int:
        """Shared-memory buffer for one step's hidden states, residual and positions."""
        hidden = int(self.info.get("hidden_size", 0) or 8192)
        tokens = int(self.info.get("max_num_batched_tokens", 0) or 8192)
        return 2 * tokens * hidden * 4 + tokens * 8 + (1 << 16)

    def group_abandon(self, why: str) -> dict:
        """A group peer is gone mid-step: take every dropped layer back from the host copies, forget
        the peers' KV and recompute every request (its KV for the lost layers is gone). No request
        is lost: vLLM re-runs each from its prompt and the tokens it has already produced."""
        t0 = time.perf_counter()
        n = self.sched.recompute_all()
        self.sched.cancel_shrink()
        st = self.sched.state()
        if st.visible > st.base:
            self.sched.begin_shrink(st.visible - st.base)  # every block is free: hidden at once
        try:
            outs = self._workers("kunserve_group_leave", {"kv_blocks": st.base, "held": [], "abandon": True})
            self._pipeline = outs[0].get("hops") or self._pipeline
        except Exception as exc:  # the workers could not restore: this engine cannot serve
            self._error("group_abandon", exc)
            raise AgentError(f"group peer lost and the layers could not be restored: {exc}") from exc
        name, self.group = (self.group or {}).get("name"), None
        self._back_alone()
        return self._event("group_abandon", "ok", time.perf_counter() - t0, 0, name=name, recomputed=n,
                           reason=why, blocks_after=self.sched.state().visible)

    def _back_alone(self) -> None:
        """Out of a group: at the base, or remapped by the streamed layers it kept through the
        group (their memory is KV again: the scheduler grows into what the workers map)."""
        self.phase = "remapped" if self.remapped else "base"
        if self.remapped and not self.sched.state().draining:
            # up from what the leave (or abandon) left visible, never by cancelling the abandon's shrink
            # (that gives back the group's count, above what is mapped now). Blocks still draining there:
            # it stays at what is visible (a later remap grows it)
            self._grow_to_mapped()
        self._after_transition()

    def is_grouped(self) -> bool:
        """Whether this engine runs as a pipeline group member now (the group scheduler's switch)."""
        return self.phase == "grouped"

    def group_pace(self, wanted: list | None = None) -> list | None:
        """While grouped (not draining), the peers' latest and wanted step chunks for the group
        scheduler (``integration.vllm.scheduler``), else None: alone the scheduler is vLLM's own.
        ``wanted`` (this member's wanted step) is handed to the worker, which sends it with its
        spans. A failed read paces nothing (the step is scheduled as vLLM would)."""
        if self.phase != "grouped":
            return None
        try:
            return self._workers("kunserve_group_pace", wanted)[0] or None
        except Exception as exc:  # the step must not fail for pacing; the span call reports peers lost
            logger.debug("group pace unavailable: %r", exc)
            return None

    def group_leave_begin(self, params: dict | None = None) -> dict:
        """Retire the blocks above the base (a leave), or above ``blocks`` (a step down into a
        smaller group: its block count there, which ``group_restage`` then keeps), draining live ones."""
        if self.phase != "grouped":
            return {"event": "group_leave", "outcome": "noop", "phase": self.phase}
        st = self.sched.state()
        target = st.base
        if (params or {}).get("blocks") is not None:
            target = _int(params, "blocks", st.base, st.base, st.visible)
        self.sched.begin_shrink(st.visible - target)
        self.phase = "group_draining"
        return self._event("group_leave", "draining", 0.0, 0, blocks_target=target,
                           step=target != st.base or None, draining=self.sched.state().draining)

    def group_leave_finish(self, params: dict) -> dict:
        if self.phase != "group_draining":
            raise ControlConflict(f"group_leave finish: the engine is {self.phase} (begin first)")
        st = self.sched.state()
        if st.draining:
            raise ControlConflict(f"group_leave finish: {st.draining} blocks above the base are still in use")
        if st.visible != st.base:
            raise ControlConflict(f"group_leave finish: drained to {st.visible} blocks for a smaller group, not to "
                                  f"the base {st.base} (that step is group_restage)")
        t0 = time.perf_counter()
        held = self.sched.held_blocks(st.visible)
        timeout = _number(params, "timeout_s", 120.0, 1.0, 3600.0, "group_leave")
        source = params.get("source", self.cfg.restore.source)
        if source not in ("auto", "peer", "host"):
            raise ControlRequestError(f"group_leave: source {source!r}: one of auto, peer, host")
        source = "peer" if source == "auto" else source   # a group always has a peer
        self.operation = {"op": "group_leave", "started": time.time(), "params": {"source": source}}
        try:
            outs = self._workers("kunserve_group_leave", {"kv_blocks": st.visible, "held": held, "timeout_s": timeout,
                                                          "source": source, "leave_id": params.get("leave_id")})
        except Exception as exc:
            self.backoff_until = time.monotonic() + _FAILURE_BACKOFF_S
            self.phase = "grouped"
            self.sched.cancel_shrink()
            self.sched.grow(self.group["blocks"] - self.sched.state().visible)
            self._event("group_leave", "failed", time.perf_counter() - t0, 0, error=repr(exc))
            raise AgentError(f"group_leave failed and was rolled back (still grouped): {exc}") from exc
        finally:
            self.operation = None
        name, self.group = self.group["name"], None
        self._pipeline = outs[0].get("hops") or self._pipeline   # the whole group's hops, for the state
        self._back_alone()
        rs = [o.get("restore") or {} for o in outs]
        return self._event("group_leave", "ok", time.perf_counter() - t0, sum(o["bytes_sent"] for o in outs),
                           name=name, held_blocks=len(held), blocks_after=self.sched.state().visible,
                           worker_s=round(max(o["seconds"] for o in outs), 4), source=source,
                           layers_from_peer=sum(r.get("peer_layers", 0) for r in rs),
                           layers_from_host=sum(r.get("host_layers", 0) for r in rs),
                           weight_bytes_from_peer=sum(r.get("peer_bytes", 0) for r in rs),
                           peer_errors=[e for r in rs for e in r.get("peer_errors", [])] or None,
                           pipeline=outs[0].get("hops"))   # rank 0's hops while grouped (HopTimes)

    # -- invariants -------------------------------------------------------------------------------------
    def invariant_problems(self) -> list[str]:
        """The scheduler never uses a block a worker has not mapped; after a grow it uses all of
        them (up to the planned maximum); every worker streams the layers the agent expects and
        its own residency checks pass."""
        st = self.sched.state()
        workers = self._workers("kunserve_check")
        problems = []
        for rank, w in enumerate(workers):
            if w["mapped_blocks"] < st.visible:
                problems.append(f"worker {rank} maps {w['mapped_blocks']} blocks, the scheduler uses {st.visible}")
            if list(w["remapped_layers"]) != list(self.remapped):
                problems.append(f"worker {rank} streams {w['remapped_layers']}, the agent expects {list(self.remapped)}")
            problems += [f"worker {rank}: {p}" for p in w["problems"]]
        low = min(min(w["mapped_blocks"] for w in workers), st.max_blocks)
        if self.phase == "remapped" and st.draining == 0 and low != st.visible:
            problems.append(f"the scheduler uses {st.visible} blocks, the workers map {low}")
        return problems

    def _after_transition(self) -> None:
        problems = self.invariant_problems()
        self._publish()
        if problems:
            self._error("invariants", AgentError("; ".join(problems)))

    # -- events, metrics, published state ---------------------------------------------------------------
    def _event(self, kind: str, outcome: str, seconds: float, nbytes: int, **extra) -> dict:
        ev = {"event": kind, "outcome": outcome, "ms": round(seconds * 1e3, 3), "bytes": int(nbytes),
              "time": time.time(), **{k: v for k, v in extra.items() if v is not None}}
        self.events.append(ev)
        del self.events[:-100]
        if self.m:
            self.m["events"].labels(self.label, kind, outcome).inc()
            self.m["event_seconds"].labels(self.label, kind).observe(seconds)
            if nbytes:
                self.m["event_bytes"].labels(self.label, kind).inc(nbytes)
        (logger.warning if outcome == "failed" else logger.info)("kunserve %s %s: %s", kind, outcome, ev)
        self._publish()
        return ev

    def _pipeline_times(self) -> dict | None:
        """While grouped, where this engine's hops spend their time (rank 0's ``HopTimes``), read
        from the worker at most every ``_PIPELINE_READ_S`` (a worker call); the last group's after
        it left, None before any group."""
        if self.group is not None and time.monotonic() - self._pipeline_read_at >= _PIPELINE_READ_S:
            self._pipeline_read_at = time.monotonic()
            try:
                self._pipeline = self._workers("kunserve_group_state")[0].get("hop_times")
            except Exception as exc:  # a report, never a reason to fail the step that publishes
                logger.debug("group state unavailable: %r", exc)
        return self._pipeline

    def _publish(self) -> None:
        self._published_at = time.monotonic()
        st = self.sched.state()
        used, queued, growth = self.sched.demand()
        waiting, running = self.sched.requests()
        prefill, decode = self.sched.pending_tokens()
        mix_prompt, mix_output = self.sched.request_mix()
        dropped = set(self.group["drop"]) if self.group else set()
        layers = ["streamed" if i in self.remapped else "dropped" if i in dropped else "resident"
                  for i in range(self.num_layers)]
        self._state = EngineState(
            engine=EngineInfo.of({"label": self.label, "pid": os.getpid(), **self.info}),
            phase=self.phase, operation=self.operation, auto=self.auto, errors=self.errors,
            capacity=Capacity(blocks_total=st.visible, blocks_base=st.base, blocks_max=st.max_blocks,
                              block_size=self.sched.block_size, block_bytes=self.block_bytes),
            blocks=Blocks(used=used, free=st.free, queued=queued, demand=used + queued + growth, draining=st.draining),
            requests=Requests(waiting=waiting, running=running, prefill_tokens=prefill, decode_tokens=decode,
                              mix_prompt_tokens=mix_prompt, mix_output_tokens=mix_output),
            layers=tuple(Layer(i, s, self.layer_bytes_each[i]) for i, s in enumerate(layers)),
            remapped_layers=tuple(self.remapped), slots=self.slots,
            dropped_layers=tuple(sorted(dropped)), group=self.group, pipeline=self._pipeline_times(),
            h2d_bytes_per_s=self.h2d_bytes_per_s, copy_overlap=self.copy_overlap,
            remap_room_bytes=self.remap_room_bytes(),
            tenancy=self.state_tenancy(),
            events=tuple(self.events[-20:]),
        ).to_dict()
        if self.m:
            self.m["remapped_layers"].labels(self.label).set(len(self.remapped))
            self.m["kv_blocks_total"].labels(self.label).set(st.visible)
            self.m["kv_blocks_base"].labels(self.label).set(st.base)

    # -- operations (collective_rpc and the control port) -----------------------------------------------
    def call(self, op: str, params: dict) -> dict:
        """Run a control operation now (the caller holds ``self.lock``)."""
        if op == "remap":
            layers = params.get("layers")
            slots = _int(params, "slots", self.slots or 1, lo=1, hi=2)
            if layers is None:
                alpha = _int(params, "alpha", 1, lo=1, hi=self.num_layers - 2)
                layers = (self._extend(alpha + self.slots) if self.remapped
                          else list(spaced_layers(self.num_layers, alpha + slots)))
            elif not isinstance(layers, list) or not all(isinstance(i, int) and 0 <= i < self.num_layers
                                                         for i in layers) or not layers:
                raise ControlRequestError(f"remap: layers must be a non-empty list of layer indices "
                                          f"0..{self.num_layers - 1}, got {layers!r}")
            if self.remapped and not set(self.remapped) <= set(layers):
                raise ControlRequestError(f"remap: layers {sorted(layers)} must include the streamed {list(self.remapped)}")
            if len(set(layers)) >= self.num_layers or slots > len(set(layers)):
                raise ControlRequestError(f"remap: {len(set(layers))} layers with {slots} slot(s) is not possible "
                                          f"on a {self.num_layers}-layer model")
            return self.remap(sorted(set(layers)), self.slots or slots, reason="forced")
        if op == "revert":
            if self.lent:
                raise ControlConflict("revert: this engine lent its layers' memory; reclaim takes it back")
            return self.begin_revert((), reason="forced")
        if op == "lend":
            slots = _int(params, "slots", 1, lo=1, hi=2)
            layers = params.get("layers")
            if layers is None:
                alpha = _int(params, "alpha", 1, lo=1, hi=self.num_layers - 1 - slots)
                layers = list(spaced_layers(self.num_layers, alpha + slots))
            elif (not isinstance(layers, list) or not layers or len(set(layers)) >= self.num_layers
                  or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_layers for i in layers)
                  or slots > len(set(layers))):
                raise ControlRequestError(f"lend: layers must be 1..{self.num_layers - 1} layer indices 0.."
                                          f"{self.num_layers - 1} (at least the slots), got {layers!r}")
            return self.lend(sorted(set(layers)), slots)
        if op == "reclaim":
            return self.reclaim()
        if op == "borrow":
            return self.borrow(_int(params, "blocks", 0, lo=1, hi=1 << 30))
        if op == "repay":
            return self.repay(None if params.get("blocks") is None else _int(params, "blocks", 0, lo=0, hi=1 << 30))
        if op == "auto":
            if not isinstance(params.get("enable"), bool):
                raise ControlRequestError(f"auto: 'enable' must be true or false, got {params.get('enable')!r}")
            self.auto = params["enable"]
            self._publish()
            return {"auto": self.auto}
        if op == "inject_fault":
            return self.inject_fault(params)
        if op == "check":
            return {"problems": self.invariant_problems()}
        if op == "group_join":
            return self.group_join(params)
        if op == "group_leave":
            step = params.get("step")
            if step == "begin":
                return self.group_leave_begin(params)
            if step == "finish":
                return self.group_leave_finish(params)
            if step == "abandon":  # the group did not form everywhere (or a peer is gone): alone again now
                if self.phase not in ("grouped", "group_draining"):
                    return {"event": "group_leave", "outcome": "noop", "phase": self.phase}
                why = params.get("reason", "abandoned by the controller")
                return self.group_abandon(why if isinstance(why, str) else repr(why))
            raise ControlRequestError(f"group_leave: step must be 'begin', 'finish' or 'abandon', got {step!r}")
        if op == "group_restage":
            return self.group_restage(params)
        if op == "group_ping":
            if not isinstance(params.get("stage"), str):
                raise ControlRequestError("group_ping: 'stage' must be a stage address string")
            return self._workers("kunserve_group_ping", params["stage"], _int(params, "bytes", 16384, 1, 1 << 30))[0]
        if op in MIGRATION_OPERATIONS:
            if self.group is not None or self.phase in ("grouped", "group_draining"):
                # the KV of a request here is spread over the group (each member holds its layers' share);
                # this engine's regions of the layers it dropped are unmapped: no export or import reads them
                raise ControlConflict(f"{op}: this engine is a pipeline-group member ({self.phase}); its requests' KV "
                                      f"is spread over the group, so no KV moves in or out until it leaves")
            return self.kv_migration().call(op, params)
        raise ControlRequestError(f"unknown operation {op!r}; known: {', '.join(OPERATIONS)}")

    def kv_migration(self) -> KVMigration:
        """The KV migration operations (``engine.migration``), made on first use."""
        mig = self.__dict__.get("_kv_migration")
        if mig is None:
            mig = self._kv_migration = KVMigration(self.sched, self._workers, self.control_submit, self._event,
                                                   self.info, self.label)
        return mig

    def inject_fault(self, params: dict) -> dict:
        step = params.get("step")
        after = _int(params, "after", 0, lo=0, hi=1000)
        if step == "clear":  # disarm every fault not fired yet, here and in the workers
            self.faults.disarm()
            return {"armed": None, "where": "everywhere", "workers": self._workers("kunserve_inject_fault", "clear")}
        if step in AGENT_FAULTS:
            self.faults.arm(step, after)
            return {"armed": step, "where": "agent"}
        if not isinstance(step, str) or not step:
            raise ControlRequestError(f"inject_fault: step must be a string, got {step!r}")
        rank = params.get("rank")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
            raise ControlRequestError(f"inject_fault: rank must be an integer, got {rank!r}")
        delay = _number(params, "delay_s", 0.0, 0.0, 600.0, "inject_fault")
        out = self._workers("kunserve_inject_fault", step, after, rank, delay)
        return {"armed": step, "where": "workers", "workers": out, "delay_s": delay}

    # -- ControlHandler (engine.control) ---------------------------------------------------------------
    def control_state(self) -> dict:
        return self._state

    def control_operations(self) -> dict[str, str]:
        return dict(OPERATIONS)

    def control_submit(self, op: str, params: dict, timeout_s: float) -> dict:
        if op not in OPERATIONS:
            raise ControlRequestError(f"unknown operation {op!r}; known: {', '.join(OPERATIONS)}")
        with self._ops_done:
            self._waiting_ops += 1
        try:
            if self.wake is not None:
                self.wake()
            if not self.lock.acquire(timeout=timeout_s):
                raise TimeoutError(f"{op}: the engine did not reach a step boundary within {timeout_s:.0f} s")
            try:
                if self.operation is not None:
                    raise ControlConflict(f"{self.operation['op']} is in progress")
                out = self.call(op, params)
                self._publish()
                return out
            finally:
                self.lock.release()
        finally:
            with self._ops_done:
                self._waiting_ops -= 1
                self._ops_done.notify_all()


def _spans_ok(spans: Any, num_layers: int) -> bool:
    """``spans`` is ``[[lo, hi, peer], ...]`` with ``0 <= lo < hi <= num_layers``."""
    return isinstance(spans, list) and all(
        isinstance(s, list) and len(s) == 3 and isinstance(s[0], int) and isinstance(s[1], int)
        and isinstance(s[2], str) and 0 <= s[0] < s[1] <= num_layers for s in spans)


def _peers_ok(peers: Any, spans: list, name: str) -> bool:
    """``peers`` maps every peer the spans name (never this member, ``name``) to {stage, blocks}."""
    return (isinstance(peers, dict) and bool(peers)
            and all(isinstance(v, dict) and isinstance(v.get("stage"), str) and isinstance(v.get("blocks"), int)
                    for v in peers.values())
            and {p for _, _, p in spans} <= set(peers) and name not in peers)


def _int(params: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = params.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ControlRequestError(f"'{key}' must be an integer in [{lo}, {hi}], got {v!r}")
    return v
