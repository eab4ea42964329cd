"""Split-KV (flash-decoding) paged attention for decode-only and verification batches.

With one new token per request, the unified kernel has only num_reqs x num_kv_heads
programs, each walking the whole context: at small batch most SMs idle, and each
program is latency-bound on a long chain of dependent loads. Here the context is cut
into `num_kv_splits` ranges (Dao et al., "Flash-Decoding for long-context inference",
2023; the layout of vLLM's `triton_decode_attention.py`, our code):

* stage 1, grid (num_reqs, num_kv_heads, num_kv_splits): one program attends the
  QPK query heads of one KV head (packed into a >= 16-row tile for `tl.dot`) to one
  range, and writes the range's normalised partial output and its log-sum-exp; with
  a single range it writes the final output itself and stage 2 is not launched;
* stage 2, grid (num_reqs, num_q_heads): merges the ranges, weighting each partial
  output by exp(lse_s - max lse).

The split count comes from batch x KV heads x context (`choose_num_kv_splits`): enough
programs for PROGRAMS_PER_SM per SM, no range shorter than MIN_TOKENS_PER_SPLIT.
Ranges are sized in-kernel from each request's seq_len, so one launch shape (and one
CUDA graph) serves any context lengths; ranges past the context are empty and carry
lse = -inf.

Verification steps of speculative decoding (issue 16) give every request a few new
tokens (its last token and k drafts, q <= MAX_QUERY_LEN): `max_query_len` = q > 1
packs the q tokens x QPK heads of one KV head into the stage-1 tile, row r = (token
r // QPK, head r % QPK), each row with its own causal limit (token t of a request
with q_len new tokens sits at position seq_len - q_len + t and sees positions <= its
own; with a sliding window also > its own - sliding_window). So each K/V tile is read
once for all q tokens, and the split-KV grid keeps the GPU busy at batch 1, where the
unified kernel (paged_attention.py) has only num_kv_heads programs walking the whole
context. Stage 2 then merges per (request, token, head).

An E4M3 (fp8) cache is widened to float16, not to the query's bfloat16: Hopper
converts a pair of E4M3 values to a pair of fp16 in one instruction
(`cvt.rn.f16x2.e4m3x2`), while E4M3 -> bf16 has no such instruction and costs two
conversions per element through fp32, enough to make the fp8 cache slower than a bf16
one. Every E4M3 value is exact in fp16, the query is rounded to fp16 once (bf16's 8
mantissa bits fit in fp16's 11; magnitudes are clamped to fp16's 65504), and products
accumulate in fp32 either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .validation import check_attention_inputs, check_tensor

MAX_KV_SPLITS = 64
# Longest per-request query that the packed verification path takes (max_query_len),
# and the most rows (max_query_len x QPK) of its packed tile: 64 x 128 fp32
# accumulators still fit in registers with 4 warps.
MAX_QUERY_LEN = 8
MAX_PACKED_ROWS = 64
# A range shorter than this spends more on the merge than it saves.
MIN_TOKENS_PER_SPLIT = 64
# Programs per SM the split count aims for: several resident programs per SM keep
# enough loads in flight to hide HBM latency (one per SM leaves it latency-bound).
PROGRAMS_PER_SM = 4


_FP8_QK_DEFAULT = os.environ.get("FLOWENGINE_DECODE_FP8_QK", "0") == "1"


@dataclass(frozen=True)
class DecodeLaunchConfig:
    """Tile shape and launch parameters of stage 1.

    Attributes:
        tile_n: K/V positions per loop step (power of 2, >= 16).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K/V loads (1: none).
        fp8_qk: with an E4M3 cache and a 16-bit query, Q.K on the FP8 tensor cores:
            the query is quantized to E4M3 once per program with one scale per query
            head (amax / 448), K is used as stored (no widening), and only V is widened
            to fp16 for P.V (FlashAttention-3's FP8 recipe, minus its V transpose).
            Costs the query's rounding to 3 mantissa bits (rel. error <= 2**-4 per
            element); off by default until measured faster (docs/benchmarks.md).
    """

    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    fp8_qk: bool = False


def default_launch_config(head_dim: int, kv_dtype: torch.dtype) -> DecodeLaunchConfig:
    """The stage-1 launch the wrapper uses when none is given, measured on an H200 at
    Llama-3.1-8B shapes (`benchmarks/decode_attention_bench.py`, docs/benchmarks.md's
    issue-14 section): for a bf16 cache 32-position tiles on 4 warps (64 for head_dim
    <= 64); for an E4M3 cache 16-position tiles on 2 warps, 13% faster there than the
    bf16 choice at batch 256 (more, smaller programs hide the widening better)."""
    if kv_dtype == torch.float8_e4m3fn:
        # FLOWENGINE_DECODE_FP8_QK=1: Q.K in E4M3 (DecodeLaunchConfig.fp8_qk), read once
        # at the first launch; an experiment switch until the H200 says which wins.
        return DecodeLaunchConfig(tile_n=16, num_warps=2, num_stages=2, fp8_qk=_FP8_QK_DEFAULT)
    return DecodeLaunchConfig(tile_n=64 if head_dim <= 64 else 32, num_warps=4, num_stages=2)


@triton.jit
def _decode_attention_stage1_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim], written when NUM_KV_SPLITS == 1
    partial_out_ptr,  # [num_reqs, MAX_Q, num_q_heads, NUM_KV_SPLITS, head_dim] fp32
    partial_lse_ptr,  # [num_reqs, MAX_Q, num_q_heads, NUM_KV_SPLITS] fp32, base-2 lse
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    scale,  # float32
    sliding_window,  # int32, positions the new token sees (itself included); if SLIDING
    soft_cap,  # float32, scores -> soft_cap * tanh(scores / soft_cap); if SOFT_CAP
    query_stride_token: tl.int64,
    query_stride_head: tl.int64,
    out_stride_token: tl.int64,
    out_stride_head: tl.int64,
    cache_stride_block: tl.int64,
    cache_stride_offset: tl.int64,
    cache_stride_head: tl.int64,
    block_table_stride: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    QPK: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,  # power of 2
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_H: tl.constexpr,  # rows of the packed query tile, >= MAX_Q * QPK, >= 16
    MAX_Q: tl.constexpr,  # most new tokens per request (1: decode; k + 1: verification)
    TILE_N: tl.constexpr,  # K/V positions per loop step
    NUM_KV_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs
    WIDEN_FP16: tl.constexpr,  # E4M3 cache, 16-bit query: compute in fp16 (module doc)
    SLIDING: tl.constexpr,  # attend to the last sliding_window positions only
    SOFT_CAP: tl.constexpr,  # attention logit soft-capping (Gemma 2)
    FP8_QK: tl.constexpr,  # E4M3 cache, 16-bit query: Q.K in E4M3 (DecodeLaunchConfig.fp8_qk)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    token = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - token
    if q_len == 0:  # an empty (padding) request owns no token row
        return
    seq_len = tl.load(seq_lens_ptr + req)
    # The last new token (position seq_len - 1) sees [.., seq_len); the first of q_len
    # with a sliding window from seq_len - q_len - sliding_window + 1 on: the splits
    # divide the union of what the request's rows see.
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(seq_len - (q_len - 1) - sliding_window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_KV_SPLITS), TILE_N) * TILE_N
    split_start = kv_start + split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_n = tl.arange(0, TILE_N)
    # Row r of the tile: new token r // QPK of the request, query head r % QPK of this
    # KV head (MAX_Q == 1: token 0, head r).
    row_t = offs_h // QPK
    head = kv_head * QPK + offs_h % QPK
    h_valid = (offs_h < MAX_Q * QPK) & (row_t < q_len)
    d_valid = offs_d < HEAD_DIM
    row_token = token + row_t  # the row's token in the flattened batch
    q = tl.load(
        query_ptr
        + row_token.to(tl.int64)[:, None] * query_stride_token
        + head[:, None] * query_stride_head
        + offs_d[None, :],
        mask=h_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if MAX_Q > 1:
        # Per-row causal limit: the row's token sits at position seq_len - q_len + t.
        row_pos = seq_len - q_len + row_t
        row_lo = tl.zeros([BLOCK_H], dtype=tl.int32)
        if SLIDING:
            row_lo = tl.maximum(row_pos - sliding_window + 1, 0)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in base 2
    if FP8_QK:
        # One E4M3 scale per query head: q = q8 * q_scale, |q8| <= 448.
        qf = q.to(tl.float32)
        q_scale = tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-30) / 448.0
        q8 = (qf / q_scale[:, None]).to(tl.float8e4nv)
        q_dot_scale = q_scale * qk_scale  # [BLOCK_H]: folds back into the scores
        q_soft_scale = q_scale * scale
    if WIDEN_FP16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table_row = block_tables_ptr + req.to(tl.int64) * block_table_stride
    kv_head_off = kv_head.to(tl.int64) * cache_stride_head
    for tile_start in range(split_start, split_end, TILE_N):
        kv_pos = tile_start + offs_n
        kv_valid = kv_pos < split_end
        # NOTE: int64 before the multiply (block_id * stride passes 2**31 in big pools).
        block_id = tl.load(
            block_table_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0
        ).to(tl.int64)
        kv_offs = (
            block_id * cache_stride_block
            + (kv_pos % BLOCK_SIZE).to(tl.int64) * cache_stride_offset
            + kv_head_off
        )
        k = tl.load(  # [HEAD_DIM_PADDED, TILE_N]
            key_cache_ptr + kv_offs[None, :] + offs_d[:, None],
            mask=d_valid[:, None] & kv_valid[None, :],
            other=0.0,
        )
        if not FP8_QK:
            k = k.to(q.dtype)  # an fp8 cache is widened here (to fp16 when WIDEN_FP16)
        v = tl.load(  # [TILE_N, HEAD_DIM_PADDED]
            value_cache_ptr + kv_offs[:, None] + offs_d[None, :],
            mask=kv_valid[:, None] & d_valid[None, :],
            other=0.0,
        ).to(q.dtype)
        if FP8_QK:
            s = tl.dot(q8, k)  # E4M3 x E4M3 -> fp32
            if SOFT_CAP:
                s = s * q_soft_scale[:, None]
                s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0) * 1.4426950408889634
            else:
                s = s * q_dot_scale[:, None]
        elif SOFT_CAP:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
            # tanh(x) = 2 * sigmoid(2x) - 1 (no tanh in every Triton version)
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0) * 1.4426950408889634
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, TILE_N]
        if MAX_Q > 1:
            seen = (kv_pos[None, :] <= row_pos[:, None]) & (kv_pos[None, :] >= row_lo[:, None])
            s = tl.where(h_valid[:, None] & kv_valid[None, :] & seen, s, float("-inf"))
        else:
            s = tl.where(h_valid[:, None] & kv_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows: no NaN
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty range leaves l_i = 0: lse = -inf and a zero output, ignored by stage 2.
    has_mass = l_i > 0.0
    acc = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    if NUM_KV_SPLITS == 1:  # the whole context: this is the output, no merge needed
        tl.store(
            out_ptr
            + row_token.to(tl.int64)[:, None] * out_stride_token
            + head[:, None].to(tl.int64) * out_stride_head
            + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=h_valid[:, None] & d_valid[None, :],
        )
    else:
        lse = tl.where(has_mass, m_i + tl.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        # Partial rows [num_reqs, MAX_Q, num_q_heads, NUM_KV_SPLITS].
        row = ((req * MAX_Q + row_t) * NUM_Q_HEADS + head).to(tl.int64) * NUM_KV_SPLITS + split
        tl.store(partial_lse_ptr + row, lse, mask=h_valid)
        tl.store(
            partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=h_valid[:, None] & d_valid[None, :],
        )


@triton.jit
def _decode_attention_stage2_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    partial_out_ptr,  # [num_reqs, MAX_Q, num_q_heads, NUM_KV_SPLITS, head_dim] fp32
    partial_lse_ptr,  # [num_reqs, MAX_Q, num_q_heads, NUM_KV_SPLITS] fp32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    out_stride_token: tl.int64,
    out_stride_head: tl.int64,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,  # power of 2
    MAX_Q: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    t = tl.program_id(2)  # the request's t-th new token
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - token <= t:
        return
    token += t
    offs_s = tl.arange(0, NUM_KV_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    d_valid = offs_d < HEAD_DIM
    row = ((req * MAX_Q + t) * NUM_Q_HEADS + head).to(tl.int64) * NUM_KV_SPLITS + offs_s
    lse = tl.load(partial_lse_ptr + row)  # [NUM_KV_SPLITS]
    partial = tl.load(  # [NUM_KV_SPLITS, HEAD_DIM_PADDED]
        partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=d_valid[None, :],
        other=0.0,
    )
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # empty context: output 0
    weight = tl.exp2(lse - lse_max)
    total = tl.sum(weight, axis=0)
    merged = tl.sum(weight[:, None] * partial, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token.to(tl.int64) * out_stride_token + head * out_stride_head + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (cached: eager steps ask once per layer), 8 elsewhere."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def choose_num_kv_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Power-of-two split count from batch x KV heads x context.

    One range when num_reqs x num_kv_heads alone gives 2 programs per SM of a CUDA
    `device` (132 SMs on an H100/H200; 8 assumed elsewhere, i.e. the CPU
    interpreter): measured, a merge never paid off there (batch 64 x 8 KV heads: 82 µs
    unsplit, 88-94 µs split). Else enough ranges for PROGRAMS_PER_SM programs per SM,
    none shorter than MIN_TOKENS_PER_SPLIT tokens, at most MAX_KV_SPLITS; rounded down
    to a power of 2 (a count past both limits would only add merge work).
    """
    num_sms = _num_sms(device)
    if num_reqs * num_kv_heads >= 2 * num_sms:
        return 1
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(1, num_reqs * num_kv_heads))
    by_len = triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(want, by_len, MAX_KV_SPLITS))
    return 1 << (splits.bit_length() - 1)


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    max_seq_len: int,
    scale: float,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    launch_config: DecodeLaunchConfig | None = None,
    max_query_len: int = 1,
) -> torch.Tensor:
    """Attention of each request's new token(s) over its paged context, split-KV.

    Args:
        query: [num_tokens, num_q_heads, head_dim] float32/float16/bfloat16.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], `query`'s dtype
            or float8_e4m3fn (widened as it is read: to float16 for a 16-bit query, see
            the module docstring), holding the new tokens' K/V already.
        query_start_loc: [num_reqs + 1] int32; every request has 1..max_query_len new
            tokens (or none: an empty padding request, skipped), the last positions of
            its context, causal among themselves. Longer chunks are not checked on the
            device (that would sync): their extra rows are left unwritten; use
            paged_attention for them.
        seq_lens: [num_reqs] int32, context length including the new token, >= 1.
        block_tables: [num_reqs, max_blocks_per_req] int32.
        max_seq_len: largest seq_lens value (host int), sizes the default split count.
        scale: softmax scale, usually head_dim ** -0.5.
        num_kv_splits: ranges per context, a power of 2 <= MAX_KV_SPLITS; None picks
            choose_num_kv_splits(). Fix it when capturing a CUDA graph. 1 runs one
            launch that writes the output directly.
        out: optional [num_tokens, num_q_heads, head_dim] output.
        sliding_window: the new token sees only the last sliding_window positions
            (itself included), which the splits divide; None: the whole context.
        logits_soft_cap: scores become cap * tanh(scores / cap) (Gemma 2); None: off.
        launch_config: stage-1 tile and launch parameters (benchmarks sweep them);
            None: default_launch_config().
        max_query_len: most new tokens of any request (host int, fixed per CUDA graph):
            1 for decode; k + 1 for speculative verification, packing the tokens x QPK
            heads of a KV head into one tile (module docstring); at most MAX_QUERY_LEN,
            and max_query_len x QPK at most MAX_PACKED_ROWS.

    Returns:
        [num_tokens, num_q_heads, head_dim] in query's dtype (`out` when given).

    Raises:
        ValueError: inputs disagree, num_kv_splits is not a power of 2 in
            [1, MAX_KV_SPLITS], a sliding window / soft cap that is not positive, a
            launch_config whose tile_n is not a power of 2 >= 16, or a max_query_len
            outside the limits above.
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
    num_reqs = seq_lens.shape[0]
    qpk = num_q_heads // num_kv_heads
    if not 1 <= max_query_len <= MAX_QUERY_LEN or max_query_len * qpk > MAX_PACKED_ROWS:
        raise ValueError(
            f"max_query_len must be in [1, {MAX_QUERY_LEN}] with max_query_len x "
            f"{qpk} query heads per KV head <= {MAX_PACKED_ROWS}, got {max_query_len}"
        )
    if num_kv_splits is None:
        attended = (max_seq_len if sliding_window is None
                    else min(max_seq_len, sliding_window + max_query_len - 1))
        num_kv_splits = choose_num_kv_splits(
            num_reqs, num_kv_heads, attended, query.device
        )
    if not 1 <= num_kv_splits <= MAX_KV_SPLITS or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(
            f"num_kv_splits must be a power of 2 in [1, {MAX_KV_SPLITS}], got {num_kv_splits}"
        )
    cfg = launch_config or default_launch_config(head_dim, kv_cache.dtype)
    if cfg.tile_n < 16 or cfg.tile_n & (cfg.tile_n - 1):
        raise ValueError(f"launch_config.tile_n must be a power of 2 >= 16, got {cfg.tile_n}")
    if query.shape[0] == 0 or num_reqs == 0:
        return out

    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    if num_kv_splits == 1:  # stage 1 writes `out`; the partial buffers are not read
        partial_out = partial_lse = out
    else:
        partial_out = torch.empty(
            (num_reqs, max_query_len, num_q_heads, num_kv_splits, head_dim),
            dtype=torch.float32, device=query.device,
        )
        partial_lse = torch.empty(
            (num_reqs, max_query_len, num_q_heads, num_kv_splits), dtype=torch.float32,
            device=query.device,
        )
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    widen_fp16 = kv_cache.dtype == torch.float8_e4m3fn and query.dtype != torch.float32
    _decode_attention_stage1_kernel[(num_reqs, num_kv_heads, num_kv_splits)](
        out,
        partial_out,
        partial_lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
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
        NUM_Q_HEADS=num_q_heads,
        QPK=qpk,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=max(16, triton.next_power_of_2(max_query_len * qpk)),
        MAX_Q=max_query_len,
        TILE_N=cfg.tile_n,
        NUM_KV_SPLITS=num_kv_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        WIDEN_FP16=widen_fp16,
        FP8_QK=widen_fp16 and cfg.fp8_qk,
        SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_kv_splits == 1:
        return out
    _decode_attention_stage2_kernel[(num_reqs, num_q_heads, max_query_len)](
        out,
        partial_out,
        partial_lse,
        query_start_loc,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        NUM_KV_SPLITS=num_kv_splits,
        MAX_Q=max_query_len,
    )
    return out
