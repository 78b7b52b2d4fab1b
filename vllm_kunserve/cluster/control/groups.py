"""Cluster drop in a running fleet: the monitor's decisions executed through the engines' control ports.

Each monitor period, :class:`GroupController` builds the policies' cluster snapshot from the
engines' control-port states (``policy.inputs.cluster_input``) and runs the controller the
simulator runs, ``policy.monitor.monitor_tick``: whether KV demand (used + queued blocks, plus the
trend forecast) exceeds capacity and, if so, which lone instances to merge (``policy.drop.
plan_drop``), or whether a group splits (``policy.restore``). This module only carries the decision
out: every new group is formed by calling ``group_join`` on all its members at once (they meet at
barriers over their stage links, exchange the KV of the layers changing hands and resume as one
pipeline); a split is ``group_leave`` ``begin``, which retires the blocks above each member's base
(live ones drain as their requests finish), then ``finish``, which gives the layers back from the
host copies and returns each peer's KV. With ``drop.regroup`` a group of four or more may split
step by step (the restore's halves): each member drains to its count in its half, then all
restage at once into the halves keeping every request's KV (:meth:`_finish_step`). With ``drop.regroup`` a plan may merge live groups into a
larger one (and an operator's drop may name whole live groups with more instances): every member,
the lone instances in the merge too, restages at once (``group_restage``: each moves to its new
stage, for a grouped member a sub-range of the layers it holds, and each request owner's KV of each
layer moves to its new holder, nothing recomputed); where that fails, or the transition is
re-prefill, each merged group's members abandon it (layers back from the host copies, their
requests recomputed) and the larger group forms as from lone instances; where that fails too the
members serve alone, every request kept. Every step is an
event with its inputs, decision, duration and bytes (``/kunserve/status``, logs, ``kunserve:``
metrics). When no plan frees enough, the engines keep vLLM's own KV-centric handling (queueing,
preemption) for the rest and the shortfall is a metric.
Operators can force both directions (``/kunserve/ops/drop``, ``/kunserve/ops/restore``, a step down
with ``step``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import aiohttp

from vllm_kunserve.cluster.control.client import ControlClient, ControlPortError
from vllm_kunserve.engine.state import EngineState, EngineStateError
from vllm_kunserve.policy.drop import balanced_stages
from vllm_kunserve.policy.inputs import cluster_input
from vllm_kunserve.policy.levers import LeverState, decide_levers
from vllm_kunserve.policy.restore import halves

logger = logging.getLogger("kunserve.groups")


class GroupOpError(RuntimeError):
    pass


class RegroupError(GroupOpError):
    """A regroup's first step failed: not retried by re-prefill (a member is not at its base)."""


class RestageError(GroupOpError):
    """A regroup keeping the KV failed: every member has abandoned its group (requests recomputed)."""


@dataclass
class Group:
    gid: int
    members: list[int]
    stages: dict[int, tuple[int, int]]
    state: str = "forming"   # forming | grouped | leaving | split | failed
    since: float = field(default_factory=time.time)
    reason: str = ""
    source: str = ""         # where a leave takes the weights back from (the restore decision's; "": config)
    leaves: int = 0          # leave attempts (each has its own id)
    # a step down (the restore's halves, drop.regroup): the smaller groups, each member's (lo, hi) there
    # and its block count there (what it drains to before restaging); None: a leave to lone instances
    step: dict | None = None

    def view(self) -> dict:
        return {"id": self.gid, "members": self.members, "state": self.state, "reason": self.reason,
                "stages": {str(i): list(r) for i, r in self.stages.items()}, "since": self.since,
                **({"into": self.step["into"]} if self.step and self.state == "leaving" else {})}


def member_name(instance: int) -> str:
    return f"e{instance}"


def host_of(state: EngineState) -> str:
    """The host an engine groups by (its agent's ``engine.host``: the machine, or its Ray node); "" unknown."""
    return str(state.engine.get("host") or "")


