"""The engine's own door to its control port: a ``vllm.endpoint_plugins`` entry point (vLLM >= 0.32)
that adds ``GET /kunserve/engine`` to ``vllm serve``'s API server, so a front end attached to the
engine by its URL (``kunserve serve --engine-url``) finds the control port instead of being told.

Where the URL comes from: the plugin's activation gate (``plugin.py``), in the API server process,
names an announce file in ``KUNSERVE_CONTROL_ANNOUNCE`` for an engine with a ``kunserve`` key; the
engine-core process vLLM starts next inherits the variable and, once its control port listens,
writes ``{"control_url", "pid"}`` there (``engine_hooks._start_control``). The route reads it.

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS`` (they add HTTP routes), and that
list also gates general plugins: an engine that wants the route runs with
``VLLM_PLUGINS=kunserve`` (both entry points are named ``kunserve``). Without it the front end
falls back to ``--engine-control-url`` or reads the engine as stock, and says so.

The route adds no path into the engine (the endpoint-plugin contract): it reads one small file.
It answers 404 where this engine has no control port (a stock engine, or ``control.enable`` off)
and 503 while the engine core has not announced one yet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllm_kunserve.engine.control import ANNOUNCE_ENV

ROUTE = "/kunserve/engine"


def announce(url: str) -> Path | None:
    """Engine core: write this engine's control URL where the API server's route reads it."""
    path = os.environ.get(ANNOUNCE_ENV, "").strip()
    if not path:
        return None
    p = Path(path)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"control_url": url, "pid": os.getpid()}))
    os.replace(tmp, p)   # the route never reads half a file
    return p


def read_announced() -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of ``GET /kunserve/engine`` in this process."""
    path = os.environ.get(ANNOUNCE_ENV, "").strip()
    if not path:
        return 404, {"error": "no kunserve control port on this engine (a stock engine, or kunserve's "
                              "control.enable is off)"}
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return 503, {"error": "the engine core has not opened its control port yet"}
    except (OSError, ValueError) as e:
        return 500, {"error": f"the control port's announce file is unreadable: {type(e).__name__}"}
    if not isinstance(d, dict) or not isinstance(d.get("control_url"), str):
        return 500, {"error": "the control port's announce file has no control_url"}
    return 200, {"control_url": d["control_url"]}


class KunserveEndpoint:
    """``vllm.endpoint_plugins`` factory: the ``/kunserve/engine`` route (no engine state needed)."""

    name = "kunserve"
    required_tasks = None   # every server that has an engine; the render server answers 404

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        async def kunserve_engine() -> JSONResponse:
            status, body = read_announced()
            return JSONResponse(body, status_code=status)

        app.add_api_route(ROUTE, kunserve_engine, methods=["GET"], include_in_schema=False)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        return None
