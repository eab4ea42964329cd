"""W4A16 GEMM on CUDA: y = x W^T with W in packed 4-bit GPTQ / AWQ groups, dequantized
in registers (never in memory).

Weights arrive in FlowEngine's canonical layout (flowengine/model/layers/int4.py):

    qweight  int32 [K / 8, N]   input row 8r + i of column n in bits 4i..4i+3 of [r, n]
    qzeros   uint8 [G, N]       zero point of group g, column n
    scales   fp16/bf16/fp32 [G, N]
    g_idx    int32 [K] or None  group of input row k (act-order); None: k // group_size

    W[n, k] = (q[k, n] - qzeros[g(k), n]) * scales[g(k), n]

A program owns a BLOCK_M x BLOCK_N output tile and one of SPLIT_K slices of K. Each
BLOCK_K step loads the [BLOCK_K / 8, BLOCK_N] words holding its nibbles (each word
read once), shifts out the 8 nibbles of each into [BLOCK_K, BLOCK_N], subtracts the
zeros and multiplies by the scales in float32, casts the tile to x's dtype and
multiplies with `tl.dot` (fp32 accumulate). Without g_idx and with
group_size a multiple of BLOCK_K, a tile lies in one group: one [BLOCK_N] row of scales
and zeros per step (GROUPED); otherwise (act-order) each k gathers its own group's row.
Split-K partial sums are added in a fixed order by fp8_linear's reduce kernel, so
results are deterministic. Decode (M = 1) pads M to 16 rows for `tl.dot`: the GEMM is
memory-bound on the packed weights, which is what 4 bits buys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_linear import _split_k_reduce_kernel
from .validation import FLOAT_DTYPES, check_tensor


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,        # [M, K] x dtype
    qweight_ptr,  # [K / 8, N] int32
    qzeros_ptr,   # [G, N] uint8
    scales_ptr,   # [G, N] float
    g_idx_ptr,    # [K] int32 (read only when HAS_G_IDX)
    bias_ptr,     # [N] (read only when HAS_BIAS)
    out_ptr,      # [SPLIT_K, M, N] float32 partials, or [M, N] x dtype when SPLIT_K == 1
    M, x_stride: tl.int64, out_stride_split: tl.int64, out_stride: tl.int64,
    N: tl.constexpr, K: tl.constexpr, GROUP_SIZE: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_G_IDX: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid_mn // num_n, pid_mn % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        k = k0 + offs_k
        k_valid = k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + k[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)  # [BM, BK]
        w_mask = k_valid[:, None] & n_valid[None, :]
        rows = k0 // 8 + offs_kw  # the words holding rows k0..k0+BK-1
        words = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                        mask=(rows < K // 8)[:, None] & n_valid[None, :], other=0)
        q = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK / 8, 8, BN]
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)  # row 8r + i = nibble i
        if GROUPED:  # the whole tile in group k0 // GROUP_SIZE
            g = k0 // GROUP_SIZE
            # NOTE: a split's last tiles may start past K (K_PER_SPLIT is rounded up):
            # their group does not exist, so its row must not be read.
            g_mask = n_valid & (k0 < K)
            z = tl.load(qzeros_ptr + g * N + offs_n, mask=g_mask, other=0).to(tl.float32)
            s = tl.load(scales_ptr + g * N + offs_n, mask=g_mask, other=0.0).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        else:
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + k, mask=k_valid, other=0)
            else:
                g = k // GROUP_SIZE
            grp = g[:, None].to(tl.int64) * N + offs_n[None, :]
            z = tl.load(qzeros_ptr + grp, mask=w_mask, other=0).to(tl.float32)
            s = tl.load(scales_ptr + grp, mask=w_mask, other=0.0).to(tl.float32)
            w = (q - z) * s
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out = (out_ptr + pid_k.to(tl.int64) * out_stride_split
           + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


_REDUCE_BLOCK = 1024


def _config(m: int, n: int, k: int, group_size: int, device: torch.device
            ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) for the shape: few rows (decode) take 16-row
    tiles and enough K slices for ~4 programs per multiprocessor; many rows (prefill)
    take 64 x 128 tiles and no split."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 8)
    block_k = 128 if group_size % 128 == 0 else (64 if group_size % 64 == 0 else 32)
    if m > 32:
        block_m = 64
        block_n = 128
    else:
        block_m = 16 if m <= 16 else 32
        block_n = 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 4 * sms and k // (split * 2) >= 2 * block_k:
        split *= 2
    return block_m, block_n, block_k, split


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               qzeros: torch.Tensor, g_idx: torch.Tensor | None, group_size: int,
               bias: torch.Tensor | None = None, *,
               config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with W dequantized from 4-bit groups in registers.

    Args:
        x: [M, K] float16/bfloat16 (or float32), contiguous columns.
        qweight: [K / 8, N] int32, contiguous (layout in the module docstring).
        scales: [G, N] float16/bfloat16/float32, G = ceil(K / group_size).
        qzeros: [G, N] uint8 zero points.
        g_idx: [K] int32 group of each input row (act-order), or None (k // group_size).
        group_size: input rows per group (a multiple of 8).
        bias: [N] or None.
        config: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) to override the heuristic
            (benchmarks); BLOCK_K a power of two >= 16.

    Returns:
        [M, N] in x's dtype: fp32 accumulation, one rounding at the end (the weight tile
        is rounded to x's dtype before the dot, as every W4A16 kernel does).

    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), device=x.device)
    m, k = x.shape
    n = qweight.shape[1]
    groups = triton.cdiv(k, group_size) if group_size > 0 else 0
    if group_size <= 0 or group_size % 8 or k % 8:
        raise ValueError(f"group_size ({group_size}) and K ({k}) must be multiples of 8")
    if qweight.shape[0] * 8 != k or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous [{k // 8}, N] int32 tensor, got "
                         f"{tuple(qweight.shape)}")
    check_tensor("scales", scales, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    check_tensor("qzeros", qzeros, ndim=2, dtypes=(torch.uint8,), device=x.device)
    for name, t in (("scales", scales), ("qzeros", qzeros)):
        if t.shape != (groups, n) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{groups}, {n}] tensor, got "
                             f"{tuple(t.shape)}")
    if g_idx is not None:
        check_tensor("g_idx", g_idx, ndim=1, dtypes=(torch.int32,), device=x.device)
        if g_idx.shape != (k,):
            raise ValueError(f"g_idx must be [{k}], got {tuple(g_idx.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, split = config or _config(m, n, k, group_size, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32,
                                                device=x.device)
    has_bias = bias is not None and split == 1
    grouped = g_idx is None and group_size % block_k == 0
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split)
    _w4a16_gemm_kernel[grid](
        x, qweight, qzeros, scales, g_idx if g_idx is not None else qweight,
        bias if has_bias else scales, target,
        m, x.stride(0), target.stride(0) if split > 1 else 0, target.stride(-2),
        N=n, K=k, GROUP_SIZE=group_size, K_PER_SPLIT=k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_G_IDX=g_idx is not None, GROUPED=grouped, HAS_BIAS=has_bias,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=4,
    )
    if split > 1:
        _split_k_reduce_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK))](
            target, bias if bias is not None else target, out, target.stride(0),
            out.stride(0), N=n, SPLIT_K=split, BLOCK=_REDUCE_BLOCK,
            HAS_BIAS=bias is not None,
        )
    return out


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    qzeros: torch.Tensor, g_idx: torch.Tensor | None, group_size: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: the float32 product with the dequantized [N, K] weights, [M, N]
    float32 (tests)."""
    k = x.shape[1]
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = ((qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(k, -1).float()
    g = (torch.arange(k, device=x.device) // group_size if g_idx is None else g_idx.long())
    w = (q - qzeros.float()[g]) * scales.float()[g]  # [K, N]
    out = x.float() @ w
    return out if bias is None else out + bias.float()
