"""KunServe: drop replicated parameters under overload, run merged instances as pipeline groups,
exchange KV instead of recomputing it, restore weights when demand falls.

Every decision is the policy package's: ``policy.monitor.monitor_tick`` (demand history, then
``assess_overload`` and ``plan_drop`` or ``decide_restore``: hysteresis, hold time, no re-trigger),
the controller the fleet runs (``cluster.control.groups``), and the lookahead microbatcher. Like the fleet, a
drop merges lone instances only unless ``drop.regroup`` (or ``regroup=True``) lets it merge live groups
further. The simulator only times the mechanisms:

* drop: weights are unmapped at once; every running request's KV for the layers an instance gives up
  moves to the new owner over the instance link. With coordinated exchange the group keeps running
  while KV streams in chunks sized to about one pipeline stage, so only the first chunk stalls it;
  without it the group waits for the whole exchange.
* regroup (a live group merged into a larger one), as the fleet carries it out (``group_restage``,
  the paper's Fig. 6): the KV stays, each (request owner, layer) range moving to the member that
  holds the layer in the larger group, timed as a drop's exchange; the plan keeps every member on a
  sub-range of the layers it holds, so nothing reloads. With ``regroup_keeps_kv=False`` the fleet's
  fallback instead (a restage that failed, or ``drop.transition: reprefill``): the live group's
  members load their dropped layers back from the host copies (PCIe) and its running requests are
  computed again on the new group; lone instances in the merge exchange as above.
* restore: the group's capacity shrinks back at once (the decision guarantees its KV fits), the
  dropped layers load from a peer (link) or the host copy (PCIe) while the group keeps serving, and
  then the group splits; each request's KV gathers on one instance (again chunked, or a full stall).
  A step down (with ``regroup``: a group of four or more into halves, ``policy.restore.halves``) is
  timed the same way, into the halves, half of each request's KV moving.
"""

from __future__ import annotations

from vllm_kunserve.config import KunServeConfig
from vllm_kunserve.policy.monitor import MonitorState, monitor_tick

from .. import adapters
from .base import DEFAULT_DISPATCH, Policy


