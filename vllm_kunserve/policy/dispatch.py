"""Dispatch: which serving unit (an instance, or a pipeline group acting as one) takes a new request.

The caller describes every unit with an immutable :class:`InstanceLoad` and calls
:func:`choose_instance`; it gets back the chosen ``instance_id``. Modes:

* ``least-work`` (queue-aware, the default): among units whose KV takes the prompt, the least
  queued prefill per instance of compute (a pipeline group of ``k`` has ``k`` GPUs); if none takes
  it, the least KV demand as a share of capacity;
* ``least-load``: the least KV demand (used + queued blocks) as a share of capacity, blind to compute;
* ``round-robin``: the ``turn``-th accepting unit (the caller counts turns).

Units that do not accept work (dead, or frozen while their group changes) are skipped unless none
accepts, then every unit is a candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DISPATCH = ("least-work", "least-load", "round-robin")
DEFAULT_DISPATCH = "least-work"  # queue-aware: what a serving engineer deploys


@dataclass(frozen=True)
class InstanceLoad:
    """One serving unit's load as dispatch sees it (KV in blocks of this unit)."""

    instance_id: int
    used_blocks: int
    queued_blocks: int          # blocks the waiting requests need to start
    capacity_blocks: int
    queued_prefill_tokens: int = 0  # prefill tokens still to compute (waiting + unfinished running)
    requests: int = 0           # running + waiting requests
    k: int = 1                  # instances in the unit (pipeline width)
    alive: bool = True          # accepts new work

    @property
    def demand_blocks(self) -> int:
        return self.used_blocks + self.queued_blocks

    @property
    def load(self) -> float:
        """KV demand as a share of capacity (queue included)."""
        return self.demand_blocks / max(self.capacity_blocks, 1)

    def fits(self, blocks: int) -> bool:
        return self.demand_blocks + blocks <= self.capacity_blocks


def check_mode(mode: str) -> str:
    if mode not in DISPATCH:
        raise ValueError(f"dispatch {mode!r}: one of {', '.join(DISPATCH)}")
    return mode


def choose_instance(units: Sequence[InstanceLoad], mode: str = DEFAULT_DISPATCH, *, prompt_blocks: int = 0,
                    turn: int = 0) -> int:
    """The ``instance_id`` of the unit that takes a request needing ``prompt_blocks`` to start."""
    check_mode(mode)
    if not units:
        raise ValueError("dispatch: no instance to choose from")
    live = [u for u in units if u.alive] or list(units)
    if mode == "round-robin":
        return live[turn % len(live)].instance_id
    if mode == "least-work":
        def key(u: InstanceLoad):
            fits = u.fits(prompt_blocks)
            return (not fits, u.queued_prefill_tokens / u.k if fits else u.load, u.load, u.instance_id)
        return min(live, key=key).instance_id
    return min(live, key=lambda u: (u.load, u.requests, u.instance_id)).instance_id


__all__ = ["DEFAULT_DISPATCH", "DISPATCH", "InstanceLoad", "check_mode", "choose_instance"]
