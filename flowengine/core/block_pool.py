"""KV cache blocks, their LRU free queue and the prefix-cache map (DESIGN.md §4).

The data structures follow vLLM v1's `vllm/v1/core/block_pool.py` and
`kv_cache_utils.py` (FreeKVCacheBlockQueue): every block is an object that carries its
own free-list links, so a block can leave the middle of the free queue in O(1) when a
request hits it in the prefix cache.

NOTE: the pool reserves no block. Block ids run 0..num_blocks-1 and all of them can
hold tokens; padding slots are marked with slot id -1 in the slot mapping and unused
block-table entries read as 0 but are never dereferenced past `seq_lens`
(see flowengine/model/attention/metadata.py). Only a sliding-window KV cache takes one
block as its null block (flowengine/core/sliding_window.py).

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVCacheBlock:
    """One block of `block_size` token slots in the KV cache.

    Attributes:
        block_id: index of the block in the KV cache tensors, 0..num_blocks-1.
        ref_cnt: number of requests whose block table holds this block. A block with
            ref_cnt 0 sits in the free queue (it may still be a prefix-cache entry).
        block_hash: chained hash of the full block's tokens while the block is a
            prefix-cache entry, else None.
        prev_free, next_free: links of the intrusive free list (None when not free).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (head = evicted first).

    Freed blocks are appended at the tail and new blocks are taken from the head, so the
    least recently freed block is reused first (LRU). A prefix-cache hit removes a block
    from the middle in O(1). Two sentinel nodes (id -1) remove the empty-list branches.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block. Raises ValueError when the queue is empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free KV cache block left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue in O(1).

        Raises ValueError if the block is not in the queue.
        """
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        last = self._tail.prev_free
        assert last is not None  # sentinel links are never None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Ids of the free blocks from head to tail (for tests and debugging), O(n)."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """All KV cache blocks: reference counts, the LRU free queue and the prefix cache.

    Args:
        num_blocks: number of blocks in the KV cache (>= 1).
        enable_caching: keep full blocks reusable by hash after their requests free them.

    Initially every block is free, queued by ascending block id, so the first
    `get_new_blocks(3)` returns blocks 0, 1, 2.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # NOTE: one block per hash. When two requests compute the same block at once,
        # only the first one registered is cached; the other stays private.
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `get_new_blocks` can hand out, cached-but-unused ones included."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, ref_cnt set to 1.

        A taken block that was a prefix-cache entry is evicted (its hash is dropped).
        Raises ValueError if fewer than `num_blocks` blocks are free.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"asked for {num_blocks} KV cache blocks, only {self.num_free_blocks} are free"
            )
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit).

        A block with no reference leaves the free queue, so it cannot be evicted while
        the request uses it.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 go to the free-queue tail.

        Pass blocks in the order they should be evicted: a request frees its block table
        in reverse, so the tail of a sequence (least likely to be shared) goes first.
        Raises ValueError on a block that has no reference (a double free).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int]
    ) -> None:
        """Register full, computed blocks as prefix-cache entries: blocks[i] under hashes[i].

        A block that already has a hash, or whose hash is already registered by another
        block, is left as it is.
        """
        if not self.enable_caching:
            return
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The block registered under `block_hash`, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def ref_counts(self) -> dict[int, int]:
        """Block id -> reference count of every block a request holds, ascending ids.

        A read-only view for tests and debugging (e.g. the beams of a beam search
        holding their prompt's blocks once each), O(num_blocks).
        """
        return {b.block_id: b.ref_cnt for b in self.blocks if b.ref_cnt > 0}

    def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache entry (e.g. after a weight update); returns how many.

        Blocks in use stay with their requests; they are just no longer found by hash.
        """
        num_entries = len(self.cached_block_hash_to_block)
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return num_entries

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
