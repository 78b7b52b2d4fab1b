"""Open-loop replay of a trace against an OpenAI-compatible ``/v1/completions`` endpoint.

Each request is sent at its arrival time (relative to the replay start) whatever happened to the
earlier ones, streamed (``stream: true``, ``max_tokens`` = output length, ``ignore_eos: true``,
``temperature: 0``) and timed with ``time.perf_counter``:

- TTFT: send -> first streamed chunk carrying a choice;
- token gaps: times between successive chunks (one chunk per token at vLLM's default stream
  interval); TPOT = (last chunk - first chunk) / (output tokens - 1);
- end-to-end latency: send -> end of stream;
- queue time: only if the server reports it in the stream (a ``queue_time_s`` field in a chunk,
  which vLLM does not send; the server-side mean comes from the Prometheus histogram instead).

Failures (HTTP status, error object in the stream, connection errors, the per-request timeout, the
overall deadline) are recorded with their error text; they never stop the replay.

:func:`request` sends one request of a given body, timed the same way (``benchmarks/front_end.py``'s
closed-loop streams use it).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp


@dataclass(frozen=True)
class RequestSpec:
    idx: int
    arrival_s: float
    prompt: list[int] | str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    idx: int
    arrival_s: float  # scheduled, from replay start
    prompt_len: int
    output_len: int  # requested
    send_s: float = math.nan  # actual send time, from replay start
    ok: bool = False
    error: str = ""
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    tpot_s: float = math.nan
    queue_s: float = math.nan
    output_tokens: int = 0  # received (server usage if reported, else streamed chunks)
    server_prompt_tokens: int = -1  # usage.prompt_tokens if reported
    finish_reason: str = ""
    token_times: list[float] = field(default_factory=list)  # chunk times from send
    token_ids: list[int] = field(default_factory=list)  # the generated ids, where chunks carry them

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def completions_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    if base.endswith("/v1/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/completions"
    return base + "/v1/completions"


def _body(model: str, spec: RequestSpec, extra: dict[str, Any] | None) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": int(spec.output_len),
        "min_tokens": int(spec.output_len),
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra or {})
    return body


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, res: RequestResult, t_send: float,
                  parse: bool = True, to_end: bool = False) -> None:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            text = (await resp.text())[:300].replace("\n", " ")
            res.error = f"HTTP {resp.status}: {text}"
            return
        chunks = 0
        usage = None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if to_end:
                    continue
                break
            now = time.perf_counter()
            if not parse:   # every chunk a token, nothing decoded
                chunks += 1
                res.token_times.append(now - t_send)
                continue
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                res.error = f"bad stream chunk: {data[:120]!r}"
                return
            if "error" in obj:
                err = obj["error"]
                res.error = "stream error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                return
            if isinstance(obj.get("queue_time_s"), (int, float)):
                res.queue_s = float(obj["queue_time_s"])
            choices = obj.get("choices") or []
            if choices:
                chunks += 1
                res.token_times.append(now - t_send)
                reason = choices[0].get("finish_reason")
                if reason:
                    res.finish_reason = str(reason)
                ids = choices[0].get("token_ids")
                if ids:   # asked for with return_token_ids
                    res.token_ids.extend(ids)
            if obj.get("usage"):
                usage = obj["usage"]
        end = time.perf_counter()
        if not res.token_times:
            res.error = "stream ended without any token"
            return
        res.output_tokens = int(usage.get("completion_tokens", chunks)) if usage else chunks
        if usage and "prompt_tokens" in usage:
            res.server_prompt_tokens = int(usage["prompt_tokens"])
        res.ttft_s = res.token_times[0]
        res.e2e_s = end - t_send
        if res.output_tokens > 1:
            res.tpot_s = (res.token_times[-1] - res.token_times[0]) / (res.output_tokens - 1)
        res.ok = True


async def _send(session: aiohttp.ClientSession, url: str, body: dict, res: RequestResult, t0: float,
                timeout_s: float, parse: bool = True, to_end: bool = False) -> None:
    delay = t0 + res.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    t_send = time.perf_counter()
    res.send_s = t_send - t0
    try:
        await asyncio.wait_for(_stream(session, url, body, res, t_send, parse, to_end), timeout_s)
    except asyncio.TimeoutError:
        res.ok, res.error = False, f"timeout after {timeout_s:g} s"
    except aiohttp.ClientError as e:
        res.ok, res.error = False, f"{type(e).__name__}: {e}"


async def request(session: aiohttp.ClientSession, url: str, body: dict, spec: RequestSpec, t0: float,
                  timeout_s: float = 300.0, *, parse: bool = True, to_end: bool = False) -> RequestResult:
    """One streamed request of ``body`` to ``url`` (a completions URL), sent at ``spec.arrival_s``
    after ``t0`` (``time.perf_counter()``; at once if that has passed) and timed as :func:`replay`
    times its requests; failures are recorded in the result. ``parse=False``: every ``data:`` chunk
    but ``[DONE]`` is a token and none is decoded (the client's own CPU per token stays minimal;
    no usage, finish reason or error chunk is read). ``to_end``: read the response to the end of its
    body, past ``[DONE]`` (the end-to-end time then ends with the body, and the connection is left
    reusable)."""
    res = RequestResult(spec.idx, spec.arrival_s, spec.prompt_len, spec.output_len)
    await _send(session, url, body, res, t0, timeout_s, parse, to_end)
    return res


def parse_concurrency(text: str) -> list[tuple[float, int]]:
    """``N`` or ``N,N@SECONDS,...`` (e.g. ``14,28@15,14@30``): the in-flight limit from each time on
    (seconds from the replay's start, increasing; the first from 0)."""
    out: list[tuple[float, int]] = []
    for k, part in enumerate(p.strip() for p in str(text).split(",")):
        n, _, at = part.partition("@")
        try:
            t, c = (float(at) if at else 0.0), int(n)
        except ValueError:
            raise ValueError(f"--max-concurrency {text!r}: expected N or N,N@SECONDS,...") from None
        if c < 1 or (k == 0 and t != 0) or (k > 0 and (not at or t <= out[-1][0])):
            raise ValueError(f"--max-concurrency {text!r}: limits >= 1, the first from 0, then at increasing times")
        out.append((t, c))
    return out


class Slots:
    """At most ``limit(t)`` requests in flight, ``t`` seconds after ``t0``, granted in arrival order."""

    def __init__(self, schedule: list[tuple[float, int]], t0: float):
        self.schedule, self.t0, self.busy = schedule, t0, 0
        self.cond = asyncio.Condition()

    def limit(self) -> int:
        now = time.perf_counter() - self.t0
        return [c for t, c in self.schedule if t <= now][-1]

    async def acquire(self) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.busy < self.limit())
            self.busy += 1

    async def release(self) -> None:
        async with self.cond:
            self.busy -= 1
            self.cond.notify_all()

    async def _wake(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    async def tick(self) -> None:
        """Wake the waiters at each later limit's start (a limit that rises frees slots by itself)."""
        for t, _ in self.schedule[1:]:
            await asyncio.sleep(max(0.0, self.t0 + t - time.perf_counter()))
            await self._wake()


async def _one(session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, t0: float,
               timeout_s: float, extra: dict | None, on_done: Callable[[RequestResult], None],
               slots: Slots | None = None) -> RequestResult:
    res = RequestResult(spec.idx, spec.arrival_s, spec.prompt_len, spec.output_len)
    try:
        if slots is None:
            await _send(session, url, _body(model, spec, extra), res, t0, timeout_s)
        else:
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()   # FIFO: the request arrives when a slot frees (its user's previous one ended)
            try:
                res.arrival_s = max(spec.arrival_s, time.perf_counter() - t0)
                await _send(session, url, _body(model, spec, extra), res, t0, timeout_s)
            finally:
                await slots.release()
    except asyncio.CancelledError:
        res.ok = False
        res.error = "overall deadline reached" + ("" if res.send_s == res.send_s else " before sending")
        on_done(res)
        raise
    on_done(res)
    return res


async def replay(endpoint: str, model: str, specs: list[RequestSpec], *, request_timeout_s: float = 300.0,
                 deadline_s: float | None = None, progress: bool = True, extra_body: dict | None = None,
                 on_start: Callable[[float], None] | None = None,
                 max_concurrency: int | list[tuple[float, int]] | None = None) -> list[RequestResult]:
    """Send every spec at its arrival time; return one result per spec, in spec order.

    ``max_concurrency``: at most this many requests in flight (``vllm bench serve --max-concurrency``'s
    meaning): a request whose arrival time has come waits for a free slot, in arrival order, and its
    recorded arrival becomes the moment it got one. With every arrival at 0 that is a closed loop of
    that many users, each sending its next request when its previous one ends: a load that depends on
    the requests' lengths and the KV they hold, not on how fast the machine is. A schedule
    (``parse_concurrency``) changes the limit over time: a closed loop whose users come and go.

    ``deadline_s`` bounds the whole replay (from its start); requests still running or not yet sent
    then are cancelled and recorded as failed. ``on_start(t0)`` is called with the replay's zero
    (``time.perf_counter()``) before the first send, e.g. to align a metrics scraper.
    """
    from tqdm.auto import tqdm

    url = completions_url(endpoint)
    results: dict[int, RequestResult] = {}
    bar = tqdm(total=len(specs), unit="req", desc="replay", disable=not progress, dynamic_ncols=True)
    failed = 0

    def on_done(r: RequestResult) -> None:
        nonlocal failed
        results[r.idx] = r
        failed += not r.ok
        bar.update(1)
        if failed:
            bar.set_postfix(failed=failed, refresh=False)

    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                         read_bufsize=1 << 16) as session:
            t0 = time.perf_counter()
            if on_start:
                on_start(t0)
            schedule = [(0.0, max_concurrency)] if isinstance(max_concurrency, int) else max_concurrency
            slots = Slots(schedule, t0) if schedule else None
            tasks = [asyncio.create_task(_one(session, url, model, s, t0, request_timeout_s, extra_body, on_done,
                                              slots)) for s in specs]
            ticker = asyncio.create_task(slots.tick()) if slots else None
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=deadline_s)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if ticker:
                ticker.cancel()
    finally:
        bar.close()
    return [results[s.idx] for s in specs]
