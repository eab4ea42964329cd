"""Decode GEMVs (kernels/gemv.py) against float32 torch references: dense (float16 /
bfloat16 / float32 weights), FP8 E4M3 per-channel and W4A16 (GPTQ / AWQ canonical
layout, with and without act-order), M in 1..8, on CPU under TRITON_INTERPRET=1 (small
shapes), on CUDA otherwise.

Tolerance, per element: the kernels take products and sums in float32 and round the
output once to x's dtype, so |y - y_ref| <= eps * |y_ref| + 2**-16 * (|x| @ |W|^T) +
1e-5, eps the unit roundoff of x's dtype (2**-11 float16, 2**-8 bfloat16, 0 float32);
2**-16 covers float32 summation over K <= 1024 in any order (K 2**-24 = 2**-14 worst
case, ~sqrt(K) 2**-24 in practice). For W4A16 without act-order the kernel sums
s (sum q x - z sum x): |W| is then bounded by (|q| + |z|) s, not |q - z| s.
"""

from __future__ import annotations

import pytest
import torch

from flowengine.kernels.gemv import dense_gemv, use_gemv, w4a16_gemv
from flowengine.kernels.w4a16 import w4a16_reference

UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 0.0}
SUM_EPS = 2.0**-16


def _poisoned_check(out, ref, bound):
    assert not torch.isnan(out).any(), "output has NaN (an unwritten element?)"
    err = (out.float() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3e}"


def _dtypes(device):
    # The interpreter on CPU has no bfloat16 arithmetic in numpy.
    return [torch.float16, torch.float32] if device.type == "cpu" else [
        torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize(("m", "n", "k", "split"), [(1, 48, 256, 2), (3, 40, 192, 1),
                                                    (8, 64, 320, 3), (1, 17, 100, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_gemv_matches_reference(m, n, k, split, bias, device):
    for dtype in _dtypes(device):
        x = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        b = torch.randn(n, device=device).to(dtype) if bias else None
        out = dense_gemv(x, w, b, config=(16, 64, split, 4, 2))
        ref = x.float() @ w.float().t() + (b.float() if bias else 0)
        bound = UNIT[dtype] * ref.abs() + SUM_EPS * (x.float().abs() @ w.float().abs().t()
                                                     ) + 1e-5
        assert out.shape == (m, n) and out.dtype == dtype
        _poisoned_check(out, ref, bound)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 256), (5, 32, 192)])
def test_fp8_gemv_matches_reference(m, n, k, device):
    w = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, device=device) * 0.01 + 1e-3
    for dtype in _dtypes(device):
        x = torch.randn(m, k, device=device).to(dtype)
        out = dense_gemv(x, w, None, scale, config=(16, 64, 2, 4, 2))
        wf = w.float() * scale[:, None]
        ref = x.float() @ wf.t()
        bound = UNIT[dtype] * ref.abs() + SUM_EPS * (x.float().abs() @ wf.abs().t()) + 1e-5
        _poisoned_check(out, ref, bound)


def _random_int4(n, k, group_size, act_order, device):
    groups = -(-k // group_size)
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device)
    qzeros = torch.randint(0, 17, (groups, n), dtype=torch.uint8, device=device)
    scales = (torch.rand(groups, n, device=device) * 0.02 + 0.005).to(torch.float16)
    g_idx = None
    if act_order:
        plain = torch.arange(k, device=device, dtype=torch.int32) // group_size
        g_idx = plain[torch.randperm(k, device=device)].contiguous()
    return qweight, scales, qzeros, g_idx


@pytest.mark.parametrize(("m", "n", "k", "group_size", "split", "block_k"), [
    (1, 64, 256, 128, 2, 128), (1, 40, 384, 128, 1, 64), (4, 64, 256, 64, 2, 64),
    (8, 32, 512, 128, 3, 128), (2, 48, 96, 32, 1, 32)])
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_gemv_matches_reference(m, n, k, group_size, split, block_k, act_order, device):
    qweight, scales, qzeros, g_idx = _random_int4(n, k, group_size, act_order, device)
    for dtype in _dtypes(device):
        x = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(n, device=device).to(dtype)
        out = w4a16_gemv(x, qweight, scales, qzeros, g_idx, group_size, b,
                         config=(16, block_k, split, 4, 2))
        ref = w4a16_reference(x, qweight, scales, qzeros, g_idx, group_size, b)
        q_abs = w4a16_reference(x.float().abs(), qweight, scales, torch.zeros_like(qzeros),
                                g_idx, group_size)  # |x| @ (q s)
        z_abs = w4a16_reference(x.float().abs(), torch.zeros_like(qweight), scales, qzeros,
                                g_idx, group_size).neg()  # |x| @ (z s)
        bound = UNIT[dtype] * ref.abs() + SUM_EPS * (q_abs + z_abs) + 1e-5
        _poisoned_check(out, ref, bound)


