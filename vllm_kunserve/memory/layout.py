"""Packing named tensors into one byte image and viewing them back out of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

ALIGN = 256  # bytes; enough for any dtype and for vectorised kernels


@dataclass(frozen=True)
class Entry:
    """One tensor inside a packed image. ``owner``/``attr``/``kind`` locate it on a module."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: nn.Module | None = None
    attr: str | None = None
    kind: str = "tensor"  # "param", "buffer" or "tensor"

    def view(self, base: torch.Tensor) -> torch.Tensor:
        """The entry's tensor viewing ``base`` (a uint8 tensor over the image), no copy."""
        raw = base[self.offset:self.offset + self.nbytes]
        return raw.view(self.dtype).view(self.shape)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def module_tensors(module: nn.Module) -> list[tuple[str, nn.Module, str, str, torch.Tensor]]:
    """``(name, owner, attr, kind, tensor)`` for every parameter and buffer, shared ones once."""
    out, seen = [], set()
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for kind, store in (("param", mod._parameters), ("buffer", mod._buffers)):
            for attr, t in store.items():
                if t is None:
                    continue
                name = f"{mod_name}.{attr}" if mod_name else attr
                key = (id(mod), attr)
                if key in seen:
                    continue
                seen.add(key)
                out.append((name, mod, attr, kind, t))
    return out


def plan(items: Iterable[tuple[str, nn.Module | None, str | None, str, torch.Tensor]]
         ) -> tuple[list[Entry], int]:
    """Lay the tensors out back to back (``ALIGN``-aligned); return the entries and image size.

    A tensor object registered twice (tied weights) gets one slot that both entries view.
    """
    entries, off, placed = [], 0, {}
    for name, owner, attr, kind, t in items:
        n = _nbytes(t)
        if id(t) in placed:
            entries.append(Entry(name, placed[id(t)], n, tuple(t.shape), t.dtype, owner, attr, kind))
            continue
        placed[id(t)] = off
        entries.append(Entry(name, off, n, tuple(t.shape), t.dtype, owner, attr, kind))
        off = _round_up(off + n, ALIGN)
    return entries, off


def plan_module(module: nn.Module) -> tuple[list[Entry], int]:
    return plan(module_tensors(module))


def plan_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[list[Entry], int]:
    return plan((k, None, None, "tensor", v) for k, v in tensors.items())


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view (or contiguous copy) of ``t``'s data."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def pack(entries: list[Entry], sources: list[torch.Tensor], image: torch.Tensor) -> None:
    """Copy ``sources`` (same order as ``entries``) into the uint8 ``image``."""
    for e, t in zip(entries, sources):
        if e.nbytes:
            image[e.offset:e.offset + e.nbytes].copy_(as_bytes(t))
