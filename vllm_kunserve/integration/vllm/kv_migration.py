"""vLLM views for moving a request's KV cache between two engines (issue 12).

The mechanism needs no request ids and no kernel changes: it goes through vLLM's **prefix cache**.
A request stopped on the source engine leaves its full KV blocks in the source's prefix cache
(hashed, in the free queue until evicted). The source finds them by hashing the request's token ids
the way the scheduler does, pins them, reads their KV on every worker and sends it to the target.
The target writes the bytes into blocks it took from its own free queue and registers them in its
prefix cache under its own hashes of the same token ids, so the continuation request (prompt =
prompt + generated token ids) hits them and only recomputes the tokens whose KV did not arrive.

Two halves, one per process:

* :class:`SchedulerKV` (engine-core process): block hashes of token ids (vLLM's own request block
  hasher), the longest cached prefix, pin / allocate / register / release on the ``BlockPool``.
  It is handed to the engine agent's migration operations (``vllm_kunserve.engine.migration``)
  through :func:`~vllm_kunserve.engine.migration.provide_scheduler_kv`, registered when this module
  is imported (the worker extension module imports it, which every kunserve process loads).
* :class:`WorkerKV` (each worker): the layout of the worker's KV cache tensors, reading blocks
  into a contiguous buffer and sending it over a one-shot transfer channel
  (``vllm_kunserve.transfer``, gloo on CPU, NCCL on CUDA) to the same rank of the target, and on
  the target receiving in a background thread (the engine keeps stepping) and writing the received
  blocks into the held blocks at commit. Every layer of every worker moves: tensor-parallel ranks
  pair up by rank.

vLLM 0.32 touchpoints (read-only or public methods; nothing is replaced): ``Scheduler.kv_cache_manager
.block_pool`` (``get_cached_block``, ``touch``, ``get_new_blocks``, ``cache_full_blocks``,
``free_blocks``, ``get_num_free_blocks``), ``Scheduler.block_size`` / ``hash_block_size`` /
``kv_cache_config``, ``vllm.v1.core.kv_cache_utils.get_request_block_hasher`` /
``resolve_block_hashes``, ``vllm.utils.hashing.get_hash_fn_by_name``, the worker's
``model_runner.kv_caches`` (scheduler-block-addressed per-layer tensors) and
``model_runner.kv_cache_config.num_blocks``. See ``patches/README.md``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_kunserve.integration.vllm.versions import UnsupportedVllmError, check_touchpoint

logger = logging.getLogger("vllm.kunserve")

#: test hooks understood by the worker half
WORKER_FAULTS = ("send", "write")


class KVMigrationUnsupported(RuntimeError):
    """This engine's KV cache cannot take part in a migration (the message says why)."""


# ---------------------------------------------------------------------------------------------------
# scheduler side (engine-core process)
# ---------------------------------------------------------------------------------------------------
class _TokenRequest:
    """The attributes of ``vllm.v1.request.Request`` that vLLM's block hasher and
    ``BlockPool.cache_full_blocks`` read, for a plain token prompt (no multimodal input, no LoRA,
    no prompt embeddings; an optional ``cache_salt``)."""

    def __init__(self, token_ids: list[int], cache_salt: str | None) -> None:
        self.all_token_ids = list(token_ids)
        self.num_tokens = len(self.all_token_ids)
        self.block_hashes: list = []
        self.mm_features: list = []
        self.lora_request = None
        self.cache_salt = cache_salt
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict = {}
        self.session_id = None


@dataclass
class TokenPrefix:
    """Token ids and their block hashes on one engine (hashes are per engine: never sent)."""

    token_ids: list[int]
    cache_salt: str | None
    request: Any                       # the _TokenRequest carrying hash-block-size hashes
    hashes: list = field(default_factory=list)   # one per full block of ``block_size`` tokens

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


