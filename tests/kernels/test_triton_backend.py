"""TritonAttentionBackend end to end: KV-cache write, then attention, against the
float64 reference; the split-KV path for long decode-only steps."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import AttentionCase, assert_close, make_attention_case, ref_paged_attention

from flowengine.model.attention import triton_backend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.attention.triton_backend import TritonAttentionBackend

FP32_TOL = {"rtol": 1e-4, "atol": 2e-5}


def _metadata(case: AttentionCase) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=case.query_start_loc,
        seq_lens=case.seq_lens,
        block_tables=case.block_tables,
        slot_mapping=case.slot_mapping,
        max_query_len=max(case.q_lens),
        max_seq_len=max(case.ctx_lens),
        query_start_loc_cpu=case.query_start_loc.cpu(),
        seq_lens_cpu=case.seq_lens.cpu(),
    )


def _expected_cache(case: AttentionCase) -> torch.Tensor:
    """The cache after a correct write: new K/V at their slots, nothing else changed."""
    cache = case.kv_cache.clone()
    flat = cache.view(2, -1, *cache.shape[3:])
    real = case.slot_mapping >= 0
    flat[0, case.slot_mapping[real]] = case.key[real]
    flat[1, case.slot_mapping[real]] = case.value[real]
    return cache


def _check_forward(case: AttentionCase, backend: TritonAttentionBackend, **attn: float) -> None:
    expected_cache = _expected_cache(case)
    out = torch.full_like(case.query, float("nan"))
    result = backend.forward(
        case.query, case.key, case.value, case.kv_cache, _metadata(case), case.scale, out=out,
        **attn,
    )
    assert result is out
    # Exact copy, NaN where nothing may be written (padding slots, unused blocks).
    torch.testing.assert_close(case.kv_cache, expected_cache, rtol=0, atol=0, equal_nan=True)
    num_real = sum(case.q_lens)
    case.kv_cache = expected_cache
    ref = ref_paged_attention(case, attn.get("sliding_window"), attn.get("logits_soft_cap"))
    assert_close(out[:num_real], ref, **FP32_TOL)
    assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:])), "padding rows not 0"


def test_mixed_batch_with_padding_tokens(device: torch.device) -> None:
    case = make_attention_case(
        [1, 17, 1, 9], [40, 17, 65, 50], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=torch.float32, num_padding_tokens=3, fill_new_tokens=False,
        device=device,
    )
    _check_forward(case, TritonAttentionBackend())


@pytest.mark.parametrize("use_split_kv", [True, False])
def test_decode_only_path_choice(
    use_split_kv: bool, monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    calls: list[int | None] = []
    real_decode = triton_backend.decode_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs["num_kv_splits"])  # type: ignore[arg-type]
        return real_decode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    case = make_attention_case(
        [1, 1, 1], [600, 33, 270], num_q_heads=4, num_kv_heads=1, head_dim=32,
        block_size=32, dtype=torch.float32, num_padding_tokens=1, fill_new_tokens=False,
        device=device,
    )
    min_len = 512 if use_split_kv else 4096
    _check_forward(case, TritonAttentionBackend(split_kv_min_seq_len=min_len))
    # 3 requests x 1 KV head on 8 assumed SMs: 4 x 8 / 3 -> 11 splits wanted, 600
    # tokens allow 10 ranges of >= 64; rounded down to a power of 2.
    # Unsplit, decode-only steps still run the decode kernel (one range).
    assert calls == ([8] if use_split_kv else [1])


def test_fixed_split_count_for_cuda_graphs(device: torch.device) -> None:
    case = make_attention_case(
        [1, 1], [40, 3], num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, fill_new_tokens=False,
        device=device,
    )
    _check_forward(case, TritonAttentionBackend(num_kv_splits=4))


@pytest.mark.parametrize("decode_only", [False, True])
def test_sliding_window_and_soft_cap_on_both_paths(decode_only: bool, device) -> None:
    # Mixed steps run the unified kernel, long decode-only steps the split-KV one.
    q_lens = [1, 1, 1] if decode_only else [1, 17, 9]
    case = make_attention_case(
        q_lens, [300, 40, 65], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=torch.float32, num_padding_tokens=2, fill_new_tokens=False,
        device=device,
    )
    backend = TritonAttentionBackend(split_kv_min_seq_len=32)
    _check_forward(case, backend, sliding_window=48, logits_soft_cap=2.0)


@pytest.mark.parametrize("decode_only", [False, True])
def test_fused_rotary_equals_rotated_inputs(decode_only: bool, device: torch.device) -> None:
    """forward(rotary=tables) on unrotated q/k gives the same cache and output, bit for
    bit, as rotary_embedding first and forward() on the rotated q/k."""
    from flowengine.kernels.rope_cache import build_rope_cache
    from flowengine.kernels.rotary import rotary_embedding

    q_lens = [1, 1] if decode_only else [1, 7]
    case = make_attention_case(
        q_lens, [90, 30], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, num_padding_tokens=1, fill_new_tokens=False, device=device,
    )
    cos, sin = build_rope_cache(32, 128, 10000.0, device=device)
    positions = torch.randint(0, 128, (case.query.shape[0],), device=device)
    backend = TritonAttentionBackend(split_kv_min_seq_len=64)
    q_rot, k_rot = case.query.clone(), case.key.clone()
    rotary_embedding(positions, q_rot, k_rot, cos, sin)
    want_cache = case.kv_cache.clone()
    want = backend.forward(q_rot, k_rot, case.value, want_cache, _metadata(case), case.scale)
    got = backend.forward(case.query, case.key, case.value, case.kv_cache, _metadata(case),
                          case.scale, rotary=(positions, cos, sin))
    assert torch.equal(case.query, q_rot), "q is rotated in place"
    torch.testing.assert_close(case.kv_cache, want_cache, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("routing", ["decode", "unified"])
def test_verification_step_routing(
    routing: str, monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    """A verification step (k + 1 = 5 tokens per request, one request with fewer, one
    padding tail) runs the split-KV decode kernel with max_query_len 5, or the unified
    kernel under FLOWENGINE_VERIFY_ATTENTION=unified; a 9-token chunk always runs the
    unified one. Output, sliding window and soft cap as the reference either way."""
    monkeypatch.setattr(triton_backend, "VERIFY_ATTENTION", routing)
    calls: list[tuple[str, int]] = []
    real_decode, real_paged = triton_backend.decode_attention, triton_backend.paged_attention

    def spy_decode(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(("decode", kwargs["max_query_len"]))  # type: ignore[arg-type]
        return real_decode(*args, **kwargs)  # type: ignore[arg-type]

    def spy_paged(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(("unified", kwargs["max_query_len"]))  # type: ignore[arg-type]
        return real_paged(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "decode_attention", spy_decode)
    monkeypatch.setattr(triton_backend, "paged_attention", spy_paged)
    for q_lens, attn in (([5, 3, 5], {}), ([5, 5, 1], {"sliding_window": 40,
                                                        "logits_soft_cap": 2.0})):
        case = make_attention_case(
            q_lens, [300, 40, 65], num_q_heads=8, num_kv_heads=2, head_dim=64,
            block_size=16, dtype=torch.float32, num_padding_tokens=2,
            fill_new_tokens=False, device=device,
        )
        _check_forward(case, TritonAttentionBackend(split_kv_min_seq_len=32), **attn)
    case = make_attention_case(
        [9, 1], [60, 20], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, fill_new_tokens=False, device=device,
    )
    _check_forward(case, TritonAttentionBackend())
    assert calls == [(routing, 5), (routing, 5), ("unified", 9)]
    assert triton_backend.uses_decode_kernel(1, 8)
    assert triton_backend.uses_decode_kernel(8, 8) == (routing == "decode")
    assert not triton_backend.uses_decode_kernel(9, 1)
    assert not triton_backend.uses_decode_kernel(5, 16)  # 80 rows > MAX_PACKED_ROWS
