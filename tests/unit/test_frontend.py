"""The front end's relay against fake OpenAI engines (aiohttp servers that stream like vLLM):
migration and failover never lose or repeat a token, chat chunks are rewritten, bad input is 400,
metrics merge per instance. The real-engine versions are tests/vllm/test_cluster_serve.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from aiohttp import web

from vllm_kunserve.cluster.fleet.fleet import Fleet
from vllm_kunserve.cluster.fleet.spec import Engine, EngineSpec
from vllm_kunserve.cluster.frontend.app import FrontEnd, build_app, relabel_metrics
from vllm_kunserve.cluster.control.monitor import FlightBook, EngineReport, instance_loads, parse_vllm_metrics

pytestmark = pytest.mark.unit


def next_token(ids: list[int]) -> int:
    """The fake model: greedy, a pure function of the whole sequence (so a continuation from
    prompt + generated ids reproduces the unmigrated output exactly)."""
    return (sum(ids) * 31 + len(ids) * 7) % 997 + 3


class FakeEngine:
    """Streams completions and chats like vLLM with return_token_ids; can die after k tokens."""

    def __init__(self, name: int, delay_s: float = 0.002):
        self.name, self.delay_s = name, delay_s
        self.die_after: int | None = None
        self.blocks = 100   # KV blocks of 16 tokens it reports
        self.requests: list[dict] = []
        self.peers: set = set()   # the front end's connections (address, port) that sent requests
        self.alive = True
        self.status: int | None = None   # answer every generate with this HTTP status (an engine error)
        self.stream_status: int | None = None   # a streamed answer's first event: an error with this code
        self.hang_s = 0.0                # wait this long before answering (a hung engine)
        self.vocab: int | None = None    # a streamed prompt id at or above it: vLLM's in-stream 400
        self.one_write = False           # a streamed answer's events all in one write (read late)
        self.api_key: str | None = None  # as vllm serve --api-key: every /v1 route needs it
        self.keys_seen: list[str] = []   # the Authorization headers /v1 requests came with

    def app(self) -> web.Application:
        @web.middleware
        async def auth(request, handler):
            if request.path.startswith("/v1"):
                self.keys_seen.append(request.headers.get("Authorization", ""))
                if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                    return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[auth])
        app.router.add_post("/v1/completions", lambda r: self.generate(r, chat=False))
        app.router.add_post("/v1/chat/completions", lambda r: self.generate(r, chat=True))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", lambda r: web.Response(status=200 if self.alive else 503))
        return app

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]})

    async def metrics(self, request):
        return web.Response(text=f'# HELP vllm:num_requests_running r\n# TYPE vllm:num_requests_running gauge\n'
                                 f'vllm:num_requests_running{{model_name="m"}} 0.0\n'
                                 f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{self.blocks}"}} 1.0\n')

    async def generate(self, request, chat: bool):
        body = await request.json()
        self.requests.append(body)
        self.peers.add(request.transport.get_extra_info("peername"))
        if self.hang_s:
            await asyncio.sleep(self.hang_s)
        if self.status is not None:
            return web.json_response({"error": {"message": "fake engine error", "type": "InternalServerError",
                                                "code": self.status}}, status=self.status)
        try:   # what this fake cannot read, vLLM refuses with a 400 too (its request models)
            if chat:
                prompt = [ord(c) % 50 for c in str(body["messages"][0]["content"])]
            else:
                p = body["prompt"]
                prompt = [ord(c) % 50 for c in p] if isinstance(p, str) else [int(x) for x in p]
            n = body.get("max_tokens") or 16
            if not prompt or not isinstance(n, int):
                raise ValueError("empty prompt or max_tokens not an integer")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            return web.json_response({"error": {"message": f"fake engine: {e!r}", "type": "BadRequestError",
                                                "code": 400}}, status=400)
        ids = list(prompt)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-e{self.name}-{len(self.requests)}"
        if not body.get("stream"):
            out = []
            for _ in range(n):
                out.append(next_token(ids + out))
            ch = {"index": 0, "finish_reason": "length", "token_ids": out}
            ch.update({"message": {"role": "assistant", "content": "".join(f"<{t}>" for t in out)}} if chat
                      else {"text": "".join(f"<{t}>" for t in out)})
            return web.json_response({"id": rid, "choices": [ch], "usage": {"prompt_tokens": len(prompt)}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        held: list[bytes] = []
        if self.stream_status is not None:   # e.g. vLLM's 503 once the stream's head went out
            err = {"message": "fake engine busy", "type": "ServiceUnavailableError", "param": None,
                   "code": self.stream_status}
            await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        if self.vocab is not None and max(prompt) >= self.vocab:   # vLLM checks ids after the stream began
            err = {"message": f"Token id {max(prompt)} is out of vocabulary", "type": "BadRequestError",
                   "param": None, "code": 400}
            await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        for k in range(n):
            if self.die_after is not None and k >= self.die_after:
                request.transport.close()   # the engine dies mid-stream
                return resp
            t = next_token(ids)
            ids.append(t)
            fin = "length" if k == n - 1 else None
            ch = {"index": 0, "finish_reason": fin, "token_ids": [t]}
            if chat:
                ch["delta"] = {"content": f"<{t}>"}
            else:
                ch["text"] = f"<{t}>"
                ch["prompt_token_ids"] = prompt if k == 0 else None
            ev = {"id": rid, "object": "x", "created": 1, "model": "m", "choices": [ch]}
            if chat and k == 0:
                ev["prompt_token_ids"] = prompt
            if self.one_write:
                held.append(b"data: " + json.dumps(ev).encode() + b"\n\n")
                continue
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await asyncio.sleep(self.delay_s)
        await resp.write(b"".join(held) + b"data: [DONE]\n\n")
        await asyncio.sleep(self.delay_s)   # the body's end reaches the front end after [DONE], as from vLLM
        return resp


class StaticBackend:
    """Fleet backend over already-running fake engines."""

    name = "static"
    probe_on_failure = True
    probe_in_thread = False

    def __init__(self, urls, engines):
        self.urls, self.fakes = urls, engines

    def launch(self, spec, index, engine: Engine):
        engine.url = self.urls[index]

    def wait_ready(self, engine, timeout_s):
        pass

    def alive(self, engine):
        return self.fakes[engine.index].alive

    def kill(self, engine):
        self.fakes[engine.index].alive = False

    def stop(self, engine):
        pass

    def close(self):
        pass


async def _serve_fakes(fakes) -> tuple[list, list[str]]:
    """Each fake engine on a port of its own: (their runners, their URLs)."""
    runners, urls = [], []
    for f in fakes:
        runner = web.AppRunner(f.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    return runners, urls


async def _stack(n=2, dispatch="round-robin", planner=None, blocks=None, tokenizer=None, api_keys=(),
                 engine_api_key="", **front_kw):
    fakes = [FakeEngine(i) for i in range(n)]
    for f, b in zip(fakes, blocks or ()):
        f.blocks = b
    for f in fakes:
        f.api_key = engine_api_key or None
    runners, urls = await _serve_fakes(fakes)
    fleet = Fleet(EngineSpec("m", startup_timeout_s=5), n, StaticBackend(urls, fakes), restart=False,
                  progress=lambda s: None)
    for e in fleet.engines:
        fleet.backend.launch(fleet.spec, e.index, e)
        e.state = "ready"
    front = FrontEnd(fleet, dispatch=dispatch, monitor_interval_s=0.05, plan_migrations=planner, tokenizer=tokenizer,
                     api_keys=api_keys, engine_api_key=engine_api_key, **front_kw)
    await front.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(front)), base_url="http://front")
    return fakes, front, client, runners


@contextlib.asynccontextmanager
async def _served(front):
    """The front end on a real uvicorn server (httpx's ASGI transport buffers whole responses, so
    anything that must happen mid-stream needs a socket)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(front), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            yield c
    finally:
        server.should_exit = True
        await task


