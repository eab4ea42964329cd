"""Unified paged attention over block tables for mixed prefill/decode batches.

One launch serves the whole flattened batch (metadata.py): prefill chunks attend fully
to their cached prefix and causally to their new tokens; decode tokens are prefill
chunks of length 1. K/V are read through the block table, so a request's blocks can
sit anywhere in the pool.

Work split (after vLLM's `triton_unified_attention.py`, our code): a program owns one
*q-block* — up to `BLOCK_Q` consecutive new tokens of one request — and one KV head.
The `QPK = num_q_heads // num_kv_heads` query heads sharing that KV head are packed
with the tokens into one `[BLOCK_M, head_dim]` tile, row `r` = (token `r // QPK`, head
`r % QPK`), so each K/V tile is loaded once for all of them and `tl.dot` runs on a
tile of at least 16 rows (tensor cores) even for decode. Softmax is the online
(streaming) softmax of FlashAttention (Dao et al. 2022, arXiv:2205.14135) in fp32,
base 2 so the exponentials are `exp2`. An E4M3 (fp8) cache under a 16-bit query is
widened to float16 and the tile math runs in fp16 (one conversion instruction per pair
of values on Hopper; decode_attention.py's docstring gives the reasoning).

Grid without a host sync: request `i` is given the q-block indices
`[query_start_loc[i] // BLOCK_Q + i, query_start_loc[i + 1] // BLOCK_Q + i + 1)`, a
range at least `ceil(q_len_i / BLOCK_Q)` long; so `num_tokens // BLOCK_Q + num_reqs`
programs along axis 0 cover every request, a program finds its request by binary
search over `query_start_loc`, and the spare ones exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import check_attention_inputs, check_tensor

# Rows of the packed query tile for a launch that contains a prefill chunk; decode-only
# launches use the smallest tile that holds one token's QPK heads (but >= 16 for
# tl.dot). 64 x 128 fp32 accumulators fit comfortably in registers with 4 warps.
PREFILL_BLOCK_M = 64
MIN_BLOCK_M = 16
# K/V positions per inner-loop step, independent of the cache block size: each position
# looks up its own block id, so any power-of-two tile works with any block size.
TILE_N = 32


@triton.jit
def find_request(
    query_start_loc_ptr,  # [num_reqs + 1] int32
    q_block_idx,
    num_reqs,
    BLOCK_Q: tl.constexpr,
):
    """Largest request i whose first q-block `query_start_loc[i] // BLOCK_Q + i` is
    <= q_block_idx (binary search; those first indices strictly increase with i)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_reqs,
    scale,  # float32, softmax scale (usually head_dim ** -0.5)
    sliding_window,  # int32, positions a token sees (itself included); used if SLIDING
    soft_cap,  # float32, scores -> soft_cap * tanh(scores / soft_cap); used if SOFT_CAP
    query_stride_token: tl.int64,
    query_stride_head: tl.int64,
    out_stride_token: tl.int64,
    out_stride_head: tl.int64,
    cache_stride_block: tl.int64,
    cache_stride_offset: tl.int64,
    cache_stride_head: tl.int64,
    block_table_stride: tl.int64,
    QPK: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,  # power of 2
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # packed rows, >= BLOCK_Q * QPK, power of 2
    TILE_N: tl.constexpr,  # K/V positions per loop step, power of 2
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding)
    WIDEN_FP16: tl.constexpr,  # E4M3 cache, 16-bit query: compute in fp16 (module doc)
    SLIDING: tl.constexpr,  # sliding-window attention (Mistral, Gemma local layers)
    SOFT_CAP: tl.constexpr,  # attention logit soft-capping (Gemma 2)
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    req = find_request(query_start_loc_ptr, q_block_idx, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    # The new tokens are the last q_len positions of the context.
    prefix_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_n = tl.arange(0, TILE_N)
    q_idx = q_block_local * BLOCK_Q + offs_m // QPK  # index among the new tokens
    head = kv_head * QPK + offs_m % QPK
    row_valid = (offs_m // QPK < BLOCK_Q) & (q_idx < q_len)
    d_valid = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)

    q = tl.load(
        query_ptr
        + token[:, None] * query_stride_token
        + head[:, None] * query_stride_head
        + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if WIDEN_FP16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    q_pos = prefix_len + q_idx  # absolute position; sees K/V positions <= q_pos

    # Causality bounds the K/V range by the last new token of this q-block.
    last_q_idx = tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len = prefix_len + last_q_idx + 1
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in base 2

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table_row = block_tables_ptr + req.to(tl.int64) * block_table_stride
    kv_lo = 0
    if SLIDING:
        # The first new token of this q-block sees nothing before first_q_pos - window + 1;
        # start at the tile holding that position (whole tiles before it are skipped).
        first_q_pos = prefix_len + q_block_local * BLOCK_Q
        kv_lo = tl.maximum(first_q_pos - sliding_window + 1, 0) // TILE_N * TILE_N
    for tile_start in range(kv_lo, kv_len, TILE_N):
        kv_pos = tile_start + offs_n
        kv_valid = kv_pos < kv_len
        # NOTE: int64 before the multiply: block_id * cache_stride_block exceeds 2**31
        # in a large pool, and int32 wraps silently.
        block_id = tl.load(
            block_table_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0
        ).to(tl.int64)
        kv_offs = (
            block_id * cache_stride_block
            + (kv_pos % BLOCK_SIZE).to(tl.int64) * cache_stride_offset
            + kv_head * cache_stride_head
        )
        k = tl.load(  # [HEAD_DIM_PADDED, TILE_N]
            key_cache_ptr + kv_offs[None, :] + offs_d[:, None],
            mask=d_valid[:, None] & kv_valid[None, :],
            other=0.0,
        ).to(q.dtype)  # an fp8 cache is widened here (to fp16 when WIDEN_FP16)
        v = tl.load(  # [TILE_N, HEAD_DIM_PADDED]
            value_cache_ptr + kv_offs[:, None] + offs_d[None, :],
            mask=kv_valid[:, None] & d_valid[None, :],
            other=0.0,
        ).to(q.dtype)
        if SOFT_CAP:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
            # tanh(x) = 2 * sigmoid(2x) - 1 (no tanh in every Triton version)
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0) * 1.4426950408889634
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        visible = row_valid[:, None] & kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Padding rows see nothing; keep their max finite so exp2 gives 0, not NaN.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=DOT_PRECISION
        )
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + token[:, None] * out_stride_token
        + head[:, None] * out_stride_head
        + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their paged context.

    Args:
        query: [num_tokens, num_q_heads, head_dim] float32/float16/bfloat16, the new
            tokens of all requests, flattened in request order.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], `query`'s dtype
            or float8_e4m3fn (widened to `query`'s dtype as it is read), already
            holding the new tokens' K/V (see reshape_and_cache).
        query_start_loc: [num_reqs + 1] int32, new-token offsets (starts at 0).
        seq_lens: [num_reqs] int32, context length including the new tokens; must be
            >= the request's new-token count.
        block_tables: [num_reqs, max_blocks_per_req] int32, block ids of each request;
            only the first ceil(seq_len / block_size) entries are read.
        max_query_len: largest new-token count (host int); picks the tile shape only.
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional [num_tokens, num_q_heads, head_dim] output; rows of tokens
            outside every request (beyond query_start_loc[-1]) are left untouched.
        sliding_window: a token at position p sees positions p - sliding_window < j <= p
            only (None: the whole context); tiles wholly before the window are skipped.
        logits_soft_cap: scores become cap * tanh(scores / cap) before the softmax
            (Gemma 2; None: off).

    Returns:
        [num_tokens, num_q_heads, head_dim] in query's dtype (`out` when given).

    Raises:
        ValueError: inputs disagree (see check_attention_inputs), or a sliding window
            / soft cap that is not positive.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
    num_q_heads, num_kv_heads, head_dim = check_attention_inputs(
        query, kv_cache, query_start_loc, seq_lens, block_tables
    )
    if out is None:
        out = torch.empty_like(query)
    check_tensor("out", out, ndim=3, device=query.device)
    if out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    num_tokens, num_reqs = query.shape[0], seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out

    qpk = num_q_heads // num_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(qpk))
    if max_query_len > 1:
        block_m = max(block_m, PREFILL_BLOCK_M)
    block_q = block_m // qpk
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_reqs,
        scale,
        sliding_window or 0,
        logits_soft_cap or 0.0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        QPK=qpk,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=TILE_N,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        WIDEN_FP16=kv_cache.dtype == torch.float8_e4m3fn and query.dtype != torch.float32,
        SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
    )
    return out
