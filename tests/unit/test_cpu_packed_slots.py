"""CPU streamed linears: packed oneDNN slots give the resident kernel's exact outputs."""

import pytest
import torch
from torch import nn

from vllm_kunserve.integration.vllm.cpu_linear import PackedSlots, _pack, _packed_linear, packed_kernel_available
from vllm_kunserve.memory import layout
from vllm_kunserve.memory.streaming import WeightStreamer

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not packed_kernel_available(), reason="torch built without oneDNN")]


class Proj(nn.Module):
    """Like a vLLM linear after CPU dispatch: a packed resident kernel, weight kept for kunserve."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, k) / k ** 0.5, requires_grad=False)
        self.bias = nn.Parameter(torch.randn(n) * 0.1, requires_grad=False)
        self._kunserve_fast_linear = _packed_linear(_pack(self.weight), n, k)
        self._kunserve_onednn = True
        self.cpu_linear = self._kunserve_fast_linear

    def forward(self, x):
        return self.cpu_linear(x, self.weight, self.bias)


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.rand(h) + 0.5, requires_grad=False)
        self.up = Proj(3 * h, h)
        self.down = Proj(h, 3 * h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x * self.norm)))


def run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("slots", [1, 2])
def test_streamed_layers_match_resident_bitwise_and_skip_plain_linear_weights(slots):
    torch.manual_seed(0)
    layers = [Block(64) for _ in range(6)]
    xs = [torch.randn(m, 64) for m in (1, 7, 40)]
    want = [run(layers, x) for x in xs]
    remapped = [0, 2, 3, 5]
    packed = PackedSlots(layers)
    assert packed.enabled and packed.kind() == "onednn_packed"
    entries = [layout.plan_module(layer)[0] for layer in layers]
    image_bytes = [layout.plan_module(layer)[1] for layer in layers]
    for i in remapped:
        assert packed.prepare(i) > 0
    st = WeightStreamer(layers, remapped, num_slots=slots, copy_plan=packed.copy_plan(entries)).install()
    resident = {}

    def poisoned(x, w, b):
        raise AssertionError("a streamed layer ran its resident kernel")
    for i in remapped:
        for p in (layers[i].up, layers[i].down):
            resident[id(p)] = p._kunserve_fast_linear
            p._kunserve_fast_linear = poisoned
        packed.point(i, st.slot_of(i))
    got = [run(layers, x) for x in xs]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # plain copies skip the linear weights (they travel packed): bytes per copy = image - weights + packed
    per_copy = st.stats.bytes_copied / st.stats.copies
    assert st.stats.copies >= len(remapped) * len(xs) and st.stats.sync_loads == 0
    assert per_copy <= image_bytes[0]
    st.uninstall()
    for i in remapped:
        for p in (layers[i].up, layers[i].down):
            p._kunserve_fast_linear = resident[id(p)]
    for i in range(len(layers)):
        packed.point(i, None)
    packed.drop_slots()
    assert all(torch.equal(run(layers, x), w) for x, w in zip(xs, want))


def test_slot_holds_the_streamed_layers_weights_not_the_first_ones():
    torch.manual_seed(1)
    layers = [Block(32) for _ in range(3)]
    x = torch.randn(5, 32)
    want = run(layers, x)
    packed = PackedSlots(layers)
    entries = [layout.plan_module(layer)[0] for layer in layers]
    for i in (0, 1, 2):
        packed.prepare(i)
    st = WeightStreamer(layers, [0, 1, 2], num_slots=1, copy_plan=packed.copy_plan(entries)).install()
    for i in (0, 1, 2):
        packed.point(i, st.slot_of(i))
    # all three layers share one slot; each must see its own weights
    assert torch.equal(run(layers, x), want)
    assert torch.equal(run(layers, x), want)  # and again, across passes
    st.uninstall()


def test_layers_without_a_onednn_handle_fall_back_to_slot_weights():
    layer = nn.Sequential(nn.Linear(8, 8))
    layer[0]._kunserve_fast_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)
    packed = PackedSlots([layer])
    assert not packed.enabled and packed.kind() == "slot_weights"
    assert packed.prepare(0) == 0
    packed.point(0, 0)
    assert layer[0].cpu_linear is not layer[0]._kunserve_fast_linear
