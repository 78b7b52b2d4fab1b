"""CUDA backend: the driver's virtual memory management API through cuda-python.

``cuMemAddressReserve`` reserves a region, ``cuMemCreate`` makes one physical chunk of the
allocation granularity (or a multiple), ``cuMemMap`` + ``cuMemSetAccess`` map chunks into a region
and ``cuMemUnmap`` takes them out again (after a device synchronize), so tensors built on a region
keep their address and attention kernels run unmodified.

cuda-python is optional (the ``cuda`` extra): it is imported lazily, and a missing package or driver
becomes a :class:`BackendUnavailableError` saying which.
"""

from __future__ import annotations

from typing import Any

import torch

from .backend_base import Backend
from .errors import BackendUnavailableError

_driver = None


def _load_driver():
    """Import ``cuda.bindings.driver`` (cuda-python >= 12.6) or the older ``cuda.cuda``."""
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver  # type: ignore
        except ImportError:
            try:
                from cuda import cuda as driver  # type: ignore  # cuda-python < 12.6
            except ImportError as exc:
                raise BackendUnavailableError(
                    "memory backend 'cuda' needs cuda-python: pip install 'vllm-kunserve[cuda]'") from exc
        _driver = driver
    return _driver


def _check(result, what: str):
    """cuda-python returns ``(CUresult, *values)``; raise on error, return the values."""
    if not isinstance(result, tuple):
        result = (result,)
    err, rest = result[0], result[1:]
    drv = _load_driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        try:
            _, msg = drv.cuGetErrorString(err)
            msg = msg.decode() if isinstance(msg, bytes) else str(msg)
        except Exception:  # pragma: no cover - best effort message
            msg = ""
        raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)} {msg}".strip())
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def probe() -> str | None:
    """None when the CUDA backend can run here, else a sentence saying why not."""
    try:
        drv = _load_driver()
    except BackendUnavailableError as exc:
        return str(exc)
    if not torch.cuda.is_available():
        return "memory backend 'cuda' needs a CUDA device visible to torch (torch.cuda.is_available() is False)"
    try:
        _check(drv.cuInit(0), "cuInit")
    except Exception as exc:  # no libcuda.so / driver too old
        return f"memory backend 'cuda' cannot initialise the CUDA driver: {exc}"
    return None


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` holder so torch can wrap a device pointer (no copy)."""

    def __init__(self, ptr: int, nbytes: int, owner: Any):
        self._owner = owner  # keep the backend alive while a view exists
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None,
        }


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: int | str | torch.device | None = None):
        reason = probe()
        if reason is not None:
            raise BackendUnavailableError(reason)
        drv = _load_driver()
        self._drv = drv
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            raise ValueError(f"CUDA memory backend needs a cuda device, got {dev}")
        ordinal = dev.index if dev.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", ordinal)
        self.ordinal = ordinal
        # Make sure torch's primary context exists and is current on this thread.
        torch.cuda.set_device(ordinal)
        torch.empty(1, device=self.device)
        ctx = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:
            cu_dev = _check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
            ctx = _check(drv.cuDevicePrimaryCtxRetain(cu_dev), "cuDevicePrimaryCtxRetain")
            _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        self._prop = prop
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self.granularity = int(_check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self.default_chunk_bytes = max(self.granularity, 2 << 20)

    @property
    def max_auto_chunk_bytes(self) -> int:
        # each chunk is one cuMemMap/cuMemUnmap call (~50 us on an H100): 10 GB into KV took 238 ms
        # at the 2 MiB granularity, 17-20 ms at 32 MiB (docs/benchmarks/mechanisms_memory_pool_gpu.md)
        return max(self.granularity, 32 << 20)

    def _ptr(self, va: int):
        return self._drv.CUdeviceptr(int(va))

    def reserve(self, nbytes: int) -> int:
        ptr = _check(self._drv.cuMemAddressReserve(nbytes, self.granularity, self._ptr(0), 0),
                     "cuMemAddressReserve")
        return int(ptr)

    def free_reservation(self, va: int, nbytes: int) -> None:
        _check(self._drv.cuMemAddressFree(self._ptr(va), nbytes), "cuMemAddressFree")

    def create_chunk(self, index: int, chunk_bytes: int) -> Any:
        return _check(self._drv.cuMemCreate(chunk_bytes, self._prop, 0), "cuMemCreate")

    def release_chunk(self, handle: Any, chunk_bytes: int) -> None:
        _check(self._drv.cuMemRelease(handle), "cuMemRelease")

    def map(self, va: int, chunk_bytes: int, handle: Any) -> None:
        _check(self._drv.cuMemMap(self._ptr(va), chunk_bytes, 0, handle, 0), "cuMemMap")

    def set_access(self, va: int, nbytes: int) -> None:
        _check(self._drv.cuMemSetAccess(self._ptr(va), nbytes, [self._access], 1), "cuMemSetAccess")

    def unmap(self, va: int, nbytes: int) -> None:
        _check(self._drv.cuMemUnmap(self._ptr(va), nbytes), "cuMemUnmap")

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.as_tensor(_CudaArray(va, nbytes, self), device=self.device)

    @property
    def pin_host_copies(self) -> bool:
        return True
