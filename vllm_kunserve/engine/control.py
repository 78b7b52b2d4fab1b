"""The engine control port: an engine's state and operations over HTTP, for the cluster controller
and for people (``kunserve status --url URL``).

It runs in the engine-core process on vLLM's HTTP stack (FastAPI on uvicorn) in a daemon thread
with its own event loop, bound to loopback by default. It installs no signal handlers and does not
reconfigure logging, so it also runs in a process that serves ``vllm serve`` or other event loops.
Operations run on their own daemon thread, so a slow operation never blocks a state read and never
holds up the process's exit.

    GET  /health          {"ok": true} (no token needed)
    GET  /state           the handler's state snapshot
    GET  /ops             {"operations": {name: parameters}}
    POST /ops/{name}      JSON object body (empty: {}) -> the operation's result

With a token (argument, else env ``KUNSERVE_CONTROL_TOKEN``) every endpoint but ``/health`` needs
``Authorization: Bearer <token>``: missing -> 401, wrong -> 403. Bad requests (unknown operation,
body not a JSON object or over 64 KiB, bad parameters) -> 400 and nothing changes; an operation
that conflicts with one in progress -> 409; one that did not reach a step boundary in time -> 504;
any other failure -> 500. Errors are ``{"error": {"message", "type", "code"}}``. See docs/control.md.
"""

# no ``from __future__ import annotations``: FastAPI must see the real ``Request`` annotations
# of the endpoints, whose types are imported lazily inside build_app.
import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import threading
from typing import Any, Callable, Protocol

logger = logging.getLogger("vllm.kunserve")

MAX_BODY = 64 << 10
TOKEN_ENV = "KUNSERVE_CONTROL_TOKEN"
#: where an engine core announces its control URL to its API server's ``GET /kunserve/engine``
#: (integration/vllm/endpoint.py): a file the plugin's activation gate names per engine
ANNOUNCE_ENV = "KUNSERVE_CONTROL_ANNOUNCE"
_THREAD = "kunserve-control"


class ControlRequestError(ValueError):
    """A bad operation or parameters (HTTP 400); nothing was changed."""


class ControlConflict(RuntimeError):
    """The engine is busy with another operation (HTTP 409)."""


