"""BlockPool and its free list: exact block ids, ref counts, LRU order, lazy eviction."""

from __future__ import annotations

import pytest

from fdplug.core.scheduler.block_pool import (
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    first = pool.get_new_blocks(4)
    assert ids(first) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(first)
    again = pool.get_new_blocks(4)
    assert 0 not in ids(again)
    assert pool.null_block.ref_cnt == 0 and pool.null_block.prev_free is None


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_blocks_handed_out_in_order_with_ref_counts():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [1, 2, 3] and ids(b) == [4, 5]
    assert [blk.ref_cnt for blk in a + b] == [1] * 5
    assert free_ids(pool) == [6, 7]
    pool.touch(a[:2])  # a second request shares a's first two blocks
    assert [blk.ref_cnt for blk in a] == [2, 2, 1]
    pool.free_blocks(a)
    assert [blk.ref_cnt for blk in a] == [1, 1, 0]
    assert free_ids(pool) == [6, 7, 3]  # only the block that reached 0 is free


def test_freed_blocks_go_to_the_tail_in_the_given_order():
    pool = BlockPool(8)
    req = pool.get_new_blocks(3)  # 1, 2, 3
    other = pool.get_new_blocks(2)  # 4, 5
    pool.free_blocks(reversed(req))  # what the manager does: the request's tail goes first
    assert free_ids(pool) == [6, 7, 3, 2, 1]
    pool.free_blocks(reversed(other))
    assert free_ids(pool) == [6, 7, 3, 2, 1, 5, 4]
    assert ids(pool.get_new_blocks(4)) == [6, 7, 3, 2]  # LRU: oldest free first, tail blocks first


def test_double_free_is_an_error():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([blk])


def test_free_queue_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4] and queue.num_free_blocks == 4
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 2]
    assert queue.popleft().block_id == 1
    assert ids(queue.popleft_n(2)) == [3, 2]
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[1])


def test_cached_free_block_is_touched_out_of_the_middle():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2, 1]
    hit = pool.get_cached_block(h(2))
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_hash == h(2)
    assert free_ids(pool) == [4, 5, 6, 7, 3, 1]
    assert pool.get_num_free_blocks() == 6


def test_eviction_drops_the_hash_lru_first():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # 1, 2
    pool.cache_full_blocks(a, [h(1), h(2)], 0, 2)
    b = pool.get_new_blocks(2)  # 3, 4
    pool.cache_full_blocks(b, [h(3), h(4)], 0, 2)
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [2, 1, 4, 3]
    assert len(pool.cached_block_hash_to_block) == 4  # freed blocks stay cached (lazy eviction)
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 2 and evicted.block_hash is None
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is a[0]  # the rest are still findable
    pool.get_new_blocks(2)  # evicts 1 and 4
    assert set(pool.cached_block_hash_to_block) == {h(3)}


def test_caching_skips_already_cached_and_keeps_the_first_duplicate():
    pool = BlockPool(8)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [h(1), h(2)], 0, 1)
    assert a[0].block_hash == h(1) and a[1].block_hash is None  # only [0, 1) asked for
    pool.cache_full_blocks(a, [h(1), h(2)], 1, 2)
    assert a[1].block_hash == h(2)
    dup = pool.get_new_blocks(1)  # same content computed by another request at the same time
    pool.cache_full_blocks(dup, [h(1)], 0, 1)
    assert dup[0].block_hash is None and pool.get_cached_block(h(1)) is a[0]
    with pytest.raises(RuntimeError, match="another hash"):
        pool.cache_full_blocks(a, [h(9), h(2)], 0, 1)


def test_caching_disabled_caches_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    assert pool.get_cached_block(h(1)) is None and blocks[0].block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    pool.prefix_cache_stats.record(10, 4)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(1)) is None and blocks[0].block_hash is None
    assert pool.prefix_cache_stats.queries == 0


def test_usage_counts_usable_blocks_only():
    pool = BlockPool(5)  # 4 usable
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.usage == 0.75
    pool.free_blocks(blocks)
    assert pool.usage == 0.0


def test_prefix_cache_stats_hit_rate():
    pool = BlockPool(3)
    assert pool.prefix_cache_stats.hit_rate == 0.0
    pool.prefix_cache_stats.record(10, 4)
    pool.prefix_cache_stats.record(10, 0)
    stats = pool.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 4)
    assert stats.hit_rate == pytest.approx(0.2)
