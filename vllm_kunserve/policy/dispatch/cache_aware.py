"""``cache-aware``: the unit that likely holds the request's prompt in its prefix cache, or its
session's, unless that unit is much busier than the least busy; else ``least-work``.

The rule of vllm-router's and SGLang's gateway's ``cache_aware`` policy, over this package's
snapshot: each unit's ``prefix_share`` (the caller's approximate index of the prompts it sent
where: ``cluster.frontend.prefix``) and ``affinity`` (the unit the request's session went to
last: a ``user`` field or an ``x-session-id`` header). A unit whose share reaches
``MATCH_SHARE`` wins (the highest share), as does the session's unit, while its load stays within
``BALANCE_REQUESTS`` requests per instance of compute of the least loaded unit that takes the
prompt: a hot prefix must not pile every request on one engine (the routers' balance threshold).
A re-prefill saved is worth a prompt's compute; queueing behind a busy engine costs more.
"""

from __future__ import annotations

from typing import Sequence

from vllm_kunserve.policy.dispatch.base import DispatchPolicy, InstanceLoad
from vllm_kunserve.policy.dispatch.least_work import LeastWork

#: the prompt share a unit must hold cached to be chosen for it
MATCH_SHARE = 0.5
#: how many more requests (per instance of compute) than the least loaded a cached unit may have
BALANCE_REQUESTS = 4


class CacheAware(DispatchPolicy):
    """Session or prefix match within a load bound; else least-work."""

    name = "cache-aware"
    summary = "the unit likely holding the prompt's prefix, or the session's, unless much busier; else least-work"
    uses_prefix = True

    def choose(self, units: Sequence[InstanceLoad], prompt_blocks: int = 0, turn: int = 0) -> int:
        fit = [u for u in units if u.fits(prompt_blocks)] or list(units)
        floor = min(u.requests / u.k for u in fit)
        near = [u for u in fit if u.requests / u.k <= floor + BALANCE_REQUESTS]
        sticky = [u for u in near if u.affinity]
        if sticky:
            return sticky[0].instance_id
        cached = [u for u in near if u.prefix_share >= MATCH_SHARE]
        if cached:
            return max(cached, key=lambda u: (u.prefix_share, -u.requests / u.k, -u.instance_id)).instance_id
        return LeastWork().choose(units, prompt_blocks, turn)
