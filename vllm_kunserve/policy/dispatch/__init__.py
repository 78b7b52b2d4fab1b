"""Dispatch: which serving unit (an instance, or a pipeline group acting as one) takes a new request.

The caller describes every unit with an immutable :class:`InstanceLoad` and calls
:func:`choose_instance`; it gets back the chosen ``instance_id``. Modes:

* ``least-work`` (queue-aware, the default): among units whose KV takes the prompt, the least
  queued prefill per instance of compute (a pipeline group of ``k`` has ``k`` GPUs), then the
  **fewest requests** per instance of compute, then the least KV demand; if none takes it, the
  least KV demand as a share of capacity. Requests come before KV because the KV a unit holds now
  undercounts young requests: a 64-token prompt holds 2 blocks and will hold 12 when its 320
  tokens are out, so ordering by KV sends the next arrivals to the unit whose requests are young,
  which then runs out of KV first. Measured in regime R1 (``benchmarks/burst_value.py``; 2 stock
  engines, decode-heavy burst at 1.8x capacity): ordering by KV split a 64-s window's arrivals up
  to 26 / 39, and the stock pair's window P99 TTFT followed the split (1.7 s at 31 / 34, 27-84 s at
  26 / 39 and 26 / 38), while vllm-router's balanced split of the same engines gave 0.8-1.4 s.
  The same order balances the members of a pipeline group (each listed with its ``group``):
  every member's step is a microbatch through the same stages, so the group's cycle is twice the
  larger microbatch, and a decode step's cost is set by its batch, not by its KV tokens. Measured
  on the cluster burst (``benchmarks/cluster_burst.py`` reports each run's split): balancing KV
  sent one member 29-30 of a burst's 48 arrivals in four of five runs, and a traced run with a
  44/34 split had one member's microbatch costing 1.5-1.9x the other's through most of the burst;
  ordering members by requests gave 22-26 per member (docs/benchmarks/cluster_burst_balanced.md,
  in git history);
* ``least-load``: the least KV demand (used + queued blocks) as a share of capacity, blind to compute;
* ``round-robin``: the ``turn``-th accepting unit (the caller counts turns);
* ``mell``: MELL's placement on a **fixed** cluster (below): among units whose KV takes the prompt,
  the lowest KV demand share after placing it; if none takes it, the lowest demand share.

Units that do not accept work (dead, or frozen while their group changes) are skipped unless none
accepts, then every unit is a candidate.

MELL on a fixed cluster
-----------------------
MELL (``policy.placement.MellPlacer``) bin-packs requests' KV onto as few instances as it can and
migrates a bounded number of requests per operation to keep them packed. Packing pays only where
an emptied instance is *released* (an elastic cluster: fewer GPUs held, the MELL paper's 9-31%).
On a fixed cluster all N instances run and are paid for whether they hold one request or a
hundred: every instance is an open bin, so consolidation buys nothing, and packing only piles
the queue and the preemptions onto a few instances while the others idle (mapping the placer's
bins onto 8 fixed instances gave a P99 TTFT 30x least-load's in the simulator). So on a fixed
cluster MELL keeps the two guarantees that still matter and drops consolidation:

* capacity (MELL's I1, no instance over its KV): a request goes where it fits with the most KV
  headroom after it is placed, so every instance keeps room for its requests to grow. On
  identical instances this is least-load's order; it differs only in never choosing a unit the
  prompt does not fit while another has room.
* bounded migrations (MELL's I2): every monitor period ``policy.migration.plan_migrations``
  relieves each instance whose KV demand passed ``placement.high_watermark`` of its capacity,
  moving the fewest requests that bring it back under (MELL's make-room rule: the smallest one
  large enough, else the largest first), at most ``placement.max_migrations`` moves and
  ``placement.max_migration_bytes`` of KV per period, to the instances with the most headroom
  that stay under the watermark; each move sends the KV or re-prefills the tokens as
  ``policy.placement.choose_migration`` decides. A balanced cluster moves nothing.

Measured in ``benchmarks/placement.py`` (docs/benchmarks/placement.md): on fixed 2- and
8-instance clusters ``mell``'s P99 TTFT equals ``least-load``'s within the noise of a 1-ms arrival
jitter (the placer's bins forced onto the instances: 8x worse on average); in the elastic setting
``MellPlacer`` holds 19-33% fewer instance-seconds than round-robin and least-load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DISPATCH = ("least-work", "least-load", "round-robin", "mell")
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
    group: int | None = None    # the pipeline group this instance is a member of (while grouped)

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
            if not fits:
                return (True, u.load, 0.0, u.instance_id)
            return (False, u.queued_prefill_tokens / u.k, u.requests / u.k, u.load, u.instance_id)
        return min(live, key=key).instance_id
    if mode == "mell":
        def headroom(u: InstanceLoad):
            fits = u.fits(prompt_blocks)
            after = (u.demand_blocks + prompt_blocks) / max(u.capacity_blocks, 1)
            return (not fits, after if fits else u.load, u.requests, u.instance_id)
        return min(live, key=headroom).instance_id
    return min(live, key=lambda u: (u.load, u.requests, u.instance_id)).instance_id


__all__ = ["DEFAULT_DISPATCH", "DISPATCH", "InstanceLoad", "check_mode", "choose_instance"]
