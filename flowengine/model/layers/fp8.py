"""FP8 (E4M3) weight quantization with dynamic per-token activation scales (W8A8).

`--quantization fp8` quantizes a bf16/fp16/fp32 checkpoint at load time, as vLLM's
online `fp8` method does: each linear layer's weight becomes float8_e4m3fn with one
float32 scale per output channel (row), and each GEMM input is quantized per token
(row) just before the GEMM, so both operands use Hopper's FP8 tensor cores through
`torch._scaled_mm` with row-wise scales:

    y[t, o] = (sum_i xq[t, i] * wq[o, i]) * x_scale[t] * w_scale[o] (+ bias[o])

where xq = round_e4m3(x / x_scale), x_scale[t] = max_i |x[t, i]| / 448 (448 is the
largest finite E4M3 value), and likewise for each weight row. Per-channel weight and
per-token activation scaling is the "FP8 dynamic" recipe of vLLM / llm-compressor
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning", for the format).

Embeddings, the LM head and norms stay in the model dtype (vLLM leaves `lm_head`
unquantized too). MoE experts are not quantized here (they keep their dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flowengine.distributed.tp_group import SINGLE_RANK, TensorParallelGroup
from flowengine.model.layers.linear import ColumnParallelLinear, RowParallelLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# Floor for a scale, so that an all-zero row (padding, a dead channel) does not divide
# by zero; any positive value works since its quantized row is all zeros.
_MIN_SCALE = 1e-12


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` runs FP8 GEMMs: CUDA compute capability >= 8.9 (Ada, Hopper and
    later), or the CPU, where torch computes `_scaled_mm` without FP8 hardware (slowly:
    the CPU path exists for tests and correctness, not speed)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return False


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of a 2-D tensor to E4M3 with its own scale.

    Args:
        x: [R, C] float32/float16/bfloat16.

    Returns:
        (xq [R, C] float8_e4m3fn, scale [R, 1] float32) with x ~= xq.float() * scale;
        scale = max|row| / 448, so no value saturates.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_rowwise takes a 2-D tensor, got shape {tuple(x.shape)}")
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_(min=_MIN_SCALE)
    xq = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) with x quantized per token to E4M3 on the fly.

    Args:
        x: [T, in] float32/float16/bfloat16 (any leading shape is flattened to T).
        weight_fp8: [out, in] float8_e4m3fn, row-major.
        weight_scale: [out] float32 (or [out, 1]), one scale per output channel.
        bias: [out] in x's dtype, or None.

    Returns:
        [..., out] in x's dtype. Padding rows are computed like any other.

    Raises:
        RuntimeError: from `torch._scaled_mm` on a device without FP8 GEMMs (check
            `fp8_supported` first), or when `in`/`out` are not multiples of 16 on CUDA.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, x_scale = quantize_rowwise(x2)
    out = torch._scaled_mm(
        xq, weight_fp8.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1),
        bias=bias, out_dtype=x.dtype,
    )
    return out.reshape(*shape[:-1], weight_fp8.shape[0])


class Fp8Linear(nn.Module):
    """A `ColumnParallelLinear` or `RowParallelLinear` whose weight is E4M3 with one
    scale per output channel; the row-parallel form sums the ranks' partial products
    with one all-reduce and adds the bias once, as its bf16 original does.

    Buffers: `weight` [out, in] float8_e4m3fn, `weight_scale` [out] float32,
    `bias` [out] (model dtype) or None.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 row_parallel: bool, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        wq, scale = quantize_rowwise(weight.detach())
        self.register_buffer("weight", wq)
        self.register_buffer("weight_scale", scale.reshape(-1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.row_parallel = row_parallel
        self.tp = tp

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features], x's dtype."""
        if self.row_parallel and self.tp.world_size > 1:
            out = self.tp.all_reduce(fp8_linear(x, self.weight, self.weight_scale))
            return out if self.bias is None else out + self.bias
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the GEMM effectively uses, [out, in] in `dtype` (for references)."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)


def quantize_model_fp8_(model: nn.Module, device: torch.device) -> int:
    """Replace every column/row-parallel linear layer of `model` with an `Fp8Linear`,
    in place, and free the original weights. Returns the number of layers replaced.

    Raises:
        ValueError: `device` has no FP8 GEMMs (CUDA below compute capability 8.9), or a
            layer's input/output width is not a multiple of 16 (the FP8 GEMM's tile
            requirement on CUDA).
    """
    if not fp8_supported(device):
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        raise ValueError(
            f"quantization='fp8' needs FP8 tensor cores (CUDA compute capability >= 8.9: "
            f"Ada, Hopper or later); {device} has {cap}. Run without --quantization fp8"
        )
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if name == "lm_head":
                continue
            out_f, in_f = child.weight.shape
            if device.type == "cuda" and (out_f % 16 or in_f % 16):
                raise ValueError(
                    f"quantization='fp8': layer {name} is [{out_f}, {in_f}]; FP8 GEMMs "
                    "need both widths to be multiples of 16"
                )
            row = isinstance(child, RowParallelLinear)
            fp8 = Fp8Linear(child.weight, child.bias, row_parallel=row,
                            tp=child.tp if row else SINGLE_RANK)
            setattr(parent, name, fp8)
            replaced += 1
    return replaced


def reference_fp8_linear(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """Float32 reference of `Fp8Linear` for tests: the same per-token quantization of x,
    then a float32 GEMM on the dequantized operands. [T, in] -> [T, out] float32."""
    xq, x_scale = quantize_rowwise(x.reshape(-1, x.shape[-1]))
    xd = xq.float() * x_scale
    out = F.linear(xd, layer.dequantized_weight(torch.float32))
    if layer.bias is not None:
        out = out + layer.bias.float()
    return out.reshape(*x.shape[:-1], layer.out_features)
