"""--kv-cache-dtype fp8: K/V stored as float8_e4m3fn (scale 1.0, clamped to +-448) by
reshape_and_cache and read back by both attention kernels.

The write is checked bit for bit against torch's own E4M3 rounding. The attention
kernels are checked against the float64 reference run over the *same* fp8 cache
(widened exactly), so the tolerance is the kernels' float32/bfloat16 arithmetic alone,
as for a bf16 cache; the quantization error itself is the format's (3 mantissa bits:
relative rounding error <= 2**-4) and is measured at the engine level."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_refs import AttentionCase, assert_close, make_attention_case, ref_paged_attention

from flowengine.kernels.decode_attention import decode_attention
from flowengine.kernels.paged_attention import paged_attention
from flowengine.kernels.reshape_and_cache import reshape_and_cache

FP8 = torch.float8_e4m3fn
FP32_TOL = {"rtol": 1e-4, "atol": 2e-5}
FP16_TOL = {"rtol": 1e-2, "atol": 3e-3}  # P rounded to fp16 before P @ V
BF16_TOL = {"rtol": 2e-2, "atol": 1e-2}


def _as_fp8(case: AttentionCase, query_dtype: torch.dtype) -> AttentionCase:
    """The same case with an E4M3 cache (NaN poison kept: E4M3 has NaN) and queries in
    query_dtype."""
    cache = case.kv_cache.float().clamp(-448, 448).to(FP8)
    return dataclasses.replace(case, kv_cache=cache, query=case.query.to(query_dtype))


def _fp8_values(*shape: int, device: torch.device) -> torch.Tensor:
    """float32 values that E4M3 holds exactly (random finite E4M3 bit patterns)."""
    bits = torch.randint(0, 256, shape, dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # 0x7F / 0xFF are E4M3's NaNs
    return bits.view(FP8).float().to(device)


@pytest.mark.parametrize("exact_inputs", [True, False])
def test_write_rounds_like_torch_and_clamps(exact_inputs: bool, device: torch.device) -> None:
    """Slots, padding and clamping on every device; with exact_inputs=False also the
    rounding of arbitrary float32 values, on the GPU only: Triton's interpreter loses
    the mantissa carry when it rounds to E4M3 (31.3 becomes 16, not 32), so under
    TRITON_INTERPRET=1 only values E4M3 holds exactly are compared."""
    if not exact_inputs and device.type != "cuda":
        pytest.skip("Triton's interpreter rounds float32 -> E4M3 wrongly; checked on CUDA")
    num_blocks, block_size, heads, dim, tokens = 6, 16, 2, 64, 30
    if exact_inputs:
        k = _fp8_values(tokens, heads, dim, device=device)
        v = _fp8_values(tokens, heads, dim, device=device)
    else:
        k = torch.randn(tokens, heads, dim, device=device) * 50
        v = torch.randn(tokens, heads, dim, device=device) * 50
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 448.0, -500.0])  # out of E4M3's range
    slots = torch.randperm(num_blocks * block_size)[:tokens]  # distinct slots
    slots[1 + torch.randperm(tokens - 1)[:5]] = -1  # token 0 (out of range) is kept
    target = int(slots[0])
    slots = slots.to(device)
    cache = torch.full((2, num_blocks, block_size, heads, dim), float("nan"), device=device)
    cache = cache.to(FP8)

    reshape_and_cache(k, v, cache, slots)

    flat = cache.view(2, num_blocks * block_size, heads, dim)
    written = slots >= 0
    want_k = k[written].clamp(-448, 448).to(FP8)
    want_v = v[written].clamp(-448, 448).to(FP8)
    assert torch.equal(flat[0, slots[written]].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(flat[1, slots[written]].view(torch.uint8), want_v.view(torch.uint8))
    assert flat[0, target, 0, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[written]] = False
    assert flat[:, untouched].float().isnan().all()


@pytest.mark.parametrize(("qpk", "mix"), [(1, "decode"), (4, "mixed"), (8, "chunk")])
def test_paged_attention_reads_fp8_cache(qpk: int, mix: str, device: torch.device) -> None:
    q_lens, seq_lens = {
        "decode": ([1, 1, 1], [37, 16, 90]),
        "mixed": ([1, 12, 5], [50, 12, 40]),
        "chunk": ([9, 3], [70, 33]),
    }[mix]
    case = _as_fp8(make_attention_case(
        q_lens, seq_lens, num_q_heads=2 * qpk, num_kv_heads=2, head_dim=32,
        block_size=16, dtype=torch.float32, device=device,
    ), torch.float32)
    out = torch.full_like(case.query, float("nan"))
    paged_attention(case.query, case.kv_cache, case.query_start_loc, case.seq_lens,
                    case.block_tables, max_query_len=max(q_lens), scale=case.scale, out=out)
    assert_close(out, ref_paged_attention(case), **FP32_TOL)


@pytest.mark.parametrize(("query_dtype", "tol"), [(torch.float32, FP32_TOL),
                                                  (torch.float16, FP16_TOL),
                                                  (torch.bfloat16, BF16_TOL)])
def test_decode_attention_reads_fp8_cache(query_dtype: torch.dtype, tol: dict,
                                          device: torch.device) -> None:
    if query_dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter's tl.dot mis-computes bfloat16 (CUDA only)")
    seq_lens = [int(torch.randint(150, 260, ()).item()), 7, 16, 1]
    case = _as_fp8(make_attention_case(
        [1] * 4, seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    ), query_dtype)
    out = torch.full_like(case.query, float("nan"))
    decode_attention(case.query, case.kv_cache, case.query_start_loc, case.seq_lens,
                     case.block_tables, max_seq_len=max(seq_lens), scale=case.scale,
                     num_kv_splits=4, out=out)
    assert_close(out.float(), ref_paged_attention(case).float(), **tol)


@pytest.mark.parametrize(("query_dtype", "num_kv_splits", "head_dim"),
                         [(torch.bfloat16, 1, 128), (torch.bfloat16, 8, 64),
                          (torch.float16, 1, 64)])
def test_decode_attention_fp8_cache_widens_to_fp16(
    query_dtype: torch.dtype, num_kv_splits: int, head_dim: int, device: torch.device
) -> None:
    """A 16-bit query over an E4M3 cache computes in fp16 (every E4M3 value is exact
    there; decode_attention's module docstring): bf16 queries included, which the
    interpreter can run because its fp16 tl.dot is right. Tolerance: fp16 rounding of
    P before P @ V and of the bf16/fp16 output (2**-8 relative for bf16)."""
    seq_lens = [int(torch.randint(100, 200, ()).item()), 3, 16]
    case = _as_fp8(make_attention_case(
        [1] * 3, seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16,
        dtype=torch.float32, device=device,
    ), query_dtype)
    out = torch.full_like(case.query, float("nan"))
    decode_attention(case.query, case.kv_cache, case.query_start_loc, case.seq_lens,
                     case.block_tables, max_seq_len=max(seq_lens), scale=case.scale,
                     num_kv_splits=num_kv_splits, out=out)
    tol = BF16_TOL if query_dtype == torch.bfloat16 else FP16_TOL
    assert_close(out.float(), ref_paged_attention(case).float(), **tol)


def test_paged_attention_fp8_cache_bf16_query_mixed_batch(device: torch.device) -> None:
    """A mixed prefill/decode batch over an E4M3 cache under a bf16 query: the unified
    kernel computes in fp16 too (runs in the interpreter, whose fp16 tl.dot is right)."""
    q_lens, seq_lens = [1, 12, 5, 1], [50, 12, 40, 130]
    case = _as_fp8(make_attention_case(
        q_lens, seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    ), torch.bfloat16)
    out = torch.full_like(case.query, float("nan"))
    paged_attention(case.query, case.kv_cache, case.query_start_loc, case.seq_lens,
                    case.block_tables, max_query_len=12, scale=case.scale, out=out)
    assert_close(out.float(), ref_paged_attention(case).float(), **BF16_TOL)


def _quantize_query_per_head(query: torch.Tensor) -> torch.Tensor:
    """The query as DecodeLaunchConfig(fp8_qk=True) uses it: per head (row of
    head_dim), q8 = E4M3(q / s) with s = amax / 448, then q8 * s, in float32."""
    q = query.float()
    s = q.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 448.0
    return (q / s).to(FP8).float() * s


def _fp8_exact_query(case: AttentionCase, device: torch.device) -> torch.Tensor:
    """A query whose per-head E4M3 quantization is exact: E4M3 values times 2**-8 with
    |448| x 2**-8 in every head, so q / (amax / 448) is the E4M3 value itself."""
    q = _fp8_values(*case.query.shape, device=device).clamp(-448, 448)
    q[..., 0] = 448.0
    return q * 2.0**-8


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize(("query_dtype", "num_kv_splits", "head_dim", "qpk"),
                         [(torch.float16, 4, 64, 4), (torch.bfloat16, 1, 128, 4),
                          (torch.bfloat16, 8, 64, 1), (torch.float16, 2, 128, 8)])
def test_decode_attention_fp8_qk(query_dtype: torch.dtype, num_kv_splits: int, head_dim: int,
                                 qpk: int, exact: bool, device: torch.device) -> None:
    """Q.K on the FP8 tensor cores (DecodeLaunchConfig(fp8_qk=True)): the output equals
    the float64 reference run with the query quantized per head to E4M3 as the kernel
    does (_quantize_query_per_head), within the fp16 path's tolerance (P and the output
    rounded to 16 bits). exact=True draws queries whose quantization is exact
    (_fp8_exact_query), which the interpreter can run; exact=False random queries,
    CUDA only (the interpreter rounds float32 -> E4M3 wrongly, see
    test_write_rounds_like_torch_and_clamps). There, against the unquantized query, the
    error is the format's (<= 2**-4 relative per query element): the relative L2 error
    of the output stays under 5e-2 (measured 1.3e-2 at head_dim 64 here, 2.5e-2 to
    2.8e-2 at head_dim 128 x 1k context on the H200, decode_attention_bench --fp8-qk)."""
    from flowengine.kernels.decode_attention import DecodeLaunchConfig

    if query_dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter's tl.dot mis-computes bfloat16 (CUDA only)")
    if not exact and device.type != "cuda":
        pytest.skip("Triton's interpreter rounds float32 -> E4M3 wrongly; checked on CUDA")
    seq_lens = [int(torch.randint(100, 300, ()).item()), 3, 16, 64]
    case = _as_fp8(make_attention_case(
        [1] * 4, seq_lens, num_q_heads=2 * qpk, num_kv_heads=2, head_dim=head_dim,
        block_size=16, dtype=torch.float32, device=device,
    ), query_dtype)
    if exact:
        case = dataclasses.replace(case, query=_fp8_exact_query(case, device).to(query_dtype))
    out = torch.full_like(case.query, float("nan"))
    decode_attention(case.query, case.kv_cache, case.query_start_loc, case.seq_lens,
                     case.block_tables, max_seq_len=max(seq_lens), scale=case.scale,
                     num_kv_splits=num_kv_splits, out=out,
                     launch_config=DecodeLaunchConfig(tile_n=16, num_warps=2, num_stages=2,
                                                      fp8_qk=True))
    assert not out.isnan().any()
    quantized = dataclasses.replace(case, query=_quantize_query_per_head(case.query))
    tol = BF16_TOL if query_dtype == torch.bfloat16 else FP16_TOL
    assert_close(out.float(), ref_paged_attention(quantized).float(), **tol)
    if not exact:
        ref = ref_paged_attention(dataclasses.replace(case, query=case.query.float())).double()
        rel = float((out.double() - ref).norm() / ref.norm())
        assert rel < 5e-2, rel
