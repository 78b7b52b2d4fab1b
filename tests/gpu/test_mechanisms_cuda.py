"""GPU-only mechanism checks: CUDA pool views used by kernels, NCCL channels between two GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm_kunserve.memory import MemoryPool, cuda_available

pytestmark = pytest.mark.gpu

CHUNK = 2 << 20


@pytest.mark.skipif(not cuda_available(), reason="needs cuda-python and a CUDA driver")
def test_kv_region_grown_under_a_live_tensor_feeds_kernels():
    with MemoryPool(32 * CHUNK, backend="cuda") as pool:
        kv = pool.create_kv_region("kv", 16 * CHUNK, 2 * CHUNK)
        full = kv.view(torch.float16, (16 * CHUNK // 2,), allow_unmapped=True)  # sized for the max
        full[: CHUNK].fill_(1.0)
        kv.grow(6 * CHUNK)
        full[2 * CHUNK // 2: 8 * CHUNK // 2].fill_(2.0)  # the same tensor now reaches the new chunks
        torch.cuda.synchronize()
        assert float(full[: CHUNK].float().sum()) == CHUNK
        assert float(full[CHUNK: 4 * CHUNK].float().sum()) == 2.0 * 3 * CHUNK
        kv.shrink(6 * CHUNK)
        assert float(full[: CHUNK].float().sum()) == CHUNK
        pool.check()


PEER = textwrap.dedent("""
    import json, sys, torch
    from vllm_kunserve.transfer import connect
    ch = connect(1, port=int(sys.argv[1]), device="cuda:1", backend="nccl", timeout_s=60)
    _, (t,) = ch.recv_bulk("w", timeout=60)
    a = ch.recv_activation(timeout=60)
    ch.send_activation(torch.tensor([float(t.double().sum()), float(a.tensor.sum())], device="cuda:1"))
    ch.close()
""")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL point-to-point needs two GPUs")
def test_nccl_channel_moves_bulk_and_activations(tmp_path):
    from vllm_kunserve.transfer import connect, make_store
    store = make_store(0)
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    proc = subprocess.Popen([sys.executable, str(script), str(store.port)], env=dict(os.environ))
    try:
        ch = connect(0, store=store, device="cuda:0", backend="nccl", timeout_s=60, chunk_bytes=1 << 20)
        w = torch.randn(3 << 20, device="cuda:0")
        ch.send_bulk(w, "w").wait(60)
        ch.send_activation(torch.full((7,), 2.0, device="cuda:0"))
        back = ch.recv_activation(timeout=60).tensor.cpu()
        assert back[0].item() == pytest.approx(float(w.double().sum()), rel=1e-6)
        assert back[1].item() == 14.0
        ch.close()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
