"""Rotary position embedding applied in place to the new tokens' queries and keys.

HF / GPT-NeoX "rotate_half" layout: dimension i of a head pairs with i + head_dim / 2,
`out = x * cos + rotate_half(x) * sin` with `rotate_half(x) = [-x2, x1]`, i.e.

    out[:half] = x1 * cos - x2 * sin,    out[half:] = x2 * cos + x1 * sin.

The cos/sin tables come from kernels/rope_cache.py. Arithmetic is fp32 with one
rounding to the tensor's dtype at the end (HF rounds each product to bf16; the
results agree within bf16 precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import FLOAT_DTYPES, FP8_E4M3_MAX, INDEX_DTYPES, KV_CACHE_DTYPES, check_tensor


@triton.jit
def _cos_sin(
    positions_ptr,  # [num_tokens] int64/int32
    cos_ptr,  # [max_position, head_dim // 2] fp32
    sin_ptr,  # [max_position, head_dim // 2] fp32
    token,  # int64
    rope_stride,  # int64, the tables' row stride
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    """The cos/sin rows of `token`'s position, fp32, [HALF_PADDED] (0 past HALF)."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_PADDED)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * rope_stride + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * rope_stride + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_halves(
    ptrs,  # [heads, HALF_PADDED] pointers to the first halves of the heads
    mask,  # [heads, HALF_PADDED]
    cos,  # [HALF_PADDED] fp32
    sin,  # [HALF_PADDED] fp32
    HALF: tl.constexpr,
):
    """The rotation itself, the one copy of the module docstring's formula: loads both
    halves and returns the rotated halves in fp32 (the caller rounds and stores)."""
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    return out1, out2


