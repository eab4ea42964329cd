"""Chained block hashes for prefix caching (DESIGN.md §4).

The hash of a full block is H(parent hash, the block's token ids, extra keys), where the
parent is the previous block's hash, or the run's root hash for the first block. Two
sequences get the same hash for block i exactly when their first (i+1)*block_size
tokens (and extra keys) match, so a hash identifies a whole prefix. The scheme is
vLLM v1's (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`).

H is BLAKE2b with an 8-byte digest over the msgpack encoding of
(parent, token ids, extra keys), read as an unsigned little-endian int. It does not
depend on PYTHONHASHSEED, so every process computes the same hashes. The cache salt is
an extra key of the first block only; chaining carries it into every later hash.

NOTE: 64-bit hashes collide with probability about n^2 / 2^65 for n distinct blocks
(~3e-6 for ten million). A secret, random `hash_seed` per run (`new_hash_seed()`, made
when the engine builds its scheduler, the one place that hashes blocks) keeps anyone who
does not know it from crafting collisions on purpose, or from precomputing the hashes of
another tenant's prefixes. The seed is never logged or sent anywhere. Tenants that must
not share cached prefixes at all pass different cache salts (`cache_salt`): a salted
block 0 hashes differently, so no block of one tenant's chain can match another's, and
a prefix-cache hit (a faster first token) tells nothing about other tenants' prompts.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import msgspec

from flowengine.request import Request

_encoder = msgspec.msgpack.Encoder()
_ROOT_DOMAIN = b"flowengine/kv-block-root/v1:"

# Extra keys of one block: hashable scalars that change the block's KV besides its
# tokens (today only the cache salt).
ExtraKeys = tuple[str | int, ...]


def _digest64(payload: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def new_hash_seed() -> str:
    """A fresh secret seed for one engine run: 128 random bits from the OS, as hex."""
    return secrets.token_hex(16)


def root_block_hash(hash_seed: str = "") -> int:
    """Parent hash of every sequence's first block, derived from the run's `hash_seed`.

    Processes that share cached blocks must use the same seed. Returns a 64-bit int.
    """
    return _digest64(_ROOT_DOMAIN + hash_seed.encode())


def hash_block_tokens(
    parent_hash: int, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> int:
    """Hash of one full block: H(parent_hash, token_ids, extra_keys), a 64-bit int.

    Args:
        parent_hash: hash of the previous block, or `root_block_hash(seed)` for block 0.
        token_ids: exactly block_size token ids.
        extra_keys: e.g. `(cache_salt,)` for the first block of a salted request.
    """
    return _digest64(_encoder.encode((parent_hash, token_ids, extra_keys)))


def block_extra_keys(block_index: int, cache_salt: str | None) -> ExtraKeys | None:
    """Extra keys of block `block_index`: the cache salt on block 0, nothing elsewhere."""
    if block_index == 0 and cache_salt is not None:
        return (cache_salt,)
    return None


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    root_hash: int,
    cache_salt: str | None = None,
) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a partial tail is skipped)."""
    hashes: list[int] = []
    parent = root_hash
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, block, block_extra_keys(i, cache_salt))
        hashes.append(parent)
    return hashes


def extend_block_hashes(
    request: Request, block_size: int, root_hash: int, max_num_blocks: int | None = None
) -> None:
    """Append to `request.block_hashes` the hashes of its full blocks not hashed yet.

    Covers prompt and output tokens; stops at `max_num_blocks` blocks when given.
    The token ids are read in place, without building prompt + output.
    """
    num_full = request.num_tokens // block_size
    if max_num_blocks is not None:
        num_full = min(num_full, max_num_blocks)
    hashes = request.block_hashes
    if len(hashes) >= num_full:
        return
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt = len(prompt)
    parent = hashes[-1] if hashes else root_hash
    for i in range(len(hashes), num_full):
        start, end = i * block_size, (i + 1) * block_size
        if end <= num_prompt:
            block = prompt[start:end]
        elif start >= num_prompt:
            block = output[start - num_prompt : end - num_prompt]
        else:
            block = prompt[start:] + output[: end - num_prompt]
        parent = hash_block_tokens(parent, block, block_extra_keys(i, request.cache_salt))
        hashes.append(parent)
