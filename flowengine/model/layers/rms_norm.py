"""Root-mean-square layer norm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

On CUDA the Triton kernels of flowengine.kernels.rms_norm run (one pass; the residual
add fused in); elsewhere plain torch. Both round like transformers' `LlamaRMSNorm`.
"""

from __future__ import annotations

import torch
from torch import nn

from flowengine.distributed.tp_group import TensorParallelGroup
from flowengine.model.layers import cpu_kernels


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), over the last dimension.

    Computed in float32 and cast back before the weight multiply, in the same order as
    transformers' `LlamaRMSNorm`, so float32 outputs match Hugging Face's bit for bit.

    Args:
        hidden_size: size of the normalized (last) dimension.
        eps: added to the mean square (config `rms_norm_eps`).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden_size] any float dtype -> same shape and dtype."""
        if x.is_cuda:
            from flowengine.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        fused = cpu_kernels.rms_norm(x, self.weight, self.eps)  # float32 CPU: one C call
        if fused is not None:
            return fused[0]
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual = x + residual; return norm(residual), residual` (pre-norm blocks).

        x, residual: [T, hidden_size], same dtype. The sum is rounded to the dtype
        before it is normalized, exactly as the unfused Hugging Face code does. Returns
        (normed, new residual), both [T, hidden_size] in that dtype.
        """
        if x.is_cuda:
            from flowengine.kernels.rms_norm import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        fused = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        if fused is not None:
            return fused
        residual = x + residual
        return self.forward(residual), residual


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a width split across the tensor-parallel ranks (OLMoE's q/k norm,
    taken over all heads at once while each rank holds only its heads).

    Each rank holds `weight`'s slice for its part of the features; the mean square is the
    sum of the ranks' sums of squares over the full width (one all-reduce of [T, 1]).
    With one rank it is exactly RMSNorm.

    Args:
        full_size: the whole normalized width; local_size: this rank's part of it.
        eps: added to the mean square. tp: the tensor-parallel group.
    """

    def __init__(self, full_size: int, local_size: int, eps: float, tp: TensorParallelGroup
                 ) -> None:
        super().__init__(local_size, eps)
        self.full_size = full_size
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., local_size] any float dtype -> same shape and dtype."""
        if self.tp.world_size == 1:
            return super().forward(x)
        input_dtype = x.dtype
        x32 = x.float()
        sum_sq = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        variance = sum_sq / self.full_size
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32 and
    cast back once (modeling_gemma2.py; checkpoints store weight - 1). Plain torch on
    every device (the Triton kernel multiplies by weight itself)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden_size] any float dtype -> same shape and dtype."""
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """As RMSNorm.add_and_norm, with Gemma's norm."""
        residual = x + residual
        return self.forward(residual), residual
