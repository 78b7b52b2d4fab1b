"""Physical memory pool: the same cases on the host backend and (gpu marker) the CUDA backend."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from torch import nn

from vllm_kunserve.memory import (BackendUnavailableError, LayerReleasedError, MapError, MemoryPool,
                                  MemoryPoolError, PoolExhaustedError, ReleasedTensor, cuda_available)

CHUNK = 2 << 20
BACKENDS = [
    pytest.param("host", marks=pytest.mark.unit),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not cuda_available(), reason="CUDA driver backend unavailable (no GPU or no cuda-python)")]),
]


@pytest.fixture(params=BACKENDS)
def pool(request):
    p = MemoryPool(24 * CHUNK, backend=request.param, chunk_bytes=CHUNK)
    yield p
    p.close()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _fill(region, start: int, end: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (end - start,), dtype=torch.uint8, generator=g)
    region.view()[start:end].copy_(data.to(region.device))


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 256))


def test_kv_data_survives_grow_and_shrink(pool):
    kv = pool.create_kv_region("kv", max_bytes=16 * CHUNK, initial_bytes=2 * CHUNK)
    ptr = kv.ptr
    assert kv.view().data_ptr() == ptr and kv.mapped_bytes == 2 * CHUNK
    block = CHUNK // 4  # KV blocks smaller than a chunk
    _fill(kv, 0, 2 * CHUNK, seed=1)
    before = [_digest(kv.view()[i:i + block]) for i in range(0, 2 * CHUNK, block)]

    kv.grow(5 * CHUNK)
    assert kv.mapped_bytes == 7 * CHUNK and kv.ptr == ptr and kv.view().data_ptr() == ptr
    assert [_digest(kv.view()[i:i + block]) for i in range(0, 2 * CHUNK, block)] == before
    _fill(kv, 2 * CHUNK, 7 * CHUNK, seed=2)
    grown = _digest(kv.view()[: 5 * CHUNK])

    kv.shrink(2 * CHUNK)
    assert kv.mapped_bytes == 5 * CHUNK and kv.ptr == ptr
    assert _digest(kv.view()) == grown
    assert pool.num_free_chunks == pool.num_chunks - 5
    with pytest.raises(MemoryPoolError, match="exceeds"):
        kv.view(torch.float16, (6 * CHUNK // 2,))
    full = kv.view(torch.float16, (16 * CHUNK // 2,), allow_unmapped=True)
    assert full.data_ptr() == ptr
    pool.check()


def test_typed_views_share_memory(pool):
    kv = pool.create_kv_region("kv", max_bytes=4 * CHUNK, initial_bytes=CHUNK)
    blocks = kv.view(torch.float32, (8, CHUNK // 32))
    blocks[3].fill_(7.0)
    raw = kv.view()
    assert raw.data_ptr() == blocks.data_ptr()
    assert torch.equal(raw[3 * CHUNK // 8: 4 * CHUNK // 8].view(torch.float32).cpu(),
                       torch.full((CHUNK // 32,), 7.0))


def test_release_grow_shrink_reload_round_trip(pool):
    dev = pool.device
    layers = [_mlp(0).to(dev), _mlp(1).to(dev)]
    x = torch.randn(4, 256, device=dev)
    ref_out = [m(x).detach().clone() for m in layers]
    ref_w = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in layers]
    regions = [pool.create_weight_region(f"layer{i}", m) for i, m in enumerate(layers)]
    params = [list(m.parameters()) for m in layers]
    ptrs = [[p.data_ptr() for p in ps] for ps in params]
    for i, m in enumerate(layers):  # the module now computes from pool memory, same results
        assert torch.equal(m(x), ref_out[i])
        assert all(regions[i].ptr <= p <= regions[i].ptr + regions[i].max_bytes for p in ptrs[i])
    kv = pool.create_kv_region("kv", max_bytes=pool.capacity_bytes, initial_bytes=CHUNK)
    free0 = pool.num_free_chunks

    freed = pool.release_layer("layer0")
    assert freed == regions[0].max_bytes and pool.num_free_chunks == free0 + freed // CHUNK
    assert isinstance(layers[0][0].weight, ReleasedTensor)
    assert layers[0][0].weight.shape == (512, 256) and layers[0][0].weight.dtype == torch.float32
    with pytest.raises(LayerReleasedError, match="layer0"):
        layers[0](x)
    with pytest.raises(LayerReleasedError):
        regions[0].tensors()
    assert torch.equal(layers[1](x), ref_out[1])  # the other layer is untouched

    kv.grow(pool.free_bytes)  # the freed chunks now back KV; scribble over all of it
    assert pool.num_free_chunks == 0
    kv.view().fill_(0xA5)
    with pytest.raises(PoolExhaustedError):
        pool.reload_layer("layer0")
    kv.shrink(kv.mapped_bytes - CHUNK)
    pool.reload_layer("layer0")

    assert list(layers[0].parameters())[0] is params[0][0]  # same Parameter objects, same addresses
    assert [p.data_ptr() for p in layers[0].parameters()] == ptrs[0]
    for k, v in layers[0].state_dict().items():
        assert torch.equal(v, ref_w[0][k]), k
    assert torch.equal(layers[0](x), ref_out[0])
    assert set(regions[0].tensors()) == set(ref_w[0])
    pool.check()


def test_plain_tensor_weight_region(pool):
    src = {"w": torch.randn(300, 70), "b": torch.arange(11, dtype=torch.int64)}
    r = pool.create_weight_region("t", src)
    views = r.tensors()
    assert all(torch.equal(views[k].cpu(), v) for k, v in src.items())
    pool.release_layer(r)
    with pytest.raises(MemoryPoolError, match="already released"):
        pool.release_layer(r)
    pool.reload_layer(r)
    assert r.tensors()["w"].data_ptr() == views["w"].data_ptr()
    assert all(torch.equal(r.tensors()[k].cpu(), v) for k, v in src.items())
    # reload from an image (e.g. received from a peer) instead of the host copy
    image = r.image().cpu().clone()
    pool.release_layer(r)
    with pytest.raises(ValueError, match="bytes"):
        pool.reload_layer(r, image[:-1])
    pool.reload_layer(r, image.to(pool.device))
    assert torch.equal(r.tensors()["b"].cpu(), src["b"])


def test_resize_many_is_all_or_nothing(pool):
    a = pool.create_kv_region("a", 8 * CHUNK, CHUNK)
    b = pool.create_kv_region("b", 8 * CHUNK, CHUNK)
    _fill(a, 0, CHUNK, 3)
    da = _digest(a.view())
    pool.faults.fail_map(after=3)  # a gets its 3 chunks, b fails on its first
    with pytest.raises(MapError, match="rolled back"):
        pool.resize_kv({a: 4 * CHUNK, b: 4 * CHUNK})
    assert (a.mapped_bytes, b.mapped_bytes) == (CHUNK, CHUNK) and _digest(a.view()) == da
    pool.check()
    pool.resize_kv({a: 4 * CHUNK, b: 4 * CHUNK})
    assert (a.mapped_bytes, b.mapped_bytes) == (4 * CHUNK, 4 * CHUNK)
    with pytest.raises(ValueError, match="twice"):
        pool.resize_kv({a: 5 * CHUNK, "a": 5 * CHUNK})
    c = pool.create_kv_region("c", 16 * CHUNK)
    with pytest.raises(PoolExhaustedError):
        pool.resize_kv({a: 8 * CHUNK, b: 8 * CHUNK, c: 9 * CHUNK})
    assert c.mapped_bytes == 0
    assert pool.num_free_chunks == pool.num_chunks - 8
    pool.check()


def test_accounting_never_leaks_under_random_ops_and_faults(pool):
    rng = random.Random(7)
    kvs = [pool.create_kv_region(f"kv{i}", 10 * CHUNK, CHUNK) for i in range(3)]
    weights = [pool.create_weight_region(f"w{i}", {"x": torch.full((CHUNK // 4 + 5,), float(i))})
               for i in range(3)]
    for r in kvs:
        _fill(r, 0, CHUNK, seed=hash(r.name) % 1000)
    failures = 0
    for step in range(150):
        before = {r.name: r.mapped_bytes for r in kvs + weights}
        heads = {r.name: _digest(r.view()[:CHUNK]) for r in kvs if r.mapped_bytes}
        op = rng.choice(["grow", "shrink", "release", "reload", "resize_many"])
        fault = rng.random() < 0.3
        if fault:
            if rng.random() < 0.5:
                pool.faults.fail_map(after=rng.randrange(0, 3))
            else:
                pool.faults.fail_set_access()
        try:
            if op == "grow":
                r = rng.choice(kvs)
                r.grow(min(rng.randrange(1, 4) * CHUNK, r.max_bytes - r.mapped_bytes))
            elif op == "shrink":
                rng.choice(kvs).shrink(rng.randrange(0, 3) * CHUNK)
            elif op == "release":
                w = rng.choice(weights)
                if not w.released:
                    pool.release_layer(w)
            elif op == "reload":
                w = rng.choice(weights)
                if w.released:
                    pool.reload_layer(w)
            else:
                pool.resize_kv({r: rng.randrange(1, 6) * CHUNK for r in kvs})
        except (MapError, PoolExhaustedError):
            failures += 1
            after = {r.name: r.mapped_bytes for r in kvs + weights}
            assert after == before, f"step {step}: failed {op} changed the pool"
        pool.faults = type(pool.faults)()  # clear an injected fault that did not fire
        pool.check()
        for r in kvs:
            if r.name in heads and r.mapped_bytes >= CHUNK:
                assert _digest(r.view()[:CHUNK]) == heads[r.name], f"step {step}: KV data lost"
        used = sum(len(r.chunks) for r in kvs + weights)
        assert used + pool.num_free_chunks == pool.num_chunks
    assert failures > 0
    for w in weights:
        if w.released:
            pool.reload_layer(w)
        assert torch.equal(w.tensors()["x"].cpu(), torch.full((CHUNK // 4 + 5,), float(w.name[1:])))
    for r in kvs + weights:
        pool.destroy_region(r)
    assert pool.num_free_chunks == pool.num_chunks
    pool.check()


def test_create_region_rolls_back_on_map_failure(pool):
    pool.faults.fail_map(after=1)
    with pytest.raises(MapError):
        pool.create_kv_region("kv", 8 * CHUNK, 3 * CHUNK)
    pool.faults.fail_set_access()
    with pytest.raises(MapError):
        pool.create_weight_region("w", {"x": torch.zeros(CHUNK)})
    assert pool.regions() == {} and pool.num_free_chunks == pool.num_chunks
    pool.check()
    pool.create_kv_region("kv", 8 * CHUNK, 3 * CHUNK)  # the names are free again


@pytest.mark.unit
def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple"):
        MemoryPool(4 * CHUNK, backend="host", chunk_bytes=CHUNK + 1)
    with pytest.raises(ValueError, match="backend"):
        MemoryPool(4 * CHUNK, backend="tpu")
    with pytest.raises(ValueError, match="positive"):
        MemoryPool(0, backend="host")
    with MemoryPool(4 * CHUNK, backend="host", chunk_bytes=CHUNK) as p:
        kv = p.create_kv_region("kv", 2 * CHUNK)
        with pytest.raises(ValueError, match="already exists"):
            p.create_kv_region("kv", CHUNK)
        with pytest.raises(ValueError, match="outside"):
            kv.resize(3 * CHUNK)
        with pytest.raises(PoolExhaustedError, match="only 4 are free"):
            p.create_kv_region("big", 8 * CHUNK, 5 * CHUNK)
        with pytest.raises(KeyError, match="nope"):
            p.region("nope")
        with pytest.raises(MemoryPoolError, match="not weight"):
            p.release_layer("kv")
    with pytest.raises(MemoryPoolError, match="closed"):
        p.create_kv_region("again", CHUNK)


@pytest.mark.unit
@pytest.mark.skipif(cuda_available(), reason="checks the error raised where CUDA is missing")
def test_cuda_backend_without_driver_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match="cuda"):
        MemoryPool(CHUNK, backend="cuda")
    with MemoryPool(CHUNK) as p:  # auto falls back to the host backend
        assert p.backend.name == "host"


def test_returned_chunks_leave_the_host_and_come_back_zeroed():
    """return_free punches a free chunk's pages out of the memfd (the host has the memory back: the
    file's allocated blocks drop); add_chunks makes those chunks again before any new one."""
    import os

    cb = 1 << 20
    pool = MemoryPool(4 * cb, backend="host", chunk_bytes=cb)
    r = pool.create_kv_region("kv", 4 * cb, 4 * cb)
    r.view(torch.uint8).fill_(7)
    pool.resize_kv({r: 2 * cb})
    allocated = os.fstat(pool.backend._fd).st_blocks
    assert pool.return_free(2) == 2 and pool.held_bytes == 2 * cb
    assert os.fstat(pool.backend._fd).st_blocks < allocated
    pool.check()
    with pytest.raises(PoolExhaustedError):
        pool.return_free(1)   # nothing free is left to give
    assert pool.add_chunks(2) == 4 and pool.held_chunks == 4   # the returned ones, not two new ones
    pool.resize_kv({r: 4 * cb})
    assert int(r.view(torch.uint8)[2 * cb:].max()) == 0   # their pages came back zeroed
    pool.check()
    pool.close()
