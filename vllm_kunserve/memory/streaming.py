"""Weight streaming for remapped layers (the Oneiros mechanism).

The remapped decoder layers give their own weight memory away (to KV cache) and share ``S`` (1 or
2) slots. The k-th remapped layer (in execution order) computes from slot ``k % S``; its parameters
are views into that slot, re-filled from a host copy (pinned on CUDA) before each use:

* when a layer finishes, the copy of the next remapped layer that uses the same slot is issued on a
  side stream, ordered after that layer's kernels (a CUDA event), so it overlaps the layers in
  between; on CPU the side stream is a copy thread (``Tensor.copy_`` releases the GIL) when a core
  is spare, else the copy runs inline just before the layer (see ``_InlineCopier``);
* before a layer runs, the compute stream waits for that one copy only.

Both run in a thin wrapper around the layer's ``forward`` (an instance attribute, removed on
uninstall), which leaves the module's hook dicts to others. It was tried against module hooks to cut
host time on a launch-bound GPU step; the two cost the same within a few microseconds per layer.

Layers are expected to run in order, once per forward pass (a decode step); any other order
(e.g. an exception mid-pass) is detected and the layer is loaded synchronously, so results are
always correct. CUDA graphs bypass the wrapper: run streamed layers eagerly.

What one layer's copy moves is a list of ``(dst, src)`` pairs: by default the whole host image into
the slot. An engine can pass ``copy_plan`` to move something else that a layer computes from, e.g.
the CPU backend's oneDNN-packed linear weights (``integration/vllm/cpu_linear.py``).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from . import guard, layout
from .errors import LayerReleasedError

#: what one layer's copy moves: ``(destination, source)`` tensor pairs of equal size
Pairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StreamStats:
    copies: int = 0            # layer copies issued into slots (prefetch + synchronous)
    bytes_copied: int = 0
    sync_loads: int = 0        # out-of-order synchronous loads (should stay 0 in steady state)
    wait_s: float = 0.0        # host time pre-hooks spent blocked (CPU copier only)
    copy_s: float = 0.0        # time spent copying (profile=True; CUDA: side-stream event time)


class _HostCopier:
    """CPU copies: plain ``Tensor.copy_`` of each pair, timed when profiling."""

    def __init__(self, profile: bool = False) -> None:
        self.profile = profile
        self.copy_s = 0.0

    def copy_now(self, pairs: Pairs) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def _run(self, pairs: Pairs) -> float:
        t0 = time.perf_counter()
        self.copy_now(pairs)
        dt = time.perf_counter() - t0
        if self.profile:
            self.copy_s += dt
        return dt

    def copy_seconds(self) -> float:
        return self.copy_s


class _ThreadCopier(_HostCopier):
    """CPU with a spare core: a single copy thread plays the side stream."""

    def __init__(self, profile: bool = False) -> None:
        super().__init__(profile)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kunserve-stream")

    def copy_async(self, pairs: Pairs) -> Future:
        return self._pool.submit(self._run, pairs)

    def wait(self, ticket) -> float:
        if ticket is None:
            return 0.0
        t0 = time.perf_counter()
        ticket.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _spare_core() -> bool:
    """Whether a CPU copy thread would get a core that compute threads do not already occupy."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


def copy_overlaps(device: torch.device | str) -> bool:
    """Whether streaming copies on ``device`` run beside compute (CUDA side stream, or a CPU copy
    thread with a core of its own) rather than inline before each streamed layer."""
    return torch.device(device).type == "cuda" or _spare_core()


class _InlineCopier(_HostCopier):
    """CPU without a spare core: copy in the compute thread when the layer needs its weights.

    A copy thread only helps when it has a core of its own; beside OpenMP compute threads that
    hold every core (vLLM-CPU binds one per core) each hand-off waits for the OS scheduler, which
    costs more than the copy (a few hundred microseconds per layer at memory bandwidth).
    """

    def copy_async(self, pairs: Pairs) -> Pairs:
        return pairs  # the ticket: copied when the layer is about to run

    def wait(self, ticket) -> float:
        return 0.0 if ticket is None else self._run(ticket)

    def close(self) -> None:
        pass


