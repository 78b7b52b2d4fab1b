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
* Step by step (with ``drop.regroup``, the switch for live groups changing shape): a group of four or
  more whose requests would not fit back in its members alone, but would in two smaller groups,
  splits into those halves (:func:`halves`): members alternate by pipeline stage, so each keeps the
  layers it holds and takes back the ones its half needs. Each member first drains to its block
  count in its half; the halves may split further once the hold time has passed again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_kunserve.config import DropConfig, RestoreConfig
from vllm_kunserve.policy.drop import balanced_stages
from vllm_kunserve.policy.overload import forecast_blocks
from vllm_kunserve.policy.snapshot import ClusterSnapshot, InstanceSnapshot, ModelSpec


@dataclass(frozen=True)
class RestoreState:
    below_since: float | None = None  # when demand last went under the restore threshold


@dataclass(frozen=True)
class GroupRestore:
    instances: tuple[int, ...]
    source: str  # "peer" or "host"
    reason: str  # "low_demand", "low_demand_step" (into halves) or "failed_instance"
    restored_bytes: int
    # a step (``drop.regroup``): the smaller groups it splits into, each member's (lo, hi) layers in
    # its half and its own block count there (what it drains to first); () where every member goes alone
    into: tuple[tuple[int, ...], ...] = ()
    stages: tuple[tuple[int, int, int], ...] = ()   # (instance, lo, hi)
    blocks: tuple[tuple[int, int], ...] = ()        # (instance, blocks)


@dataclass(frozen=True)
class RestoreDecision:
    restore: tuple[GroupRestore, ...]
    reason: str
    demand_ratio: float  # demand / undropped capacity
    predicted_ratio: float  # demand / capacity after the chosen restores

    def to_dict(self) -> dict:
        return {"restore": [{"instances": list(g.instances), "source": g.source, "reason": g.reason,
                             "restored_bytes": g.restored_bytes,
                             **({"into": [list(p) for p in g.into], "stages": [list(x) for x in g.stages],
                                 "blocks": dict(g.blocks)} if g.into else {})} for g in self.restore],
                "reason": self.reason, "demand_ratio": self.demand_ratio,
                "predicted_ratio": self.predicted_ratio}


def check_thresholds(restore: RestoreConfig, drop: DropConfig) -> None:
    if restore.threshold >= drop.trigger_ratio:
        raise ValueError(f"restore.threshold={restore.threshold} must be below drop.trigger_ratio="
                         f"{drop.trigger_ratio} (hysteresis)")


def halves(group: tuple[int, ...], by_id: dict[int, InstanceSnapshot], model: ModelSpec
           ) -> tuple[tuple[tuple[int, ...], ...], dict[int, tuple[int, int]], dict[int, int]]:
    """A group's step down: two smaller groups, each member's layers there and its own block count.

    Members alternate by the first layer they hold (stages 0, 2, 4 ... and 1, 3, 5 ...), and each
    half's balanced stages go to its members in that order: where the layers divide evenly, every
    member's new range contains the one it holds (nothing it holds is given up). A member's block
    count is what it has now less the bytes of the layers it takes back, the half running at its
    smallest member's count (a member holds every half-member's KV over its layers: the same
    area as before, over half the owners and twice the layers); never below its base."""
    order = sorted(group, key=lambda i: (by_id[i].layer_start, i))
    parts = (tuple(order[0::2]), tuple(order[1::2]))
    stages, blocks = {}, {}
    for part in parts:
        for i, rg in zip(part, balanced_stages(model.num_layers, len(part))):
            stages[i] = rg
        each = min(by_id[i].kv_blocks_total - (stages[i][1] - stages[i][0] - by_id[i].held_layers(model.num_layers))
                   * model.layer_bytes / model.block_bytes for i in part)
        blocks.update((i, int(max(each, by_id[i].base_kv_blocks(model)))) for i in part)
    return tuple(tuple(sorted(p)) for p in parts), stages, blocks


def decide_restore(cluster: ClusterSnapshot, state: RestoreState = RestoreState(),
                   restore: RestoreConfig = RestoreConfig(), drop: DropConfig = DropConfig(),
                   regroup: bool | None = None) -> tuple[RestoreDecision, RestoreState]:
    """Which groups to split now, and the state to pass to the next call. ``regroup`` (default
    ``drop.regroup``) lets a group split step by step (:func:`halves`)."""
    regroup = drop.regroup if regroup is None else regroup
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

    def demand_of(part):
        return sum(by_id[i].kv_blocks_used + by_id[i].queued_blocks for i in part)

    for g in sorted(rest, key=lambda g: (-len(g), min(g))):
        g_base = sum(by_id[i].base_kv_blocks(model) for i in g)
        after = cap - shrink(g)
        if g_base > 0 and demand_of(g) / g_base < drop.trigger_ratio \
                and after > 0 and demand / after < drop.trigger_ratio:
            cap = after
            out.append(GroupRestore(tuple(g), source, "low_demand", group_bytes(g)))
            continue
        if not regroup or len(g) < 4:
            continue  # its requests would not fit back alone: splitting would re-trigger a drop
        parts, stages, blocks = halves(tuple(g), by_id, model)   # one step down instead
        after = cap - sum(by_id[i].kv_blocks_total - blocks[i] for i in g)
        if any(demand_of(p) / sum(blocks[i] for i in p) >= drop.trigger_ratio for p in parts) \
                or after <= 0 or demand / after >= drop.trigger_ratio:
            continue
        cap = after
        back = sum(max(0, stages[i][1] - stages[i][0] - by_id[i].held_layers(model.num_layers)) for i in g)
        out.append(GroupRestore(tuple(g), source, "low_demand_step", back * model.layer_bytes, into=parts,
                                stages=tuple((i, *stages[i]) for i in sorted(g)),
                                blocks=tuple(sorted(blocks.items()))))
    # restoring resets the hold clock: the next split must again wait for hold_s
    return _decision(out, "restore" if out else "would_retrigger", ratio, demand, cap), \
        (RestoreState(None) if out else new_state)


def _decision(out, reason, ratio, demand, cap) -> RestoreDecision:
    return RestoreDecision(tuple(out), reason, ratio, demand / cap if cap > 0 else float("inf"))
