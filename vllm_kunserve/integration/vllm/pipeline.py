"""vLLM view: pipeline groups across independently started engines (KunServe cluster drop).

vLLM cannot re-form its pipeline-parallel groups at runtime, so a group is built here, between
the workers of engines that were started alone. Each member keeps a contiguous range of decoder
layers and drops the rest (``LayerResidency.join``: the dropped weights' memory becomes KV). Every
member keeps its own scheduler and requests; a step of member A runs A's layers locally and, at
the first layer of a span A dropped, hands the hidden states, the residual, the positions and the
step's attention metadata to the member that holds that span (``transfer.stage``: shared memory on
one host). That member runs the span with **A's KV for those layers**, which it holds in its own
memory indexed by A's block ids, and hands the result back; A finishes the step (final norm, logits,
sampling). The members' steps are the pipeline's microbatches: while B runs A's span, A's stage is
free for B's step, so with balanced load neither stage idles half the time, and no scheduler has
to hand requests to another at group formation or restore.

Numerics: the same layer runs the same kernels on the same inputs in the same batch, only in
another process, so greedy outputs are token-identical with and without the group.

Touchpoints (vLLM >= 0.32, < 0.34): a dropped decoder layer's ``forward`` (an instance attribute,
removed on restore); the worker's ``execute_model`` and ``sample_tokens`` (instance attributes:
they hold the process's compute lock, because vLLM's forward context is a module global and a
stage server thread runs peers' spans in the same process); ``vllm.forward_context.create_forward_context`` /
``override_forward_context``; each attention layer's ``kv_cache`` (swapped to the peer's KV
while its span runs); ``compilation_config.static_forward_context`` (attention layers by name); on CPU, the model
runner's ``attn_groups`` metadata builders and ``_custom_ops.cpu_attn_get_scheduler_metadata`` (a
peer's attention plan is made again in this process, see ``_local_metadata``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

import torch

from vllm_kunserve.engine.agent import PEER_LOST  # the agent recognises a lost peer by this marker
from vllm_kunserve.integration.vllm.attn_meta import AttentionMetadataError, localize
from vllm_kunserve.integration.vllm.worker_memory import decoder_layers
from vllm_kunserve.transfer.errors import PeerFailedError
from vllm_kunserve.transfer.stage import RemoteError, StageClient, StageServer, bulk_chunk_bytes

logger = logging.getLogger("vllm.kunserve")

#: one per process: vLLM's forward context is a module global, so a peer's span and this process's
#: own step never run at the same time (the step lets go of it while it waits for a peer)
COMPUTE = threading.Lock()

_BULK_BYTES = bulk_chunk_bytes("cpu")  # host-side chunk (the bulk connection's shared memory)


#: how long a step waits for a peer's span before declaring the peer lost
SPAN_TIMEOUT_S = 30.0


class Turn:
    """Whether this member's own microbatch is due at its stage, so a peer's span that finds the
    core free waits for it (at most ``turn_s``) instead of taking the core.

    A grouped member's microbatch leaves its stage only while it hops to the peer; in between steps
    (vLLM's engine core asks for the sampling in a second call about a millisecond after
    ``execute_model`` returns, then outputs and schedules the next step in a few milliseconds) it
    comes straight back. A peer's span that took the core in such a gap held this member's
    sampling or next step for a whole span while the peer's own stage had nothing to run: a
    *collision*, both microbatches at one stage (``benchmarks/common/pipeline_trace.py`` measures them). So the
    member marks its turn due from the end of a step until its next step hops (sampling due, then
    the next step expected within ``turn_s``), and a span waits for the turn to pass, at most
    ``turn_s``: the two stages alternate between their own microbatch and the peer's. ``turn_s``
    is ``KUNSERVE_STAGE_TURN_MS`` (default 8 ms; 0: off)."""

    def __init__(self, turn_s: float) -> None:
        self.turn_s = turn_s
        self._cv = threading.Condition()
        self._until = 0.0

    def due(self) -> None:
        """This member's own work comes next (a step ended, a sampling ended, a step is starting)."""
        if self.turn_s > 0:
            with self._cv:
                self._until = time.monotonic() + self.turn_s

    def away(self) -> None:
        """This member's microbatch left the stage (it hops) or its work failed: spans may run."""
        with self._cv:
            self._until = 0.0
            self._cv.notify_all()

    def is_due(self) -> bool:
        return time.monotonic() < self._until

    def wait(self) -> None:
        """Until the turn has passed, at most ``turn_s`` from now."""
        deadline = time.monotonic() + self.turn_s
        with self._cv:
            while True:
                left = min(self._until, deadline) - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(left)


def turn_s(raw: str) -> float:
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0 <= ms <= 1000:
        raise ValueError(f"KUNSERVE_STAGE_TURN_MS={raw!r}: a number of milliseconds in 0..1000")
    return ms / 1e3


#: this process's member's turn (one worker per process)
TURN = Turn(turn_s(os.environ.get("KUNSERVE_STAGE_TURN_MS", "8")))


#: a group transition's own fault points (test hooks, ``inject_fault``), beside the residency's
#: (``release``, ``foreign_create``, ``exchange``, ``kv_free`` on join; ``kv_shrink``, ``reload``,
#: ``kv_regrow``, ``exchange``, ``foreign_destroy`` on leave): the stage links opened (``connect``),
#: a member at the join's first barrier (``barrier``), each KV chunk sent (``kv_chunk``), the
#: committed join's last word (``grown``: the join completes with the peers' base), a member at the
#: leave's first barrier (``leave_barrier``), a member at a restage's first barrier (``restage_barrier``,
#: before any layer or region changed; the residency's steps follow)
GROUP_STEPS = ("connect", "barrier", "kv_chunk", "grown", "leave_barrier", "restage_barrier")


