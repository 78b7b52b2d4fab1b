"""``least-work`` (queue-aware, the default): among units whose KV takes the prompt, the least
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
on the cluster burst (a retired benchmark reported each run's split; git history keeps it and its
pages): balancing KV sent one member 29-30 of a burst's 48 arrivals in four of five runs, and a
traced run with a 44/34 split had one member's microbatch costing 1.5-1.9x the other's through
most of the burst; ordering members by requests gave 22-26 per member.
"""

from __future__ import annotations

from typing import Sequence

from vllm_kunserve.policy.dispatch.base import DispatchPolicy, InstanceLoad


class LeastWork(DispatchPolicy):
    """Least queued prefill, then fewest requests, per instance of compute; then least KV demand."""

    name = "least-work"
    summary = ("queue-aware: among units with room for the prompt, the least queued prefill per instance "
               "of compute, then the fewest requests")

    def choose(self, units: Sequence[InstanceLoad], prompt_blocks: int = 0, turn: int = 0) -> int:
        def key(u: InstanceLoad):
            fits = u.fits(prompt_blocks)
            if not fits:
                return (True, u.load, 0.0, u.instance_id)
            return (False, u.queued_prefill_tokens / u.k, u.requests / u.k, u.load, u.instance_id)
        return min(units, key=key).instance_id
