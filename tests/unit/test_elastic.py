"""An elastic fleet: the pure scaling decision (policy.elastic), its options, and the front end starting,
draining and stopping engines while requests stream, token-identical."""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import replace

import httpx
import pytest

from tests.unit.test_frontend import FakeEngine, StaticBackend, _expected, _serve_fakes, _stream
from vllm_kunserve.cli.serve import parse
from vllm_kunserve.cluster.fleet.fleet import Fleet
from vllm_kunserve.cluster.fleet.spec import EngineSpec
from vllm_kunserve.cluster.frontend.app import FrontEnd, build_app
from vllm_kunserve.config import ElasticConfig, KunServeConfigError, PlacementConfig, parse_elastic
from vllm_kunserve.policy.dispatch.base import InstanceLoad
from vllm_kunserve.policy.elastic import ElasticState, ElasticView, decide_scale, drain_moves, drain_target
from vllm_kunserve.policy.migration import RequestLoad

pytestmark = pytest.mark.unit

NOW = ElasticConfig(up_hold_s=0.0, down_hold_s=0.0, cooldown_s=0.0, forecast_horizon_s=0.0)


def view(*units, t=0.0, starting=0, draining=(), lo=1, hi=4, reach=None):
    us = tuple(InstanceLoad(i, used, queued, cap, requests=n, alive=i not in draining, group=g)
               for i, (used, queued, cap, n, g) in enumerate(units))
    r = sum(u.capacity_blocks for u in us if u.alive) if reach is None else reach
    return ElasticView(t, us, starting, tuple(draining), float(r), lo, hi)


def u(used, queued=0, cap=100, n=1, group=None):
    return (used, queued, cap, n, group)


# -- the decision ---------------------------------------------------------------------------------------
def test_an_engine_starts_only_once_the_demand_stayed_above_what_the_fleet_reaches_for_the_hold():
    cfg = ElasticConfig(up_ratio=0.9, up_hold_s=5.0, forecast_horizon_s=0.0)
    st = ElasticState()
    for t in (0.0, 2.0, 4.9):
        d, st = decide_scale(view(u(95, 10), t=t), cfg, st)
        assert d.action == "none", (t, d)
    d, st = decide_scale(view(u(95, 10), t=5.0), cfg, st)
    assert (d.action, d.count) == ("add", 1) and d.ratio_up == pytest.approx(1.05)
    # a dip below the threshold restarts the hold
    st = ElasticState()
    _, st = decide_scale(view(u(95, 10), t=0.0), cfg, st)
    _, st = decide_scale(view(u(50), t=3.0), cfg, st)
    d, st = decide_scale(view(u(95, 10), t=6.0), cfg, st)
    assert d.action == "none"


def test_the_reach_after_drops_is_the_capacity_a_stock_fleet_would_scale_at():
    # KV now 100, but a group of the engines would reach 160: demand 110 fits, nothing starts
    d, _ = decide_scale(view(u(60, 10), u(40), reach=160.0, hi=4), NOW)
    assert d.action == "none" and d.ratio_up == pytest.approx(110 / 160)
    d, _ = decide_scale(view(u(60, 10), u(40), reach=100.0, hi=4), NOW)
    assert d.action == "add"


def test_a_big_rise_starts_enough_engines_at_once_capped_by_the_maximum_and_counts_those_starting():
    d, _ = decide_scale(view(u(100, 200), hi=8), NOW)
    assert (d.action, d.count) == ("add", 3)       # 300 blocks at 0.9 x 100 a engine: 4 engines
    d, _ = decide_scale(view(u(100, 200), hi=3), NOW)
    assert d.count == 2
    d, _ = decide_scale(view(u(100, 200), starting=3, hi=8), NOW)
    assert d.action == "none"                      # the three starting reach 400 blocks
    d, _ = decide_scale(view(u(100, 200), starting=3, hi=4), NOW)
    assert d.action == "none"                      # and the maximum is met


