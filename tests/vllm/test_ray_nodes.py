"""`kunserve serve --backend ray` across Ray nodes (issue 74, item 1), on a Ray cluster this test starts
on this machine with Ray's own test utility (``ray.cluster_utils.Cluster``: a head that takes no
engine and two worker nodes, each a raylet of its own with its own node id, one CPU and one
``engine_slot``). Two kunserve engines, each reserving an ``engine_slot``: one lands on each node;
each reports its node as its host, so an operator's group across the two is refused; a node removed
while requests stream (its raylet and workers gone, its engine stopping with its actor) loses no
request and changes no token, and the front end's event loop is never blocked meanwhile; and the
engine comes back on a node added in its place."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.vllm.cluster_client import complete, status
from tests.vllm.test_cluster_serve import ARGS, PROMPTS
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster
from vllm_kunserve.runtime.looplag import lag_cause

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

TOKEN = "ray-nodes-test"
SLOT = {"engine_slot": 1}
N_TOKENS = 200   # streams long enough to be cut: the lost node's engine stops a second or two after its actor


@pytest.fixture(scope="module")
def ray_nodes():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [c.add_node(num_cpus=1, resources=SLOT) for _ in range(2)]
    c.wait_for_nodes()
    try:
        yield c, workers
    finally:
        c.shutdown()


async def _op(s: aiohttp.ClientSession, url: str, name: str, body: dict) -> tuple[int, dict]:
    async with s.post(f"{url}/kunserve/ops/{name}", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        return r.status, await r.json()


def test_engines_spread_over_ray_nodes_group_only_within_one_and_survive_its_loss(ray_nodes, tiny_model,
                                                                               tmp_path):
    c, workers = ray_nodes
    log = tmp_path / "serve.log"
    srv = KunserveCluster(str(tiny_model), ARGS, {"drop": {"enable": False}}, log_path=log, instances=2,
                          startup_timeout_s=600, backend="ray",
                          extra=["--ray-address", c.address, "--ray-resources", json.dumps(SLOT), "--token", TOKEN,
                                 "--monitor-interval", "0.25", "--log-dir", str(tmp_path)])
    with srv:
        url = srv.url

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
                refs = dict(zip(PROMPTS, [a.token_ids for a in await asyncio.gather(
                    *(complete(s, url, p, max_tokens=N_TOKENS) for p in PROMPTS))]))
                before = await status(s, url)   # the monitor has polled the engines' states by now
                cross = await _op(s, url, "drop", {"instances": [0, 1]})
                by_node = {i["node"]: i["instance"] for i in before["instances"]}
                lost = workers[1]
                victim = by_node[lost.node_id]
                removed = {}

                async def remove_when_streaming():
                    t0 = time.monotonic()
                    while time.monotonic() - t0 < 120:
                        st = await status(s, url)
                        if any(r["instance"] == victim and r["generated"] >= 4 for r in st["requests"]):
                            t = time.monotonic()
                            await asyncio.to_thread(c.remove_node, lost, False)   # no graceful drain
                            removed["in_flight"] = [r for r in st["requests"] if r["instance"] == victim]
                            removed["s"] = time.monotonic() - t
                            return
                        await asyncio.sleep(0.01)

                jobs = [complete(s, url, PROMPTS[i % len(PROMPTS)], max_tokens=N_TOKENS, stream=i % 2 == 0)
                        for i in range(12)]
                answers, _ = await asyncio.gather(asyncio.gather(*jobs), remove_when_streaming())
                t0 = time.monotonic()
                while time.monotonic() - t0 < 60:   # the supervisor's probe finds the actor gone
                    after = await status(s, url)
                    if after["instances"][victim]["state"] != "ready":
                        break
                    await asyncio.sleep(0.5)
                return before, cross, refs, victim, removed, answers, after

        async def comes_back(victim: int):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
                t0 = time.monotonic()
                while time.monotonic() - t0 < 420:
                    back = await status(s, url)
                    if back["instances"][victim]["state"] == "ready" and back["instances"][victim]["restarts"] >= 1:
                        break
                    await asyncio.sleep(1)
                return back, await complete(s, url, PROMPTS[0], max_tokens=N_TOKENS)

        before, cross, refs, victim, removed, answers, after = asyncio.run(go())
        # a node takes the lost one's place (Ray starts a node from the main thread only): the fleet's
        # restart, waiting for a node with an engine_slot, places the engine there
        fresh = c.add_node(num_cpus=1, resources=SLOT)
        back, again = asyncio.run(comes_back(victim))

    nodes = [i["node"] for i in before["instances"]]
    hosts = [i["kv"]["engine"]["host"] for i in before["instances"]]
    assert set(nodes) == {w.node_id for w in workers}, nodes   # one engine a node, none on the head
    assert all(str(h).startswith("ray-node-") for h in hosts) and len(set(hosts)) == 2, before["instances"]
    code, body = cross
    assert code == 409 and "different hosts" in json.dumps(body), (code, body)
    assert removed.get("in_flight"), "no request was streaming on the lost node's engine"
    assert all(a.status == 200 and a.error is None for a in answers), [(a.status, a.error) for a in answers][:4]
    for i, a in enumerate(answers):
        assert a.token_ids == refs[PROMPTS[i % len(PROMPTS)]], f"request {i} differs after the node's loss"
    kinds = [(e["event"], e.get("instance")) for e in after["events"]]
    assert ("dead", victim) in kinds, kinds
    assert any(e["event"] == "failover" and e.get("src") == victim for e in after["events"]), after["events"]
    # no blocking call on the front end's event loop while the node went (Ray's liveness probe of up to
    # 10 s runs in a thread): no late wake-up of a second or more that the loop spent blocked
    longest = after["loop"]["longest"]
    print(f"front end's event loop, longest late wake-ups around the node's loss: {longest[:3]}")
    assert not [e for e in longest if e["late_s"] >= 1.0 and lag_cause(e) == "blocked"], longest[:5]
    inst = back["instances"][victim]
    assert inst["state"] == "ready" and inst["node"] == fresh.node_id, inst
    assert again.status == 200 and again.token_ids == refs[PROMPTS[0]]
