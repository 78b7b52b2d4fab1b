"""Policy base: dispatch and the hooks the engine calls."""

from __future__ import annotations

import itertools

DISPATCH = ("least-work", "least-load", "round-robin")
DEFAULT_DISPATCH = "least-work"  # queue-aware: what a serving engineer deploys; same for every policy


def queued_work(s) -> int:
    """Prefill tokens a server still has to compute before a new arrival's prefill is done:
    waiting requests' tokens plus the unfinished prefill of running ones."""
    return sum(r.need for r in s.waiting) + sum(r.need for r in s.running if r.need > 1)


class Policy:
    name = "base"
    preempt_mode = "recompute"   # what the server does when a running request needs a block
    infinite_memory = False
    tick_s: float | None = None  # period of on_tick (None: no monitor)

    def __init__(self, dispatch: str = DEFAULT_DISPATCH):
        if dispatch not in DISPATCH:
            raise ValueError(f"dispatch {dispatch!r}: one of {', '.join(DISPATCH)}")
        self.dispatch_mode = dispatch
        self._rr = itertools.count()

    def dispatch(self, sim, req):
        live = [s for s in sim.servers if s.alive and not s.frozen] or sim.servers
        if self.dispatch_mode == "round-robin":
            return live[next(self._rr) % len(live)]
        if self.dispatch_mode == "least-work":
            # queue-aware: among servers whose memory takes the prompt, the least queued prefill per
            # instance of compute (a pipeline group of k has k GPUs); else the least memory share
            def key(s):
                fits = s.demand_blocks() + s.blocks_for(req.prompt) <= s.capacity
                return (not fits, queued_work(s) / s.k if fits else s.load(), s.load(), s.sid)
            return min(live, key=key)
        # least-load: KV demand (used + queued blocks) as a share of capacity, blind to compute
        return min(live, key=lambda s: (s.load(), len(s.running) + len(s.waiting), s.sid))

    def on_tick(self, sim) -> None:
        pass

    def describe(self) -> dict:
        return {"name": self.name, "preempt": self.preempt_mode, "dispatch": self.dispatch_mode}


def move_request(sim, r, src, dst, downtime_share: float = 0.1, kind: str = "migrate") -> bool:
    """Move ``r`` from ``src`` to ``dst`` at a step boundary. A queued request moves for free; a
    running one keeps its KV, copied over the instance link while it keeps decoding, so only the
    final share of the copy (``downtime_share``) stalls the destination. False if impossible."""
    if src is dst or not dst.alive or any(r is x for x, _ in src.inflight):
        return False
    if r in src.waiting:
        src.waiting.remove(r)
        dst.waiting.append(r)
    elif r in src.running:
        if r.blocks + 1 > dst.free:
            return False
        src.running.remove(r)
        src.used -= r.blocks
        dst.used += r.blocks
        dst.running.append(r)
        copy = sim.cfg.link.time(r.blocks * sim.cfg.block_bytes)
        dst.pending_io += copy * downtime_share
        r.migrations += 1
        sim.log(kind, req=r.id, src=src.sid, dst=dst.sid, blocks=r.blocks, copy_s=round(copy, 6))
    else:
        return False
    r.server = dst
    sim.kick(src)
    sim.kick(dst)
    return True
