"""Backend selection for the physical memory pool: :func:`make_backend`, :func:`cuda_available`.

The interface, :class:`Backend`, lives in ``backend_base`` (the backends import it from there, so
this module may import them without a circle).
"""

from __future__ import annotations

import torch

from .backend_base import Backend
from .errors import BackendUnavailableError


def cuda_available() -> bool:
    """True when the CUDA driver backend can run (cuda-python importable, driver and a device)."""
    try:
        from .cuda_backend import probe
    except ImportError:
        return False
    return probe() is None


def make_backend(kind: str = "auto", *, device: int | str | torch.device | None = None,
                 chunk_bytes: int | None = None) -> Backend:
    """Build a backend. ``auto`` picks ``cuda`` when usable, else ``host``.

    Asking for ``cuda`` where it cannot run raises :class:`BackendUnavailableError` naming why.
    """
    if isinstance(kind, Backend):
        return kind
    if kind not in ("auto", "cuda", "host"):
        raise ValueError(f"memory backend must be one of auto, cuda, host; got {kind!r}")
    if kind == "auto":
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type == "cpu":
            kind = "host"
        else:
            kind = "cuda" if cuda_available() else "host"
    if kind == "cuda":
        from .cuda_backend import CudaBackend  # lazy: cuda-python is optional
        return CudaBackend(device)
    from .host_backend import HostBackend
    return HostBackend(chunk_bytes=chunk_bytes)


__all__ = ["Backend", "BackendUnavailableError", "cuda_available", "make_backend"]