@pytest.mark.parametrize(("m", "split"), [(1, 1), (1, 4), (3, 2), (8, 3)])
def test_split_k_finished_in_kernel_equals_the_reduce_launch(m, split, device, monkeypatch):
    """The in-kernel split-K finish (the last program of a tile adds the partials, bias
    and cast) gives the bits of the separate reduce launch, and leaves every tile counter
    at zero for the next call (a CUDA graph replays it as is)."""
    from flowengine.kernels import gemv

    n, k, group = 80, 512, 128
    qweight, scales, qzeros, _ = _random_int4(n, k, group, False, device)
    weight = torch.randn(n, k, device=device).to(torch.float16)
    x = torch.randn(m, k, device=device).to(torch.float16)
    b = torch.randn(n, device=device).to(torch.float16)

    def both():
        return (w4a16_gemv(x, qweight, scales, qzeros, None, group, b,
                           config=(16, 128, split, 4, 2)),
                dense_gemv(x, weight, b, config=(16, 128, split, 4, 2)))

    monkeypatch.setattr(gemv, "_FUSED_FINISH", False)
    reference = both()
    monkeypatch.setattr(gemv, "_FUSED_FINISH", True)
    for _ in range(2):
        for got, want in zip(both(), reference, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    counters = gemv._counters[x.device]
    assert int(counters.count_nonzero()) == 0


def test_gemv_rejects_bad_shapes(device):
    x = torch.randn(9, 64, device=device)
    with pytest.raises(ValueError):
        dense_gemv(x, torch.randn(16, 64, device=device))
    with pytest.raises(ValueError):
        dense_gemv(torch.randn(2, 64, device=device), torch.randn(16, 72, device=device))


def test_committed_tables_are_well_formed():
    """Every kernels/configs gemv table (benchmarks/gemv_gpu.py's output): keys
    format,M bucket,N,K; a launchable config; `faster` only where the sweep measured
    the GEMV below the current path."""
    import glob
    import os

    from flowengine.kernels import gemv

    paths = glob.glob(os.path.join(gemv._CONFIG_DIR, "gemv,device_name=*.json"))
    assert paths
    for path in paths:
        device_name = os.path.basename(path)[len("gemv,device_name="):-len(".json")]
        table = gemv._load_table(device_name)
        assert table, path
        for key, entry in table.items():
            fmt, bucket, n, k = key.split(",")
            assert fmt in ("dense", "fp8", "w4a16", "w4a16_act") and bucket in ("1", "8")
            assert int(n) > 0 and int(k) > 0
            for name in ("block_n", "block_k", "split_k", "num_warps", "num_stages"):
                assert entry[name] >= 1, (key, name)
            if fmt.startswith("w4a16"):
                assert 128 % entry["block_k"] == 0, key  # a step within one group
            if entry["faster"]:
                assert entry["gemv_us"] <= entry["current_us"] and entry["rel_err"] < 1e-2, key


def test_the_h100_table_routes_what_its_sweep_measured(monkeypatch):
    """use_gemv over the committed H100 table, as the layers ask it (N, K order; format
    names; row buckets): FP8 and W4A16 at one row on Llama-3.1-8B's projections, bf16
    only on the LM head, nothing at 2-8 rows and nothing with act-order."""
    from flowengine.kernels import gemv

    monkeypatch.delenv("FLOWENGINE_GEMV", raising=False)
    monkeypatch.setattr(gemv, "_device_name", lambda device: "NVIDIA_H100_80GB_HBM3")
    cuda = torch.device("cuda", 0)  # constructible without a GPU; only its type is read
    projections = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    for n, k in projections:
        assert gemv.use_gemv("fp8", 1, n, k, cuda), (n, k)
        assert gemv.use_gemv("w4a16", 1, n, k, cuda), (n, k)
        assert not gemv.use_gemv("dense", 1, n, k, cuda), (n, k)
        assert not gemv.use_gemv("w4a16_act", 1, n, k, cuda), (n, k)
        for m in (2, 8):
            assert not gemv.use_gemv("fp8", m, n, k, cuda), (m, n, k)
        assert not gemv.use_gemv("fp8", 1, k, n, cuda) or n == k  # (K, N) is not a key
    assert gemv.use_gemv("dense", 1, 128256, 4096, cuda)  # the LM head
    assert gemv.gemv_config("fp8", 1, 28672, 4096, cuda) == (8, 512, 1, 4, 3)


def test_use_gemv_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("FLOWENGINE_GEMV", "1")
    assert use_gemv("dense", 1, 64, 64, cpu) and use_gemv("fp8", 8, 64, 64, cpu)
    assert not use_gemv("dense", 9, 64, 64, cpu)  # past GEMV_MAX_M
    monkeypatch.setenv("FLOWENGINE_GEMV", "0")
    assert not use_gemv("dense", 1, 128256, 4096, cpu)
    monkeypatch.delenv("FLOWENGINE_GEMV")
    assert not use_gemv("dense", 1, 128256, 4096, cpu)  # tables are per CUDA device
