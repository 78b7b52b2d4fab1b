"""A point-to-point channel with two traffic classes: activations and chunked bulk transfers.

One sender thread owns the outgoing link. Between any two bulk chunks it looks at the activation
queue first (``priority=True``), so an activation waits at most for the chunk already on the wire;
``priority=False`` is the FIFO baseline (messages leave in submission order). One receiver thread
reads the incoming link: activations go to an in-order inbox, chunks are received straight into
their destination tensor (registered with :meth:`Channel.expect_bulk` or allocated on arrival).

Wire format: every message is a 16 x int64 header on the control group (gloo), optionally followed
by a payload on the data group (gloo, or NCCL for CUDA tensors). An idle sender emits heartbeats,
so a silent peer is detected within ``timeout_s``; a dead one usually at once (connection reset).
On failure every waiter gets a :class:`PeerFailedError` naming what was and was not transferred.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .errors import PeerFailedError, TransferCancelled, TransferError
from .group import PeerGroup, make_store, resolve_backend

ACT, BEGIN, CHUNK, CANCEL, HEARTBEAT, CLOSE, ACK = 1, 2, 3, 4, 5, 6, 7
HDR = 16  # kind, id, a, b, c, dtype, ndim, shape[8], t_ns
MAX_DIMS = 8
_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.bool]
_DCODE = {d: i for i, d in enumerate(_DTYPES)}
DEFAULT_CHUNK_BYTES = 4 << 20


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("bulk tensors must be contiguous (they are sent and received in place)")
    return t.reshape(-1).view(torch.uint8)


@dataclass
class Activation:
    """A received activation: its payload, the sender's tag and the sender's enqueue time."""

    seq: int
    tag: int
    tensor: torch.Tensor
    sent_ns: int  # time.monotonic_ns() at send_activation on the sender (same host: comparable)
    received_ns: int = 0


class BulkHandle:
    """Sender-side progress of one bulk transfer."""

    def __init__(self, channel: "Channel", tid: int, name: str, tensors: list[torch.Tensor], chunk_bytes: int):
        self.channel, self.id, self.name = channel, tid, name
        self.tensors = tensors
        self.flat = [_flat_bytes(t) for t in tensors]
        self.chunks = [(ti, off, min(chunk_bytes, f.numel() - off))
                       for ti, f in enumerate(self.flat) for off in range(0, f.numel(), chunk_bytes)]
        self.chunk_bytes = chunk_bytes
        self.total_bytes = sum(f.numel() for f in self.flat)
        self.chunks_sent = 0
        self.bytes_sent = 0
        self.chunks_acked = 0  # confirmed received by the peer
        self.bytes_acked = 0
        self.began = False
        self.state = "queued"  # queued, sending, done, cancelled, failed
        self.error: BaseException | None = None
        self.cancel_requested = False
        self.submitted_ns = time.monotonic_ns()
        self.finished_ns = 0
        self._event = threading.Event()

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def progress(self) -> dict:
        return {"name": self.name, "state": self.state, "chunks_done": self.chunks_sent,
                "chunks_total": self.num_chunks, "bytes_done": self.bytes_sent, "bytes_total": self.total_bytes,
                "chunks_acked": self.chunks_acked, "bytes_acked": self.bytes_acked}

    def done(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        """Stop before the next chunk; the receiver drops the partial transfer."""
        self.channel._cancel(self)

    def wait(self, timeout: float | None = None) -> None:
        """Block until sent; raise TransferCancelled / PeerFailedError / TimeoutError."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"bulk {self.name!r} not finished after {timeout}s: "
                               f"{self.chunks_sent}/{self.num_chunks} chunks sent")
        if self.error is not None:
            raise self.error

    def _finish(self, state: str, error: BaseException | None = None) -> None:
        self.state, self.error = state, error
        self.finished_ns = time.monotonic_ns()
        self._event.set()

    def __repr__(self) -> str:
        return f"BulkHandle({self.name!r}, {self.state}, {self.chunks_sent}/{self.num_chunks} chunks)"