class _CudaCopier:
    """CUDA: copies on a side stream, ordered after the slot's previous user by an event."""

    def __init__(self, device: torch.device, profile: bool = False) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.profile = profile
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def copy_seconds(self) -> float:
        self.stream.synchronize()
        return sum(a.elapsed_time(b) for a, b in self._timings) / 1e3

    def copy_async(self, pairs: Pairs) -> torch.cuda.Event:
        compute = torch.cuda.current_stream(self.device)
        after = torch.cuda.Event()
        after.record(compute)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            if self.profile:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(enable_timing=self.profile)
            done.record(self.stream)
            if self.profile:
                self._timings.append((start, done))
        return done

    def wait(self, ticket) -> float:
        if ticket is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket)
        return 0.0

    def copy_now(self, pairs: Pairs) -> None:
        for dst, src in pairs:  # on the compute stream, after the slot's last user
            dst.copy_(src, non_blocking=True)

    def close(self) -> None:
        self.stream.synchronize()


@dataclass
class _Layer:
    index: int
    module: nn.Module
    entries: list[layout.Entry]
    host: torch.Tensor          # packed uint8 image
    slot: int
    next_user: int              # layer index that uses this slot next (cyclic)
    saved: list                 # (owner, attr, kind, original tensor)


def _layer_device(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    raise ValueError("layer has no tensors to stream")


class WeightStreamer:
    """Streams the weights of ``remapped`` layers (indices into ``layers``) through shared slots.

    Args:
        layers: the model's decoder layers in execution order (e.g. ``model.model.layers``).
        remapped: indices of the layers to stream.
        num_slots: 1 or 2 shared slots.
        device: compute device (default: the first remapped layer's device).
        sources: optional ``{index: WeightRegion}`` of already packed layers; their host copies and
            layouts are used directly (no second host copy, works after the region was released).
        slot_factory: ``f(nbytes) -> uint8 tensor`` for slot memory (e.g. a pool region);
            default ``torch.empty`` on the device.
        copy_plan: optional ``f(index, slot, slot_tensor, host_image) -> [(dst, src), ...]``, what
            loading layer ``index`` into ``slot`` copies (default: the image into the slot's head).
    """

    def __init__(self, layers: Sequence[nn.Module], remapped: Iterable[int], *, num_slots: int = 1,
                 device: torch.device | str | None = None, sources: Mapping[int, object] | None = None,
                 slot_factory: Callable[[int], torch.Tensor] | None = None, profile: bool = False,
                 copy_plan: Callable[[int, int, torch.Tensor, torch.Tensor], Pairs] | None = None):
        self.layers = list(layers)
        idx = sorted(set(int(i) for i in remapped))
        if not idx:
            raise ValueError("no remapped layers given")
        bad = [i for i in idx if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"remapped layer indices {bad} outside 0..{len(self.layers) - 1}")
        if num_slots not in (1, 2):
            raise ValueError(f"num_slots must be 1 or 2, got {num_slots}")
        self.remapped = idx
        self.num_slots = min(num_slots, len(idx))
        self.sources = dict(sources or {})
        self._device = torch.device(device) if device is not None else None
        self._slot_factory = slot_factory
        self._copy_plan = copy_plan
        self.profile = profile
        self.stats = StreamStats()
        self.installed = False

    # ------------------------------------------------------------------------------------------
    def install(self) -> "WeightStreamer":
        if self.installed:
            raise RuntimeError("weight streaming is already installed")
        n, S = len(self.remapped), self.num_slots
        first = self.layers[self.remapped[0]]
        src0 = self.sources.get(self.remapped[0])
        device = self._device or (src0.device if src0 is not None else _layer_device(first))
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self._layers: dict[int, _Layer] = {}
        for k, i in enumerate(self.remapped):
            region = self.sources.get(i)
            if region is not None:
                entries, host = region.entries, region.host_copy
                if host is None:
                    raise ValueError(f"source region {region.name!r} of layer {i} has no host copy")
            else:
                items = layout.module_tensors(self.layers[i])
                for name, *_x, t in items:
                    if isinstance(t, guard.ReleasedTensor):
                        raise LayerReleasedError(
                            f"layer {i} is released ({name}); pass its WeightRegion in sources= to stream it")
                entries, nbytes = layout.plan(items)
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                layout.pack(entries, [t for *_x, t in items], host)
            # The slot's next user is the next remapped layer (cyclically, across passes) that
            # computes from the same slot.
            nxt = next(self.remapped[(k + j) % n] for j in range(1, n + 1) if (k + j) % n % S == k % S)
            self._layers[i] = _Layer(i, self.layers[i], entries, host, k % S, nxt, [])
        slot_bytes = max(L.host.numel() for L in self._layers.values())
        make = self._slot_factory or (lambda nb: torch.empty(nb, dtype=torch.uint8, device=self.device))
        self.slots = [make(slot_bytes) for _ in range(S)]
        self._copier = (_CudaCopier(self.device, self.profile) if self.device.type == "cuda"
                        else _ThreadCopier(self.profile) if _spare_core() else _InlineCopier(self.profile))
        self._slot_holder = [-1] * S
        self._plans: dict[int, Pairs] = {}
        self._ticket: dict[int, object] = {}
        self._hooks = []
        try:
            # Point each remapped layer's tensors at its slot (fresh objects; the originals saved).
            for L in self._layers.values():
                base = self.slots[L.slot]
                views: dict[int, torch.Tensor] = {}
                for e in L.entries:
                    store = e.owner._parameters if e.kind == "param" else e.owner._buffers
                    L.saved.append((e.owner, e.attr, e.kind, store[e.attr]))
                    v = views.setdefault(e.offset, e.view(base))
                    store[e.attr] = nn.Parameter(v, requires_grad=False) if e.kind == "param" else v
            # Initial fill: the first S remapped layers own the slots.
            for i in self.remapped[:S]:
                self._load_now(i)
            for L in self._layers.values():
                self._hooks.append(_ForwardWrapper(L.module, self._make_pre(L.index), self._make_post(L.index)))
        except BaseException:
            # all or nothing: no layer is left pointing at a slot, no hook stays installed
            self._restore_saved(force=True)
            raise
        self.installed = True
        return self

    def _restore_saved(self, force: bool = False) -> None:
        """Put every saved tensor back, remove the forward wrappers and close the copier."""
        for L in self._layers.values():
            for owner, attr, kind, orig in reversed(L.saved):
                if isinstance(orig, guard.ReleasedTensor) and guard.released_region_of(orig._kun_original) is None:
                    orig = orig._kun_original  # its region was reloaded meanwhile
                (owner._parameters if kind == "param" else owner._buffers)[attr] = orig
            L.saved.clear()
        for h in self._hooks:
            h.remove()
        try:
            self._copier.close()
            self.stats.copy_s = self._copier.copy_seconds()
        except Exception:
            if not force:
                raise
        self._hooks, self.slots, self._ticket, self._plans = [], [], {}, {}

    def uninstall(self) -> None:
        """Remove the forward wrappers and restore the layers' own tensors (refuses if they are unmapped)."""
        if not self.installed:
            return
        for L in self._layers.values():
            for owner, attr, kind, orig in L.saved:
                if not isinstance(orig, guard.ReleasedTensor):
                    key = guard.released_region_of(orig)
                    if key is not None:
                        raise LayerReleasedError(
                            f"cannot uninstall streaming: layer {L.index}'s {attr!r} lives in released "
                            f"region {key!r}; reload the layer first")
        self._restore_saved()
        self.installed = False

    def __enter__(self) -> "WeightStreamer":
        return self.install() if not self.installed else self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def drain(self) -> None:
        """Wait for every copy in flight (before slot or layer memory is touched)."""
        if self.installed:
            for ticket in list(self._ticket.values()):
                self._copier.wait(ticket)
            self._ticket.clear()

    def prefetch_copy_seconds(self) -> float:
        """Total time the side stream spent in prefetch copies (needs ``profile=True``)."""
        return self._copier.copy_seconds() if self.installed else self.stats.copy_s

    def slot_of(self, i: int) -> int:
        """The slot that remapped layer ``i`` computes from."""
        return self._layers[i].slot

    @property
    def slot_bytes(self) -> int:
        return self.slots[0].numel() if self.installed else 0

    # ------------------------------------------------------------------------------------------
    def _pairs(self, i: int) -> Pairs:
        """The copies that put layer ``i`` into its slot (computed once per layer)."""
        L = self._layers[i]
        pairs = self._plans.get(i)
        if pairs is None:
            slot = self.slots[L.slot]
            pairs = (self._copy_plan(i, L.slot, slot, L.host) if self._copy_plan is not None
                     else [(slot[:L.host.numel()], L.host)])
            self._plans[i] = pairs
        return pairs

    def _load_now(self, i: int) -> None:
        """Synchronously (in compute-stream order) put layer ``i`` into its slot."""
        L = self._layers[i]
        holder = self._slot_holder[L.slot]
        if holder >= 0:  # never overwrite a slot while a copy into it is in flight
            self.stats.wait_s += self._copier.wait(self._ticket.pop(holder, None))
        pairs = self._pairs(i)
        self._copier.copy_now(pairs)
        self._slot_holder[L.slot] = i
        self._ticket[i] = None
        self.stats.copies += 1
        self.stats.bytes_copied += _nbytes(pairs)

    def _make_pre(self, i: int):
        def pre_hook(module, args):
            L = self._layers[i]
            if self._slot_holder[L.slot] != i:
                self.stats.sync_loads += 1
                self._load_now(i)
            else:
                self.stats.wait_s += self._copier.wait(self._ticket.pop(i, None))
        return pre_hook

    def _make_post(self, i: int):
        def post_hook(module, args, output):
            L = self._layers[i]
            nxt = L.next_user
            if nxt == i or self._slot_holder[L.slot] != i:
                return None
            pairs = self._pairs(nxt)
            self._ticket[nxt] = self._copier.copy_async(pairs)
            self._slot_holder[L.slot] = nxt
            self.stats.copies += 1
            self.stats.bytes_copied += _nbytes(pairs)
            return None
        return post_hook


class _ForwardWrapper:
    """``pre(module, args)``, the module's own forward, then ``post(module, args, output)``: set as
    the module's instance ``forward`` (``nn.Module.__call__`` calls it on its hook-free fast path);
    ``remove()`` puts back whatever instance attribute was there before (usually none)."""

    _MISSING = object()

    def __init__(self, module: nn.Module, pre, post) -> None:
        self.module = module
        self._before = module.__dict__.get("forward", self._MISSING)
        inner = module.forward

        def forward(*args, **kwargs):
            pre(module, args)
            out = inner(*args, **kwargs)
            post(module, args, out)
            return out

        self._forward = forward
        module.forward = forward

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is not self._forward:
            return  # already removed (or replaced by someone else since)
        if self._before is self._MISSING:
            del self.module.forward
        else:
            self.module.forward = self._before


def _nbytes(pairs: Pairs) -> int:
    return sum(src.numel() * src.element_size() for _, src in pairs)


def install_streaming(layers: Sequence[nn.Module], remapped: Iterable[int], num_slots: int = 1,
                      **kwargs) -> WeightStreamer:
    """Build a :class:`WeightStreamer` and install it; ``uninstall()`` restores the resident model."""
    return WeightStreamer(layers, remapped, num_slots=num_slots, **kwargs).install()


__all__ = ["StreamStats", "WeightStreamer", "install_streaming"]
