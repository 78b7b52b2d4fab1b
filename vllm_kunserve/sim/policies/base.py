"""Policy base: the hooks the simulator calls, each with its default (stock vLLM behaviour).

Dispatch is ``policy.dispatch.choose_instance`` over the servers' :class:`InstanceLoad` snapshots
(``sim.adapters.instance_loads``); a policy overrides :meth:`Policy.dispatch` only to place requests
its own way (MELL).
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from vllm_kunserve.policy.dispatch import DEFAULT_DISPATCH, DISPATCH, check_mode, choose_instance

from .. import adapters
from ..steptime import Pair

__all__ = ["DEFAULT_DISPATCH", "DISPATCH", "Policy", "move_request"]


class Policy:
    name = "base"
    #: what a server does when a running request needs a block: "recompute" or "swap"
    preempt_mode = "recompute"
    #: pipeline groups admit only what can finish in their KV (``lookahead.admission = "peak"``)
    peak_admission = False
    #: every server has unbounded KV (the oracle)
    infinite_memory = False
    #: period of :meth:`on_tick` in simulated seconds (None: no monitor)
    tick_s: float | None = None
    #: splits a pipeline group's step into microbatches: ``(server, [(prefix, tokens)]) -> [[...]]``;
    #: None runs the step as one microbatch
    microbatch: Callable[[object, Sequence[Pair]], list[list[Pair]]] | None = None
    #: ``max_num_seqs`` of every server this policy runs (None: ``SimConfig.max_seqs``)
    max_seqs: int | None = None

    def __init__(self, dispatch: str = DEFAULT_DISPATCH):
        self.dispatch_mode = check_mode(dispatch)
        self._rr = itertools.count()

    def kv_blocks(self, cfg) -> int:
        """KV blocks of one instance holding the whole model under this policy (the simulator's
        ``base_blocks``): the config's (``SimConfig.base_kv_blocks``) unless a policy changes them."""
        return cfg.base_kv_blocks()

    def setup(self, sim) -> None:
        """Called once before the first event."""

    def dispatch_units(self, sim):
        """The servers as dispatch sees them (``InstanceLoad``; ``alive``: may take a new request)."""
        return adapters.instance_loads(sim)

    def dispatch(self, sim, req):
        """The server that takes the arriving request ``req``."""
        units = self.dispatch_units(sim)
        sid = choose_instance(units, self.dispatch_mode, prompt_blocks=-(-req.prompt // sim.cfg.block_size),
                              turn=next(self._rr) if self.dispatch_mode == "round-robin" else 0)
        return next(s for s in sim.servers if s.sid == sid)

    def on_tick(self, sim) -> None:
        """Every :attr:`tick_s` while requests remain."""

    def on_step_done(self, sim, server) -> None:
        """After ``server`` finished a step (finished requests already removed)."""

    def on_finish(self, sim, req) -> None:
        """When ``req`` produced its last token, before its blocks are freed."""

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
        copy = sim.server_bulk_time(src, r.blocks * sim.cfg.block_bytes)
        dst.pending_io += copy * downtime_share
        r.migrations += 1
        sim.log(kind, req=r.id, src=src.sid, dst=dst.sid, blocks=r.blocks, copy_s=round(copy, 6))
    else:
        return False
    r.server = dst
    sim.kick(src)
    sim.kick(dst)
    return True
