"""Kept for old imports: server processes are :mod:`vllm_kunserve.cluster.fleet.launcher`'s."""

from vllm_kunserve.cluster.fleet.launcher import ServerProcess, free_port

__all__ = ["ServerProcess", "free_port"]
