"""Rotary-embedding cos/sin tables (RoFormer, Su et al. 2021, arXiv:2104.09864).

Pure torch, built once at model load and read by kernels/rotary.py. Frequencies follow
Hugging Face transformers' `modeling_rope_utils` bit for bit (same fp32 operations), so
positions rotate exactly as in the HF reference model:

* default: `inv_freq[i] = 1 / base ** (2i / head_dim)`;
* "llama3" (Llama 3.1+): `_compute_llama3_parameters` — wavelengths longer than
  `original_max_position_embeddings / low_freq_factor` are divided by `factor`,
  shorter than `.../ high_freq_factor` kept, and those between interpolated smoothly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def compute_inv_freq(
    head_dim: int, base: float, rope_scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies, [head_dim // 2] float32 (radians per position).

    Args:
        head_dim: rotated dimensions per head (even).
        base: `rope_theta` of the model config (10000 for Llama 2, 500000 for Llama 3).
        rope_scaling: the config's `rope_scaling` / `rope_parameters` dict, or None. The
            type is read from "rope_type" (or the legacy "type"); "llama3" needs
            factor, low_freq_factor, high_freq_factor, original_max_position_embeddings.
            Other keys (such as rope_theta) are ignored.

    Raises:
        ValueError: odd head_dim, an unsupported rope type, or a missing llama3 key.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    # The arithmetic is the model's own (flowengine/model/layers/rotary.py), so the
    # kernel tests check the tables the model really uses; here only the dict form of
    # config.json is validated and converted.
    from flowengine.model.layers.rotary import rope_inv_freq
    from flowengine.model.model_config import RopeScaling

    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return rope_inv_freq(head_dim, base, None)
    if rope_type != "llama3":
        raise ValueError(
            f"rope type {rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}"
        )
    missing = [k for k in _LLAMA3_KEYS if k not in rope_scaling]
    if missing:
        raise ValueError(f"llama3 rope_scaling lacks {missing}; copy them from config.json")
    scaling = RopeScaling("llama3", **{k: rope_scaling[k] for k in _LLAMA3_KEYS})
    return rope_inv_freq(head_dim, base, scaling)


def build_rope_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for positions [0, max_position).

    Returns:
        (cos, sin), each [max_position, head_dim // 2] float32 on `device`:
        `cos[p, i] = cos(p * inv_freq[i])`. The HF layout repeats them over both halves
        of the head (rotate_half); the kernel reads the half once.

    Raises:
        ValueError: as compute_inv_freq, or max_position < 1.
    """
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    inv_freq = compute_inv_freq(head_dim, base, rope_scaling).to(device)
    positions = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = torch.outer(positions, inv_freq)  # fp32, as HF's [D/2, 1] @ [1, S] matmul
    return freqs.cos(), freqs.sin()
