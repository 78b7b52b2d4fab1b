"""Dispatch: which serving unit (an instance, or a pipeline group acting as one) takes a new request.

The caller describes every unit with an immutable :class:`InstanceLoad` and calls
:func:`choose_instance`; it gets back the chosen ``instance_id``. The policies, one class and one module each (its docstring says what it chooses and why), are
those of one registry (:mod:`.registry`: name -> policy, :func:`get_policy`; :func:`describe` lists
them with a line each, as ``kunserve serve --help`` shows them), ``least-work`` the default. A
``periodic`` policy also acts every monitor period (``on_period``: MELL's bounded migrations); a
``uses_prefix`` one reads each unit's ``prefix_share`` and ``affinity``.

Units that do not accept work (dead, or frozen while their group changes) are skipped unless none
accepts, then every unit is a candidate.
"""

from __future__ import annotations

from typing import Sequence

from vllm_kunserve.policy.dispatch.base import DispatchPolicy, InstanceLoad
from vllm_kunserve.policy.dispatch.registry import DEFAULT_DISPATCH, DISPATCH, POLICIES, check_mode, describe, get_policy


def choose_instance(units: Sequence[InstanceLoad], mode: str = DEFAULT_DISPATCH, *, prompt_blocks: int = 0,
                    turn: int = 0) -> int:
    """The ``instance_id`` of the unit that takes a request needing ``prompt_blocks`` to start."""
    policy = get_policy(mode)
    if not units:
        raise ValueError("dispatch: no instance to choose from")
    live = [u for u in units if u.alive] or list(units)
    return policy.choose(live, prompt_blocks, turn)


__all__ = ["DEFAULT_DISPATCH", "DISPATCH", "POLICIES", "DispatchPolicy", "InstanceLoad", "check_mode",
           "choose_instance", "describe", "get_policy"]
