"""Memory-aware admission: the policy's gate over what the fleet can reach after its drops
(policy/admission.py) and the front end's bounded, prioritised queue (cluster/frontend/admission.py)."""

import asyncio
import math
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from vllm_kunserve.cluster.frontend.admission import AdmissionGate, needs_of, parse_priority
from vllm_kunserve.cluster.frontend.app import FrontEnd
from vllm_kunserve.cluster.frontend.validate import BadRequest, Checked
from vllm_kunserve.policy import ClusterSnapshot, InstanceSnapshot, ModelSpec
from vllm_kunserve.policy.admission import KvNeed, gate, peak_blocks, reachable_blocks

pytestmark = pytest.mark.unit

MODEL = ModelSpec(num_layers=32, layer_bytes=100, block_bytes=10, block_size=16)


def test_reachable_counts_what_every_drop_frees_within_a_host_and_each_members_cap():
    two = ClusterSnapshot(MODEL, (InstanceSnapshot(0, 100, 0), InstanceSnapshot(1, 100, 0)))
    # one merge frees a copy of the weights: 32 x 100 bytes = 320 blocks of 10 bytes
    assert reachable_blocks(two) == pytest.approx(200 + 320)
    capped = ClusterSnapshot(MODEL, (InstanceSnapshot(0, 100, 0, kv_blocks_max=150),
                                     InstanceSnapshot(1, 100, 0, kv_blocks_max=150)))
    assert reachable_blocks(capped) == pytest.approx(300)
    apart = ClusterSnapshot(MODEL, (InstanceSnapshot(0, 100, 0, host="a"), InstanceSnapshot(1, 100, 0, host="b")))
    assert reachable_blocks(apart) == pytest.approx(200)   # groups never span hosts
    sick = ClusterSnapshot(MODEL, (InstanceSnapshot(0, 100, 0), InstanceSnapshot(1, 100, 0, healthy=False)))
    assert reachable_blocks(sick) == pytest.approx(100)


def test_gate_admits_within_the_reachable_peak_queues_then_sheds():
    running = [KvNeed(64, 320)] * 3   # 3 x ceil(384 / 16) = 72 blocks at their peak
    assert peak_blocks(running, 16) == 72
    assert gate(running, [KvNeed(64, 320)], 96, 16, 0, 2).action == "admit"
    assert gate(running, [KvNeed(64, 320)], 95, 16, 0, 2) == ("queue", 96, 95)
    assert gate(running, [KvNeed(64, 320)], 95, 16, 2, 2).action == "shed"
    assert gate([], [KvNeed(10_000, 10_000)], 1, 16, 0, 0).action == "admit"   # nothing admitted: the head goes


def test_needs_count_every_sequence_and_what_was_generated():
    c = Checked("completion", {"n": 2}, [10, 20], 100, False, False)
    assert needs_of(c) == [KvNeed(10, 100)] * 2 + [KvNeed(20, 100)] * 2
    assert needs_of(c, generated=30)[0] == KvNeed(40, 70)


@pytest.mark.parametrize("raw,want", [(None, 0), ("", 0), (" -3 ", -3), ("7", 7)])
def test_priority_header(raw, want):
    assert parse_priority(raw) == want


def test_a_priority_that_is_no_integer_is_a_400():
    with pytest.raises(BadRequest, match="x-kunserve-priority") as e:
        parse_priority("high")
    assert e.value.status == 400


def fake_front(capacity_blocks: int):
    report = SimpleNamespace(ok=True, capacity_blocks=capacity_blocks, block_size=16)
    front = SimpleNamespace(registry=CollectorRegistry(), groups=None, flights={},
                            monitor=SimpleNamespace(reports={0: report}),
                            fleet=SimpleNamespace(engines=[SimpleNamespace(accepting=True)]))
    front.reachable_blocks = lambda: FrontEnd.reachable_blocks(front)   # the front end's own reading
    return front


