"""Discrete-event cluster simulator (``kunserve simulate``): N instances serving a trace under
vLLM recompute, KV swap, migration, MELL placement, KunServe drop, Oneiros remap and an
infinite-memory oracle. Policy decisions come from ``vllm_kunserve.policy``. See docs/simulator.md."""

from .engine import SimConfig, Simulator
from .runner import run_policies, simulate

__all__ = ["SimConfig", "Simulator", "run_policies", "simulate"]
