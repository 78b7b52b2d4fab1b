"""Guards for released layers, and the registry of released address ranges.

A tensor viewing unmapped memory would crash the process (SIGSEGV on the host, an illegal address
on the GPU) instead of raising. So when a layer is released, every module parameter or buffer that
viewed its region is swapped for a :class:`ReleasedTensor`: a metadata-only tensor (shape, dtype and
device still readable) on which any operation raises :class:`LayerReleasedError` naming the layer.
Raw views a caller kept aside cannot be invalidated; :func:`check_resident` lets code that holds
such tensors (e.g. weight streaming) verify them before use.
"""

from __future__ import annotations

import threading

import torch

from .errors import LayerReleasedError

_ALLOWED_GETTERS = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
}


_DEVICE_GETTER = torch.Tensor.device.__get__


class ReleasedTensor(torch.Tensor):
    """Stands in for a released layer's tensor; any use raises :class:`LayerReleasedError`."""

    @staticmethod
    def __new__(cls, original: torch.Tensor, region: str, name: str):
        meta = torch.empty(tuple(original.shape), dtype=original.dtype, device="meta")
        self = torch.Tensor._make_subclass(cls, meta, bool(original.requires_grad))
        self._kun_region = region
        self._kun_name = name
        self._kun_device = original.device
        self._kun_original = original  # restored by reload
        return self

    def _error(self) -> LayerReleasedError:
        return LayerReleasedError(
            f"tensor {self._kun_name!r} of layer {self._kun_region!r} was released to the memory pool "
            f"(its chunks now back other regions, e.g. KV cache); reload the layer before using it")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _ALLOWED_GETTERS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func == _DEVICE_GETTER:
            return args[0]._kun_device
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, ReleasedTensor):
                raise a._error()
            if isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, ReleasedTensor):
                        raise b._error()
        raise LayerReleasedError("a released layer's tensor was used; reload the layer first")

    def __repr__(self, *args, **kwargs):  # noqa: D105
        return (f"ReleasedTensor(layer={self._kun_region!r}, name={self._kun_name!r}, "
                f"shape={tuple(self.shape)}, dtype={self.dtype})")

    def __reduce_ex__(self, proto):
        raise self._error()


# (device string) -> {region name: (start, end)}
_released: dict[str, dict[str, tuple[int, int]]] = {}
_lock = threading.Lock()


def _dev(device: torch.device) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def mark_released(device: torch.device, key: str, start: int, end: int) -> None:
    with _lock:
        _released.setdefault(_dev(device), {})[key] = (start, end)


def mark_resident(device: torch.device, key: str) -> None:
    with _lock:
        _released.get(_dev(device), {}).pop(key, None)


def released_region_of(t: torch.Tensor) -> str | None:
    """The released region a plain tensor points into, or None."""
    if isinstance(t, ReleasedTensor):
        return t._kun_region
    if t.numel() == 0 or t.device.type == "meta":
        return None
    ptr = t.data_ptr()
    with _lock:
        for key, (start, end) in _released.get(_dev(t.device), {}).items():
            if start <= ptr < end:
                return key
    return None


def check_resident(t: torch.Tensor, what: str = "tensor") -> None:
    """Raise :class:`LayerReleasedError` if ``t`` is a guard or views a released region."""
    key = released_region_of(t)
    if key is not None:
        raise LayerReleasedError(f"{what} points into released layer region {key!r}; reload it first")
