"""Rotary position embedding (Su et al. 2021, "RoFormer"), Hugging Face's layout.

Hugging Face checkpoints rotate the two halves of each head (`rotate_half`), not
interleaved pairs; GGUF files store q/k permuted for the interleaved layout, which
`gguf_loader` undoes, so this one layout serves every weight source.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flowengine.model.layers import cpu_kernels
from flowengine.model.model_config import ModelConfig, RopeScaling


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

    Holds a cos/sin table [rows, 2, rotary_dim] float32 (a non-persistent buffer,
    recomputed by `init_buffers()` after the module is materialized from the meta
    device); rows = max_positions, plus original_max_position rows of short factors
    first for longrope.

    Args:
        head_dim: size per head. max_positions: table length; positions must be <
            max_positions.
        base: rope_theta. scaling: frequency scaling by the built-in rules (linear /
            llama3) when `inv_freq` is not given.
        inv_freq: [rotary_dim // 2] inverse frequencies (from transformers'
            ROPE_INIT_FUNCTIONS, see ModelConfig), overriding base/scaling.
        attention_scaling: factor on cos and sin (yarn, longrope).
        rotary_dim: leading dimensions rotated per head (None: head_dim); the rest pass.
        long_inv_freq, original_max_position: longrope's long factors, used for every
            token of a step once any position of the step reaches original_max_position.
    """

    def __init__(self, head_dim: int, max_positions: int, base: float,
                 scaling: RopeScaling | None, *, inv_freq: tuple[float, ...] = (),
                 attention_scaling: float = 1.0, rotary_dim: int | None = None,
                 long_inv_freq: tuple[float, ...] = (), original_max_position: int = 0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = scaling
        self.inv_freq = inv_freq
        self.attention_scaling = attention_scaling
        self.long_inv_freq = long_inv_freq
        self.original_max_position = original_max_position if long_inv_freq else 0
        rows = max_positions + self.original_max_position
        self.register_buffer(
            "cos_sin_cache", torch.empty(rows, 2, self.rotary_dim), persistent=False
        )
        if self.cos_sin_cache.device.type != "meta":
            self.init_buffers()

    @classmethod
    def from_config(cls, config: ModelConfig, rope_theta: float | None = None
                    ) -> RotaryEmbedding:
        """The RoPE a ModelConfig describes (rope_theta: override, e.g. Gemma 3's local
        layers)."""
        return cls(config.head_dim, config.max_model_len,
                   config.rope_theta if rope_theta is None else rope_theta,
                   config.rope_scaling, inv_freq=config.rope_inv_freq,
                   attention_scaling=config.rope_attention_scaling,
                   rotary_dim=config.rotary_dim or None,
                   long_inv_freq=config.rope_long_inv_freq,
                   original_max_position=config.rope_original_max_position)

    def _table(self, inv_freq: torch.Tensor, num_positions: int) -> torch.Tensor:
        positions = torch.arange(num_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # transformers multiplies cos and sin by the scaling in float32, then casts.
        return torch.stack((emb.cos() * self.attention_scaling,
                            emb.sin() * self.attention_scaling), dim=1)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the cos/sin table on the buffer's device, float32 whatever the
        module dtype (transformers computes cos/sin in float32, then casts)."""
        if self.inv_freq:
            inv_freq = torch.tensor(self.inv_freq, dtype=torch.float32)
        else:
            inv_freq = rope_inv_freq(self.rotary_dim, self.base, self.scaling)
        table = self._table(inv_freq, self.max_positions)
        if self.original_max_position:
            long = torch.tensor(self.long_inv_freq, dtype=torch.float32)
            table = torch.cat((table[:self.original_max_position],
                               self._table(long, self.max_positions)))
        self.cos_sin_cache = table.to(self.cos_sin_cache.device)

    def _table_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Row of the table for each position: longrope's long rows (after the short
        ones) for the whole step once any position reaches the original length,
        computed on the device (no host sync)."""
        if not self.original_max_position:
            return positions
        is_long = (positions.max() >= self.original_max_position).to(positions.dtype)
        return positions + is_long * self.original_max_position

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys of the same tokens.

        positions: [T] int64; q: [T, num_heads, head_dim], k: [T, num_kv_heads,
        head_dim], any token/head strides with a contiguous last dimension (views of
        the fused qkv output). On CUDA one Triton kernel rotates both in place (fp32
        arithmetic, one rounding) and returns them; elsewhere `forward` on each.
        """
        positions = self._table_positions(positions)
        if q.is_cuda and self.rotary_dim == self.head_dim:
            from flowengine.kernels.rotary import rotary_embedding

            half = self.head_dim // 2
            # Views of the [max_positions, 2, head_dim] table: the first half of each
            # row holds every frequency once (the second half repeats it).
            cos = self.cos_sin_cache[:, 0, :half]
            sin = self.cos_sin_cache[:, 1, :half]
            rotary_embedding(positions, q, k, cos, sin)
            return q, k
        if self.rotary_dim == self.head_dim:  # float32 CPU: one C call per tensor
            fused = cpu_kernels.rope_neox(positions, q, k, self.cos_sin_cache)
            if fused is not None:
                return fused
        return self._rotate(positions, q), self._rotate(positions, k)

    def kernel_tables(self, positions: torch.Tensor, q: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(table rows [T], cos [rows, head_dim // 2], sin likewise) for a kernel that
        applies this RoPE itself (the Triton backend's fused rotary + KV write), or
        None where only `rotate_qk` applies (not CUDA, or partial rotary).

        positions: [T] int64; q: the queries to be rotated (their device decides).
        """
        if not q.is_cuda or self.rotary_dim != self.head_dim:
            return None
        half = self.head_dim // 2
        return (self._table_positions(positions), self.cos_sin_cache[:, 0, :half],
                self.cos_sin_cache[:, 1, :half])

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions: [T] int64; x: [T, num_heads, head_dim] (may be a strided view)
        -> rotated [T, num_heads, head_dim], x's dtype, contiguous."""
        return self._rotate(self._table_positions(positions), x)

    def _rotate(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos_sin = self.cos_sin_cache[rows].to(x.dtype)  # [T, 2, rotary_dim]
        cos = cos_sin[:, 0].unsqueeze(1)
        sin = cos_sin[:, 1].unsqueeze(1)
        if self.rotary_dim != self.head_dim:  # partial rotary: the tail passes through
            x_rot, x_pass = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
            return torch.cat((self._rotate_full(x_rot, cos, sin), x_pass), dim=-1)
        return self._rotate_full(x, cos, sin)

    @staticmethod
    def _rotate_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
