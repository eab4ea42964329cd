"""W4A16 GEMM (kernels/w4a16.py) against the float32 torch reference over the
dequantized weights; on CPU under TRITON_INTERPRET=1 (small shapes), on CUDA otherwise.

Tolerance, per element: the kernel rounds each dequantized weight to x's dtype before
the dot (relative error <= eps / 2) and accumulates in float32, then rounds the output
once; so |y - y_ref| <= eps * (|x| @ |W|^T) + eps * |y_ref| + 1e-5, eps the machine
epsilon of x's dtype (2**-10 float16, 2**-7 bfloat16, and tf32-free 2**-20 for float32
inputs, which use the IEEE dot).
"""

from __future__ import annotations

import pytest
import torch

from flowengine.kernels.w4a16 import w4a16_gemm, w4a16_reference

EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}


def _random_layer(n: int, k: int, group_size: int, act_order: bool, device: torch.device,
                  scale_dtype: torch.dtype = torch.float16):
    groups = -(-k // group_size)
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device)
    qzeros = torch.randint(0, 17, (groups, n), dtype=torch.uint8, device=device)  # v1: 16
    scales = (torch.rand(groups, n, device=device) * 0.02 + 0.005).to(scale_dtype)
    g_idx = None
    if act_order:
        plain = torch.arange(k, device=device, dtype=torch.int32) // group_size
        g_idx = plain[torch.randperm(k, device=device)].contiguous()
    return qweight, scales, qzeros, g_idx


def _abs_bound(x, qweight, scales, qzeros, g_idx, group_size, dtype, ref):
    absw = w4a16_reference(torch.eye(x.shape[1], device=x.device), qweight, scales, qzeros,
                           g_idx, group_size).abs()  # [K, N] = |W|^T
    return EPS[dtype] * (x.float().abs() @ absw) + EPS[dtype] * ref.abs() + 1e-5


@pytest.mark.parametrize(("m", "n", "k", "group_size", "act_order", "dtype", "bias"), [
    (1, 96, 256, 128, False, torch.float16, False),     # decode, grouped tiles, masked N
    (5, 64, 384, 128, True, torch.bfloat16, True),      # act-order g_idx + bias
    (37, 72, 192, 64, False, torch.float32, True),      # several M tiles, IEEE dot
    (3, 40, 200, 40, True, torch.float16, False),       # group not a power of 2, partial K
    # K 576 in 2 splits of 384: the second split's last tile starts past K, in a group
    # that does not exist (its row must not be read); a partial last group (64 of 128).
    (2, 48, 576, 128, False, torch.float16, False),
])
def test_w4a16_matches_reference(m: int, n: int, k: int, group_size: int, act_order: bool,
                                 dtype: torch.dtype, bias: bool, device: torch.device) -> None:
    if dtype == torch.bfloat16 and device.type == "cpu":
        dtype = torch.float16  # the interpreter's bfloat16 tl.dot is wrong (CUDA only)
    qweight, scales, qzeros, g_idx = _random_layer(n, k, group_size, act_order, device)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    ref = w4a16_reference(x, qweight, scales, qzeros, g_idx, group_size, b)
    for config in (None, (16, 32, 32, 2)):  # the heuristic, and a forced split-K
        out = w4a16_gemm(x, qweight, scales, qzeros, g_idx, group_size, b, config=config)
        assert out.dtype == dtype and out.shape == (m, n)
        bound = _abs_bound(x, qweight, scales, qzeros, g_idx, group_size, dtype, ref)
        err = (out.float() - ref).abs()
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def test_w4a16_rejects_bad_shapes(device: torch.device) -> None:
    qweight, scales, qzeros, _ = _random_layer(16, 64, 32, False, device)
    x = torch.randn(2, 64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="qweight must be"):
        w4a16_gemm(torch.randn(2, 72, device=device, dtype=torch.float16), qweight, scales,
                   qzeros, None, 32)
    with pytest.raises(ValueError, match="scales must be"):
        w4a16_gemm(x, qweight, scales[:1], qzeros, None, 32)
    with pytest.raises(ValueError, match="g_idx must be"):
        w4a16_gemm(x, qweight, scales, qzeros, torch.zeros(8, dtype=torch.int32,
                                                           device=device), 32)
