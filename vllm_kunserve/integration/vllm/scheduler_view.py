"""The engine agent's view of vLLM's scheduler: growable block capacity and KV demand.

Everything the agent needs from vLLM's scheduler goes through this one class, so the agent itself
(``vllm_kunserve.engine.agent``) stays free of vLLM internals.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_kunserve.integration.vllm.block_capacity import BlockCapacity, CapacityState


class SchedulerView:
    def __init__(self, scheduler: Any, base_blocks: int, cache_config: Any, growth_tokens: int) -> None:
        self.scheduler = scheduler
        self.pool = scheduler.kv_cache_manager.block_pool
        self.block_size = int(cache_config.block_size)
        self.growth_tokens = int(growth_tokens)
        self.cap = BlockCapacity(self.pool, base_blocks, cache_config)
        orig_free = self.pool.free_blocks

        def free_blocks(ordered_blocks):
            blocks = list(ordered_blocks)
            orig_free(blocks)
            self.cap.on_freed(blocks)
        self.pool.free_blocks = free_blocks  # instance attribute: this engine's pool only

    # -- capacity -------------------------------------------------------------------------------
    def state(self) -> CapacityState:
        self.cap.reap()  # draining blocks freed by any path (free_blocks, unpin_blocks, ...)
        return self.cap.state()

    def grow(self, n: int) -> None:
        self.cap.grow(n)

    def begin_shrink(self, n: int) -> bool:
        return self.cap.begin_shrink(n)

    def cancel_shrink(self) -> int:
        return self.cap.cancel_shrink()

    def held_blocks(self, below: int | None = None) -> list[int]:
        """Ids of blocks whose contents matter: in use by a request, or kept by the prefix cache
        (free but hashed). A pipeline group moves exactly these when KV changes hands."""
        hi = self.state().visible if below is None else int(below)
        return [b.block_id for b in self.pool.blocks[1:hi] if b.ref_cnt > 0 or b.block_hash is not None]

    def recompute_all(self) -> int:
        """Preempt every running request (vLLM's own preemption: each is recomputed from its
        tokens when it runs again) and forget the prefix cache. For when this engine's KV cannot
        be trusted or moved: a pipeline peer died, or a group forms by re-prefill. Returns how many
        requests were preempted. (``Scheduler.reset_prefix_cache(reset_running_requests=True)``
        does the same but refuses while blocks are hidden by the capacity view.)"""
        sched, pool = self.scheduler, self.pool
        n, ts = len(sched.running), time.monotonic()
        while sched.running:
            req = sched.running.pop()
            # synchronous scheduling: nothing of an earlier step is still coming (a failed step's
            # tokens never will), so nothing is stale
            req.num_in_flight_tokens = 0
            sched._preempt_request(req, ts)
        sched.prev_step_scheduled_req_ids.clear()
        pool.cached_block_hash_to_block = type(pool.cached_block_hash_to_block)()
        pool.cached_block_hashes_by_block.clear()
        for b in pool.blocks:
            b.reset_hash()
        return n

    # -- demand ---------------------------------------------------------------------------------
    def demand(self) -> tuple[int, int, int]:
        """(used, queued, growth) blocks: in use now; what queued requests need to start; what
        running and queued requests need for their next ``growth_tokens`` outputs."""
        sched, bs, horizon = self.scheduler, self.block_size, self.growth_tokens

        def ahead(r) -> int:
            max_tokens = getattr(r, "max_tokens", None) or horizon
            left = max(0, max_tokens - getattr(r, "num_output_tokens", 0))
            return r.num_tokens + min(left, horizon)

        queued = sum(-(-r.num_tokens // bs) for r in sched.waiting)
        growth = (sum(-(-ahead(r) // bs) - -(-r.num_tokens // bs) for r in sched.waiting)
                  + sum(max(0, -(-ahead(r) // bs) - -(-r.num_tokens // bs)) for r in sched.running))
        return self.state().used, queued, growth

    def pending_tokens(self) -> tuple[int, int]:
        """(prefill, decode) tokens still to compute: prompt tokens not yet prefilled (waiting
        requests, preempted ones included, and running ones mid-prefill) and outputs still to come
        (``max_tokens`` less what each request has generated): what the engine still has to compute
        (status)."""
        sched = self.scheduler

        def prefill(r) -> int:
            return max(0, getattr(r, "num_prompt_tokens", r.num_tokens) - r.num_computed_tokens)

        def decode(r) -> int:
            return max(0, (getattr(r, "max_tokens", None) or 0) - getattr(r, "num_output_tokens", 0))

        reqs = [*sched.waiting, *sched.running]
        return sum(prefill(r) for r in reqs), sum(decode(r) for r in reqs)

    def request_mix(self) -> tuple[int, int]:
        """(prompt, output) tokens of the requests in the engine (waiting, preempted ones included,
        and running), whole requests: their prompt lengths and output budgets (``max_tokens``). The
        drop monitor reads their ratio: more KV buys throughput only through bigger decode batches."""
        reqs = [*self.scheduler.waiting, *self.scheduler.running]
        return (sum(int(getattr(r, "num_prompt_tokens", r.num_tokens)) for r in reqs),
                sum(int(getattr(r, "max_tokens", None) or 0) for r in reqs))

    def requests(self) -> tuple[int, int]:
        """(waiting, running) request counts."""
        return len(self.scheduler.waiting), len(self.scheduler.running)

    def unfinished(self) -> int:
        return self.scheduler.get_num_unfinished_requests()
