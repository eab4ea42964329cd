"""RMSNorm and fused residual-add + RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467).

`y = x / sqrt(mean(x^2) + eps) * weight`, the mean in fp32. Rounding follows Hugging
Face's `LlamaRMSNorm`: the normalised row is cast to the input dtype before the weight
multiply, and the fused variant normalises the residual sum *after* rounding it to the
residual's dtype, exactly as an unfused `residual = x + residual; norm(residual)` does.
One program normalises one row held in registers (rows up to MAX_HIDDEN_SIZE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import FLOAT_DTYPES, check_tensor

# Largest row held in one program's registers (64K fp32 over 16 warps = 128 per thread).
MAX_HIDDEN_SIZE = 65536


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, hidden_size]
    residual_out_ptr,  # [num_rows, hidden_size], written when ADD_RESIDUAL
    x_ptr,  # [num_rows, hidden_size]
    residual_ptr,  # [num_rows, hidden_size], read when ADD_RESIDUAL
    weight_ptr,  # [hidden_size]
    eps,  # float32
    x_stride: tl.int64,
    residual_stride: tl.int64,
    out_stride: tl.int64,
    residual_out_stride: tl.int64,
    HIDDEN_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,  # power of 2 >= HIDDEN_SIZE
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN_SIZE
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        res = tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0)
        # Round the sum to the residual dtype first, as the unfused add would.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / HIDDEN_SIZE
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(name: str, t: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """[..., hidden] -> [num_rows, hidden] with unit last stride (copies only if needed)."""
    if t.dim() == 2 and t.stride(-1) == 1:
        return t
    if not t.is_contiguous():
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} must be 2-D with a contiguous last "
            "dimension or fully contiguous; pass .contiguous()"
        )
    return t.view(-1, hidden_size)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> torch.Tensor:
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    hidden_size = weight.shape[0]
    if x.dim() == 0 or x.shape[-1] != hidden_size:
        raise ValueError(f"x shape {tuple(x.shape)} must end in hidden_size {hidden_size}")
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden_size {hidden_size} exceeds MAX_HIDDEN_SIZE {MAX_HIDDEN_SIZE}")
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, hidden_size)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != x shape {tuple(x.shape)}")
    out2 = _as_rows("out", out, hidden_size)
    res2 = res_out2 = x2  # placeholders, never read or written without a residual
    if residual is not None:
        if residual.shape != x.shape or residual.device != x.device:
            raise ValueError(
                f"residual {tuple(residual.shape)} on {residual.device} must match x "
                f"{tuple(x.shape)} on {x.device}"
            )
        res2 = residual if residual.dim() == 2 and residual.stride(-1) == 1 else (
            residual.reshape(-1, hidden_size)
        )
        if residual_out is None or residual_out.shape != x.shape:
            raise ValueError(
                f"residual_out must be given with x's shape {tuple(x.shape)}"
            )
        res_out2 = _as_rows("residual_out", residual_out, hidden_size)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        out2,
        res_out2,
        x2,
        res2,
        weight,
        eps,
        x2.stride(0),
        res2.stride(0),
        out2.stride(0),
        res_out2.stride(0),
        HIDDEN_SIZE=hidden_size,
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 512)),
    )
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension.

    Args:
        x: [..., hidden_size] float32/float16/bfloat16 ([num_tokens, hidden_size] in the
            model; [num_tokens, num_heads, head_dim] for per-head q/k norms).
        weight: [hidden_size], any float dtype.
        eps: added to the mean square (the model's `rms_norm_eps`).
        out: optional output of x's shape; may be `x` itself (in place).

    Returns:
        [..., hidden_size] in x's dtype (`out` when given).

    Raises:
        ValueError: shapes or dtypes disagree, or hidden_size > MAX_HIDDEN_SIZE.
    """
    return _launch(x, None, weight, eps, out, None)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = x + residual; return rms_norm(residual), residual` in one pass.

    Args:
        x: [..., hidden_size] float32/float16/bfloat16, the sublayer output.
        residual: same shape, the residual stream.
        weight, eps: as in rms_norm.
        out, residual_out: optional outputs; may alias `x` and `residual` (in place),
            since each row is read completely before it is written.

    Returns:
        (normed [..., hidden_size] in x's dtype, new residual in residual's dtype).

    Raises:
        ValueError: shapes or dtypes disagree, or hidden_size > MAX_HIDDEN_SIZE.
    """
    if residual_out is None:
        residual_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    normed = _launch(x, residual, weight, eps, out, residual_out)
    return normed, residual_out
