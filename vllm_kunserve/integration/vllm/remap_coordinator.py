"""Engine-core side of Oneiros remap: watch KV demand each step, decide with the policy, execute on
the workers, and keep the scheduler's block pool in step with what the workers mapped.

Order of operations keeps the two sides consistent (a step never sees a block that is not mapped
on every worker): remap = workers map first, then the scheduler un-hides blocks; revert = the
scheduler retires blocks first (draining live ones), then the workers unmap and reload weights.
All of it runs between engine steps (``EngineCore.step`` calls :meth:`tick` before scheduling).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

from vllm_kunserve.integration.vllm import metrics
from vllm_kunserve.integration.vllm.block_capacity import BlockCapacity
from vllm_kunserve.policy.remap import ModelLayers, RemapInput, RemapState, decide_remap, spaced_layers

logger = logging.getLogger("vllm.kunserve")

#: methods handled by the engine core itself when called through ``collective_rpc``
ENGINE_METHODS = ("kunserve_state", "kunserve_remap", "kunserve_revert", "kunserve_inject_fault",
                  "kunserve_auto")

_FAILURE_BACKOFF_S = 5.0


class RemapCoordinator:
    def __init__(self, core: Any, cfg: Any, base_blocks: int) -> None:
        self.core = core
        self.cfg = cfg
        sched = core.scheduler
        self.pool = sched.kv_cache_manager.block_pool
        self.block_size = int(core.vllm_config.cache_config.block_size)
        self.cap = BlockCapacity(self.pool, base_blocks, core.vllm_config.cache_config)
        orig_free = self.pool.free_blocks

        def free_blocks(ordered_blocks):
            blocks = list(ordered_blocks)
            orig_free(blocks)
            self.cap.on_freed(blocks)
        self.pool.free_blocks = free_blocks  # instance attribute: this engine's pool only

        states = self._workers("kunserve_memory_state")
        self.num_layers = states[0]["num_layers"]
        self.layer_bytes = max(max(s["layer_bytes"]) for s in states)
        self.chunk_bytes = states[0]["chunk_bytes"]
        self.block_bytes = max(s["block_bytes"] for s in states)
        bw = cfg.remap.h2d_bandwidth_gbps * 1e9 if cfg.remap.h2d_bandwidth_gbps else min(
            s["h2d_bytes_per_s"] for s in states)
        self.h2d_bytes_per_s = bw
        self.copy_overlap = all(s.get("copy_overlap", True) for s in states)
        self.phase = "base"          # base | remapped | draining
        self.remapped: tuple[int, ...] = ()
        self.slots = 0
        self.auto = True
        self.policy_state = RemapState()
        self.step_ms: deque[float] = deque(maxlen=64)
        self.backoff_until = 0.0
        self.events: list[dict] = []
        self._revert_reason = "idle"
        self.engine_label = str(getattr(core.vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        self.m = metrics.get()
        self._publish()
        logger.info("kunserve remap ready: %d layers of %.1f MB, KV base %d blocks (max %d), "
                    "host link %.1f GB/s, copies %s", self.num_layers, self.layer_bytes / 1e6, base_blocks,
                    self.cap.max_blocks, bw / 1e9, "overlap compute" if self.copy_overlap else "inline")

    # -- helpers --------------------------------------------------------------------------------
    def _workers(self, method: str, *args, **kwargs) -> list:
        return self.core.model_executor.collective_rpc(method, args=args, kwargs=kwargs)

    def _publish(self) -> None:
        lbl = self.engine_label
        self.m["remapped_layers"].labels(lbl).set(len(self.remapped))
        self.m["kv_blocks_total"].labels(lbl).set(self.cap.visible)
        self.m["kv_blocks_base"].labels(lbl).set(self.cap.base)

    def _event(self, kind: str, outcome: str, seconds: float, nbytes: int, **extra) -> dict:
        ev = {"event": kind, "outcome": outcome, "ms": round(seconds * 1e3, 3), "bytes": int(nbytes),
              "time": time.time(), **extra}
        self.events.append(ev)
        del self.events[:-100]
        self.m["events"].labels(self.engine_label, kind, outcome).inc()
        self.m["event_seconds"].labels(self.engine_label, kind).observe(seconds)
        if nbytes:
            self.m["event_bytes"].labels(self.engine_label, kind).inc(nbytes)
        (logger.warning if outcome != "ok" else logger.info)("kunserve %s %s: %s", kind, outcome, ev)
        return ev

    def demand_blocks(self) -> tuple[int, int]:
        """(used, demand): blocks used now; demand adds what queued requests need to start and what
        running and queued requests will need for their next ``remap.growth_tokens`` outputs."""
        sched = self.core.scheduler
        st = self.cap.state()
        bs, horizon = self.block_size, self.cfg.remap.growth_tokens

        def ahead(r) -> int:
            max_tokens = getattr(r, "max_tokens", None) or horizon
            left = max(0, max_tokens - getattr(r, "num_output_tokens", 0))
            return r.num_tokens + min(left, horizon)

        queued = sum(-(-ahead(r) // bs) for r in sched.waiting)
        growth = sum(max(0, -(-ahead(r) // bs) - -(-r.num_tokens // bs)) for r in sched.running)
        return st.used, st.used + queued + growth

    def note_step(self, ms: float) -> None:
        self.step_ms.append(ms)

    def on_idle(self) -> None:
        """The engine ran out of requests: tick now, and keep ticking while idle until reverted.

        An idle ``EngineCoreProc`` blocks on its input queue and never steps, so a timer thread
        queues an idle callback (run by the engine thread, like every other tick) and a WAKEUP.
        """
        self.tick()
        if self.phase == "base" or not self.auto:
            return
        queue_ = getattr(self.core, "input_queue", None)
        callbacks = getattr(self.core, "_idle_state_callbacks", None)
        if queue_ is None or callbacks is None or getattr(self, "_idle_timer", None) is not None:
            return
        import threading

        from vllm.v1.engine import EngineCoreRequestType

        def fire() -> None:
            self._idle_timer = None
            callbacks.append(lambda core: self.on_idle() if core.scheduler.get_num_unfinished_requests() == 0 else None)
            queue_.put_nowait((EngineCoreRequestType.WAKEUP, None))

        self._idle_timer = threading.Timer(max(0.05, self.cfg.remap.revert_hold_s / 4), fire)
        self._idle_timer.daemon = True
        self._idle_timer.start()

    # -- the per-step control loop ----------------------------------------------------------------
    def tick(self) -> None:
        if self.phase == "draining":
            if self.cap.state().draining == 0:
                self._finish_revert()
            else:
                used, demand = self.demand_blocks()
                if demand > self.cfg.remap.high_watermark * (self.cap.base - 1):
                    n = self.cap.cancel_shrink()
                    self.phase = "remapped"
                    self._event("revert", "cancelled", 0.0, 0, blocks_returned=n)
                    self._publish()
            return
        if not self.auto or time.monotonic() < self.backoff_until:
            return
        used, demand = self.demand_blocks()
        capacity = self.cap.visible - 1
        shortage = max(0.0, demand - self.cfg.remap.high_watermark * capacity)
        sorted_ms = sorted(self.step_ms)
        step_ms = sorted_ms[len(sorted_ms) // 2] if sorted_ms else 10.0
        per_layer_ms = max(1e-3, step_ms / self.num_layers)
        alpha_now = max(0, len(self.remapped) - self.slots)
        model = ModelLayers("self", self.num_layers, self.layer_bytes, per_layer_ms, per_layer_ms,
                            active=True, remapped_alpha=alpha_now, slots=self.slots)
        free_blocks = self.cap.state().free
        inp = RemapInput((model,), self.h2d_bytes_per_s,
                         kv_shortage_bytes=shortage * self.block_bytes,
                         kv_free_bytes=max(0, capacity - demand - (self.cap.visible - self.cap.base)) * self.block_bytes
                         if self.phase == "remapped" else free_blocks * self.block_bytes,
                         demand_ratio=demand / max(1, self.cap.base - 1), now_s=time.monotonic(),
                         copy_overlap=self.copy_overlap)
        plan, self.policy_state = decide_remap(inp, self.cfg.remap, self.policy_state)
        if plan.action == "remap":
            target = plan.models[0]
            if self.phase == "base":
                self.remap(list(target.layers), target.slots, reason="overload")
            elif self.phase == "remapped" and target.alpha > alpha_now:
                self.remap(self._extend(target.alpha + self.slots), self.slots, reason="overload")
        elif plan.action == "revert" and self.phase == "remapped" and all(m.alpha == 0 for m in plan.models):
            self.begin_revert(reason="idle")

    # -- operations --------------------------------------------------------------------------------
    def _extend(self, m: int) -> list[int]:
        """``m`` layers including the remapped ones, the rest spread over the largest gaps."""
        chosen = set(self.remapped)
        while len(chosen) < min(m, self.num_layers - 1):
            free = [i for i in range(self.num_layers) if i not in chosen]
            # the free layer farthest (circularly) from every chosen one
            def dist(i: int) -> int:
                return min(min(abs(i - c), self.num_layers - abs(i - c)) for c in chosen)
            chosen.add(max(free, key=lambda i: (dist(i), -i)))
        return sorted(chosen)

    def remap(self, layers: list[int], slots: int, reason: str = "forced") -> dict:
        if self.phase == "draining":
            raise RuntimeError("cannot remap while a revert is draining")
        t0 = time.perf_counter()
        before = self.cap.visible
        try:
            mapped = self._workers("kunserve_remap", list(layers), int(slots))
        except Exception as exc:
            # the failing worker rolled itself back; from the base state make sure every worker is
            # back at base (from a remapped state the scheduler uses the grown blocks: leave them)
            if self.phase == "base":
                try:
                    self._workers("kunserve_revert")
                except Exception:
                    logger.exception("kunserve: reverting workers after a failed remap also failed")
            self.backoff_until = time.monotonic() + _FAILURE_BACKOFF_S
            return self._event("remap", "failed", time.perf_counter() - t0, 0, layers=list(layers),
                               reason=reason, error=str(exc), blocks=before)
        new_visible = min(min(mapped), self.cap.max_blocks)
        self.cap.grow(new_visible - self.cap.visible)
        self.remapped, self.slots, self.phase = tuple(sorted(layers)), int(slots), "remapped"
        self._publish()
        return self._event("remap", "ok", time.perf_counter() - t0, len(layers) * self.layer_bytes,
                           layers=list(self.remapped), slots=self.slots, reason=reason,
                           blocks_before=before, blocks_after=self.cap.visible)

    def begin_revert(self, reason: str = "forced") -> dict:
        if self.phase != "remapped":
            return {"event": "revert", "outcome": "noop", "phase": self.phase}
        self.cap.begin_shrink(self.cap.visible - self.cap.base)
        self.phase = "draining"
        self._revert_reason = reason
        self._publish()
        if self.cap.state().draining == 0:
            return self._finish_revert()
        return {"event": "revert", "outcome": "draining", "draining": self.cap.state().draining}

    def _finish_revert(self) -> dict:
        t0 = time.perf_counter()
        layers = list(self.remapped)
        try:
            self._workers("kunserve_revert")
        except Exception as exc:
            # workers keep streaming; scheduler stays at base capacity, which is always safe
            self.phase = "remapped"
            self.cap.cancel_shrink()
            self.backoff_until = time.monotonic() + _FAILURE_BACKOFF_S
            self._publish()
            return self._event("revert", "failed", time.perf_counter() - t0, 0, error=str(exc))
        self.remapped, self.slots, self.phase = (), 0, "base"
        self._publish()
        return self._event("revert", "ok", time.perf_counter() - t0, len(layers) * self.layer_bytes,
                           layers=layers, reason=self._revert_reason,
                           blocks_after=self.cap.visible)

    # -- control API (collective_rpc on the engine) -------------------------------------------------
    def call(self, method: str, *args, **kwargs) -> Any:
        if method == "kunserve_state":
            st = self.cap.state()
            used, demand = self.demand_blocks()
            return {"pid": os.getpid(), "phase": self.phase, "remapped_layers": list(self.remapped),
                    "slots": self.slots, "kv_blocks_total": st.visible, "kv_blocks_base": st.base,
                    "kv_blocks_max": st.max_blocks, "free_blocks": st.free, "draining": st.draining,
                    "used_blocks": used, "demand_blocks": demand, "auto": self.auto,
                    "num_layers": self.num_layers, "layer_bytes": self.layer_bytes,
                    "h2d_bytes_per_s": self.h2d_bytes_per_s, "copy_overlap": self.copy_overlap,
                    "events": list(self.events[-20:]),
                    "workers": self._workers("kunserve_memory_state")}
        if method == "kunserve_remap":
            alpha = int(kwargs.get("alpha", args[0] if args else 1))
            slots = int(kwargs.get("slots", args[1] if len(args) > 1 else 1))
            layers = kwargs.get("layers") or (
                self._extend(alpha + self.slots) if self.remapped else list(spaced_layers(self.num_layers, alpha + slots)))
            return self.remap(layers, self.slots or slots, reason="forced")
        if method == "kunserve_revert":
            return self.begin_revert(reason="forced")
        if method == "kunserve_inject_fault":
            return self._workers("kunserve_inject_fault", *args, **kwargs)
        if method == "kunserve_auto":
            self.auto = bool(args[0] if args else kwargs.get("enable", True))
            return {"auto": self.auto}
        raise ValueError(f"unknown kunserve engine method {method!r}; known: {', '.join(ENGINE_METHODS)}")

