"""Pipeline-group transitions of the layer residency (join: drop layers and host a peer's KV;
leave: take them back): all-or-nothing up to the KV exchange, best effort after it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_kunserve.memory import MemoryPool
from vllm_kunserve.memory.residency import KVPlace, LayerResidency, LayerState
from vllm_kunserve.memory.transaction import StepFaults

pytestmark = pytest.mark.unit

CHUNK = 64 << 10
L, H = 6, 96
PAGE = 16 << 10
BASE, MAX = 8, 64


def _stack():
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.LayerNorm(H), nn.Linear(H, 2 * H), nn.ReLU(), nn.Linear(2 * H, H))
                         for _ in range(L)).eval()


def _run(layers, x, upto=L):
    with torch.no_grad():
        for m in list(layers)[:upto]:
            x = x + m(x)
    return x


def _residency(layers, faults=None) -> LayerResidency:
    pool = MemoryPool(CHUNK, backend="host", chunk_bytes=CHUNK)
    weights = []
    for i, m in enumerate(layers):
        nbytes = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
        pool.add_chunks(-(-nbytes // CHUNK) - pool.num_free_chunks)
        weights.append(pool.create_weight_region(f"layer{i}", m))
    kv = []
    for i in range(L):  # one KV region per layer, as vLLM's per-layer views
        pool.add_chunks(-(-BASE * PAGE // CHUNK) - pool.num_free_chunks)
        kv.append(KVPlace(f"kv{i}", pool.create_kv_region(f"kv{i}", MAX * PAGE, BASE * PAGE), PAGE, layer=i))
    return LayerResidency(pool, list(layers), weights, kv, MAX, BASE, faults=faults)


@pytest.fixture
def setup():
    layers = _stack()
    x = torch.randn(3, H)
    ref = _run(layers, x)
    res = _residency(layers, StepFaults())
    for k in res.kv:  # this engine's requests' KV: block b of layer i holds the value i * 100 + b
        for b in range(BASE):
            k.region.view(torch.uint8)[b * PAGE:(b + 1) * PAGE].fill_((k.layer * 10 + b) % 251)
    return layers, x, ref, res


def _state(res):
    return ([s.value for s in res.states], res.mapped_blocks, res.pool.num_free_chunks, res.peers,
            [k.region.mapped_bytes for k in res.kv])


def test_join_frees_dropped_layers_into_kept_kv_and_hosts_the_peer(setup):
    layers, x, ref, res = setup
    seen = {}

    def exchange():  # the dropped layers' own KV is still there to send; the peer's region exists
        seen["states"] = [s.value for s in res.states]
        seen["own"] = [int(res.place(f"kv{i}").region.view(torch.uint8)[0]) for i in (3, 4, 5)]
        seen["peer"] = res.foreign_blocks("p")
    mapped = res.join([3, 4, 5], {"p": BASE}, exchange)
    assert seen["states"][3:] == ["dropped"] * 3 and seen["own"] == [30, 40, 50]
    assert seen["peer"] == BASE
    assert res.dropped == (3, 4, 5) and res.peers == ("p",)
    # own KV of the dropped layers is gone; kept layers (own and the peer's) grew evenly past the base
    assert all(res.place(f"kv{i}").region.mapped_bytes == 0 for i in (3, 4, 5))
    assert mapped == res.mapped_blocks > BASE and res.foreign_blocks("p") >= mapped - 1
    # the kept layers' KV survived, the kept layers compute as before
    assert int(res.place("kv1").region.view(torch.uint8)[2 * PAGE]) == 12
    assert torch.equal(_run(layers, x, 3), _run(_stack(), x, 3))
    assert res.check_invariants() == []
    # where the join's time went: every step of its transaction, and the grow after it, in its event
    ev = res.events[-1]
    assert ev["event"] == "join"
    assert set(ev["step_ms"]) == {"release", "foreign_create", "exchange", "kv_free", "kv_grow_after"}
    assert all(v >= 0 for v in ev["step_ms"].values()) and sum(ev["step_ms"].values()) <= ev["ms"] + 1


@pytest.mark.parametrize("step", ["release", "foreign_create", "exchange"])
def test_join_failing_before_the_exchange_completes_undoes_everything(setup, step):
    layers, x, ref, res = setup
    before = _state(res)
    res.faults.arm(step)
    with pytest.raises(Exception):
        res.join([3, 4, 5], {"p": BASE}, lambda: None)
    assert _state(res) == before
    assert torch.equal(_run(layers, x), ref) and res.check_invariants() == []
    assert int(res.place("kv4").region.view(torch.uint8)[3 * PAGE]) == 43


def test_join_grow_failure_after_the_exchange_keeps_the_group(setup):
    _, _, _, res = setup
    res.faults.arm("kv_grow")
    mapped = res.join([3, 4, 5], {"p": BASE}, lambda: None)
    assert res.dropped == (3, 4, 5) and mapped == BASE
    assert any(e["event"] == "kv_grow_failed" for e in res.events)
    assert res.check_invariants() == []


def test_leave_returns_layers_and_kv_and_drops_the_peer(setup):
    layers, x, ref, res = setup
    res.join([3, 4, 5], {"p": BASE}, lambda: None)
    seen = {}

    def exchange():  # weights back and own regions mapped again before the peer's KV arrives
        seen["states"] = [s.value for s in res.states]
        seen["own"] = [res.place(f"kv{i}").region.mapped_bytes for i in (3, 4, 5)]
        for i in (3, 4, 5):  # what the peer sends back: this engine's KV of the returning layers
            res.place(f"kv{i}").region.view(torch.uint8)[:PAGE].fill_(7)
    mapped = res.leave(BASE, exchange)
    assert seen["states"] == ["resident"] * L and all(b >= BASE * PAGE for b in seen["own"])
    assert mapped >= BASE and res.peers == () and res.dropped == ()
    assert all(s is LayerState.RESIDENT for s in res.states)
    assert torch.equal(_run(layers, x), ref) and res.check_invariants() == []
    assert int(res.place("kv4").region.view(torch.uint8)[0]) == 7


@pytest.mark.parametrize("step", ["kv_shrink", "reload", "kv_regrow", "exchange"])
def test_leave_failing_keeps_the_group_as_it_was(setup, step):
    layers, x, _, res = setup
    res.join([3, 4, 5], {"p": BASE}, lambda: None)
    before = _state(res)
    res.faults.arm(step)
    with pytest.raises(Exception):
        res.leave(BASE, lambda: None)
    after = _state(res)  # (the pool may have grown by a few chunks of rounding: not compared)
    assert (after[:2], after[3:]) == (before[:2], before[3:]) and res.check_invariants() == []
    assert torch.equal(_run(layers, x, 3), _run(_stack(), x, 3))


def test_join_refuses_bad_plans(setup):
    _, _, _, res = setup
    with pytest.raises(ValueError):
        res.join(list(range(L)), {"p": BASE}, lambda: None)  # nothing left to run
    with pytest.raises(ValueError):
        res.join([1], {"": BASE}, lambda: None)
    res.join([5], {"p": BASE}, lambda: None)
    with pytest.raises(ValueError):
        res.join([4], {"p": BASE}, lambda: None)  # already hosting p
    with pytest.raises(ValueError):
        res.join([5], {"q": BASE}, lambda: None)  # layer 5 is dropped already


def test_leave_takes_each_layer_from_the_image_a_peer_sends_as_it_reloads_else_the_host_copy(setup):
    """``images`` as a function: asked for each dropped layer after the KV shrank (the bytes need no
    memory the KV still holds); its bytes become the layer's weights; None: the host copy."""
    layers, x, ref, res = setup
    res.join([3, 4, 5], {"p": BASE}, lambda: None)
    peer = _residency(_stack())                  # the peer's copy of the same layers
    marked = peer.weights[3].image().clone()
    marked[:4] = 0                               # tell the peer's bytes from the host copy's
    asked = []

    def image(i):
        asked.append((i, max(k.region.mapped_bytes for k in res.kv if not k.origin and k.layer not in (3, 4, 5))))
        return {3: marked, 5: peer.weights[5].image().clone()}.get(i)
    res.leave(BASE, lambda: None, images=image)
    assert [i for i, _ in asked] == [3, 4, 5]
    assert all(b <= BASE * PAGE for _, b in asked)     # asked once the KV was back to the base
    assert torch.equal(res.weights[3].image(), marked)

    def same(a, b):  # the tensors (an image's alignment padding is not part of the weights)
        ta, tb = a.tensors(), b.tensors()
        return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert same(res.weights[4], peer.weights[4]) and same(res.weights[5], peer.weights[5])
    assert [e["source"] for e in res.events if e["event"] == "leave"] == ["peer"]
    assert res.check_invariants() == []


