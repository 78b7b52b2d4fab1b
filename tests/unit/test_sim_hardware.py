"""Simulated hardware: shared links (contention between concurrent transfers), the RDMA link, the
paper's clusters, unmapping cost in drops."""

import pytest

from vllm_kunserve.policy.transfer import Link, SharedLink
from vllm_kunserve.sim.engine import SimConfig, Simulator
from vllm_kunserve.sim.hardware import CLUSTERS, UnmapCost, get_cluster, get_gpu, get_link
from vllm_kunserve.sim.policies import build_policy
from vllm_kunserve.sim.request import Req
from vllm_kunserve.sim.steptime import EqStepTime
from vllm_kunserve.sim.trace import TraceRequest
from vllm_kunserve.workload.models import BUILTIN

pytestmark = pytest.mark.unit


def test_two_exchanges_sharing_a_link_each_get_half():
    link = Link(10e9, 0.0)
    alone = SharedLink(link)
    a = alone.start(0.0, 10e9)
    assert alone.finish_time(a, 0.0) == pytest.approx(1.0)
    both = SharedLink(link)
    a, b = both.start(0.0, 10e9), both.start(0.0, 10e9)
    assert both.finish_time(a, 0.0) == pytest.approx(2.0) and both.finish_time(b, 0.0) == pytest.approx(2.0)
    assert both.active(1.999) == 2 and both.active(2.001) == 0


def test_a_later_transfer_slows_the_earlier_one_from_then_on():
    s = SharedLink(Link(10.0, 0.0))
    a = s.start(0.0, 100.0)
    b = s.start(5.0, 100.0)  # a has 50 left: 5/s until it ends at 15, then b runs alone
    assert s.finish_time(a, 5.0) == pytest.approx(15.0)
    assert s.finish_time(b, 5.0) == pytest.approx(20.0)
    assert s.active(14.9) == 2 and s.active(15.1) == 1
    # latency is paid once per transfer, before its bytes flow; chunk_time_s starts nothing
    t = SharedLink(Link(10.0, 1.0))
    assert t.time_s(0.0, 100.0) == pytest.approx(11.0)
    assert t.chunk_time_s(0.0, 10.0) == pytest.approx(1.0 + 2.0)  # shares with the one above
    assert t.active(0.0) == 1
    with pytest.raises(ValueError, match="back"):
        t.start(-1.0, 1.0)


def test_rdma_link_is_the_profiled_network_at_200_gbps():
    ib, rdma = get_link("ib"), get_link("rdma200")
    assert rdma.bandwidth_bytes_per_s < 25e9  # below the 200 Gb/s line rate
    if ib.name.startswith("vidur"):  # fitted from the Vidur profile: half the 400 Gb/s NIC's rate
        assert rdma.bandwidth_bytes_per_s == pytest.approx(ib.bandwidth_bytes_per_s / 2)
        assert rdma.latency_s == ib.latency_s
    assert get_cluster("paper-rdma").link == "rdma200" and get_cluster("paper-rdma").servers == 8
    assert get_cluster("paper-nvlink").link == "nvlink" and get_cluster("ideal-nvlink").unmap is None
    assert set(CLUSTERS) >= {"paper-rdma", "paper-nvlink", "ideal-nvlink"}
    with pytest.raises(ValueError, match="cluster"):
        get_cluster("nope")
    assert UnmapCost().time_s(10e9) < 0.05 and UnmapCost().time_s(0) == 0.0


def make_cfg(**kw):
    return SimConfig(model=BUILTIN["small"], gpu=get_gpu("h100"), step_time=EqStepTime(1e-8, 2e-5, 5e-3),
                     instances=4, block_size=16, max_tokens=512, max_seqs=64, kv_blocks=kw.pop("kv_blocks", 64),
                     link=Link(1e9, 0.0, "slow"), **kw)


def test_concurrent_migrations_from_one_instance_share_its_port():
    for contention, second in ((False, 1.0), (True, 2.0)):
        sim = Simulator(make_cfg(contention=contention), build_policy("vllm"), [])
        src = sim.servers[0]
        assert sim.server_bulk_time(src, 1e9) == pytest.approx(1.0)
        # a second 1 GB copy started at the same moment shares the port: both finish at 2 s
        assert sim.server_bulk_time(src, 1e9) == pytest.approx(second)
        # another instance's port is free
        assert sim.server_bulk_time(sim.servers[1], 1e9) == pytest.approx(1.0)
    # a pipeline group's KV leaves from all its members at once
    sim = Simulator(make_cfg(contention=True), build_policy("vllm"), [])
    group = sim.new_server((2, 3))
    assert sim.server_bulk_time(group, 2e9) == pytest.approx(1.0)


def test_llumnix_migration_copy_reflects_contention():
    from vllm_kunserve.sim.policies.base import move_request

    sim = Simulator(make_cfg(contention=True), build_policy("llumnix"), [])
    src, dst = sim.servers[0], sim.servers[1]
    reqs = [Req(TraceRequest(i, 0.0, 320, 4)) for i in range(2)]
    for r in reqs:
        r.computed, r.blocks = 320, 20
        src.running.append(r)
        src.used += 20
        r.server = src
    src.busy = dst.busy = True  # mid-step elsewhere: the moves start no step here
    assert move_request(sim, reqs[0], src, dst) and move_request(sim, reqs[1], src, dst)
    c1, c2 = [e["copy_s"] for e in sim.events if e["kind"] == "migrate"]
    assert c2 == pytest.approx(2 * c1, rel=1e-3)  # the second copy shares the source's port


def burst(n=100, gap=0.005):
    return [TraceRequest(i, i * gap, 200 + (i * 37) % 150, 40 + (i * 11) % 30) for i in range(n)]


def test_drop_stall_pays_unmapping():
    stalls = {}
    for name, unmap in (("free", None), ("charged", UnmapCost(fixed_s=0.25, per_gb_s=0.0))):
        sim = Simulator(make_cfg(unmap=unmap), build_policy("kunserve"), burst()).run()
        drops = [e for e in sim.events if e["kind"] == "drop"]
        assert drops and all(r.finishes == 1 for r in sim.reqs)
        stalls[name] = drops[0]["stall_s"]
        plans = [e for e in sim.events if e["kind"] == "drop_plan"]
        assert plans[0]["unmap_bytes"] > 0
    assert stalls["charged"] == pytest.approx(stalls["free"] + 0.25, abs=1e-6)


def test_the_measured_stage_link_figures_are_the_ones_in_use():
    """The simulator's ``stage-h100`` link and the CUDA bulk chunk are what the H100 run derived
    (docs/benchmarks/stage_link_gpu.json): re-measuring changes them in one place."""
    import json
    from pathlib import Path

    from vllm_kunserve.transfer.stage import BULK_CHUNK_BYTES

    got = json.loads((Path(__file__).resolve().parents[2] / "docs/benchmarks/stage_link_gpu.json").read_text())
    d = got["derived"]
    link = get_link("stage-h100")
    assert link.bandwidth_bytes_per_s == pytest.approx(d["link_fit"]["bandwidth_bytes_per_s"], rel=1e-3)
    assert link.latency_s == pytest.approx(d["link_fit"]["latency_s"], rel=1e-3)
    assert BULK_CHUNK_BYTES["cuda"] == d["chosen_chunk_mib"] << 20
    assert "H100" in got["device"]
