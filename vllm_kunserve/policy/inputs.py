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


def cluster_input(*, num_layers: int, layer_bytes: int, block_bytes: int, block_size: int, rows: list[dict],
                  groups: list[tuple[int, ...]], now_s: float, history: tuple = (),
                  work_history: tuple = ()) -> "ClusterSnapshot":
    """The drop / restore policies' cluster snapshot from per-instance rows (``instance_id``,
    ``capacity_blocks``, ``used_blocks``, ``queued_blocks``, ``held``: the (start, end) layer range
    it runs in a group or None for all, ``healthy``, optional ``base_blocks``: capacity holding every
    layer, optional ``max_blocks``: the most its KV cache can reach, optional ``host``: the
    machine it runs on (groups form within one), optional ``prompt_tokens`` / ``output_tokens``: the request mix, the prompt lengths and output budgets of
    the requests in the engine, optional ``awaiting_first_token``: how many of them have had no token yet). Capacity and use count one block per
    ``block_size`` tokens of a request, whichever members hold its layers."""
    from vllm_kunserve.policy.snapshot import ClusterSnapshot, InstanceSnapshot, ModelSpec

    model = ModelSpec(num_layers=num_layers, layer_bytes=layer_bytes, block_bytes=block_bytes, block_size=block_size)
    insts = tuple(InstanceSnapshot(instance_id=r["instance_id"], kv_blocks_total=int(r["capacity_blocks"]),
                                   kv_blocks_used=int(r["used_blocks"]), queued_blocks=int(r["queued_blocks"]),
                                   layer_start=(r["held"] or (0, 0))[0],
                                   layer_end=(r["held"] or (0, 0))[1] if r["held"] else 0,
                                   healthy=bool(r.get("healthy", True)),
                                   kv_blocks_base=int(r.get("base_blocks") or 0),
                                   prompt_tokens=int(r.get("prompt_tokens") or 0),
                                   output_tokens=int(r.get("output_tokens") or 0),
                                   kv_blocks_max=int(r.get("max_blocks") or 0),
                                   host=str(r.get("host") or ""),
                                   awaiting_first_token=int(r.get("awaiting_first_token") or 0)) for r in rows)
    return ClusterSnapshot(model=model, instances=insts, groups=tuple(groups), now_s=now_s,
                           demand_history=tuple(history), work_history=tuple(work_history))
