"""Freeing KV blocks that fell out of a sliding attention window (DESIGN.md §4).

Follows the idea of vLLM v1's `SlidingWindowManager`
(`vllm/v1/core/single_type_kv_cache_manager.py`): when every attention layer of the
model attends only to the last `sliding_window` positions, a token at position p reads
positions p - sliding_window < j <= p, so a block whose slots all lie before the oldest
position any future token reads is dead weight. Such a block is returned to the pool
and its entry in the request's block table is replaced by the *null block*, so block
table index i still holds positions i*block_size .. (i+1)*block_size - 1 and the
attention kernels' slot arithmetic is unchanged (they never read a slot outside the
window: the window mask excludes it).

The null block is one block of the pool taken once, at start, and never handed to a
request nor freed: its KV stays zero (the cache is zero-initialised), so a kernel that
loads a whole block before masking reads finite values only.

A freed block keeps its prefix-cache hash until the pool evicts it: its KV is still the
KV of its tokens, so a later request whose prompt starts with the same blocks may hit
it (KVCacheManager.get_computed_blocks matches a chain from the first block, as for a
full-attention model; vLLM's sliding-window lookup can also start the chain later).

Models that mix local and global layers (Gemma 2/3) keep every block: the global
layers read the whole context. Only a window shared by all layers frees blocks.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from flowengine.core.block_pool import BlockPool, KVCacheBlock


class SlidingWindowBlocks:
    """Which leading blocks of a request fell out of the window, and their release.

    Args:
        block_pool: the pool of the request blocks; one of its blocks becomes the null
            block (the first one handed out: block id 0 on a fresh pool).
        sliding_window: tokens each position attends to, itself included (>= 1).
        block_size: token slots per block (>= 1).

    Raises ValueError on a window or block size below 1, or a pool with no free block.
    """

    def __init__(self, block_pool: BlockPool, sliding_window: int, block_size: int) -> None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if block_pool.num_blocks < 2:
            raise ValueError("a sliding-window KV cache needs at least 2 blocks (one is "
                             f"the null block), got {block_pool.num_blocks}")
        self.block_pool = block_pool
        self.sliding_window = sliding_window
        self.block_size = block_size
        # NOTE: taken with ref_cnt 1 and never freed, so it never returns to the free
        # queue, is never evicted into another request and is never hashed.
        self.null_block: KVCacheBlock = block_pool.get_new_blocks(1)[0]

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no token at position >= `num_computed_tokens` reads.

        The next token to compute sits at position num_computed_tokens and reads
        positions > num_computed_tokens - sliding_window; every later token reads less.
        """
        first_needed = num_computed_tokens - self.sliding_window + 1
        return max(0, first_needed) // self.block_size

    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> int:
        """Replace the skipped blocks of a block table by the null block and free them.

        Args:
            blocks: a request's block table, changed in place.
            num_computed_tokens: the request's tokens whose KV has been written; no step
                still to run (or in flight) computes a token before this position.

        Returns the number of blocks freed. Blocks are freed newest first (the one
        just left behind is evicted last of them), as KVCacheManager.free does.
        """
        num_skipped = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        null_block = self.null_block
        freed: list[KVCacheBlock] = []
        # Walk back from the newest skipped block: the ones before a null block were
        # nulled on an earlier call.
        for i in range(num_skipped - 1, -1, -1):
            block = blocks[i]
            if block is null_block:
                break
            freed.append(block)
            blocks[i] = null_block
        if freed:
            self.block_pool.free_blocks(freed)
        return len(freed)
