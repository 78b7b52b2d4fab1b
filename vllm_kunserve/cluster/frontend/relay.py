"""One streamed request through the front end: relay, migrate, fail over, never lose or repeat a token.

A :class:`Flight` is a streamed request the front end relays from an engine to the client. It asks
the engine for token ids (``return_token_ids``), so at every chunk it knows the prompt's ids and
every id the client has been sent. When it must leave its engine (a migration order, or the engine
died or broke the stream), it closes the engine's stream at a chunk boundary (vLLM aborts the
request on disconnect), and continues on another engine with a completion whose prompt is
``prompt ids + generated ids`` and whose budget is what is left: the target re-prefills those
tokens, or finds them in its prefix cache when their KV was migrated there first. Chunks of the
continuation are rewritten into the client's format (the original ``id``, ``created``, ``model``;
chat deltas for a chat request; usage counted over the whole request), so the client's stream never
notices. Only tokens the client was sent are counted: whatever the old engine produced after the
cut is discarded, so nothing is repeated and, with greedy sampling, nothing changes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import aiohttp
import msgspec

from vllm_kunserve.cluster.frontend.validate import Checked, continuation_body, decode_json

logger = logging.getLogger("kunserve.relay")

__all__ = ["Flight", "Move", "RelayHost", "UpstreamLost", "sse_batches"]


class UpstreamLost(RuntimeError):
    """The engine's stream ended without finishing the request (engine died or cut the stream)."""


class EngineBusy(UpstreamLost):
    """The engine's stream carried a 503 (vLLM's queue bound, met after the stream began): it is full,
    not broken. The request continues elsewhere as after a lost stream, but the engine's breaker does
    not count it."""


class EngineRefused(RuntimeError):
    """The engine's stream carried a client error (a 4xx code: e.g. a prompt token id out of the
    model's vocabulary, which vLLM finds after the stream began). The request's fault, not the
    engine's: passed on to the client as the engine wrote it, never retried elsewhere and never
    counted against the engine (a client sending such requests must not open every breaker)."""

    def __init__(self, error: Any):
        super().__init__(f"engine refused the request: {error}")
        self.error = error


#: the status of an engine that is full, not broken (vLLM's ``--max-num-queued-reqs`` bound)
BUSY = 503


def busy_or_status(status: int) -> str:
    """How a 5xx answer is retried (the ``kind`` of :meth:`RelayHost.reroute`): :data:`BUSY` is an engine
    saying it is full, "busy": try another, its breaker stays shut; any other 5xx is a fault of the
    engine, "status"."""
    return "busy" if status == BUSY else "status"


def _error_code(err: Any) -> int | None:
    """The code of an engine's in-stream ``error`` object (OpenAI error body), if it has an integer one."""
    code = err.get("code") if isinstance(err, dict) else None
    return code if type(code) is int else None


def _client_error(err: Any) -> bool:
    """Whether an engine's in-stream ``error`` object is a client error (4xx code)."""
    code = _error_code(err)
    return code is not None and 400 <= code < 500


@dataclass(frozen=True)
class Move:
    dst: int
    method: str        # "kv" | "reprefill"
    reason: str = "placement"
    at_token: int = 0  # move once the client has been sent this many tokens (0: at the next chunk)


@dataclass
class Flight:
    rid: str                     # the front end's id
    checked: Checked
    instance: int
    model: str
    visible_id: str | None = None
    created: int | None = None
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    move: Move | None = None
    hops: list[dict] = field(default_factory=list)
    sent_chunks: int = 0
    booked: tuple | None = None   # what the front end last wrote to its FlightBook for it
    t0: float = field(default_factory=time.monotonic)
    session: str | None = None    # the client's session (``user``, or an ``x-session-id`` header)
    retries: int = 0              # engines this request was sent to again after one failed it

    @property
    def started(self) -> bool:
        return self.prompt_ids is not None and bool(self.generated)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids) if self.prompt_ids is not None else self.checked.prompt_tokens[0]

    @property
    def remaining(self) -> int:
        return self.checked.max_tokens - len(self.generated)

    @property
    def wants_ids(self) -> bool:
        return bool(self.checked.body.get("return_token_ids"))


