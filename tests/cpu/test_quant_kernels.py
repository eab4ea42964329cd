"""The quantized-weight kernels (flowengine/_cpu_ops.c) against torch references.

Per format (Q4_0, Q4_1, Q8_0): blocks made by gguf's own quantizer from fresh random
weights; dequantization must equal gguf.quants.dequantize bit for bit, matmuls must
match float64 over the dequantized matrix within float32 rounding (stated below), for
one row (decode), 2..8 rows (the register-blocked kernel), 9..16 rows (two passes) and
more (dequantize + GEMM), with float32 and bfloat16 inputs; embedding rows exactly.
The portable C body (no AVX-512) is checked the same way in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flowengine.executor.cpu_threads import cpu_flags
from flowengine.model.layers.quant_linear import (
    DEQUANT_MIN_ROWS,
    QuantizedWeight,
    kernels_available,
    pack_gguf_blocks,
    quantize_q8_0,
)

pytestmark = pytest.mark.skipif(not kernels_available(), reason="flowengine._cpu_ops not built")
_needs_vnni = pytest.mark.skipif(
    not kernels_available()
    or "avx512-vnni" not in __import__("flowengine._cpu_ops", fromlist=["x"]).linear_path(1),
    reason="no AVX512-VNNI on this CPU")

FORMATS = ["q4_0", "q4_1", "q8_0"]
# |ours - float64| <= REL_TOL * sqrt(K) * max|x| * max|w|: float32 sums of K products in
# another order than the reference's (errors measured about 10x below this bound).
REL_TOL = 2e-5


def _gguf_weight(fmt: str, n: int, k: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random [n, k] weight through gguf's quantizer: (ours, gguf's dequantized values)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 1.0, (n, 1)).astype(
        np.float32)
    qtype = getattr(GGMLQuantizationType, fmt.upper())
    raw = quantize(w, qtype)
    ref = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(n, k))
    packed = pack_gguf_blocks(raw, fmt, k)
    return QuantizedWeight(fmt, packed.qs, packed.scales), ref


def _run_ok(script: str, env_name: str, env_value: str, more_env: dict | None = None,
            **fields) -> None:
    """Run `script` (a template with {here} and `fields`) in a fresh interpreter with
    one environment variable set (and `more_env`: the C extension reads its switches
    once, at first use); the script must print "ok"."""
    env = dict(os.environ, **{env_name: env_value}, **(more_env or {}))
    code = script.format(here=os.path.dirname(os.path.abspath(__file__)), **fields)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_gguf(fmt):
    seed = int(torch.randint(0, 2**31, ()).item())
    weight, ref = _gguf_weight(fmt, 77, 320, seed)
    out = weight.dequantize()
    assert out.dtype == torch.float32 and out.shape == (77, 320)
    assert torch.equal(out, ref), f"seed {seed}"
    # straight to bf16 in one pass: torch's rounding of the same values, bit for bit
    out16 = weight.dequantize(torch.bfloat16)
    assert out16.dtype == torch.bfloat16 and out16.shape == (77, 320)
    assert torch.equal(out16.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 17, 33, 70, DEQUANT_MIN_ROWS + 1])
def test_matmul_matches_float64(fmt, rows):
    seed = int(torch.randint(0, 2**31, ()).item())
    n, k = 83, 576  # n not a multiple of 16: a thread's last rows are partial
    weight, ref = _gguf_weight(fmt, n, k, seed)
    x = torch.randn(rows, k)
    bias = torch.randn(n)
    out = weight.matmul(x, bias)
    expected = x.double() @ ref.double().t() + bias.double()
    bound = REL_TOL * k ** 0.5 * x.abs().max().item() * ref.abs().max().item()
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    err = (out.double() - expected).abs().max().item()
    assert err <= bound, f"seed {seed}: error {err} > {bound}"


_ROW_TILES = """
import torch, sys
sys.path.insert(0, {here!r})
from test_quant_kernels import _gguf_weight, REL_TOL
for fmt in ("q4_0", "q4_1", "q8_0"):
    for k in (576, 1536):
        seed = {seed}
        weight, ref = _gguf_weight(fmt, 150, k, seed)  # 3 weight blocks, a short last one
        x = torch.randn(40, k, generator=torch.Generator().manual_seed(seed))
        out = weight.matmul(x)
        parts = torch.cat([weight.matmul(x[i:i + 8]) for i in range(0, 40, 8)])
        assert torch.equal(out, parts), (fmt, k, seed)
        expected = x.double() @ ref.double().t()
        bound = REL_TOL * k ** 0.5 * x.abs().max().item() * ref.abs().max().item()
        assert (out.double() - expected).abs().max().item() <= bound, (fmt, k, seed)
