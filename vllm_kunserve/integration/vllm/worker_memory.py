"""The vLLM view of a worker's memory: builds kunserve's chunk pool from vLLM's model and KV plan.

At KV-cache allocation time (see ``kv_alloc.py``) the decoder layers' weights move into per-layer
weight regions **one layer at a time** (the pool grows by that layer's chunks, the region takes the
weights, vLLM's tensor is freed), so peak memory holds at most one extra layer. Every attention
layer's KV cache gets its own KV region, reserved for the engine's planned maximum block count and
mapped for the base count; vLLM's own ``create_kv_cache_views`` builds the per-layer views over it
(vLLM 0.26-0.28: the runner's ``_reshape_kv_cache_tensors``), so attention kernels run unmodified.
The transitions themselves (remap, revert, drop, restore) are
:class:`~vllm_kunserve.memory.residency.LayerResidency`'s, which knows nothing of vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

from vllm_kunserve.integration.vllm.cpu_linear import PackedSlots
from vllm_kunserve.integration.vllm.versions import release
from vllm_kunserve.memory import MemoryPool
from vllm_kunserve.memory.residency import KVPlace, LayerResidency
from vllm_kunserve.memory.streaming import copy_overlaps

logger = logging.getLogger("vllm.kunserve")

#: how many chunks the smallest decoder layer should span when choosing a chunk size
_CHUNKS_PER_LAYER = 16


def decoder_layers(model: nn.Module | None) -> list[nn.Module]:
    """The decoder layers this engine runs, in execution order (Llama-style ``model.model.layers``).

    Layers outside this engine's pipeline stage are vLLM ``PPMissingLayer`` placeholders: skipped."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers; kunserve supports decoder-only models")
    return [m for m in layers if type(m).__name__ != "PPMissingLayer"]


def _shared_owners(layers: list[nn.Module]) -> set[int]:
    """ids of submodules reachable from more than one layer (e.g. a shared rotary embedding)."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for i, layer in enumerate(layers):
        for m in layer.modules():
            if m is not layer and owner.setdefault(id(m), i) != i:
                shared.add(id(m))
    return shared


@contextlib.contextmanager
def _detached(layer: nn.Module, shared: set[int]) -> Iterator[None]:
    """Temporarily unhook shared submodules so a layer's region holds only its own tensors."""
    removed = []
    for parent in layer.modules():
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in shared:
                removed.append((parent, name, child))
                del parent._modules[name]
    try:
        yield
    finally:
        for parent, name, child in removed:
            parent._modules[name] = child


