"""Touchpoint: ``scheduler_config.scheduler_cls`` (the lookahead scheduler of a pipeline group).

Alone, an engine schedules exactly as vLLM's own :class:`~vllm.v1.core.sched.scheduler.Scheduler`
(the subclass adds nothing to the call). In a pipeline group every member's step is one microbatch
through every member's stage, so a step much costlier than the peers' (a long prefill landing on one
member) stalls the stages behind it. While grouped, each ``schedule()`` call gets a token budget from
the lookahead cost cut (:func:`vllm_kunserve.policy.microbatch.step_budget`): the member's queue in
scheduling order (running decodes, never split; then prefills, chunked where the cut falls) is cut
where its cost under the fitted model (``lookahead.cost_model``) reaches the cost of the peers'
latest steps, which this member's stage server saw pass through (their (prefix, new tokens) chunks,
read from the attention metadata of the spans it ran). The budget is applied by lowering
``max_num_scheduled_tokens`` for that one call; everything else is vLLM's scheduling.

While grouped, admission can be peak-aware too (``lookahead.admission = "peak"``; the default is
vLLM's own, ``"vllm"``; :func:`vllm_kunserve.policy.admission.admit_count`): a queued request
starts only if the running ones and it can all reach their ``max_tokens`` in the group's KV,
applied by lowering ``max_num_active_reqs`` (vLLM's admission limit) for that one call. A group
whose KV is short of the burst (no drop plan frees the need) then runs a steady set to completion
instead of preempting and recomputing requests over and over; where the shortfall is brief (a burst
that ends before the admitted set's peak), it makes the queue wait for whole requests to finish
instead (docs/config.md, ``lookahead.admission``).

CPU vLLM forces ``async_scheduling=False``, so subclassing the synchronous ``Scheduler`` loses
nothing there; on an engine with async scheduling the class is not installed (logged).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from vllm_kunserve.integration.vllm.base import VllmPatch
from vllm_kunserve.integration.vllm.versions import release

logger = logging.getLogger("vllm.kunserve")

QUALNAME = "vllm_kunserve.integration.vllm.scheduler.KunServeScheduler"
#: a peer's step older than this no longer paces this member (the peer is idle: nothing to balance)
PACE_MAX_AGE_S = 1.0


class SchedulerPatch(VllmPatch):
    name = "scheduler"
    summary = "scheduler_cls = KunServeScheduler: cost-balanced step budgets while in a pipeline group"

    def wanted(self, cfg: Any) -> bool:
        la = cfg.lookahead
        return bool(cfg.drop.group_member and (la.enable or la.admission == "peak"))

    def configure(self, cfg: Any, holder: Any) -> None:
        if not self.wanted(cfg):
            return
        target = getattr(holder, "scheduler_config", holder)  # VllmConfig or EngineArgs
        if getattr(target, "async_scheduling", None):
            logger.warning("kunserve: async scheduling is on; the lookahead scheduler is not installed")
            return
        current = getattr(target, "scheduler_cls", None)
        if current in (None, "", QUALNAME):
            target.scheduler_cls = QUALNAME
        else:
            logger.warning("kunserve: scheduler_cls=%s already set by the user; lookahead scheduling is off", current)


def queue_work(scheduler: Any) -> list:
    """The member's queue in scheduling order as lookahead work: running decodes (one token each),
    then the prefills of running and waiting requests (their tokens not yet computed)."""
    from vllm_kunserve.policy.microbatch import WorkChunk

    work = []
    for r in scheduler.running:
        done, prompt = int(r.num_computed_tokens), int(r.num_prompt_tokens)
        work.append(WorkChunk(r.request_id, done, 1, True) if done >= prompt
                    else WorkChunk(r.request_id, done, prompt - done))
    for r in scheduler.waiting:
        done = int(r.num_computed_tokens)
        work.append(WorkChunk(r.request_id, done, max(1, int(r.num_tokens) - done)))
    return work


def wanted_step(work: list, max_tokens: int) -> list[tuple[int, int]]:
    """The (prefix, new tokens) chunks of the step this member would run with vLLM's own budget
    (``max_tokens``): its decodes, then its prefills in queue order, the last one chunked at the
    budget. Sent to the peers with this member's spans: what they balance their steps against."""
    out, left = [], int(max_tokens)
    for c in sorted(work, key=lambda c: not c.decode):  # decodes first, each kind in queue order
        if left <= 0:
            break
        n = min(int(c.tokens), left)
        out.append((int(c.prefix), n))
        left -= n
    return out


def budget_for(scheduler: Any, peer_chunks: list[list[tuple[int, int]]], model: Any, min_tokens: int,
               work: list | None = None) -> int:
    """This member's next step budget against its peers' steps (the costliest of the chunk lists
    ``fresh_peer_chunks`` gives: each peer's latest step, and its wanted step where it sent one);
    ``work``: this member's queue where the caller has read it already."""
    from vllm_kunserve.policy.microbatch import step_budget

    target = max((sum(model.var_cost(int(p), int(c)) for p, c in chunks) for chunks in peer_chunks), default=0.0)
    work = queue_work(scheduler) if work is None else work
    return step_budget(work, model, target, min_tokens, int(scheduler.max_num_scheduled_tokens))


def _need(r: Any) -> Any:
    from vllm_kunserve.policy.admission import KvNeed

    left = int(getattr(r, "max_tokens", 0) or 0) - int(getattr(r, "num_output_tokens", 0))
    return KvNeed(int(r.num_tokens), max(0, left))


