"""Root-mean-square layer norm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""

from __future__ import annotations

import torch
from torch import nn


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
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)
