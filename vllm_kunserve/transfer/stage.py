"""Stage links: request/reply calls between pipeline stages on one host, payloads in shared memory.

A pipeline group hands hidden states from one engine's worker to another's for every step, so the
hop must cost microseconds, not the 1.5-9 ms gloo took over loopback here for 16 KiB. A
:class:`StageClient` creates one shared-memory file (``/dev/shm``) per connection and maps it;
the :class:`StageServer` maps the same file. A call writes its tensors into that buffer and sends
a small pickled header (kind, metadata, tensor descriptors) over a Unix-domain socket; the reply
comes back the same way in the same buffer (calls on one connection are strictly request/reply,
so the buffer is never shared by two messages). Nothing is copied through the kernel but the
header; the socket also gives the waiting side a blocking read instead of a busy loop. Tensors
inside the metadata (a step's attention metadata) travel in the buffer too, each as just its own
elements: pickle would write a view's whole storage (a slice of a runner's persistent buffer)
through ``torch.save`` on every call. (Measured end to end, the pipeline group's throughput did
not change with it: docs/benchmarks/pipeline_overhead.md's runs are with it.)

Two traffic classes: a connection opened with ``bulk=True`` (KV exchange) yields to activation
calls: before each bulk message the server waits while an activation call is being handled, so
an activation waits at most for the bulk chunk already being written.

Engine-agnostic: the handler gets ``(kind, meta, tensors)`` and returns ``(meta, tensors)``, or
``(meta, tensors, after)``: ``after()`` runs once the reply is sent (or could not be), so a handler
can hold a resource across the reply (a pipeline stage keeps its compute lock until the reply is
on its way: released earlier, the caller waiting for it competes for the core with whatever takes
the lock). A caller can do the same on its side: ``call(..., sent=fn)`` runs ``fn()`` once the
request is sent.

Device tensors stay on the device (one interface, chosen by the tensors' device). The first call
that carries a CUDA tensor sets up the connection's device path: the client allocates a device
buffer and two interprocess CUDA events (one per direction) and hands the server their IPC
handles (torch's own CUDA IPC, ``torch.multiprocessing.reductions``); from then on a call's CUDA
tensors are copied into that buffer on the caller's stream, the client records its event and
sends the header, and the server's stream waits on that event before the handler's kernels run
(the host never waits for the device; ordering is the streams'). The reply comes back the same
way with the server's event. Where CUDA IPC cannot be opened (another device, a driver without
it) or ``device_link="host"`` is asked for, CUDA tensors are staged through the shared-memory
buffer (pinned with ``cudaHostRegister`` where possible) and put back on their device on the
other side. CPU tensors take the shared-memory path as before. Measured on an H100:
docs/benchmarks/stage_link_gpu.md.
"""

from __future__ import annotations

import io
import os
import pickle
import select
import socket
import struct
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import PeerFailedError

#: how a client's CUDA tensors travel: "auto" (CUDA IPC, else host staging), "ipc" (CUDA IPC, else
#: host staging: the same, named), "host" (staged through the pinned shared-memory buffer)
DEVICE_LINKS = ("auto", "ipc", "host")
Handler = Callable[[str, Any, dict], "tuple[Any, dict] | tuple[Any, dict, Callable[[], None]]"]
_LEN = struct.Struct("!Q")
_ALIGN = 64
_DEVICE_ALIGN = 512  # as the CUDA caching allocator aligns blocks: kernels see the same alignment


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerFailedError("stage link closed by the peer")
        got += k
    return bytes(buf)


