"""FP8 (E4M3) weight quantization: the quantizer, the FP8 GEMM against a float32
reference, and the model pass that swaps linear layers. CPU (torch computes
`_scaled_mm` without FP8 hardware); tests/gpu covers Hopper's FP8 tensor cores."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowengine.model.layers.fp8 import (
    FP8_DTYPE,
    W8A16_MAX_M,
    Fp8Linear,
    fp8_linear,
    quantize_model_fp8_,
    quantize_rowwise,
    reference_fp8_linear,
)
from flowengine.model.layers.linear import ColumnParallelLinear, RowParallelLinear

# E4M3 keeps 3 mantissa bits: round-to-nearest has relative error <= 2**-4 for values
# in the normal range (>= 2**-6 after scaling).
E4M3_UNIT_ROUNDOFF = 2.0**-4


def test_quantize_rowwise_scale_and_error() -> None:
    x = torch.randn(64, 512) * torch.logspace(-3, 3, 64)[:, None]  # rows of any magnitude
    x[5] = 0.0
    xq, scale = quantize_rowwise(x)
    assert xq.dtype == FP8_DTYPE and scale.shape == (64, 1) and scale.dtype == torch.float32
    amax = x.abs().amax(dim=1, keepdim=True)
    nonzero = amax[:, 0] > 0
    assert torch.equal(scale[nonzero], amax[nonzero] / 448.0)
    # The largest magnitude of every row maps to E4M3's largest value: nothing clips.
    assert torch.equal(xq.float().abs().amax(dim=1)[nonzero], torch.full((63,), 448.0))
    assert not xq.float().isnan().any() and (xq[5].float() == 0).all()
    back = xq.float() * scale
    normal = (x / scale).abs() >= 2.0**-6
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= E4M3_UNIT_ROUNDOFF + 1e-7


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [7, 100])  # weight-only (<= 64 rows) and W8A8
def test_fp8_linear_matches_float32_reference(bias: bool, rows: int) -> None:
    w = torch.randn(96, 256) * 0.05
    b = torch.randn(96) if bias else None
    layer = Fp8Linear(w, b, row_parallel=False)
    x = torch.randn(rows, 256)
    got = layer(x)
    w_deq = layer.weight.float() * layer.weight_scale[:, None]
    if rows <= W8A16_MAX_M:
        x_used = x  # activations as they are
    else:
        xq, x_scale = quantize_rowwise(x)
        x_used = xq.float() * x_scale
        assert not torch.equal(x_used, x)
    torch.testing.assert_close(got, F.linear(x_used, w_deq, b), rtol=1e-5, atol=1e-5)
    # Against the unquantized layer: each quantized operand carries E4M3's rounding
    # (<= 2**-4 relative, ~2**-4 / sqrt(3) RMS), so the output's relative RMS error
    # stays under 2**-4.
    exact = F.linear(x, w, b)
    rel = (got - exact).norm() / exact.norm()
    assert rel < E4M3_UNIT_ROUNDOFF, rel


def test_fp8_linear_bf16_keeps_dtype_and_leading_dims() -> None:
    w = torch.randn(32, 64)
    layer = Fp8Linear(w.bfloat16(), None, row_parallel=True)
    x = torch.randn(2, 40, 64, dtype=torch.bfloat16)  # 80 rows: the W8A8 path
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 40, 32)
    want = reference_fp8_linear(x.float(), layer)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)  # one bf16 rounding


def test_fp8_linear_rejects_non_2d_quantize() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_rowwise(torch.zeros(2, 3, 4))
    xq, _ = quantize_rowwise(torch.zeros(3, 16))
    assert fp8_linear(torch.zeros(3, 16), xq, torch.ones(3)).abs().sum() == 0


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from flowengine.distributed.tp_group import SINGLE_RANK

        self.qkv_proj = ColumnParallelLinear(64, 96, bias=True)
        self.o_proj = RowParallelLinear(32, 64, bias=False, tp=SINGLE_RANK)
        self.lm_head = ColumnParallelLinear(64, 100, bias=False)
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.1)


def test_quantize_model_swaps_linears_but_not_lm_head() -> None:
    model = _Block()
    qkv_w = model.qkv_proj.weight.detach().clone()
    assert quantize_model_fp8_(model, torch.device("cpu")) == 2
    assert isinstance(model.qkv_proj, Fp8Linear) and not model.qkv_proj.row_parallel
    assert isinstance(model.o_proj, Fp8Linear) and model.o_proj.row_parallel
    assert isinstance(model.lm_head, ColumnParallelLinear)
    assert model.qkv_proj.weight.dtype == FP8_DTYPE
    assert model.qkv_proj.bias is not None
    err = (model.qkv_proj.dequantized_weight() - qkv_w).abs()
    assert (err <= E4M3_UNIT_ROUNDOFF * qkv_w.abs() + model.qkv_proj.weight_scale[:, None]
            * 2.0**-9).all()  # relative, or E4M3's subnormal spacing near zero
