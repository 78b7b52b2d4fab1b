"""Devices, links and clusters of the simulation.

GPU peak figures are vendor datasheet numbers (dense bf16 tensor FLOP/s, HBM bandwidth); the
``*_eff`` factors are the achievable share used for the attention term (linear layers use Vidur's
measured times instead). Links are ``policy.transfer.Link``; NVLink and InfiniBand come from Vidur's
measured ``send_recv.csv`` profiles (Microsoft Vidur, MIT license) fitted by
``policy.transfer.load_vidur_send_recv`` to ``t = latency + bytes / bandwidth``; ``rdma200`` is that
inter-node fit scaled to a 200 Gb/s NIC. A :class:`ClusterSpec` names a whole setup: GPU, instance
count, link, whether concurrent transfers on one GPU's port share its bandwidth
(``policy.transfer.SharedLink``), and what unmapping dropped weights costs (:class:`UnmapCost`).
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
    "rdma200": Link(25e9 * 0.72, 20e-6, "rdma200"),
    "pcie": Link(25e9, 10e-6, "pcie"),
    "local": Link(1e15, 0.0, "local"),
    # this project's own stage link (CUDA IPC between two processes on one H100), measured by
    # benchmarks/stage_link_gpu.py: the device's copy rate / 3 and what a hop adds to a CUDA-graphed
    # 7B decode step (docs/benchmarks/stage_link_gpu.json, "derived"; a unit test keeps them equal)
    "stage-h100": Link(415.367e9, 10.5e-6, "stage-h100 (measured: stage link, CUDA IPC, H100)"),
}
#: line rate of the NIC behind Vidur's h100_dgx inter-node profile (a DGX H100: 400 Gb/s per GPU)
VIDUR_IB_LINE_RATE = 400e9 / 8


def get_link(name: str) -> Link:
    """``nvlink`` / ``ib`` from Vidur's h100_dgx profile when present, else datasheet fallbacks;
    ``rdma200``: the ``ib`` fit's latency, and its bandwidth scaled from the profiled 400 Gb/s NIC
    to 200 Gb/s at the same efficiency (the KunServe paper's cluster); ``pcie``, ``local`` fixed."""
    key = name.lower()
    if key in ("nvlink", "ib", "rdma200"):
        path = os.path.join(data_dir(), "profiles", "vidur", "network", "h100_dgx", "send_recv.csv")
        if os.path.isfile(path):
            fit = load_vidur_send_recv(path, devices_per_node=2 if key == "nvlink" else 1,
                                       name=f"vidur:h100_dgx:{'intra' if key == 'nvlink' else 'inter'}")
            if key != "rdma200":
                return fit
            eff = fit.bandwidth_bytes_per_s / VIDUR_IB_LINE_RATE
            return Link(200e9 / 8 * eff, fit.latency_s, f"rdma200 ({fit.name} x 200/400 Gb/s)")
    if key not in LINKS:
        raise ValueError(f"--link {name!r}: unknown; one of {', '.join(LINKS)}")
    return LINKS[key]


@dataclass(frozen=True)
class UnmapCost:
    """Time for an instance to unmap the weights of the layers it drops and map the freed pages
    into its KV pool before the new pipeline group can run: ``fixed_s + per_gb_s x GB``, paid
    after the instance's last step under the old layout. The default is an assumption anchored on
    the KunServe paper's ~5 ms per remap call and this project's target of < 50 ms to move 10 GB
    (docs/benchmarks/mechanisms_memory_pool.md; no GPU measurement yet): 5 ms + 4.5 ms/GB."""

    fixed_s: float = 5e-3
    per_gb_s: float = 4.5e-3

    def time_s(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.fixed_s + self.per_gb_s * nbytes / 1e9


@dataclass(frozen=True)
class ClusterSpec:
    """A simulated cluster: ``instances`` single-GPU instances of ``gpu`` joined by ``link``.
    ``contention``: concurrent bulk transfers (KV exchanges, weight restores, migrations) leaving
    one GPU share its port's bandwidth equally; ``unmap``: cost of unmapping dropped weights (None:
    free)."""

    name: str
    gpu: str
    instances: int
    link: str
    servers: int
    contention: bool
    unmap: UnmapCost | None
    note: str = ""


CLUSTERS: dict[str, ClusterSpec] = {
    "paper-rdma": ClusterSpec(
        "paper-rdma", "h100", 8, "rdma200", servers=8, contention=True, unmap=UnmapCost(),
        note="the KunServe paper's main cluster: 8 single-GPU servers on 200 Gb/s RDMA (one NIC per GPU)"),
    "paper-nvlink": ClusterSpec(
        "paper-nvlink", "h100", 8, "nvlink", servers=1, contention=True, unmap=UnmapCost(),
        note="the paper's NVLink server: 8 GPUs in one box, one NVLink port per GPU"),
    "ideal-nvlink": ClusterSpec(
        "ideal-nvlink", "h100", 8, "nvlink", servers=1, contention=False, unmap=None,
        note="the earlier model: NVLink, free unmapping, no contention between transfers"),
}


def get_cluster(name: str) -> ClusterSpec:
    if name not in CLUSTERS:
        raise ValueError(f"cluster {name!r}: unknown; one of {', '.join(CLUSTERS)}")
    return CLUSTERS[name]