@triton.jit
def _norm_halves(
    x1,  # [heads, HALF_PADDED] fp32, the first halves (0 past HALF)
    x2,  # [heads, HALF_PADDED] fp32, the second halves
    w_ptr,  # [2 * HALF] the per-head RMSNorm weight
    eps,  # float32
    dtype: tl.constexpr,  # the activation dtype
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    """Qwen3's per-head q/k RMSNorm of both halves, rounded as kernels/rms_norm.py (and
    transformers' RMSNorm) round: normalised row to `dtype`, times the weight, to
    `dtype`; returned as fp32."""
    offs_d = tl.arange(0, HALF_PADDED)
    d_mask = offs_d < HALF
    mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
    inv = tl.rsqrt(mean_sq + eps)[:, None]
    w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    y1 = ((x1 * inv).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
    y2 = ((x2 * inv).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def _rotate_normed_halves(
    ptrs,  # [heads, HALF_PADDED] pointers to the first halves of the heads
    mask,  # [heads, HALF_PADDED]
    cos,  # [HALF_PADDED] fp32
    sin,  # [HALF_PADDED] fp32
    w_ptr,  # [2 * HALF] RMSNorm weight (read when QK_NORM)
    eps,
    dtype: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    """`_rotate_halves`, after the per-head RMSNorm when QK_NORM."""
    if QK_NORM:
        x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = _norm_halves(x1, x2, w_ptr, eps, dtype, HALF, HALF_PADDED)
        out1 = x1 * cos[None, :] - x2 * sin[None, :]
        out2 = x2 * cos[None, :] + x1 * sin[None, :]
    else:
        out1, out2 = _rotate_halves(ptrs, mask, cos, sin, HALF)
    return out1, out2


@triton.jit
def _rotate_heads(
    x_ptr,  # [num_tokens, num_heads, head_dim], rows of this program's token
    stride_token,  # int64
    stride_head,  # int64
    token,  # int64
    cos,  # [HALF_PADDED] fp32
    sin,  # [HALF_PADDED] fp32
    NUM_HEADS: tl.constexpr,
    NUM_HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    offs_h = tl.arange(0, NUM_HEADS_PADDED)
    offs_d = tl.arange(0, HALF_PADDED)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    ptrs = x_ptr + token * stride_token + offs_h[:, None] * stride_head + offs_d[None, :]
    out1, out2 = _rotate_halves(ptrs, mask, cos, sin, HALF)
    tl.store(ptrs, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_dim], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    positions_ptr,  # [num_tokens] int64/int32
    cos_ptr,  # [max_position, head_dim // 2] fp32
    sin_ptr,  # [max_position, head_dim // 2] fp32
    query_stride_token: tl.int64,
    query_stride_head: tl.int64,
    key_stride_token: tl.int64,
    key_stride_head: tl.int64,
    cache_stride: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_Q_HEADS_PADDED: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PADDED: tl.constexpr,  # power of 2
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(positions_ptr, cos_ptr, sin_ptr, token, cache_stride, HALF, HALF_PADDED)
    _rotate_heads(
        query_ptr, query_stride_token, query_stride_head, token, cos, sin,
        NUM_Q_HEADS, NUM_Q_HEADS_PADDED, HALF, HALF_PADDED,
    )
    _rotate_heads(
        key_ptr, key_stride_token, key_stride_head, token, cos, sin,
        NUM_KV_HEADS, NUM_KV_HEADS_PADDED, HALF, HALF_PADDED,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Rotate `query` and `key` in place by their tokens' positions.

    Args:
        positions: [num_tokens] int64/int32, each < max_position (not checked on the
            device: that would sync).
        query: [num_tokens, num_q_heads, head_dim] float32/float16/bfloat16; any token
            and head strides with a contiguous last dimension (views of a fused QKV
            output are rotated where they lie).
        key: [num_tokens, num_kv_heads, head_dim], same dtype.
        cos_cache, sin_cache: [max_position, head_dim // 2] float32, from
            rope_cache.build_rope_cache.

    Raises:
        ValueError: shapes, dtypes or devices disagree, or head_dim is odd.
    """
    dev = query.device
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,), device=dev)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("cos_cache", cos_cache, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("sin_cache", sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if head_dim % 2 or key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must share num_tokens "
            "and an even head_dim"
        )
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    half = head_dim // 2
    if cos_cache.shape[1] != half or sin_cache.shape != cos_cache.shape:
        raise ValueError(
            f"cos_cache {tuple(cos_cache.shape)} and sin_cache {tuple(sin_cache.shape)} "
            f"must both be [max_position, {half}]"
        )
    if cos_cache.stride(0) != sin_cache.stride(0):
        raise ValueError("cos_cache and sin_cache must have the same row stride")
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos_cache,
        sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        NUM_Q_HEADS_PADDED=triton.next_power_of_2(num_q_heads),
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PADDED=triton.next_power_of_2(half),
    )


@triton.jit
def _rotary_and_cache_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_dim], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], read only
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], read only
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1: padding (no cache write)
    positions_ptr,  # [num_tokens] int64/int32
    cos_ptr,  # [max_position, head_dim // 2] fp32
    sin_ptr,  # [max_position, head_dim // 2] fp32
    query_stride_token: tl.int64,
    query_stride_head: tl.int64,
    key_stride_token: tl.int64,
    key_stride_head: tl.int64,
    value_stride_token: tl.int64,
    value_stride_head: tl.int64,
    cache_stride_block: tl.int64,
    cache_stride_offset: tl.int64,
    cache_stride_head: tl.int64,
    rope_stride: tl.int64,
    q_norm_ptr,  # [head_dim] q RMSNorm weight (read when QK_NORM)
    k_norm_ptr,  # [head_dim] k RMSNorm weight (read when QK_NORM)
    norm_eps,  # float32
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_Q_HEADS_PADDED: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PADDED: tl.constexpr,  # power of 2
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    FP8_MAX: tl.constexpr,  # > 0: the cache is E4M3; clamp to +-FP8_MAX before the cast
    QK_NORM: tl.constexpr,  # per-head RMSNorm of q and k before the rotation (Qwen3)
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(positions_ptr, cos_ptr, sin_ptr, token, rope_stride, HALF, HALF_PADDED)
    dtype = query_ptr.dtype.element_ty
    offs_d = tl.arange(0, HALF_PADDED)
    offs_q = tl.arange(0, NUM_Q_HEADS_PADDED)
    q_mask = (offs_q[:, None] < NUM_Q_HEADS) & (offs_d[None, :] < HALF)
    q_ptrs = (query_ptr + token * query_stride_token + offs_q[:, None] * query_stride_head
              + offs_d[None, :])
    q1, q2 = _rotate_normed_halves(q_ptrs, q_mask, cos, sin, q_norm_ptr, norm_eps, dtype,
                                   HALF, HALF_PADDED, QK_NORM)
    tl.store(q_ptrs, q1.to(dtype), mask=q_mask)
    tl.store(q_ptrs + HALF, q2.to(dtype), mask=q_mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, NUM_KV_HEADS_PADDED)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HALF)
    k_ptrs = key_ptr + token * key_stride_token + offs_h[:, None] * key_stride_head + offs_d[None, :]
    out1, out2 = _rotate_normed_halves(k_ptrs, mask, cos, sin, k_norm_ptr, norm_eps, dtype,
                                       HALF, HALF_PADDED, QK_NORM)
    # Round to the activation dtype first, as rotary_embedding followed by
    # reshape_and_cache would store it: the cached key is the same bits either way.
    out1 = out1.to(key_ptr.dtype.element_ty)
    out2 = out2.to(key_ptr.dtype.element_ty)
    v_ptrs = (value_ptr + token * value_stride_token + offs_h[:, None] * value_stride_head
              + offs_d[None, :])
    v1 = tl.load(v_ptrs, mask=mask, other=0.0)
    v2 = tl.load(v_ptrs + HALF, mask=mask, other=0.0)
    if FP8_MAX > 0:
        # E4M3 has no infinity: clamp, as reshape_and_cache does.
        out1 = tl.minimum(tl.maximum(out1.to(tl.float32), -FP8_MAX), FP8_MAX)
        out2 = tl.minimum(tl.maximum(out2.to(tl.float32), -FP8_MAX), FP8_MAX)
        v1 = tl.minimum(tl.maximum(v1.to(tl.float32), -FP8_MAX), FP8_MAX)
        v2 = tl.minimum(tl.maximum(v2.to(tl.float32), -FP8_MAX), FP8_MAX)
    # NOTE: int64: block * cache_stride_block passes 2**31 elements in a large pool.
    cache_offs = ((slot // BLOCK_SIZE) * cache_stride_block
                  + (slot % BLOCK_SIZE) * cache_stride_offset
                  + offs_h[:, None] * cache_stride_head + offs_d[None, :])
    cache_ty = key_cache_ptr.dtype.element_ty
    tl.store(key_cache_ptr + cache_offs, out1.to(cache_ty), mask=mask)
    tl.store(key_cache_ptr + cache_offs + HALF, out2.to(cache_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offs, v1.to(cache_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offs + HALF, v2.to(cache_ty), mask=mask)


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """rotary_embedding + reshape_and_cache in one launch: rotate `query` in place, and
    write the rotated keys and the values into `kv_cache` at `slot_mapping`.

    qk_norm: (q_weight [head_dim], k_weight [head_dim], eps): Qwen3's per-head RMSNorm
    of q and k applied first in the same launch (two launches less a layer), rounded as
    `rms_norm` followed by this function would round; None: no norm.

    The cache ends up bit for bit as `rotary_embedding(positions, query, key, ...)`
    followed by `reshape_and_cache(key, value, kv_cache, slot_mapping)` leaves it
    (the rotated key is rounded to key's dtype before the cache cast); `key` itself is
    not modified (nothing reads it after the write, and skipping the store saves a
    pass over it).

    Args:
        positions: [num_tokens] int64/int32, each < max_position (not checked on the
            device: that would sync).
        query: [num_tokens, num_q_heads, head_dim] float32/float16/bfloat16, any token
            and head strides with a contiguous last dimension.
        key, value: [num_tokens, num_kv_heads, head_dim], query's dtype, any strides
            with a contiguous last dimension (views of a fused QKV output).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], float32/float16/
            bfloat16 or float8_e4m3fn (clamped to +-448, scale 1.0).
        slot_mapping: [num_tokens] int64 (int32 accepted), -1 skips the token's write
            (its query is still rotated).
        cos_cache, sin_cache: [max_position, head_dim // 2] float32.

    Raises:
        ValueError: shapes, dtypes or devices disagree, or head_dim is odd.
    """
    dev = query.device
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,), device=dev)
    check_tensor("value", value, ndim=3, dtypes=(query.dtype,), device=dev)
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=KV_CACHE_DTYPES, device=dev)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("cos_cache", cos_cache, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("sin_cache", sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if head_dim % 2 or key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must share num_tokens "
            "and an even head_dim"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match "
            f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"positions ({positions.shape[0]}) and slot_mapping ({slot_mapping.shape[0]}) "
            f"must have one entry per token ({num_tokens})"
        )
    half = head_dim // 2
    if cos_cache.shape[1] != half or sin_cache.shape != cos_cache.shape:
        raise ValueError(
            f"cos_cache {tuple(cos_cache.shape)} and sin_cache {tuple(sin_cache.shape)} "
            f"must both be [max_position, {half}]"
        )
    if cos_cache.stride(0) != sin_cache.stride(0):
        raise ValueError("cos_cache and sin_cache must have the same row stride")
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        check_tensor("q_norm weight", q_w, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
        check_tensor("k_norm weight", k_w, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
        if q_w.shape[0] != head_dim or k_w.shape[0] != head_dim:
            raise ValueError(f"q/k norm weights {tuple(q_w.shape)}, {tuple(k_w.shape)} "
                             f"must be [{head_dim}]")
    else:
        q_w, k_w, eps = cos_cache, cos_cache, 0.0  # not read
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _rotary_and_cache_kernel[(num_tokens,)](
        query, key, value, key_cache, value_cache, slot_mapping, positions,
        cos_cache, sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        cos_cache.stride(0),
        q_w, k_w, float(eps),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        NUM_Q_HEADS_PADDED=triton.next_power_of_2(num_q_heads),
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PADDED=triton.next_power_of_2(half),
        BLOCK_SIZE=kv_cache.shape[2],
        FP8_MAX=FP8_E4M3_MAX if kv_cache.dtype == torch.float8_e4m3fn else 0.0,
        QK_NORM=qk_norm is not None,
    )
