"""One builder of policy inputs: the engine agent and the simulator describe an engine's KV load
with :class:`EngineLoad` and turn it into the remap policy's input with :func:`remap_input`, so the
same numbers mean the same thing everywhere (shortage, free KV, demand ratio)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kunserve.policy.remap import ModelLayers, RemapInput


@dataclass(frozen=True)
class EngineLoad:
    """An engine's KV load in usable blocks (vLLM's null block excluded)."""

    used_blocks: int
    queued_blocks: int      # blocks queued requests need to start
    growth_blocks: int      # blocks running and queued requests need for their next outputs
    capacity_blocks: int    # usable now
    base_blocks: int        # usable with nothing remapped or dropped
    free_blocks: int
    block_bytes: int

    @property
    def demand_blocks(self) -> int:
        return self.used_blocks + self.queued_blocks + self.growth_blocks


def remap_input(load: EngineLoad, model: ModelLayers, *, h2d_bytes_per_s: float, high_watermark: float,
                now_s: float, copy_overlap: bool = True) -> RemapInput:
    """The remap policy's view of ``load``: the shortage above ``high_watermark`` of capacity, the
    KV a revert could take back (only what the base can hold beside the demand), demand / base."""
    demand = load.demand_blocks
    shortage = max(0.0, demand - high_watermark * load.capacity_blocks)
    if load.capacity_blocks > load.base_blocks:
        free = max(0, load.base_blocks - demand)
    else:
        free = load.free_blocks
    return RemapInput((model,), h2d_bytes_per_s, kv_shortage_bytes=shortage * load.block_bytes,
                      kv_free_bytes=free * load.block_bytes, demand_ratio=demand / max(1, load.base_blocks),
                      now_s=now_s, copy_overlap=copy_overlap)
