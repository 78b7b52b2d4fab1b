"""Devices and links of the simulated cluster.

GPU peak figures are vendor datasheet numbers (dense bf16 tensor FLOP/s, HBM bandwidth); the
``*_eff`` factors are the achievable share used for the attention term (linear layers use Vidur's
measured times instead). Links are ``policy.transfer.Link``; NVLink and InfiniBand come from Vidur's
measured ``send_recv.csv`` profiles (Microsoft Vidur, MIT license) fitted by
``policy.transfer.load_vidur_send_recv`` to ``t = latency + bytes / bandwidth``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from vllm_kunserve.policy.transfer import Link, load_vidur_send_recv

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


LINKS = {  # fallbacks when the Vidur profile is absent (datasheet-level figures)
    "nvlink": Link(300e9, 10e-6, "nvlink"),
    "ib": Link(40e9, 20e-6, "ib"),
    "pcie": Link(25e9, 10e-6, "pcie"),
    "local": Link(1e15, 0.0, "local"),
}


def get_link(name: str) -> Link:
    """``nvlink`` / ``ib`` from Vidur's h100_dgx profile when present, else datasheet fallbacks;
    ``pcie`` and ``local`` are fixed."""
    key = name.lower()
    if key in ("nvlink", "ib"):
        path = os.path.join(data_dir(), "profiles", "vidur", "network", "h100_dgx", "send_recv.csv")
        if os.path.isfile(path):
            return load_vidur_send_recv(path, devices_per_node=2 if key == "nvlink" else 1,
                                        name=f"vidur:h100_dgx:{'intra' if key == 'nvlink' else 'inter'}")
    if key not in LINKS:
        raise ValueError(f"--link {name!r}: unknown; one of {', '.join(LINKS)}")
    return LINKS[key]
