"""The one registry of dispatch policies: name -> policy (a factory in the manner of Llumnix's
``DispatchPolicyFactory``; each policy is its own module of this package, as llm-d keeps one
folder per plugin). A new policy is a module with a :class:`DispatchPolicy` subclass, listed here."""

from __future__ import annotations

from typing import Any

from vllm_kunserve.policy.dispatch.base import DispatchPolicy
from vllm_kunserve.policy.dispatch.cache_aware import CacheAware
from vllm_kunserve.policy.dispatch.least_load import LeastLoad
from vllm_kunserve.policy.dispatch.least_work import LeastWork
from vllm_kunserve.policy.dispatch.mell import Mell
from vllm_kunserve.policy.dispatch.round_robin import RoundRobin

__all__ = ["DEFAULT_DISPATCH", "DISPATCH", "POLICIES", "check_mode", "describe", "get_policy"]

#: every policy by name, in the order ``--dispatch`` lists them
POLICIES: dict[str, DispatchPolicy] = {p.name: p for p in (LeastWork(), LeastLoad(), RoundRobin(), Mell(),
                                                            CacheAware())}
DISPATCH = tuple(POLICIES)
DEFAULT_DISPATCH = "least-work"  # queue-aware: what a serving engineer deploys


def get_policy(mode: Any) -> DispatchPolicy:
    """The policy named ``mode``; a ValueError that lists the names for anything else."""
    policy = POLICIES.get(mode) if isinstance(mode, str) else None
    if policy is None:
        raise ValueError(f"dispatch {mode!r}: one of {', '.join(DISPATCH)}")
    return policy


def check_mode(mode: str) -> str:
    get_policy(mode)
    return mode


def describe(default: str | None = DEFAULT_DISPATCH) -> str:
    """Every policy of the registry, in its order, with its summary, ``default`` marked: the
    ``--dispatch`` help texts' list (``name (summary) | ...``), so no help names a policy by hand."""
    return " | ".join(f"{n} ({'default; ' if n == default else ''}{p.summary})" for n, p in POLICIES.items())
