"""KV migration between two engines: the engine agent's control operations (issue 12).

A request stopped on the source engine leaves its full KV blocks in the source's prefix cache. The
front end asks the source to move the KV of the request's token ids (prompt + generated) to a
target engine, then sends the continuation (prompt = those token ids) to the target, whose prefix
cache now holds the migrated blocks: only the tokens whose KV did not arrive are recomputed. No
request ids and no kernel changes: the prefix cache is the interface on both ends. Staged like
Llumnix, driven by the source's ``kv_export``:

1. **lookup** (source): hash the token ids as the scheduler does, find the longest cached prefix,
   pin those blocks (they cannot be evicted or reused until the export ends).
2. **prepare** (target, ``kv_import_prepare``): hash the same token ids with the target's own hash
   function and seed, skip the blocks it already caches (and pin them), take the missing ones from
   its free queue and hold them (no hash: invisible to requests), open one receiver per worker
   (a background thread: the target keeps stepping while the bytes arrive).
3. **copy** (source workers -> target workers): each source worker reads the blocks of every layer
   and sends them over a one-shot transfer channel (``vllm_kunserve.transfer``) to the same rank.
4. **commit** (target, ``kv_import_commit``): write the received blocks into the held ones on every
   worker, register them in the prefix cache under the target's hashes, release them (cached and
   free, like the blocks of a finished request) -- or **abort** (``kv_import_abort``, or any
   failure): close the receivers and free the held blocks unregistered.

Any failure rolls back (target blocks freed unregistered, source blocks unpinned) and is reported
as ``outcome: failed``; the engine keeps serving and the continuation simply re-prefills. A staged
import that is never committed (the source died) is aborted after ``ttl_s``. Blocks evicted on the
source before the export leave a shorter cached prefix, which is exported (a shorter hit is still
correct); so does a target without enough free blocks.

The data path is the transfer channel between the workers (gloo on CPU, NCCL on CUDA): the KV
never passes through the engine-core processes, vLLM's RPC queues or HTTP; the control port only
carries the small JSON of the staged operations. The source's ``kv_export`` holds the source
engine between steps for the whole sequence (its request is stopped already; the other requests
wait for the copy); the target is held only for prepare and commit.

This module knows no vLLM and no torch: the scheduler-side view (``SchedulerKV`` in
``integration/vllm/kv_migration.py``) is provided by the integration layer through
:func:`provide_scheduler_kv`; the worker half is reached with the agent's worker calls
(``kunserve_kv_layout``, ``kunserve_kv_read``, ``kunserve_kv_open``, ``kunserve_kv_write``,
``kunserve_kv_close``).
"""

from __future__ import annotations

import base64
import logging
import os
import struct
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm_kunserve.engine.control import MAX_BODY, TOKEN_ENV, ControlRequestError
from vllm_kunserve.engine.portcall import ControlPortError, ControlPortNotAnObject, call_json
from vllm_kunserve.engine.state import EngineState, EngineStateError

logger = logging.getLogger("vllm.kunserve")

#: the agent's migration operations: name -> parameters
MIGRATION_OPERATIONS = {
    "kv_export": "token_ids (list of int) or token_ids_b64 (int32 LE), target (control URL; omitted: "
                 "only report what is cached), target_token, cache_salt, max_blocks, timeout_s (30), "
                 "chunk_bytes, inject_fault (send|write|commit: test hook)",
    "kv_import_prepare": "token_ids_b64 or token_ids, cache_salt, block_size, layout, num_blocks, timeout_s, "
                         "ttl_s (staged blocks are freed after it), inject_fault (called by kv_export)",
    "kv_import_commit": "import_id, timeout_s: write, register in the prefix cache, release (called by kv_export)",
    "kv_import_abort": "import_id: free the staged blocks unregistered (idempotent)",
}

#: test hooks: where an injected failure happens
FAULTS = ("send", "write", "commit")

_DEFAULT_TIMEOUT_S = 30.0
_DEFAULT_TTL_S = 120.0
#: blocks a target keeps free for its own requests when it takes blocks for an import
_RESERVE_FRACTION = 0.05

_scheduler_kv_factory: Callable[[Any], Any] | None = None


