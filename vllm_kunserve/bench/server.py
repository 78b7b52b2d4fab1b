"""Kept for old imports: server processes are :mod:`vllm_kunserve.cluster.launcher`'s."""

from vllm_kunserve.cluster.launcher import ServerProcess, free_port

__all__ = ["ServerProcess", "free_port"]
