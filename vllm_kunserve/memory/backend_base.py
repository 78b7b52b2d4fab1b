"""The interface of a physical memory pool backend (the CUDA VMM and host memfd backends implement it).

A backend knows how to reserve virtual address ranges, create fixed-size physical chunks, map a
chunk at an address inside a reservation, unmap it again and wrap an address range as a torch
tensor without copying. The pool (``pool.py``) does the bookkeeping on top.
"""

from __future__ import annotations

import abc
from typing import Any

import torch


class Backend(abc.ABC):
    """One device's virtual-memory primitives. Chunk handles are opaque to the pool."""

    name: str = "?"
    device: torch.device
    granularity: int  # chunk sizes and reservations are multiples of this
    default_chunk_bytes: int  # the pool's chunk when none is given

    @property
    def max_auto_chunk_bytes(self) -> int:
        """Largest chunk an automatic choice (``memory.chunk_kib = 0``) may take on this device."""
        return self.default_chunk_bytes

    @abc.abstractmethod
    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of address space (nothing mapped); return its base address."""

    @abc.abstractmethod
    def free_reservation(self, va: int, nbytes: int) -> None:
        """Give back a reservation whose chunks are all unmapped."""

    @abc.abstractmethod
    def create_chunk(self, index: int, chunk_bytes: int) -> Any:
        """Create physical chunk number ``index``; return its handle."""

    @abc.abstractmethod
    def release_chunk(self, handle: Any, chunk_bytes: int) -> None:
        """Free a chunk's physical memory (pool shutdown)."""

    def give_back(self, handle: Any, index: int, chunk_bytes: int) -> Any:
        """Return a free chunk's physical memory to the device (or host) while the pool runs, so that
        another process can have it; :meth:`create_chunk` with the same index makes it again. Returns
        what the pool keeps as the chunk's handle meanwhile."""
        self.release_chunk(handle, chunk_bytes)
        return None

    @abc.abstractmethod
    def map(self, va: int, chunk_bytes: int, handle: Any) -> None:
        """Map one chunk at ``va`` (inside a reservation)."""

    def set_access(self, va: int, nbytes: int) -> None:
        """Make a freshly mapped contiguous range readable and writable (CUDA needs it)."""

    @abc.abstractmethod
    def unmap(self, va: int, nbytes: int) -> None:
        """Unmap a range; the reservation stays (the addresses are not handed to anyone else)."""

    def unmap_chunks(self, va: int, chunk_bytes: int, n: int) -> None:
        """Unmap ``n`` consecutive chunks; one call per chunk (CUDA requires whole mappings)."""
        for i in range(n):
            self.unmap(va + i * chunk_bytes, chunk_bytes)

    def synchronize(self) -> None:
        """Wait for all device work that may touch mapped memory (called before unmapping)."""

    @abc.abstractmethod
    def view(self, va: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``[va, va + nbytes)`` sharing the memory (no copy)."""

    def close(self) -> None:
        """Release backend-wide resources after all chunks were released."""

    @property
    def pin_host_copies(self) -> bool:
        """Whether host copies of weights should be pinned (only useful for a device backend)."""
        return False


__all__ = ["Backend"]
