import pytest
import torch
from torch import nn

from vllm_kunserve.config import parse_config
from vllm_kunserve.integration.vllm import PATCH_CLASSES
from vllm_kunserve.integration.vllm.worker_memory import _detached, _shared_owners, auto_chunk_bytes

pytestmark = pytest.mark.unit


class _Layer(nn.Module):
    def __init__(self, shared: nn.Module):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.rope = shared


def test_shared_submodules_are_found_and_detached_temporarily():
    rope = nn.Module()
    rope.register_buffer("cos_sin_cache", torch.ones(4))
    layers = [_Layer(rope), _Layer(rope)]
    shared = _shared_owners(layers)
    assert shared == {id(rope)}
    with _detached(layers[0], shared):
        assert [n for n, _ in layers[0].named_buffers()] == []
        assert "rope" not in layers[0]._modules
    assert layers[0].rope is rope and layers[1].rope is rope


CUDA_CAP = 32 << 20  # the CUDA backend's max_auto_chunk_bytes


@pytest.mark.parametrize("layers, gran, cap, want", [
    ([9_000_000], 4096, 2 << 20, 512 << 10),          # host: ~1/16 of the smallest layer, power of two
    ([100_000], 4096, 2 << 20, 4096),                 # tiny layers: the granularity
    ([1 << 30], 4096, 2 << 20, 2 << 20),              # never above the cap
    ([9_000_000], 2 << 20, CUDA_CAP, 2 << 20),  # CUDA, small layers: the device granularity
    ([404_000_000, 500_000_000], 2 << 20, CUDA_CAP, 16 << 20),  # CUDA, a 7B layer: ~1/16 of it
    ([1 << 33], 2 << 20, CUDA_CAP, 32 << 20),  # CUDA, huge layers: the cap
])
def test_auto_chunk_bytes(layers, gran, cap, want):
    got = auto_chunk_bytes(layers, gran, cap)
    assert got == want and got % gran == 0


def test_memory_touchpoints_only_with_remap():
    off, on = parse_config({}), parse_config({"remap": {"enable": True}})
    wanted_off = {c.name for c in PATCH_CLASSES if c().wanted(off)}
    wanted_on = {c.name for c in PATCH_CLASSES if c().wanted(on)}
    assert wanted_off == {"worker_extension"}
    assert wanted_on == {"worker_extension", "runner_select", "kv_plan", "engine_core", "kv_allocation", "cpu_linear"}
    member = parse_config({"drop": {"group_member": True}})
    assert {c.name for c in PATCH_CLASSES if c().wanted(member)} == wanted_on | {"scheduler"}
    no_lookahead = parse_config({"drop": {"group_member": True}, "lookahead": {"enable": False, "admission": "peak"}})
    assert {c.name for c in PATCH_CLASSES if c().wanted(no_lookahead)} == wanted_on | {"scheduler"}  # admission
    stock_sched = parse_config({"drop": {"group_member": True}, "lookahead": {"enable": False}})   # vLLM's admission
    assert {c.name for c in PATCH_CLASSES if c().wanted(stock_sched)} == wanted_on


def test_host_backend_caps_automatic_chunks_at_its_default():
    from vllm_kunserve.memory import make_backend

    b = make_backend("host")
    assert b.max_auto_chunk_bytes == b.default_chunk_bytes
