"""``static``: one pipeline group of every instance from t=0, kept (``drop.static_group``). An
alternative configuration without transition cost, not a bound: KunServe can beat it (its groups
form only when needed). The group is KunServe's (microbatches, admission) without its monitor."""

from __future__ import annotations

from .base import DEFAULT_DISPATCH
from .kunserve import KunServePolicy


class StaticGroupPolicy(KunServePolicy):
    name = "static"

    def __init__(self, config=None, dispatch: str = DEFAULT_DISPATCH, **kw):
        super().__init__(config, dispatch, **kw)
        self.tick_s = None   # no monitor: the group neither grows nor splits

    def setup(self, sim) -> None:
        n, L = sim.cfg.instances, sim.cfg.model.layers
        layers = {i: (i * L // n, (i + 1) * L // n) for i in range(n)}
        sim.transition(list(sim.servers), [tuple(range(n))], layers, 0.0, "drop")
