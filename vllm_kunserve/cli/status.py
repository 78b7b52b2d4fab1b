"""``kunserve status --url URL``: an engine's state, read from its control port, as a table.

``--json`` prints the raw state. The token comes from ``--token`` or env ``KUNSERVE_CONTROL_TOKEN``.
A control port that cannot be reached, answers with an error or with a state that is not an engine's
is one line on stderr and exit 1. The control port is read through the cluster's control-port client
(``cluster.control.client``, its standard-library call) and the state parsed as
``engine.state.EngineState``: no vLLM, no torch, no aiohttp.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

TOKEN_ENV = "KUNSERVE_CONTROL_TOKEN"  # same as vllm_kunserve.engine.control.TOKEN_ENV (kept import-free)
LAYER_LETTERS = {"resident": "R", "streamed": "S", "dropped": "D"}
_EVENT_KEYS = ("time", "event", "outcome", "ms", "bytes")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="print an engine's (or a kunserve front end's) state from its control "
                                      "port as a table")
    p.add_argument("--url", required=True, help="an engine's control port or a kunserve serve front end, "
                                                "e.g. http://127.0.0.1:PORT")
    p.add_argument("--token", default=None, help=f"bearer token (default: env {TOKEN_ENV})")
    p.add_argument("--json", action="store_true", help="print the raw state as JSON")
    p.add_argument("--events", type=int, default=10, metavar="N", help="show the last N events (default 10)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer (default 10)")
    p.set_defaults(func=run)


class StatusError(Exception):
    """The control port could not be read; the message is one line for stderr."""


def fetch_state(url: str, token: str | None, timeout: float = 10.0) -> dict:
    """GET ``url``/state; raises StatusError with a one-line reason."""
    base = url.rstrip("/")
    if "://" not in base:
        base = "http://" + base
    try:
        return _get_json(base, "/state", token, timeout)
    except _NotFound:  # not an engine's control port: a kunserve serve front end?
        try:
            return _get_json(base, "/kunserve/status", token, timeout)
        except _NotFound:
            raise StatusError(f"{base}: neither an engine control port (/state) nor a kunserve front end "
                              f"(/kunserve/status)") from None


class _NotFound(Exception):
    pass


def _get_json(base: str, path: str, token: str | None, timeout: float) -> dict:
    from vllm_kunserve.cluster.control.client import (ControlClient, ControlPortError, ControlPortNotAnObject,
                                                      ControlPortUnreachable)

    try:
        return ControlClient(token).get_json(base + path, timeout)
    except ControlPortUnreachable as e:
        raise StatusError(f"cannot reach the control port at {base}: {e.body}") from None
    except ControlPortNotAnObject as e:
        if e.body is None:
            raise StatusError(f"{base}{path} did not answer JSON (is this a kunserve control port?)") from None
        raise StatusError(f"{base}{path} answered {e.body}, not a JSON object") from None
    except ControlPortError as e:
        if e.status == 401:
            raise StatusError(f"{base}: the control port needs a token and none was given "
                              f"(--token or env {TOKEN_ENV})") from None
        if e.status == 403:
            raise StatusError(f"{base}: wrong token (--token or env {TOKEN_ENV})") from None
        if e.status == 404:
            raise _NotFound(path) from None
        raise StatusError(f"{base}{path}: HTTP {e.status}: {e.body}") from None


def run(args: argparse.Namespace) -> int:
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    try:
        state = fetch_state(args.url, token, args.timeout)
    except StatusError as e:
        print(f"kunserve status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(state, indent=2, sort_keys=True, default=str))
        return 0
    from vllm_kunserve.engine.state import EngineStateError

    try:
        print(render(state, events=args.events))
    except EngineStateError as e:
        print(f"kunserve status: {args.url}: {e}", file=sys.stderr)
        return 1
    return 0


# -- rendering ------------------------------------------------------------------------------------------
def _s(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def human_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # unreachable


def _compact(v: Any, width: int) -> str:
    text = json.dumps(v, separators=(",", ":"), default=str) if not isinstance(v, str) else v
    return text if len(text) <= width else text[:width - 3] + "..."


def _pairs(section: Any, keys: tuple[str, ...]) -> str:
    return "  ".join(f"{k} {_s(getattr(section, k))}" for k in keys)


def _operation(op: Any, now: float) -> str:
    if not op:
        return "none"
    if not isinstance(op, dict):
        return str(op)
    text = str(op.get("op", "?"))
    started = op.get("started")
    if isinstance(started, (int, float)):
        text += f" ({max(0.0, now - started):.1f} s)"
    if op.get("params"):
        text += " " + _compact(op["params"], 40)
    return text


def _layers(layers: Any) -> list[str]:
    if not isinstance(layers, list) or not layers:
        return ["layers     -"]
    states = [str(x.get("state", "?")) if isinstance(x, dict) else str(x) for x in layers]
    letters = [LAYER_LETTERS.get(s, s[:1].upper() or "?") for s in states]
    rows = [(i, " ".join(letters[i:i + 32])) for i in range(0, len(letters), 32)]
    if len(rows) == 1:
        out = [f"layers     {rows[0][1]}"]
    else:  # long models: each row starts with its first layer's index
        out = [f"{'layers' if i == 0 else '':<7}{i:>3} {r}" for i, r in rows]
    counts: dict[str, int] = {s: 0 for s in LAYER_LETTERS if s in states}  # known states first
    for s in states:
        counts[s] = counts.get(s, 0) + 1
    legend = {**{v: k for k, v in LAYER_LETTERS.items()},
              **{LAYER_LETTERS.get(s, s[:1].upper() or "?"): s for s in states}}
    out.append(f"           {len(states)} layers: " + ", ".join(f"{n} {s}" for s, n in counts.items())
               + "   (" + " ".join(f"{k}={v}" for k, v in legend.items()) + ")")
    return out


def _event_details(ev: dict) -> str:
    parts = []
    for key in ("inputs", "decision"):
        if ev.get(key) is not None:
            parts.append(f"{key} {_compact(ev[key], 50)}")
    rest = {k: v for k, v in ev.items() if k not in _EVENT_KEYS + ("inputs", "decision", "error")}
    if rest:
        parts.append(_compact(rest, 50))
    if ev.get("error"):
        parts.append(f"error {_compact(ev['error'], 60)}")
    return "; ".join(parts) or "-"


def _events(events: Any, n: int) -> list[str]:
    if not isinstance(events, list) or not events or n <= 0:
        return ["events     none"]
    shown = [e for e in events[-n:] if isinstance(e, dict)]
    rows = [("time", "event", "outcome", "ms", "bytes", "inputs / decision")]
    for ev in shown:
        t = ev.get("time")
        ms = ev.get("ms")
        rows.append((time.strftime("%H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "-",
                     _s(ev.get("event")), _s(ev.get("outcome")),
                     f"{ms:.1f}" if isinstance(ms, (int, float)) else "-",
                     human_bytes(ev.get("bytes")), _event_details(ev)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    head = f"events (last {len(shown)} of {len(events)})"
    return [head] + ["  " + "  ".join(c.rjust(w) if i in (3, 4) else c.ljust(w)
                                      for i, (c, w) in enumerate(zip(r[:5], widths))) + "  " + r[5]
                     for r in rows]


def render_engine(state: dict, events: int = 10, now: float | None = None) -> str:
    """One engine's ``/state`` (``EngineStateError`` when it is not one)."""
    from vllm_kunserve.engine.state import EngineState

    now = time.time() if now is None else now
    st = EngineState.from_dict(state)
    eng, cap = st.engine, st.capacity
    block = ""
    if cap.block_size is not None or cap.block_bytes is not None:
        block = f"   (block: {_s(cap.block_size)} tokens, {human_bytes(cap.block_bytes)})"
    lines = [
        f"engine {_s(eng.label)}  pid {_s(eng.pid)}  model {_s(eng.model)}  vllm {_s(eng.get('vllm'))}",
        f"phase {_s(st.phase)}  operation {_operation(st.operation, now)}"
        f"  auto {_s(st.auto)}  errors {_s(st.errors)}",
        f"blocks     total {_s(cap.blocks_total)}  base {_s(cap.blocks_base)}  max {_s(cap.blocks_max)}{block}",
        "           " + _pairs(st.blocks, ("used", "free", "queued", "demand", "draining")),
        "requests   " + _pairs(st.requests, ("waiting", "running")),
    ]
    layers = ["?" if x.state is None else x.state for x in st.layers]
    return "\n".join(lines + _layers(layers) + _events(list(st.events), events))


