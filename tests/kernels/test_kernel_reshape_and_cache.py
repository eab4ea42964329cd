from __future__ import annotations

import pytest
import torch

from flowengine.kernels.reshape_and_cache import reshape_and_cache


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim", "dtype"),
    [(16, 2, 64, torch.float32), (32, 3, 48, torch.float16), (16, 1, 32, torch.bfloat16)],
)
def test_writes_exact_slots_and_skips_padding(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    num_blocks, num_tokens = 8, 40
    # K/V as views of a fused QKV output: strided token rows, contiguous heads.
    qkv = torch.randn(num_tokens, (2 + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    k = qkv[:, 2 * head_dim : (2 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (2 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.randperm(num_tokens)[:7]] = -1
    slots = slots.to(device)
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype,
        device=device,
    )

    reshape_and_cache(k, v, cache, slots)

    flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    written = slots >= 0
    assert torch.equal(flat[0, slots[written]], k[written])  # a copy: exact
    assert torch.equal(flat[1, slots[written]], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[written]] = False
    assert flat[:, untouched].isnan().all(), "a padding token (slot -1) or stray slot was written"


def test_casts_to_cache_dtype(device: torch.device) -> None:
    k = torch.randn(5, 2, 32, device=device)
    v = torch.randn(5, 2, 32, device=device)
    cache = torch.zeros(2, 2, 16, 2, 32, dtype=torch.float16, device=device)
    slots = torch.tensor([3, 17, 0, 31, 8], device=device)
    reshape_and_cache(k, v, cache, slots)
    flat = cache.view(2, 32, 2, 32)
    assert torch.equal(flat[0, slots], k.half())
    assert torch.equal(flat[1, slots], v.half())


def test_rejects_mismatched_cache() -> None:
    k = torch.randn(4, 2, 32)
    with pytest.raises(ValueError, match="kv_cache shape"):
        reshape_and_cache(k, k, torch.zeros(2, 4, 16, 3, 32), torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping has 3 entries for 4 tokens"):
        reshape_and_cache(k, k, torch.zeros(2, 4, 16, 2, 32), torch.arange(3))
