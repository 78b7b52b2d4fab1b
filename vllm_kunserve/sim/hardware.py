"""Devices and links of the simulated cluster.

GPU peak figures are vendor datasheet numbers (dense bf16 tensor FLOP/s, HBM bandwidth); the
``*_eff`` factors are the achievable share used for the attention term (linear layers use Vidur's
measured times instead). Link times come from Vidur's measured ``send_recv.csv`` profiles
(Microsoft Vidur, MIT license) fitted to ``t = latency + bytes / bandwidth``.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, replace

import numpy as np

DEFAULT_DATA = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data"))


def data_dir() -> str:
    return os.environ.get("KUNSERVE_DATA", DEFAULT_DATA)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    mem_bytes: int
    flops: float          # dense 16-bit tensor FLOP/s
    hbm_bw: float         # bytes/s
    pcie_bw: float        # host<->device bytes/s, effective
    flops_eff: float = 0.5
    hbm_eff: float = 0.7
    vidur_name: str = ""  # folder under profiles/vidur/


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 80 * 10**9, 989e12, 3.35e12, 25e9, vidur_name="h100"),
    "a100": GpuSpec("a100", 80 * 10**9, 312e12, 2.0e12, 20e9, vidur_name="a100"),
    # the CPU "device" used to replay the harness's vLLM-CPU runs; step times come from a measured
    # profile, so only memory and the host link matter here
    "cpu": GpuSpec("cpu", 16 * 2**30, 1e12, 50e9, 50e9),
}


def get_gpu(name: str, mem_gb: float | None = None) -> GpuSpec:
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r}: unknown; one of {', '.join(GPUS)}")
    g = GPUS[key]
    if mem_gb is not None:
        if not mem_gb > 0:
            raise ValueError(f"--gpu-mem-gb {mem_gb}: must be positive")
        g = replace(g, mem_bytes=int(mem_gb * 10**9))
    return g


@dataclass(frozen=True)
class Link:
    """Point-to-point link: ``time(bytes) = latency_s + bytes / bw``."""

    name: str
    latency_s: float
    bw: float  # bytes/s

    def time(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bw


LINKS = {  # fallbacks when the Vidur profile is absent (datasheet-level figures)
    "nvlink": Link("nvlink", 10e-6, 300e9),
    "ib": Link("ib", 20e-6, 40e9),
    "pcie": Link("pcie", 10e-6, 25e9),
    "local": Link("local", 0.0, 1e15),
}


def fit_send_recv(path: str, intra_node: bool = True) -> Link:
    """Fit ``latency + bytes/bw`` (least squares on the medians) to a Vidur send_recv.csv.

    ``intra_node`` keeps rows with ``devices_per_node == 2`` (both GPUs in one node: NVLink),
    otherwise ``== 1`` (one GPU per node: the inter-node network).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"network profile {path} not found")
    xs, ys = [], []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            try:
                dpn = int(row["devices_per_node"])
                if (dpn == 2) != intra_node:
                    continue
                xs.append(float(row["size"]))
                ys.append(float(row["time_stats.send_recv.median"]) * 1e-3)
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}:{i}: bad send_recv row ({e})") from None
    if len(xs) < 2:
        raise ValueError(f"{path}: fewer than 2 usable rows for intra_node={intra_node}")
    a = np.vstack([np.ones(len(xs)), np.asarray(xs)]).T
    (lat, inv_bw), *_ = np.linalg.lstsq(a, np.asarray(ys), rcond=None)
    lat, inv_bw = max(lat, 0.0), max(inv_bw, 1e-15)
    return Link(f"vidur:{os.path.basename(os.path.dirname(path))}:{'intra' if intra_node else 'inter'}",
                float(lat), float(1.0 / inv_bw))


def get_link(name: str) -> Link:
    """``nvlink`` / ``ib`` from Vidur's h100_dgx profile when present, else datasheet fallbacks;
    ``pcie`` and ``local`` are fixed."""
    key = name.lower()
    if key in ("nvlink", "ib"):
        path = os.path.join(data_dir(), "profiles", "vidur", "network", "h100_dgx", "send_recv.csv")
        if os.path.isfile(path):
            return fit_send_recv(path, intra_node=(key == "nvlink"))
    if key not in LINKS:
        raise ValueError(f"--link {name!r}: unknown; one of {', '.join(LINKS)}")
    return LINKS[key]