class GroupError(RuntimeError):
    pass


#: ``KUNSERVE_PIPELINE_TRACE=DIR``: every worker records when its steps, samplings, hops and the
#: peers' spans it serves start, get their core and end (``time.perf_counter``: CLOCK_MONOTONIC on
#: Linux, one clock for every process of the host), and what each step carried (requests, tokens,
#: prefill tokens). It writes them to ``DIR`` in parts as it goes (every ``_TRACE_PART_EVENTS``
#: events or ``_TRACE_PART_S`` seconds, a few ms each; so a group still formed when its engines
#: are stopped is traced too: vLLM kills the worker process at shutdown) and when its group
#: splits, for ``benchmarks/common/pipeline_trace.py`` (where a stage idles, what a prompt costs the group),
#: which joins a group's parts again.
_TRACE_DIR = os.environ.get("KUNSERVE_PIPELINE_TRACE", "")
_TRACE: list[tuple] = []
_TRACE_PART_EVENTS = 2000
_TRACE_PART_S = 5.0
_TRACE_LOCK = threading.Lock()
#: this process's member name in its latest group, that group's number here, the next part's and
#: when the latest part was written
_TRACE_AT = {"name": "", "group": 0, "part": 0, "written": 0.0}


def _trace(kind: str, *marks: float) -> None:
    if _TRACE_DIR:
        _TRACE.append((kind, *marks))
        if len(_TRACE) >= _TRACE_PART_EVENTS or time.perf_counter() - _TRACE_AT["written"] >= _TRACE_PART_S:
            _dump_trace()


def _trace_group(name: str) -> None:
    """A new group: its events go to parts of their own."""
    with _TRACE_LOCK:
        _TRACE_AT.update(name=name, group=_TRACE_AT["group"] + 1, part=0, written=time.perf_counter())


def _dump_trace() -> None:
    """Write the events traced since the last part (the stage server thread and the step's thread
    both trace: the part takes what was there, appends made meanwhile go to the next)."""
    if not _TRACE_DIR:
        return
    with _TRACE_LOCK:
        n = len(_TRACE)
        if not n:
            return
        events = _TRACE[:n]
        del _TRACE[:n]
        at = dict(_TRACE_AT, pid=os.getpid())
        _TRACE_AT["part"] += 1
        _TRACE_AT["written"] = time.perf_counter()
    name = at["name"] or "worker"
    path = os.path.join(_TRACE_DIR, f"{name}-{at['pid']}-g{at['group']}-{at['part']:05d}.json")
    try:
        os.makedirs(_TRACE_DIR, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"member": name, "pid": at["pid"], "group": at["group"], "part": at["part"],
                       "events": events}, f)
    except OSError as exc:  # a trace that cannot be written must not fail the step that wrote it
        _stop_tracing(f"KUNSERVE_PIPELINE_TRACE={_TRACE_DIR}: cannot write {path} ({exc}); tracing is off")


def _stop_tracing(why: str) -> None:
    global _TRACE_DIR
    logger.warning("kunserve: %s", why)
    _TRACE_DIR = ""
    _TRACE.clear()


