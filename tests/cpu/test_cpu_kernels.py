"""The per-layer C operations of a CPU decode step (flowengine/model/layers/cpu_kernels.py)
against the torch code they replace: RMSNorm (with and without the residual add),
SiLU-and-mul, rotary embedding on views of a fused qkv row, the KV-cache write, and the
all-decode short path of the CPU attention backend (cache writes included)."""

from __future__ import annotations

import pytest
import torch

from flowengine.model.attention.cpu_backend import CpuAttentionBackend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from flowengine.model.layers import cpu_kernels
from flowengine.model.layers.quant_linear import kernels_available
from flowengine.model.layers.rms_norm import RMSNorm
from flowengine.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not kernels_available() or not cpu_kernels.ENABLED,
                                reason="flowengine._cpu_ops not built")


def _torch_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _one_and_two_threads(fn):
    """fn() with torch's intra-op threads at 1, then 2 (restored after)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(2)
        two = fn()
    finally:
        torch.set_num_threads(threads)
    return one, two


@pytest.mark.parametrize("t", [1, 3, 40, 300])
def test_rms_norm_and_add(t):
    """The 300-row case (173K values, a prefill) splits its rows among two threads and
    equals the one-thread result bit for bit."""
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    x, res = torch.randn(t, 576) * 3, torch.randn(t, 576)
    with torch.inference_mode():
        out = norm(x)
        out2, res2 = norm.add_and_norm(x, res)
        w = norm.weight.detach()
        one, two = _one_and_two_threads(lambda: cpu_kernels.rms_norm(x, w, 1e-5, res))
        alone = _one_and_two_threads(lambda: cpu_kernels.rms_norm(x, w, 1e-5))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert torch.equal(one[0], out2) and torch.equal(one[1], res2)
    assert torch.equal(alone[0][0], alone[1][0]) and torch.equal(alone[0][0], out)
    torch.testing.assert_close(out, _torch_norm(x, norm.weight.detach(), 1e-5),
                               rtol=2e-6, atol=2e-6)
    assert torch.equal(res2, x + res)  # one float32 add: exact
    torch.testing.assert_close(out2, _torch_norm(x + res, norm.weight.detach(), 1e-5),
                               rtol=2e-6, atol=2e-6)


def test_rms_norm_declines_other_inputs():
    w = torch.ones(64)
    with torch.inference_mode():
        assert cpu_kernels.rms_norm(torch.randn(2, 64).to(torch.bfloat16), w, 1e-6) is None
        assert cpu_kernels.rms_norm(torch.randn(64, 2).t(), w, 1e-6) is None  # strided
        assert cpu_kernels.rms_norm(torch.randn(2, 32), w, 1e-6) is None  # width


@pytest.mark.parametrize("t,i", [(1, 1536), (7, 17), (300, 1536)])
def test_silu_and_mul_matches_torch(t, i):
    """The C body against float64 silu(gate) * up: its exp is within ~2e-7 relative, so
    3e-7 of each value plus float32 rounding bounds it; the 300-row case (460K
    elements) splits its rows among two threads, and equals the one-thread result."""
    from flowengine.model.layers.activation import silu_and_mul

    gate_up = torch.randn(t, 2 * i) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    with torch.inference_mode():
        out = silu_and_mul(gate_up)
        one, two = _one_and_two_threads(lambda: cpu_kernels.silu_and_mul(gate_up))
    assert out.shape == (t, i) and out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= 5e-7 * ref.abs() + 1e-30).all()
    assert torch.equal(one, two) and torch.equal(one, out)


def test_silu_and_mul_declines_other_inputs():
    with torch.inference_mode():
        assert cpu_kernels.silu_and_mul(torch.randn(2, 64).to(torch.bfloat16)) is None
        assert cpu_kernels.silu_and_mul(torch.randn(64, 2).t()) is None  # strided
        assert cpu_kernels.silu_and_mul(torch.randn(2, 63)) is None  # odd width
    assert cpu_kernels.silu_and_mul(torch.randn(2, 64)) is None  # autograd on


@pytest.mark.parametrize("t,i", [(1, 1536), (3, 23), (300, 1536)])
def test_silu_and_mul_bf16_is_the_float32_body_rounded_once(t, i):
    """bf16 in and out: the float32 body on the widened values, rounded once as torch
    rounds, bit for bit (odd widths run the scalar tail); NaN, infinities and values
    whose exp overflows included; the 300-row case split over two threads."""
    gate_up = (torch.randn(t, 2 * i) * 6).to(torch.bfloat16)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -200.0, 200.0, 0.0,
                            -0.0, 1e-38], dtype=torch.bfloat16)
    flat = gate_up.view(-1)
    flat[: min(flat.numel(), 8)] = special[: min(flat.numel(), 8)]
    flat[-min(flat.numel(), 8):] = special[: min(flat.numel(), 8)]
    with torch.inference_mode():
        expected = cpu_kernels.silu_and_mul(gate_up.float()).to(torch.bfloat16)
        one, two = _one_and_two_threads(lambda: cpu_kernels.silu_and_mul_bf16(gate_up))
    assert one.dtype == torch.bfloat16 and one.shape == (t, i)
    same = (one.view(torch.int16) == expected.view(torch.int16)) | (one.isnan() & expected.isnan())
    assert bool(same.all())
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))


def test_silu_and_mul_bf16_declines_other_inputs():
    with torch.inference_mode():
        assert cpu_kernels.silu_and_mul_bf16(torch.randn(2, 64)) is None  # float32
        assert cpu_kernels.silu_and_mul_bf16(
            torch.randn(64, 2).to(torch.bfloat16).t()) is None  # strided
        assert cpu_kernels.silu_and_mul_bf16(torch.randn(2, 63).to(torch.bfloat16)) is None
    assert cpu_kernels.silu_and_mul_bf16(torch.randn(2, 64).to(torch.bfloat16)) is None


@pytest.mark.parametrize("t", [1, 5, 200])
def test_rotary_on_fused_qkv_views(t):
    """The 200-row case (115K values of q) splits its rows among two threads and equals
    the one-thread result bit for bit."""
    hq, hkv, d = 9, 3, 64
    rope = RotaryEmbedding(d, 512, 10000.0, None)
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    positions = torch.randint(0, 512, (t,))
    with torch.inference_mode():
        q2, k2 = rope.rotate_qk(positions, q, k)
        ref_q, ref_k = rope._rotate(positions, q), rope._rotate(positions, k)
    assert q2.is_contiguous() and k2.is_contiguous()
    torch.testing.assert_close(q2, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k2, ref_k, rtol=1e-6, atol=1e-6)
    with torch.inference_mode():
        one, two = _one_and_two_threads(
            lambda: cpu_kernels.rope_neox(positions, q, k, rope.cos_sin_cache))
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    with torch.inference_mode(), pytest.raises(IndexError, match="512"):
        cpu_kernels.rope_neox(torch.tensor([512] * t), q, k, rope.cos_sin_cache)


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.float16, torch.float16)])
def test_write_kv_cache_matches_reference(dtype, cache_dtype):
    """K/V rows into their slots, as torch's index_copy_ (write_kv_cache in
    torch_backend.py) writes them: float32 rows into a bf16 or float16 cache rounded in
    C to the same bits as torch's conversion."""
    hkv, d = 3, 64
    cache = torch.randn(2, 6, 16, hkv, d).to(cache_dtype)
    ref = cache.clone()
    kv = torch.randn(4, 2 * hkv * d).to(dtype)  # K and V as views of one row each
    k, v = kv[:, :hkv * d].view(4, hkv, d), kv[:, hkv * d:].view(4, hkv, d)
    slots = torch.tensor([17, -1, 95, 0])
    assert cpu_kernels.write_kv_cache(k, v, cache, slots)
    write_kv_cache(k, v, ref, slots)
    assert torch.equal(cache, ref)
    with pytest.raises(IndexError, match="96"):
        cpu_kernels.write_kv_cache(k, v, cache, torch.tensor([0, 1, 96, 2]))
    assert torch.equal(cache, ref)  # nothing written
    assert not cpu_kernels.write_kv_cache(k.double(), v.double(), cache, slots)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_write_kv_cache_rounds_as_torch(cache_dtype):
    """The C rounding of float32 into float16 / bf16 against torch's conversion, bit for
    bit: ties to even, float16 subnormals and underflow to zero, overflow to infinity
    from 65520 up (65504 the largest float16), infinities, NaN, signed zeros, and fresh
    random values over float16's and bf16's whole range."""
    finfo = torch.finfo(torch.float16)
    edge = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e6,
                         float("inf"), float("-inf"), finfo.tiny, finfo.tiny * 0.75,
                         2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0001, 2.0 ** -26, 3e-8,
                         1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -20,
                         1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3e38, -3e38])
    g = torch.Generator().manual_seed(7)
    mag = torch.exp2(torch.empty(4096 - edge.numel()).uniform_(-30, 20, generator=g))
    signs = torch.where(torch.rand(mag.shape, generator=g) < 0.5, -1.0, 1.0)
    vals = torch.cat([edge, mag * signs]).reshape(-1, 1, 64)  # [64 tokens, 1 head, 64]
    n = vals.shape[0]
    cache = torch.zeros(2, 4, 16, 1, 64, dtype=cache_dtype)
    slots = torch.arange(n)
    assert cpu_kernels.write_kv_cache(vals, -vals, cache, slots)
    want = vals.to(cache_dtype)
    got_k, got_v = cache[0].reshape(n, 1, 64), cache[1].reshape(n, 1, 64)
    assert torch.equal(got_k.view(torch.int16), want.view(torch.int16))
    assert torch.equal(got_v.view(torch.int16), (-vals).to(cache_dtype).view(torch.int16))
    nan = torch.full((1, 1, 64), float("nan"))
    assert cpu_kernels.write_kv_cache(nan, nan, cache, torch.tensor([0]))
    assert cache[0, 0, 0].isnan().all() and cache[1, 0, 0].isnan().all()


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16)])
def test_all_decode_step_short_path_matches_reference(dtype, cache_dtype):
    hq, hkv, d, block = 6, 2, 32, 16
    cache = torch.randn(2, 12, block, hkv, d).to(cache_dtype)
    cache_ref = cache.clone()
    lens = [20, 33, 5]
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    bt = torch.tensor([[0, 1, 0], [2, 3, 4], [5, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([16 + 3, 4 * block + 0, 5 * block + 4])
    seq = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(qsl, seq, bt, slots, 1, 33, qsl, seq)
    q = torch.randn(3, hq, d).to(dtype)
    kv = torch.randn(3, 2 * hkv * d).to(dtype)
    k, v = kv[:, :hkv * d].view(3, hkv, d), kv[:, hkv * d:].view(3, hkv, d)
    backend = CpuAttentionBackend()
    out = backend.forward(q, k, v, cache, meta, d ** -0.5)
    assert meta._cpu_decode_plan is not None  # the short path ran
    out_again = backend.forward(q, k, v, cache, meta, d ** -0.5)  # the cached plan
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, d ** -0.5)
    assert torch.equal(cache, cache_ref)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=8e-3)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    assert torch.equal(out, out_again)


def test_no_pool_runs_the_split_rows_in_openmp():
    """FLOWENGINE_CPU_NO_POOL=1 (read once per process: a subprocess) runs the split
    row-wise operations in an OpenMP region instead of the extension's pool, with the
    same bits as the pool."""
    import os
    import subprocess
    import sys

    code = (
        "import torch; torch.manual_seed(0); torch.set_num_threads(2)\n"
        "from flowengine.model.layers import cpu_kernels as ck\n"
        "x = torch.randn(300, 576); w = torch.rand(576) + 0.5\n"
        "with torch.inference_mode(): out, _ = ck.rms_norm(x, w, 1e-5)\n"
        "import sys; sys.stdout.buffer.write(out.numpy().tobytes())\n")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                           env={**os.environ, "FLOWENGINE_CPU_NO_POOL": flag})
            for flag in ("1", "0")]
    for r in runs:
        assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert len(runs[0].stdout) == 300 * 576 * 4 and runs[0].stdout == runs[1].stdout
