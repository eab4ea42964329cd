from __future__ import annotations

import pytest
import torch
from kernel_refs import assert_close, ref_rms_norm

from flowengine.kernels.rms_norm import fused_add_rms_norm, rms_norm

EPS = 1e-5
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
# bf16 output: two roundings (normalised row, then times weight), 2**-8 each.
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}
FP16_TOL = {"rtol": 2e-3, "atol": 2e-3}  # 2**-11 per rounding


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)]
)
def test_rms_norm(dtype: torch.dtype, tol: dict[str, float], device: torch.device) -> None:
    hidden = 576  # SmolLM2's hidden size: not a power of two
    # Rows of a wider buffer: a row stride other than hidden.
    x = (torch.randn(13, hidden + 64, device=device) * 3)[:, :hidden].to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    out = torch.full((13, hidden), float("nan"), dtype=dtype, device=device)
    assert rms_norm(x, weight, EPS, out=out) is out
    assert_close(out, ref_rms_norm(x, weight, EPS), **tol)


def test_rms_norm_per_head_3d(device: torch.device) -> None:
    """q/k norm (Qwen3): [T, heads, head_dim] normalised per head with a [head_dim] weight."""
    x = torch.randn(6, 4, 64, device=device)
    weight = torch.randn(64, device=device)
    assert_close(rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS), **FP32_TOL)


# fp16, not bf16: the CPU interpreter truncates fp32 -> bf16 instead of rounding to
# nearest even, so the exact residual check holds for bf16 only on a GPU (tests/gpu).
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, FP32_TOL), (torch.float16, FP16_TOL)]
)
def test_fused_add_rms_norm(
    dtype: torch.dtype, tol: dict[str, float], device: torch.device
) -> None:
    x = torch.randn(9, 320, dtype=dtype, device=device)
    residual = torch.randn(9, 320, dtype=dtype, device=device)
    weight = (1 + 0.1 * torch.randn(320, device=device)).to(dtype)
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan"))
    normed, new_residual = fused_add_rms_norm(
        x, residual, weight, EPS, out=out, residual_out=res_out
    )
    assert normed is out and new_residual is res_out
    expected_residual = x + residual  # torch rounds the fp32 sum once, as the kernel does
    assert torch.equal(new_residual, expected_residual)
    assert_close(normed, ref_rms_norm(expected_residual, weight, EPS), **tol)


def test_fused_add_rms_norm_in_place(device: torch.device) -> None:
    x = torch.randn(5, 128, device=device)
    residual = torch.randn(5, 128, device=device)
    weight = torch.randn(128, device=device)
    expected_residual = x + residual
    expected = ref_rms_norm(expected_residual, weight, EPS)
    normed, new_residual = fused_add_rms_norm(
        x, residual, weight, EPS, out=x, residual_out=residual
    )
    assert normed is x and new_residual is residual
    assert torch.equal(residual, expected_residual)
    assert_close(x, expected, **FP32_TOL)


def test_rejects_wrong_hidden_size() -> None:
    with pytest.raises(ValueError, match="must end in hidden_size 64"):
        rms_norm(torch.randn(2, 32), torch.ones(64), EPS)
