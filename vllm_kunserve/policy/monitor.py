"""The overload monitor: each period, decide from the cluster's demand history whether to drop
(merge instances into pipeline groups), restore (split groups back) or do nothing.

This is the one controller of cluster drop: the fleet (``cluster.control.groups.GroupController``) and the
simulator (``sim.policies.kunserve``) each build a :class:`ClusterSnapshot` every period and thread
a :class:`MonitorState` through :func:`monitor_tick`; they only carry its decision out (the fleet
through the engines' control ports, the simulator by timing the transition). The tick records the
cluster's demand, keeps the last ``history_s`` of it for the forecast, and returns what to do:

* ``drop`` when :func:`assess_overload` finds the cluster overloaded and drop is enabled, with the
  :func:`plan_drop` plan for what must be freed (the restore hold starts over), unless the join is
  *deferred*: the instances it would group have requests waiting for their first token, their KV
  is not short yet (demand below capacity) and the deferral has not lasted
  ``drop.defer_for_first_token_s``; then ``none``, with the plan and the reason (a join stalls its
  members for its length: those requests would pay it in TTFT, decoding ones once in a stream);
* else ``restore`` when some group may split (:func:`decide_restore`: hysteresis, hold time, no
  re-trigger; a group with an unhealthy member splits at once, restore enabled or not);
* else ``none`` (with the restore decision where one was asked for, for status).

Where the fleet and the simulator used to decide differently (issue 35), what was kept and why:

* The demand sample is recorded *before* the assessment, so the forecast's trend ends at the
  reading being judged (the fleet appended it after and forecast one period late).
* A drop restarts the restore hold: demand that was over the trigger has not stayed below the
  restore threshold, and a group just formed must wait ``restore.hold_s`` before it may split (the
  fleet kept the clock of before the drop).
* Live groups change shape only with ``drop.regroup`` (or ``regroup=True``): a drop may merge them
  further, and a restore may split a group of four or more into halves where its requests would not
  fit back in its members alone (``policy.restore.halves``). The fleet carries both out keeping
  every request's KV (``cluster.control.groups``: ``group_restage``), and falls back to recomputing
  where that fails, so it stays the operator's choice until measured under a real burst. (Before,
  the fleet planned with live groups and skipped the plan's groups that touched one, so a plan
  counted bytes it never freed and merged no lone instances instead.) The simulator follows the
  same setting and times both as the fleet carries them out.
* The history is a time window (``history_s``, 20 s; the request-mix readings keep at least
  ``drop.decode_share_window_s``), not a sample count (the fleet kept 256 samples): the forecast
  reads 10 s of it, so any window of at least that decides the same at every monitor period.
* The recorded demand is the healthy instances' (what :func:`assess_overload` divides by their
  capacity); the simulator has no unhealthy instances, so its decisions are unchanged by it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_kunserve.config import DropConfig, RestoreConfig
from vllm_kunserve.policy.drop import DropPlan, plan_drop
from vllm_kunserve.policy.overload import OverloadReport, assess_overload
from vllm_kunserve.policy.restore import RestoreDecision, RestoreState, decide_restore
from vllm_kunserve.policy.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class MonitorState:
    history: tuple[tuple[float, float], ...] = ()  # (time_s, cluster demand blocks), oldest first
    restore: RestoreState = RestoreState()
    work: tuple[tuple[float, int, int], ...] = ()  # (time_s, decode, prefill tokens to compute), oldest first
    deferred_since: float | None = None  # when the drop now waiting for first tokens was first due


@dataclass(frozen=True)
class MonitorDecision:
    action: str  # "drop" | "restore" | "none"
    cluster: ClusterSnapshot  # the snapshot with the demand history the decision used
    overload: OverloadReport
    drop: DropPlan | None = None
    restore: RestoreDecision | None = None  # the restore decision, wherever one was asked for
    deferred: str = ""  # why a due drop waits (action "none", with its plan in ``drop``)


def record_demand(history: tuple[tuple[float, float], ...], now_s: float, demand_blocks: float,
                  history_s: float) -> tuple[tuple[float, float], ...]:
    """``history`` plus the sample ``(now_s, demand_blocks)``, without samples older than ``history_s``."""
    return tuple(h for h in (*history, (now_s, demand_blocks)) if h[0] >= now_s - history_s)


def monitor_tick(cluster: ClusterSnapshot, state: MonitorState = MonitorState(), drop: DropConfig = DropConfig(),
                 restore: RestoreConfig = RestoreConfig(), *, history_s: float = 20.0,
                 allow_restore: bool = True, regroup: bool | None = None) -> tuple[MonitorDecision, MonitorState]:
    """One monitor period over ``cluster`` (its demand and work histories are replaced by the state's).

    ``allow_restore=False`` never splits a group (the simulator's no-restore ablation);
    ``regroup`` (default ``drop.regroup``) lets a drop merge live groups further and a restore split a group
    step by step (see the module docstring)."""
    demand = float(sum(i.kv_blocks_used + i.queued_blocks for i in cluster.instances if i.healthy))
    history = record_demand(state.history, cluster.now_s, demand, history_s)
    past = tuple(w for w in state.work if w[0] >= cluster.now_s - max(history_s, drop.decode_share_window_s))
    snap = replace(cluster, demand_history=history, work_history=past)
    work = (*past, snap.work_now())
    rep = assess_overload(snap, drop)
    if rep.overloaded and drop.enable:
        plan = plan_drop(snap, rep.need_bytes, drop.max_group_size,
                         regroup=drop.regroup if regroup is None else regroup)
        why = deferral(snap, plan, rep, drop, state.deferred_since)
        if why:
            since = cluster.now_s if state.deferred_since is None else state.deferred_since
            return (MonitorDecision("none", snap, rep, drop=plan, deferred=why),
                    MonitorState(history, RestoreState(), work, since))
        return MonitorDecision("drop", snap, rep, drop=plan), MonitorState(history, RestoreState(), work)
    rstate, dec = state.restore, None
    grouped = [g for g in snap.groups if len(g) > 1]
    sick = {i.instance_id for i in snap.instances if not i.healthy}
    if allow_restore and grouped and (restore.enable or any(sick.intersection(g) for g in grouped)):
        dec, rstate = decide_restore(snap, rstate, restore, drop, regroup=regroup)
        if dec.restore:
            return MonitorDecision("restore", snap, rep, restore=dec), MonitorState(history, rstate, work)
    return MonitorDecision("none", snap, rep, restore=dec), MonitorState(history, rstate, work)


def deferral(cluster: ClusterSnapshot, plan: DropPlan, rep: OverloadReport, drop: DropConfig,
             since: float | None) -> str:
    """Why the drop ``plan`` should wait this period, or "" to carry it out now: it waits while
    the instances it groups have requests with no first token yet, as long as the KV is not short
    (the demand below capacity, the cluster's and each of those instances') and for at most
    ``drop.defer_for_first_token_s`` from ``since`` (when it was first due; None: now)."""
    if drop.defer_for_first_token_s <= 0 or rep.demand_blocks >= rep.capacity_blocks:
        return ""
    if since is not None and cluster.now_s - since >= drop.defer_for_first_token_s:
        return ""
    members = {i for g in plan.groups for i in g.instances}
    if any(d.ratio >= 1.0 for d in rep.instances if d.instance_id in members):
        return ""
    waiting = sum(i.awaiting_first_token for i in cluster.instances if i.instance_id in members and i.healthy)
    if not waiting:
        return ""
    return (f"{waiting} requests on {sorted(members)} await their first token; KV demand "
            f"{rep.demand_blocks:.0f} of {rep.capacity_blocks:.0f} blocks")


__all__ = ["MonitorDecision", "MonitorState", "deferral", "monitor_tick", "record_demand"]