def render_fleet(state: dict, events: int = 10) -> str:
    """A ``kunserve serve`` front end's ``/kunserve/status``: one row per instance, then events."""
    lines = [f"front end  dispatch {_s(state.get('dispatch'))}  models {','.join(state.get('served_models') or [])}"
             f"  max_model_len {_s(state.get('max_model_len'))}  inflight {_s(state.get('inflight'))}"]
    rows = [("inst", "state", "restarts", "inflight", "blocks", "used", "queued", "running", "waiting", "via", "url")]
    for i in state.get("instances") or []:
        kv = i.get("kv") or {}
        rows.append((_s(i.get("instance")), _s(i.get("state")), _s(i.get("restarts")), _s(i.get("inflight")),
                     _s(kv.get("capacity_blocks")), _s(kv.get("used_blocks")), _s(kv.get("queued_blocks")),
                     _s(kv.get("running")), _s(kv.get("waiting")), _s(kv.get("source")), _s(i.get("url"))))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    el = state.get("elastic")
    if isinstance(el, dict):   # an elastic fleet: its bounds, engines per state and the last decision
        last = el.get("last") or {}
        lines.append(f"elastic  {_s(el.get('min_instances'))} to {_s(el.get('max_instances'))} engines  "
                     + " ".join(f"{k} {v}" for k, v in sorted((el.get("engines") or {}).items()))
                     + f"  last {_s(last.get('action'))}  demand/reach {_s(last.get('ratio_up'))}"
                     + (f"  ({last['reason']})" if last.get("reason") else ""))
    lever = (state.get("drop") or {}).get("lever") if isinstance(state.get("drop"), dict) else None
    if isinstance(lever, dict):   # the fleet's lever order (policy.levers): what it pulled last and why
        lines.append(f"levers   last {_s(lever.get('lever'))}  remap room {_s(lever.get('room_blocks'))} blocks"
                     f"  drop need {_s(lever.get('need_blocks'))} blocks"
                     + (f"  ({lever['reason']})" if lever.get("reason") else ""))
    for i in state.get("instances") or []:
        eng = (i.get("kv") or {}).get("engine")
        if isinstance(eng, dict) and eng.get("layers"):
            lines += [f"instance {i.get('instance')}: phase {_s(eng.get('phase'))}"] + _layers(eng["layers"])
    evs = [{**e, "time": e.get("t")} for e in state.get("events") or [] if isinstance(e, dict)]
    evs.sort(key=lambda e: e.get("time") or 0)
    return "\n".join(lines + _events(evs, events))


