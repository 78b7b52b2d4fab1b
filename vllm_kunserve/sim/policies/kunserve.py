"""KunServe: drop replicated parameters under overload, run merged instances as pipeline groups,
exchange KV instead of recomputing it, restore weights when demand falls.

Every decision is the policy package's: ``policy.overload.assess_overload`` (demand vs capacity,
forecast), ``policy.drop.plan_drop`` (greedy merge of the smallest groups), ``policy.restore.
decide_restore`` (hysteresis, hold time, no re-trigger) and the lookahead microbatcher. The
simulator only times the mechanisms:

* drop: weights are unmapped at once; every running request's KV for the layers an instance gives up
  moves to the new owner over the instance link. With coordinated exchange the group keeps running
  while KV streams in chunks sized to about one pipeline stage, so only the first chunk stalls it;
  without it the group waits for the whole exchange.
* restore: the group's capacity shrinks back at once (the decision guarantees its KV fits), the
  dropped layers load from a peer (link) or the host copy (PCIe) while the group keeps serving, and
  then the group splits; each request's KV gathers on one instance (again chunked, or a full stall).
"""

from __future__ import annotations

from vllm_kunserve.config import KunServeConfig
from vllm_kunserve.policy.drop import plan_drop
from vllm_kunserve.policy.overload import assess_overload
from vllm_kunserve.policy.restore import RestoreState, decide_restore

from .. import adapters
from .base import DEFAULT_DISPATCH, Policy


class KunServePolicy(Policy):
    name = "kunserve"

    def __init__(self, config: KunServeConfig | None = None, dispatch: str = DEFAULT_DISPATCH,
                 lookahead: bool = True, exchange: bool = True, restore: bool = True,
                 cost_model=None, history_s: float = 20.0):
        super().__init__(dispatch)
        self.cfg = config or KunServeConfig()
        self.tick_s = self.cfg.drop.check_interval_s
        self.lookahead = lookahead and self.cfg.lookahead.enable
        self.exchange = exchange
        self.restore_on = restore and self.cfg.restore.enable
        self.cost_model = cost_model  # policy CostModel the microbatcher balances (None: from step time)
        self._cm_fitted = None
        self.history: list[tuple[float, float]] = []
        self.history_s = history_s
        self.rstate = RestoreState()
        self.microbatch = self._microbatch
        self.lookahead_impl = adapters.lookahead_impl()

    # ---- microbatches ----------------------------------------------------------------------------
    def _microbatch(self, server, pairs):
        if self.lookahead_impl is None:  # policy.microbatch absent: token-count fallback
            return adapters.token_count_microbatches(pairs, server.k)
        return adapters.policy_microbatches(self.lookahead_impl, pairs, server.k, self._cm(server),
                                            self.cfg.lookahead.min_tokens, self.lookahead)

    def _cm(self, server):
        if self._cm_fitted is None:
            self._cm_fitted = self.cost_model or adapters.lookahead_costmodel(server.step_time)
        return self._cm_fitted

    # ---- monitor ---------------------------------------------------------------------------------
    def on_tick(self, sim) -> None:
        if sim._pending is not None:
            return
        demand = float(sum(s.demand_blocks() for s in sim.servers))
        self.history.append((sim.now, demand))
        while self.history and self.history[0][0] < sim.now - self.history_s:
            self.history.pop(0)
        snap = adapters.cluster_snapshot(sim, self.history)
        rep = assess_overload(snap, self.cfg.drop)
        if rep.overloaded and self.cfg.drop.enable:
            self.rstate = RestoreState()
            self._drop(sim, snap, rep.need_bytes)
        elif self.restore_on and any(s.k > 1 for s in sim.servers):
            dec, self.rstate = decide_restore(snap, self.rstate, self.cfg.restore, self.cfg.drop)
            if dec.restore:
                self._restore(sim, dec)

    def _drop(self, sim, snap, need_bytes: float) -> None:
        plan = plan_drop(snap, need_bytes, self.cfg.drop.max_group_size)
        changed = [g for g in plan.groups if getattr(g, "changed", True)]
        if not changed:
            return
        by_inst = {i: s for s in sim.servers for i in s.instances}
        old = list({id(by_inst[i]): by_inst[i] for g in changed for i in g.instances}.values())
        layers = {st.instance_id: (st.layer_start, st.layer_end) for g in changed for st in g.stages}
        # KV exchange: each instance sends its requests' KV of the layers it gives up
        L = sim.cfg.model.layers
        send = 0.0
        for s in old:
            per_inst = s.used * sim.cfg.block_bytes / s.k
            for i in s.instances:
                lo, hi = layers[i]
                send = max(send, per_inst * (1 - (hi - lo) / L))
        stall = self._exchange_stall(sim, send, max(len(g.instances) for g in changed))
        sim.transition(old, [tuple(g.instances) for g in changed], layers, stall, "drop")
        sim.log("drop_plan", need_bytes=need_bytes, freed_bytes=plan.freed_bytes,
                satisfied=plan.satisfied, exchange_bytes=send)

    def _exchange_stall(self, sim, nbytes: float, k: int) -> float:
        full = sim.cfg.link.time(nbytes)
        if not self.exchange or nbytes <= 0:
            return full
        stage = adapters.typical_stage_time(sim, k)
        chunk = adapters.transfer_chunk_bytes(sim.cfg.link, stage)
        return min(full, sim.cfg.link.time(chunk))

    def _restore(self, sim, dec) -> None:
        by_inst = {i: s for s in sim.servers for i in s.instances}
        for g in dec.restore:
            s = by_inst.get(g.instances[0])
            if s is None or s.frozen or s.k == 1:
                continue
            base = s.k * sim.base_blocks
            s.capacity = max(s.used, min(s.capacity, base))
            per_inst = max(g.restored_bytes / s.k, 0.0)
            link = sim.cfg.pcie if g.source == "host" else sim.cfg.link
            load_s = link.time(per_inst)
            kv = s.used * sim.cfg.block_bytes * (1 - 1 / s.k) / s.k
            stall = self._exchange_stall(sim, kv, s.k)
            layers = {i: (0, sim.cfg.model.layers) for i in s.instances}
            sim.log("restore_start", instances=list(s.instances), source=g.source, load_s=round(load_s, 6))
            sim.at(sim.now + load_s, self._split, sim, s, layers, stall)
            break  # one transition at a time

    def _split(self, sim, s, layers, stall) -> None:
        if not s.alive:
            return
        if sim._pending is not None:  # another transition is under way: retry shortly
            sim.at(sim.now + 0.05, self._split, sim, s, layers, stall)
            return
        sim.transition([s], [(i,) for i in s.instances], layers, stall, "restore")

    def describe(self) -> dict:
        return {**super().describe(), "lookahead": self.lookahead,
                "microbatcher": ("policy.microbatch." + ("lookahead" if self.lookahead else "token_count"))
                if self.lookahead_impl else "sim token-count fallback",
                "exchange": self.exchange, "restore": self.restore_on}