class HopTimes:
    """Where a group's hops spend their time, over the group's life (the last ``keep`` hops): each
    hop's round trip from this worker, the peer's wait for its compute lock (its own step was
    running: pipeline queueing, not the link), the span's compute there, and what is left, the
    link itself (both copies through shared memory, the pickled headers, the wake-ups)."""

    FIELDS = ("round_trip_ms", "peer_wait_ms", "peer_span_ms", "link_ms")

    def __init__(self, keep: int = 4096) -> None:
        self.keep, self.count = keep, 0
        self.rows: list[tuple[float, float, float, float]] = []

    def add(self, round_trip_ms: float, peer_wait_ms: float, peer_span_ms: float) -> None:
        link = max(0.0, round_trip_ms - peer_wait_ms - peer_span_ms)
        self.rows.append((round_trip_ms, peer_wait_ms, peer_span_ms, link))
        self.count += 1
        if len(self.rows) > 2 * self.keep:
            del self.rows[:-self.keep]

    def summary(self) -> dict:
        rows = self.rows[-self.keep:]
        out: dict[str, Any] = {"hops": self.count}
        for j, name in enumerate(self.FIELDS):
            xs = sorted(r[j] for r in rows)
            out[name] = ({"p50": round(xs[len(xs) // 2], 3), "p90": round(xs[int(0.9 * (len(xs) - 1))], 3),
                          "max": round(xs[-1], 3)} if xs else None)
        return out


class GroupMember:
    """The worker half of a pipeline group (one per worker process, made on first use)."""

    def __init__(self, worker: Any) -> None:
        runner = worker.model_runner
        self.worker = worker
        self.runner = runner
        self.res = runner._kunserve_memory
        self.make_view = runner._kunserve_kv_view
        self.layers = decoder_layers(runner.model)
        self.static = worker.vllm_config.compilation_config.static_forward_context
        self.names: dict[int, list[str]] = {}
        for k in self.res.kv:
            if not k.origin:
                self.names.setdefault(k.layer, []).append(k.name)
        #: the worker's compute threads: a stage server thread must use the same count (OpenMP's
        #: thread count is per calling thread, and vLLM's CPU attention metadata is planned for
        #: this many: a span run with more threads reads past it)
        self.threads = torch.get_num_threads()
        self.server = StageServer(self._handle)
        self.name = ""
        self.act: dict[str, StageClient] = {}
        self.bulk: dict[str, StageClient] = {}
        self.spans: list[tuple[int, int, str]] = []
        self.views: dict[tuple[str, str], torch.Tensor] = {}
        self._inbox: dict[tuple[str, str], Any] = {}
        self._cv = threading.Condition()
        self._epoch = ""          # the transition's id (``join_id``): barriers of an earlier attempt never match
        self._rx = threading.Lock()
        self._accepting = False   # peers' KV is written only inside an exchange (never during a rollback)
        self._leaves = 0          # leave attempts in this group (a leave's default id)
        self._locked: list[str] = []
        self.hops = HopTimes()   # this worker's calls to peers' spans (the peers time each span they run)
        #: origin -> (when, the chunks of its step, the chunks of the step it wanted)
        self.peer_steps: dict[str, tuple[float, list[tuple[int, int]], list[tuple[int, int]]]] = {}
        self.wanted: list = []  # this member's wanted step, (prefix, new tokens) pairs from its scheduler, sent with its spans
        self.lost = ""

    # -- the stage server: what peers ask of this worker ------------------------------------------
    def _handle(self, kind: str, meta: Any, tensors: dict) -> tuple[Any, dict]:
        if torch.get_num_threads() != self.threads:
            # the raw setter: vLLM's CPU worker replaces torch.set_num_threads with a no-op after
            # binding its threads (this sets only this server thread's OpenMP team size)
            torch._C._set_num_threads(self.threads)
        if kind == "span":
            return self._run_span(meta, tensors)
        if kind == "kv_put":
            with self._rx:  # a rollback that frees the regions waits for this write; a late one is refused
                if not self._accepting:
                    raise GroupError("kv_put outside an exchange (the transition failed or finished)")
                place = self.res.place(meta["name"], meta["origin"] if meta["to"] == "foreign" else "")
                page = place.page_bytes
                dst = place.region.view(torch.uint8)
                data = tensors["data"]
                with COMPUTE:  # a copy per page: uint8 index_copy_ is ~10x slower on CPU (measured)
                    for j, b in enumerate(meta["blocks"]):
                        dst[b * page:(b + 1) * page].copy_(data[j])
            return {"n": len(meta["blocks"])}, {}
        if kind == "weights":  # a peer restoring a layer this worker holds: a slice of its packed image
            w = self.res.weights[int(meta["layer"])]
            if int(meta["image_bytes"]) != w.image_bytes:
                raise GroupError(f"layer {meta['layer']}: the peer's image is {meta['image_bytes']} bytes, "
                                 f"this worker's {w.image_bytes} (not the same model layout)")
            off, n = int(meta["offset"]), int(meta["nbytes"])
            return {"n": n}, {"data": w.image()[off:off + n]}
        if kind == "barrier":
            with self._cv:
                self._inbox[(meta["from"], meta["tag"])] = meta.get("payload")
                self._cv.notify_all()
            return {"ok": True}, {}
        if kind == "ping":
            return {"t": time.time()}, dict(tensors)
        raise GroupError(f"unknown stage call {kind!r}")

    def _run_span(self, meta: dict, tensors: dict) -> tuple[dict, dict]:
        origin, lo, hi = meta["origin"], meta["lo"], meta["hi"]
        positions, hidden = tensors["positions"], tensors["hidden"]
        residual = tensors.get("residual")
        self.peer_steps[origin] = (time.monotonic(), _step_chunks(meta["attn"]), _chunks(meta.get("want")))
        t_wait = time.perf_counter()
        COMPUTE.acquire()  # held until the reply is sent (the stage server calls the release)
        if TURN.is_due():  # checked holding the core: a step marks its turn before it lets go
            COMPUTE.release()
            TURN.wait()
            COMPUTE.acquire()
        if not self.views:   # this member abandoned its group (under COMPUTE): its peers' KV regions are gone
            COMPUTE.release()
            raise GroupError(f"{self.name or 'this member'} is not in a group: no span of {origin} runs here")
        try:
            from vllm.forward_context import create_forward_context, override_forward_context

            t0 = time.perf_counter()
            self._local_metadata(meta["attn"])
            ctx = create_forward_context(meta["attn"], self.worker.vllm_config, slot_mapping=meta["slots"])
            swapped = []
            try:
                for i in range(lo, hi):
                    for n in self.names.get(i, ()):
                        layer = self.static[n]
                        swapped.append((layer, layer.kv_cache))
                        layer.kv_cache = self.views[(origin, n)]
                with override_forward_context(ctx), torch.inference_mode():
                    for i in range(lo, hi):
                        hidden, residual = self.layers[i](positions, hidden, residual)
            finally:
                for layer, kv in swapped:
                    layer.kv_cache = kv
            span_ms = (time.perf_counter() - t0) * 1e3
        except BaseException:
            COMPUTE.release()
            raise
        _trace("span", t_wait, t0, time.perf_counter())
        return ({"wait_ms": (t0 - t_wait) * 1e3, "span_ms": span_ms}, {"hidden": hidden, "residual": residual},
                COMPUTE.release)

    def _local_metadata(self, attn: Any) -> None:
        """Make a peer's attention metadata valid in this process (``attn_meta.localize``: the CPU
        attention plan made again with this worker's builder; FlashAttention's tensors moved to this
        worker's device and its ahead-of-time plan made again)."""
        try:
            localize(attn, self._device(), self._builders)
        except AttentionMetadataError as exc:
            raise GroupError(str(exc)) from exc

    def _device(self) -> torch.device:
        d = getattr(self.worker, "device", None)
        return torch.device(d) if d is not None else torch.device("cpu")

    def _builders(self) -> dict[str, Any]:
        if self.__dict__.get("_builder_map") is None:
            out = {}
            for groups in getattr(self.runner, "attn_groups", []) or []:
                for g in groups:
                    b = g.get_metadata_builder()
                    for n in g.layer_names:
                        out[n] = b
            self._builder_map = out
        return self._builder_map

    # -- this worker's own steps: spans it dropped run on a peer ----------------------------------
    def _span_names(self, lo: int, hi: int) -> list[str]:
        """The attention layers of decoder layers ``lo..hi-1``."""
        return [n for i in range(lo, hi) for n in self.names.get(i, ())]

    def _span_forward(self, lo: int, hi: int, peer: str):
        names = self._span_names(lo, hi)

        def forward(positions, hidden_states, residual, **kwargs):
            from vllm.forward_context import get_forward_context

            ctx = get_forward_context()
            attn = ctx.attn_metadata
            attn = {n: attn[n] for n in names} if isinstance(attn, dict) else attn
            slots = ctx.slot_mapping
            slots = {n: slots[n] for n in names if n in slots} if isinstance(slots, dict) else slots
            tensors = {"positions": positions, "hidden": hidden_states}
            if residual is not None:
                tensors["residual"] = residual
            meta = {"origin": self.name, "lo": lo, "hi": hi, "attn": attn, "slots": slots, "want": self.wanted}
            held = []  # the step lets go of this worker's core once the request is sent, not before:
            # this thread would then compete for the core with the peer span taking the lock

            def let_go() -> None:
                marks.append(time.perf_counter())
                TURN.away()
                held.append(_release(COMPUTE))

            marks: list[float] = []

            try:
                t0 = time.perf_counter()
                try:
                    timing, out = self.act[peer].call("span", meta, tensors, sent=let_go)
                except (PeerFailedError, RemoteError, OSError) as exc:
                    self.lost = f"{peer}: {exc}"
                    raise GroupError(f"{PEER_LOST}: layers {lo}..{hi - 1} on {peer}: {exc}") from exc
                timing = timing if isinstance(timing, dict) else {}
                self.hops.add((time.perf_counter() - t0) * 1e3, float(timing.get("wait_ms", 0.0)),
                              float(timing.get("span_ms", 0.0)))
            finally:
                t_back = time.perf_counter()
                if held and held[0]:
                    COMPUTE.acquire()
                _trace("hop", t0, marks[0] if marks else t0, t_back, time.perf_counter())
            return out["hidden"].to(hidden_states.dtype), out["residual"]
        return forward

    @staticmethod
    def _passthrough(positions, hidden_states, residual, **kwargs):
        return hidden_states, residual

    def _install(self) -> None:
        for lo, hi, peer in self.spans:
            self.layers[lo].forward = self._span_forward(lo, hi, peer)
            for i in range(lo + 1, hi):
                self.layers[i].forward = self._passthrough
        if not self._locked:
            for name in _LOCKED_METHODS:
                orig = getattr(self.worker, name, None)
                if orig is not None:
                    self.worker.__dict__[name] = _locked(orig, name)
                    self._locked.append(name)

    def _uninstall(self) -> None:
        for lo, hi, _ in self.spans:
            for i in range(lo, hi):
                self.layers[i].__dict__.pop("forward", None)
        for name in self._locked:
            self.worker.__dict__.pop(name, None)
        self._locked = []
        TURN.away()

    # -- barriers and KV exchange -----------------------------------------------------------------
    def _signal(self, tag: str, payload: Any = None) -> None:
        for peer, c in self.act.items():
            c.call("barrier", {"from": self.name, "tag": f"{tag}#{self._epoch}", "payload": payload})

    def _wait(self, tag: str, timeout_s: float) -> dict[str, Any]:
        """Every peer's word ``tag`` in this transition; a peer's ``abort`` ends the wait at once."""
        deadline = time.monotonic() + timeout_s
        key, abort = f"{tag}#{self._epoch}", f"abort#{self._epoch}"
        with self._cv:
            while not all((p, key) in self._inbox for p in self.act):
                gone = {p: self._inbox[(p, abort)] for p in self.act if (p, abort) in self._inbox}
                if gone:
                    raise GroupError(f"group barrier {tag!r}: {', '.join(f'{p} failed: {w}' for p, w in gone.items())}")
                left = deadline - time.monotonic()
                missing = [p for p in self.act if (p, key) not in self._inbox]
                if left <= 0:
                    raise GroupError(f"group barrier {tag!r}: no word from {missing} within {timeout_s:.0f} s")
                dead = [p for p in missing if self.act[p].peer_closed()]
                if dead:  # a member that died says nothing: its closed link says it
                    raise GroupError(f"{PEER_LOST}: group barrier {tag!r}: {', '.join(dead)} closed the stage link")
                self._cv.wait(min(left, 0.25))
            return {p: self._inbox.pop((p, key)) for p in self.act}

    def _abort(self, exc: BaseException) -> None:
        """Tell the peers this member's transition failed (best effort): they stop waiting for it."""
        for peer, c in list(self.act.items()):
            try:
                c.call("barrier", {"from": self.name, "tag": f"abort#{self._epoch}", "payload": repr(exc)[:300]})
            except Exception:  # noqa: BLE001 - a peer that is gone needs no word
                pass

    def _begin(self, epoch: str) -> None:
        """A new transition ``epoch``: words of earlier ones still in the inbox are dropped (a
        faster peer's words of this one are kept)."""
        self._epoch = epoch
        with self._cv:
            for key in [k for k in self._inbox if not k[1].endswith(f"#{epoch}")]:
                del self._inbox[key]

    @contextlib.contextmanager
    def _exchange_open(self):
        """Peers' KV may be written here (``kv_put``) while this block runs, and never after: the
        close waits for a write in progress, so a rollback never frees memory under one."""
        with self._rx:
            self._accepting = True
        try:
            yield
        finally:
            with self._rx:
                self._accepting = False

    def _send_kv(self, peer: str, names: list[str], origin: str, blocks: list[int], to: str,
                 owner: str | None = None) -> int:
        """Copy ``blocks`` of ``origin``'s KV for attention layers ``names`` to ``peer`` (bulk), where
        it lands in its ``to`` ("own" or "foreign") place for ``owner``'s requests (default: this
        member's; a restage moves another member's)."""
        sent, stage = 0, None
        for n in names:
            place = self.res.place(n, origin)
            page = place.page_bytes
            src = place.region.view(torch.uint8)
            per = max(1, bulk_chunk_bytes(src.device) // page)  # the chunk measured for the KV's device
            if stage is None or stage.numel() < per * page or stage.device != src.device:
                # one staging buffer for the whole exchange: a fresh one per chunk costs its page
                # faults every time (glibc maps an 8 MiB allocation anew)
                stage = torch.empty(per * page, dtype=torch.uint8, device=src.device)
            for s in range(0, len(blocks), per):
                ids = blocks[s:s + per]
                self.res.faults.check("kv_chunk")
                data = stage[:len(ids) * page].view(len(ids), page)
                torch.index_select(_pages(src, page), 0, torch.tensor(ids, dtype=torch.long, device=src.device),
                                   out=data)
                self.bulk[peer].call("kv_put", {"name": n, "origin": owner or self.name, "to": to, "blocks": ids},
                                     {"data": data})
                sent += data.numel()
        return sent

    # -- transitions (called by the worker extension, under the engine agent) ----------------------
    def join(self, p: dict) -> dict:
        """Drop ``p["drop"]``; spans ``p["spans"]`` ([lo, hi, peer]) run on peers; host each peer's KV
        for the kept layers. ``p["peers"]``: name -> {"stage": address, "blocks": its block count};
        ``p["held"]``: this engine's block ids with contents."""
        if self.res.dropped:
            raise GroupError(f"already in a group (dropped layers {list(self.res.dropped)})")
        timeout = float(p.get("timeout_s", 120.0))
        t_in = time.perf_counter()
        self.name = p["name"]
        self._begin(str(p.get("join_id", "")))
        self._leaves = 0
        _trace_group(self.name)
        peers = p["peers"]
        nbytes = max(1 << 20, int(p.get("stage_bytes", 1 << 20)))
        try:
            for peer, info in peers.items():
                self._connect(peer, info["stage"], nbytes, timeout)
            self.res.faults.check("connect")
            self.spans = [(int(lo), int(hi), str(peer)) for lo, hi, peer in p["spans"]]
            held = [int(b) for b in p["held"]]
            stats = {"bytes_sent": 0, "ms": {"connect": (time.perf_counter() - t_in) * 1e3}}

            def exchange() -> None:
                with self._exchange_open():
                    t = time.perf_counter()
                    self._signal("ready")
                    self.res.faults.check("barrier")
                    self._wait("ready", timeout)
                    t, stats["ms"]["ready_barrier"] = time.perf_counter(), (time.perf_counter() - t) * 1e3
                    for lo, hi, peer in self.spans:
                        stats["bytes_sent"] += self._send_kv(peer, self._span_names(lo, hi), "", held, "foreign")
                    t, stats["ms"]["kv_send"] = time.perf_counter(), (time.perf_counter() - t) * 1e3
                    self._signal("sent")
                    self._wait("sent", timeout)
                    stats["ms"]["sent_barrier"] = (time.perf_counter() - t) * 1e3

            t0 = time.perf_counter()
            mapped = self.res.join(list(p["drop"]), {o: int(i["blocks"]) for o, i in peers.items()}, exchange)
        except Exception as exc:  # the residency rolled itself back; the peers hear it and roll back too
            self._abort(exc)
            self.spans = []
            self._close()
            raise
        t1 = time.perf_counter()
        self._make_views()
        self._install()
        stats["ms"]["residency"] = (t1 - t0) * 1e3
        stats["ms"].update({f"residency.{k}": v for k, v in (self.res.events[-1:] or [{}])[0].get("step_ms", {}).items()})
        stats["ms"]["views"] = (time.perf_counter() - t1) * 1e3
        t1 = time.perf_counter()
        # tell each peer how many of its blocks this worker can hold now; hear the same from them
        try:
            self._signal("grown", {"for": {o: self.res.foreign_blocks(o) for o in peers}})
            self.res.faults.check("grown")
            heard = self._wait("grown", timeout)
            peer_foreign = {o: int(v["for"][self.name]) for o, v in heard.items()}
        except Exception as exc:  # the join has committed: go on with what the peers had made before
            logger.warning("kunserve: group %s: no word of the peers' grown KV (%r); assuming their base", self.name, exc)
            peer_foreign = {o: int(p.get("visible", 0)) for o in peers}  # safe: what the peers had made
        stats["ms"]["grown_barrier"] = (time.perf_counter() - t1) * 1e3
        return {"mapped_blocks": mapped, "peer_foreign": peer_foreign, "seconds": time.perf_counter() - t0,
                "bytes_sent": stats["bytes_sent"], "ms": {k: round(v, 1) for k, v in stats["ms"].items()}}

    def restage(self, p: dict) -> dict:
        """Move to another stage of a regrouped group keeping every request's KV (live groups, and
        lone engines with them, merging into a larger one): afterwards this worker runs every layer no span of
        ``p["spans"]`` ([lo, hi, peer]: who of its new group runs the rest) names, and hosts the KV
        of ``p["peers"]`` (its new group: name -> {stage, blocks}) for those layers.

        ``p["members"]``: every engine of the transition (the old groups' members, which are the
        new groups' too) -> its stage address; ``p["holders"]``: origin -> [[lo, hi, holder]], who
        holds each member's requests' KV of each layer afterwards (the same on every member);
        ``p["held"]``: this engine's block ids with contents; ``p["kv_blocks"]``: the block count to
        shrink to first (None: none). The members first meet at a barrier, each with its engine
        paused, so no step of any of them runs a span anywhere after it; then the residency
        restages (:meth:`LayerResidency.restage`), its exchange sending each (origin, layer) KV held
        here whose holder changes to that holder, and waiting for every member's. A failure up to
        the exchange rolls back on every member (they hear it at the next barrier); after the
        exchange the KV has moved, and the caller abandons (every request recomputed). A lone
        engine merged with live groups restages too (``p["name"]``: its member name), from every
        layer: a join whose KV goes to, and comes from, whichever member holds it."""
        lone = not self.res.dropped
        if lone:
            self.name = str(p["name"])
            self._leaves = 0
            _trace_group(self.name)
        elif p.get("name", self.name) != self.name:
            raise GroupError(f"restage: this member is {self.name}, not {p['name']}")
        # the controller's view (``p["grouped"]``): a member it saw grouped that is alone now has
        # abandoned its group meanwhile (a peer's restage failed first) and must not take part; it
        # tells the others at once (below), whose words its abandon may have cleared
        gone = bool(p.get("grouped", not lone)) and lone
        timeout = float(p.get("timeout_s", 120.0))
        t_in = time.perf_counter()
        L = len(self.layers)
        spans = [(int(lo), int(hi), str(peer)) for lo, hi, peer in p["spans"]]
        keep = [i for i in range(L) if not any(lo <= i < hi for lo, hi, _ in spans)]
        holders = {str(o): [(int(lo), int(hi), str(h)) for lo, hi, h in v] for o, v in p["holders"].items()}
        peers, held = p["peers"], [int(b) for b in p["held"]]
        kv_blocks = p.get("kv_blocks")
        nbytes = max(1 << 20, int(p.get("stage_bytes", 1 << 20)))
        self._begin(str(p.get("restage_id", "")))

        def holder(origin: str, layer: int) -> str:
            for lo, hi, h in holders.get(origin, ()):
                if lo <= layer < hi:
                    return h
            raise GroupError(f"restage: no holder of layer {layer} for {origin}'s requests")

        opened: list[str] = []
        stats = {"bytes_sent": 0, "moved": 0, "ms": {}}
        try:
            for m, addr in p["members"].items():   # the new peers among them (the agent checks)
                if m != self.name and m not in self.act:
                    self._connect(m, addr, nbytes, timeout)
                    opened.append(m)
            self.res.faults.check("connect")
            if gone:
                raise GroupError(f"restage: {self.name} left its group before the regroup reached it")
            stats["ms"]["connect"] = (time.perf_counter() - t_in) * 1e3
            t = time.perf_counter()
            with self._exchange_open():
                self._signal("restage_paused", {"held": held})
                self.res.faults.check("restage_barrier")
                held_of = {o: list(v["held"]) for o, v in self._wait("restage_paused", timeout).items()}
                held_of[self.name] = held
                stats["ms"]["paused_barrier"] = (time.perf_counter() - t) * 1e3
                keep_before = {i for i in range(L) if i not in self.res.dropped}   # own KV lives only there

                def exchange() -> None:
                    t = time.perf_counter()
                    self._signal("restage_ready")
                    self._wait("restage_ready", timeout)   # every member's new regions exist
                    t, stats["ms"]["ready_barrier"] = time.perf_counter(), (time.perf_counter() - t) * 1e3
                    moves: dict[tuple[str, str, str], list[str]] = {}
                    for k in self.res.kv:
                        if k.layer < 0 or (not k.origin and k.layer not in keep_before):
                            continue   # this engine's own KV of a layer it did not run: nothing there
                        owner = k.origin or self.name
                        h = holder(owner, k.layer)
                        if h != self.name:
                            moves.setdefault((h, k.origin, owner), []).append(k.name)
                    for (h, origin, owner), names in moves.items():
                        stats["bytes_sent"] += self._send_kv(h, names, origin, held_of[owner],
                                                             "own" if h == owner else "foreign", owner=owner)
                        stats["moved"] += len(names)
                    t, stats["ms"]["kv_send"] = time.perf_counter(), (time.perf_counter() - t) * 1e3
                    self._signal("restage_sent")
                    self._wait("restage_sent", timeout)
                    stats["ms"]["sent_barrier"] = (time.perf_counter() - t) * 1e3

                t0 = time.perf_counter()
                mapped = self.res.restage(keep, {o: int(i["blocks"]) for o, i in peers.items()}, exchange,
                                          kv_blocks=None if kv_blocks is None else int(kv_blocks))
        except Exception as exc:  # the residency rolled itself back; the members hear it and roll back too
            self._abort(exc)
            self._disconnect(opened)
            raise
        t1 = time.perf_counter()
        stats["ms"]["residency"] = (t1 - t0) * 1e3
        self._disconnect([m for m in self.act if m not in peers])   # members of the old groups it leaves
        self._uninstall()
        self.spans = spans
        self._make_views()
        self._install()
        try:   # as a join: each peer hears how many of its blocks this worker can hold now
            self._signal("grown", {"for": {o: self.res.foreign_blocks(o) for o in peers}})
            heard = self._wait("grown", timeout)
            peer_foreign = {o: int(v["for"][self.name]) for o, v in heard.items()}
        except Exception as exc:  # the restage has committed: go on with what each peer held before
            logger.warning("kunserve: group %s: no word of the peers' grown KV (%r)", self.name, exc)
            peer_foreign = {o: int(i["blocks"]) for o, i in peers.items()}
        return {"mapped_blocks": mapped, "peer_foreign": peer_foreign, "seconds": time.perf_counter() - t0,
                "bytes_sent": stats["bytes_sent"], "moved_regions": stats["moved"],
                "ms": {k: round(v, 1) for k, v in stats["ms"].items()}}

    def _make_views(self) -> None:
        self.views = {(k.origin, k.name): self.make_view(k.name, k.region) for k in self.res.kv if k.origin}

    def _peer_image(self, i: int, stats: dict) -> torch.Tensor | None:
        """Layer ``i``'s packed weights pulled from the peer that ran it for this engine, in bulk
        chunks (activation calls go first), or None when no peer holds it or the copy fails: the
        layer then comes back from its host copy (counted in ``stats``)."""
        peer = next((q for lo, hi, q in self.spans if lo <= i < hi), None)
        client = self.bulk.get(peer) if peer is not None else None
        if client is None:
            stats["host_layers"] += 1
            return None
        n = int(self.res.weights[i].image_bytes)
        try:
            out = torch.empty(n, dtype=torch.uint8)
            for off in range(0, n, _BULK_BYTES):
                k = min(_BULK_BYTES, n - off)
                _, t = client.call("weights", {"layer": i, "offset": off, "nbytes": k, "image_bytes": n},
                                   copy=False)
                out[off:off + k].copy_(t["data"])
        except Exception as exc:  # the host copy is the fallback: the restore must not fail for it
            logger.warning("kunserve: layer %d from peer %s failed (%r); using the host copy", i, peer, exc)
            stats["host_layers"] += 1
            stats["peer_errors"].append(f"layer {i}: {exc!r}")
            return None
        stats["peer_layers"] += 1
        stats["peer_bytes"] += n
        return out

    def leave(self, p: dict) -> dict:
        """Back to an independent engine: KV shrinks to ``p["kv_blocks"]``, dropped layers return
        (``p["source"]``: ``peer``, pulled from the peer that ran them, else or where that fails
        their host copies), each peer's KV for the kept layers goes back to it and this engine's KV
        of the returning layers comes back. ``p["held"]``: this engine's block ids with contents
        (all below ``kv_blocks``)."""
        if not self.res.dropped:
            raise GroupError("not in a group")
        timeout = float(p.get("timeout_s", 120.0))
        blocks = int(p["kv_blocks"])
        held = [int(b) for b in p["held"]]
        abandon = bool(p.get("abandon"))  # a peer is gone: no exchange, the agent recomputes every request
        if not abandon and any(b >= blocks for b in held):
            raise GroupError(f"leave: blocks above {blocks} are still in use; drain first")
        stats = {"bytes_sent": 0}

        def exchange() -> None:
            with self._exchange_open():
                self._signal("leave_ready", {"held": held})
                self.res.faults.check("leave_barrier")
                theirs = self._wait("leave_ready", timeout)
                for peer, info in theirs.items():
                    names = [k.name for k in self.res.kv if k.origin == peer]
                    stats["bytes_sent"] += self._send_kv(peer, names, peer, list(info["held"]), "own")
                self._signal("leave_sent")
                self._wait("leave_sent", timeout)

        source = str(p.get("source", "host"))
        if source not in ("peer", "host"):
            raise GroupError(f"leave: source {source!r}: one of peer, host")
        restore = {"source": "host" if abandon else source, "peer_layers": 0, "host_layers": 0, "peer_bytes": 0,
                   "peer_errors": []}
        if restore["source"] == "peer":
            images = lambda i: self._peer_image(i, restore)  # noqa: E731 - pulled as each layer reloads
        else:
            images = None
            restore["host_layers"] = len(self.res.dropped)
        t0 = time.perf_counter()
        if not abandon:
            self._leaves += 1
            self._begin(str(p.get("leave_id") or f"{self._epoch.split('/')[0]}/leave{self._leaves}"))
        try:
            if abandon:
                # a live peer may be running a span here (a regroup, a partial join): it ends before the
                # regions go (spans hold COMPUTE), and the views go with them, so later spans are refused
                # (the peer's step finds its peer lost and abandons too) instead of writing into freed KV
                with COMPUTE:
                    self.views = {}
                    mapped = self.res.leave(blocks, lambda: None, images=images)
            else:
                mapped = self.res.leave(blocks, exchange, images=images)
        except Exception as exc:  # rolled back: still grouped; the peers hear it and roll back too
            if not abandon:
                self._abort(exc)
            raise
        self._uninstall()
        _dump_trace()
        self.spans, self.views, self.lost = [], {}, ""
        self._close()
        hops = self.hops.summary()
        self.hops = HopTimes()
        return {"mapped_blocks": mapped, "seconds": time.perf_counter() - t0, "bytes_sent": stats["bytes_sent"],
                "restore": restore, "hops": hops}

    def _connect(self, peer: str, address: str, nbytes: int, timeout: float) -> None:
        """Open the activation link (``nbytes`` of shared memory) and the bulk link to ``peer``."""
        self.act[peer] = StageClient(address, nbytes=nbytes, timeout_s=min(timeout, SPAN_TIMEOUT_S))
        self.bulk[peer] = StageClient(address, nbytes=_BULK_BYTES + (1 << 16), bulk=True, timeout_s=timeout)

    def _disconnect(self, peers: list[str]) -> None:
        for m in peers:
            self.act.pop(m).close()
            self.bulk.pop(m).close()

    def _close(self) -> None:
        for c in list(self.act.values()) + list(self.bulk.values()):
            c.close()
        self.act.clear()
        self.bulk.clear()
        with self._cv:
            self._inbox.clear()

    def state(self) -> dict:
        return {"stage": self.server.address, "name": self.name, "spans": [list(s) for s in self.spans],
                "peers": sorted(self.act), "dropped_layers": list(self.res.dropped),
                "foreign_blocks": {o: self.res.foreign_blocks(o) for o in self.res.peers},
                "hop_times": self.hops.summary(),
                "served_calls": self.server.stats.calls, "lost": self.lost, "locked": list(self._locked),
                # per peer, the tokens of its latest step and of the step it wanted (the pacing input)
                "peer_steps": {o: {"tokens": sum(c for _, c in e[1]), "wanted_tokens": sum(c for _, c in e[2])}
                               for o, e in list(self.peer_steps.items())},
                "threads": self.threads}

    def pace(self, wanted: Any = None) -> list[list[tuple[int, int]]]:
        """The (prefix, new tokens) chunks of each peer's latest step this stage served and of the
        step it wanted (recent ones only): what the group scheduler balances this member's steps
        against. ``wanted``, this member's own wanted step, goes to the peers with its next spans."""
        from vllm_kunserve.integration.vllm.scheduler import fresh_peer_chunks

        if wanted is not None:
            self.wanted = wanted   # sent as given; the peer reads it with _chunks
        return fresh_peer_chunks(self.peer_steps, peers=list(self.act))

    def ping(self, peer_stage: str, nbytes: int, n: int = 20) -> dict:
        """Round-trip latency to a stage server with an ``nbytes`` payload (for reports)."""
        c = StageClient(peer_stage, nbytes=nbytes + 4096)
        try:
            t = torch.zeros(nbytes // 4, dtype=torch.float32)
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                c.call("ping", None, {"x": t})
                times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            return {"bytes": nbytes, "p50_ms": times[len(times) // 2], "max_ms": times[-1], "n": n}
        finally:
            c.close()


def _pages(region: torch.Tensor, page: int) -> torch.Tensor:
    """A KV region's bytes as (blocks, page): row ``b`` is block ``b``'s page (a view)."""
    return region[:region.numel() // page * page].view(-1, page)


#: worker methods that compute (the model step, sampling): they hold COMPUTE, so a peer's span never
#: runs beside them (vLLM's CPU kernels keep per-thread scratch state; the forward context is global)
_LOCKED_METHODS = ("execute_model", "sample_tokens")


def _step_chunks(attn: Any) -> list[tuple[int, int]]:
    """A step's (prefix, new tokens) per request, from its attention metadata (one layer's)."""
    md = next(iter(attn.values()), None) if isinstance(attn, dict) else attn
    q, seq = getattr(md, "query_start_loc", None), getattr(md, "seq_lens", None)
    if q is None or seq is None:
        return []
    new = (q[1:] - q[:-1]).tolist()
    return [(int(s) - int(n), int(n)) for s, n in zip(seq.tolist()[:len(new)], new)]


def _chunks(pairs: Any) -> list[tuple[int, int]]:
    """(prefix, new tokens) pairs as a list of int tuples ([] for None)."""
    return [(int(p), int(c)) for p, c in (pairs or ())]


def _step_load(scheduler_output: Any) -> tuple[int, ...]:
    """A step's (requests, tokens, prefill tokens) from vLLM's ``SchedulerOutput``: prefill tokens
    are those of requests scheduled with more than one token (a decode is one); () for a call that
    carries no step (``sample_tokens``)."""
    n = getattr(scheduler_output, "num_scheduled_tokens", None)
    if not isinstance(n, dict):
        return ()
    return len(n), sum(n.values()), sum(v for v in n.values() if v > 1)


def _locked(fn, name: str):
    """``fn`` under the compute lock (traced as ``name``), keeping this member's turn (``Turn``):
    due while a step starts, after it ends (its sampling or the next step follows) and after a
    sampling (the next step follows); away when either fails."""
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        TURN.due()
        with COMPUTE:
            t1 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                TURN.away()
                raise
            finally:
                _trace(name, t0, t1, time.perf_counter(), *(_step_load(args[0]) if args and _TRACE_DIR else ()))
            TURN.due()
            return out
    return call


def _release(lock: threading.Lock) -> bool:
    """Let go of ``lock`` if this thread's step holds it (a step without the wrapper does not)."""
    try:
        lock.release()
        return True
    except RuntimeError:
        return False


def member(worker: Any) -> GroupMember:
    """This worker's group member (kept on the worker object, made on first use)."""
    m = worker.__dict__.get("_kunserve_group")
    if m is None:
        if getattr(getattr(worker, "model_runner", None), "_kunserve_memory", None) is None:
            raise GroupError("pipeline groups need kunserve memory on this worker (drop.engine or remap)")
        m = worker.__dict__["_kunserve_group"] = GroupMember(worker)
    return m
