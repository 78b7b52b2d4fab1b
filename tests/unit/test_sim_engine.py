"""Simulator behaviour: event order, conservation under every policy, preemption, drop and restore."""

import pytest

from vllm_kunserve.sim.engine import SimConfig, Simulator
from vllm_kunserve.sim.hardware import get_gpu
from vllm_kunserve.sim.metrics import ratios_to, summarize
from vllm_kunserve.sim.policies import POLICIES, build_policy
from vllm_kunserve.sim.steptime import EqStepTime
from vllm_kunserve.sim.trace import TraceRequest
from vllm_kunserve.workload.models import BUILTIN

pytestmark = pytest.mark.unit


def make_cfg(kv_blocks=64, instances=4, **kw):
    # small model, 16-token blocks, Eq. 1 step time in seconds
    return SimConfig(model=BUILTIN["small"], gpu=get_gpu("h100"), step_time=EqStepTime(1e-8, 2e-5, 5e-3),
                     instances=instances, block_size=16, max_tokens=512, max_seqs=64, kv_blocks=kv_blocks, **kw)


def burst(n=120, gap=0.01, prompt=200, output=40):
    return [TraceRequest(i, i * gap, prompt + (i * 37) % 150, output + (i * 11) % 30) for i in range(n)]


def run(policy, cfg=None, trace=None):
    sim = Simulator(cfg or make_cfg(), build_policy(policy), trace or burst()).run()
    return sim, summarize(sim)


def test_events_run_in_time_then_insertion_order():
    sim = Simulator(make_cfg(), build_policy("vllm"), [])
    seen = []
    for t, tag in [(2.0, "c"), (1.0, "a"), (1.0, "b"), (0.5, "z")]:
        sim.at(t, seen.append, tag)
    sim.run()
    assert seen == ["z", "a", "b", "c"]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_exactly_once(policy):
    sim, s = run(policy)
    assert s["completed"] == len(sim.reqs) and s["failed"] == 0
    assert all(r.finishes == 1 and r.generated == r.output for r in sim.reqs)
    assert all(r.first_t >= r.arrival and r.finish_t >= r.first_t for r in sim.reqs)
    assert all(sv.used == 0 and not sv.running and not sv.waiting for sv in sim.servers)


def test_oracle_never_preempts_and_recompute_does_under_overload():
    _, oracle = run("oracle")
    sim, vllm = run("vllm")
    assert oracle["preemptions"] == 0
    assert vllm["preemptions"] > 0
    assert max(r.preempts for r in sim.reqs) >= 1
    assert oracle["ttft_s"]["p99"] < vllm["ttft_s"]["p99"]


def test_swap_keeps_kv_instead_of_recomputing():
    sim, s = run("infercept")
    assert s["preemptions"] > 0
    # a swapped-in request resumes where it was: total prefill tokens stay the prompt tokens
    assert sim._tok == sum(r.prompt + r.output - 1 for r in sim.reqs)


def test_kunserve_drop_frees_memory_then_restores():
    # a burst, then a long quiet tail so demand falls below the restore threshold for hold_s
    trace = burst(100, 0.005) + [TraceRequest(100 + i, 5 + i * 2.0, 64, 8) for i in range(12)]
    cfg = make_cfg(kv_blocks=64)
    sim = Simulator(cfg, build_policy("kunserve"), trace).run()
    kinds = [e["kind"] for e in sim.events]
    assert "drop" in kinds and "restore" in kinds
    assert kinds.index("drop") < kinds.index("restore")
    peak = max(p["kv_capacity_blocks"] for p in sim.timeline)
    base = cfg.instances * cfg.kv_blocks
    freed_per_merge = cfg.model.layers * cfg.model.layer_bytes // cfg.block_bytes
    assert peak >= base + freed_per_merge  # dropped weights became KV
    assert sim.timeline[-1]["kv_capacity_blocks"] == base and len(sim.servers) == cfg.instances
    assert all(r.finishes == 1 for r in sim.reqs)
    assert summarize(sim)["preemptions"] <= summarize(run("vllm")[0])["preemptions"]


