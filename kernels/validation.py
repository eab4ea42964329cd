"""Argument checks shared by the kernel wrappers.

Triton kernels read raw pointers, so a wrong shape, dtype or device is not an error
there but silent garbage; every wrapper checks its inputs here first and raises an
error that says what to change.
"""

from __future__ import annotations

import torch


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    """Check rank, dtype, device and a unit stride on the last dimension.

    Raises:
        ValueError: `tensor` has the wrong rank or dtype, lives on another device than
            `device`, or its last dimension is strided (kernels load rows as vectors).
    """
    if tensor.dim() != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}"
        )
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(
            f"{name} is on {tensor.device} but the other inputs are on {device}; "
            "move all inputs to one device"
        )
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride {tensor.stride(-1)}); "
            "pass tensor.contiguous()"
        )


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# A KV cache may also be float8_e4m3fn (--kv-cache-dtype fp8): the kernels store K/V
# clamped to +-448 and read them back into the query's dtype (scale 1.0, as vLLM's
# default when a checkpoint carries no KV scales).
KV_CACHE_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0


def check_attention_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[int, int, int]:
    """Validate the shared attention inputs; returns (num_q_heads, num_kv_heads, head_dim).

    Raises:
        ValueError: a shape, dtype or device disagrees with the layout of metadata.py,
            or num_q_heads is not a multiple of num_kv_heads.
    """
    dev = query.device
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=KV_CACHE_DTYPES, device=dev)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=dev)
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match "
            f"[2, num_blocks, block_size, num_kv_heads, {head_dim}]"
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_tables.shape[0] != num_reqs:
        raise ValueError(
            f"query_start_loc must have num_reqs + 1 = {num_reqs + 1} entries and "
            f"block_tables {num_reqs} rows; got {query_start_loc.shape[0]} and "
            f"{block_tables.shape[0]}"
        )
    return num_q_heads, num_kv_heads, head_dim
