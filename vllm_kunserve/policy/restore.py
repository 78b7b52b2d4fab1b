"""Restore policy: split pipeline groups back into standalone instances when demand falls.

Rules (all thresholds from :class:`~vllm_kunserve.config.RestoreConfig` / ``DropConfig``):

* Hysteresis: restore only when demand (used + queued + forecast) stays below
  ``restore.threshold`` x the *undropped* capacity, a level that must lie below the drop trigger.
* Hold: the condition must hold continuously for ``restore.hold_s`` (tracked in :class:`RestoreState`,
  an immutable value the caller threads through successive calls).
* No flapping: a group is split only if the predicted usage after the split stays under the drop
  trigger both for the group's own instances (its requests must fit back in their base capacity)
  and cluster-wide (capacity shrinks by the restored weights). Groups are tried largest first.
* A group with an unhealthy instance is split at once from the host copy (a failed peer triggers
  restore, never lost requests), without waiting for the hold time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_kunserve.config import DropConfig, RestoreConfig
from vllm_kunserve.policy.overload import forecast_blocks
from vllm_kunserve.policy.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class RestoreState:
    below_since: float | None = None  # when demand last went under the restore threshold


@dataclass(frozen=True)
class GroupRestore:
    instances: tuple[int, ...]
    source: str  # "peer" or "host"
    reason: str  # "low_demand" or "failed_instance"
    restored_bytes: int


@dataclass(frozen=True)
class RestoreDecision:
    restore: tuple[GroupRestore, ...]
    reason: str
    demand_ratio: float  # demand / undropped capacity
    predicted_ratio: float  # demand / capacity after the chosen restores

    def to_dict(self) -> dict:
        return {"restore": [{"instances": list(g.instances), "source": g.source, "reason": g.reason,
                             "restored_bytes": g.restored_bytes} for g in self.restore],
                "reason": self.reason, "demand_ratio": self.demand_ratio,
                "predicted_ratio": self.predicted_ratio}


def check_thresholds(restore: RestoreConfig, drop: DropConfig) -> None:
    if restore.threshold >= drop.trigger_ratio:
        raise ValueError(f"restore.threshold={restore.threshold} must be below drop.trigger_ratio="
                         f"{drop.trigger_ratio} (hysteresis)")


def decide_restore(cluster: ClusterSnapshot, state: RestoreState = RestoreState(),
                   restore: RestoreConfig = RestoreConfig(), drop: DropConfig = DropConfig()
                   ) -> tuple[RestoreDecision, RestoreState]:
    """Which groups to split now, and the state to pass to the next call."""
    check_thresholds(restore, drop)
    model = cluster.model
    by_id = cluster.by_id()
    groups = [g for g in cluster.groups if len(g) > 1]
    demand = sum(i.kv_blocks_used + i.queued_blocks for i in cluster.instances)
    demand += forecast_blocks(cluster.demand_history, drop.forecast_horizon_s)
    base = cluster.base_capacity_blocks()
    cap_now = float(sum(i.kv_blocks_total for i in cluster.instances))
    ratio = demand / base if base > 0 else float("inf")

    def group_bytes(g):  # weight bytes the group must load back to run every member alone
        return sum((model.num_layers - by_id[i].held_layers(model.num_layers)) * model.layer_bytes for i in g)

    def shrink(g):  # blocks the group's capacity loses when every member holds every layer again
        return sum(by_id[i].kv_blocks_total - by_id[i].base_kv_blocks(model) for i in g)

    out: list[GroupRestore] = []
    cap = cap_now
    # failed instances: split immediately from the host copy
    for g in groups:
        if not all(by_id[i].healthy for i in g):
            out.append(GroupRestore(tuple(g), "host", "failed_instance", group_bytes(g)))
            cap -= shrink(g)
    failed = {r.instances for r in out}
    rest = [g for g in groups if tuple(g) not in failed]

    if not restore.enable or not rest:
        return _decision(out, "disabled" if not restore.enable else "nothing_dropped", ratio, demand, cap), state
    if ratio >= restore.threshold:
        return _decision(out, "demand_above_threshold", ratio, demand, cap), RestoreState(None)
    since = state.below_since if state.below_since is not None else cluster.now_s
    new_state = replace(state, below_since=since)
    if cluster.now_s - since < restore.hold_s:
        return _decision(out, "holding", ratio, demand, cap), new_state

    source = restore.source if restore.source != "auto" else ("peer" if len(cluster.instances) > 1 else "host")
    for g in sorted(rest, key=lambda g: (-len(g), min(g))):
        members = [by_id[i] for i in g]
        g_demand = sum(m.kv_blocks_used + m.queued_blocks for m in members)
        g_base = sum(m.base_kv_blocks(model) for m in members)
        after = cap - shrink(g)
        if g_base <= 0 or g_demand / g_base >= drop.trigger_ratio:
            continue  # its requests would not fit back: splitting would re-trigger a drop here
        if after <= 0 or demand / after >= drop.trigger_ratio:
            continue
        cap = after
        out.append(GroupRestore(tuple(g), source, "low_demand", group_bytes(g)))
    # restoring resets the hold clock: the next split must again wait for hold_s
    return _decision(out, "restore" if out else "would_retrigger", ratio, demand, cap), \
        (RestoreState(None) if out else new_state)


def _decision(out, reason, ratio, demand, cap) -> RestoreDecision:
    return RestoreDecision(tuple(out), reason, ratio, demand / cap if cap > 0 else float("inf"))