def _own(res, i):
    return int(res.place(f"kv{i}").region.view(torch.uint8)[2 * PAGE])


def test_restage_to_a_sub_range_sends_the_layers_given_up_and_hosts_a_new_peer(setup):
    """Two pairs merging into a four, seen from one member: it keeps a sub-range of the layers it
    runs, its own KV of the layer it gives up is still there to send during the exchange (and
    freed after), the new peer's regions exist by then, and the regions of the old peer for the
    layer given up go."""
    layers, x, _, res = setup
    res.join([3, 4, 5], {"p": BASE}, lambda: None)
    grown = res.mapped_blocks
    seen = {}

    def exchange():
        seen["states"] = [s.value for s in res.states]
        seen["own2"] = _own(res, 2)
        seen["q"] = res.foreign_blocks("q")
        seen["p2"] = res.place("kv2", "p").region.mapped_bytes
    mapped = res.restage([0, 1], {"p": BASE, "q": BASE}, exchange)
    assert seen["states"] == ["resident"] * 2 + ["dropped"] * 4
    assert seen["own2"] == 22 and seen["q"] == BASE and seen["p2"] > 0
    assert res.dropped == (2, 3, 4, 5) and res.peers == ("p", "q")
    assert res.place("kv2").region.mapped_bytes == 0
    assert {(k.origin, k.layer) for k in res.kv if k.origin} == {("p", 0), ("p", 1), ("q", 0), ("q", 1)}
    assert mapped == res.mapped_blocks >= grown            # layer 2's weights went to the KV kept
    assert _own(res, 0) == 2 and _own(res, 1) == 12        # the kept layers' own KV survived
    assert torch.equal(_run(layers, x, 2), _run(_stack(), x, 2))
    assert res.check_invariants() == []
    ev = res.events[-1]
    assert ev["event"] == "restage" and ev["released"] == [2] and ev["reloaded"] == []