def provide_scheduler_kv(factory: Callable[[Any], Any]) -> None:
    """Called by the integration layer: ``factory(vllm_scheduler)`` builds the scheduler-side KV
    view (hashes, cached prefix, pin / allocate / register / release)."""
    global _scheduler_kv_factory
    _scheduler_kv_factory = factory


class MigrationError(RuntimeError):
    pass


# -- token ids on the wire ---------------------------------------------------------------------------
def encode_tokens(token_ids: list[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(token_ids)}i", *token_ids)).decode()


def decode_tokens(params: dict, what: str) -> list[int]:
    if params.get("token_ids_b64") is not None:
        raw = params["token_ids_b64"]
        try:
            data = base64.b64decode(raw, validate=True) if isinstance(raw, str) else b"?"
            if len(data) % 4:
                raise ValueError("length is not a multiple of 4")
            ids = list(struct.unpack(f"<{len(data) // 4}i", data))
        except (ValueError, struct.error) as exc:
            raise ControlRequestError(f"{what}: token_ids_b64 is not base64 of int32 values: {exc}") from None
    else:
        ids = params.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ControlRequestError(f"{what}: token_ids must be a list of integers (or token_ids_b64), "
                                      f"got {type(ids).__name__}")
    if not ids or min(ids) < 0:
        raise ControlRequestError(f"{what}: token_ids must be non-empty and non-negative")
    return ids


def _number(params: dict, key: str, default: float, lo: float, hi: float, what: str) -> float:
    v = params.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ControlRequestError(f"{what}: '{key}' must be a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _opt_int(params: dict, key: str, lo: int, what: str) -> int | None:
    v = params.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ControlRequestError(f"{what}: '{key}' must be an integer >= {lo}, got {v!r}")
    return v


def _opt_str(params: dict, key: str, what: str) -> str | None:
    v = params.get(key)
    if v is not None and not isinstance(v, str):
        raise ControlRequestError(f"{what}: '{key}' must be a string, got {v!r}")
    return v or None


# -- the control port of another engine --------------------------------------------------------------
def _request(url: str, path: str, body: dict | None, token: str | None, timeout_s: float) -> dict:
    try:
        return call_json(url.rstrip("/") + path, body, token, timeout_s)
    except ControlPortError as e:
        why = f"HTTP {e.status}: {e.body}" if e.status and not isinstance(e, ControlPortNotAnObject) else f"{e}: {e.body}"
        raise MigrationError(f"{url}{path}: {why}") from None


@dataclass
class StagedImport:
    import_id: str
    prefix: Any
    pinned: list            # blocks the target already cached (held so they stay hit-able)
    blocks: list            # blocks taken for the import (held, no hash)
    skip: int
    fault: str | None
    created: float = field(default_factory=time.monotonic)
    timer: threading.Timer | None = None


class KVMigration:
    """The migration operations of one engine (made by the agent on first use). Every method runs
    under the agent's lock (between engine steps), except the expiry timer, which goes through
    ``submit`` (the control port's path) like any other caller."""

    def __init__(self, sched: Any, workers: Callable[..., list], submit: Callable[[str, dict, float], dict],
                 event: Callable[..., dict], info: dict, label: str = "0") -> None:
        self.sched = sched
        self.workers = workers
        self.submit = submit
        self.event = event
        self.info = info
        self.label = label
        self.imports: dict[str, StagedImport] = {}
        self._kv: Any = None
        self._layout: list[dict] | None = None

    # -- views ------------------------------------------------------------------------------------
    @property
    def kv(self) -> Any:
        if self._kv is None:
            if _scheduler_kv_factory is None:
                raise MigrationError("KV migration is not available: the vLLM integration is not loaded")
            self._kv = _scheduler_kv_factory(self.sched.scheduler)
        return self._kv

    def layout(self) -> list[dict]:
        if self._layout is None:
            self._layout = sorted(self.workers("kunserve_kv_layout"), key=lambda x: int(x["rank"]))
        return self._layout

    def block_bytes(self) -> int:
        """KV bytes of one block over every layer of every worker."""
        return sum(int(w["block_bytes"]) for w in self.layout())

    def call(self, op: str, params: dict) -> dict:
        if op == "kv_export":
            return self.export(params)
        if op == "kv_import_prepare":
            return self.prepare(params)
        if op == "kv_import_commit":
            return self.commit(params)
        if op == "kv_import_abort":
            return self.abort(params)
        raise ControlRequestError(f"unknown migration operation {op!r}")

    # -- source -----------------------------------------------------------------------------------
    def export(self, params: dict) -> dict:
        what = "kv_export"
        token_ids = decode_tokens(params, what)
        target = _opt_str(params, "target", what)
        token = _opt_str(params, "target_token", what) or os.environ.get(TOKEN_ENV) or None
        salt = _opt_str(params, "cache_salt", what)
        max_blocks = _opt_int(params, "max_blocks", 0, what)
        chunk_bytes = _opt_int(params, "chunk_bytes", 1, what)
        timeout = _number(params, "timeout_s", _DEFAULT_TIMEOUT_S, 1.0, 3600.0, what)
        fault = _opt_str(params, "inject_fault", what)
        if fault is not None and fault not in FAULTS:
            raise ControlRequestError(f"{what}: inject_fault must be one of {', '.join(FAULTS)}, got {fault!r}")
        if target is not None and urllib.parse.urlparse(target).scheme not in ("http", "https"):
            raise ControlRequestError(f"{what}: target must be the target engine's control URL (http://host:port), "
                                      f"got {target!r}")
        try:
            kv = self.kv
            kv.check_enabled()
        except Exception as exc:
            raise ControlRequestError(f"{what}: {exc}") from None

        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        bs = kv.block_size
        # the continuation's last token is always computed (vLLM hits at most num_tokens - 1),
        # so a block ending exactly at the end of token_ids is never worth sending
        usable = (len(token_ids) - 1) // bs
        if max_blocks is not None:
            usable = min(usable, max_blocks)
        prefix = kv.prefix(token_ids[:usable * bs], salt)
        blocks = kv.cached_prefix(prefix)
        if target is not None and blocks:
            # the prepare body carries the token ids: keep it under the control port's body limit
            fit = ((MAX_BODY - 8192) * 3 // 4) // 4 // bs
            blocks = blocks[:fit]
        per_block = self.block_bytes()
        base = {"tokens": len(token_ids), "block_size": bs, "cached_blocks": len(blocks),
                "cached_tokens": len(blocks) * bs, "block_bytes": per_block, "target": target}
        phases["lookup_ms"] = (time.perf_counter() - t0) * 1e3
        if target is None or not blocks:
            return {"event": "kv_export", "outcome": "probe" if target is None else "nothing",
                    "bytes": len(blocks) * per_block if target is None else 0, **base}
        kv.pin(blocks)
        import_id = None
        try:
            self._not_self(target, token, timeout)
            t = time.perf_counter()
            n = len(blocks)
            prep = _request(target, "/ops/kv_import_prepare", {
                "token_ids_b64": encode_tokens(token_ids[:n * bs]), "cache_salt": salt, "block_size": bs,
                "num_blocks": n, "layout": self.layout(), "timeout_s": timeout, "source": self.info.get("control_url"),
                **({"inject_fault": fault} if fault in ("write", "commit") else {})}, token, timeout)
            phases["prepare_ms"] = (time.perf_counter() - t) * 1e3
            import_id, skip, count = prep.get("import_id"), int(prep["skip_blocks"]), int(prep["blocks"])
            if import_id is None or count == 0:
                return self.event("kv_export", "nothing", time.perf_counter() - t0, 0, **base, skipped_blocks=skip,
                                  sent_blocks=0, target_cached_tokens=skip * bs, reason=prep.get("reason"),
                                  phases=_round(phases))
            t = time.perf_counter()
            ids = kv.block_ids(blocks[skip:skip + count])
            sent = self.workers("kunserve_kv_read", {
                "xfer_id": import_id, "block_ids": ids, "hosts": prep["hosts"], "ports": prep["ports"],
                "timeout_s": timeout, "chunk_bytes": chunk_bytes, "fault": fault if fault == "send" else None})
            phases["copy_ms"] = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            done = _request(target, "/ops/kv_import_commit", {"import_id": import_id, "timeout_s": timeout}, token,
                            timeout + 5)
            import_id = None  # committed (or rolled back by the target itself)
            phases["commit_ms"] = (time.perf_counter() - t) * 1e3
        except Exception as exc:
            if import_id is not None:
                try:
                    _request(target, "/ops/kv_import_abort", {"import_id": import_id, "reason": "source failed"},
                             token, timeout)
                except Exception as abort_exc:  # the target's expiry timer frees the blocks then
                    logger.warning("kunserve kv_export: abort of %s on %s failed: %r", import_id, target, abort_exc)
            return self.event("kv_export", "failed", time.perf_counter() - t0, 0, **base, error=repr(exc),
                              phases=_round(phases))
        finally:
            kv.release(blocks)
        nbytes = sum(int(s["bytes"]) for s in sent)
        return self.event("kv_export", "ok", time.perf_counter() - t0, nbytes, **base, skipped_blocks=skip,
                          sent_blocks=count, target_cached_tokens=(skip + count) * bs,
                          chunks=sum(s["chunks"] for s in sent),
                          phases=_round({**phases, **{k: max(s[k] for s in sent) for k in
                                                      ("gather_ms", "connect_ms", "send_ms", "close_ms")},
                                         "target_write_ms": done.get("write_ms", 0.0)}),
                          target_free_blocks=done.get("free_blocks"))

    def _not_self(self, target: str, token: str | None, timeout: float) -> None:
        """Exporting to this very engine would wait on its own lock: refuse it (the target's
        /state needs no lock)."""
        mine = self.info.get("control_url")
        if mine and target.rstrip("/") == mine.rstrip("/"):
            raise MigrationError("the target is this engine")
        try:
            eng = EngineState.from_dict(_request(target, "/state", None, token, timeout)).engine
        except EngineStateError as e:
            raise MigrationError(f"{target}/state: {e}") from None
        if mine and eng.control_url == mine and eng.pid == os.getpid():
            raise MigrationError("the target is this engine")

    # -- target -----------------------------------------------------------------------------------
    def prepare(self, params: dict) -> dict:
        what = "kv_import_prepare"
        token_ids = decode_tokens(params, what)
        salt = _opt_str(params, "cache_salt", what)
        timeout = _number(params, "timeout_s", _DEFAULT_TIMEOUT_S, 1.0, 3600.0, what)
        ttl = _number(params, "ttl_s", max(_DEFAULT_TTL_S, 4 * timeout), 1.0, 86400.0, what)
        fault = _opt_str(params, "inject_fault", what)
        if fault is not None and fault not in FAULTS:
            raise ControlRequestError(f"{what}: inject_fault must be one of {', '.join(FAULTS)}, got {fault!r}")
        layout = params.get("layout")
        if layout is not None and not (isinstance(layout, list) and all(isinstance(x, dict) for x in layout)):
            raise ControlRequestError(f"{what}: layout must be a list of per-rank objects")
        kv = self.kv
        try:
            kv.check_enabled()
        except Exception as exc:
            raise ControlRequestError(f"{what}: {exc}") from None
        bs = params.get("block_size")
        if bs is not None and bs != kv.block_size:
            raise ControlRequestError(f"{what}: the source's block size {bs} differs from this engine's "
                                      f"{kv.block_size}")
        if layout is not None and len(layout) != len(self.layout()):
            raise ControlRequestError(f"{what}: the source has {len(layout)} workers, this engine {len(self.layout())}")
        prefix = kv.prefix(token_ids, salt)
        n_total = prefix.num_blocks
        want = _opt_int(params, "num_blocks", 0, what)
        if want is not None:
            n_total = min(n_total, want)
        free_before = kv.free_blocks()
        have = kv.cached_prefix(prefix, n_total)
        skip = len(have)
        reserve = int(_RESERVE_FRACTION * kv.usable_blocks())
        need = max(0, min(n_total - skip, free_before - reserve))
        reply = {"block_size": kv.block_size, "skip_blocks": skip, "free_blocks": free_before}
        if need == 0:
            why = "already cached" if skip >= n_total else "no free blocks"
            return {**reply, "import_id": None, "blocks": 0, "reason": why}
        import_id = uuid.uuid4().hex[:16]
        kv.pin(have)
        blocks: list = []
        try:
            blocks = kv.allocate(need)
            opened = self.workers("kunserve_kv_open", {"xfer_id": import_id, "num_blocks": need, "layout": layout,
                                                       "timeout_s": timeout})
        except Exception as exc:
            self._close_workers(import_id)
            kv.release(have + blocks)
            if isinstance(exc, ControlRequestError):
                raise
            raise MigrationError(f"{what}: {exc}") from exc
        staged = StagedImport(import_id, prefix, have, blocks, skip, fault)
        staged.timer = threading.Timer(ttl, self._expire, args=(import_id,))
        staged.timer.daemon = True
        staged.timer.start()
        self.imports[import_id] = staged
        return {**reply, "import_id": import_id, "blocks": need, "hosts": {str(o["rank"]): o["host"] for o in opened},
                "ports": {str(o["rank"]): int(o["port"]) for o in opened}, "ttl_s": ttl}

    def commit(self, params: dict) -> dict:
        what = "kv_import_commit"
        import_id = _opt_str(params, "import_id", what)
        timeout = _number(params, "timeout_s", _DEFAULT_TIMEOUT_S, 1.0, 3600.0, what)
        staged = self.imports.pop(import_id or "", None)
        if staged is None:
            raise ControlRequestError(f"{what}: no staged import {import_id!r} (expired or aborted?)")
        if staged.timer is not None:
            staged.timer.cancel()
        kv = self.kv
        t0 = time.perf_counter()
        try:
            wrote = self.workers("kunserve_kv_write", {
                "xfer_id": staged.import_id, "block_ids": kv.block_ids(staged.blocks), "timeout_s": timeout,
                "fault": staged.fault if staged.fault == "write" else None})
            if staged.fault == "commit":
                raise MigrationError("injected fault: commit failed before registering the blocks")
            kv.register(staged.prefix, staged.blocks, staged.skip)
        except Exception as exc:
            self._close_workers(staged.import_id)
            kv.release(staged.pinned + staged.blocks)  # unregistered: plain free blocks again
            self.event("kv_import", "failed", time.perf_counter() - t0, 0, import_id=staged.import_id,
                       blocks=len(staged.blocks), error=repr(exc), free_blocks=kv.free_blocks())
            raise MigrationError(f"{what}: rolled back: {exc}") from exc
        kv.release(staged.pinned + staged.blocks)
        nbytes = sum(int(w["bytes"]) for w in wrote)
        return self.event("kv_import", "ok", time.perf_counter() - t0, nbytes, import_id=staged.import_id,
                          blocks=len(staged.blocks), skipped_blocks=staged.skip,
                          cached_tokens=(staged.skip + len(staged.blocks)) * kv.block_size,
                          write_ms=max(w["write_ms"] for w in wrote), receive_ms=max(w["receive_ms"] for w in wrote),
                          free_blocks=kv.free_blocks())

    def abort(self, params: dict) -> dict:
        import_id = _opt_str(params, "import_id", "kv_import_abort")
        staged = self.imports.pop(import_id or "", None)
        if staged is None:
            return {"aborted": False, "import_id": import_id}
        if staged.timer is not None:
            staged.timer.cancel()
        self._close_workers(staged.import_id)
        self.kv.release(staged.pinned + staged.blocks)
        reason = params.get("reason") if isinstance(params.get("reason"), str) else "requested"
        self.event("kv_import", "aborted", 0.0, 0, import_id=staged.import_id,
                   blocks=len(staged.blocks), reason=reason, free_blocks=self.kv.free_blocks())
        return {"aborted": True, "import_id": staged.import_id, "blocks": len(staged.blocks),
                "free_blocks": self.kv.free_blocks()}

    def _close_workers(self, import_id: str) -> None:
        try:
            self.workers("kunserve_kv_close", import_id)
        except Exception as exc:  # a receiver that never connected ends by its own timeout
            logger.warning("kunserve kv import %s: closing the receivers failed: %r", import_id, exc)

    def _expire(self, import_id: str) -> None:
        """Timer thread: free an import nobody committed (through the control path, so it runs
        between engine steps)."""
        for _ in range(10):
            if import_id not in self.imports:
                return
            try:
                self.submit("kv_import_abort", {"import_id": import_id, "reason": "expired"}, 60.0)
                return
            except Exception as exc:  # busy (another operation) or shutting down: try again
                logger.warning("kunserve kv import %s: expiry abort failed (%r); retrying", import_id, exc)
                time.sleep(1.0)


def _round(d: dict) -> dict:
    return {k: round(float(v), 3) for k, v in d.items()}
