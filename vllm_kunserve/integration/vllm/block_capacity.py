"""Scheduler-side growable KV capacity over vLLM's ``BlockPool``.

The engine is planned at the *maximum* block count the KV regions may ever reach; blocks whose
memory is not mapped on the workers are **hidden**: out of the free queue, no prefix-cache hash,
and ``ref_cnt = 1`` so ``touch``/``free_blocks`` never see them as free. Visible blocks are always
the id range ``[0, visible)``, so the workers only need a mapped prefix of every layer's region.

- ``grow(n)``: the workers mapped ``n`` more blocks; un-hide ``[visible, visible + n)``.
- ``begin_shrink(n)``: stop handing out ``[visible - n, visible)``. Free ones are hidden at once;
  ones in use are *draining* and are hidden when their request frees them (``on_freed``), so no
  live block is ever taken from a request. The workers may unmap the range once ``draining`` is
  empty. ``cancel_shrink`` gives draining blocks back.

``BlockPool.num_gpu_blocks`` always equals the usable capacity, so ``get_usage`` (Prometheus
``vllm:kv_cache_usage_perc``) and ``cache_config.num_gpu_blocks`` stay true.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class CapacityState:
    visible: int          # usable block ids are [0, visible) (block 0 is vLLM's null block)
    max_blocks: int       # blocks the engine was planned with (KV regions reserved for this)
    base: int             # capacity at startup (what stock vLLM would have had)
    free: int             # free blocks in the queue
    draining: int         # blocks in [visible, ...) still held by requests

    @property
    def used(self) -> int:
        return self.visible - 1 - self.free

    @property
    def usage(self) -> float:
        return 1.0 - self.free / max(1, self.visible - 1)


class BlockCapacity:
    """Hides / un-hides the tail of a ``BlockPool``. Not thread-safe: call between engine steps."""

    def __init__(self, pool: Any, visible: int, cache_config: Any = None) -> None:
        if not 1 < visible <= pool.num_gpu_blocks:
            raise ValueError(f"visible={visible} must be in (1, {pool.num_gpu_blocks}]")
        self.pool = pool
        self.cache_config = cache_config
        self.max_blocks = pool.num_gpu_blocks
        self.base = visible
        self.visible = self.max_blocks
        self.draining: set[int] = set()
        self._hide_range(visible, self.max_blocks, allow_draining=False)
        self._set_visible(visible)

    # -- queries ------------------------------------------------------------------------------
    def state(self) -> CapacityState:
        return CapacityState(self.visible, self.max_blocks, self.base,
                             self.pool.get_num_free_blocks(), len(self.draining))

    @property
    def headroom(self) -> int:
        """Blocks that could still be added before reaching the planned maximum."""
        return self.max_blocks - self.visible - len(self.draining)

    # -- grow / shrink -------------------------------------------------------------------------
    def grow(self, n: int) -> None:
        """Make ``n`` more blocks usable. Their memory must already be mapped on every worker."""
        if n <= 0:
            return
        if self.draining:
            raise RuntimeError("cannot grow while a shrink is draining; cancel_shrink() first")
        if self.visible + n > self.max_blocks:
            raise ValueError(f"grow({n}) exceeds the planned maximum {self.max_blocks} (visible {self.visible})")
        new = self.pool.blocks[self.visible:self.visible + n]
        for b in new:
            if b.ref_cnt != 1 or b.block_hash is not None:
                raise RuntimeError(f"block {b.block_id} was not hidden (ref_cnt {b.ref_cnt}); capacity "
                                   "bookkeeping is inconsistent")
        for b in new:
            b.ref_cnt = 0
        self.pool.free_block_queue.append_n(new)
        self._set_visible(self.visible + n)

    def begin_shrink(self, n: int) -> bool:
        """Retire the last ``n`` usable blocks. Returns True when all are already hidden."""
        if n <= 0:
            return not self.draining
        target = self.visible - n
        if target < 2:
            raise ValueError(f"shrink({n}) would leave {target} blocks; at least 2 are needed")
        self._hide_range(target, self.visible, allow_draining=True)
        self._set_visible(target)
        return not self.draining

    def cancel_shrink(self) -> int:
        """Give blocks still draining back (a failed or aborted shrink). Returns how many."""
        if not self.draining:
            return 0
        ids = sorted(self.draining)
        # hidden blocks between visible and the draining ones come back too: visible stays a prefix
        top = max(ids) + 1
        back = [b for b in self.pool.blocks[self.visible:top] if b.block_id not in self.draining]
        for b in back:
            b.ref_cnt = 0
        self.pool.free_block_queue.append_n(back)
        self.draining.clear()
        self._set_visible(top)
        return len(ids)

    def on_freed(self, blocks: Iterable[Any]) -> None:
        """Called after ``BlockPool.free_blocks``: hide draining blocks that became free."""
        if not self.draining:
            return
        for b in blocks:
            if b.block_id in self.draining and b.ref_cnt == 0:
                self._hide(b)
                self.draining.discard(b.block_id)

    def reap(self) -> int:
        """Hide draining blocks that became free by any path (``free_blocks`` is hooked, but vLLM
        also frees through ``unpin_blocks`` and may add others). Returns how many were hidden."""
        if not self.draining:
            return 0
        freed = [self.pool.blocks[i] for i in self.draining if self.pool.blocks[i].ref_cnt == 0]
        self.on_freed(freed)
        return len(freed)

    # -- internals ----------------------------------------------------------------------------
    def _hide(self, b: Any) -> None:
        if b.ref_cnt == 0:
            self.pool.free_block_queue.remove(b)
        self.pool._maybe_evict_cached_block(b)
        b.ref_cnt = 1

    def _hide_range(self, lo: int, hi: int, allow_draining: bool) -> None:
        for b in self.pool.blocks[lo:hi]:
            if b.ref_cnt == 0:
                self._hide(b)
            elif allow_draining:
                self.draining.add(b.block_id)
            else:
                raise RuntimeError(f"block {b.block_id} is in use; cannot hide it")

    def _set_visible(self, visible: int) -> None:
        self.visible = visible
        self.pool.num_gpu_blocks = visible
        if self.cache_config is not None:
            self.cache_config.num_gpu_blocks = visible
