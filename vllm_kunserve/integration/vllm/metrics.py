"""kunserve's Prometheus metrics (``kunserve:*``), registered once per process.

In the engine-core process these live in prometheus_client's default registry. ``vllm serve``
exposes them on ``/metrics`` when ``PROMETHEUS_MULTIPROC_DIR`` is set (``kunserve compare`` and the
launcher set it); in-process engines (``LLM``) see them in the default registry.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_metrics: dict[str, Any] = {}


def get() -> dict[str, Any]:
    with _lock:
        if _metrics:
            return _metrics
        from prometheus_client import Counter, Gauge, Histogram

        _metrics.update(
            remapped_layers=Gauge("kunserve:remapped_layers", "Decoder layers whose weights are remapped to KV "
                                  "and streamed from host memory", ["engine"], multiprocess_mode="mostrecent"),
            kv_blocks_total=Gauge("kunserve:kv_blocks_total", "Usable KV cache blocks now (grows with remap)",
                                  ["engine"], multiprocess_mode="mostrecent"),
            kv_blocks_base=Gauge("kunserve:kv_blocks_base", "KV cache blocks without any remap",
                                 ["engine"], multiprocess_mode="mostrecent"),
            events=Counter("kunserve:memory_events", "Remap/revert events by kind and outcome",
                           ["engine", "kind", "outcome"]),
            event_seconds=Histogram("kunserve:memory_event_seconds", "Duration of remap/revert operations",
                                    ["engine", "kind"], buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5)),
            controller_errors=Counter("kunserve:controller_errors", "Errors caught by the engine agent's "
                                      "exception boundary (the engine kept serving)", ["engine", "where"]),
            event_bytes=Counter("kunserve:memory_event_bytes", "Weight bytes moved by remap/revert",
                                ["engine", "kind"]),
        )
        return _metrics
