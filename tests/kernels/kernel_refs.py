"""Plain-torch float64 references and random paged-attention cases for the kernel tests.

Imported by tests/kernels/test_kernel_*.py and tests/gpu/test_kernels_gpu.py (the
unusual module name keeps it from clashing with other test folders' helpers under
pytest's default `prepend` import mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class AttentionCase:
    """A random batch laid out as in flowengine/model/attention/metadata.py.

    Every cache slot that belongs to no request's context holds NaN, and unused
    block-table entries point at an all-NaN block, so a kernel that reads outside a
    context (and lets it reach the output) produces NaN.
    """

    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D], K of the new tokens
    value: torch.Tensor  # [T, Hkv, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_tables: torch.Tensor  # [R, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    q_lens: list[int]
    ctx_lens: list[int]
    scale: float


def make_attention_case(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    num_blocks: int | None = None,
    min_block_id: int = 1,
    num_padding_tokens: int = 0,
    fill_new_tokens: bool = True,
    poison_unused_blocks: bool = True,
    max_blocks_per_req: int | None = None,
) -> AttentionCase:
    """Build a random case; block ids are drawn at random from
    `[min_block_id, num_blocks - 1)` (the last block is the all-NaN one).

    `fill_new_tokens=False` leaves the new tokens' slots NaN, for tests that write them
    with reshape_and_cache first. `num_padding_tokens` appends tokens outside every
    request with slot -1. `poison_unused_blocks=False` leaves blocks no request uses
    uninitialised, so a pool far larger than RAM costs only the pages touched (Linux
    allocates anonymous memory lazily). `max_blocks_per_req` fixes the block-table
    width (CUDA-graph replays need one shape).
    """
    assert len(q_lens) == len(seq_lens) and all(0 < q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    if num_blocks is None:
        num_blocks = min_block_id + sum(blocks_per_req) + 3
    num_usable = num_blocks - 1 - min_block_id
    assert num_usable >= sum(blocks_per_req), "num_blocks too small for the case"
    nan_block = num_blocks - 1
    perm = torch.randperm(num_usable)[: sum(blocks_per_req)] + min_block_id

    max_blocks = max(blocks_per_req) + 1  # at least one unused entry per row
    if max_blocks_per_req is not None:
        assert max_blocks_per_req >= max(blocks_per_req), "max_blocks_per_req too small"
        max_blocks = max_blocks_per_req
    block_tables = torch.full((len(q_lens), max_blocks), nan_block, dtype=torch.int32)
    kv_cache = torch.empty(
        (2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )
    if poison_unused_blocks:
        kv_cache.fill_(float("nan"))
    else:
        kv_cache[:, torch.cat([perm, torch.tensor([nan_block])]).to(device)] = float("nan")
    num_tokens = sum(q_lens) + num_padding_tokens
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
    start = 0
    token = 0
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        ids = perm[start : start + blocks_per_req[r]]
        start += blocks_per_req[r]
        block_tables[r, : len(ids)] = ids.to(torch.int32)
        pos = torch.arange(seq_len)
        slots = ids[pos // block_size] * block_size + pos % block_size
        prefix = seq_len - q_len
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        ctx_slots = slots[:prefix].to(device)
        flat[:, ctx_slots] = torch.randn(
            2, prefix, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        slot_mapping[token : token + q_len] = slots[prefix:]
        if fill_new_tokens:
            new_slots = slots[prefix:].to(device)
            flat[0, new_slots] = key[token : token + q_len]
            flat[1, new_slots] = value[token : token + q_len]
        token += q_len
    query = torch.randn(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return AttentionCase(
        query=query,
        key=key,
        value=value,
        kv_cache=kv_cache,
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=slot_mapping.to(device),
        q_lens=list(q_lens),
        ctx_lens=list(seq_lens),
        scale=head_dim**-0.5,
    )


def ref_paged_attention(case: AttentionCase, sliding_window: int | None = None,
                        soft_cap: float | None = None) -> torch.Tensor:
    """float64 attention of each request's new tokens over its context gathered through
    the block table: [sum(q_lens), Hq, D]. Query j of request i sits at position
    seq_len - q_len + j and sees positions <= its own (and > its own - sliding_window
    when given); soft_cap: scores -> cap * tanh(scores / cap)."""
    num_q_heads = case.query.shape[1]
    block_size = case.kv_cache.shape[2]
    outs = []
    token = 0
    for r, (q_len, seq_len) in enumerate(zip(case.q_lens, case.ctx_lens, strict=True)):
        pos = torch.arange(seq_len, device=case.kv_cache.device)
        blocks = case.block_tables[r].long()[pos // block_size]
        k = case.kv_cache[0][blocks, pos % block_size].double()  # [S, Hkv, D]
        v = case.kv_cache[1][blocks, pos % block_size].double()
        qpk = num_q_heads // k.shape[1]
        k = k.repeat_interleave(qpk, dim=1)
        v = v.repeat_interleave(qpk, dim=1)
        q = case.query[token : token + q_len].double()  # [Q, Hq, D]
        scores = torch.einsum("qhd,shd->hqs", q, k) * case.scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=pos.device)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        if sliding_window is not None:
            scores.masked_fill_(pos[None, None, :] <= q_pos[None, :, None] - sliding_window,
                                float("-inf"))
        outs.append(torch.einsum("hqs,shd->qhd", scores.softmax(-1), v))
        token += q_len
    return torch.cat(outs)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight."""
    x64 = x.double()
    rms = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return x64 * rms * weight.double()


def ref_rotary(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """float64 HF rotate_half rotary: x * cos + rotate_half(x) * sin, on [T, H, D]."""
    c = torch.cat([cos, cos], -1)[positions.long()].double()[:, None, :]
    s = torch.cat([sin, sin], -1)[positions.long()].double()[:, None, :]
    x64 = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x64[..., half:], x64[..., :half]], -1)
    return x64 * c + rotated * s


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """float64 SwiGLU gate: silu(x[:, :I]) * x[:, I:]."""
    half = x.shape[-1] // 2
    x64 = x.double()
    return torch.nn.functional.silu(x64[:, :half]) * x64[:, half:]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float):
    """Fully written (no NaN left from the poisoned output) and close to the reference."""
    assert not torch.isnan(actual).any(), "output has NaN: a row was not written or read NaN"
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)
