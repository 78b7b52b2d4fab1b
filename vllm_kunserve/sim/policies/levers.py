"""All three together: remap on each engine, cluster drop over the fleet, MELL placement at the front,
ordered by ``policy.levers.decide_levers`` (the controller the fleet runs).

Each period every lone server runs the engine agent's remap decision (``policy.remap.decide_remap``
over ``policy.inputs.remap_input``, timed as :class:`OneirosPolicy` times it), then the fleet's lever
order decides over the cluster snapshot with each lone server's remap room
(``policy.remap.remap_room``): a due drop waits while that room covers the shortfall (for at most
``drop.remap_first_s``), else it goes ahead as :class:`KunServePolicy` carries it out; restores
likewise. Placement is the dispatch rule (``mell`` by default here).

What the simulator leaves out: a remapped server that joins a group keeps no streamed layers in the
group (the fleet's engine keeps streaming those it still runs: a little more KV, and their copies),
and one that leaves a group comes back at its base (the fleet's comes back remapped by those layers,
then reverts by its own rule). Both make the simulated group hold slightly less than the fleet's.
"""

from __future__ import annotations

from dataclasses import replace

from vllm_kunserve.policy.levers import LeverState, decide_levers
from vllm_kunserve.policy.remap import remap_room

from .. import adapters
from .kunserve import KunServePolicy
from .oneiros import OneirosPolicy


class LeversPolicy(KunServePolicy):
    name = "levers"

    def __init__(self, config=None, dispatch: str = "mell", copy_overlap: bool = True, **kw):
        super().__init__(config, dispatch, **kw)
        self.remap = OneirosPolicy(config, dispatch, copy_overlap=copy_overlap)
        self.remap.rcfg = replace(self.remap.rcfg, enable=True)   # the three levers: remap is one of them
        self.lstate = LeverState()
        self.levers: list[dict] = []   # (time, lever) each time the lever changes, for the replay

    def on_tick(self, sim) -> None:
        if sim._pending is not None:
            return
        room = {}
        for s in sim.servers:
            if s.k == 1 and s.alive:   # the agents of lone servers remap; a group's members do not
                room[s.instances[0]] = remap_room(self.remap.step_server(sim, s), sim.cfg.pcie.bandwidth_bytes_per_s,
                                                  self.remap.rcfg, self.remap.copy_overlap)
        dec, self.lstate = decide_levers(adapters.cluster_snapshot(sim), self.lstate, self.cfg.drop,
                                         self.cfg.restore, remap_room=room, history_s=self.history_s,
                                         allow_restore=self.restore_on, regroup=self.regroup)
        if not self.levers or self.levers[-1]["lever"] != dec.lever:
            self.levers.append({"t": round(sim.now, 3), "lever": dec.lever, **dec.to_dict()})
            sim.log("lever", **dec.to_dict())
        if dec.lever == "drop":
            self._drop(sim, dec.monitor.drop, dec.monitor.overload.need_bytes)
        elif dec.lever == "restore":
            self._restore(sim, dec.monitor.restore)

    def describe(self) -> dict:
        return {**super().describe(), "levers": "policy.levers.decide_levers", "remap": "policy.remap.decide_remap"}
