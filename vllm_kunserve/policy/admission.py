"""Peak-aware admission: start a queued request only if every admitted request can finish in KV.

vLLM admits a queued request as soon as its prompt's blocks are free. When the running requests
then grow (one token each per step), the KV runs out and vLLM preempts the newest one; preempted, it
loses its KV and is recomputed from its tokens later. Under a burst that is longer than the KV's
headroom this repeats: a full KV with a churning running set, every preemption paying a prefill of
the request's whole context again (a 64-token prompt preempted at 300 outputs recomputes 364
tokens). A pipeline group meets a burst with more KV but not always enough (the harsh window, when
no drop plan frees the need), and its prefills cost a pass through every stage.

Each request's ``max_tokens`` bounds its KV, so the future peak of a set of requests is known: a
request holding ``n`` tokens with ``left`` still to generate holds ``n + t`` after ``t`` more steps
and nothing after ``left``. The set's usage is piecewise increasing between finishes, so its peak is
at one of the finish times; over the requests sorted by ``left`` (descending), the ``c`` with the
most left are alive at ``t = left_c``. :func:`peak_blocks` takes the largest of those sums, in
blocks, each request's tokens rounded up to whole blocks as vLLM allocates them (exact: an earlier
bound added a block per request, which on R1's 2-engine group of ~40 requests held back ~12% of the
KV, and in the simulator the burst's last arrivals waited 18-58 s behind it). :func:`admit_count`
admits queued requests in queue order while the peak stays within the capacity, and stops at the
first that does not fit (no overtaking: a long request is not starved by short ones behind it).

A request without ``max_tokens`` is reserved to the model length (vLLM's default), which admits
less than it could; the engine's vLLM preemption is still there for whatever the bound misses.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import numpy as np


class KvNeed(NamedTuple):
    tokens: int   # tokens whose KV the request holds (or will hold once its context is prefilled)
    left: int     # tokens it may still generate (max_tokens less those generated)


def peak_blocks(reqs: Iterable[KvNeed], block_size: int) -> int:
    """The most KV blocks the requests will hold at once if each runs to ``max_tokens``: exact, each
    request's blocks counted as vLLM allocates them (its tokens rounded up to whole blocks)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    order = sorted(reqs, key=lambda r: r.left, reverse=True)
    if not order:
        return 0
    n, bs = len(order), block_size
    # at t_c, the moment the c-th longest-lived request generates its last token, the first c are alive,
    # request i holding ceil((tokens_i + t_c) / bs) = floor((b_i + t_c) / bs) blocks, b_i = tokens_i + bs - 1.
    # Summed over i <= c: (B_c + c t_c - R_c) / bs with B_c the prefix sum of b_i and R_c the sum of
    # (b_i + t_c) mod bs = (q_i + s_c) mod bs (q_i = b_i mod bs, s_c = t_c mod bs), which is
    # Q_c + c s_c - bs K_c with K_c = #{i <= c: q_i >= bs - s_c}: O(n bs) where all pairs were O(n^2)
    b = np.fromiter((r.tokens for r in order), dtype=np.int64, count=n) + (bs - 1)
    t = np.maximum(0, np.fromiter((r.left for r in order), dtype=np.int64, count=n))
    q, s = b % bs, t % bs
    c = np.arange(1, n + 1, dtype=np.int64)
    seen = np.zeros((n, bs + 1), dtype=np.int64)       # seen[c, v]: #{i <= c: q_i == v}
    seen[np.arange(n), q] = 1
    at_least = np.cumsum(np.cumsum(seen, axis=0)[:, ::-1], axis=1)[:, ::-1]   # [c, v]: #{i <= c: q_i >= v}
    k = at_least[np.arange(n), bs - s]                 # s == 0: v == bs, which no q_i reaches
    held = (np.cumsum(b) + c * t - (np.cumsum(q) + c * s - bs * k)) // bs
    return int(held.max())


def admit_count(running: Sequence[KvNeed], queued: Iterable[KvNeed], capacity_blocks: int,
                block_size: int) -> int:
    """How many of ``queued`` (in queue order) may start now: each admitted one keeps the peak of
    the running and admitted requests within ``capacity_blocks``. With nothing running the head is
    always admitted (alone, vLLM's own handling is all there is)."""
    admitted = list(running)
    n = 0
    for q in queued:
        trial = admitted + [q]
        if admitted and peak_blocks(trial, block_size) > capacity_blocks:
            break
        admitted = trial
        n += 1
    return n


# ------------------------------------------------------------------------------------ the fleet's gate
class Gate(NamedTuple):
    """The front end's answer to one new request: ``admit`` it to an engine now, ``queue`` it until
    the fleet can hold it, or ``shed`` it (429) because the queue is full."""

    action: str            # "admit" | "queue" | "shed"
    peak_blocks: int       # the peak of the admitted requests and this one, were it admitted
    reachable_blocks: float  # what the fleet can hold after every drop it may still make


def reachable_blocks(cluster, max_group_size: int = 8) -> float:
    """KV blocks (full-model) the fleet's healthy instances can hold once every drop that the planner
    may still make is made: their blocks now plus what :func:`~vllm_kunserve.policy.drop.plan_drop`
    frees with an unbounded need (its merges within a host, capped at each member's ``kv_blocks_max``)."""
    from vllm_kunserve.policy.drop import plan_drop

    now = float(sum(i.kv_blocks_total for i in cluster.instances if i.healthy))
    plan = plan_drop(cluster, float("inf"), max_group_size)
    return now + plan.freed_bytes / cluster.model.block_bytes


def gate(admitted: Sequence[KvNeed], new: Sequence[KvNeed], reachable: float, block_size: int,
         queued: int, queue_max: int) -> Gate:
    """Admit ``new`` (one request's sequences) if the peak KV of the admitted requests and it stays
    within ``reachable`` blocks (nothing admitted: always, as :func:`admit_count` does); else queue it
    while fewer than ``queue_max`` wait; else shed it."""
    peak = peak_blocks([*admitted, *new], block_size)
    if not admitted or peak <= reachable:
        return Gate("admit", peak, reachable)
    return Gate("queue" if queued < queue_max else "shed", peak, reachable)
