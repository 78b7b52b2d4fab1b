"""Where the front end sent which prompts: the approximate per-engine prefix index and the session
map that ``cache-aware`` dispatch reads (``policy.dispatch.cache_aware``).

:class:`PrefixIndex` keeps, per engine, the chained hashes of the fixed-size chunks of the prompts
it sent there (an LRU of ``capacity`` chunks per engine, as an engine's prefix cache forgets): a
new prompt's share on an engine is the length of its leading chunks found there over its length.
Text prompts are chunked by characters, token-id prompts by ids (vllm-router's cache-aware tree
is over characters; this is its flat, hashed equivalent). :class:`Sessions` maps a session key
(the request's ``user``, or an ``x-session-id`` header) to the engine that served it last (LRU).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

__all__ = ["PrefixIndex", "Sessions", "prompt_key"]

CHUNK = 64   # characters (text) or token ids per hashed chunk


def prompt_key(body: dict) -> str | list[int] | None:
    """The request's prompt as one string (text, or a chat's messages) or one id list; None for
    anything else (a batch of prompts: not indexed)."""
    p = body.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return p
    msgs = body.get("messages")
    if isinstance(msgs, list):
        parts = []
        for m in msgs:
            if isinstance(m, dict):
                c = m.get("content")
                parts.append(f"{m.get('role', '')}:{c if isinstance(c, str) else repr(c)}\n")
        return "".join(parts)
    return None


def _chunks(key: str | list[int]) -> list[bytes]:
    """Chained hashes of the leading whole chunks (a chunk's hash covers every chunk before it)."""
    out, h = [], b""
    for i in range(0, len(key) - CHUNK + 1, CHUNK):
        part = key[i:i + CHUNK]
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else repr(part).encode()
        h = hashlib.blake2b(h + data, digest_size=12).digest()
        out.append(h)
    return out


class PrefixIndex:
    def __init__(self, capacity: int = 50_000):
        self.capacity = capacity
        self._lru: dict[int, OrderedDict[bytes, None]] = {}

    def share(self, key: Any) -> dict[int, float]:
        """Per engine, the share of ``key`` in its leading chunks found there."""
        if not key:
            return {}
        hs = _chunks(key)
        if not hs:
            return {}
        out = {}
        for inst, lru in self._lru.items():
            n = 0
            for h in hs:
                if h not in lru:
                    break
                n += 1
            if n:
                out[inst] = n * CHUNK / len(key)
        return out

    def add(self, instance: int, key: Any) -> None:
        """``key`` was sent to ``instance``: its chunks are there now (most recent)."""
        if not key:
            return
        lru = self._lru.setdefault(instance, OrderedDict())
        for h in _chunks(key):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def forget(self, instance: int) -> None:
        """The engine restarted: its cache is empty."""
        self._lru.pop(instance, None)


class Sessions:
    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._map: OrderedDict[str, int] = OrderedDict()

    def get(self, session: str | None) -> int | None:
        return self._map.get(session) if session else None

    def put(self, session: str | None, instance: int) -> None:
        if not session:
            return
        self._map[session] = instance
        self._map.move_to_end(session)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)
