"""Several models behind one OpenAI endpoint (``kunserve serve --fleet FILE``): each model has a front
end of its own (its engines, monitor, dispatch, tokenizer; ``app.FrontEnd``), and this ASGI app sends
each request to the one its body's ``model`` names. ``GET /v1/models`` lists every model;
``/metrics`` is every front end's series with a ``model`` label, plus the tenancy controller's;
``/kunserve/status`` has one section per model and the tenancy controller's; ``/kunserve/ops/OP``
takes ``?model=NAME`` (needed with several models). An unknown model is a 404 in OpenAI's form, as
vLLM answers it; a request naming none, a 400.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Any, Mapping

from vllm_kunserve.cluster.frontend.validate import error_body

_GENERATE = ("/v1/completions", "/v1/chat/completions")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?(\s.*)$")


def add_label(text: str, key: str, value: str, families: dict[str, list[str]], meta: dict[str, list[str]]) -> None:
    """Add ``key="value"`` to every sample of a Prometheus text exposition, collected per family
    (``meta``: a family's HELP and TYPE lines, the first seen; ``families``: its samples)."""
    current = None
    esc = value.replace("\\", "\\\\").replace('"', '\\"')
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = parts[2]
                lines = meta.setdefault(current, [])
                if not any(x.split(None, 2)[1] == parts[1] for x in lines):
                    lines.append(line)
                families.setdefault(current, [])
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, _, labels, rest = m.groups()
        labels = f'{key}="{esc}"' + (f",{labels}" if labels else "")
        families.setdefault(current or name, []).append(f"{name}{{{labels}}}{rest}")


class ModelRouter:
    """The ASGI app of a multi-model fleet. ``apps``: model -> (its FrontEnd, its ASGI app)."""

    def __init__(self, apps: Mapping[str, tuple[Any, Any]], tenancy: Any = None, api_keys: tuple[str, ...] = (),
                 token: str = ""):
        self.apps = dict(apps)
        self.tenancy = tenancy
        self.api_keys, self.token = tuple(api_keys), token

    # -- lifespan -----------------------------------------------------------------------------------------
    async def startup(self) -> None:
        for front, _ in self.apps.values():
            await front.start()
        if self.tenancy is not None:
            self.tenancy.start()

    async def shutdown(self) -> None:
        for front, _ in self.apps.values():
            await front.close()

    # -- ASGI ---------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path.startswith("/v1/") and self.api_keys and not self._key_ok(scope):
            return await self._json(send, 401, error_body("Unauthorized", 401, "AuthenticationError"))
        if method == "POST" and path in _GENERATE:
            return await self._generate(scope, receive, send)
        if path == "/v1/models" and method == "GET":
            data = []
            for front, _ in self.apps.values():
                try:
                    data += json.loads(front.models_body or b"{}").get("data", [])
                except ValueError:
                    pass
            return await self._json(send, 200, {"object": "list", "data": data})
        if path == "/health":
            ok = all(front.fleet.ready() for front, _ in self.apps.values())
            return await self._raw(send, 200 if ok else 503, b"", b"text/plain")
        if path == "/metrics" and method == "GET":
            return await self._metrics(send)
        if path == "/kunserve/status" and method == "GET":
            body = {"models": {m: front.status() for m, (front, _) in self.apps.items()},
                    "tenancy": self.tenancy.status() if self.tenancy is not None else None}
            return await self._json(send, 200, body)
        if path.startswith("/kunserve/ops/"):
            model = _query(scope).get("model")
            if model is None and len(self.apps) == 1:
                model = next(iter(self.apps))
            if model not in self.apps:
                return await self._json(send, 400, error_body(
                    f"?model= names the model this operation is for: one of {', '.join(self.apps)}", 400,
                    "BadRequestError", "model"))
            return await self.apps[model][1](scope, receive, send)
        return await self._json(send, 404, error_body(f"no route {method} {path}", 404, "NotFoundError"))

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _generate(self, scope, receive, send) -> None:
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            model = None if len(self.apps) > 1 else next(iter(self.apps))
            if model is None:
                return await self._json(send, 400, error_body("the body is not a JSON object", 400, "BadRequestError"))
        if model is None and len(self.apps) == 1:
            model = next(iter(self.apps))
        if model is None:
            return await self._json(send, 400, error_body(
                f"'model' is required: this endpoint serves {', '.join(self.apps)}", 400, "BadRequestError", "model"))
        if not isinstance(model, str) or model not in self.apps:
            return await self._json(send, 404, error_body(
                f"The model `{model}` does not exist (served: {', '.join(self.apps)}).", 404, "NotFoundError", "model"))
        if self.tenancy is not None:
            self.tenancy.arrived(model)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.apps[model][1](scope, replay, send)

    async def _metrics(self, send) -> None:
        import asyncio

        from prometheus_client import generate_latest

        families: dict[str, list[str]] = {}
        meta: dict[str, list[str]] = {}

        async def text(app) -> str:
            out: list[bytes] = []

            async def rx():
                return {"type": "http.request", "body": b"", "more_body": False}

            async def tx(msg):
                if msg["type"] == "http.response.body":
                    out.append(msg.get("body", b""))
            await app({"type": "http", "method": "GET", "path": "/metrics", "raw_path": b"/metrics",
                       "query_string": b"", "headers": [], "scheme": "http", "root_path": "",
                       "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0), "http_version": "1.1"}, rx, tx)
            return b"".join(out).decode()
        texts = await asyncio.gather(*(text(app) for _, app in self.apps.values()))
        for model, t in zip(self.apps, texts):
            add_label(t, "model", model, families, meta)
        lines = []
        for name, samples in families.items():
            lines += meta.get(name, []) + samples
        body = "\n".join(lines) + "\n"
        if self.tenancy is not None:
            body += generate_latest(self.tenancy.registry).decode()
        await self._raw(send, 200, body.encode(), b"text/plain; version=0.0.4; charset=utf-8")

    def _key_ok(self, scope) -> bool:
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        return any(hmac.compare_digest(got, f"Bearer {k}".encode()) for k in self.api_keys)

    @staticmethod
    async def _raw(send, status: int, body: bytes, ctype: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _json(self, send, status: int, obj: Any) -> None:
        await self._raw(send, status, json.dumps(obj).encode(), b"application/json")


def _query(scope) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return dict(parse_qsl((scope.get("query_string") or b"").decode()))