print("ok")
"""


def test_row_tiles_same_bits_as_untiled():
    """The row-tiled float32 body (FLOWENGINE_CPU_PANEL_MIN_ROWS=0: no panels) runs more
    than a tile's rows (40 KB of activations: 16 rows of 576 features, 8 of 1536) tile by
    tile over blocks of 64 weight rows; every output is summed in the same order, so 40
    rows at once equal five calls of 8 rows bit for bit, and the rows above a tile match
    float64."""
    _run_ok(_ROW_TILES, "FLOWENGINE_CPU_PANEL_MIN_ROWS", "0",
            seed=int(torch.randint(0, 2**31, ()).item()))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [576, 1536])
def test_panel_rows_same_bits_in_any_split(fmt, k):
    """From PANEL_MIN_ROWS (14) activation rows the float32 matmul runs the panel body:
    16 weight rows dequantized and transposed, every output one float32 chain over k in
    order, whichever tile of 16 activation rows it falls in. So 40 rows at once equal
    20 + 20 and 14 + 26 bit for bit, with 150 weight rows (a short last panel), and
    match float64."""
    seed = int(torch.randint(0, 2**31, ()).item())
    weight, ref = _gguf_weight(fmt, 150, k, seed)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(seed))
    out = weight.matmul(x)
    assert torch.equal(out, torch.cat([weight.matmul(x[:20]), weight.matmul(x[20:])]))
    assert torch.equal(out, torch.cat([weight.matmul(x[:14]), weight.matmul(x[14:])]))
    expected = x.double() @ ref.double().t()
    bound = REL_TOL * k ** 0.5 * x.abs().max().item() * ref.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= bound, f"seed {seed}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_panel_blocks_of_activation_rows_same_bits(fmt):
    """Above PANEL_BLOCK_ROWS (512) activation rows the panel body runs block by block
    (each panel dequantized once per block): 1,100 rows (blocks of 512, 512 and 76, the
    last tile short) equal 40-row calls bit for bit, and match float64."""
    seed = int(torch.randint(0, 2**31, ()).item())
    weight, ref = _gguf_weight(fmt, 150, 576, seed)
    x = torch.randn(1100, 576, generator=torch.Generator().manual_seed(seed))
    out = weight.matmul(x)
    assert torch.equal(out, torch.cat([weight.matmul(c) for c in x.split(40)])), f"seed {seed}"
    expected = x.double() @ ref.double().t()
    bound = REL_TOL * 576 ** 0.5 * x.abs().max().item() * ref.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= bound, f"seed {seed}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_bf16_input_and_leading_dims(fmt):
    weight, ref = _gguf_weight(fmt, 40, 64, int(torch.randint(0, 2**31, ()).item()))
    x = torch.randn(3, 2, 64).to(torch.bfloat16)
    out = weight.matmul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 2, 40)
    x2 = x.double().reshape(6, 64)
    expected = (x2 @ ref.double().t()).reshape(3, 2, 40)
    # bf16 in and out (and, where the CPU has AMX, the weights rounded to bf16 for 6
    # rows: bf16_rows): a few bf16 ulps of the row's scale
    scale = (x2.abs() @ ref.double().abs().t()).max().item()
    assert (out.double() - expected).abs().max().item() <= 2e-2 * scale


def test_every_format_has_bf16_thresholds():
    import flowengine.model.layers.quant_linear as ql

    assert (set(ql.BF16_GEMM_MIN_ROWS) == set(ql.FORMATS) == set(ql.AMX_ROWS)
            == set(ql.AMX_BF16_MIN_ROWS))
    # the AMX bodies hand over to the GEMM above where they start, past the VNNI rows
    assert all(1 < a < g for a, g in ql.AMX_ROWS.values())
    assert all(1 < ql.AMX_BF16_MIN_ROWS[f] < g for f, (_, g) in ql.AMX_ROWS.items())


@pytest.mark.parametrize("int8", [True, False])
def test_amx_rows_follow_the_int8_body(int8, monkeypatch):
    """Where the AMX-INT8 body runs, the AMX bodies start at AMX_ROWS; where it does
    not (FLOWENGINE_CPU_NO_AMX_INT8=1, no AMX-INT8), the AMX-BF16 body starts where it
    beat the float32 kernel, AMX_BF16_MIN_ROWS."""
    import flowengine.model.layers.quant_linear as ql

    monkeypatch.setattr(ql, "amx_int8_max_rows", lambda: 8 if int8 else 0)
    for fmt in ql.FORMATS:
        start = ql.AMX_ROWS[fmt][0] if int8 else ql.AMX_BF16_MIN_ROWS[fmt]
        assert ql.amx_rows(fmt) == (start, ql.AMX_ROWS[fmt][1])


_has_amx = kernels_available() and __import__("flowengine._cpu_ops", fromlist=["x"]).has_amx()
_needs_amx = pytest.mark.skipif(not _has_amx, reason="no AMX-BF16 on this CPU")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("native_bf16,amx", [(True, True), (True, False), (False, False)])
def test_bf16_rows_take_bf16_products_where_native(fmt, native_bf16, amx, monkeypatch):
    """bf16 activations on a CPU with native bf16 GEMMs: from bf16_rows(fmt)[1] rows one
    bf16 GEMM over the weights rounded to bf16 (exactly F.linear of those); with AMX,
    from bf16_rows(fmt)[0] rows the AMX body (the same products, float32 sums in the
    tile unit's order); else the float32 kernel (its float32 result rounded once to
    bf16); all within bf16 rounding of float64."""
    import flowengine.model.layers.quant_linear as ql

    if amx and not _has_amx:
        pytest.skip("no AMX-BF16 on this CPU")
    monkeypatch.setattr(ql, "_NATIVE_BF16", native_bf16)
    monkeypatch.setattr(ql, "_HAS_AMX", amx)
    weight, ref = _gguf_weight(fmt, 72, 128, int(torch.randint(0, 2**31, ()).item()))
    rows = ql.bf16_rows(fmt)
    assert rows == ((ql.amx_rows(fmt) if amx else (0, ql.BF16_GEMM_MIN_ROWS[fmt]))
                    if native_bf16 else None)
    counts = {1, 2 * ql.BF16_GEMM_MIN_ROWS[fmt]}
    if rows:
        counts |= {rows[1] - 1, rows[1]} | ({rows[0] - 1, rows[0]} if rows[0] else set())
    for m in sorted(counts):
        x = torch.randn(m, 128).to(torch.bfloat16)
        bias = torch.randn(72).to(torch.bfloat16)
        out = weight.matmul(x, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (m, 72)
        float32_path = (weight.matmul(x.float()) + bias.float()).to(torch.bfloat16)
        if rows and m >= rows[1]:
            bf16_gemm = torch.nn.functional.linear(x, ref.to(torch.bfloat16), bias)
            assert torch.equal(out, bf16_gemm), m
        elif rows and rows[0] and m >= rows[0]:
            from flowengine import _cpu_ops

            amx_body, xf = torch.empty(m, 72), x.float()
            _cpu_ops.linear(ql.FORMATS[fmt][0], xf.data_ptr(), m, 128,
                            weight.qs.data_ptr(), weight.scales.data_ptr(), 72,
                            amx_body.data_ptr(), torch.get_num_threads(), 1)
            assert torch.equal(out, (amx_body + bias.float()).to(torch.bfloat16)), m
        else:
            assert torch.equal(out, float32_path), m
        expected = x.double() @ ref.double().t() + bias.double()
        # bf16 inputs and output: a few bf16 ulps of the row's scale.
        scale = (x.double().abs() @ ref.double().abs().t()).max().item()
        assert (out.double() - expected).abs().max().item() <= 2e-2 * scale, m


@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_over_bf16_gemms_is_the_float32_route_bit_for_bit(fmt, monkeypatch):
    """An MLP whose two matmuls both take the bf16 GEMM (--dtype bfloat16, a prefill of
    >= bf16_rows(fmt)[1] rows) keeps the gate_up product bf16: the same bits as the
    float32 route (gate_up in float32, SiLU-and-mul in float32, down rounding its input
    to bf16). Below the threshold, or without bf16 GEMMs, it declines."""
    import flowengine.model.layers.quant_linear as ql
    from flowengine.model.layers import cpu_kernels
    from flowengine.model.layers.activation import silu_and_mul

    if not cpu_kernels.ENABLED:
        pytest.skip("the C operations are off")
    monkeypatch.setattr(ql, "_NATIVE_BF16", True)  # F.linear in bf16 runs anywhere
    seed = int(torch.randint(0, 2**31, ()).item())
    gate_up, _ = _gguf_weight(fmt, 2 * 96, 64, seed)
    down, _ = _gguf_weight(fmt, 64, 96, seed + 1)
    for w in (gate_up, down):
        w.bf16_rows = ql.bf16_rows(fmt)
    m = ql.bf16_rows(fmt)[1]
    x = torch.randn(m + 3, 64)
    layers = SimpleNamespace(weight=gate_up, bias=None), SimpleNamespace(weight=down, bias=None)
    with torch.inference_mode():
        chained = ql.swiglu_bf16_gemms(x, *layers)
        routed = down.matmul(silu_and_mul(gate_up.matmul(x)))
        assert chained is not None and chained.dtype == torch.float32
        assert torch.equal(chained, routed)
        assert ql.swiglu_bf16_gemms(x[: m - 1], *layers) is None
        biased = SimpleNamespace(weight=down, bias=torch.zeros(64))
        assert ql.swiglu_bf16_gemms(x, layers[0], biased) is None
        gate_up.bf16_rows = None  # --dtype float32: no bf16 products
        assert ql.swiglu_bf16_gemms(x, *layers) is None
    assert ql.swiglu_bf16_gemms(x, *layers) is None  # autograd on


@_needs_amx
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(72, 128), (48, 576), (200, 1536)])
def test_amx_body_matches_bf16_products(fmt, n, k):
    """The AMX-BF16 body (_cpu_ops.linear with amx_min_rows, the AMX-INT8 body off)
    against float64 over the
    activations and weights rounded to bf16: each product of two bf16 values is exact in
    float32, so only the order of the float32 sums differs (REL_TOL's bound); weight
    rows past a multiple of 16 and 32 (n = 72, 200), activation rows past a tile (5, 17,
    33) and past a block of 256 (300); the same bits with one thread and two."""
    from flowengine import _cpu_ops
    from flowengine.model.layers.quant_linear import FORMATS as codes

    weight, ref = _gguf_weight(fmt, n, k, int(torch.randint(0, 2**31, ()).item()))
    w16 = ref.to(torch.bfloat16).double()
    for m in (1, 5, 16, 17, 33, 300):
        x = torch.randn(m, k) * 3
        outs = []
        for threads in (2, 1):  # two first: its packing's buffer is fresh memory
            out = torch.full((m, n), float("nan"))
            _cpu_ops.linear(codes[fmt][0], x.data_ptr(), m, k, weight.qs.data_ptr(),
                            weight.scales.data_ptr(), n, out.data_ptr(), threads, 1, True)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), m
        expected = x.to(torch.bfloat16).double() @ w16.t()
        bound = REL_TOL * k ** 0.5 * x.abs().max().item() * ref.abs().max().item()
        for out in outs:
            assert (out.double() - expected).abs().max().item() <= bound, (m, fmt)
        # not the float32 kernel's result: the inputs were rounded to bf16
        f32 = x.double() @ ref.double().t()
        assert (outs[0].double() - f32).abs().max().item() > bound, m


@_needs_amx
@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_body_weights_are_the_bf16_rounding_of_the_dequantized_ones(fmt):
    """The AMX-BF16 body's weights bit for bit: with the identity as activations (K rows,
    each product a weight times 1 or 0, each sum one nonzero term: exact), the output
    is the transposed weight panel, which must equal gguf's values rounded to bf16
    (dequantize(bfloat16)). Weight rows past a multiple of 32 (n = 200)."""
    from flowengine import _cpu_ops
    from flowengine.model.layers.quant_linear import FORMATS as codes

    n, k = 200, 128
    weight, ref = _gguf_weight(fmt, n, k, int(torch.randint(0, 2**31, ()).item()))
    x = torch.eye(k)
    out = torch.full((k, n), float("nan"))
    _cpu_ops.linear(codes[fmt][0], x.data_ptr(), k, k, weight.qs.data_ptr(),
                    weight.scales.data_ptr(), n, out.data_ptr(), 2, 1, True)
    expected = ref.to(torch.bfloat16).float().t()
    assert torch.equal(out, expected)
    assert torch.equal(weight.dequantize(torch.bfloat16).float().t(), expected)


_has_amx_int8 = _has_amx and __import__("flowengine._cpu_ops", fromlist=["x"]).has_amx_int8()


def _rounded_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each 32-value block rounded as the AMX-INT8 body rounds it to 16-bit
    integers (float32 arithmetic: s = max|x| / TOP, A = rint(x * (TOP / max|x|)), TOP =
    127 * 256), as float64 s * A."""
    top = 127.0 * 256
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv).double() * (amax / top).double()).view(m, k)