def test_a_rising_trend_is_forecast_ahead_by_the_horizon():
    cfg = ElasticConfig(up_ratio=0.9, up_hold_s=0.0, forecast_horizon_s=10.0)
    st = ElasticState()
    for t, used in ((0.0, 40), (1.0, 45), (2.0, 50), (3.0, 55)):
        d, st = decide_scale(view(u(used), t=t), cfg, st)
    assert d.action == "add" and d.demand_blocks == pytest.approx(55 + 50)   # 5 blocks a second for 10 s
    st = ElasticState()
    for t, used in ((0.0, 85), (1.0, 80), (2.0, 75)):
        d, st = decide_scale(view(u(used), t=t), cfg, st)
    assert d.action == "none" and d.demand_blocks == pytest.approx(75)      # falling: no forecast


def test_a_drain_waits_for_its_hold_the_cooldown_and_nothing_starting_or_draining():
    cfg = ElasticConfig(down_ratio=0.6, down_hold_s=10.0, cooldown_s=30.0, forecast_horizon_s=0.0)
    st = ElasticState(last_change_s=0.0)
    low = (u(20), u(10), u(5))
    d, st = decide_scale(view(*low, t=1.0), cfg, st)
    assert d.action == "none" and d.ratio_down == pytest.approx(35 / 200)
    d, st = decide_scale(view(*low, t=20.0), cfg, st)
    assert d.action == "none"                                  # held 19 s, but 20 s since the last change
    d, st = decide_scale(view(*low, t=31.0), cfg, st)
    assert (d.action, d.instance) == ("drain", 2)              # the least demand
    assert decide_scale(view(*low, t=100.0), cfg, ElasticState(below_since=0.0), )[0].action == "drain"
    for kw in ({"starting": 1}, {"draining": (2,)}):
        assert decide_scale(view(*low, t=100.0, **kw), cfg, ElasticState(below_since=0.0))[0].action == "none", kw
    assert decide_scale(view(*low, t=100.0, lo=3), cfg, ElasticState(below_since=0.0))[0].action == "none"
    # the demand would not fit in one fewer at the ratio: no drain
    assert decide_scale(view(u(70), u(60), u(5), t=100.0), cfg, ElasticState(below_since=0.0))[0].action == "none"


def test_no_engine_is_drained_while_a_request_waits_anywhere():
    # 35 blocks would fit one engine fewer at 0.6, but 3 are queued: compute binds somewhere
    d, st = decide_scale(view(u(20, 3), u(10), u(2)), NOW)
    assert d.action == "none" and st.below_since is None
    d, _ = decide_scale(view(u(20), u(10), u(5)), NOW)
    assert d.action == "drain"


def test_before_any_engine_reported_its_kv_nothing_scales():
    d, st = decide_scale(view(u(0), u(0), reach=math.inf), NOW)
    assert d.action == "none" and st == ElasticState()


def test_below_the_minimum_an_engine_starts_whatever_the_demand():
    d, _ = decide_scale(view(u(0), lo=2, hi=4), NOW)
    assert (d.action, d.count) == ("add", 1)


def test_the_drained_engine_holds_the_least_and_is_in_no_group():
    units = view(u(5, group=0), u(5, group=0), u(9), u(9, n=3), u(12)).units
    assert drain_target(units) == 2                           # 9 blocks, 1 request; grouped ones never
    assert drain_target(view(u(5, group=0), u(5, group=0)).units) is None
    assert drain_target(view(u(3), u(3)).units) == 1          # a tie: the last started leaves first


def test_a_drain_moves_at_most_its_budget_off_the_draining_engine_onto_engines_with_room():
    units = view(u(60, cap=100), u(10, cap=100), u(85, cap=100), draining=(0,)).units
    reqs = [RequestLoad(f"r{k}", 0, 10, 150, 100 - k) for k in range(6)] + [RequestLoad("x", 2, 80, 1200, 50),
                                                                             RequestLoad("done", 0, 10, 150, 0)]
    orders = drain_moves(units, reqs, 0, budget=4, kv_bytes_per_block=1024, link_bytes_per_s=1e9)
    assert len(orders) == 4 and all(o.src == 0 for o in orders)
    assert {o.dst for o in orders} == {1}                      # engine 2 is past the watermark
    assert "done" not in {o.request_id for o in orders}      # about to finish: never moves
    assert drain_moves(units, reqs, 0, budget=0, kv_bytes_per_block=1024, link_bytes_per_s=1e9) == ()
    one = drain_moves(units, reqs, 0, budget=4, placement=PlacementConfig(max_migrations=2),
                      kv_bytes_per_block=1024, link_bytes_per_s=1e9)
    assert len(one) == 2                                       # the per-period budget binds too


