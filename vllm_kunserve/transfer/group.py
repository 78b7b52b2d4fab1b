"""A dedicated two-rank process group per channel (never the default group, which vLLM owns).

Rendezvous is a ``TCPStore`` (rank 0 hosts it; with ``port=0`` it picks a free port, readable as
``store.port`` to hand to the peer). The control path (headers) is always gloo on CPU; the data path
(payloads) is the same gloo group on CPU, or an NCCL group for CUDA tensors.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def make_store(rank: int, port: int = 0, host: str = "127.0.0.1", timeout_s: float = 30.0) -> dist.TCPStore:
    """Rank 0 hosts the store (``port=0``: any free port); rank 1 connects to ``host:port``."""
    if rank not in (0, 1):
        raise ValueError(f"a point-to-point channel has ranks 0 and 1, got {rank}")
    if rank == 1 and not port:
        raise ValueError("rank 1 needs the port of rank 0's store")
    return dist.TCPStore(host, port, 2, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"transfer backend must be auto, gloo or nccl; got {backend!r}")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"the nccl transfer backend needs a cuda device, got {device}")
        if not (dist.is_available() and dist.is_nccl_available()):
            raise ValueError("the nccl transfer backend is not available in this torch build")
    elif device.type != "cpu":
        raise ValueError(f"the gloo transfer backend moves CPU tensors; got device {device} (use nccl)")
    return backend


class PeerGroup:
    """The control and data process groups of one channel."""

    def __init__(self, store: dist.Store, rank: int, *, backend: str, device: torch.device,
                 connect_timeout_s: float = 120.0, host: str = "127.0.0.1", name: str = "kunserve"):
        self.rank, self.peer = rank, 1 - rank
        self.device = device
        self.backend = backend
        # The groups' own timeout bounds the rendezvous (the peer may still be starting up);
        # the channel passes its shorter per-operation timeout to every wait().
        timeout = datetime.timedelta(seconds=connect_timeout_s)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        self.ctrl = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/ctrl", store), rank, 2, opts)
        if backend == "nccl":
            # One communicator per direction: NCCL serialises a communicator's kernels on one stream,
            # so a send and a recv on the same one, issued by both ranks at once, would deadlock.
            torch.cuda.set_device(device)
            groups = []
            for direction in (0, 1):
                nopts = dist.ProcessGroupNCCL.Options()
                nopts._timeout = timeout
                groups.append(dist.ProcessGroupNCCL(
                    dist.PrefixStore(f"{name}/data{direction}", store), rank, 2, nopts))
            self.data_out, self.data_in = groups[rank], groups[self.peer]
        else:
            self.data_out = self.data_in = self.ctrl

    def abort(self) -> None:
        pgs = [self.ctrl, self.data_out, self.data_in]
        for pg in {id(p): p for p in pgs}.values():
            try:
                pg.abort()
            except Exception:
                pass