async def _teardown(front, client, runners):
    await client.aclose()
    await front.close()
    for r in runners:
        await r.cleanup()


async def _stream(client, body, path="/v1/completions", on_event=None):
    ids, texts, events = [], [], []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            for ch in ev.get("choices") or []:
                ids += ch.get("token_ids") or []
                texts.append(ch.get("text") if "text" in ch else ch["delta"].get("content", ""))
            if on_event is not None:
                await on_event(ev, ids)
    return ids, "".join(t or "" for t in texts), events


def _expected(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(next_token(ids))
    return ids[len(prompt):]


@pytest.mark.parametrize("chat", [False, True])
def test_migration_mid_stream_loses_and_repeats_nothing(chat):
    async def go():
        fakes, front, client, runners = await _stack()
        try:
            body = {"model": "m", "max_tokens": 40, "stream": True, "return_token_ids": True, "request_id": "r1"}
            if chat:
                body["messages"] = [{"role": "user", "content": "hello"}]
                path = "/v1/chat/completions"
            else:
                body["prompt"] = [5, 6, 7]
                path = "/v1/completions"
            order = asyncio.ensure_future(client.post("/kunserve/ops/migrate", json={
                "request_id": "r1", "method": "reprefill", "at_token": 11, "wait_s": 5}))
            await asyncio.sleep(0.02)
            ids, text, events = await _stream(client, body, path)
            res = (await order).json()
            return fakes, ids, text, events, res, front.status()
        finally:
            await _teardown(front, client, runners)
    fakes, ids, text, events, res, st = asyncio.run(go())
    prompt = [ord(c) % 50 for c in "hello"] if chat else [5, 6, 7]
    assert ids == _expected(prompt, 40)
    assert text == "".join(f"<{t}>" for t in ids)
    assert {ev["id"] for ev in events} == {events[0]["id"]}           # one id for the client
    if chat:
        assert all(ev["object"] == "chat.completion.chunk" for ev in events[11:])
    assert "to" in res, res
    dst = fakes[res["to"]]
    cont = dst.requests[-1]
    assert cont["prompt"] == prompt + ids[:11] and cont["max_tokens"] == 29   # re-prefill of what was sent
    assert [e for e in st["events"] if e["event"] == "migration"][0]["dst"] == res["to"]


def test_engine_dying_mid_stream_fails_over_without_a_gap():
    async def go():
        fakes, front, client, runners = await _stack(dispatch="round-robin")
        try:
            fakes[0].die_after = 7
            ids, _, _ = await _stream(client, {"prompt": [1, 2], "max_tokens": 30, "stream": True})
            st = front.status()
            return ids, st
        finally:
            await _teardown(front, client, runners)
    ids, st = asyncio.run(go())
    assert ids == []  # the client did not ask for token ids: they are stripped
    assert any(e["event"] == "failover" for e in st["events"])


def test_a_stream_that_runs_out_of_engines_ends_in_an_error_and_counts_as_failed():
    """Every engine dies two tokens into every stream: the relay hops until its limit, then ends
    the client's stream with an error event; the front end counts the request failed, not ok
    (the stream reached its end, the answer did not)."""
    async def go():
        fakes, front, client, runners = await _stack(dispatch="round-robin")
        try:
            for f in fakes:
                f.die_after = 2
            ids, _, events = await _stream(client, {"prompt": [1, 2], "max_tokens": 40, "stream": True,
                                                    "return_token_ids": True})
            counts = {o: front.m_requests.labels("completion", o)._value.get() for o in ("ok", "failed")}
            return ids, events, counts
        finally:
            await _teardown(front, client, runners)
    ids, events, counts = asyncio.run(go())
    assert 0 < len(ids) < 40 and ids == _expected([1, 2], len(ids))   # what was sent is right, and short
    assert events[-1]["error"]["code"] == 503
    assert counts == {"ok": 0.0, "failed": 1.0}


def test_finished_streams_give_their_engine_connection_back_to_the_pool():
    """A stream relayed to its ``[DONE]`` leaves its connection to the engine open for later
    requests (closed, every request would open a connection on the path to its first token)."""
    async def go():
        fakes, front, client, runners = await _stack(n=1)
        try:
            got = [await _stream(client, {"prompt": [1, k], "max_tokens": 5, "stream": True,
                                          "return_token_ids": True}) for k in range(6)]
            return fakes, got
        finally:
            await _teardown(front, client, runners)
    fakes, got = asyncio.run(go())
    assert [ids for ids, _, _ in got] == [_expected([1, k], 5) for k in range(6)]
    # the end of a finished stream is read in the background (the client's [DONE] does not wait for
    # it), so the next request may find that connection still busy and open one more, never one each
    assert len(fakes[0].requests) == 6 and len(fakes[0].peers) <= 2


def test_kill_answers_with_the_requests_it_interrupts():
    async def go():
        fakes, front, client, runners = await _stack(dispatch="round-robin")
        for f in fakes:
            f.delay_s = 0.02
        try:
            task = asyncio.create_task(_stream(client, {"prompt": [1, 2], "max_tokens": 40, "stream": True}))
            while not any(len(f.generated) >= 3 for f in front.flights.values()):
                await asyncio.sleep(0.005)
            flight = next(iter(front.flights.values()))
            where = flight.instance
            gone = await client.post("/kunserve/ops/kill", json={"request_id": "no-such-request"})
            assert gone.status_code == 404 and "no-such-request" in gone.text
            bad = await client.post("/kunserve/ops/kill", json={"request_id": None})
            assert bad.status_code == 400 and "non-empty string" in bad.text
            r = await client.post("/kunserve/ops/kill", json={"request_id": flight.visible_id})  # its engine
            await task
            return where, r.status_code, r.json(), front.status()
        finally:
            await _teardown(front, client, runners)
    where, code, body, st = asyncio.run(go())
    assert code == 200 and body["killed"] == where
    (hit,) = body["in_flight"]   # the one stream, at least 3 tokens sent when the kill came
    assert hit["movable"] and 3 <= hit["generated"] < 40
    assert [e["in_flight"] for e in st["events"] if e["event"] == "kill"] == [1]
    # the collector's pauses of the front end's loop are timed; only `kunserve serve` freezes its heap
    assert st["gc"]["frozen_objects"] == 0 and len(st["gc"]["collections"]) == 3
    # and its loop's wake-ups are watched while it serves (a 10 ms timer: a streamed run ticks)
    assert st["loop"]["ticks"] > 0 and st["loop"]["late"] >= len(st["loop"]["longest"])


def test_engine_dying_mid_stream_output_equals_unbroken_run():
    async def go():
        fakes, front, client, runners = await _stack(dispatch="round-robin")
        try:
            fakes[0].die_after = 7
            fakes[1].die_after = None
            body = {"prompt": [1, 2], "max_tokens": 30, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}
            ids, _, events = await _stream(client, body)
            return ids, events, fakes
        finally:
            await _teardown(front, client, runners)
    ids, events, fakes = asyncio.run(go())
    assert ids == _expected([1, 2], 30)
    assert fakes[1].requests[-1]["prompt"] == [1, 2] + ids[:7]


def test_bad_input_never_reaches_an_engine():
    async def go():
        fakes, front, client, runners = await _stack()
        try:
            out = []
            for raw in (b"{", b'"x"', b'{"prompt": "a", "max_tokens": 0}', b'{"prompt": "a", "max_tokens": 10000}',
                        b'{"prompt": "a", "model": "other"}', b'{"prompt": "a", "n": "two"}', b'{"max_tokens": 3}',
                        b'{"prompt": [1, 2], "max_tokens": 3.5}',
                        b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}", b"[" * 10000 + b"]" * 10000,
                        b'{"prompt": "\\udc80", "max_tokens": 3}', b'{"prompt": ["ok", "\\ud800x"], "max_tokens": 3}'):
                r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
                out.append((r.status_code, r.json()["error"]))
            r = await client.post("/v1/chat/completions", json={"messages": []})
            out.append((r.status_code, r.json()["error"]))
            return out, sum(len(f.requests) for f in fakes)
        finally:
            await _teardown(front, client, runners)
    out, reached = asyncio.run(go())
    assert reached == 0
    assert all(code == 400 and err["code"] == 400 and err["message"] for code, err in out), out