class GroupController:
    """Forms and splits pipeline groups of a fleet (one per front end)."""

    def __init__(self, front: Any, cfg: Any, auto: bool = True, timeout_s: float = 60.0) -> None:
        self.front = front
        self.cfg = cfg
        self.auto = auto and cfg.drop.enable
        self.timeout_s = timeout_s
        self.groups: list[Group] = []
        self.lstate = LeverState()  # the monitor's demand and request-mix history, restore hold, remap wait
        self.clock: Callable[[], float] = time.monotonic  # the snapshots' now_s
        self.busy = False
        self.last: dict = {}
        self.peak_ratio = 0.0  # the highest (demand + forecast) / capacity seen (status, diagnosis)
        self.compute_bound = False  # over the trigger with a prefill-heavy queue: no drop (an event on change)
        self._ids = 0
        from prometheus_client import Counter, Gauge

        r = front.registry
        self.m_ops = Counter("kunserve:group_ops", "Pipeline-group operations", ["op", "outcome"], registry=r)
        self.m_shortfall = Gauge("kunserve:kv_shortfall_blocks",
                                 "KV blocks no drop plan could free (for an autoscaler)", registry=r)
        self.m_lever = Counter("kunserve:lever_decisions", "The fleet controller's lever decisions (policy.levers): "
                               "remap (a due drop waits for the engines' own remap), drop, restore", ["lever"], registry=r)
        self.m_grouped = Gauge("kunserve:grouped_instances", "Instances in a pipeline group", registry=r)
        self.m_layers = Gauge("kunserve:layers_held", "Decoder layers held per instance", ["instance"], registry=r)

    def set_auto(self, enable: bool) -> bool:
        """Let the monitor drop and restore by itself (or not), whatever ``drop.enable`` said at start;
        returns the previous setting. Switched on, the monitor starts over from an empty demand history."""
        was, self.auto = self.auto, enable
        if enable and not self.cfg.drop.enable:   # the policy reads drop.enable too
            self.cfg = replace(self.cfg, drop=replace(self.cfg.drop, enable=True))
        if enable and not was:
            self.lstate = LeverState()
        return was

    # -- state ----------------------------------------------------------------------------------------
    def group_of(self, instance: int) -> Group | None:
        return next((g for g in self.groups if instance in g.members and g.state != "split"), None)

    def view(self) -> list[dict]:
        return [g.view() for g in self.groups if g.state != "split"][-50:]

    def _states(self) -> dict[int, EngineState]:
        """The members' states from the monitor's last period (as it parsed them)."""
        out = {}
        for i, r in self.front.monitor.reports.items():
            if r.ok and r.state:
                es = getattr(r, "engine_state", None)
                out[i] = es if es is not None else EngineState.from_dict(r.state)
        return out

    def snapshot(self, states: dict[int, EngineState]):
        members = [i for i, s in states.items() if s.engine.stage]
        if not members:
            return None
        rows = []
        for i in members:
            s = states[i]
            g = self.group_of(i)
            held = g.stages.get(i) if g else None
            rows.append({"instance_id": i, "capacity_blocks": s.capacity.blocks_total or 0,
                         "used_blocks": s.blocks.used or 0, "queued_blocks": s.blocks.queued or 0,
                         "held": held, "healthy": self.front.fleet.engines[i].accepting,
                         "base_blocks": s.capacity.blocks_base or 0, "max_blocks": s.capacity.blocks_max or 0,
                         "prompt_tokens": s.requests.mix_prompt_tokens or 0,
                         "output_tokens": s.requests.mix_output_tokens or 0,
                         "host": host_of(s),
                         # the front end's own count: requests it relays there that have had no token yet
                         "awaiting_first_token": self.front.book.tally(i, s.capacity.block_size or 16).awaiting})
        s0 = states[members[0]]
        layer_bytes = max(x.bytes or 0 for x in s0.layers)
        groups = [tuple(g.members) for g in self.groups if g.state in ("forming", "grouped", "leaving")]
        grouped = {i for g in groups for i in g}
        groups += [(i,) for i in members if i not in grouped]
        return cluster_input(num_layers=len(s0.layers), layer_bytes=layer_bytes,
                             block_bytes=s0.capacity.block_bytes, block_size=s0.capacity.block_size,
                             rows=rows, groups=groups, now_s=self.clock())

    @staticmethod
    def remap_room(states: dict[int, EngineState]) -> dict[int, float]:
        """Bytes each engine's own remap could still give its KV (what it publishes; 0 where its
        remap is off, it is grouped, draining or lends memory)."""
        return {i: float(s.remap_room_bytes or 0) for i, s in states.items()}

    # -- the monitor's listener -----------------------------------------------------------------------
    async def on_poll(self, reports: dict) -> None:
        if self.busy:
            return
        states = self._states()
        for i in self.front.monitor.reports:
            st = states.get(i)
            if st:
                self.m_layers.labels(str(i)).set(sum(1 for x in st.layers if x.state != "dropped"))
        self.m_grouped.set(sum(len(g.members) for g in self.groups if g.state in ("grouped", "leaving")))
        for i, st in states.items():   # grouped with no live group (its peer died, or a partial join)
            if st.phase in ("grouped", "group_draining") and self.group_of(i) is None \
                    and self.front.fleet.engines[i].accepting:
                await self._abandon(i, "its group is gone")
        for g in [g for g in self.groups if g.state == "leaving"]:
            if all(i in states and states[i].phase == "group_draining" and not states[i].blocks.draining
                   for i in g.members):
                await (self._finish_step(g) if g.step else self._finish_leave(g))
        if self.cfg.drop.static_group:
            await self._static(states)
            return
        if not self.auto:
            return
        snap = self.snapshot(states)
        if snap is None:
            return
        waiting_since = self.lstate.monitor.deferred_since   # a due drop already waiting for first tokens
        remap_since = self.lstate.remap_since                 # a due drop already waiting for the engines' remap
        lever, self.lstate = decide_levers(snap, self.lstate, self.cfg.drop, self.cfg.restore,
                                           remap_room=self.remap_room(states))
        dec = lever.monitor
        report = dec.overload
        self.peak_ratio = max(self.peak_ratio, report.ratio)
        self.last = {"overload": report.to_dict(), "peak_ratio": self.peak_ratio}
        if report.compute_bound != self.compute_bound:
            self.compute_bound = report.compute_bound
            self.front.record("compute_bound" if report.compute_bound else "compute_bound_over",
                              ratio=round(report.ratio, 3), decode_share=round(report.decode_share, 3),
                              min_decode_share=self.cfg.drop.min_decode_share)
        if dec.deferred:
            self.last["deferred"] = dec.deferred
            if waiting_since is None:   # an event when a deferral starts
                self.front.record("drop_deferred", reason=dec.deferred, ratio=round(report.ratio, 3),
                                  max_s=self.cfg.drop.defer_for_first_token_s)
        self.last["lever"] = lever.to_dict()
        if lever.lever == "remap":
            if remap_since is None:   # an event when the wait starts
                self.front.record("lever", lever="remap", reason=lever.reason, ratio=round(report.ratio, 3),
                                  room_blocks=round(lever.room_blocks), need_blocks=round(lever.need_blocks))
                self.m_lever.labels("remap").inc()
            return
        if dec.action == "drop":  # live groups are in the plan only with drop.regroup (form re-forms them)
            if dec.drop.groups:
                self.front.record("lever", lever="drop", reason=lever.reason or "overload",
                                  ratio=round(report.ratio, 3), room_blocks=round(lever.room_blocks),
                                  need_blocks=round(lever.need_blocks))
                self.m_lever.labels("drop").inc()
            plan = dec.drop
            self.m_shortfall.set(max(0.0, plan.shortfall_bytes / snap.model.block_bytes))
            self.last["plan"] = plan.to_dict()
            for gp in plan.groups:
                await self.form(list(gp.instances), reason="overload", inputs=report.to_dict(),
                                decision=plan.to_dict(),
                                stages={st.instance_id: (st.layer_start, st.layer_end) for st in gp.stages})
            return
        self.m_shortfall.set(0)
        if dec.restore is None:
            return
        decision = dec.restore
        self.last["restore"] = decision.to_dict()
        if decision.restore:
            self.m_lever.labels("restore").inc()
        for r in decision.restore:
            g = next((g for g in self.groups if set(g.members) == set(r.instances) and g.state == "grouped"), None)
            if g is not None:
                g.source = r.source
                g.step = {"into": [list(p) for p in r.into], "stages": {i: (lo, hi) for i, lo, hi in r.stages},
                          "blocks": dict(r.blocks)} if r.into else None
                await self.begin_leave(g, reason=r.reason, decision=decision.to_dict())

    async def _static(self, states: dict[int, EngineState]) -> None:
        """``drop.static_group``: one group of every instance of a host, formed once all are up,
        never split by the monitor (a member's death still splits it; it is formed again when all
        are back)."""
        if any(g.state != "split" for g in self.groups):
            return
        engines = self.front.fleet.engines
        members = sorted(i for i, s in states.items() if s.engine.stage)
        if len(members) < 2 or len(members) != len(engines) or not all(e.accepting for e in engines):
            return
        by_host: dict[str, list[int]] = {}
        for i in members:
            by_host.setdefault(host_of(states[i]), []).append(i)
        for host_members in by_host.values():
            if len(host_members) < 2:
                continue
            try:
                await self.form(host_members, reason="static")
            except GroupOpError as exc:
                logger.warning("static group of %s not formed: %s", host_members, exc)

    # -- operations -------------------------------------------------------------------------------------
    def _client(self) -> ControlClient:
        return ControlClient(self.front.token)

    async def _op(self, instance: int, op: str, body: dict, timeout_s: float) -> dict:
        e = self.front.fleet.engines[instance]
        if not e.control_url:
            raise GroupOpError(f"instance {instance} has no control port (a stock engine cannot join a group)")
        try:
            return await self._client().op(self.front.session, e.control_url, op, body, timeout_s=timeout_s + 30)
        except ControlPortError as exc:
            raise GroupOpError(f"instance {instance} {op}: {exc.status} {exc.body}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:   # the engine died or hung
            raise GroupOpError(f"instance {instance} {op}: no answer ({type(exc).__name__}: {exc})") from None

    async def _abandon(self, instance: int, reason: str) -> None:
        """Tell a member grouped with no one to take its layers back from the host copies now
        (``group_leave`` ``abandon``; it recomputes its requests). Best effort: where the call
        fails, the orphan rule of a later period asks again, and its next step finding the peer
        gone abandons by itself."""
        try:
            await self._op(instance, "group_leave", {"step": "abandon", "reason": reason[:300]}, self.timeout_s)
        except GroupOpError as exc:
            logger.warning("instance %s could not abandon its group (%s): %s", instance, reason[:120], exc)

    async def _fresh_states(self, members: list[int]) -> dict[int, EngineState]:
        """Every member's state, read at once (a transition waits for the slowest read, not their sum)."""
        for i in members:
            e = self.front.fleet.engines[i]
            if not e.accepting or not e.control_url:
                raise GroupOpError(f"instance {i} is not a live group member")

        async def one(i: int) -> EngineState:
            try:
                st = await self._client().state(self.front.session, self.front.fleet.engines[i].control_url)
            except EngineStateError as exc:
                raise GroupOpError(f"instance {i}: {exc}") from None
            except (ControlPortError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                raise GroupOpError(f"instance {i}: its state: {type(exc).__name__}: {exc}") from None
            if not st.engine.stage:
                raise GroupOpError(f"instance {i} has no stage link (not started as a group member)")
            return st

        return dict(zip(members, await asyncio.gather(*(one(i) for i in members))))

    async def form(self, members: list[int], reason: str = "forced", inputs: dict | None = None,
                   decision: dict | None = None, transition: str | None = None,
                   stages: dict[int, tuple[int, int]] | None = None) -> dict:
        """Form one group of ``members``, each holding its range of ``stages`` (the drop plan's;
        default: balanced ranges in pipeline order, :meth:`_ranges`). ``transition``: how ongoing
        requests cross over, ``kv`` (their KV of the layers changing hands moves, the default) or
        ``reprefill`` (they are recomputed); a failed KV exchange is retried once by re-prefill.
        Members already in live groups regroup: each such group must lie wholly inside ``members``;
        with ``kv`` every member restages keeping the KV (:meth:`_restage`), else, or where that
        fails, the groups are dissolved first (:meth:`_dissolve`)."""
        transition = transition or self.cfg.drop.transition
        try:
            return await self._form(members, reason, inputs, decision, transition, stages)
        except GroupOpError as exc:
            if transition != "kv" or isinstance(exc, RegroupError):
                raise
            logger.warning("group of %s: KV exchange failed; forming by re-prefill instead", members)
            return await self._form(members, reason + "+fallback", inputs, decision, "reprefill", stages)

    async def _form(self, members: list[int], reason: str, inputs: dict | None, decision: dict | None,
                    transition: str, stages: dict[int, tuple[int, int]] | None = None) -> dict:
        members = sorted(set(members))
        if len(members) < 2:
            raise GroupOpError("a group needs at least two instances")
        states = self._states()
        hosts = {i: host_of(states[i]) for i in members if i in states}
        if len(set(hosts.values())) > 1:   # the planner never asks this; an operator's drop may
            raise GroupOpError(f"instances {members} are on different hosts ({', '.join(f'{i}: {h}' for i, h in hosts.items())}): "
                               "a group's stage links are one host's (shared memory)")
        old = []
        for i in members:
            g = self.group_of(i)
            if g is None or g in old:
                continue
            if g.state != "grouped" or not set(g.members) <= set(members):
                raise GroupOpError(f"instance {i} is already in group {g.gid} ({g.state}, members {g.members}); "
                                   f"a larger group may take in a grouped group only whole")
            old.append(g)
        if len(old) == 1 and set(old[0].members) == set(members):
            raise GroupOpError(f"instances {members} already form group {old[0].gid}")
        self.busy = True
        t0 = time.perf_counter()
        merged = [g.members for g in old] or None
        try:
            if old and transition == "kv":
                try:
                    return await self._restage(old, members, reason, inputs, decision, stages, t0)
                except RestageError as exc:   # every member abandoned: the group forms from lone engines
                    logger.warning("regroup into %s keeping the KV failed (%s); forming it from lone engines",
                                   members, exc)
                    old = []
            if old:
                await self._dissolve(old, members)
            states = await self._fresh_states(members)
            L = len(states[members[0]].layers)
            ranges = self._ranges(members, L, stages)
            self._ids += 1
            g = Group(self._ids, members, ranges, reason=reason)
            self.groups.append(g)
            bodies = {}
            for i in members:
                lo, hi = ranges[i]
                peers = {member_name(j): {"stage": states[j].engine.stage[0],
                                          "blocks": states[j].capacity.blocks_total} for j in members if j != i}
                spans = [[ranges[j][0], ranges[j][1], member_name(j)] for j in members if j != i]
                bodies[i] = {"name": member_name(i), "drop": [x for x in range(L) if not lo <= x < hi],
                             "spans": spans, "peers": peers, "timeout_s": self.timeout_s, "transition": transition,
                             "join_id": f"g{g.gid}"}   # one id per attempt: an earlier attempt's barriers never match
            outs = await asyncio.gather(*(self._op(i, "group_join", bodies[i], self.timeout_s) for i in members),
                                        return_exceptions=True)
            failed = {i: repr(o) for i, o in zip(members, outs) if isinstance(o, BaseException)}
            if failed:
                g.state = "failed"
                self.m_ops.labels("join", "failed").inc()
                ok = [i for i in members if i not in failed]
                self.front.record("group_join", outcome="failed", group=g.gid, members=members, errors=failed,
                                  joined=ok, ms=round((time.perf_counter() - t0) * 1e3, 1))
                # members that joined while another failed (its last step failed after the exchange)
                # take their layers back from the host copies at once: their peer is not there to
                # drain with, so they recompute their requests instead
                for i in ok:
                    await self._abandon(i, f"partial join: {failed}")
                self.groups.remove(g)
                raise GroupOpError(f"group {g.gid} did not form: {failed}")
            g.state = "grouped"
            self.m_ops.labels("join", "ok").inc()
            return self._joined(g, ranges, reason, transition, merged, outs, t0, inputs, decision)
        finally:
            self.busy = False

    def _ranges(self, members: list[int], L: int, stages: dict[int, tuple[int, int]] | None) -> dict:
        """Each member's layer range: the plan's ``stages``, else balanced ranges in pipeline order,
        members of live groups by the first layer they hold now (two pairs merging then keep
        sub-ranges of what they hold: nothing is reloaded)."""
        if len(members) > L:
            raise GroupOpError(f"{len(members)} instances cannot share {L} layers")
        if stages:
            ranges = dict(stages)
        else:
            def held_lo(i: int) -> int:
                g = self.group_of(i)
                return g.stages[i][0] if g is not None and i in g.stages else 0
            order = sorted(members, key=lambda i: (held_lo(i), i))
            ranges = dict(zip(order, balanced_stages(L, len(members))))
        held = sorted(x for lo, hi in ranges.values() for x in range(lo, hi))
        if sorted(ranges) != members or held != list(range(L)):
            raise GroupOpError(f"stages {ranges} do not give each of {members} a share of the {L} layers")
        return ranges

    async def _restage(self, old: list[Group], members: list[int], reason: str, inputs: dict | None,
                       decision: dict | None, stages: dict[int, tuple[int, int]] | None, t0: float) -> dict:
        """A regroup keeping every request's KV: the ``old`` groups, and any lone instances among
        ``members``, become one group, every member called at once (``group_restage``); each moves
        to its new stage and the KV of each (request owner, layer) moves to its new holder, so
        nothing is recomputed. Where any member fails, every member ends alone: the failed ones by
        themselves (a grouped one abandons, a lone one rolls back), the others are told to abandon
        (their requests recomputed), and :class:`RestageError` says so."""
        try:
            states = await self._fresh_states(members)
            ranges = self._ranges(members, len(states[members[0]].layers), stages)
        except GroupOpError as exc:   # nothing asked of an engine: the groups stay, and no re-prefill retry
            raise RegroupError(f"regroup into {members}: {exc}") from None   # (it would dissolve them first)
        self._ids += 1
        g = Group(self._ids, members, ranges, reason=reason)
        self.groups.append(g)
        stage = {i: states[i].engine.stage[0] for i in members}
        grouped = {i for o in old for i in o.members}
        bodies = self._restage_bodies(members, [members], ranges, stage,
                                      {j: states[j].capacity.blocks_total for j in members}, grouped, f"g{g.gid}")
        outs = await asyncio.gather(*(self._op(i, "group_restage", bodies[i], self.timeout_s) for i in members),
                                    return_exceptions=True)
        for o in old:
            o.state, o.reason = "split", f"regrouped into group {g.gid}"
        failed = {i: repr(o) for i, o in zip(members, outs) if isinstance(o, BaseException)}
        ms = round((time.perf_counter() - t0) * 1e3, 1)
        common = {"groups": [o.gid for o in old], "members": [o.members for o in old], "into": members,
                  "lone": [i for i in members if all(i not in o.members for o in old)] or None,
                  "kept_kv": True, "ms": ms}
        if failed:
            g.state = "failed"
            self.groups.remove(g)
            for i in members:
                if i not in failed:
                    await self._abandon(i, f"the regroup failed on {sorted(failed)}")
            self.m_ops.labels("regroup", "failed").inc()
            self.front.record("group_regroup", outcome="failed", errors=failed, **common)
            raise RestageError(f"regroup into {members}: {failed}")
        g.state = "grouped"
        self.m_ops.labels("regroup", "ok").inc()
        self.m_ops.labels("join", "ok").inc()
        self.front.record("group_regroup", outcome="ok", recomputed={str(i): 0 for i in members},
                          moved_regions={str(i): o.get("moved_regions", 0) for i, o in zip(members, outs)}, **common)
        return self._joined(g, ranges, reason, "kv", [o.members for o in old], outs, t0, inputs, decision,
                            kept_kv=True)

    def _restage_bodies(self, members: list[int], parts: list, ranges: dict, stage: dict, blocks: dict,
                        grouped: set, restage_id: str) -> dict[int, dict]:
        """Each member's ``group_restage`` body: every one of ``members`` moves at once into its part
        of ``parts`` (one part: a regroup; the halves: a step down) on its range of ``ranges``, each
        request owner's KV of each layer held by the member of the owner's part that runs it.
        ``stage``: each member's stage address; ``blocks``: each member's count in its part (its
        peers size their regions for its KV by it); ``grouped``: the members the controller saw grouped."""
        name = {i: member_name(i) for i in members}
        part = {i: p for p in parts for i in p}
        order = {i: sorted(part[i], key=lambda j: ranges[j]) for i in members}
        holders = {name[o]: [[*ranges[j], name[j]] for j in order[o]] for o in members}
        return {i: {"name": name[i], "grouped": i in grouped,
                    "spans": [[*ranges[j], name[j]] for j in order[i] if j != i],
                    "peers": {name[j]: {"stage": stage[j], "blocks": blocks[j]} for j in part[i] if j != i},
                    "members": {name[j]: stage[j] for j in members}, "holders": holders,
                    "timeout_s": self.timeout_s, "restage_id": restage_id} for i in members}

    def _joined(self, g: Group, ranges: dict, reason: str, transition: str, regrouped: list | None,
                outs: list[dict], t0: float, inputs: dict | None, decision: dict | None, **extra) -> dict:
        """The ``group_join`` event of a group formed (by a join or a restage), recorded and returned."""
        members = g.members
        ev = {"group": g.gid, "members": members, "stages": {str(i): list(r) for i, r in ranges.items()},
              "reason": reason, "transition": transition, "regrouped": regrouped, **extra,
              "recomputed": {str(i): o.get("recomputed", 0) for i, o in zip(members, outs)},
              "ms": round((time.perf_counter() - t0) * 1e3, 1), "bytes": sum(o.get("bytes", 0) for o in outs),
              "blocks": {str(i): [o.get("blocks_before"), o.get("blocks_after")] for i, o in zip(members, outs)},
              # each engine's own time in the transition (the rest of "ms" is the front end's reads and the
              # engines' waits for a step to end) and its workers' steps
              "engine_ms": {str(i): o.get("ms") for i, o in zip(members, outs)},
              "worker_ms": {str(i): o.get("worker_ms") for i, o in zip(members, outs)},
              "inputs": inputs, "decision": decision}
        self.front.record("group_join", outcome="ok", **ev)
        return ev

    async def _dissolve(self, old: list[Group], members: list[int]) -> None:
        """The first step of a regroup: every member of the ``old`` groups abandons its group at
        once (its dropped layers come back from the host copies, its requests are recomputed, its KV
        shrinks to its base). Their requests stay where they are; the larger group then forms from
        lone instances. A member whose abandon fails is left to the orphan rule of a later period
        (it is grouped with no live group) and the regroup stops here: every member that abandoned
        serves alone."""
        t0 = time.perf_counter()
        ids = [i for g in old for i in g.members]
        why = f"regroup into {members}"
        outs = await asyncio.gather(*(self._op(i, "group_leave", {"step": "abandon", "reason": why}, self.timeout_s)
                                      for i in ids), return_exceptions=True)
        for g in old:
            g.state, g.reason = "split", why
        failed = {i: repr(o) for i, o in zip(ids, outs) if isinstance(o, BaseException)}
        outcome = "failed" if failed else "ok"
        self.m_ops.labels("regroup", outcome).inc()
        self.front.record("group_regroup", outcome=outcome, groups=[g.gid for g in old],
                          members=[g.members for g in old], into=members,
                          recomputed={str(i): o.get("recomputed", 0) for i, o in zip(ids, outs) if isinstance(o, dict)},
                          ms=round((time.perf_counter() - t0) * 1e3, 1), errors=failed or None)
        if failed:
            raise RegroupError(f"regroup into {members}: {failed}")

    async def begin_leave(self, g: Group, reason: str = "forced", decision: dict | None = None) -> dict:
        """Every member retires its blocks above its base, or for a step down (``g.step``) above its
        count in its smaller group; live ones drain as their requests finish (then the finish)."""
        def body(i: int) -> dict:
            return {"step": "begin", **({"blocks": g.step["blocks"][i]} if g.step else {})}
        outs = await asyncio.gather(*(self._op(i, "group_leave", body(i), self.timeout_s) for i in g.members),
                                    return_exceptions=True)
        g.state, g.reason = "leaving", reason
        self.front.record("group_leave", outcome="draining", group=g.gid, members=g.members, reason=reason,
                          into=g.step["into"] if g.step else None,
                          draining={str(i): (o.get("draining") if isinstance(o, dict) else repr(o))
                                    for i, o in zip(g.members, outs)}, decision=decision)
        return {"group": g.gid, "state": g.state}

    async def _finish_step(self, g: Group) -> None:
        """A step down, every member drained to its count in its smaller group: all restage at once
        (``group_restage``), each into its half keeping every request's KV (each owner's KV of each
        layer moves to the member of its half that runs the layer; layers a member takes back load
        from its host copy). Where any member fails, every member ends alone as a failed regroup
        does (its requests recomputed, none lost)."""
        t0 = time.perf_counter()
        self.busy = True
        try:
            states = await self._fresh_states(g.members)
            ranges = g.step["stages"]
            g.leaves += 1
            # grouped: a member that abandoned meanwhile (its engine alone now) refuses at once and tells
            # the others, rather than leaving them at the first barrier until the timeout
            bodies = self._restage_bodies(g.members, g.step["into"], ranges,
                                          {i: states[i].engine.stage[0] for i in g.members}, g.step["blocks"],
                                          set(g.members), f"g{g.gid}/step{g.leaves}")
            outs = await asyncio.gather(*(self._op(i, "group_restage", bodies[i], self.timeout_s)
                                          for i in g.members), return_exceptions=True)
        except GroupOpError as exc:   # a state read failed: nothing asked; a member's death splits it
            logger.warning("step down of group %s not started: %s", g.gid, exc)
            return
        finally:
            self.busy = False
        failed = {i: repr(o) for i, o in zip(g.members, outs) if isinstance(o, BaseException)}
        g.state = "split"
        common = {"group": g.gid, "members": g.members, "into": g.step["into"], "kept_kv": True,
                  "ms": round((time.perf_counter() - t0) * 1e3, 1)}
        if failed:
            for i in g.members:
                if i not in failed:
                    await self._abandon(i, f"the step down failed on {sorted(failed)}")
            self.m_ops.labels("step_down", "failed").inc()
            self.front.record("group_step_down", outcome="failed", errors=failed, **common)
            return
        for p in g.step["into"]:
            self._ids += 1
            self.groups.append(Group(self._ids, sorted(p), {i: tuple(ranges[i]) for i in p}, state="grouped",
                                     reason=f"step down of group {g.gid}"))
        self.m_ops.labels("step_down", "ok").inc()
        self.front.record("group_step_down", outcome="ok", groups=[x.gid for x in self.groups[-len(g.step["into"]):]],
                          blocks={str(i): [o.get("blocks_before"), o.get("blocks_after")]
                                  for i, o in zip(g.members, outs)},
                          moved_regions={str(i): o.get("moved_regions", 0) for i, o in zip(g.members, outs)},
                          engine_ms={str(i): o.get("ms") for i, o in zip(g.members, outs)}, **common)

    async def _finish_leave(self, g: Group) -> None:
        t0 = time.perf_counter()
        self.busy = True
        try:
            g.leaves += 1
            params = {"step": "finish", "timeout_s": self.timeout_s, "leave_id": f"g{g.gid}/leave{g.leaves}",
                      **({"source": g.source} if g.source else {})}
            outs = await asyncio.gather(*(self._op(i, "group_leave", params, self.timeout_s) for i in g.members),
                                        return_exceptions=True)
        finally:
            self.busy = False
        failed = {i: repr(o) for i, o in zip(g.members, outs) if isinstance(o, BaseException)}
        outcome = "failed" if failed else "ok"
        self.m_ops.labels("leave", outcome).inc()
        if not failed:
            g.state = "split"
        elif g.state == "split":
            pass   # forgotten meanwhile (a member died): the survivors abandon by the orphan rule
        elif len(failed) < len(g.members):
            # some members left, the others rolled back: those are grouped with no one; they take
            # their layers back from the host copies now
            for i in failed:
                await self._abandon(i, f"its peers left: {failed[i]}")
            g.state = "split"
        else:
            g.state = "grouped"   # rolled back on every member: still one group; a later restore retries
        ok = [o for o in outs if isinstance(o, dict)]
        self.front.record("group_leave", outcome=outcome, group=g.gid, members=g.members,
                          ms=round((time.perf_counter() - t0) * 1e3, 1), errors=failed or None,
                          bytes=sum(o.get("bytes", 0) for o in ok),
                          layers_from_peer=sum(o.get("layers_from_peer", 0) for o in ok),
                          layers_from_host=sum(o.get("layers_from_host", 0) for o in ok),
                          pipeline={str(i): o["pipeline"] for i, o in zip(g.members, outs)
                                    if isinstance(o, dict) and o.get("pipeline")} or None)

    async def restore(self, gid: int | None = None, step: bool = False) -> list[dict]:
        """An operator's restore: every member of group ``gid`` (default: of every group) alone, or
        with ``step`` group ``gid`` one step down into halves (``policy.restore.halves``)."""
        todo = [g for g in self.groups if g.state == "grouped" and (gid is None or g.gid == gid)]
        if gid is not None and not todo:
            raise GroupOpError(f"no grouped group {gid}")
        for g in todo:
            g.step = None
        if step:
            if gid is None or len(todo[0].members) < 4:
                raise GroupOpError("a step down names one group of four or more instances (a smaller one has no "
                                   "smaller group to step to: restore it whole)")
            g = todo[0]
            snap = self.snapshot(await self._fresh_states(g.members))
            parts, stages, blocks = halves(tuple(g.members), snap.by_id(), snap.model)
            g.step = {"into": [list(p) for p in parts], "stages": stages, "blocks": blocks}
        return [await self.begin_leave(g, reason="forced step" if step else "forced") for g in todo]

    def forget(self, instance: int) -> None:
        """An instance died: its group is gone (the survivors restore their own layers)."""
        g = self.group_of(instance)
        if g is not None:
            g.state = "split"
            g.reason = f"instance {instance} failed"
            self.front.record("group_lost", group=g.gid, members=g.members, failed=instance)
