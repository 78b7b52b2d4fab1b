"""Layer residency transitions on a toy layer stack over a host memory pool: every transition is
all-or-nothing, at every step, and outputs stay bit-identical."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_kunserve.memory import LayerReleasedError, MemoryPool
from vllm_kunserve.memory.residency import STEPS, KVPlace, LayerResidency, LayerState
from vllm_kunserve.memory.transaction import RollbackError, StepFaults, Transaction

pytestmark = pytest.mark.unit

CHUNK = 64 << 10
L, H = 6, 96
PAGE = 16 << 10  # bytes of one KV block per region
BASE, MAX = 8, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)
        self.norm = nn.LayerNorm(H)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _stack():
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(L)).eval()


def _run(layers, x):
    with torch.no_grad():
        for m in layers:
            x = m(x)
    return x


def _residency(layers, faults=None) -> LayerResidency:
    pool = MemoryPool(CHUNK, backend="host", chunk_bytes=CHUNK)
    weights = []
    for i, m in enumerate(layers):  # layer by layer: the pool grows as each layer moves in
        nbytes = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
        pool.add_chunks(-(-nbytes // CHUNK) - pool.num_free_chunks)
        weights.append(pool.create_weight_region(f"layer{i}", m))
    kv = []
    for r in range(2):
        pool.add_chunks(-(-BASE * PAGE // CHUNK) - pool.num_free_chunks)
        kv.append(KVPlace(f"kv{r}", pool.create_kv_region(f"kv{r}", MAX * PAGE, BASE * PAGE), PAGE))
    return LayerResidency(pool, list(layers), weights, kv, MAX, BASE, faults=faults)


def _snapshot(res: LayerResidency):
    return ([s.value for s in res.states], res.mapped_blocks, len(res.slot_regions), res.pool.num_free_chunks,
            res.streamed, res.pool.held_chunks)


@pytest.fixture
def setup():
    layers = _stack()
    x = torch.randn(3, H)
    ref = _run(layers, x)
    res = _residency(layers)
    assert res.check_invariants() == []
    return layers, x, ref, res


def test_pool_grows_layer_by_layer_without_spare_chunks(setup):
    _, _, _, res = setup
    assert res.pool.num_free_chunks == 0  # exactly weights + base KV were created


def test_remap_revert_partial_revert_identical_outputs(setup):
    layers, x, ref, res = setup
    base = res.mapped_blocks
    res.remap([1, 4], 1)
    assert res.states[1] is LayerState.STREAMED and res.mapped_blocks > base
    assert res.check_invariants() == []
    assert torch.equal(_run(layers, x), ref)
    res.remap([1, 3, 4], 1)  # further remap keeps the old ones and the slot count
    grown = res.mapped_blocks
    assert torch.equal(_run(layers, x), ref) and res.check_invariants() == []
    res.revert(kv_blocks=grown - 8, keep=[1, 4])  # partial: layer 3 comes back, slots stay
    assert res.streamed == (1, 4) and res.check_invariants() == []
    assert torch.equal(_run(layers, x), ref)
    res.revert()
    assert res.streamed == () and res.mapped_blocks == base and res.slot_regions == []
    assert res.check_invariants() == [] and torch.equal(_run(layers, x), ref)


def test_drop_guards_layers_and_restore_from_peer_image(setup):
    layers, x, ref, res = setup
    images = {i: res.weights[i].image().clone() for i in (3, 4, 5)}
    res.drop([3, 4, 5])
    assert res.dropped == (3, 4, 5) and res.mapped_blocks > BASE
    assert res.check_invariants() == []
    with pytest.raises(LayerReleasedError):
        _run(layers, x)
    assert torch.equal(_run(layers[:3], x), _run(_stack()[:3], x))  # the kept stage still runs
    res.restore([3, 4, 5], images=images)
    assert res.dropped == () and res.mapped_blocks == BASE and res.check_invariants() == []
    assert torch.equal(_run(layers, x), ref)


def test_refuses_bad_transitions_without_changing_anything(setup):
    _, _, _, res = setup
    before = _snapshot(res)
    with pytest.raises(ValueError):
        res.remap([0, 1, 2, 3, 4, 5], 1)  # whole model
    with pytest.raises(ValueError):
        res.remap([9], 1)
    res.remap([2], 1)
    with pytest.raises(ValueError):
        res.remap([3], 1)  # must contain the streamed layer
    with pytest.raises(ValueError):
        res.drop([2])  # streamed, not resident
    with pytest.raises(ValueError):
        res.revert(kv_blocks=BASE - 1)
    res.revert()
    assert _snapshot(res) == before


def _faulted(res, step, op):
    res.faults.arm(step)
    before = _snapshot(res)
    with pytest.raises(Exception):
        op()
    assert _snapshot(res) == before, f"step {step}: state changed after a failed transition"
    assert res.check_invariants() == []
    res.faults.disarm()


OPS = {
    "remap": (lambda res: None, lambda res: res.remap([1, 4], 2)),
    "further_remap": (lambda res: res.remap([1, 4], 1), lambda res: res.remap([1, 2, 4], 1)),
    "revert": (lambda res: res.remap([1, 4], 2), lambda res: res.revert()),
    "partial_revert": (lambda res: res.remap([1, 3, 5], 1), lambda res: res.revert(keep=[1, 5],
                                                                                    kv_blocks=res.mapped_blocks - 8)),
    "drop": (lambda res: None, lambda res: res.drop([4, 5])),
    "restore": (lambda res: res.drop([4, 5]), lambda res: res.restore([4, 5])),
    "lend": (lambda res: None, lambda res: res.remap([1, 4], 1, lend=True)),
    "reclaim": (lambda res: res.remap([1, 4], 1, lend=True), lambda res: res.revert()),
    "borrow": (lambda res: None, lambda res: res.borrow(BASE + 16)),
    "repay": (lambda res: res.borrow(BASE + 16), lambda res: res.repay(BASE)),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("step", STEPS)
def test_fault_at_every_step_rolls_back(op, step):
    layers = _stack()
    x = torch.randn(3, H)
    ref = _run(layers, x)
    res = _residency(layers)
    prepare, run = OPS[op]
    prepare(res)
    res.faults.arm(step)
    before = _snapshot(res)
    try:
        run(res)
    except Exception:
        assert _snapshot(res) == before, f"{op}: a failure at {step} changed the state"
    else:  # this transition has no such step: the fault stays armed, the transition succeeded
        assert step in res.faults.armed
    res.faults.disarm()
    assert res.check_invariants() == []
    if not res.dropped:
        assert torch.equal(_run(layers, x), ref)
    # still able to move afterwards
    if res.dropped:
        res.restore(list(res.dropped))
    res.revert()
    res.remap([0, 3], 1)
    res.revert()
    assert res.check_invariants() == [] and torch.equal(_run(layers, x), ref)


def test_lend_gives_memory_to_the_host_and_a_borrower_grows_on_it(setup):
    """An idle model's engine lends two layers' memory (streams them; the pool gives the chunks
    back), another engine borrows KV on memory it makes, repays it, and the lender reclaims: outputs
    stay identical on both, and every chunk is accounted for at each step."""
    layers, x, ref, res = setup
    other_layers = _stack()
    other = _residency(other_layers)
    held = res.pool.held_chunks
    res.remap([1, 3, 5], 1, lend=True)
    gave = held - res.pool.held_chunks
    assert res.streamed == (1, 3, 5) and res.mapped_blocks == BASE and gave > 0
    assert res.pool.num_free_chunks == 0 and res.check_invariants() == []
    assert torch.equal(_run(layers, x), ref)   # streamed from the host copies
    before = other.pool.held_chunks
    other.borrow(BASE + 24)
    assert other.mapped_blocks == BASE + 24 and other.check_invariants() == []
    # exactly the chunks the two KV regions lack for 24 more blocks: none made to sit free
    assert other.pool.held_chunks - before == 2 * (-(-(BASE + 24) * PAGE // CHUNK) + (-BASE * PAGE // CHUNK))
    assert other.pool.num_free_chunks == 0
    assert torch.equal(_run(other_layers, x), ref)
    other.repay(BASE)
    assert other.mapped_blocks == BASE and other.pool.held_chunks == before and other.check_invariants() == []
    res.revert()   # reclaim: the pool makes the chunks its layers need again
    assert res.streamed == () and res.pool.held_chunks == held and res.check_invariants() == []
    assert torch.equal(_run(layers, x), ref)
    with pytest.raises(ValueError):
        other.repay(BASE - 1)


def test_prepared_transition_aborts_and_commits(setup):
    layers, x, ref, res = setup
    before = _snapshot(res)
    res.remap([1, 4], 1, commit=False)
    assert res.pending is not None
    with pytest.raises(RuntimeError):
        res.revert()  # one transition at a time
    res.abort()
    assert _snapshot(res) == before and res.check_invariants() == []
    res.remap([1, 4], 1, commit=False)
    res.commit()
    assert res.pending is None and res.streamed == (1, 4)
    assert torch.equal(_run(layers, x), ref)
    res.abort()  # nothing pending: no-op
    assert res.streamed == (1, 4)


def test_transaction_undoes_newest_first_and_reports_a_failed_undo():
    log = []
    tx = Transaction("t", StepFaults())
    tx.step("a", lambda: log.append("a"), lambda: log.append("-a"))
    tx.step("b", lambda: log.append("b"), lambda: log.append("-b"))
    assert tx.rollback() == ["b", "a"] and log == ["a", "b", "-b", "-a"]
    tx = Transaction("t")
    tx.step("a", lambda: None, lambda: log.append("-a2"))
    tx.step("b", lambda: None, lambda: 1 / 0)
    with pytest.raises(RollbackError, match="step 'b'"):
        tx.rollback()
    assert log[-1] == "-a2"  # the other undos still ran