class VocabTokenizer:
    """A tokenizer of ``size`` ids with no model config beside it (what the front end reads of one)."""

    name_or_path = "/nonexistent/model"

    def __init__(self, size: int):
        self.vocab_size = size

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.vocab_size)}

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % self.vocab_size for c in text]}


def test_a_prompt_token_id_outside_the_vocabulary_is_a_400_that_reaches_no_engine():
    """vLLM finds such an id only after a streamed answer began; the front end, knowing the
    tokenizer, refuses it before dispatch, naming the id and the bound."""
    async def go():
        fakes, front, client, runners = await _stack(tokenizer=VocabTokenizer(1000))
        try:
            out = []
            for prompt in ([1, 5000], [[1, 2], [3, 1000]]):
                r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "stream": True})
                out.append((r.status_code, r.json()["error"]))
            reached = sum(len(f.requests) for f in fakes)
            ok = await client.post("/v1/completions", json={"prompt": [1, 999], "max_tokens": 3})
            return out, reached, ok.status_code
        finally:
            await _teardown(front, client, runners)
    out, reached, ok = asyncio.run(go())
    assert [c for c, _ in out] == [400, 400] and reached == 0
    assert "5000" in out[0][1]["message"] and "0..999" in out[0][1]["message"] and out[0][1]["param"] == "prompt"
    assert "1000" in out[1][1]["message"]
    assert ok == 200


