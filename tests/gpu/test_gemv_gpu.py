"""Decode GEMVs (kernels/gemv.py) at Llama-3.1-8B shapes on CUDA, heuristic / table
configs, against float32 references; bound as tests/kernels/test_kernel_gemv.py (bf16
output rounding 2**-8 |y| plus 2**-16 |x| |W| for the fp32 sums over K <= 14336)."""

from __future__ import annotations

import pytest
import torch

from flowengine.kernels.gemv import dense_gemv, w4a16_gemv
from flowengine.kernels.w4a16 import w4a16_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _inference_mode():
    """As the engine runs its forwards (the layers take the GEMV only without grad)."""
    with torch.inference_mode():
        yield


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "w4a16", "w4a16_act"])
def test_gemv_full_shapes(fmt, m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if fmt in ("bf16", "fp8"):
        w = torch.randn(n, k, device="cuda")
        scale = None
        if fmt == "fp8":
            w = (w * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = torch.rand(n, device="cuda") * 0.01 + 1e-3
            wf = w.float() * scale[:, None]
        else:
            w = w.to(torch.bfloat16)
            wf = w.float()
        out = dense_gemv(x, w, None, scale)
        ref = x.float() @ wf.t()
        absref = x.float().abs() @ wf.abs().t()
    else:
        g = k // 128
        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")
        sc = (torch.rand(g, n, device="cuda") * 0.02 + 0.005).to(torch.bfloat16)
        qz = torch.randint(0, 16, (g, n), dtype=torch.uint8, device="cuda")
        gi = None
        if fmt == "w4a16_act":
            gi = (torch.arange(k, device="cuda", dtype=torch.int32) // 128)[
                torch.randperm(k, device="cuda")].contiguous()
        out = w4a16_gemv(x, qw, sc, qz, gi, 128)
        ref = w4a16_reference(x, qw, sc, qz, gi, 128)
        absref = (w4a16_reference(x.float().abs(), qw, sc, torch.zeros_like(qz), gi, 128)
                  - w4a16_reference(x.float().abs(), torch.zeros_like(qw), sc, qz, gi, 128))
    assert not torch.isnan(out).any()
    err = (out.float() - ref).abs()
    bound = 2.0**-8 * ref.abs() + 2.0**-16 * absref + 1e-4
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3e}"


@pytest.mark.parametrize("gemv_env", ["1", "0"])
@pytest.mark.parametrize("m", [1, 3, 8, 9])
def test_layers_route_few_rows_through_the_gemv(monkeypatch, gemv_env, m):
    """The layers' dispatch: FLOWENGINE_GEMV=1 sends every product of <= 8 rows to the
    GEMV (the result equals the kernel called directly, bit for bit), =0 keeps the
    current path (cuBLAS / fp8_w8a16_gemm / w4a16_gemm, bit for bit); 9 rows never take
    the GEMV."""
    from flowengine.kernels.fp8_linear import fp8_w8a16_gemm
    from flowengine.kernels.w4a16 import w4a16_gemm
    from flowengine.model.layers.fp8 import fp8_linear
    from flowengine.model.layers.int4 import Int4Linear
    from flowengine.model.layers.quant_linear import linear

    monkeypatch.setenv("FLOWENGINE_GEMV", gemv_env)
    gemv = gemv_env == "1" and m <= 8
    n, k = 1536, 1024
    x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
    x2 = x.view(m, k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = linear(x, w, bias)
    assert out.shape == (1, m, n)
    expect = dense_gemv(x2, w, bias) if gemv else torch.nn.functional.linear(x2, w, bias)
    assert torch.equal(out.view(m, n), expect)

    w8 = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, device="cuda") * 0.01 + 1e-3
    out = fp8_linear(x, w8, scale, bias)
    expect = dense_gemv(x2, w8, bias, scale) if gemv else fp8_w8a16_gemm(x2, w8, scale, bias)
    assert torch.equal(out.view(m, n), expect)

    for act_order in (False, True):
        layer = Int4Linear(k, n, True, 128, act_order, torch.bfloat16).cuda()
        layer.qweight.copy_(torch.randint(-2**31, 2**31 - 1, layer.qweight.shape,
                                          dtype=torch.int32))
        layer.qzeros.copy_(torch.randint(0, 16, layer.qzeros.shape, dtype=torch.uint8))
        layer.scales.copy_(torch.rand(layer.scales.shape) * 0.02 + 0.005)
        layer.bias.data.copy_(bias)
        if act_order:
            layer.g_idx.copy_((torch.arange(k, dtype=torch.int32) // 128)[torch.randperm(k)])
        args = (x2, layer.qweight, layer.scales, layer.qzeros, layer.g_idx, 128, layer.bias)
        expect = w4a16_gemv(*args) if gemv else w4a16_gemm(*args)
        assert torch.equal(layer(x).view(m, n), expect)


def test_layers_ask_the_table_with_its_key_order(monkeypatch):
    """What each layer passes to use_gemv (format, rows, N, K) is the table's key order
    (benchmarks/gemv_gpu.py writes format,M,N,K), checked by recording the calls."""
    from flowengine.kernels import gemv
    from flowengine.model.layers.fp8 import fp8_linear
    from flowengine.model.layers.int4 import Int4Linear
    from flowengine.model.layers.quant_linear import linear

    monkeypatch.delenv("FLOWENGINE_GEMV", raising=False)
    asked = []
    monkeypatch.setattr(gemv, "use_gemv", lambda *args: asked.append(args[:4]) or False)
    n, k = 1536, 1024
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    linear(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16), None)
    w8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    fp8_linear(x, w8, torch.ones(n, device="cuda"), None)
    for act_order in (False, True):
        layer = Int4Linear(k, n, False, 128, act_order, torch.bfloat16).cuda()
        layer.qweight.zero_()
        layer.qzeros.zero_()
        layer.scales.fill_(1)
        if act_order:
            layer.g_idx.copy_(torch.arange(k, dtype=torch.int32) // 128)
        layer(x)
    assert asked == [("dense", 1, n, k), ("fp8", 1, n, k), ("w4a16", 1, n, k),
                     ("w4a16_act", 1, n, k)]