async def settle() -> None:
    """Let woken waiters run (a future's result reaches its task through a few loop turns)."""
    for _ in range(10):
        await asyncio.sleep(0)


def req(prompt=64, out=320) -> Checked:
    return Checked("completion", {}, [prompt], out, True, True)


def test_the_queue_admits_by_priority_when_memory_frees_and_sheds_past_its_bound():
    async def go():
        front = fake_front(48)   # two requests of 24 blocks at their peak
        g = AdmissionGate(front, queue_max=2, max_wait_s=5.0)
        assert await g.enter("a", req()) == 0.0
        assert await g.enter("b", req()) == 0.0
        low = asyncio.create_task(g.enter("low", req(), priority=5))
        await settle()
        high = asyncio.create_task(g.enter("high", req(), priority=-1))
        await settle()
        assert g.view()["queued"] == 2
        with pytest.raises(BadRequest) as e:   # the queue is full
            await g.enter("c", req())
        assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
        g.leave("a")   # one request's KV is free: the more important waiter goes first
        await settle()
        assert high.done() and not low.done()
        g.leave("b")
        await settle()
        assert low.done() and set(g.admitted) == {"high", "low"}
        return g
    g = asyncio.run(go())
    assert g.shed == 1


def test_a_newcomer_that_fits_does_not_overtake_a_waiter_unless_it_is_more_important():
    async def go():
        g = AdmissionGate(fake_front(48), queue_max=4, max_wait_s=5.0)
        await g.enter("a", req())                                   # 24 blocks
        big = asyncio.create_task(g.enter("big", req(64, 1000)))    # 67 more: waits
        await settle()
        same = asyncio.create_task(g.enter("same", req()))          # would fit, but big waits ahead
        await settle()
        assert not same.done() and g.view()["queued"] == 2
        assert await g.enter("urgent", req(), priority=-1) == 0.0   # more important: goes now
        for t in (big, same):
            t.cancel()
        await asyncio.gather(big, same, return_exceptions=True)
    asyncio.run(go())


def test_a_waiter_gets_429_after_its_longest_wait_and_leaves_the_queue():
    async def go():
        g = AdmissionGate(fake_front(24), queue_max=4, max_wait_s=0.05)
        await g.enter("a", req())
        with pytest.raises(BadRequest) as e:
            await g.enter("b", req())
        assert e.value.status == 429 and "queued 0.05 s" in e.value.message
        assert g.view()["queued"] == 0 and g.timed_out == 1
    asyncio.run(go())


def test_a_client_that_leaves_while_queued_frees_its_place():
    async def go():
        g = AdmissionGate(fake_front(24), queue_max=4, max_wait_s=5.0)
        await g.enter("a", req())
        t = asyncio.create_task(g.enter("b", req()))
        await settle()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert g.view()["queued"] == 0 and set(g.admitted) == {"a"}
    asyncio.run(go())


def test_progress_of_admitted_streams_lowers_their_need():
    async def go():
        front = fake_front(30)
        g = AdmissionGate(front, queue_max=4, max_wait_s=5.0)
        await g.enter("a", req(64, 320))   # 24 blocks at its peak
        t = asyncio.create_task(g.enter("b", req(64, 200)))   # with a: 17 + 17 blocks at b's end > 30
        await settle()
        assert not t.done()
        front.flights["a"] = SimpleNamespace(generated=[0] * 300)   # a has 20 left: 24 + 6 at its end
        g.wake()
        await settle()
        assert t.done()
    asyncio.run(go())


def test_no_report_yet_admits_everything_and_a_refresh_reads_the_next_period():
    front = fake_front(10)
    reports = front.monitor.reports
    front.monitor.reports = {}
    g = AdmissionGate(front)
    assert math.isinf(g.reachable())
    front.monitor.reports = reports
    assert math.isinf(g.reachable()) and g.refresh() == 10 == g.reachable()


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="admission queue"):
        AdmissionGate(fake_front(10), queue_max=-1)
