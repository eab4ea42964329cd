"""Rotary position embedding (Su et al. 2021, "RoFormer"), Hugging Face's layout.

Hugging Face checkpoints rotate the two halves of each head (`rotate_half`), not
interleaved pairs; GGUF files store q/k permuted for the interleaved layout, which
`gguf_loader` undoes, so this one layout serves every weight source.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flowengine.model.model_config import RopeScaling


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, computed exactly as transformers'
    `modeling_rope_utils` does (default, linear and llama3 rules), so positions embed
    identically to the Hugging Face reference."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        raise ValueError(f"RoPE scaling type {scaling.rope_type!r} is not supported")
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band in
    # between interpolated (Meta's llama/model.py `apply_scaling`).
    factor = scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query/key heads at given positions.

    Holds a cos/sin table [max_positions, 2, head_dim] float32 (a non-persistent
    buffer, recomputed by `init_buffers()` after the module is materialized from the
    meta device).

    Args:
        head_dim: rotated size per head (the whole head; partial rotary is rejected by
            ModelConfig).
        max_positions: table length; positions must be < max_positions.
        base: rope_theta.
        scaling: optional frequency scaling (linear / llama3).
    """

    def __init__(self, head_dim: int, max_positions: int, base: float,
                 scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = scaling
        self.register_buffer(
            "cos_sin_cache", torch.empty(max_positions, 2, head_dim), persistent=False
        )
        if self.cos_sin_cache.device.type != "meta":
            self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the cos/sin table on the buffer's device, float32 whatever the
        module dtype (transformers computes cos/sin in float32, then casts)."""
        inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling)
        positions = torch.arange(self.max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        table = torch.stack((emb.cos(), emb.sin()), dim=1)
        self.cos_sin_cache = table.to(self.cos_sin_cache.device)

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys of the same tokens.

        positions: [T] int64; q: [T, num_heads, head_dim], k: [T, num_kv_heads,
        head_dim], any token/head strides with a contiguous last dimension (views of
        the fused qkv output). On CUDA one Triton kernel rotates both in place (fp32
        arithmetic, one rounding) and returns them; elsewhere `forward` on each.
        """
        if q.is_cuda:
            from flowengine.kernels.rotary import rotary_embedding

            half = self.head_dim // 2
            # Views of the [max_positions, 2, head_dim] table: the first half of each
            # row holds every frequency once (the second half repeats it).
            cos = self.cos_sin_cache[:, 0, :half]
            sin = self.cos_sin_cache[:, 1, :half]
            rotary_embedding(positions, q, k, cos, sin)
            return q, k
        return self.forward(positions, q), self.forward(positions, k)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions: [T] int64; x: [T, num_heads, head_dim] (may be a strided view)
        -> rotated [T, num_heads, head_dim], x's dtype, contiguous."""
        cos_sin = self.cos_sin_cache[positions].to(x.dtype)  # [T, 2, D]
        cos = cos_sin[:, 0].unsqueeze(1)
        sin = cos_sin[:, 1].unsqueeze(1)
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
