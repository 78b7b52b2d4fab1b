"""A serving unit: one instance, or a pipeline group of instances that acts as one engine.

Scheduling follows vLLM v1's iteration-level scheduler with chunked prefill and continuous
batching: running requests first in admission order (decodes and unfinished prefill chunks) under a
token budget; when a running request cannot get its next KV block, the newest running request is
preempted (recompute: KV dropped, re-prefilled later; or swap: KV copied to host); waiting
requests are admitted FCFS only in steps without a preemption, prefill chunked to the budget. A
kunserve group with ``lookahead.admission = "peak"`` admits peak-aware (``peak_admission``:
:func:`vllm_kunserve.policy.admission.admit_count`, as the engine's group scheduler does): only
requests that every admitted one can finish beside.

A group of ``k`` instances runs its batch as up to ``k`` microbatches through ``k`` stages. A cycle
(every scheduled request advances one iteration) lasts
``max(max_j cost_j + k*hop_j, sum_j (cost_j/k + hop_j))``: the longest microbatch crossing every
stage, or the busiest stage processing every microbatch. ``1 - sum_j cost_j / (k * cycle)`` is the
bubble fraction, recorded per step.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from vllm_kunserve.policy.admission import KvNeed, admit_count
from vllm_kunserve.policy.dispatch import InstanceLoad, choose_instance

from .request import Req
from .steptime import Pair, StepTime

INF_BLOCKS = 1 << 60


class WaitQueue(deque):
    """The waiting queue, keeping the sums dispatch reads at every arrival (KV blocks to start every
    request, prefill tokens to compute) so they cost O(1) instead of O(queue). Each request's
    share is recorded when it enters and taken back when it leaves: the simulator changes a
    request's ``computed`` / ``generated`` only while it runs or before it is queued."""

    def __init__(self, block_size: int):
        super().__init__()
        self.block_size = block_size
        self.blocks = 0
        self.need = 0
        self._share: dict[int, tuple[int, int]] = {}

    def _add(self, r: Req) -> None:
        b, n = -(-r.length // self.block_size), r.need
        self._share[id(r)] = (b, n)
        self.blocks += b
        self.need += n

    def _drop(self, r: Req) -> Req:
        b, n = self._share.pop(id(r))
        self.blocks -= b
        self.need -= n
        return r

    def append(self, r: Req) -> None:
        self._add(r)
        super().append(r)

    def appendleft(self, r: Req) -> None:
        self._add(r)
        super().appendleft(r)

    def extend(self, rs) -> None:
        for r in rs:
            self.append(r)

    def pop(self) -> Req:
        return self._drop(super().pop())

    def popleft(self) -> Req:
        return self._drop(super().popleft())

    def remove(self, r: Req) -> None:
        super().remove(r)
        self._drop(r)

    def clear(self) -> None:
        super().clear()
        self._share.clear()
        self.blocks = self.need = 0

    def _unsupported(self, *a, **k):
        raise NotImplementedError("WaitQueue keeps running sums: use append/appendleft/pop/popleft/remove")

    insert = extendleft = rotate = __setitem__ = __delitem__ = __iadd__ = _unsupported


class Server:
    def __init__(self, sid: int, instances: tuple[int, ...], capacity_blocks: int, block_size: int,
                 max_tokens: int, max_seqs: int, step_time: StepTime, preempt_mode: str = "recompute"):
        self.sid = sid
        self.instances = tuple(instances)
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.step_time = step_time
        self.preempt_mode = preempt_mode  # "recompute" | "swap"
        self.peak_admission = False  # admit only what can finish in KV (policy.admission; groups, kunserve)
        self.prefix_cache = False    # a preempted request resumes from its blocks still cached (vLLM v1)
        self.members = False         # a group whose members keep their requests (SimConfig.member_queues)
        self._used = 0
        self._taken = 0              # blocks taken from the free queue's head so far (prefix_cache)
        self._tail = capacity_blocks  # the free queue position the next freed block goes to
        self._seg: dict[Req, tuple[int, int]] = {}  # preempted request -> (end position, full blocks)
        self.running: list[Req] = []
        self.waiting: WaitQueue = WaitQueue(block_size)
        self.busy = False
        self.alive = True
        self.frozen = False          # set while a group change waits for this step to end
        self.stall_until = 0.0       # no step starts before this (transitions)
        self.penalty_fn: Callable[[float], float] | None = None  # extra seconds given the step time
        self.extra_blocks = 0        # KV blocks gained by remapping layers (Oneiros)
        self.pending_io = 0.0        # one-off seconds added to the next step (swap in/out)
        self.swapped_blocks = 0
        self.preemptions = 0
        self.steps = 0
        self.bubble_sum = 0.0
        self.stage_busy_s = 0.0      # sum over group cycles of k x cycle (stage-seconds)
        self.stage_idle_s = 0.0      # the idle part of it (pipeline bubbles)
        self.microbatcher: Callable[[Server, list[Pair]], list[list[Pair]]] | None = None
        self.hop_time: Callable[[int], float] = lambda tokens: 0.0
        self.swap_time: Callable[[int], float] = lambda blocks: 0.0
        self.inflight: list[tuple[Req, int]] = []
        self.version = 0             # bumped whenever running requests' progress may change
        self.work_cache = None       # adapters.queued_work's running part, keyed on the version

    # ---- memory ------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return self._used

    @used.setter
    def used(self, v: int) -> None:
        d = v - self._used
        if d > 0:
            self._taken += d     # allocation takes the oldest free blocks
        else:
            self._tail -= d      # freed blocks join the queue's tail
        self._used = v

    # vLLM's prefix cache across a preemption (``prefix_cache``): the free blocks form vLLM's free
    # queue; allocation takes the oldest freed first, and a freed block keeps its contents (its
    # hash) until then. A preempted request's blocks are freed last block first, so what survives
    # until it runs again is a prefix of its full blocks, and it resumes from there instead of
    # recomputing everything. Queue positions are counted, not stored: a preempted request's
    # blocks went to [end - blocks, end), its first block at end - 1; a block is gone once
    # ``_taken`` has passed its position.
    def cached_blocks(self, r: Req) -> int:
        end, full = self._seg.get(r, (0, 0))
        return max(0, min(full, end - self._taken))

    def _reuse(self, r: Req, k: int) -> None:
        """``r`` resumes on ``k`` of its cached blocks: they leave the free queue from its middle, so
        the blocks freed after them move up by ``k``."""
        end, _ = self._seg.pop(r)
        for q, (e, f) in list(self._seg.items()):
            if e - self._taken <= 0:
                del self._seg[q]             # evicted whole: nothing left to resume from
            elif e > end:
                self._seg[q] = (e - k, f)
        self._tail -= k
        self._used += k
        r.blocks, r.computed = k, k * self.block_size

    @property
    def k(self) -> int:
        return len(self.instances)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def queued_blocks(self, horizon: int = 0) -> int:
        """Blocks the waiting requests need to start (all of them when horizon=0)."""
        if not horizon:
            return self.waiting.blocks
        tot = 0
        for i, r in enumerate(self.waiting):
            if horizon and i >= horizon:
                break
            tot += self.blocks_for(r.length)
        return tot

    def demand_blocks(self) -> int:
        return self.used + self.queued_blocks()

    def load(self) -> float:
        """Dispatch key: KV demand as a share of capacity (queue included)."""
        return self.demand_blocks() / max(self.capacity, 1)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- scheduling --------------------------------------------------------------------------
    def _preempt(self, victim: Req) -> None:
        self.running.remove(victim)
        self.used -= victim.blocks
        victim.preempts += 1
        self.preemptions += 1
        if self.preempt_mode == "swap" and victim.computed > 0:
            victim.swapped = True
            self.swapped_blocks += victim.blocks
            self.pending_io += self.swap_time(victim.blocks)
        else:
            if self.prefix_cache:  # ``used -= blocks`` above put them at [tail - blocks, tail)
                self._seg[victim] = (self._tail, min(victim.blocks, victim.computed // self.block_size))
            victim.computed = 0
        victim.blocks = 0
        self.waiting.appendleft(victim)

    def schedule(self) -> list[tuple[Req, int]]:
        if self.members:
            return self._schedule_members()
        self.version += 1
        budget = self.max_tokens * self.k
        max_seqs = self.max_seqs * self.k
        out: list[tuple[Req, int]] = []
        preempted = False
        bs = self.block_size
        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            r = running[i]
            n = r.prompt + r.generated - r.computed  # Req.need, inlined (hot loop)
            if n > budget:
                n = budget
            extra = -(-(r.computed + n) // bs) - r.blocks
            lost = False
            while extra > self.capacity - self.used:
                victim = self.running[-1]  # newest first, never one already scheduled (index < i)
                self._preempt(victim)
                preempted = True
                if victim is r:
                    lost = True
                    break
            if lost:
                break
            r.blocks += extra
            self.used += extra
            out.append((r, n))
            budget -= n
            i += 1
        if not preempted:
            if self.peak_admission and self.waiting:
                need = lambda q: KvNeed(q.prompt + q.generated, q.output - q.generated)  # noqa: E731
                max_seqs = min(max_seqs, len(self.running) + admit_count(
                    [need(q) for q in self.running], (need(q) for q in self.waiting), self.capacity, bs))
            while self.waiting and budget > 0 and len(self.running) < max_seqs:
                r = self.waiting[0]
                if r.swapped:
                    need_blocks = self.blocks_for(r.computed + 1)
                    if need_blocks > self.capacity - self.used:
                        break
                    self.pending_io += self.swap_time(self.blocks_for(r.computed))
                    self.swapped_blocks -= self.blocks_for(r.computed)
                    r.swapped = False
                    r.blocks = need_blocks
                    self.used += need_blocks
                if self.prefix_cache and r in self._seg:
                    hit = min(self.cached_blocks(r), (r.length - 1) // bs)  # at least one token to compute
                    if hit:
                        n = min(r.length - hit * bs, budget)
                        if self.blocks_for(hit * bs + n) - hit > self.capacity - self.used - hit:
                            break
                        self._reuse(r, hit)
                    else:
                        del self._seg[r]
                n = min(r.need, budget)
                extra = self.blocks_for(r.computed + n) - r.blocks
                if extra > self.capacity - self.used:
                    break
                self.waiting.popleft()
                r.blocks += extra
                self.used += extra
                self.running.append(r)
                out.append((r, n))
                budget -= n
        return out

    # ---- a group whose members keep their requests (``members``) ------------------------------
    # Each member is an engine of its own: its scheduler sees its own running and waiting requests,
    # a token budget and max_num_seqs of its own and 1/k of the group's KV blocks; it preempts its
    # own newest request and admits FCFS from its own queue (peak-aware where the group is); its step
    # is one microbatch through every member's stage. What stays pooled is an approximation: the
    # prefix cache's free queue (one for the group).
    def member_cap(self) -> int:
        return self.capacity // self.k

    def member_used(self) -> list[int]:
        used = [0] * self.k
        for r in self.running:
            used[r.member] += r.blocks
        return used

    def pick_member(self, r: Req) -> int:
        """Where the front end sends an arrival (its least-work dispatch over the members as engines)."""
        used, queued, work, n = self.member_used(), [0] * self.k, [0] * self.k, [0] * self.k
        for q in self.waiting:
            queued[q.member] += self.blocks_for(q.length)
            work[q.member] += q.need
            n[q.member] += 1
        for q in self.running:
            n[q.member] += 1
            if q.need > 1:
                work[q.member] += q.need
        cap = self.member_cap()
        loads = [InstanceLoad(m, used[m], queued[m], cap, work[m], n[m], group=0) for m in range(self.k)]
        return choose_instance(loads, "least-work", prompt_blocks=self.blocks_for(r.length))

    def _schedule_members(self) -> list[tuple[Req, int]]:
        self.version += 1
        k, bs, cap = self.k, self.block_size, self.member_cap()
        used = self.member_used()
        budget = [self.max_tokens] * k
        nrun = [0] * k
        for r in self.running:
            nrun[r.member] += 1
        out: list[tuple[Req, int]] = []
        blocked = [False] * k          # a member that preempted this step admits nothing (vLLM)
        i = 0
        while i < len(self.running):
            r = self.running[i]
            m = r.member
            if budget[m] <= 0:
                i += 1
                continue
            n = min(r.need, budget[m])
            extra = self.blocks_for(r.computed + n) - r.blocks
            lost = False
            while extra > cap - used[m]:
                victim = next(q for q in reversed(self.running) if q.member == m)  # its newest: index >= i
                used[m] -= victim.blocks
                nrun[m] -= 1
                self._preempt(victim)
                blocked[m] = True
                if victim is r:
                    lost = True
                    break
            if lost:
                continue                 # r left running: running[i] is the next request
            r.blocks += extra
            self.used += extra
            used[m] += extra
            out.append((r, n))
            budget[m] -= n
            i += 1
        allowed = [self.max_seqs] * k
        if self.peak_admission and self.waiting:
            def need(q):
                return KvNeed(q.prompt + q.generated, q.output - q.generated)
            for m in range(k):
                allowed[m] = nrun[m] + admit_count([need(q) for q in self.running if q.member == m],
                                                   (need(q) for q in self.waiting if q.member == m), cap, bs)
        for r in list(self.waiting):
            m = r.member
            if blocked[m] or budget[m] <= 0 or nrun[m] >= min(self.max_seqs, allowed[m]):
                blocked[m] = True
                continue
            if self.prefix_cache and r in self._seg:
                hit = min(self.cached_blocks(r), (r.length - 1) // bs)
                if hit and self.blocks_for(hit * bs + min(r.length - hit * bs, budget[m])) - hit <= cap - used[m] - hit:
                    self._reuse(r, hit)
                    used[m] += hit
                elif not hit:
                    del self._seg[r]
            n = min(r.need, budget[m])
            extra = self.blocks_for(r.computed + n) - r.blocks
            if extra > cap - used[m]:
                blocked[m] = True
                continue
            self.waiting.remove(r)
            r.blocks += extra
            self.used += extra
            used[m] += extra
            nrun[m] += 1
            self.running.append(r)
            out.append((r, n))
            budget[m] -= n
            if all(blocked):
                break
        return out

    def cycle_time(self, batch: Sequence[tuple[Req, int]]) -> float:
        pairs = [(r.computed, n) for r, n in batch]
        if self.k == 1:
            return self.step_time.batch_time(pairs)
        if self.members:     # each member's requests are its own microbatch
            mbs = [[(r.computed, n) for r, n in batch if r.member == m] for m in range(self.k)]
        else:
            mbs = self.microbatcher(self, pairs) if self.microbatcher else [pairs]
        k = self.k
        costs = [self.step_time.batch_time(mb) for mb in mbs if mb]
        hops = [self.hop_time(sum(c for _, c in mb)) for mb in mbs if mb]
        longest = max(c + k * h for c, h in zip(costs, hops))
        busiest = sum(c / k + h for c, h in zip(costs, hops))
        cycle = max(longest, busiest)
        self.bubble_sum += 1.0 - sum(costs) / (k * cycle) if cycle > 0 else 0.0
        self.stage_busy_s += k * cycle
        self.stage_idle_s += max(0.0, k * cycle - sum(costs))
        return cycle

    def reset_block_accounting(self) -> None:
        self.used = sum(r.blocks for r in self.running)
