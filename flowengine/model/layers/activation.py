"""Gated activations of the Llama MLP (Triton kernel on CUDA, torch elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): silu(gate) * up.

    gate_up: [T, 2 * intermediate] with the gate in the first half (the fused
    gate_up_proj output) -> [T, intermediate], same dtype. On CUDA one Triton kernel
    (fp32 arithmetic, one rounding); elsewhere torch (a rounding per operation, as
    transformers does).
    """
    if gate_up.is_cuda:
        from flowengine.kernels.activation import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Shazeer 2020) with the tanh approximation of GELU, Gemma's MLP:
    gelu_tanh(gate) * up. gate_up: [T, 2 * intermediate], gate first -> [T, intermediate],
    same dtype (torch on every device)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
