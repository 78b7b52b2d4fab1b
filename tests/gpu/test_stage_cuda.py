"""The stage link with CUDA tensors between two processes sharing a GPU: CUDA IPC (device buffer +
interprocess events) and the pinned host-staging fallback, activations and chunked KV exchange."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm_kunserve.transfer.errors import PeerFailedError
from vllm_kunserve.transfer.stage import RemoteError, StageClient

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# The peer: a stage server in another process. "affine" answers a*x+b computed on the device after
# a long kernel chain (a reply written before the work finished would show); "kv_put" scatters a
# chunk of pages into its own device KV region; "kv_sum" returns the region's checksum; "host"
# answers a CPU tensor; "boom" raises.
PEER = textwrap.dedent("""
    import sys, time, torch
    from vllm_kunserve.transfer.stage import StageServer
    region = torch.zeros(64, 4096, dtype=torch.uint8, device="cuda")

    def handler(kind, meta, t):
        if kind == "affine":
            x = t["x"]
            y = x
            for _ in range(meta["spin"]):  # keeps the device busy, so a missing wait would be caught
                y = torch.tanh(y) * 0 + y
            return {"n": x.numel()}, {"y": meta["a"] * y + t["b"], "seen_dev": torch.tensor([x.is_cuda])}
        if kind == "kv_put":
            region[torch.tensor(meta["blocks"], device="cuda")] = t["data"]
            return {"ok": True}, {}
        if kind == "kv_sum":
            return {}, {"sum": region.double().sum(dim=1)}
        if kind == "host":
            return {}, {"cpu": torch.arange(5)}
        raise ValueError("boom")

    srv = StageServer(handler)
    print(srv.address, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def peer(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    addr = proc.stdout.readline().strip()
    assert addr.startswith("unix://"), addr
    yield proc, addr
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("link", ["auto", "host"])
def test_cuda_tensors_cross_processes_exactly_on_either_path(peer, link):
    _, addr = peer
    c = StageClient(addr, nbytes=1 << 16, device_link=link)
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        for rows in (1, 7, 256, 4096, 64):  # grows the device buffer, then shrinks the payload again
            x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
            b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=gen)
            x = x * 1  # written by a kernel just before the call: the copy must wait for it
            meta, out = c.call("affine", {"a": 3.0, "spin": 50}, {"x": x, "b": b})
            assert meta == {"n": x.numel()}
            assert out["y"].is_cuda and out["y"].dtype == torch.bfloat16
            assert torch.equal(out["y"], 3.0 * x + b)
            assert bool(out["seen_dev"].item())  # the handler got a device tensor on both paths
        assert c.device_link == ("ipc" if link == "auto" else "host")
        assert c.device_link_error is None
        # a CPU tensor in the reply and a CPU-only call still take the shared-memory path
        _, out = c.call("host")
        assert out["cpu"].device.type == "cpu" and out["cpu"].tolist() == list(range(5))
        with pytest.raises(RemoteError, match="boom"):
            c.call("boom", None, {"x": torch.ones(3, device="cuda")})
        _, out = c.call("affine", {"a": 1.0, "spin": 0}, {"x": torch.ones(2, 2, device="cuda"),
                                                          "b": torch.zeros(2, device="cuda")})
        assert out["y"].sum().item() == 4.0  # the link survives a remote error
    finally:
        c.close()


def test_chunked_kv_exchange_on_the_bulk_link_lands_every_page(peer):
    _, addr = peer
    bulk = StageClient(addr, nbytes=1 << 16, bulk=True)
    act = StageClient(addr, nbytes=1 << 16)
    try:
        src = torch.randint(0, 255, (64, 4096), dtype=torch.uint8, device="cuda")
        blocks = list(range(3, 60))
        for s in range(0, len(blocks), 8):  # 8 pages a chunk, as pipeline._send_kv chunks by bytes
            ids = blocks[s:s + 8]
            bulk.call("kv_put", {"blocks": ids}, {"data": src[torch.tensor(ids, device="cuda")]})
            _, out = act.call("affine", {"a": 2.0, "spin": 0}, {"x": torch.ones(4, device="cuda"),
                                                                "b": torch.zeros(4, device="cuda")})
            assert out["y"].tolist() == [2.0] * 4  # activations keep flowing between chunks
        _, out = act.call("kv_sum", None, {"x": torch.zeros(1, device="cuda")})
        want = torch.zeros(64, dtype=torch.float64, device="cuda")
        want[blocks] = src[blocks].double().sum(dim=1)
        assert torch.equal(out["sum"], want)
        assert bulk.device_link == "ipc"
    finally:
        bulk.close()
        act.close()


def test_a_dead_peer_fails_the_call_instead_of_hanging(peer):
    proc, addr = peer
    c = StageClient(addr, nbytes=1 << 16, timeout_s=20)
    try:
        c.call("affine", {"a": 1.0, "spin": 0}, {"x": torch.ones(2, device="cuda"), "b": torch.ones(2, device="cuda")})
        proc.kill()
        proc.wait()
        with pytest.raises(PeerFailedError):
            c.call("affine", {"a": 1.0, "spin": 0}, {"x": torch.ones(2, device="cuda"),
                                                     "b": torch.ones(2, device="cuda")})
    finally:
        c.close()