def test_restage_to_a_super_range_reloads_maps_own_kv_and_lets_a_peer_go(setup):
    """A four shrinking into pairs, seen from one member: the KV first shrinks to the pair's block
    count, the layer taken back is reloaded and its own KV mapped again before the exchange (which
    fills it), the remaining peer's region for it is created, the peer let go loses its regions."""
    layers, x, _, res = setup
    res.join([2, 3, 4, 5], {"p": BASE, "q": BASE}, lambda: None)
    assert res.mapped_blocks > BASE
    seen = {}

    def exchange():
        seen["states"] = [s.value for s in res.states]
        seen["blocks"] = {(k.origin, k.layer): k.region.mapped_bytes // PAGE for k in res.kv
                          if k.origin or k.layer < 3}
        res.place("kv2").region.view(torch.uint8)[:PAGE].fill_(9)   # what a peer sends back
    mapped = res.restage([0, 1, 2], {"p": BASE}, exchange, kv_blocks=BASE)
    assert seen["states"] == ["resident"] * 3 + ["dropped"] * 3
    assert all(b == BASE for b in seen["blocks"].values()), seen["blocks"]
    assert ("p", 2) in seen["blocks"] and ("q", 0) in seen["blocks"]
    assert res.dropped == (3, 4, 5) and res.peers == ("p",)
    assert {(k.origin, k.layer) for k in res.kv if k.origin} == {("p", 0), ("p", 1), ("p", 2)}
    assert mapped == res.mapped_blocks >= BASE
    assert int(res.place("kv2").region.view(torch.uint8)[0]) == 9 and _own(res, 1) == 12
    assert torch.equal(_run(layers, x, 3), _run(_stack(), x, 3))
    assert res.check_invariants() == []


@pytest.mark.parametrize("step", ["kv_shrink", "release", "reload", "kv_regrow", "foreign_create", "exchange"])
def test_restage_failing_up_to_the_exchange_keeps_the_stage_as_it_was(setup, step):
    layers, x, _, res = setup
    res.join([2, 3, 4, 5], {"p": BASE, "q": BASE}, lambda: None)
    if step == "release":   # a grow releases a layer; a shrink reloads one
        keep, kw = [0], {}
    else:
        keep, kw = [0, 1, 2], {"kv_blocks": BASE}
    before = _state(res)
    res.faults.arm(step)
    with pytest.raises(Exception):
        res.restage(keep, {"p": BASE, "r": BASE}, lambda: None, **kw)
    after = _state(res)  # (the pool may have grown by a few chunks of rounding: not compared)
    assert (after[:2], after[3:]) == (before[:2], before[3:]) and res.check_invariants() == []
    assert _own(res, 1) == 12 and torch.equal(_run(layers, x, 2), _run(_stack(), x, 2))


def test_restage_grow_failure_after_the_exchange_keeps_the_new_stage(setup):
    _, _, _, res = setup
    res.join([3, 4, 5], {"p": BASE}, lambda: None)
    res.faults.arm("kv_grow")
    res.restage([0, 1], {"p": BASE, "q": BASE}, lambda: None)
    assert res.dropped == (2, 3, 4, 5) and res.peers == ("p", "q")
    assert any(e["event"] == "kv_grow_failed" for e in res.events) and res.check_invariants() == []


