"""Gated activations of the Llama MLP (Triton kernel on CUDA, C on a float32 CPU, torch
elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowengine.model.layers import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): silu(gate) * up.

    gate_up: [T, 2 * intermediate] with the gate in the first half (the fused
    gate_up_proj output) -> [T, intermediate], same dtype. On CUDA one Triton kernel
    (fp32 arithmetic, one rounding); float32 on the CPU one C call
    (cpu_kernels.silu_and_mul, the fused decode layers' body); elsewhere torch (a
    rounding per operation, as transformers does).
    """
    if gate_up.is_cuda:
        from flowengine.kernels.activation import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate_up)
    fused = cpu_kernels.silu_and_mul(gate_up)
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Shazeer 2020) with the tanh approximation of GELU, Gemma's MLP:
    gelu_tanh(gate) * up. gate_up: [T, 2 * intermediate], gate first -> [T, intermediate],
    same dtype (torch on every device)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