# -- options --------------------------------------------------------------------------------------------
def test_elastic_options_are_checked_key_by_key():
    assert parse_elastic(None) == ElasticConfig()
    assert parse_elastic('{"up_ratio": 0.8}').up_ratio == 0.8
    for bad, says in (('{"up": 1}', "kunserve.elastic.up: unknown key"),
                      ('{"down_ratio": 1.5}', "kunserve.elastic.down_ratio=1.5: out of range"),
                      ('{"drain_migrations": 2.5}', "expected an integer"), ("{", "not valid JSON")):
        with pytest.raises(KunServeConfigError, match=says):
            parse_elastic(bad)


def serve_args(*flags):
    return argparse.Namespace(model="m", rest=list(flags))


@pytest.mark.parametrize("flags,says", [
    (("--instances", "2", "--max-instances", "1"), "need 1 <= min <= instances <= max"),
    (("--min-instances", "3", "--instances", "2", "--max-instances", "4"), "need 1 <= min <= instances <= max"),
    (("--elastic", "{}"), "the fleet is fixed"),
    (("--max-instances", "3", "--elastic", '{"up_hold": 1}'), "--elastic: kunserve.elastic.up_hold: unknown key"),
    (("--engine-url", "http://127.0.0.1:9", "--max-instances", "3"), "--max-instances with --engine-url"),
])
def test_bad_elastic_flags_are_one_line(flags, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        parse(serve_args(*flags))


def test_elastic_flags_parse_to_a_fleet_that_may_grow():
    opts, _ = parse(serve_args("--instances", "2", "--max-instances", "4", "--elastic", '{"up_hold_s": 1}'))
    assert (opts.min_instances, opts.instances, opts.max_instances) == (2, 2, 4)
    assert opts.elastic.up_hold_s == 1.0
    opts, _ = parse(serve_args("--instances", "2"))
    assert (opts.min_instances, opts.max_instances) == (2, 2)


# -- the front end ------------------------------------------------------------------------------------
async def elastic_stack(start: int, most: int, cfg: ElasticConfig, blocks: int = 8, delay_s: float = 0.01,
                        min_instances: int = 1):
    fakes = [FakeEngine(i, delay_s=delay_s) for i in range(most)]
    for f in fakes:
        f.blocks = blocks
    runners, urls = await _serve_fakes(fakes)
    fleet = Fleet(EngineSpec("m", startup_timeout_s=5), start, StaticBackend(urls, fakes), restart=False,
                  progress=lambda s: None, max_instances=most)
    for e in fleet.engines[:start]:
        fleet.backend.launch(fleet.spec, e.index, e)
        e.state = "ready"
    front = FrontEnd(fleet, dispatch="least-work", monitor_interval_s=0.05, elastic=cfg, min_instances=min_instances)
    await front.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(front)), base_url="http://front",
                               timeout=30)
    return fakes, front, client, runners


async def close_stack(front, client, runners):
    await client.aclose()
    await front.close()
    for r in runners:
        await r.cleanup()


def body(k: int, n: int) -> dict:
    return {"model": "m", "prompt": [k + 1, 2, 3], "max_tokens": n, "stream": True, "return_token_ids": True}


