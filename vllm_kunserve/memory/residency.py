"""Layer residency: where each decoder layer's weights live, and the transitions between states.

Each layer is one of:

* ``resident``: its weights are mapped in its own weight region of the pool;
* ``streamed`` (Oneiros remap): its region's chunks went to the KV cache; it computes from a shared
  slot, refilled from its host copy just before it runs (:class:`~.streaming.WeightStreamer`);
* ``dropped`` (KunServe): its region's chunks went to the KV cache and it does not run on this
  engine at all (a pipeline peer runs it); its tensors are guards that raise if touched.

KV regions grow into the chunks weights give up and shrink before weights come back. Every
transition is a :class:`~.transaction.Transaction`: each step records its undo and a failure at any
step restores the state before the transition, so no layer is ever left computing from unmapped
memory. Transitions can be kept *prepared* (``commit=False``) until :meth:`commit` or :meth:`abort`,
which lets an engine move several workers together.

Nothing here knows vLLM: the engine integration passes the layers, the pool regions and an optional
:class:`SlotAdapter` (how a backend's kernels read a slot, e.g. oneDNN-packed weights on CPU).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import guard
from .pool import KVRegion, MemoryPool, WeightRegion
from .streaming import WeightStreamer
from .transaction import StepFaults, Transaction

logger = logging.getLogger("vllm.kunserve")

#: fault points, in the order transitions reach them (``StepFaults.arm(name)``)
STEPS = ("pack", "streamer_uninstall", "release", "slot_create", "streamer_install", "copy_plan",
         "kv_grow", "kv_shrink", "slot_destroy", "reload", "foreign_create", "exchange", "kv_free", "kv_regrow",
         "foreign_destroy", "give_back", "kv_borrow", "kv_repay", "unstream")


class LayerState(str, Enum):
    RESIDENT = "resident"
    STREAMED = "streamed"
    DROPPED = "dropped"


class SlotAdapter:
    """How streamed layers compute from a slot. The default (GPU) needs nothing: kernels read the
    slot tensors the streamer points the parameters at."""

    def kind(self) -> str:
        return "slot_weights"

    def prepare(self, i: int) -> int:
        """Called while layer ``i`` is still resident, before it is first streamed."""
        return 0

    def copy_plan(self, entries: list[Any]) -> Callable | None:
        return None

    def point(self, i: int, slot: int | None) -> None:
        """Layer ``i`` computes from ``slot`` (streamed) or from its own region (None)."""

    def drop_slots(self) -> None:
        """The slots are gone (everything resident again)."""


@dataclass
class KVPlace:
    name: str
    region: KVRegion
    page_bytes: int  # bytes of one KV block of this layer
    layer: int = -1  # the decoder layer whose KV this is (-1: unknown, always counted)
    origin: str = ""  # "": this engine's requests; else the group peer whose requests' KV this holds


class LayerResidency:
    """The residency state machine of one engine's decoder layers over one memory pool."""

    def __init__(self, pool: MemoryPool, layers: Sequence[nn.Module], weights: Sequence[WeightRegion],
                 kv: Sequence[KVPlace], max_blocks: int, base_blocks: int,
                 adapter: SlotAdapter | None = None, faults: StepFaults | None = None) -> None:
        if len(layers) != len(weights):
            raise ValueError(f"{len(layers)} layers but {len(weights)} weight regions")
        self.pool = pool
        self.layers = list(layers)
        self.weights = list(weights)
        self.kv = list(kv)
        self.max_blocks = int(max_blocks)
        self.base_blocks = int(base_blocks)
        self.adapter = adapter or SlotAdapter()
        self.faults = faults or StepFaults()
        self.states = [LayerState.RESIDENT] * len(self.layers)
        self.streamer: WeightStreamer | None = None
        self.slot_regions: list[KVRegion] = []
        self.pending: Transaction | None = None
        self.events: list[dict] = []
        #: the streaming link as the engine measured it (reported in ``state()``)
        self.h2d_bytes_per_s = 0.0
        self.copy_overlap = True

    # -- queries --------------------------------------------------------------------------------
    def _in(self, state: LayerState) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.states) if s is state)

    @property
    def streamed(self) -> tuple[int, ...]:
        return self._in(LayerState.STREAMED)

    @property
    def dropped(self) -> tuple[int, ...]:
        return self._in(LayerState.DROPPED)

    def _active(self, origin: str | None = "") -> list[KVPlace]:
        """KV places in use: this engine's (``origin=""``) for the layers it runs, a peer's
        (``origin=name``) or all of them (``None``)."""
        return [k for k in self.kv if (origin is None or k.origin == origin)
                and (k.origin or k.layer < 0 or self.states[k.layer] is not LayerState.DROPPED)]

    @staticmethod
    def _blocks(places: Sequence[KVPlace], cap: int) -> int:
        return min((min(k.region.mapped_bytes // k.page_bytes, cap) for k in places), default=0)

    @property
    def mapped_blocks(self) -> int:
        """Blocks mapped in every KV region of the layers this engine runs (what its scheduler may
        use, as far as this engine's memory goes)."""
        return self._blocks(self._active(), self.max_blocks)

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(sorted({k.origin for k in self.kv if k.origin}))

    def foreign_blocks(self, origin: str) -> int:
        """Blocks of group peer ``origin``'s requests this engine can hold for the layers it runs."""
        return self._blocks(self._active(origin), self.max_blocks)

    @property
    def block_bytes(self) -> int:
        return sum(k.page_bytes for k in self.kv)

    def layer_bytes(self) -> list[int]:
        return [w.image_bytes for w in self.weights]

    def state(self) -> dict:
        st = self.pool.stats()
        return {"layers": [s.value for s in self.states], "remapped_layers": list(self.streamed),
                "dropped_layers": list(self.dropped), "slots": len(self.slot_regions),
                "mapped_blocks": self.mapped_blocks, "base_blocks": self.base_blocks,
                "max_blocks": self.max_blocks, "block_bytes": self.block_bytes,
                "layer_bytes": self.layer_bytes(), "num_layers": len(self.layers),
                "chunk_bytes": st.chunk_bytes, "free_chunks": st.free_chunks, "total_chunks": st.total_chunks,
                "held_bytes": self.pool.held_bytes,
                "pending": self.pending.name if self.pending else None,
                "stream": vars(self.streamer.stats) if self.streamer else None,
                "streamed_linear": self.adapter.kind(), "faults_armed": self.faults.armed,
                "kv_regions": len([k for k in self.kv if not k.origin]),
                "foreign_blocks": {o: self.foreign_blocks(o) for o in self.peers},
                "h2d_bytes_per_s": self.h2d_bytes_per_s,
                "copy_overlap": self.copy_overlap,
                "events": self.events[-20:]}

    def check_invariants(self) -> list[str]:
        """Every chunk accounted for, every layer's tensors where its state says, KV >= base."""
        problems = []
        try:
            self.pool.check()
        except Exception as exc:
            problems.append(f"pool: {exc}")
        slots = [(r.va, r.va + r.mapped_bytes) for r in self.slot_regions]
        for i, (st, w) in enumerate(zip(self.states, self.weights)):
            if w.released != (st is not LayerState.RESIDENT):
                problems.append(f"layer {i} is {st.value} but its region is {'released' if w.released else 'mapped'}")
            for e in w.entries:
                t = (e.owner._parameters if e.kind == "param" else e.owner._buffers).get(e.attr)
                if t is None or t.numel() == 0:
                    continue
                guarded = isinstance(t, guard.ReleasedTensor)
                ptr = t.data_ptr() if not guarded else -1
                if st is LayerState.RESIDENT:
                    ok = not guarded and w.va <= ptr < w.va + w.mapped_bytes
                elif st is LayerState.STREAMED:
                    ok = not guarded and any(lo <= ptr < hi for lo, hi in slots)
                else:
                    ok = guarded
                if not ok:
                    problems.append(f"layer {i} ({st.value}) {e.name}: "
                                    f"{'guard' if guarded else hex(ptr)} is not where its state says")
        want = self.streamed
        have = tuple(self.streamer.remapped) if self.streamer is not None and self.streamer.installed else ()
        if want != have:
            problems.append(f"streamed layers {list(want)} but the streamer runs {list(have)}")
        if self.mapped_blocks < self.base_blocks:
            problems.append(f"KV maps {self.mapped_blocks} blocks, below the base {self.base_blocks}")
        for k in self.kv:
            if not k.origin and k.layer >= 0 and self.states[k.layer] is LayerState.DROPPED \
                    and k.region.mapped_bytes and self.pending is None:
                problems.append(f"{k.name}: layer {k.layer} is dropped but its KV region maps {k.region.mapped_bytes} bytes")
        return problems

    # -- two-phase use ----------------------------------------------------------------------------
    def commit(self) -> None:
        if self.pending is not None:
            self.pending.commit()
            self.pending = None

    def abort(self) -> list[str]:
        """Undo the prepared transition (no-op when none is pending). Returns the undone steps."""
        tx, self.pending = self.pending, None
        if tx is None:
            return []
        self._drain()
        undone = tx.rollback()
        self.event(f"{tx.name}_aborted", 0.0, 0, undone=undone)
        return undone

    # -- transitions ---------------------------------------------------------------------------------
    def remap(self, layers: Sequence[int], num_slots: int, commit: bool = True, lend: bool = False) -> int:
        """Stream ``layers`` through ``num_slots`` slots; their memory grows the KV cache, or with
        ``lend`` goes back to the device or host (every free chunk: another engine's KV takes it).

        From no streaming any resident layers work; with layers already streamed the new set must
        contain them and keep the slot count (the KV cache above the old size is in use).
        Returns the new mapped block count."""
        T = self._check_layers(layers, "remap")
        C = self.streamed
        if not T or len(T) + len(self.dropped) >= len(self.layers):
            raise ValueError("remap needs 1..L-1 layers and at least one resident layer left")
        if any(self.states[i] is LayerState.DROPPED for i in T):
            raise ValueError(f"remap layers {list(T)}: some are dropped on this engine")
        if num_slots not in (1, 2) or num_slots > len(T):
            raise ValueError(f"num_slots={num_slots}: must be 1 or 2 and at most the remapped layers")
        slot_bytes = max(self.weights[i].image_bytes for i in T)
        if C and (not set(C) <= set(T) or num_slots != len(self.slot_regions)):
            raise ValueError(f"layers {list(C)} are streamed with {len(self.slot_regions)} slot(s); a further "
                             f"remap must keep them and the slot count (got {list(T)}, {num_slots})")
        if C and slot_bytes > self.slot_regions[0].mapped_bytes:
            raise ValueError("a newly remapped layer is larger than the existing slots")
        new = [i for i in T if i not in C]
        if not new:
            return self.mapped_blocks

        def body(tx: Transaction) -> None:
            for i in new:
                tx.step("pack", lambda i=i: self.adapter.prepare(i))
            if C:
                self._t_uninstall(tx, C)
            for i in new:
                self._t_release(tx, i, LayerState.STREAMED)
            if not C:
                self._t_slots_create(tx, num_slots, slot_bytes)
            self._t_install(tx, T)
            if lend:
                self._t_give_back(tx)
            else:
                self._t_kv(tx, "kv_grow", None)
        return self._run("lend" if lend else "remap", body, commit, layers=list(T), new_layers=new, slots=num_slots,
                         nbytes=sum(self.weights[i].max_bytes for i in new))

    def revert(self, kv_blocks: int | None = None, keep: Sequence[int] = (), commit: bool = True) -> int:
        """Stop streaming every layer not in ``keep`` (which must be streamed now): KV shrinks to
        ``kv_blocks`` (default the base) first, then those layers are reloaded from their host
        copies. The blocks above ``kv_blocks`` must be unused. Returns the mapped block count."""
        C = self.streamed
        K = set(self._check_layers(keep, "revert keep")) if keep else set()
        if not K <= set(C):
            raise ValueError(f"revert keep={sorted(K)}: not all of them are streamed ({list(C)})")
        if not C or K == set(C):
            return self.mapped_blocks
        T = tuple(sorted(K))
        back = [i for i in C if i not in K]
        blocks = self.base_blocks if kv_blocks is None else int(kv_blocks)

        def body(tx: Transaction) -> None:
            self._t_kv(tx, "kv_shrink", blocks)
            self._t_uninstall(tx, C)
            if not T:
                self._t_slots_destroy(tx)
            for i in back:
                self._t_reload(tx, i)
            if T:
                self._t_install(tx, T)
        out = self._run("revert", body, commit, layers=back, kept=list(T),
                        nbytes=sum(self.weights[i].max_bytes for i in back))
        if not T and self.pending is None:
            self.adapter.drop_slots()
        return out

    def drop(self, layers: Sequence[int], commit: bool = True) -> int:
        """Give resident ``layers``' memory to the KV cache; they no longer run on this engine."""
        D = self._check_layers(layers, "drop")
        if any(self.states[i] is not LayerState.RESIDENT for i in D):
            raise ValueError(f"drop {list(D)}: only resident layers can be dropped (states "
                             f"{[self.states[i].value for i in D]})")
        if len(D) + len(self.dropped) + len(self.streamed) >= len(self.layers):
            raise ValueError("drop would leave no resident layer on this engine")

        def body(tx: Transaction) -> None:
            for i in D:
                self._t_release(tx, i, LayerState.DROPPED)
            self._t_kv(tx, "kv_grow", None)
        return self._run("drop", body, commit, layers=list(D), nbytes=sum(self.weights[i].max_bytes for i in D))

    def restore(self, layers: Sequence[int], kv_blocks: int | None = None,
                images: dict[int, torch.Tensor] | None = None, commit: bool = True) -> int:
        """Bring dropped ``layers`` back: KV shrinks to ``kv_blocks`` (default the base) first, then
        each layer is reloaded from ``images[i]`` (bytes received from a peer) or its host copy."""
        R = self._check_layers(layers, "restore")
        if any(self.states[i] is not LayerState.DROPPED for i in R):
            raise ValueError(f"restore {list(R)}: only dropped layers can be restored")
        blocks = self.base_blocks if kv_blocks is None else int(kv_blocks)
        images = images or {}

        def body(tx: Transaction) -> None:
            self._t_kv(tx, "kv_shrink", blocks)
            for i in R:
                self._t_reload(tx, i, images.get(i))
        return self._run("restore", body, commit, layers=list(R), nbytes=sum(self.weights[i].max_bytes for i in R),
                         source="peer" if images else "host")

    # -- memory between engines (a multi-model fleet) ---------------------------------------------------
    def borrow(self, blocks: int, commit: bool = True) -> int:
        """Grow this engine's KV to ``blocks`` (at most its maximum) on chunks the pool makes now: memory
        another engine on the host gave back (:meth:`remap` with ``lend``). Returns the mapped blocks."""
        blocks = min(int(blocks), self.max_blocks)
        if self.peers or self.dropped:
            raise ValueError("borrow: this engine is a pipeline-group member (its KV is the group's)")
        places = self._active()
        prev = {k.region: k.region.mapped_bytes for k in places}
        made = [0]

        def do() -> None:
            held, cb = self.pool.held_chunks, self.pool.chunk_bytes
            try:   # the chunks the regions lack for ``blocks``, less what the pool has free, made now
                need = sum(max(0, -(-blocks * k.page_bytes // cb) - len(k.region.chunks)) for k in places)
                if need > self.pool.num_free_chunks:
                    self.pool.add_chunks(need - self.pool.num_free_chunks)
                self._resize({k.region: blocks * k.page_bytes for k in places})
            except Exception:
                self.pool.return_free(max(0, min(self.pool.held_chunks - held, self.pool.num_free_chunks)))
                raise
            made[0] = self.pool.held_chunks - held
            self._zero_new(prev)

        def undo() -> None:
            self._resize(prev)
            if made[0]:
                self.pool.return_free(min(made[0], self.pool.num_free_chunks))

        def body(tx: Transaction) -> None:
            if blocks > self.mapped_blocks:
                tx.step("kv_borrow", do, undo)
        return self._run("borrow", body, commit, blocks=blocks)

    def repay(self, blocks: int, commit: bool = True) -> int:
        """Shrink this engine's KV to ``blocks`` (at least its base; the blocks above must be unused)
        and give every free chunk back to the device or host. Returns the mapped blocks."""
        blocks = int(blocks)
        if blocks < self.base_blocks:
            raise ValueError(f"repay: KV cannot shrink below the base ({blocks} < {self.base_blocks})")
        places = self._active()
        prev = {k.region: k.region.mapped_bytes for k in places}
        targets = {k.region: blocks * k.page_bytes for k in places if k.region.mapped_bytes > blocks * k.page_bytes}
        gave = [0]

        def do() -> None:
            self._drain()
            self._resize(targets)
            gave[0] = self.pool.num_free_chunks
            self.pool.return_free(gave[0])

        def undo() -> None:
            if gave[0]:
                self.pool.add_chunks(gave[0])
            self._resize(prev)

        def body(tx: Transaction) -> None:
            tx.step("kv_repay", do, undo)
        return self._run("repay", body, commit, blocks=blocks)

    def _t_give_back(self, tx: Transaction) -> None:
        """Every free chunk's memory back to the device or host (a lend's last step)."""
        gave = [0]

        def do() -> None:
            gave[0] = self.pool.num_free_chunks
            self.pool.return_free(gave[0])

        def undo() -> None:
            if gave[0]:
                self.pool.add_chunks(gave[0])
        tx.step("give_back", do, undo)

    # -- pipeline groups (KunServe cluster drop) --------------------------------------------------------
    def join(self, layers: Sequence[int], peers: dict[str, int], exchange: Callable[[], None],
             commit: bool = True) -> int:
        """Join a pipeline group: ``layers`` are dropped (a peer runs them) and this engine hosts
        the KV of each peer's requests for the layers it keeps.

        Steps: release the dropped layers' weights; create a KV region per kept layer for each peer
        in ``peers`` (mapped for the peer's current block count); ``exchange()`` (the caller moves
        the KV of the dropped layers to the peers and waits for theirs); free the dropped layers'
        own KV; grow every kept KV region (own and the peers') evenly into the free chunks. A
        failure up to the exchange undoes everything; after it, the KV already moved, so a failed
        grow keeps the group at its current size (an event, not a rollback). Returns the mapped
        block count.

        A remapped engine joins too (the levers stack: local remap first, then a cluster drop): a
        streamed layer in ``layers`` becomes dropped (its memory is KV already; its host copy stays
        for the leave), the other streamed layers go on streaming through the same slots (none
        left: the slots go, their memory grows the KV). :meth:`leave` brings every dropped layer
        back resident, so the engine is remapped afterwards only by the streamed layers it kept."""
        D = self._check_layers(layers, "join")
        if any(self.states[i] is LayerState.DROPPED for i in D) or not D:
            raise ValueError(f"join {list(D)}: need resident or streamed layers to drop "
                             f"(states {[self.states[i].value for i in D]})")
        if len(set(D) | set(self.dropped) | set(self.streamed)) >= len(self.layers):
            raise ValueError("join would leave no resident layer on this engine")
        if any(o in self.peers for o in peers) or any(not o for o in peers):
            raise ValueError(f"join: peers {sorted(peers)} must be new, non-empty names (have {list(self.peers)})")
        kept = [k for k in self.kv if not k.origin and k.layer >= 0 and k.layer not in D]
        created: list[KVPlace] = []
        own_dropped = [k for k in self.kv if not k.origin and k.layer in D]
        prev = {k.region: k.region.mapped_bytes for k in own_dropped}

        C = self.streamed
        gone = [i for i in D if i in C]   # streamed layers a peer runs from now on
        still = tuple(i for i in C if i not in D)

        def body(tx: Transaction) -> None:
            if gone:
                self._t_uninstall(tx, C)
                for i in gone:
                    tx.step("unstream", lambda i=i: self._set_state(i, LayerState.DROPPED),
                            lambda i=i: self._set_state(i, LayerState.STREAMED))
                if still:
                    self._t_install(tx, still)
                else:
                    self._t_slots_destroy(tx)
            for i in D:
                if i not in C:
                    self._t_release(tx, i, LayerState.DROPPED)
            tx.step("foreign_create", lambda: self._host_peers(peers, kept, created),
                    lambda: self._drop_regions(created))
            tx.step("exchange", exchange)
            tx.step("kv_free", lambda: self._resize({k.region: 0 for k in own_dropped}),
                    lambda: self._resize(prev))
            t = time.perf_counter()
            self._grow_best_effort()  # after kv_free: a failure here must not roll back (KV moved)
            tx.step_ms["kv_grow_after"] = (time.perf_counter() - t) * 1e3   # timed, not a step: nothing to undo
        out = self._run("join", body, commit, layers=list(D), peers=dict(peers), unstreamed=gone or None,
                        nbytes=sum(self.weights[i].max_bytes for i in D if i not in C))
        if gone and not still and self.pending is None:
            self.adapter.drop_slots()
        return out

    def _grow_best_effort(self) -> None:
        places = self._active(None)
        before = {k.region: k.region.mapped_bytes for k in places}
        try:
            self.faults.check("kv_grow")
            self._resize(self._kv_targets(places, None, "kv_grow"))
            self._zero_new(before)
        except Exception as exc:
            self.event("kv_grow_failed", 0.0, 0, error=repr(exc))

    def leave(self, kv_blocks: int, exchange: Callable[[], None],
              images: dict[int, torch.Tensor] | Callable[[int], torch.Tensor | None] | None = None,
              commit: bool = True) -> int:
        """Leave the pipeline group: every KV region shrinks to ``kv_blocks`` (the blocks above must
        be unused on this engine and on the peers), the dropped layers come back (from ``images``,
        bytes a peer sent: a dict, or a function asked for each layer as it reloads, after the KV
        has shrunk, so the bytes need no memory the KV still holds; None for a layer, or no image:
        its host copy) with their own KV regions mapped again,
        ``exchange()`` moves the peers' KV for the kept layers back to them and waits for this
        engine's KV of the returning layers, then the peers' regions go. Returns the mapped blocks."""
        D = self.dropped
        if not D:
            raise ValueError("leave: this engine is not in a group (no dropped layers)")
        source = "host" if not images else "peer"
        image_of = images if callable(images) else (images or {}).get
        own_dropped = [k for k in self.kv if not k.origin and k.layer in D]
        foreign = [k for k in self.kv if k.origin]

        def body(tx: Transaction) -> None:
            self._t_kv(tx, "kv_shrink", kv_blocks)
            for i in D:
                self._t_reload(tx, i, lambda i=i: image_of(i))
            tx.step("kv_regrow", lambda: self._map(own_dropped, kv_blocks),
                    lambda: self._resize({k.region: 0 for k in own_dropped}))
            tx.step("exchange", exchange)
            tx.step("foreign_destroy", lambda: self._drop_regions(foreign))
            if self.streamed:   # a remapped engine left: its KV grows back into its streamed layers' memory
                t = time.perf_counter()
                self._grow_best_effort()
                tx.step_ms["kv_grow_after"] = (time.perf_counter() - t) * 1e3
        return self._run("leave", body, commit, layers=list(D), peers=list(self.peers),
                         nbytes=sum(self.weights[i].max_bytes for i in D), source=source)

    def restage(self, keep: Sequence[int], peers: dict[str, int], exchange: Callable[[], None],
                kv_blocks: int | None = None,
                images: dict[int, torch.Tensor] | Callable[[int], torch.Tensor | None] | None = None,
                commit: bool = True) -> int:
        """Move to another stage of a regrouped pipeline group without leaving it: afterwards this
        engine runs exactly the layers ``keep`` and hosts, for each peer in ``peers`` (name -> the
        peer's block count), that peer's KV for ``keep``; peers not named are let go. Two pairs
        merging into a four keep a sub-range of the layers they run; a four shrinking into two
        pairs keeps a super-range, with ``kv_blocks`` the smaller group's block count (the blocks
        above it drained on every member first). A lone engine merged with live groups restages
        from every layer (a join whose KV may go to, and come from, any member).

        Steps: every KV region shrinks to ``kv_blocks`` (when given); the layers no longer kept are
        released and the newly kept ones reloaded (from ``images`` as in :meth:`leave`, or their
        host copies); this engine's own KV regions of the newly kept layers map its block count
        again and a region is created for each (peer, kept layer) not hosted yet; ``exchange()``
        (the caller sends each (origin, layer) KV held here whose new holder is another engine and
        waits for what comes here); then the own KV of the layers no longer kept is freed, the
        regions of peers' KV no longer held go, and the kept regions grow into the free chunks.
        All or nothing up to the exchange; after it the KV has moved, so a failed grow keeps the
        current size (an event), as in :meth:`join`. Returns the mapped block count."""
        K = self._check_layers(keep, "restage keep")
        if self.streamed:
            raise ValueError(f"restage: layers {list(self.streamed)} are streamed (revert them first)")
        if not K or len(K) >= len(self.layers):
            raise ValueError(f"restage keep {list(K)}: must keep 1..{len(self.layers) - 1} layers")
        if not peers or any(not o for o in peers):
            raise ValueError(f"restage: peers {sorted(peers)} must be non-empty names")
        if kv_blocks is not None and kv_blocks < self.base_blocks:
            raise ValueError(f"restage: KV cannot shrink below the base ({kv_blocks} < {self.base_blocks})")
        old = {i for i, s in enumerate(self.states) if s is LayerState.RESIDENT}
        release = [i for i in sorted(old) if i not in K]
        reload = [i for i in K if i not in old]
        own_blocks = self.mapped_blocks if kv_blocks is None else int(kv_blocks)
        image_of = images if callable(images) else (images or {}).get
        own_new = [k for k in self.kv if not k.origin and k.layer in reload]
        own_gone = [k for k in self.kv if not k.origin and k.layer in release]
        kept_own = [k for k in self.kv if not k.origin and k.layer in K]
        created: list[KVPlace] = []
        prev_gone = {k.region: k.region.mapped_bytes for k in own_gone}

        def body(tx: Transaction) -> None:
            if kv_blocks is not None:
                self._t_kv(tx, "kv_shrink", own_blocks)
            for i in release:
                self._t_release(tx, i, LayerState.DROPPED)
            for i in reload:
                self._t_reload(tx, i, lambda i=i: image_of(i))
            tx.step("kv_regrow", lambda: self._map(own_new, own_blocks),
                    lambda: self._resize({k.region: 0 for k in own_new}))
            tx.step("foreign_create", lambda: self._host_peers(peers, kept_own, created),
                    lambda: self._drop_regions(created))
            tx.step("exchange", exchange)
            tx.step("kv_free", lambda: self._resize({k.region: 0 for k in own_gone}),
                    lambda: self._resize(prev_gone))
            tx.step("foreign_destroy", lambda: self._drop_regions(
                [k for k in self.kv if k.origin and (k.origin not in peers or k.layer not in K)]))
            t = time.perf_counter()
            self._grow_best_effort()  # the KV moved: a failure here must not roll back
            tx.step_ms["kv_grow_after"] = (time.perf_counter() - t) * 1e3
        return self._run("restage", body, commit, keep=list(K), released=release, reloaded=reload,
                         peers=dict(peers), nbytes=sum(self.weights[i].max_bytes for i in release + reload))

    def place(self, name: str, origin: str = "") -> KVPlace:
        """The KV place of attention layer ``name`` for ``origin``'s requests."""
        for k in self.kv:
            if k.name == name and k.origin == origin:
                return k
        raise KeyError(f"no KV region for {name!r} (origin {origin or 'self'!r})")

    # -- machinery -------------------------------------------------------------------------------------
    def _check_layers(self, layers: Sequence[int], what: str) -> tuple[int, ...]:
        out = tuple(sorted(set(int(i) for i in layers)))
        if out and (out[0] < 0 or out[-1] >= len(self.layers)):
            raise ValueError(f"{what} layers {list(out)} outside 0..{len(self.layers) - 1}")
        return out

    def _run(self, name: str, body: Callable[[Transaction], None], commit: bool, nbytes: int = 0,
             **info) -> int:
        if self.pending is not None:
            raise RuntimeError(f"{name}: a prepared {self.pending.name} is not committed or aborted yet")
        t0 = time.perf_counter()
        before = self.mapped_blocks
        tx = Transaction(name, self.faults)
        try:
            body(tx)
        except Exception as exc:
            self._drain()
            undone = tx.rollback()  # raises RollbackError if an undo fails
            self.event(f"{name}_failed", time.perf_counter() - t0, 0, error=repr(exc), at=len(tx.steps),
                        undone=undone, **info)
            raise
        if commit:
            tx.commit()
        else:
            self.pending = tx
        self.event(name, time.perf_counter() - t0, nbytes, blocks_before=before,
                    blocks_after=self.mapped_blocks, step_ms={k: round(v, 1) for k, v in tx.step_ms.items()},
                    **info)
        return self.mapped_blocks

    def event(self, kind: str, seconds: float, nbytes: int, **extra) -> None:
        ev = {"event": kind, "ms": round(seconds * 1e3, 3), "bytes": int(nbytes), "time": time.time(), **extra}
        self.events.append(ev)
        del self.events[:-100]
        logger.info("kunserve worker %s: %s", kind, ev)

    def _drain(self) -> None:
        if self.streamer is not None:
            self.streamer.drain()
        self.pool.backend.synchronize()

    def _set_state(self, i: int, st: LayerState) -> Callable[[], None]:
        old = self.states[i]
        self.states[i] = st

        def undo() -> None:
            self.states[i] = old
        return undo

    def _t_release(self, tx: Transaction, i: int, to: LayerState) -> None:
        w = self.weights[i]

        def undo() -> None:
            self.pool.reload_layer(w)
            self.states[i] = LayerState.RESIDENT
        tx.step("release", lambda: (self.pool.release_layer(w), self._set_state(i, to)), undo)

    def _t_reload(self, tx: Transaction, i: int,
                  image: torch.Tensor | Callable[[], torch.Tensor | None] | None = None) -> None:
        """Reload layer ``i`` from ``image`` (or a function giving it when the step runs; None: the
        host copy)."""
        w, old = self.weights[i], self.states[i]
        made = [0]

        def do() -> None:
            # a lent layer's chunks went back to the host: the pool makes what its free list lacks
            made[0] = max(0, -(-w.max_bytes // self.pool.chunk_bytes) - self.pool.num_free_chunks)
            if made[0]:
                self.pool.add_chunks(made[0])
            self.pool.reload_layer(w, image() if callable(image) else image)
            self._set_state(i, LayerState.RESIDENT)

        def undo() -> None:
            self.pool.release_layer(w)
            self.states[i] = old
            if made[0]:
                self.pool.return_free(made[0])
        tx.step("reload", do, undo)

    def _streamer_for(self, layers: Sequence[int]) -> WeightStreamer:
        slots = iter(self.slot_regions)
        plan = self.adapter.copy_plan([w.entries for w in self.weights])
        faults = self.faults

        def copy_plan(i, slot, slot_tensor, host):
            faults.check("copy_plan")
            return plan(i, slot, slot_tensor, host) if plan else [(slot_tensor[:host.numel()], host)]
        return WeightStreamer(self.layers, layers, num_slots=len(self.slot_regions), device=self.pool.device,
                              sources={i: self.weights[i] for i in layers}, copy_plan=copy_plan,
                              slot_factory=lambda nb: next(slots).view(torch.uint8)[:nb])

    def _install(self, layers: Sequence[int]) -> None:
        """Stream ``layers`` (their kernels then read the slots)."""
        st = self._streamer_for(layers)
        st.install()  # all or nothing (streaming.py restores the layers if it fails)
        self.streamer = st
        try:
            self._point(layers)
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        """Stop streaming: every layer's kernels read its own region again."""
        if self.streamer is not None:
            self.streamer.drain()
            self._point(())
            self.streamer.uninstall()
            self.streamer = None

    def _t_install(self, tx: Transaction, layers: Sequence[int]) -> None:
        tx.step("streamer_install", lambda: self._install(layers), self._uninstall)

    def _t_uninstall(self, tx: Transaction, layers: Sequence[int]) -> None:
        tx.step("streamer_uninstall", self._uninstall, lambda: self._install(layers))

    def _slots_create(self, n: int, nbytes: int) -> None:
        for s in range(n):
            self.slot_regions.append(self.pool.create_kv_region(f"slot{s}", nbytes, nbytes))

    def _slots_destroy(self) -> None:
        while self.slot_regions:
            self.pool.destroy_region(self.slot_regions.pop())

    def _t_slots_create(self, tx: Transaction, n: int, nbytes: int) -> None:
        tx.step("slot_create", lambda: self._slots_create(n, nbytes), self._slots_destroy)

    def _t_slots_destroy(self, tx: Transaction) -> None:
        n, nbytes = len(self.slot_regions), self.slot_regions[0].mapped_bytes
        tx.step("slot_destroy", self._slots_destroy, lambda: self._slots_create(n, nbytes))

    def _point(self, layers: Sequence[int]) -> None:
        on = set(layers)
        for i in range(len(self.layers)):
            if self.states[i] is not LayerState.DROPPED:
                self.adapter.point(i, self.streamer.slot_of(i) if i in on else None)

    def _host_peers(self, peers: dict[str, int], kept: Sequence[KVPlace], created: list[KVPlace]) -> None:
        """A KV region for each peer in ``peers`` (name -> its block count) and each of this engine's
        own places ``kept`` that it does not host yet, mapped for the peer's block count (the pool
        grown by what the freed weights did not cover: KV larger than the weights) and zeroed; each
        new place is appended to ``created`` (what the undo drops)."""
        have = {(k.origin, k.name) for k in self.kv if k.origin}
        for origin, blocks in peers.items():
            for k in kept:
                if (origin, k.name) in have:
                    continue
                region = self.pool.create_kv_region(f"kv@{origin}:{k.name}", self.max_blocks * k.page_bytes, 0)
                place = KVPlace(k.name, region, k.page_bytes, k.layer, origin)
                self.kv.append(place)
                created.append(place)
                need = -(-blocks * k.page_bytes // self.pool.chunk_bytes) - self.pool.num_free_chunks
                if need > 0:
                    self.pool.add_chunks(need)
                self.pool.resize_kv({region: blocks * k.page_bytes})
                region.view(torch.uint8).zero_()

    def _drop_regions(self, places: Sequence[KVPlace]) -> None:
        """Destroy the regions of ``places`` (peers' KV) and forget them."""
        for k in places:
            self.pool.destroy_region(k.region)
            self.kv.remove(k)

    def _map(self, places: Sequence[KVPlace], blocks: int) -> None:
        """Map ``blocks`` in each of ``places`` (own regions of layers coming back), the pool grown
        by what its free chunks do not cover."""
        need = sum(-(-blocks * k.page_bytes // self.pool.chunk_bytes) for k in places) - self.pool.num_free_chunks
        if need > 0:
            self.pool.add_chunks(need)
        self._resize({k.region: blocks * k.page_bytes for k in places})

    def _resize(self, targets: dict[KVRegion, int]) -> None:
        if targets:
            self.pool.resize_kv(targets)

    def _t_kv(self, tx: Transaction, step: str, blocks: int | None) -> None:
        """``kv_grow`` (blocks None: map every free chunk, evenly) or ``kv_shrink`` to ``blocks``."""
        places = self._active(None)
        prev = {k.region: k.region.mapped_bytes for k in places}
        before = {k.region: k.region.mapped_bytes for k in places}
        targets = self._kv_targets(places, blocks, step)

        def do() -> None:
            self._drain()
            self._resize(targets)
            self._zero_new(before)
        tx.step(step, do, lambda: self._resize(prev))

    def _kv_targets(self, places: Sequence[KVPlace], blocks: int | None, step: str) -> dict:
        if blocks is None:
            per = self.pool.num_free_chunks // max(1, len(places))
            return {k.region: min(k.region.mapped_bytes + per * self.pool.chunk_bytes, k.region.max_bytes)
                    for k in places} if per > 0 else {}
        if blocks < self.base_blocks and step == "kv_shrink":
            raise ValueError(f"KV cannot shrink below the base ({blocks} < {self.base_blocks})")
        return {k.region: blocks * k.page_bytes for k in places if k.region.mapped_bytes > blocks * k.page_bytes}

    def _zero_new(self, before: dict) -> None:
        for region, old in before.items():
            if region.mapped_bytes > old:
                region.view(torch.uint8)[old:region.mapped_bytes].zero_()

    def zero_kv(self, lo_block: int = 0) -> None:
        """Zero newly mapped KV blocks (fresh chunks may hold old data)."""
        for k in self.kv:
            n = min(k.region.mapped_bytes // k.page_bytes, self.max_blocks)
            if n > lo_block:
                k.region.view(torch.uint8)[lo_block * k.page_bytes:n * k.page_bytes].zero_()


__all__ = ["KVPlace", "LayerResidency", "LayerState", "STEPS", "SlotAdapter"]
