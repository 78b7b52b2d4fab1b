"""The physical memory pool: fixed-size chunks shared by weight regions and growable KV regions.

Every region is a virtual-address reservation of its maximum size, so its address (and every tensor
viewing it) never moves; chunks are mapped in and out underneath. Moving memory from weights to KV
cache is ``release_layer`` (unmap the layer's chunks, back to the free list) followed by
``resize_kv`` (map free chunks at the tail of KV regions); no byte is copied.

Invariants (checked by :meth:`MemoryPool.check`): every chunk is either free or owned by exactly one
region, where it is mapped at the region's ``chunks`` position. Every operation either completes or
leaves the pool exactly as it was (a map failure part-way is rolled back).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import torch
from torch import nn

from . import guard, layout
from .backend import Backend, make_backend
from .errors import InjectedFault, LayerReleasedError, MapError, MemoryPoolError, PoolExhaustedError

_ids = itertools.count()


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class FaultInjector:
    """Test hook: make the next map (or access-setting) call fail, to exercise rollback."""

    def __init__(self) -> None:
        self._map_after: int | None = None
        self._access_failures = 0

    def fail_map(self, after: int = 0) -> None:
        """Let ``after`` chunk maps succeed, then fail the next one (once)."""
        self._map_after = after

    def clear(self) -> None:
        """Disarm every fault not fired yet."""
        self._map_after, self._access_failures = None, 0

    def fail_set_access(self) -> None:
        """Fail the next access-setting step (after all chunks of an operation were mapped)."""
        self._access_failures += 1

    def before_map(self) -> None:
        if self._map_after is None:
            return
        if self._map_after == 0:
            self._map_after = None
            raise InjectedFault("injected chunk map failure")
        self._map_after -= 1

    def before_set_access(self) -> None:
        if self._access_failures:
            self._access_failures -= 1
            raise InjectedFault("injected access-setting failure")


class Region:
    """A reserved address range with chunks mapped from its start. Created by the pool."""

    kind = "region"

    def __init__(self, pool: "MemoryPool", name: str, va: int, max_bytes: int):
        self.pool = pool
        self.name = name
        self.va = va
        self.max_bytes = max_bytes
        self.chunks: list[int] = []
        self.destroyed = False

    @property
    def ptr(self) -> int:
        """Base address; constant for the region's life."""
        return self.va

    @property
    def mapped_bytes(self) -> int:
        return len(self.chunks) * self.pool.chunk_bytes

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def _alive(self) -> None:
        if self.destroyed:
            raise MemoryPoolError(f"region {self.name!r} was destroyed")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, ptr={self.va:#x}, mapped={self.mapped_bytes}, "
                f"max={self.max_bytes})")


