"""Per-request KV block tables on top of the `BlockPool` (DESIGN.md §4).

Follows vLLM v1's `KVCacheManager` (`vllm/v1/core/kv_cache_manager.py`) with one
deliberate difference: a block becomes a prefix-cache entry only after the step that
computes it has returned (`cache_blocks`, called from `Scheduler.update_from_output`),
not when its slots are allocated. So a prefix-cache hit always points at KV that has
been written, whatever the executor's order of work inside a step, and a failed step
never publishes blocks holding garbage.

Blocks of a request that leaves while a step that writes them is in flight (finished
with a speculative token scheduled, preempted, aborted; DESIGN.md §5) are freed with
`free(request, after_step=...)`: they leave the request at once but return to the pool
only in `release_deferred`, once that step has completed, so no block is handed to
another request while an in-flight step still writes it.

With a sliding window shared by all layers, blocks that fell out of the window are
freed as the request advances (`remove_skipped_blocks`, flowengine/core/sliding_window.py)
and their block-table entries point at the null block.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flowengine.core.block_pool import BlockPool, KVCacheBlock
from flowengine.core.kv_cache_utils import extend_block_hashes, root_block_hash
from flowengine.core.sliding_window import SlidingWindowBlocks
from flowengine.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since start: requests, queried and hit prompt tokens."""

    num_requests: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens, 0.0 before any query."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def record(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_requests += 1
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Block tables of running requests, prefix-cache lookups and block accounting.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: token slots per block.
        enable_caching: reuse full blocks across requests by their chained hash.
        hash_seed: seed of the root block hash; processes sharing hashes use the same.
        sliding_window: the attention window (tokens) of every layer, or None for a
            model with a full-attention layer; with a window, one block becomes the null
            block and blocks out of the window are freed (`remove_skipped_blocks`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_seed: str = "",
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.root_hash = root_block_hash(hash_seed)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # (step id, blocks): blocks to free once that step has completed.
        self._deferred_frees: list[tuple[int, list[KVCacheBlock]]] = []
        self.sliding_window: SlidingWindowBlocks | None = None
        self.null_block: KVCacheBlock | None = None
        if sliding_window is not None:
            self.sliding_window = SlidingWindowBlocks(self.block_pool, sliding_window,
                                                      block_size)
            self.null_block = self.sliding_window.null_block

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all of them, less the null block of a window."""
        return self.block_pool.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to new allocations (evictable cached blocks included)."""
        return self.block_pool.num_free_blocks

    @property
    def num_deferred_free_blocks(self) -> int:
        """Blocks that become free when their steps complete (`release_deferred`):
        those held by a deferred free only. Blocks also held by another deferred free
        are left out, so this never overstates what comes back."""
        return sum(b.ref_cnt == 1 for _, blocks in self._deferred_frees for b in blocks)

    @property
    def usage(self) -> float:
        """Fraction of KV cache blocks held by requests, in [0, 1] (the null block of
        a window is not counted, as in vLLM)."""
        if self.null_block is None:
            return self.block_pool.usage
        return 1.0 - self.block_pool.num_free_blocks / self.num_usable_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached full blocks that prefixes the request's tokens.

        Returns (blocks, num_computed_tokens) with num_computed_tokens =
        len(blocks) * block_size. The match stops before the last token, so at least
        one token is left to compute and the step yields logits to sample from. Looks
        only; nothing is referenced until `allocate_slots` takes the blocks.
        """
        if not self.enable_caching:
            return [], 0
        extend_block_hashes(request, self.block_size, self.root_hash)
        if request.sampling_params.prompt_logprobs is not None:
            # Its prompt logprobs need the hidden states of every prompt position (vLLM
            # skips the prefix cache for such requests too).
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Args:
            request: its `num_computed_tokens` tokens already have slots.
            num_new_tokens: tokens to compute this step (>= 1).
            new_computed_blocks: prefix-cache hits from `get_computed_blocks`, only for
                a request that holds no blocks yet; they count as computed tokens.

        Returns the newly allocated blocks (hits excluded; possibly empty), or None
        when too few blocks are free, in which case nothing changed. Cached blocks
        nobody uses count as free, except the hits themselves, which this call takes.
        Raises ValueError on num_new_tokens < 1 or hits for a request that has blocks.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        req_blocks = self.req_to_blocks.get(request.request_id)
        # Fast path (most decode steps): the tokens fit in the blocks the request holds.
        if (
            req_blocks is not None
            and not new_computed_blocks
            and request.num_computed_tokens + num_new_tokens <= len(req_blocks) * self.block_size
        ):
            return []
        if new_computed_blocks and req_blocks:
            raise ValueError(
                f"request {request.request_id} already holds blocks; prefix-cache hits "
                "apply only to a request's first allocation"
            )
        num_new_blocks = self.num_new_blocks_for(request, num_new_tokens, len(new_computed_blocks))
        # Hits sitting in the free queue stop being free once taken.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        if new_computed_blocks:
            # NOTE: touch before get_new_blocks, or popping could evict a hit block.
            self.block_pool.touch(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        if new_computed_blocks and self.sliding_window is not None:
            # No step computes this request yet, so hits before its first window go
            # back at once (they stay cached; the table holds the null block there).
            self.sliding_window.remove_skipped_blocks(
                req_blocks,
                request.num_computed_tokens + len(new_computed_blocks) * self.block_size)
        return new_blocks

    def num_new_blocks_for(
        self, request: Request, num_new_tokens: int, num_hit_blocks: int = 0
    ) -> int:
        """Blocks `allocate_slots(request, num_new_tokens, hits)` takes from the free queue,
        with `num_hit_blocks` prefix-cache hits (0 for a request that holds blocks)."""
        num_held = len(self.req_to_blocks.get(request.request_id, ())) + num_hit_blocks
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        return max(0, cdiv(num_computed + num_new_tokens, self.block_size) - num_held)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks among its first `num_computed_tokens` tokens.

        Call once those tokens' KV has been written (after the step returned). Extends
        `request.block_hashes` to cover them; tokens not yet known (a speculative
        position) are never hashed.
        """
        if not self.enable_caching:
            return
        req_id = request.request_id
        start = self.num_cached_blocks.get(req_id, 0)
        if num_computed_tokens // self.block_size <= start:
            return  # no block filled up (most decode steps)
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None or num_full <= start:
            return
        extend_block_hashes(request, self.block_size, self.root_hash, num_full)
        new_blocks, new_hashes = blocks[start:num_full], request.block_hashes[start:num_full]
        if self.null_block is not None and self.null_block in new_blocks:
            # Freed out of the window before being offered (not on the scheduler's
            # path, which publishes first): nothing of it to publish.
            kept = [(b, h) for b, h in zip(new_blocks, new_hashes, strict=True)
                    if b is not self.null_block]
            new_blocks, new_hashes = [b for b, _ in kept], [h for _, h in kept]
        self.block_pool.cache_full_blocks(new_blocks, new_hashes)
        self.num_cached_blocks[req_id] = num_full

    def unpublished_block_hashes(self, requests: Iterable[Request]) -> set[int]:
        """Hashes of full blocks these requests will compute but have not published yet.

        Covers every full block of their known tokens past the published ones, so a
        chunked prefill's later chunks count too. Empty when caching is off.
        """
        if not self.enable_caching:
            return set()
        pending: set[int] = set()
        for request in requests:
            pending.update(
                request.block_hashes[self.num_cached_blocks.get(request.request_id, 0) :]
            )
        return pending

    def free(self, request: Request, *, after_step: int | None = None) -> None:
        """Release the request's blocks, last block first (evicted before its prefix).

        With `after_step`, the blocks leave the request now but stay taken until
        `release_deferred(after_step)`: step `after_step`, still in flight, writes them.
        Unknown or already freed requests are ignored.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if self.null_block is not None:
            blocks = [b for b in blocks if b is not self.null_block]
        if after_step is not None and blocks:
            self._deferred_frees.append((after_step, blocks))
        else:
            self.block_pool.free_blocks(reversed(blocks))

    def release_deferred(self, completed_step_id: int) -> None:
        """Free the blocks deferred until steps up to `completed_step_id`, which have
        all completed (steps complete in order)."""
        keep: list[tuple[int, list[KVCacheBlock]]] = []
        for step_id, blocks in self._deferred_frees:
            if step_id <= completed_step_id:
                self.block_pool.free_blocks(reversed(blocks))
            else:
                keep.append((step_id, blocks))
        self._deferred_frees = keep

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty for an unknown request)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> int:
        """Forget all prefix-cache entries; returns how many were dropped."""
        return self.block_pool.reset_prefix_cache()

    def trim(self, request: Request, num_tokens: int) -> int:
        """Speculative decoding's rollback: free the request's blocks past the first
        ceil(num_tokens / block_size), which hold only rejected draft tokens (none is
        published: published blocks hold verified tokens only). Call once the step that
        wrote them has completed and no later step in flight computes the request.
        Returns the number of blocks freed."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return 0
        freed = [b for b in blocks[keep:] if b is not self.null_block]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(freed))
        return len(freed)

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> int:
        """Sliding window: free the request's leading blocks that no token at position
        >= `num_computed_tokens` reads, leaving the null block in their table entries.

        Call after the step that wrote its first `num_computed_tokens` tokens has
        completed, with no step still to run starting before that position (the
        scheduler passes the count after any draft rollback). Returns the number of
        blocks freed; 0 without a window or for an unknown request.
        """
        if self.sliding_window is None:
            return 0
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return 0
        return self.sliding_window.remove_skipped_blocks(blocks, num_computed_tokens)
