"""Blocking calls to an engine's control port, standard library only: the one implementation of the
port's client side (bearer token, JSON in and out, its errors). The cluster's
``cluster.control.client.ControlClient`` builds on it (and adds the asynchronous calls); an engine
calls another engine's port with it (``engine.migration``'s staged KV import), and ``kunserve
status`` through the client, neither importing aiohttp nor vLLM.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["ControlPortError", "ControlPortNotAnObject", "ControlPortUnreachable", "bearer", "call_json"]


def bearer(token: str | None) -> dict[str, str]:
    """Request headers for an engine's control port (empty without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class ControlPortError(RuntimeError):
    """A control port answered, but not with what was asked: ``status`` (the HTTP status) and
    ``body`` (the answer, or its error message)."""

    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status, self.body = status, body


class ControlPortUnreachable(ControlPortError):
    """No answer at all: refused, timed out, no such host; ``body`` says why."""


class ControlPortNotAnObject(ControlPortError):
    """An answer that is not a JSON object; ``body``: None where it is not JSON at all, else the
    name of the JSON type it is."""


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read())["error"]["message"])
    except Exception:
        return str(e.reason)


def call_json(url: str, body: dict | None = None, token: str | None = "", timeout_s: float = 10.0) -> dict:
    """``GET url`` (``body`` None) or ``POST`` ``body`` as JSON: the JSON object answered. An HTTP
    error is a :class:`ControlPortError` (``status``; ``body``: the answer's error message, else the
    reason), no answer a :class:`ControlPortUnreachable`, an answer that is not a JSON object a
    :class:`ControlPortNotAnObject`."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Accept": "application/json", **bearer(token)}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data, headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raise ControlPortError(f"HTTP {e.code}", e.code, _error_message(e)) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ControlPortUnreachable(f"no answer from {url}", None, getattr(e, "reason", e)) from None
    try:
        out = json.loads(raw)
    except ValueError:
        raise ControlPortNotAnObject("not JSON", 200) from None
    if not isinstance(out, dict):
        raise ControlPortNotAnObject(f"{type(out).__name__}, not a JSON object", 200, type(out).__name__)
    return out