def render_models(state: dict, events: int = 10) -> str:
    """A multi-model ``kunserve serve``'s status: the memory of each host and who holds it, then each
    model's front end."""
    ten = state.get("tenancy") or {}
    lines = []
    if ten:
        for host, h in (ten.get("hosts") or {}).items():
            lines.append(f"host {host}  budget {human_bytes(h.get('budget_bytes'))}  free {human_bytes(h.get('free_bytes'))}")
        rows = [("engine", "active", "held", "home", "lent", "borrowed", "blocks", "demand")]
        models = ten.get("models") or {}
        for key, e in (ten.get("engines") or {}).items():
            m = models.get(key.split("#", 1)[0]) or {}
            rows.append((key, "yes" if m.get("active") else "no", human_bytes(e.get("held_bytes")),
                         human_bytes(e.get("home_bytes")), _s(e.get("lent")),
                         _s(e.get("borrowed_blocks")) + (" (repaying)" if e.get("repaying") else ""),
                         _s(e.get("blocks")), _s(e.get("demand"))))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    else:
        lines.append("memory moves between models: off (stock engines: a static split)")
    parts = ["\n".join(lines)]
    parts += [f"model {name}\n" + render_fleet(st, events) for name, st in (state.get("models") or {}).items()]
    return "\n\n".join(parts)


def render(state: dict, events: int = 10, now: float | None = None) -> str:
    """The state as text: one engine, a ``kunserve serve`` front end (of one model or several), or each
    of ``engines``."""
    if isinstance(state.get("models"), dict) and "tenancy" in state:
        return render_models(state, events)
    if isinstance(state.get("instances"), list) and "dispatch" in state:
        return render_fleet(state, events)
    engines = state.get("engines")
    if isinstance(engines, list) and engines and all(isinstance(e, dict) for e in engines):
        head = {k: v for k, v in state.items() if k != "engines" and not isinstance(v, (dict, list))}
        parts = ["  ".join(f"{k} {_s(v)}" for k, v in head.items()) or f"{len(engines)} engines"]
        parts += [render_engine(e, events, now) for e in engines]
        return "\n\n".join(parts)
    return render_engine(state, events, now)