def admission_limit(scheduler: Any) -> int:
    """vLLM's admission limit (``max_num_active_reqs``) for this step under peak-aware admission:
    the requests in the model runner now plus the queued ones (in vLLM's order: those holding KV,
    then the waiting queue) whose start keeps every admitted request's KV within the capacity."""
    from vllm_kunserve.policy.admission import admit_count

    queued = [*getattr(scheduler, "kv_holding_waiting", ()), *scheduler.waiting]
    pool = scheduler.kv_cache_manager.block_pool
    k = admit_count([_need(r) for r in scheduler.running], (_need(r) for r in queued),
                    int(pool.num_gpu_blocks) - 1, int(scheduler.block_size))  # block 0: vLLM's null block
    return len(scheduler.running) + int(getattr(scheduler, "num_waiting_for_streaming_input", 0)) + k


def admission_attr() -> str:
    """The scheduler attribute vLLM's admission into RUNNING reads."""
    if release() < (0, 31):  # vLLM 0.26-0.30: max_num_running_reqs (0.31 split max_num_active_reqs from it)
        return "max_num_running_reqs"
    return "max_num_active_reqs"


def _make() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    admit = admission_attr()

    class KunServeScheduler(Scheduler):
        """vLLM's scheduler; in a pipeline group, each step's token budget comes from the lookahead
        cost cut against the peers' steps (module doc)."""

        #: set by the engine agent: given this member's wanted step (sent on with its spans; None
        #: with ``lookahead.pace = "latest"``), returns the peers' latest and wanted step chunks while
        #: grouped, else None
        kunserve_pace: Callable[[list], list | None] | None = None
        #: set by the engine agent: whether the engine is in a pipeline group now
        kunserve_grouped: Callable[[], bool] | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            from vllm_kunserve.config import LookaheadConfig, engine_config
            from vllm_kunserve.policy.costmodel import CostModel, default_model

            cfg = engine_config(self.vllm_config)
            la = cfg.lookahead if cfg is not None else LookaheadConfig()   # no kunserve config: the defaults
            self.kunserve_step_min_tokens = la.step_min_tokens
            self.kunserve_lookahead = la.enable
            self.kunserve_send_wanted = la.pace == "wanted"
            self.kunserve_peak_admission = la.admission == "peak"
            self.kunserve_limits: list[int] = []  # the latest admission limits set (state, tests)
            self.kunserve_model = CostModel.load(la.cost_model) if la.cost_model else default_model()
            self.kunserve_budgets: list[int] = []  # the latest budgets set (state, tests)

        def schedule(self, *args: Any, **kwargs: Any):
            grouped = self.kunserve_grouped
            if grouped is None or not grouped():
                return super().schedule(*args, **kwargs)
            full, active = self.max_num_scheduled_tokens, getattr(self, admit)
            if self.kunserve_lookahead:
                pace = self.kunserve_pace
                # the queue is read before the pace call only to send the wanted step ("wanted");
                # with "latest" only a step with peers to balance against reads it (budget_for)
                work = queue_work(self) if pace is not None and self.kunserve_send_wanted else None
                peers = pace(None if work is None else wanted_step(work, full)) if pace is not None else None
                if peers:
                    budget = budget_for(self, peers, self.kunserve_model, self.kunserve_step_min_tokens, work)
                    self.kunserve_budgets.append(budget)
                    del self.kunserve_budgets[:-64]
                    self.max_num_scheduled_tokens = budget
            if self.kunserve_peak_admission and self.waiting:
                try:
                    limit = min(active, admission_limit(self))
                except Exception as exc:  # the step must not fail for admission: vLLM's own admits
                    logger.warning("kunserve: peak-aware admission off (%r); vLLM admits", exc)
                    self.kunserve_peak_admission = False
                else:
                    self.kunserve_limits.append(limit)
                    del self.kunserve_limits[:-64]
                    setattr(self, admit, limit)
            try:
                return super().schedule(*args, **kwargs)
            finally:
                self.max_num_scheduled_tokens = full
                setattr(self, admit, active)

    KunServeScheduler.__module__ = __name__
    KunServeScheduler.__qualname__ = "KunServeScheduler"
    return KunServeScheduler


_CLASS: list[type] = []


def __getattr__(name: str) -> Any:
    """``KunServeScheduler`` is built on first use (vLLM resolves ``scheduler_cls`` by name in the
    engine-core process): importing this module for the patch class does not import vLLM's
    scheduler into every process the plugin loads in."""
    if name == "KunServeScheduler":
        if not _CLASS:
            _CLASS.append(_make())
        return _CLASS[0]
    raise AttributeError(name)


def fresh_peer_chunks(steps: dict[str, tuple], now: float | None = None,
                      peers: Iterable[str] | None = None) -> list[list]:
    """For each peer whose latest step was seen within :data:`PACE_MAX_AGE_S`, the chunks this
    member balances against: the step it ran and the step it wanted (``(when, chunks, wanted)``:
    its queue under vLLM's budget, sent with its spans), where it sent one; with ``peers``, of
    those peers only (a member that left the group, or a span of it that arrived late, paces nothing).

    By their latest steps alone (``lookahead.pace = "latest"``, the default, where no peer sends a
    wanted step), members with prompts queued on both hold each other at ``lookahead.step_min_tokens`` of
    prefill per step (each cut at the other's cut): a queue of k short prompts takes k short steps
    where vLLM takes one longer one. ``"wanted"`` lifts that; at R1 on a CPU it bought no TTFT and
    cost 6% of TPOT (docs/benchmarks/burst_value_r1_xeon_pace_ablation.md)."""
    now = time.monotonic() if now is None else now
    keep = None if peers is None else set(peers)
    out = []
    for origin, entry in list(steps.items()):
        t, chunks = entry[0], entry[1]
        wanted = entry[2] if len(entry) > 2 else None
        if (keep is None or origin in keep) and now - t <= PACE_MAX_AGE_S:
            out.extend(c for c in (chunks, wanted) if c)  # the costlier of the two paces this member
    return out
