"""The operator's operations, ``POST /kunserve/ops/{op}``: one handler per operation, each with its
own validation.

    kill       {"instance"} or {"request_id"}: hard-kill an engine (fault drill)
    migrate    {"request_id", "to" (default: dispatch's choice), "method": "kv"|"reprefill",
                "at_token": N (once N tokens were sent), "wait_s": S (wait for a request id not yet arrived)}
    dispatch   {"mode"}: switch the dispatch policy at run time
    drop       {"instances": [i, j, ...], "transition": "kv"|"reprefill"}: form a pipeline group now
    restore    {"group": id (default: every group), "step": bool}: split it (with step: a group of four
               or more into halves, keeping every request's KV)
    auto       {"enable": bool}: let the monitor drop and restore by itself, or stop it (operations
               forced by the operator work either way)

A handler takes the front end (``cluster.frontend.app.FrontEnd``) and the request's JSON object and
returns the answer's JSON object, or raises :class:`BadRequest`: 400 for a parameter it cannot take,
404 for a request that is not in flight, 409 for an operation the fleet cannot do now. :func:`run_op`
picks the handler (404 for an unknown operation); the app checks the token and parses the body first.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from vllm_kunserve.cluster.control.groups import GroupOpError
from vllm_kunserve.cluster.frontend.relay import Move
from vllm_kunserve.cluster.frontend.validate import BadRequest
from vllm_kunserve.policy.dispatch import get_policy

__all__ = ["OPS", "auto", "dispatch", "drop", "kill", "migrate", "restore", "run_op"]

Handler = Callable[[Any, dict], Awaitable[dict]]


def _instance(value: Any, n: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n


async def kill(front: Any, body: dict) -> dict:
    """Hard-kill the engine ``instance``, or the one serving ``request_id`` (found in the kill's own
    turn); answers with the requests it interrupts, read in the same event-loop turn as the kill."""
    n = len(front.fleet.engines)
    if "request_id" in body:  # the engine serving this request, found in the kill's own turn
        key = body["request_id"]
        if not isinstance(key, str) or not key:  # None would match a flight not yet started
            raise BadRequest(f"request_id must be a non-empty string, got {key!r}", param="request_id")
        f = front.find(key)
        if f is None:
            raise BadRequest(f"no request {key!r} in flight", param="request_id", status=404, kind="NotFoundError")
        i = f.instance
    else:
        i = body.get("instance")
    if not _instance(i, n):
        raise BadRequest(f"instance must be an integer 0..{n - 1}, got {i!r}", param="instance")
    # what the kill interrupts, read in the same event-loop turn as the kill itself
    hit = [{"id": f.visible_id or f.rid, "generated": len(f.generated), "movable": f.checked.movable}
           for f in front.flights.values() if f.instance == i]
    try:
        front.fleet.kill(i)
    except NotImplementedError as e:   # an attached engine (started elsewhere)
        raise BadRequest(str(e), param="instance", status=409, kind="ConflictError") from None
    front.record("kill", instance=i, in_flight=len(hit))
    return {"killed": i, "in_flight": hit}


async def migrate(front: Any, body: dict) -> dict:
    """Move the request ``request_id`` (waiting up to ``wait_s`` for it to arrive) to ``to`` (default:
    where dispatch would send it) by ``method``, once ``at_token`` tokens were sent."""
    n = len(front.fleet.engines)
    key = body.get("request_id")
    wait = body.get("wait_s", 0)
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= 600:
        raise BadRequest(f"wait_s must be a number of seconds 0..600, got {wait!r}", param="wait_s")
    f = front.find(key)
    if f is None and wait and isinstance(key, str):  # a request about to arrive
        waiter = front.arrivals.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(waiter.wait(), wait)
        except asyncio.TimeoutError:
            front.arrivals.pop(key, None)
        f = front.by_visible.get(key)
    if f is None:
        raise BadRequest(f"no request {body.get('request_id')!r} in flight", param="request_id", status=404,
                         kind="NotFoundError")
    to, method = body.get("to"), body.get("method", "reprefill")
    if to is None:  # away from where it runs, to where dispatch would send it
        to = await front.pick(f, {f.instance})
    if not _instance(to, n) or to == f.instance:
        raise BadRequest(f"to must be an instance 0..{n - 1} other than {f.instance}, got {to!r}", param="to")
    if method not in ("kv", "reprefill"):
        raise BadRequest(f"method must be kv or reprefill, got {method!r}", param="method")
    at = body.get("at_token", 0)
    if not isinstance(at, int) or isinstance(at, bool) or at < 0:
        raise BadRequest(f"at_token must be an integer >= 0, got {at!r}", param="at_token")
    if not f.checked.movable:
        raise BadRequest("this request cannot move (only single streamed sequences without logprobs, "
                         "echo, tools or structured output)", status=409, kind="ConflictError")
    f.move = Move(to, method, "operator", at)
    return {"request_id": f.visible_id or f.rid, "from": f.instance, "to": to,
            "method": method, "generated": len(f.generated), "at_token": at}


async def dispatch(front: Any, body: dict) -> dict:
    """Switch the dispatch policy to ``mode``; a periodic one (MELL) needs the migration planner."""
    mode = body.get("mode")
    try:
        policy = get_policy(mode)
    except ValueError as e:
        raise BadRequest(str(e), param="mode") from None
    if policy.periodic and front.plan_migrations is None:
        raise BadRequest(f"{mode} needs the migration planner: start with --dispatch {mode}", param="mode")
    old, front.dispatch = front.dispatch, mode
    front.migrating = policy.periodic
    front.record("dispatch", old=old, new=mode)
    return {"dispatch": mode, "was": old}


def _controller(front: Any):
    """The group controller (409 where the fleet has none)."""
    if front.groups is None:
        raise BadRequest("cluster drop needs kunserve engines (start with --kunserve-config)",
                         status=409, kind="ConflictError")
    return front.groups


def _groups(front: Any):
    """The group controller, if a group operation can start now (409 otherwise)."""
    groups = _controller(front)
    if groups.busy:
        raise BadRequest("a group operation is in progress", status=409, kind="ConflictError")
    return groups


async def drop(front: Any, body: dict) -> dict:
    """Form one pipeline group of ``instances`` now (their ongoing requests cross over by ``transition``);
    live groups named whole among them regroup (their KV kept; dissolved where that fails), one named in
    part is a 409."""
    groups = _groups(front)
    n = len(front.fleet.engines)
    members = body.get("instances")
    if not (isinstance(members, list) and len(members) >= 2 and all(_instance(i, n) for i in members)):
        raise BadRequest(f"instances must list two or more instances 0..{n - 1}, got {members!r}",
                         param="instances")
    transition = body.get("transition")
    if transition not in (None, "kv", "reprefill"):
        raise BadRequest(f"transition must be kv or reprefill, got {transition!r}", param="transition")
    try:
        return await groups.form(members, transition=transition)
    except GroupOpError as e:
        raise BadRequest(str(e), status=409, kind="ConflictError") from None


async def restore(front: Any, body: dict) -> dict:
    """Split the group ``group`` (default: every grouped group); with ``step`` that group (of four or
    more) into halves."""
    groups = _groups(front)
    gid, step = body.get("group"), body.get("step", False)
    if gid is not None and (not isinstance(gid, int) or isinstance(gid, bool)):
        raise BadRequest(f"group must be a group id, got {gid!r}", param="group")
    if not isinstance(step, bool):
        raise BadRequest(f"step must be true or false, got {step!r}", param="step")
    if step and gid is None:
        raise BadRequest("a step down names its group", param="group")
    try:
        return {"restoring": await groups.restore(gid, step=step)}
    except GroupOpError as e:
        raise BadRequest(str(e), status=409, kind="ConflictError") from None


async def auto(front: Any, body: dict) -> dict:
    """Switch the monitor's own drops and restores on or off (``enable``); switched on, it starts from
    a fresh demand history (no hold carried over from before)."""
    groups = _controller(front)
    enable = body.get("enable")
    if not isinstance(enable, bool):
        raise BadRequest(f"enable must be true or false, got {enable!r}", param="enable")
    if groups.cfg.drop.static_group:
        raise BadRequest("a static group (drop.static_group) is formed once and never restored: the monitor "
                         "has nothing to switch", status=409, kind="ConflictError")
    was = groups.set_auto(enable)
    front.record("auto", old=was, new=enable)
    return {"auto": enable, "was": was}


#: every operation by name
OPS: dict[str, Handler] = {"auto": auto, "dispatch": dispatch, "drop": drop, "kill": kill, "migrate": migrate,
                           "restore": restore}


async def run_op(front: Any, op: str, body: dict) -> dict:
    """The answer of operation ``op`` (404 for an operation that does not exist)."""
    handler = OPS.get(op)
    if handler is None:
        raise BadRequest(f"unknown operation {op!r}; known: {', '.join(sorted(OPS))}", status=404,
                         kind="NotFoundError")
    return await handler(front, body)
