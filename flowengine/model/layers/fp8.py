"""FP8 (E4M3) weight quantization with dynamic per-token activation scales (W8A8).

`--quantization fp8` quantizes a bf16/fp16/fp32 checkpoint at load time, as vLLM's
online `fp8` method does: each linear layer's weight becomes float8_e4m3fn with one
float32 scale per output channel (row). A GEMM of many rows quantizes its input per
token (row) just before the GEMM, so both operands use Hopper's FP8 tensor cores
through `torch._scaled_mm` with row-wise scales (W8A8):

    y[t, o] = (sum_i xq[t, i] * wq[o, i]) * x_scale[t] * w_scale[o] (+ bias[o])

where xq = round_e4m3(x / x_scale), x_scale[t] = max_i |x[t, i]| / 448 (448 is the
largest finite E4M3 value), and likewise for each weight row. Per-channel weight and
per-token activation scaling is the "FP8 dynamic" recipe of vLLM / llm-compressor
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning", for the format). A GEMM of
few rows (decode at small batch, memory-bound on the weights) keeps its input as it is
and widens the E4M3 weights in registers instead (W8A16; see `fp8_linear`).

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


# Up to this many rows (tokens) a GEMM is memory-bound on the weights: the weight-only
# kernel (E4M3 weights widened in registers, activations as they are) reads half of
# bf16's bytes and skips the activation quantization; more rows go to the W8A8 GEMM on
# the FP8 tensor cores. Same value as flowengine.kernels.fp8_linear.W8A16_MAX_M.
W8A16_MAX_M = 64


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None
               ) -> torch.Tensor:
    """y = x W^T (+ b) with an E4M3 weight.

    T = the number of rows of x (its leading dimensions flattened):
    - T <= W8A16_MAX_M: weight-only (W8A16): y = x (W_e4m3 * w_scale)^T;
    - T > W8A16_MAX_M: W8A8: x quantized per token to E4M3, then the FP8 GEMM with
      row-wise scales (module docstring).
    On CUDA these are the Triton kernels of flowengine.kernels.fp8_linear and
    `torch._scaled_mm`; on the CPU (no FP8 hardware) the same arithmetic in float32
    (`fp8_linear_reference`).

    Args:
        x: [..., in] float32/float16/bfloat16.
        weight_fp8: [out, in] float8_e4m3fn, contiguous.
        weight_scale: [out] float32, one scale per output channel.
        bias: [out] in x's dtype, or None.
        input_scale: [1] float32, a checkpoint's static activation scale (used by the
            W8A8 GEMM instead of per-token scales), or None.

    Returns:
        [..., out] in x's dtype.

    Raises:
        RuntimeError: from `torch._scaled_mm` on a CUDA device without FP8 GEMMs (check
            `fp8_supported` first).
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x.is_cuda or weight_scale.dim() == 2:
        out = fp8_linear_reference(x2, weight_fp8, weight_scale, bias, input_scale
                                   ).to(x.dtype)
    elif x2.shape[0] <= W8A16_MAX_M:
        from flowengine.kernels.fp8_linear import fp8_w8a16_gemm
        from flowengine.model.layers.quant_linear import cuda_gemv

        out = cuda_gemv(x2, weight_fp8, bias, weight_scale)
        if out is None:
            out = fp8_w8a16_gemm(x2, weight_fp8, weight_scale, bias)
    else:
        if input_scale is not None:
            xq = (x2.float() / input_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            x_scale = input_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        else:
            from flowengine.kernels.fp8_linear import per_token_quant_fp8

            xq, x_scale = per_token_quant_fp8(x2)
        out = torch._scaled_mm(xq, weight_fp8.t(), scale_a=x_scale,
                               scale_b=weight_scale.reshape(1, -1), bias=bias,
                               out_dtype=x.dtype)
    return out.reshape(*shape[:-1], weight_fp8.shape[0])


def dequantize_fp8(weight_fp8: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 = E4M3 value x its scale (exact in float32). weight_scale: [out]
    per row, or [ceil(out / bo), ceil(in / bi)] per bo x bi block (the block size
    follows from the two shapes)."""
    w = weight_fp8.float()
    if weight_scale.dim() == 2:
        out_f, in_f = w.shape
        bo = -(-out_f // weight_scale.shape[0])
        bi = -(-in_f // weight_scale.shape[1])
        full = weight_scale.repeat_interleave(bo, 0)[:out_f].repeat_interleave(bi, 1)[:, :in_f]
        return w * full
    return w * weight_scale.reshape(-1, 1)


def fp8_linear_reference(x: torch.Tensor, weight_fp8: torch.Tensor,
                         weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                         input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear`'s arithmetic in float32: x [T, in] -> [T, out] float32.

    The weight is dequantized (`dequantize_fp8`, exact); for T > W8A16_MAX_M x is first
    quantized, per token (`quantize_rowwise`) or with the static `input_scale`, and
    dequantized.
    """
    w = dequantize_fp8(weight_fp8, weight_scale)
    xf = x.float()
    if xf.shape[0] > W8A16_MAX_M:
        if input_scale is not None:
            xq = (xf / input_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            xf = xq.float() * input_scale
        else:
            xq, x_scale = quantize_rowwise(xf)
            xf = xq.float() * x_scale
    out = F.linear(xf, w)
    return out if bias is None else out + bias.float()


class Fp8Linear(nn.Module):
    """A `ColumnParallelLinear` or `RowParallelLinear` whose weight is E4M3 with one
    scale per output channel; the row-parallel form sums the ranks' partial products
    with one all-reduce and adds the bias once, as its bf16 original does.

    Buffers: `weight` [out, in] float8_e4m3fn, `weight_scale` [out] float32 (or, for
    a block-scaled checkpoint, [ceil(out / bo), ceil(in / bi)]: CPU only), `bias` [out]
    (model dtype) or None, `input_scale` [1] float32 (a checkpoint's static activation
    scale) or None. `empty` makes the layer an FP8 checkpoint fills
    (flowengine/model/fp8_loader.py).
    """

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, *,
                 row_parallel: bool, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        if weight is not None:
            wq, scale = quantize_rowwise(weight.detach())
            self.register_buffer("weight", wq)
            self.register_buffer("weight_scale", scale.reshape(-1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("input_scale", None)
        self.input_scale_seen = False
        self.row_parallel = row_parallel
        self.tp = tp

    @classmethod
    def empty(cls, out_features: int, in_features: int, has_bias: bool, dtype: torch.dtype,
              *, row_parallel: bool, tp: TensorParallelGroup = SINGLE_RANK,
              block_size: tuple[int, int] | None = None,
              static_input_scale: bool = False) -> Fp8Linear:
        """A layer with uninitialized buffers (on the current default device, e.g.
        meta before materialization) for a checkpoint's E4M3 weight and its scales."""
        layer = cls(None, None, row_parallel=row_parallel, tp=tp)
        layer.register_buffer("weight", torch.empty(out_features, in_features,
                                                    dtype=FP8_DTYPE))
        scale_shape: tuple[int, ...] = (out_features,)
        if block_size is not None:
            scale_shape = (-(-out_features // block_size[0]), -(-in_features // block_size[1]))
        layer.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32))
        if has_bias:
            layer.register_buffer("bias", torch.empty(out_features, dtype=dtype))
        if static_input_scale:
            layer.register_buffer("input_scale", torch.empty(1, dtype=torch.float32))
        return layer

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features], x's dtype."""
        if self.row_parallel and self.tp.world_size > 1:
            out = self.tp.all_reduce(fp8_linear(x, self.weight, self.weight_scale,
                                                input_scale=self.input_scale))
            return out if self.bias is None else out + self.bias
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.input_scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the GEMM effectively uses, [out, in] in `dtype` (for references)."""
        return dequantize_fp8(self.weight, self.weight_scale).to(dtype)


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
    """Float32 reference of an `Fp8Linear` for tests: [..., in] -> [..., out] float32."""
    out = fp8_linear_reference(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale,
                               layer.bias, layer.input_scale)
    return out.reshape(*x.shape[:-1], layer.out_features)