class _MetaPickler(pickle.Pickler):
    """Pickles metadata with its tensors left out (each becomes an index into ``tensors``)."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors, self._seen = tensors, {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        k = self._seen.get(id(obj))
        if k is None:  # the same tensor twice arrives as one
            k = self._seen[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return k


class _MetaUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.tensors[pid]


def _dump_meta(meta: Any) -> tuple[bytes, list[torch.Tensor]]:
    out, tensors = io.BytesIO(), []
    _MetaPickler(out, tensors).dump(meta)
    return out.getvalue(), tensors


_META = "\x00meta"  # buffer names of the metadata's tensors: _META + index


def _with_meta(tensors: dict[str, torch.Tensor], meta_tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**tensors, **{f"{_META}{k}": t for k, t in enumerate(meta_tensors)}}


def _split_meta(got: dict[str, torch.Tensor], data: bytes, owned: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """(metadata, tensors) from a message's buffer contents. The metadata's tensors are copied out
    of the buffer (the next message is written into it) unless ``got`` is already a copy."""
    mine = [t for name, t in got.items() if name.startswith(_META)]
    meta = _MetaUnpickler(data, mine if owned else [t.clone() for t in mine]).load()
    return meta, {name: t for name, t in got.items() if not name.startswith(_META)}


def _send_msg(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_msg(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return pickle.loads(_recv_exact(sock, n))


class _Buffer:
    """A shared-memory file mapped as a uint8 tensor."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        self.path, self.nbytes = path, int(nbytes)
        if create:
            with open(path, "wb") as f:
                f.truncate(self.nbytes)
        self.t = torch.from_file(path, shared=True, size=self.nbytes, dtype=torch.uint8)
        self.pinned = False

    def pin(self) -> None:
        """Page-lock the mapping for the device's DMA (host staging of CUDA tensors); best effort."""
        if not self.pinned:
            self.pinned = _host_register(self.t.data_ptr(), self.nbytes)

    def unpin(self) -> None:
        if self.pinned:
            _host_register(self.t.data_ptr(), 0, unregister=True)
            self.pinned = False

    def put(self, tensors: dict[str, torch.Tensor]) -> list[tuple]:
        """Write tensors back to back; returns their descriptors. A CUDA tensor is staged here (host
        staging) and its descriptor names its device, where the reader puts it back."""
        desc, off = [], 0
        for name, t in tensors.items():
            t = t.detach().contiguous()
            n = t.numel() * t.element_size()
            if off + n > self.nbytes:
                raise ValueError(f"stage buffer of {self.nbytes} bytes is too small for {name}")
            if n:
                self.t[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            desc.append((name, t.dtype, tuple(t.shape), off, n, None if t.device.type == "cpu" else str(t.device)))
            off += -(-n // _ALIGN) * _ALIGN
        return desc

    def get(self, desc: list[tuple], copy: bool = True) -> dict[str, torch.Tensor]:
        out = {}
        for name, dtype, shape, off, n, device in desc:
            t = self.t[off:off + n].view(dtype).view(shape)
            if device is not None:
                out[name] = t.to(_local_device(device))  # a copy: staged tensors go back to their device
            else:
                out[name] = t.clone() if copy else t
        return out

    def close(self) -> None:
        self.unpin()


def _host_register(ptr: int, nbytes: int, unregister: bool = False) -> bool:
    """Page-lock (or release) host memory with the driver API (cuda-python), so a failure leaves no
    error behind in the runtime torch checks after its kernels. False where it cannot be done."""
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver  # type: ignore
    except ImportError:
        return False
    torch.cuda.set_device(torch.cuda.current_device())  # the device's context, current on this thread
    if unregister:
        res = driver.cuMemHostUnregister(ptr)
    else:
        res = driver.cuMemHostRegister(ptr, nbytes, 0)
    err = res[0] if isinstance(res, tuple) else res
    return err == driver.CUresult.CUDA_SUCCESS


def _local_device(device: str) -> torch.device:
    """The sender's CUDA device as this process names it (the same index; one host)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        return torch.device("cuda", torch.cuda.current_device())
    return d


class _DeviceBuffer:
    """A device buffer shared by one connection's two processes through CUDA IPC, with one
    interprocess event per direction: the writer records its event after its copies; the reader's
    stream waits on it before touching the buffer. Request/reply keeps the two directions apart."""

    def __init__(self, t: torch.Tensor, send_ev: torch.cuda.Event, recv_ev: torch.cuda.Event) -> None:
        self.t, self.nbytes, self.device = t, t.numel(), t.device
        self.send_ev, self.recv_ev = send_ev, recv_ev

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> tuple["_DeviceBuffer", dict]:
        """The client's side, and the hello that lets the server open it."""
        from torch.multiprocessing.reductions import reduce_tensor

        with torch.cuda.device(device):
            t = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
            c2s = torch.cuda.Event(interprocess=True)
            s2c = torch.cuda.Event(interprocess=True)
            hello = {"rebuild": reduce_tensor(t)[1], "c2s": c2s.ipc_handle(), "s2c": s2c.ipc_handle(),
                     "device": t.device.index, "nbytes": int(nbytes)}
        return cls(t, c2s, s2c), hello

    @classmethod
    def open(cls, hello: dict) -> "_DeviceBuffer":
        """The server's side of :meth:`create`."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        dev = torch.device("cuda", int(hello["device"]))
        with torch.cuda.device(dev):
            t = rebuild_cuda_tensor(*hello["rebuild"])
            c2s = torch.cuda.Event.from_ipc_handle(dev, hello["c2s"])
            s2c = torch.cuda.Event.from_ipc_handle(dev, hello["s2c"])
        return cls(t, s2c, c2s)

    def put(self, tensors: dict[str, torch.Tensor]) -> list[tuple]:
        desc, off = [], 0
        with torch.cuda.device(self.device):
            for name, t in tensors.items():
                t = t.detach()
                n = t.numel() * t.element_size()
                if off + n > self.nbytes:
                    raise ValueError(f"device stage buffer of {self.nbytes} bytes is too small for {name}")
                if n:
                    self.t[off:off + n].view(t.dtype).view(t.shape).copy_(t)
                desc.append((name, t.dtype, tuple(t.shape), off, n))
                off += -(-n // _DEVICE_ALIGN) * _DEVICE_ALIGN
            self.send_ev.record(torch.cuda.current_stream(self.device))
        return desc

    def get(self, desc: list[tuple], copy: bool = True) -> dict[str, torch.Tensor]:
        out = {}
        with torch.cuda.device(self.device):
            torch.cuda.current_stream(self.device).wait_event(self.recv_ev)
            for name, dtype, shape, off, n in desc:
                t = self.t[off:off + n].view(dtype).view(shape)
                out[name] = t.clone() if copy else t
        return out


#: bulk chunk (KV exchange, weight pulls) by the payload's device. CPU: 8 MiB (a chunk is a memcpy
#: into shared memory; an activation waits at most one). CUDA: 256 MiB, measured on an H100
#: (docs/benchmarks/stage_link_gpu.md, its "derived" figures): a chunk costs a host round trip
#: (~0.4 ms) plus three device copies, so small chunks waste the link (1 MiB: 3 GB/s; 256 MiB: 188
#: GB/s, the smallest measured chunk within 3/4 of the best measured throughput) while a decode hop
#: sent during the exchange still waits under 1 ms (p50) for the chunk in flight.
BULK_CHUNK_BYTES = {"cpu": 8 << 20, "cuda": 256 << 20}


def bulk_chunk_bytes(device: torch.device | str) -> int:
    """Bytes per bulk chunk for payloads on ``device``."""
    return BULK_CHUNK_BYTES.get(torch.device(device).type, BULK_CHUNK_BYTES["cpu"])


def _split_devices(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(host tensors, CUDA tensors)."""
    host, dev = {}, {}
    for name, t in tensors.items():
        (dev if t.device.type == "cuda" else host)[name] = t
    return host, dev


def needed_bytes(tensors: dict[str, torch.Tensor], align: int = _ALIGN) -> int:
    """Buffer bytes ``tensors`` take written back to back."""
    return sum(-(-(t.numel() * t.element_size()) // align) * align for t in tensors.values())


@dataclass
class StageStats:
    calls: int = 0
    bulk_calls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    handler_s: float = 0.0


class StageServer:
    """Serves calls on a Unix-domain socket; one thread per connection."""

    def __init__(self, handler: Handler, path: str | None = None) -> None:
        self.handler = handler
        self.path = path or os.path.join(tempfile.gettempdir(), f"kunserve-stage-{uuid.uuid4().hex[:12]}.sock")
        self.stats = StageStats()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(16)
        self._stop = False
        self._active = 0
        self._cv = threading.Condition()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="kunserve-stage-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return "unix://" + self.path

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kunserve-stage", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf: _Buffer | None = None
        dbuf: _DeviceBuffer | None = None
        bulk = False
        try:
            while not self._stop:
                msg = _recv_msg(conn)
                if msg.get("shm"):  # hello or a bigger buffer
                    if buf is not None:
                        buf.close()
                    buf = _Buffer(msg["shm"], msg["nbytes"], create=False)
                    bulk = bool(msg.get("bulk"))
                    _send_msg(conn, {"ok": True})
                    continue
                if msg.get("cuda"):  # the device path, or a bigger device buffer
                    try:
                        dbuf = _DeviceBuffer.open(msg["cuda"])
                        _send_msg(conn, {"ok": True})
                    except Exception as exc:  # the client falls back to host staging
                        _send_msg(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                if msg.get("pin"):
                    buf.pin()
                    _send_msg(conn, {"ok": True})
                    continue
                if bulk:
                    with self._cv:  # activations first
                        while self._active:
                            self._cv.wait()
                else:
                    with self._cv:
                        self._active += 1
                after = None
                try:
                    t0 = time.perf_counter()
                    try:
                        got = buf.get(msg["tensors"], copy=False) if buf is not None else {}
                        if msg.get("dev"):  # also with no tensors: the event orders the buffer's reuse
                            got.update(dbuf.get(msg["dtensors"], copy=False))
                        meta, tensors = _split_meta(got, msg["meta"])
                        res = self.handler(msg["kind"], meta, tensors)
                        meta, out = res[0], res[1]
                        after = res[2] if len(res) > 2 else None
                        data, meta_tensors = _dump_meta(meta)
                        out = _with_meta(out or {}, meta_tensors)
                        host, dev = _split_devices(out) if dbuf is not None else (out, {})
                        reply = {"meta": data, "tensors": buf.put(host) if host else [],
                                 "dtensors": dbuf.put(dev) if dbuf is not None else [], "dev": dbuf is not None}
                    except Exception as exc:  # the caller gets the error, the link stays up
                        reply = {"error": f"{type(exc).__name__}: {exc}"}
                    self.stats.calls += 1
                    self.stats.bulk_calls += bulk
                    self.stats.bytes_in += sum(d[4] for d in msg["tensors"] + msg.get("dtensors", []))
                    self.stats.handler_s += time.perf_counter() - t0
                    _send_msg(conn, reply)
                finally:
                    if after is not None:
                        after()
                    if not bulk:
                        with self._cv:
                            self._active -= 1
                            self._cv.notify_all()
        except (PeerFailedError, OSError, EOFError):
            pass
        finally:
            if buf is not None:
                buf.close()
            conn.close()

    def close(self) -> None:
        self._stop = True
        try:
            self._sock.close()
        finally:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if os.path.exists(self.path):
                os.unlink(self.path)


class RemoteError(RuntimeError):
    """The peer's handler raised."""


class StageClient:
    """One connection to a :class:`StageServer`; calls are serialised (request/reply)."""

    def __init__(self, address: str, nbytes: int = 1 << 20, bulk: bool = False, timeout_s: float = 60.0,
                 device_link: str = "auto") -> None:
        if not address.startswith("unix://"):
            raise ValueError(f"stage address {address!r}: only unix:// (same host) links are supported")
        if device_link not in DEVICE_LINKS:
            raise ValueError(f"device_link {device_link!r}: one of {', '.join(DEVICE_LINKS)}")
        self.address, self.bulk, self.timeout_s = address, bulk, timeout_s
        #: how CUDA tensors travel: "auto" until the first one, then "ipc" or "host" (staging)
        self.device_link = device_link
        self.device_link_error: str | None = None
        self._dbuf: _DeviceBuffer | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(address[len("unix://"):])
        self._lock = threading.Lock()
        self._buf: _Buffer | None = None
        self._files: list[str] = []
        self.last_hop_s = 0.0
        self._ensure(nbytes)

    def _ensure(self, nbytes: int) -> None:
        if self._buf is not None and self._buf.nbytes >= nbytes:
            return
        size = max(nbytes, 2 * self._buf.nbytes if self._buf else 0, 1 << 16)
        path = os.path.join(_shm_dir(), f"kunserve-stage-{uuid.uuid4().hex[:12]}")
        buf = _Buffer(path, size, create=True)
        _send_msg(self._sock, {"shm": path, "nbytes": size, "bulk": self.bulk})
        _recv_msg(self._sock)
        old, self._buf = self._buf, buf
        self._files.append(path)
        if old is not None:
            old.close()
            os.unlink(old.path)
            self._files.remove(old.path)
        if self.device_link == "host":
            self._pin()

    def _pin(self) -> None:
        self._buf.pin()
        _send_msg(self._sock, {"pin": True})
        _recv_msg(self._sock)

    def _ensure_device(self, dev: dict[str, torch.Tensor]) -> None:
        """Open (or grow) the device path for a call's CUDA tensors; fall back to host staging."""
        if self.device_link == "host":
            return
        nbytes = needed_bytes(dev, _DEVICE_ALIGN)
        if self._dbuf is not None and self._dbuf.nbytes >= nbytes:
            return
        device = next(iter(dev.values())).device
        size = max(nbytes, 2 * self._dbuf.nbytes if self._dbuf else 0, 1 << 20)
        try:
            dbuf, hello = _DeviceBuffer.create(size, device)
        except Exception as exc:
            ok = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        else:
            _send_msg(self._sock, {"cuda": hello})
            ok = _recv_msg(self._sock)
        if ok.get("ok"):
            self._dbuf, self.device_link = dbuf, "ipc"
        elif self._dbuf is None:
            self.device_link, self.device_link_error = "host", ok.get("error")
            self._pin()
        else:
            raise PeerFailedError(f"stage link to {self.address}: growing the device buffer: {ok.get('error')}")

    def call(self, kind: str, meta: Any = None, tensors: dict[str, torch.Tensor] | None = None,
             copy: bool = True, sent: Callable[[], None] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
        """Send one request and wait for its reply. ``sent()``, when given, runs exactly once: as
        soon as the request is on its way, or when the call fails before that."""
        try:
            data, meta_tensors = _dump_meta(meta)
            tensors = _with_meta(tensors or {}, meta_tensors)
        except BaseException:
            if sent is not None:
                sent()
            raise
        with self._lock:
            try:
                try:
                    host, dev = _split_devices(tensors)
                    if dev:
                        self._ensure_device(dev)
                        if self.device_link != "ipc":
                            host, dev = tensors, {}
                    self._ensure(needed_bytes(host))
                    t0 = time.perf_counter()
                    desc = self._buf.put(host)
                    # with the device path open, every message records (and every reader waits on) its
                    # event, tensors or none: a reply written into the device buffer must wait for the
                    # caller's last reads of it
                    dev_open = self._dbuf is not None
                    ddesc = self._dbuf.put(dev) if dev_open else []
                    _send_msg(self._sock, {"kind": kind, "meta": data, "tensors": desc, "dtensors": ddesc,
                                           "dev": dev_open})
                finally:
                    if sent is not None:
                        sent()
                reply = _recv_msg(self._sock)
                self.last_hop_s = time.perf_counter() - t0
            except (OSError, socket.timeout) as exc:
                raise PeerFailedError(f"stage link to {self.address}: {exc!r}") from exc
            if "error" in reply:
                raise RemoteError(f"{kind} on {self.address}: {reply['error']}")
            got = self._buf.get(reply["tensors"], copy=copy)
            if reply.get("dev"):
                got.update(self._dbuf.get(reply["dtensors"], copy=copy))
            return _split_meta(got, reply["meta"], owned=copy)

    def peer_closed(self) -> bool:
        """Whether the server's end of this connection is gone (its process died or closed it):
        between calls nothing is ever sent to the client, so a readable socket means end of file.
        False while a call is in flight (the call itself reports a lost peer)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            r, _, _ = select.select([self._sock], [], [], 0)
            if not r:
                return False
            try:
                return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return True
        except (OSError, ValueError):
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            if self._buf is not None:
                self._buf.close()
            self._dbuf = None
            for p in self._files:
                if os.path.exists(p):
                    os.unlink(p)
            self._files.clear()


__all__ = ["BULK_CHUNK_BYTES", "DEVICE_LINKS", "bulk_chunk_bytes", "RemoteError", "StageClient", "StageServer", "StageStats", "needed_bytes"]
