"""SiLU-and-mul, the gate of a SwiGLU MLP (Shazeer 2020, arXiv:2002.05202).

`out = silu(x[:, :I]) * x[:, I:]` with `silu(a) = a * sigmoid(a)`: Llama's
`down_proj(act(gate_proj(h)) * up_proj(h))` with gate and up fused into one matmul
whose output is [gate | up]. fp32 arithmetic, one rounding at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import FLOAT_DTYPES, check_tensor

# Columns per program: wide enough for full-width 128-bit loads on every warp.
BLOCK_COLS = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_tokens, intermediate_size]
    x_ptr,  # [num_tokens, 2 * intermediate_size]
    x_stride: tl.int64,
    out_stride: tl.int64,
    INTERMEDIATE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE_SIZE
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(
        x_ptr + row * x_stride + INTERMEDIATE_SIZE + cols, mask=mask, other=0.0
    ).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU gate.

    Args:
        x: [num_tokens, 2 * intermediate_size] float32/float16/bfloat16, [gate | up];
            any row stride, contiguous columns.
        out: optional [num_tokens, intermediate_size] output with contiguous columns.

    Returns:
        [num_tokens, intermediate_size] in x's dtype (`out` when given).

    Raises:
        ValueError: x is not 2-D with an even number of columns, or `out` mismatches.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x must have 2 * intermediate_size columns, got {width}")
    intermediate_size = width // 2
    if out is None:
        out = torch.empty((num_tokens, intermediate_size), dtype=x.dtype, device=x.device)
    check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    if tuple(out.shape) != (num_tokens, intermediate_size):
        raise ValueError(
            f"out shape {tuple(out.shape)} != [{num_tokens}, {intermediate_size}]"
        )
    if num_tokens == 0 or intermediate_size == 0:
        return out
    block = min(BLOCK_COLS, triton.next_power_of_2(intermediate_size))
    grid = (num_tokens, triton.cdiv(intermediate_size, block))
    _silu_and_mul_kernel[grid](
        out, x, x.stride(0), out.stride(0), INTERMEDIATE_SIZE=intermediate_size, BLOCK=block
    )
    return out