class SchedulerKV:
    """The block pool operations a migration needs. Call between engine steps only (the agent's
    lock): nothing here is thread-safe, exactly like the scheduler itself."""

    def __init__(self, scheduler: Any) -> None:
        try:
            check_touchpoint("kv_migration")
        except UnsupportedVllmError as e:
            raise KVMigrationUnsupported(str(e)) from None
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        self.scheduler = scheduler
        self.pool = scheduler.kv_cache_manager.block_pool
        cfg = scheduler.kv_cache_config
        groups = list(cfg.kv_cache_groups)
        if len(groups) != 1:
            raise KVMigrationUnsupported(f"KV migration supports one KV cache group (full attention); "
                                         f"this engine has {len(groups)}")
        spec = groups[0].kv_cache_spec
        if not getattr(spec, "prefix_cacheable", True):
            raise KVMigrationUnsupported(f"KV cache spec {type(spec).__name__} is not prefix-cacheable")
        cache_config = scheduler.vllm_config.cache_config
        self.enabled = bool(cache_config.enable_prefix_caching and self.pool.enable_caching)
        self.block_size = int(scheduler.block_size)
        self.hash_block_size = int(getattr(scheduler, "hash_block_size", None) or self.block_size)
        if self.block_size % self.hash_block_size:
            raise KVMigrationUnsupported(f"block size {self.block_size} is not a multiple of the hash block "
                                         f"size {self.hash_block_size}")
        self.hash_algo = str(cache_config.prefix_caching_hash_algo)
        self._hasher = get_request_block_hasher(self.hash_block_size, get_hash_fn_by_name(self.hash_algo))

    def check_enabled(self) -> None:
        if not self.enabled:
            raise KVMigrationUnsupported("prefix caching is off on this engine (start it with "
                                         "--enable-prefix-caching): migrated KV could never be hit")

    # -- hashes and lookups ---------------------------------------------------------------------
    def prefix(self, token_ids: list[int], cache_salt: str | None = None) -> TokenPrefix:
        """The hashes of every full block of ``token_ids``, as the scheduler computes them for a
        request with this prompt (its own hash function and seed)."""
        from vllm.v1.core.kv_cache_utils import resolve_block_hashes

        req = _TokenRequest(token_ids, cache_salt)
        req.block_hashes = list(self._hasher(req))
        hashes = list(resolve_block_hashes(req.block_hashes, self.hash_block_size, self.block_size))
        return TokenPrefix(list(token_ids), cache_salt, req, hashes)

    def cached_prefix(self, prefix: TokenPrefix, limit: int | None = None) -> list:
        """The blocks holding the longest cached prefix of ``prefix`` (what a request hits)."""
        out = []
        for h in prefix.hashes[:limit]:
            hit = self.pool.get_cached_block(h, [0])
            if not hit:
                break
            out.append(hit[0])
        return out

    # -- block ownership ------------------------------------------------------------------------
    def pin(self, blocks: list) -> None:
        """Hold ``blocks`` (cached ones leave the free queue: no eviction, no reuse)."""
        self.pool.touch(blocks)

    def allocate(self, n: int) -> list:
        """``n`` blocks from the free queue (the least recently used cached ones are evicted),
        held by us, without a hash."""
        return self.pool.get_new_blocks(n) if n > 0 else []

    def register(self, prefix: TokenPrefix, blocks: list, start: int) -> None:
        """Put ``blocks`` (holding the KV of blocks ``start .. start+len(blocks)`` of ``prefix``)
        into the prefix cache under this engine's hashes."""
        if not blocks:
            return
        self.pool.cache_full_blocks(prefix.request, [None] * start + list(blocks), start, start + len(blocks),
                                    self.block_size, 0)

    def release(self, blocks: list) -> None:
        """Drop our reference (chain order: the tail is evicted first, as vLLM frees a request).
        Registered blocks stay in the prefix cache; unregistered ones go back as plain free blocks."""
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))

    # -- facts ----------------------------------------------------------------------------------
    @staticmethod
    def block_ids(blocks: list) -> list[int]:
        return [int(b.block_id) for b in blocks]

    def free_blocks(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def usable_blocks(self) -> int:
        return int(self.pool.num_gpu_blocks) - 1  # block 0 is vLLM's null block

    def total_blocks(self) -> int:
        """Blocks the KV tensors are shaped for (the planned maximum with a growable cache)."""
        return len(self.pool.blocks)

    def describe(self) -> dict:
        return {"block_size": self.block_size, "hash_block_size": self.hash_block_size,
                "prefix_caching": self.enabled, "hash_algo": self.hash_algo}


# ---------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------
def local_ip() -> str:
    """The address this host's peers reach it at (``VLLM_HOST_IP``, else vLLM's guess)."""
    ip = os.environ.get("VLLM_HOST_IP")
    if ip:
        return ip
    from vllm.utils.network_utils import get_ip

    return get_ip()


@dataclass
class _Incoming:
    """One staged receive on a worker: the channel thread's progress and result."""

    xfer_id: str
    num_blocks: int
    thread: threading.Thread | None = None
    channel: Any = None
    tensors: list | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    received_s: float = 0.0


class WorkerKV:
    """The worker half. One instance per worker (``KunServeWorkerExtension._kunserve_kv``)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.incoming: dict[str, _Incoming] = {}
        self._lock = threading.Lock()

    # -- the KV tensors -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return int(getattr(self.worker, "rank", 0) or 0)

    def tensors(self) -> list:
        runner = getattr(self.worker, "model_runner", None)
        kv = list(getattr(runner, "kv_caches", None) or [])
        if not kv:
            raise KVMigrationUnsupported("this worker has no KV cache tensors (model_runner.kv_caches is empty)")
        return kv

    def _num_blocks(self, kv: list) -> int:
        runner = self.worker.model_runner
        cfg = getattr(runner, "kv_cache_config", None)
        return int(cfg.num_blocks) if cfg is not None else int(kv[0].shape[0])

    @staticmethod
    def _block_dim(t: Any, num_blocks: int) -> int:
        """The dimension that indexes blocks: the first one of size ``num_blocks`` (dim 0 on CPU's
        ``[blocks, kv_heads, block_size, 2*head]``, dim 1 on FlashAttention's ``[2, blocks, ...]``)."""
        for d in range(min(2, t.dim())):
            if int(t.shape[d]) == num_blocks:
                return d
        raise KVMigrationUnsupported(f"KV tensor of shape {tuple(t.shape)} has no block dimension of size "
                                     f"{num_blocks} among its first two")

    def layout(self) -> dict:
        """What must match on both ends: per layer the block shape, dtype and bytes per block."""
        kv = self.tensors()
        nb = self._num_blocks(kv)
        layers = []
        for t in kv:
            d = self._block_dim(t, nb)
            shape = [int(s) for i, s in enumerate(t.shape) if i != d]
            per_block = t.element_size()
            for s in shape:
                per_block *= s
            layers.append({"block_dim": d, "block_shape": shape, "dtype": str(t.dtype).replace("torch.", ""),
                           "block_bytes": per_block})
        return {"rank": self.rank, "device": str(kv[0].device.type), "layers": layers,
                "block_bytes": sum(x["block_bytes"] for x in layers)}

    @staticmethod
    def _comparable(layout: dict) -> list:
        return [(x["block_shape"], x["dtype"]) for x in layout["layers"]]

    def check_layout(self, peer: dict) -> None:
        mine = self.layout()
        if self._comparable(mine) != self._comparable(peer):
            raise KVMigrationUnsupported(f"KV layout differs on rank {self.rank}: peer {self._comparable(peer)} "
                                         f"vs here {self._comparable(mine)} (same model, dtype, tensor "
                                         "parallelism and block size are needed)")

    def _ids(self, block_ids: list[int], device: Any):
        import torch

        return torch.tensor([int(i) for i in block_ids], dtype=torch.long, device=device)

    def gather(self, block_ids: list[int]) -> list:
        """Per layer, a contiguous copy of ``block_ids`` (in that order)."""
        import torch

        kv = self.tensors()
        nb = self._num_blocks(kv)
        ids = self._ids(block_ids, kv[0].device)
        out = [t.index_select(self._block_dim(t, nb), ids).contiguous() for t in kv]
        if kv[0].is_cuda:
            torch.cuda.current_stream(kv[0].device).synchronize()
        return out

    def scatter(self, block_ids: list[int], tensors: list, fault: str | None = None) -> int:
        """Write per-layer ``tensors`` (as :meth:`gather` made them) into ``block_ids``."""
        import torch

        kv = self.tensors()
        if len(tensors) != len(kv):
            raise ValueError(f"received {len(tensors)} layers, this worker has {len(kv)}")
        nb = self._num_blocks(kv)
        ids = self._ids(block_ids, kv[0].device)
        nbytes = 0
        for i, (t, src) in enumerate(zip(kv, tensors)):
            d = self._block_dim(t, nb)
            want = [int(s) for s in t.shape]
            want[d] = len(block_ids)
            if list(src.shape) != want or src.dtype != t.dtype:
                raise ValueError(f"layer {i}: received {tuple(src.shape)} {src.dtype}, "
                                 f"expected {tuple(want)} {t.dtype}")
            t.index_copy_(d, ids, src.to(t.device, non_blocking=False))
            nbytes += src.numel() * src.element_size()
            if fault == "write" and i == 0:
                raise RuntimeError("injected fault: kv write failed after the first layer")
        if kv[0].is_cuda:
            torch.cuda.current_stream(kv[0].device).synchronize()
        return nbytes

    # -- source: read and send ------------------------------------------------------------------
    def send(self, xfer: dict) -> dict:
        """Read ``xfer["block_ids"]`` from every layer and send them to this rank's receiver on the
        target (``xfer["hosts"][rank]``, ``xfer["ports"][rank]``). Blocks until sent and the channel is
        closed. ``xfer["fault"] == "send"``: cancel the transfer after its first chunk (test hook)."""
        from vllm_kunserve.transfer import connect, make_store

        t0 = time.perf_counter()
        bufs = self.gather(xfer["block_ids"])
        t_gather = time.perf_counter() - t0
        nbytes = sum(b.numel() * b.element_size() for b in bufs)
        timeout = float(xfer.get("timeout_s", 30.0))
        ports = {int(k): int(v) for k, v in dict(xfer["ports"]).items()}
        hosts = {int(k): str(v) for k, v in dict(xfer["hosts"]).items()}
        if self.rank not in ports or self.rank not in hosts:
            raise KVMigrationUnsupported(f"the target has no receiver for rank {self.rank} (ranks {sorted(ports)})")
        fault = xfer.get("fault")
        chunk = int(xfer.get("chunk_bytes") or 0) or None
        if fault == "send":  # many chunks, so the failure lands mid-copy
            chunk = max(1, min(b.numel() * b.element_size() for b in bufs) // max(1, len(xfer["block_ids"])))

        def on_chunk(handle: Any, index: int) -> None:
            if fault == "send" and index == 0:
                handle.cancel()

        t1 = time.perf_counter()
        store = make_store(1, ports[self.rank], host=hosts[self.rank], timeout_s=timeout)
        ch = connect(1, store=store, host=local_ip(), device=bufs[0].device, name=f"kunserve-kv/{xfer['xfer_id']}",
                     timeout_s=timeout, connect_timeout_s=timeout, on_chunk_sent=on_chunk,
                     **({"chunk_bytes": chunk} if chunk else {}))
        t2 = time.perf_counter()
        try:
            h = ch.send_bulk(bufs, str(xfer["xfer_id"]))
            h.wait(timeout)
            chunks = h.num_chunks
            t3 = time.perf_counter()
        finally:
            ch.close()
        return {"rank": self.rank, "bytes": nbytes, "chunks": chunks, "gather_ms": round(t_gather * 1e3, 3),
                "connect_ms": round((t2 - t1) * 1e3, 3), "send_ms": round((t3 - t2) * 1e3, 3),
                "close_ms": round((time.perf_counter() - t3) * 1e3, 3)}

    # -- target: receive, write, close ----------------------------------------------------------
    def open(self, xfer: dict) -> dict:
        """Start receiving ``xfer["num_blocks"]`` blocks in a background thread (the engine keeps
        stepping); returns this rank's rendezvous ``{"rank", "host", "port"}``."""
        from vllm_kunserve.transfer import make_store

        if xfer.get("layout") is not None:
            peer = next((x for x in xfer["layout"] if int(x["rank"]) == self.rank), None)
            if peer is None:
                raise KVMigrationUnsupported(f"the source has no rank {self.rank}")
            self.check_layout(peer)
        xid = str(xfer["xfer_id"])
        timeout = float(xfer.get("timeout_s", 30.0))
        host = local_ip()
        store = make_store(0, 0, host=host, timeout_s=timeout)
        rx = _Incoming(xid, int(xfer["num_blocks"]))
        device = self.tensors()[0].device
        rx.thread = threading.Thread(target=self._receive, args=(rx, store, host, device, timeout),
                                     name=f"kunserve-kv-rx-{xid}", daemon=True)
        with self._lock:
            if xid in self.incoming:
                raise ValueError(f"transfer {xid} is already open")
            self.incoming[xid] = rx
        rx.thread.start()
        return {"rank": self.rank, "host": host, "port": int(store.port)}

    def _receive(self, rx: _Incoming, store: Any, host: str, device: Any, timeout: float) -> None:
        from vllm_kunserve.transfer import connect

        ch = None
        try:
            ch = connect(0, store=store, host=host, device=device, name=f"kunserve-kv/{rx.xfer_id}",
                         timeout_s=timeout, connect_timeout_s=timeout)
            rx.channel = ch
            _, tensors = ch.recv_bulk(rx.xfer_id, timeout=timeout)
            rx.tensors = tensors
            rx.bytes = sum(t.numel() * t.element_size() for t in tensors)
            rx.received_s = time.perf_counter() - rx.started
        except BaseException as exc:  # handed to write()/close() on the worker's main thread
            rx.error = exc
        finally:
            rx.done.set()  # the bytes are ours (or the error is): write() need not wait for the close
            if ch is not None:
                try:
                    ch.close()
                except Exception:  # the link is going away either way
                    pass

    def write(self, xfer: dict) -> dict:
        """Wait for the receive (up to ``timeout_s``), then write the blocks into
        ``xfer["block_ids"]``. The transfer is closed either way."""
        xid = str(xfer["xfer_id"])
        with self._lock:
            rx = self.incoming.pop(xid, None)
        if rx is None:
            raise KeyError(f"no open transfer {xid} on rank {self.rank}")
        timeout = float(xfer.get("timeout_s", 30.0))
        try:
            if not rx.done.wait(timeout):
                raise TimeoutError(f"transfer {xid}: rank {self.rank} received nothing complete in {timeout:g} s")
            if rx.error is not None:
                raise RuntimeError(f"transfer {xid}: receive failed on rank {self.rank}: {rx.error!r}") from rx.error
            t0 = time.perf_counter()
            nbytes = self.scatter(xfer["block_ids"], rx.tensors or [], fault=xfer.get("fault"))
            return {"rank": self.rank, "bytes": nbytes, "receive_ms": round(rx.received_s * 1e3, 3),
                    "write_ms": round((time.perf_counter() - t0) * 1e3, 3)}
        finally:
            rx.tensors = None
            self._stop(rx)

    def close(self, xfer_id: str) -> bool:
        """Abort a staged receive (idempotent). Returns whether one was open."""
        with self._lock:
            rx = self.incoming.pop(str(xfer_id), None)
        if rx is None:
            return False
        rx.tensors = None
        self._stop(rx)
        return True

    @staticmethod
    def _stop(rx: _Incoming) -> None:
        """Stop a receive still in progress (a finished one closes its channel by itself)."""
        if rx.done.is_set():
            return
        ch = rx.channel
        if ch is not None:  # connected: tear the link down, the thread's receive fails at once
            ch.group.abort()
        # not connected yet: the thread gives up after its connect timeout (daemon, holds no blocks)


def worker_kv(worker: Any) -> WorkerKV:
    kv = worker.__dict__.get("_kunserve_kv")
    if kv is None:
        kv = worker.__dict__["_kunserve_kv"] = WorkerKV(worker)
    return kv


def _register() -> None:
    from vllm_kunserve.engine.migration import provide_scheduler_kv

    provide_scheduler_kv(SchedulerKV)


_register()
