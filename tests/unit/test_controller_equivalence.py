"""One controller (issue 35): the fleet's group controller (``cluster.control.groups``) and the simulator's
KunServe policy (``sim.policies.kunserve``) decide the same way over the same snapshots.

A recorded sequence of cluster snapshots (demand rising past the trigger, a drop, demand falling,
a spike and a second drop beside the live group, the hold, a restore, a dead peer, a drop among
the survivors) is fed to both: to the fleet through fake engine control ports (each engine's
``/state`` built from its row of the snapshot; the group operations it issues are recorded, no
HTTP), to the simulator's policy by handing its ``on_tick`` the snapshot. Step by step, the fleet
builds the recorded snapshot from the engines' states, both reach the same decision, and the
operations the fleet issues are that decision's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from vllm_kunserve.policy import levers as fleet_levers   # the fleet's controller calls monitor_tick there
from vllm_kunserve.cluster.control.groups import GroupController, GroupOpError
from vllm_kunserve.cluster.control.monitor import FlightBook
from vllm_kunserve.config import parse_config
from vllm_kunserve.engine.state import EngineState
from vllm_kunserve.policy.drop import balanced_stages
from vllm_kunserve.policy.snapshot import ClusterSnapshot, InstanceSnapshot, ModelSpec
from vllm_kunserve.sim import adapters
from vllm_kunserve.sim.policies import kunserve as sim_kunserve

pytestmark = pytest.mark.unit

L, LAYER_BYTES, BLOCK_BYTES, BLOCK_SIZE = 8, 3 << 20, 1 << 16, 32   # one layer = 48 blocks
BASE, MAX = 100, 200   # each engine's blocks holding every layer, and the most its KV cache reaches
N = 4
CFG = {"drop": {"trigger_ratio": 0.9, "forecast_horizon_s": 1.0, "headroom_ratio": 0.1},
       "restore": {"threshold": 0.7, "hold_s": 2.0}}
MODEL = ModelSpec(num_layers=L, layer_bytes=LAYER_BYTES, block_bytes=BLOCK_BYTES, block_size=BLOCK_SIZE)

# (now_s, per-instance (used, queued) blocks, groups, unhealthy instances, expected action)
STEPS = [
    (0.0, [(40, 0)] * 4, [], (), "none"),
    (0.5, [(45, 0)] * 4, [], (), "none"),
    (1.0, [(90, 0), (90, 0), (60, 0), (60, 0)], [], (), "drop"),         # forms (0, 1): the trend ending now
    (1.5, [(100, 0), (100, 0), (60, 0), (60, 0)], [(0, 1)], (), "none"),  # the group absorbs it
    (2.0, [(20, 0), (20, 0), (60, 0), (60, 0)], [(0, 1)], (), "none"),    # below the restore level: hold
    (2.5, [(20, 0), (20, 0), (60, 0), (60, 0)], [(0, 1)], (), "none"),
    (3.0, [(20, 0), (20, 0), (100, 150), (100, 150)], [(0, 1)], (), "drop"),  # a spike: forms (2, 3) only
    (3.5, [(20, 0), (20, 0), (90, 0), (90, 0)], [(0, 1), (2, 3)], (), "none"),  # hold starts over
    (4.0, [(20, 0), (20, 0), (90, 0), (90, 0)], [(0, 1), (2, 3)], (), "none"),
    (4.5, [(20, 0), (20, 0), (90, 0), (90, 0)], [(0, 1), (2, 3)], (), "none"),
    (5.0, [(20, 0), (20, 0), (90, 0), (90, 0)], [(0, 1), (2, 3)], (), "none"),
    (5.5, [(20, 0), (20, 0), (90, 0), (90, 0)], [(0, 1), (2, 3)], (), "restore"),  # (0, 1); (2, 3) is full
    (6.0, [(20, 0), (20, 0), (90, 0), (90, 0)], [(2, 3)], (), "none"),
    (6.5, [(20, 0), (20, 0), (90, 0), (90, 0)], [(2, 3)], (3,), "restore"),  # a dead peer: from the host
    (7.0, [(20, 0), (20, 0), (90, 0), (90, 0)], [], (3,), "none"),
    (7.5, [(95, 20), (95, 20), (90, 0), (90, 0)], [], (3,), "drop"),     # the survivors: (0, 1) again
]


def snapshot(now, load, groups, sick, awaiting=(), cap=MAX) -> ClusterSnapshot:
    """The recorded snapshot; ``groups`` in pipeline order (stage 0 first; the snapshot lists each
    group's members sorted, as the fleet does); a member of a G-group holds its base plus its share
    of the freed copies (the copy spread over G members: 48 blocks a layer), up to ``cap``."""
    held = {i: r for g in groups for i, r in zip(g, balanced_stages(L, len(g)))}
    size = {i: len(g) for g in groups for i in g}
    insts = tuple(InstanceSnapshot(
        i, min(cap, BASE + 48 * L * (size[i] - 1) // size[i]) if i in held else BASE, used, queued,
        *(held.get(i) or (0, 0)), healthy=i not in sick,
        kv_blocks_base=BASE, prompt_tokens=10 * used, output_tokens=30 * used, kv_blocks_max=cap,
        awaiting_first_token=(awaiting or (0,) * N)[i])
        for i, (used, queued) in enumerate(load))
    alone = [(i,) for i in range(N) if i not in held]
    return ClusterSnapshot(MODEL, insts, tuple(tuple(sorted(g)) for g in groups) + tuple(alone), now_s=now)


class FakePorts:
    """The engines' control ports: ``/state`` from an instance's row, the operations recorded."""

    def __init__(self) -> None:
        self.phase = {i: "base" for i in range(N)}
        self.healthy = {i: True for i in range(N)}
        self.ops: list[tuple[int, str, dict]] = []

    def state(self, r: InstanceSnapshot) -> dict:
        lo, hi = r.layer_start, r.layer_end or L
        return {"engine": {"stage": [f"unix:///tmp/s{r.instance_id}"]}, "phase": self.phase[r.instance_id],
                "capacity": {"blocks_total": r.kv_blocks_total, "blocks_base": r.kv_blocks_base,
                             "blocks_max": r.kv_blocks_max, "block_bytes": BLOCK_BYTES, "block_size": BLOCK_SIZE},
                "blocks": {"used": r.kv_blocks_used, "queued": r.queued_blocks, "draining": 0},
                "requests": {"mix_prompt_tokens": r.prompt_tokens, "mix_output_tokens": r.output_tokens},
                "layers": [{"index": k, "state": "resident" if lo <= k < hi else "dropped", "bytes": LAYER_BYTES}
                           for k in range(L)]}

    async def op(self, i: int, name: str, body: dict, timeout_s: float) -> dict:
        self.ops.append((i, name, body))
        if not self.healthy[i]:
            raise GroupOpError(f"instance {i} is dead")
        if name in ("group_join", "group_restage"):
            self.phase[i] = "grouped"
            return {"bytes": 0, "blocks_before": BASE, "blocks_after": MAX}
        self.phase[i] = "group_draining" if body["step"] == "begin" else "base"
        return {"draining": 0}


def fleet_controller(ports: FakePorts, cfg: dict = CFG):
    engines = [SimpleNamespace(index=i, accepting=True, control_url=f"http://c{i}") for i in range(N)]
    events: list = []
    front = SimpleNamespace(registry=CollectorRegistry(), token="", fleet=SimpleNamespace(engines=engines),
                            monitor=SimpleNamespace(reports={}), book=FlightBook(), events=events,
                            record=lambda kind, **info: events.append((kind, info)))
    gc = GroupController(front, parse_config(cfg))
    gc._op = ports.op
    return front, gc


def recorded(monkeypatch, module) -> list:
    """Every ``monitor_tick`` call ``module`` makes: (its input snapshot, its decision)."""
    ticks, real = [], module.monitor_tick

    def tick(snap, *a, **kw):
        dec, state = real(snap, *a, **kw)
        ticks.append((snap, dec))
        return dec, state
    monkeypatch.setattr(module, "monitor_tick", tick)
    return ticks


def drive(monkeypatch, steps, cfg: dict = CFG, cap: int = MAX):
    """Feed ``steps`` ((now, load, groups, sick, expected action[, awaiting first token per
    instance])) to the fleet's controller and the simulator's policy; assert, step by step, that
    they decide the same and that the fleet's operations are that decision's. Returns (the fleet's
    ticks, the front end, the controller, each step's finished leaves)."""
    fleet_ticks, sim_ticks = recorded(monkeypatch, fleet_levers), recorded(monkeypatch, sim_kunserve)
    ports = FakePorts()
    front, gc = fleet_controller(ports, cfg)

    # the simulator: its KunServe policy's on_tick over the recorded snapshot, its mechanisms recorded
    pol = sim_kunserve.KunServePolicy(parse_config(cfg))
    sim_decs = []
    sim = SimpleNamespace(_pending=None, recorded=None)
    monkeypatch.setattr(adapters, "cluster_snapshot", lambda s: s.recorded)
    pol._drop = lambda s, plan, need: sim_decs.append(("drop", plan))
    pol._restore = lambda s, dec: sim_decs.append(("restore", dec))

    actions, finishes = [], {}
    for now, load, groups, sick, expected, *rest in steps:
        awaiting = rest[0] if rest else ()
        snap = snapshot(now, load, groups, sick, awaiting, cap)
        # the fleet: what it relays to each engine, in its own book (no first token: not started)
        front.book = FlightBook()
        for i, n in enumerate(awaiting):
            for k in range(n):
                front.book.put(i, f"r{i}-{k}", 64, 0, False)
        for r in snap.instances:
            front.fleet.engines[r.instance_id].accepting = ports.healthy[r.instance_id] = r.healthy
        if 3 in sick and gc.group_of(3) is not None and not groups:
            gc.forget(3)  # the fleet's supervisor declares the engine dead
        front.monitor.reports = {r.instance_id: SimpleNamespace(ok=True, state=ports.state(r)) for r in snap.instances}
        gc._fresh_states = lambda members, snap=snap: _fresh(ports, snap, members)
        gc.clock = lambda now=now: now
        n_ops, n_ticks = len(ports.ops), len(fleet_ticks)
        asyncio.run(gc.on_poll({}))
        # the simulator
        n_sim = len(sim_decs)
        sim.recorded = snap
        pol.on_tick(sim)

        assert len(fleet_ticks) == len(sim_ticks) == n_ticks + 1, now
        (fsnap, fdec), (ssnap, sdec) = fleet_ticks[-1], sim_ticks[-1]
        assert fsnap == snap == ssnap, now                # the fleet builds the recorded snapshot
        assert fdec == sdec, now                          # history, report, plan, restore decision
        actions.append(fdec.action)
        assert fdec.action == expected, (now, fdec.action, fdec.overload.ratio)
        if fdec.action == "none":
            assert len(sim_decs) == n_sim, now
        else:
            kind, what = sim_decs[-1]
            assert kind == fdec.action and what == (fdec.drop if kind == "drop" else fdec.restore), now
        assert pol.mstate == gc.lstate.monitor, now               # the same history and restore hold after each step
        # the operations the fleet issued are the decision's
        step_ops = ports.ops[n_ops:]
        # a join names the layers it drops; a restage (a regroup keeping the KV) the spans its peers run
        joins = {i: b.get("drop") or sorted(k for lo, hi, _ in b["spans"] for k in range(lo, hi))
                 for i, name, b in step_ops if name in ("group_join", "group_restage")}
        begins = [i for i, name, b in step_ops if name == "group_leave" and b["step"] == "begin"]
        finishes.update({now: [i for i, name, b in step_ops if name == "group_leave" and b["step"] == "finish"]})
        if fdec.action == "drop":
            for gp in fdec.drop.groups:
                for st in gp.stages:
                    assert joins.pop(st.instance_id) == [k for k in range(L)
                                                                 if not st.layer_start <= k < st.layer_end]
        assert not joins, now
        want = [i for r in (fdec.restore.restore if fdec.action == "restore" else ()) for i in r.instances]
        assert sorted(begins) == sorted(want), now
    assert actions == [s[4] for s in steps]
    return fleet_ticks, front, gc, finishes


def test_the_fleet_and_the_simulator_decide_the_same_over_the_same_snapshots(monkeypatch):
    fleet_ticks, front, gc, finishes = drive(monkeypatch, STEPS)

    # the settled behaviours, as the two decided them
    by_t = {s[0]: d for (s, d) in ((st, dec) for st, (_, dec) in zip(STEPS, fleet_ticks))}
    assert [g.instances for g in by_t[3.0].drop.groups] == [(2, 3)]        # the live group (0, 1) stays
    assert by_t[3.0].drop.unchanged == ((0, 1),)
    assert by_t[1.0].overload.forecast_blocks == pytest.approx(140.0)    # 160, 180, 300 blocks at 0, 0.5, 1 s
    assert by_t[2.5].restore.reason == "holding"                          # below the restore level since 2.0;
    assert all(by_t[t].restore.reason == "holding" for t in (3.5, 4.0, 4.5, 5.0))  # the drop at 3.0 restarted it
    assert [(r.instances, r.source, r.reason) for r in by_t[5.5].restore.restore] == [((0, 1), "peer", "low_demand")]
    assert [(r.instances, r.source, r.reason) for r in by_t[6.5].restore.restore] == [
        ((2, 3), "host", "failed_instance")]
    assert [g.instances for g in by_t[7.5].drop.groups] == [(0, 1)]        # the dead peer is left out
    # the mechanism: (0, 1) drained and finished its split at the next poll; the dead peer's group was forgotten
    assert {t: f for t, f in finishes.items() if f} == {6.0: [0, 1]}
    assert [(g["members"], g["state"]) for g in gc.view()] == [([0, 1], "grouped")]


async def _fresh(ports: FakePorts, snap: ClusterSnapshot, members) -> dict:
    by_id = snap.by_id()
    for i in members:
        if not by_id[i].healthy:
            raise GroupOpError(f"instance {i} is not a live group member")
    return {i: EngineState.from_dict(ports.state(by_id[i])) for i in members}



# a drop due while requests await their first token: it waits for a moment with none, for at most
# drop.defer_for_first_token_s (1 s here), and never while the KV is short
DEFER_CFG = {**CFG, "drop": {**CFG["drop"], "defer_for_first_token_s": 1.0}}
DEFER_STEPS = [
    (0.0, [(40, 0)] * 4, [], (), "none"),
    (0.5, [(90, 0), (90, 0), (40, 0), (40, 0)], [], (), "none", (2, 0, 1, 0)),   # due, (0, 1) await: waits
    (1.0, [(92, 0), (92, 0), (40, 0), (40, 0)], [], (), "drop", (0, 0, 1, 0)),   # none left on (0, 1): joins
    (1.5, [(180, 0)] * 2 + [(92, 0)] * 2, [(0, 1)], (), "none", (0, 0, 1, 1)),    # (2, 3) due, awaiting: waits
    (2.0, [(180, 0)] * 2 + [(94, 0)] * 2, [(0, 1)], (), "none", (0, 0, 1, 1)),
    (2.5, [(180, 0)] * 2 + [(96, 0)] * 2, [(0, 1)], (), "drop", (0, 0, 1, 1)),    # waited 1 s: joins anyway
]


def test_a_due_drop_waits_for_first_tokens_alike_in_the_fleet_and_the_simulator(monkeypatch):
    fleet_ticks, front, gc, _ = drive(monkeypatch, DEFER_STEPS, DEFER_CFG)
    by_t = {s[0]: d for s, (_, d) in zip(DEFER_STEPS, fleet_ticks)}
    assert "2 requests on [0, 1] await their first token" in by_t[0.5].deferred
    assert [g.instances for g in by_t[0.5].drop.groups] == [(0, 1)]     # the plan it waits to carry out
    assert not by_t[1.0].deferred and not by_t[2.5].deferred
    assert by_t[1.5].deferred and by_t[2.0].deferred
    assert [g.instances for g in by_t[2.5].drop.groups] == [(2, 3)]
    # one event per deferral, when it starts
    assert [k for k, _ in front.events if k == "drop_deferred"] == ["drop_deferred"] * 2


def test_a_drop_never_waits_while_the_kv_is_short(monkeypatch):
    # instance 0's demand is over its capacity (the cluster's is not): the join goes ahead, awaiting or not
    steps = [(0.0, [(60, 0)] * 4, [], (), "none"),
             (0.5, [(100, 10), (98, 0), (60, 0), (60, 0)], [], (), "drop", (3, 3, 0, 0))]
    fleet_ticks, *_ = drive(monkeypatch, steps, DEFER_CFG)
    rep = fleet_ticks[-1][1].overload
    assert rep.demand_blocks < rep.capacity_blocks and rep.instances[0].ratio > 1.0
    assert not fleet_ticks[-1][1].deferred


# with drop.regroup a drop may merge the live group (0, 1) further: every member,
# the lone 2 and 3 too, restages into one group of four keeping the KV; each engine's KV can reach
# 400 blocks here
REGROUP_CFG = {**CFG, "drop": {**CFG["drop"], "regroup": True}}
NO_REGROUP_CFG = {**CFG, "drop": {**CFG["drop"], "regroup": False}}
REGROUP_STEPS = [
    (0.0, [(40, 0)] * 4, [], (), "none"),
    (0.5, [(90, 0), (90, 0), (40, 0), (40, 0)], [], (), "drop"),                        # forms (0, 1)
    (1.0, [(290, 100), (290, 100), (100, 200), (100, 200)], [(0, 1)], (), "drop"),     # (2, 3) is not enough
    (1.5, [(150, 0)] * 4, [(0, 2, 3, 1)], (), "none"),   # the plan's order: each keeps what it held where it can
]


@pytest.mark.parametrize("regroup", [False, True])
def test_a_live_group_is_merged_further_only_with_regroup_alike_in_the_fleet_and_the_simulator(monkeypatch, regroup):
    # without regroup the cluster stays overloaded with nothing left to merge: a drop decision that forms nothing
    steps = REGROUP_STEPS if regroup else [*REGROUP_STEPS[:3], (1.5, [(290, 0)] * 4, [(0, 1), (2, 3)], (), "drop")]
    fleet_ticks, front, gc, _ = drive(monkeypatch, steps, REGROUP_CFG if regroup else NO_REGROUP_CFG, cap=400)
    dec = fleet_ticks[2][1]
    if not regroup:   # only the lone instances merge; the plan falls short
        assert [g.instances for g in dec.drop.groups] == [(2, 3)] and dec.drop.unchanged == ((0, 1),)
        assert not dec.drop.satisfied and not fleet_ticks[3][1].drop.groups
        assert [(g["members"], g["state"]) for g in gc.view()] == [([0, 1], "grouped"), ([2, 3], "grouped")]
        return
    assert [sorted(g.instances) for g in dec.drop.groups] == [[0, 1, 2, 3]]
    assert dec.drop.merges == (((2,), (3,)), ((0, 1), (2, 3)))
    # the fleet restaged (0, 1) with the lone 2 and 3 (nothing recomputed)
    regroup_ev = next(info for kind, info in front.events if kind == "group_regroup")
    assert regroup_ev["outcome"] == "ok" and regroup_ev["members"] == [[0, 1]] and regroup_ev["into"] == [0, 1, 2, 3]
    assert regroup_ev["kept_kv"] and regroup_ev["lone"] == [2, 3]
    assert [(g["members"], g["state"]) for g in gc.view()] == [([0, 1, 2, 3], "grouped")]
