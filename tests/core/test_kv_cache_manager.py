"""KVCacheManager: longest-prefix hits, last token always computed, exact block tables."""

from __future__ import annotations

import pytest

from flowengine.core.kv_cache_manager import KVCacheManager
from flowengine.core.kv_cache_utils import hash_token_blocks
from flowengine.request import Request
from flowengine.sampling_params import SamplingParams


def req(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(), eos_token_id=None, max_tokens=16)


def run_prompt(manager: KVCacheManager, request: Request) -> None:
    """Allocate, 'compute' and publish the whole prompt, as the scheduler would."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def test_longest_prefix_hit_with_exact_block_ids() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(14)))
    run_prompt(manager, a)
    assert manager.get_block_ids("a") == [0, 1, 2, 3]
    manager.free(a)
    free_ids = manager.block_pool.free_block_queue.block_ids()
    assert free_ids == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]

    b = req("b", [*range(8), 100, 101, 102, 103, 104, 105])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit == 8
    new_blocks = manager.allocate_slots(b, 6, hits)
    assert new_blocks is not None and [blk.block_id for blk in new_blocks] == [4, 5]
    assert manager.get_block_ids("b") == [0, 1, 4, 5]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 4)] == [1, 1, 0, 1]
    assert manager.block_pool.free_block_queue.block_ids() == [6, 7, 8, 9, 3, 2]
    assert manager.num_free_blocks == 6 and manager.usage == pytest.approx(0.4)


def test_last_prompt_token_is_always_computed() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    run_prompt(manager, req("a", list(range(14))))
    # 12 tokens, all three blocks cached: only two are used, the third is recomputed.
    hits, num_hit = manager.get_computed_blocks(req("c", list(range(12))))
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    hits, num_hit = manager.get_computed_blocks(req("d", list(range(13))))
    assert [blk.block_id for blk in hits] == [0, 1, 2] and num_hit == 12
    hits, num_hit = manager.get_computed_blocks(req("e", [0, 1, 2, 3]))
    assert hits == [] and num_hit == 0


def test_sharing_a_prefix_counts_references() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    run_prompt(manager, req("a", list(range(9))))
    b, c = req("b", list(range(10))), req("c", list(range(11)))
    run_prompt(manager, b)
    run_prompt(manager, c)
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert manager.get_block_ids("c") == [0, 1, 4]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1]
    manager.free(b)
    manager.free(c)
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(5)] == [1, 1, 1, 0, 0]
    # Reverse order: each request's last block reaches the queue before its prefix.
    assert manager.block_pool.free_block_queue.block_ids() == [5, 6, 7, 8, 9, 3, 4]


def test_allocation_failure_counts_evictable_hits_and_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(8)))
    run_prompt(manager, a)
    manager.free(a)
    assert manager.block_pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    # 17 tokens need 5 blocks: 2 hits + 3 new, but taking the hits leaves only 2 free.
    big = req("big", list(range(17)))
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 8
    assert manager.allocate_slots(big, 9, hits) is None
    assert manager.get_block_ids("big") == []
    assert manager.block_pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    assert [blk.ref_cnt for blk in manager.block_pool.blocks] == [0, 0, 0, 0]
    # 13 tokens need 4 blocks: 2 hits + 2 new fits exactly.
    fits = req("fits", list(range(13)))
    hits, num_hit = manager.get_computed_blocks(fits)
    new_blocks = manager.allocate_slots(fits, 5, hits)
    assert new_blocks is not None and [blk.block_id for blk in new_blocks] == [2, 3]
    assert manager.get_block_ids("fits") == [0, 1, 2, 3]
    assert manager.num_free_blocks == 0


def test_decode_fills_blocks_and_extends_hashes() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    r = req("r", [1, 2, 3, 4, 5, 6])
    run_prompt(manager, r)
    assert len(r.block_hashes) == 1
    for token in (7, 8, 9):
        r.append_output_token_ids([token])
        new_blocks = manager.allocate_slots(r, 1)
        assert new_blocks is not None
        r.num_computed_tokens += 1
        manager.cache_blocks(r, r.num_computed_tokens)
    # 9 tokens known, 9 computed: two full blocks published, block 2 holds token 9.
    assert manager.get_block_ids("r") == [0, 1, 2]
    assert r.block_hashes == hash_token_blocks(list(range(1, 10)), 4, manager.root_hash)
    assert manager.block_pool.get_cached_block(r.block_hashes[1]) is manager.block_pool.blocks[1]
    # Publishing never hashes tokens that are not known yet.
    manager.cache_blocks(r, 100)
    assert len(r.block_hashes) == 2


def test_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    a = req("a", list(range(9)))
    run_prompt(manager, a)
    manager.free(a)
    b = req("b", list(range(9)))
    assert manager.get_computed_blocks(b) == ([], 0)
    assert a.block_hashes == [] and manager.block_pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache_forgets_hits() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(9)))
    run_prompt(manager, a)
    manager.free(a)
    assert manager.reset_prefix_cache() == 2
    assert manager.get_computed_blocks(req("b", list(range(9)))) == ([], 0)


def test_argument_errors() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(9)))
    run_prompt(manager, a)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1"):
        manager.allocate_slots(a, 0)
    hits, _ = manager.get_computed_blocks(req("b", list(range(9))))
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(a, 1, hits)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


def test_deferred_free_waits_for_its_step() -> None:
    manager = KVCacheManager(num_blocks=7, block_size=4)
    a, b = req("a", list(range(6))), req("b", list(range(100, 105)))
    run_prompt(manager, a)
    run_prompt(manager, b)
    c = req("c", [*range(4), 50, 51])
    run_prompt(manager, c)  # shares a's first block
    assert [manager.get_block_ids(r) for r in "abc"] == [[0, 1], [2, 3], [0, 4]]
    assert [manager.num_new_blocks_for(a, n) for n in (2, 3, 7)] == [0, 1, 2]
    manager.free(a, after_step=5)
    manager.free(b, after_step=6)
    assert manager.get_block_ids("a") == [] and manager.num_free_blocks == 2
    # Block 0 is still c's: it does not come free with a's step.
    assert manager.num_deferred_free_blocks == 3
    manager.release_deferred(4)
    assert manager.block_pool.free_block_queue.block_ids() == [5, 6]
    manager.release_deferred(5)
    assert manager.block_pool.free_block_queue.block_ids() == [5, 6, 1]
    assert manager.num_deferred_free_blocks == 2
    manager.free(c, after_step=None)
    manager.release_deferred(6)
    assert manager.block_pool.free_block_queue.block_ids() == [5, 6, 1, 4, 0, 3, 2]
    assert manager.num_deferred_free_blocks == 0 and manager.num_free_blocks == 7
