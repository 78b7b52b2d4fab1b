"""Growable capacity over vLLM's real BlockPool (imported only; no engine is started)."""

import pytest

pytest.importorskip("vllm")
from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from vllm_kunserve.integration.vllm.block_capacity import BlockCapacity  # noqa: E402

pytestmark = pytest.mark.unit


class _CacheCfg:
    num_gpu_blocks = None


def _pool(n=64, caching=True):
    return BlockPool(num_gpu_blocks=n, enable_caching=caching, hash_block_size=16)


def _ids(blocks):
    return sorted(b.block_id for b in blocks)


def test_hidden_tail_is_never_handed_out_and_usage_is_true():
    pool, cc = _pool(64), _CacheCfg()
    cap = BlockCapacity(pool, 24, cc)
    assert pool.num_gpu_blocks == 24 and cc.num_gpu_blocks == 24
    assert pool.get_num_free_blocks() == 23  # minus the null block
    got = pool.get_new_blocks(23)
    assert max(_ids(got)) < 24
    assert pool.get_usage() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    cap.grow(16)
    assert pool.num_gpu_blocks == 40 and pool.get_num_free_blocks() == 16
    more = pool.get_new_blocks(16)
    assert _ids(more) == list(range(24, 40))
    assert pool.get_usage() == pytest.approx(1.0)


def test_grow_past_planned_maximum_is_refused():
    pool = _pool(32)
    cap = BlockCapacity(pool, 16)
    with pytest.raises(ValueError, match="planned maximum"):
        cap.grow(17)
    assert cap.state().visible == 16 and pool.get_num_free_blocks() == 15


def test_shrink_drains_live_blocks_instead_of_taking_them():
    pool = _pool(64)
    cap = BlockCapacity(pool, 48)
    held = pool.get_new_blocks(47)  # everything, so the tail is in use
    tail = [b for b in held if b.block_id >= 40]
    assert cap.begin_shrink(8) is False and cap.state().draining == 8
    assert pool.num_gpu_blocks == 40
    # a request finishes: its tail blocks are hidden, its other blocks become free
    keep = [b for b in held if b.block_id < 40]
    pool.free_blocks(tail + keep[:5])
    cap.on_freed(tail + keep[:5])
    assert cap.state().draining == 0
    assert pool.get_num_free_blocks() == 5
    assert all(b.ref_cnt == 1 for b in pool.blocks[40:])
    again = pool.get_new_blocks(5)
    assert max(_ids(again)) < 40


def test_cancel_shrink_returns_draining_blocks():
    pool = _pool(32)
    cap = BlockCapacity(pool, 32)
    held = pool.get_new_blocks(31)
    cap.begin_shrink(4)
    pool.free_blocks(held)
    n = cap.cancel_shrink()
    assert n == 4 and cap.state().visible == 32 and pool.get_num_free_blocks() == 31


def test_cached_prefix_blocks_are_evicted_when_hidden():
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool = _pool(16)
    cap = BlockCapacity(pool, 16)
    blocks = pool.get_new_blocks(15)
    last = max(blocks, key=lambda b: b.block_id)
    key = make_block_hash_with_group_id(b"h" * 32, 0)
    pool._insert_block_hash(key, last, num_tokens=16)
    pool.free_blocks(blocks)
    assert pool.get_cached_block(b"h" * 32, [0]) is not None
    cap.begin_shrink(16 - last.block_id)
    assert pool.get_cached_block(b"h" * 32, [0]) is None  # can no longer be touched as a prefix hit
    assert last.block_hash is None and last.ref_cnt == 1
