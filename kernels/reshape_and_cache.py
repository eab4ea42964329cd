"""KV-cache write: scatter the new tokens' K and V into their cache slots.

Layout (flowengine/model/attention/metadata.py): the cache of one layer is
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, index 0 holding K and 1 holding
V; slot `s` lives at block `s // block_size`, offset `s % block_size`. Same operation
as vLLM's `reshape_and_cache_flash`; a slot of -1 marks a padding token whose K/V must
not be written (CUDA-graph padding, for example).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import FLOAT_DTYPES, FP8_E4M3_MAX, KV_CACHE_DTYPES, check_tensor


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    key_stride_token: tl.int64,
    key_stride_head: tl.int64,
    value_stride_token: tl.int64,
    value_stride_head: tl.int64,
    cache_stride_block: tl.int64,
    cache_stride_offset: tl.int64,
    cache_stride_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,  # power of 2
    HEAD_DIM_PADDED: tl.constexpr,  # power of 2
    FP8_MAX: tl.constexpr,  # > 0: the cache is E4M3; clamp to +-FP8_MAX before the cast
):
    token_idx = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot < 0:
        return
    # NOTE: int64 all the way: block * cache_stride_block passes 2**31 elements in a
    # large pool (e.g. 80k blocks of 16 x 8 x 128 bf16).
    block_idx = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, NUM_KV_HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    key = tl.load(
        key_ptr
        + token_idx * key_stride_token
        + offs_h[:, None] * key_stride_head
        + offs_d[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr
        + token_idx * value_stride_token
        + offs_h[:, None] * value_stride_head
        + offs_d[None, :],
        mask=mask,
    )
    if FP8_MAX > 0:
        # E4M3 has no infinity: an out-of-range value would become NaN, and one NaN
        # in a cache slot poisons every later attention over it.
        key = tl.minimum(tl.maximum(key.to(tl.float32), -FP8_MAX), FP8_MAX)
        value = tl.minimum(tl.maximum(value.to(tl.float32), -FP8_MAX), FP8_MAX)
    cache_offs = (
        block_idx * cache_stride_block
        + block_offset * cache_stride_offset
        + offs_h[:, None] * cache_stride_head
        + offs_d[None, :]
    )
    tl.store(key_cache_ptr + cache_offs, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(
        value_cache_ptr + cache_offs, value.to(value_cache_ptr.dtype.element_ty), mask=mask
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` rows into `kv_cache` at `slot_mapping`, in place.

    Args:
        key: [num_tokens, num_kv_heads, head_dim] float32/float16/bfloat16; any strides
            with a contiguous last dimension (a view of a fused QKV output works).
        value: same shape and dtype as `key`.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], the layer's cache
            (0 = K, 1 = V); values are cast to its dtype (float32/float16/bfloat16, or
            float8_e4m3fn: clamped to +-448 first, scale 1.0).
        slot_mapping: [num_tokens] int64 (int32 accepted), slot of each token; -1 skips
            the token. Slots must be < num_blocks * block_size (not checked: that would
            need a device sync).

    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES, device=key.device)
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=KV_CACHE_DTYPES, device=key.device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, device=key.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match "
            f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens"
        )
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        FP8_MAX=FP8_E4M3_MAX if kv_cache.dtype == torch.float8_e4m3fn else 0.0,
    )