def test_the_fleet_grows_under_load_shrinks_after_and_every_stream_is_token_identical():
    """One engine of 8 blocks; 6 streams of 60 tokens need ~24: a second engine starts and takes the
    later requests; once they end, the engine that holds least is drained, stopped and parked, and the
    metrics and status say so."""
    async def go():
        cfg = ElasticConfig(up_ratio=0.9, up_hold_s=0.0, down_ratio=0.6, down_hold_s=0.2, cooldown_s=0.0,
                            forecast_horizon_s=0.0)
        fakes, front, client, runners = await elastic_stack(1, 2, cfg)
        try:
            first = [asyncio.ensure_future(_stream(client, body(k, 60))) for k in range(4)]
            for _ in range(200):   # the demand is over one engine's 8 blocks: engine 1 is added
                await asyncio.sleep(0.02)
                if front.fleet.engines[1].state == "ready":
                    break
            grew = front.fleet.engines[1].state
            later = [asyncio.ensure_future(_stream(client, body(k, 60))) for k in range(4, 6)]
            outs = await asyncio.gather(*first, *later)
            for _ in range(200):   # idle: one engine is drained and parked
                await asyncio.sleep(0.02)
                if "parked" in front.fleet.counts():
                    break
            metrics = (await client.get("/metrics")).text
            return grew, outs, front.status(), metrics, [len(f.requests) for f in fakes]
        finally:
            await close_stack(front, client, runners)
    grew, outs, st, metrics, served = asyncio.run(go())
    assert grew == "ready"
    for k, (ids, _, _) in enumerate(outs):
        assert ids == _expected([k + 1, 2, 3], 60), k
    assert served[1] >= 1                                    # the added engine took requests
    kinds = [e["event"] for e in st["events"]]
    assert "scale_up" in kinds and "scale_down" in kinds and "scale_down_done" in kinds
    assert [e["event"] for e in st["events"] if e.get("instance") is not None and e["event"] in
            ("adding", "added", "draining", "removed")][:2] == ["adding", "added"]
    assert st["elastic"]["engines"] == {"ready": 1, "parked": 1}
    assert 'kunserve:fleet_engines{state="held"} 1.0' in metrics
    assert 'kunserve:fleet_scale_events_total{action="add"} 1.0' in metrics


def test_a_drain_moves_its_budget_of_streams_the_rest_finish_in_place_and_none_is_lost():
    """Two engines, six long streams on each: a drain of engine 1 with a budget of two moves two of
    its streams to engine 0 (re-prefill between stock engines), lets the others finish there, then
    stops it; every stream is token-identical."""
    async def go():
        cfg = ElasticConfig(up_ratio=4.0, up_hold_s=3600.0, down_ratio=1.0, down_hold_s=0.0, cooldown_s=0.0,
                            forecast_horizon_s=0.0, drain_migrations=2)
        fakes, front, client, runners = await elastic_stack(2, 2, replace(cfg, down_hold_s=3600.0), blocks=1000,
                                                            delay_s=0.02)
        try:
            streams = [asyncio.ensure_future(_stream(client, body(k, 80))) for k in range(8)]
            while sum(len(f.requests) for f in fakes) < 8 or any(f.started is False for f in front.flights.values()):
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            front.elastic.cfg = cfg                                    # now: the fleet is far below one engine
            outs = await asyncio.gather(*streams)
            for _ in range(200):
                await asyncio.sleep(0.02)
                if "parked" in front.fleet.counts():
                    break
            return outs, front.status(), fakes
        finally:
            await close_stack(front, client, runners)
    outs, st, fakes = asyncio.run(go())
    for k, (ids, _, _) in enumerate(outs):
        assert ids == _expected([k + 1, 2, 3], 80), k
    drained = next(e["instance"] for e in st["events"] if e["event"] == "scale_down")
    moves = [e for e in st["events"] if e["event"] == "migration"]
    assert len(moves) == 2 and {(m["src"], m["dst"]) for m in moves} == {(drained, 1 - drained)}
    assert all(m["method"] == "reprefill" for m in moves)
    assert st["elastic"]["engines"] == {"ready": 1, "parked": 1}
    assert st["instances"][drained]["state"] == "parked"


# -- the simulator runs the same decision -------------------------------------------------------------
def test_the_simulator_and_the_front_end_scale_by_the_same_policy_code():
    from vllm_kunserve.cluster.control import elastic as fleet_side
    from vllm_kunserve.policy import elastic as policy
    from vllm_kunserve.sim.policies import elastic as sim_side

    for side in (fleet_side, sim_side):
        assert side.decide_scale is policy.decide_scale and side.drain_moves is policy.drain_moves


def _rise_and_fall(peak_rps: float, seconds: float = 240.0, seed: int = 0):
    import numpy as np

    from vllm_kunserve.sim.trace import TraceRequest

    rng, t, out = np.random.default_rng(seed), 0.0, []
    while True:
        t += rng.exponential(1 / (0.1 * peak_rps + 0.9 * peak_rps * np.sin(np.pi * t / seconds) ** 2))
        if t >= seconds:
            return out
        out.append(TraceRequest(len(out), t, int(rng.integers(200, 1500)), int(rng.integers(100, 400))))


