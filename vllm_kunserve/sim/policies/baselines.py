"""KV-centric baselines: vLLM (recompute), InferCept-like swap, Llumnix-like migration, the oracle."""

from __future__ import annotations

from .base import DEFAULT_DISPATCH, Policy


class VllmPolicy(Policy):
    """Stock vLLM: preempt the newest running request and recompute it later."""

    name = "vllm"


class OraclePolicy(Policy):
    """Infinite KV memory: never preempts, never queues for memory (the TTFT bound)."""

    name = "oracle"
    infinite_memory = True


class InferceptPolicy(Policy):
    """InferCept-like: preempted requests' KV is swapped to host memory over PCIe and swapped back
    in instead of being recomputed (the copy time stalls the step that does it)."""

    name = "infercept"
    preempt_mode = "swap"


class LlumnixPolicy(Policy):
    """Llumnix-like load balancing: load-aware dispatch plus periodic live migration of the newest
    running requests from the instance with the highest KV demand to the one with the most free
    blocks (KV copied over the instance link, overlapped with decoding; the request pauses for the
    final copy only)."""

    name = "llumnix"

    def __init__(self, dispatch: str = DEFAULT_DISPATCH, tick_s: float = 0.1, gap: float = 0.1,
                 max_per_tick: int = 4, downtime_share: float = 0.1):
        super().__init__(dispatch)
        self.tick_s = tick_s
        self.gap = gap
        self.max_per_tick = max_per_tick
        self.downtime_share = downtime_share

    def on_tick(self, sim) -> None:
        live = [s for s in sim.servers if s.alive and not s.frozen]
        if len(live) < 2:
            return
        for _ in range(self.max_per_tick):
            src = max(live, key=lambda s: s.load())
            dst = min(live, key=lambda s: s.load())
            if src.load() - dst.load() < self.gap:
                return
            cand = [r for r in reversed(src.running) if not any(r is x for x, _ in src.inflight)]
            movable = [r for r in cand if r.blocks + 1 <= dst.free]
            if src.waiting and (not movable or src.load() > 1.0):
                # queued requests hold no KV: re-dispatch the newest one for free
                r = src.waiting.pop()
                r.server = dst
                dst.waiting.append(r)
                sim.kick(dst)
                continue
            if not movable:
                return
            r = movable[0]
            src.running.remove(r)
            src.used -= r.blocks
            dst.used += r.blocks
            dst.running.append(r)
            r.server = dst
            r.migrations += 1
            copy = sim.server_bulk_time(src, r.blocks * sim.cfg.block_bytes)
            dst.pending_io += copy * self.downtime_share
            sim.log("migrate", req=r.id, src=src.sid, dst=dst.sid, blocks=r.blocks, copy_s=round(copy, 6))
            sim.kick(src)
            sim.kick(dst)
