"""The order of the levers: which one the fleet pulls first when KV demand rises, and which it lets go first.

Three techniques may run on the same engines (remap on each engine, cluster drop over the fleet,
MELL placement at the front). They pull on different things and cost different amounts:

* **placement** (MELL, ``policy.dispatch.mell``): where each new request goes, and bounded migrations
  (``policy.migration``). It adds no memory; it runs at every request and every migration period,
  whatever the other two do, so it is not a step of this order.
* **remap** (Oneiros, ``policy.remap``): an engine streams some of its own layers from host memory and
  their weight memory becomes KV. Local (no other engine stops), and free per step where the link
  hides the copies; each engine's agent decides it from its own load. Its room is bounded by what
  the link hides (``policy.remap.remap_room``).
* **cluster drop** (KunServe, ``policy.monitor``): engines merge into pipeline groups and drop
  replicated layers. It frees the most memory but stalls the members for the join and adds a hop
  to every step of the group (TPOT about 1.3x on the CPU).

Up: remap first, then drop. When the monitor's drop is due (:func:`policy.monitor.monitor_tick`),
:func:`decide_levers` holds it while the lone engines' remap room covers the shortfall (the blocks
the drop would have to free), for at most ``drop.remap_first_s`` from when it was first due; the
engines remap meanwhile (their agents see the same shortage). Where the room is short, or the wait
is over (a remap failed, or the engines' shortage was under their own watermark), the drop goes
ahead: a remapped engine joins keeping the streamed layers it still runs (``memory.residency.join``).

Down: the reverse. A group splits first (the monitor's restore: hysteresis and hold); an engine in a
group never reverts its remap, and one that leaves a group remapped reverts by its own rule after
(``remap.low_watermark`` held for ``remap.revert_hold_s``). So what costs the most per step is let
go first and the cheap local lever last.

The fleet (``cluster.control.groups.GroupController``) and the simulator (``sim.policies.levers``)
both call :func:`decide_levers` each monitor period; with no remap room anywhere it decides exactly
what ``monitor_tick`` decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from vllm_kunserve.config import DropConfig, RestoreConfig
from vllm_kunserve.policy.monitor import MonitorDecision, MonitorState, monitor_tick
from vllm_kunserve.policy.snapshot import ClusterSnapshot

@dataclass(frozen=True)
class LeverState:
    monitor: MonitorState = MonitorState()
    remap_since: float | None = None  # when the drop now waiting for the engines' remap was first due


@dataclass(frozen=True)
class LeverDecision:
    lever: str  # "remap" (a due drop waits: the engines remap) | "drop" | "restore" | "none"
    monitor: MonitorDecision  # the monitor's decision (its drop plan when the lever is remap)
    room_blocks: float  # the lone engines' remap room, in blocks
    need_blocks: float  # what the drop would free, in blocks (0 when none is due)
    reason: str = ""

    def to_dict(self) -> dict:
        return {"lever": self.lever, "room_blocks": round(self.room_blocks, 1),
                "need_blocks": round(self.need_blocks, 1), "reason": self.reason}


def decide_levers(cluster: ClusterSnapshot, state: LeverState = LeverState(), drop: DropConfig = DropConfig(),
                  restore: RestoreConfig = RestoreConfig(), *, remap_room: Mapping[int, float] | None = None,
                  **monitor_kw) -> tuple[LeverDecision, LeverState]:
    """One period of the fleet's controller. ``remap_room``: instance id -> bytes its own remap could
    still give its KV (:func:`policy.remap.remap_room`; only lone, healthy instances count: a grouped
    engine does not remap). ``monitor_kw`` goes to :func:`monitor_tick`."""
    dec, mstate = monitor_tick(cluster, state.monitor, drop, restore, **monitor_kw)
    grouped = {i for g in cluster.groups if len(g) > 1 for i in g}
    lone = {i.instance_id for i in cluster.instances if i.healthy and i.instance_id not in grouped}
    bb = max(1, cluster.model.block_bytes)
    room = sum(float(b) for i, b in (remap_room or {}).items() if i in lone and b > 0) / bb
    if dec.action != "drop":
        if dec.action == "none" and dec.deferred:   # the drop is due but waits for first tokens: the remap
            # wait, where one started, goes on counting
            return LeverDecision("none", dec, room, 0.0, dec.deferred), LeverState(mstate, state.remap_since)
        return LeverDecision(dec.action, dec, room, 0.0), LeverState(mstate, None)
    need = float(dec.overload.need_blocks)
    since = state.remap_since if state.remap_since is not None else cluster.now_s
    waited = cluster.now_s - since
    if drop.remap_first_s > 0 and room >= need and waited < drop.remap_first_s:
        why = (f"remap first: the engines' remap room of {room:.0f} blocks covers the {need:.0f} the drop "
               f"would free (waited {waited:.1f} of {drop.remap_first_s:.0f} s)")
        # the drop stays due: the restore hold starts over as for a drop (the monitor's state)
        return LeverDecision("remap", dec, room, need, why), LeverState(mstate, since)
    why = ""
    if room > 0 or state.remap_since is not None:
        why = (f"the engines' remap room of {room:.0f} blocks is short of the {need:.0f} the drop frees"
               if room < need else f"the remap did not cover it within {drop.remap_first_s:.0f} s")
    return LeverDecision("drop", dec, room, need, why), LeverState(mstate, None)


__all__ = ["LeverDecision", "LeverState", "decide_levers"]
