"""FP8 (E4M3) linear layers on CUDA: a fused per-token quantizer for the W8A8 GEMM and a
weight-only W8A16 GEMM for small batches.

- `per_token_quant_fp8`: one program per row computes max|x|, the row's scale
  max|x| / 448 and the E4M3 row in one launch (in torch it is five or six launches,
  which at 4 GEMMs x 32 layers cost more than the FP8 GEMMs save). Its output feeds
  `torch._scaled_mm` (cuBLASLt on the FP8 tensor cores) with row-wise scales.
- `fp8_w8a16_gemm`: y = x (W_e4m3 * w_scale)^T for few rows. A decode step of a small
  batch reads every weight once for a handful of rows: the GEMM is memory-bound, and
  reading E4M3 weights (half of bf16's bytes) is what it gains. The weight tile is
  widened to x's dtype in registers and multiplied with `tl.dot` (fp32 accumulate);
  activations are not quantized, so this path is also the more accurate one (the
  W8A16 scheme of vLLM's Marlin FP8 kernels). Programs split N in BLOCK_N columns and
  K into SPLIT_K slices whose fp32 partial sums a second launch adds in a fixed order
  (deterministic), so that even one row fills the GPU's multiprocessors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import FLOAT_DTYPES, FP8_E4M3_MAX, check_tensor

QUANT_BLOCK = 1024  # columns per pass of the quantizer (two passes: max, then quantize)
MIN_SCALE = 1e-12  # an all-zero row gets this scale (its quantized row is all zeros)


@triton.jit
def _per_token_quant_kernel(
    x_ptr, xq_ptr, scale_ptr,
    x_stride: tl.int64, xq_stride: tl.int64,
    K: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_stride + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, EPS)
    tl.store(scale_ptr + row, scale)
    inv = 1.0 / scale
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_stride + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX)
        tl.store(xq_ptr + row * xq_stride + cols, q.to(xq_ptr.dtype.element_ty), mask=cols < K)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of x to E4M3 with its own scale.

    Args:
        x: [M, K] float32/float16/bfloat16 on CUDA, contiguous columns.

    Returns:
        (xq [M, K] float8_e4m3fn, scale [M, 1] float32), x ~= xq * scale, scale =
        max(max|row| / 448, 1e-12); x * (1 / scale) is rounded to nearest (the torch
        reference divides; the two can differ by one E4M3 step where a value sits on a
        rounding boundary).

    Raises:
        ValueError: x is not 2-D float with contiguous columns.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return xq, scale
    block = min(QUANT_BLOCK, triton.next_power_of_2(k))
    _per_token_quant_kernel[(m,)](
        x, xq, scale, x.stride(0), xq.stride(0), K=k, BLOCK=block, FP8_MAX=FP8_E4M3_MAX,
        EPS=MIN_SCALE, num_warps=4,
    )
    return xq, scale


@triton.jit
def _w8a16_gemm_kernel(
    x_ptr, weight_ptr, weight_scale_ptr, bias_ptr, out_ptr,
    M, x_stride: tl.int64, out_stride_split: tl.int64, out_stride: tl.int64,
    N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # out is [SPLIT_K, M, N] float32 partial sums when K is split (summed by
    # _split_k_reduce_kernel), else the [M, N] output itself in x's dtype.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        k = k0 + offs_k
        k_valid = k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + k[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)  # [BM, BK]
        w = tl.load(weight_ptr + offs_n[None, :].to(tl.int64) * K + k[:, None],
                    mask=n_valid[None, :] & k_valid[:, None], other=0.0)  # [BK, BN] E4M3
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    w_scale = tl.load(weight_scale_ptr + offs_n, mask=n_valid, other=0.0)
    acc = acc * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out = (out_ptr + pid_k.to(tl.int64) * out_stride_split
           + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr, bias_ptr, out_ptr, stride_split: tl.int64, out_stride: tl.int64,
    N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # A fixed summation order (split 0, 1, ...): the result does not depend on timing.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(partial_ptr + s * stride_split + row * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Weight-only path for M up to this many rows; more rows use the W8A8 GEMM.
W8A16_MAX_M = 64
_BLOCK_N, _BLOCK_K = 64, 128
_REDUCE_BLOCK = 1024


def _split_k(n: int, k: int, device: torch.device) -> int:
    """K slices so that N / BLOCK_N x SPLIT_K programs reach ~4 per multiprocessor."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 8)
    tiles = triton.cdiv(n, _BLOCK_N)
    split = 1
    while tiles * split < 4 * sms and k // (split * 2) >= 4 * _BLOCK_K:
        split *= 2
    return split


def fp8_w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, *, split_k: int | None = None
                   ) -> torch.Tensor:
    """y = x (weight * weight_scale[:, None])^T (+ bias), weights widened in registers.

    Args:
        x: [M, K] float16/bfloat16 (or float32), M <= W8A16_MAX_M, contiguous columns.
        weight: [N, K] float8_e4m3fn, contiguous.
        weight_scale: [N] float32, one scale per output channel.
        bias: [N] in x's dtype, or None.
        split_k: K slices (default: enough programs for ~4 per multiprocessor); the
            slices' float32 partial sums are added in a fixed order, so results are
            deterministic.

    Returns:
        [M, N] in x's dtype: fp32 accumulation, one rounding at the end.

    Raises:
        ValueError: shapes, dtypes or devices disagree, or M > W8A16_MAX_M.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float8_e4m3fn,), device=x.device)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, {k}] tensor, got {tuple(weight.shape)}")
    if weight_scale.shape != (n,) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be [{n}] float32, got {tuple(weight_scale.shape)} "
                         f"{weight_scale.dtype}")
    if m > W8A16_MAX_M:
        raise ValueError(f"fp8_w8a16_gemm takes at most {W8A16_MAX_M} rows, got {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    split = _split_k(n, k, x.device) if split_k is None else split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), _BLOCK_K) * _BLOCK_K
    split = triton.cdiv(k, k_per_split)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32,
                                                device=x.device)
    has_bias = bias is not None and split == 1
    _w8a16_gemm_kernel[(triton.cdiv(n, _BLOCK_N), split)](
        x, weight, weight_scale, bias if has_bias else weight_scale, target,
        m, x.stride(0), target.stride(0) if split > 1 else 0, target.stride(-2),
        N=n, K=k, K_PER_SPLIT=k_per_split,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        HAS_BIAS=has_bias, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=4,
    )
    if split > 1:
        _split_k_reduce_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK))](
            target, bias if bias is not None else target, out, target.stride(0),
            out.stride(0), N=n, SPLIT_K=split, BLOCK=_REDUCE_BLOCK,
            HAS_BIAS=bias is not None,
        )
    return out