def test_a_client_error_inside_an_engines_stream_is_passed_on_not_failed_over():
    """An engine that refuses a streamed request inside its stream (vLLM's way for an id out of the
    vocabulary, where the front end has no tokenizer to check it): the client gets the engine's own
    400 error event; no other engine is tried, no breaker counts a failure, and the request is
    counted an engine error, not a lost one."""
    async def go():
        fakes, front, client, runners = await _stack()
        try:
            for f in fakes:
                f.vocab = 1000
            answers = [await _stream(client, {"prompt": [1, 5000], "max_tokens": 5, "stream": True})
                       for _ in range(4)]
            good = await _stream(client, {"prompt": [1, 2], "max_tokens": 5, "stream": True, "return_token_ids": True})
            counts = {o: front.m_requests.labels("completion", o)._value.get() for o in ("ok", "failed", "engine_error")}
            return answers, good, [len(f.requests) for f in fakes], counts, list(front.events)
        finally:
            await _teardown(front, client, runners)
    answers, good, reached, counts, events = asyncio.run(go())
    for ids, _, evs in answers:
        assert ids == [] and len(evs) == 1 and evs[0]["error"]["code"] == 400, evs
        assert "out of vocabulary" in evs[0]["error"]["message"]
    assert sum(reached) == 5 and reached == [3, 2]    # round-robin: each request went to one engine only
    assert good[0] == _expected([1, 2], 5)
    assert counts == {"ok": 1.0, "failed": 0.0, "engine_error": 4.0}
    assert not [e for e in events if e["event"] in ("failover", "breaker_open", "retry")], events


