"""``mell``: MELL's placement on a **fixed** cluster (below): among units whose KV takes the prompt,
the lowest KV demand share after placing it; if none takes it, the lowest demand share.

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

from typing import Any, Sequence

from vllm_kunserve.policy.dispatch.base import DispatchPolicy, InstanceLoad


class Mell(DispatchPolicy):
    """Most KV headroom after placing the request where it fits; bounded migrations every period."""

    name = "mell"
    summary = "MELL on a fixed cluster: the most KV headroom after placing, bounded migrations every monitor period"
    periodic = True

    def choose(self, units: Sequence[InstanceLoad], prompt_blocks: int = 0, turn: int = 0) -> int:
        def headroom(u: InstanceLoad):
            fits = u.fits(prompt_blocks)
            after = (u.demand_blocks + prompt_blocks) / max(u.capacity_blocks, 1)
            return (not fits, after if fits else u.load, u.requests, u.instance_id)
        return min(units, key=headroom).instance_id

    def on_period(self, units: Sequence[InstanceLoad], requests: Sequence[Any], config: Any, *,
                  kv_bytes_per_block: int = 0, link_bytes_per_s: float = 0.0) -> Sequence[Any]:
        """MELL's I2: ``policy.migration.plan_migrations`` over this period's loads."""
        from vllm_kunserve.policy.migration import plan_migrations  # it imports policy.dispatch.base

        return plan_migrations(units, requests, config, kv_bytes_per_block=kv_bytes_per_block,
                               link_bytes_per_s=link_bytes_per_s)
