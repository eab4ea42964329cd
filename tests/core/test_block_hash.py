"""Chained block hashes: prefix sharing, salt, seed, and values fixed across processes."""

from __future__ import annotations

import hashlib

import msgspec

from flowengine.core.kv_cache_utils import (
    extend_block_hashes,
    hash_block_tokens,
    hash_token_blocks,
    root_block_hash,
)
from flowengine.request import Request
from flowengine.sampling_params import SamplingParams

ROOT = root_block_hash()


def test_known_values_do_not_depend_on_the_process() -> None:
    # Computed once; Python's hash() would change with PYTHONHASHSEED, these must not.
    assert ROOT == 5446422530523653163
    assert hash_token_blocks(list(range(8)), 4, ROOT) == [
        13966614927902045541,
        10057096744901526436,
    ]
    assert hash_token_blocks(list(range(8)), 4, ROOT, "salt") == [
        6852541883634234279,
        11595879574866799578,
    ]


def test_hash_is_blake2b_of_msgpack() -> None:
    payload = msgspec.msgpack.encode((ROOT, [5, 6, 7, 8], None))
    expected = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
    assert hash_block_tokens(ROOT, [5, 6, 7, 8]) == expected
    # Tuples and lists of the same ids hash alike.
    assert hash_block_tokens(ROOT, (5, 6, 7, 8)) == expected


def test_same_prefix_same_hashes_then_diverge() -> None:
    a = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 4, ROOT)
    b = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 9, 9, 10, 11, 12], 4, ROOT)
    assert len(a) == 2  # the partial tail block is not hashed
    assert len(b) == 3
    assert a[0] == b[0]
    assert a[1] != b[1]
    # Same tokens in a later block but a different parent: different hash.
    c = hash_token_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    assert c[0] != a[0] and c[1] != a[1]


def test_salt_and_seed_change_every_hash() -> None:
    tokens = list(range(12))
    plain = hash_token_blocks(tokens, 4, ROOT)
    salted = hash_token_blocks(tokens, 4, ROOT, "tenant-a")
    other_salt = hash_token_blocks(tokens, 4, ROOT, "tenant-b")
    seeded = hash_token_blocks(tokens, 4, root_block_hash("run-2"))
    for other in (salted, other_salt, seeded):
        assert all(x != y for x, y in zip(plain, other, strict=True))
    assert all(x != y for x, y in zip(salted, other_salt, strict=True))
    assert hash_token_blocks(tokens, 4, ROOT, "tenant-a") == salted


def test_extend_block_hashes_covers_prompt_and_outputs() -> None:
    request = Request(
        "r", [1, 2, 3, 4, 5, 6], SamplingParams(), eos_token_id=None, max_tokens=8, cache_salt="s"
    )
    extend_block_hashes(request, 4, ROOT)
    assert request.block_hashes == hash_token_blocks([1, 2, 3, 4], 4, ROOT, "s")
    request.append_output_token_ids([7, 8, 9, 10, 11, 12, 13])
    extend_block_hashes(request, 4, ROOT, max_num_blocks=2)
    assert len(request.block_hashes) == 2
    extend_block_hashes(request, 4, ROOT)
    assert request.block_hashes == hash_token_blocks(list(range(1, 14)), 4, ROOT, "s")
    assert len(request.block_hashes) == 3
