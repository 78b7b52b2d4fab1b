"""Dispatch: which serving unit (an instance, or a pipeline group acting as one) takes a new request.

The caller describes every unit with an immutable :class:`InstanceLoad` and calls
:func:`choose_instance`; it gets back the chosen ``instance_id``. Modes, one policy class and one
module each, behind one registry (:mod:`.registry`: name -> policy, :func:`get_policy`):

* ``least-work`` (queue-aware, the default; :mod:`.least_work`, which says why): among units whose
  KV takes the prompt, the least queued prefill per instance of compute (a pipeline group of ``k``
  has ``k`` GPUs), then the **fewest requests** per instance of compute, then the least KV demand;
  if none takes it, the least KV demand as a share of capacity;
* ``least-load`` (:mod:`.least_load`): the least KV demand (used + queued blocks) as a share of
  capacity, blind to compute;
* ``round-robin`` (:mod:`.round_robin`): the ``turn``-th accepting unit (the caller counts turns);
* ``mell`` (:mod:`.mell`: MELL on a fixed cluster, and why): MELL's placement on a **fixed**
  cluster: among units whose KV takes the prompt, the lowest KV demand share after placing it; if
  none takes it, the lowest demand share. It is the one ``periodic`` policy: every monitor period
  its ``on_period`` plans MELL's bounded migrations (``policy.migration.plan_migrations``);
* ``cache-aware`` (:mod:`.cache_aware`): the unit holding the prompt's prefix (or the session's
  unit) unless it is much busier than the least busy, else ``least-work`` (vllm-router's rule).

Units that do not accept work (dead, or frozen while their group changes) are skipped unless none
accepts, then every unit is a candidate.
"""

from __future__ import annotations

from typing import Sequence

from vllm_kunserve.policy.dispatch.base import DispatchPolicy, InstanceLoad
from vllm_kunserve.policy.dispatch.registry import DEFAULT_DISPATCH, DISPATCH, POLICIES, check_mode, get_policy


def choose_instance(units: Sequence[InstanceLoad], mode: str = DEFAULT_DISPATCH, *, prompt_blocks: int = 0,
                    turn: int = 0) -> int:
    """The ``instance_id`` of the unit that takes a request needing ``prompt_blocks`` to start."""
    policy = get_policy(mode)
    if not units:
        raise ValueError("dispatch: no instance to choose from")
    live = [u for u in units if u.alive] or list(units)
    return policy.choose(live, prompt_blocks, turn)


__all__ = ["DEFAULT_DISPATCH", "DISPATCH", "POLICIES", "DispatchPolicy", "InstanceLoad", "check_mode",
           "choose_instance", "get_policy"]
