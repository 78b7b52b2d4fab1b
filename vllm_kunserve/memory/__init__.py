"""Engine-agnostic memory mechanisms: the physical chunk pool (CUDA VMM or host memfd) backing
weight and growable KV regions, and weight streaming of remapped layers (``streaming``).

Importing this package never needs cuda-python; the CUDA backend loads it on first use.
"""

from .backend import Backend, cuda_available, make_backend
from .errors import (BackendUnavailableError, InjectedFault, LayerReleasedError, MapError,
                     MemoryPoolError, PoolExhaustedError)
from .guard import ReleasedTensor, check_resident
from .pool import FaultInjector, KVRegion, MemoryPool, PoolStats, Region, WeightRegion

__all__ = [
    "Backend", "BackendUnavailableError", "FaultInjector", "InjectedFault", "KVRegion",
    "LayerReleasedError", "MapError", "MemoryPool", "MemoryPoolError", "PoolExhaustedError",
    "PoolStats", "Region", "ReleasedTensor", "WeightRegion", "check_resident", "cuda_available",
    "make_backend",
]
