"""Scrape a server's Prometheus ``/metrics`` once a second during a replay.

Kept per scrape (values summed over label sets, except percentages which are averaged):
``vllm:kv_cache_usage_perc``, ``vllm:num_preemptions_total``, ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, the sums and counts of the queue-time, time-to-first-token and
end-to-end latency histograms (the engine's own view of a request), and every sample whose
name starts with ``kunserve:`` (kept with its labels, e.g. ``kunserve:groups{...}``).
``vllm:cache_config_info`` labels (num_gpu_blocks, block_size) are read once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

VLLM_SERIES = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:request_queue_time_seconds_sum": "queue_time_sum",
    "vllm:request_queue_time_seconds_count": "queue_time_count",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:e2e_request_latency_seconds_sum": "e2e_sum",
    "vllm:e2e_request_latency_seconds_count": "e2e_count",
}
_MEAN = {"kv_usage"}


def metrics_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    for suffix in ("/v1/completions", "/v1"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base + "/metrics"


def _label_key(name: str, labels: dict[str, str]) -> str:
    keep = {k: v for k, v in sorted(labels.items()) if k not in ("model_name", "engine")}
    return name if not keep else name + "{" + ",".join(f"{k}={v}" for k, v in keep.items()) + "}"


_KEEP = tuple(VLLM_SERIES) + ("kunserve:", "vllm:cache_config_info")


def _kept_lines(text: str, keep: tuple[str, ...] = _KEEP) -> str:
    """Only the sample lines ``parse_metrics`` keeps. A 2-engine cluster exposes ~100 KB of
    histograms; parsing all of it on the replay client's event loop once a second delayed sends by
    up to 0.85 s on a 2-core machine whose cores the engines hold (a late client, not a slow server)."""
    return "\n".join(line for line in text.splitlines() if line.startswith(keep)) + "\n"


def parse_metrics(text: str, series: dict[str, str] = VLLM_SERIES) -> tuple[dict[str, float], dict[str, str]]:
    """(values, cache_config_labels) from a Prometheus text exposition; ``series`` names the ``vllm:``
    samples kept and their keys (the replay's by default)."""
    keep = _KEEP if series is VLLM_SERIES else (*series, "kunserve:", "vllm:cache_config_info")
    sums: dict[str, list[float]] = {}
    info: dict[str, str] = {}
    for family in text_string_to_metric_families(_kept_lines(text, keep)):
        for s in family.samples:
            if s.name in series:
                sums.setdefault(series[s.name], []).append(float(s.value))
            elif s.name.startswith("kunserve:"):
                sums.setdefault(_label_key(s.name, s.labels), []).append(float(s.value))
            elif s.name == "vllm:cache_config_info" and not info:
                info = dict(s.labels)
    values = {k: (sum(v) / len(v) if k in _MEAN else sum(v)) for k, v in sums.items()}
    return values, info


def engine_metrics(url: str, series: dict[str, str] = VLLM_SERIES, timeout_s: float = 30.0) -> dict[str, float]:
    """A server's ``/metrics`` now, parsed as the replay's scraper does (sums over label sets), from
    synchronous code (benchmark harnesses). Raises OSError when the server does not answer."""
    import urllib.request

    with urllib.request.urlopen(metrics_url(url), timeout=timeout_s) as r:
        return parse_metrics(r.read().decode(), series)[0]


@dataclass
class Scraper:
    endpoint: str
    interval_s: float = 1.0
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    cache_info: dict[str, str] = field(default_factory=dict)
    errors: int = 0
    last_error: str = ""
    t0: float = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        url = metrics_url(self.endpoint)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    async with session.get(url) as resp:
                        if resp.status != 200:
                            raise RuntimeError(f"HTTP {resp.status}")
                        text = await resp.text()
                    values, info = parse_metrics(text)
                    self.cache_info = self.cache_info or info
                    self.samples.append((time.perf_counter() - self.t0, values))
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
                    self.errors += 1
                    self.last_error = f"{type(e).__name__}: {e}"
                wait = self.interval_s - (time.perf_counter() - started)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=max(wait, 0.01))
                except asyncio.TimeoutError:
                    pass

    def baseline(self) -> dict[str, float]:
        return self.samples[0][1] if self.samples else {}

    def series(self) -> list[dict[str, Any]]:
        return [{"t": t, **v} for t, v in self.samples]


async def scrape_once(endpoint: str, timeout_s: float = 5.0) -> tuple[dict[str, float], dict[str, str]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(metrics_url(endpoint)) as resp:
            resp.raise_for_status()
            return parse_metrics(await resp.text())
