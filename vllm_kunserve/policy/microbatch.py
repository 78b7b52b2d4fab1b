"""Microbatch formation for pipeline groups: lookahead divide and conquer (KunServe Fig. 11).

The queued work is a sequence of chunks in queue order: a prefill request contributes
``(computed, prompt - computed)`` and a decoding one ``(context, 1)``. Lookahead splits the sequence
recursively at half of its *cost* under the fitted model (not at half of its tokens), chunking a
prefill where the cut falls inside it; the part of a request with the smaller prefix always goes to
the earlier microbatch, so chunks of a request stay in prefix order.

Stop rule (by cost, not tokens): a microbatch is given at least the variable cost of ``min_tokens``
prefill tokens from an empty prefix (:func:`min_microbatch_cost`), so a batch of variable cost ``C``
is split into at most ``floor(C / that)`` microbatches (never more than asked for) and not at all
below twice it. A token floor would never split a decode-only batch of fewer than
``2 * min_tokens`` requests, although each decode reads its whole KV prefix and such a batch can cost
as much as a long prefill chunk; run as one microbatch it leaves ``k - 1`` of ``k`` pipeline stages
idle.

The baseline is Sarathi-style token-count chunking: the same sequence cut into equal token budgets.
:func:`pipeline_bubble` scores both on a simulated k-stage pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from vllm_kunserve.policy.costmodel import CostModel
from vllm_kunserve.policy.snapshot import RequestSnapshot


class WorkChunk(NamedTuple):
    """Immutable (a NamedTuple: cheap to build by the thousand)."""

    request_id: str
    prefix: int  # tokens of this request with KV before the chunk
    tokens: int  # new tokens
    decode: bool = False


@dataclass(frozen=True)
class Microbatch:
    chunks: tuple[WorkChunk, ...]
    cost: float  # batch cost under the model (Eq. 3)

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    def to_dict(self) -> dict:
        return {"cost": self.cost, "tokens": self.tokens,
                "chunks": [{"request_id": c.request_id, "prefix": c.prefix, "tokens": c.tokens,
                            "decode": c.decode} for c in self.chunks]}


def work_from_requests(requests: Iterable[RequestSnapshot]) -> list[WorkChunk]:
    out = []
    for r in requests:
        if r.is_prefill:
            out.append(WorkChunk(r.request_id, r.computed_tokens, r.prompt_tokens - r.computed_tokens))
        else:
            out.append(WorkChunk(r.request_id, r.kv_tokens, 1, True))
    return out


def _var_cost(m: CostModel, p: int, c: int) -> float:
    return m.var_cost(p, c)  # alpha and beta terms, plus the decode KV-read term (delta) of 1-token chunks


def _finish(model: CostModel, parts: list[list[WorkChunk]]) -> list[Microbatch]:
    return [Microbatch(tuple(p), model.batch_cost((c.prefix, c.tokens) for c in p)) for p in parts if p]


def _cut(model: CostModel, chunks: Sequence[WorkChunk], target: float) -> tuple[list, list]:
    """Split ``chunks`` where the cumulative variable cost reaches ``target``."""
    acc = 0.0
    a, b = model.alpha, model.beta
    for i, ch in enumerate(chunks):
        cost = model.var_cost(ch.prefix, ch.tokens)
        if acc + cost < target:
            acc += cost
            continue
        r = target - acc
        if ch.tokens == 1 or ch.decode:
            k = 1 if r >= cost / 2 else 0  # whole chunk to the nearer side
        else:
            # solve a/2 k^2 + (a p + a/2 + b) k = r for the tokens k that go left
            qa, qb = a / 2, a * ch.prefix + a / 2 + b
            k_real = r / qb if qa == 0 else (-qb + math.sqrt(qb * qb + 4 * qa * r)) / (2 * qa)
            lo = int(k_real)
            k = lo if abs(_var_cost(model, ch.prefix, lo) - r) <= abs(_var_cost(model, ch.prefix, lo + 1) - r) else lo + 1
            k = max(0, min(ch.tokens, k))
        left = list(chunks[:i])
        right = list(chunks[i + 1:])
        if k == ch.tokens:
            left.append(ch)
        elif k == 0:
            right.insert(0, ch)
        else:
            left.append(WorkChunk(ch.request_id, ch.prefix, k))
            right.insert(0, WorkChunk(ch.request_id, ch.prefix + k, ch.tokens - k))
        return left, right
    return list(chunks), []


def min_microbatch_cost(model: CostModel, min_tokens: int) -> float:
    """The least variable cost a microbatch is given: ``min_tokens`` prefill tokens at prefix 0."""
    return model.var_cost(0, min_tokens)


def max_microbatches(chunks: Sequence[WorkChunk], model: CostModel, parts: int, min_tokens: int,
                     total: float | None = None) -> int:
    """How many microbatches ``chunks`` (of variable cost ``total``) may be split into: ``parts``,
    capped so each carries at least :func:`min_microbatch_cost`; a model with no per-token cost
    falls back to a floor of ``min_tokens`` tokens."""
    floor = min_microbatch_cost(model, min_tokens)
    if floor > 0:
        if total is None:
            total = sum(_var_cost(model, c.prefix, c.tokens) for c in chunks)
        cap = int(total / floor * (1 + 1e-12))
    else:
        cap = sum(c.tokens for c in chunks) // min_tokens
    return max(1, min(parts, cap))


def lookahead_microbatches(work: Sequence[WorkChunk], model: CostModel, parts: int,
                           min_tokens: int = 64) -> list[Microbatch]:
    """Recursively split ``work`` at half cost into at most ``parts`` cost-balanced microbatches,
    each with at least the variable cost of ``min_tokens`` prefill tokens (see the module doc)."""
    if parts < 1 or min_tokens < 1:
        raise ValueError("parts and min_tokens must be >= 1")

    def rec(chunks: list[WorkChunk], n: int) -> list[list[WorkChunk]]:
        if n <= 1 or not chunks:
            return [chunks]
        total = sum(_var_cost(model, c.prefix, c.tokens) for c in chunks)
        n = max_microbatches(chunks, model, n, min_tokens, total)
        if n <= 1:
            return [chunks]
        n_left = n // 2
        left, right = _cut(model, chunks, total * n_left / n)
        if not left or not right:
            return [chunks]
        return rec(left, n_left) + rec(right, n - n_left)

    return _finish(model, rec(list(work), parts))


def token_count_microbatches(work: Sequence[WorkChunk], model: CostModel, parts: int,
                             min_tokens: int = 64) -> list[Microbatch]:
    """Sarathi-style baseline: cut the same sequence into equal token budgets."""
    if parts < 1 or min_tokens < 1:
        raise ValueError("parts and min_tokens must be >= 1")
    total = sum(c.tokens for c in work)
    budget = max(min_tokens, -(-total // parts)) if total else 1
    out: list[list[WorkChunk]] = [[]]
    room = budget
    for ch in work:
        rest = ch
        while rest.tokens > room and not rest.decode:
            if room > 0:
                out[-1].append(WorkChunk(rest.request_id, rest.prefix, room))
                rest = WorkChunk(rest.request_id, rest.prefix + room, rest.tokens - room)
            out.append([])
            room = budget
        if rest.tokens > room:  # a decode token with no room left
            out.append([])
            room = budget
        out[-1].append(rest)
        room -= rest.tokens
    return _finish(model, out)


def pipeline_bubble(costs: Sequence[float], stages: int, rounds: int = 16) -> float:
    """Steady-state idle share of a ``stages``-deep pipeline serving these microbatches repeatedly.

    Each microbatch takes ``cost / stages`` on every stage; stages serve microbatches in order; a
    microbatch starts its next step only after its previous step left the last stage (decoding is
    autoregressive, and the next prefill chunk of a request needs the previous one's KV). After
    ``rounds`` steps the period P between consecutive steps is measured over the second half (so
    pipeline fill and drain do not count) and the bubble is ``1 - sum(cost / stages) / P``: zero for
    perfectly balanced microbatches, ``1 - mean/max`` when one microbatch dominates.
    """
    if stages < 1 or rounds < 2:
        raise ValueError("stages must be >= 1 and rounds >= 2")
    t = [c / stages for c in costs]
    if not t or sum(t) <= 0:
        return 0.0
    free = [0.0] * stages
    done = [0.0] * len(t)  # when each microbatch left the last stage
    half = rounds // 2
    mark = 0.0
    for r in range(rounds):
        for i, ti in enumerate(t):
            ready = done[i]
            for s in range(stages):
                start = free[s] if free[s] > ready else ready
                ready = start + ti
                free[s] = ready
            done[i] = ready
        if r == half - 1:
            mark = max(done)
    period = (max(done) - mark) / (rounds - half)
    return max(0.0, 1.0 - sum(t) / period)


def step_budget(work: Sequence[WorkChunk], model: CostModel, target_cost: float, min_tokens: int,
                max_tokens: int) -> int:
    """Token budget of one member's next step in a pipeline group, so that the step costs about
    ``target_cost`` (the group's other microbatches: what a peer's steps cost under the same model).

    In a group every member's step is one microbatch through every stage; a step far costlier than
    the others stalls the stages behind it. The work is the member's queue in scheduling order
    (decodes of running requests first, then prefills). Decodes are never split (a decode batch
    split in two reads the weights twice); prefills are cut by the lookahead's cost cut where the
    cumulative variable cost reaches the target, chunking the prefill the cut falls in. At least
    ``min_tokens`` prefill tokens are always given (queued work keeps moving when the peers idle or
    decode alone); ``target_cost <= 0`` means no peer to balance against: ``max_tokens``."""
    if min_tokens < 1 or max_tokens < 1:
        raise ValueError("min_tokens and max_tokens must be >= 1")
    decodes = [c for c in work if c.decode]
    prefills = [c for c in work if not c.decode]
    if target_cost <= 0 or not prefills:
        return max_tokens
    room = target_cost - sum(model.var_cost(c.prefix, c.tokens) for c in decodes)
    left, _ = _cut(model, prefills, max(room, min_microbatch_cost(model, min_tokens)))
    pre = max(sum(c.tokens for c in left), min(min_tokens, sum(c.tokens for c in prefills)))
    return max(1, min(max_tokens, len(decodes) + pre))