def test_status_counts_the_engine_stream_reads_and_the_events_they_held():
    """``relay_reads``: every read of an engine's stream and its events. A fake engine that writes
    its tokens 20 ms apart is read one event at a time (the front end keeps up); one that writes a
    whole answer in one write is read in one or two reads."""
    async def go():
        fakes, front, client, runners = await _stack()
        try:
            out = []
            for late in (False, True):
                for f in fakes:
                    f.delay_s, f.one_write = 0.02, late
                before = (await client.get("/kunserve/status")).json()["relay_reads"]
                ids, _, _ = await _stream(client, {"prompt": [1, 2], "max_tokens": 12, "stream": True,
                                                   "return_token_ids": True})
                after = (await client.get("/kunserve/status")).json()["relay_reads"]
                out.append((len(ids), after["reads"] - before["reads"], after["events"] - before["events"]))
            return out
        finally:
            await _teardown(front, client, runners)
    (n1, reads1, events1), (n2, reads2, events2) = asyncio.run(go())
    assert n1 == n2 == 12 and events1 == events2 == 13      # one event per token, and [DONE]
    assert reads1 >= 10 and reads2 <= 2, (reads1, reads2)


def test_ops_need_the_token_and_check_their_parameters():
    async def go():
        fakes, front, client, runners = await _stack()
        front.token = "s3cret"
        try:
            a = await client.post("/kunserve/ops/kill", json={"instance": 0})
            b = await client.post("/kunserve/ops/kill", json={"instance": 9}, headers={"authorization": "Bearer s3cret"})
            c = await client.post("/kunserve/ops/migrate", json={"request_id": "none"},
                                  headers={"authorization": "Bearer s3cret"})
            d = await client.post("/kunserve/ops/explode", json={}, headers={"authorization": "Bearer s3cret"})
            return a.status_code, b.status_code, c.status_code, d.status_code, fakes[0].alive
        finally:
            await _teardown(front, client, runners)
    assert asyncio.run(go()) == (401, 400, 404, 404, True)


def test_relabel_metrics_keeps_families_together():
    a = "# HELP x_total c\n# TYPE x_total counter\nx_total{a=\"1\"} 3.0\ny 1\n"
    out = relabel_metrics({0: a, 1: a})
    lines = out.splitlines()
    assert lines.count("# TYPE x_total counter") == 1
    i0, i1 = lines.index('x_total{instance="0",a="1"} 3.0'), lines.index('x_total{instance="1",a="1"} 3.0')
    assert abs(i0 - i1) == 1   # samples of one family adjacent
    assert 'y{instance="1"} 1' in lines


