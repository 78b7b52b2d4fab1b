"""vllm-kunserve: drop replicated parameters instead of KV cache under memory bursts.

The package is split into rooms that must stay apart (docs/architecture.md orders them):

- ``runtime`` / ``workload``: process-level helpers; traces, KV demand and model shapes shared by
  the benchmark harness and the simulator;
- ``policy``: pure decisions over immutable snapshots (no torch, no vLLM);
- ``memory`` / ``transfer``: engine-agnostic mechanisms (plain torch);
- ``integration``: the thin vLLM glue, one small version-gated patch class per touchpoint;
- ``cluster`` / ``sim``: launcher, monitor, dispatcher, API front and the cluster simulator.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
