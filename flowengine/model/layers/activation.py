"""Gated activations of the Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): silu(gate) * up.

    gate_up: [T, 2 * intermediate] with the gate in the first half (the fused
    gate_up_proj output) -> [T, intermediate], same dtype.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
