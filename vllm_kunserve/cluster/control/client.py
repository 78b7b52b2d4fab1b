"""The one client of the engines' control ports: every HTTP call the fleet's controllers, the front
end and ``kunserve status`` make to an engine's control port goes through :class:`ControlClient`.

* ``GET /state``: :meth:`ControlClient.state` (parsed into ``engine.state.EngineState``, the type
  the agent publishes) or :meth:`ControlClient.state_json` (the dict as sent);
* ``POST /ops/{op}``: :meth:`ControlClient.op` (the group controller's ``group_join`` /
  ``group_leave``), :meth:`ControlClient.kv_export` (the front end's KV migration);
* :meth:`ControlClient.get_json`: a blocking GET with the standard library only (``kunserve status``,
  which imports neither aiohttp nor vLLM).

The asynchronous calls run on the caller's ``aiohttp.ClientSession`` (the monitor's, the front
end's). An answer other than 200 is a :class:`ControlPortError` with the status and the body; a
connection that fails raises what aiohttp raised. Engines call each other's control ports from the
engine room (``engine.migration``), which cannot import the cluster: the blocking calls and the
errors are ``engine.portcall``'s, which both use, and the state's type is ``engine.state``.
"""

from __future__ import annotations

from typing import Any, Sequence

from vllm_kunserve.engine.portcall import (ControlPortError, ControlPortNotAnObject, ControlPortUnreachable, bearer,
                                           call_json)
from vllm_kunserve.engine.state import EngineState

__all__ = ["ControlClient", "ControlPortError", "ControlPortNotAnObject", "ControlPortUnreachable", "bearer"]


class ControlClient:
    """Calls to engines' control ports with one bearer token (empty: none)."""

    def __init__(self, token: str | None = ""):
        self.token = token or ""

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.token)

    # -- asynchronous (aiohttp, on the caller's session) --------------------------------------------
    async def state_json(self, session: Any, control_url: str) -> dict:
        """``GET /state`` as sent."""
        async with session.get(f"{control_url}/state", headers=self.headers) as resp:
            if resp.status != 200:
                raise ControlPortError(f"control port answered {resp.status}", resp.status)
            return await resp.json()

    async def state(self, session: Any, control_url: str) -> EngineState:
        """``GET /state``, parsed (``EngineStateError`` when it is not an engine's state)."""
        return EngineState.from_dict(await self.state_json(session, control_url))

    async def op(self, session: Any, control_url: str, op: str, body: dict, timeout_s: float | None = None) -> Any:
        """``POST /ops/{op}`` with ``body``: the operation's answer. ``timeout_s``: the whole call's
        limit (None: the session's)."""
        import aiohttp

        limit = {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s is not None else {}
        async with session.post(f"{control_url}/ops/{op}", json=body, headers=self.headers, **limit) as resp:
            out = await resp.json(content_type=None)
            if resp.status != 200:
                raise ControlPortError(f"{op} answered {resp.status}: {out}", resp.status, out)
            return out

    async def kv_export(self, session: Any, source_url: str, target_url: str, token_ids: Sequence[int]) -> dict:
        """Move the KV of ``token_ids`` from the source engine's prefix cache to the target's (the
        source's ``kv_export`` runs the staged prepare / copy / commit-or-abort with the target; the
        bytes go worker to worker over the transfer channel): ``blocks``, ``bytes``, ``cached_tokens``
        (the target's, after) and ``export_ms``. Raises when nothing could be moved."""
        from vllm_kunserve.engine.migration import encode_tokens

        body = {"token_ids_b64": encode_tokens(list(token_ids)), "target": target_url,
                **({"target_token": self.token} if self.token else {})}
        try:
            out = await self.op(session, source_url, "kv_export", body)
        except ControlPortError as e:
            why = e.body.get("error", e.body) if isinstance(e.body, dict) else e.body
            raise ControlPortError(f"kv_export answered {e.status}: {why}", e.status, e.body) from None
        if out.get("outcome") == "nothing" and out.get("target_cached_tokens"):
            return {"blocks": 0, "bytes": 0, "cached_tokens": out["target_cached_tokens"]}  # already there
        if out.get("outcome") != "ok":
            raise ControlPortError(f"kv_export {out.get('outcome')}: {out.get('error') or out.get('reason') or ''}",
                                   200, out)
        return {"blocks": out.get("sent_blocks", 0), "bytes": out.get("bytes", 0),
                "cached_tokens": out.get("target_cached_tokens", 0), "export_ms": out.get("ms")}

    # -- blocking (standard library only) -----------------------------------------------------------------
    def get_json(self, url: str, timeout_s: float = 10.0) -> dict:
        """``GET url``: the JSON object it answers. An HTTP error is a :class:`ControlPortError`
        (``status``; ``body``: the answer's error message, else the reason), no answer a
        :class:`ControlPortUnreachable`, an answer that is not a JSON object a
        :class:`ControlPortNotAnObject`."""
        return call_json(url, None, self.token, timeout_s)

