"""BlockPool and FreeBlockQueue: exact block ids, reference counts, LRU eviction."""

from __future__ import annotations

import pytest

from flowengine.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_initial_order_and_allocation() -> None:
    pool = BlockPool(6)
    assert pool.free_block_queue.block_ids() == [0, 1, 2, 3, 4, 5]
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_queue.block_ids() == [3, 4, 5]
    assert pool.num_free_blocks == 3
    assert pool.usage == 0.5


def test_reverse_free_puts_sequence_tail_first_in_eviction_order() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    # LRU: the never-used blocks first, then the freed sequence from its tail.
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]
    assert pool.free_block_queue.block_ids() == [1, 0]


def test_eviction_drops_the_hash() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [100, 101, 102])
    assert pool.get_cached_block(101) is blocks[1]
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.block_ids() == [3, 2, 1, 0]
    # Freed cached blocks stay findable until they are reused.
    assert pool.get_cached_block(102) is blocks[2]
    taken = pool.get_new_blocks(2)
    assert ids(taken) == [3, 2]
    assert pool.get_cached_block(102) is None
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(101) is blocks[1]
    assert pool.get_cached_block(100) is blocks[0]
    assert sorted(pool.cached_block_hash_to_block) == [100, 101]


def test_touch_removes_a_free_cached_block_from_the_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [7, 8])
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    hit = pool.get_cached_block(7)
    assert hit is not None and hit.block_id == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_queue.block_ids() == [2, 3, 1]
    assert pool.num_free_blocks == 3
    # A second request hitting the same block shares it.
    pool.touch([hit])
    assert hit.ref_cnt == 2
    assert pool.num_free_blocks == 3
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_queue.block_ids() == [2, 3, 1]
    pool.free_blocks([hit])
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    # Still cached after being freed again.
    assert pool.get_cached_block(7) is hit


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [55])
    pool.cache_full_blocks([b], [55])
    assert pool.get_cached_block(55) is a
    assert b.block_hash is None
    # A block that already has a hash keeps it.
    pool.cache_full_blocks([a], [56])
    assert a.block_hash == 55 and pool.get_cached_block(56) is None


def test_errors() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([block])
    with pytest.raises(ValueError, match="2 blocks but 1 hashes"):
        pool.cache_full_blocks(pool.blocks, [1])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    assert pool.get_cached_block(1) is None
    assert [b.block_hash for b in blocks] == [None, None]


def test_reset_prefix_cache() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [1, 2, 3])
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() == 3
    assert pool.cached_block_hash_to_block == {}
    assert [b.block_hash for b in blocks] == [None, None, None]
    # The block still in use stays with its owner.
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 3


def test_free_queue_remove_from_middle_and_ends() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert queue.block_ids() == [1, 3]
    assert queue.num_free_blocks == 2
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 0]
    assert queue.popleft() is blocks[1]
    assert queue.popleft() is blocks[3]
    assert queue.popleft() is blocks[0]
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError, match="no free"):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
