"""Worker-side kunserve memory for one vLLM worker: weights and KV cache in one chunk pool.

At KV-cache allocation time (see ``kv_alloc.py``) the decoder layers' weights are packed into
per-layer weight regions and every attention layer's KV cache gets its own KV region, reserved for
the engine's planned maximum block count and mapped for the base count. vLLM's attention kernels
see ordinary tensors over those regions (addresses never move), so they run unmodified.

Remap (Oneiros) = release ``m`` layers' regions, stream those layers through 1-2 slot regions
(``memory.streaming.WeightStreamer``), and map every free chunk at the tail of the KV regions.
Revert = shrink the KV regions back to the base, reload the layers from their host copies and
remove the streaming hooks. Each is all-or-nothing: a failure part-way restores the previous state.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from vllm_kunserve.integration.vllm.cpu_linear import PackedSlots
from vllm_kunserve.memory import MemoryPool, WeightRegion
from vllm_kunserve.memory.streaming import WeightStreamer, copy_overlaps

logger = logging.getLogger("vllm.kunserve")

#: how many chunks the smallest decoder layer should span when choosing a host chunk size
_CHUNKS_PER_LAYER = 16


@dataclass
class KVLayer:
    name: str
    region: Any          # KVRegion
    page_bytes: int      # bytes of one block of this layer


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers in execution order (Llama-style ``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers; kunserve supports decoder-only models")
    out = [m for m in layers if any(True for _ in m.parameters())]  # skip PPMissingLayer
    return out


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


def auto_chunk_bytes(layer_bytes: list[int], granularity: int, default: int) -> int:
    """Host chunks small enough that the smallest layer spans ~16 chunks; device: the default."""
    if granularity >= default:
        return default
    target = max(granularity, min(layer_bytes) // _CHUNKS_PER_LAYER)
    size = granularity
    while size * 2 <= min(target, default):
        size *= 2
    return size


class WorkerMemory:
    """kunserve's memory on one worker. Created by the KV allocation patch."""

    def __init__(self, model: nn.Module, kv_cache_config: Any, device: torch.device, layout: Any,
                 kernel_block_sizes: list[int] | None, cfg: Any) -> None:
        from vllm.v1.kv_cache_interface import KVCacheTensor, UniformTypeKVCacheSpecs, create_kv_cache_views

        self.cfg = cfg
        self.layers = decoder_layers(model)
        self.max_blocks = int(kv_cache_config.num_blocks)
        self.base_blocks = int(kv_cache_config.kunserve_base_blocks)
        self.events: list[dict] = []
        self.streamer: WeightStreamer | None = None
        self.remapped: tuple[int, ...] = ()
        self.slot_regions: list[Any] = []

        # -- sizes -----------------------------------------------------------------------------
        shared = _shared_owners(self.layers)
        self._shared = shared
        layer_bytes = []
        for layer in self.layers:
            with _detached(layer, shared):
                layer_bytes.append(sum(t.numel() * t.element_size()
                                       for t in list(layer.parameters()) + list(layer.buffers())))
        kv_specs: list[tuple[str, Any, int, Any]] = []  # (layer name, spec, page bytes, tensor)
        for tensor in kv_cache_config.kv_cache_tensors:
            if len(tensor.layers) > 1 and tensor.layer_stride != tensor.block_stride * self.max_blocks:
                raise ValueError("kunserve growable KV needs a layer-outermost KV layout "
                                 f"(got layer_stride={tensor.layer_stride}, block_stride={tensor.block_stride})")
            for name in tensor.layers:
                group_id, group = next((g, grp) for g, grp in enumerate(kv_cache_config.kv_cache_groups)
                                       if name in grp.layer_names)
                spec = group.kv_cache_spec
                if isinstance(spec, UniformTypeKVCacheSpecs):
                    spec = spec.kv_cache_specs[name]
                if not spec.has_layer_views:
                    raise ValueError(f"layer {name}: KV spec without per-layer views is not supported")
                kv_specs.append((name, spec, tensor.block_stride, group_id))

        from vllm_kunserve.memory.backend import make_backend

        backend = make_backend(cfg.memory.backend, device=device)
        chunk = cfg.memory.chunk_kib * 1024 if cfg.memory.chunk_kib else auto_chunk_bytes(
            layer_bytes, backend.granularity, backend.default_chunk_bytes)

        def rnd(n: int) -> int:
            return -(-n // chunk) * chunk

        capacity = sum(rnd(b) for b in layer_bytes) + sum(rnd(self.base_blocks * p) for _, _, p, _ in kv_specs)
        self.pool = MemoryPool(capacity, backend=backend, device=device, chunk_bytes=chunk)
        t0 = time.perf_counter()
        # -- weights: pack each decoder layer into its own region (frees vLLM's tensors) --------
        self.weights: list[WeightRegion] = []
        for i, layer in enumerate(self.layers):
            with _detached(layer, shared):
                self.weights.append(self.pool.create_weight_region(f"layer{i}", layer))
        # -- KV: one region per attention layer, reserved for max, mapped for base ---------------
        self.kv: list[KVLayer] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        for name, spec, page, group_id in kv_specs:
            region = self.pool.create_kv_region(f"kv:{name}", self.max_blocks * page, self.base_blocks * page)
            raw = region.view(torch.int8, allow_unmapped=True)[: self.max_blocks * page]
            one = KVCacheTensor(size=self.max_blocks * page, layers=[name],
                                layer_stride=self.max_blocks * page, block_stride=page)
            kbs = kernel_block_sizes[group_id] if kernel_block_sizes and group_id < len(kernel_block_sizes) else None
            (view,) = create_kv_cache_views(raw, spec, self.max_blocks, layout, one, kernel_block_size=kbs)
            self.kv.append(KVLayer(name, region, page))
            self.kv_caches[name] = view
        self._zero_mapped()
        self.h2d_bytes_per_s = self._measure_h2d()
        self._inject: str | None = None
        self.packed = PackedSlots(self.layers)  # CPU: streamed linears keep oneDNN's packed kernel
        self._event("setup", time.perf_counter() - t0, capacity,
                    layers=len(self.layers), chunk_bytes=chunk, base_blocks=self.base_blocks,
                    max_blocks=self.max_blocks)

    def _measure_h2d(self) -> float:
        """Bytes/s of copying a layer's host copy into device memory (the streaming link)."""
        w = max(self.weights, key=lambda r: r.image_bytes)
        dst = torch.empty(w.image_bytes, dtype=torch.uint8, device=self.pool.device)
        dst.copy_(w.host_copy)  # warm-up: first touch of fresh pages is not the link speed
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(w.host_copy, non_blocking=False)
            if dst.is_cuda:
                torch.cuda.synchronize(dst.device)
            best = min(best, time.perf_counter() - t0)
        return w.image_bytes / max(best, 1e-9)

    def inject_fault(self, kind: str) -> dict:
        """Test hook: make the next remap fail while growing KV ("map" or "exhausted")."""
        if kind not in ("map", "exhausted", "none"):
            raise ValueError(f"fault kind must be map, exhausted or none; got {kind!r}")
        self._inject = None if kind == "none" else kind
        return {"armed": self._inject}

    # -- state ----------------------------------------------------------------------------------
    @property
    def mapped_blocks(self) -> int:
        """Blocks mapped in every KV region (what the scheduler may use)."""
        return min(min(k.region.mapped_bytes // k.page_bytes, self.max_blocks) for k in self.kv)

    def layer_bytes(self) -> list[int]:
        return [w.image_bytes for w in self.weights]

    def state(self) -> dict:
        st = self.pool.stats()
        return {
            "mapped_blocks": self.mapped_blocks, "base_blocks": self.base_blocks,
            "max_blocks": self.max_blocks, "remapped_layers": list(self.remapped),
            "slots": len(self.slot_regions), "chunk_bytes": st.chunk_bytes,
            "free_chunks": st.free_chunks, "total_chunks": st.total_chunks,
            "layer_bytes": self.layer_bytes(), "num_layers": len(self.layers),
            "stream": (vars(self.streamer.stats) if self.streamer else None),
            "streamed_linear": self.packed.kind(),
            "copy_overlap": copy_overlaps(self.pool.device),
            "block_bytes": sum(k.page_bytes for k in self.kv),
            "h2d_bytes_per_s": self.h2d_bytes_per_s,
            "events": self.events[-20:],
        }

    def _event(self, kind: str, seconds: float, nbytes: int, **extra) -> None:
        ev = {"event": kind, "ms": round(seconds * 1000, 3), "bytes": int(nbytes), **extra}
        self.events.append(ev)
        logger.info("kunserve %s: %s", kind, ev)

    def _zero_mapped(self, lo_block: int = 0) -> None:
        for k in self.kv:
            n = min(k.region.mapped_bytes // k.page_bytes, self.max_blocks)
            if n > lo_block:
                k.region.view(torch.uint8)[lo_block * k.page_bytes:n * k.page_bytes].zero_()

    # -- remap / revert ---------------------------------------------------------------------------
    def remap(self, layers: list[int], num_slots: int) -> int:
        """Release ``layers``, stream them through ``num_slots`` slots, grow KV with the freed chunks.

        From the base state any layer set works; when layers are already remapped the new set must
        contain them and keep the slot count (the scheduler is using the grown blocks, so the KV
        regions can only grow). Returns the new mapped block count. All-or-nothing: on failure
        the previous remap state and KV regions are restored.
        """
        layers = sorted(set(int(i) for i in layers))
        if not layers or layers[-1] >= len(self.layers) or layers[0] < 0:
            raise ValueError(f"remap layers {layers} outside 0..{len(self.layers) - 1}")
        if len(layers) >= len(self.layers):
            raise ValueError("never remap a whole model: at least one layer stays resident")
        if num_slots not in (1, 2) or num_slots > len(layers):
            raise ValueError(f"num_slots={num_slots}: must be 1 or 2 and at most the remapped layers")
        old = list(self.remapped)
        if old and (not set(old) <= set(layers) or num_slots != len(self.slot_regions)):
            raise ValueError(f"layers {old} are remapped with {len(self.slot_regions)} slot(s); a further "
                             f"remap must keep them and the slot count (got {layers}, {num_slots})")
        new = [i for i in layers if i not in old]
        if not new:
            return self.mapped_blocks
        t0 = time.perf_counter()
        before = self.mapped_blocks
        released: list[int] = []
        slot_bytes = max(self.weights[i].image_bytes for i in layers)
        try:
            if old:
                if slot_bytes > self.slot_regions[0].mapped_bytes:
                    raise ValueError("a newly remapped layer is larger than the existing slots")
                self._drain_copies()
                self.streamer.uninstall()  # remapped layers keep their released-guards
                self.streamer = None
            for i in new:
                self.packed.prepare(i)  # while the weights are still resident
            for i in new:
                self.pool.release_layer(self.weights[i])
                released.append(i)
            if not old:
                for s in range(num_slots):
                    self.slot_regions.append(self.pool.create_kv_region(f"slot{s}", slot_bytes, slot_bytes))
            self.streamer = self._streamer(layers)
            self.remapped = tuple(layers)
            self._streamed(layers)
            fault, self._inject = self._inject, None
            if fault == "exhausted":
                from vllm_kunserve.memory import PoolExhaustedError

                raise PoolExhaustedError("injected: no free chunks to grow the KV cache")
            if fault == "map":
                self.pool.faults.fail_map(after=1)
            self._grow_all()
        except Exception as exc:
            self._rollback(old, released, before)
            self._event("remap_failed", time.perf_counter() - t0, 0, layers=layers, error=repr(exc))
            raise
        self._zero_mapped(before)
        self._event("remap", time.perf_counter() - t0, sum(self.weights[i].max_bytes for i in new),
                    layers=layers, new_layers=new, slots=num_slots, blocks_before=before,
                    blocks_after=self.mapped_blocks)
        return self.mapped_blocks

    def _rollback(self, old: list[int], released: list[int], kv_blocks: int) -> None:
        """Undo a failed remap: back to streaming exactly ``old`` (or fully resident)."""
        if not old:
            self._restore_layers(released, kv_blocks)
            return
        self._drain_copies()
        self.shrink_kv(kv_blocks)
        if self.streamer is not None and self.streamer.installed:
            self.streamer.uninstall()
        for i in released:
            if self.weights[i].released:
                self.pool.reload_layer(self.weights[i])
        self.streamer = self._streamer(old)
        self.remapped = tuple(old)
        self._streamed(old)

    def _streamer(self, layers: list[int]) -> WeightStreamer:
        slots = iter(self.slot_regions)
        plan = self.packed.copy_plan([w.entries for w in self.weights]) if self.packed.enabled else None
        return WeightStreamer(
            self.layers, layers, num_slots=len(self.slot_regions), device=self.pool.device,
            sources={i: self.weights[i] for i in layers}, copy_plan=plan,
            slot_factory=lambda nb: next(slots).view(torch.uint8)[:nb]).install()

    def _grow_all(self) -> None:
        """Map every free chunk at the tail of the KV regions, evenly (all-or-nothing)."""
        per = self.pool.num_free_chunks // len(self.kv)
        if per <= 0:
            return
        targets = {k.region: min(k.region.mapped_bytes + per * self.pool.chunk_bytes, k.region.max_bytes)
                   for k in self.kv}
        self.pool.resize_kv(targets)

    def shrink_kv(self, blocks: int) -> None:
        targets = {k.region: blocks * k.page_bytes for k in self.kv
                   if k.region.mapped_bytes > blocks * k.page_bytes}
        if targets:
            self.pool.resize_kv(targets)

    def _streamed(self, layers: list[int]) -> None:
        """CPU: streamed layers compute from their slot, resident ones use vLLM's packed kernels."""
        on = set(layers)
        for i in range(len(self.layers)):
            self.packed.point(i, self.streamer.slot_of(i) if i in on else None)

    def _drain_copies(self) -> None:
        st = self.streamer
        if st is not None and st.installed:
            for ticket in list(st._ticket.values()):
                st._copier.wait(ticket)
            st._ticket.clear()
        self.pool.backend.synchronize()

    def _restore_layers(self, layers: list[int], kv_blocks: int) -> None:
        """KV down to ``kv_blocks``, then every layer in ``layers`` resident again, no streaming.

        Runs between engine steps: slot memory is given back before the last layers are reloaded
        (nothing computes in between), and the streaming hooks go last.
        """
        self._drain_copies()
        self.shrink_kv(kv_blocks)
        for r in self.slot_regions:
            self.pool.destroy_region(r)
        self.slot_regions = []
        for i in layers:
            if self.weights[i].released:
                self.pool.reload_layer(self.weights[i])
        if self.streamer is not None and self.streamer.installed:
            self.streamer.uninstall()
        self.streamer = None
        self.remapped = ()
        self._streamed([])
        self.packed.drop_slots()

    def revert(self) -> int:
        """Shrink KV back to the base and reload the remapped layers. The scheduler must have
        retired blocks ``[base, mapped)`` first. Returns the mapped block count."""
        if not self.remapped:
            return self.mapped_blocks
        t0 = time.perf_counter()
        before = self.mapped_blocks
        layers = list(self.remapped)
        self._restore_layers(layers, self.base_blocks)
        self._event("revert", time.perf_counter() - t0, sum(self.weights[i].max_bytes for i in layers),
                    layers=layers, blocks_before=before, blocks_after=self.mapped_blocks)
        return self.mapped_blocks