def test_pipeline_cycle_and_bubble():
    cfg = make_cfg(instances=2)
    sim = Simulator(cfg, build_policy("kunserve"), [])
    s = sim.new_server((0, 1))
    from vllm_kunserve.sim.request import Req
    reqs = [Req(TraceRequest(i, 0, 100, 5)) for i in range(4)]
    batch = [(r, 100) for r in reqs]
    t = s.cycle_time(batch)
    whole = cfg.step_time.batch_time([(0, 100)] * 4)
    # two balanced microbatches: about half the whole batch each, never faster than that
    assert whole / 2 <= t < whole
    assert 0 <= s.bubble_sum < 0.2
    assert s.stage_busy_s == pytest.approx(2 * t) and 0 <= s.stage_idle_s < 0.2 * s.stage_busy_s


def test_ratios_to_vllm():
    res = {"vllm": {"summary": {m: {"p50": 2.0, "p99": 10.0} for m in ("ttft_s", "tpot_s", "latency_s")}},
           "x": {"summary": {m: {"p50": 1.0, "p99": 0.5} for m in ("ttft_s", "tpot_s", "latency_s")}}}
    r = ratios_to(res)
    assert r["x"]["ttft_s_p99"] == 20.0 and r["x"]["ttft_s_p50"] == 2.0 and r["vllm"]["ttft_s_p99"] == 1.0
    res["x"]["summary"]["ttft_s"]["p99"] = 0.0
    assert ratios_to(res)["x"]["ttft_s_p99"] is None


def test_bad_policy_name():
    with pytest.raises(ValueError, match="unknown"):
        build_policy("nope")


def test_least_work_dispatch_avoids_a_prefill_queue():
    from vllm_kunserve.sim.request import Req

    cfg = make_cfg(kv_blocks=100, instances=3)
    sims = {m: Simulator(cfg, build_policy("vllm", m), []) for m in ("least-load", "least-work")}
    for sim in sims.values():
        a, b, c = sim.servers
        a.capacity = 300  # a pipeline group's extra memory, but a deep prefill queue
        a.waiting.extend(Req(TraceRequest(i, 0, 400, 4)) for i in range(5))
        b.used = 60  # fuller memory, idle compute
        c.used = 95  # idle but the new prompt does not fit
    new = Req(TraceRequest(99, 0, 200, 4))  # 13 blocks
    assert sims["least-load"].policy.dispatch(sims["least-load"], new) is sims["least-load"].servers[0]
    assert sims["least-work"].policy.dispatch(sims["least-work"], new) is sims["least-work"].servers[1]
    with pytest.raises(ValueError, match="dispatch"):
        build_policy("vllm", "fastest")


def test_least_work_is_the_default_router_of_every_policy_but_mell():
    from vllm_kunserve.sim.policies import DEFAULT_DISPATCH

    assert DEFAULT_DISPATCH == "least-work"
    for name in POLICIES:
        pol = build_policy(name)
        if name not in ("mell", "levers"):  # MELL places with its own placer; levers runs all three: MELL too
            assert pol.dispatch_mode == "least-work" and pol.describe()["dispatch"] == "least-work"
    assert build_policy("kunserve", "least-load").dispatch_mode == "least-load"  # still selectable