def test_in_the_simulator_an_elastic_fleet_grows_with_the_rise_shrinks_with_the_fall_and_serves_all():
    from vllm_kunserve.sim.policies.elastic import ElasticPolicy
    from vllm_kunserve.sim.runner import build_config, simulate

    trace = _rise_and_fall(peak_rps=30.0)
    cfg = ElasticConfig(up_hold_s=2.0, down_hold_s=10.0, cooldown_s=10.0, forecast_horizon_s=10.0)
    runs = {}
    for name, (n, start) in {"min": (1, 1), "max": (3, 3), "elastic": (3, 1)}.items():
        pol = ElasticPolicy(start, 1 if name != "max" else 3, cfg, startup_s=10.0)
        res = simulate(build_config("llama2-7b", "h100", instances=n), pol, trace, keep_requests=False)
        runs[name] = (pol, res)
    for name, (pol, res) in runs.items():
        assert res["summary"]["completed"] == len(trace), name
    pol, res = runs["elastic"]
    kinds = [e["kind"] for e in res["events"]]
    ups = [e["t"] for e in res["events"] if e["kind"] == "scale_up"]
    downs = [e["t"] for e in res["events"] if e["kind"] == "scale_down_done"]
    assert ups and downs and min(ups) < 120.0 < max(downs), kinds   # grew on the rise, shrank on the fall
    assert max(h for _, h in pol.held) == 3 and pol.held[-1][1] < 3
    assert not [e for e in runs["max"][1]["events"] if e["kind"].startswith("scale")]   # a fixed fleet never scales
    inst = {k: p.instance_seconds for k, (p, _) in runs.items()}
    assert inst["min"] < inst["elastic"] < inst["max"]
    p99 = {k: r["summary"]["ttft_s"]["p99"] for k, (_, r) in runs.items()}
    assert p99["elastic"] < p99["min"]


# -- the fleet's own steps ------------------------------------------------------------------------------
class FlakyBackend:
    """A backend whose next launches fail as told; engines 'alive' as set."""

    name, probe_on_failure, probe_in_thread = "flaky", False, False

    def __init__(self):
        self.fail_launches, self.stopped, self.dead = 0, [], set()

    def launch(self, spec, index, engine):
        if self.fail_launches:
            self.fail_launches -= 1
            raise RuntimeError("no node took the engine")
        engine.url = f"http://e{index}"

    def wait_ready(self, engine, timeout_s):
        pass

    def alive(self, engine):
        return engine.index not in self.dead

    def kill(self, engine):
        self.dead.add(engine.index)

    def stop(self, engine):
        self.stopped.append(engine.index)

    def close(self):
        pass


def _wait(cond, s=5.0):
    import time

    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < s:
        time.sleep(0.01)
    return cond()


def test_an_engine_that_fails_to_start_goes_back_to_parked_and_a_draining_one_that_dies_is_not_restarted():
    be = FlakyBackend()
    fleet = Fleet(EngineSpec("m", startup_timeout_s=5), 1, be, progress=lambda s: None, max_instances=3,
                  check_interval_s=0.01)
    fleet.start()
    try:
        assert fleet.counts() == {"ready": 1, "parked": 2}
        be.fail_launches = 1
        e = fleet.add("test")
        assert e.index == 1 and _wait(lambda: fleet.engines[1].state == "parked")
        assert [x["event"] for x in fleet.events if x["instance"] == 1] == ["adding", "add_failed"]
        assert fleet.add("again").index == 1 and _wait(lambda: fleet.engines[1].state == "ready")
        assert fleet.drain(1, "test") and not fleet.drain(1, "twice") and not fleet.drain(2, "parked")
        fleet.kill(1)   # dies while draining: parked, not restarted
        assert _wait(lambda: fleet.engines[1].state == "parked")
        assert [x["event"] for x in fleet.events if x["instance"] == 1][-2:] == ["dead", "removed"]
        assert not fleet.retire(0) and fleet.counts() == {"ready": 1, "parked": 2}
    finally:
        fleet.stop()
    assert 2 not in be.stopped   # a parked engine is not stopped again
