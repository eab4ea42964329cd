"""Fused mixture-of-experts MLP: tokens grouped by expert, two grouped GEMMs.

The MegaBlocks / vLLM `fused_moe` scheme (Gale et al. 2023, "MegaBlocks: Efficient
Sparse Training with Mixture-of-Experts"): every (token, top-k slot) pair is sorted by
its expert and each expert's run is padded to a multiple of BLOCK_M
(`moe_align_block_size`), so that one program's BLOCK_M rows all belong to one expert.
Then

1. one grouped GEMM: rows x W13[e]^T -> [T * k, 2 * I] (gate | up);
2. SiLU-and-mul -> [T * k, I];
3. one grouped GEMM: rows W2[e]^T, times each pair's routing weight -> [T * k, hidden];
4. the k rows of each token summed -> [T, hidden].

The alignment runs in torch with a static upper bound on the padded length
(T * k + E * (BLOCK_M - 1)), so nothing syncs with the host and a decode step can be
captured in a CUDA graph; padding blocks and blocks past the end exit at once.

Decode (T * k * I <= 98304 expert columns, at most 128 pairs: `decode_pair_limit`): the
alignment's ~12 small launches and a grid over every expert's padded block cost more
than the weights they read, so `_fused_moe_decode` skips them: a gate/up GEMV per (pair,
I tile) that reads its expert id on the device, SiLU-and-mul fused in, then a down GEMV
per (token, hidden tile) that sums the token's k weighted pairs, all k in one
[k, BLOCK_N, BLOCK_K] load per step. Same rounding as the grouped path; two launches,
no host sync. `route_topk` is the router's softmax top-k in one
launch (torch takes five); `route_topk_gemv` adds the router GEMV to that launch at
decode sizes (the last program of a token, by an atomic counter, picks the top k).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul
from .validation import FLOAT_DTYPES, check_tensor

BLOCK_M = 16  # rows (token-slot pairs) per program; tl.dot needs >= 16


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the T * k (token, slot) pairs by expert, each group padded to block_m rows.

    topk_ids: [T, k] int32/int64 in [0, num_experts), or -1 for a pair this rank does
    not compute (its expert lives on another expert-parallel rank). Returns (sorted_ids
    [T * k + E * (block_m - 1), rounded up to block_m] int64: flat pair index t * k + j,
    grouped by expert in ascending order (pairs of one expert in index order), T * k
    marking padding; -1 pairs appear nowhere; block_experts [len(sorted_ids) // block_m]
    int64: the expert of each block_m-row block, -1 for blocks past the last group).
    No host sync.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    max_rows = num_pairs + num_experts * (block_m - 1)
    num_blocks = triton.cdiv(max_rows, block_m)
    # Pairs of no local expert (-1) go to an extra bucket E that gets no rows.
    key = torch.where(flat >= 0, flat, num_experts)
    # NOTE: not torch.bincount, which reads the largest id on the host (a sync that
    # breaks CUDA-graph capture).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    # Row of each bucket's first pair; bucket E's pairs land on a scratch row past the end.
    padded_start = torch.cat([padded_end - padded,
                              torch.full((1,), num_blocks * block_m, device=device,
                                         dtype=torch.int64)])
    group_start = counts.cumsum(0) - counts
    order = torch.argsort(key, stable=True)
    expert_of = key[order]
    rank = torch.arange(num_pairs, device=device) - group_start[expert_of]
    dest = torch.where(expert_of < num_experts, padded_start[expert_of] + rank,
                       num_blocks * block_m)
    sorted_ids = torch.full((num_blocks * block_m + 1,), num_pairs, dtype=torch.int64,
                            device=device)
    sorted_ids[dest] = order
    sorted_ids = sorted_ids[:num_blocks * block_m]
    block_row = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_row, right=True)
    block_experts = torch.where(block_row < padded_end[-1], block_experts, -1)
    return sorted_ids, block_experts


@triton.jit
def _grouped_gemm_kernel(
    out_ptr,  # [num_pairs, N]
    a_ptr,  # [num_tokens, K] (A_BY_TOKEN) or [num_pairs, K]
    w_ptr,  # [num_experts, N, K]
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int64, num_pairs = padding
    block_experts_ptr,  # [num_blocks] int64, -1 = no rows
    topk_weights_ptr,  # [num_pairs] float32 (read when MUL_WEIGHT)
    num_pairs,
    N,
    K,
    a_stride: tl.int64,
    w_stride_e: tl.int64,
    w_stride_n: tl.int64,
    out_stride: tl.int64,
    TOP_K: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,  # A rows are tokens (pair // TOP_K), else pairs
    MUL_WEIGHT: tl.constexpr,  # scale each output row by its routing weight
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    if A_BY_TOKEN:
        a_row = pair // TOP_K
    else:
        a_row = pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None].to(tl.int64) * a_stride + offs_k[None, :]
    w_ptrs = (w_ptr + expert.to(tl.int64) * w_stride_e
              + offs_n[None, :].to(tl.int64) * w_stride_n + offs_k[:, None])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_WEIGHT:
        weight = tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0)
        acc = acc * weight[:, None]
    tl.store(out_ptr + pair[:, None].to(tl.int64) * out_stride + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


# Decode path (`decode_pair_limit`): small batches skip the alignment and run as GEMVs.
# Each (token, slot) pair reads its expert's weights itself, so pairs that share an
# expert read them again; the grouped path reads each picked expert once but pays the
# alignment's ~12 small launches and a grid over every expert's padded block (~0.08 ms a
# layer on the H200, docs/benchmarks.md). What decides is the expert columns the pairs
# read, T * k * I (I: the expert width on this rank).
DECODE_MAX_PAIRS = 128
DECODE_MAX_PAIR_COLUMNS = 98304


def decode_pair_limit(intermediate: int) -> int:
    """The most T * k pairs `fused_moe` sends down the decode path by default:
    DECODE_MAX_PAIR_COLUMNS // I, at most DECODE_MAX_PAIRS, at least 1, I the local
    expert width. From the H200 crossover (one bf16 layer, CUDA-graph medians, ms;
    grouped: the aligned path with the tuned tiles; decode: this path at gate/up 8 x 256
    and down 8 x 128 / 4 x 256; benchmarks/moe_gpu.py --decode-compare, 2026-12-02
    14:55 UTC, docs/benchmarks.md):

        shape                        T  pairs  T*k*I    grouped  decode
        Qwen3-30B-A3B (I 768, k 8)   1    8     6,144   0.105    0.039 / 0.031
                                     4   32    24,576   0.148    0.088 / 0.084
                                     8   64    49,152   0.191    0.143 / 0.137
                                    16  128    98,304   0.263    0.251 / 0.246
        Mixtral-8x7B (I 14336, k 2)  1    2    28,672   0.238    0.226 / 0.191
                                     2    4    57,344   0.320    0.311 / 0.305
                                     4    8   114,688   0.553    0.579 / 0.573

    so Qwen3-30B-A3B takes the decode path up to 16 tokens (128 pairs: past them, not
    measured) and Mixtral up to 3 (not measured at 3; grouped is ahead at 4); under
    tensor parallelism I is the rank's slice, so the limit grows with it."""
    return max(1, min(DECODE_MAX_PAIRS, DECODE_MAX_PAIR_COLUMNS // intermediate))


def _tile(tile: int, n: int) -> int:
    """`tile`, but no wider than a tiny dimension n needs (its next power of two, and
    not below 16 on that account)."""
    return min(tile, max(16, triton.next_power_of_2(n)))


@triton.jit
def _decode_expert_id(topk_ids_ptr, expert_map_ptr, pair, HAS_MAP: tl.constexpr):
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    if HAS_MAP:
        expert = tl.load(expert_map_ptr + expert).to(tl.int64)
    return expert


@triton.jit
def _decode_gate_up_kernel(
    act_ptr,  # [num_pairs, INTER] x's dtype: silu(gate) * up
    x_ptr,  # [num_tokens, K]
    w_ptr,  # [num_experts, 2 * INTER, K]: gate rows then up rows
    topk_ids_ptr,  # [num_pairs] int32/int64
    expert_map_ptr,  # [E] int32/int64 (read when HAS_MAP)
    INTER,
    K,
    x_stride: tl.int64,
    w_stride_e: tl.int64,
    w_stride_n: tl.int64,
    act_stride: tl.int64,
    TOP_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    expert = _decode_expert_id(topk_ids_ptr, expert_map_ptr, pair, HAS_MAP)
    if expert < 0:  # another rank's expert: the down kernel skips this pair
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * x_stride + offs_k
    g_ptrs = (w_ptr + expert * w_stride_e + offs_n[:, None].to(tl.int64) * w_stride_n
              + offs_k[None, :])
    u_ptrs = g_ptrs + INTER * w_stride_n
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k + k0 < K
        xv = tl.load(x_ptrs, mask=k_valid, other=0.0).to(tl.float32)
        wmask = n_valid[:, None] & k_valid[None, :]
        g = tl.load(g_ptrs, mask=wmask, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=wmask, other=0.0).to(tl.float32)
        acc_g += tl.sum(g * xv[None, :], axis=1)
        acc_u += tl.sum(u * xv[None, :], axis=1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # Round gate and up to x's dtype first, as the unfused gate_up tensor would be.
    dtype = act_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + pair.to(tl.int64) * act_stride + offs_n, act.to(dtype), mask=n_valid)


@triton.jit
def _decode_down_pairs_kernel(
    out_ptr,  # [num_tokens, N] x's dtype
    act_ptr,  # [num_pairs, K]
    w_ptr,  # [num_experts, N, K]
    topk_ids_ptr,  # [num_pairs] int32/int64
    expert_map_ptr,  # [E] (read when HAS_MAP)
    topk_weights_ptr,  # [num_pairs] float32
    N,
    K,
    act_stride: tl.int64,
    w_stride_e: tl.int64,
    w_stride_n: tl.int64,
    out_stride: tl.int64,
    TOP_K: tl.constexpr,
    PAIRS: tl.constexpr,  # next power of two >= TOP_K
    HAS_MAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program: one token's BLOCK_N hidden columns, all TOP_K pairs in one
    # [PAIRS, BLOCK_N, BLOCK_K] load per step (a one-pair-at-a-time loop, deleted, kept a
    # TOP_K-th of those bytes in flight: 0.073 against 0.062 ms a Qwen3 layer at T = 1).
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_j = tl.arange(0, PAIRS)
    pair = token * TOP_K + offs_j
    expert = tl.load(topk_ids_ptr + pair, mask=offs_j < TOP_K, other=-1).to(tl.int64)
    if HAS_MAP:
        expert = tl.load(expert_map_ptr + tl.where(expert >= 0, expert, 0), mask=expert >= 0,
                         other=-1).to(tl.int64)
    live = expert >= 0  # padding slots and other ranks' experts add nothing
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pair[:, None].to(tl.int64) * act_stride + offs_k[None, :]
    w_ptrs = (w_ptr + tl.where(live, expert, 0)[:, None, None] * w_stride_e
              + offs_n[None, :, None].to(tl.int64) * w_stride_n + offs_k[None, None, :])
    acc = tl.zeros([PAIRS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=live[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=live[:, None, None] & n_valid[None, :, None]
                    & k_valid[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[:, None, :], axis=2)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    weight = tl.load(topk_weights_ptr + pair, mask=live, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # Each pair's weighted row rounded to x's dtype, as the grouped path stores it.
    rows = (acc * weight[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * out_stride + offs_n,
             tl.sum(rows, axis=0).to(dtype), mask=n_valid)


@dataclass(frozen=True)
class DecodeTiles:
    """Tiles and warps of the two decode launches: gate/up programs cover gate_up_n of
    the I columns of one pair, reading gate_up_k of hidden per step; down programs cover
    down_n hidden columns of one token, all its k pairs x down_k of I per step. The
    reduction tiles set the fp32 summation order. Defaults from the H200 sweep
    (benchmarks/moe_gpu.py --decode-compare, docs/benchmarks.md), one layer at T = 1,
    ms: session 26's tiles (gate/up 16 x 128, down 16 x 64) 0.057; gate/up 8 x 256 with
    down 8 x 128 0.039; with down 4 x 256 0.031 (Mixtral 0.226 -> 0.191), and no slower
    at T = 4 .. 16 either (T = 2: 0.058 against 0.056). Session 28 (2026-12-02 20:15
    UTC): gate/up 4 x 256 with down 4 x 256, Qwen3 T = 1 / 2 / 4 / 8 / 16: 0.0296 /
    0.0505 / 0.0788 / 0.1330 / 0.2323 against gate/up 8 x 256's 0.0342 / 0.0572 /
    0.0844 / 0.1383 / 0.2421; Mixtral T = 1 0.1940 against 0.1894, T = 2 / 3 faster."""

    gate_up_n: int = 4
    gate_up_k: int = 256
    gate_up_warps: int = 4
    down_n: int = 4
    down_k: int = 256
    down_warps: int = 8


DEFAULT_DECODE_TILES = DecodeTiles()


def _fused_moe_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_map: torch.Tensor | None,
                      tiles: DecodeTiles = DEFAULT_DECODE_TILES) -> torch.Tensor:
    """The alignment-free decode path of `fused_moe` (same arguments, checked there):
    gate/up GEMVs with SiLU-and-mul per (pair, I tile), then down GEMVs per (token,
    hidden tile) summing the token's k pairs. Two launches, no host sync."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    inter = w2.shape[2]
    ids = topk_ids.reshape(-1).contiguous()
    emap = expert_map.contiguous() if expert_map is not None else ids
    has_map = expert_map is not None
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    bn_i = _tile(tiles.gate_up_n, inter)
    _decode_gate_up_kernel[(num_pairs, triton.cdiv(inter, bn_i))](
        act, x, w13, ids, emap, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), TOP_K=top_k, HAS_MAP=has_map, BLOCK_N=bn_i,
        BLOCK_K=_tile(tiles.gate_up_k, hidden), num_warps=tiles.gate_up_warps,
    )
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    bn_h = _tile(tiles.down_n, hidden)
    _decode_down_pairs_kernel[(num_tokens, triton.cdiv(hidden, bn_h))](
        out, act, w2, ids, emap, topk_weights.reshape(-1).contiguous(), hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), TOP_K=top_k,
        PAIRS=max(2, triton.next_power_of_2(top_k)), HAS_MAP=has_map, BLOCK_N=bn_h,
        BLOCK_K=_tile(tiles.down_k, inter), num_warps=tiles.down_warps,
    )
    return out


@triton.jit
def _softmax_topk_store(x, offs, valid, t, weights_ptr, ids_ptr, BLOCK: tl.constexpr,
                        TOP_K: tl.constexpr, PAIRS: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Softmax over one token's router logits x [BLOCK] (float32, -inf where not valid),
    the TOP_K largest probabilities (ties to the lower expert id), renormalised by their
    sum when RENORMALIZE; stores row t of weights [T, TOP_K] and ids [T, TOP_K]."""
    p = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    probs = p / tl.sum(p, axis=0)
    work = tl.where(valid, probs, -1.0)
    slots = tl.arange(0, PAIRS)
    sel_w = tl.zeros([PAIRS], dtype=tl.float32)
    sel_i = tl.zeros([PAIRS], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(work, axis=0)
        idx = tl.min(tl.where(work == best, offs, BLOCK), axis=0)
        sel_w = tl.where(slots == j, best, sel_w)
        sel_i = tl.where(slots == j, idx.to(tl.int64), sel_i)
        work = tl.where(offs == idx, -2.0, work)
    if RENORMALIZE:
        sel_w = sel_w / tl.sum(sel_w, axis=0)
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, sel_w, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, sel_i, mask=keep)


@triton.jit
def _route_topk_kernel(
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int64
    logits_ptr,  # [T, E] any float dtype
    E,
    logits_stride: tl.int64,
    TOP_K: tl.constexpr,
    PAIRS: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_E: tl.constexpr,  # next power of two >= E
    RENORMALIZE: tl.constexpr,
):
    # One token: softmax over its E logits in float32, the TOP_K largest probabilities
    # in descending order (the lowest index first among equal ones), optionally divided
    # by their sum.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * logits_stride + offs, mask=valid,
                other=-float("inf")).to(tl.float32)
    _softmax_topk_store(x, offs, valid, t, weights_ptr, ids_ptr, BLOCK_E, TOP_K, PAIRS,
                        RENORMALIZE)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`flowengine.model.layers.moe.select_experts` in one launch (it takes five: the
    float32 cast, softmax, topk, sum, division): (topk_weights [T, top_k] float32,
    topk_ids [T, top_k] int64), experts in descending probability order, the lowest
    expert id first among equal probabilities."""
    if router_logits.ndim == 2 and router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        _route_topk_kernel[(num_tokens,)](
            weights, ids, router_logits, num_experts, router_logits.stride(0), TOP_K=top_k,
            PAIRS=max(2, triton.next_power_of_2(top_k)),
            BLOCK_E=max(16, triton.next_power_of_2(num_experts)), RENORMALIZE=renormalize,
            num_warps=1 if num_experts <= 128 else 4,
        )
    return weights, ids


# Router GEMV fused into the routing (`route_topk_gemv`): up to this many tokens (decode
# sizes; past them one cuBLAS GEMM for the logits is the better launch).
ROUTER_GEMV_MAX_TOKENS = 16  # FusedMoE.router_counter's length
ROUTER_BLOCK_E = 4  # experts (logit rows) per program


@triton.jit
def _router_gemv_topk_kernel(
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int64
    logits_ptr,  # [T, E] float32 scratch: x's-dtype-rounded logits
    counter_ptr,  # [>= T] int32, zero between launches (the last program re-zeroes it)
    x_ptr,  # [T, K]
    w_ptr,  # [E, K] router weight, x's dtype
    E,
    K,
    x_stride: tl.int64,
    w_stride: tl.int64,
    TOP_K: tl.constexpr,
    PAIRS: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_E: tl.constexpr,  # logit rows per program
    BLOCK_K: tl.constexpr,
    E_PADDED: tl.constexpr,  # next power of two >= E
    RENORMALIZE: tl.constexpr,
):
    # Programs (t, j) compute logits j * BLOCK_E .. of token t, rounded to x's dtype as
    # the unfused nn.Linear stores them; the last of token t's programs to finish (an
    # acq_rel counter, the "last block reduces" pattern) runs the softmax top-k of
    # `_route_topk_kernel` over the E logits and re-zeroes the counter.
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_valid = offs_e < E
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k + k0 < K
        xv = tl.load(x_ptr + t * x_stride + k0 + offs_k, mask=k_valid, other=0.0)
        w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * w_stride + k0 + offs_k[None, :],
                    mask=e_valid[:, None] & k_valid[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    logit = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + t * E + offs_e, logit, mask=e_valid)
    tl.debug_barrier()  # every thread's stores precede the release below
    done = tl.atomic_add(counter_ptr + t, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if done == tl.num_programs(1) - 1:
        tl.store(counter_ptr + t, 0)
        offs = tl.arange(0, E_PADDED)
        valid = offs < E
        # .cg: read through L2, where the other programs' stores are.
        x = tl.load(logits_ptr + t * E + offs, mask=valid, other=-float("inf"),
                    cache_modifier=".cg")
        _softmax_topk_store(x.to(tl.float32), offs, valid, t, weights_ptr, ids_ptr, E_PADDED,
                            TOP_K, PAIRS, RENORMALIZE)


def route_topk_gemv(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
                    renormalize: bool, counter: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk(x @ router_weight.T, ...)` in one launch: the router GEMV (logits
    rounded to x's dtype, as nn.Linear leaves them) and the softmax top-k, for decode
    sizes (T <= ROUTER_GEMV_MAX_TOKENS; the caller picks).

    Args:
        x: [T, hidden] float32/float16/bfloat16, contiguous rows.
        router_weight: [E, hidden], x's dtype.
        counter: [>= T] int32 on x's device, all zero (a persistent buffer: the kernel
            leaves it zero again, so a CUDA graph can replay it).

    Returns:
        (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64), as `route_topk`.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("router_weight", router_weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_tensor("counter", counter, ndim=1, dtypes=(torch.int32,), device=x.device)
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    if router_weight.shape[1] != hidden or x.stride(1) != 1 or router_weight.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and router_weight {tuple(router_weight.shape)} "
                         "must share hidden with contiguous rows")
    if counter.shape[0] < num_tokens:
        raise ValueError(f"counter has {counter.shape[0]} entries for {num_tokens} tokens")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    if num_tokens:
        logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
        block_e = min(ROUTER_BLOCK_E, triton.next_power_of_2(num_experts))
        _router_gemv_topk_kernel[(num_tokens, triton.cdiv(num_experts, block_e))](
            weights, ids, logits, counter, x, router_weight, num_experts, hidden,
            x.stride(0), router_weight.stride(0), TOP_K=top_k,
            PAIRS=max(2, triton.next_power_of_2(top_k)), BLOCK_E=block_e,
            BLOCK_K=min(2048, max(16, triton.next_power_of_2(hidden))),
            E_PADDED=max(16, triton.next_power_of_2(num_experts)),
            RENORMALIZE=renormalize, num_warps=4,
        )
    return weights, ids


# Tile configuration of one launch: vLLM's fused-MoE config keys.
MoeConfig = dict[str, int]

CONFIG_DIR = Path(__file__).parent / "configs"


def default_config(num_tokens: int, n: int, k: int) -> MoeConfig:
    """The tiles used when no tuned file covers the shape: 16 rows per block (a decode
    batch rarely gives an expert more), 64 x 64 weight tiles, Triton's default warps and
    stages. `n`, `k` clamp the tiles for tiny test shapes."""
    del num_tokens
    return {"BLOCK_SIZE_M": BLOCK_M,
            "BLOCK_SIZE_N": 64 if n >= 64 else max(16, triton.next_power_of_2(n)),
            "BLOCK_SIZE_K": 64 if k >= 64 else max(16, triton.next_power_of_2(k)),
            "num_warps": 4, "num_stages": 3}


def config_file_name(num_experts: int, intermediate: int, device_name: str,
                     dtype: str | None = None) -> str:
    """vLLM's fused-MoE config file name: `E=<experts>,N=<intermediate per rank>,
    device_name=<torch.cuda.get_device_name() with spaces as _>[,dtype=<dtype>].json`."""
    name = f"E={num_experts},N={intermediate},device_name={device_name.replace(' ', '_')}"
    return name + (f",dtype={dtype}" if dtype else "") + ".json"


@functools.lru_cache(maxsize=64)
def load_configs(num_experts: int, intermediate: int, device_name: str,
                 dtype: str | None = None) -> dict[int, MoeConfig] | None:
    """The tuned configs for a shape from kernels/configs/ (or $FLOWENGINE_MOE_CONFIG_DIR),
    {num_tokens: config}, or None when no file exists. A file that does not parse, or an
    entry without the tile keys, raises ValueError naming the file (a broken tuning run
    should not fall back silently)."""
    folder = Path(os.environ.get("FLOWENGINE_MOE_CONFIG_DIR") or CONFIG_DIR)
    path = folder / config_file_name(num_experts, intermediate, device_name, dtype)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        configs = {int(m): {key: int(cfg[key]) for key in _CONFIG_KEYS}
                   for m, cfg in raw.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"fused-MoE config {path} is not a {{num_tokens: {{"
                         f"{', '.join(_CONFIG_KEYS)}}}}} JSON object: {exc}") from exc
    for m, cfg in configs.items():
        for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
            if cfg[key] < 16 or cfg[key] & (cfg[key] - 1):
                raise ValueError(f"fused-MoE config {path}, num_tokens {m}: {key} must be a "
                                 f"power of two >= 16, got {cfg[key]}")
    return configs or None


_CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages")


def get_config(num_tokens: int, num_experts: int, n: int, k: int, intermediate: int,
               device: torch.device, dtype: str | None = None) -> MoeConfig:
    """The tuned config whose num_tokens key is nearest `num_tokens` (vLLM's rule), else
    `default_config`. Tiles wider than a tiny test shape are clamped to it."""
    configs = None
    if device.type == "cuda":
        configs = load_configs(num_experts, intermediate, torch.cuda.get_device_name(device),
                               dtype)
    if not configs:
        return default_config(num_tokens, n, k)
    cfg = dict(configs[min(configs, key=lambda m: abs(m - num_tokens))])
    return cfg


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor,
                  block_experts: torch.Tensor, num_pairs: int, top_k: int, a_by_token: bool,
                  topk_weights: torch.Tensor | None, config: MoeConfig,
                  zero_fill: bool) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    # Rows of pairs no local expert computes (expert parallelism) stay zero.
    alloc = torch.zeros if zero_fill else torch.empty
    out = alloc(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n = min(config["BLOCK_SIZE_N"], max(16, triton.next_power_of_2(n)))
    block_k = min(config["BLOCK_SIZE_K"], max(16, triton.next_power_of_2(k)))
    block_m = config["BLOCK_SIZE_M"]
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        out, a, w, sorted_ids, block_experts,
        topk_weights if topk_weights is not None else out,  # unused without MUL_WEIGHT
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, A_BY_TOKEN=a_by_token, MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_map: torch.Tensor | None = None, config: MoeConfig | None = None,
              decode: bool | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * W2[e] silu_and_mul(W13[e] x[t]), e = topk_ids[t, j].

    Args:
        x: [T, hidden] float32/float16/bfloat16.
        w13: [E_local, 2 * I, hidden], x's dtype (gate rows then up rows per expert).
        w2: [E_local, hidden, I], x's dtype.
        topk_weights: [T, k] float32 routing weights.
        topk_ids: [T, k] int32/int64 experts in [0, E) (not checked on the device).
        expert_map: expert parallelism: [E] int32, global expert id -> local index in
            [0, E_local) or -1 for an expert of another rank (whose pairs add nothing
            here); None: all E experts are local (E_local = E).
        config: tile sizes (BLOCK_SIZE_M/N/K, num_warps, num_stages); None: the tuned
            file in kernels/configs/ for (E_local, I, this GPU), nearest T, else
            `default_config` (`get_config`). Grouped path only.
        decode: True: the alignment-free decode path (a GEMV per (token, slot) pair,
            the k pairs of a token summed in one program); False: the aligned grouped
            GEMMs; None: decode when T * k <= `decode_pair_limit(I)` and no `config`
            is given.

    Returns:
        [T, hidden] in x's dtype; fp32 accumulation, intermediates rounded to x's dtype
        (as the unfused computation in that dtype).

    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("w13", w13, ndim=3, dtypes=(x.dtype,), device=x.device)
    check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,), device=x.device)
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,), device=x.device)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64),
                 device=x.device)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, ndim=1, dtypes=(torch.int32, torch.int64),
                     device=x.device)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    if (w13.shape[2] != hidden or two_i % 2 or w2.shape != (num_experts, hidden, two_i // 2)
            or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens):
        raise ValueError(
            f"fused_moe shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 "
            f"{tuple(w2.shape)}, topk_weights {tuple(topk_weights.shape)}, topk_ids "
            f"{tuple(topk_ids.shape)}; want w13 [E, 2I, hidden], w2 [E, hidden, I], "
            "[T, k] routing"
        )
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if not x.is_contiguous():
        x = x.contiguous()
    if decode is None:
        decode = config is None and num_pairs <= decode_pair_limit(two_i // 2)
    if decode:
        return _fused_moe_decode(x, w13, w2, topk_weights, topk_ids, expert_map)
    if config is None:
        config = get_config(num_tokens, num_experts, two_i, hidden, two_i // 2, x.device)
    if expert_map is not None:
        topk_ids = expert_map[topk_ids.long()]
    sorted_ids, block_experts = moe_align_block_size(topk_ids, num_experts,
                                                     config["BLOCK_SIZE_M"])
    gate_up = _grouped_gemm(x, w13, sorted_ids, block_experts, num_pairs, top_k, True, None,
                            config, zero_fill=False)
    act = silu_and_mul(gate_up)
    down = _grouped_gemm(act, w2, sorted_ids, block_experts, num_pairs, top_k, False,
                         topk_weights.reshape(-1).contiguous(), config,
                         zero_fill=expert_map is not None)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