class RelayHost(Protocol):
    session: aiohttp.ClientSession
    first_byte_timeout_s: float

    def engine_url(self, instance: int) -> str | None: ...
    async def pick(self, flight: Flight, exclude: set[int]) -> int: ...
    def untried(self, tried: set[int]) -> bool: ...
    async def reroute(self, flight: Flight, tried: set[int], why: str, max_hops: int, kind: str = "connect") -> int: ...
    def engine_failed(self, instance: int, why: str) -> None: ...
    def engine_ok(self, instance: int) -> None: ...
    def account(self, flight: Flight) -> None: ...
    async def migrate_kv(self, flight: Flight, src: int, dst: int) -> dict: ...
    def record(self, kind: str, **info: Any) -> None: ...


class ReadCounts:
    """Reads of the engines' streams and the events they held, over this process's relays
    (``/kunserve/status`` ``relay_reads``). An engine writes each token's event as it makes it, so
    more than one event per read is a front end that read its engines late: the tokens made
    meanwhile waited in the socket and leave for the client together (``benchmarks/relay_reads.py``)."""

    __slots__ = ("reads", "events")

    def __init__(self) -> None:
        self.reads = self.events = 0

    def view(self) -> dict[str, int]:
        return {"reads": self.reads, "events": self.events}


READS = ReadCounts()


async def sse_batches(resp: aiohttp.ClientResponse) -> AsyncIterator[list[bytes]]:
    """The ``data:`` payloads of a server-sent event stream, undecoded (``b"[DONE]"`` included), one
    list per network read: under load a read holds many events, and the relay forwards them to the
    client in one write instead of one write each."""
    buf = b""
    async for data in resp.content.iter_any():
        buf = buf + data if buf else data
        if b"\n\n" not in buf:
            continue
        *events, buf = buf.split(b"\n\n")
        batch: list[bytes] = []
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    if payload:
                        batch.append(payload)
        if batch:
            yield batch


#: a chunk the relay must rewrite is parsed and written again: msgspec does each in about a
#: microsecond, the json module in tens (measured on this machine's 300-byte completion chunks)
_decode = decode_json
_encode = msgspec.json.Encoder().encode


class _PeekChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None


class _Peek(msgspec.Struct):
    """What the relay needs of an engine's chunk; every other field is skipped, not built."""
    id: str | None = None
    created: int | None = None
    choices: list[_PeekChoice] = []
    prompt_token_ids: list[int] | None = None
    usage: msgspec.Raw | None = None
    error: msgspec.Raw | None = None


_peek = msgspec.json.Decoder(_Peek).decode
#: the members the relay asked the engine for and a client that did not ask must not see. In JSON
#: text a quote inside a string is always escaped, so ``,"token_ids":`` can only be a member
_IDS = re.compile(rb',\s*"(?:prompt_token_ids|token_ids|prompt_text)"\s*:\s*(?:null|\[[^\]]*\]|"(?:[^"\\]|\\.)*")')


def _strip_ids(payload: bytes) -> bytes | None:
    """``payload`` without its token-id members, as bytes (None: one is left, e.g. first in its object)."""
    out = _IDS.sub(b"", payload)
    return None if b'token_ids"' in out or b'"prompt_text"' in out else out


async def _drain(resp: aiohttp.ClientResponse, timeout_s: float = 5.0) -> None:
    """Read what is left of a finished stream (after ``[DONE]``, only the chunked body's end), so
    that aiohttp puts the connection back in its pool: closed instead, every request would open a
    new connection to its engine (a TCP connect on the path to the first token, and one more
    connection for the engine's server to accept). Closes it when the end does not come."""
    try:
        await asyncio.wait_for(resp.content.read(), timeout_s)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        pass
    finally:
        resp.close()   # nothing once the end was read: the connection is back in the pool


_draining: set[asyncio.Task] = set()   # the drains under way (the loop keeps only weak references)