def test_parse_metrics_and_loads_prefer_the_exact_book():
    m = parse_vllm_metrics('vllm:cache_config_info{block_size="32",num_gpu_blocks="88"} 1.0\n'
                           'vllm:kv_cache_usage_perc{m="x"} 0.5\nvllm:num_requests_waiting{m="x"} 2\n')
    assert m["num_gpu_blocks"] == 88 and m["block_size"] == 32 and m["waiting"] == 2 and m["kv_usage"] == 0.5
    book = FlightBook()
    book.put(0, "a", 64, 10, True)     # 74 tokens -> 3 blocks of 32
    book.put(0, "b", 40, 0, False)     # queued: 2 blocks
    book.put(1, "a", 64, 11, True)     # "a" moved to instance 1
    engines = [Engine(0, state="ready"), Engine(1, state="dead")]
    reps = {0: EngineReport(0, ok=True, capacity_blocks=88, block_size=32, used_blocks=1)}
    u0, u1 = instance_loads(engines, reps, book)
    # the engine reports 1 used block the book does not know (another client): the larger wins
    assert (u0.used_blocks, u0.queued_blocks, u0.capacity_blocks, u0.requests) == (1, 2, 88, 1)
    assert u0.queued_prefill_tokens == 40
    assert u1.alive is False and u1.requests == 1


