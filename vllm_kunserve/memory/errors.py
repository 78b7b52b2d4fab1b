"""Errors raised by the memory pool and weight streaming."""

from __future__ import annotations


class MemoryPoolError(RuntimeError):
    """Base class for pool errors."""


class BackendUnavailableError(MemoryPoolError):
    """The requested backend cannot run here (no CUDA driver, no cuda-python, not Linux...)."""


class PoolExhaustedError(MemoryPoolError):
    """Not enough free chunks; nothing was changed."""


class MapError(MemoryPoolError):
    """Mapping chunks failed part-way; the operation was rolled back to the previous state."""


class LayerReleasedError(MemoryPoolError):
    """A tensor of a released layer was used; reload the layer first."""


class InjectedFault(OSError):
    """Raised by :class:`FaultInjector` to simulate a driver/kernel map failure in tests."""
