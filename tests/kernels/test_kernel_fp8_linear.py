"""The FP8 linear kernels (flowengine.kernels.fp8_linear) against float32 references:
the weight-only W8A16 GEMM (interpreter and CUDA) and the per-token E4M3 quantizer
(CUDA only: Triton's interpreter rounds float32 -> E4M3 wrongly, see
test_kernel_fp8_kv_cache.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowengine.kernels.fp8_linear import fp8_w8a16_gemm, per_token_quant_fp8
from flowengine.model.layers.fp8 import quantize_rowwise


def _weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    wq, scale = quantize_rowwise(torch.randn(n, k) * 0.05)
    return wq.to(device), scale.reshape(-1).to(device)


@pytest.mark.parametrize(("m", "n", "k", "split_k", "bias"), [
    (1, 96, 512, None, False), (5, 200, 384, 1, True), (16, 64, 1024, 4, True),
    (33, 130, 640, 2, False), (64, 64, 256, None, True),
])
def test_w8a16_gemm_matches_reference(m: int, n: int, k: int, split_k: int | None, bias: bool,
                                      device: torch.device) -> None:
    # bfloat16 tl.dot is wrong in the interpreter; fp16 is exact there, bf16 on CUDA.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    wq, scale = _weight(n, k, device)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    got = fp8_w8a16_gemm(x, wq, scale, b, split_k=split_k)
    want = F.linear(x.float(), wq.float() * scale[:, None], None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (m, n)
    # fp32 accumulation, one rounding to fp16/bf16 at the end (2**-11 / 2**-8 relative).
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_w8a16_gemm_rejects_bad_inputs(device: torch.device) -> None:
    wq, scale = _weight(32, 64, device)
    x = torch.randn(65, 64, device=device).half()
    with pytest.raises(ValueError, match="at most 64 rows"):
        fp8_w8a16_gemm(x, wq, scale)
    with pytest.raises(ValueError, match="contiguous"):
        fp8_w8a16_gemm(x[:4, :32], wq, scale)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_w8a16_gemm(x[:4], wq, scale[:8])


@pytest.mark.parametrize(("m", "k"), [(1, 4096), (300, 14336), (17, 1000)])
def test_per_token_quant_matches_torch(m: int, k: int, device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("Triton's interpreter rounds float32 -> E4M3 wrongly; checked on CUDA")
    x = (torch.randn(m, k, device=device) * torch.logspace(-2, 2, m, device=device)[:, None])
    x = x.bfloat16()
    x[0, :7] = 0  # a partly zero row
    xq, scale = per_token_quant_fp8(x)
    want_q, want_scale = quantize_rowwise(x)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    # x * (1 / scale) against x / scale: at most one E4M3 step apart, and rarely.
    got, want = xq.float(), want_q.float()
    step = torch.maximum(want.abs(), torch.full_like(want, 2.0**-6)) * 2.0**-3
    assert ((got - want).abs() <= step).all()
    assert (got != want).float().mean() < 1e-3