def test_client_disconnect_aborts_the_engine_request():
    """Through a real uvicorn server: a client that goes away mid-stream closes the front end's
    upstream connection (vLLM aborts a request whose connection closes)."""
    import uvicorn

    async def go():
        fakes, front, client, runners = await _stack()
        await client.aclose()
        for f in fakes:
            f.delay_s = 0.05
        cancelled = asyncio.Event()
        orig = fakes[0].generate

        async def watched(request, chat):
            try:
                return await orig(request, chat)
            except (ConnectionResetError, asyncio.CancelledError):
                cancelled.set()
                raise
        fakes[0].generate = watched
        fakes[1].generate = watched
        cfg = uvicorn.Config(build_app(front), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        server = uvicorn.Server(cfg)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                async with c.stream("POST", "/v1/completions",
                                    json={"prompt": [1], "max_tokens": 200, "stream": True}) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n == 3:
                            break
            await asyncio.wait_for(cancelled.wait(), 5)
            for _ in range(100):
                if not front.flights:
                    break
                await asyncio.sleep(0.02)
            return len(front.flights), front.m_requests.labels("completion", "aborted")._value.get()
        finally:
            server.should_exit = True
            await task
            await front.close()
            for r in runners:
                await r.cleanup()
    assert asyncio.run(go()) == (0, 1.0)


def test_mell_relieves_an_overfull_engine_by_migrating_a_running_request():
    """least-load places a 1500-token request on engine 0 (100 blocks of 16; engine 1 has 400);
    switched to mell at run time, the monitor's next period finds engine 0 over the watermark and
    moves the request to engine 1, which continues it from prompt + sent tokens."""
    from vllm_kunserve.cluster.control.migration import placement_planner
    from vllm_kunserve.config import PlacementConfig

    async def go():
        fakes, front, client, runners = await _stack(dispatch="least-load", blocks=(100, 400),
                                                     planner=placement_planner(PlacementConfig()))
        for f in fakes:
            f.delay_s = 0.02
        await asyncio.sleep(0.2)   # a monitor period: capacities known
        switched = {}

        async def on_event(ev, ids):
            if len(ids) == 5 and not switched:
                switched["r"] = (await client.post("/kunserve/ops/dispatch", json={"mode": "mell"})).json()
                switched["bad"] = (await client.post("/kunserve/ops/dispatch", json={"mode": "fastest"})).status_code
        try:
            async with _served(front) as live:
                client = live
                prompt = [i % 50 for i in range(1500)]
                ids, _, _ = await _stream(live, {"prompt": prompt, "max_tokens": 60, "stream": True,
                                                 "return_token_ids": True}, on_event=on_event)
            return switched, prompt, ids, fakes, front.status()
        finally:
            await _teardown(front, client, runners)
    sw, prompt, ids, fakes, st = asyncio.run(go())
    assert sw["r"] == {"dispatch": "mell", "was": "least-load"} and sw["bad"] == 400
    assert ids == _expected(prompt, 60)
    assert len(fakes[0].requests) == 1
    mig = [e for e in st["events"] if e["event"] == "migration"]
    assert len(mig) == 1 and mig[0]["src"] == 0 and mig[0]["dst"] == 1 and mig[0]["method"] == "reprefill"
    cont = fakes[1].requests[-1]
    k = len(cont["prompt"]) - len(prompt)
    assert 5 <= k < 60 and cont["prompt"] == prompt + ids[:k] and cont["max_tokens"] == 60 - k


def test_chunk_codec_round_trips_what_the_json_module_reads():
    """The relay's per-chunk JSON (msgspec): what it writes is standard JSON the client's json module
    reads back unchanged (non-ASCII text as UTF-8, nulls, floats, nested ids), and a malformed
    payload is a ValueError, which the relay treats as a broken stream."""
    from vllm_kunserve.cluster.frontend.relay import _decode, _sse

    ev = {"id": "cmpl-1", "created": 17, "choices": [{"index": 0, "text": " héllo ✓", "token_ids": [5, 6],
                                                       "logprobs": None, "finish_reason": None}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, "x": 0.25}
    out = _sse(ev)
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")
    assert json.loads(out[6:-2].decode("utf-8")) == ev
    assert _decode(json.dumps(ev).encode()) == ev
    with pytest.raises(ValueError):
        _decode(b'{"id": ')


def test_ttft_stages_split_a_streamed_requests_wait_where_it_went():
    """An engine that takes 0.15 s before its response: two streamed requests put that time in the
    histogram's engine stage, each stage counted once per streamed request, the front end's own
    stages small; a non-streamed request adds nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    async def go():
        fakes, front, client, runners = await _stack()
        try:
            for f in fakes:
                f.hang_s = 0.15
            async with _served(front) as c:
                for p in ([1, 2], [3, 4]):
                    await _stream(c, {"prompt": p, "max_tokens": 4, "stream": True})
                r = await c.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
                assert r.status_code == 200
                return (await c.get("/metrics")).text
        finally:
            await _teardown(front, client, runners)
    text = asyncio.run(go())
    stages = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "kunserve:frontend_ttft_stage_seconds":
            for s in fam.samples:
                if s.name.endswith(("_count", "_sum")):
                    stages.setdefault(s.labels["stage"], {})[s.name.rsplit("_", 1)[1]] = s.value
    assert set(stages) == {"admit", "engine", "relay"}
    assert all(v["count"] == 2 for v in stages.values())
    assert stages["engine"]["sum"] >= 0.3
    assert stages["admit"]["sum"] < 0.15 and stages["relay"]["sum"] < 0.15


def test_api_key_guards_every_v1_route_as_vllm_serve_does_and_reaches_the_engines():
    """vLLM's --api-key on the front end: /v1 routes (the relayed hot paths too) answer 401 without
    one of the keys or with a wrong one, and serve with any of them; /health, /metrics and
    /kunserve/status need none; the front end calls its engines, which ask their own key, with it.
    Served by uvicorn, as `kunserve serve` runs it (it must take the guarded app as ASGI 3)."""
    body = {"prompt": [1, 2, 3], "max_tokens": 3}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    keys = {"missing": {}, "wrong": {"Authorization": "Bearer nope"}, "not bearer": {"Authorization": "k1"},
            "k1": {"Authorization": "Bearer k1"}, "k2": {"Authorization": "Bearer k2"}}

    async def requests(c) -> dict:
        out = {name: [(await c.post("/v1/completions", json=body, headers=h)).status_code,
                      (await c.post("/v1/chat/completions", json=chat, headers=h)).status_code,
                      (await c.get("/v1/models", headers=h)).status_code] for name, h in keys.items()}
        out["stream"] = (await c.post("/v1/completions", json={**body, "stream": True}, headers=keys["k1"])).status_code
        out["open"] = [(await c.get(p)).status_code for p in ("/health", "/metrics", "/kunserve/status")]
        out["refusal"] = (await c.get("/v1/models")).json()
        return out

    async def go():
        fakes, front, plain, runners = await _stack(api_keys=("k1", "k2"), engine_api_key="ek")
        try:
            async with _served(front) as client:
                return await requests(client), fakes
        finally:
            await _teardown(front, plain, runners)
    out, fakes = asyncio.run(go())
    assert out["missing"] == out["wrong"] == out["not bearer"] == [401, 401, 401]
    assert out["k1"] == out["k2"] == [200, 200, 200] and out["stream"] == 200
    assert out["open"] == [200, 200, 200] and out["refusal"] == {"error": "Unauthorized"}
    seen = [k for f in fakes for k in f.keys_seen]
    assert seen and set(seen) == {"Bearer ek"}   # the engines' key on every call, never a client's
    assert sum(len(f.requests) for f in fakes) == 5   # refused requests reached no engine


def test_memory_admission_queues_by_priority_and_answers_429_with_retry_after_past_its_bound():
    """--admission memory over fake engines of 10 blocks of 16 tokens each (20 in the fleet): a request
    of 16 prompt tokens and 100 outputs peaks at 8 blocks, so two run and a third waits; the queue holds
    one, the next gets 429 with Retry-After and reaches no engine; a waiter goes in when a request ends;
    a priority that is no integer is a 400."""
    body = {"prompt": list(range(1, 17)), "max_tokens": 100, "stream": True}

    async def go():
        fakes, front, client, runners = await _stack(blocks=(10, 10), admission="memory", admission_queue=1,
                                                     admission_wait_s=30.0)
        for f in fakes:
            f.delay_s = 0.01   # 100 tokens: about a second a request
        try:
            for _ in range(100):   # the monitor has polled both engines' KV
                if sum(r.capacity_blocks for r in front.monitor.reports.values() if r.ok) == 20:
                    break
                await asyncio.sleep(0.02)
            async with _served(front) as c:
                async def one(headers=None):
                    async with c.stream("POST", "/v1/completions", json=body, headers=headers or {}) as r:
                        await r.aread()
                        return r.status_code, r.headers.get("retry-after"), time.monotonic()
                first = [asyncio.create_task(one()) for _ in range(2)]
                await asyncio.sleep(0.2)
                waiter = asyncio.create_task(one({"x-kunserve-priority": "1"}))
                await asyncio.sleep(0.2)
                queued = front.status()["admission"]["queued"]
                shed = await one()
                bad = (await c.post("/v1/completions", json=body, headers={"x-kunserve-priority": "soon"})).status_code
                done = await asyncio.gather(*first)
                w = await waiter
                return queued, shed, bad, done, w, front.status()["admission"], sum(len(f.requests) for f in fakes)
        finally:
            await _teardown(front, client, runners)
    queued, shed, bad, done, w, adm, reached = asyncio.run(go())
    assert queued == 1
    assert shed[0] == 429 and int(shed[1]) >= 1
    assert bad == 400
    assert [d[0] for d in done] == [200, 200] and w[0] == 200
    assert w[2] >= min(d[2] for d in done)   # the waiter finished after a running request freed its KV
    assert adm["shed"] == 1 and adm["queued"] == 0 and adm["admitted"] == 0
    assert reached == 3   # the shed and the bad request reached no engine


def test_a_client_that_disconnects_while_queued_for_admission_leaves_the_queue():
    """--admission memory, one request running that fills the fleet's KV: a second waits in the queue;
    its client hangs up: the queue is empty again at once (not after --admission-wait), the request
    counts as aborted and never reaches an engine."""
    body = {"prompt": list(range(1, 17)), "max_tokens": 300, "stream": True}

    async def go():
        fakes, front, client, runners = await _stack(blocks=(10, 10), admission="memory", admission_queue=4,
                                                     admission_wait_s=60.0)
        for f in fakes:
            f.delay_s = 0.01
        try:
            for _ in range(100):
                if sum(r.capacity_blocks for r in front.monitor.reports.values() if r.ok) == 20:
                    break
                await asyncio.sleep(0.02)
            async with _served(front) as c:
                async def one():
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        await r.aread()
                        return r.status_code
                running = asyncio.create_task(one())   # 20 blocks at its peak: the fleet's all
                await asyncio.sleep(0.2)
                queued = asyncio.create_task(one())
                for _ in range(50):
                    if front.status()["admission"]["queued"] == 1:
                        break
                    await asyncio.sleep(0.02)
                before = front.status()["admission"]["queued"]
                queued.cancel()   # the client hangs up
                await asyncio.gather(queued, return_exceptions=True)
                for _ in range(50):
                    if front.status()["admission"]["queued"] == 0:
                        break
                    await asyncio.sleep(0.02)
                after = front.status()["admission"]
                metrics = (await c.get("/metrics")).text
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                return before, after, metrics, sum(len(f.requests) for f in fakes)
        finally:
            await _teardown(front, client, runners)
    before, after, metrics, reached = asyncio.run(go())
    assert before == 1 and after["queued"] == 0 and after["timed_out"] == 0
    assert 'kunserve:admission_total{outcome="abandoned"} 1.0' in metrics
    assert reached == 1
