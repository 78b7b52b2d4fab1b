"""Discrete-event engine: a heap of timed callbacks driving servers, arrivals and policy ticks.

Events at equal times run in insertion order (a sequence number breaks ties), so a run is fully
deterministic for a given trace, config and policy.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from vllm_kunserve.policy.transfer import Link, SharedLink
from vllm_kunserve.workload.models import ModelArch

from .hardware import GpuSpec, UnmapCost
from .request import Req
from .server import INF_BLOCKS, Server
from .steptime import StepTime
from .trace import TraceRequest

if TYPE_CHECKING:
    from .policies.base import Policy


@dataclass
class SimConfig:
    model: ModelArch
    gpu: GpuSpec
    step_time: StepTime
    instances: int = 8
    gpu_mem_util: float = 0.9
    block_size: int = 16
    max_tokens: int = 8192          # max_num_batched_tokens per instance and step
    max_seqs: int = 1024            # max_num_seqs per instance
    kv_blocks: int | None = None    # per-instance KV capacity override (replaying a measured engine)
    runtime_reserve_bytes: int = int(1.5e9)  # CUDA graphs, workspaces, allocator slack
    link: Link = field(default_factory=lambda: Link(360e9, 8e-6, "nvlink"))
    pcie: Link = field(default_factory=lambda: Link(25e9, 10e-6, "pcie"))
    timeline_dt: float = 1.0
    max_sim_s: float = 1e7          # hard stop (a policy that cannot drain its queue)
    # concurrent bulk transfers leaving one instance share its port (policy.transfer.SharedLink);
    # False: every transfer has the whole link (the earlier model)
    contention: bool = False
    unmap: UnmapCost | None = None  # cost of unmapping dropped weights (None: free)
    # a recompute-preempted request resumes from its blocks still in vLLM's prefix cache
    # (Server.cached_blocks); False: it recomputes everything (the earlier model)
    prefix_cache: bool = False
    # a group's members keep their own requests (vllm-kunserve's pipeline groups: each member is an
    # engine with its own scheduler, queue and 1/k of the group's KV, the front end dispatching to
    # members); False: one scheduler over the pooled KV (the KunServe paper's group)
    member_queues: bool = False

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.model.kv_bytes_per_token

    def activation_reserve_bytes(self) -> int:
        m = self.model
        return (self.max_tokens * (6 * m.hidden + 3 * m.intermediate) * m.dtype_bytes
                + min(self.max_seqs, self.max_tokens) * m.vocab * 4)

    def base_kv_blocks(self) -> int:
        """KV blocks of one instance holding the whole model (vLLM's profile-and-fill rule)."""
        if self.kv_blocks is not None:
            return self.kv_blocks
        free = (self.gpu.mem_bytes * self.gpu_mem_util - self.model.param_bytes
                - self.activation_reserve_bytes() - self.runtime_reserve_bytes)
        blocks = int(free // self.block_bytes)
        if blocks < 1:
            raise ValueError(
                f"model {self.model.name} ({self.model.param_bytes / 1e9:.1f} GB) leaves no KV space on "
                f"{self.gpu.name} with {self.gpu.mem_bytes / 1e9:.0f} GB x {self.gpu_mem_util}")
        return blocks


class Simulator:
    def __init__(self, cfg: SimConfig, policy: Policy, trace: list[TraceRequest]):
        if cfg.instances < 1:
            raise ValueError(f"instances={cfg.instances}: need at least 1")
        self.cfg = cfg
        self.policy = policy
        self.trace = trace
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.base_blocks = policy.kv_blocks(cfg)  # the config's unless the policy changes it
        # decoder layers [start, end) each instance holds (all of them until a drop)
        self.layer_range = {i: (0, cfg.model.layers) for i in range(cfg.instances)}
        self._sid = itertools.count()
        self.servers: list[Server] = []
        self.reqs: list[Req] = []
        self.failed: list[Req] = []
        self.done = 0
        self.timeline: list[dict] = []
        self.events: list[dict] = []   # drops, restores, remaps, migrations
        self._tok = 0
        # (sum of bubble fractions, steps, idle stage-seconds, stage-seconds) of past groups
        self.group_steps: list[tuple[float, int, float, float]] = []
        self._arrived = 0
        # one port per instance (its NIC or NVLink port) when transfers contend
        self.ports = {i: SharedLink(cfg.link) for i in range(cfg.instances)} if cfg.contention else None
        for i in range(cfg.instances):
            self.servers.append(self.new_server((i,)))

    # ---- event plumbing ----------------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def log(self, kind: str, **kw) -> None:
        self.events.append({"t": round(self.now, 6), "kind": kind, **kw})

    # ---- transfers -------------------------------------------------------------------------------
    def bulk_time(self, src: int, nbytes: float) -> float:
        """Duration of a bulk transfer of ``nbytes`` leaving instance ``src``, started now: on its
        port, shared equally with the transfers already on it (``cfg.contention``; this one then
        slows them too), else alone on the link."""
        if nbytes <= 0:
            return 0.0
        if self.ports is None:
            return self.cfg.link.time_s(nbytes)
        return self.ports[src].time_s(self.now, nbytes)

    def chunk_time(self, src: int, nbytes: float) -> float:
        """Time of one ``nbytes`` message from ``src`` at the share it would get now (starts nothing)."""
        if self.ports is None:
            return self.cfg.link.time_s(nbytes)
        return self.ports[src].chunk_time_s(self.now, nbytes)

    def server_bulk_time(self, s: "Server", nbytes: float) -> float:
        """A transfer of ``nbytes`` held by server ``s``: a group's members each send their 1/k."""
        if self.ports is None or s.k == 1:
            return self.bulk_time(s.instances[0], nbytes)
        return max(self.bulk_time(i, nbytes / s.k) for i in s.instances)

    def unmap_time(self, nbytes: float) -> float:
        return self.cfg.unmap.time_s(nbytes) if self.cfg.unmap is not None else 0.0

    # ---- servers -----------------------------------------------------------------------------
    def capacity_blocks(self, instances: tuple[int, ...], layers: dict[int, tuple[int, int]] | None = None) -> int:
        """KV blocks of a server over ``instances`` holding ``layers`` (default: what they hold now)."""
        if self.policy.infinite_memory:
            return INF_BLOCKS
        m = self.cfg.model
        rng = layers or self.layer_range
        held = sum(rng[i][1] - rng[i][0] for i in instances)
        freed = (len(instances) * m.layers - held) * m.layer_bytes
        return len(instances) * self.base_blocks + int(freed // self.cfg.block_bytes)

    def new_server(self, instances: tuple[int, ...]) -> Server:
        c = self.cfg
        if c.member_queues and self.policy.preempt_mode != "recompute":
            raise ValueError("member_queues models recompute preemption only")
        max_seqs = c.max_seqs if self.policy.max_seqs is None else self.policy.max_seqs
        s = Server(next(self._sid), instances, self.capacity_blocks(instances), c.block_size, c.max_tokens,
                   max_seqs, c.step_time, self.policy.preempt_mode)
        act = c.model.activation_bytes_per_token()
        s.hop_time = lambda tokens: c.link.time_s(tokens * act)
        s.swap_time = lambda blocks: c.pcie.time_s(blocks * c.block_bytes)
        s.microbatcher = self.policy.microbatch
        s.peak_admission = self.policy.peak_admission and len(instances) > 1
        s.prefix_cache = c.prefix_cache
        s.members = c.member_queues and len(instances) > 1
        return s

    def kick(self, s: Server) -> None:
        """Start a step on an idle server that has work."""
        if s.busy or not s.alive or s.frozen or not s.has_work():
            return
        if self.now < s.stall_until:
            s.busy = True
            self.at(s.stall_until, self._unstall, s)
            return
        batch = s.schedule()
        if not batch:
            if not s.running and s.waiting:
                self._fail_head(s)
            return
        dt = s.cycle_time(batch)
        dt += (s.penalty_fn(dt) if s.penalty_fn else 0.0) + s.pending_io
        s.pending_io = 0.0
        s.busy = True
        s.steps += 1
        s.inflight = batch
        self.at(self.now + dt, self._step_done, s, batch)

    def _unstall(self, s: Server) -> None:
        s.busy = False
        self.kick(s)

    def _fail_head(self, s: Server) -> None:
        """The head request cannot fit even in an empty server: reject it like vLLM would."""
        r = s.waiting.popleft()
        r.swapped = False
        self.failed.append(r)
        self.log("reject", req=r.id, tokens=r.length, capacity_blocks=s.capacity)
        self.kick(s)

    def _step_done(self, s: Server, batch) -> None:
        now = self.now
        s.version += 1
        finished = []
        for r, n in batch:
            r.computed += n
            self._tok += n
            if r.computed >= r.prompt + r.generated:
                r.generated += 1
                r.last_tok_t = now
                if r.first_t is None:
                    r.first_t = now
                if r.generated >= r.output:
                    finished.append(r)
        if finished:
            fin = set(map(id, finished))
            s.running = [r for r in s.running if id(r) not in fin]
            for r in finished:
                self.policy.on_finish(self, r)
                s.used -= r.blocks
                r.blocks = 0
                r.finish_t = now
                r.finishes += 1
                r.server = None
                self.done += 1
        s.busy = False
        s.inflight = []
        self.policy.on_step_done(self, s)
        if s.frozen:
            self._maybe_transition()
        else:
            self.kick(s)

    # ---- arrivals ----------------------------------------------------------------------------
    def _arrive(self, r: Req) -> None:
        self._arrived += 1
        s = self.policy.dispatch(self, r)
        r.server = s
        if s.members:
            r.member = s.pick_member(r)
        s.waiting.append(r)
        self.kick(s)

    # ---- group transitions (drop / restore) ----------------------------------------------------
    _pending: list | None = None

    def transition(self, old: list[Server], new_groups: list[tuple[int, ...]],
                   layers: dict[int, tuple[int, int]],
                   stall_s: float | Callable[[], float], kind: str, recompute: tuple = ()) -> None:
        """Replace ``old`` servers by servers over ``new_groups`` once every old one ends its step.
        ``stall_s`` (seconds the new servers wait before their first step) may be a callable,
        evaluated at that moment (so transfers it starts begin when the transition happens).
        The running requests of the old servers in ``recompute`` lose their KV (a regroup, as the
        fleet carries it out) and queue to be computed again."""
        if self._pending is not None:
            return
        if any(s.frozen or not s.alive for s in old):
            return
        for s in old:
            s.frozen = True
        self._pending = [old, new_groups, layers, stall_s, kind, {id(s) for s in recompute}]
        self._maybe_transition()

    def _maybe_transition(self) -> None:
        if self._pending is None:
            return
        old, groups, layers, stall, kind, recompute = self._pending
        if any(s.inflight for s in old):
            return  # a step is still running; the last _step_done calls back here
        self._pending = None
        if callable(stall):
            stall = stall()
        running = sorted((r for s in old if id(s) not in recompute for r in s.running), key=lambda r: r.arrival)
        waiting = [r for s in old for r in s.waiting]
        recomputed = [r for s in old if id(s) in recompute for r in s.running]
        for r in recomputed:
            r.computed, r.blocks = 0, 0   # recomputed: queued with the waiting ones
            r.preempts += 1
            waiting.append(r)
        # the instance each request was on (a member's requests stay on it: member_queues)
        was_on = {id(r): s.instances[r.member if s.members else 0] for s in old for r in (*s.running, *s.waiting)}
        swapped = [r for r in waiting if r.swapped]
        for s in old:
            s.alive = False
            self.servers.remove(s)
            if s.k > 1 and s.steps:
                self.group_steps.append((s.bubble_sum, s.steps, s.stage_idle_s, s.stage_busy_s))
        self.layer_range.update(layers)
        new = [self.new_server(g) for g in groups]
        for s in new:
            s.stall_until = self.now + stall
            self.servers.append(s)

        def home(r) -> "Server | None":   # member_queues: the new server holding the request's instance
            if not self.cfg.member_queues:
                return None
            dst = next((s for s in new if was_on[id(r)] in s.instances), None)
            if dst is not None:
                r.member = dst.instances.index(was_on[id(r)]) if dst.members else 0
            return dst

        # running requests keep their KV: place each on the new server with the most free blocks
        for r in running:
            dst = home(r) or max(new, key=lambda s: s.free)
            if dst.free >= r.blocks:
                dst.running.append(r)
                dst.used += r.blocks
            else:  # cannot keep its KV anywhere: recompute later
                r.computed, r.blocks = 0, 0
                r.preempts += 1
                dst.waiting.append(r)
            r.server = dst
        for r in swapped:
            r.swapped = False  # host copy is re-read as a prefill after a regroup (rare)
            r.computed = 0
        for r in sorted(waiting, key=lambda r: r.arrival):
            dst = home(r) or min(new, key=lambda s: s.load())
            dst.waiting.append(r)
            r.server = dst
        self.log(kind, groups=[list(g) for g in groups], stall_s=round(stall, 6),
                 moved_running=len(running), moved_waiting=len(waiting), recomputed=len(recomputed))
        for s in new:
            s.busy = False
            self.kick(s)

    # ---- timeline ------------------------------------------------------------------------------
    def _sample(self) -> None:
        used = sum(s.used for s in self.servers)
        cap = sum(s.capacity for s in self.servers)
        self.timeline.append({
            "t": round(self.now, 3), "arrived": self._arrived, "done": self.done,
            "running": sum(len(s.running) for s in self.servers),
            "waiting": sum(len(s.waiting) for s in self.servers),
            "kv_used_blocks": used, "kv_capacity_blocks": cap if cap < INF_BLOCKS else None,
            "kv_demand_blocks": sum(s.demand_blocks() for s in self.servers),
            "tokens": self._tok, "servers": len(self.servers),
            "max_group": max(s.k for s in self.servers),
        })
        if self.done + len(self.failed) < len(self.reqs):
            self.at(self.now + self.cfg.timeline_dt, self._sample)

    def _tick(self) -> None:
        self.policy.on_tick(self)
        if self.done + len(self.failed) < len(self.reqs):
            self.at(self.now + self.policy.tick_s, self._tick)

    # ---- run -----------------------------------------------------------------------------------
    def run(self) -> "Simulator":
        self.reqs = [Req(t) for t in self.trace]
        for r in self.reqs:
            self.at(r.arrival, self._arrive, r)
        self.policy.setup(self)
        self.at(0.0, self._sample)
        if self.policy.tick_s:
            self.at(0.0, self._tick)
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            if t > self.cfg.max_sim_s:
                break
            self.now = t
            fn(*args)
        return self
