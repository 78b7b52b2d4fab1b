"""Oneiros remap: when an instance runs short of KV, some layers' weight memory becomes KV and those
layers stream from pinned host memory into shared slots just before they run.

Decisions are ``policy.remap.decide_remap``'s (how many layers, one or two slots, evenly spaced,
reverted when demand stays low), over the input ``policy.inputs.remap_input`` builds from the
server's load, exactly as the engine agent builds it. The simulator times the mechanism: the remapped layers' loads
must hide behind the compute of the resident layers between them. Per step, a load of ``t_x``
(layer bytes over PCIe) hides behind ``gap`` layer-times of the step being run (``gap = L//m - 1``
with one slot, ``L//m`` with two); what does not hide is added to the step.
"""

from __future__ import annotations

from vllm_kunserve.policy.inputs import remap_input
from vllm_kunserve.policy.remap import ModelLayers, RemapState, decide_remap

from .. import adapters
from .base import DEFAULT_DISPATCH, Policy


class OneirosPolicy(Policy):
    name = "oneiros"

    def __init__(self, config=None, dispatch: str = DEFAULT_DISPATCH, tick_s: float = 0.25, copy_overlap: bool = True):
        super().__init__(dispatch)
        from vllm_kunserve.config import RemapConfig

        self.rcfg = config.remap if config is not None else RemapConfig()
        self.tick_s = tick_s
        # False: the host's copies run inline before each streamed layer (a CPU engine on one core), as
        # the engine agent's ``copy_overlap``: every streamed layer then costs its whole copy per step
        self.copy_overlap = copy_overlap
        self.state: dict[int, tuple[int, int, RemapState]] = {}  # sid -> (alpha, slots, state)

    def _layers(self, sim, s, alpha: int, slots: int) -> ModelLayers:
        m, st = sim.cfg.model, sim.cfg.step_time
        decode_ms = st.batch_time([(1024, 1)] * 32) / m.layers * 1e3
        prefill_ms = st.batch_time([(0, 2048)]) / m.layers * 1e3
        return ModelLayers(m.name, m.layers, m.layer_bytes, decode_ms, prefill_ms, True, None,
                           sim.now, alpha, slots)

    def on_tick(self, sim) -> None:
        for s in sim.servers:
            self.step_server(sim, s)

    def step_server(self, sim, s) -> ModelLayers:
        """One decision of server ``s``'s agent, carried out; returns its model as it is now."""
        alpha, slots, rs = self.state.get(s.sid, (0, 0, RemapState()))
        load = adapters.engine_load(sim, s)
        inp = remap_input(load, self._layers(sim, s, alpha, slots),
                          h2d_bytes_per_s=sim.cfg.pcie.bandwidth_bytes_per_s,
                          high_watermark=self.rcfg.high_watermark, now_s=sim.now,
                          copy_overlap=self.copy_overlap)
        plan, rs = decide_remap(inp, self.rcfg, rs)
        if plan.models:
            mr = plan.models[0]
            alpha, slots = mr.alpha, mr.slots
            self._apply(sim, s, alpha, slots, load.base_blocks)
            sim.log("remap", server=s.sid, action=plan.action, alpha=alpha, slots=slots,
                    layers=list(mr.layers))
        self.state[s.sid] = (alpha, slots, rs)
        return self._layers(sim, s, alpha, slots)

    def _apply(self, sim, s, alpha: int, slots: int, base: int) -> None:
        m = sim.cfg.model
        s.extra_blocks = int(alpha * m.layer_bytes // sim.cfg.block_bytes)
        s.capacity = max(base + s.extra_blocks, s.used)
        if alpha <= 0:
            s.penalty_fn = None
            return
        mcount = alpha + slots
        gap = m.layers // mcount - (1 if slots == 1 else 0)
        t_x = sim.cfg.pcie.time_s(m.layer_bytes)
        L = m.layers

        hide = gap if self.copy_overlap else 0   # inline copies hide behind nothing

        def penalty(step_s: float, mcount=mcount, gap=hide, t_x=t_x, L=L) -> float:
            t_c = step_s / L
            return mcount * max(0.0, t_x - gap * t_c)

        s.penalty_fn = penalty

    def describe(self) -> dict:
        return {**super().describe(), "remap": "policy.remap.decide_remap"}
