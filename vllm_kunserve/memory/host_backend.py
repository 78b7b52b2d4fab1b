"""Host backend: Linux memfd chunks mapped with ``MAP_FIXED`` into ``PROT_NONE`` reservations.

This is the CPU twin of the CUDA virtual-memory API: a reservation is an anonymous ``PROT_NONE``
mapping (address space only), the physical memory is one memfd whose fixed-size slices are the
chunks, mapping a chunk is ``mmap(MAP_SHARED | MAP_FIXED)`` of its slice over part of the
reservation, and unmapping puts a fresh ``PROT_NONE`` mapping back so the addresses stay reserved.
Python's ``mmap`` module cannot map at a fixed address, hence ctypes.
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os
import sys
import threading

import torch

from .backend_base import Backend
from .errors import BackendUnavailableError

# Linux values (identical on x86-64 and aarch64).
PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE, MAP_POPULATE = 0x01, 0x02, 0x10, 0x20, 0x4000, 0x8000
_MAP_FAILED = ctypes.c_void_p(-1).value
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02

DEFAULT_CHUNK_BYTES = 2 << 20

_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.fallocate.restype = ctypes.c_int
        lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        _libc = lib
    return _libc


def _mmap_call(addr: int, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    res = _lib().mmap(ctypes.c_void_p(addr or None), length, prot, flags, fd, offset)
    if res is None or res == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap(addr={addr:#x}, len={length}, fd={fd}, off={offset}) failed: "
                           f"{os.strerror(err)}")
    if flags & MAP_FIXED and res != addr:
        raise OSError(0, f"mmap MAP_FIXED returned {res:#x}, expected {addr:#x}")
    return res


class HostBackend(Backend):
    """Chunks are slices of one growing memfd; chunk size is a multiple of the page size."""

    name = "host"

    def __init__(self, chunk_bytes: int | None = None):
        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
            raise BackendUnavailableError("the host memory backend needs Linux (memfd_create, mmap MAP_FIXED)")
        self.device = torch.device("cpu")
        self.granularity = _mmap.PAGESIZE
        self.default_chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
        self._fd = os.memfd_create("kunserve-pool", getattr(os, "MFD_CLOEXEC", 1))
        self.populate = MAP_POPULATE   # 0: map lazily, page by page (benchmarks/memory_pool.py compares)
        self._size = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> int:
        return _mmap_call(0, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)

    def free_reservation(self, va: int, nbytes: int) -> None:
        if _lib().munmap(ctypes.c_void_p(va), nbytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap({va:#x}, {nbytes}) failed: {os.strerror(err)}")

    def create_chunk(self, index: int, chunk_bytes: int) -> int:
        offset = index * chunk_bytes
        with self._lock:
            if offset + chunk_bytes > self._size:
                os.ftruncate(self._fd, offset + chunk_bytes)
                self._size = offset + chunk_bytes
        return offset  # the handle is the chunk's offset in the memfd

    def release_chunk(self, handle: int, chunk_bytes: int) -> None:
        pass  # the memfd is closed as a whole in close()

    def give_back(self, handle: int, index: int, chunk_bytes: int) -> int:
        # punch the chunk's pages out of the memfd: the host has them back at once; the slice stays
        # (create_chunk hands out the same offset, and its pages come back zeroed when touched)
        if _lib().fallocate(self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, handle, chunk_bytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fallocate(punch hole at {handle}, {chunk_bytes}) failed: {os.strerror(err)}")
        return handle

    def map(self, va: int, chunk_bytes: int, handle: int) -> None:
        # MAP_POPULATE: a mapped chunk is always written next (zeroed KV, a reloaded layer, a peer's
        # KV), and one populate call costs less than a page fault per 4 KiB page
        # (docs/benchmarks/mechanisms_memory_pool.md measures both ways).
        _mmap_call(va, chunk_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | self.populate, self._fd, handle)

    def unmap(self, va: int, nbytes: int) -> None:
        # Replace with PROT_NONE so the range stays reserved; the memfd keeps the data.
        _mmap_call(va, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)

    def unmap_chunks(self, va: int, chunk_bytes: int, n: int) -> None:
        self.unmap(va, chunk_bytes * n)  # one call replaces the whole range

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        buf = (ctypes.c_ubyte * nbytes).from_address(va)
        return torch.frombuffer(buf, dtype=torch.uint8)  # keeps ``buf`` alive, no copy

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
