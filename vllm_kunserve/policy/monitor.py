"""The overload monitor: each period, decide from the cluster's demand history whether to drop
(merge instances into pipeline groups), restore (split groups back) or do nothing.

The caller (the cluster controller, the simulator) builds a :class:`ClusterSnapshot` each period
and threads a :class:`MonitorState` through :func:`monitor_tick`; the tick records the cluster's
demand, keeps the last ``history_s`` of it for the forecast, and returns what to do:

* ``drop`` when :func:`assess_overload` finds the cluster overloaded and drop is enabled, with the
  :func:`plan_drop` plan for what must be freed (the restore hold starts over);
* else ``restore`` when some group may split (:func:`decide_restore`: hysteresis, hold time, no
  re-trigger) and restore is enabled;
* else ``none``.
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


@dataclass(frozen=True)
class MonitorDecision:
    action: str  # "drop" | "restore" | "none"
    cluster: ClusterSnapshot  # the snapshot with the demand history the decision used
    overload: OverloadReport
    drop: DropPlan | None = None
    restore: RestoreDecision | None = None


def record_demand(history: tuple[tuple[float, float], ...], now_s: float, demand_blocks: float,
                  history_s: float) -> tuple[tuple[float, float], ...]:
    """``history`` plus the sample ``(now_s, demand_blocks)``, without samples older than ``history_s``."""
    return tuple(h for h in (*history, (now_s, demand_blocks)) if h[0] >= now_s - history_s)


def monitor_tick(cluster: ClusterSnapshot, state: MonitorState = MonitorState(), drop: DropConfig = DropConfig(),
                 restore: RestoreConfig = RestoreConfig(), *, history_s: float = 20.0,
                 allow_restore: bool = True) -> tuple[MonitorDecision, MonitorState]:
    """One monitor period over ``cluster`` (its ``demand_history`` is replaced by the state's)."""
    demand = float(sum(i.kv_blocks_used + i.queued_blocks for i in cluster.instances))
    history = record_demand(state.history, cluster.now_s, demand, history_s)
    past = tuple(w for w in state.work if w[0] >= cluster.now_s - max(history_s, drop.decode_share_window_s))
    snap = replace(cluster, demand_history=history, work_history=past)
    work = (*past, snap.work_now())
    rep = assess_overload(snap, drop)
    if rep.overloaded and drop.enable:
        plan = plan_drop(snap, rep.need_bytes, drop.max_group_size)
        return MonitorDecision("drop", snap, rep, drop=plan), MonitorState(history, RestoreState(), work)
    rstate = state.restore
    if allow_restore and restore.enable and any(len(g) > 1 for g in snap.groups):
        dec, rstate = decide_restore(snap, rstate, restore, drop)
        if dec.restore:
            return MonitorDecision("restore", snap, rep, restore=dec), MonitorState(history, rstate, work)
    return MonitorDecision("none", snap, rep), MonitorState(history, rstate, work)


__all__ = ["MonitorDecision", "MonitorState", "monitor_tick", "record_demand"]