@pytest.mark.skipif(not _has_amx_int8, reason="no AMX-INT8 on this CPU")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(72, 128), (48, 576), (200, 1536), (40, 96)])
def test_amx_int8_body_is_dequantized_weights_times_rounded_activations(fmt, n, k):
    """The AMX-INT8 body (_cpu_ops.linear with amx_min_rows, 1-8 activation rows): the
    integer products are exact, so it equals float64 over the dequantized weights and the
    activations rounded to 16-bit integers per 32-value block within float32's
    order-of-sums bound (REL_TOL), for 1-4 rows (one group of 4) and 5-8 (two); weight
    rows past
    a 16-row panel (n = 72, 200, 40), an odd number of blocks (k = 96: the pair's second
    block missing), a zero block (scale 0); the same bits with one thread and two; and it
    is neither the float32 kernel's result nor the AMX-BF16 body's."""
    from flowengine import _cpu_ops
    from flowengine.model.layers.quant_linear import FORMATS as codes

    weight, ref = _gguf_weight(fmt, n, k, int(torch.randint(0, 2**31, ()).item()))
    for m in (1, 3, 4, 5, 8):
        x = torch.randn(m, k) * 3
        x[0, 32:64] = 0
        outs = []
        for threads in (1, 2):
            out = torch.full((m, n), float("nan"))
            _cpu_ops.linear(codes[fmt][0], x.data_ptr(), m, k, weight.qs.data_ptr(),
                            weight.scales.data_ptr(), n, out.data_ptr(), threads, 1)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), m
        expected = _rounded_blocks(x) @ ref.double().t()
        bound = REL_TOL * k ** 0.5 * x.abs().max().item() * ref.abs().max().item()
        assert (outs[0].double() - expected).abs().max().item() <= bound, (m, fmt)
        # the int8 body ran: not the float32 kernel's bits, not the AMX-BF16 body's
        # products (bf16 weights: far outside the bound)
        others = []
        for amx_min, no_int8 in ((0, False), (1, True)):
            out = torch.full((m, n), float("nan"))
            _cpu_ops.linear(codes[fmt][0], x.data_ptr(), m, k, weight.qs.data_ptr(),
                            weight.scales.data_ptr(), n, out.data_ptr(), 2, amx_min, no_int8)
            others.append(out)
        assert not torch.equal(outs[0], others[0]), m
        assert (outs[0] - others[1]).abs().max().item() > bound, m