def auto_chunk_bytes(layer_bytes: list[int], granularity: int, cap: int) -> int:
    """Chunks small enough that the smallest layer spans ~16 (little rounding waste per layer), as
    large as that allows up to ``cap``: every chunk costs one map or unmap call."""
    target = max(granularity, min(layer_bytes) // _CHUNKS_PER_LAYER)
    size = granularity
    while size * 2 <= min(target, cap):
        size *= 2
    return size


def _kv_places(kv_cache_config: Any, max_blocks: int) -> list[tuple[str, Any, int, int]]:
    """(layer name, KV spec, page bytes, group id) of every attention layer."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    old = release() < (0, 29)   # vLLM 0.26-0.28: KVCacheTensor(size, shared_by, offset, block_stride)
    per_layer_views = _is_attention if release() < (0, 30) else (lambda spec: spec.has_layer_views)
    out = []
    for tensor in kv_cache_config.kv_cache_tensors:
        if old and (tensor.block_stride or len(tensor.shared_by) != 1):
            raise ValueError("kunserve growable KV needs one KV cache tensor per layer (got a packed or "
                             f"shared one: {tensor.shared_by}, block_stride={tensor.block_stride})")
        if not old and len(tensor.layers) > 1 and tensor.layer_stride != tensor.block_stride * max_blocks:
            raise ValueError("kunserve growable KV needs a layer-outermost KV layout "
                             f"(got layer_stride={tensor.layer_stride}, block_stride={tensor.block_stride})")
        for name in tensor.shared_by if old else tensor.layers:
            group_id, group = next((g, grp) for g, grp in enumerate(kv_cache_config.kv_cache_groups)
                                   if name in grp.layer_names)
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            if not per_layer_views(spec):
                raise ValueError(f"layer {name}: KV spec without per-layer views is not supported")
            page = tensor.size // max_blocks if old else tensor.block_stride
            out.append((name, spec, page, group_id))
    return out


def _is_attention(spec: Any) -> bool:
    """vLLM 0.26-0.29 (no ``KVCacheSpec.has_layer_views``): attention specs are viewed per layer."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    return isinstance(spec, AttentionSpec)


def layer_index(name: str) -> int:
    """The decoder layer an attention layer belongs to (``model.layers.3.self_attn.attn`` -> 3)."""
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def build_worker_memory(model: nn.Module, kv_cache_config: Any, device: torch.device, layout: Any,
                        kernel_block_sizes: list[int] | None, cfg: Any,
                        reshape: Callable[[dict], dict] | None = None,
                        ) -> tuple[LayerResidency, dict, Callable[[str, Any], torch.Tensor]]:
    """Move the model's decoder layers and a growable KV cache into one pool.

    Returns the residency state machine, vLLM's per-layer KV views (for ``bind_kv_cache``) and a
    function building the same kind of view over another region (a group peer's KV). ``reshape``
    (vLLM 0.26-0.28): the runner's ``_reshape_kv_cache_tensors`` (raw per-layer buffers -> views);
    then the raw buffers are returned in place of the views, and vLLM views them itself."""
    from vllm_kunserve.memory.backend import make_backend

    t0 = time.perf_counter()
    layers = decoder_layers(model)
    max_blocks = int(kv_cache_config.num_blocks)
    base_blocks = int(kv_cache_config.kunserve_base_blocks)
    shared = _shared_owners(layers)
    layer_bytes = []
    for layer in layers:
        with _detached(layer, shared):
            layer_bytes.append(sum(t.numel() * t.element_size()
                                   for t in list(layer.parameters()) + list(layer.buffers())))
    places = _kv_places(kv_cache_config, max_blocks)
    backend = make_backend(cfg.memory.backend, device=device)
    chunk = cfg.memory.chunk_kib * 1024 if cfg.memory.chunk_kib else auto_chunk_bytes(
        layer_bytes, backend.granularity, backend.max_auto_chunk_bytes)

    def chunks(nbytes: int) -> int:
        return -(-nbytes // chunk)

    pool = MemoryPool(chunk, backend=backend, device=device, chunk_bytes=chunk)
    # -- weights, one layer at a time: the pool grows by one layer, the layer moves in, vLLM's
    #    tensors of that layer are freed before the next one (peak: one extra layer, not a model)
    weights = []
    for i, layer in enumerate(layers):
        pool.add_chunks(chunks(layer_bytes[i]) - pool.num_free_chunks)
        with _detached(layer, shared):
            weights.append(pool.create_weight_region(f"layer{i}", layer))
        if pool.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed copy back to the driver before the next layer
    # -- KV: one region per attention layer, reserved for the maximum, mapped for the base -------
    kv, views, how = [], {}, {}

    def raw_of(name: str, region: Any) -> torch.Tensor:
        return region.view(torch.int8, allow_unmapped=True)[: max_blocks * how[name][1]]

    def make_view(name: str, region: Any) -> torch.Tensor:
        spec, page, kbs = how[name]
        raw = raw_of(name, region)
        if reshape is not None:  # vLLM 0.26-0.28: no create_kv_cache_views; the runner views every layer
            return reshape(dict.fromkeys(how, raw))[name]
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

        one = KVCacheTensor(size=max_blocks * page, layers=[name], layer_stride=max_blocks * page, block_stride=page)
        (view,) = create_kv_cache_views(raw, spec, max_blocks, layout, one, kernel_block_size=kbs)
        return view

    for name, spec, page, group_id in places:
        pool.add_chunks(chunks(base_blocks * page) - pool.num_free_chunks)
        region = pool.create_kv_region(f"kv:{name}", max_blocks * page, base_blocks * page)
        kbs = kernel_block_sizes[group_id] if kernel_block_sizes and group_id < len(kernel_block_sizes) else None
        how[name] = (spec, page, kbs)
        views[name] = raw_of(name, region) if reshape is not None else make_view(name, region)
        kv.append(KVPlace(name, region, page, layer_index(name)))
    res = LayerResidency(pool, layers, weights, kv, max_blocks, base_blocks,
                         adapter=PackedSlots(layers))  # CPU: streamed linears keep oneDNN's packed kernel
    res.zero_kv()
    res.h2d_bytes_per_s = measure_h2d(res)
    res.copy_overlap = copy_overlaps(pool.device)
    res.event("setup", time.perf_counter() - t0, pool.capacity_bytes, layers=len(layers), chunk_bytes=chunk,
               base_blocks=base_blocks, max_blocks=max_blocks, peak_extra_chunks=max(map(chunks, layer_bytes)))
    return res, views, make_view


def measure_h2d(res: LayerResidency) -> float:
    """Bytes/s of copying a layer's host copy into device memory (the streaming link)."""
    w = max(res.weights, key=lambda r: r.image_bytes)
    dst = torch.empty(w.image_bytes, dtype=torch.uint8, device=res.pool.device)
    dst.copy_(w.host_copy)  # warm-up: first touch of fresh pages is not the link speed
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(w.host_copy, non_blocking=False)
        if dst.is_cuda:
            torch.cuda.synchronize(dst.device)
        best = min(best, time.perf_counter() - t0)
    return w.image_bytes / max(best, 1e-9)