class KunServePolicy(Policy):
    name = "kunserve"

    def __init__(self, config: KunServeConfig | None = None, dispatch: str = DEFAULT_DISPATCH,
                 lookahead: bool = True, exchange: bool = True, restore: bool = True,
                 cost_model=None, history_s: float = 20.0, regroup: bool | None = None,
                 regroup_keeps_kv: bool = True):
        super().__init__(dispatch)
        self.cfg = config or KunServeConfig()
        self.tick_s = self.cfg.drop.check_interval_s
        self.lookahead = lookahead and self.cfg.lookahead.enable
        self.peak_admission = self.cfg.lookahead.admission == "peak"
        self.exchange = exchange
        self.restore_on = restore and self.cfg.restore.enable
        self.cost_model = cost_model  # policy CostModel the microbatcher balances (None: from step time)
        self._cm_fitted = None
        self.history_s = history_s
        self.regroup = self.cfg.drop.regroup if regroup is None else regroup
        self.regroup_keeps_kv = regroup_keeps_kv
        self.mstate = MonitorState()
        self.microbatch = self._microbatch

    # ---- microbatches ----------------------------------------------------------------------------
    def _microbatch(self, server, pairs):
        return adapters.policy_microbatches(pairs, server.k, self._cm(server), self.cfg.lookahead.min_tokens,
                                            self.lookahead)

    def _cm(self, server):
        if self._cm_fitted is None:
            self._cm_fitted = self.cost_model or adapters.lookahead_costmodel(server.step_time)
        return self._cm_fitted

    # ---- monitor ---------------------------------------------------------------------------------
    def on_tick(self, sim) -> None:
        if sim._pending is not None:
            return
        dec, self.mstate = monitor_tick(adapters.cluster_snapshot(sim), self.mstate, self.cfg.drop,
                                        self.cfg.restore, history_s=self.history_s, allow_restore=self.restore_on,
                                        regroup=self.regroup)
        if dec.action == "drop":
            self._drop(sim, dec.drop, dec.overload.need_bytes)
        elif dec.action == "restore":
            self._restore(sim, dec.restore)

    def _drop(self, sim, plan, need_bytes: float) -> None:
        changed = [g for g in plan.groups if getattr(g, "changed", True)]
        if not changed:
            return
        by_inst = {i: s for s in sim.servers for i in s.instances}
        old = list({id(by_inst[i]): by_inst[i] for g in changed for i in g.instances}.values())
        layers = {st.instance_id: (st.layer_start, st.layer_end) for g in changed for st in g.stages}
        # KV exchange: each instance sends its requests' KV of the layers it gives up; it unmaps
        # the weights of the layers it drops (those it held before and does not keep)
        L = sim.cfg.model.layers
        lb = sim.cfg.model.layer_bytes
        # live groups merged further: restaged keeping the KV (the fleet's), or dissolved and recomputed
        regrouped = [s for s in old if s.k > 1 and not self.regroup_keeps_kv]
        sends, unmapped, reload = {}, {}, {}
        for s in old:
            dissolved = s in regrouped
            per_inst = 0.0 if dissolved else s.used * sim.cfg.block_bytes / s.k
            for i in s.instances:
                lo, hi = layers[i]
                sends[i] = per_inst * (1 - (hi - lo) / L)
                plo, phi = (0, L) if dissolved else sim.layer_range[i]
                reload[i] = (L - (sim.layer_range[i][1] - sim.layer_range[i][0])) * lb if dissolved else 0.0
                kept = max(0, min(hi, phi) - max(lo, plo))
                unmapped[i] = (phi - plo - kept) * lb
        send = max(sends.values(), default=0.0)
        k = max(len(g.instances) for g in changed)

        def stall() -> float:  # evaluated when the old servers have ended their steps
            return (max(sim.cfg.pcie.time_s(reload[i]) + sim.unmap_time(unmapped[i]) for i in unmapped)
                    + self._exchange_stall(sim, sends, k))

        sim.transition(old, [tuple(g.instances) for g in changed], layers, stall, "drop", recompute=regrouped)
        sim.log("drop_plan", need_bytes=need_bytes, freed_bytes=plan.freed_bytes,
                satisfied=plan.satisfied, exchange_bytes=send,
                live_merged=[list(s.instances) for s in old if s.k > 1],   # live groups merged further
                regrouped=[list(s.instances) for s in regrouped],          # of those, dissolved (KV recomputed)
                unmap_bytes=max(unmapped.values(), default=0.0))

    def _exchange_stall(self, sim, sends: dict[int, float], k: int) -> float:
        """Stall of a KV exchange where instance ``i`` sends ``sends[i]`` bytes, all starting now:
        the whole exchange without coordination; with it, the KV streams in chunks of about one
        pipeline stage and only the first chunk stalls (the rest keeps the ports busy)."""
        sends = {i: b for i, b in sends.items() if b > 0}
        if not sends:
            return 0.0
        if not self.exchange:
            full = max(sim.bulk_time(i, b) for i, b in sends.items())
            sim.log("exchange", bytes_per_instance=round(max(sends.values())), full_s=round(full, 6),
                    stall_s=round(full, 6))
            return full
        stage = adapters.typical_stage_time(sim, k)
        chunk = adapters.transfer_chunk_bytes(sim.cfg.link, stage)
        first = max(sim.chunk_time(i, min(b, chunk)) for i, b in sends.items())
        full = max(sim.bulk_time(i, b) for i, b in sends.items())  # the stream occupies the ports
        sim.log("exchange", bytes_per_instance=round(max(sends.values())), full_s=round(full, 6),
                stall_s=round(min(full, first), 6))
        return min(full, first)

    def _restore(self, sim, dec) -> None:
        by_inst = {i: s for s in sim.servers for i in s.instances}
        for g in dec.restore:
            s = by_inst.get(g.instances[0])
            if s is None or s.frozen or s.k == 1:
                continue
            layers = {i: (lo, hi) for i, lo, hi in g.stages} or {i: (0, sim.cfg.model.layers) for i in s.instances}
            into = g.into or tuple((i,) for i in s.instances)   # a step down into halves, or every member alone
            base = sum(sim.capacity_blocks(p, layers) for p in into)
            s.capacity = max(s.used, min(s.capacity, base))
            per_inst = max(g.restored_bytes / s.k, 0.0)
            if g.source == "host":
                load_s = sim.cfg.pcie.time_s(per_inst)
            else:  # each member receives the layers it lacks from the others (all-to-all)
                load_s = max(sim.bulk_time(i, per_inst) for i in s.instances)
            load_s += sim.unmap_time(per_inst)  # mapping the pages back as weights
            # each request's KV held by members outside its owner's new group moves: all but its
            # owner's share alone, half of it into halves
            moved = (1 - 1 / s.k) if not g.into else 0.5
            kv = s.used * sim.cfg.block_bytes * moved / s.k
            k = s.k
            stall = lambda: self._exchange_stall(sim, {i: kv for i in s.instances}, k)  # noqa: E731
            sim.log("restore_start", instances=list(s.instances), source=g.source, load_s=round(load_s, 6),
                    into=[list(p) for p in g.into] or None)
            sim.at(sim.now + load_s, self._split, sim, s, into, layers, stall)
            break  # one transition at a time

    def _split(self, sim, s, into, layers, stall) -> None:
        if not s.alive:
            return
        if sim._pending is not None:  # another transition is under way: retry shortly
            sim.at(sim.now + 0.05, self._split, sim, s, into, layers, stall)
            return
        sim.transition([s], list(into), layers, stall, "restore")

    def describe(self) -> dict:
        return {**super().describe(), "lookahead": self.lookahead,
                "microbatcher": "policy.microbatch." + ("lookahead" if self.lookahead else "token_count"),
                "exchange": self.exchange, "restore": self.restore_on, "regroup": self.regroup,
                "regroup_keeps_kv": self.regroup_keeps_kv,
                "admission": self.cfg.lookahead.admission}
