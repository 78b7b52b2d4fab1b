"""``round-robin``: the ``turn``-th accepting unit (the caller counts turns)."""

from __future__ import annotations

from typing import Sequence

from vllm_kunserve.policy.dispatch.base import DispatchPolicy, InstanceLoad


class RoundRobin(DispatchPolicy):
    """Each unit in turn."""

    name = "round-robin"
    summary = "each accepting unit in turn"

    def choose(self, units: Sequence[InstanceLoad], prompt_blocks: int = 0, turn: int = 0) -> int:
        return units[turn % len(units)].instance_id
