"""A small asyncio client for the cluster tests: completions and chat, streamed or not, with the
token ids of every answer, and operator calls to the front end."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Answer:
    status: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    request_id: str | None = None
    error: dict | None = None
    chunks: int = 0


async def complete(session: aiohttp.ClientSession, url: str, prompt, *, max_tokens: int = 16, stream: bool = False,
                   chat: bool = False, on_chunk=None, **extra) -> Answer:
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream": stream, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    async with session.post(url + path, json=body) as resp:
        if resp.status != 200:
            return Answer(resp.status, error=(await resp.json()).get("error"))
        if not stream:
            data = await resp.json()
            ch = data["choices"][0]
            text = ch["message"]["content"] if chat else ch["text"]
            return Answer(200, text or "", list(ch.get("token_ids") or []), ch.get("finish_reason"), data["id"])
        ans = Answer(200)
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            ev = json.loads(payload)
            if "error" in ev and not ev.get("choices"):
                ans.error = ev["error"]
                continue
            ans.request_id = ans.request_id or ev.get("id")
            for ch in ev.get("choices") or []:
                ans.text += (ch.get("delta") or {}).get("content") or "" if chat else ch.get("text") or ""
                ans.token_ids += ch.get("token_ids") or []
                ans.finish_reason = ch.get("finish_reason") or ans.finish_reason
            ans.chunks += 1
            if on_chunk is not None:
                await on_chunk(ans)
        return ans


async def op(session: aiohttp.ClientSession, url: str, name: str, body: dict) -> tuple[int, dict]:
    async with session.post(f"{url}/kunserve/ops/{name}", json=body) as resp:
        return resp.status, await resp.json()


async def status(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/kunserve/status") as resp:
        return await resp.json()


async def migrate_midway(s, url: str, prompt: str, n: int, chat: bool, method: str, at_token: int = 12):
    """Send a streamed greedy request with our own request id, and have the front end move it to the
    other engine once it has sent ``at_token`` tokens. Returns (answer, the migrate op's answer)."""
    rid = f"mig-{method}-{chat}-{time.monotonic_ns()}"
    order = asyncio.ensure_future(op(s, url, "migrate", {"request_id": rid, "method": method,
                                                         "at_token": at_token, "wait_s": 30}))
    await asyncio.sleep(0.05)  # the order waits in the front end for the request to arrive
    task = asyncio.ensure_future(complete(s, url, prompt, max_tokens=n, stream=True, chat=chat, request_id=rid))
    res = await order
    return await task, res


def run(coro):
    return asyncio.run(coro)