@pytest.mark.skipif(not _has_amx_int8, reason="no AMX-INT8 on this CPU")
@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_int8_body_tiny_blocks_and_nan(fmt):
    """The AMX-INT8 body on a row of values near 1e-36 (TOP / max|x| would overflow
    float32 without the body's exact 2^100 pre-scaling): within the rounding bound of
    the exact product; a NaN in one row makes that row's outputs NaN (as the float32
    kernel's) and leaves the other rows as they were."""
    from flowengine import _cpu_ops
    from flowengine.model.layers.quant_linear import FORMATS as codes

    n, k = 40, 128
    weight, ref = _gguf_weight(fmt, n, k, int(torch.randint(0, 2**31, ()).item()))

    def run(x):
        out = torch.full((x.shape[0], n), float("nan"))
        _cpu_ops.linear(codes[fmt][0], x.data_ptr(), x.shape[0], k, weight.qs.data_ptr(),
                        weight.scales.data_ptr(), n, out.data_ptr(), 2, 1)
        return out

    x = torch.randn(4, k)
    x[2] *= 1e-36
    out = run(x)
    exact = x.double() @ ref.double().t()
    for r in range(4):
        scale = x[r].abs().max().item() * ref.abs().sum(1).max().item()
        assert (out[r].double() - exact[r]).abs().max().item() <= 1e-4 * scale, r
    x_nan = x.clone()
    x_nan[1, 5] = float("nan")
    out_nan = run(x_nan)
    assert bool(out_nan[1].isnan().all())
    assert torch.equal(out_nan[[0, 2, 3]], out[[0, 2, 3]])


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_rows_exact(fmt):
    weight, ref = _gguf_weight(fmt, 50, 96, int(torch.randint(0, 2**31, ()).item()))
    ids = torch.tensor([0, 49, 7, 7, 23])
    assert torch.equal(weight.embedding(ids), ref[ids])