def test_simulate_cli_dispatch_default_help_and_bad_value(tmp_path, capsys):
    from vllm_kunserve.cli.main import build_parser, main

    args = build_parser(["simulate"]).parse_args(["simulate", "--trace", "x.csv"])
    assert args.dispatch == "least-work"
    with pytest.raises(SystemExit):
        build_parser(["simulate"]).parse_args(["simulate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "least-work (default" in help_text and "least-load" in help_text
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1000,12,3\n2000,20,4\n")
    assert main(["simulate", "--trace", str(trace), "--dispatch", "fastest"]) == 2
    assert "--dispatch 'fastest'" in capsys.readouterr().err


def test_a_group_with_peak_admission_runs_a_short_kv_burst_without_preempting():
    """A 2-instance group whose KV is short of a burst of long decodes: with vLLM's admission it
    preempts and recomputes; admitting only what can finish (policy.admission), it never preempts,
    still finishes everything and computes no token twice."""
    from vllm_kunserve.sim.request import Req

    def drain(peak: bool):
        cfg = make_cfg(kv_blocks=40, instances=2)
        sim = Simulator(cfg, build_policy("kunserve"), [])
        s = sim.new_server((0, 1))
        s.capacity = 80                       # the group's KV: 80 blocks of 16 = 1280 tokens
        s.peak_admission = peak
        reqs = [Req(TraceRequest(i, 0.0, 32, 200 + 13 * i)) for i in range(12)]
        s.waiting.extend(reqs)
        computed = 0
        for _ in range(20000):
            if not s.has_work():
                break
            batch = s.schedule()
            for r, n in batch:
                r.computed += n
                computed += n
                if r.computed >= r.prompt + r.generated:
                    r.generated += 1
            for r in [r for r in s.running if r.generated >= r.output]:
                s.running.remove(r)
                s.used -= r.blocks
            assert s.used <= s.capacity
        assert not s.has_work() and all(r.generated == r.output for r in reqs)
        return s.preemptions, computed - sum(r.prompt + r.output - 1 for r in reqs)

    assert drain(True) == (0, 0)                  # nothing preempted, nothing recomputed
    preempted, recomputed = drain(False)
    assert preempted > 0 and recomputed > 0


def test_a_preempted_request_resumes_from_its_blocks_still_in_the_prefix_cache():
    """vLLM v1 frees a preempted request's blocks last-first into its free queue and allocates
    from the oldest: until others take them, its prefix stays cached and it resumes from there."""
    from vllm_kunserve.sim.request import Req

    cfg = make_cfg(kv_blocks=20, instances=1)
    sim = Simulator(cfg, build_policy("vllm"), [])
    s = sim.new_server((0,))
    s.prefix_cache = True
    a, b = Req(TraceRequest(0, 0.0, 96, 50)), Req(TraceRequest(1, 0.0, 32, 50))
    for r, blocks in ((a, 8), (b, 4)):   # a: 128 tokens in 8 blocks; b: 4 blocks
        s.running.append(r)
        r.computed, r.generated, r.blocks = blocks * 16, blocks * 16 - r.prompt, blocks
        s.used += blocks
    s._preempt(a)                        # 8 blocks to the free queue's tail, behind 8 never used
    assert s.cached_blocks(a) == 8 and a.computed == 0
    s.used += 10                         # others take 10: the 8 old ones and a's last 2
    assert s.cached_blocks(a) == 6
    b.computed = b.blocks = 0            # (b gives its blocks back: the free count fits a again)
    s.running.remove(b)
    s.used -= 4 + 10
    batch = s.schedule()
    assert (a, 128 - 6 * 16) in batch and a.blocks == 8 and s.cached_blocks(a) == 0
    # the same without the prefix cache: everything again
    s2 = sim.new_server((0,))
    c = Req(TraceRequest(2, 0.0, 96, 50))
    s2.running.append(c)
    c.computed, c.generated, c.blocks = 128, 32, 8
    s2.used += 8
    s2._preempt(c)
    assert (c, 128) in s2.schedule()


@pytest.mark.parametrize("cache", [False, True])
def test_stock_under_overload_finishes_everything_with_or_without_the_prefix_cache(cache):
    cfg = make_cfg(prefix_cache=cache)
    sim, s = run("vllm", cfg)
    assert s["completed"] == len(sim.reqs) and s["preemptions"] > 0
    assert all(sv.used == 0 and not sv.running and not sv.waiting for sv in sim.servers)
    recomputed = sim._tok - sum(r.prompt + r.output - 1 for r in sim.reqs)
    assert recomputed > 0
    if cache:  # resuming from cached blocks computes fewer tokens than recomputing everything
        assert sim._tok < Simulator(make_cfg(), build_policy("vllm"), burst()).run()._tok


def _member_group(kv_blocks=20, capacity=40):
    """A 2-member group whose members keep their requests (SimConfig.member_queues): 20 blocks each."""
    cfg = make_cfg(kv_blocks=kv_blocks, instances=2, member_queues=True)
    sim = Simulator(cfg, build_policy("kunserve"), [])
    s = sim.new_server((0, 1))
    s.capacity = capacity
    return sim, s


def test_a_member_admits_from_its_own_queue_only_and_preempts_its_own_newest():
    """Member 0 is full and has a request waiting; member 1 has room: the waiting one stays in member
    0's queue (no member takes another's request), member 1's arrival is admitted, and when member
    0's running request needs a block the victim is member 0's newest, never member 1's."""
    from vllm_kunserve.sim.request import Req

    sim, s = _member_group()
    assert s.members and s.member_cap() == 20
    old, new0 = Req(TraceRequest(0, 0.0, 16 * 9, 50)), Req(TraceRequest(1, 0.0, 16 * 10, 50))
    for r, blocks in ((old, 9), (new0, 10)):   # member 0: 19 of its 20 blocks
        r.member, r.computed, r.blocks = 0, r.prompt, blocks
        r.generated = 1
        s.running.append(r)
        s.used += blocks
    m1 = Req(TraceRequest(2, 0.0, 32, 10))
    m1.member = 1
    wait0 = Req(TraceRequest(3, 0.0, 32, 10))
    wait0.member = 0
    s.waiting.extend([wait0, m1])                # member 0's waiting request is ahead of member 1's
    batch = dict(s.schedule())
    # old (145 tokens in 9 blocks of 16 = 144) needs a 10th block: member 0 has 1 free -> no preemption;
    # new0 (161 tokens in 10 blocks) needs an 11th: none left in member 0 -> its newest (new0) goes
    assert old in batch and new0 not in batch and new0.preempts == 1 and new0 in s.waiting
    assert m1 in batch and m1 in s.running            # member 1 admits from its own queue
    assert wait0 not in batch and wait0 in s.waiting  # member 0 preempted this step: admits nothing
    assert s.member_used() == [10, 2] and s.used == 12


def test_arrivals_go_to_the_member_with_the_least_prefill_queued():
    from vllm_kunserve.sim.request import Req

    sim, s = _member_group()
    queued = Req(TraceRequest(0, 0.0, 300, 10))
    queued.member = 0
    s.waiting.append(queued)
    assert s.pick_member(Req(TraceRequest(1, 0.0, 64, 10))) == 1
    s.waiting.popleft()
    assert s.pick_member(Req(TraceRequest(1, 0.0, 64, 10))) == 0   # a tie: the lower index


def test_a_group_of_member_queues_finishes_every_request_and_keeps_them_on_their_instance():
    """kunserve with member_queues under a burst: drop and restore happen, every request finishes
    once, and requests that ran through a group change stayed on the instance they started on."""
    trace = burst(100, 0.005) + [TraceRequest(100 + i, 5 + i * 2.0, 64, 8) for i in range(12)]
    cfg = make_cfg(kv_blocks=64, member_queues=True)
    sim = Simulator(cfg, build_policy("kunserve"), trace)
    seen: dict[int, set] = {}
    orig = sim._step_done

    def step_done(srv, batch):
        for r, _ in batch:
            seen.setdefault(r.id, set()).add(srv.instances[r.member] if srv.members else srv.instances[0])
        return orig(srv, batch)
    sim._step_done = step_done
    sim.run()
    kinds = [e["kind"] for e in sim.events]
    assert "drop" in kinds and "restore" in kinds
    assert all(r.finishes == 1 and r.generated == r.output for r in sim.reqs)
    assert all(sv.used == 0 and not sv.running and not sv.waiting for sv in sim.servers)
    assert sum(len(v) > 1 for v in seen.values()) == 0
    with pytest.raises(ValueError, match="recompute"):
        Simulator(make_cfg(member_queues=True), build_policy("infercept"), []).new_server((0, 1))


def test_kunserve_regroups_a_live_pair_only_with_drop_regroup_keeping_or_recomputing_its_kv():
    """A burst that two pairs cannot hold after one pair formed: with ``drop.regroup`` the live
    pair is merged into a group of four, the lone instances' KV exchanged; the pair's running
    requests keep their KV (the fleet's restage) or, with ``regroup_keeps_kv=False`` (its fallback),
    are recomputed; without it the pairs stay. Every request finishes once."""
    from vllm_kunserve.config import parse_config
    from vllm_kunserve.sim.policies.kunserve import KunServePolicy
    trace = [TraceRequest(i, i * 0.02, 200 + (i * 37) % 150, 300) for i in range(200)]
    trace += [TraceRequest(200 + i, 4.0 + i * 0.005, 200 + (i * 37) % 150, 300) for i in range(400)]
    out = {}
    for name, pol in (("off", build_policy("kunserve", config=parse_config({"drop": {"regroup": False}}))),
                      ("recompute", KunServePolicy(parse_config({"drop": {"regroup": True}}), regroup_keeps_kv=False)),
                      ("keep", build_policy("kunserve", config=parse_config({"drop": {"regroup": True}})))):
        sim = Simulator(make_cfg(kv_blocks=600), pol, trace).run()
        assert all(r.finishes == 1 and r.generated == r.output for r in sim.reqs)
        out[name] = sim
    drops = {k: [e for e in sim.events if e["kind"] == "drop"] for k, sim in out.items()}
    assert max(p["max_group"] for p in out["off"].timeline) == 2
    assert all(e["recomputed"] == 0 for e in drops["off"])
    assert max(p["max_group"] for p in out["recompute"].timeline) == 4
    (regroup,) = [e for e in drops["recompute"] if [sorted(g) for g in e["groups"]] == [[0, 1, 2, 3]]]
    assert regroup["recomputed"] > 0 and all(e["recomputed"] == 0 for e in drops["recompute"] if e is not regroup)
    plan = [e for e in out["recompute"].events if e["kind"] == "drop_plan" and e["regrouped"]]
    assert [e["regrouped"] for e in plan] == [[[0, 1]]]
    keep = out["keep"]
    assert max(p["max_group"] for p in keep.timeline) == 4
    assert all(e["recomputed"] == 0 for e in drops["keep"])
    plans = [e for e in keep.events if e["kind"] == "drop_plan" and e["live_merged"]]
    assert [e["live_merged"] for e in plans] == [[[0, 1]]] and all(not e["regrouped"] for e in plans)


def test_kunserve_steps_a_group_of_four_down_into_pairs_keeping_every_request():
    """The restore's step down (``GroupRestore.into``, drop.regroup) as the simulator times it: the
    four's capacity shrinks to the two pairs' at once, the layers each member takes back load, then
    the four becomes the two pairs on the decision's stages, every running request kept (none
    recomputed, every one finishes once)."""
    from types import SimpleNamespace

    from vllm_kunserve.config import parse_config
    from vllm_kunserve.policy.restore import GroupRestore
    from vllm_kunserve.sim.policies.kunserve import KunServePolicy

    L = BUILTIN["small"].layers
    half, quarter = L // 2, L // 4
    stages = ((0, 0, half), (2, half, L), (1, 0, half), (3, half, L))

    class Scripted(KunServePolicy):
        def on_tick(self, sim):
            if sim._pending is not None:
                return
            if len(sim.servers) == 4 and sim.now < 1.0:     # the four forms at once
                sim.transition(list(sim.servers), [(0, 2, 1, 3)], {i: (k * quarter, (k + 1) * quarter)
                                                                   for k, i in enumerate((0, 2, 1, 3))}, 0.0, "drop")
            elif len(sim.servers) == 1 and sim.now >= 1.0:  # then steps down
                g = GroupRestore((0, 1, 2, 3), "peer", "low_demand_step", 4 * quarter * BUILTIN["small"].layer_bytes,
                                 into=((0, 2), (1, 3)), stages=stages)
                self._restore(sim, SimpleNamespace(restore=(g,)))

    trace = [TraceRequest(i, 0.2 + i * 0.01, 100, 400) for i in range(24)]
    sim = Simulator(make_cfg(kv_blocks=600), Scripted(parse_config({"drop": {"regroup": True}})), trace).run()
    (start,) = [e for e in sim.events if e["kind"] == "restore_start"]
    assert start["into"] == [[0, 2], [1, 3]] and start["load_s"] > 0
    assert sorted(tuple(s.instances) for s in sim.servers) == [(0, 2), (1, 3)]
    assert {i: sim.layer_range[i] for i in range(4)} == {i: (lo, hi) for i, lo, hi in stages}
    assert all(s.capacity == sim.capacity_blocks(tuple(s.instances)) for s in sim.servers)
    assert all(r.finishes == 1 and r.generated == r.output and r.preempts == 0 for r in sim.reqs)
    assert min(r.finish_t for r in sim.reqs) > start["t"]   # requests were running across the step


def test_levers_remap_first_then_drop_then_restore_and_every_request_finishes():
    """All three levers (``levers``: remap on each server, drop, MELL placement) under a burst and a
    quiet tail, in the order ``policy.levers`` gives: the servers remap first, the drop comes once
    their remap room is short (or its wait is over), the group restores after."""
    trace = burst(100, 0.005) + [TraceRequest(100 + i, 5 + i * 2.0, 64, 8) for i in range(12)]
    sim = Simulator(make_cfg(kv_blocks=64), build_policy("levers"), trace).run()
    kinds = [e["kind"] for e in sim.events]
    assert "remap" in kinds and "drop" in kinds and "restore" in kinds
    assert kinds.index("remap") < kinds.index("drop") < kinds.index("restore")
    levers = [x["lever"] for x in sim.policy.levers]
    assert "drop" in levers and levers.index("drop") < levers.index("restore")
    assert all(r.finishes == 1 and r.generated == r.output for r in sim.reqs)
    assert sim.policy.describe()["dispatch"] == "mell"


def test_levers_a_rise_the_servers_remap_covers_needs_no_drop():
    """A slower rise: the remap room covers what a drop would free, so the drop waits and never comes
    (kunserve alone drops for the same trace); then a steeper one the remap cannot cover drops."""
    slow = burst(60, 0.1, prompt=150, output=200)
    sim = Simulator(make_cfg(kv_blocks=64), build_policy("levers"), slow).run()
    kinds = [e["kind"] for e in sim.events]
    assert "remap" in kinds and "drop" not in kinds
    assert [x["lever"] for x in sim.policy.levers][:2] == ["none", "remap"]
    alone = Simulator(make_cfg(kv_blocks=64), build_policy("kunserve"), slow).run()
    assert "drop" in [e["kind"] for e in alone.events]
    steep = Simulator(make_cfg(kv_blocks=64), build_policy("levers"), burst(80, 0.05, prompt=150, output=300)).run()
    assert [x["lever"] for x in steep.policy.levers][:3] == ["none", "remap", "drop"]
    assert all(r.finishes == 1 for r in sim.reqs + steep.reqs)