class ControlHandler(Protocol):
    def control_state(self) -> dict:
        """A thread-safe, JSON-able snapshot of the engine; cheap (called on the server's loop)."""

    def control_operations(self) -> dict[str, str]:
        """Operation name -> one-line description of its parameters."""

    def control_submit(self, op: str, params: dict, timeout_s: float) -> dict:
        """Run ``op`` on the engine thread and return its JSON-able result; raises
        ControlRequestError (400), ControlConflict (409), TimeoutError (504), anything else (500)."""


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None (JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json(obj: Any, status: int = 200):
    from starlette.responses import Response

    try:
        body = json.dumps(obj, allow_nan=False, default=str)
    except ValueError:
        body = json.dumps(_finite(obj), allow_nan=False, default=str)
    return Response(body, status_code=status, media_type="application/json")


def _error(code: int, message: str, kind: str):
    return _json({"error": {"message": message, "type": kind, "code": code}}, code)


async def _off_loop(fn: Callable, *args: Any) -> Any:
    """Run ``fn(*args)`` on a fresh daemon thread and await its result. Not the default executor nor
    anyio's pool: their threads are joined at interpreter exit, and an operation may wait long."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as exc:  # handed to the awaiting request
            ok, value = False, exc
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the server stopped meanwhile
            pass

    threading.Thread(target=work, name=f"{_THREAD}-op", daemon=True).start()
    return await fut


async def _read_body(request) -> bytes | None:
    """The request body, or None when it is over MAX_BODY (stops reading there)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(handler: ControlHandler, token: str | None, request_timeout_s: float):
    """The FastAPI app of the control port (also usable with any ASGI server)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="kunserve engine control", openapi_url=None, docs_url=None, redoc_url=None)
    want = token.encode() if token else None

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(400, f"bad request: {exc.errors()}", "invalid_request")

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if want is not None and request.url.path != "/health":
            scheme, _, got = request.headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not got.strip():
                return _error(401, "missing bearer token (send Authorization: Bearer <token>)", "unauthorized")
            if not hmac.compare_digest(got.strip().encode(), want):
                return _error(403, "wrong token", "forbidden")
        return await call_next(request)

    def guarded(what: str, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """``(fn(), None)``, or ``(None, a 500 response)`` when it raises."""
        try:
            return fn(), None
        except Exception as exc:  # the engine keeps running; the caller learns what failed
            logger.exception("kunserve control: %s failed", what)
            return None, _error(500, f"{what} failed: {exc!r}", "internal_error")

    @app.get("/health")
    async def health():
        return _json({"ok": True})

    @app.get("/state")
    async def state():
        snapshot, failed = guarded("state", handler.control_state)
        return failed if failed is not None else _json(snapshot)

    @app.get("/ops")
    async def ops():
        known, failed = guarded("operations", handler.control_operations)
        return failed if failed is not None else _json({"operations": known})

    @app.post("/ops/{op}")
    async def submit(op: str, request: Request):
        known, failed = guarded("operations", handler.control_operations)
        if failed is not None:
            return failed
        if op not in known:
            return _error(400, f"unknown operation {op!r}; known: {', '.join(sorted(known)) or 'none'}",
                          "invalid_request")
        raw = await _read_body(request)
        if raw is None:
            return _error(400, f"body is over the {MAX_BODY}-byte limit", "invalid_request")
        try:
            params = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"body is not valid JSON: {exc}", "invalid_request")
        except RecursionError:
            return _error(400, "body is nested too deeply", "invalid_request")
        if not isinstance(params, dict):
            return _error(400, f"body must be a JSON object, got {type(params).__name__}", "invalid_request")
        try:
            return _json(await _off_loop(handler.control_submit, op, params, request_timeout_s))
        except ControlRequestError as exc:
            return _error(400, str(exc), "invalid_request")
        except ControlConflict as exc:
            return _error(409, str(exc), "conflict")
        except TimeoutError as exc:
            return _error(504, str(exc) or f"{op} timed out after {request_timeout_s:g} s", "timeout")
        except Exception as exc:  # the engine keeps running; the caller learns what failed
            logger.exception("kunserve control: %s failed", op)
            return _error(500, f"{op} failed: {exc!r}", "internal_error")

    return app


class _QuietControlThreads(logging.Filter):
    """Drop uvicorn's info lines (startup, access log) emitted by the control port's threads only,
    so a process that also runs ``vllm serve`` keeps its own uvicorn logging untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not (record.threadName or "").startswith(_THREAD)


_quiet_installed = False


def _install_quiet_filter() -> None:
    global _quiet_installed
    if not _quiet_installed:
        for name in ("uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).addFilter(_QuietControlThreads())
        _quiet_installed = True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ControlServer:
    """Serve ``handler`` on ``host:port`` (port 0: a free port) in a daemon thread.

    ``token`` None takes env ``KUNSERVE_CONTROL_TOKEN`` (empty or unset: no token). ``start()``
    binds the socket itself (so the real port is known at once) and returns the base URL;
    ``stop()`` is idempotent, joins the thread and frees the port. Also a context manager.
    """

    def __init__(self, handler: ControlHandler, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, request_timeout_s: float = 60.0) -> None:
        self.handler = handler
        self.host, self.port = host, int(port)
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self.request_timeout_s = float(request_timeout_s)
        self.url = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def start(self) -> str:
        with self._lock:
            if self._thread is not None:
                return self.url
            return self._start()

    def _start(self) -> str:
        import uvicorn

        if not is_loopback(self.host):
            if not self.token:   # anyone who reaches it could drop layers or kill requests
                raise ValueError(f"kunserve control port: {self.host or 'all interfaces'} is reachable from other "
                                 f"machines; set control.token (or {TOKEN_ENV}) to bind it")
            logger.warning("kunserve control port bound to %s: reachable from other machines (token required)",
                           self.host or "all interfaces")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"kunserve control port: cannot listen on {self.host}:{self.port}: "
                                     f"{exc.strerror or exc}") from exc
        port = sock.getsockname()[1]
        _install_quiet_filter()
        # log_config=None and the default access_log: uvicorn.Config would otherwise reconfigure the
        # process's uvicorn loggers (dictConfig, levels, access handlers) at construction.
        config = uvicorn.Config(build_app(self.handler, self.token, self.request_timeout_s),
                                log_config=None, lifespan="off", ws="none", timeout_graceful_shutdown=2)
        ready = threading.Event()

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None) -> None:
                try:
                    await super().startup(sockets=sockets)
                finally:
                    ready.set()

        server = _Server(config)
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            try:
                asyncio.set_event_loop(loop)
                loop.run_until_complete(server.serve(sockets=[sock]))
                loop.run_until_complete(loop.shutdown_asyncgens())
            except BaseException as exc:  # SystemExit from a failed uvicorn startup included
                failure.append(exc)
                logger.error("kunserve control port stopped: %r", exc)
            finally:
                ready.set()
                asyncio.set_event_loop(None)
                loop.close()

        thread = threading.Thread(target=run, name=_THREAD, daemon=True)
        thread.start()
        if not ready.wait(30) or failure or not server.started:
            server.should_exit = True
            thread.join(5)
            sock.close()
            why = repr(failure[0]) if failure else "timed out"
            raise RuntimeError(f"kunserve control port did not start on {self.host}:{port}: {why}")
        self._server, self._thread, self._sock, self.port = server, thread, sock, port
        host = f"[{self.host}]" if family == socket.AF_INET6 else (self.host or "0.0.0.0")
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self) -> None:
        with self._lock:
            server, thread, sock = self._server, self._thread, self._sock
            self._server = self._thread = self._sock = None
            if server is not None:
                server.should_exit = True
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)
                if thread.is_alive() and server is not None:
                    server.force_exit = True
                    thread.join(timeout=5)
                if thread.is_alive():
                    logger.warning("kunserve control port: server thread did not stop in 10 s")
            if sock is not None:
                sock.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> "ControlServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