def test_matmul_rejects_wrong_width():
    weight, _ = _gguf_weight("q4_1", 8, 64, 0)
    with pytest.raises(ValueError, match="64"):
        weight.matmul(torch.randn(1, 32))


def test_empty_batch():
    weight, _ = _gguf_weight("q8_0", 8, 64, 0)
    assert weight.matmul(torch.randn(0, 64)).shape == (0, 8)


def test_online_int8_round_trip():
    w = torch.randn(33, 128) * torch.rand(33, 1)
    w[3, :32] = 0  # an all-zero block: scale 0, weights 0
    packed = quantize_q8_0(w)
    weight = QuantizedWeight("q8_0", packed.qs, packed.scales)
    deq = weight.dequantize()
    blocks = w.view(33, 4, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127  # one quantization step per block
    err = (deq.view(33, 4, 32) - blocks).abs()
    # Half a step of rounding, plus the float16 rounding of the scale: 127 |d16 - d|
    # (<= 127 * 2^-11 d for a normal float16; more where d < 2^-14 is subnormal, e.g.
    # d = 7.7e-6 for a row scaled by a small torch.rand: the test failed ~1 run in 15)
    d16 = packed.scales.float().view(33, 4, 1)
    assert bool((err <= step * (0.5 + 2.0 ** -11) + 127 * (d16 - step).abs() + 1e-7).all())
    assert torch.equal(deq[3, :32], torch.zeros(32))
    x = torch.randn(4, 128)
    from flowengine import _cpu_ops
    if _cpu_ops.linear_path(4) == "avx2-int16-panels":  # x rounded to 16 bits per block
        err = (weight.matmul(x).double() - x.double() @ deq.double().t()).abs()
        assert bool((err <= _rounding_bound(x, deq, 32767, "q8_0")).all())
    else:
        torch.testing.assert_close(weight.matmul(x), x @ deq.t(), rtol=1e-5, atol=1e-5)


_PORTABLE = """
import os
os.environ["FLOWENGINE_CPU_NO_AVX2"] = "1"  # read at the extension's first use
import numpy as np, torch, sys
sys.path.insert(0, {here!r})
from test_quant_kernels import _gguf_weight
from flowengine import _cpu_ops
assert not _cpu_ops.has_avx512()
assert _cpu_ops.linear_path(1) == "c", _cpu_ops.linear_path(1)
for fmt in ("q4_0", "q4_1", "q8_0"):
    w, ref = _gguf_weight(fmt, 19, 96, 5)
    assert torch.equal(w.dequantize(), ref), fmt
    assert torch.equal(w.dequantize(torch.bfloat16).view(torch.int16),
                       ref.to(torch.bfloat16).view(torch.int16)), fmt
    for rows in (1, 3, 11):
        x = torch.randn(rows, 96)
        err = (w.matmul(x).double() - x.double() @ ref.double().t()).abs().max().item()
        assert err < 1e-4, (fmt, rows, err)
print("ok")
"""


def test_portable_body_without_avx512():
    _run_ok(_PORTABLE, "FLOWENGINE_CPU_NO_AVX512", "1")


# The AVX2 float32 bodies (CPUs without AVX-512; forced here with
# FLOWENGINE_CPU_NO_AVX512=1, the int16 body off with FLOWENGINE_CPU_INT16_MIN_ROWS=0):
# every format, 3 and 5 blocks per row, 37 weight rows (a short last panel of 5); the
# row body's counts around its groups of 4, and from 12 rows the panel body's tiles of
# 6 rows with every remainder 0-5, against float64 over gguf's dequantized values; the
# panel body's outputs the same bits in any split of the rows.
_AVX2 = """
import numpy as np, torch, sys
sys.path.insert(0, {here!r})
from test_quant_kernels import _gguf_weight
from flowengine import _cpu_ops
assert not _cpu_ops.has_avx512()
paths = [_cpu_ops.linear_path(r) for r in (1, 11, 12, 2048)]
assert paths == ["avx2", "avx2", "avx2-panels", "avx2-panels"], paths
for fmt in ("q4_0", "q4_1", "q8_0"):
    for k in (96, 160):
        w, ref = _gguf_weight(fmt, 37, k, 11)
        for rows in (1, 2, 3, 4, 5, 8, 9, 11, 12, 13, 14, 15, 16, 17, 130):
            x = torch.randn(rows, k) * 3
            want = x.double() @ ref.double().t()
            err = (w.matmul(x).double() - want).abs().max().item()
            assert err < 1e-5 * (1 + want.abs().max().item()), (fmt, k, rows, err)
        x = torch.randn(40, k)
        out = w.matmul(x)
        assert torch.equal(out, torch.cat([w.matmul(x[:20]), w.matmul(x[20:])])), (fmt, k)
        assert torch.equal(out, torch.cat([w.matmul(x[:14]), w.matmul(x[14:])])), (fmt, k)
print("ok")
"""


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(),
                    reason="no AVX2/FMA/F16C on this CPU")