@dataclass
class _RxBulk:
    id: int
    name: str
    dests: list[torch.Tensor]
    flat: list[torch.Tensor]
    num_chunks: int
    total_bytes: int
    chunks_received: int = 0
    bytes_received: int = 0
    state: str = "receiving"  # receiving, done, cancelled

    def progress(self) -> dict:
        return {"name": self.name, "state": self.state, "chunks_done": self.chunks_received,
                "chunks_total": self.num_chunks, "bytes_done": self.bytes_received,
                "bytes_total": self.total_bytes}


@dataclass
class ChannelStats:
    activations_sent: int = 0
    activation_bytes_sent: int = 0
    chunks_sent: int = 0
    bulk_bytes_sent: int = 0
    preemptions: int = 0           # activations sent while a bulk transfer was part-way
    heartbeats_sent: int = 0
    activations_received: int = 0
    chunks_received: int = 0
    bulk_bytes_received: int = 0
    tx_log: list = field(default_factory=list)   # only with record=True
    rx_log: list = field(default_factory=list)


class Channel:
    """Both directions of a point-to-point link to one peer. Build with :func:`connect`."""

    def __init__(self, group: PeerGroup, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, priority: bool = True,
                 timeout_s: float = 30.0, heartbeat_s: float | None = None, record: bool = False,
                 on_chunk_sent: Callable[[BulkHandle, int], None] | None = None, window_chunks: int = 2):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {window_chunks}")
        # Flow control: at most ``window_chunks`` bulk chunks sent but not yet acknowledged by the
        # receiver, so bulk data never piles up in socket buffers ahead of a later activation.
        self.window_chunks = window_chunks
        self._unacked = 0
        self._ctrl: collections.deque = collections.deque()  # acks to send, before anything else
        self._by_id: dict[int, BulkHandle] = {}
        self.group = group
        self.rank, self.peer, self.device = group.rank, group.peer, group.device
        self.chunk_bytes = chunk_bytes
        self.priority = priority
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else max(0.05, timeout_s / 4)
        self.record = record
        self.on_chunk_sent = on_chunk_sent
        self.stats = ChannelStats()
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._tag_out, self._tag_in = 100 + self.rank, 100 + self.peer
        self._cv = threading.Condition()
        self._acts: collections.deque = collections.deque()     # (submit seq, seq, tag, tensor, t_ns)
        self._bulks: collections.deque = collections.deque()    # (submit seq, BulkHandle)
        self._submit = itertools.count()
        self._act_seq = itertools.count()
        self._tid = itertools.count()
        self._all_out: list[BulkHandle] = []
        self._inbox: collections.deque = collections.deque()
        self._rx: dict[int, _RxBulk] = {}
        self._rx_done: list[_RxBulk] = []
        self._rx_cancelled: list[_RxBulk] = []
        self._expected: dict[str, list[torch.Tensor]] = {}
        self._error: PeerFailedError | None = None
        self._closing = False
        self._close_sent = False
        self._inflight = 0
        self._peer_closed = False
        self._sender = threading.Thread(target=self._send_loop, name=f"kunserve-tx{self.rank}", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"kunserve-rx{self.rank}", daemon=True)
        self._sender.start()
        self._receiver.start()

    # ---- public API: sending ------------------------------------------------------------------
    def send_activation(self, tensor: torch.Tensor, tag: int = 0) -> int:
        """Queue a small urgent tensor; it overtakes queued bulk chunks. Returns its sequence number."""
        self._check_tensor(tensor)
        if tensor.dim() > MAX_DIMS or tensor.dtype not in _DCODE:
            raise ValueError(f"activation must have <= {MAX_DIMS} dims and a dtype in {_DTYPES}")
        t_ns = time.monotonic_ns()
        with self._cv:
            self._raise_if_failed()
            seq = next(self._act_seq)
            self._acts.append((next(self._submit), seq, int(tag), tensor.contiguous(), t_ns))
            self._cv.notify_all()
            return seq

    def send_bulk(self, tensors: torch.Tensor | Sequence[torch.Tensor], name: str, *,
                  chunk_bytes: int | None = None) -> BulkHandle:
        """Queue a bulk transfer (one tensor or several) sent in chunks of ``chunk_bytes``."""
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for t in ts:
            self._check_tensor(t)
        cb = chunk_bytes or self.chunk_bytes
        if cb <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {cb}")
        with self._cv:
            self._raise_if_failed()
            h = BulkHandle(self, next(self._tid), str(name), ts, cb)
            self._by_id[h.id] = h
            self._bulks.append((next(self._submit), h))
            self._all_out.append(h)
            self._cv.notify_all()
            return h

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far has been handed to the transport."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._acts or self._bulks or self._inflight:
                self._raise_if_failed()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("flush timed out")
                self._cv.wait(left if left is not None else 0.5)
            self._raise_if_failed()

    # ---- public API: receiving ----------------------------------------------------------------
    def recv_activation(self, timeout: float | None = None) -> Activation:
        """The next activation, in send order."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._inbox or self._error or self._peer_closed, timeout):
                raise TimeoutError(f"no activation within {timeout}s")
            if self._inbox:
                return self._inbox.popleft()
            self._raise_if_failed()
            raise TransferError("peer closed the channel")

    def expect_bulk(self, name: str, out: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Receive the bulk transfer called ``name`` directly into ``out`` (same byte sizes)."""
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        for t in outs:
            self._check_tensor(t)
            _flat_bytes(t)
        with self._cv:
            self._expected[name] = outs

    def recv_bulk(self, name: str | None = None, timeout: float | None = None) -> tuple[str, list[torch.Tensor]]:
        """Wait for a complete incoming bulk transfer (the named one, or the oldest)."""
        def ready():
            return (self._find_done(name) is not None or self._find_cancelled(name) is not None
                    or self._error is not None or self._peer_closed)
        with self._cv:
            if not self._cv.wait_for(ready, timeout):
                what = f"bulk {name!r}" if name else "a bulk transfer"
                raise TimeoutError(f"{what} not received within {timeout}s; in progress: "
                                   f"{[r.progress() for r in self._rx.values()]}")
            r = self._find_done(name)
            if r is not None:
                self._rx_done.remove(r)
                return r.name, r.dests
            c = self._find_cancelled(name)
            if c is not None:
                self._rx_cancelled.remove(c)
                raise TransferCancelled(f"bulk {c.name!r} was cancelled by the sender after "
                                        f"{c.chunks_received}/{c.num_chunks} chunks")
            self._raise_if_failed()
            raise TransferError("peer closed the channel")

    def rx_progress(self) -> list[dict]:
        with self._cv:
            return [r.progress() for r in list(self._rx.values()) + self._rx_done]

    def tx_progress(self) -> list[dict]:
        with self._cv:
            return [h.progress() for h in self._all_out]

    @property
    def failed(self) -> bool:
        return self._error is not None

    def close(self, timeout: float | None = None) -> None:
        """Flush what is queued, tell the peer, wait up to ``timeout`` (default min(timeout_s, 5))
        for the peer's own close, then tear the groups down. Both sides should close."""
        timeout = min(self.timeout_s, 5.0) if timeout is None else timeout
        with self._cv:
            if not self._closing:
                self._closing = True
                self._cv.notify_all()
        self._sender.join(timeout)
        self._receiver.join(timeout)
        if self._receiver.is_alive() or self._sender.is_alive():
            self.group.abort()
            self._sender.join(1.0)
            self._receiver.join(1.0)

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------
    def _check_tensor(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type != self.device.type:
            raise ValueError(f"tensor on {t.device} but the channel moves {self.device.type} tensors "
                             f"({self.group.backend})")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _find_done(self, name):
        return next((r for r in self._rx_done if name is None or r.name == name), None)

    def _find_cancelled(self, name):
        return next((r for r in self._rx_cancelled if name is None or r.name == name), None)

    def _cancel(self, h: BulkHandle) -> None:
        with self._cv:
            if h.done():
                return
            h.cancel_requested = True
            self._cv.notify_all()

    def _header(self, kind: int, tid: int = 0, a: int = 0, b: int = 0, c: int = 0,
                tensor: torch.Tensor | None = None, t_ns: int = 0) -> torch.Tensor:
        h = torch.zeros(HDR, dtype=torch.int64)
        h[0], h[1], h[2], h[3], h[4], h[15] = kind, tid, a, b, c, t_ns
        if tensor is not None:
            h[5], h[6] = _DCODE[tensor.dtype], tensor.dim()
            for i, s in enumerate(tensor.shape):
                h[7 + i] = s
        return h

    def _send(self, pg, t: torch.Tensor, tag: int) -> None:
        pg.send([t], self.peer, tag).wait(self._timeout)

    def _recv(self, pg, t: torch.Tensor, tag: int) -> None:
        pg.recv([t], self.peer, tag).wait(self._timeout)

    def _next_item(self):
        """Under the lock: the next thing to send (acks, then activations, then a bulk chunk if the
        flow-control window allows), a heartbeat after an idle interval, or close once drained."""
        deadline = time.monotonic() + self.heartbeat_s
        while True:
            for _, h in list(self._bulks):  # cancelled ones leave the queue at once
                if h.cancel_requested:
                    self._bulks.remove((_, h))
                    return ("cancel", h)
            if self._ctrl:
                return ("ack", self._ctrl.popleft())
            bulk_ok = self._bulks and self._unacked < self.window_chunks
            if self._acts and (self.priority or not self._bulks or self._acts[0][0] < self._bulks[0][0]):
                self._inflight += 1
                return ("act", self._acts.popleft())
            if bulk_ok:
                return ("bulk", self._bulks[0][1])
            if self._closing and not self._bulks and not self._acts:
                return ("close", None)
            left = deadline - time.monotonic()
            if left <= 0:
                return ("heartbeat", None)
            self._cv.wait(left)

    def _send_loop(self) -> None:
        g = self.group
        try:
            while True:
                with self._cv:
                    if self._error is not None:
                        return
                    kind, item = self._next_item()
                if kind == "act":
                    _, seq, tag, t, t_ns = item
                    nbytes = t.numel() * t.element_size()
                    self._send(g.ctrl, self._header(ACT, seq, tag, nbytes, tensor=t, t_ns=t_ns), self._tag_out)
                    if nbytes:
                        self._send(g.data_out, t, self._tag_out)
                    with self._cv:
                        self.stats.activations_sent += 1
                        self.stats.activation_bytes_sent += nbytes
                        self._inflight -= 1
                        if any(h.chunks_sent for _, h in self._bulks):
                            self.stats.preemptions += 1
                        if self.record:
                            self.stats.tx_log.append(("act", seq))
                        self._cv.notify_all()
                elif kind == "bulk":
                    self._send_next_chunk(item)
                elif kind == "ack":
                    self._send(g.ctrl, self._header(ACK, *item), self._tag_out)
                elif kind == "cancel":
                    if item.began:
                        self._send(g.ctrl, self._header(CANCEL, item.id), self._tag_out)
                    with self._cv:
                        item._finish("cancelled", TransferCancelled(
                            f"bulk {item.name!r} cancelled after {item.chunks_sent}/{item.num_chunks} chunks "
                            f"({_mib(item.bytes_sent)} of {_mib(item.total_bytes)})"))
                        self._cv.notify_all()
                elif kind == "heartbeat":
                    self._send(g.ctrl, self._header(HEARTBEAT), self._tag_out)
                    self.stats.heartbeats_sent += 1
                else:  # close
                    self._send(g.ctrl, self._header(CLOSE), self._tag_out)
                    self._close_sent = True
                    return
        except Exception as exc:  # the peer died, closed the link, or timed out
            self._fail(exc, "sending")

    def _send_next_chunk(self, h: BulkHandle) -> None:
        g = self.group
        if not h.began:
            meta = json.dumps({"name": h.name, "sizes": [f.numel() for f in h.flat],
                               "dtypes": [str(t.dtype).replace("torch.", "") for t in h.tensors],
                               "shapes": [list(t.shape) for t in h.tensors],
                               "chunks": h.num_chunks}).encode()
            payload = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
            self._send(g.ctrl, self._header(BEGIN, h.id, h.num_chunks, len(meta), h.total_bytes), self._tag_out)
            self._send(g.ctrl, payload, self._tag_out)
            with self._cv:
                h.began, h.state = True, "sending"
        if h.chunks_sent < h.num_chunks:
            i = h.chunks_sent
            ti, off, n = h.chunks[i]
            # header: a = chunk index, b = bytes, c = byte offset, last slot = tensor index
            self._send(g.ctrl, self._header(CHUNK, h.id, i, n, off, t_ns=ti), self._tag_out)
            self._send(g.data_out, h.flat[ti][off:off + n], self._tag_out)
            with self._cv:
                h.chunks_sent += 1
                h.bytes_sent += n
                self._unacked += 1
                self.stats.chunks_sent += 1
                self.stats.bulk_bytes_sent += n
                if self.record:
                    self.stats.tx_log.append(("chunk", h.name, i))
            if self.on_chunk_sent is not None:
                self.on_chunk_sent(h, i)
        if h.chunks_sent == h.num_chunks:
            with self._cv:
                self._bulks = collections.deque(x for x in self._bulks if x[1] is not h)
                h._finish("done")
                self._cv.notify_all()

    def _recv_loop(self) -> None:
        g = self.group
        hdr = torch.zeros(HDR, dtype=torch.int64)
        try:
            while True:
                self._recv(g.ctrl, hdr, self._tag_in)
                kind, tid, a, b, c = (int(x) for x in hdr[:5])
                if kind == ACT:
                    dtype, ndim = _DTYPES[int(hdr[5])], int(hdr[6])
                    shape = tuple(int(s) for s in hdr[7:7 + ndim])
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                    if b:
                        self._recv(g.data_in, t, self._tag_in)
                    act = Activation(tid, a, t, int(hdr[15]), time.monotonic_ns())
                    with self._cv:
                        self._inbox.append(act)
                        self.stats.activations_received += 1
                        if self.record:
                            self.stats.rx_log.append(("act", tid))
                        self._cv.notify_all()
                elif kind == BEGIN:
                    meta_t = torch.empty(b, dtype=torch.uint8)
                    self._recv(g.ctrl, meta_t, self._tag_in)
                    meta = json.loads(bytes(meta_t.numpy()).decode())
                    self._begin_rx(tid, meta, a, c)
                elif kind == CHUNK:
                    r = self._rx[tid]
                    dst = r.flat[int(hdr[15])][c:c + b]
                    self._recv(g.data_in, dst, self._tag_in)
                    with self._cv:
                        r.chunks_received += 1
                        r.bytes_received += b
                        self.stats.chunks_received += 1
                        self.stats.bulk_bytes_received += b
                        if self.record:
                            self.stats.rx_log.append(("chunk", r.name, a))
                        self._ctrl.append((tid, a, b))
                        if r.chunks_received == r.num_chunks:
                            self._complete_rx(r)
                        self._cv.notify_all()
                elif kind == ACK:
                    with self._cv:
                        self._unacked -= 1
                        h = self._by_id.get(tid)
                        if h is not None:
                            h.chunks_acked += 1
                            h.bytes_acked += b
                        self._cv.notify_all()
                elif kind == CANCEL:
                    with self._cv:
                        r = self._rx.pop(tid, None)
                        if r is not None:
                            r.state = "cancelled"
                            self._rx_cancelled.append(r)
                        self._cv.notify_all()
                elif kind == CLOSE:
                    with self._cv:
                        self._peer_closed = True
                        self._cv.notify_all()
                    return
                # HEARTBEAT: nothing to do; its arrival proves the peer is alive
        except Exception as exc:
            self._fail(exc, "receiving")

    def _begin_rx(self, tid: int, meta: dict, num_chunks: int, total: int) -> None:
        name = meta["name"]
        with self._cv:
            outs = self._expected.pop(name, None)
        sizes = meta["sizes"]
        if outs is not None:
            got = [t.numel() * t.element_size() for t in outs]
            if got != sizes:
                raise TransferError(f"bulk {name!r}: registered destination sizes {got} != incoming {sizes}")
        else:
            outs = [torch.empty(s, dtype=getattr(torch, d), device=self.device)
                    for s, d in zip(meta["shapes"], meta["dtypes"])]
        r = _RxBulk(tid, name, outs, [_flat_bytes(t) for t in outs], num_chunks, total)
        with self._cv:
            self._rx[tid] = r
            if num_chunks == 0:
                self._complete_rx(r)

    def _complete_rx(self, r: _RxBulk) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        r.state = "done"
        self._rx.pop(r.id, None)
        self._rx_done.append(r)
        self._cv.notify_all()

    def _fail(self, exc: BaseException, where: str) -> None:
        with self._cv:
            if self._error is not None:
                return
            unfinished = any(not h.done() for h in self._all_out) or self._acts or self._rx
            if self._close_sent or (self._peer_closed and not unfinished):
                # a clean shutdown (ours or the peer's), not a failure
                self._error = TransferError("the channel is closed")
                self._cv.notify_all()
                return
            out = [h.progress() for h in self._all_out]
            inc = [r.progress() for r in self._rx.values()]
            lines = [f"peer rank {self.peer} failed while {where} ({type(exc).__name__}: {str(exc)[:200]})."]
            for p in out:
                if p["state"] in ("done", "cancelled"):
                    continue
                lines.append(f"outgoing bulk {p['name']!r}: {p['chunks_done']}/{p['chunks_total']} chunks sent "
                             f"({_mib(p['bytes_done'])} of {_mib(p['bytes_total'])}), "
                             f"{p['chunks_acked']} confirmed received; not sent: "
                             f"{p['chunks_total'] - p['chunks_done']} chunks "
                             f"({_mib(p['bytes_total'] - p['bytes_done'])}).")
            done = [p["name"] for p in out if p["state"] == "done"]
            if done:
                lines.append(f"outgoing bulk completed before the failure: {done}.")
            for p in inc:
                lines.append(f"incoming bulk {p['name']!r}: {p['chunks_done']}/{p['chunks_total']} chunks received "
                             f"({_mib(p['bytes_done'])} of {_mib(p['bytes_total'])}); missing "
                             f"{_mib(p['bytes_total'] - p['bytes_done'])}.")
            unsent = len(self._acts)
            lines.append(f"activations: {self.stats.activations_sent} sent, {unsent} not sent, "
                         f"{self.stats.activations_received} received.")
            err = PeerFailedError(" ".join(lines), outgoing=out, incoming=inc,
                                  activations_sent=self.stats.activations_sent, activations_unsent=unsent)
            err.__cause__ = exc
            self._error = err
            for h in self._all_out:
                if not h.done():
                    h.state = "failed"
                    h._finish("failed", err)
            self._cv.notify_all()
        self.group.abort()


def connect(rank: int, port: int = 0, host: str = "127.0.0.1", *, store: dist.Store | None = None,
            backend: str = "auto", device: str | torch.device = "cpu", name: str = "kunserve",
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, priority: bool = True, timeout_s: float = 30.0,
            connect_timeout_s: float = 120.0, **kwargs) -> Channel:
    """Open a channel between rank 0 and rank 1 (blocks until both sides have joined).

    Rank 0 may pass ``store=make_store(0)`` (a free port, ``store.port``) and hand the port to the
    peer; rank 1 passes that ``port``. ``backend``: ``gloo`` (CPU tensors), ``nccl`` (CUDA tensors,
    headers still over gloo) or ``auto`` (from ``device``). ``chunk_bytes`` is the default bulk
    chunk size (the policy module's rule decides it; a per-transfer value may override it).
    ``timeout_s`` bounds every send/receive (a silent peer fails the channel after it);
    ``connect_timeout_s`` bounds the rendezvous with a peer that is still starting.
    """
    dev = torch.device(device)
    be = resolve_backend(backend, dev)
    if store is None:
        store = make_store(rank, port, host, connect_timeout_s)
    group = PeerGroup(store, rank, backend=be, device=dev, connect_timeout_s=connect_timeout_s,
                      host=host, name=name)
    return Channel(group, chunk_bytes=chunk_bytes, priority=priority, timeout_s=timeout_s, **kwargs)
