"""``least-load``: the least KV demand (used + queued blocks) as a share of capacity, blind to compute."""

from __future__ import annotations

from typing import Sequence

from vllm_kunserve.policy.dispatch.base import DispatchPolicy, InstanceLoad


class LeastLoad(DispatchPolicy):
    """Least KV demand share, then fewest requests."""

    name = "least-load"
    summary = "the lowest share of KV in use, queue included; blind to compute"

    def choose(self, units: Sequence[InstanceLoad], prompt_blocks: int = 0, turn: int = 0) -> int:
        return min(units, key=lambda u: (u.load, u.requests, u.instance_id)).instance_id