def test_avx2_body():
    _run_ok(_AVX2, "FLOWENGINE_CPU_NO_AVX512", "1", {"FLOWENGINE_CPU_INT16_MIN_ROWS": "0"})


# The AVX2 int16 bodies (CPUs without AVX-512: the panel body from 4 activation rows,
# the one-row body for 1; 2-3 rows the float32 row body): every format, 1, 3, 18, 19 and 48 blocks per row, 37 and 83 weight
# rows (short last panels of 16); tiles of 4 rows with every remainder; heavy-tailed
# activations with an outlier, an all-zero block and a block of tiny values (below
# 2^-100: scaled first); within the activations' rounding (_rounding_bound, TOP = 32767)
# of float64 over gguf's dequantized values; each row the same bits in any batch of 4 or
# more rows (its rounding is its own); a NaN row gives NaN in its own outputs only;
# no_int8 the float32 bodies.
_AVX2_INT16 = """
import torch, sys
sys.path.insert(0, {here!r})
from test_quant_kernels import _gguf_weight, _rounding_bound, _float_bound
from flowengine import _cpu_ops
from flowengine.model.layers.quant_linear import FORMATS
assert not _cpu_ops.has_avx512()
paths = [_cpu_ops.linear_path(r) for r in (1, 3, 4, 12, 2048)]
assert paths == ["avx2-int16", "avx2"] + ["avx2-int16-panels"] * 3, paths
g = torch.Generator().manual_seed({seed})
for fmt in ("q4_0", "q4_1", "q8_0"):
    for k, n in ((32, 37), (96, 83), (576, 37), (608, 83), (1536, 37)):
        w, ref = _gguf_weight(fmt, n, k, {seed} + k)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 130):
            x = torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g) ** 4 * 4
            x[:, 3] = 300.0
            x[0, -32:] = 0
            if k > 32 and rows > 1:
                x[1, :32] = torch.randn(32, generator=g) * 1e-38
            out = w.matmul(x)
            err = (out.double() - x.double() @ ref.double().t()).abs()
            bound = _rounding_bound(x, ref, 32767, fmt)
            assert bool((err <= bound).all()), (fmt, k, rows, float((err / bound).max()))
        x = torch.randn(40, k, generator=g)
        out = w.matmul(x)
        assert torch.equal(out, torch.cat([w.matmul(x[:20]), w.matmul(x[20:])])), (fmt, k)
        assert torch.equal(out, torch.cat([w.matmul(x[:7]), w.matmul(x[7:])])), (fmt, k)
        assert torch.equal(out[5:9], w.matmul(x[5:9])), (fmt, k)
        assert torch.equal(out[10:14], w.matmul(x[10:14])), (fmt, k)
        x[6, 10] = float("nan")
        nan = w.matmul(x)
        assert bool(nan[6].isnan().all()) and not bool(nan[torch.arange(40) != 6].isnan().any())
        assert torch.equal(nan[torch.arange(40) != 6], out[torch.arange(40) != 6]), (fmt, k)
        # no_int8: float32 activations (the row and panel bodies), within float32 rounding
        for rows in (1, 16):
            xr = x[:rows].nan_to_num()
            f32 = torch.empty(rows, n)
            _cpu_ops.linear(FORMATS[fmt][0], xr.data_ptr(), rows, k, w.qs.data_ptr(),
                            w.scales.data_ptr(), n, f32.data_ptr(), 2, 0, True)
            err = (f32.double() - xr.double() @ ref.double().t()).abs().max().item()
            assert err <= _float_bound(xr, ref), (fmt, k, rows, err)
print("ok")
"""


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(),
                    reason="no AVX2/FMA/F16C on this CPU")