def _sse(obj: dict) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class Relay:
    """Drives one :class:`Flight` from its first engine response to ``[DONE]``."""

    def __init__(self, host: RelayHost, flight: Flight, max_hops: int = 8):
        self.h, self.f, self.max_hops = host, flight, max_hops
        self.continuing = False      # chunks now come from a continuation completion
        self.finished = False
        self.failed = False          # the stream ended in an error event: the request was lost
        self.refused = False         # the engine refused it as the client's error (EngineRefused)
        self.usage_wanted = bool((flight.checked.body.get("stream_options") or {}).get("include_usage"))
        self.wants_ids = flight.wants_ids   # read once: every chunk asks, and the client's body does not change
        self.detok = None
        self.draining: aiohttp.ClientResponse | None = None   # a finished engine stream being read to its end
        self.first_read: float | None = None   # when the engine's first event reached the front end (monotonic)

    def close(self, resp: aiohttp.ClientResponse) -> None:
        """Close an engine stream the relay is done with, unless it is being drained back to the pool."""
        if resp is not self.draining:
            resp.close()

    # -- chunk rewriting ----------------------------------------------------------------------------
    def _forward(self, payload: bytes) -> bytes | None:
        """Record an engine chunk's ids; return the event to send the client (None: nothing). A chunk
        of the first engine with no usage to recount is passed on as the engine wrote it, less the
        token ids the client did not ask for (:func:`_strip_ids`): only what the relay needs is
        decoded (:class:`_Peek`). Any other chunk is decoded whole and rewritten (:meth:`_absorb`)."""
        if not self.continuing:
            try:
                pk = _peek(payload)
            except ValueError:   # not the usual shape: the full path decides
                pk = None
            if pk is not None and pk.usage is None and pk.error is None:
                body = payload if self.wants_ids else _strip_ids(payload)
                if body is not None:
                    ch = pk.choices[0] if pk.choices else None
                    self._record(pk.id, pk.created, pk.prompt_token_ids or (ch.prompt_token_ids if ch else None),
                                 ch.token_ids if ch else None, ch is not None and ch.finish_reason is not None)
                    return b"data: " + body + b"\n\n"
        ev = _decode(payload)   # a msgspec.DecodeError is a ValueError: a broken stream
        if isinstance(ev, dict) and "error" in ev and not ev.get("choices"):
            if _client_error(ev["error"]) and not self.continuing and not self.f.generated:
                raise EngineRefused(ev["error"])
            lost = EngineBusy if _error_code(ev["error"]) == BUSY else UpstreamLost
            raise lost(f"engine error in stream: {ev['error']}")
        chunk = self._absorb(ev)
        return None if chunk is None else _sse(chunk)

    def _record(self, eid: str | None, created: int | None, pids: list[int] | None, ids: list[int] | None,
                finished: bool) -> None:
        f = self.f
        if f.prompt_ids is None and pids is not None:
            f.prompt_ids = list(pids)
        if ids:
            f.generated.extend(ids)
        if finished:
            self.finished = True
        if f.visible_id is None:
            f.visible_id, f.created = eid, created

    def _absorb(self, ev: dict) -> dict | None:
        """Record the chunk's ids; return the chunk to send the client (None: nothing to send)."""
        f = self.f
        choices = ev.get("choices") or []
        ch = choices[0] if choices else None
        # completions carry the prompt's ids in the choice, chat at the top level
        self._record(ev.get("id"), ev.get("created"),
                     ev.get("prompt_token_ids") or (ch.get("prompt_token_ids") if ch is not None else None),
                     ch.get("token_ids") if ch is not None else None,
                     ch is not None and ch.get("finish_reason") is not None)
        if ev.get("usage") and (self.continuing or not self.usage_wanted):
            if not self.usage_wanted:
                ev = {k: v for k, v in ev.items() if k != "usage"}
                if not ev.get("choices"):
                    return None
            else:
                p, c = f.prompt_len, len(f.generated)
                ev = {**ev, "usage": {**ev["usage"], "prompt_tokens": p, "completion_tokens": c,
                                      "total_tokens": p + c}}
        if self.continuing:
            ev = self._rewrite(ev)
        if not self.wants_ids:
            if "prompt_token_ids" in ev or "prompt_text" in ev:
                ev = {k: v for k, v in ev.items() if k not in ("prompt_token_ids", "prompt_text")}
            for c in ev.get("choices") or []:
                c.pop("token_ids", None)
                c.pop("prompt_token_ids", None)
        return ev

    def _start_detokenizer(self) -> None:
        """The text of a continuation, decoded here the way the first engine's detokenizer would have
        (tokenizers' ``DecodeStream`` primed with the original prompt, replaying every token sent):
        an engine primed with ``prompt + generated`` ids resets its stream when they end inside a
        UTF-8 sequence and would repeat the whole prompt as text (vLLM issue 17448)."""
        tok = getattr(self.h, "tokenizer", None)
        backend = getattr(tok, "_tokenizer", None)
        self.detok = None
        if backend is None or self.f.prompt_ids is None:
            return
        from tokenizers.decoders import DecodeStream

        skip = self.f.checked.body.get("skip_special_tokens", True) is not False
        self.detok = (backend, DecodeStream(ids=list(self.f.prompt_ids), skip_special_tokens=skip), skip)
        for t in self.f.generated:
            self._decode(t)

    def _decode(self, token_id: int) -> str:
        backend, stream, skip = self.detok
        try:
            return stream.step(backend, token_id) or ""
        except Exception:  # the same recovery as vLLM's FastIncrementalDetokenizer
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(skip_special_tokens=skip)
            self.detok = (backend, stream, skip)
            return stream.step(backend, token_id) or ""

    def _rewrite(self, ev: dict) -> dict:
        f = self.f
        if self.detok is not None:
            for c in ev.get("choices") or []:
                c["text"] = "".join(self._decode(t) for t in c.get("token_ids") or [])
        out = {**ev, "id": f.visible_id, "created": f.created, "model": f.model,
               "choices": [{k: v for k, v in c.items() if k != "prompt_token_ids"} for c in ev.get("choices") or []]}
        if f.checked.kind == "chat":
            out["object"] = "chat.completion.chunk"
            out["choices"] = [{"index": c.get("index", 0), "delta": {"content": c.get("text", "")},
                               "logprobs": None, "finish_reason": c.get("finish_reason"),
                               "stop_reason": c.get("stop_reason"),
                               **({"token_ids": c.get("token_ids")} if self.wants_ids else {})}
                              for c in ev.get("choices") or []]
        return out

    # -- engine calls -------------------------------------------------------------------------------
    async def _post(self, instance: int, path: str, body: dict) -> aiohttp.ClientResponse:
        url = self.h.engine_url(instance)
        if url is None:
            raise UpstreamLost(f"instance {instance} is not ready")
        return await self.h.session.post(url + path, json=body)

    async def open_first(self) -> aiohttp.ClientResponse:
        """The first engine response. An engine that refuses the connection, answers 5xx or sends
        no response head within the host's ``first_byte_timeout_s`` is reported and the request
        goes to another engine after a backoff (:meth:`RelayHost.reroute`); a 4xx, or a 5xx when no
        retry is left, is returned for the caller to relay as it is (a 503 from every engine: the fleet is
        full, and the client hears it so)."""
        f = self.f
        body = {**f.checked.body, "stream": True, "return_token_ids": True}
        path = "/v1/chat/completions" if f.checked.kind == "chat" else "/v1/completions"
        tried: set[int] = set()
        while True:
            try:
                resp = await asyncio.wait_for(self._post(f.instance, path, body), self.h.first_byte_timeout_s)
            except (aiohttp.ClientConnectionError, UpstreamLost) as e:
                f.instance = await self.h.reroute(f, tried, f"connect: {e}", self.max_hops)
                continue
            except asyncio.TimeoutError:
                f.instance = await self.h.reroute(f, tried, f"no response in {self.h.first_byte_timeout_s:g} s",
                                                  self.max_hops, "timeout")
                continue
            if resp.status >= 500 and f.retries < self.max_hops and self.h.untried(tried | {f.instance}):
                text = (await resp.text())[:200]
                resp.release()
                f.instance = await self.h.reroute(f, tried, f"answered {resp.status}: {text}", self.max_hops,
                                                  busy_or_status(resp.status))
                continue
            f.hops.append({"instance": f.instance, "at_token": 0, "method": "dispatch"})
            return resp

    async def _continue(self, reason: str) -> aiohttp.ClientResponse:
        """Leave the current engine and continue the request elsewhere (migration or failover)."""
        f = self.f
        if f.sent_chunks == 0 and f.move is None:
            # nothing reached the client yet: send the original request again, elsewhere
            self.h.record("failover", request=f.visible_id, src=f.instance, reason=reason, tokens=0)
            f.prompt_ids, f.generated, self.finished = None, [], False
            f.instance = await self.h.pick(f, {f.instance})
            resp = await self.open_first()
            if resp.status != 200:
                text = (await resp.text())[:500]
                resp.release()
                raise UpstreamLost(f"retry on instance {f.instance} answered {resp.status}: {text}")
            return resp
        if f.prompt_ids is None:
            raise UpstreamLost("the engine failed before sending the prompt's token ids")
        src, move = f.instance, f.move
        f.move = None
        tried = {src} if move is None else set()
        method = "reprefill"
        dst = move.dst if move is not None else await self.h.pick(f, tried)
        if move is not None and move.method == "kv":
            t0 = time.monotonic()
            try:
                res = await self.h.migrate_kv(f, src, dst)
                method = "kv"
                self.h.record("migration", request=f.visible_id, src=src, dst=dst, method="kv",
                              tokens=len(f.prompt_ids) + len(f.generated), **res,
                              duration_s=round(time.monotonic() - t0, 4))
            except Exception as e:  # the staged copy rolled back: re-prefill instead
                self.h.record("migration_fallback", request=f.visible_id, src=src, dst=dst, error=str(e)[:300])
        elif move is not None:
            self.h.record("migration", request=f.visible_id, src=src, dst=dst, method="reprefill",
                          tokens=len(f.prompt_ids) + len(f.generated))
        else:
            self.h.record("failover", request=f.visible_id, src=src, dst=dst, reason=reason,
                          tokens=len(f.prompt_ids) + len(f.generated))
        while True:
            body = continuation_body(f.checked.body, f.model, f.prompt_ids + f.generated, f.remaining,
                                     len(f.generated))
            try:
                f.instance = dst
                self.h.account(f)
                resp = await self._post(dst, "/v1/completions", body)
                if resp.status != 200:
                    text = (await resp.text())[:500]
                    resp.release()
                    raise UpstreamLost(f"continuation on instance {dst} answered {resp.status}: {text}")
                f.hops.append({"instance": dst, "at_token": len(f.generated), "method": method, "reason": reason})
                if not self.continuing:
                    self._start_detokenizer()
                self.continuing = True
                return resp
            except (aiohttp.ClientConnectionError, UpstreamLost) as e:
                dst = await self.h.reroute(f, tried, f"continuation: {e}", self.max_hops)
                method = "reprefill"

    # -- the relay loop -----------------------------------------------------------------------------
    async def stream(self, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        f = self.f
        ok_for: int | None = None
        try:
            while True:
                reason = ""
                done = False
                try:
                    stop = False
                    async for batch in sse_batches(resp):
                        READS.reads += 1
                        READS.events += len(batch)
                        if self.first_read is None:
                            self.first_read = time.monotonic()
                        out: list[bytes] = []
                        for payload in batch:
                            if payload == b"[DONE]":
                                done = stop = True
                                break
                            data = self._forward(payload)
                            if data is not None:
                                f.sent_chunks += 1
                                out.append(data)
                                if ok_for != f.instance:   # this engine delivered: its breaker closes
                                    ok_for = f.instance
                                    self.h.engine_ok(f.instance)
                            if (f.move is not None and not self.finished and f.checked.movable
                                    and len(f.generated) >= f.move.at_token):
                                reason, stop = "migrate", True
                                break
                        self.h.account(f)
                        if out:
                            yield b"".join(out)
                        if stop:
                            break
                    if not stop:
                        if not self.finished:
                            raise UpstreamLost("stream ended without [DONE]")
                        done = True
                    if done:   # the client's [DONE] does not wait for the engine's body to end
                        self.draining = resp
                        task = asyncio.get_running_loop().create_task(_drain(resp))
                        _draining.add(task)
                        task.add_done_callback(_draining.discard)
                except EngineRefused as e:   # the client's error: it gets the engine's own words
                    self.h.engine_ok(f.instance)
                    self.refused = True
                    yield _sse({"error": e.error})
                    yield b"data: [DONE]\n\n"
                    return
                except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamLost, ValueError) as e:
                    if self.finished:
                        done = True
                    else:
                        reason = f"lost: {type(e).__name__}: {e}"[:300]
                        if not isinstance(e, EngineBusy):   # a full engine is not a failed one
                            self.h.engine_failed(f.instance, reason)
                finally:
                    self.close(resp)
                if done or self.finished:
                    yield b"data: [DONE]\n\n"
                    return
                if (not f.checked.movable and f.sent_chunks > 0) or len(f.hops) > self.max_hops:
                    raise UpstreamLost(reason or "request cannot move")
                resp = await self._continue(reason)
        except UpstreamLost as e:
            logger.warning("request %s failed: %s", f.rid, e)
            self.failed = True
            yield _sse({"error": {"message": str(e), "type": "ServiceUnavailableError", "param": None, "code": 503}})
            yield b"data: [DONE]\n\n"
