"""Unified paged attention against the float64 reference (kernel_refs.py).

Every case: random non-contiguous block tables, unused cache slots and block-table
entries NaN, output poisoned with NaN before the call."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import AttentionCase, assert_close, make_attention_case, ref_paged_attention

from flowengine.kernels.paged_attention import paged_attention

# fp32 in the interpreter is exact IEEE arithmetic; the error is summation order only.
FP32_TOL = {"rtol": 1e-4, "atol": 2e-5}
# fp16: P is rounded to fp16 before P @ V (as in FlashAttention).
FP16_TOL = {"rtol": 1e-2, "atol": 3e-3}


def _randint(low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, ()).item())


def _lengths(mix: str) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens) of a random batch of the given kind."""
    if mix == "decode":
        seq = [_randint(1, 100) for _ in range(5)]
        return [1] * 5, seq
    if mix == "prefill":
        seq = [_randint(1, 40) for _ in range(3)]
        return seq, seq
    if mix == "chunk":  # prefill chunks after a cached prefix
        seq = [_randint(20, 90) for _ in range(3)]
        return [_randint(2, min(s - 1, 30)) for s in seq], seq
    assert mix == "mixed"
    q_lens, seq = [1, _randint(2, 20), 1, 0, 0], [_randint(1, 80), 0, _randint(1, 80), 0, 0]
    seq[1] = q_lens[1] + _randint(1, 40)
    q_lens[3] = seq[3] = _randint(1, 25)  # a whole prompt
    seq[4] = _randint(30, 60)
    q_lens[4] = _randint(2, seq[4])
    return q_lens, seq


def _run(case: AttentionCase) -> torch.Tensor:
    out = torch.full_like(case.query, float("nan"))
    result = paged_attention(
        case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables,
        max_query_len=max(case.q_lens), scale=case.scale, out=out,
    )
    assert result is out
    return out


# Pairwise cover of GQA ratio x block size x batch kind (plus QPK 3, SmolLM2's 9/3).
@pytest.mark.parametrize(
    ("qpk", "block_size", "mix"),
    [
        (1, 16, "decode"), (4, 32, "decode"), (8, 16, "decode"),
        (1, 32, "prefill"), (4, 16, "prefill"), (8, 32, "prefill"),
        (1, 16, "chunk"), (4, 32, "chunk"), (8, 16, "chunk"),
        (1, 32, "mixed"), (4, 16, "mixed"), (8, 32, "mixed"), (3, 16, "mixed"),
    ],
)
def test_matches_reference_fp32(
    qpk: int, block_size: int, mix: str, device: torch.device
) -> None:
    q_lens, seq_lens = _lengths(mix)
    case = make_attention_case(
        q_lens, seq_lens, num_q_heads=2 * qpk, num_kv_heads=2, head_dim=32,
        block_size=block_size, dtype=torch.float32, device=device,
    )
    assert_close(_run(case), ref_paged_attention(case), **FP32_TOL)


def test_fp16_odd_head_dim_and_padding_rows_untouched(device: torch.device) -> None:
    q_lens, seq_lens = _lengths("mixed")
    case = make_attention_case(
        q_lens, seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=48, block_size=16,
        dtype=torch.float16, num_padding_tokens=3, device=device,
    )
    out = _run(case)
    num_real = sum(q_lens)
    assert_close(out[:num_real], ref_paged_attention(case), **FP16_TOL)
    assert out[num_real:].isnan().all(), "rows of padding tokens must be left untouched"


@pytest.mark.parametrize("block_size", [16, 32])
def test_block_boundaries(block_size: int, device: torch.device) -> None:
    """Contexts ending exactly on, just before and just after a block edge; a one-token
    context; a chunk whose new tokens straddle a block edge."""
    b = block_size
    q_lens = [1, 1, 1, 1, b + 1, 3]
    seq_lens = [b, b - 1, b + 1, 1, 2 * b + 1, 2 * b + 1]
    case = make_attention_case(
        q_lens, seq_lens, num_q_heads=4, num_kv_heads=1, head_dim=32, block_size=b,
        dtype=torch.float32, device=device,
    )
    assert_close(_run(case), ref_paged_attention(case), **FP32_TOL)


def test_rejects_bad_gqa_ratio(device: torch.device) -> None:
    case = make_attention_case(
        [1], [4], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, device=device,
    )
    bad_cache = torch.zeros(2, 4, 16, 3, 32, device=device)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads 3"):
        paged_attention(
            case.query, bad_cache, case.query_start_loc, case.seq_lens, case.block_tables,
            max_query_len=1, scale=1.0,
        )


@pytest.mark.parametrize(
    ("qpk", "mix", "window", "soft_cap"),
    [
        (1, "decode", 7, None), (4, "chunk", 13, None), (2, "mixed", 5, None),
        (4, "prefill", None, 2.5), (1, "mixed", 9, 1.5), (8, "decode", None, 3.0),
    ],
)
def test_sliding_window_and_soft_cap_match_reference_fp32(
    qpk: int, mix: str, window: int | None, soft_cap: float | None, device: torch.device
) -> None:
    q_lens, seq_lens = _lengths(mix)
    case = make_attention_case(
        q_lens, seq_lens, num_q_heads=2 * qpk, num_kv_heads=2, head_dim=32,
        block_size=16, dtype=torch.float32, device=device,
    )
    out = torch.full_like(case.query, float("nan"))
    paged_attention(
        case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables,
        max_query_len=max(case.q_lens), scale=case.scale, out=out,
        sliding_window=window, logits_soft_cap=soft_cap,
    )
    expected = ref_paged_attention(case, sliding_window=window, soft_cap=soft_cap)
    assert_close(out, expected, **FP32_TOL)
    if window is not None and max(seq_lens) > window:  # the window changes the result
        assert not torch.allclose(expected, ref_paged_attention(case), atol=1e-3)


def test_bad_window_and_cap_are_refused(device: torch.device) -> None:
    case = make_attention_case([3], [3], num_q_heads=2, num_kv_heads=2, head_dim=32,
                               block_size=16, dtype=torch.float32, device=device)
    args = (case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables)
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0"):
        paged_attention(*args, max_query_len=3, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap must be > 0, got -1"):
        paged_attention(*args, max_query_len=3, scale=1.0, logits_soft_cap=-1.0)