def test_a_lone_engine_restages_as_it_would_join(setup):
    """A lone engine merged with live groups: its own KV of the layers it gives up is there to send
    during the exchange (to whichever member holds them next), then freed; the peers' regions exist."""
    layers, x, _, res = setup
    seen = {}

    def exchange():
        seen["own"] = [_own(res, i) for i in (3, 4, 5)]
        seen["peers"] = {o: res.foreign_blocks(o) for o in ("p", "q")}
    res.restage([0, 1, 2], {"p": BASE, "q": BASE}, exchange)
    assert seen["own"] == [32, 42, 52] and seen["peers"] == {"p": BASE, "q": BASE}
    assert res.dropped == (3, 4, 5) and res.peers == ("p", "q") and res.mapped_blocks >= BASE
    assert all(res.place(f"kv{i}").region.mapped_bytes == 0 for i in (3, 4, 5))
    assert torch.equal(_run(layers, x, 3), _run(_stack(), x, 3)) and res.check_invariants() == []


def test_restage_refuses_bad_plans_without_changing_anything(setup):
    _, _, _, res = setup
    res.join([3, 4, 5], {"p": BASE}, lambda: None)
    before = _state(res)
    for keep, peers, kw in [(list(range(L)), {"p": BASE}, {}), ([], {"p": BASE}, {}), ([0], {}, {}),
                            ([0], {"": BASE}, {}), ([0, 1, 2, 3], {"p": BASE}, {"kv_blocks": BASE - 1}),
                            ([0, L], {"p": BASE}, {})]:
        with pytest.raises(ValueError):
            res.restage(keep, peers, lambda: None, **kw)
    assert _state(res) == before and res.check_invariants() == []


def test_a_remapped_engine_joins_its_streamed_layers_in_the_drop_become_dropped_the_rest_stream_on(setup):
    """The levers stack: a remapped engine joins a group. Streamed layers a peer runs from now on
    are dropped (no weight memory to free: it is KV already), the other streamed layer streams on
    through the slot; the leave brings every dropped layer back resident and the kept one streams."""
    layers, x, ref, res = setup
    res.remap([1, 4], 1)
    assert res.streamed == (1, 4) and torch.equal(_run(layers, x), ref)
    slots = len(res.slot_regions)
    res.join([3, 4, 5], {"p": BASE}, lambda: None)
    assert res.dropped == (3, 4, 5) and res.streamed == (1,) and len(res.slot_regions) == slots
    assert torch.equal(_run(layers, x, 3), _run(_stack(), x, 3)) and res.check_invariants() == []
    back = res.leave(BASE, lambda: None)
    assert res.dropped == () and res.streamed == (1,) and res.states[4] is LayerState.RESIDENT
    assert back > BASE   # the KV grew back into the memory of the layer it still streams
    assert torch.equal(_run(layers, x), ref) and res.check_invariants() == []
    res.revert()
    assert all(s is LayerState.RESIDENT for s in res.states) and torch.equal(_run(layers, x), ref)


def test_a_remapped_engine_whose_streamed_layers_all_go_to_the_peer_gives_its_slots_to_kv(setup):
    layers, x, ref, res = setup
    res.remap([4, 5], 1)
    mapped = res.join([3, 4, 5], {"p": BASE}, lambda: None)
    assert res.streamed == () and res.slot_regions == [] and res.dropped == (3, 4, 5)
    assert torch.equal(_run(layers, x, 3), _run(_stack(), x, 3)) and res.check_invariants() == []
    # the same memory as a join from the base: the slot went to the KV too
    assert mapped == _residency(_stack()).join([3, 4, 5], {"p": BASE}, lambda: None)
    res.leave(BASE, lambda: None)
    assert all(s is LayerState.RESIDENT for s in res.states) and torch.equal(_run(layers, x), ref)
    assert res.check_invariants() == []


@pytest.mark.parametrize("step", ["streamer_uninstall", "unstream", "streamer_install", "release",
                                  "foreign_create", "exchange"])
def test_a_remapped_engine_failing_to_join_stays_remapped_as_it_was(setup, step):
    layers, x, ref, res = setup
    res.remap([1, 4], 1)
    before = (_state(res), res.streamed, len(res.slot_regions))
    res.faults.arm(step)
    with pytest.raises(Exception):
        res.join([3, 4, 5], {"p": BASE}, lambda: None)
    res.faults.disarm()
    assert (_state(res), res.streamed, len(res.slot_regions)) == before
    assert torch.equal(_run(layers, x), ref) and res.check_invariants() == []


def test_a_remapped_engine_cannot_join_leaving_only_streamed_layers(setup):
    _, _, _, res = setup
    res.remap([0, 1, 2], 1)
    with pytest.raises(ValueError, match="no resident layer"):
        res.join([3, 4, 5], {"p": BASE}, lambda: None)
    assert res.dropped == () and res.streamed == (0, 1, 2)
