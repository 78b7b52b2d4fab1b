"""Serving policies the simulator compares. ``build_policy(name, ...)`` makes one by name."""

from __future__ import annotations

from .base import DEFAULT_DISPATCH, DISPATCH, Policy
from .baselines import InferceptPolicy, LlumnixPolicy, OraclePolicy, VllmPolicy
from .kunserve import KunServePolicy

POLICIES = ("vllm", "infercept", "llumnix", "mell", "kunserve", "oneiros", "oracle",
            # KunServe ablations
            "kunserve-nolookahead", "kunserve-noexchange", "kunserve-norestore")


def build_policy(name: str, dispatch: str = DEFAULT_DISPATCH, config=None, cost_model=None) -> Policy:
    key = name.lower()
    if key == "vllm":
        return VllmPolicy(dispatch)
    if key == "oracle":
        return OraclePolicy(dispatch)
    if key == "infercept":
        return InferceptPolicy(dispatch)
    if key == "llumnix":
        return LlumnixPolicy(dispatch)
    if key.startswith("kunserve"):
        flags = {"kunserve": {}, "kunserve-nolookahead": {"lookahead": False},
                 "kunserve-noexchange": {"exchange": False}, "kunserve-norestore": {"restore": False}}
        if key not in flags:
            raise ValueError(f"policy {name!r}: unknown; one of {', '.join(POLICIES)}")
        return KunServePolicy(config, dispatch, cost_model=cost_model, **flags[key])
    if key == "mell":
        from .mell import MellPolicy
        return MellPolicy(config)
    if key == "oneiros":
        from .oneiros import OneirosPolicy
        return OneirosPolicy(config, dispatch)
    raise ValueError(f"policy {name!r}: unknown; one of {', '.join(POLICIES)}")


__all__ = ["DEFAULT_DISPATCH", "DISPATCH", "Policy", "POLICIES", "build_policy"]
