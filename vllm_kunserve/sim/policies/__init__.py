"""Serving policies the simulator compares. ``build_policy(name, ...)`` makes one by name."""

from __future__ import annotations

import re

from .base import DEFAULT_DISPATCH, DISPATCH, Policy
from .baselines import (InferceptPolicy, LlumnixPolicy, OracleEqualPolicy, OraclePolicy, VllmPolicy,
                        VllmTunedPolicy)
from .kunserve import KunServePolicy
from .static import StaticGroupPolicy

POLICIES = ("vllm", "infercept", "llumnix", "mell", "kunserve", "oneiros", "oracle",
            # KunServe ablations
            "kunserve-nolookahead", "kunserve-noexchange", "kunserve-norestore",
            # KunServe's group of every instance from t=0, kept (no transitions)
            "static",
            # stock vLLM with the KV of a 2-instance KunServe group
            "oracle-equal",
            # remap on each engine, cluster drop and MELL placement, ordered by policy.levers
            "levers")
#: names with a parameter: tuned vLLM with batch cap N (``build_policy("vllm-tuned", max_seqs=N)``
#: is the same) and the equal-KV oracle of an N-instance group
POLICY_PATTERNS = ("vllm-cap<N>", "oracle-equal-g<N>")
_CAP = re.compile(r"vllm-cap(\d+)")
_EQUAL = re.compile(r"oracle-equal-g(\d+)")


def is_policy(name: str) -> bool:
    """Whether ``build_policy(name)`` knows ``name`` (a :data:`POLICIES` entry or a pattern)."""
    key = name.lower()
    return key in POLICIES or bool(_CAP.fullmatch(key) or _EQUAL.fullmatch(key))


def _unknown(name: str) -> ValueError:
    return ValueError(f"policy {name!r}: unknown; one of {', '.join(POLICIES)}, vllm-tuned (with max_seqs), "
                      f"{', '.join(POLICY_PATTERNS)}")


def build_policy(name: str, dispatch: str = DEFAULT_DISPATCH, config=None, cost_model=None, *,
                 max_seqs: int | None = None, group: int | None = None, copy_overlap: bool = True) -> Policy:
    """The policy called ``name`` routing by ``dispatch``; ``config`` is KunServe's
    (``KunServeConfig``). ``max_seqs``: the batch cap of ``vllm-tuned`` (required there; the name
    ``vllm-capN`` gives it too); ``group``: the group size whose KV ``oracle-equal`` holds (default
    2; the name ``oracle-equal-gN`` gives it too); ``copy_overlap``: False where remapped layers' copies
    run inline (a CPU engine on one core: ``oneiros`` and ``levers``)."""
    key = name.lower()
    if max_seqs is not None and key != "vllm-tuned":
        raise ValueError(f"policy {name!r}: max_seqs is vllm-tuned's parameter")
    if group is not None and key != "oracle-equal":
        raise ValueError(f"policy {name!r}: group is oracle-equal's parameter")
    if key == "vllm":
        return VllmPolicy(dispatch)
    if key == "vllm-tuned":
        if max_seqs is None:
            raise ValueError("policy 'vllm-tuned' needs its batch cap: build_policy('vllm-tuned', max_seqs=N) or the "
                             "name 'vllm-capN' (sim.tuning.pick_vllm_cap picks N on a trace)")
        return VllmTunedPolicy(max_seqs, dispatch)
    if m := _CAP.fullmatch(key):
        return VllmTunedPolicy(int(m.group(1)), dispatch)
    if key == "oracle-equal":
        return OracleEqualPolicy(dispatch, group if group is not None else 2)
    if m := _EQUAL.fullmatch(key):
        return OracleEqualPolicy(dispatch, int(m.group(1)))
    if key == "oracle":
        return OraclePolicy(dispatch)
    if key == "static":
        return StaticGroupPolicy(config, dispatch, cost_model=cost_model)
    if key == "infercept":
        return InferceptPolicy(dispatch)
    if key == "llumnix":
        return LlumnixPolicy(dispatch)
    if key.startswith("kunserve"):
        flags = {"kunserve": {}, "kunserve-nolookahead": {"lookahead": False},
                 "kunserve-noexchange": {"exchange": False}, "kunserve-norestore": {"restore": False}}
        if key not in flags:
            raise _unknown(name)
        return KunServePolicy(config, dispatch, cost_model=cost_model, **flags[key])
    if key == "mell":
        from .mell import MellPolicy
        return MellPolicy(config)
    if key == "levers":
        from .levers import LeversPolicy
        return LeversPolicy(config, dispatch if dispatch != DEFAULT_DISPATCH else "mell", cost_model=cost_model,
                            copy_overlap=copy_overlap)
    if key == "oneiros":
        from .oneiros import OneirosPolicy
        return OneirosPolicy(config, dispatch, copy_overlap=copy_overlap)
    raise _unknown(name)


__all__ = ["DEFAULT_DISPATCH", "DISPATCH", "Policy", "POLICIES", "POLICY_PATTERNS", "build_policy", "is_policy"]