class KVRegion(Region):
    """A growable region, typically one layer's (or one K/V plane's) KV cache."""

    kind = "kv"

    def view(self, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] | None = None, *,
             allow_unmapped: bool = False) -> torch.Tensor:
        """A tensor viewing the region from its start (no copy; the address never changes).

        By default it may only cover mapped bytes. ``allow_unmapped=True`` returns a view over up to
        the whole reservation (for engines that size tensors for the maximum block count and only
        index mapped blocks): touching an unmapped part is undefined (SIGSEGV / illegal address).
        """
        self._alive()
        if self.device.type == "cuda" and not self.chunks and allow_unmapped:
            # torch resolves a CUDA pointer's device by querying it, which needs mapped memory
            raise MemoryPoolError(f"KV region {self.name!r}: map at least one chunk before viewing it on CUDA")
        limit = self.max_bytes if allow_unmapped else self.mapped_bytes
        esize = torch.empty(0, dtype=dtype).element_size()
        if shape is None:
            nbytes = limit // esize * esize
            shape = (nbytes // esize,)
        else:
            shape = tuple(int(s) for s in shape)
            nbytes = esize
            for s in shape:
                nbytes *= s
            if nbytes > limit:
                what = "reserved" if allow_unmapped else "mapped"
                raise MemoryPoolError(
                    f"view of {nbytes} bytes exceeds the {limit} {what} bytes of KV region {self.name!r}")
        return self.pool.backend.view(self.va, nbytes).view(dtype).view(shape)

    def grow(self, nbytes: int) -> None:
        """Map at least ``nbytes`` more (whole chunks) at the tail."""
        self.pool.resize_kv({self: self.mapped_bytes + nbytes})

    def shrink(self, nbytes: int) -> None:
        """Unmap whole chunks from the tail so that at least ``mapped - nbytes`` stay mapped."""
        self.pool.resize_kv({self: max(0, self.mapped_bytes - nbytes)})

    def resize(self, mapped_bytes: int) -> None:
        self.pool.resize_kv({self: mapped_bytes})


class WeightRegion(Region):
    """One layer's packed weights; can be released (chunks to the pool) and reloaded."""

    kind = "weight"

    def __init__(self, pool, name, va, max_bytes, entries, image_bytes, module, host_copy):
        super().__init__(pool, name, va, max_bytes)
        self.entries: list[layout.Entry] = entries
        self.image_bytes = image_bytes
        self.module: nn.Module | None = module
        self.host_copy: torch.Tensor | None = host_copy
        self.released = False
        self._guards: dict[tuple[int, str], tuple[nn.Module, str, str, guard.ReleasedTensor]] = {}

    @property
    def registry_key(self) -> str:
        return f"pool{self.pool.id}:{self.name}"

    def image(self) -> torch.Tensor:
        """uint8 view of the packed image in device memory (e.g. to send to a peer)."""
        self._check_resident()
        return self.pool.backend.view(self.va, self.image_bytes)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors as views of the region (raises if the layer is released)."""
        base = self.image()
        return {e.name: e.view(base) for e in self.entries}

    def _check_resident(self) -> None:
        self._alive()
        if self.released:
            raise LayerReleasedError(f"layer {self.name!r} is released; reload it before using its tensors")

    def release(self) -> None:
        self.pool.release_layer(self)

    def reload(self, image: torch.Tensor | None = None) -> None:
        self.pool.reload_layer(self, image)


RegionRef = Union[str, Region]


@dataclass(frozen=True)
class PoolStats:
    backend: str
    device: str
    chunk_bytes: int
    total_chunks: int
    free_chunks: int
    regions: dict[str, dict[str, Any]] = field(default_factory=dict)
    returned_chunks: int = 0   # given back to the device or host (not held)

    @property
    def used_chunks(self) -> int:
        return self.total_chunks - self.free_chunks - self.returned_chunks


class MemoryPool:
    """A fixed number of physical chunks and the regions they are mapped into.

    Args:
        capacity_bytes: physical memory of the pool (rounded up to whole chunks), created up front.
        backend: ``"auto"`` (cuda when usable, else host), ``"cuda"``, ``"host"`` or a Backend.
        device: CUDA device for the cuda backend (default: torch's current device).
        chunk_bytes: chunk size, a multiple of the backend's granularity (default 2 MiB or the
            CUDA recommended granularity if larger).
    """

    def __init__(self, capacity_bytes: int, *, backend: str | Backend = "auto",
                 device: int | str | torch.device | None = None, chunk_bytes: int | None = None):
        if capacity_bytes <= 0:
            raise ValueError(f"pool capacity must be positive, got {capacity_bytes}")
        self.backend = make_backend(backend, device=device, chunk_bytes=chunk_bytes)
        gran = self.backend.granularity
        cb = chunk_bytes or self.backend.default_chunk_bytes
        if cb <= 0 or cb % gran:
            raise ValueError(f"chunk_bytes={cb} must be a positive multiple of the {self.backend.name} "
                             f"backend's granularity ({gran} bytes)")
        self.chunk_bytes = cb
        n = max(1, -(-capacity_bytes // cb))
        self.id = next(_ids)
        self.faults = FaultInjector()
        self._lock = threading.RLock()
        self._handles: list[Any] = []
        try:
            for i in range(n):
                self._handles.append(self.backend.create_chunk(i, cb))
        except Exception as exc:
            self._release_handles()
            raise MemoryPoolError(f"could not create {n} chunks of {cb} bytes "
                                  f"({len(self._handles)} made): {exc}") from exc
        self._free: list[int] = list(range(n - 1, -1, -1))  # pop() hands out low ids first
        self._owner: list[str | None] = [None] * n
        #: chunks whose physical memory went back to the device or host (:meth:`return_free`): neither
        #: free nor owned; :meth:`add_chunks` makes them again before it creates new ones
        self._returned: list[int] = []
        self._regions: dict[str, Region] = {}
        self.closed = False

    def add_chunks(self, n: int) -> int:
        """Create ``n`` more physical chunks (free). Lets a caller grow the pool step by step, e.g.
        one layer at a time while the framework's own copy of that layer is freed, so the peak
        never holds two copies of the weights. Chunks given back (:meth:`return_free`) are made again
        first. Returns the new chunk count."""
        with self._lock:
            self._open()
            n = int(n)
            again = []
            try:
                while len(again) < n and self._returned:
                    c = self._returned[-1]
                    self._handles[c] = self.backend.create_chunk(c, self.chunk_bytes)
                    again.append(self._returned.pop())
            except Exception as exc:
                for c in reversed(again):   # back as they were: returned
                    self._handles[c] = self.backend.give_back(self._handles[c], c, self.chunk_bytes)
                    self._returned.append(c)
                raise MemoryPoolError(f"could not make {n} returned chunks again: {exc}") from exc
            self._free.extend(again)   # made highest first: the lowest ends on top (pop() hands it out first)
            n -= len(again)
            made = []
            try:
                for _ in range(int(n)):
                    made.append(self.backend.create_chunk(len(self._handles) + len(made), self.chunk_bytes))
            except Exception as exc:
                for h in made:
                    self.backend.release_chunk(h, self.chunk_bytes)
                raise MemoryPoolError(f"could not add {n} chunks of {self.chunk_bytes} bytes: {exc}") from exc
            first = len(self._handles)
            self._handles.extend(made)
            self._owner.extend([None] * len(made))
            # pop() hands out low ids first: new (higher) ids go to the bottom of the stack
            self._free[:0] = list(range(first + len(made) - 1, first - 1, -1))
            return len(self._handles)

    def return_free(self, n: int) -> int:
        """Give ``n`` free chunks' physical memory back to the device or host (the highest ids first),
        so that another engine may use it; all or nothing. Returns the chunks the pool holds after."""
        with self._lock:
            self._open()
            n = int(n)
            if n < 0 or n > len(self._free):
                raise PoolExhaustedError(f"returning {n} chunks but only {len(self._free)} are free")
            chosen = sorted(self._free, reverse=True)[:n]
            done: list[tuple[int, Any]] = []
            try:
                for c in chosen:
                    done.append((c, self._handles[c]))
                    self._handles[c] = self.backend.give_back(self._handles[c], c, self.chunk_bytes)
            except Exception as exc:
                c, h = done.pop()
                self._handles[c] = h
                for c, _ in done:
                    self._handles[c] = self.backend.create_chunk(c, self.chunk_bytes)
                raise MemoryPoolError(f"could not return {n} chunks: {exc}") from exc
            gone = set(chosen)
            self._free = [c for c in self._free if c not in gone]
            self._returned.extend(sorted(chosen))
            return self.held_chunks

    @property
    def held_chunks(self) -> int:
        """Chunks whose physical memory this pool holds (made and not returned)."""
        return len(self._handles) - len(self._returned)

    @property
    def held_bytes(self) -> int:
        return self.held_chunks * self.chunk_bytes

    # ---- accounting -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def num_chunks(self) -> int:
        return len(self._handles)

    @property
    def num_free_chunks(self) -> int:
        return len(self._free)

    @property
    def capacity_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    @property
    def free_bytes(self) -> int:
        return self.num_free_chunks * self.chunk_bytes

    def region(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise KeyError(f"no region named {name!r} in the pool (have: {sorted(self._regions)})") from None

    def regions(self) -> dict[str, Region]:
        return dict(self._regions)

    def stats(self) -> PoolStats:
        with self._lock:
            regions = {
                r.name: {"kind": r.kind, "mapped_bytes": r.mapped_bytes, "max_bytes": r.max_bytes,
                         "released": getattr(r, "released", False)}
                for r in self._regions.values()}
            return PoolStats(self.backend.name, str(self.device), self.chunk_bytes, self.num_chunks,
                             self.num_free_chunks, regions, len(self._returned))

    def check(self) -> None:
        """Verify the accounting invariants; raise MemoryPoolError describing any violation."""
        with self._lock:
            seen: dict[int, str] = {}
            for c in self._free:
                if c in seen:
                    raise MemoryPoolError(f"chunk {c} is on the free list twice")
                seen[c] = "<free>"
                if self._owner[c] is not None:
                    raise MemoryPoolError(f"free chunk {c} is owned by {self._owner[c]!r}")
            for r in self._regions.values():
                if r.mapped_bytes > r.max_bytes:
                    raise MemoryPoolError(f"region {r.name!r} maps more than it reserved")
                for c in r.chunks:
                    if c in seen:
                        raise MemoryPoolError(f"chunk {c} of {r.name!r} is also held by {seen[c]!r}")
                    seen[c] = r.name
                    if self._owner[c] != r.name:
                        raise MemoryPoolError(f"chunk {c} in {r.name!r} is recorded as owned by {self._owner[c]!r}")
            for c in self._returned:
                if c in seen:
                    raise MemoryPoolError(f"returned chunk {c} is also held by {seen[c]!r}")
                seen[c] = "<returned>"
            if len(seen) != self.num_chunks:
                lost = sorted(set(range(self.num_chunks)) - set(seen))
                raise MemoryPoolError(f"{len(lost)} chunks leaked (neither free nor in a region): {lost[:10]}")

    # ---- chunk plumbing -----------------------------------------------------------------------
    def _take(self, n: int, for_what: str) -> list[int]:
        if n > len(self._free):
            raise PoolExhaustedError(
                f"{for_what} needs {n} chunks of {self.chunk_bytes} bytes but only {len(self._free)} are free")
        return [self._free.pop() for _ in range(n)]

    def _give(self, chunks: list[int]) -> None:
        for c in reversed(chunks):
            self._owner[c] = None
            self._free.append(c)

    def _map(self, region: Region, chunks: list[int]) -> None:
        """Map ``chunks`` at the tail of ``region``; all or nothing."""
        cb, start = self.chunk_bytes, len(region.chunks)
        if (start + len(chunks)) * cb > region.max_bytes:  # never map outside the reservation
            raise MemoryPoolError(f"region {region.name!r}: mapping {len(chunks)} more chunks exceeds "
                                  f"its {region.max_bytes} reserved bytes")
        base = region.va + start * cb
        done = 0
        try:
            for i, c in enumerate(chunks):
                self.faults.before_map()
                self.backend.map(base + i * cb, cb, self._handles[c])
                done += 1
            if chunks:
                self.faults.before_set_access()
                self.backend.set_access(base, len(chunks) * cb)
        except Exception as exc:
            self._unmap_range(base, done)
            raise MapError(f"mapping {len(chunks)} chunks into {region.name!r} failed after {done}; "
                           f"rolled back: {exc}") from exc
        for c in chunks:
            self._owner[c] = region.name
        region.chunks.extend(chunks)

    def _unmap_range(self, va: int, n: int) -> None:
        if n:
            self.backend.unmap_chunks(va, self.chunk_bytes, n)

    def _unmap_tail(self, region: Region, n: int) -> list[int]:
        if n == 0:
            return []
        keep = len(region.chunks) - n
        self._unmap_range(region.va + keep * self.chunk_bytes, n)
        tail = region.chunks[keep:]
        del region.chunks[keep:]
        return tail

    def _map_new(self, region: Region, chunks: list[int]) -> None:
        """Map ``chunks`` into a just-reserved region and register it; on failure give both back."""
        try:
            self._map(region, chunks)
        except Exception:
            self._give(chunks)
            self.backend.free_reservation(region.va, region.max_bytes)
            raise
        self._add(region)

    def _add(self, region: Region) -> None:
        if region.name in self._regions:
            raise ValueError(f"region {region.name!r} already exists")
        self._regions[region.name] = region

    def _resolve(self, ref: RegionRef, cls: type) -> Any:
        r = self.region(ref) if isinstance(ref, str) else ref
        if r.pool is not self or self._regions.get(r.name) is not r:
            raise MemoryPoolError(f"region {r.name!r} does not belong to this pool")
        if not isinstance(r, cls):
            raise MemoryPoolError(f"region {r.name!r} is a {r.kind} region, not {cls.kind}")
        return r

    def _open(self) -> None:
        if self.closed:
            raise MemoryPoolError("the memory pool is closed")

    # ---- KV regions ---------------------------------------------------------------------------
    def create_kv_region(self, name: str, max_bytes: int, initial_bytes: int = 0) -> KVRegion:
        """Reserve ``max_bytes`` of address space and map ``initial_bytes`` (rounded to chunks)."""
        with self._lock:
            self._open()
            if max_bytes <= 0 or initial_bytes < 0 or initial_bytes > max_bytes:
                raise ValueError(f"KV region {name!r}: need 0 <= initial_bytes ({initial_bytes}) <= "
                                 f"max_bytes ({max_bytes}) and max_bytes > 0")
            if name in self._regions:
                raise ValueError(f"region {name!r} already exists")
            max_b = _round_up(max_bytes, self.chunk_bytes)
            chunks = self._take(-(-initial_bytes // self.chunk_bytes), f"KV region {name!r}")
            try:
                va = self.backend.reserve(max_b)
            except Exception:
                self._give(chunks)
                raise
            region = KVRegion(self, name, va, max_b)
            self._map_new(region, chunks)
            return region

    def resize_kv(self, targets: Mapping[RegionRef, int]) -> None:
        """Set several KV regions' mapped sizes at once (each rounded up to whole chunks).

        All-or-nothing: if the pool lacks chunks nothing changes (:class:`PoolExhaustedError`); if a
        map fails part-way every region is put back as it was (:class:`MapError`). Shrinking
        synchronizes the device first and keeps the head of the region (live data) in place.
        """
        with self._lock:
            self._open()
            plan: list[tuple[KVRegion, int]] = []
            for ref, nbytes in targets.items():
                r = self._resolve(ref, KVRegion)
                if any(r is q for q, _ in plan):
                    raise ValueError(f"KV region {r.name!r} appears twice in one resize")
                if nbytes < 0 or nbytes > r.max_bytes:
                    raise ValueError(f"KV region {r.name!r}: size {nbytes} outside [0, {r.max_bytes}]")
                plan.append((r, -(-nbytes // self.chunk_bytes) - len(r.chunks)))
            need = sum(d for _, d in plan if d > 0)
            if need > len(self._free):
                raise PoolExhaustedError(f"growing KV needs {need} chunks of {self.chunk_bytes} bytes "
                                         f"but only {len(self._free)} are free")
            grown: list[tuple[KVRegion, int]] = []
            try:
                for r, d in plan:
                    if d > 0:
                        chunks = self._take(d, f"KV region {r.name!r}")
                        try:
                            self._map(r, chunks)
                        except Exception:
                            self._give(chunks)
                            raise
                        grown.append((r, d))
            except Exception:
                for r, d in reversed(grown):
                    self._give(self._unmap_tail(r, d))
                raise
            shrinks = [(r, -d) for r, d in plan if d < 0]
            if shrinks:
                self.backend.synchronize()
                for r, n in shrinks:
                    self._give(self._unmap_tail(r, n))

    # ---- weight regions ---------------------------------------------------------------------
    def create_weight_region(self, name: str, source: nn.Module | Mapping[str, torch.Tensor], *,
                             keep_host_copy: bool = True) -> WeightRegion:
        """Pack a layer's tensors into a new region.

        With a module, its parameters keep their identity (``param.data`` is pointed at the region)
        and buffers are replaced by region views, so the module now computes from pool memory. A
        host copy of the packed image (pinned on CUDA) is kept for :meth:`reload_layer`.
        """
        with self._lock:
            self._open()
            if name in self._regions:
                raise ValueError(f"region {name!r} already exists")
            if isinstance(source, nn.Module):
                items = layout.module_tensors(source)
                module = source
            else:
                items = [(k, None, None, "tensor", v) for k, v in source.items()]
                module = None
            for n, *_rest, t in items:
                if isinstance(t, guard.ReleasedTensor):
                    raise LayerReleasedError(f"cannot pack {n!r}: it belongs to a released layer")
            entries, image_bytes = layout.plan(items)
            if image_bytes == 0:
                raise ValueError(f"weight region {name!r}: no tensor data to place")
            max_b = _round_up(image_bytes, self.chunk_bytes)
            chunks = self._take(max_b // self.chunk_bytes, f"weight region {name!r}")
            try:
                va = self.backend.reserve(max_b)
            except Exception:
                self._give(chunks)
                raise
            host = None
            if keep_host_copy:
                host = torch.empty(image_bytes, dtype=torch.uint8, pin_memory=self.backend.pin_host_copies)
                layout.pack(entries, [t for *_x, t in items], host)
            region = WeightRegion(self, name, va, max_b, entries, image_bytes, module, host)
            self._map_new(region, chunks)
            base = self.backend.view(va, image_bytes)
            if host is not None:
                base.copy_(host)
            else:
                layout.pack(entries, [t for *_x, t in items], base)
            if module is not None:
                self._bind(region, base)
            return region

    def _bind(self, region: WeightRegion, base: torch.Tensor) -> None:
        for e in region.entries:
            view = e.view(base)
            if e.kind == "param":
                p = e.owner._parameters[e.attr]
                if p.data_ptr() != view.data_ptr():
                    p.data = view
            else:
                e.owner._buffers[e.attr] = view

    def release_layer(self, ref: RegionRef) -> int:
        """Return a weight region's chunks to the pool; returns the bytes freed.

        The region keeps its address reservation (a reload lands at the same address). Module
        tensors that viewed it become :class:`ReleasedTensor` guards, so any use raises
        :class:`LayerReleasedError` instead of touching unmapped memory.
        """
        with self._lock:
            self._open()
            r: WeightRegion = self._resolve(ref, WeightRegion)
            if r.released:
                raise MemoryPoolError(f"layer {r.name!r} is already released")
            if r.host_copy is None:
                raise MemoryPoolError(f"layer {r.name!r} has no host copy; releasing it would lose its "
                                      "weights (create it with keep_host_copy=True or destroy it)")
            self.backend.synchronize()
            self._guard(r)
            freed = r.mapped_bytes
            self._give(self._unmap_tail(r, len(r.chunks)))
            r.released = True
            guard.mark_released(self.device, r.registry_key, r.va, r.va + r.max_bytes)
            return freed

    def _guard(self, r: WeightRegion) -> None:
        if r.module is None:
            return
        lo, hi = r.va, r.va + r.max_bytes
        for e in r.entries:
            store = e.owner._parameters if e.kind == "param" else e.owner._buffers
            cur = store.get(e.attr)
            if cur is None or isinstance(cur, guard.ReleasedTensor):
                continue
            if cur.numel() and not (lo <= cur.data_ptr() < hi):
                continue  # the attribute was re-pointed elsewhere (e.g. a streaming slot)
            g = guard.ReleasedTensor(cur, r.name, e.name)
            store[e.attr] = g
            r._guards[(id(e.owner), e.attr)] = (e.owner, e.attr, e.kind, g)

    def reload_layer(self, ref: RegionRef, image: torch.Tensor | None = None) -> None:
        """Map fresh chunks into a released layer's region (same address) and copy its weights in.

        ``image`` is the packed uint8 image (e.g. received from a peer); default: the host copy.
        On failure the layer stays released and the pool unchanged.
        """
        with self._lock:
            self._open()
            r: WeightRegion = self._resolve(ref, WeightRegion)
            if not r.released:
                raise MemoryPoolError(f"layer {r.name!r} is not released")
            src = image if image is not None else r.host_copy
            if src is None:
                raise MemoryPoolError(f"layer {r.name!r}: no host copy and no image given")
            if src.dtype != torch.uint8 or src.numel() != r.image_bytes:
                raise ValueError(f"layer {r.name!r}: image must be {r.image_bytes} uint8 bytes, "
                                 f"got {src.numel()} {src.dtype}")
            chunks = self._take(r.max_bytes // self.chunk_bytes, f"reloading layer {r.name!r}")
            try:
                self._map(r, chunks)
            except Exception:
                self._give(chunks)
                raise
            self.backend.view(r.va, r.image_bytes).copy_(src)
            r.released = False
            guard.mark_resident(self.device, r.registry_key)
            for owner, attr, kind, g in r._guards.values():
                store = owner._parameters if kind == "param" else owner._buffers
                if store.get(attr) is g:
                    store[attr] = g._kun_original
            r._guards.clear()

    def destroy_region(self, ref: RegionRef) -> None:
        """Unmap a region, return its chunks and give back its address space.

        A destroyed weight region's module tensors stay guarded (any use raises)."""
        with self._lock:
            r = self.region(ref) if isinstance(ref, str) else ref
            r = self._resolve(r, Region)
            self.backend.synchronize()
            if isinstance(r, WeightRegion) and not r.released:
                self._guard(r)
            self._give(self._unmap_tail(r, len(r.chunks)))
            self.backend.free_reservation(r.va, r.max_bytes)
            if isinstance(r, WeightRegion):
                guard.mark_resident(self.device, r.registry_key)
            r.destroyed = True
            del self._regions[r.name]

    def close(self) -> None:
        """Destroy all regions and free the physical chunks."""
        with self._lock:
            if self.closed:
                return
            for name in list(self._regions):
                self.destroy_region(name)
            self._release_handles()
            self.backend.close()
            self.closed = True

    def _release_handles(self) -> None:
        returned = set(self._returned)
        for c, h in enumerate(self._handles):
            if c not in returned:
                self.backend.release_chunk(h, self.chunk_bytes)
        self._returned = []
        self._handles = []

    def __enter__(self) -> "MemoryPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"MemoryPool(backend={self.backend.name}, device={self.device}, chunk={self.chunk_bytes}, "
                f"free={self.num_free_chunks}/{self.num_chunks})")