def test_avx2_int16_body():
    _run_ok(_AVX2_INT16, "FLOWENGINE_CPU_NO_AVX512", "1",
            seed=int(torch.randint(0, 2**20, ()).item()))


# The VNNI path's activation quantization (flowengine/_cpu_ops.c): each 32-value block
# of x is rounded to multiples of max|x_block| / TOP.
_TOP = {"q4_0": 127 * 2**16, "q4_1": 127 * 2**16, "q8_0": 2097000}


def _vnni_bound(fmt: str, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return _rounding_bound(x, ref, _TOP[fmt], fmt)


def _float_bound(x: torch.Tensor, ref: torch.Tensor) -> float:
    """REL_TOL's bound for float32 sums of [rows, K] x [n, K]."""
    return REL_TOL * x.shape[1] ** 0.5 * x.abs().max().item() * ref.abs().max().item()


def _rounding_bound(x: torch.Tensor, ref: torch.Tensor, top: float,
                    fmt: str = "q8_0") -> torch.Tensor:
    """Per output [rows, n] of a body that rounds each 32-value block of x to integer
    multiples of max|x_block| / top: half a quantization step of every block of x times that
    block's |w| (Q4_1: the larger of |w| and |w - m| = |d q|, since the rounded x multiply
    d q and the offset m multiplies the exact sum of x; m is the block's smallest
    dequantized value, the one of code 0), plus float32 rounding: 5e-6 of sum over blocks
    of sum |x| times the
    block's largest |w|, because the kernel sums d s sum(q A) and the offset term (m or
    -8 d times sum x) separately, each up to ~16 d sum |x| whatever the weight itself is.
    (The bound used sum |x| |w|, which fails when an outlier of x meets a weight near 0,
    e.g. Q4_0's q = 8: 4.4% of random Q4_0 cases at K = 32 with a 300 outlier.)"""
    rows, k = x.shape
    xb = x.double().abs().view(rows, k // 32, 32)
    wb = ref.double().view(-1, k // 32, 32)
    if fmt == "q4_1":
        wb = torch.maximum(wb.abs(), (wb - wb.amin(-1, keepdim=True)).abs())
    else:
        wb = wb.abs()
    step = xb.amax(-1) / top  # [rows, nb]
    return 0.5 * step @ wb.sum(-1).t() + 5e-6 * (xb.sum(-1) @ wb.amax(-1).t())


@_needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [32, 576, 608])  # 1 block; even; odd block count
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_vnni_matmul_within_activation_rounding(fmt, k, rows):
    from flowengine import _cpu_ops

    assert _cpu_ops.linear_path(rows) == "avx512-vnni"
    seed = int(torch.randint(0, 2**31, ()).item())
    weight, ref = _gguf_weight(fmt, 83, k, seed)
    # Heavy-tailed activations with one outlier per row and an all-zero block, as
    # hidden states have them.
    x = torch.randn(rows, k) * torch.rand(rows, k) ** 4 * 4
    x[:, 5] = 300.0
    x[0, -32:] = 0
    out = weight.matmul(x)
    err = (out.double() - x.double() @ ref.double().t()).abs()
    bound = _vnni_bound(fmt, x, ref)
    assert bool((err <= bound).all()), f"seed {seed}: worst err/bound {(err / bound).max():.3f}"


_ONE_ROW = """
import torch, sys
sys.path.insert(0, {here!r})
from test_quant_kernels import _gguf_weight, _vnni_bound
for fmt in ("q4_0", "q4_1", "q8_0"):
    for k in (32, 608):
        w, ref = _gguf_weight(fmt, 83, k, 7)
        for rows in (1, 2, 3):
            x = torch.randn(rows, k)
            err = (w.matmul(x).double() - x.double() @ ref.double().t()).abs()
            assert bool((err <= _vnni_bound(fmt, x, ref)).all()), (fmt, k, rows)
print("ok")
"""


@_needs_vnni
def test_one_weight_row_vnni_body_still_correct():
    # FLOWENGINE_CPU_VNNI_ONE_ROW=1 (kept for comparisons) takes the body that runs one
    # weight row at a time instead of 4 (1 activation row) or 2 (2-3 rows).
    _run_ok(_ONE_ROW, "FLOWENGINE_CPU_VNNI_ONE_ROW", "1")


_NO_VNNI = """
import torch, sys
sys.path.insert(0, {here!r})
from test_quant_kernels import _gguf_weight
from flowengine import _cpu_ops
assert _cpu_ops.linear_path(1) == "avx512", _cpu_ops.linear_path(1)
for fmt in ("q4_0", "q4_1", "q8_0"):
    w, ref = _gguf_weight(fmt, 83, 608, 5)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 608)
        err = (w.matmul(x).double() - x.double() @ ref.double().t()).abs().max().item()
        bound = 2e-5 * 608 ** 0.5 * x.abs().max().item() * ref.abs().max().item()
        assert err <= bound, (fmt, rows, err, bound)
print("ok")
"""


@_needs_vnni
def test_float_body_when_vnni_is_off():
    # FLOWENGINE_CPU_NO_VNNI=1: batches of 1-3 rows take the AVX-512 float32 body.
    _run_ok(_NO_VNNI, "FLOWENGINE_CPU_NO_VNNI", "1")
